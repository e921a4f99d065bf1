"""What tests observe: every request answered (verb, resource, status) and the watch streams open.

Shares the store's condition variable, so ``ApiServer.wait_for`` wakes on requests as well as on object changes.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

from msgspec import Struct


class Request(Struct, frozen=True):
    time: float  # time.monotonic() when answered (a watch: when its stream was open)
    method: str
    verb: str  # get | list | watch | create | update | patch | delete | deletecollection | discovery
    resource: str  # resourceslices, resourceclaims/status, nodes, version, ...
    namespace: str | None
    name: str | None
    path: str
    status: int  # 0: the connection was dropped without an answer


class RequestLog:
    def __init__(self, cond: threading.Condition) -> None:
        self._cond = cond
        self._records: list[Request] = []
        self._open_watches: Counter[str] = Counter()

    def record(self, request: Request) -> None:
        with self._cond:
            self._records.append(request)
            self._cond.notify_all()

    def watch_opened(self, resource: str) -> None:
        with self._cond:
            self._open_watches[resource] += 1
            self._cond.notify_all()

    def watch_closed(self, resource: str) -> None:
        with self._cond:
            self._open_watches[resource] -= 1
            self._cond.notify_all()

    def open_watches(self, resource: str | None = None) -> int:
        with self._cond:
            if resource is None:
                return sum(self._open_watches.values())
            return self._open_watches[resource]

    def records(self, verb: str | None = None, resource: str | None = None, status: int | None = None) -> list[Request]:
        with self._cond:
            return [
                r
                for r in self._records
                if (verb is None or r.verb == verb)
                and (resource is None or r.resource == resource)
                and (status is None or r.status == status)
            ]

    def count(self, verb: str | None = None, resource: str | None = None, status: int | None = None) -> int:
        return len(self.records(verb, resource, status))

    def counts(self) -> Counter[tuple[str, str]]:
        with self._cond:
            return Counter((r.verb, r.resource) for r in self._records)

    def clear(self) -> None:
        with self._cond:
            self._records.clear()


def stamp() -> float:
    return time.monotonic()
