"""The MPS manager: keeps one control daemon per MPS daemon spec running, limited and supervised.

It belongs to the reconcile loop: ``reconcile`` and ``tick`` run on the loop's thread and only look at
state; the slow work (setting compute modes, starting a daemon, sending its limits, quitting it) runs on
a small worker pool whose results come back as events (``MpsDaemonReady``, ``MpsDaemonFailed``,
``MpsDaemonStopped``) through ``post``. So the loop never blocks on a daemon, and no state is shared.

- Start: compute mode EXCLUSIVE_PROCESS on the daemon's devices, then ``-d`` with the limits already in
  its environment, then the limits again as daemon defaults, then a readiness command that must answer.
  Only then is the resource advertised; so no client can connect before its limits are in place.
- Supervision: a dead daemon (its PID gone) is noticed at the next tick (0.1 s); its devices turn
  Unhealthy; it is restarted with backoff (0.5 s doubling to 30 s), and a daemon that keeps failing is
  reported with the last lines of its control log once per streak, not in a hot loop.
- An agent restart adopts a daemon that still answers on its pipe instead of killing its clients' server;
  stopping the agent leaves daemons running. A resource that goes away gets ``quit`` and DEFAULT compute mode.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from agent.core.mps import MpsDaemonSpec
from agent.gpu.compute_mode import DEFAULT, EXCLUSIVE_PROCESS, ComputeModeError, set_compute_mode
from agent.mps.control import MpsControl, MpsError, pinned_limit_command, thread_percentage_command

log = logging.getLogger(__name__)

BINARY = "nvidia-cuda-mps-control"
READINESS_COMMAND = "get_default_active_thread_percentage"
MAX_BACKOFF = 30.0


@dataclass(frozen=True, slots=True)
class MpsDaemonReady:
    key: str
    generation: int
    pid: int | None
    adopted: bool


@dataclass(frozen=True, slots=True)
class MpsDaemonFailed:
    key: str
    generation: int
    error: str


@dataclass(frozen=True, slots=True)
class MpsDaemonStopped:
    key: str


@dataclass
class _Daemon:
    spec: MpsDaemonSpec
    control: MpsControl | None
    generation: int = 0  # bumped per start attempt, so a late result of an old attempt is ignored
    state: str = "pending"  # pending | starting | ready | down
    ready_once: bool = False
    attempts: int = 0
    next_attempt: float = 0.0
    last_error: str | None = None
    restarts: int = 0


class MpsManager:
    def __init__(self, binary: str | None, post: Callable[[object], None]) -> None:
        self._binary = binary
        self._post = post
        self._daemons: dict[str, _Daemon] = {}
        self._root: Path | None = None
        # One worker: jobs run in the order they were asked for, so a daemon's tear-down (compute mode back
        # to DEFAULT) never overtakes the start of its successor on the same devices.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mps")

    # ----- the loop's view ------------------------------------------------------------------------

    def reconcile(self, specs: Iterable[MpsDaemonSpec], root: Path, now: float) -> None:
        wanted = {spec.key: spec for spec in specs}
        if root != self._root:
            for key in list(self._daemons):  # a new root: every daemon lives somewhere else now
                self._stop(key)
            self._root = root
        for key in list(self._daemons):
            if key not in wanted or wanted[key] != self._daemons[key].spec:
                self._stop(key)
        for key, spec in wanted.items():
            if key not in self._daemons:
                self._daemons[key] = _Daemon(spec, self._control(spec, root), next_attempt=now)
        if wanted:
            (root / "shm").mkdir(parents=True, exist_ok=True)

    def tick(self, now: float) -> bool:
        """Notice dead daemons, start due ones; True when some device's availability changed."""
        changed = False
        for key, daemon in self._daemons.items():
            if daemon.state == "ready" and daemon.control is not None and daemon.control.pid() is None:
                daemon.state, daemon.restarts = "down", daemon.restarts + 1
                daemon.next_attempt = now  # the first restart is immediate; repeated failures back off
                log.warning(
                    "MPS daemon died key=%s restarts=%d control_log=%r",
                    key, daemon.restarts, " | ".join(daemon.control.log_tail(3)),
                )  # fmt: skip
                changed = True
            if daemon.state in ("pending", "down") and now >= daemon.next_attempt:
                self._start(key, daemon)
        return changed

    def on_ready(self, event: MpsDaemonReady) -> bool:
        daemon = self._daemons.get(event.key)
        if daemon is None or event.generation != daemon.generation:
            return False
        daemon.state, daemon.ready_once, daemon.attempts, daemon.last_error = "ready", True, 0, None
        log.info("MPS daemon ready key=%s pid=%s adopted=%s", event.key, event.pid, event.adopted)
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
            if daemon.state != "ready":
                down |= daemon.spec.physical_ids
        return frozenset(down)

    def advertised(self, resource: str) -> bool:
        """A resource is advertised once each of its daemons has been ready (limits in place) at least once."""
        daemons = [d for d in self._daemons.values() if d.spec.resource == resource]
        return all(d.ready_once for d in daemons)

    def status(self) -> dict[str, dict[str, object]]:
        return {
            key: {"state": d.state, "restarts": d.restarts, "error": d.last_error, "resource": d.spec.resource}
            for key, d in self._daemons.items()
        }

    def shutdown(self) -> None:
        """The agent stops; daemons keep serving their clients and are adopted by the next agent."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    # ----- the work -------------------------------------------------------------------------------

    def _control(self, spec: MpsDaemonSpec, root: Path) -> MpsControl | None:
        try:
            return _make_control(self._resolve_binary(), root, spec)
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
        if daemon.control is None:
            try:
                assert self._root is not None
                daemon.control = _make_control(self._resolve_binary(), self._root, daemon.spec)
            except (MpsError, ValueError) as error:
                self._post(MpsDaemonFailed(key, daemon.generation, str(error)))
                return
        self._pool.submit(self._bring_up, key, daemon.generation, daemon.spec, daemon.control)

    def _bring_up(self, key: str, generation: int, spec: MpsDaemonSpec, control: MpsControl) -> None:
        """Worker thread: adopt a daemon that answers, else start one; then limits; then readiness."""
        try:
            adopted = control.pid() is not None and _answers(control)
            if not adopted:
                for uuid in spec.visible_devices:
                    _compute_mode(uuid, EXCLUSIVE_PROCESS)
                control.start()
            commands = [thread_percentage_command(spec.active_thread_percentage)]
            commands += [pinned_limit_command(uuid, mib) for uuid, mib in spec.pinned_memory_mib]
            control.commands(commands)
            reply = control.commands([READINESS_COMMAND])
            if not reply or float(reply[-1]) != float(spec.active_thread_percentage):
                raise MpsError(f"the daemon reports {reply!r} for {READINESS_COMMAND}")
            self._post(MpsDaemonReady(key, generation, control.pid(), adopted))
        except (MpsError, ValueError, OSError) as error:
            self._post(MpsDaemonFailed(key, generation, str(error)))

    def _stop(self, key: str) -> None:
        daemon = self._daemons.pop(key)
        if daemon.control is not None:
            self._pool.submit(self._tear_down, key, daemon.spec, daemon.control)

    def _tear_down(self, key: str, spec: MpsDaemonSpec, control: MpsControl) -> None:
        try:
            if control.pid() is not None:
                control.quit()
        except MpsError as error:
            log.warning("MPS daemon did not quit cleanly key=%s error=%r", key, str(error))
        for uuid in spec.visible_devices:
            _compute_mode(uuid, DEFAULT)
        log.info("MPS daemon stopped key=%s", key)
        self._post(MpsDaemonStopped(key))


def _make_control(binary: str, root: Path, spec: MpsDaemonSpec) -> MpsControl:
    """The daemon's environment carries its limits too, so they hold from its first instant."""
    return MpsControl(
        binary,
        root / spec.key / "pipe",
        root / spec.key / "log",
        spec.visible_devices,
        active_thread_percentage=spec.active_thread_percentage,
        pinned_memory_mib=spec.pinned_memory_mib,
    )


def _answers(control: MpsControl) -> bool:
    try:
        return bool(control.commands([READINESS_COMMAND]))
    except MpsError:
        return False


def _compute_mode(uuid: str, mode: int) -> None:
    try:
        set_compute_mode(uuid, mode)
    except ComputeModeError as error:
        log.warning("%s; MPS still works, with less isolation", error)
