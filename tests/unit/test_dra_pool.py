"""The pool DRA publishes (``agent.core.dra.pool``), the one function the agent and ``tessera plan --dra`` call: which
dynamic-MIG GPUs are partitioned, which are whole, and the placements MIG devices no claim made take away."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from msgspec.structs import replace

from agent.core.dra.partitions import counter_sets, partitionable_devices
from agent.core.dra.pool import dra_pool
from agent.core.inventory import Inventory
from agent.core.mig_catalog import mig_catalog
from agent.gpu.discovery import discover
from agent.sim.nvml.driver import SimDriver


@pytest.fixture
def inventory(sim_node: Callable[[object], SimDriver]) -> Callable[[object], Inventory]:
    def make(spec: object) -> Inventory:
        sim_node(spec)
        return discover()

    return make


def pool_names(inventory: Inventory) -> list[str]:
    uuids = frozenset(g.uuid for g in inventory.gpus)
    return [d.name for d in dra_pool(inventory, served=uuids, dynamic_mig=uuids).offered]


@pytest.mark.parametrize(
    ("gpu", "whole", "partitions"),
    [
        ({"model": "H100-SXM5-80GB"}, True, 25),  # MIG off: switched on at Prepare
        ({"model": "H100-SXM5-80GB", "mig": {"instances": []}}, True, 25),  # MIG on: switched off for the whole GPU
        ({"model": "A100-SXM4-80GB"}, True, 0),  # MIG off, needs a reset to change: a plain GPU
        ({"model": "A100-SXM4-80GB", "mig": {"instances": []}}, False, 25),  # MIG on: never preparable whole
    ],
    ids=["hopper-off", "hopper-on", "a100-off", "a100-on"],
)
def test_which_gpus_are_partitioned_and_which_are_whole(inventory, gpu: dict, whole: bool, partitions: int) -> None:
    names = pool_names(inventory({"gpus": [gpu]}))
    assert ("gpu-0" in names) is whole
    assert sum(1 for n in names if "-mig-" in n) == partitions


def test_an_a100_in_mig_mode_keeps_its_counter_set_without_its_whole_gpu(inventory) -> None:
    (gpu,) = inventory({"gpus": [{"model": "A100-SXM4-80GB", "mig": {"instances": []}}]}).gpus
    catalog = mig_catalog(gpu.pci_device_id)
    assert catalog is not None
    hopper_like = partitionable_devices(replace(gpu, mig_enabled=False), catalog, {})  # published whole
    whole_set = counter_sets(d for d in hopper_like if d.kind == "gpu")  # what the whole GPU consumes
    partitions = partitionable_devices(gpu, catalog, {})
    assert all(d.kind == "mig" for d in partitions)
    assert counter_sets(partitions) == whole_set  # every counter, each at its largest, in the same order
    assert list(counter_sets(partitions)["gpu-0-counter-set"]) == list(whole_set["gpu-0-counter-set"])


def test_a_mig_device_no_claim_made_takes_its_placement_but_a_claims_does_not(inventory) -> None:
    node = inventory({"gpus": [{"model": "H100-SXM5-80GB", "mig": {"instances": ["3g.40gb"]}}]})
    (gpu,) = node.gpus
    (mig,) = gpu.mig_devices
    assert (mig.placement.start, mig.placement.size) == (4, 4)
    names = pool_names(node)
    assert "gpu-0" not in names and "gpu-0-mig-3g40gb-9-4" not in names and "gpu-0-mig-3g40gb-9-0" in names
    claimed = dra_pool(node, served={gpu.uuid}, dynamic_mig={gpu.uuid}, claimed_migs={mig.uuid})
    assert "gpu-0" in [d.name for d in claimed.offered] and not claimed.unclaimed  # the scheduler counts it
