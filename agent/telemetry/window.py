"""One collection window as the per-holder series see it: the physical devices, what NVML said, the idle rule.

Shared by the pods' series (``pods``) and the DRA claims' (``claim_series``), so that a pod and a claim on the same
kind of device are judged alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from msgspec import Struct

if TYPE_CHECKING:
    from agent.gpu.process_utilization import UtilizationRead
    from agent.gpu.telemetry import GpuStats
    from agent.telemetry.usage import Attribution, DeviceProcesses, Usage

ENGINES = (
    ("tessera_pod_gpu_utilization_percent", "SM (graphics and compute engine)"),
    ("tessera_pod_gpu_memory_copy_utilization_percent", "memory controller"),
    ("tessera_pod_gpu_encoder_utilization_percent", "video encoder"),
    ("tessera_pod_gpu_decoder_utilization_percent", "video decoder"),
)


class Physical(Struct, frozen=True):
    """A physical device's dcgm-exporter labels: gpu, UUID (the GPU's), device, modelName, GPU_I_PROFILE, GPU_I_ID."""

    labels: tuple[str, str, str, str, str, str]
    gpu_uuid: str
    is_mig: bool
    gpu_memory_mib: int
    memory_mib: int  # the device's own: the GPU's, or the MIG device's


class IdleDevice(Struct, frozen=True):
    """One held device in ``tessera status --idle``: its pod, how long it has been idle, its pod's utilization."""

    resource: str
    device_id: str
    namespace: str
    pod: str
    container: str
    idle_seconds: float  # 0 while busy
    utilization_percent: float | None  # the pod's SM utilization on the device; None when NVML cannot say


class Window(Struct, frozen=True):
    """What one collection read, and the idle threshold it is judged by."""

    physical: Mapping[str, Physical]  # physical UUID -> its labels
    stats: Mapping[str, GpuStats]
    utilization: Mapping[str, UtilizationRead]
    devices: tuple[DeviceProcesses, ...]
    attribution: Attribution
    elapsed: float  # seconds since the previous collection
    now: float  # monotonic
    threshold: float  # percent
    host: str

    def is_idle(self, usage: Usage | None, where: Physical | None, replicas: int) -> bool:
        """Idle over the window: the holder's own processes on the device did no work (each engine under the
        threshold) or it has none there. Where NVML cannot say per process, processes mean busy, unless the
        holder has the whole unshared GPU, whose utilization is then its own."""
        gpu_stat = self.stats.get(where.gpu_uuid) if where is not None else None
        if where is None or gpu_stat is None or gpu_stat.gpu is None:
            return False  # NVML did not answer for the GPU: unknown, not idle
        if usage is None:
            return True  # none of the holder's processes is on the device
        if usage.load is not None:
            return max(usage.load) < self.threshold
        if not usage.processes:
            return True  # only exited processes, whose work NVML cannot tell here
        whole = not where.is_mig and replicas == 1 and gpu_stat.gpu.utilization_percent is not None
        return whole and gpu_stat.gpu.utilization_percent < self.threshold

    def zero_load(self, where: Physical) -> tuple[float, ...] | None:
        """A holder without processes on a device: 0 where NVML measures per process, else unknown."""
        if where.is_mig:
            return None
        read = self.utilization.get(where.gpu_uuid)
        return (0.0, 0.0, 0.0, 0.0) if read is None or read.error is None else None


def gpu_share(memory_mib: int, where: Physical | None, replicas: int) -> float:
    """A device's share of a GPU: its memory over the GPU's, over the number sharing it (1 for a whole GPU)."""
    if where is None or where.gpu_memory_mib <= 0:
        return 0.0
    return min(1.0, memory_mib / where.gpu_memory_mib) / max(1, replicas)
