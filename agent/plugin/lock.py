"""One agent per device-plugin directory: an exclusive ``flock`` on a file inside it.

Two agents serving one directory would delete and recreate each other's sockets for ever (each sees its
socket gone and serves it again). The lock makes the second one say who holds the directory and stop.

The lock file lives in a sub-directory, ``.tessera/agent.lock``: the kubelet cleans the device-plugin
directory at start — current kubelets remove its sockets, older ones every regular file except the
checkpoint — and no version removes directories. The holder writes its PID, host and start time into the
file so that a second agent can name it. ``flock`` dies with the process, so a crashed holder never
leaves a stale lock behind.
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


class PluginDirLocked(RuntimeError):
    """Another agent holds the device-plugin directory; the message names it."""


class PluginDirLock:
    def __init__(self, device_plugin_dir: Path) -> None:
        self.path = device_plugin_dir / LOCK_DIRECTORY / LOCK_FILE
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, wait: float = 0.0, *, poll: float = 0.1) -> None:
        """Take the lock, trying for up to ``wait`` seconds; ``PluginDirLocked`` naming the holder if not."""
        self.path.parent.mkdir(mode=0o700, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        deadline = time.monotonic() + wait
        pause = threading.Event()  # never set: a bounded wait between tries
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as error:
                    if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                        raise
                    if time.monotonic() >= deadline:
                        raise PluginDirLocked(self._refusal(fd)) from None
                    pause.wait(poll)
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

    def _refusal(self, fd: int) -> str:
        try:
            holder = json.loads(os.pread(fd, MAX_HOLDER_BYTES, 0) or b"{}")
        except (OSError, ValueError):
            holder = {}
        who = (
            f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('since')}"
            if isinstance(holder, dict) and holder.get("pid")
            else "an unknown process"
        )
        return (
            f"another Tessera agent ({who}) serves the device-plugin directory {self.path.parent.parent} "
            f"(lock {self.path}); two agents there would fight over the kubelet sockets. Stop the other one "
            "(a second Tessera DaemonSet, or a `tessera run` on the host), or give this one another "
            "--device-plugin-dir"
        )
