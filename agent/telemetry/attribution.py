"""Which pod a GPU process belongs to, for shared GPUs where device IDs alone cannot tell.

The process's cgroup (``<proc root>/<pid>/cgroup``) names its pod UID; the kubelet's device-manager
checkpoint (next to the plugin sockets) maps pod UIDs to the device IDs their containers were given; the
PodResources API maps those device IDs to the pod's name, namespace and container. This is what
dcgm-exporter cannot do on shared GPUs.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

from agent.config.model import ConfigError
from agent.config.yaml_limits import read_bounded

_POD_UID = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")
CHECKPOINT = "kubelet_internal_checkpoint"
MAX_CHECKPOINT_BYTES = 64 << 20


def pod_uid_of(pid: int, proc_root: Path) -> str | None:
    """The pod UID in the process's cgroup path (cgroup v1 or v2, systemd or cgroupfs driver), if any."""
    try:
        text = (proc_root / str(int(pid)) / "cgroup").read_text(errors="replace")
    except (OSError, ValueError):
        return None
    match = _POD_UID.search(text)
    return match[1].replace("_", "-") if match else None


def devices_by_pod_uid(device_plugin_dir: Path) -> dict[str, set[str]]:
    """Pod UID -> the device IDs (any resource) its containers hold, from the kubelet's checkpoint.

    The checkpoint is read defensively: too large, not JSON, nested too deep or of another shape gives
    nothing (attribution falls back to PodResources), never an exception.
    """
    path = device_plugin_dir / CHECKPOINT
    try:
        document = json.loads(read_bounded(path, str(path), MAX_CHECKPOINT_BYTES))
    except (ConfigError, ValueError, RecursionError):  # missing, too big, not a regular file, not JSON
        return {}
    data = document.get("Data") if isinstance(document, dict) else None
    entries = data.get("PodDeviceEntries") if isinstance(data, dict) else None
    result: dict[str, set[str]] = defaultdict(set)
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, dict) or not isinstance(entry.get("PodUID"), str):
            continue
        ids = entry.get("DeviceIDs")
        groups = ids.values() if isinstance(ids, dict) else [ids]
        result[entry["PodUID"]].update(
            i for group in groups if isinstance(group, list) for i in group if isinstance(i, str)
        )
    return dict(result)
