"""The MPS manager: keeps one control daemon per MPS daemon spec running, limited and supervised.

It belongs to the reconcile loop: ``reconcile`` and ``tick`` run on the loop's thread and only look at
state; the slow work (setting compute modes, starting a daemon, sending its limits, quitting it) runs on
a small worker pool whose results come back as events (``MpsDaemonReady``, ``MpsDaemonFailed``,
``MpsDaemonStopped``) through ``post``. So the loop never blocks on a daemon, and no state is shared.

- Start: compute mode EXCLUSIVE_PROCESS on the daemon's devices, then ``-d`` with the limits already in
  its environment, then the limits again as daemon defaults, then a readiness command that must answer.
  Only then is the resource advertised; so no client can connect before its limits are in place.
- Supervision: a dead daemon is noticed the moment it exits (a pidfd per daemon, ``agent.mps.exits``; a
  slow safety re-check where pidfds are not available); its devices turn Unhealthy; it is restarted with
  backoff (0.5 s doubling to 30 s), and a daemon that keeps failing is reported with the last lines of its
  control log once per streak, not in a hot loop.
- An agent restart adopts a daemon that still answers on its pipe instead of killing its clients' server;
  stopping the agent leaves daemons running. Where the daemon runs decides whether it outlives the agent's
  container: with a keeper (``keeper``, ``agent.mps.keeper``) ``-d`` runs in the keeper's container and the
  daemon survives an agent restart or upgrade; without one it runs in the agent's and ends with it.
- A DRA daemon serving shares of a device (``agent.core.dra.mps``) whose limits change (a share came or went) is not
  restarted: the new limits are set on it — as defaults for servers to come and on each running server for its new
  clients — and it reports ready once they are in place (state ``limiting`` until then), so a Prepare waiting on it
  returns only when the server holds the new share. Clients already running keep the limits they started with.
- Retiring a daemon (its resource went away, or its spec changed) never pulls the server from under a
  client: its devices are withdrawn from ListAndWatch first (``withdrawn``), then a worker waits until the
  kubelet holds none of their replicas and NVML lists no compute process or MPS client on them — unknown
  counts as busy — and only then sends ``quit`` and sets DEFAULT compute mode (left EXCLUSIVE_PROCESS when a
  successor daemon takes the devices). A successor on the same devices starts once its predecessor is gone.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from msgspec import Struct

from agent.core.ledger import Drain
from agent.core.mps import MpsDaemonSpec
from agent.gpu.compute_mode import DEFAULT, EXCLUSIVE_PROCESS, ComputeModeError, set_compute_mode
from agent.mps.control import (
    READINESS_COMMAND,
    MpsControl,
    MpsError,
    control_for,
    pinned_limit_command,
    server_limit_commands,
    thread_percentage_command,
)
from agent.mps.exits import ProcessExited, ProcessExitWatcher
from agent.news import NOTHING, PUBLISH, STATUS, News
from agent.supervise import WorkerCrashed, submit

if TYPE_CHECKING:
    from agent.ledger import DeviceLedger

log = logging.getLogger(__name__)

BINARY = "nvidia-cuda-mps-control"
MAX_BACKOFF = 30.0
DRAIN_CHECK_INTERVAL = 1.0  # how often a retiring daemon looks again whether its clients are gone
SAFETY_CHECK_INTERVAL = 30.0  # a missed exit (no pidfd) is found by this slow re-check


class MpsDaemonReady(Struct, frozen=True):
    key: str
    generation: int
    pid: int | None
    adopted: bool


class MpsDaemonFailed(Struct, frozen=True):
    key: str
    generation: int
    error: str


class MpsDaemonStopped(Struct, frozen=True):
    key: str


class MpsDrainChecked(Struct, frozen=True):
    """A retiring daemon's devices are still in use (``busy`` says by what): nothing was done."""

    key: str
    busy: tuple[str, ...]


class _Daemon(Struct):
    spec: MpsDaemonSpec
    control: MpsControl | None
    generation: int = 0  # bumped per start attempt, so a late result of an old attempt is ignored
    state: str = "pending"  # pending | starting | limiting | ready | down
    applying: MpsDaemonSpec | None = None  # the spec whose limits the job in flight sets
    applied: MpsDaemonSpec | None = None  # the spec whose limits the daemon holds (its last good job's)
    ready_once: bool = False
    attempts: int = 0
    next_attempt: float = 0.0
    last_error: str | None = None
    restarts: int = 0
    pid: int | None = None  # the daemon's PID once ready


class _Retiring(Struct):
    """A daemon on its way out: withdrawn, waiting for its clients to be gone before it is quit."""

    spec: MpsDaemonSpec
    control: MpsControl | None
    next_check: float = 0.0
    in_flight: bool = False
    waiting_for: tuple[str, ...] = ()
    failures: int = 0


class MpsManager:
    def __init__(
        self,
        binary: str | None,
        post: Callable[[object], None],
        ledger: DeviceLedger,
        keeper: Path | None = None,
    ) -> None:
        self._binary = binary
        self._keeper = keeper  # the MPS keeper's socket: daemons are started in its container (agent.mps.keeper)
        self._post = post
        self._ledger = ledger  # who holds each device; a daemon quits in its critical section
        self._daemons: dict[str, _Daemon] = {}
        self._retiring: dict[str, _Retiring] = {}
        self._root: Path | None = None
        # One worker: jobs run in the order they were asked for, so a daemon's tear-down (compute mode back
        # to DEFAULT) never overtakes the start of its successor on the same devices.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mps")
        self._exits: ProcessExitWatcher | None = None  # started with the first daemon
        self._next_safety_check = 0.0

    # ----- the loop's view ------------------------------------------------------------------------

    def reconcile(self, specs: Iterable[MpsDaemonSpec], root: Path, now: float) -> None:
        wanted = {spec.key: spec for spec in specs}
        if root != self._root:
            for key in list(self._daemons):  # a new root: every daemon lives somewhere else now
                self._retire(key, now)
            self._root = root
        for key in list(self._daemons):
            if (
                key in wanted
                and wanted[key] != self._daemons[key].spec
                and _limits_only(self._daemons[key].spec, wanted[key])
            ):
                self._limit(key, self._daemons[key], wanted[key], root)
            elif key not in wanted or wanted[key] != self._daemons[key].spec:
                self._retire(key, now)
        for key, spec in wanted.items():
            if key not in self._daemons:
                self._daemons[key] = _Daemon(spec, self._control(spec, root), next_attempt=now)
        if wanted:
            (root / "shm").mkdir(parents=True, exist_ok=True)

    def _limit(self, key: str, daemon: _Daemon, spec: MpsDaemonSpec, root: Path) -> None:
        """New limits for a running DRA daemon: set on it (a job), not a restart; a start in flight sets them after."""
        daemon.spec = spec
        daemon.control = self._control(spec, root)  # a restart after a crash starts with these in its environment
        log.info("MPS daemon limits change key=%s threads=%s pinned=%s", key, spec.active_thread_percentage,
                 ",".join(f"{u}={m}M" for u, m in spec.pinned_memory_mib) or "-")  # fmt: skip
        if daemon.state == "ready":
            self._submit_limits(key, daemon)

    def _submit_limits(self, key: str, daemon: _Daemon) -> None:
        daemon.generation += 1
        daemon.state, daemon.applying = "limiting", daemon.spec
        if daemon.control is None:
            self._post(MpsDaemonFailed(key, daemon.generation, "no control for the daemon"))
            return
        submit(
            self._pool, self._post, "mps", key, self._set_limits, key, daemon.generation, daemon.spec, daemon.control
        )

    def next_deadline(self) -> float | None:
        """When ``tick`` has something to do next (None: nothing until an event)."""
        daemons = self._daemons.values()
        due = [d.next_attempt for d in daemons if d.state in ("pending", "down") and not self._blocked(d)]
        due += [r.next_check for r in self._retiring.values() if not r.in_flight]
        if any(d.state == "ready" for d in self._daemons.values()):
            due.append(self._next_safety_check)
        return min(due, default=None)

    def on_exited(self, event: ProcessExited, now: float) -> bool:
        """A daemon's process ended: its devices turn Unhealthy and it is started again."""
        daemon = self._daemons.get(event.key)
        if daemon is None or daemon.state not in ("ready", "limiting") or daemon.pid != event.pid:
            return False
        self._died(event.key, daemon, now)
        return True

    def _died(self, key: str, daemon: _Daemon, now: float) -> None:
        daemon.state, daemon.restarts, daemon.pid = "down", daemon.restarts + 1, None
        daemon.next_attempt = now  # the first restart is immediate; repeated failures back off
        tail = " | ".join(daemon.control.log_tail(3)) if daemon.control else ""
        log.warning("MPS daemon died key=%s restarts=%d control_log=%r", key, daemon.restarts, tail)

    def tick(self, now: float) -> bool:
        """Start due daemons and retirements; True when some device's availability changed."""
        changed = False
        if now >= self._next_safety_check:  # the slow re-check for an exit no pidfd reported
            self._next_safety_check = now + SAFETY_CHECK_INTERVAL
            for key, daemon in self._daemons.items():
                if daemon.state == "ready" and daemon.control is not None and daemon.control.pid() is None:
                    self._died(key, daemon, now)
                    changed = True
        for key, daemon in self._daemons.items():
            if daemon.state in ("pending", "down") and now >= daemon.next_attempt and not self._blocked(daemon):
                self._start(key, daemon)
        for key, retiring in self._retiring.items():
            if not retiring.in_flight and now >= retiring.next_check:
                retiring.in_flight = True
                keep = self._successor_devices(retiring.spec)
                if submit(self._pool, self._post, "mps", key, self._drain_and_stop, key, retiring, keep) is None:
                    retiring.in_flight = False
        return changed

    def on_drain_checked(self, event: MpsDrainChecked, now: float) -> None:
        retiring = self._retiring.get(event.key)
        if retiring is None:
            return
        if event.busy != retiring.waiting_for:
            log.info("MPS daemon change waits for its clients key=%s waiting_for=%r", event.key, "; ".join(event.busy))
        retiring.in_flight, retiring.waiting_for = False, event.busy
        retiring.next_check = now + DRAIN_CHECK_INTERVAL

    def on_stopped(self, event: MpsDaemonStopped) -> bool:
        """The retired daemon is gone: its devices may be advertised again (by a successor)."""
        return self._retiring.pop(event.key, None) is not None

    def on_event(self, event: object, now: float) -> News:
        """A daemon ready, failed, exited or stopped; a retiring daemon's devices still in use."""
        match event:
            case MpsDaemonReady():
                return News(publish=True, dra_mps=True) if self.on_ready(event) else NOTHING
            case MpsDaemonFailed():
                return News(publish=True, dra_mps=True) if self.on_failed(event, now) else NOTHING
            case ProcessExited():
                return PUBLISH if self.on_exited(event, now) else NOTHING
            case MpsDaemonStopped():
                return PUBLISH if self.on_stopped(event) else NOTHING
            case MpsDrainChecked():
                self.on_drain_checked(event, now)
                return STATUS
        return NOTHING

    def on_crashed(self, event: WorkerCrashed, now: float) -> bool:
        """A worker job raised past its guard: a retiring daemon checks again later, a starting one failed."""
        log.debug("MPS worker traceback:\n%s", event.traceback)
        retiring = self._retiring.get(event.key)
        if retiring is not None:
            retiring.in_flight, retiring.failures = False, retiring.failures + 1
            retiring.next_check = now + min(MAX_BACKOFF, DRAIN_CHECK_INTERVAL * 2**retiring.failures)
            log.error("MPS daemon retirement failed key=%s error=%r; trying again", event.key, event.error)
            return False
        daemon = self._daemons.get(event.key)
        if daemon is None or daemon.state not in ("starting", "limiting"):
            return False
        return self.on_failed(MpsDaemonFailed(event.key, daemon.generation, event.error), now)

    def withdrawn(self) -> frozenset[str]:
        """Physical devices of retiring daemons: not advertised (by any resource) until the daemon is gone."""
        return frozenset().union(*(r.spec.physical_ids for r in self._retiring.values()))

    def waiting_for(self) -> dict[str, tuple[str, ...]]:
        return {key: r.waiting_for for key, r in self._retiring.items() if r.waiting_for}

    def _blocked(self, daemon: _Daemon) -> bool:
        """A daemon waits while a retiring one has its key (its pipe directory) or any of its devices."""
        return any(
            key == daemon.spec.key or retiring.spec.physical_ids & daemon.spec.physical_ids
            for key, retiring in self._retiring.items()
        )

    def _successor_devices(self, spec: MpsDaemonSpec) -> frozenset[str]:
        return frozenset().union(*(d.spec.physical_ids for d in self._daemons.values())) & spec.physical_ids

    def on_ready(self, event: MpsDaemonReady) -> bool:
        daemon = self._daemons.get(event.key)
        if daemon is None or event.generation != daemon.generation:
            return False
        daemon.state, daemon.ready_once, daemon.attempts, daemon.last_error = "ready", True, 0, None
        daemon.pid = event.pid
        daemon.applied = daemon.applying
        if daemon.applying is not None and daemon.applying != daemon.spec:  # the limits changed while it started
            self._submit_limits(event.key, daemon)
        log.info("MPS daemon ready key=%s pid=%s adopted=%s", event.key, event.pid, event.adopted)
        if event.pid is not None:
            if self._exits is None:
                self._exits = ProcessExitWatcher(self._post)
            self._exits.watch(event.key, event.pid)
        return True

    def on_failed(self, event: MpsDaemonFailed, now: float) -> bool:
        daemon = self._daemons.get(event.key)
        if daemon is None or event.generation != daemon.generation:
            return False
        daemon.state, daemon.attempts = "down", daemon.attempts + 1
        backoff = min(MAX_BACKOFF, 0.5 * 2 ** (daemon.attempts - 1))
        daemon.next_attempt = now + backoff
        if event.error != daemon.last_error or daemon.attempts in (5, 10, 20):
            log.error(
                "MPS daemon failed key=%s attempt=%d retry_in=%.1fs error=%r",
                event.key, daemon.attempts, backoff, event.error,
            )  # fmt: skip
        daemon.last_error = event.error
        return True

    def unavailable(self) -> frozenset[str]:
        """Physical devices whose daemon is not ready: their replicas are Unhealthy."""
        down: set[str] = set()
        for daemon in self._daemons.values():
            if daemon.state not in ("ready", "limiting"):  # limiting: it serves, new limits on their way
                down |= daemon.spec.physical_ids
        return frozenset(down)

    def advertised(self, resource: str) -> bool:
        """A resource is advertised once each of its daemons has been ready (limits in place) at least once."""
        daemons = [d for d in self._daemons.values() if d.spec.resource == resource]
        return all(d.ready_once for d in daemons)

    def status(self) -> dict[str, dict[str, object]]:
        status: dict[str, dict[str, object]] = {
            key: {
                "state": d.state,
                "restarts": d.restarts,
                "error": d.last_error,
                "resource": d.spec.resource,
                "limits": d.applied.limits if d.applied is not None else None,
            }
            for key, d in self._daemons.items()
        }
        for key, r in self._retiring.items():
            status[f"{key} (retiring)"] = {
                "state": "draining",
                "restarts": 0,
                "error": "; ".join(r.waiting_for) or None,
                "resource": r.spec.resource,
            }
        return status

    def shutdown(self, wait: bool = True) -> None:
        """The agent stops; daemons keep serving their clients and are adopted by the next agent (which sets their
        limits again). ``wait=False`` (a process that exits next) does not wait for a daemon being started."""
        self._pool.shutdown(wait=wait, cancel_futures=True)
        if self._exits is not None:
            self._exits.stop()

    # ----- the work -------------------------------------------------------------------------------

    def _control(self, spec: MpsDaemonSpec, root: Path) -> MpsControl | None:
        try:
            return control_for(self._resolve_binary(), root, spec)
        except (MpsError, ValueError) as error:
            log.error("cannot manage MPS daemon key=%s error=%r", spec.key, str(error))
            return None

    def _resolve_binary(self) -> str:
        found = shutil.which(self._binary or BINARY)
        if found is None:
            raise MpsError(
                f"{self._binary or BINARY} not found; MPS needs the driver's nvidia-cuda-mps-control on PATH "
                "(NVIDIA container runtime) or --mps-control pointing at it"
            )
        return found

    def _start(self, key: str, daemon: _Daemon) -> None:
        daemon.generation += 1
        daemon.state = "starting"
        assert self._root is not None
        if daemon.control is None:
            try:
                daemon.control = control_for(self._resolve_binary(), self._root, daemon.spec)
            except (MpsError, ValueError) as error:
                self._post(MpsDaemonFailed(key, daemon.generation, str(error)))
                return
        daemon.applying = daemon.spec
        job = (key, daemon.generation, daemon.spec, daemon.control, self._root)
        submit(self._pool, self._post, "mps", key, self._bring_up, *job)

    def _bring_up(self, key: str, generation: int, spec: MpsDaemonSpec, control: MpsControl, root: Path) -> None:
        """Worker thread: adopt a daemon that answers, else start one; then limits; then readiness."""
        try:
            adopted = control.pid() is not None and control.answers()
            if not adopted:
                with self._ledger.section():  # a compute-mode change, as every mutating step, in the ledger's section
                    for uuid in spec.visible_devices:
                        _compute_mode(uuid, EXCLUSIVE_PROCESS)
                if self._keeper is None:
                    control.start()  # in this container: the daemon ends when it does
                else:  # in the keeper's container: the daemon outlives this one
                    from agent.mps.keeper import start_through_keeper  # only with a keeper, not on every start

                    start_through_keeper(self._keeper, root, spec)
            commands = [thread_percentage_command(spec.active_thread_percentage)]
            commands += [pinned_limit_command(uuid, mib) for uuid, mib in spec.pinned_memory_mib]
            if adopted and _limits_only(spec, spec):  # a DRA daemon's running servers: limits set on them too
                for server in sorted(_server_pids(control)):
                    commands += server_limit_commands(server, spec.pinned_memory_mib, spec.active_thread_percentage)
            control.commands(commands)
            reply = control.commands([READINESS_COMMAND])
            if not reply or float(reply[-1]) != float(spec.active_thread_percentage):
                raise MpsError(f"the daemon reports {reply!r} for {READINESS_COMMAND}")
            self._post(MpsDaemonReady(key, generation, control.pid(), adopted))
        except Exception as error:  # MpsError, OSError, NVML gone ...: a failed attempt, retried with backoff
            self._post(MpsDaemonFailed(key, generation, str(error) or type(error).__name__))

    def _set_limits(self, key: str, generation: int, spec: MpsDaemonSpec, control: MpsControl) -> None:
        """Worker thread: a running daemon's new limits, as defaults (servers to come) and on each running server
        (its new clients); then readiness."""
        try:
            commands = [thread_percentage_command(spec.active_thread_percentage)]
            commands += [pinned_limit_command(uuid, mib) for uuid, mib in spec.pinned_memory_mib]
            servers = sorted(_server_pids(control))
            for server in servers:
                commands += server_limit_commands(server, spec.pinned_memory_mib, spec.active_thread_percentage)
            replies = control.commands(commands)
            refused = [line for line in replies if line.strip() and not _is_number(line) and "not found" not in line]
            if refused:
                raise MpsError(f"the daemon refused the new limits: {'; '.join(refused)}")
            reply = control.commands([READINESS_COMMAND])
            if not reply or float(reply[-1]) != float(spec.active_thread_percentage):
                raise MpsError(f"the daemon reports {reply!r} for {READINESS_COMMAND}")
            log.info("MPS daemon limits set key=%s servers=%s", key, ",".join(map(str, servers)) or "-")
            self._post(MpsDaemonReady(key, generation, control.pid(), True))
        except Exception as error:  # as a failed start: the daemon is started (adopted) again, limits and all
            self._post(MpsDaemonFailed(key, generation, str(error) or type(error).__name__))

    def _retire(self, key: str, now: float) -> None:
        daemon = self._daemons.pop(key)
        if self._exits is not None:
            self._exits.forget(key)  # its quit is not a death to restart from
        previous = self._retiring.get(key)
        if previous is not None:  # still retiring an older one under this key: that one goes first
            return
        self._retiring[key] = _Retiring(daemon.spec, daemon.control, next_check=now)
        log.info("MPS daemon retiring key=%s; its devices are withdrawn until its clients are gone", key)

    def _drain_and_stop(self, key: str, retiring: _Retiring, keep_exclusive: frozenset[str]) -> None:
        """Worker: quit the daemon only when nothing uses its devices; else report what does."""
        drain = Drain(retiring.spec.physical_ids, retiring.spec.physical_ids)
        pids = _server_pids(retiring.control)
        with self._ledger.acting(drain, exclude_pids=pids, for_daemon=key) as busy:
            if busy:
                self._post(MpsDrainChecked(key, tuple(busy)))
                return
            control = retiring.control
            try:
                if control is not None and control.pid() is not None:
                    control.quit()
            except MpsError as error:
                log.warning("MPS daemon did not quit cleanly key=%s error=%r", key, str(error))
            for uuid in retiring.spec.visible_devices:
                if uuid not in keep_exclusive:
                    _compute_mode(uuid, DEFAULT)
        log.info("MPS daemon stopped key=%s", key)
        self._post(MpsDaemonStopped(key))


def _limits_only(old: MpsDaemonSpec, new: MpsDaemonSpec) -> bool:
    """The same DRA daemon with other limits (shares came or went): set on it, not a restart."""
    from agent.core.dra.mps import RESOURCE

    return (old.key, old.resource, old.visible_devices) == (new.key, new.resource, new.visible_devices) and (
        old.resource == RESOURCE
    )


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _server_pids(control: MpsControl | None) -> frozenset[int]:
    """The daemon's own MPS servers: a real driver lists a server among its GPUs' compute processes, but it is
    the daemon's, not a workload (clients are listed on their own). None when the daemon does not say."""
    if control is None:
        return frozenset()
    try:
        return frozenset(int(line) for line in control.commands(["get_server_list"]) if line.strip().isdigit())
    except MpsError:
        return frozenset()


def _compute_mode(uuid: str, mode: int) -> None:
    try:
        set_compute_mode(uuid, mode)
    except ComputeModeError as error:
        log.warning("%s; MPS still works, with less isolation", error)
