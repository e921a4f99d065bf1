"""Noticing config changes through inotify, and posting ``ConfigSourceChanged`` only on a real change.

What is watched (``agent.fswatch.plan_for``): for a single file, its directory, for the file's name
(``IN_CLOSE_WRITE``, ``IN_MOVED_TO``, ``IN_CREATE``, ``IN_DELETE``, ``IN_MOVED_FROM``, ``IN_ATTRIB``: editors
replace files) and for every symlink on its way (a file of a mounted ConfigMap is ``name -> ..data/name``,
so the kubelet's swap of ``..data`` is seen); for a directory (a mounted ConfigMap), every entry of it,
including the kubelet's atomic swap (``..data_tmp`` renamed onto ``..data``: ``IN_MOVED_TO``) and plain
file writes; a path that does not exist yet is awaited in the nearest directory above it that does.

An event only makes the watcher compare ``fingerprint(path)`` with the last one: an event that changes
nothing (a file opened and closed, its times set to what they were) posts nothing, and the steps of one
swap post once. A regular file just created is not read until its writer closes it (``IN_CLOSE_WRITE``
follows), so a half-written file is not reported. A safety re-check every ``safety_interval`` seconds
compares the fingerprint too. The reconcile loop then has the change checked off the loop
(:mod:`agent.config.check_worker`) and applies the answer — or keeps the last good config.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

from msgspec import Struct

from agent.fswatch import (
    ENTRY_CHANGES,
    IN_ATTRIB,
    IN_CLOSE_WRITE,
    IN_CREATE,
    InotifyWatcher,
    Watch,
    plan_for,
)

CONFIG_CHANGES = ENTRY_CHANGES | IN_CLOSE_WRITE | IN_ATTRIB


class ConfigSourceChanged(Struct, frozen=True):
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


def _being_written(path: Path) -> bool:
    """A regular file with one link was just created by a writer that has it open: wait for its close."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and info.st_nlink == 1


class ConfigWatcher(InotifyWatcher):
    def __init__(self, path: Path, post: Callable[[object], None], *, safety_interval: float = 30.0) -> None:
        super().__init__(post, safety_interval=safety_interval, thread_name="config-watch")
        self._path = path
        self._last = fingerprint(path)

    def _plan(self) -> tuple[Watch, ...]:
        return plan_for(self._path, CONFIG_CHANGES)

    def _on_events(self, events: list[tuple[Watch, int, str]]) -> None:
        if any(not (mask & IN_CREATE and _being_written(Path(w.directory, name))) for w, mask, name in events):
            self._resync()

    def _resync(self) -> None:
        current = fingerprint(self._path)
        if current != self._last:
            self._post(ConfigSourceChanged())
            self._last = current
