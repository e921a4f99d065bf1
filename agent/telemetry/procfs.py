"""Which pod a GPU process belongs to, from ``<proc root>/<pid>``, checked against PID reuse.

NVML names a process by its PID only. Between NVML listing a process and this module reading its ``/proc`` entry
the process may exit, and its PID may be given to another process, perhaps in another pod. So each PID is read
with its start time (``/proc/<pid>/stat``, field 22, clock ticks since boot), and:

- a process that started after NVML's list was read is not the process NVML listed (``pid_reused``);
- a process whose entry is gone has exited (``exited``), and is nobody's;
- its cgroup is read again only when the start time of its PID changed (the same process keeps its pod), and
  the start time is read again after the cgroup, so a PID reused while its cgroup was read is caught too.

The pod UID comes from the cgroup path the kubelet gives a pod (``/kubepods/.../pod<uid>/...`` with the cgroupfs
driver, ``kubepods-<qos>-pod<uid with _>.slice`` with systemd; cgroup v1 has a line per controller, v2 one line).
A path outside ``kubepods`` (a host process, a container the kubelet did not start, the MPS server) has no pod
(``no_pod``). The proc root is configurable: in a container the host's /proc is mounted elsewhere, and tests
use a fake tree.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable
from enum import StrEnum
from pathlib import Path

from msgspec import Struct

HZ = os.sysconf("SC_CLK_TCK")  # the unit of /proc/<pid>/stat's start time
_KUBEPODS_POD = re.compile(
    r"kubepods[^\n]*?pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})(?![0-9a-f])"
)
MAX_CGROUP_BYTES = 64 << 10  # a process's cgroup file is a few hundred bytes; anything larger is not one
_START_FIELD = 19  # starttime (field 22) counted from the state (field 3), the first field after "(comm)"


class Unattributed(StrEnum):
    """Why a GPU process is nobody's: the value of the ``reason`` label."""

    NO_POD = "no_pod"  # its cgroup is no pod's: a host process, a container outside Kubernetes, an MPS server
    EXITED = "exited"  # gone before its /proc entry could be read
    PID_REUSED = "pid_reused"  # its PID now names a process that started after NVML listed it
    UNREADABLE = "unreadable"  # /proc/<pid> exists but cannot be read (permissions, a malformed file)
    NOT_HOLDING = "not_holding"  # a pod's, but the kubelet gave that pod no device here
    UNKNOWN_POD = "unknown_pod"  # a pod's, but the kubelet's assignments do not name the pod (yet)


class Owner(Struct, frozen=True):
    """A process as /proc tells it: its start (seconds since boot) and pod UID, or why it has none."""

    pid: int
    start: float | None
    pod_uid: str | None
    reason: Unattributed | None = None  # None exactly when pod_uid is set


def boot_clock() -> float:
    """Seconds since boot, the clock of /proc's start times (the same kernel's, in any container)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def pod_uid_in(cgroup: str) -> str | None:
    """The pod UID in a ``/proc/<pid>/cgroup`` text, with dashes; None outside any pod or when lines disagree."""
    found = {match[1].replace("_", "-") for match in _KUBEPODS_POD.finditer(cgroup)}
    return found.pop() if len(found) == 1 else None


class ProcessOwners:
    """PID -> pod UID, with the start-time checks above; remembers each PID's pod until its start time changes."""

    def __init__(self, proc_root: Path) -> None:
        self.proc_root = proc_root
        self._root = os.fspath(proc_root)  # paths as strings: a collection reads a stat file per GPU process
        self._known: dict[int, tuple[int, str | None]] = {}  # pid -> (start ticks, pod UID)

    def owners(self, pids: Iterable[int], listed_at: float | None = None) -> dict[int, Owner]:
        """Each PID's owner. ``listed_at``: the boot clock just before NVML's process lists were read (a process
        started later is not the one listed). PIDs not asked for are forgotten."""
        found: dict[int, Owner] = {}
        for pid in pids:
            if pid not in found:
                found[pid] = self._owner(pid, listed_at)
        for gone in self._known.keys() - found.keys():
            del self._known[gone]
        return found

    def _owner(self, pid: int, listed_at: float | None) -> Owner:
        if not isinstance(pid, int) or pid <= 0:  # a path component must be a plain PID
            return Owner(pid, None, None, Unattributed.UNREADABLE)
        ticks = self._start_ticks(pid)
        if not isinstance(ticks, int):
            self._known.pop(pid, None)
            return Owner(pid, None, None, ticks)
        start = ticks / HZ
        if listed_at is not None and start > listed_at:
            return Owner(pid, start, None, Unattributed.PID_REUSED)
        known = self._known.get(pid)
        if known is not None and known[0] == ticks:
            uid = known[1]
        else:
            try:
                with open(f"{self._root}/{pid}/cgroup", "rb") as file:  # noqa: PTH123 - a str path: no pathlib per read
                    text = file.read(MAX_CGROUP_BYTES).decode(errors="replace")
            except FileNotFoundError:
                return Owner(pid, start, None, Unattributed.EXITED)
            except OSError:
                return Owner(pid, start, None, Unattributed.UNREADABLE)
            if self._start_ticks(pid) != ticks:  # the PID changed hands while its cgroup was read
                self._known.pop(pid, None)
                return Owner(pid, start, None, Unattributed.PID_REUSED)
            uid = pod_uid_in(text)
            self._known[pid] = (ticks, uid)
        return Owner(pid, start, uid, None if uid else Unattributed.NO_POD)

    def _start_ticks(self, pid: int) -> int | Unattributed:
        try:
            with open(f"{self._root}/{pid}/stat", "rb") as file:  # noqa: PTH123 - as above
                text = file.read()
        except (FileNotFoundError, ProcessLookupError):
            return Unattributed.EXITED
        except OSError:
            return Unattributed.UNREADABLE
        try:  # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")"
            return int(text[text.rindex(b")") + 1 :].split()[_START_FIELD])
        except (ValueError, IndexError):
            return Unattributed.UNREADABLE
