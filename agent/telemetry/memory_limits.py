"""Per-container GPU memory limits as metrics: what each pod's container is held to on each GPU, and what it uses.

``tessera_pod_gpu_memory_limit_bytes`` (the hard limit) and ``tessera_pod_gpu_memory_request_bytes`` (the soft
limit, the guaranteed part) come from the memory-limits room's snapshot, with ``enforcement`` saying what holds
them (``driver``, ``mps``, ``advisory``); ``tessera_pod_gpu_memory_limit_used_bytes`` is ``currentUsed`` of
``nvmlDeviceGetMemoryLimits_v1`` for the container's cgroups (driver-held containers only: it is the driver's own
count against the limit). Labels follow the per-pod metrics (dcgm-exporter's ``gpu``, ``UUID``, ``pod``,
``namespace``, ``container``, ``Hostname``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from agent.telemetry.exposition import Family, gauge

LABELS = ["gpu", "UUID", "pod", "namespace", "container", "claim", "enforcement", "Hostname"]


def read_used(rows: Iterable[Any]) -> dict[tuple[str, str], int]:
    """(GPU UUID, cgroup) -> bytes the driver counts against the limit, for driver-held rows; call inside an NVML
    session. A cgroup that cannot be read (gone meanwhile) is left out."""
    from agent.gpu.memory_limits import MemoryLimitError, read_memory_limits

    used: dict[tuple[str, str], int] = {}
    for row in rows:
        if str(row.enforcement) != "driver":
            continue
        for cgroup in row.cgroups:
            try:
                used[(row.gpu_uuid, cgroup)] = read_memory_limits(row.gpu_uuid, cgroup).used
            except MemoryLimitError:
                continue
    return used


def families(rows: Sequence[Any], used: dict[tuple[str, str], int], host: str) -> list[Family]:
    limit = gauge("tessera_pod_gpu_memory_limit_bytes", "GPU memory a container may allocate (hard limit)", LABELS)
    request = gauge("tessera_pod_gpu_memory_request_bytes", "GPU memory guaranteed to a container (soft limit)", LABELS)
    current = gauge(
        "tessera_pod_gpu_memory_limit_used_bytes",
        "GPU memory the driver counts against a container's limit (nvmlDeviceGetMemoryLimits_v1 currentUsed)",
        LABELS,
    )
    for row in rows:
        who = row.container
        labels = (str(row.gpu_index), row.gpu_uuid, who.pod, who.namespace, who.container, row.claim or "",
                  str(row.enforcement), host)  # fmt: skip
        limit.add_metric(labels, row.limit)
        request.add_metric(labels, row.request)
        counted = [used[(row.gpu_uuid, c)] for c in row.cgroups if (row.gpu_uuid, c) in used]
        if counted:
            current.add_metric(labels, sum(counted))
    return [limit, request, current]
