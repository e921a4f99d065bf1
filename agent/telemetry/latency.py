"""How long the agent takes to answer the kubelet, as histograms comparable with the kubelet's own.

The kubelet measures, from its side, ``kubelet_device_plugin_alloc_duration_seconds{resource_name}`` (an
Allocate call, per resource) and ``dra_operations_duration_seconds{operation_name, is_error}`` (preparing or
unpreparing all of a pod's claims), both with client_golang's default buckets (``metrics.DefBuckets``). Tessera
records the same operations from its side with the same buckets and label names, so the two can be put on one
graph: the difference is the gRPC transport and the kubelet's own work.

Recording is on the hot path of every Allocate and Prepare: ``observe`` is a dictionary lookup, a bisection and
two additions under a lock, with no allocation once a series exists. The series are copied out once per metrics
collection (``families``).

One ``OperationLatency`` per agent, made by whoever wires the front ends (no module-level registry): the device
plugin servers and the DRA service record into it, the telemetry collector exposes it. Made before the first
resource is served, so this module imports nothing the agent's start does not already have.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agent.telemetry.exposition import Family

DEFAULT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)  # client_golang's DefBuckets
PREPARE = "PrepareResources"  # the kubelet's operation_name values
UNPREPARE = "UnprepareResources"


class Histogram:
    """Cumulative-on-read counts per label values; thread-safe."""

    def __init__(self, name: str, documentation: str, labels: Sequence[str], bounds: Sequence[float]) -> None:
        self.name, self.documentation, self.labels = name, documentation, tuple(labels)
        self.bounds = tuple(bounds)
        if list(self.bounds) != sorted(set(self.bounds)):
            raise ValueError(f"histogram {name}: bucket bounds must be distinct and ascending")
        self._lock = threading.Lock()
        self._series: dict[tuple[str, ...], list[float]] = {}  # values -> [count per bucket..., +Inf count, sum]

    def observe(self, values: tuple[str, ...], seconds: float) -> None:
        slot = bisect_left(self.bounds, seconds)  # le is inclusive: a value equal to a bound is in its bucket
        with self._lock:
            series = self._series.get(values)
            if series is None:
                if len(values) != len(self.labels):
                    raise ValueError(f"histogram {self.name}: {len(values)} label values for {len(self.labels)}")
                series = self._series[values] = [0.0] * (len(self.bounds) + 2)
            series[slot] += 1
            series[-1] += seconds

    def family(self, extra: tuple[str, ...] = (), extra_labels: Sequence[str] = ()) -> Family:
        """The histogram as a family; ``extra`` label values (the Hostname) are appended to every series."""
        from agent.telemetry.exposition import Buckets, histogram  # with the first collection, not at the agent's start

        family = histogram(self.name, self.documentation, [*self.labels, *extra_labels])
        with self._lock:
            copies = [(values, list(series)) for values, series in sorted(self._series.items())]
        for values, series in copies:
            cumulative, running = [], 0
            for count in series[:-1]:
                running += int(count)
                cumulative.append(running)
            family.add_metric((*values, *extra), Buckets(self.bounds, tuple(cumulative), series[-1]))
        return family


class OperationLatency:
    """The agent's answers to the kubelet, timed by the servers that give them (seconds, from a monotonic clock)."""

    def __init__(self, bounds: Sequence[float] = DEFAULT_BUCKETS) -> None:
        self.allocate = Histogram(
            "tessera_device_plugin_alloc_duration_seconds",
            "seconds to answer a kubelet Allocate call, per resource (compare kubelet_device_plugin_alloc_duration_"
            "seconds)",
            ["resource_name"],
            bounds,
        )
        self.preferred = Histogram(
            "tessera_device_plugin_preferred_allocation_duration_seconds",
            "seconds to answer a kubelet GetPreferredAllocation call, per resource",
            ["resource_name"],
            bounds,
        )
        self.dra = Histogram(
            "tessera_dra_operations_duration_seconds",
            "seconds to answer a kubelet NodePrepareResources or NodeUnprepareResources call, by operation and "
            "whether any claim failed (compare dra_operations_duration_seconds)",
            ["operation_name", "is_error"],
            bounds,
        )

    def observe_allocate(self, resource: str, seconds: float) -> None:
        self.allocate.observe((resource,), seconds)

    def observe_preferred_allocation(self, resource: str, seconds: float) -> None:
        self.preferred.observe((resource,), seconds)

    def observe_prepare(self, seconds: float, *, error: bool) -> None:
        self.dra.observe((PREPARE, "true" if error else "false"), seconds)

    def observe_unprepare(self, seconds: float, *, error: bool) -> None:
        self.dra.observe((UNPREPARE, "true" if error else "false"), seconds)

    def families(self, hostname: str) -> list[Family]:
        return [h.family((hostname,), ("Hostname",)) for h in (self.allocate, self.preferred, self.dra)]
