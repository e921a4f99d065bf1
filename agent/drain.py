"""Is anything using these devices? The kubelet's word (PodResources) and NVML's (processes), together.

Runs on worker threads, never on the reconcile loop. Whatever cannot be known — the kubelet not
answering, NVML refusing a process list — makes the answer "busy", with the reason.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from agent.core.drain import Drain, busy_reasons
from agent.gpu.processes import ProcessesUnknown, device_processes
from agent.plugin.podresources import PodResourcesError, allocated_devices


def why_busy(drain: Drain, pod_resources_socket: Path, *, exclude_pids: Collection[int] = ()) -> list[str]:
    """Empty when no pod holds a withdrawn device and no process runs in a scope; else the reasons."""
    try:
        holders = allocated_devices(pod_resources_socket) if drain.withdrawn else {}
    except PodResourcesError as error:
        return [f"cannot tell whether pods hold the devices: {error}"]
    try:
        processes = device_processes(sorted(drain.scopes), exclude_pids=exclude_pids)
    except ProcessesUnknown as error:
        return [f"cannot tell whether processes run on the devices: {error}"]
    return busy_reasons(drain, holders, processes)
