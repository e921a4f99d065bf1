"""GPU memory the driver enforces per container, the pure part: what each container should be held to, and how.

Since driver r615 NVML holds a cgroup to a memory request (soft limit: guaranteed) and limit (hard limit:
allocations above it fail) on one GPU (``nvmlDeviceSetMemoryLimits_v1``). A container given devices of a known
size is held to their sum on each GPU: request = limit = its share (bursting above the share is a later config).

Where the sizes come from (``sized_devices``): MPS replicas with a memory size (``gpu-10gb`` style: every
replica of an MPS resource is given the daemon's per-client pinned-memory limit, ``Resource.limits_of``),
time-sliced replicas given a ``memoryLimit`` (Tessera's extension; with ``memoryBurstLimit`` the hard limit is
above the request), and DRA shares' ``memory`` consumed capacity (``claim_sizes``). A time-sliced replica without
a size or a whole GPU has none: it may use all of its device.

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
    size: int  # bytes: what its holder is guaranteed (the request)
    server_default: bool  # the GPU's MPS server holds every client to this size by default (a fallback)
    claim: str | None = None  # "namespace/name" of a DRA claim; None for a device-plugin device
    burst: int | None = None  # bytes: the hard limit when above ``size`` (a time-sliced replica's memoryBurstLimit)

    @property
    def limit(self) -> int:
        return self.size if self.burst is None else self.burst


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
    """Device ID -> its size, for the plan's MPS replicas and sized time-sliced replicas (the device-plugin
    devices with a memory size)."""
    sized: dict[str, SizedDevice] = {}
    for resource in plan.resources:
        mps = resource.sharing is Sharing.MPS and resource.mps is not None
        if not mps and (resource.sharing is not Sharing.TIME_SLICING or resource.memory is None):
            continue
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


@dataclass(frozen=True, slots=True)
class ResourceEnforcement:
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


TOOLKIT_HOOK = "apply-cuda-memory-limits"  # NVIDIA Container Toolkit v1.20.1+


def toolkit_hook(gpu_uuid: str, *, driver_root: str = "/", hook_path: str = "/usr/bin/nvidia-ctk") -> dict[str, object]:
    """The CDI ``containerEdits.hooks`` entry that has the container toolkit apply ``NVIDIA_GPU_MEMORY_REQUEST`` /
    ``NVIDIA_GPU_MEMORY_LIMIT`` to the container's cgroup for one GPU, before the workload runs (one per GPU, as the
    toolkit's own discoverer adds it). A seam for a CDI spec that names the device plugin's devices: Allocate gives
    the variables (``agent.core.allocation.memory_limit_envs``); without the hook the agent's own path sets the
    limits once the container started."""
    return {
        "hookName": "createRuntime",
        "path": hook_path,
        "args": ["nvidia-ctk", "hook", TOOLKIT_HOOK, "--driver-root", driver_root, "--gpu-id", gpu_uuid],
    }
