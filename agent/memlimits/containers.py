"""Which cgroup a container has, found from what the kubelet leaves on the node, without the CRI.

PodResources names a container by namespace, pod and container name; NVML wants its cgroup directory. The kubelet
links every container's log once it started as

    /var/log/containers/<pod>_<namespace>_<container>-<container ID>.log
        -> /var/log/pods/<namespace>_<pod>_<pod UID>/<container>/<restart>.log

(pod and namespace names are DNS names, without ``_``; a container name is a DNS label), which gives the pod UID
and the container ID. The container's cgroup is then one of the few the kubelet's cgroup drivers and the
runtimes name, under the cgroup root:

- systemd: ``kubepods.slice/[kubepods-<qos>.slice/]kubepods[-<qos>]-pod<uid, _ for ->.slice/<runtime>-<id>.scope``
  (``cri-containerd``, ``crio``, ``docker``);
- cgroupfs: ``kubepods/[<qos>/]pod<uid>/<id>``.

A link whose cgroup is gone (the container ended; its restarted successor has a link of its own) is skipped.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from msgspec import Struct

from agent.core.memlimits import ContainerRef

_LINK = re.compile(r"^(?P<pod>[^_/]+)_(?P<namespace>[^_/]+)_(?P<container>[^_/]+)-(?P<id>[0-9a-f]{64})\.log$")
_POD_LOGS = re.compile(r"^(?P<namespace>[^_/]+)_(?P<pod>[^_/]+)_(?P<uid>[0-9a-f-]{36})$")
_QOS = ("besteffort", "burstable", "")  # "": Guaranteed pods sit right under kubepods
_SCOPES = ("cri-containerd-{}.scope", "crio-{}.scope", "docker-{}.scope")
MAX_LINKS = 100_000  # a node runs at most a few hundred containers; more entries than this are not read

log = logging.getLogger(__name__)


class ContainerCgroup(Struct, frozen=True):
    container: ContainerRef
    pod_uid: str
    container_id: str
    cgroup: str  # the full path of its cgroup directory


def candidates(cgroup_root: Path, pod_uid: str, container_id: str) -> list[Path]:
    """Where the container's cgroup may be, systemd driver first."""
    under = pod_uid.replace("-", "_")
    found = []
    for qos in _QOS:
        parent = cgroup_root / "kubepods.slice"
        if qos:
            parent = parent / f"kubepods-{qos}.slice" / f"kubepods-{qos}-pod{under}.slice"
        else:
            parent = parent / f"kubepods-pod{under}.slice"
        found += [parent / scope.format(container_id) for scope in _SCOPES]
    for qos in _QOS:
        parent = cgroup_root / "kubepods" / qos / f"pod{pod_uid}" if qos else cgroup_root / "kubepods" / f"pod{pod_uid}"
        found.append(parent / container_id)
    return found


def parse_link(name: str, target: str) -> tuple[ContainerRef, str, str] | None:
    """(container, pod UID, container ID) of a log link, or None when it is not one of the kubelet's."""
    link = _LINK.match(name)
    if link is None:
        return None
    pod_dir = Path(target).parent.parent.name
    pod = _POD_LOGS.match(pod_dir)
    if pod is None or (pod["namespace"], pod["pod"]) != (link["namespace"], link["pod"]):
        return None
    return ContainerRef(link["namespace"], link["pod"], link["container"]), pod["uid"], link["id"]


class ContainerCgroups:
    """Scans the log links and finds each started container's cgroup; remembers what it found per link."""

    def __init__(self, container_logs: Path, cgroup_root: Path) -> None:
        self.container_logs = container_logs
        self.cgroup_root = cgroup_root
        self._known: dict[str, ContainerCgroup | None] = {}  # link name -> its container (None: not a container)
        self._over_bound = False  # the last scan stopped at MAX_LINKS (said once, until the directory shrinks)

    def scan(self) -> dict[ContainerRef, list[ContainerCgroup]]:
        """Every container with a live cgroup, by name (a restarted container may have two for a moment)."""
        found: dict[ContainerRef, list[ContainerCgroup]] = {}
        seen: set[str] = set()
        over_bound = False
        try:
            with os.scandir(self.container_logs) as entries:
                for count, entry in enumerate(entries):
                    if count >= MAX_LINKS:
                        over_bound = True
                        break
                    seen.add(entry.name)
                    container = self._container(entry.name, entry.path)
                    if container is not None and Path(container.cgroup).is_dir():
                        found.setdefault(container.container, []).append(container)
        except OSError:
            return {}
        if over_bound and not self._over_bound:
            log.warning(
                "container logs directory %s holds more than %d entries; only the first %d are read: a container "
                "whose log link is beyond them gets no memory limit", self.container_logs, MAX_LINKS, MAX_LINKS,
            )  # fmt: skip
        self._over_bound = over_bound
        for gone in self._known.keys() - seen:
            del self._known[gone]
        return found

    def _container(self, name: str, path: str) -> ContainerCgroup | None:
        if name in self._known and self._known[name] is not None:
            return self._known[name]
        try:
            target = str(Path(path).readlink())
        except OSError:
            self._known[name] = None
            return None
        parsed = parse_link(name, target)
        if parsed is None:
            self._known[name] = None
            return None
        container, uid, container_id = parsed
        for candidate in candidates(self.cgroup_root, uid, container_id):
            if candidate.is_dir():
                found = ContainerCgroup(container, uid, container_id, str(candidate))
                self._known[name] = found
                return found
        return None  # not (yet) there: looked for again next time
