"""DRA claims' series: each prepared claim device's pods' own work, labelled as dcgm-exporter labels DRA devices.

Without the kubelet's word on which pods a claim serves (PodResources, or its DRA checkpoint), no process is the
claim's: the device is then idle only when no process at all runs on it, and its utilization is unknown (no series).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from agent.telemetry.exposition import Family, counter, gauge
from agent.telemetry.window import ENGINES, IdleDevice, Window, gpu_share

if TYPE_CHECKING:
    from agent.telemetry.dra_claims import PhysicalClaim
    from agent.telemetry.idle import IdleLedger

DRA_LABELS = (
    "dra_claim_name",
    "namespace",
    "dra_pool_name",
    "dra_device_name",
    "dra_mig_profile",
    "dra_mig_device_uuid",
    "gpu",
    "UUID",
    "device",
    "modelName",
    "GPU_I_PROFILE",
    "GPU_I_ID",
    "Hostname",
)


def claim_series(
    window: Window,
    claims: Sequence[PhysicalClaim],
    claim_pods: Mapping[str, frozenset[str]] | None,
    ledger: IdleLedger,
) -> tuple[list[Family], list[IdleDevice], set[tuple[str, ...]]]:
    """Per claim device: the claim's pods' own work there, idle time, and its share of the GPU-seconds.

    Without the kubelet's word on which pods a claim serves, no process is the claim's: the device is then
    idle only when no process at all runs on it, and its utilization is unknown."""
    engines = [gauge(name.replace("tessera_pod_", "tessera_dra_claim_"), f"{what} utilization of the claim's "
                     "pods' own processes on the device, percent; absent where NVML cannot say", DRA_LABELS)
               for name, what in ENGINES]  # fmt: skip
    memory = gauge("tessera_dra_claim_memory_used_bytes", "GPU memory of the claim's pods' processes on the "
                   "device", DRA_LABELS)  # fmt: skip
    processes = gauge("tessera_dra_claim_processes", "the claim's pods' processes on the device", DRA_LABELS)
    idle_now = gauge(
        "tessera_dra_claim_idle",
        "1 when the claim's pods' own processes did no work on the device over the last window",
        DRA_LABELS,
    )
    idle = counter(
        "tessera_dra_claim_allocated_idle_seconds",
        "seconds a prepared claim held the device while its pods' own processes on it stayed under the idle threshold",
        DRA_LABELS,
    )
    busy_devices = {d.uuid for d in window.devices if d.processes}
    sharing: dict[str, int] = defaultdict(int)
    for entry in claims:
        sharing[entry.uuid] += 1
    keys: set[tuple[str, ...]] = set()
    report: list[IdleDevice] = []
    for entry in claims:
        claim, where = entry.claim, window.physical.get(entry.uuid)
        if where is None:
            continue
        labels = (claim.name, claim.namespace, claim.pool, claim.device, entry.mig_profile,
                  entry.uuid if where.is_mig else "", *where.labels, window.host)  # fmt: skip
        known = claim_pods is not None and claim.claim_uid in claim_pods
        usage = window.attribution.by_holder.get((("dra", claim.namespace, claim.claim_uid), entry.uuid))
        gpu_stat = window.stats.get(where.gpu_uuid)
        if known:
            is_idle = window.is_idle(usage, where, sharing[entry.uuid])
        else:
            is_idle = gpu_stat is not None and gpu_stat.gpu is not None and entry.uuid not in busy_devices
        load = usage.load if usage is not None else window.zero_load(where)
        if not known and entry.uuid in busy_devices:
            load = None
        if load is not None:
            for family, value in zip(engines, load, strict=True):
                family.add_metric(labels, value)
        memory.add_metric(labels, usage.memory_bytes if usage is not None else 0)
        processes.add_metric(labels, usage.processes if usage is not None else 0)
        idle_now.add_metric(labels, 1 if is_idle else 0)
        keys.add(labels)
        share = gpu_share(where.memory_mib, where, sharing[entry.uuid])
        total, streak = ledger.credit(labels, claim.namespace, is_idle, window.elapsed, share, window.now)
        idle.add_metric(labels, total)
        sm = None if load is None else load[0]
        report.append(IdleDevice(f"DRA claim {claim.name}", claim.device, claim.namespace, "", "", streak, sm))
    return [*engines, memory, processes, idle_now, idle], report, keys
