"""Noticing kubelet restarts: the kubelet recreates ``kubelet.sock`` and never dials plugins back.

A poll of the socket's identity (inode and change time) every 100 ms is enough to re-register well
within a second, works on every filesystem a hostPath can be, and needs no inotify limits.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KubeletSocketChanged:
    """The kubelet socket appeared, was replaced (a kubelet restart), or went away."""

    present: bool


class KubeletWatcher:
    def __init__(self, kubelet_socket: Path, post: Callable[[object], None], *, interval: float = 0.1) -> None:
        self._socket = kubelet_socket
        self._post = post
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kubelet-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self._interval + 2)

    def alive(self) -> bool:
        return self._thread.is_alive() or self._stop.is_set()

    def _identity(self) -> tuple[int, int] | None:
        try:
            info = self._socket.stat()
        except OSError:
            return None
        return info.st_ino, info.st_ctime_ns

    def _run(self) -> None:
        last: tuple[int, int] | str | None = "unknown"
        while not self._stop.is_set():
            identity = self._identity()
            if identity != last:
                self._post(KubeletSocketChanged(present=identity is not None))
                last = identity
            self._stop.wait(self._interval)
