"""Per-pod GPU truth on shared GPUs: each pod's own memory, utilization and idleness per device it holds.

One collection turns what NVML and /proc said (``usage.attribute``) into series per pod, container and physical
device (a GPU, a MIG device; replicas of one device that a pod holds share one series, ``device_id`` lists them),
labelled with dcgm-exporter's names. What cannot be attributed is summed per device and reason, never given to
a pod; where NVML has no per-process utilization the pod's utilization series is absent, not zero, and
``tessera_gpu_process_utilization_available`` says why.

Idle is per pod: a held device is idle over a window when the pod's own processes on it did no work (every
engine under the idle threshold), or it has none there. Where NVML cannot tell (a MIG device, a GPU whose
per-process utilization fails), a pod with processes there counts as busy, unless it holds the whole unshared
GPU, whose utilization is then the pod's. Idle time accumulates per held device, per namespace and per node in
GPU-seconds: a device counts as its share of a GPU (its memory over the GPU's, divided by its replicas).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from msgspec import Struct

from agent.gpu.process_utilization import UtilizationRead
from agent.telemetry.claim_series import claim_series
from agent.telemetry.dra_claims import PhysicalClaim, claim_holdings, podresources_claim_pods
from agent.telemetry.exposition import Family, counter, gauge
from agent.telemetry.idle import IdleLedger
from agent.telemetry.procfs import Owner, ProcessOwners, Unattributed, boot_clock
from agent.telemetry.usage import Attribution, DeviceProcesses, Holder, ListedProcess, PodKey, Usage, attribute
from agent.telemetry.window import ENGINES, IdleDevice, Physical, Window, gpu_share

if TYPE_CHECKING:
    from pathlib import Path

    from agent.core.inventory import Inventory
    from agent.gpu.telemetry import GpuStats
    from agent.plugin.podresources import DeviceHolder

log = logging.getLogger(__name__)

POD_LABELS = (
    "resource",
    "device_id",
    "gpu",
    "UUID",
    "device",
    "modelName",
    "GPU_I_PROFILE",
    "GPU_I_ID",
    "pod",
    "namespace",
    "container",
    "Hostname",
)
UNATTRIBUTED_LABELS = ("gpu", "UUID", "device", "modelName", "GPU_I_PROFILE", "GPU_I_ID", "reason", "Hostname")


class HeldDevice(Struct, frozen=True):
    """An advertised device a pod holds, as the collector saw it this collection."""

    resource: str
    device_id: str
    physical_uuid: str
    idle_key: tuple[str, ...]  # the labels of tessera_partition_allocated_idle_seconds
    namespace: str
    pod: str
    container: str
    replicas: int
    memory_mib: int


class PodTelemetry:
    """The per-pod part of a collection, with what it keeps between collections (idle time, PID owners)."""

    def __init__(self, proc_root: Path, idle_threshold_percent: float, hostname: str) -> None:
        self._owners = ProcessOwners(proc_root)
        self._threshold = idle_threshold_percent
        self._host = hostname
        self._physical: tuple[Inventory | None, dict[str, Physical]] = (None, {})
        self._ledger = IdleLedger()
        self._warned: set[str] = set()
        self.idle_devices: tuple[IdleDevice, ...] = ()  # the last collection's, for /status
        self.attribution: Attribution | None = None  # the last collection's

    def families(
        self,
        inventory: Inventory | None,
        stats: Mapping[str, GpuStats],
        utilization: Mapping[str, UtilizationRead],
        listed_at: float,
        held: Sequence[HeldDevice],
        holders: Mapping[str, DeviceHolder],
        devices_of_pod: Mapping[str, set[str]],
        elapsed: float,
        claims: Sequence[PhysicalClaim] = (),
        claim_pods: Mapping[str, frozenset[str]] | None = None,
        claim_users: Mapping[tuple[str, str, str, str], frozenset[tuple[str, str]]] | None = None,
    ) -> list[Family]:
        """``claims``: the devices of prepared DRA claims; ``claim_users``: (claim namespace, claim name, pool,
        device) -> the pods PodResources says use it; ``claim_pods``: claim UID -> its pods' UIDs from the
        kubelet's DRA checkpoint, for the claims PodResources does not name; both None when unknown."""
        host = self._host
        physical = self._physical_devices(inventory)
        devices = self._device_processes(inventory, stats, utilization)
        pids = {p.pid for d in devices for p in d.processes}
        pids |= {s.pid for d in devices for s in d.samples or ()}
        owners = self._owners.owners(pids, listed_at) if pids else {}
        boot_wall = time.time() - boot_clock()
        holdings = _holdings(devices_of_pod, holders)
        if claims and claim_users:
            named = podresources_claim_pods(claims, claim_users, _other_pods_on(devices, owners, holdings))
            claim_pods = {**(claim_pods or {}), **named}
        for uid, held_by_claims in claim_holdings(claims, claim_pods or {}).items():
            for uuid, claim in held_by_claims.items():
                holdings.setdefault(uid, {}).setdefault(uuid, claim)
        result = self.attribution = attribute(devices, owners, holdings, boot_wall)
        for (_, reason), usage in result.unattributed.items():
            if usage.processes and reason not in self._warned:
                self._warned.add(reason)
                log.warning(
                    "GPU processes not attributed to any pod reason=%s (see tessera_unattributed_gpu_*)", reason
                )

        engines = [gauge(name, f"{what} utilization of the pod's own processes on the device, percent (from "
                         "NVML's per-process samples); absent where NVML cannot say", POD_LABELS)
                   for name, what in ENGINES]  # fmt: skip
        memory = gauge(
            "tessera_pod_device_memory_used_bytes",
            "GPU memory used by the pod's own processes on the device (compute and MPS client processes)",
            POD_LABELS,
        )
        processes = gauge("tessera_pod_device_processes", "the pod's processes on the device", POD_LABELS)
        idle_now = gauge(
            "tessera_pod_device_idle",
            "1 when the pod's own processes did no work on the device over the last collection window",
            POD_LABELS,
        )
        idle = counter(
            "tessera_partition_allocated_idle_seconds",
            "seconds a pod held the device while its own processes on it stayed under the idle threshold",
            ["resource", "device_id", "gpu", "UUID", "pod", "namespace", "container", "Hostname"],
        )
        now = time.monotonic()
        window = Window(physical, stats, utilization, tuple(devices), result, elapsed, now, self._threshold, host)
        groups: dict[tuple[str, str, str], list[HeldDevice]] = defaultdict(list)
        for device in held:
            groups[(device.namespace, device.pod, device.physical_uuid)].append(device)
        idle_keys: set[tuple[str, ...]] = set()
        report: list[IdleDevice] = []
        for (namespace, pod, uuid), members in sorted(groups.items()):
            where = physical.get(uuid)
            usage = result.by_holder.get(((namespace, pod), uuid))
            is_idle = window.is_idle(usage, where, members[0].replicas)
            containers = {m.container for m in members}
            if where is not None:
                labels = (
                    members[0].resource,
                    ",".join(sorted(m.device_id for m in members)),
                    *where.labels,
                    pod,
                    namespace,
                    containers.pop() if len(containers) == 1 else "",
                    host,
                )
                known = usage.load if usage is not None else window.zero_load(where)
                if known is not None:
                    for family, value in zip(engines, known, strict=True):
                        family.add_metric(labels, value)
                memory.add_metric(labels, usage.memory_bytes if usage is not None else 0)
                processes.add_metric(labels, usage.processes if usage is not None else 0)
                idle_now.add_metric(labels, 1 if is_idle else 0)
            sm = None
            if usage is not None and usage.load is not None:
                sm = usage.load[0]
            elif usage is None and where is not None and window.zero_load(where) is not None:
                sm = 0.0
            for member in members:
                idle_keys.add(member.idle_key)
                total, streak = self._ledger.credit(
                    member.idle_key,
                    namespace,
                    is_idle,
                    elapsed,
                    gpu_share(member.memory_mib, where, member.replicas),
                    now,
                )
                idle.add_metric(member.idle_key, total)
                report.append(IdleDevice(member.resource, member.device_id, namespace, pod, member.container,
                                         streak, sm))  # fmt: skip
        claim_families, claim_report, claim_keys = claim_series(window, claims, claim_pods, self._ledger)
        report += claim_report
        self._ledger.keep(idle_keys | claim_keys)
        self.idle_devices = tuple(report)

        namespace_seconds = counter(
            "tessera_namespace_allocated_idle_gpu_seconds",
            "GPU-seconds the namespace's pods held devices their own processes left idle (a device counts as its "
            "share of a GPU; / 3600 for GPU-hours)",
            ["namespace", "Hostname"],
        )
        for namespace, seconds in sorted(self._ledger.namespace_seconds.items()):
            namespace_seconds.add_metric((namespace, host), seconds)
        node_seconds = counter(
            "tessera_node_allocated_idle_gpu_seconds",
            "GPU-seconds this node's devices were held by pods whose own processes left them idle",
            ["Hostname"],
        )
        node_seconds.add_metric((host,), self._ledger.node_seconds)
        families = [*engines, memory, processes, idle_now, idle, *claim_families, namespace_seconds, node_seconds]
        families += self._unattributed(result.unattributed, physical)
        families.append(self._availability(inventory, utilization))
        return families

    # ----- pieces -----------------------------------------------------------------------------------------

    def _physical_devices(self, inventory: Inventory | None) -> dict[str, Physical]:
        """Physical UUID -> its labels, built once per inventory (inventories are immutable)."""
        if self._physical[0] is inventory:
            return self._physical[1]
        found: dict[str, Physical] = {}
        for gpu in inventory.gpus if inventory is not None else ():
            device = f"nvidia{gpu.minor_number}"
            base = (str(gpu.index), gpu.uuid, device, gpu.name)
            found[gpu.uuid] = Physical((*base, "", ""), gpu.uuid, False, gpu.memory_mib, gpu.memory_mib)
            for mig in gpu.mig_devices:
                labels = (*base, mig.profile, str(mig.gi_id))
                found[mig.uuid] = Physical(labels, gpu.uuid, True, gpu.memory_mib, mig.memory_mib)
        self._physical = (inventory, found)
        return found

    @staticmethod
    def _device_processes(
        inventory: Inventory | None, stats: Mapping[str, GpuStats], utilization: Mapping[str, UtilizationRead]
    ) -> list[DeviceProcesses]:
        devices: list[DeviceProcesses] = []
        for gpu in inventory.gpus if inventory is not None else ():
            stat = stats.get(gpu.uuid)
            if stat is None or stat.gpu is None:
                continue
            if gpu.mig_enabled:
                for mig in gpu.mig_devices:
                    mig_stat = stat.migs.get(mig.uuid)
                    if mig_stat is not None and mig_stat.processes:
                        listed = [ListedProcess(p.pid, p.used_bytes) for p in mig_stat.processes]
                        devices.append(DeviceProcesses(mig.uuid, listed, None))
                continue
            read = utilization.get(gpu.uuid)
            samples = None if read is not None and read.error is not None else (read.samples if read else ())
            if stat.gpu.processes or samples:
                listed = [ListedProcess(p.pid, p.used_bytes) for p in stat.gpu.processes]
                devices.append(DeviceProcesses(gpu.uuid, listed, samples))
        return devices

    def _unattributed(
        self, unattributed: Mapping[tuple[str, Unattributed], Usage], physical: Mapping[str, Physical]
    ) -> list[Family]:
        processes = gauge(
            "tessera_unattributed_gpu_processes",
            "GPU processes no pod is known to own, by reason (no_pod, exited, pid_reused, unreadable, not_holding, "
            "unknown_pod)",
            UNATTRIBUTED_LABELS,
        )
        memory = gauge(
            "tessera_unattributed_gpu_memory_used_bytes",
            "GPU memory of processes no pod is known to own, by reason",
            UNATTRIBUTED_LABELS,
        )
        sm = gauge(
            "tessera_unattributed_gpu_utilization_percent",
            "SM utilization of processes no pod is known to own, by reason; absent where NVML cannot say",
            UNATTRIBUTED_LABELS,
        )
        for (uuid, reason), usage in sorted(unattributed.items()):
            where = physical.get(uuid)
            if where is None:
                continue
            labels = (*where.labels, str(reason), self._host)
            processes.add_metric(labels, usage.processes)
            memory.add_metric(labels, usage.memory_bytes)
            if usage.load is not None:
                sm.add_metric(labels, usage.load[0])
        return [processes, memory, sm]

    def _availability(self, inventory: Inventory | None, utilization: Mapping[str, UtilizationRead]) -> Family:
        available = gauge(
            "tessera_gpu_process_utilization_available",
            "1 when NVML reports per-process utilization on the GPU (pods' utilization series exist), else 0 with "
            "the reason: MIG (not reported with MIG enabled) or the NVML error",
            ["gpu", "UUID", "modelName", "reason", "Hostname"],
        )
        for gpu in inventory.gpus if inventory is not None else ():
            read = utilization.get(gpu.uuid)
            reason = "MIG" if gpu.mig_enabled else (read.error or "") if read is not None else ""
            if reason and reason != "MIG":
                key = f"utilization:{gpu.uuid}:{reason}"
                if key not in self._warned:
                    self._warned.add(key)
                    log.warning("no per-process GPU utilization gpu=%s error=NVML_ERROR_%s: pods on it are never "
                                "counted idle while they run processes", gpu.uuid, reason)  # fmt: skip
            available.add_metric((str(gpu.index), gpu.uuid, gpu.name, reason, self._host), 0 if reason else 1)
        return available


def _holdings(
    devices_of_pod: Mapping[str, set[str]], holders: Mapping[str, DeviceHolder]
) -> dict[str, dict[str, Holder]]:
    """Pod UID -> physical UUID -> (namespace, pod), for the pods PodResources names as holding the devices the
    kubelet's checkpoint gave them."""
    holdings: dict[str, dict[str, Holder]] = {}
    for uid, device_ids in devices_of_pod.items():
        pod: PodKey | None = None
        for device_id in device_ids:
            holder = holders.get(device_id)
            if holder is None:
                continue
            if pod is None:
                pod = (holder.namespace, holder.pod)
            elif pod != (holder.namespace, holder.pod):  # two pods for one UID cannot be: trust neither
                holdings.pop(uid, None)
                break
            holdings.setdefault(uid, {})[device_id.split("::", 1)[0]] = pod
    return holdings


def _other_pods_on(
    devices: Sequence[DeviceProcesses], owners: Mapping[int, Owner], holdings: Mapping[str, Mapping[str, Holder]]
) -> dict[str, frozenset[str]]:
    """Physical UUID -> the UIDs of the pods with processes there (listed or sampled) that hold no device-plugin
    device there."""
    found: dict[str, frozenset[str]] = {}
    for device in devices:
        pids = {p.pid for p in device.processes} | {s.pid for s in device.samples or ()}
        uids = {owner.pod_uid for pid in pids if (owner := owners.get(pid)) is not None and owner.pod_uid}
        found[device.uuid] = frozenset(u for u in uids if device.uuid not in holdings.get(u, {}))
    return found
