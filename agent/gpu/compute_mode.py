"""Compute modes through NVML: MPS wants its GPUs (or MIG devices) in EXCLUSIVE_PROCESS, so the MPS server
is their only CUDA client; removing the MPS resource puts them back to DEFAULT."""

from __future__ import annotations

import pynvml

from agent.gpu.nvml import error_name, nvml_session

DEFAULT = pynvml.NVML_COMPUTEMODE_DEFAULT
EXCLUSIVE_PROCESS = pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS


class ComputeModeError(RuntimeError):
    pass


def set_compute_mode(uuid: str, mode: int) -> None:
    """Set the compute mode of a GPU or MIG device (with MIG on, the driver wants the MIG handle)."""
    try:
        with nvml_session():
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            if pynvml.nvmlDeviceGetComputeMode(handle) != mode:
                pynvml.nvmlDeviceSetComputeMode(handle, mode)
    except pynvml.NVMLError as error:
        raise ComputeModeError(f"cannot set the compute mode of {uuid}: NVML_ERROR_{error_name(error)}") from error


def compute_mode(uuid: str) -> int:
    with nvml_session():
        return int(pynvml.nvmlDeviceGetComputeMode(pynvml.nvmlDeviceGetHandleByUUID(uuid)))
