"""Who holds each device right now: one answer, built from every source, as a pure value.

Two front ends (device plugin and DRA), a MIG manager, dynamic MIG, MPS and time-slicing can all change a GPU.
Before any of them does something that would disturb a workload — MIG mode, destroying a MIG device, a compute-mode
or time-slice change, quitting an MPS daemon, handing a GPU from one front end to the other — it asks the ledger,
and acts only when nothing it would disturb is held. The sources (read by the shell, ``agent.ledger``):

- the kubelet's PodResources: device-plugin allocations (advertised IDs, a replica as ``<physical>::<n>``) and the
  DRA claim devices containers use (``dynamic_resources``);
- the DRA checkpoint: claims being prepared (``PrepareStarted``) and prepared, admin access included, and the MIG
  devices made for them (recorded by placement before they exist);
- NVML: compute processes and MPS clients per GPU or MIG device.

A prepared claim often runs no process (an image being pulled, an idle notebook, a restarting container), which is
why the checkpoint is a source of its own. What a source could not tell is ``unknown``, and unknown counts as held.

A step names what it disturbs as a ``Drain`` (``agent.core.drain``): ``withdrawn`` physical device IDs (a GPU UUID
stands for the whole GPU, a MIG UUID for that MIG device) and ``scopes`` (GPU or MIG UUIDs on which no process may
run). ``Ledger.blocking`` answers with one reason per holder in the way, naming it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

from msgspec import Struct

from agent.core.inventory import Inventory

if TYPE_CHECKING:
    from agent.core.dra.checkpoint import Checkpoint


class Drain(Struct, frozen=True):
    """What a step disturbs: ``withdrawn`` physical device IDs, ``scopes`` where no process may run."""

    withdrawn: frozenset[str] = frozenset()
    scopes: frozenset[str] = frozenset()

    def __bool__(self) -> bool:
        return bool(self.withdrawn or self.scopes)

    def __or__(self, other: Drain) -> Drain:
        return Drain(self.withdrawn | other.withdrawn, self.scopes | other.scopes)


class Holder(Protocol):
    """A pod's container holding a device, as the kubelet's PodResources API reports it."""

    @property
    def namespace(self) -> str: ...
    @property
    def pod(self) -> str: ...
    @property
    def container(self) -> str: ...


class HoldKind(StrEnum):
    POD = "device-plugin pod"
    CLAIM = "DRA claim"
    PREPARING = "DRA claim being prepared"
    ADMIN = "DRA admin-access claim"
    CLAIM_POD = "pod of a DRA claim"
    PROCESS = "process"


CLAIM_KINDS = frozenset({HoldKind.CLAIM, HoldKind.PREPARING, HoldKind.ADMIN})


class Hold(Struct, frozen=True, order=True):
    """One holder of one device."""

    gpu: str  # the GPU the held device is on (its UUID; the device's own ID when the node does not know it)
    # a GPU or MIG UUID (a device-plugin replica as advertised, ``<uuid>::<n>``); a DRA device name while its MIG
    # device is not made yet
    device: str
    kind: HoldKind
    holder: str  # "default/train (main)", "claim default/gpu-claim", "pid 4242"
    claim_uid: str = ""  # the claim of a CLAIM, PREPARING or ADMIN hold
    daemon: str = ""  # the MPS daemon (its key) a claim's devices are served by
    placement: tuple[int, int] | None = None  # (GPU-instance profile ID, start) of a MIG device made for a claim

    def __str__(self) -> str:
        return f"{self.device} held by {self.holder} ({self.kind})"


class ClaimDevice(Struct, frozen=True):
    """One device of a recorded DRA claim, as the ledger needs it (``agent.ledger`` reads it from the checkpoint)."""

    claim_uid: str
    claim: str  # namespace/name
    device: str  # the DRA device name (gpu-0, gpu-0-mig-1g10gb-19-0)
    gpu_minor: int | None
    prepared: bool  # PrepareCompleted (else PrepareStarted: being prepared, or left half-way by a dead agent)
    admin: bool = False
    made_mig: str | None = None  # the UUID of the MIG device Prepare made for it
    placement: tuple[int, int] | None = None  # (GPU-instance profile ID, start) Prepare makes it at
    daemon: str = ""
    timeslice: bool = False  # Prepare set (or sets) the GPU's time-slice for it


class Ledger(Struct, frozen=True):
    holds: tuple[Hold, ...] = ()
    unknown: tuple[str, ...] = ()  # "cannot tell whether pods hold the devices: …": each counts as a holder

    def blocking(
        self, drain: Drain, *, other_than_claim: str | None = None, for_daemon: str | None = None
    ) -> list[str]:
        """Why the devices ``drain`` disturbs are not free, one line per holder in the way (empty: free).

        ``other_than_claim``: the acting claim's own holds are not in its way. ``for_daemon``: an MPS daemon's quit
        waits for the claims its devices serve, not for claims that have let it go (they are being unprepared)."""
        if not drain:
            return []
        reasons = [*self.unknown]
        pids: dict[str, list[str]] = {}
        for hold in sorted(set(self.holds)):
            if other_than_claim is not None and hold.claim_uid == other_than_claim and hold.kind in CLAIM_KINDS:
                continue
            if for_daemon is not None and hold.kind in CLAIM_KINDS and hold.daemon != for_daemon:
                continue
            if not _disturbed(hold, drain):
                continue
            if hold.kind is HoldKind.PROCESS:
                pids.setdefault(hold.device, []).append(hold.holder.removeprefix("pid "))
            else:
                reasons.append(str(hold))
        for uuid, listed in sorted(pids.items()):
            shown = sorted(listed, key=int)
            reasons.append(f"{uuid} runs {len(shown)} process(es) (pid {', '.join(shown[:5])})")
        return reasons

    def on_gpu(self, gpu_uuid: str, kinds: Collection[HoldKind] | None = None) -> tuple[Hold, ...]:
        return tuple(h for h in self.holds if h.gpu == gpu_uuid and (kinds is None or h.kind in kinds))

    def claimed_gpus(self) -> frozenset[str]:
        """The GPUs a recorded claim holds a device of (prepared, being prepared, admin access)."""
        return frozenset(h.gpu for h in self.holds if h.kind in CLAIM_KINDS)

    def claimed_placements(self, gpu_uuid: str) -> frozenset[tuple[int, int]]:
        """The (GPU-instance profile ID, start) of every MIG device a claim has made or is making on the GPU."""
        return frozenset(h.placement for h in self.holds if h.gpu == gpu_uuid and h.placement is not None)

    def claimed_migs(self) -> frozenset[str]:
        return frozenset(h.device for h in self.holds if h.kind in CLAIM_KINDS and h.device.startswith("MIG-"))


def _disturbed(hold: Hold, drain: Drain) -> bool:
    if hold.kind is HoldKind.PROCESS:
        return hold.device in drain.scopes
    if hold.kind is HoldKind.POD:
        return hold.device.split("::", 1)[0] in drain.withdrawn
    # a claim (or a pod using one): its device when it is a UUID; a MIG device not made yet stands on its GPU
    if hold.device.startswith(("GPU-", "MIG-")):
        return hold.device in drain.withdrawn or hold.device in drain.scopes
    return hold.gpu in drain.withdrawn or hold.gpu in drain.scopes


# ----- building it from the sources -----------------------------------------------------------------------------


def _parents(inventory: Inventory) -> dict[str, str]:
    """Physical ID (GPU or MIG UUID) -> the GPU's UUID."""
    parents = {}
    for gpu in inventory.gpus:
        parents[gpu.uuid] = gpu.uuid
        for mig in gpu.mig_devices:
            parents[mig.uuid] = gpu.uuid
    return parents


def pod_holds(holders: Mapping[str, Holder], inventory: Inventory) -> list[Hold]:
    """Device-plugin allocations: advertised ID (``<physical>::<n>`` for a replica) -> the pod's container."""
    parents = _parents(inventory)
    holds = []
    for device_id, h in holders.items():
        physical = device_id.split("::", 1)[0]
        holder = f"{h.namespace}/{h.pod} ({h.container})"
        holds.append(Hold(parents.get(physical, physical), device_id, HoldKind.POD, holder))
    return holds


def admitting_holds(device_ids: Iterable[str], inventory: Inventory) -> list[Hold]:
    """Devices an Allocate call answered for that PodResources does not list yet (the kubelet records them next)."""
    parents = _parents(inventory)
    holds = []
    for device_id in device_ids:
        physical = device_id.split("::", 1)[0]
        who = "a pod the kubelet is admitting (Allocate answered, not yet in PodResources)"
        holds.append(Hold(parents.get(physical, physical), device_id, HoldKind.POD, who))
    return holds


def process_holds(processes: Mapping[str, Iterable[int]], inventory: Inventory) -> list[Hold]:
    """Scope UUID -> the PIDs NVML lists there (compute processes and MPS clients)."""
    parents = _parents(inventory)
    return [
        Hold(parents.get(uuid, uuid), uuid, HoldKind.PROCESS, f"pid {pid}")
        for uuid, pids in processes.items()
        for pid in pids
    ]


def claim_holds(devices: Iterable[ClaimDevice], inventory: Inventory) -> list[Hold]:
    """The recorded claims' devices: by UUID where the node has it (a made or static MIG device, a whole GPU), else
    by name on the GPU its name carries."""
    from agent.core.dra.devices import gpu_device_name, mig_device_name  # DRA's naming, loaded with the first claim

    by_minor = {g.minor_number: g for g in inventory.gpus}
    names = {}
    for gpu in inventory.gpus:
        names[gpu_device_name(gpu)] = gpu.uuid
        names.update({mig_device_name(gpu, m): m.uuid for m in gpu.mig_devices})
    holds = []
    for d in devices:
        gpu = by_minor.get(d.gpu_minor) if d.gpu_minor is not None else None
        kind = HoldKind.ADMIN if d.admin else HoldKind.CLAIM if d.prepared else HoldKind.PREPARING
        device = d.made_mig or (d.device if d.placement is not None else names.get(d.device, d.device))
        holds.append(
            Hold(gpu.uuid if gpu else device, device, kind, f"claim {d.claim}", d.claim_uid, d.daemon, d.placement)
        )
    return holds


def claim_pod_holds(
    users: Mapping[tuple[str, str, str, str], Collection[tuple[str, str]]],
    pool: str,
    devices: Iterable[ClaimDevice],
    inventory: Inventory,
) -> list[Hold]:
    """Pods the kubelet says use a claim's device (PodResources ``dynamic_resources``), for this driver's pool:
    (claim namespace, claim name, pool, device) -> the pods. A claim the checkpoint does not know (a lost
    checkpoint) is placed by its device's name."""
    from agent.core.dra.devices import gpu_minor_of

    recorded = {(d.claim, d.device): d for d in devices}
    holds = []
    for (namespace, name, device_pool, device), pods in users.items():
        if device_pool != pool:
            continue
        claim = f"{namespace}/{name}"
        record = recorded.get((claim, device)) or ClaimDevice("", claim, device, gpu_minor_of(device), True)
        (placed,) = claim_holds([record], inventory)
        holds += [
            Hold(placed.gpu, placed.device, HoldKind.CLAIM_POD, f"{pod_ns}/{pod} (claim {claim})")
            for pod_ns, pod in sorted(pods)
        ]
    return holds


def checkpoint_devices(checkpoint: Checkpoint) -> list[ClaimDevice]:
    """Every device of every recorded claim (``agent.core.dra.checkpoint``), as the ledger holds it."""
    from agent.core.dra.checkpoint import PREPARE_COMPLETED
    from agent.core.dra.devices import gpu_minor_of

    found = []
    for uid, claim in checkpoint.claims.items():
        daemon = claim.mps.key if claim.mps is not None else ""
        for d in claim.devices:
            mig = d.mig
            found.append(
                ClaimDevice(
                    claim_uid=uid,
                    claim=f"{claim.namespace}/{claim.name}",
                    device=d.device,
                    gpu_minor=gpu_minor_of(d.device),
                    prepared=claim.state == PREPARE_COMPLETED,
                    admin=d.admin_access,
                    made_mig=mig.uuid if mig is not None else None,
                    placement=(mig.profile_id, mig.start) if mig is not None else None,
                    daemon=daemon,
                    timeslice=d.timeslice is not None,
                )
            )
    return found
