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
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from agent.core.resources import ResourcePlan, Sharing

MIB = 1 << 20
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
    equal_shares: bool  # every holder of this GPU's shares gets the same size from its MPS server's default
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
    equal_shares: bool
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
                equal_shares=True,  # one resource per GPU, its daemon's default pinned limit is the same for all
            )
    return sized


def wanted_limits(sizes: Mapping[str, SizedDevice], holders: Mapping[str, ContainerRef]) -> list[Wanted]:
    """Per container and GPU, the sum of the sizes of the devices it holds there; sorted, so the same holders give
    the same list. ``holders``: device ID -> the container PodResources says holds it."""
    grouped: dict[tuple[ContainerRef, str], list[SizedDevice]] = defaultdict(list)
    for device_id, container in holders.items():
        device = sizes.get(device_id)
        if device is not None:
            grouped[(container, device.gpu_uuid)].append(device)
    wanted = []
    for (container, gpu_uuid), devices in sorted(grouped.items()):
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
                equal_shares=all(d.equal_shares for d in devices),
                claim=devices[0].claim,
            )
        )
    return wanted


def enforcement(wanted: Wanted, *, driver_refusal: str | None) -> Verdict:
    """How ``wanted`` is enforced. ``driver_refusal``: why the driver cannot do it on this GPU (the call is missing,
    the agent is not root, the call failed), None when it can."""
    if not wanted.mig and driver_refusal is None:
        return Verdict(Enforcement.DRIVER, "nvmlDeviceSetMemoryLimits_v1 on the container's cgroup")
    why = "MIG devices have no per-cgroup limits" if wanted.mig else driver_refusal
    if wanted.equal_shares:
        return Verdict(Enforcement.MPS, f"{why}; the MPS server's default per-client limit holds it")
    return Verdict(Enforcement.ADVISORY, f"{why}; shares differ, so nothing but the client's own MPS limit holds it")


def holds(wanted: Wanted, soft: int, hard: int) -> bool:
    """Whether limits read back from the driver are the ones wanted."""
    return soft == wanted.request and hard == wanted.limit
