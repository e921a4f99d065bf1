"""NVIDIA's dynamic-MIG semantics: MIG mode follows the claims on GPUs that change it without a reset.

A Hopper GPU with MIG mode off is published partitioned (the whole GPU and every profile and placement); Prepare
of its first partition turns MIG mode on (only when nobody holds the GPU: the ledger's critical section) and creates
the MIG device, Unprepare of its last turns MIG mode off again, and a claim for the whole GPU gets it with MIG mode
off. An A100 changes MIG mode only with a reset: with MIG off it is a plain GPU, with MIG on only its partitions
(it could never be prepared whole). MIG devices no claim made take their placements away from the pool.
"""

from __future__ import annotations

import pytest

from agent.sim.kubelet.dra_common import PodStartError
from agent.sim.scheduler import Unschedulable
from tests import cdi_devices

from . import test_dra_e2e
from .test_dra_dynamic_mig import MIG_CLASS, mig_claim
from .test_dra_e2e import DEADLINE, DRIVER, World

world = test_dra_e2e.world  # the fixture: an agent, both kubelets and the API server on a simulated node

# GPU 0 a Hopper with MIG mode off (switched by claims), GPU 1 an A100 with MIG mode off (needs a reset: whole)
HOPPER = {"gpus": [{"model": "H100-SXM5-80GB"}, {"model": "A100-SXM4-80GB"}]}
HOPPER_MIG_ON = {"gpus": [{"model": "H100-SXM5-80GB", "mig": {"instances": []}}, {"model": "A100-SXM4-80GB"}]}
MADE_BY_HAND = {"gpus": [{"model": "H100-SXM5-80GB", "mig": {"instances": ["3g.40gb"]}}, {"model": "A100-SXM4-80GB"}]}
A100_MIG_ON = {"gpus": [{"model": "A100-SXM4-80GB", "mig": {"instances": []}}, {"model": "A100-SXM4-80GB"}]}
DYNAMIC = "version: v1\ndra:\n  enabled: true\n  gpus: [0, 1]\n  dynamicMig: all\n"


def go_dynamic(world: World, devices: int) -> dict[str, dict]:
    """Dynamic MIG on in the world's config; the published devices by name once there are ``devices`` of them."""
    world.api.wait_for(lambda: "gpu-1" in world.devices(), DEADLINE)
    (world.base / "config.yaml").write_text(DYNAMIC)
    try:
        world.api.wait_for(lambda: len(world.devices()) == devices, DEADLINE)
    except TimeoutError:
        raise AssertionError(sorted(world.devices())) from None
    world.api.create("deviceclasses", {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
                                       "metadata": {"name": "mig.nvidia.com"},
                                       "spec": {"selectors": [{"cel": {"expression": MIG_CLASS}}]}})  # fmt: skip
    world.dra.wait_for(lambda: DRIVER in world.dra.drivers(), DEADLINE, "the DRA driver registered")
    return {d["name"]: d for s in world.slices() for d in s["spec"].get("devices", [])}


def mig_on(world: World) -> bool:
    gpu = world.driver.gpus[0]
    assert gpu.mig_pending == gpu.mig_current  # never left waiting for a reset
    return gpu.mig_current


def instances(world: World) -> dict[tuple[int, int], str]:
    return {gi.placement: ci.uuid for gi, ci in world.driver.gpus[0].mig_devices()}


@pytest.mark.parametrize("world", [HOPPER], indirect=True)
def test_a_hopper_with_mig_off_is_partitioned_and_mig_mode_follows_its_claims(world: World) -> None:
    published = go_dynamic(world, 27)  # GPU 0: whole + 25 partitions; GPU 1 (an A100, MIG off) whole
    assert published["gpu-0"]["consumesCounters"][0]["counterSet"] == "gpu-0-counter-set"
    assert "consumesCounters" not in published["gpu-1"]  # an A100 is never switched under claims
    assert not mig_on(world)

    mig_claim(world, "big", "3g.40gb")
    world.dra.run_pod("default", "big", "pod-1", [("mig", "big")], {"main": [("mig", None)]})
    assert mig_on(world) and len(instances(world)) == 1  # MIG mode on at Prepare, then the MIG device made
    mig_claim(world, "small", "1g.10gb")
    world.dra.run_pod("default", "small", "pod-2", [("mig", "small")], {"main": [("mig", None)]})
    assert len(instances(world)) == 2

    world.dra.stop_pod("pod-1")
    assert mig_on(world) and len(instances(world)) == 1  # another partition still lives on the GPU
    world.dra.stop_pod("pod-2")
    assert instances(world) == {} and not mig_on(world)  # the last one gone: MIG mode off again
    assert not world.driver.gpus[1].mig_current  # the A100 was never touched


@pytest.mark.parametrize("world", [HOPPER], indirect=True)
def test_mig_mode_is_not_turned_on_while_a_process_holds_the_gpu(world: World) -> None:
    """A process runs on the whole GPU (MIG mode off): turning MIG mode on would need it gone. The Prepare fails
    naming it, nothing changes, and the kubelet's retry succeeds once it has ended."""
    go_dynamic(world, 27)
    mig_claim(world, "small", "1g.10gb")
    world.driver.add_process(0, 4242, 1024)
    with pytest.raises(PodStartError, match=r"MIG mode cannot be turned on while it is held: .*pid 4242.*retries"):
        world.dra.run_pod("default", "small", "pod-1", [("mig", "small")], {"main": [("mig", None)]})
    assert not mig_on(world) and instances(world) == {}
    assert list((world.base / "cdi").glob("*.yaml")) == []
    world.driver.remove_process(4242)
    world.dra.run_pod("default", "small", "pod-1", [("mig", "small")], {"main": [("mig", None)]})  # the retry
    assert mig_on(world) and len(instances(world)) == 1


@pytest.mark.parametrize("world", [HOPPER_MIG_ON], indirect=True)
def test_the_whole_of_a_hopper_in_mig_mode_is_prepared_with_mig_mode_off(world: World) -> None:
    published = go_dynamic(world, 27)  # MIG on, yet whole: Prepare can turn MIG mode off
    uuid = published["gpu-0"]["attributes"]["uuid"]["string"]
    claim = world.claim("whole", [f"device.attributes['gpu.nvidia.com'].uuid == '{uuid}'"])
    assert claim["status"]["allocation"]["devices"]["results"][0]["device"] == "gpu-0"
    assert mig_on(world)
    ids = world.dra.run_pod("default", "whole", "pod-1", [("gpu", "whole")], {"main": [("gpu", None)]})
    assert not mig_on(world)  # a container given the whole GPU can use it: CUDA sees no MIG mode
    assert cdi_devices.physical(world.base / "cdi", ids["main"], world.driver) == [uuid]  # the claim's spec has it
    world.dra.stop_pod("pod-1")
    assert not mig_on(world)


@pytest.mark.parametrize("world", [A100_MIG_ON], indirect=True)
def test_an_a100_in_mig_mode_is_not_published_whole(world: World) -> None:
    """It could never be prepared whole (its MIG mode changes only with a reset): NVIDIA's gpu-test1 would be given
    gpu-0 and its pod would never start. A claim for a GPU gets the other one."""
    published = go_dynamic(world, 26)  # GPU 0: its 25 partitions only; GPU 1 whole
    assert "gpu-0" not in published and "gpu-0-mig-7g80gb-0-0" in published
    claim = world.claim("any-gpu", [])
    assert claim["status"]["allocation"]["devices"]["results"][0]["device"] == "gpu-1"
    world.dra.run_pod("default", "any-gpu", "pod-1", [("gpu", "any-gpu")], {"main": [("gpu", None)]})


@pytest.mark.parametrize("world", [MADE_BY_HAND], indirect=True)
def test_a_mig_device_no_claim_made_takes_its_placement_away(world: World) -> None:
    """A 3g.40gb made outside Tessera on memory slices 4-7, a process running on it (so it is not swept away yet):
    no partition overlapping it is offered, nor the whole GPU, so the scheduler never picks one whose Prepare
    would fail."""
    ((placement, mig_uuid),) = instances(world).items()
    assert placement == (4, 4)
    world.api.wait_for(lambda: "gpu-0-mig-3g40gb-9-4" in world.devices(), DEADLINE)  # GPU 0 is DRA's (static MIG)
    world.driver.add_process(0, 4343, 1024, mig_uuid=mig_uuid)
    published = go_dynamic(world, 1 + 14)  # GPU 1 whole; GPU 0: the 14 partitions on slices 0-3 only
    assert "gpu-0" not in published
    assert sorted(n for n in published if n.startswith("gpu-0-mig-3g40gb")) == ["gpu-0-mig-3g40gb-9-0"]
    with pytest.raises(Unschedulable):
        mig_claim(world, "all", "7g.80gb")  # it would cover slices 4-7 too
    world.driver.remove_process(4343)
    world.api.wait_for(lambda: len(world.devices()) == 27, DEADLINE)  # swept: the whole pool again
    assert instances(world) == {}
