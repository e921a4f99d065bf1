"""Noticing that an MPS control daemon died, the moment it dies: a pidfd per daemon, one thread polling them.

``nvidia-cuda-mps-control -d`` double-forks, so the daemon is not the agent's child and ``waitpid`` cannot
see it. A pidfd (``os.pidfd_open``, Linux 5.3+) can: it becomes readable when the process exits. One
thread sleeps in ``poll`` on every daemon's pidfd and a wake-up pipe, and posts ``ProcessExited`` — no
timer, no CPU while nothing happens. Where pidfds are not available the agent's slow safety re-check
(``MpsManager.next_deadline``) still finds a dead daemon.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
from collections.abc import Callable

from msgspec import Struct

log = logging.getLogger(__name__)


class ProcessExited(Struct, frozen=True):
    key: str
    pid: int


class ProcessExitWatcher:
    def __init__(self, post: Callable[[object], None]) -> None:
        self._post = post
        self._lock = threading.Lock()
        self._fds: dict[int, tuple[str, int]] = {}  # pidfd -> (key, pid)
        self._wake_read, self._wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="mps-exits", daemon=True)
        self._thread.start()

    @staticmethod
    def supported() -> bool:
        return hasattr(os, "pidfd_open")

    def watch(self, key: str, pid: int) -> bool:
        """Post ``ProcessExited(key, pid)`` when ``pid`` exits (at once if it already has); False if this
        kernel cannot watch it (the safety re-check will)."""
        self.forget(key)
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._post(ProcessExited(key, pid))
            return True
        except (AttributeError, OSError) as error:
            log.debug("cannot watch process pid=%d error=%r", pid, str(error))
            return False
        with self._lock:
            self._fds[fd] = (key, pid)
        self._wake()
        return True

    def forget(self, key: str) -> None:
        with self._lock:
            for fd in [fd for fd, (k, _) in self._fds.items() if k == key]:
                del self._fds[fd]
                os.close(fd)
        self._wake()

    def stop(self) -> None:
        self._stopped = True
        self._wake()
        self._thread.join(timeout=2)
        with self._lock:
            for fd in self._fds:
                os.close(fd)
            self._fds.clear()
        os.close(self._wake_read)
        os.close(self._wake_write)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_write, b"x")

    def _run(self) -> None:
        while not self._stopped:
            poller = select.poll()
            poller.register(self._wake_read, select.POLLIN)
            with self._lock:
                watched = dict(self._fds)
            for fd in watched:
                poller.register(fd, select.POLLIN)
            try:
                ready = poller.poll()
            except OSError as error:  # a pidfd closed under us by forget(): build the poll set again
                log.debug("poll failed error=%r", str(error))
                continue
            for fd, events in ready:
                if not events & select.POLLIN:
                    continue  # POLLNVAL: forgotten (closed) meanwhile
                if fd == self._wake_read:
                    with contextlib.suppress(BlockingIOError, OSError):
                        os.read(self._wake_read, 4096)
                    continue
                with self._lock:
                    entry = self._fds.pop(fd, None)
                if entry is not None:
                    os.close(fd)
                    self._post(ProcessExited(*entry))
