"""GPU memory the driver enforces per container, the pure part: what each container should be held to, and how.

Since driver r615 NVML holds a cgroup to a memory request (soft limit: guaranteed) and limit (hard limit:
allocations above it fail) on one GPU (``nvmlDeviceSetMemoryLimits_v1``). A container given devices of a known
size is held to their sum on each GPU: request = limit = its share (bursting above the share is a later config).

Where the sizes come from (``sized_devices``): MPS replicas with a memory size (``gpu-10gb`` style: every
replica of an MPS resource is given the daemon's per-client pinned-memory limit, ``Resource.limits_of``),
time-sliced replicas given a ``memoryLimit`` (Tessera's extension; with ``memoryBurstLimit`` the hard limit is
above the request), and DRA claims' whole GPUs (``claim_sizes``): a share's ``memory`` consumed capacity, an MPS
claim's ``GpuConfig`` pinned memory limit. A time-sliced replica without a size or a whole GPU has none: it may use
all of its device. ``DriverReport`` is what the room tells the loop, so a DRA share says whether the driver holds
it.

How a size is enforced (``enforcement``), said out loud for each device, never silently:

- ``driver``: the driver has the call, the agent may make it, and the device is a full GPU (not MIG);
- ``mps``: else, when the GPU's MPS server holds every client to the same default limit (an MPS resource's
  replicas, which are all equal), the server's default does it;
- ``advisory``: else nothing holds the container to its size but its own goodwill (a client-side MPS variable
  it may drop).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Iterable, Mapping
from enum import StrEnum
from types import MappingProxyType
from typing import TYPE_CHECKING

from msgspec import Struct, field

from agent.core.resources import ResourcePlan, Sharing

if TYPE_CHECKING:
    from agent.core.dra.checkpoint import Checkpoint
    from agent.core.inventory import Inventory

MIB = 1 << 20
ClaimKey = tuple[str, str, str, str]  # a claim's namespace and name, its device's pool and name
NO_LIMIT = 0xFFFFFFFFFFFFFFFF  # NVML_DEVICE_MEMORY_LIMIT_MAX


class Enforcement(StrEnum):
    DRIVER = "driver"
    MPS = "mps"
    ADVISORY = "advisory"


class ContainerRef(Struct, frozen=True, order=True):
    namespace: str
    pod: str
    container: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.pod}/{self.container}"


class SizedDevice(Struct, frozen=True):
    """An advertised device (or a claim's device) that gives its holder a known amount of GPU memory."""

    device_id: str
    gpu_uuid: str  # the physical GPU
    gpu_index: int
    mig: bool  # a MIG device: the driver's limits are not supported on it
    size: int  # bytes: what its holder is guaranteed (the request)
    server_default: bool  # the GPU's MPS server holds every client to this size by default (a fallback)
    claim: str | None = None  # "namespace/name" of a DRA claim; None for a device-plugin device
    burst: int | None = None  # bytes: the hard limit when above ``size`` (a time-sliced replica's memoryBurstLimit)

    @property
    def limit(self) -> int:
        return self.size if self.burst is None else self.burst


class Wanted(Struct, frozen=True):
    """What one container should be held to on one GPU: the sum of the sizes of its devices there."""

    container: ContainerRef
    gpu_uuid: str
    gpu_index: int
    request: int  # bytes: the soft limit
    limit: int  # bytes: the hard limit
    devices: tuple[str, ...]
    mig: bool
    server_default: bool
    claim: str | None = None


class Verdict(Struct, frozen=True):
    enforcement: Enforcement
    reason: str


def sized_devices(plan: ResourcePlan) -> dict[str, SizedDevice]:
    """Device ID -> its size, for the plan's MPS replicas and sized time-sliced replicas (the device-plugin
    devices with a memory size)."""
    sized: dict[str, SizedDevice] = {}
    for resource in plan.resources:
        if not resource.sized:
            continue
        mps = resource.sharing is Sharing.MPS
        for device in resource.devices:
            limits = resource.limits_of(device)
            if limits is None:
                continue
            request, limit = limits
            sized[device.id] = SizedDevice(
                device_id=device.id,
                gpu_uuid=device.gpu_uuid,
                gpu_index=device.gpu_index,
                mig=device.mig_uuid is not None,
                size=request * MIB,
                server_default=mps,  # an MPS resource's daemon sets this as every client's default pinned limit
                burst=limit * MIB if limit != request else None,
            )
    return sized


def unsized_holders(
    plan: ResourcePlan, holders: Iterable[tuple[str, ContainerRef]], sizes: Mapping[Hashable, SizedDevice]
) -> list[tuple[str, ContainerRef]]:
    """(GPU UUID, container) of each container holding one of the plan's devices without a size on a whole GPU (MIG
    devices have no per-container limits): where a limit an earlier agent set may be left over. ``holders``: (device
    ID, the container PodResources says holds it) pairs."""
    gpus = {d.id: d.gpu_uuid for r in plan.resources for d in r.devices if d.mig_uuid is None and d.id not in sizes}
    return [(gpus[device_id], container) for device_id, container in holders if device_id in gpus]


def claim_sizes(checkpoint: Checkpoint | None, inventory: Inventory | None) -> dict[ClaimKey, SizedDevice]:
    """(claim namespace, claim name, pool, device) -> its size, for the prepared claims' whole GPUs that have one:
    a share of a GPU (the ``memory`` it consumes) or a GPU of an MPS claim whose ``GpuConfig`` gives it a pinned
    memory limit (``defaultPinnedDeviceMemoryLimit`` / ``defaultPerDevicePinnedMemoryLimit``). Their clients are
    held by ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` in the claim's CDI edits only: a client-side limit a container can
    drop, so without the driver such a size is advisory (a share's MPS server may hold it: ``agent.core.dra.mps``).
    MIG devices have no per-container limits and are left out."""
    if checkpoint is None or inventory is None:
        return {}
    from agent.core.dra.checkpoint import PREPARE_COMPLETED
    from agent.core.dra.devices import gpu_minor_of
    from agent.core.dra.mps import memory_sizes

    by_minor = {gpu.minor_number: gpu for gpu in inventory.gpus}
    sized: dict[ClaimKey, SizedDevice] = {}
    for claim in checkpoint.claims.values():
        if claim.state != PREPARE_COMPLETED:
            continue
        sizes = memory_sizes(claim.mps)  # MiB per GPU UUID: what its CDI edits give the claim's containers too
        for device in claim.devices:
            minor = gpu_minor_of(device.device)
            gpu = by_minor.get(minor) if minor is not None else None
            whole = gpu is not None and device.device == f"gpu-{minor}" and device.mig is None
            if device.admin_access or gpu is None or not whole:
                continue
            # the MPS record's size first: a share counted in `shares` consumes no memory capacity, yet its
            # containers get their part of the GPU's memory (agent.core.dra.shares.limits)
            size = sizes.get(gpu.uuid, 0) * MIB or (device.share.memory if device.share is not None else 0)
            if not size:
                continue
            name = f"{claim.namespace}/{claim.name}"
            sized[(claim.namespace, claim.name, device.pool, device.device)] = SizedDevice(
                device_id=f"{name}/{device.device}",
                gpu_uuid=gpu.uuid,
                gpu_index=gpu.index,
                mig=False,
                size=size,
                server_default=False,
                claim=name,
            )
    return sized


class DriverReport(Struct, frozen=True):
    """What the memory-limits room tells the reconcile loop after each look, for the DRA shares' status: on which
    GPUs the driver can hold containers (``capable``: the call answered; not MIG), why it cannot elsewhere
    (``refusals``: GPU UUID, or ``*`` for every GPU), and how each claim's containers are held now (``claims``:
    (claim ``namespace/name``, GPU UUID) -> each container's enforcement)."""

    capable: frozenset[str] = frozenset()
    refusals: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    claims: Mapping[tuple[str, str], tuple[Enforcement, ...]] = field(default_factory=lambda: MappingProxyType({}))

    def holds(self, claim: str, gpu_uuid: str) -> bool:
        """Whether the driver holds ``claim``'s containers on ``gpu_uuid`` to their size: the GPU is one it can
        limit, and every container of the claim found there is held by it (none started yet: each will be, as it
        starts). False on a MIG device (never ``capable``), an older driver, a refusal (not root)."""
        if gpu_uuid not in self.capable or "*" in self.refusals or gpu_uuid in self.refusals:
            return False
        return all(how is Enforcement.DRIVER for how in self.claims.get((claim, gpu_uuid), ()))


def wanted_limits(
    sizes: Mapping[Hashable, SizedDevice], holders: Iterable[tuple[Hashable, ContainerRef]]
) -> list[Wanted]:
    """Per container and GPU, the sum of the sizes of the devices it holds there; sorted, so the same holders give
    the same list. ``holders``: (device ID or claim device key, a container PodResources says uses it) pairs; a claim
    used by several containers holds each of them to its size."""
    grouped: dict[tuple[ContainerRef, str], list[SizedDevice]] = defaultdict(list)
    for key, container in holders:
        device = sizes.get(key)
        if device is not None and device not in grouped[(container, device.gpu_uuid)]:
            grouped[(container, device.gpu_uuid)].append(device)
    wanted = []
    for (container, gpu_uuid), devices in sorted((k, v) for k, v in grouped.items() if v):
        wanted.append(
            Wanted(
                container=container,
                gpu_uuid=gpu_uuid,
                gpu_index=devices[0].gpu_index,
                request=sum(d.size for d in devices),
                limit=sum(d.limit for d in devices),
                devices=tuple(sorted(d.device_id for d in devices)),
                mig=any(d.mig for d in devices),
                server_default=all(d.server_default for d in devices),
                claim=", ".join(sorted({d.claim for d in devices if d.claim})) or None,
            )
        )
    return wanted


def enforcement(wanted: Wanted, *, driver_refusal: str | None) -> Verdict:
    """How ``wanted`` is enforced. ``driver_refusal``: why the driver cannot do it on this GPU (the call is missing,
    the agent is not root, the call failed), None when it can."""
    return _verdict(wanted.mig, wanted.server_default, wanted.claim, driver_refusal)


def _verdict(mig: bool, server_default: bool, claim: str | None, driver_refusal: str | None) -> Verdict:
    if not mig and driver_refusal is None:
        return Verdict(Enforcement.DRIVER, "nvmlDeviceSetMemoryLimits_v1 on the container's cgroup")
    why = "MIG devices have no per-cgroup limits" if mig else driver_refusal
    if server_default:
        return Verdict(Enforcement.MPS, f"{why}; the MPS server's default per-client limit holds it")
    if claim is None:  # a time-sliced replica: no MPS server, no client variable
        return Verdict(
            Enforcement.ADVISORY,
            f"{why}; nothing holds a time-sliced replica to its size but the workload's own goodwill",
        )
    return Verdict(
        Enforcement.ADVISORY,
        f"{why}; only the client's own CUDA_MPS_PINNED_DEVICE_MEM_LIMIT holds it, which a container can drop",
    )


MIN_DRIVER = 615  # nvmlDeviceSetMemoryLimits_v1 came with driver r615


def driver_refusal(driver_version: str) -> str | None:
    """Why a driver of this version cannot hold containers to a size (None: it has the call)."""
    try:
        major = int(driver_version.split(".")[0])
    except ValueError:
        return f"driver {driver_version!r} is not a version this agent reads; memory limits need r{MIN_DRIVER}+"
    if major < MIN_DRIVER:
        return f"driver {driver_version} has no nvmlDeviceSetMemoryLimits_v1 (it needs r{MIN_DRIVER} or newer)"
    return None


class ResourceEnforcement(Struct, frozen=True):
    """What would hold a sized resource's containers on a node (``tessera plan``)."""

    resource: str
    request_mib: int  # per replica
    limit_mib: int
    enforcement: Enforcement
    reason: str

    def to_json(self) -> dict[str, object]:
        return {
            "request_mib": self.request_mib,
            "limit_mib": self.limit_mib,
            "enforcement": str(self.enforcement),
            "reason": self.reason,
        }


def plan_enforcement(plan: ResourcePlan, driver_version: str) -> list[ResourceEnforcement]:
    """Per sized resource of ``plan``, what would hold its containers to their size with this driver: the driver's
    limits (when the agent runs as root, as the DaemonSet does), else the MPS server, else nothing (advisory). A
    resource with devices of both kinds (MIG and not) is shown by its weakest."""
    refusal = driver_refusal(driver_version)
    found = []
    for resource in plan.resources:
        verdicts, sizes = [], set()
        for device in resource.devices:
            limits = resource.limits_of(device)
            if limits is None:
                continue
            sizes.add(limits)
            server = resource.sharing is Sharing.MPS
            verdicts.append(_verdict(device.mig_uuid is not None, server, None, refusal))
        if not verdicts:
            continue
        weakest = max(verdicts, key=lambda v: list(Enforcement).index(v.enforcement))
        request, limit = max(sizes)
        found.append(ResourceEnforcement(resource.name, request, limit, weakest.enforcement, weakest.reason))
    return found


def holds(wanted: Wanted, soft: int, hard: int) -> bool:
    """Whether limits read back from the driver are the ones wanted."""
    return soft == wanted.request and hard == wanted.limit
