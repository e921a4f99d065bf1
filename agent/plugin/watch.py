"""Watching the kubelet's device-plugin directory through inotify.

The kubelet never dials a plugin back: after a restart it recreates ``kubelet.sock`` (and deletes every
other socket in the directory), and a plugin must notice and register again. ``PluginDirWatcher`` posts:

- ``KubeletSocketChanged(present)``: at start, and when ``kubelet.sock`` is created, replaced (``IN_CREATE``,
  ``IN_MOVED_TO``, ``IN_DELETE`` then ``IN_CREATE``; its identity, device + inode + ctime, is compared too)
  or removed;
- ``PluginSocketRemoved(name)``: when another socket in the directory is deleted or renamed away;
- ``PluginDirChanged(present)``: at start, and when the directory itself appears or goes (it is then
  awaited through the nearest directory above it that exists).

Posting only what changed; a queue overflow and a safety re-check every ``safety_interval`` seconds
re-read the directory and post what differs from what was last posted.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

from msgspec import Struct

from agent.fswatch import (
    ENTRY_CHANGES,
    IN_CREATE,
    IN_DELETE,
    IN_ISDIR,
    IN_MOVED_FROM,
    IN_MOVED_TO,
    InotifyWatcher,
    Watch,
    plan_for,
)

KUBELET_SOCKET_NAME = "kubelet.sock"

_Identity = tuple[int, int, int]
_UNKNOWN: object = object()  # nothing posted yet


class KubeletSocketChanged(Struct, frozen=True):
    """The kubelet socket appeared, was replaced (a kubelet restart), or went away."""

    present: bool


class PluginSocketRemoved(Struct, frozen=True):
    """A socket other than the kubelet's (``name``, in the device-plugin directory) was deleted or moved away."""

    name: str


class PluginDirChanged(Struct, frozen=True):
    """The device-plugin directory appeared or went away."""

    present: bool


def _identity(path: Path) -> _Identity | None:
    try:
        info = path.stat()
    except OSError:
        return None
    return info.st_dev, info.st_ino, info.st_ctime_ns


SocketIdentity = tuple[int, int, int]


def socket_identity(path: Path) -> SocketIdentity | None:
    """Which socket file ``path`` names now (device, inode, mtime), ``None`` when none: a kubelet that starts
    again listens on a new ``kubelet.sock``. A socket's mtime is when it was bound: a chmod, a link or a rename
    leaves it (they change its ctime), so the same socket keeps its identity; a new one on a reused inode gets
    a later mtime (unless it is made within the same clock tick, a few milliseconds)."""
    try:
        info = path.stat()
    except OSError:
        return None
    return info.st_dev, info.st_ino, info.st_mtime_ns


def _is_socket(path: Path) -> bool | None:
    """``None``: it is gone already."""
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return None


class PluginDirWatcher(InotifyWatcher):
    def __init__(
        self,
        device_plugin_dir: Path,
        post: Callable[[object], None],
        *,
        safety_interval: float = 30.0,
        kubelet_socket_name: str = KUBELET_SOCKET_NAME,
    ) -> None:
        super().__init__(post, safety_interval=safety_interval, thread_name="plugin-dir-watch")
        self._dir = device_plugin_dir
        self._kubelet_name = kubelet_socket_name
        self._dir_posted: bool | None = None
        self._kubelet_posted: _Identity | object | None = _UNKNOWN
        self._sockets: set[str] = set()  # other sockets in the directory, as last seen

    def _plan(self) -> tuple[Watch, ...]:
        return plan_for(self._dir, ENTRY_CHANGES)

    def _initial(self) -> None:
        self._resync()

    def _resync(self) -> None:
        present = self._dir.is_dir()
        sockets: set[str] = set()
        if present:
            try:
                with os.scandir(self._dir) as entries:
                    for entry in entries:
                        if entry.name != self._kubelet_name and _is_socket(Path(entry.path)):
                            sockets.add(entry.name)
            except OSError:
                present = self._dir.is_dir()
        for name in sorted(self._sockets - sockets):
            self._socket_gone(name)
        self._sockets |= sockets
        first = self._dir_posted is None
        if present != self._dir_posted and (present or first):
            self._post(PluginDirChanged(present=present))  # the directory first when it comes (or at start)
            self._dir_posted = present
        self._check_kubelet(rebound=False)
        if present != self._dir_posted:
            self._post(PluginDirChanged(present=present))  # ... and last when it goes
            self._dir_posted = present

    def _on_events(self, events: list[tuple[Watch, int, str]]) -> None:
        touched = rebound = False
        for watch, mask, name in events:
            if watch.names is not None or not name or mask & IN_ISDIR:
                continue  # on the way to the directory (the plan is re-read), or a sub-directory (the lock's)
            if name == self._kubelet_name:
                touched = True
                rebound = rebound or bool(mask & (IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO))
            elif mask & (IN_DELETE | IN_MOVED_FROM):
                if name in self._sockets:
                    self._socket_gone(name)
            elif mask & (IN_CREATE | IN_MOVED_TO):
                kind = _is_socket(self._dir / name)
                if kind or (kind is None and name.endswith(".sock")):  # gone before it could be looked at
                    self._sockets.add(name)
        if touched:
            self._check_kubelet(rebound=rebound)

    def _socket_gone(self, name: str) -> None:
        self._post(PluginSocketRemoved(name=name))
        self._sockets.discard(name)

    def _check_kubelet(self, *, rebound: bool) -> None:
        """Post when present-ness or identity differs, or when the name was re-bound while present (the
        kubelet removed and recreated it, or renamed a new socket onto it: its inode may be reused)."""
        identity = _identity(self._dir / self._kubelet_name)
        if identity != self._kubelet_posted or (rebound and identity is not None):
            self._post(KubeletSocketChanged(present=identity is not None))
            self._kubelet_posted = identity


class KubeletWatcher(PluginDirWatcher):
    """The former interface (``KubeletWatcher(kubelet_socket, post)``): posts only ``KubeletSocketChanged``."""

    def __init__(self, kubelet_socket: Path, post: Callable[[object], None], *, safety_interval: float = 30.0) -> None:
        def kubelet_only(event: object) -> None:
            if isinstance(event, KubeletSocketChanged):
                post(event)

        super().__init__(
            kubelet_socket.parent,
            kubelet_only,
            safety_interval=safety_interval,
            kubelet_socket_name=kubelet_socket.name,
        )
