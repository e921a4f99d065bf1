"""Noticing config changes: the kubelet swaps a ConfigMap mount atomically (``..data`` symlink), so the
watcher compares a fingerprint of what the path resolves to, every half second, and posts an event when
it changes. The reconcile loop then reloads, validates and applies — or keeps the last good config.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class ConfigSourceChanged:
    pass


def fingerprint(path: Path) -> tuple[object, ...]:
    """What changes whenever a config at ``path`` could have changed (missing paths included)."""
    try:
        if path.is_dir():
            data = path / "..data"
            target = str(data.resolve()) if data.is_symlink() else ""
            files = tuple(
                (p.name, p.stat().st_ino, p.stat().st_mtime_ns, p.stat().st_size)
                for p in sorted(path.iterdir())
                if not p.name.startswith("..") and p.is_file()
            )
            return ("dir", target, files)
        info = path.stat()
        return ("file", str(path.resolve()), info.st_ino, info.st_mtime_ns, info.st_size)
    except (OSError, RuntimeError):  # vanished meanwhile, or a symlink loop
        return ("missing",)


class ConfigWatcher:
    def __init__(self, path: Path, post: Callable[[object], None], *, interval: float = 0.5) -> None:
        self._path = path
        self._post = post
        self._interval = interval
        self._stop = threading.Event()
        self._last = fingerprint(path)
        self._thread = threading.Thread(target=self._run, name="config-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self._interval + 2)

    def alive(self) -> bool:
        return self._thread.is_alive() or self._stop.is_set()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            current = fingerprint(self._path)
            if current != self._last:
                self._last = current
                self._post(ConfigSourceChanged())
