"""Faults tests inject: scripted failures of the next N matching requests, added latency, and an outage answered
with an HTTP status (the refused-connection outage is the server's listener being closed, in ``server``)."""

from __future__ import annotations

import threading

from msgspec import Struct


class _Failure(Struct):
    verb: str  # "*" for any
    resource: str  # "*" for any
    status: int  # 0: drop the connection without answering
    remaining: int
    message: str | None


class Faults:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failures: list[_Failure] = []
        self.latency = 0.0
        self.down_status: int | None = None  # every request answered with this status while set

    def fail_next(self, verb: str, resource: str, status: int, n: int = 1, message: str | None = None) -> None:
        with self._lock:
            self._failures.append(_Failure(verb, resource, status, n, message))

    def take(self, verb: str, resource: str) -> tuple[int, str | None] | None:
        """The failure this request gets, if one is scripted for it (consuming one of its N)."""
        with self._lock:
            for failure in self._failures:
                if failure.verb in ("*", verb) and failure.resource in ("*", resource):
                    failure.remaining -= 1
                    if failure.remaining <= 0:
                        self._failures.remove(failure)
                    return failure.status, failure.message
        return None

    def pending(self) -> int:
        with self._lock:
            return sum(f.remaining for f in self._failures)

    def clear(self) -> None:
        with self._lock:
            self._failures.clear()
            self.latency = 0.0
            self.down_status = None
