"""Device health, the reconcile loop's room for it: what the NVML watcher says, turned into device health.

The loop hands the keeper the watcher's events (``XidEvent``, ``WatchFailed``, ``GpuLost``,
``WatchRestored``) and its ticks; the keeper holds the ``HealthState`` and the policy, counts XIDs, checks
quiet faults for recovery on the driver's evidence and re-checks that every GPU still answers (a GPU can
fall off the bus without an event reaching us). Each step says what it asks of the loop (``News``):
publish, refresh the status, or read the node again for GPUs back from the bus. The keeper runs on the
loop's thread only; the state it holds is the loop's.

Two rules keep a device from looking Healthy while nobody could see it fail (``agent.core.health``):

- a GPU the watcher reports it cannot watch is Unhealthy until the watcher says it watches it again; no
  quiet period clears that;
- a lost GPU that answers again stays Unhealthy until the watcher has registered it for events again: the
  keeper tells the watcher (``gpu_back``) and waits for its ``WatchRestored``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from agent.core.health import (
    GPU_LOST_REASON,
    WATCH_FAILED_REASON,
    HealthPolicy,
    HealthState,
    XidEffect,
    awaiting_watch,
    due_for_probe,
    next_probe,
    probe_failed,
    probe_succeeded,
    record_fault,
    record_unwatched,
    record_xid,
    units_for_event,
    watch_restored,
    with_ecc_baseline,
)
from agent.core.inventory import Gpu, Inventory
from agent.gpu.health import Evidence, XidEvent, probe, read_ecc_uncorrected, recovery_evidence
from agent.news import News

log = logging.getLogger(__name__)


class Watcher(Protocol):
    """What the keeper asks of the NVML event watcher (``agent.gpu.health.NvmlEventWatcher``)."""

    def gpu_back(self, uuid: str) -> None: ...


class HealthKeeper:
    """Device health for the reconcile loop (see the module doc). ``clock`` stamps faults; ``liveness_seconds``
    is how often every GPU is asked whether it still answers."""

    def __init__(self, policy: HealthPolicy, *, liveness_seconds: float, clock: Callable[[], float]) -> None:
        self.state = HealthState()
        self.policy = policy  # the flags' policy with the config's health.xids (the loop replaces it on a reload)
        self.xid_counts: dict[tuple[str, str, str], int] = {}  # (GPU index, GPU UUID, XID) -> events
        self._clock = clock
        self._liveness_seconds = liveness_seconds
        self._next_liveness = 0.0
        self._told: Watcher | None = None  # the watcher last told which GPUs wait for its word

    def next_deadline(self) -> float:
        """When the keeper next has something to do: a liveness re-check or a quiet fault's recovery check."""
        due = next_probe(self.state, self.policy)
        return self._next_liveness if due is None else min(due, self._next_liveness)

    # ----- the watcher's events --------------------------------------------------------------------

    def on_xid(self, event: XidEvent, inventory: Inventory | None) -> list[str]:
        """Count the XID and judge it by NVIDIA's catalog (and the overrides): the units it makes Unhealthy, none
        for an application-level or ignored one (logged and counted only)."""
        gpu = inventory.gpu_by_uuid(event.gpu_uuid) if inventory else None
        key = (str(gpu.index) if gpu else "", event.gpu_uuid, str(event.xid))
        self.xid_counts[key] = self.xid_counts.get(key, 0) + 1
        verdict = self.policy.verdict(event.xid)
        if not verdict.marks_unhealthy:
            kind = "application XID" if verdict.effect is XidEffect.APPLICATION else "ignored XID"
            log.info("%s gpu=%s xid=%d reason=%r; the device stays Healthy", kind, event.gpu_uuid, event.xid,
                     verdict.reason)  # fmt: skip
            return []
        assert inventory is not None  # the loop reads the node before it starts the watcher
        units = units_for_event(inventory, event.gpu_uuid, event.gi_id, event.ci_id)
        self.state = record_xid(self.state, units, verdict, self._clock(), gpu_uuid=event.gpu_uuid)
        return units  # said by ``say_xid``, once the kubelet has been told

    def say_xid(self, event: XidEvent, units: Sequence[str]) -> None:
        """Log a critical XID (after the kubelet hears of it: formatting a log line costs a tenth of a ms)."""
        verdict = self.policy.verdict(event.xid)
        log.warning("critical XID gpu=%s xid=%d reason=%r effect=%s unhealthy=%s",
                    event.gpu_uuid, event.xid, verdict.reason, verdict.effect, ",".join(units))  # fmt: skip

    def take_ecc_baseline(self, event: XidEvent, units: Sequence[str]) -> bool:
        """Read what the recovery of an XID's units will be judged against (an NVML read, so the loop does it
        after telling the kubelet); False when there is nothing to read (a lost GPU does not answer)."""
        if self.policy.verdict(event.xid).lost:
            return False
        self.state = with_ecc_baseline(self.state, units, read_ecc_uncorrected(event.gpu_uuid))
        return True

    def on_watch_failed(self, units: Sequence[str], error: str) -> None:
        """The watcher cannot see these GPUs' events: Unhealthy until it says it sees them again."""
        log.error("GPU health cannot be watched gpus=%s error=%s", ",".join(units), error)
        self.state = record_unwatched(self.state, units, WATCH_FAILED_REASON.format(error=error), self._clock())

    def on_gpu_lost(self, uuid: str) -> None:
        fault = self.state.faults.get(uuid)
        if fault is None or not fault.lost:
            log.warning("GPU lost gpu=%s reason=%s", uuid, GPU_LOST_REASON)
        self.state = record_fault(self.state, [uuid], GPU_LOST_REASON, self._clock(), lost=True)

    def on_watch_restored(self, gpu_uuid: str) -> News:
        """The watcher sees the GPU again: a fault that waited only for that goes; an XID or a loss the evidence
        has not cleared yet stays."""
        before = self.state
        self.state = watch_restored(before, gpu_uuid)
        if self.state is before:
            return News()
        cleared = sorted(before.faults.keys() - self.state.faults.keys())
        log.info("GPU health watched again gpu=%s healthy_again=%s", gpu_uuid, ",".join(cleared) or "-")
        return News(publish=bool(cleared), status=True)

    def record_lost(self, uuids: Sequence[str]) -> None:
        """GPUs found lost without the watcher saying so (a read of the node, the liveness re-check)."""
        if uuids:
            log.warning("GPU lost gpus=%s", ",".join(uuids))
            self.state = record_fault(self.state, uuids, GPU_LOST_REASON, self._clock(), lost=True)

    # ----- the clock -------------------------------------------------------------------------------

    def probe(self, now: float, gpus: Sequence[Gpu], watcher: Watcher | None) -> News:
        """Faulty units quiet for long enough are checked for recovery: only on evidence (the recovery action,
        pending remaps and retirements, ECC growth, the device answering) is the cause cleared, and a GPU back
        from the bus stays Unhealthy until ``watcher`` says it watches it again."""
        self._tell(watcher)
        publish = False
        back: set[str] = set()
        checked = due_for_probe(self.state, self.policy, now)
        for unit in checked:
            fault = self.state.faults[unit]
            evidence = self._evidence(unit, fault.ecc_baseline, gpus)
            if evidence is None or evidence.ok:
                self.state = probe_succeeded(self.state, unit)
                waiting = self.state.faults.get(unit)
                if waiting is None:
                    log.info("recovered unit=%s after=%r", unit, fault.reason)
                else:
                    log.info("recovered unit=%s after=%r; Unhealthy until watched reason=%r", unit, fault.reason,
                             waiting.reason)  # fmt: skip
                publish = True
                if fault.lost:
                    gpu = fault.gpu_uuid or unit
                    back.add(gpu)
                    if watcher is not None:
                        watcher.gpu_back(gpu)  # its WatchRestored, once it is registered again, ends the wait
            else:
                if evidence.reasons != fault.blockers:
                    log.info("still unhealthy unit=%s after=%r blockers=%r", unit, fault.reason,
                             "; ".join(evidence.reasons))  # fmt: skip
                self.state = probe_failed(
                    self.state, unit, now, blockers=evidence.reasons, ecc_baseline=evidence.ecc_uncorrected
                )
        return News(reread="GPU back" if back else None, stale=frozenset(back), publish=publish, status=bool(checked))

    def liveness_due(self, now: float) -> bool:
        """Is the liveness re-check due (then it is scheduled next ``liveness_seconds`` on)?"""
        if now < self._next_liveness:
            return False
        self._next_liveness = now + self._liveness_seconds
        return True

    def find_lost(self, gpus: Iterable[Gpu]) -> bool:
        """Ask every GPU not already known lost whether it answers: what no event reaches us for (a GPU off the
        bus that the watcher cannot see, or whose event was missed). True if one was found lost."""
        lost = [g.uuid for g in gpus if not self._known_lost(g.uuid) and _probe(g.uuid) == "GPU_IS_LOST"]
        self.record_lost(lost)
        return bool(lost)

    # ----- helpers ---------------------------------------------------------------------------------

    def _known_lost(self, uuid: str) -> bool:
        fault = self.state.faults.get(uuid)
        return fault is not None and fault.lost

    def _tell(self, watcher: Watcher | None) -> None:
        """A watcher that was replaced (its thread died) knows nothing of what its predecessor reported: tell the
        new one which GPUs wait for its word, so it says when it watches them."""
        if watcher is None or watcher is self._told:
            return
        if self._told is not None:
            for gpu in dict.fromkeys(self.state.faults[u].gpu_uuid or u for u in awaiting_watch(self.state)):
                watcher.gpu_back(gpu)
        self._told = watcher

    def _evidence(self, unit: str, ecc_baseline: int | None, gpus: Sequence[Gpu]) -> Evidence | None:
        """The recovery evidence for a unit; None when the unit (a MIG device) no longer exists."""
        if not unit.startswith("MIG-"):
            return recovery_evidence(unit, ecc_baseline=ecc_baseline)  # asked even when absent from the inventory
        for gpu in gpus:
            if any(m.uuid == unit for m in gpu.mig_devices):
                return recovery_evidence(gpu.uuid, unit, ecc_baseline=ecc_baseline)
        return None


def _probe(gpu_uuid: str) -> str | None:
    """``probe`` that never raises: NVML that cannot even initialise is an answer too (the error name)."""
    try:
        return probe(gpu_uuid)
    except Exception as error:  # NvmlUnavailable and kin
        return type(error).__name__
