"""What DRA publishes on a node: one function, called by the agent's publisher and by ``tessera plan --dra``.

The preview must show exactly what the agent publishes (issue 25): both build the pool here from the node's inventory
and the config's choices, so no rule (which GPUs are partitioned, which are whole, which placements a MIG device no
claim made takes away) lives in only one of them.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from msgspec import Struct

from agent.core.dra.devices import DraDevice, dra_devices
from agent.core.dra.partitions import Unclaimed, counter_sets, partitioned, unclaimed_instances, without_overlaps
from agent.core.inventory import Inventory


class Pool(Struct, frozen=True):
    devices: tuple[DraDevice, ...]  # every device DRA serves (Prepare and health read these)
    offered: tuple[DraDevice, ...]  # the ones the slices list
    counters: dict[str, dict[str, int]]  # the counter sets of the offered devices' GPUs (from every device served)
    unclaimed: tuple[Unclaimed, ...]  # GPU instances on partitioned GPUs no claim made: their placements are taken


def dra_pool(
    inventory: Inventory,
    *,
    served: Collection[str],
    dynamic_mig: Collection[str] = (),
    shared: Collection[str] = (),
    default_share: int | None = None,
    share_mode: str | int = "memory",
    pcie_roots: Mapping[str, str] | None = None,
    numa_nodes: Mapping[str, int | None] | None = None,
    offered_gpus: Collection[str] | None = None,
    claimed_placements: Mapping[str, Collection[tuple[int, int]]] | None = None,
    claimed_migs: Collection[str] = (),
) -> Pool:
    """The pool of the GPUs DRA ``served`` (UUIDs): ``dynamic_mig`` are the ones the config puts in dynamic-MIG mode,
    ``shared`` the ones shared by memory; ``offered_gpus`` (default: all served) are the ones the slices list (a GPU
    leaving DRA, or one whose inventory is stale, is served but not offered). ``claimed_placements`` (GPU UUID ->
    (GPU-instance profile ID, start)) and ``claimed_migs`` (MIG UUIDs) are what recorded claims made or are making;
    every other MIG device on a partitioned GPU takes its placement: no partition overlapping it is offered, nor the
    whole GPU."""
    devices = dra_devices(
        inventory,
        gpu_uuids=frozenset(served),
        pcie_roots=pcie_roots,
        numa_nodes=numa_nodes,
        dynamic_mig=dynamic_mig,
        shared=shared,
        default_share=default_share,
        share_mode=share_mode,
    )
    offered_on = frozenset(served) if offered_gpus is None else frozenset(offered_gpus)
    offered = tuple(d for d in devices if d.gpu_uuid in offered_on)
    placements = claimed_placements or {}
    unclaimed = tuple(
        instance
        for gpu in inventory.gpus
        if gpu.uuid in served and gpu.uuid in dynamic_mig and partitioned(gpu)
        for instance in unclaimed_instances(gpu, placements.get(gpu.uuid, ()), claimed_migs)
    )
    if unclaimed:
        offered = without_overlaps(offered, unclaimed)
    gpus = {d.gpu_uuid for d in offered}
    counters = counter_sets(d for d in devices if d.gpu_uuid in gpus)
    return Pool(devices, offered, counters, unclaimed)
