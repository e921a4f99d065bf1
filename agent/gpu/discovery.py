"""GPU discovery: NVML -> an immutable ``Inventory``.

One GPU failing (lost, unknown error) is recorded with its NVML error name and the rest are still
discovered. Calls that a driver or GPU legitimately does not support (NVLink on PCIe cards, MIG on a T4,
NUMA on old drivers) give ``None``/empty values, not failures.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import suppress
from typing import TypeVar

import pynvml
from msgspec import Struct
from msgspec.structs import replace

from agent.core.inventory import GiProfileCounts, Gpu, GpuFailure, Inventory, MigDevice, Placement
from agent.core.mig_naming import mig_profile_name
from agent.gpu.nvml import NvmlUnavailable, error_name, is_error, nvml_session

_GI_PROFILE_INDICES = range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT)
_CI_PROFILE_INDICES = range(pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT)
_ENGINE_SHARED = pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
_ARCHITECTURES = {
    pynvml.NVML_DEVICE_ARCH_KEPLER: "Kepler",
    pynvml.NVML_DEVICE_ARCH_MAXWELL: "Maxwell",
    pynvml.NVML_DEVICE_ARCH_PASCAL: "Pascal",
    pynvml.NVML_DEVICE_ARCH_VOLTA: "Volta",
    pynvml.NVML_DEVICE_ARCH_TURING: "Turing",
    pynvml.NVML_DEVICE_ARCH_AMPERE: "Ampere",
    pynvml.NVML_DEVICE_ARCH_ADA: "Ada",
    pynvml.NVML_DEVICE_ARCH_HOPPER: "Hopper",
    pynvml.NVML_DEVICE_ARCH_BLACKWELL: "Blackwell",
}
# NVML's addressing mode as NVIDIA's DRA driver publishes it (``addressingMode``: HMM, ATS or None; facts dra.md C3)
_ADDRESSING_MODES = {
    pynvml.NVML_DEVICE_ADDRESSING_MODE_NONE: "None",
    pynvml.NVML_DEVICE_ADDRESSING_MODE_HMM: "HMM",
    pynvml.NVML_DEVICE_ADDRESSING_MODE_ATS: "ATS",
}
# go-nvlib's GetBrandAsString, which NVIDIA's DRA driver publishes as the ``brand`` attribute. A brand nvlib
# has no string for (DLA, NPU, vGameDev: nvlib returns an error) is left empty.
_BRANDS = {
    pynvml.NVML_BRAND_UNKNOWN: "Unknown",
    pynvml.NVML_BRAND_QUADRO: "Quadro",
    pynvml.NVML_BRAND_TESLA: "Tesla",
    pynvml.NVML_BRAND_NVS: "NVS",
    pynvml.NVML_BRAND_GRID: "Grid",
    pynvml.NVML_BRAND_GEFORCE: "GeForce",
    pynvml.NVML_BRAND_TITAN: "Titan",
    pynvml.NVML_BRAND_NVIDIA_VAPPS: "NvidiaVApps",
    pynvml.NVML_BRAND_NVIDIA_VPC: "NvidiaVPC",
    pynvml.NVML_BRAND_NVIDIA_VCS: "NvidiaVCS",
    pynvml.NVML_BRAND_NVIDIA_VWS: "NvidiaVWS",
    pynvml.NVML_BRAND_NVIDIA_CLOUD_GAMING: "NvidiaCloudGaming",
    pynvml.NVML_BRAND_QUADRO_RTX: "QuadroRTX",
    pynvml.NVML_BRAND_NVIDIA_RTX: "NvidiaRTX",
    pynvml.NVML_BRAND_NVIDIA: "Nvidia",
    pynvml.NVML_BRAND_GEFORCE_RTX: "GeForceRTX",
    pynvml.NVML_BRAND_TITAN_RTX: "TitanRTX",
}
_COMPUTE_MODES = {
    pynvml.NVML_COMPUTEMODE_DEFAULT: "DEFAULT",
    pynvml.NVML_COMPUTEMODE_PROHIBITED: "PROHIBITED",
    pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS: "EXCLUSIVE_PROCESS",
}
_SKIPPED_PROFILE_ERRORS = ("NOT_SUPPORTED", "INVALID_ARGUMENT")
_WARNED: set[str] = set()  # said once per process, not at every re-discovery
T = TypeVar("T")
log = logging.getLogger(__name__)


class _GpuStepFailed(Exception):
    def __init__(self, operation: str, error: pynvml.NVMLError) -> None:
        super().__init__(operation)
        self.operation = operation
        self.error = error


class _GiProfileInfo(Struct, frozen=True):
    index: int
    slice_count: int
    memory_mib: int
    counts: GiProfileCounts  # what the profile info says an instance holds (engines, SMs, memory)


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        log.warning("%s", message)


class DiscoveryError(RuntimeError):
    """NVML failed at the node level (not for one GPU), e.g. it could not count the GPUs."""


def discover() -> Inventory:
    """Describe every GPU the driver exposes.

    A GPU that fails is recorded in ``Inventory.failures``; a failure of the node-level calls raises
    ``DiscoveryError`` naming the call and the NVML error.
    """
    try:
        return _discover()
    except pynvml.NVMLError as error:
        raise DiscoveryError(f"NVML discovery failed: NVML_ERROR_{error_name(error)}") from error


def _discover() -> Inventory:
    with nvml_session():
        driver_version = _text(pynvml.nvmlSystemGetDriverVersion())
        nvml_version = _text(pynvml.nvmlSystemGetNVMLVersion())
        try:
            cuda_version: int | None = pynvml.nvmlSystemGetCudaDriverVersion()
        except pynvml.NVMLError:
            cuda_version = None
        gpus: list[Gpu] = []
        failures: list[GpuFailure] = []
        raw: list[tuple[Gpu, object]] = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            uuid: str | None = None
            try:
                handle = _step("nvmlDeviceGetHandleByIndex", pynvml.nvmlDeviceGetHandleByIndex, index)
                uuid = _text(_step("nvmlDeviceGetUUID", pynvml.nvmlDeviceGetUUID, handle))
                gpu = _describe_gpu(index, uuid, handle)
            except _GpuStepFailed as failed:
                failures.append(GpuFailure(index, error_name(failed.error), failed.operation, uuid))
                continue
            raw.append((gpu, handle))
        for gpu, handle in raw:
            gpus.append(_with_nvlink_peers(gpu, handle, [h for g, h in raw if g.index != gpu.index]))
        return Inventory(
            driver_version=driver_version,
            nvml_version=nvml_version,
            cuda_driver_version=cuda_version,
            gpus=tuple(gpus),
            failures=tuple(failures),
        )


class MigNow(Struct, frozen=True):
    """A MIG-capable GPU's MIG mode and MIG device UUIDs as the driver has them now."""

    enabled: bool
    devices: frozenset[str] = frozenset()


def mig_now(gpu_uuids: Iterable[str]) -> dict[str, MigNow]:
    """What each MIG-capable GPU has now, a few calls per GPU; a GPU NVML cannot answer for is left out (the
    liveness probe and the event watcher speak for it).

    No NVML event announces every MIG change: ``nvidia-smi -r`` destroys a GPU's MIG devices and applies a
    pending MIG mode, ``nvidia-smi mig`` makes and destroys them by hand. The reconcile loop's slow re-check
    compares this with the inventory."""
    found: dict[str, MigNow] = {}
    try:
        with nvml_session():
            for uuid in gpu_uuids:
                with suppress(pynvml.NVMLError, _GpuStepFailed):
                    handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
                    current, _ = pynvml.nvmlDeviceGetMigMode(handle)
                    migs = _mig_handles(handle) if current else ()
                    found[uuid] = MigNow(bool(current), frozenset(_text(pynvml.nvmlDeviceGetUUID(m)) for _, m in migs))
    except NvmlUnavailable:
        pass  # the liveness probe says so
    return found


def _step(operation: str, call: Callable[..., T], *args: object) -> T:
    try:
        return call(*args)
    except pynvml.NVMLError as error:
        raise _GpuStepFailed(operation, error) from error


def _optional(call: Callable[..., T], *args: object) -> T | None:
    """A query some GPUs or drivers do not support; anything but 'not supported' still fails the GPU."""
    try:
        return call(*args)
    except pynvml.NVMLError as error:
        if is_error(error, "NOT_SUPPORTED", "FUNCTION_NOT_FOUND", "INVALID_ARGUMENT", "NO_DATA"):
            return None
        raise _GpuStepFailed(call.__name__, error) from error


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _describe_gpu(index: int, uuid: str, handle: object) -> Gpu:
    name = _text(_step("nvmlDeviceGetName", pynvml.nvmlDeviceGetName, handle))
    memory = _step("nvmlDeviceGetMemoryInfo", pynvml.nvmlDeviceGetMemoryInfo, handle)
    pci = _step("nvmlDeviceGetPciInfo", pynvml.nvmlDeviceGetPciInfo, handle)
    cc = _step("nvmlDeviceGetCudaComputeCapability", pynvml.nvmlDeviceGetCudaComputeCapability, handle)
    minor = _step("nvmlDeviceGetMinorNumber", pynvml.nvmlDeviceGetMinorNumber, handle)
    arch = _optional(pynvml.nvmlDeviceGetArchitecture, handle)
    brand = _optional(pynvml.nvmlDeviceGetBrand, handle)
    mig_mode = _optional(pynvml.nvmlDeviceGetMigMode, handle)
    mig_capable = mig_mode is not None
    mig_enabled = bool(mig_capable and mig_mode[0] == pynvml.NVML_DEVICE_MIG_ENABLE)
    compute_mode = None if mig_enabled else _optional(pynvml.nvmlDeviceGetComputeMode, handle)
    numa = _optional(pynvml.nvmlDeviceGetNumaNodeId, handle)
    addressing = _optional(pynvml.nvmlDeviceGetAddressingMode, handle)
    gi_profiles = _gi_profiles(handle) if mig_enabled else {}
    return Gpu(
        index=index,
        uuid=uuid,
        name=name,
        memory_mib=memory.total >> 20,
        compute_capability=(cc[0], cc[1]),
        pci_bus_id=_text(pci.busId),
        pci_device_id=pci.pciDeviceId,
        minor_number=minor,
        architecture=_ARCHITECTURES.get(arch, "Unknown"),
        mig_capable=mig_capable,
        mig_enabled=mig_enabled,
        mig_pending=bool(mig_mode[1] == pynvml.NVML_DEVICE_MIG_ENABLE) if mig_capable else None,
        mig_devices=tuple(_mig_devices(index, uuid, handle, memory.total, gi_profiles)) if mig_enabled else (),
        numa_node=numa if numa is not None and numa >= 0 else None,
        compute_mode=_COMPUTE_MODES.get(compute_mode) if compute_mode is not None else None,
        brand=_BRANDS.get(brand, "") if brand is not None else "",
        addressing_mode=_ADDRESSING_MODES.get(addressing) if addressing is not None else None,
        gi_profiles=tuple(gi_profiles[i].counts for i in sorted(gi_profiles)),
    )


def _gi_profiles(handle: object) -> dict[int, _GiProfileInfo]:
    """GPU instance profiles by profile *id*, found by trying every profile *index* (as mig-parted does)."""
    profiles: dict[int, _GiProfileInfo] = {}
    for profile_index in _GI_PROFILE_INDICES:
        try:
            info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, profile_index)
        except pynvml.NVMLError as error:
            if is_error(error, *_SKIPPED_PROFILE_ERRORS):
                continue
            raise _GpuStepFailed("nvmlDeviceGetGpuInstanceProfileInfo", error) from error
        counts = GiProfileCounts(
            id=info.id,
            multiprocessors=info.multiprocessorCount,
            copy_engines=info.copyEngineCount,
            decoders=info.decoderCount,
            encoders=info.encoderCount,
            jpeg_engines=info.jpegCount,
            ofa_engines=info.ofaCount,
            memory_mib=info.memorySizeMB,
        )
        profiles[info.id] = _GiProfileInfo(profile_index, info.sliceCount, info.memorySizeMB, counts)
    return profiles


def _ci_slices(gpu_instance: object, ci_profile_id: int) -> int:
    for profile_index in _CI_PROFILE_INDICES:
        try:
            info = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gpu_instance, profile_index, _ENGINE_SHARED)
        except pynvml.NVMLError as error:
            if is_error(error, *_SKIPPED_PROFILE_ERRORS):
                continue
            raise _GpuStepFailed("nvmlGpuInstanceGetComputeInstanceProfileInfo", error) from error
        if info.id == ci_profile_id:
            return info.sliceCount
    raise _GpuStepFailed("nvmlGpuInstanceGetComputeInstanceProfileInfo", pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND))


def _mig_handles(handle: object) -> Iterator[tuple[int, object]]:
    """(MIG index, handle) of each MIG device of a GPU in MIG mode; empty slots are skipped."""
    count = _step("nvmlDeviceGetMaxMigDeviceCount", pynvml.nvmlDeviceGetMaxMigDeviceCount, handle)
    for mig_index in range(count):
        try:
            yield mig_index, pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, mig_index)
        except pynvml.NVMLError as error:
            if not is_error(error, "NOT_FOUND", "INVALID_ARGUMENT"):
                raise _GpuStepFailed("nvmlDeviceGetMigDeviceHandleByIndex", error) from error


def _mig_devices(
    gpu_index: int, gpu_uuid: str, handle: object, total_bytes: int, gi_profiles: dict[int, _GiProfileInfo]
) -> list[MigDevice]:
    devices = []
    for mig_index, mig in _mig_handles(handle):
        gi_id = _step("nvmlDeviceGetGpuInstanceId", pynvml.nvmlDeviceGetGpuInstanceId, mig)
        ci_id = _step("nvmlDeviceGetComputeInstanceId", pynvml.nvmlDeviceGetComputeInstanceId, mig)
        gpu_instance = _step("nvmlDeviceGetGpuInstanceById", pynvml.nvmlDeviceGetGpuInstanceById, handle, gi_id)
        gi_info = _step("nvmlGpuInstanceGetInfo", pynvml.nvmlGpuInstanceGetInfo, gpu_instance)
        compute_instance = _step(
            "nvmlGpuInstanceGetComputeInstanceById", pynvml.nvmlGpuInstanceGetComputeInstanceById, gpu_instance, ci_id
        )
        ci_info = _step("nvmlComputeInstanceGetInfo", pynvml.nvmlComputeInstanceGetInfo, compute_instance)
        attributes = _step("nvmlDeviceGetAttributes", pynvml.nvmlDeviceGetAttributes, mig)
        gi_profile = gi_profiles.get(gi_info.profileId)
        if gi_profile is None:
            _warn_once(
                f"GPU {gpu_index}: MIG device {mig_index} has GPU instance profile id {gi_info.profileId}, which the "
                f"installed nvidia-ml-py ({len(_GI_PROFILE_INDICES)} profiles) cannot describe; it is not "
                "advertised. Upgrade nvidia-ml-py to one that knows the driver's profiles"
            )
            continue
        ci_slices = _ci_slices(gpu_instance, ci_info.profileId)
        devices.append(
            MigDevice(
                uuid=_text(_step("nvmlDeviceGetUUID", pynvml.nvmlDeviceGetUUID, mig)),
                parent_uuid=gpu_uuid,
                gpu_index=gpu_index,
                mig_index=mig_index,
                profile=mig_profile_name(
                    gi_slices=gi_profile.slice_count,
                    ci_slices=ci_slices,
                    memory_mib=gi_profile.memory_mib,
                    parent_total_bytes=total_bytes,
                    gi_profile_index=gi_profile.index,
                ),
                gi_id=gi_id,
                ci_id=ci_id,
                gi_profile_id=gi_info.profileId,
                ci_profile_id=ci_info.profileId,
                gi_slices=gi_profile.slice_count,
                ci_slices=ci_slices,
                placement=Placement(gi_info.placement.start, gi_info.placement.size),
                memory_mib=attributes.memorySizeMB,
                multiprocessor_count=attributes.multiprocessorCount,
            )
        )
    return devices


def _with_nvlink_peers(gpu: Gpu, handle: object, others: list[object]) -> Gpu:
    """Peers reachable over NVLink, directly or through NVSwitches (the P2P NVLink capability)."""
    peers = []
    for other in others:
        try:
            status = pynvml.nvmlDeviceGetP2PStatus(handle, other, pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
            if status == pynvml.NVML_P2P_STATUS_OK:
                peers.append(pynvml.nvmlDeviceGetIndex(other))
        except pynvml.NVMLError:
            continue  # no NVLink information for this pair: leave it out
    return replace(gpu, nvlink_peers=tuple(sorted(peers)))
