"""plan(): NVIDIA's MIG strategies (device plugin §2.1) over hand-built inventories, no driver involved."""

from __future__ import annotations

import json

import pytest
from msgspec.structs import replace

from agent.core.inventory import Gpu, GpuFailure, Inventory, MigDevice, Placement
from agent.core.plan import plan
from agent.core.resources import GPU_RESOURCE, MigStrategy, PlanConfig, PlanError, ResourcePlan
from tests.unit.builders import a100

NONE, SINGLE, MIXED = MigStrategy.NONE, MigStrategy.SINGLE, MigStrategy.MIXED

# (gi_slices, ci_slices, memory MiB, gi_profile_id, ci_profile_id) of A100-80GB profiles
_PROFILES = {
    "1g.10gb": (1, 1, 9728, 19, 0),
    "1g.10gb+me": (1, 1, 9984, 20, 7),
    "2g.20gb": (2, 2, 19968, 14, 1),
    "3g.40gb": (3, 3, 40192, 9, 2),
    "1c.3g.40gb": (3, 1, 40192, 9, 0),
    "7g.80gb": (7, 7, 80896, 0, 4),
}


def mig(gpu_index: int, mig_index: int, profile: str) -> MigDevice:
    gi_slices, ci_slices, memory, gi_profile_id, ci_profile_id = _PROFILES[profile]
    return MigDevice(
        uuid=f"MIG-{gpu_index:08x}-0000-5000-8000-{mig_index:012x}",
        parent_uuid=gpu_uuid(gpu_index),
        gpu_index=gpu_index,
        mig_index=mig_index,
        profile=profile,
        gi_id=7 + mig_index,
        ci_id=0,
        gi_profile_id=gi_profile_id,
        ci_profile_id=ci_profile_id,
        gi_slices=gi_slices,
        ci_slices=ci_slices,
        placement=Placement(mig_index, gi_slices),
        memory_mib=memory,
        multiprocessor_count=14 * ci_slices,
    )


def gpu_uuid(index: int) -> str:
    return f"GPU-{index:08x}-0000-5000-8000-000000000000"


def gpu(index: int, *profiles: str, mig_enabled: bool | None = None, mig_pending: bool | None = None) -> Gpu:
    """An A100-80GB; MIG is enabled when profiles are given (or when ``mig_enabled`` says so)."""
    enabled = bool(profiles) if mig_enabled is None else mig_enabled
    return a100(
        index,
        gpu_uuid(index),
        pci_bus_id=f"00000000:{0x18 + 0x20 * index:02X}:00.0",
        mig_enabled=enabled,
        mig_pending=enabled if mig_pending is None else mig_pending,
        mig_devices=tuple(mig(index, i, p) for i, p in enumerate(profiles)),
        numa_node=index // 4,
    )


def node(*gpus: Gpu, failures: tuple[GpuFailure, ...] = ()) -> Inventory:
    return Inventory(
        driver_version="580.95.05", nvml_version="13.580.95.05", cuda_driver_version=13000, gpus=gpus, failures=failures
    )


def run(strategy: MigStrategy, inventory: Inventory) -> ResourcePlan:
    return plan(PlanConfig(mig_strategy=strategy), inventory)


def ids(result: ResourcePlan, name: str) -> list[str]:
    resource = result.resource(name)
    assert resource is not None, f"{name} not advertised; got {[r.name for r in result.resources]}"
    return [d.id for d in resource.devices]


def names(result: ResourcePlan) -> list[str]:
    return [r.name for r in result.resources]


# --- none -------------------------------------------------------------------------------------------------


def test_none_advertises_every_gpu_including_mig_enabled_ones_as_a_full_gpu():
    inventory = node(gpu(0), gpu(1, "1g.10gb", "1g.10gb"), gpu(2))
    result = run(NONE, inventory)
    assert names(result) == [GPU_RESOURCE]
    assert ids(result, GPU_RESOURCE) == [gpu_uuid(0), gpu_uuid(1), gpu_uuid(2)]
    devices = result.resource(GPU_RESOURCE).devices
    assert all(d.mig_uuid is None and d.mig_profile is None for d in devices)
    assert [d.index for d in devices] == ["0", "1", "2"]
    assert devices[1].memory_mib == 81920
    # advertised as NVIDIA's plugin does, but not silently: CUDA in a pod given GPU 1 finds no usable device
    (warning,) = result.warnings
    assert warning.startswith(f"GPU 1 ({gpu_uuid(1)}) has MIG enabled: with mig-strategy none it is advertised whole")
    assert "CUDA in a pod given it finds no device it can use" in warning and "mig-strategy mixed" in warning


def test_none_warns_about_a_mig_enabled_gpu_by_the_name_it_is_advertised_as():
    from agent.core.resources import NamingRule

    config = PlanConfig(gpu_names=(NamingRule("*A100*", "nvidia.com/a100"),))
    result = plan(config, node(gpu(0, "1g.10gb", mig_enabled=True)))
    (warning,) = result.warnings
    assert "advertised whole as nvidia.com/a100" in warning
    assert run(NONE, node(gpu(0), gpu(1))).warnings == ()  # no MIG: nothing to say


def test_none_is_the_default_strategy():
    assert PlanConfig().mig_strategy is NONE


# --- single -----------------------------------------------------------------------------------------------


def test_single_turns_every_mig_device_into_a_gpu_and_drops_the_parent():
    inventory = node(gpu(0, "1g.10gb", "1g.10gb", "1g.10gb"), gpu(1, "1g.10gb", "1g.10gb"))
    result = run(SINGLE, inventory)
    assert names(result) == [GPU_RESOURCE]
    devices = result.resource(GPU_RESOURCE).devices
    assert [d.id for d in devices] == [m.uuid for g in inventory.gpus for m in g.mig_devices]
    assert gpu_uuid(0) not in [d.id for d in devices]
    assert [d.index for d in devices] == ["0:0", "0:1", "0:2", "1:0", "1:1"]
    assert all(d.mig_profile == "1g.10gb" and d.memory_mib == 9728 for d in devices)
    assert [d.gpu_uuid for d in devices] == [gpu_uuid(0)] * 3 + [gpu_uuid(1)] * 2
    assert result.warnings == ()


@pytest.mark.parametrize("strategy", [SINGLE, MIXED])
def test_node_without_mig_behaves_like_none(strategy):
    inventory = node(gpu(0), gpu(1))
    assert run(strategy, inventory).resources == run(NONE, inventory).resources


def test_single_rejects_two_profiles_and_names_both():
    inventory = node(gpu(0, "3g.40gb", "1g.10gb"), gpu(1, "1g.10gb"))
    with pytest.raises(PlanError) as raised:
        run(SINGLE, inventory)
    message = str(raised.value)
    assert "3g.40gb" in message
    assert "1g.10gb" in message
    assert "mixed" in message  # says how to fix it


def test_single_rejects_profiles_that_differ_only_by_attribute():
    with pytest.raises(PlanError, match=r"1g\.10gb\+me"):
        run(SINGLE, node(gpu(0, "1g.10gb", "1g.10gb+me")))


def test_single_rejects_a_mig_enabled_gpu_without_mig_devices():
    inventory = node(gpu(0, "1g.10gb"), gpu(1, mig_enabled=True))
    with pytest.raises(PlanError, match=r"GPU\(s\) 1 have MIG enabled but no MIG devices"):
        run(SINGLE, inventory)


def test_single_rejects_mig_and_non_mig_gpus_on_one_node():
    inventory = node(gpu(0, "1g.10gb"), gpu(1))
    with pytest.raises(PlanError, match="same MIG mode") as raised:
        run(SINGLE, inventory)
    assert "GPU(s) 0 have MIG enabled and GPU(s) 1 do not" in str(raised.value)


# --- mixed ------------------------------------------------------------------------------------------------


def test_mixed_names_resources_after_profiles_with_plus_replaced_by_dot():
    inventory = node(gpu(0, "3g.40gb", "2g.20gb", "1g.10gb+me", "1g.10gb"), gpu(1))
    result = run(MIXED, inventory)
    assert names(result) == [
        GPU_RESOURCE,
        "nvidia.com/mig-1g.10gb",
        "nvidia.com/mig-1g.10gb.me",
        "nvidia.com/mig-2g.20gb",
        "nvidia.com/mig-3g.40gb",
    ]
    migs = inventory.gpus[0].mig_devices
    assert ids(result, GPU_RESOURCE) == [gpu_uuid(1)]  # the MIG-disabled GPU stays a full GPU
    assert ids(result, "nvidia.com/mig-3g.40gb") == [migs[0].uuid]
    assert ids(result, "nvidia.com/mig-1g.10gb.me") == [migs[2].uuid]
    me = result.resource("nvidia.com/mig-1g.10gb.me").devices[0]
    assert (me.mig_profile, me.index, me.gpu_uuid, me.memory_mib) == ("1g.10gb+me", "0:2", gpu_uuid(0), 9984)
    assert result.warnings == ()


def test_mixed_gpu_with_mig_enabled_but_no_devices_is_a_warning_not_an_error():
    inventory = node(gpu(0, "1g.10gb"), gpu(1, mig_enabled=True))
    result = run(MIXED, inventory)
    assert names(result) == ["nvidia.com/mig-1g.10gb"]
    assert len(result.warnings) == 1
    assert "GPU 1" in result.warnings[0]
    assert "no MIG devices" in result.warnings[0]


@pytest.mark.parametrize("strategy", [SINGLE, MIXED])
def test_partial_compute_instances_are_not_advertised_and_warned_about(strategy):
    inventory = node(gpu(0, "1c.3g.40gb", "1c.3g.40gb"))
    result = run(strategy, inventory)
    assert result.resources == ()
    assert len(result.warnings) == 2
    for device, warning in zip(inventory.gpus[0].mig_devices, result.warnings, strict=True):
        assert device.uuid in warning
        assert "1c.3g.40gb" in warning
        assert "partial" in warning


def test_mixed_advertises_full_instances_next_to_partial_ones():
    inventory = node(gpu(0, "3g.40gb", "1c.3g.40gb"))
    result = run(MIXED, inventory)
    assert names(result) == ["nvidia.com/mig-3g.40gb"]
    assert ids(result, "nvidia.com/mig-3g.40gb") == [inventory.gpus[0].mig_devices[0].uuid]
    assert len(result.warnings) == 1


# --- failures, pending changes, order ---------------------------------------------------------------------


@pytest.mark.parametrize("strategy", list(MigStrategy))
def test_failed_gpus_are_left_out_with_a_warning_naming_the_nvml_error(strategy):
    lost = GpuFailure(index=1, error="GPU_IS_LOST", operation="nvmlDeviceGetHandleByIndex")
    broken = GpuFailure(index=2, error="UNKNOWN", operation="nvmlDeviceGetMemoryInfo", uuid=gpu_uuid(2))
    inventory = node(gpu(0), gpu(3), failures=(lost, broken))
    result = run(strategy, inventory)
    assert ids(result, GPU_RESOURCE) == [gpu_uuid(0), gpu_uuid(3)]
    assert len(result.warnings) == 2
    assert "GPU 1" in result.warnings[0]
    assert "NVML_ERROR_GPU_IS_LOST" in result.warnings[0]
    assert "NVML_ERROR_UNKNOWN" in result.warnings[1]
    assert gpu_uuid(2) in result.warnings[1]
    assert "nvmlDeviceGetMemoryInfo" in result.warnings[1]


def test_pending_mig_change_is_warned_about_and_the_current_mode_is_advertised():
    inventory = node(gpu(0, mig_pending=True), gpu(1, "1g.10gb", mig_pending=False))
    result = run(MIXED, inventory)
    assert ids(result, GPU_RESOURCE) == [gpu_uuid(0)]
    assert ids(result, "nvidia.com/mig-1g.10gb") == [inventory.gpus[1].mig_devices[0].uuid]
    assert len(result.warnings) == 2
    assert "GPU 0" in result.warnings[0]
    assert "change to enabled pending" in result.warnings[0]
    assert "GPU 1" in result.warnings[1]
    assert "change to disabled pending" in result.warnings[1]


def test_devices_are_ordered_by_gpu_index_then_mig_index_whatever_the_inventory_order():
    first = gpu(0, "1g.10gb", "1g.10gb", "1g.10gb")
    second = gpu(1, "1g.10gb", "1g.10gb")
    shuffled = node(
        replace(second, mig_devices=tuple(reversed(second.mig_devices))),
        replace(first, mig_devices=tuple(reversed(first.mig_devices))),
    )
    for strategy in (SINGLE, MIXED):
        resource = run(strategy, shuffled).resources[0]
        assert [d.index for d in resource.devices] == ["0:0", "0:1", "0:2", "1:0", "1:1"]
    assert [d.index for d in run(NONE, shuffled).resources[0].devices] == ["0", "1"]


def test_plan_is_deterministic():
    inventory = node(gpu(0, "3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"), gpu(1), gpu(2, "7g.80gb"))
    assert run(MIXED, inventory) == run(MIXED, inventory)
    assert json.dumps(run(MIXED, inventory).to_json()) == json.dumps(run(MIXED, inventory).to_json())


# --- JSON contract ----------------------------------------------------------------------------------------


def test_to_json_shape():
    inventory = node(gpu(0, "1g.10gb", "1g.10gb"), gpu(1), gpu(2, mig_enabled=True))
    document = run(MIXED, inventory).to_json()
    assert json.loads(json.dumps(document)) == document  # plain JSON types only
    assert set(document) == {"mig_strategy", "resources", "warnings"}
    assert document["mig_strategy"] == "mixed"
    assert list(document["resources"]) == [GPU_RESOURCE, "nvidia.com/mig-1g.10gb"]
    assert document["resources"][GPU_RESOURCE] == {
        "count": 1,
        "sharing": "none",
        "replicas": 1,
        "devices": [
            {
                "id": gpu_uuid(1),
                "gpu": gpu_uuid(1),
                "gpu_index": 1,
                "index": "1",
                "mig": None,
                "profile": None,
                "memory_mib": 81920,
                "numa_node": 0,
                "replica": None,
            }
        ],
    }
    migs = document["resources"]["nvidia.com/mig-1g.10gb"]
    assert migs["count"] == 2 == len(migs["devices"])
    device = migs["devices"][1]
    expected = inventory.gpus[0].mig_devices[1].uuid
    assert device == {
        "id": expected,
        "gpu": gpu_uuid(0),
        "gpu_index": 0,
        "index": "0:1",
        "mig": expected,
        "profile": "1g.10gb",
        "memory_mib": 9728,
        "numa_node": 0,
        "replica": None,
    }
    assert len(document["warnings"]) == 1
    assert isinstance(document["warnings"][0], str)


def test_to_json_of_an_empty_node():
    assert run(SINGLE, node()).to_json() == {"mig_strategy": "single", "resources": {}, "warnings": []}
