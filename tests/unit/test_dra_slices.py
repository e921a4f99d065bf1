"""ResourceSlices for this node's pool: complete objects the real OpenAPI schemas accept, split at the API's
limits, in both layouts; and device health as NVIDIA's taints on them."""

from __future__ import annotations

import random
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import kubernetes_validate
import pytest

from agent.core.dra.devices import DraDevice, Version, dra_devices
from agent.core.dra.slices import (
    COMBINED,
    SPLIT,
    SliceError,
    layout_for,
    quantity,
    resource_slices,
)
from agent.core.dra.taints import DeviceTaint, device_taints, rfc3339
from agent.core.health import GPU_LOST_REASON, HealthPolicy, HealthState, probe_succeeded, record_fault, record_xid
from agent.core.inventory import Inventory
from agent.gpu.discovery import discover
from agent.sim.nvml.driver import SimDriver

NODE = "node-a"
UID = "6a1f0c2e-8d1b-4c5e-9f3a-2b7d4e6f8a90"
DRIVER = "gpu.nvidia.com"
KUBERNETES = ("1.34", "1.35", "1.36", "1.37")
NOW = datetime(2026, 7, 1, 12, 0, 0, tzinfo=UTC)
DGX_A100_MIG = {"gpus": [{"model": "A100-SXM4-80GB", "count": 8, "mig": {"instances": ["1g.10gb"] * 7}}]}


@pytest.fixture
def inventory(sim_node: Callable[[object], SimDriver]) -> Callable[[object], Inventory]:
    def make(spec: object) -> Inventory:
        sim_node(spec)
        return discover()

    return make


def fake(count: int, **extra: Any) -> list[DraDevice]:
    """``count`` full GPUs, as many as no real node has."""
    return [
        DraDevice(
            name=f"gpu-{i}",
            kind="gpu",
            uuid=f"GPU-{i:08d}-0000-0000-0000-000000000000",
            parent_uuid=None,
            gpu_minor=i,
            attributes={"type": "gpu", "uuid": f"GPU-{i}", "cudaComputeCapability": Version("9.0.0")},
            capacity={"memory": 80 << 30},
            **extra,
        )
        for i in range(count)
    ]


def validate(slices: list[dict[str, Any]]) -> None:
    for version in KUBERNETES:
        for obj in slices:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as error:
                pytest.fail(f"{obj['metadata']['generateName']} on {version}: {error.message}")


def device_counts(slices: list[dict[str, Any]]) -> list[int]:
    return [len(s["spec"].get("devices", [])) for s in slices]


def xid(state: HealthState, unit: str, number: int, now: float = 1.0, gpu_uuid: str | None = None) -> HealthState:
    return record_xid(state, [unit], HealthPolicy().verdict(number), now, gpu_uuid=gpu_uuid)


# ----- the objects -------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", [COMBINED, SPLIT])
def test_dgx_a100_with_56_mig_devices_is_one_complete_slice(inventory, layout):
    devices = dra_devices(inventory(DGX_A100_MIG))
    assert len(devices) == 56
    (slice_,) = resource_slices(NODE, UID, DRIVER, devices, 7, layout)
    assert slice_["apiVersion"] == "resource.k8s.io/v1" and slice_["kind"] == "ResourceSlice"
    assert slice_["metadata"] == {
        "generateName": "00000-gpu.nvidia.com-node-a-",
        "ownerReferences": [{"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": UID, "controller": True}],
    }
    spec = slice_["spec"]
    assert spec["driver"] == DRIVER and spec["nodeName"] == NODE
    assert spec["pool"] == {"name": NODE, "generation": 7, "resourceSliceCount": 1}
    assert [d["name"] for d in spec["devices"]][:2] == ["gpu-0-mig-1g10gb-19-0", "gpu-0-mig-1g10gb-19-1"]
    assert "sharedCounters" not in spec
    validate([slice_])


def test_devices_in_the_apis_json_form(inventory):
    (slice_,) = resource_slices(NODE, UID, DRIVER, dra_devices(inventory("a100-mig")), 1)
    first = slice_["spec"]["devices"][0]
    assert first["attributes"]["type"] == {"string": "mig"}
    assert first["attributes"]["cudaComputeCapability"] == {"version": "8.0.0"}
    assert first["attributes"]["driverVersion"] == {"version": "580.95.5"}
    assert first["attributes"]["resource.kubernetes.io/pciBusID"] == {"string": "0000:18:00.0"}
    assert first["capacity"] == {
        "copyEngines": {"value": "1"},
        "decoders": {"value": "0"},
        "encoders": {"value": "0"},
        "jpegEngines": {"value": "0"},
        "memory": {"value": "9728Mi"},
        "memorySlice0": {"value": "1"},
        "multiprocessors": {"value": "14"},
        "ofaEngines": {"value": "0"},
    }
    assert "taints" not in first and "consumesCounters" not in first


def test_int_and_bool_attributes_in_the_apis_json_form():
    (device,) = fake(1)
    device = DraDevice(**{**_fields(device), "attributes": {"numa": 1, "coherent": False, "type": "gpu"}})
    (slice_,) = resource_slices(NODE, UID, DRIVER, [device], 1)
    assert slice_["spec"]["devices"][0]["attributes"] == {
        "coherent": {"bool": False},
        "numa": {"int": 1},
        "type": {"string": "gpu"},
    }
    validate([slice_])


def test_a_node_without_devices_still_publishes_one_empty_slice():
    for layout in (COMBINED, SPLIT):
        (slice_,) = resource_slices(NODE, UID, DRIVER, [], 1, layout)
        assert slice_["spec"]["devices"] == []
        assert slice_["spec"]["pool"]["resourceSliceCount"] == 1
        validate([slice_])


# ----- splitting -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", [COMBINED, SPLIT])
def test_130_devices_split_into_two_slices_of_one_generation(layout):
    slices = resource_slices(NODE, UID, DRIVER, fake(130), 4, layout)
    assert device_counts(slices) == [128, 2]
    assert [s["spec"]["pool"] for s in slices] == [{"name": NODE, "generation": 4, "resourceSliceCount": 2}] * 2
    assert [s["metadata"]["generateName"] for s in slices] == [
        "00000-gpu.nvidia.com-node-a-",
        "00001-gpu.nvidia.com-node-a-",
    ]
    names = [d["name"] for s in slices for d in s["spec"]["devices"]]
    assert names == [f"gpu-{i}" for i in range(130)]  # by minor: gpu-2 before gpu-10
    validate(slices)


def test_a_tainted_device_caps_its_slice_at_64_from_1_35_on():
    devices = fake(130)
    taints = {"gpu-0": [DeviceTaint("gpu.nvidia.com/xid", "NoSchedule", "48", rfc3339(NOW))]}
    split = resource_slices(NODE, UID, DRIVER, devices, 1, SPLIT, taints=taints)
    assert device_counts(split) == [64, 66]
    combined = resource_slices(NODE, UID, DRIVER, devices, 1, COMBINED, taints=taints)
    assert device_counts(combined) == [128, 2]  # 1.34 has no such limit
    validate(split)
    validate(combined)


def test_only_slices_holding_a_tainted_device_are_capped():
    taints = {"gpu-100": [DeviceTaint("gpu.nvidia.com/gpu-lost")]}
    slices = resource_slices(NODE, UID, DRIVER, fake(200), 1, SPLIT, taints=taints)
    for slice_ in slices:
        tainted = any("taints" in d for d in slice_["spec"]["devices"])
        assert len(slice_["spec"]["devices"]) <= (64 if tainted else 128)
    assert sum(device_counts(slices)) == 200
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {len(slices)}


def test_same_input_same_slices_whatever_the_order():
    devices = fake(150)
    shuffled = devices[:]
    random.Random(7).shuffle(shuffled)
    assert resource_slices(NODE, UID, DRIVER, shuffled, 2) == resource_slices(NODE, UID, DRIVER, devices, 2)


def test_the_index_prefix_grows_past_five_hex_digits_only_when_needed():
    many = fake(128 * 17)
    slices = resource_slices(NODE, UID, DRIVER, many, 1)
    assert len(slices) == 17
    assert slices[16]["metadata"]["generateName"] == "00010-gpu.nvidia.com-node-a-"


# ----- counter sets (dynamic MIG, next issue): the layouts ----------------------------------------------


def partitioned(gpus: int = 2, per_gpu: int = 3) -> tuple[list[DraDevice], dict[str, dict[str, int]]]:
    sets = {f"gpu-{g}-counter-set": {"memory": 80 << 30, "memory-slice-0": 1, "memory-slice-1": 1} for g in range(gpus)}
    devices = []
    for g in range(gpus):
        for p in range(per_gpu):
            consumes = {f"gpu-{g}-counter-set": {"memory": 10 << 30, f"memory-slice-{p % 2}": 1}}
            devices.append(
                DraDevice(f"gpu-{g}-mig-{p}", "mig", f"MIG-{g}-{p}", f"GPU-{g}", g, {"type": "mig"}, {}, consumes)
            )
    return devices, sets


def test_split_layout_puts_counter_sets_in_a_slice_of_their_own_first():
    devices, sets = partitioned(gpus=10)
    slices = resource_slices(NODE, UID, DRIVER, devices, 3, SPLIT, counter_sets=sets)
    assert [sorted(s["spec"]) for s in slices[:2]] == [["driver", "nodeName", "pool", "sharedCounters"]] * 2
    assert [len(s["spec"]["sharedCounters"]) for s in slices[:2]] == [8, 2]  # at most 8 sets per slice
    assert [s["name"] for s in slices[0]["spec"]["sharedCounters"]][:3] == [
        "gpu-0-counter-set",
        "gpu-1-counter-set",
        "gpu-2-counter-set",
    ]
    assert device_counts(slices)[2:] == [30]
    assert all("sharedCounters" not in s["spec"] for s in slices[2:])
    first = slices[2]["spec"]["devices"][0]
    assert first["consumesCounters"] == [
        {"counterSet": "gpu-0-counter-set", "counters": {"memory": {"value": "10Gi"}, "memory-slice-0": {"value": "1"}}}
    ]
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {3}
    validate(slices)


def test_devices_consuming_counters_cap_a_split_slice_at_64():
    devices, sets = partitioned(gpus=2, per_gpu=40)
    slices = resource_slices(NODE, UID, DRIVER, devices, 1, SPLIT, counter_sets=sets)
    assert device_counts(slices) == [0, 64, 16]


def test_combined_layout_keeps_each_counter_set_with_its_devices():
    devices, sets = partitioned(gpus=2)
    slices = resource_slices(NODE, UID, DRIVER, devices + fake(1), 1, COMBINED, counter_sets=sets)
    assert [[c["name"] for c in s["spec"].get("sharedCounters", [])] for s in slices] == [
        ["gpu-0-counter-set"],
        ["gpu-1-counter-set"],
        [],
    ]
    assert [[d["name"] for d in s["spec"]["devices"]] for s in slices] == [
        ["gpu-0-mig-0", "gpu-0-mig-1", "gpu-0-mig-2"],
        ["gpu-1-mig-0", "gpu-1-mig-1", "gpu-1-mig-2"],
        ["gpu-0"],
    ]
    validate(slices)


def test_counter_errors_name_the_device_or_set():
    devices, _ = partitioned(gpus=1)
    with pytest.raises(SliceError, match="device gpu-0-mig-0: consumes counter set 'gpu-0-counter-set', which"):
        resource_slices(NODE, UID, DRIVER, devices, 1, SPLIT)
    with pytest.raises(SliceError, match="counter set gpu-0-counter-set: 33 counters"):
        resource_slices(NODE, UID, DRIVER, [], 1, counter_sets={"gpu-0-counter-set": {f"c{i}": 1 for i in range(33)}})
    big = {"gpu-0-counter-set": {f"c{i}": 1 for i in range(20)}, "gpu-1-counter-set": {f"c{i}": 1 for i in range(20)}}
    joined = DraDevice("gpu-0-mig-0", "mig", "MIG-0", "GPU-0", 0, {}, {}, {s: {"c0": 1} for s in big})
    with pytest.raises(SliceError, match=r"hold 40 counters and must share one slice on Kubernetes 1\.34"):
        resource_slices(NODE, UID, DRIVER, [joined], 1, COMBINED, counter_sets=big)


# ----- limits, with errors that name the device --------------------------------------------------------


def _fields(device: DraDevice) -> dict[str, Any]:
    return {f: getattr(device, f) for f in DraDevice.__struct_fields__}


def broken(**changes: Any) -> DraDevice:
    return DraDevice(**{**_fields(fake(1)[0]), **changes})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"name": "gpu.0"}, "device gpu.0: the name must be a DNS label"),
        ({"attributes": {f"a{i}": i for i in range(32)}}, "device gpu-0: 33 attributes and capacities; at most 32"),
        ({"attributes": {"productName": "x" * 65}}, "device gpu-0: attribute 'productName' is 65 characters long"),
        ({"attributes": {"driverVersion": Version("580.95.05")}}, "'580.95.05' is not a semantic version"),
        ({"attributes": {"bad-name": "x"}}, "attribute 'bad-name': the name must be a C identifier"),
        ({"attributes": {"a" * 33: "x"}}, "the name must be a C identifier of at most 32 characters"),
        ({"attributes": {"Bad_Domain/x": "x"}}, "the domain must be a DNS subdomain"),
        ({"attributes": {"type": "gpu", "gpu.nvidia.com/type": "gpu"}}, "is also given as 'type'"),
        ({"attributes": {"ratio": 0.5}}, "attribute 'ratio': a DRA attribute is a bool, an int, a str or a Version"),
        ({"capacity": {"memory": 1 << 64}}, "'memory': 18446744073709551616 is not a 64-bit integer"),
    ],
)
def test_a_device_breaking_a_rule_is_named_in_the_error(changes, message):
    with pytest.raises(SliceError, match=message.replace("(", r"\(")):
        resource_slices(NODE, UID, DRIVER, [broken(**changes)], 1)


def test_32_attributes_and_capacities_are_allowed():
    device = broken(attributes={f"a{i}": i for i in range(31)}, capacity={"memory": 1})
    validate(resource_slices(NODE, UID, DRIVER, [device], 1))


def test_taint_limits_follow_the_layout():
    four = [DeviceTaint(f"gpu.nvidia.com/k{i}") for i in range(5)]
    with pytest.raises(SliceError, match="device gpu-0: 5 taints; at most 4 are allowed"):
        resource_slices(NODE, UID, DRIVER, fake(1), 1, COMBINED, taints={"gpu-0": four})
    validate(resource_slices(NODE, UID, DRIVER, fake(1), 1, SPLIT, taints={"gpu-0": four}))  # 16 from 1.35 on
    none = {"gpu-0": [DeviceTaint("gpu.nvidia.com/xid", "None", "13")]}
    with pytest.raises(SliceError, match="effect 'None'; the API allows NoSchedule, NoExecute"):
        resource_slices(NODE, UID, DRIVER, fake(1), 1, COMBINED, taints=none)
    validate(resource_slices(NODE, UID, DRIVER, fake(1), 1, SPLIT, taints=none))
    with pytest.raises(SliceError, match="not a device of this pool"):
        resource_slices(NODE, UID, DRIVER, fake(1), 1, taints={"gpu-9": four[:1]})


def test_pool_errors():
    with pytest.raises(SliceError, match="device gpu-0: the name is used twice"):
        resource_slices(NODE, UID, DRIVER, fake(1) + fake(1), 1)
    with pytest.raises(SliceError, match="driver name 'GPU_driver'"):
        resource_slices(NODE, UID, "GPU_driver", fake(1), 1)
    with pytest.raises(SliceError, match="Node's UID"):
        resource_slices(NODE, "", DRIVER, fake(1), 1)
    with pytest.raises(SliceError, match="layout 'both'"):
        resource_slices(NODE, UID, DRIVER, fake(1), 1, "both")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "text"),
    [(80 << 30, "80Gi"), (9728 << 20, "9728Mi"), (1, "1"), (0, "0"), (14, "14"), (1536, "1536"), (1000, "1k")],
)
def test_quantities_in_canonical_binary_si_form(value, text):
    assert quantity(value) == text


@pytest.mark.parametrize(
    ("version", "layout"),
    [("v1.34.2", COMBINED), ("v1.35.0", SPLIT), ("v1.36.3-gke.100", SPLIT), ("1.37.0-beta.0", SPLIT)],
)
def test_layout_by_api_server_version(version, layout):
    assert layout_for(version) == layout


# ----- taints from health ------------------------------------------------------------------------------


def test_an_xid_on_a_gpu_taints_it_with_nvidias_key(inventory):
    devices = dra_devices(inventory({"gpus": [{"model": "A100-SXM4-80GB", "count": 2}]}))
    health = xid(HealthState(), devices[1].uuid, 48)
    taints = device_taints(devices, health, now=NOW)
    assert taints == {"gpu-1": (DeviceTaint("gpu.nvidia.com/xid", "NoSchedule", "48", "2026-07-01T12:00:00Z"),)}
    slices = resource_slices(NODE, UID, DRIVER, devices, 2, taints=taints)
    assert slices[0]["spec"]["devices"][1]["taints"] == [
        {"key": "gpu.nvidia.com/xid", "value": "48", "effect": "NoSchedule", "timeAdded": "2026-07-01T12:00:00Z"}
    ]
    assert "taints" not in slices[0]["spec"]["devices"][0]
    validate(slices)


def test_a_gpu_fault_taints_all_its_mig_devices_and_a_mig_fault_only_its_own(inventory):
    inv = inventory({"gpus": [{"model": "A100-SXM4-80GB", "count": 2, "mig": {"instances": ["3g.40gb", "3g.40gb"]}}]})
    devices = dra_devices(inv)
    on_gpu = xid(HealthState(), inv.gpus[0].uuid, 79)
    assert sorted(device_taints(devices, on_gpu, now=NOW)) == ["gpu-0-mig-3g40gb-9-0", "gpu-0-mig-3g40gb-9-4"]
    one = inv.gpus[1].mig_devices[0]
    on_mig = xid(HealthState(), one.uuid, 95, gpu_uuid=inv.gpus[1].uuid)  # uncontained ECC error
    (name,) = device_taints(devices, on_mig, now=NOW)
    assert name == next(d.name for d in devices if d.uuid == one.uuid)


def test_lost_and_unwatched_gpus(inventory):
    devices = dra_devices(inventory({"gpus": [{"model": "A100-SXM4-80GB", "count": 2}]}))
    health = record_fault(HealthState(), [devices[0].uuid], GPU_LOST_REASON, 1.0, lost=True)
    health = record_fault(health, [devices[1].uuid], "health watch failed: NOT_SUPPORTED", 1.0)
    taints = device_taints(devices, health, now=NOW)
    assert [(t.key, t.value, t.effect) for t in taints["gpu-0"]] == [("gpu.nvidia.com/gpu-lost", None, "NoSchedule")]
    assert [(t.key, t.effect) for t in taints["gpu-1"]] == [("gpu.nvidia.com/unmonitored", "NoSchedule")]


def test_an_xid_the_policy_ignores_makes_no_taint(inventory):
    devices = dra_devices(inventory({"gpus": [{"model": "A100-SXM4-80GB"}]}))
    assert device_taints(devices, xid(HealthState(), devices[0].uuid, 13), now=NOW) == {}


def test_time_added_is_kept_while_the_taint_stays_and_it_goes_when_the_gpu_recovers(inventory):
    devices = dra_devices(inventory({"gpus": [{"model": "A100-SXM4-80GB"}]}))
    uuid = devices[0].uuid
    health = xid(HealthState(), uuid, 48)
    first = device_taints(devices, health, now=NOW)
    later = NOW + timedelta(minutes=5)
    again = device_taints(devices, xid(health, uuid, 48, now=2.0), now=later, previous=first)
    assert again["gpu-0"][0].time_added == "2026-07-01T12:00:00Z"  # the same taint: its first time
    changed = device_taints(devices, xid(health, uuid, 74, now=2.0), now=later, previous=first)
    assert changed["gpu-0"] == (DeviceTaint("gpu.nvidia.com/xid", "NoSchedule", "74", "2026-07-01T12:05:00Z"),)
    assert device_taints(devices, probe_succeeded(health, uuid), now=later, previous=first) == {}


def test_one_taint_per_key_the_latest_event_wins(inventory):
    inv = inventory({"gpus": [{"model": "A100-SXM4-80GB", "mig": {"instances": ["7g.80gb"]}}]})
    devices = dra_devices(inv)
    gpu, mig = inv.gpus[0].uuid, inv.gpus[0].mig_devices[0].uuid
    health = xid(xid(HealthState(), gpu, 48, now=1.0), mig, 95, now=2.0, gpu_uuid=gpu)
    (taints,) = device_taints(devices, health, now=NOW).values()
    assert [(t.key, t.value) for t in taints] == [("gpu.nvidia.com/xid", "95")]  # its own XID came later
    health = record_fault(health, [gpu], GPU_LOST_REASON, 3.0, lost=True)
    (taints,) = device_taints(devices, health, now=NOW).values()
    assert [(t.key, t.value) for t in taints] == [("gpu.nvidia.com/gpu-lost", None), ("gpu.nvidia.com/xid", "95")]


def test_taint_keys_follow_the_driver_name(inventory):
    devices = dra_devices(inventory({"gpus": [{"model": "A100-SXM4-80GB"}]}))
    taints = device_taints(devices, xid(HealthState(), devices[0].uuid, 48), now=NOW, driver="gpu.tessera.example")
    assert taints["gpu-0"][0].key == "gpu.tessera.example/xid"


def test_time_added_is_utc_whole_seconds():
    eastern = datetime(2026, 7, 1, 4, 0, 0, 999000, tzinfo=timezone(timedelta(hours=-4)))
    assert rfc3339(eastern) == "2026-07-01T08:00:00Z"
    assert rfc3339(datetime(2026, 7, 1, 8, 0, 0)) == "2026-07-01T08:00:00Z"  # naive: taken as UTC


# ----- what the API server dropped ------------------------------------------------------------------------------


def _slice(*devices: dict, counters: bool = False) -> dict:
    spec: dict = {"devices": list(devices)}
    if counters:
        spec["sharedCounters"] = [{"name": "gpu-0-counter-set", "counters": {"memory": {"value": "80Gi"}}}]
    return {"spec": spec}


def test_dropped_gates_names_the_gates_whose_fields_the_server_did_not_keep() -> None:
    from agent.core.dra.slices import DROPPED_GATES, dropped_gates

    shared = {"name": "gpu-0", "allowMultipleAllocations": True}
    whole = {"name": "gpu-0"}
    assert dropped_gates([_slice(shared)], [_slice(whole)]) == ("DRAConsumableCapacity",)
    assert dropped_gates([_slice(shared)], [_slice(shared)]) == ()
    assert dropped_gates([_slice(whole, counters=True)], [_slice(whole)]) == ("DRAPartitionableDevices",)
    assert dropped_gates([_slice(whole)], [_slice(whole)]) == ()  # nothing gated was asked for
    assert "dra.gpuShares are allocated whole" in DROPPED_GATES["DRAConsumableCapacity"]
