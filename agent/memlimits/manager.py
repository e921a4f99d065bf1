"""The memory-limits room: holds each container given sized devices to its size through the driver, on its worker.

On every ``ContainersChanged`` (a container started or went, the watcher's safety re-check, the start) and every
new plan the loop publishes (``plan_published``: a config resized a replica, so running containers get the new
size at once, not at the next re-check) the worker looks at the node again: the plan's sizes
(``agent.core.memlimits``), who holds which device (the kubelet's PodResources), which cgroup each holder has
(``containers``). For each container and GPU it reads the limits back
from the driver; where they are not the wanted ones it sets them, inside the ledger's critical section, and reads
them again. So a container is limited when it starts, a limit changed behind the agent's back is restored at the
next look, after an agent restart limits already in place are found and kept (read, not set again), and a limit no
size asks for any more (the config dropped the size) is lifted from the running container, as a resize is applied —
one an earlier agent set too, for a size dropped while no agent ran: the containers of unsized replicas are read
once each for limits left over (``_find_left_over``).

Where the driver cannot (an older driver, no root, a MIG device) the fallback is said once in the log and kept in
``report()`` for the status, per container and GPU; when that picture changes the worker posts ``LimitsChanged``
so the loop publishes it (``tessera status``, the Node Event of a fallback). The worker owns all of this state; the
loop and metrics read only the immutable ``snapshot``.

The loop hears what the room found (``LimitsReported``, after each look that changed it, and once at start from
a probe of every GPU: does the driver have the call at all): ``driver_report()`` is the loop's copy, which it
hands to the DRA front end so a claim's share says ``held by the driver`` exactly when the driver holds it
(``agent.core.memlimits.DriverReport``), and falls back — with the claim's Event — when the driver path does.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Hashable
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from msgspec import Struct

from agent.core.memlimits import (
    NO_LIMIT,
    ContainerRef,
    DriverReport,
    Enforcement,
    SizedDevice,
    Wanted,
    claim_sizes,
    enforcement,
    holds,
    sized_devices,
    unsized_holders,
    wanted_limits,
)
from agent.core.resources import ResourcePlan
from agent.gpu.memory_limits import MemoryLimitError, read_memory_limits, set_memory_limits
from agent.gpu.nvml import nvml_session
from agent.memlimits.containers import ContainerCgroups
from agent.memlimits.settings import MemoryLimitSettings
from agent.memlimits.watch import ContainerLogWatcher, ContainersChanged, LimitsChanged
from agent.news import NOTHING, STATUS, News

if TYPE_CHECKING:
    from agent.core.dra.checkpoint import Checkpoint
    from agent.core.inventory import Inventory
    from agent.plugin.podresources import PodAllocations

log = logging.getLogger(__name__)

RETRY_SECONDS = (0.2, 30.0)  # backoff of a look that failed (NVML or the kubelet did not answer)
# A read of a container's limits that answers for good: its cgroup is gone, or the driver has no limits to give
# (no call, or none on this GPU) — so nothing was ever set there. Any other failure is tried again.
SETTLED_READS = frozenset({"NOT_FOUND", "FUNCTION_NOT_FOUND", "NOT_SUPPORTED"})


class LimitsReported(Struct, frozen=True):
    """The room's news for the loop: where the driver holds containers now (after a look that changed it)."""

    report: DriverReport


class HeldLimit(Struct, frozen=True):
    """One container on one GPU: what it is held to, how, and where (its cgroups; none until it started)."""

    container: ContainerRef
    gpu_uuid: str
    gpu_index: int
    request: int  # bytes
    limit: int  # bytes
    enforcement: Enforcement
    reason: str
    cgroups: tuple[str, ...] = ()
    applied: bool = False  # the driver read back the wanted limits on every cgroup
    devices: tuple[str, ...] = ()
    claim: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "namespace": self.container.namespace,
            "pod": self.container.pod,
            "container": self.container.container,
            "claim": self.claim,
            "gpu": self.gpu_uuid,
            "gpu_index": self.gpu_index,
            "request_bytes": self.request,
            "limit_bytes": self.limit,
            "enforcement": str(self.enforcement),
            "reason": self.reason,
            "applied": self.applied,
            "cgroups": list(self.cgroups),
            "devices": list(self.devices),
        }


class MemoryLimits:
    def __init__(
        self,
        settings: MemoryLimitSettings,
        *,
        plan: Callable[[], ResourcePlan | None],
        holders: Callable[[], PodAllocations],
        section: Callable[[], contextlib.AbstractContextManager[None]],
        post: Callable[[object], None],
        claims: Callable[[], Checkpoint | None] = lambda: None,
        inventory: Callable[[], Inventory | None] = lambda: None,
    ) -> None:
        """``plan``: the plan in force; ``holders``: one PodResources List (devices and DRA claims' containers);
        ``section``: the ledger's critical section; ``post``: the reconcile loop's queue; ``claims``: the DRA front
        end's checkpoint (its prepared shares); ``inventory``: the node's GPUs (a claim device's GPU)."""
        self.settings = settings
        self._plan = plan
        self._holders = holders
        self._claims = claims
        self._inventory = inventory
        self._section = section
        self._containers = ContainerCgroups(settings.container_logs, settings.cgroup_root)
        self._watcher = ContainerLogWatcher(settings.container_logs, post, safety_interval=settings.recheck_seconds)
        self._dirty = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-limits", daemon=True)
        self._snapshot: tuple[HeldLimit, ...] = ()
        self._post = post
        self._published: ResourcePlan | None = None  # the plan of the last look the loop asked for
        self._set: dict[tuple[str, str], tuple[int, int]] = {}  # (GPU UUID, cgroup) -> what this agent set there
        self._looked: set[tuple[str, str]] = set()  # (GPU UUID, cgroup) of unsized devices read for left-over limits
        self._refusals: dict[str, str] = {}  # GPU UUID (or "*": every GPU) -> why the driver cannot limit there
        self._said: set[tuple[str, str]] = set()
        self._failures = 0
        self._recheck = False
        self._capable: set[str] = set()  # GPUs whose driver answered the call (worker's)
        self._probed: set[str] = set()
        self._reported = DriverReport()  # the last report posted (worker's)
        self._told = DriverReport()  # the loop's copy (``driver_report``)
        self.applied_total = 0  # limits set (new or repaired)
        self.repaired_total = 0  # limits found changed behind the agent's back and set again

    # ----- the loop's side ----------------------------------------------------------------------------------

    def probe(self) -> DriverReport:
        """Before the room starts (on the loop, at the agent's start): whether each GPU's driver has the call, so the
        first status already says what holds the DRA shares (one read per GPU)."""
        with nvml_session():
            self._probe()
        self._reported = self._told = self._report()
        return self._told

    def start(self) -> None:
        self._thread.start()
        self._watcher.start()

    def stop(self, timeout: float | None = 5.0) -> None:
        self._stopping.set()
        self._dirty.set()
        self._watcher.stop(timeout=5.0 if timeout is None else timeout)
        if self._thread.ident is not None:
            self._thread.join(timeout)

    def on_event(self, event: object, now: float) -> News:
        """``ContainersChanged``: the worker looks again (looks asked for meanwhile are one look)."""
        if isinstance(event, ContainersChanged):
            if event.reason == "re-check":
                self._recheck = True  # a refusal that may pass (NO_PERMISSION) is tried again
            self._dirty.set()
        if isinstance(event, LimitsChanged):
            return STATUS
        if isinstance(event, LimitsReported):
            self._told = event.report
            return STATUS  # a share's enforcement in the status (and its claim's Event) may have changed
        return NOTHING

    def plan_published(self, plan: ResourcePlan | None) -> None:
        """The loop published ``plan``: a new one (a config applied, the node read again) may size replicas anew,
        so the worker looks now and running containers are held to the new sizes at once."""
        if plan is not self._published:
            self._published = plan
            self._dirty.set()

    def driver_report(self) -> DriverReport:
        """The loop's copy of where the driver holds containers (for the DRA shares' status)."""
        return self._told

    def snapshot(self) -> tuple[HeldLimit, ...]:
        return self._snapshot

    def report(self) -> dict[str, Any]:
        """For the status: each container's limits and how they are enforced."""
        return {"containers": [held.to_json() for held in self._snapshot]}

    # ----- the worker --------------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            delay = None if not self._failures else min(RETRY_SECONDS[1], RETRY_SECONDS[0] * 2**self._failures)
            self._dirty.wait(delay)
            if self._stopping.is_set():
                return
            self._dirty.clear()
            if self._recheck:
                self._recheck = False
                self._refusals = {k: v for k, v in self._refusals.items() if k == "*"}
            try:
                retry = self._look()
            except Exception as error:  # a bug here must not end the worker: logged once, retried with backoff
                said = ("error", f"{type(error).__name__}: {error}")
                if said not in self._said:
                    self._said.add(said)
                    log.exception("memory limits: look failed; retrying")
                retry = True
            self._failures = min(self._failures + 1, 16) if retry else 0
            report = self._report()
            if report != self._reported:
                self._reported = report
                self._post(LimitsReported(report))

    def _report(self) -> DriverReport:
        claims: dict[tuple[str, str], list[Enforcement]] = {}
        for held in self._snapshot:
            for claim in held.claim.split(", ") if held.claim else ():
                claims.setdefault((claim, held.gpu_uuid), []).append(held.enforcement)
        return DriverReport(
            capable=frozenset(self._capable),
            refusals=MappingProxyType(dict(self._refusals)),
            claims=MappingProxyType({key: tuple(found) for key, found in claims.items()}),
        )

    def _probe(self) -> None:
        """Ask each GPU not asked yet whether its driver has the call (a read: no privilege needed); callers hold an
        NVML session. MIG-mode GPUs have no per-cgroup limits."""
        inventory = self._inventory()
        for gpu in inventory.gpus if inventory is not None else ():
            if gpu.uuid in self._probed:
                continue
            self._probed.add(gpu.uuid)
            if gpu.mig_enabled:
                continue
            try:
                read_memory_limits(gpu.uuid, str(self.settings.cgroup_root))
            except MemoryLimitError as error:
                if error.code == "FUNCTION_NOT_FOUND":
                    self._refusals["*"] = "the driver has no nvmlDeviceSetMemoryLimits_v1 (it needs r615 or newer)"
                    continue
                # any other answer about the root cgroup (which has no limits of its own) still shows the call is
                # there; whether it holds a container is learnt from the first set, said then with the claim's Event
            self._capable.add(gpu.uuid)

    def _look(self) -> bool:
        """Look at the node and hold every container to its size; True when something must be tried again."""
        inventory = self._inventory()
        if inventory is not None and any(g.uuid not in self._probed for g in inventory.gpus):
            with nvml_session():
                self._probe()  # GPUs that joined since
        plan = self._plan()
        sizes: dict[Hashable, SizedDevice] = dict(sized_devices(plan)) if plan is not None else {}
        sizes.update(claim_sizes(self._claims(), self._inventory()))
        wanted: list[Wanted] = []
        unsized: list[tuple[str, ContainerRef]] = []
        if sizes:
            try:
                answer = self._holders()
            except Exception as error:  # the kubelet does not answer: keep the last picture, look again later
                self._say("podresources", f"memory limits wait for PodResources error={error!r}", logging.WARNING)
                return True
            devices = [(d, ContainerRef(h.namespace, h.pod, h.container)) for d, h in answer.devices.items()]
            unsized = unsized_holders(plan, devices, sizes) if plan is not None else []
            holders: list[tuple[Hashable, ContainerRef]] = [(d, c) for d, c in devices if d in sizes]
            holders += [
                (key, ContainerRef(*name))
                for key, names in answer.claim_containers.items()
                if key in sizes
                for name in sorted(names)
            ]
            wanted = wanted_limits(sizes, holders)
        if not wanted and not self._set and not unsized:
            self._show(())
            return False
        cgroups = self._containers.scan()
        live = {c.cgroup for found in cgroups.values() for c in found}
        self._set = {key: value for key, value in self._set.items() if key[1] in live}
        self._looked = {key for key in self._looked if key[1] in live}
        held = {(want.gpu_uuid, c.cgroup) for want in wanted for c in cgroups.get(want.container, [])}
        left = [
            (gpu_uuid, c.cgroup)
            for gpu_uuid, container in unsized
            for c in cgroups.get(container, [])
            if (gpu_uuid, c.cgroup) not in held and (gpu_uuid, c.cgroup) not in self._set
        ]
        rows: list[HeldLimit] = []
        retry = False
        with nvml_session():
            retry = self._find_left_over(left)
            for gpu_uuid, cgroup in [key for key in self._set if key not in held]:
                retry = not self._lift(gpu_uuid, cgroup) or retry
            for want in wanted:
                row, failed = self._hold(want, [c.cgroup for c in cgroups.get(want.container, [])])
                rows.append(row)
                retry = retry or failed
        self._show(tuple(rows))
        return retry

    def _find_left_over(self, keys: list[tuple[str, str]]) -> bool:
        """Limits on containers of unsized devices, read once per container and GPU: found, they were set by an earlier
        agent for a size the config dropped while no agent ran (this one never set them), and are taken as this
        agent's, so that the lift that follows applies to them as to its own. True when a read failed and must be
        tried again (the next look, with the worker's backoff)."""
        retry = False
        for gpu_uuid, cgroup in keys:
            if (gpu_uuid, cgroup) in self._looked:
                continue
            try:
                read = read_memory_limits(gpu_uuid, cgroup)
            except MemoryLimitError as error:
                if error.code in SETTLED_READS:
                    self._looked.add((gpu_uuid, cgroup))
                else:
                    retry = True
                continue
            self._looked.add((gpu_uuid, cgroup))
            if (read.soft, read.hard) != (0, NO_LIMIT):
                self._set[(gpu_uuid, cgroup)] = (read.soft, read.hard)
                log.info(
                    "memory limit found that no size asks for (set before this agent started) gpu=%s cgroup=%s "
                    "soft=%d hard=%d; lifting it", gpu_uuid, cgroup, read.soft, read.hard,
                )  # fmt: skip
        return retry

    def _lift(self, gpu_uuid: str, cgroup: str) -> bool:
        """Lift a limit this agent set that no size asks for any more — the config dropped the size, or made the
        container's device an unsized one — as a resize is applied: at once, for the running container. False
        when the driver failed (tried again at the next look)."""
        try:
            with self._section():
                set_memory_limits(gpu_uuid, cgroup, 0, NO_LIMIT)
        except MemoryLimitError as error:
            if error.code != "NOT_FOUND":  # else the cgroup went meanwhile: nothing is left to lift
                self._say(f"lift/{gpu_uuid}/{error.code}", f"memory limit not lifted cgroup={cgroup} error={error}; "
                          "trying again", logging.WARNING)  # fmt: skip
                return False
        del self._set[(gpu_uuid, cgroup)]
        log.info("memory limit lifted: no size asks for it any more gpu=%s cgroup=%s", gpu_uuid, cgroup)
        return True

    def _hold(self, want: Wanted, cgroups: list[str]) -> tuple[HeldLimit, bool]:
        verdict = enforcement(want, driver_refusal=self._refusal(want))
        if verdict.enforcement is Enforcement.DRIVER:
            applied, failed = True, False
            for cgroup in cgroups:
                outcome = self._apply(want, cgroup)
                applied = applied and outcome is True
                failed = failed or outcome is None
            verdict = enforcement(want, driver_refusal=self._refusal(want))
            if verdict.enforcement is Enforcement.DRIVER:
                return self._row(want, verdict, cgroups, applied and bool(cgroups)), failed
        self._say(
            f"fallback/{want.container}/{want.gpu_uuid}/{verdict.enforcement}",
            f"memory limit not enforced by the driver container={want.container} gpu={want.gpu_uuid} "
            f"size={want.limit} enforcement={verdict.enforcement} reason={verdict.reason!r}",
            logging.WARNING,
        )
        return self._row(want, verdict, cgroups, False), False

    def _apply(self, want: Wanted, cgroup: str) -> bool | None:
        """Hold one cgroup to ``want``: True when the driver reads back the wanted limits, False when the driver
        cannot (a refusal recorded: the fallback holds), None when it failed and must be tried again."""
        try:
            read = read_memory_limits(want.gpu_uuid, cgroup)
            if holds(want, read.soft, read.hard):
                self._set[(want.gpu_uuid, cgroup)] = (read.soft, read.hard)  # found in place (a restart): kept
                return True
            ours = self._set.get((want.gpu_uuid, cgroup))
            found = (read.soft, read.hard)
            repaired = found != ours if ours is not None else found != (0, NO_LIMIT)  # else: new, or resized
            with self._section():
                set_memory_limits(want.gpu_uuid, cgroup, want.request, want.limit)
            read = read_memory_limits(want.gpu_uuid, cgroup)
        except MemoryLimitError as error:
            return self._refused(want, cgroup, error)
        self._set[(want.gpu_uuid, cgroup)] = (want.request, want.limit)
        self.applied_total += 1
        if repaired:
            self.repaired_total += 1
            log.warning(
                "memory limit was changed behind the agent's back; restored container=%s gpu=%s cgroup=%s "
                "request=%d limit=%d", want.container, want.gpu_uuid, cgroup, want.request, want.limit,
            )  # fmt: skip
        else:
            log.info(
                "memory limit applied container=%s gpu=%s cgroup=%s request=%d limit=%d",
                want.container, want.gpu_uuid, cgroup, want.request, want.limit,
            )  # fmt: skip
        return holds(want, read.soft, read.hard)

    def _refusal(self, want: Wanted) -> str | None:
        """Why the driver cannot hold ``want``: for every GPU, for its GPU, or for this container's size there."""
        refusals = self._refusals
        return refusals.get("*") or refusals.get(want.gpu_uuid) or refusals.get(f"{want.container}@{want.gpu_uuid}")

    def _refused(self, want: Wanted, cgroup: str, error: MemoryLimitError) -> bool | None:
        if error.code == "FUNCTION_NOT_FOUND":
            self._refusals["*"] = "the driver has no nvmlDeviceSetMemoryLimits_v1 (it needs r615 or newer)"
            return False
        if error.code == "NO_PERMISSION":
            self._refusals[want.gpu_uuid] = "the agent may not set memory limits (NVML_ERROR_NO_PERMISSION: not root)"
            return False
        if error.code == "NOT_SUPPORTED":
            self._refusals[want.gpu_uuid] = "the driver does not support memory limits on this GPU (NOT_SUPPORTED)"
            return False
        if error.code == "NOT_FOUND":
            return False  # the container's cgroup went meanwhile: the link's removal brings the next look
        if error.code == "INVALID_ARGUMENT":  # the size itself (above the GPU's memory): retrying cannot help
            self._refusals[f"{want.container}@{want.gpu_uuid}"] = (
                f"the driver refused {want.limit} bytes on this GPU (NVML_ERROR_INVALID_ARGUMENT)"
            )
            return False
        message = f"memory limit failed cgroup={cgroup} error={error}; trying again"
        self._say(f"nvml/{want.gpu_uuid}/{error.code}", message, logging.WARNING)
        return None

    @staticmethod
    def _row(want: Wanted, verdict: Any, cgroups: list[str], applied: bool) -> HeldLimit:
        return HeldLimit(
            container=want.container,
            gpu_uuid=want.gpu_uuid,
            gpu_index=want.gpu_index,
            request=want.request,
            limit=want.limit,
            enforcement=verdict.enforcement,
            reason=verdict.reason,
            cgroups=tuple(cgroups),
            applied=applied,
            devices=want.devices,
            claim=want.claim,
        )

    def _show(self, rows: tuple[HeldLimit, ...]) -> None:
        """The new picture, for metrics and the status; the loop hears of it only when it changed."""
        if rows != self._snapshot:
            self._snapshot = rows
            self._post(LimitsChanged())

    def _say(self, key: str, message: str, level: int) -> None:
        """Log once per key (a fallback or a failure is said when it starts, not at every look)."""
        if (key, message) not in self._said:
            self._said.add((key, message))
            log.log(level, "%s", message)
