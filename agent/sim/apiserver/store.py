"""Objects, the one resourceVersion counter, and the event history that watches replay.

Like etcd behind the API server, every write of any kind takes the next resourceVersion, and the history keeps
each change (``ADDED``/``MODIFIED``/``DELETED`` with the object and the object it replaced) so a watch from
resourceVersion N replays every change after N. The history is bounded (``history_limit``); ``compact()`` drops it
all. A watch from a resourceVersion older than the oldest kept change gets 410 Gone.

Stored objects are never mutated: each write stores a new dict, so history entries can share them, and readers hold
them without copying. Everything is guarded by one re-entrant condition variable, notified on every change.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import TypeVar

from msgspec import Struct

from agent.sim.apiserver.errors import already_exists, not_found
from agent.sim.apiserver.kinds import Kind

T = TypeVar("T")

DEFAULT_HISTORY = 2000


class Event(Struct, frozen=True):
    rv: int
    kind: Kind
    type: str  # ADDED | MODIFIED | DELETED
    object: dict
    previous: dict | None  # the object it replaced (None for ADDED)


def _key(obj: dict) -> tuple[str, str]:
    meta = obj["metadata"]
    return meta.get("namespace") or "", meta["name"]


def with_rv(obj: dict, rv: int) -> dict:
    """A new object that is ``obj`` with ``metadata.resourceVersion`` set (the rest shared)."""
    return {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(rv)}}


class Store:
    def __init__(self, history_limit: int = DEFAULT_HISTORY, first_rv: int = 1) -> None:
        self.cond = threading.Condition(threading.RLock())
        self._objects: dict[Kind, dict[tuple[str, str], dict]] = {}
        self._rv = first_rv
        self._history: deque[Event] = deque()
        self._history_limit = history_limit
        self._horizon = first_rv  # the oldest resourceVersion a watch may start from
        self.close_generation = 0  # bumped to end every open watch stream
        self.closing = False

    # -- reads

    @property
    def rv(self) -> int:
        with self.cond:
            return self._rv

    @property
    def horizon(self) -> int:
        with self.cond:
            return self._horizon

    def get(self, kind: Kind, namespace: str | None, name: str) -> dict | None:
        with self.cond:
            return self._objects.get(kind, {}).get((namespace or "", name))

    def list(self, kind: Kind, namespace: str | None = None) -> tuple[list[dict], int]:
        """The kind's objects (of one namespace, or all), sorted by namespace and name as etcd keys sort."""
        with self.cond:
            items = sorted(self._objects.get(kind, {}).items())
            return [obj for (ns, _), obj in items if namespace is None or ns == namespace], self._rv

    def events_after(self, since: int) -> list[Event]:
        """Every kept change newer than ``since`` (call with a ``since`` no older than the horizon)."""
        with self.cond:
            newer: list[Event] = []
            for event in reversed(self._history):
                if event.rv <= since:
                    break
                newer.append(event)
            newer.reverse()
            return newer

    # -- writes (each takes the next resourceVersion, records an event and wakes every waiter)

    def insert(self, kind: Kind, obj: dict) -> dict:
        with self.cond:
            table = self._objects.setdefault(kind, {})
            key = _key(obj)
            if key in table:
                raise already_exists(kind, key[1])
            stored = self._bump(kind, "ADDED", obj, None)
            table[key] = stored
            return stored

    def replace(self, kind: Kind, obj: dict, expect_rv: str) -> dict | None:
        """Store ``obj`` over the current object if that still has ``expect_rv``; None when it changed meanwhile.

        An object being deleted (``deletionTimestamp``) whose last finalizer goes is removed instead.
        """
        with self.cond:
            table = self._objects.get(kind, {})
            key = _key(obj)
            current = table.get(key)
            if current is None:
                raise not_found(kind, key[1])
            if current["metadata"].get("resourceVersion") != expect_rv:
                return None
            meta = obj["metadata"]
            if meta.get("deletionTimestamp") and not meta.get("finalizers"):
                del table[key]
                return self._bump(kind, "DELETED", obj, current)
            stored = self._bump(kind, "MODIFIED", obj, current)
            table[key] = stored
            return stored

    def remove(self, kind: Kind, namespace: str | None, name: str) -> dict:
        """Delete now; returns the object as the DELETED event carries it (with the deletion's resourceVersion)."""
        with self.cond:
            table = self._objects.get(kind, {})
            current = table.pop((namespace or "", name), None)
            if current is None:
                raise not_found(kind, name)
            return self._bump(kind, "DELETED", current, current)

    def _bump(self, kind: Kind, type_: str, obj: dict, previous: dict | None) -> dict:
        self._rv += 1
        stored = with_rv(obj, self._rv)
        self._history.append(Event(self._rv, kind, type_, stored, previous))
        while len(self._history) > self._history_limit:
            self._horizon = self._history.popleft().rv
        self.cond.notify_all()
        return stored

    # -- history and streams

    def compact(self) -> None:
        """Forget every change so far: a watch from any older resourceVersion now gets 410 Gone."""
        with self.cond:
            self._history.clear()
            self._horizon = self._rv
            self.cond.notify_all()

    def close_watches(self) -> None:
        with self.cond:
            self.close_generation += 1
            self.cond.notify_all()

    def notify(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def wait_for(self, predicate: Callable[[], T], timeout: float) -> T:
        """Wait (on the condition, no polling) until ``predicate()`` is truthy; returns it or raises TimeoutError."""
        with self.cond:
            result = self.cond.wait_for(predicate, timeout=timeout)
            if not result:
                raise TimeoutError(f"API server stand-in: condition not met within {timeout}s")
            return result
