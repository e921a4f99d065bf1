"""Device health as a pure state machine: XID and GPU-lost events in, per-device health out.

Faults are held per *unit*: a GPU (its UUID) or one MIG device (its MIG UUID). An advertised device is
healthy unless its GPU or its own MIG device has a fault, so an XID on a GPU turns every device on it
Unhealthy — every replica and every MIG device — and an XID attributed to one MIG device only that one.

What an XID does follows NVIDIA's Xid catalog (``agent.core.xid_catalog``): each XID's immediate action
gives an ``XidEffect``. Application-level XIDs (``RESTART_APP``, ``IGNORE``) leave the device Healthy;
reset-class and unknown XIDs make it Unhealthy; the reboot class (79 fallen off the bus, ``RESTART_BM``,
``RESTART_VM``) makes it Unhealthy *and lost*. ``HealthPolicy`` is the one object that decides, with
per-XID overrides (flag and config), ``--ignored-xids`` and NVIDIA's ``DP_DISABLE_HEALTHCHECKS`` /
``DP_ENABLE_HEALTHCHECKS`` layered on top (see ``HealthPolicy.effect``).

Unlike NVIDIA's plugin a fault is not forever: after ``quiet_seconds`` without a new critical event the
unit is due for a recovery check. The shell gathers the evidence through NVML (``agent.gpu.health.
recovery_evidence``: the GPU answers, the recovery action reads NONE, nothing pending, ECC not growing)
and reports it back here: ``probe_succeeded`` clears the fault, ``probe_failed`` keeps it for another quiet
period and remembers what blocked it.

Evidence can only speak for what the driver shows. While the event watcher cannot see a GPU — it reported
the watch failed (``record_unwatched``), or the GPU fell off the bus and has not been registered for events
again since (``lost``) — an XID on it would go unnoticed, so its fault holds ``unwatched`` (why) and no
quiet period clears it: only the watcher saying it sees the GPU again (``watch_restored``). A fault whose
cause the evidence cleared while the GPU is still unwatched stays, with the unwatched reason
(``BACK_UNWATCHED_REASON`` for a GPU back from the bus).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import msgspec
from msgspec.structs import replace

from agent.core.inventory import Inventory
from agent.core.resources import Device
from agent.core.xid_catalog import CATALOG, XidAction, XidInfo, lookup
from agent.core.xid_effect import (  # the vocabulary of effects and its parsers, re-exported for the callers
    EFFECT_NAMES as EFFECT_NAMES,
)
from agent.core.xid_effect import (
    MAX_RANGE as MAX_RANGE,
)
from agent.core.xid_effect import (
    MAX_XID,
    OVERRIDE_SYNTAX,
    XidEffect,
    is_xid_number,
    parse_xid_overrides,
)
from agent.core.xid_effect import (
    parse_effect as parse_effect,
)
from agent.core.xid_effect import (
    parse_override_mapping as parse_override_mapping,
)
from agent.core.xid_effect import (
    parse_xid_key as parse_xid_key,
)

NVIDIA_IGNORED_XIDS = frozenset({13, 31, 43, 45, 68, 109})  # NVIDIA's device plugin v0.20, hard-coded
UNATTRIBUTED = 0xFFFFFFFF  # an event's GI/CI id when the driver cannot name one instance
GPU_LOST_REASON = "GPU is lost (NVML_ERROR_GPU_IS_LOST)"
BACK_UNWATCHED_REASON = "back from the bus; health watch not yet re-registered"
WATCH_FAILED_REASON = "health watch failed: {error}"


# The catalog's immediate action -> Tessera's default effect. Anything that may need a reset, a reboot or a
# human is Unhealthy until evidence says otherwise; only what the catalog says the application causes or
# that needs no action leaves the device in service.
DEFAULT_EFFECT: Mapping[XidAction, XidEffect] = MappingProxyType(
    {
        XidAction.IGNORE: XidEffect.IGNORE,
        XidAction.RESTART_APP: XidEffect.APPLICATION,
        XidAction.WORKFLOW_XID_45: XidEffect.APPLICATION,  # preemptive cleanup after Ctrl-C, a kill, a reset
        XidAction.RESET_GPU: XidEffect.UNHEALTHY,
        XidAction.WORKFLOW_XID_48: XidEffect.UNHEALTHY,  # alone: RESET_GPU
        XidAction.WORKFLOW_NVLINK_ERR: XidEffect.UNHEALTHY,  # needs the message's register bits
        XidAction.WORKFLOW_NVLINK5_ERR: XidEffect.UNHEALTHY,  # a subcode may need RESET_GPU
        XidAction.XID_154: XidEffect.UNHEALTHY,  # the recovery action itself decides when it clears
        XidAction.CHECK_UVM: XidEffect.UNHEALTHY,  # RESET_GPU when UVM is in use, which we cannot rule out
        XidAction.CHECK_MECHANICALS: XidEffect.UNHEALTHY,
        XidAction.UPDATE_SWFW: XidEffect.UNHEALTHY,
        XidAction.CONTACT_SUPPORT: XidEffect.UNHEALTHY,
        XidAction.NO_BUCKET: XidEffect.UNHEALTHY,  # treated as RESET_GPU
        XidAction.UNKNOWN: XidEffect.UNHEALTHY,  # treated as CONTACT_SUPPORT
        XidAction.RESTART_BM: XidEffect.LOST,
        XidAction.RESTART_VM: XidEffect.LOST,
    }
)


def default_effect(xid: int) -> XidEffect:
    """Tessera's default for ``xid``: its catalog action's effect."""
    return DEFAULT_EFFECT[lookup(xid).action]


def nvidia_effect(xid: int) -> XidEffect:
    """What NVIDIA's device plugin v0.20 does by default: its six XIDs ignored, every other one Unhealthy."""
    if xid in NVIDIA_IGNORED_XIDS:
        return XidEffect.IGNORE
    return XidEffect.LOST if default_effect(xid) is XidEffect.LOST else XidEffect.UNHEALTHY


class XidVerdict(msgspec.Struct, frozen=True):
    """One XID as the policy sees it: the catalog's entry and the effect in force."""

    xid: int
    info: XidInfo
    effect: XidEffect

    @property
    def action(self) -> XidAction:
        return self.info.action

    @property
    def reason(self) -> str:
        """For logs, status and metrics: ``XID 48 (Double Bit ECC Error, WORKFLOW_XID_48)``."""
        return f"XID {self.xid} ({self.info.short_name}, {self.info.action})"

    @property
    def marks_unhealthy(self) -> bool:
        return self.effect.marks_unhealthy

    @property
    def lost(self) -> bool:
        return self.effect is XidEffect.LOST


def _frozen_overrides(value: Mapping[int, XidEffect | str] | None) -> Mapping[int, XidEffect]:
    return MappingProxyType({int(x): XidEffect(e) for x, e in (value or {}).items()})


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    """The one object the agent consults about XIDs. Layers, the first that names an XID deciding:

    1. ``overrides`` — Tessera's per-XID flag (``--xid-overrides``);
    2. ``config_overrides`` — the sharing config's ``health.xids``;
    3. ``enabled_xids`` / ``enable_all`` — NVIDIA's ``DP_ENABLE_HEALTHCHECKS``: at least Unhealthy
       (a reboot-class XID stays lost);
    4. ``ignored_xids`` / ``ignore_all`` — ``--ignored-xids`` and ``DP_DISABLE_HEALTHCHECKS``: ignored;
    5. the default: the catalog's effect, or — when ``catalog_defaults`` is off (``--ignored-xids`` given,
       NVIDIA's model) — Unhealthy for every XID.
    """

    overrides: Mapping[int, XidEffect] = field(default_factory=dict, hash=False)
    config_overrides: Mapping[int, XidEffect] = field(default_factory=dict, hash=False)
    ignored_xids: frozenset[int] = frozenset()
    enabled_xids: frozenset[int] = frozenset()
    ignore_all: bool = False
    enable_all: bool = False
    catalog_defaults: bool = True
    quiet_seconds: float | None = 60.0  # None: faults never clear by themselves (NVIDIA's behaviour)

    def __post_init__(self) -> None:
        object.__setattr__(self, "overrides", _frozen_overrides(self.overrides))
        object.__setattr__(self, "config_overrides", _frozen_overrides(self.config_overrides))
        object.__setattr__(self, "ignored_xids", frozenset(self.ignored_xids))
        object.__setattr__(self, "enabled_xids", frozenset(self.enabled_xids))

    @classmethod
    def nvidia(cls, quiet_seconds: float | None = None) -> HealthPolicy:
        """NVIDIA's device plugin exactly: its six XIDs ignored, every other one Unhealthy, no recovery."""
        return cls(ignored_xids=NVIDIA_IGNORED_XIDS, catalog_defaults=False, quiet_seconds=quiet_seconds)

    def effect(self, xid: int) -> XidEffect:
        if xid in self.overrides:
            return self.overrides[xid]
        if xid in self.config_overrides:
            return self.config_overrides[xid]
        base = default_effect(xid)
        if not self.catalog_defaults and not base.marks_unhealthy:
            base = XidEffect.UNHEALTHY
        if self.enable_all or xid in self.enabled_xids:
            return base if base.marks_unhealthy else XidEffect.UNHEALTHY
        if self.ignore_all or xid in self.ignored_xids:
            return XidEffect.IGNORE
        return base

    def verdict(self, xid: int) -> XidVerdict:
        return XidVerdict(xid, lookup(xid), self.effect(xid))

    def is_critical(self, xid: int) -> bool:
        """Does ``xid`` make a device Unhealthy (effect UNHEALTHY or LOST)?"""
        return self.effect(xid).marks_unhealthy

    def with_config_overrides(self, config_overrides: Mapping[int, XidEffect] | None) -> HealthPolicy:
        """The same flags with another config's ``health.xids`` (on a config reload)."""
        return dataclasses.replace(self, config_overrides=_frozen_overrides(config_overrides))


class Fault(msgspec.Struct, frozen=True):
    reason: str  # e.g. "XID 48 (Double Bit ECC Error, WORKFLOW_XID_48)" or GPU_LOST_REASON
    since: float
    last_event: float
    lost: bool = False
    gpu_uuid: str | None = None  # the parent GPU of a MIG-device fault; None when the unit is the GPU itself
    xid: int | None = None  # the XID of the latest event, None for a fault that is not an XID
    action: XidAction | None = None  # the catalog's immediate action for that XID
    effect: XidEffect | None = None  # the effect the policy gave it
    ecc_baseline: int | None = None  # volatile uncorrected ECC count to compare the next recovery check with
    blockers: tuple[str, ...] = ()  # what the last recovery check found still wrong
    # The watcher cannot see this GPU's events, and why: only its word (``watch_restored``) clears this.
    unwatched: str | None = None
    # The cause (an XID, a loss) waits for the recovery evidence; False once only the watcher's word is missing.
    needs_evidence: bool = True


class HealthState(msgspec.Struct, frozen=True):
    faults: Mapping[str, Fault] = msgspec.field(default_factory=dict)  # unit (GPU or MIG UUID) -> fault

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
    xid: int | None = None,
    action: XidAction | None = None,
    effect: XidEffect | None = None,
    ecc_baseline: int | None = None,
) -> HealthState:
    """Mark units faulty; ``gpu_uuid`` names the parent GPU when the units are its MIG devices.

    A unit already faulty keeps its first ``since``, stays lost once lost, keeps its ECC baseline (a
    count that grows between the first fault and the check blocks recovery once, then becomes the baseline)
    and stays unwatched until the watcher says otherwise. A lost GPU is unwatched from now on: the watcher
    dropped it, and it must register it again before an XID on it can be seen.
    """
    faults = dict(state.faults)
    for unit in units:
        previous = faults.get(unit)
        unwatched = previous.unwatched if previous else None
        faults[unit] = Fault(
            reason=reason,
            since=previous.since if previous else now,
            last_event=now,
            lost=lost or bool(previous and previous.lost),
            gpu_uuid=gpu_uuid if gpu_uuid != unit else None,
            xid=xid,
            action=action,
            effect=effect,
            ecc_baseline=previous.ecc_baseline if previous and previous.ecc_baseline is not None else ecc_baseline,
            unwatched=BACK_UNWATCHED_REASON if lost else unwatched,
        )
    return HealthState(faults)


def record_unwatched(state: HealthState, units: Iterable[str], why: str, now: float) -> HealthState:
    """The watcher cannot see these GPUs' events (``why``): they are Unhealthy until it says it sees them again
    (``watch_restored``). A fault already there keeps its cause and reason; a new one has nothing for the
    recovery evidence to clear, so no quiet period ends it."""
    faults = dict(state.faults)
    for unit in units:
        previous = faults.get(unit)
        if previous is None:
            faults[unit] = Fault(reason=why, since=now, last_event=now, unwatched=why, needs_evidence=False)
        else:
            faults[unit] = replace(previous, unwatched=why, reason=previous.reason if previous.needs_evidence else why)
    return HealthState(faults)


def watch_restored(state: HealthState, gpu_uuid: str) -> HealthState:
    """The watcher sees the GPU's events again: a fault of it (or of one of its MIG devices) that waited only for
    that goes; one whose cause (an XID, a loss) the evidence has not cleared yet stays, watched."""
    faults: dict[str, Fault] = {}
    for unit, fault in state.faults.items():
        if fault.unwatched is None or gpu_uuid not in (unit, fault.gpu_uuid):
            faults[unit] = fault
        elif fault.needs_evidence:
            faults[unit] = replace(fault, unwatched=None)
    return state if faults == state.faults else HealthState(faults)


def awaiting_watch(state: HealthState) -> list[str]:
    """The units whose faults wait for the watcher's word, in a stable order."""
    return sorted(u for u, f in state.faults.items() if f.unwatched is not None)


def record_xid(
    state: HealthState,
    units: Iterable[str],
    verdict: XidVerdict,
    now: float,
    *,
    gpu_uuid: str | None = None,
    ecc_baseline: int | None = None,
) -> HealthState:
    """Record an XID the policy judged; an XID that does not mark a device Unhealthy changes nothing."""
    if not verdict.marks_unhealthy:
        return state
    return record_fault(
        state,
        units,
        verdict.reason,
        now,
        lost=verdict.lost,
        gpu_uuid=gpu_uuid,
        xid=verdict.xid,
        action=verdict.action,
        effect=verdict.effect,
        ecc_baseline=ecc_baseline,
    )


def with_ecc_baseline(state: HealthState, units: Iterable[str], baseline: int | None) -> HealthState:
    """Give faults that have none the uncorrected ECC count to judge their recovery against."""
    if baseline is None:
        return state
    faults = dict(state.faults)
    for unit in units:
        fault = faults.get(unit)
        if fault is not None and fault.ecc_baseline is None:
            faults[unit] = replace(fault, ecc_baseline=baseline)
    return HealthState(faults)


def due_for_probe(state: HealthState, policy: HealthPolicy, now: float) -> list[str]:
    """Units quiet for long enough to be checked for recovery, in a stable order. A fault with nothing for the
    evidence to clear (the GPU is only unwatched) is never due: time passing does not make it watched."""
    if policy.quiet_seconds is None:
        return []
    return sorted(u for u, f in state.faults.items() if f.needs_evidence and now - f.last_event >= policy.quiet_seconds)


def next_probe(state: HealthState, policy: HealthPolicy) -> float | None:
    """When the next unit is due for a recovery check (``due_for_probe``), or None if none will be."""
    if policy.quiet_seconds is None:
        return None
    quiet = policy.quiet_seconds
    return min((f.last_event + quiet for f in state.faults.values() if f.needs_evidence), default=None)


def probe_succeeded(state: HealthState, unit: str) -> HealthState:
    """The evidence says the unit recovered: its fault is cleared — unless the watcher still cannot see it: then
    it stays Unhealthy for that reason alone (``unwatched``) until the watcher says it does."""
    fault = state.faults.get(unit)
    if fault is not None and fault.unwatched is not None:
        waiting = Fault(
            reason=fault.unwatched,
            since=fault.since,
            last_event=fault.last_event,
            gpu_uuid=fault.gpu_uuid,
            unwatched=fault.unwatched,
            needs_evidence=False,
        )
        return HealthState({**state.faults, unit: waiting})
    return HealthState({u: f for u, f in state.faults.items() if u != unit})


def probe_failed(
    state: HealthState,
    unit: str,
    now: float,
    *,
    blockers: Iterable[str] = (),
    ecc_baseline: int | None = None,
) -> HealthState:
    """Still broken: wait another quiet period before the next check, and remember why (``blockers``).

    ``ecc_baseline`` is the uncorrected ECC count the check read; the next check compares with it.
    """
    fault = state.faults.get(unit)
    if fault is None:
        return state
    updated = replace(
        fault,
        last_event=now,
        blockers=tuple(blockers),
        ecc_baseline=fault.ecc_baseline if ecc_baseline is None else ecc_baseline,
    )
    return HealthState({**state.faults, unit: updated})


# ----- parsing flags, environment and config -------------------------------------------------------


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
        elif is_xid_number(entry) and int(entry) <= MAX_XID:
            numbers.add(int(entry))
        else:
            rejected.append(entry)
    return frozenset(numbers), everything, rejected


def health_policy(
    *,
    ignored: str | None = None,
    overrides: str | None = None,
    config_overrides: Mapping[int, XidEffect] | None = None,
    nvidia_disabled: str | None = None,
    nvidia_enabled: str | None = None,
    quiet_seconds: float | None = 60.0,
) -> tuple[HealthPolicy, list[str]]:
    """The policy from every source, and one warning line per thing that was not understood or conflicts.

    - ``ignored``: ``--ignored-xids`` (None when not given). Given, it switches to NVIDIA's model: the listed
      XIDs are ignored and every other XID makes a device Unhealthy (it replaces NVIDIA's list, as before).
    - ``overrides``: ``--xid-overrides``, e.g. ``94=unhealthy,13=ignore``; wins over everything.
    - ``config_overrides``: the sharing config's ``health.xids`` (already validated by the config model).
    - ``nvidia_disabled`` / ``nvidia_enabled``: ``DP_DISABLE_HEALTHCHECKS`` / ``DP_ENABLE_HEALTHCHECKS``.
    """
    warnings: list[str] = []
    ignored_xids: frozenset[int] = frozenset()
    if ignored is not None:
        ignored_xids, _, bad = parse_xid_list(ignored)
        if bad:
            warnings.append(f"--ignored-xids: ignored entries that are not XIDs: {', '.join(bad)}")
    disabled, disable_all, bad = parse_xid_list(nvidia_disabled or "")
    if bad:
        warnings.append(f"DP_DISABLE_HEALTHCHECKS: ignored entries that are not XIDs: {', '.join(bad)}")
    enabled, enable_all, bad = parse_xid_list(nvidia_enabled or "")
    if bad:
        warnings.append(f"DP_ENABLE_HEALTHCHECKS: ignored entries that are not XIDs: {', '.join(bad)}")
    flag_overrides: dict[int, XidEffect] = {}
    if overrides:
        flag_overrides, bad = parse_xid_overrides(overrides)
        if bad:
            warnings.append(f"--xid-overrides: ignored entries {', '.join(bad)}; write {OVERRIDE_SYNTAX}")
    policy = HealthPolicy(
        overrides=flag_overrides,
        config_overrides=config_overrides or {},
        ignored_xids=ignored_xids | disabled,
        enabled_xids=enabled,
        ignore_all=disable_all,
        enable_all=enable_all,
        catalog_defaults=ignored is None,
        quiet_seconds=quiet_seconds,
    )
    warnings += override_conflicts(policy)
    return policy, warnings


def override_conflicts(policy: HealthPolicy) -> list[str]:
    """One line per XID that an override and an NVIDIA variable (or ``--ignored-xids``) both name."""
    lines = []
    for xid in sorted(set(policy.overrides) | set(policy.config_overrides)):
        named = [
            source
            for source, xids in (
                ("DP_ENABLE_HEALTHCHECKS", policy.enabled_xids),
                ("DP_DISABLE_HEALTHCHECKS/--ignored-xids", policy.ignored_xids),
            )
            if xid in xids
        ]
        if named:
            where = "--xid-overrides" if xid in policy.overrides else "the config's health.xids"
            lines.append(f"XID {xid}: {where} ({policy.effect(xid)}) wins over {' and '.join(named)}")
    return lines


def xid_policy(
    ignored: str | None = None,
    nvidia_disabled: str | None = None,
    nvidia_enabled: str | None = None,
    quiet_seconds: float | None = 60.0,
) -> tuple[HealthPolicy, list[str]]:
    """The policy from ``--ignored-xids`` and NVIDIA's two variables, and the entries not understood.

    Kept for existing callers; ``health_policy`` also takes the overrides and returns whole warning lines.
    """
    rejected: list[str] = []
    for text in (ignored, nvidia_disabled, nvidia_enabled):
        rejected += parse_xid_list(text or "")[2]
    policy, _ = health_policy(
        ignored=ignored, nvidia_disabled=nvidia_disabled, nvidia_enabled=nvidia_enabled, quiet_seconds=quiet_seconds
    )
    return policy, rejected


# ----- the documented table ------------------------------------------------------------------------


def effect_table_markdown() -> str:
    """docs/health.md's classification table, one row per catalogued XID (a test keeps them equal)."""
    lines = [
        "| XID | Mnemonic | Short name | Catalog action | Tessera default | NVIDIA plugin v0.20 |",
        "|---:|---|---|---|---|---|",
    ]
    for xid, info in sorted(CATALOG.items()):
        ours, theirs = default_effect(xid), nvidia_effect(xid)
        mark = "" if ours.marks_unhealthy == theirs.marks_unhealthy else " **≠**"
        lines.append(
            f"| {xid} | {info.mnemonic or '—'} | {info.short_name} | {info.action} | {ours}{mark} | {theirs} |"
        )
    lines.append(
        f"| other, 999 | — | not in the catalog / unknown to NVML | {XidAction.UNKNOWN} | "
        f"{DEFAULT_EFFECT[XidAction.UNKNOWN]} | {XidEffect.UNHEALTHY} |"
    )
    return "\n".join(lines) + "\n"
