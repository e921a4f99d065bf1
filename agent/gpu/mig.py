"""MIG changes through NVML: the MIG manager's hands. Every call names the GPU and the NVML error."""

from __future__ import annotations

from ctypes import byref

import pynvml

from agent.core.inventory import Placement
from agent.gpu.nvml import error_name, nvml_session


class MigOperationError(RuntimeError):
    """An NVML MIG call failed; ``error`` is the NVML error name (e.g. ``IN_USE``)."""

    def __init__(self, what: str, error: pynvml.NVMLError) -> None:
        self.error = error_name(error)
        super().__init__(f"{what}: NVML_ERROR_{self.error}")


def set_mig_mode(gpu_index: int, enabled: bool) -> bool:
    """Request a MIG mode; True when it is in force now, False when it waits for a GPU reset."""
    with nvml_session():
        handle = _gpu(gpu_index)
        try:
            pynvml.nvmlDeviceSetMigMode(handle, int(enabled))
            current, _ = pynvml.nvmlDeviceGetMigMode(handle)
        except pynvml.NVMLError as error:
            raise MigOperationError(f"GPU {gpu_index}: set MIG mode {'on' if enabled else 'off'}", error) from error
        return bool(current) == enabled


def destroy_instance(gpu_index: int, gi_id: int) -> None:
    """Destroy a GPU instance and, first, its compute instances."""
    with nvml_session():
        handle = _gpu(gpu_index)
        try:
            gpu_instance = pynvml.nvmlDeviceGetGpuInstanceById(handle, gi_id)
            for ci_index in range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
                try:
                    info = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                        gpu_instance, ci_index, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
                    )
                except pynvml.NVMLError as error:
                    if error_name(error) in ("NOT_SUPPORTED", "INVALID_ARGUMENT"):
                        continue
                    raise
                for compute_instance in _compute_instances(gpu_instance, info.id, info.instanceCount):
                    pynvml.nvmlComputeInstanceDestroy(compute_instance)
            pynvml.nvmlGpuInstanceDestroy(gpu_instance)
        except pynvml.NVMLError as error:
            raise MigOperationError(f"GPU {gpu_index}: destroy GPU instance {gi_id}", error) from error


def create_instance(gpu_index: int, profile_id: int, placement: Placement, ci_profile_id: int) -> None:
    """Create a GPU instance at an exact placement, and its full compute instance."""
    with nvml_session():
        handle = _gpu(gpu_index)
        where = pynvml.c_nvmlGpuInstancePlacement_t(placement.start, placement.size)
        try:
            gpu_instance = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(handle, profile_id, byref(where))
            pynvml.nvmlGpuInstanceCreateComputeInstance(gpu_instance, ci_profile_id)
        except pynvml.NVMLError as error:
            raise MigOperationError(
                f"GPU {gpu_index}: create GPU instance profile {profile_id} at {placement}", error
            ) from error


def _gpu(gpu_index: int) -> object:
    try:
        return pynvml.nvmlDeviceGetHandleByIndex(gpu_index)
    except pynvml.NVMLError as error:
        raise MigOperationError(f"GPU {gpu_index}", error) from error


def _compute_instances(gpu_instance: object, profile_id: int, capacity: int) -> list[object]:
    count = pynvml.c_uint(capacity)
    array = (pynvml.c_nvmlComputeInstance_t * max(capacity, 1))()
    pynvml.nvmlGpuInstanceGetComputeInstances(gpu_instance, profile_id, array, byref(count))
    return [array[i] for i in range(count.value)]
