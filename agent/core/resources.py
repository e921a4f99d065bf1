"""What the node advertises: resources, their devices, and the plan that holds them."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from msgspec import Struct, field
from msgspec.structs import replace

GPU_RESOURCE = "nvidia.com/gpu"
RESOURCE_PREFIX = "nvidia.com/"


class MigStrategy(StrEnum):
    """How MIG devices are advertised; the same three strategies NVIDIA's device plugin has."""

    NONE = "none"  # every GPU is one nvidia.com/gpu, MIG devices are ignored
    SINGLE = "single"  # every MIG device is an nvidia.com/gpu; all must be of one profile
    MIXED = "mixed"  # every MIG device is nvidia.com/mig-<profile>


class Sharing(StrEnum):
    NONE = "none"
    TIME_SLICING = "time-slicing"
    MPS = "mps"


class AllocationPolicy(StrEnum):
    """Where replicas go (NVIDIA's ``sharedDevicesAllocationPolicy``)."""

    DISTRIBUTED = "distributed"  # the GPUs with the most free replicas first
    PACKED = "packed"  # the fullest GPUs first


class NamingRule(Struct, frozen=True):
    """``resources.gpus`` / ``resources.mig``: devices whose name matches ``pattern`` become ``name``."""

    pattern: str  # a glob (only ``*`` is special) matched against the whole GPU name or MIG profile
    name: str


class DeviceSelector(Struct, frozen=True):
    """Which devices of a resource a sharing rule takes: all of them, the first ``count``, or a list."""

    count: int | None = None
    refs: tuple[str, ...] = ()  # GPU index "0", MIG index "0:1", GPU-/MIG- UUID, legacy MIG-GPU-<uuid>/<gi>/<ci>

    @property
    def takes_all(self) -> bool:
        return self.count is None and not self.refs


class MpsLimits(Struct, frozen=True):
    """Per-client MPS limits of one resource (Tessera's extensions; NVIDIA splits evenly)."""

    active_thread_percentage: int  # of each device's SMs, for every client
    memory_limit_mib: int | None = None  # pinned device memory per client; None: the device's memory / replicas
    oversubscribe: bool = False  # allow replicas x memory above the device's memory

    def memory_for(self, device_memory_mib: int, replicas: int) -> int:
        return self.memory_limit_mib if self.memory_limit_mib is not None else device_memory_mib // replicas


class ReplicaMemory(Struct, frozen=True):
    """Tessera: the GPU memory each time-sliced replica is held to (``memoryLimit``, ``memoryBurstLimit``): its
    container is guaranteed ``request_mib`` (the driver's soft limit) and may allocate up to ``limit_mib`` (the
    hard limit). Without bursting the two are the same."""

    request_mib: int
    limit_mib: int


def replica_memory(
    device: Device, replicas: int, mps: MpsLimits | None, memory: ReplicaMemory | None
) -> tuple[int, int] | None:
    """(request, limit) in MiB a container given one replica of ``device`` is held to, or None when it has no size
    (a whole GPU, a time-sliced replica without memoryLimit: it may use all of its device)."""
    if mps is not None:
        size = mps.memory_for(device.memory_mib, replicas)
        return size, size
    if memory is not None:
        return memory.request_mib, memory.limit_mib
    return None


class ReplicaRule(Struct, frozen=True):
    """One ``sharing.<strategy>.resources[]`` entry: replicate ``name``'s selected devices ``replicas`` times."""

    name: str
    replicas: int
    target: str  # the resource the replicas are advertised as (``rename``, ``<name>.shared`` or ``name``)
    devices: DeviceSelector = field(default_factory=DeviceSelector)
    where: str = ""  # the config path, for messages: sharing.timeSlicing.resources[0]
    mps: MpsLimits | None = None  # set for sharing.mps entries
    memory: ReplicaMemory | None = None  # set for time-slicing entries with a memoryLimit


class SharingConfig(Struct, frozen=True):
    strategy: Sharing
    rules: tuple[ReplicaRule, ...]
    fail_requests_greater_than_one: bool


class PlanConfig(Struct, frozen=True):
    """Everything planning needs from the sharing config."""

    mig_strategy: MigStrategy = MigStrategy.NONE
    gpu_names: tuple[NamingRule, ...] = ()
    mig_names: tuple[NamingRule, ...] = ()
    sharing: SharingConfig | None = None


class Device(Struct, frozen=True):
    """One advertised device: a full GPU or a MIG device, identified by its UUID."""

    id: str
    gpu_uuid: str
    gpu_index: int
    index: str  # NVIDIA's index: "0" for a GPU, "0:3" for a MIG device
    memory_mib: int
    mig_uuid: str | None = None
    mig_profile: str | None = None
    numa_node: int | None = None
    replica: int | None = None  # n of a shared device's replica, whose ID is <physical ID>::<n>

    @property
    def physical_id(self) -> str:
        """What the container runtime is given: the MIG UUID for a MIG device, else the GPU UUID."""
        return self.mig_uuid or self.gpu_uuid

    def to_json(self, memory_mib: int | None = None) -> dict[str, Any]:
        """``memory_mib``: what a pod given this device may use, when that is not the device's own memory (an
        MPS replica's pinned-memory limit)."""
        return {
            "id": self.id,
            "gpu": self.gpu_uuid,
            "gpu_index": self.gpu_index,
            "index": self.index,
            "mig": self.mig_uuid,
            "profile": self.mig_profile,
            "memory_mib": self.memory_mib if memory_mib is None else memory_mib,
            "numa_node": self.numa_node,
            "replica": self.replica,
        }


class Resource(Struct, frozen=True):
    name: str
    devices: tuple[Device, ...]
    sharing: Sharing = Sharing.NONE
    replicas: int = 1  # replicas per physical device
    fail_requests_greater_than_one: bool = False
    mps: MpsLimits | None = None
    memory: ReplicaMemory | None = None  # time-sliced replicas with a size (Tessera's memoryLimit)

    def memory_of(self, device: Device) -> int:
        """The memory (MiB) a pod given ``device`` may use: an MPS replica's pinned-memory limit (its slice of
        the GPU), a sized time-sliced replica's limit, else the device's own memory (a time-sliced replica may
        use all of it, shared with the others)."""
        sized = self.limits_of(device)
        return device.memory_mib if sized is None else sized[1]

    def limits_of(self, device: Device) -> tuple[int, int] | None:
        """(request, limit) in MiB a container given ``device`` is held to; None when it has no size."""
        return replica_memory(device, self.replicas, self.mps, self.memory)

    @property
    def sized(self) -> bool:
        """Are its replicas given a memory size the driver can hold their containers to: MPS replicas (each its
        slice of the GPU) and time-sliced replicas with a ``memoryLimit``."""
        mps = self.sharing is Sharing.MPS and self.mps is not None
        return mps or (self.sharing is Sharing.TIME_SLICING and self.memory is not None)

    def to_json(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            "count": len(self.devices),
            "sharing": str(self.sharing),
            "replicas": self.replicas,
            "devices": [d.to_json(self.memory_of(d)) for d in self.devices],
        }
        if self.mps is not None:
            document["mps"] = {
                "active_thread_percentage": self.mps.active_thread_percentage,
                "pinned_memory_mib": {
                    d.physical_id: self.mps.memory_for(d.memory_mib, self.replicas) for d in self.devices
                },
            }
        if self.memory is not None:
            document["memory"] = {"request_mib": self.memory.request_mib, "limit_mib": self.memory.limit_mib}
        return document


class ResourcePlan(Struct, frozen=True):
    """Every resource the node advertises, sorted by name, plus what the user should know."""

    resources: tuple[Resource, ...]
    mig_strategy: MigStrategy
    warnings: tuple[str, ...] = field(default=())

    def resource(self, name: str) -> Resource | None:
        return next((r for r in self.resources if r.name == name), None)

    def sizes_memory(self) -> bool:
        """Has a device of the plan a memory size (one ``agent.core.memlimits.sized_devices`` lists)?"""
        return any(r.sized and any(r.limits_of(d) is not None for d in r.devices) for r in self.resources)

    def without(self, physical_ids: frozenset[str]) -> ResourcePlan:
        """The plan minus some physical devices (and their replicas), e.g. MIG devices being drained."""
        if not physical_ids:
            return self
        resources = tuple(
            replace(r, devices=tuple(d for d in r.devices if d.physical_id not in physical_ids)) for r in self.resources
        )
        return replace(self, resources=tuple(r for r in resources if r.devices))

    def to_json(self) -> dict[str, Any]:
        """The stable JSON contract of ``tessera plan --format json``."""
        return {
            "mig_strategy": str(self.mig_strategy),
            "resources": {r.name: r.to_json() for r in self.resources},
            "warnings": list(self.warnings),
        }


class PlanError(ValueError):
    """The config cannot be applied to this node; the message says why and how to fix it."""
