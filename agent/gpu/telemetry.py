"""Telemetry reads through NVML: memory, utilization and processes (MPS clients included) per GPU and MIG device.

One failing GPU gives a ``GpuStats`` with its NVML error and no numbers; the others are still read.
Utilization is ``None`` where the driver does not report it (a MIG-enabled GPU): Tessera does not fake it.
NVML never reports it for a MIG device, so it is not asked there (four calls per MIG device, not five).
"""

from __future__ import annotations

import pynvml
from msgspec import Struct, field

from agent.core.inventory import Inventory
from agent.gpu.nvml import error_name, is_error, nvml_session


class ProcessStat(Struct, frozen=True):
    pid: int
    used_bytes: int | None


class DeviceStats(Struct, frozen=True):
    uuid: str
    memory_total_bytes: int
    memory_used_bytes: int
    utilization_percent: int | None
    processes: tuple[ProcessStat, ...]


class GpuStats(Struct, frozen=True):
    uuid: str
    error: str | None = None
    gpu: DeviceStats | None = None
    migs: dict[str, DeviceStats] = field(default_factory=dict)


def read_stats(inventory: Inventory) -> dict[str, GpuStats]:
    stats: dict[str, GpuStats] = {}
    with nvml_session():
        for gpu in inventory.gpus:
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
                migs = {
                    m.uuid: _device(pynvml.nvmlDeviceGetHandleByUUID(m.uuid), m.uuid, mig=True) for m in gpu.mig_devices
                }
                stats[gpu.uuid] = GpuStats(gpu.uuid, None, _device(handle, gpu.uuid), migs)
            except pynvml.NVMLError as error:
                stats[gpu.uuid] = GpuStats(gpu.uuid, error_name(error))
    return stats


def _device(handle: object, uuid: str, *, mig: bool = False) -> DeviceStats:
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    utilization: int | None = None
    if not mig:  # NOT_SUPPORTED on every MIG device
        try:
            utilization = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
        except pynvml.NVMLError as error:
            if not is_error(error, "NOT_SUPPORTED"):
                raise
    return DeviceStats(uuid, memory.total, memory.used, utilization, _processes(handle))


def _processes(handle: object) -> tuple[ProcessStat, ...]:
    """Compute processes and MPS clients: a real driver lists an MPS server among the compute processes and
    its clients — the pods' processes — only in the MPS list."""
    compute = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    try:
        clients = pynvml.nvmlDeviceGetMPSComputeRunningProcesses(handle)
    except pynvml.NVMLError as error:
        if not is_error(error, "NOT_SUPPORTED"):
            raise
        clients = []
    if not compute and not clients:
        return ()
    found = {p.pid: ProcessStat(p.pid, p.usedGpuMemory) for p in compute}
    found.update((p.pid, ProcessStat(p.pid, p.usedGpuMemory)) for p in clients)
    return tuple(found[pid] for pid in sorted(found))
