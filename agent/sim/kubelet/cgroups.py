"""What starting a container leaves on the node's filesystem: its cgroup, its log link, its processes' /proc entries.

A real kubelet with the systemd cgroup driver and containerd gives each container a cgroup (v2) directory

    <cgroup root>/kubepods.slice/kubepods-<qos>.slice/kubepods-<qos>-pod<uid, _ for ->.slice/cri-containerd-<id>.scope

(``Guaranteed`` pods sit right under ``kubepods.slice``), and, once the container started, the legacy log link

    <log root>/containers/<pod>_<namespace>_<container>-<id>.log
        -> <log root>/pods/<namespace>_<pod>_<uid>/<container>/0.log

which is how a node agent tells a container's name from its ID without the CRI. Each process in the container has
``/proc/<pid>/cgroup`` = ``0::/kubepods.slice/.../cri-containerd-<id>.scope``. The emulator makes all three in
directories a test points the agent at (the simulated pods carry no QoS requests, so they are ``BestEffort``).
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path

from msgspec import Struct


class StartedContainer(Struct, frozen=True):
    namespace: str
    pod: str
    pod_uid: str
    name: str
    id: str  # 64 hex digits, as containerd's
    cgroup: Path  # the full path of its cgroup directory
    relative_cgroup: str  # as /proc/<pid>/cgroup names it: "/kubepods.slice/..."

    @property
    def proc_cgroup(self) -> str:
        """The contents of ``/proc/<pid>/cgroup`` for a process of this container (cgroup v2: one line)."""
        return f"0::{self.relative_cgroup}\n"


def pod_slice(uid: str, qos: str = "besteffort") -> str:
    """The pod's cgroup, relative to the cgroup root (systemd driver)."""
    name = f"kubepods-{qos}-pod{uid.replace('-', '_')}.slice"
    return f"/kubepods.slice/kubepods-{qos}.slice/{name}"


class ContainerFiles:
    """Cgroup directories and log links of the containers the emulator starts."""

    def __init__(self, cgroup_root: Path, log_root: Path) -> None:
        self.cgroup_root = Path(cgroup_root)
        self.log_root = Path(log_root)
        self.cgroup_root.mkdir(parents=True, exist_ok=True)
        (self.log_root / "containers").mkdir(parents=True, exist_ok=True)

    @property
    def container_logs(self) -> Path:
        """``/var/log/containers``: what the agent watches for containers that start."""
        return self.log_root / "containers"

    def start(self, namespace: str, pod: str, pod_uid: str, name: str) -> StartedContainer:
        """The runtime creates the container's cgroup, then the kubelet links its log once it started."""
        container_id = uuid.uuid4().hex + uuid.uuid4().hex
        relative = f"{pod_slice(pod_uid)}/cri-containerd-{container_id}.scope"
        cgroup = self.cgroup_root / relative.lstrip("/")
        cgroup.mkdir(parents=True)
        log_dir = self.log_root / "pods" / f"{namespace}_{pod}_{pod_uid}" / name
        log_dir.mkdir(parents=True, exist_ok=True)
        (log_dir / "0.log").touch()
        link = self.container_logs / f"{pod}_{namespace}_{name}-{container_id}.log"
        link.symlink_to(log_dir / "0.log")
        return StartedContainer(namespace, pod, pod_uid, name, container_id, cgroup, relative)

    def remove_pod(self, namespace: str, pod: str, pod_uid: str) -> None:
        """The pod is gone: its log links, its log directory and its cgroups go with it."""
        for link in self.container_logs.glob(f"{pod}_{namespace}_*.log"):
            link.unlink(missing_ok=True)
        shutil.rmtree(self.log_root / "pods" / f"{namespace}_{pod}_{pod_uid}", ignore_errors=True)
        slice_dir = self.cgroup_root / pod_slice(pod_uid).lstrip("/")
        if slice_dir.is_dir():  # cgroup directories are removed bottom-up, as rmdir on cgroupfs needs
            for directory, _, _ in sorted(os.walk(slice_dir), key=lambda entry: -len(entry[0])):
                Path(directory).rmdir()


def write_proc_entry(proc_root: Path, pid: int, container: StartedContainer, started: float | None = None) -> None:
    """``<proc root>/<pid>``: ``cgroup`` naming the container's cgroup and a ``stat`` with its start time (the boot
    clock; now by default), as a process of the container has."""
    entry = Path(proc_root) / str(pid)
    entry.mkdir(parents=True, exist_ok=True)
    (entry / "cgroup").write_text(container.proc_cgroup)
    ticks = int((time.clock_gettime(time.CLOCK_BOOTTIME) if started is None else started) * os.sysconf("SC_CLK_TCK"))
    fields = f"{pid} (python3 worker) S 1 {pid} {pid} 0 -1 4194560 " + "0 " * 12 + f"{ticks} 1000 10\n"
    (entry / "stat").write_text(fields)
