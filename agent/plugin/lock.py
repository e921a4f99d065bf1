"""One agent per directory: an exclusive ``flock`` on a file inside it.

Two agents serving one device-plugin directory would delete and recreate each other's sockets for ever (each
sees its socket gone and serves it again). The lock makes the second one say who holds the directory and
stop. The DRA front end locks its driver's plugin directory the same way (``agent.dra.frontend``): whoever
holds that lock works the prepared-claims checkpoint and the CDI specs, so that a successor rolls back and
sweeps only what its predecessor can no longer be writing.

The lock file lives in a sub-directory, ``.tessera/agent.lock``: the kubelet cleans the device-plugin
directory at start — current kubelets remove its sockets, older ones every regular file except the
checkpoint — and no version removes directories. The holder writes its PID, host and start time into the
file so that a second agent can name it. ``flock`` dies with the process, so a crashed holder never
leaves a stale lock behind.

A wait for the lock ends early when the caller's ``stop`` event is set (SIGTERM while a predecessor still
holds the directory): ``LockWaitStopped``. The wait tries again every ``poll`` seconds: the kernel offers no
event for a ``flock`` let go, and a blocking ``flock`` could not be interrupted.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import threading
import time
from pathlib import Path

LOCK_DIRECTORY = ".tessera"
LOCK_FILE = "agent.lock"
MAX_HOLDER_BYTES = 4096


class DirLocked(RuntimeError):
    """Another process holds the directory; the message names it."""


PluginDirLocked = DirLocked  # the name the device-plugin side knows it by


class LockWaitStopped(DirLocked):
    """The wait for the lock was ended by the caller's ``stop`` event before the holder let go."""


class DirLock:
    """An exclusive ``flock`` on ``<directory>/.tessera/agent.lock``. Messages say that the holder ``does``
    ``what`` ("serves" "the device-plugin directory /var/lib/kubelet/device-plugins"); ``advice`` says what to
    do about it."""

    def __init__(self, directory: Path, *, what: str, does: str = "holds", advice: str = "") -> None:
        self.path = directory / LOCK_DIRECTORY / LOCK_FILE
        self.what, self._does, self._advice = what, does, advice
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, wait: float = 0.0, *, stop: threading.Event | None = None, poll: float = 0.1) -> None:
        """Take the lock, trying for up to ``wait`` seconds (``math.inf``: until it is let go); ``DirLocked``
        naming the holder if not, ``LockWaitStopped`` as soon as ``stop`` is set while waiting."""
        self.path.parent.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        deadline = time.monotonic() + wait
        pause = stop if stop is not None else threading.Event()  # never set without a stop: a bounded wait
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as error:
                    if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                        raise
                    if stop is not None and stop.is_set():
                        who = self._holder(fd)
                        raise LockWaitStopped(
                            f"stopped while waiting for {self.what}: {who} {self._does} it (lock {self.path})"
                        ) from None
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise DirLocked(self._refusal(fd)) from None
                    pause.wait(min(poll, left))
            os.ftruncate(fd, 0)
            holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%SZ")}
            os.pwrite(fd, json.dumps(holder).encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
        os.close(self._fd)  # closing drops the flock
        self._fd = None

    def holder(self) -> str:
        """Who holds the lock now, as its file says ("another Tessera agent (pid 42 on node-1 since ...)")."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return "an unknown process"
        try:
            return self._holder(fd)
        finally:
            os.close(fd)

    def _holder(self, fd: int) -> str:
        try:
            holder = json.loads(os.pread(fd, MAX_HOLDER_BYTES, 0) or b"{}")
        except (OSError, ValueError):
            holder = {}
        if isinstance(holder, dict) and holder.get("pid"):
            pid, host, since = holder.get("pid"), holder.get("host"), holder.get("since")
            return f"another Tessera agent (pid {pid} on {host} since {since})"
        return "another Tessera agent (an unknown process)"

    def _refusal(self, fd: int) -> str:
        advice = f"; {self._advice}" if self._advice else ""
        return f"{self._holder(fd)} {self._does} {self.what} (lock {self.path}){advice}"


class PluginDirLock(DirLock):
    def __init__(self, device_plugin_dir: Path) -> None:
        super().__init__(
            device_plugin_dir,
            what=f"the device-plugin directory {device_plugin_dir}",
            does="serves",
            advice=(
                "two agents there would fight over the kubelet sockets. Stop the other one (a second Tessera "
                "DaemonSet, or a `tessera run` on the host), or give this one another --device-plugin-dir"
            ),
        )
