"""Idle time as it accumulates: per held device (pod or DRA claim), its current streak, and GPU-seconds per
namespace and per node.

A device that was idle over a collection window is credited the window's length; its GPU-seconds are that
length times its share of a GPU. A device's own count ends with its last holder (``keep``); the namespace and
node counters never go down (Prometheus counters), so capacity left idle stays visible after the pods are gone.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable


class IdleLedger:
    def __init__(self) -> None:
        self._seconds: dict[tuple[str, ...], float] = defaultdict(float)
        self._since: dict[tuple[str, ...], float] = {}  # key -> monotonic start of its idle streak
        self.namespace_seconds: dict[str, float] = defaultdict(float)
        self.node_seconds = 0.0

    def credit(
        self, key: tuple[str, ...], namespace: str, idle: bool, elapsed: float, share: float, now: float
    ) -> tuple[float, float]:
        """Record one window of ``key``; (its idle seconds so far, how long its current idle streak is: 0 if busy)."""
        if idle:
            self._seconds[key] += elapsed
            self._since.setdefault(key, now - elapsed)
            self.namespace_seconds[namespace] += elapsed * share
            self.node_seconds += elapsed * share
        else:
            self._since.pop(key, None)
        since = self._since.get(key)
        return self._seconds[key], 0.0 if since is None else now - since

    def keep(self, keys: Iterable[tuple[str, ...]]) -> None:
        """Forget every device not in ``keys`` (released: its series ends, and so does its memory)."""
        kept = set(keys)
        for gone in self._seconds.keys() - kept:
            del self._seconds[gone]
            self._since.pop(gone, None)
