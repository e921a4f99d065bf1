"""Watching paths through inotify: the loop that the kubelet-directory and config watchers share.

One thread per watcher sleeps in ``poll()`` on two descriptors, the inotify queue and an eventfd that
``stop()`` writes to; it wakes only when the kernel reports a change, when it is stopped, or for the one
timer, a slow safety re-check (every ``safety_interval`` seconds) that compares what is there with what
was last posted, so that a missed event (a queue overflow, a change through a renamed ancestor, a
filesystem that does not report) cannot strand the agent.

What is watched is a *plan* (``plan_for``): the directory that holds the path (or the path itself when it
is a directory), every symlink on the way to it (a ConfigMap's ``..data``), and, while the path does not
exist, the nearest directory above it that does. When the plan changes (a directory deleted or created, a
symlink swapped), the watches are rebuilt on a fresh inotify instance and the state re-read. An error
anywhere is logged and the watch rebuilt with backoff; the thread never ends on its own.

``inotify_simple`` is imported by the thread, not at import time: ``start()`` costs nothing on the path to
the first registration.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import select
import stat
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from msgspec import Struct

if TYPE_CHECKING:
    from inotify_simple import Event, INotify

log = logging.getLogger(__name__)

# inotify(7) event bits (kernel ABI, as in <sys/inotify.h>); defined here so that importing this module
# does not import inotify_simple
IN_MODIFY = 0x00000002
IN_ATTRIB = 0x00000004
IN_CLOSE_WRITE = 0x00000008
IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_UNMOUNT = 0x00002000
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
IN_ONLYDIR = 0x01000000
IN_ISDIR = 0x40000000


def inotify_class() -> type[INotify]:
    """``inotify_simple.INotify``, with the C library this process already runs on handed to it.

    Left to itself, inotify_simple finds libc with ``ctypes.util.find_library("c")`` on its first ``INotify``,
    which on Linux runs ``ldconfig -p`` in a subprocess: ~13 ms of a start and a fork from a process that is
    serving. ``dlopen(NULL)`` (``CDLL(None)``) names the libc the interpreter is linked with, where
    ``inotify_init1`` and ``inotify_add_watch`` are.
    """
    import ctypes

    import inotify_simple

    if inotify_simple._libc is None:  # the library's one way to be handed a libc
        inotify_simple._libc = ctypes.CDLL(None, use_errno=True)
    return inotify_simple.INotify


ENTRY_CHANGES = IN_CREATE | IN_DELETE | IN_MOVED_FROM | IN_MOVED_TO
"""An entry of a directory appeared, went, or was renamed onto or away from its name."""
SELF_GONE = IN_DELETE_SELF | IN_MOVE_SELF | IN_IGNORED | IN_UNMOUNT
"""The watched directory itself was deleted, renamed or unmounted: the plan must be rebuilt."""

FIRST_BACKOFF = 0.1
MAX_BACKOFF = 30.0
MAX_SYMLINKS = 40  # as the kernel's path walk (ELOOP)


class Watch(Struct, frozen=True):
    """One watched directory: ``names`` filters its entries (``None``: all of them)."""

    directory: str
    identity: tuple[int, int]  # (st_dev, st_ino) when planned: a directory replaced under the same path differs
    names: frozenset[str] | None
    mask: int


def plan_for(path: Path, mask: int) -> tuple[Watch, ...]:
    """The directories to watch so that any change to what ``path`` resolves to is reported.

    Walks ``path`` as the kernel resolves it: every symlink met adds its name in its directory (a swap of
    ``..data`` is reported there); the final component adds its name in its directory and, when it is a
    directory, the directory itself with all its entries; a component that does not exist (or is not a
    directory where one is needed) adds its name in the deepest directory that does, to learn when it comes.

    The parent is watched for a directory's name because a deleted directory's ``IN_DELETE_SELF`` comes only
    once nothing uses it any more (a socket bound inside it, a process's working directory); the parent's
    ``IN_DELETE`` comes at once.
    """
    entries: dict[tuple[int, int], tuple[str, set[str] | None]] = {}

    def add(directory: Path, name: str | None) -> None:
        try:
            info = directory.stat()
        except OSError:
            return  # it went meanwhile: the plan differs next time it is computed
        key = (info.st_dev, info.st_ino)
        known = entries.get(key)
        if known is None:
            entries[key] = (str(directory), None if name is None else {name})
        elif known[1] is not None:
            if name is None:
                entries[key] = (known[0], None)
            else:
                known[1].add(name)

    parts = list(reversed(path.absolute().parts[1:]))  # a stack: the next component last
    current = Path("/")
    hops = 0
    while parts:
        name = parts.pop()
        if name == "..":
            current = current.parent
            continue
        candidate = current / name
        try:
            info = candidate.lstat()
        except OSError:
            add(current, name)  # not there (yet): wait for it in the directory that is
            break
        if stat.S_ISLNK(info.st_mode):
            add(current, name)
            hops += 1
            if hops > MAX_SYMLINKS:
                break
            try:
                target = candidate.readlink()
            except OSError:
                break  # replaced meanwhile: the plan differs next time
            if target.is_absolute():
                current = Path("/")
                parts.extend(reversed(target.parts[1:]))
            else:
                parts.extend(reversed(target.parts))
            continue
        if not parts:
            add(current, name)  # replaced or removed: a directory's own IN_DELETE_SELF waits for its last user
            if stat.S_ISDIR(info.st_mode):
                add(candidate, None)
        elif stat.S_ISDIR(info.st_mode):
            current = candidate
        else:
            add(current, name)  # a file where a directory should be: wait for that to change
            break
    watch_mask = mask | IN_DELETE_SELF | IN_MOVE_SELF
    return tuple(
        Watch(directory, key, None if names is None else frozenset(names), watch_mask)
        for key, (directory, names) in entries.items()
    )


class InotifyWatcher:
    """The shared loop; a subclass says what to watch (``_plan``) and what to post (``_initial``,
    ``_on_events``, ``_resync``). Every hook but ``_initial`` runs on the watcher's thread only."""

    def __init__(self, post: Callable[[object], None], *, safety_interval: float, thread_name: str) -> None:
        self._post = post
        self._safety_interval = safety_interval
        self._stopping = threading.Event()
        self._wake = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._wake_closed = False
        self._thread = threading.Thread(target=self._run, name=thread_name, daemon=True)
        self._armed: tuple[Watch, ...] = ()
        self._unwatchable: set[tuple[str, int]] = set()
        self.failures = 0
        """Errors the thread recovered from (each logged and followed by a rebuild with backoff)."""
        self._streak = 0  # failures since the last quiet safety interval: the backoff
        self.armed = threading.Event()
        """Set while the watches are in place: a change is then reported by its event (before, and while they
        are rebuilt after an error, by the state re-read once they are)."""

    # --- the public surface -------------------------------------------------------------------------

    def start(self) -> None:
        """Post the current state (from the caller's thread, without waiting for inotify) and start watching."""
        self._initial()
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop and join the thread (at most ``timeout`` seconds): it wakes at once (no timed sleep to wait
        out), but closing its inotify instance takes the kernel a grace period (~10 ms after a rebuild), which
        a process about to exit need not wait for (``timeout=0``)."""
        self._stopping.set()
        if self._wake_closed:
            return
        os.eventfd_write(self._wake, 1)
        if self._thread.is_alive():
            self._thread.join(timeout=timeout)
        if not self._thread.is_alive():
            self._wake_closed = True
            os.close(self._wake)

    def alive(self) -> bool:
        """The thread runs, or it was stopped on purpose."""
        return self._thread.is_alive() or self._stopping.is_set()

    @property
    def native_id(self) -> int | None:
        """The thread's kernel id (``/proc/self/task/<id>``), once started."""
        return self._thread.native_id

    # --- the hooks ----------------------------------------------------------------------------------

    def _plan(self) -> tuple[Watch, ...]:
        raise NotImplementedError

    def _initial(self) -> None:
        """At ``start()``: post what must be known at once."""

    def _on_events(self, events: list[tuple[Watch, int, str]]) -> None:
        """A batch of (watch, mask, name) for entries the plan names (or all, for ``names=None``)."""
        raise NotImplementedError

    def _resync(self) -> None:
        """Re-read the whole state; post what differs from what was last posted."""
        raise NotImplementedError

    # --- the thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                if self._streak:
                    self._resync()  # first: inotify itself may be what keeps failing (EMFILE)
                self._watch()
            except Exception as error:
                self.armed.clear()
                self.failures += 1
                self._streak += 1
                delay = min(MAX_BACKOFF, FIRST_BACKOFF * 2 ** min(self._streak - 1, 16))
                hint = ""
                if isinstance(error, OSError) and error.errno in (errno.EMFILE, errno.ENOSPC):
                    hint = " fix='raise fs.inotify.max_user_instances / max_user_watches'"
                log.error(
                    "watch failed thread=%s failures=%d retry_in=%.1fs error=%r%s",
                    self._thread.name,
                    self.failures,
                    delay,
                    error,
                    hint,
                    exc_info=self._streak == 1,
                )
                if self._sleep(delay):
                    return

    def _sleep(self, seconds: float) -> bool:
        """Wait ``seconds`` or until stopped (True)."""
        select.select([self._wake], [], [], seconds)
        return self._stopping.is_set()

    def _watch(self) -> None:
        INotify = inotify_class()

        rearms = 0
        while not self._stopping.is_set():
            with INotify(nonblocking=True) as inotify:
                plan = self._plan()
                watches, complete = self._add(inotify, plan)
                if (not complete or self._plan() != plan) and rearms < 5:
                    rearms += 1  # it changed while the watches were added: again, on a clean instance
                    continue
                rearms = 0
                self._armed = plan
                inotify.read(timeout=0)  # what happened while arming is in the state read next
                self._resync()
                self.armed.set()
                if not self._serve(inotify, watches):
                    return

    def _add(self, inotify: INotify, plan: tuple[Watch, ...]) -> tuple[dict[int, Watch], bool]:
        """Add the plan's watches; False if a directory of the plan went meanwhile."""
        watches: dict[int, Watch] = {}
        complete = True
        for watch in plan:
            try:
                watches[inotify.add_watch(watch.directory, watch.mask | IN_ONLYDIR)] = watch
            except (FileNotFoundError, NotADirectoryError):
                complete = False
            except OSError as error:  # EACCES, ENOSPC (max_user_watches): the safety re-check still runs
                if (watch.directory, error.errno or 0) not in self._unwatchable:
                    self._unwatchable.add((watch.directory, error.errno or 0))
                    log.warning(
                        "cannot watch directory=%s error=%r; changes there are noticed within %gs",
                        watch.directory,
                        str(error),
                        self._safety_interval,
                    )
        return watches, complete

    def _serve(self, inotify: INotify, watches: dict[int, Watch]) -> bool:
        """Wait for events; False when stopped, True when the watches must be rebuilt."""
        poller = select.poll()
        poller.register(inotify.fileno(), select.POLLIN)
        poller.register(self._wake, select.POLLIN)
        deadline = time.monotonic() + self._safety_interval
        while True:
            timeout = max(0, math.ceil((deadline - time.monotonic()) * 1000))
            ready = poller.poll(timeout)
            if self._stopping.is_set():
                return False
            if ready and self._dispatch(watches, inotify.read(timeout=0)):
                return True
            if time.monotonic() >= deadline:
                self._resync()
                if self._plan() != self._armed:
                    return True
                self._streak = 0  # a whole interval without an error: the next one backs off from the start
                deadline = time.monotonic() + self._safety_interval

    def _dispatch(self, watches: dict[int, Watch], events: Iterable[Event]) -> bool:
        """Handle one batch read from the queue; True when the watches must be rebuilt."""
        matched: list[tuple[Watch, int, str]] = []
        overflow = rebuild = replan = False
        for event in events:
            wd, mask, name = event.wd, event.mask, event.name
            if mask & IN_Q_OVERFLOW:
                overflow = True
                continue
            watch = watches.get(wd)
            if watch is None:
                continue  # a watch of an instance or plan since left
            if mask & SELF_GONE:
                rebuild = True
            elif watch.names is None or name in watch.names:
                matched.append((watch, mask, name))
                replan = replan or watch.names is not None  # a symlink or an awaited name: the plan may change
        if matched:
            self._on_events(matched)
        if rebuild:
            return True  # rebuilding re-reads the state
        if overflow:
            log.warning("inotify queue overflowed thread=%s; re-reading the state", self._thread.name)
            self._resync()
        return (replan or overflow) and self._plan() != self._armed
