"""discover() through real pynvml, with a simulated node installed where libnvidia-ml.so.1 would be."""

from __future__ import annotations

import re

import pytest

from agent.core.inventory import Placement
from agent.gpu.discovery import discover
from agent.sim.nvml.codes import Return

GPU_UUID = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
MIG_UUID = re.compile(r"^MIG-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def one_gpu(model: str, **group: object) -> dict[str, object]:
    return {"gpus": [{"model": model, **group}]}


def mig_layout(model: str, *instances: str) -> dict[str, object]:
    return one_gpu(model, mig={"instances": list(instances)})


def test_dgx_a100(sim_node):
    sim_node("dgx-a100")
    inventory = discover()

    assert inventory.failures == ()
    assert inventory.driver_version == "580.95.05"
    assert [g.index for g in inventory.gpus] == list(range(8))
    uuids = [g.uuid for g in inventory.gpus]
    assert all(GPU_UUID.match(u) for u in uuids), uuids
    assert len(set(uuids)) == 8
    assert len({g.pci_bus_id for g in inventory.gpus}) == 8
    for gpu in inventory.gpus:
        assert gpu.name == "NVIDIA A100-SXM4-80GB"
        assert gpu.memory_mib == 81920
        assert gpu.compute_capability == (8, 0)
        assert gpu.architecture == "Ampere"
        assert gpu.nvlink_peers == tuple(i for i in range(8) if i != gpu.index)  # all-to-all over NVSwitch
        assert (gpu.mig_capable, gpu.mig_enabled, gpu.mig_pending) == (True, False, False)
        assert not gpu.mig_change_pending
        assert gpu.mig_devices == ()
        assert gpu.compute_mode == "DEFAULT"
    assert [g.numa_node for g in inventory.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert inventory.gpu_by_uuid(uuids[5]) is inventory.gpus[5]


def test_mixed_mig_layout_on_a100(sim_node):
    # The MIG user guide's `-cgi 9,19,14,19` sequence on an A100 (facts: observed_default_placement_sequences):
    # 3g@4:4 GI2, 1g@0:1 GI7, 2g@2:2 GI4, 1g@1:1 GI8. MIG devices follow ascending GI id.
    sim_node(mig_layout("A100-SXM4-80GB", "3g.40gb", "1g.10gb", "2g.20gb", "1g.10gb"))
    (gpu,) = discover().gpus

    assert (gpu.mig_enabled, gpu.mig_pending, gpu.mig_change_pending) == (True, True, False)
    assert gpu.compute_mode is None  # NVML does not report it for a MIG-enabled parent
    devices = gpu.mig_devices
    assert [(m.profile, m.gi_id, m.ci_id, m.placement) for m in devices] == [
        ("3g.40gb", 2, 0, Placement(4, 4)),
        ("2g.20gb", 4, 0, Placement(2, 2)),
        ("1g.10gb", 7, 0, Placement(0, 1)),
        ("1g.10gb", 8, 0, Placement(1, 1)),
    ]
    assert [m.mig_index for m in devices] == [0, 1, 2, 3]
    assert [m.index for m in devices] == ["0:0", "0:1", "0:2", "0:3"]
    assert [m.memory_mib for m in devices] == [40192, 19968, 9728, 9728]
    assert [(m.gi_slices, m.ci_slices) for m in devices] == [(3, 3), (2, 2), (1, 1), (1, 1)]
    assert [(m.gi_profile_id, m.ci_profile_id) for m in devices] == [(9, 2), (14, 1), (19, 0), (19, 0)]
    assert all(m.is_full_instance for m in devices)
    assert all(MIG_UUID.match(m.uuid) for m in devices)
    assert len({m.uuid for m in devices}) == 4
    assert all(m.parent_uuid == gpu.uuid and m.gpu_index == 0 for m in devices)


def test_compute_instances_sharing_one_gpu_instance(sim_node):
    sim_node(mig_layout("A100-SXM4-80GB", "1c.3g.40gb", "1c.3g.40gb"))
    (gpu,) = discover().gpus

    first, second = gpu.mig_devices
    for device in (first, second):
        assert device.profile == "1c.3g.40gb"
        assert (device.gi_slices, device.ci_slices) == (3, 1)
        assert not device.is_full_instance
        assert device.memory_mib == 40192  # a compute instance sees its GPU instance's memory
    assert first.gi_id == second.gi_id
    assert first.placement == second.placement
    assert (first.ci_id, second.ci_id) == (0, 1)
    assert first.uuid != second.uuid


@pytest.mark.parametrize(
    ("model", "profile", "memory_mib"),
    [
        ("H200-141GB", "3g.71gb", 71552),  # 70.5 rounds half up to 71, not to even (70)
        ("H100-SXM5-80GB", "1g.10gb+me", 9984),
    ],
)
def test_profile_names_are_derived_like_nvidia_names_them(sim_node, model, profile, memory_mib):
    sim_node(mig_layout(model, profile))
    (gpu,) = discover().gpus
    (device,) = gpu.mig_devices
    assert device.profile == profile
    assert device.memory_mib == memory_mib


def test_h200(sim_node):
    sim_node(mig_layout("H200-141GB", "3g.71gb", "2g.35gb", "1g.18gb"))
    (gpu,) = discover().gpus
    assert gpu.name == "NVIDIA H200"
    assert gpu.compute_capability == (9, 0)
    assert gpu.architecture == "Hopper"
    assert [m.profile for m in gpu.mig_devices] == ["3g.71gb", "2g.35gb", "1g.18gb"]


def test_lost_gpu_is_a_failure_and_the_others_are_still_discovered(sim_node):
    sim_node("dgx-a100")
    healthy = discover()

    driver = sim_node("dgx-a100")
    driver.lose_gpu(1)
    inventory = discover()

    (failure,) = inventory.failures
    assert failure.index == 1
    assert failure.error == "GPU_IS_LOST"
    assert "NVML_ERROR_GPU_IS_LOST" in str(failure)
    assert [g.index for g in inventory.gpus] == [0, 2, 3, 4, 5, 6, 7]
    # the survivors keep their indices and UUIDs
    assert [g.uuid for g in inventory.gpus] == [g.uuid for g in healthy.gpus if g.index != 1]
    assert all(1 not in g.nvlink_peers for g in inventory.gpus)


def test_recovered_gpu_is_discovered_again(sim_node):
    driver = sim_node("t4x4")
    driver.lose_gpu(3)
    assert [f.index for f in discover().failures] == [3]
    driver.recover_gpu(3)
    inventory = discover()
    assert inventory.failures == ()
    assert [g.index for g in inventory.gpus] == [0, 1, 2, 3]


def test_injected_nvml_error_fails_only_that_gpu(sim_node):
    driver = sim_node("dgx-a100")
    driver.inject_error("nvmlDeviceGetMemoryInfo", Return.ERROR_UNKNOWN, gpu_index=2)
    inventory = discover()

    (failure,) = inventory.failures
    assert failure.index == 2
    assert failure.error == "UNKNOWN"
    assert failure.operation == "nvmlDeviceGetMemoryInfo"
    assert failure.uuid is not None and GPU_UUID.match(failure.uuid)
    assert [g.index for g in inventory.gpus] == [0, 1, 3, 4, 5, 6, 7]
    assert failure.uuid not in {g.uuid for g in inventory.gpus}

    # the fault fired once: the next discovery sees all eight GPUs again
    again = discover()
    assert again.failures == ()
    assert len(again.gpus) == 8


def test_injected_error_on_a_mig_query_fails_only_that_gpu(sim_node):
    driver = sim_node({"gpus": [{"model": "A100-SXM4-80GB", "count": 2, "mig": {"instances": ["7g.80gb"]}}]})
    driver.inject_error("nvmlDeviceGetMigDeviceHandleByIndex", Return.ERROR_UNKNOWN, gpu_index=0)
    inventory = discover()
    assert [(f.index, f.error) for f in inventory.failures] == [(0, "UNKNOWN")]
    (gpu,) = inventory.gpus
    assert gpu.index == 1
    assert [m.profile for m in gpu.mig_devices] == ["7g.80gb"]


def test_t4_is_not_mig_capable(sim_node):
    sim_node("t4x4")
    inventory = discover()
    assert inventory.failures == ()
    assert len(inventory.gpus) == 4
    for gpu in inventory.gpus:
        assert gpu.name == "Tesla T4"
        assert gpu.memory_mib == 15360
        assert gpu.compute_capability == (7, 5)
        assert gpu.architecture == "Turing"
        assert gpu.mig_capable is False
        assert gpu.mig_enabled is False
        assert gpu.mig_pending is None
        assert gpu.mig_change_pending is False
        assert gpu.nvlink_peers == ()  # PCIe cards, no NVLink
        assert gpu.compute_mode == "DEFAULT"


def test_mig_enable_pending_until_reset(sim_node):
    sim_node(one_gpu("A100-SXM4-80GB", mig_pending="enabled"))
    (gpu,) = discover().gpus
    assert (gpu.mig_enabled, gpu.mig_pending) == (False, True)
    assert gpu.mig_change_pending
    assert gpu.mig_devices == ()


def test_mig_disable_pending_until_reset(sim_node):
    sim_node(one_gpu("A100-SXM4-80GB", mig={"instances": []}, mig_pending="disabled"))
    (gpu,) = discover().gpus
    assert (gpu.mig_enabled, gpu.mig_pending) == (True, False)
    assert gpu.mig_change_pending
    assert gpu.mig_devices == ()


def test_compute_mode_is_reported(sim_node):
    sim_node(one_gpu("T4", compute_mode="EXCLUSIVE_PROCESS"))
    (gpu,) = discover().gpus
    assert gpu.compute_mode == "EXCLUSIVE_PROCESS"


@pytest.mark.parametrize("spec", ["dgx-h100", "a100-mig"])
def test_same_spec_gives_identical_inventories(sim_node, spec):
    sim_node(spec)
    first = discover()
    sim_node(spec)
    second = discover()
    assert first == second
    assert first.gpus  # not trivially equal
