"""MPS, the pure part: which control daemons a plan needs, and what a client container is given.

One daemon per MPS resource serves its full GPUs (``CUDA_VISIBLE_DEVICES`` limited to them — NVIDIA leaves
this as a TODO); a MIG device needs a daemon of its own (the hardware's rule), so an MPS resource of MIG
devices gets one daemon per MIG device. Each daemon has a directory under the MPS root named by its key.
"""

from __future__ import annotations

from collections import defaultdict

from msgspec import Struct

from agent.core.resources import Device, MpsLimits, ResourcePlan, Sharing

CONTAINER_MPS_ROOT = "/mps"


class MpsDaemonSpec(Struct, frozen=True):
    key: str  # its directory under the MPS root: "nvidia.com/gpu", "nvidia.com/mig-1g.10gb/mig-0-3"
    resource: str
    visible_devices: tuple[str, ...]  # GPU or MIG UUIDs, in plan order
    active_thread_percentage: int
    pinned_memory_mib: tuple[tuple[str, int], ...]  # (device UUID, MiB per client)

    @property
    def physical_ids(self) -> frozenset[str]:
        return frozenset(self.visible_devices)

    @property
    def limits(self) -> tuple[int, tuple[tuple[str, int], ...]]:
        """The limits the daemon's servers hold (thread percentage, pinned memory per device)."""
        return (self.active_thread_percentage, self.pinned_memory_mib)


def daemon_key(resource: str, device: Device) -> str:
    if device.mig_uuid is None:
        return resource
    return f"{resource}/mig-{device.index.replace(':', '-')}"


def mps_daemons(plan: ResourcePlan) -> tuple[MpsDaemonSpec, ...]:
    specs = []
    for resource in plan.resources:
        if resource.sharing is not Sharing.MPS or resource.mps is None:
            continue
        groups: dict[str, list[Device]] = defaultdict(list)
        for device in resource.devices:
            group = groups[daemon_key(resource.name, device)]
            if all(d.physical_id != device.physical_id for d in group):
                group.append(device)
        for key, devices in groups.items():
            specs.append(_spec(key, resource.name, devices, resource.mps, resource.replicas))
    return tuple(specs)


def _spec(key: str, resource: str, devices: list[Device], limits: MpsLimits, replicas: int) -> MpsDaemonSpec:
    return MpsDaemonSpec(
        key=key,
        resource=resource,
        visible_devices=tuple(d.physical_id for d in devices),
        active_thread_percentage=limits.active_thread_percentage,
        pinned_memory_mib=tuple((d.physical_id, limits.memory_for(d.memory_mib, replicas)) for d in devices),
    )
