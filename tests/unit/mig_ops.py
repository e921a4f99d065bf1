"""Test-only: run MIG layout operations through pynvml, as the agent's executor does on a real node."""

from __future__ import annotations

import ctypes
from collections.abc import Iterable

import pynvml

from agent.core.inventory import Placement
from agent.core.mig_layout import DestroyInstance, Operation, SetMigMode


def execute(ops: Iterable[Operation]) -> None:
    """SetMigMode, DestroyInstance (its compute instances first, then the GPU instance), CreateInstance."""
    for op in ops:
        handle = pynvml.nvmlDeviceGetHandleByIndex(op.gpu_index)
        if isinstance(op, SetMigMode):
            mode = pynvml.NVML_DEVICE_MIG_ENABLE if op.enabled else pynvml.NVML_DEVICE_MIG_DISABLE
            assert pynvml.nvmlDeviceSetMigMode(handle, mode) == pynvml.NVML_SUCCESS
        elif isinstance(op, DestroyInstance):
            gi = pynvml.nvmlDeviceGetGpuInstanceById(handle, op.gi_id)
            info = pynvml.nvmlGpuInstanceGetInfo(gi)
            assert Placement(info.placement.start, info.placement.size) == op.placement
            for ci_id in range(8):  # CI ids run 0..7 in a GPU instance
                try:
                    ci = pynvml.nvmlGpuInstanceGetComputeInstanceById(gi, ci_id)
                except pynvml.NVMLError_NotFound:
                    continue
                pynvml.nvmlComputeInstanceDestroy(ci)
            pynvml.nvmlGpuInstanceDestroy(gi)
        else:
            placement = pynvml.c_nvmlGpuInstancePlacement_t(op.placement.start, op.placement.size)
            gi = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(handle, op.profile_id, ctypes.byref(placement))
            pynvml.nvmlGpuInstanceCreateComputeInstance(gi, op.ci_profile_id)
