"""GPU memory the driver enforces per container, the pure part: what each container should be held to, and how.

Since driver r615 NVML holds a cgroup to a memory request (soft limit: guaranteed) and limit (hard limit:
allocations above it fail) on one GPU (``nvmlDeviceSetMemoryLimits_v1``). A container given devices of a known
size is held to their sum on each GPU: request = limit = its share (bursting above the share is a later config).

Where the sizes come from (``sized_devices``): MPS replicas with a memory size (``gpu-10gb`` style: every
replica of an MPS resource is given the daemon's per-client pinned-memory limit, ``Resource.memory_of``), and
DRA shares' ``memory`` consumed capacity (``claim_sizes``). A time-sliced replica or a whole GPU has no size: it
may use all of its device.

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
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

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


@dataclass(frozen=True, slots=True, order=True)
class ContainerRef:
    namespace: str
    pod: str
    container: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.pod}/{self.container}"


@dataclass(frozen=True, slots=True)
class SizedDevice:
    """An advertised device (or a claim's device) that gives its holder a known amount of GPU memory."""

    device_id: str
    gpu_uuid: str  # the physical GPU
    gpu_index: int
    mig: bool  # a MIG device: the driver's limits are not supported on it
    size: int  # bytes
    server_default: bool  # the GPU's MPS server holds every client to this size by default (a fallback)
    claim: str | None = None  # "namespace/name" of a DRA claim; None for a device-plugin device


@dataclass(frozen=True, slots=True)
class Wanted:
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


@dataclass(frozen=True, slots=True)
class Verdict:
    enforcement: Enforcement
    reason: str


def sized_devices(plan: ResourcePlan) -> dict[str, SizedDevice]:
    """Device ID -> its size, for the plan's MPS replicas (the only device-plugin devices with a memory size)."""
    sized: dict[str, SizedDevice] = {}
    for resource in plan.resources:
        if resource.sharing is not Sharing.MPS or resource.mps is None:
            continue
        for device in resource.devices:
            sized[device.id] = SizedDevice(
                device_id=device.id,
                gpu_uuid=device.gpu_uuid,
                gpu_index=device.gpu_index,
                mig=device.mig_uuid is not None,
                size=resource.memory_of(device) * MIB,
                server_default=True,  # the resource's daemon sets this as every client's default pinned limit
            )
    return sized


def claim_sizes(checkpoint: Checkpoint | None, inventory: Inventory | None) -> dict[ClaimKey, SizedDevice]:
    """(claim namespace, claim name, pool, device) -> its size, for the prepared claims' shares of a GPU (the
    ``memory`` they consume). Their clients are held by ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` in the claim's CDI
    edits only: a client-side limit a container can drop, so without the driver a share is advisory."""
    if checkpoint is None or inventory is None:
        return {}
    from agent.core.dra.checkpoint import PREPARE_COMPLETED
    from agent.core.dra.devices import gpu_minor_of

    by_minor = {gpu.minor_number: gpu for gpu in inventory.gpus}
    sized: dict[ClaimKey, SizedDevice] = {}
    for claim in checkpoint.claims.values():
        if claim.state != PREPARE_COMPLETED:
            continue
        for device in claim.devices:
            minor = gpu_minor_of(device.device)
            gpu = by_minor.get(minor) if minor is not None else None
            if device.share is None or device.admin_access or gpu is None or device.mig is not None:
                continue
            name = f"{claim.namespace}/{claim.name}"
            sized[(claim.namespace, claim.name, device.pool, device.device)] = SizedDevice(
                device_id=f"{name}/{device.device}",
                gpu_uuid=gpu.uuid,
                gpu_index=gpu.index,
                mig=False,
                size=device.share.memory,
                server_default=False,
                claim=name,
            )
    return sized


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
        total = sum(d.size for d in devices)
        wanted.append(
            Wanted(
                container=container,
                gpu_uuid=gpu_uuid,
                gpu_index=devices[0].gpu_index,
                request=total,
                limit=total,
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
    if not wanted.mig and driver_refusal is None:
        return Verdict(Enforcement.DRIVER, "nvmlDeviceSetMemoryLimits_v1 on the container's cgroup")
    why = "MIG devices have no per-cgroup limits" if wanted.mig else driver_refusal
    if wanted.server_default:
        return Verdict(Enforcement.MPS, f"{why}; the MPS server's default per-client limit holds it")
    return Verdict(
        Enforcement.ADVISORY,
        f"{why}; only the client's own CUDA_MPS_PINNED_DEVICE_MEM_LIMIT holds it, which a container can drop",
    )


def holds(wanted: Wanted, soft: int, hard: int) -> bool:
    """Whether limits read back from the driver are the ones wanted."""
    return soft == wanted.request and hard == wanted.limit
