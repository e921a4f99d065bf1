"""Device health as a pure state machine: XID and GPU-lost events in, per-device health out.

Faults are held per *unit*: a GPU (its UUID) or one MIG device (its MIG UUID). An advertised device is
healthy unless its GPU or its own MIG device has a fault, so an XID on a GPU turns every device on it
Unhealthy — every replica and every MIG device — and an XID attributed to one MIG device only that one.

Unlike NVIDIA's plugin a fault is not forever: after ``quiet_seconds`` without a new critical event the
unit is due for a probe, and a successful probe (done by the shell through NVML) clears it. A lost GPU
clears only once it answers again, which is exactly what the probe checks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from agent.core.inventory import Inventory
from agent.core.resources import Device

NVIDIA_IGNORED_XIDS = frozenset({13, 31, 43, 45, 68, 109})
UNATTRIBUTED = 0xFFFFFFFF  # an event's GI/CI id when the driver cannot name one instance


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    ignored_xids: frozenset[int] = NVIDIA_IGNORED_XIDS
    only_xids: frozenset[int] | None = None  # when set, only these count (NVIDIA's "disable all, enable some")
    quiet_seconds: float | None = 60.0  # None: faults never clear by themselves (NVIDIA's behaviour)

    def is_critical(self, xid: int) -> bool:
        if self.only_xids is not None:
            return xid in self.only_xids
        return xid not in self.ignored_xids


@dataclass(frozen=True, slots=True)
class Fault:
    reason: str
    since: float
    last_event: float
    lost: bool = False
    gpu_uuid: str | None = None  # the parent GPU of a MIG-device fault; None when the unit is the GPU itself


@dataclass(frozen=True, slots=True)
class HealthState:
    faults: Mapping[str, Fault] = field(default_factory=dict)  # unit (GPU or MIG UUID) -> fault

    def is_healthy(self, device: Device) -> bool:
        """A GPU fault spoils every device on it; a MIG-device fault that device and the whole GPU's device."""
        if device.gpu_uuid in self.faults:
            return False
        if device.mig_uuid is not None:
            return device.mig_uuid not in self.faults
        return not any(fault.gpu_uuid == device.gpu_uuid for fault in self.faults.values())

    def device_health(self, devices: Iterable[Device]) -> dict[str, bool]:
        return {d.id: self.is_healthy(d) for d in devices}


def units_for_event(inventory: Inventory, gpu_uuid: str, gi_id: int, ci_id: int) -> list[str]:
    """The units an event names: one MIG device when its GI/CI ids match one, else the whole GPU."""
    gpu = inventory.gpu_by_uuid(gpu_uuid)
    if gpu is None or gi_id == UNATTRIBUTED:
        return [gpu_uuid]
    matching = [m.uuid for m in gpu.mig_devices if m.gi_id == gi_id and (ci_id == UNATTRIBUTED or m.ci_id == ci_id)]
    return matching or [gpu_uuid]


def record_fault(
    state: HealthState,
    units: Iterable[str],
    reason: str,
    now: float,
    *,
    lost: bool = False,
    gpu_uuid: str | None = None,
) -> HealthState:
    """Mark units faulty; ``gpu_uuid`` names the parent GPU when the units are its MIG devices."""
    faults = dict(state.faults)
    for unit in units:
        previous = faults.get(unit)
        faults[unit] = Fault(
            reason=reason,
            since=previous.since if previous else now,
            last_event=now,
            lost=lost or bool(previous and previous.lost),
            gpu_uuid=gpu_uuid if gpu_uuid != unit else None,
        )
    return HealthState(faults)


def due_for_probe(state: HealthState, policy: HealthPolicy, now: float) -> list[str]:
    """Units quiet for long enough to be probed, in a stable order."""
    if policy.quiet_seconds is None:
        return []
    return sorted(u for u, f in state.faults.items() if now - f.last_event >= policy.quiet_seconds)


def probe_succeeded(state: HealthState, unit: str) -> HealthState:
    return HealthState({u: f for u, f in state.faults.items() if u != unit})


def probe_failed(state: HealthState, unit: str, now: float) -> HealthState:
    """Still broken: wait another quiet period before the next probe."""
    fault = state.faults.get(unit)
    if fault is None:
        return state
    return HealthState({**state.faults, unit: replace(fault, last_event=now)})


def parse_xid_list(text: str) -> tuple[frozenset[int], bool, list[str]]:
    """A comma list of XIDs (or ``all``): the numbers, whether it said ``all``, and the entries it rejected."""
    numbers: set[int] = set()
    rejected: list[str] = []
    everything = False
    for entry in (e.strip().lower() for e in text.split(",")):
        if not entry:
            continue
        if entry in ("all", "xids"):
            everything = True
        elif entry.isascii() and entry.isdigit():  # isdigit() alone accepts '\u00b2', which int() rejects
            numbers.add(int(entry))
        else:
            rejected.append(entry)
    return frozenset(numbers), everything, rejected


def xid_policy(
    ignored: str | None = None,
    nvidia_disabled: str | None = None,
    nvidia_enabled: str | None = None,
    quiet_seconds: float | None = 60.0,
) -> tuple[HealthPolicy, list[str]]:
    """The XID policy from Tessera's ``--ignored-xids`` and NVIDIA's two environment variables.

    ``ignored`` replaces NVIDIA's default list; ``DP_DISABLE_HEALTHCHECKS`` adds to it (``all`` ignores every
    XID) and ``DP_ENABLE_HEALTHCHECKS`` forces XIDs back on (``all``: every XID counts). Returns the policy
    and the entries that were not understood, for one warning.
    """
    rejected: list[str] = []
    base = NVIDIA_IGNORED_XIDS
    if ignored is not None:
        base, _, bad = parse_xid_list(ignored)
        rejected += bad
    disabled, disable_all, bad = parse_xid_list(nvidia_disabled or "")
    rejected += bad
    enabled, enable_all, bad = parse_xid_list(nvidia_enabled or "")
    rejected += bad
    if enable_all:
        return HealthPolicy(ignored_xids=frozenset(), quiet_seconds=quiet_seconds), rejected
    if disable_all:
        return HealthPolicy(only_xids=enabled, quiet_seconds=quiet_seconds), rejected
    return HealthPolicy(ignored_xids=(base | disabled) - enabled, quiet_seconds=quiet_seconds), rejected
