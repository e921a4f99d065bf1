"""What one resource server serves: an immutable snapshot of its devices, their health and options.

The reconcile loop builds a new snapshot whenever anything changes and hands it to the server; gRPC
handler threads only ever read the snapshot they picked up, so nothing is shared mutable state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import InitVar, dataclass, field
from types import MappingProxyType

import msgspec

from agent.core.allocation import DEFAULT_CDI_KIND, DeviceListStrategy
from agent.core.health import HealthState
from agent.core.inventory import Inventory
from agent.core.preferred import DeviceLayout
from agent.core.resources import AllocationPolicy, Device, MpsLimits, ReplicaMemory, ResourcePlan, Sharing


class AllocationOptions(msgspec.Struct, frozen=True):
    strategies: tuple[DeviceListStrategy, ...] = (DeviceListStrategy.ENVVAR,)
    cdi_kind: str = DEFAULT_CDI_KIND
    policy: AllocationPolicy = AllocationPolicy.DISTRIBUTED
    mps_root: str = "/run/nvidia/mps"  # on the host
    memory_envs: bool = False  # sized replicas' containers get NVIDIA_GPU_MEMORY_REQUEST / _LIMIT (limits enforced)
    cdi_unavailable: str = ""  # why the device plugin's CDI spec could not be written (cdi-* strategies refuse)


@dataclass(frozen=True, slots=True)
class ResourceSnapshot:
    name: str
    devices: tuple[Device, ...]
    health: Mapping[str, bool]
    nvlink_peers: Mapping[int, frozenset[int]] = field(default_factory=dict)
    options: AllocationOptions = field(default_factory=AllocationOptions)
    sharing: Sharing = Sharing.NONE
    fail_requests_greater_than_one: bool = False
    replicas: int = 1
    mps: MpsLimits | None = None
    memory: ReplicaMemory | None = None  # a time-sliced replica's size
    by_id: Mapping[str, Device] = field(init=False)
    layout: DeviceLayout = field(init=False)  # counted once here, not on every GetPreferredAllocation
    _listing: tuple[tuple[str, bool, int | None], ...] = field(init=False, repr=False, compare=False)
    previous: InitVar[ResourceSnapshot | None] = None  # its layout is taken over when the devices are the same

    def __post_init__(self, previous: ResourceSnapshot | None) -> None:
        health = MappingProxyType(dict(self.health))
        if previous is not None and previous.devices == self.devices and previous.nvlink_peers == self.nvlink_peers:
            by_id, layout = previous.by_id, previous.layout  # only health changed (an XID): nothing to count again
        else:
            by_id = MappingProxyType({d.id: d for d in self.devices})
            layout = DeviceLayout.of(by_id, self.nvlink_peers)
        object.__setattr__(self, "by_id", by_id)
        object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "health", health)
        object.__setattr__(self, "_listing", tuple((d.id, health.get(d.id, False), d.numa_node) for d in self.devices))

    def with_options(self, options: AllocationOptions) -> ResourceSnapshot:
        """This snapshot under other allocation options (its devices and layout taken over)."""
        return dataclasses.replace(self, options=options, previous=self)

    def listing(self) -> tuple[tuple[str, bool, int | None], ...]:
        """What ListAndWatch sends: (ID, healthy, NUMA node) per device. Equal listings need no update.
        Computed once with the snapshot: the reconcile loop compares listings on every publish."""
        return self._listing

    @property
    def healthy_count(self) -> int:
        return sum(self.health.values())


def build_snapshots(
    plan: ResourcePlan,
    health: HealthState,
    inventory: Inventory,
    options: AllocationOptions,
    *,
    unavailable: frozenset[str] = frozenset(),
    cordoned: frozenset[str] = frozenset(),
    previous: Mapping[str, ResourceSnapshot] | None = None,
) -> dict[str, ResourceSnapshot]:
    """One snapshot per resource with devices; a device is healthy when its GPU (or MIG device) is, its
    physical device is not ``unavailable`` (e.g. its MPS daemon is down) and neither its GPU nor its MIG
    device is ``cordoned`` by the operator. ``previous`` (the snapshots being served) lends its per-device
    layout to a resource whose devices did not change."""
    peers = {gpu.index: frozenset(gpu.nvlink_peers) for gpu in inventory.gpus}
    snapshots = {}
    for resource in plan.resources:
        if not resource.devices:
            continue
        healthy = health.device_health(resource.devices)
        if unavailable:
            healthy = {d.id: healthy[d.id] and d.physical_id not in unavailable for d in resource.devices}
        if cordoned:
            healthy = {
                d.id: healthy[d.id] and d.gpu_uuid not in cordoned and d.mig_uuid not in cordoned
                for d in resource.devices
            }
        snapshots[resource.name] = ResourceSnapshot(
            name=resource.name,
            devices=resource.devices,
            health=healthy,
            nvlink_peers=peers,
            options=options,
            sharing=resource.sharing,
            fail_requests_greater_than_one=resource.fail_requests_greater_than_one,
            replicas=resource.replicas,
            mps=resource.mps,
            memory=resource.memory,
            previous=previous.get(resource.name) if previous else None,
        )
    return snapshots
