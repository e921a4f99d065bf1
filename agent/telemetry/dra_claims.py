"""DRA claims as telemetry sees them: which claim holds which physical device, and which pods use each claim.

Three inputs, all read-only:

- ``ClaimDevice`` values, one per device of a prepared claim: the claim's UID, namespace and name, the pool and
  device names the kubelet was given, and the MIG device Prepare made (dynamic MIG). ``claim_devices`` builds them
  from the DRA front end's checkpoint value (``agent.core.dra.checkpoint.Checkpoint``); the collector takes a
  callable returning them (``TelemetryCollector(claims=...)``).
- the kubelet's PodResources answer (``dynamic_resources``: per container the claims it uses and their pool and
  device names), read in the List the collector makes anyway, as dcgm-exporter reads it. It names pods by
  namespace and name, while a GPU process names its pod by UID (its cgroup), so the join is the device:
  ``podresources_claim_pods`` below.
- the kubelet's own DRA checkpoint (``<kubelet dir>/dra_manager_state``: per claim its UID, name, namespace and the
  UIDs of the pods it is reserved for), the fallback for a claim PodResources does not name (a kubelet before
  1.34, or with ``KubeletPodResourcesDynamicResources`` off). It is read, never written (a driver must never touch
  it), only when it changed, bounded and defensively: anything unexpected gives no pods (processes then stay
  unattributed, ``unknown_pod``), never an exception. A DaemonSet does not mount it.

Labels follow dcgm-exporter's DRA mapper: ``dra_claim_name``, ``dra_pool_name``, ``dra_device_name``,
``dra_mig_profile``, ``dra_mig_device_uuid``, with the claim's ``namespace``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from msgspec import Struct

from agent.config.bounded import read_bounded
from agent.config.model import ConfigError

if TYPE_CHECKING:
    from agent.core.dra.checkpoint import Checkpoint
    from agent.core.inventory import Inventory

KUBELET_DRA_STATE = "dra_manager_state"
MAX_STATE_BYTES = 64 << 20


class ClaimDevice(Struct, frozen=True):
    """One device of a prepared claim."""

    claim_uid: str
    namespace: str
    name: str
    pool: str
    device: str  # the DRA device name (``gpu-<minor>``, ``gpu-<minor>-mig-<profile>-<id>-<start>``)
    mig_uuid: str | None = None  # the MIG device Prepare made for it (dynamic MIG); else found by name


def claim_devices(checkpoint: Checkpoint) -> tuple[ClaimDevice, ...]:
    """The devices of every completed claim in the DRA front end's checkpoint (admin-access devices excluded:
    they watch a device, they do not hold it)."""
    from agent.core.dra.checkpoint import PREPARE_COMPLETED

    return tuple(
        ClaimDevice(uid, claim.namespace, claim.name, device.pool, device.device,
                    device.mig.uuid if device.mig is not None else None)
        for uid, claim in sorted(checkpoint.claims.items())
        if claim.state == PREPARE_COMPLETED
        for device in claim.devices
        if not device.admin_access
    )  # fmt: skip


class PhysicalClaim(Struct, frozen=True):
    """A claim device resolved on the node: the physical UUID it is, and its MIG profile ("" for a whole GPU)."""

    claim: ClaimDevice
    uuid: str
    gpu_uuid: str
    mig_profile: str


def resolve(claims: Iterable[ClaimDevice], inventory: Inventory | None) -> list[PhysicalClaim]:
    """Each claim device's physical UUID, by its device name on this node's inventory; a device not found (a MIG
    device being made, a GPU gone) is left out."""
    claims = tuple(claims)
    if not claims:
        return []  # the usual node without DRA: DRA's device naming is not even loaded
    from agent.core.dra.devices import gpu_device_name, mig_device_name

    names: dict[str, tuple[str, str, str]] = {}  # device name or MIG UUID -> (uuid, gpu uuid, profile)
    for gpu in inventory.gpus if inventory is not None else ():
        names[gpu_device_name(gpu)] = (gpu.uuid, gpu.uuid, "")
        for mig in gpu.mig_devices:
            names[mig_device_name(gpu, mig)] = names[mig.uuid] = (mig.uuid, gpu.uuid, mig.profile)
    found = []
    for claim in claims:
        where = names.get(claim.mig_uuid or "") or names.get(claim.device)
        if where is not None:
            found.append(PhysicalClaim(claim, *where))
    return found


class KubeletClaimPods:
    """Claim UID -> the UIDs of the pods it is reserved for, from the kubelet's DRA checkpoint; read again only
    when the file changed (a ``stat`` per collection otherwise)."""

    def __init__(self, kubelet_dir: Path) -> None:
        self.path = kubelet_dir / KUBELET_DRA_STATE
        self._key: tuple[int, ...] | None = None
        self._pods: dict[str, frozenset[str]] = {}

    def pods(self) -> dict[str, frozenset[str]]:
        try:
            info = self.path.stat()
        except (OSError, ValueError):
            self._key, self._pods = None, {}
            return self._pods
        key = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
        if key != self._key:
            self._key, self._pods = key, read_claim_pods(self.path)
        return self._pods


def read_claim_pods(path: Path) -> dict[str, frozenset[str]]:
    """The kubelet's ``dra_manager_state``: ``{"Data": "<JSON of a DRACheckpoint>", "Checksum": N}`` whose
    ``ClaimInfoStateList`` holds per claim ``ClaimUID`` and ``PodUIDs`` (a Go set: a JSON object, or a list)."""
    try:
        outer = json.loads(read_bounded(path, str(path), MAX_STATE_BYTES))
        data = outer.get("Data") if isinstance(outer, dict) else None
        inner = json.loads(data) if isinstance(data, str) else data
    except (ConfigError, ValueError, RecursionError):
        return {}
    entries = inner.get("ClaimInfoStateList") if isinstance(inner, dict) else None
    found: dict[str, frozenset[str]] = {}
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, dict) or not isinstance(entry.get("ClaimUID"), str):
            continue
        pods = entry.get("PodUIDs")
        uids = pods.keys() if isinstance(pods, dict) else pods if isinstance(pods, list) else ()
        found[entry["ClaimUID"]] = frozenset(uid for uid in uids if isinstance(uid, str))
    return found


def podresources_claim_pods(
    claims: Iterable[PhysicalClaim],
    users: Mapping[tuple[str, str, str, str], frozenset[tuple[str, str]]],
    pods_on: Mapping[str, frozenset[str]],
) -> dict[str, frozenset[str]]:
    """Claim UID -> the UIDs of its pods, for the claims whose devices PodResources names users of.

    ``users``: (claim namespace, claim name, pool, device) -> the pods (namespace, name) whose containers use it;
    ``pods_on``: physical UUID -> the UIDs of the pods running processes there that hold it through nothing else
    (no device-plugin device).

    PodResources names pods, /proc names pod UIDs: a process is the claim's when the kubelet gave its pod no other
    way onto the device, exactly one prepared claim holds the device, and no more pods run there than the claim
    serves. A device several claims share, or with more pods on it than the claim's, cannot tell whose a process
    is: the claim is left out (its processes stay ``unknown_pod``, its utilization unknown), never guessed.
    """
    holders_of: dict[str, int] = {}
    by_claim: dict[str, list[PhysicalClaim]] = {}
    for physical in claims:
        holders_of[physical.uuid] = holders_of.get(physical.uuid, 0) + 1
        by_claim.setdefault(physical.claim.claim_uid, []).append(physical)
    found: dict[str, frozenset[str]] = {}
    for uid, devices in by_claim.items():
        keys = [(d.claim.namespace, d.claim.name, d.claim.pool, d.claim.device) for d in devices]
        if not any(key in users for key in keys):
            continue  # PodResources does not name this claim: the kubelet's checkpoint may
        served: set[tuple[str, str]] = set().union(*(users.get(key, frozenset()) for key in keys))
        pods: set[str] = set()
        for device in devices:
            running = pods_on.get(device.uuid, frozenset())
            if running and holders_of[device.uuid] > 1:
                break
            pods |= running
        else:
            if len(pods) <= len(served):
                found[uid] = frozenset(pods)
    return found


def claim_holdings(
    claims: Iterable[PhysicalClaim], pods: Mapping[str, frozenset[str]]
) -> dict[str, dict[str, tuple[str, ...]]]:
    """Pod UID -> physical UUID -> the claim holding it for that pod (``("dra", namespace, claim UID)``)."""
    holdings: dict[str, dict[str, tuple[str, ...]]] = {}
    for physical in claims:
        claim = physical.claim
        for pod in pods.get(claim.claim_uid, ()):
            holdings.setdefault(pod, {})[physical.uuid] = ("dra", claim.namespace, claim.claim_uid)
    return holdings
