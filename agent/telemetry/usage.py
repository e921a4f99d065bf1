"""Each GPU process joined to its holder: memory and utilization per holder and physical device, and what is nobody's.

Pure: it takes what was read (NVML's process lists and per-process samples, each PID's owner from /proc, the
kubelet's assignments) and returns sums. A holder is a pod that the kubelet gave a device (``(namespace, pod)``)
or a DRA claim prepared for a pod (``("dra", namespace, claim UID)``). A process counts for a holder only when all
of these agree: its cgroup names a pod, and that pod holds, through the holder, the very physical device (GPU or
MIG device) the process runs on. Anything else goes to an unattributed sum with its reason, never to a holder.

Utilization: a process's utilization over the window is the mean of its samples stamped after it started (an
older sample is of an earlier process with the same PID); a listed process without a sample did no work. A pod's
utilization is the sum over its processes, at most 100 %. Where NVML cannot say (a MIG device, an error) it is
``None``: unknown, not zero.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from msgspec import Struct, field

from agent.gpu.process_utilization import Load, Sample
from agent.telemetry.procfs import Owner, Unattributed

PodKey = tuple[str, str]  # (namespace, pod)
Holder = tuple[str, ...]  # a PodKey, or ("dra", namespace, claim UID)
Holdings = Mapping[str, Mapping[str, Holder]]  # pod UID -> physical UUID -> who holds it for that pod
IDLE_LOAD: Load = (0.0, 0.0, 0.0, 0.0)


class ListedProcess(Struct, frozen=True):
    pid: int
    used_bytes: int | None


class DeviceProcesses(Struct, frozen=True):
    """What NVML said about one physical device: a GPU not in MIG mode, or a MIG device."""

    uuid: str
    processes: Sequence[ListedProcess]
    samples: Sequence[Sample] | None  # None: per-process utilization unknown here (MIG, NOT_SUPPORTED, an error)


class Usage(Struct):
    processes: int = 0
    memory_bytes: int = 0
    load: list[float] | None = field(default_factory=lambda: [0.0, 0.0, 0.0, 0.0])  # None: unknown

    def add(self, memory: int | None, load: Load | None, *, counted: bool = True) -> None:
        self.processes += 1 if counted else 0
        self.memory_bytes += memory or 0
        if self.load is not None and load is not None:
            self.load = [min(100.0, a + b) for a, b in zip(self.load, load, strict=True)]


class Attribution(Struct, frozen=True):
    by_holder: dict[tuple[Holder, str], Usage]  # (holder, physical UUID) -> its processes there
    unattributed: dict[tuple[str, Unattributed], Usage]  # (physical UUID, reason) -> processes nobody owns


def attribute(
    devices: Iterable[DeviceProcesses],
    owners: Mapping[int, Owner],
    holdings: Holdings,
    boot_wall: float,
) -> Attribution:
    """``holdings``: pod UID -> the physical UUIDs the pod holds and through whom (only pods the kubelet's
    assignments name); ``boot_wall``: the wall-clock time of boot (to put /proc start times and NVML timestamps on
    one clock)."""
    by_holder: dict[tuple[Holder, str], Usage] = {}
    unattributed: dict[tuple[str, Unattributed], Usage] = {}
    for device in devices:
        loads = _loads(device.samples, owners, boot_wall) if device.samples is not None else None
        listed = {process.pid for process in device.processes}
        entries: list[tuple[int, int | None, bool]] = [(p.pid, p.used_bytes, True) for p in device.processes]
        if loads is not None:  # processes that exited within the window worked too: their utilization counts
            entries += [(pid, None, False) for pid in loads if pid not in listed]
        for pid, memory, is_listed in entries:
            load = None if loads is None else loads.get(pid, IDLE_LOAD)
            owner = owners.get(pid)
            reason = _reason(owner, device.uuid, holdings)
            if reason is None and owner is not None and owner.pod_uid is not None:
                holder = holdings[owner.pod_uid][device.uuid]
                usage = by_holder.setdefault((holder, device.uuid), Usage())
            else:
                usage = unattributed.setdefault((device.uuid, reason or Unattributed.UNREADABLE), Usage())
            if loads is None:
                usage.load = None
            usage.add(memory, load, counted=is_listed)
    return Attribution(by_holder, unattributed)


def _reason(owner: Owner | None, uuid: str, holdings: Holdings) -> Unattributed | None:
    if owner is None:
        return Unattributed.UNREADABLE
    if owner.reason is not None or owner.pod_uid is None:
        return owner.reason or Unattributed.NO_POD
    held = holdings.get(owner.pod_uid)
    if held is None:
        return Unattributed.UNKNOWN_POD
    if uuid not in held:
        return Unattributed.NOT_HOLDING
    return None


def _loads(samples: Sequence[Sample], owners: Mapping[int, Owner], boot_wall: float) -> dict[int, Load]:
    """PID -> its mean load over the window, from the samples recorded after the process now holding the PID
    started (when /proc does not know the PID, all of its samples: they go to an unattributed sum anyway)."""
    sums: dict[int, list[float]] = {}
    counts: dict[int, int] = {}
    for sample in samples:
        owner = owners.get(sample.pid)
        if owner is not None and owner.start is not None and sample.timestamp_us / 1e6 < boot_wall + owner.start:
            continue  # recorded before this process started: an earlier holder of the PID
        total = sums.setdefault(sample.pid, [0.0, 0.0, 0.0, 0.0])
        for n in range(4):
            total[n] += sample.load[n]
        counts[sample.pid] = counts.get(sample.pid, 0) + 1
    return {pid: tuple(value / counts[pid] for value in total) for pid, total in sums.items()}  # type: ignore[misc]
