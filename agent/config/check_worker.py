"""Config checks off the reconcile loop: one checker child at a time, on a thread of its own, the newest change
winning.

A reload's check (:class:`agent.config.isolated.Check`: a child process, ~0.25 s, up to its timeout if the
checker hangs) must not hold the loop: an XID, a kubelet restart or SIGTERM would wait behind a config edit.
The loop asks (:meth:`CheckWorker.request`) and goes on; the worker runs the child and posts
:class:`ConfigChecked` with the finished check, which the loop applies as it applies any config (the last good
one stays on error). A request arriving while a check runs supersedes it: the running child is killed and its
result dropped; a request for files that have not changed since the one in hand is not run twice. The start
does not come here: the agent waits for its first check before its first advertise.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from msgspec import Struct

from agent.config.isolated import TIMEOUT_SECONDS, Check
from agent.config.model import ConfigError
from agent.supervise import WorkerCrashed

log = logging.getLogger(__name__)


class ConfigChecked(Struct, frozen=True):
    """A finished check (its :meth:`Check.result` answers at once: the checked set or the ``ConfigError``);
    ``generation`` tells the loop whether a newer request has superseded it."""

    generation: int
    check: Check


class CheckWorker:
    def __init__(
        self,
        post: Callable[[object], None],
        *,
        timeout: float = TIMEOUT_SECONDS,
        command: Sequence[str] | None = None,
    ) -> None:
        self._post = post
        self._timeout = timeout
        self._command = command
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._generation = 0  # of the newest request: only its answer is posted
        self._wanted: Path | None = None  # asked for, not started yet
        self._asked: object = None  # the stamp of the newest request, while it is wanted or running
        self._running: Check | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None

    @property
    def generation(self) -> int:
        return self._generation

    def request(self, path: Path, stamp: object) -> None:
        """Check ``path`` (its files as :func:`agent.config.early.stamp` gave ``stamp``); returns at once."""
        with self._lock:
            if self._stopping or (stamp == self._asked and (self._wanted is not None or self._running is not None)):
                return  # the check in hand reads these very files
            self._generation += 1
            self._wanted, self._asked = path, stamp
            superseded, self._running = self._running, None
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="config-check", daemon=True)
                self._thread.start()
        if superseded is not None:
            log.info("config changed while being checked; checking the newest path=%s", path)
            superseded.cancel()  # its child killed: its answer would be stale
        self._wake.set()

    def alive(self) -> bool:
        return self._thread is None or self._thread.is_alive()

    def stop(self, timeout: float | None = None) -> None:
        """No more checks: the running child is killed (a hung checker does not hold the agent's exit)."""
        with self._lock:
            self._stopping = True
            running, self._running = self._running, None
            thread = self._thread
        if running is not None:
            running.cancel()
        self._wake.set()
        if thread is not None:
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                if self._stopping:
                    return
                path, generation, self._wanted = self._wanted, self._generation, None
            if path is None:
                continue
            try:
                self._check(path, generation)
            except Exception as error:  # unforeseen: counted by the loop; the next change is checked afresh
                with self._lock:
                    self._running, self._asked = None, None
                self._post(WorkerCrashed("config", str(path), f"{type(error).__name__}: {error}"))

    def _check(self, path: Path, generation: int) -> None:
        """Run one check; post it unless a newer request (or the stop) came meanwhile."""
        check = Check(path, timeout=self._timeout, command=self._command)  # the child starts here
        with self._lock:
            current = generation == self._generation and not self._stopping
            if current:
                self._running = check
        if not current:
            check.cancel()  # superseded (or stopped) while it started
            return
        with contextlib.suppress(ConfigError):  # the answer, an error included, stays in the check: the loop's
            check.result()  # bounded by the check's own timeout; a cancel ends it at once
        with self._lock:
            current = generation == self._generation and not self._stopping
            if self._running is check:
                self._running, self._asked = None, None
        if current:
            self._post(ConfigChecked(generation, check))
