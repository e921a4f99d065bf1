"""Which pod a GPU process belongs to, for shared GPUs where device IDs alone cannot tell.

The process's cgroup names its pod UID (``procfs``); the kubelet's device-manager
checkpoint (next to the plugin sockets) maps pod UIDs to the device IDs their containers were given; the
PodResources API maps those device IDs to the pod's name, namespace and container. This is what
dcgm-exporter cannot do on shared GPUs.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from msgspec import Struct

from agent.config.bounded import read_bounded
from agent.config.model import ConfigError

CHECKPOINT = "kubelet_internal_checkpoint"
MAX_CHECKPOINT_BYTES = 64 << 20


class Checkpoint(Struct, frozen=True):
    """What the kubelet's device checkpoint says: pod UID -> the device IDs (any resource) its containers hold.

    ``complete`` is False when some entry was not understood: the IDs read are then not all the kubelet handed out.
    """

    devices_by_pod: dict[str, set[str]]
    complete: bool

    def device_ids(self) -> set[str]:
        return set().union(*self.devices_by_pod.values())


def devices_by_pod_uid(device_plugin_dir: Path) -> dict[str, set[str]]:
    """Pod UID -> the device IDs (any resource) its containers hold, from the kubelet's checkpoint.

    The checkpoint is read defensively: too large, not JSON, nested too deep or of another shape gives
    nothing (attribution falls back to PodResources), never an exception.
    """
    checkpoint = read_checkpoint(device_plugin_dir)
    return checkpoint.devices_by_pod if checkpoint is not None else {}


def read_checkpoint(device_plugin_dir: Path) -> Checkpoint | None:
    """The kubelet's checkpoint; None when it is missing, unreadable or not of the kubelet's shape.

    A kubelet without allocations writes ``"PodDeviceEntries": null`` (a Go nil slice): that is a complete,
    empty checkpoint, not an unreadable one.
    """
    path = device_plugin_dir / CHECKPOINT
    try:
        document = json.loads(read_bounded(path, str(path), MAX_CHECKPOINT_BYTES))
    except (ConfigError, ValueError, RecursionError):  # missing, too big, not a regular file, not JSON
        return None
    data = document.get("Data") if isinstance(document, dict) else None
    if not isinstance(data, dict):
        return None
    entries = data.get("PodDeviceEntries")
    complete = isinstance(entries, list) or (entries is None and "PodDeviceEntries" in data)
    result: dict[str, set[str]] = defaultdict(set)
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, dict) or not isinstance(entry.get("PodUID"), str):
            complete = False
            continue
        ids = entry.get("DeviceIDs")
        groups = list(ids.values()) if isinstance(ids, dict) else [ids]
        if not all(isinstance(g, list) and all(isinstance(i, str) for i in g) for g in groups):
            complete = False
        result[entry["PodUID"]].update(
            i for group in groups if isinstance(group, list) for i in group if isinstance(i, str)
        )
    return Checkpoint(dict(result), complete)


class CheckpointReader:
    """Reads the checkpoint again only when the file changed, or ``max_age`` seconds after it was last read.

    The kubelet replaces the file (a new inode) whenever it writes it, so its identity, size and times tell a
    new checkpoint from the one read before, for the price of a ``stat``. The age bound covers what a ``stat``
    cannot tell: a same-sized file rewritten in place within one timestamp tick, or a recycled inode.
    """

    def __init__(
        self, device_plugin_dir: Path, max_age: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.device_plugin_dir = device_plugin_dir
        self._max_age = max_age
        self._clock = clock
        self._key: tuple[int, ...] | None = None
        self._read_at = 0.0
        self._last: Checkpoint | None = None

    def read(self) -> Checkpoint | None:
        try:
            info = (self.device_plugin_dir / CHECKPOINT).stat()
        except (OSError, ValueError):
            self._key = self._last = None
            return None
        key = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
        now = self._clock()
        if key != self._key or now - self._read_at >= self._max_age:
            self._key, self._read_at, self._last = key, now, read_checkpoint(self.device_plugin_dir)
        return self._last
