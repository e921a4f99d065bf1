"""What an operator should hear about: the differences between two published agent statuses.

The agent publishes one status value after every change; :func:`announcements` compares the previous one with
the new one and says, in the terms ``kubectl describe node`` shows, what happened: a device went Unhealthy (the
XID and the catalog's action) or Healthy again, a config was applied or rejected, a MIG change is pending, was
applied or failed, an MPS daemon restarted or is failing, a GPU was cordoned, a DRA claim's share is held only
advisorily (an Event on the claim: ``kubectl describe resourceclaim`` shows it). Deriving the announcements from
the status (instead of calling a recorder from every handler) keeps them true to what the status says and
keeps the reconcile loop's handlers free of reporting code.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal, Protocol

from msgspec import Struct

from agent.core.health import Fault
from agent.core.inventory import Inventory

if TYPE_CHECKING:
    from agent.status import HeldLimitView

EventType = Literal["Normal", "Warning"]


class Announcement(Struct, frozen=True):
    """One Kubernetes Event's worth: ``reason`` is CamelCase (``GPUUnhealthy``), ``note`` the sentence."""

    type: EventType
    reason: str
    action: str
    note: str
    regarding: Mapping[str, str] | None = None  # another object than the Node (a ResourceClaim); None: the Node


class StatusView(Protocol):
    """The parts of the agent's status announcements are made from (``agent.status.AgentStatus``)."""

    @property
    def inventory(self) -> Inventory | None: ...
    @property
    def faults(self) -> Mapping[str, Fault]: ...
    @property
    def config_name(self) -> str | None: ...
    @property
    def config_digest(self) -> str | None: ...
    @property
    def config_error(self) -> str | None: ...
    @property
    def mig_state(self) -> str | None: ...
    @property
    def mig_error(self) -> str | None: ...
    @property
    def mps(self) -> Mapping[str, Mapping[str, object]]: ...
    @property
    def cordoned(self) -> Mapping[str, tuple[str, ...]]: ...
    @property
    def cordon_problems(self) -> tuple[str, ...]: ...
    @property
    def dra(self) -> Mapping[str, object] | None: ...
    @property
    def memory_limits(self) -> tuple[HeldLimitView, ...]: ...


def announcements(before: StatusView, after: StatusView) -> list[Announcement]:
    """Everything that changed from ``before`` to ``after`` and an operator must see, in order."""
    said: list[Announcement] = []
    said += _health(before, after)
    said += _config(before, after)
    said += _mig(before, after)
    said += _mps(before, after)
    said += _cordon(before, after)
    said += _shares(before, after)
    said += _memory_limits(before, after)
    return said


def _shares(before: StatusView, after: StatusView) -> list[Announcement]:
    """A claim's share whose limits its device's MPS server does not hold exactly (a larger share sets the ceiling,
    or nothing holds it): a Warning on the claim, each time what holds it changes."""
    if before.dra is after.dra:
        return []
    old = _share_notes(before.dra)
    said = []
    for (uid, namespace, name, device), note in sorted(_share_notes(after.dra).items()):
        if note is None or old.get((uid, namespace, name, device)) == note:
            continue
        regarding = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "namespace": namespace,
                     "name": name, "uid": uid}  # fmt: skip
        said.append(Announcement("Warning", "ShareLimitAdvisory", "PrepareShare", f"{device}: {note}", regarding))
    return said


def _share_notes(dra: Mapping[str, object] | None) -> dict[tuple[str, str, str, str], str | None]:
    """(claim uid, namespace, name, device) -> the enforcement note of an advisory share (None: held exactly)."""
    notes: dict[tuple[str, str, str, str], str | None] = {}
    claims = dra.get("claims") if dra else None
    for claim in claims if isinstance(claims, list) else ():
        namespace, _, name = str(claim.get("claim", "")).partition("/")
        for device in claim.get("devices") or ():
            held = device.get("enforcement")
            if isinstance(held, Mapping):
                key = (str(claim.get("uid")), namespace, name, str(device.get("device")))
                notes[key] = str(held.get("note")) if held.get("advisory") else None
    return notes


def _health(before: StatusView, after: StatusView) -> list[Announcement]:
    if before.faults is after.faults:
        return []
    said = []
    for unit, fault in sorted(after.faults.items()):
        previous = before.faults.get(unit)
        if previous is not None and (previous.reason, previous.lost) == (fault.reason, fault.lost):
            continue
        action = f"; the catalog says {fault.action}" if fault.action is not None else ""
        reason = "GPULost" if fault.lost else "GPUUnhealthy"
        said.append(
            Announcement(
                "Warning",
                reason,
                "MarkUnhealthy",
                f"{_name(unit, after.inventory)}: {fault.reason}{action}; its devices are Unhealthy until the driver "
                "shows it recovered",
            )
        )
    for unit, fault in sorted(before.faults.items()):
        if unit not in after.faults:
            said.append(
                Announcement(
                    "Normal",
                    "GPUHealthy",
                    "MarkHealthy",
                    f"{_name(unit, after.inventory)}: healthy again after {fault.reason}",
                )
            )
    return said


def _config(before: StatusView, after: StatusView) -> list[Announcement]:
    said = []
    if (after.config_name, after.config_digest) != (before.config_name, before.config_digest) and after.config_digest:
        name = after.config_name or "the defaults (no config applies)"
        said.append(
            Announcement(
                "Normal", "ConfigApplied", "ApplyConfig", f"sharing config {name} ({after.config_digest[:12]})"
            )
        )
    if after.config_error and after.config_error != before.config_error:
        kept = f"config {after.config_name} stays in force" if after.config_name else "the last good config stays"
        said.append(Announcement("Warning", "ConfigRejected", "ApplyConfig", f"{after.config_error}; {kept}"))
    return said


_MIG = {
    "pending": ("Normal", "MIGChangePending", "the MIG layout will change once nothing runs where it acts"),
    "applying": ("Normal", "MIGChangeApplying", "changing the MIG layout"),
    "success": ("Normal", "MIGChangeApplied", "the MIG layout is in place"),
    "failed": ("Warning", "MIGChangeFailed", "the MIG layout could not be applied"),
    "reset-required": ("Warning", "MIGResetRequired", "the MIG mode change waits for a GPU reset or a reboot"),
}


def _mig(before: StatusView, after: StatusView) -> list[Announcement]:
    if after.mig_state == before.mig_state or after.mig_state not in _MIG:
        return []
    type_, reason, note = _MIG[after.mig_state]
    detail = f": {after.mig_error}" if after.mig_error and type_ == "Warning" else ""
    return [Announcement(type_, reason, "ApplyMIGLayout", note + detail)]  # type: ignore[arg-type]


def _mps(before: StatusView, after: StatusView) -> list[Announcement]:
    said = []
    for key, daemon in sorted(after.mps.items()):
        previous = before.mps.get(key, {})
        restarts, error = daemon.get("restarts"), daemon.get("error")
        if isinstance(restarts, int) and restarts > int(previous.get("restarts") or 0):
            said.append(
                Announcement(
                    "Warning",
                    "MPSDaemonRestarted",
                    "RestartMPSDaemon",
                    f"MPS daemon {key} restarted ({restarts} in all): {error or 'it exited'}",
                )
            )
        elif error and error != previous.get("error") and daemon.get("state") != "draining":
            said.append(
                Announcement(
                    "Warning",
                    "MPSDaemonFailing",
                    "StartMPSDaemon",
                    f"MPS daemon {key} cannot start, retrying with backoff: {error}",
                )
            )
    return said


def _cordon(before: StatusView, after: StatusView) -> list[Announcement]:
    said = []
    for unit in sorted(after.cordoned.keys() - before.cordoned.keys()):
        by = ", ".join(after.cordoned[unit])
        said.append(
            Announcement(
                "Normal",
                "GPUCordoned",
                "Cordon",
                f"{_name(unit, after.inventory)} cordoned by {by}: "
                "its devices are Unhealthy, running pods are untouched",
            )
        )
    for unit in sorted(before.cordoned.keys() - after.cordoned.keys()):
        said.append(
            Announcement("Normal", "GPUUncordoned", "Uncordon", f"{_name(unit, after.inventory)}: cordon lifted")
        )
    for problem in after.cordon_problems:
        if problem not in before.cordon_problems:
            said.append(Announcement("Warning", "CordonEntryIgnored", "Cordon", problem))
    return said


def _fallbacks(status: StatusView) -> dict[tuple[str, str], set[str]]:
    """(enforcement, reason) -> the GPUs where a container's memory size is held by something else than the
    driver."""
    found: dict[tuple[str, str], set[str]] = {}
    for held in status.memory_limits:
        if str(held.enforcement) != "driver":
            found.setdefault((str(held.enforcement), held.reason), set()).add(held.gpu_uuid)
    return found


def _memory_limits(before: StatusView, after: StatusView) -> list[Announcement]:
    """A fallback from the driver's memory limits, once when it starts (not once per container it holds)."""
    if before.memory_limits is after.memory_limits:
        return []
    known = _fallbacks(before)
    said = []
    for (how, why), gpus in sorted(_fallbacks(after).items()):
        if (how, why) in known:
            continue
        where = ", ".join(_name(uuid, after.inventory) for uuid in sorted(gpus))
        holds = "the MPS server's per-client default" if how == "mps" else "nothing but the workload's goodwill"
        said.append(
            Announcement(
                "Warning",
                "MemoryLimitFallback",
                "LimitMemory",
                f"containers' GPU memory sizes on {where} are held by {holds} ({how}), not the driver: {why}",
            )
        )
    return said


def _name(unit: str, inventory: Inventory | None) -> str:
    """``GPU 3 (GPU-…)`` or ``MIG device 1g.10gb on GPU 3 (MIG-…)``: what an operator recognises."""
    for gpu in inventory.gpus if inventory else ():
        if gpu.uuid == unit:
            return f"GPU {gpu.index} ({unit})"
        for mig in gpu.mig_devices:
            if mig.uuid == unit:
                return f"MIG device {mig.profile} on GPU {gpu.index} ({unit})"
    return unit
