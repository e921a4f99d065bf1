"""Where path (b) finds containers: the agent's options for the memory-limits room (no heavy imports)."""

from __future__ import annotations

from pathlib import Path

from msgspec import Struct


class MemoryLimitSettings(Struct, frozen=True):
    cgroup_root: Path = Path("/sys/fs/cgroup")  # the host's cgroup (v2) hierarchy, as the agent sees it
    container_logs: Path = Path("/var/log/containers")  # the kubelet's log links: container name -> ID
    recheck_seconds: float = 30.0  # the safety re-check: limits changed behind the agent's back are found then
