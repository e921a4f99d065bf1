"""MIG changes through NVML: the MIG manager's hands. Every call names the GPU and the NVML error."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from ctypes import byref
from typing import Any

import pynvml
from msgspec import Struct

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


class MigModeState(Struct, frozen=True):
    """A GPU's MIG mode now, its architecture (as discovery names it) and how many MIG devices it holds."""

    enabled: bool
    architecture: str
    mig_devices: int


def mig_mode_state(gpu_uuid: str) -> MigModeState:
    from agent.gpu.discovery import _ARCHITECTURES  # one table of NVML's architecture names

    with nvml_session():
        handle = _gpu_by_uuid(gpu_uuid)
        try:
            current, _ = pynvml.nvmlDeviceGetMigMode(handle)
            architecture = _ARCHITECTURES.get(pynvml.nvmlDeviceGetArchitecture(handle), "Unknown")
            count = 0
            for index in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle) if current else 0):
                try:
                    pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
                except pynvml.NVMLError as error:
                    if error_name(error) == "NOT_FOUND":
                        continue
                    raise
                count += 1
        except pynvml.NVMLError as error:
            raise MigOperationError(f"GPU {gpu_uuid}: read its MIG mode", error) from error
        return MigModeState(bool(current), architecture, count)


def switch_mig_mode(gpu_uuid: str, enabled: bool) -> bool:
    """Request a MIG mode; True when it is in force now. When it would only take effect at a GPU reset (the
    activation status says why), the request is withdrawn again, so no reset applies it later, and False is returned."""
    with nvml_session():
        handle = _gpu_by_uuid(gpu_uuid)
        what = f"GPU {gpu_uuid}: set MIG mode {'on' if enabled else 'off'}"
        try:
            pynvml.nvmlDeviceSetMigMode(handle, int(enabled))
            current, _ = pynvml.nvmlDeviceGetMigMode(handle)
            if bool(current) == enabled:
                return True
            pynvml.nvmlDeviceSetMigMode(handle, int(current))  # pending := current: nothing waits for a reset
            return False
        except pynvml.NVMLError as error:
            raise MigOperationError(what, error) from error


def destroy_instance(gpu_index: int, gi_id: int) -> None:
    """Destroy a GPU instance and, first, its compute instances."""
    with nvml_session():
        _destroy(_gpu(gpu_index), gi_id, f"GPU {gpu_index}")


def _destroy(handle: object, gi_id: int, gpu: str) -> None:
    try:
        gpu_instance = pynvml.nvmlDeviceGetGpuInstanceById(handle, gi_id)
        for _, info in _compute_profiles(gpu_instance):
            for compute_instance in _compute_instances(gpu_instance, info.id, info.instanceCount):
                pynvml.nvmlComputeInstanceDestroy(compute_instance)
        pynvml.nvmlGpuInstanceDestroy(gpu_instance)
    except pynvml.NVMLError as error:
        raise MigOperationError(f"{gpu}: destroy GPU instance {gi_id}", error) from error


def create_instance(gpu_index: int, profile_id: int, placement: Placement, ci_profile_id: int) -> None:
    """Create a GPU instance at an exact placement, and its full compute instance. A compute instance that cannot be
    made takes its GPU instance with it: a GPU instance alone is no MIG device, the inventory does not list it, and
    it would hold its placement against every retry (INSUFFICIENT_RESOURCES)."""
    with nvml_session():
        handle = _gpu(gpu_index)
        where = pynvml.c_nvmlGpuInstancePlacement_t(placement.start, placement.size)
        what = f"GPU {gpu_index}: create GPU instance profile {profile_id} at {placement}"
        try:
            gpu_instance = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(handle, profile_id, byref(where))
        except pynvml.NVMLError as error:
            raise MigOperationError(what, error) from error
        try:
            pynvml.nvmlGpuInstanceCreateComputeInstance(gpu_instance, ci_profile_id)
        except pynvml.NVMLError as error:
            with contextlib.suppress(pynvml.NVMLError):
                pynvml.nvmlGpuInstanceDestroy(gpu_instance)
            raise MigOperationError(f"{what}: its compute instance", error) from error


def destroy_empty_instances(gpu_index: int) -> int:
    """Destroy the GPU's GPU instances that have no compute instance; how many. Such an instance is no MIG device (no
    inventory lists it, no process can run in it), but it holds its placement against every creation: a creation
    cut short by a failure whose undo failed too leaves one."""
    with nvml_session():
        handle = _gpu(gpu_index)
        destroyed = 0
        try:
            for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
                try:
                    profile = pynvml.nvmlDeviceGetGpuInstanceProfileInfoV(handle, index)
                except pynvml.NVMLError as error:
                    if error_name(error) in ("NOT_SUPPORTED", "INVALID_ARGUMENT"):
                        continue
                    raise
                count = pynvml.c_uint(profile.instanceCount)
                array = (pynvml.c_nvmlGpuInstance_t * max(profile.instanceCount, 1))()
                pynvml.nvmlDeviceGetGpuInstances(handle, profile.id, array, byref(count))
                for gpu_instance in (array[i] for i in range(count.value)):
                    computes = [_compute_instances(gpu_instance, info.id, info.instanceCount)
                                for _, info in _compute_profiles(gpu_instance)]  # fmt: skip
                    if not any(computes):
                        pynvml.nvmlGpuInstanceDestroy(gpu_instance)
                        destroyed += 1
        except pynvml.NVMLError as error:
            raise MigOperationError(
                f"GPU {gpu_index}: destroy GPU instances without a compute instance", error
            ) from error
        return destroyed


class MigInstance(Struct, frozen=True):
    """A MIG device as NVML names it: its GPU and compute instance IDs and its UUID."""

    gi_id: int
    ci_id: int
    uuid: str


def create_partition(gpu_uuid: str, profile_id: int, placement: Placement) -> MigInstance:
    """Create a GPU instance at exactly ``placement`` with the compute instance that spans it, for a dynamic-MIG
    claim; a compute instance that cannot be made takes its GPU instance with it, so nothing is left half-made."""
    with nvml_session():
        handle = _gpu_by_uuid(gpu_uuid)
        where = pynvml.c_nvmlGpuInstancePlacement_t(placement.start, placement.size)
        what = f"GPU {gpu_uuid}: create GPU instance profile {profile_id} at {placement.start}+{placement.size}"
        try:
            slices = pynvml.nvmlDeviceGetGpuInstanceProfileInfoV(handle, _profile_index(handle, profile_id)).sliceCount
            gpu_instance = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(handle, profile_id, byref(where))
            gi_id = pynvml.nvmlGpuInstanceGetInfo(gpu_instance).id
        except pynvml.NVMLError as error:
            raise MigOperationError(what, error) from error
        try:
            pynvml.nvmlGpuInstanceCreateComputeInstance(gpu_instance, _full_compute_profile(gpu_instance, slices))
            return _mig_device(handle, gi_id, what)
        except (pynvml.NVMLError, MigOperationError) as error:
            with contextlib.suppress(pynvml.NVMLError, MigOperationError):
                _destroy(handle, gi_id, f"GPU {gpu_uuid}")
            if isinstance(error, MigOperationError):
                raise
            raise MigOperationError(f"{what}: its compute instance", error) from error


def gpu_instance_at(gpu_uuid: str, profile_id: int, start: int) -> int | None:
    """The ID of the GPU instance of ``profile_id`` placed at ``start`` on the GPU, if there is one."""
    with nvml_session():
        handle = _gpu_by_uuid(gpu_uuid)
        try:
            capacity = pynvml.nvmlDeviceGetGpuInstanceProfileInfoV(
                handle, _profile_index(handle, profile_id)
            ).instanceCount
            count = pynvml.c_uint(capacity)  # the array's size in; how many were written out
            array = (pynvml.c_nvmlGpuInstance_t * max(capacity, 1))()
            pynvml.nvmlDeviceGetGpuInstances(handle, profile_id, array, byref(count))
            for i in range(count.value):
                info = pynvml.nvmlGpuInstanceGetInfo(array[i])
                if info.placement.start == start:
                    return int(info.id)
        except pynvml.NVMLError as error:
            raise MigOperationError(f"GPU {gpu_uuid}: list GPU instances of profile {profile_id}", error) from error
        return None


def mig_instance(gpu_uuid: str, gi_id: int) -> MigInstance | None:
    """The MIG device of GPU instance ``gi_id`` on the GPU, or None when there is none."""
    with nvml_session():
        handle = _gpu_by_uuid(gpu_uuid)
        try:
            return _mig_device(handle, gi_id, f"GPU {gpu_uuid}: GPU instance {gi_id}")
        except MigOperationError as error:
            if error.error == "NOT_FOUND":
                return None
            raise


def destroy_partition(gpu_uuid: str, gi_id: int) -> None:
    """Destroy a GPU instance (and its compute instances) of the GPU with this UUID."""
    with nvml_session():
        _destroy(_gpu_by_uuid(gpu_uuid), gi_id, f"GPU {gpu_uuid}")


def _mig_device(handle: object, gi_id: int, what: str) -> MigInstance:
    try:
        for index in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
            except pynvml.NVMLError as error:
                if error_name(error) == "NOT_FOUND":
                    continue
                raise
            if pynvml.nvmlDeviceGetGpuInstanceId(mig) == gi_id:
                uuid = pynvml.nvmlDeviceGetUUID(mig)
                return MigInstance(gi_id, pynvml.nvmlDeviceGetComputeInstanceId(mig), str(uuid))
    except pynvml.NVMLError as error:
        raise MigOperationError(f"{what}: find its MIG device", error) from error
    raise MigOperationError(f"{what}: find its MIG device", pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND))


def _full_compute_profile(gpu_instance: object, slices: int) -> int:
    """The ID of the compute-instance profile that spans a GPU instance of ``slices``, as ``nvidia-smi -C`` picks
    it: the plain one, or ``1_SLICE_REV1`` where that is the only one (a ``1g.20gb``, ``1_SLICE_REV2``, instance)."""
    found = {index: int(info.id) for index, info in _compute_profiles(gpu_instance) if info.sliceCount == slices}
    plain = [profile for index, profile in found.items() if index != pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE_REV1]
    if plain or found:
        return (plain or list(found.values()))[0]
    raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)


def _compute_profiles(gpu_instance: object) -> Iterator[tuple[int, Any]]:
    """The compute-instance profiles the GPU instance supports: (NVML profile index, its info)."""
    for index in range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
        try:
            info = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                gpu_instance, index, pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
            )
        except pynvml.NVMLError as error:
            if error_name(error) in ("NOT_SUPPORTED", "INVALID_ARGUMENT"):
                continue
            raise
        yield index, info


def _profile_index(handle: object, profile_id: int) -> int:
    """The NVML profile index (``NVML_GPU_INSTANCE_PROFILE_*``) whose profile has this ID."""
    for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            if pynvml.nvmlDeviceGetGpuInstanceProfileInfoV(handle, index).id == profile_id:
                return index
        except pynvml.NVMLError as error:
            if error_name(error) in ("NOT_SUPPORTED", "INVALID_ARGUMENT"):
                continue
            raise
    raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)


def _gpu_by_uuid(gpu_uuid: str) -> object:
    try:
        return pynvml.nvmlDeviceGetHandleByUUID(gpu_uuid)
    except pynvml.NVMLError as error:
        raise MigOperationError(f"GPU {gpu_uuid}", error) from error


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
