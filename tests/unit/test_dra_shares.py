"""GPU shares (agent.core.dra.shares, NVIDIA's ConsumableShares): how a shared GPU or MIG device is published in
each mode, what a claim's share is, when shares do not fit together, what a share's MPS clients are limited to, and
what holds those limits."""

from __future__ import annotations

from types import MappingProxyType

import pytest
from msgspec.structs import replace

from agent.core.dra.claims import ClaimRef, plan_prepare
from agent.core.dra.devices import DraDevice, RequestPolicy
from agent.core.dra.shares import (
    Enforcement,
    Limits,
    Share,
    check_mode,
    client_env,
    enforced_by,
    gate_note,
    limits,
    over_committed,
    server_limits,
    share_of,
    shareable,
    whole,
)
from agent.core.dra.slices import SliceError, resource_slices

GIB = 1 << 30
GPU = DraDevice(
    name="gpu-0",
    kind="gpu",
    uuid="GPU-0000",
    parent_uuid=None,
    gpu_minor=0,
    attributes=MappingProxyType({"type": "gpu", "uuid": "GPU-0000"}),
    capacity=MappingProxyType({"memory": 80 * GIB}),
)
SHARED = shareable(GPU)
REF = ClaimRef("default", "mine", "0b8e2f44-0000-4000-8000-000000000001")


def test_a_shared_gpu_is_published_multi_allocatable_with_memory_and_compute_policies() -> None:
    (item,) = resource_slices("node", "uid", "gpu.nvidia.com", [SHARED], 1)
    (device,) = item["spec"]["devices"]
    assert device["allowMultipleAllocations"] is True
    assert device["capacity"] == {
        "computePercent": {
            "value": "100",
            "requestPolicy": {"default": "0", "validRange": {"min": "0", "max": "100", "step": "1"}},
        },
        "memory": {
            "value": "80Gi",
            "requestPolicy": {"default": "80Gi", "validRange": {"min": "1Mi", "max": "80Gi", "step": "1Mi"}},
        },
    }


def test_unlimited_mode_takes_no_memory_by_default_and_any_number_of_claims_fit() -> None:
    unlimited = shareable(GPU, mode="unlimited")
    (item,) = resource_slices("node", "uid", "gpu.nvidia.com", [unlimited], 1)
    (device,) = item["spec"]["devices"]
    assert device["capacity"]["memory"]["requestPolicy"] == {
        "default": "0",
        "validRange": {"min": "0", "max": "80Gi", "step": "1Mi"},
    }
    assert "shares" not in device["capacity"]
    none = share_of(unlimited, {"memory": 0})
    assert none == Share(0) and not whole(unlimited, Share(80 * GIB))  # nothing excludes another claim
    assert limits(unlimited, Share(0)) == Limits(None, None)  # asked for nothing: nothing to hold it to


def test_integer_mode_adds_a_shares_capacity_and_a_share_without_memory_gets_its_part_of_the_gpu() -> None:
    four = shareable(GPU, mode=4)
    (item,) = resource_slices("node", "uid", "gpu.nvidia.com", [four], 1)
    (device,) = item["spec"]["devices"]
    assert device["capacity"]["shares"] == {
        "value": "4",
        "requestPolicy": {"default": "1", "validRange": {"min": "1", "max": "4", "step": "1"}},
    }
    assert device["capacity"]["memory"]["requestPolicy"]["default"] == "0"
    one = share_of(four, {"memory": 0, "shares": 1})
    assert one == Share(0, 0, 1)
    assert limits(four, one) == Limits(memory_mib=20480, threads=25)  # 1/4 of 80Gi and of the SMs
    assert limits(four, Share(GIB, 10, 1)) == Limits(memory_mib=1024, threads=10)  # what it asked for wins
    assert whole(four, Share(0, 0, 4)) and not whole(four, Share(80 * GIB, 0, 3))
    assert "exceed the device's 4" in str(over_committed(four, Share(0, 0, 2), {"default/a": Share(0, 0, 3)}))
    assert "not between 1 and the device's 4" in str(share_of(four, {"shares": 5}))


def test_a_mig_device_is_shared_with_its_engines_unsplit() -> None:
    mig = replace(
        GPU, name="gpu-0-mig-1g10gb-19-0", kind="mig", uuid="MIG-0000", parent_uuid="GPU-0000",
        capacity=MappingProxyType({"memory": 9856 * (1 << 20), "multiprocessors": 14}),
    )  # fmt: skip
    (item,) = resource_slices("node", "uid", "gpu.nvidia.com", [shareable(mig)], 1)
    (device,) = item["spec"]["devices"]
    assert device["allowMultipleAllocations"] is True
    unsplit = {"default": "0", "validValues": ["0"]}  # a claim asking for SMs does not match it
    assert device["capacity"]["multiprocessors"] == {"value": "14", "requestPolicy": unsplit}
    assert device["capacity"]["memory"]["requestPolicy"]["validRange"]["step"] == "1Mi"


@pytest.mark.parametrize("value", ["memory", "unlimited", "disabled", 4, "4", " 12 "])
def test_nvidias_consumable_shares_values_are_accepted(value: object) -> None:
    assert check_mode(value) in ("memory", "unlimited", "disabled", 4, 12)


@pytest.mark.parametrize("value", ["0", 0, -1, "four", True, "1e3", 1025, "Memory"])
def test_other_consumable_shares_values_are_refused_naming_them(value: object) -> None:
    with pytest.raises(ValueError, match="is not a consumableShares value: write memory, unlimited, disabled"):
        check_mode(value)


def test_the_server_defaults_are_the_largest_share_and_say_which_shares_they_hold_exactly() -> None:
    equal = server_limits([Limits(10240, 25), Limits(10240, 25)])
    assert equal == Limits(10240, 25)
    assert enforced_by(10240, equal.memory_mib) is Enforcement.MPS_SERVER_EXACT
    mixed = server_limits([Limits(10240, None), Limits(20480, 30)])
    assert mixed == Limits(20480, None)  # one share has no thread limit: the server's stays at 100
    assert enforced_by(10240, mixed.memory_mib) is Enforcement.MPS_SERVER_CEILING
    assert enforced_by(20480, mixed.memory_mib) is Enforcement.MPS_SERVER_EXACT
    assert enforced_by(30, mixed.threads) is Enforcement.ADVISORY
    assert enforced_by(None, mixed.threads) is None  # nothing to hold
    assert server_limits([Limits(None, None), Limits(10240, None)]).memory_mib is None  # an unlimited share
    assert enforced_by(10240, 10240, driver=True) is Enforcement.DRIVER  # issue 27


def test_a_request_policy_without_multiple_allocations_is_refused_before_publishing() -> None:
    policy = {"memory": RequestPolicy(default=GIB, minimum=GIB, maximum=80 * GIB, step=GIB)}
    with pytest.raises(
        SliceError, match="gpu-0: a capacity has a request policy, which needs allowMultipleAllocations"
    ):
        resource_slices("node", "uid", "gpu.nvidia.com", [replace(GPU, request_policies=policy)], 1)


def test_only_a_whole_gpu_or_an_existing_mig_device_can_be_shared() -> None:
    with pytest.raises(ValueError, match="only a whole GPU or an existing MIG device"):
        shareable(replace(GPU, kind="mig", name="gpu-0-mig-1g10gb-19-0", placement=(0, 1)))


def test_a_share_is_read_from_the_consumed_capacity_and_checked_against_the_gpu() -> None:
    assert share_of(SHARED, {"memory": 10 * GIB, "computePercent": 25}) == Share(10 * GIB, 25)
    assert share_of(SHARED, {"memory": 10 * GIB}) == Share(10 * GIB, 0)
    assert "not between 1048576 and the device's" in str(share_of(SHARED, {"memory": 81 * GIB}))
    assert share_of(SHARED, {"memory": 1500 << 20}) == Share(1500 << 20)  # 1Mi steps: 1500Mi is 1500Mi
    assert "not between 0 and 100" in str(share_of(SHARED, {"memory": GIB, "computePercent": 101}))
    assert whole(SHARED, Share(80 * GIB)) and not whole(SHARED, Share(79 * GIB))


def test_shares_that_together_exceed_the_gpus_memory_or_compute_do_not_fit() -> None:
    others = {"default/a": Share(50 * GIB, 60), "default/b": Share(20 * GIB)}
    assert over_committed(SHARED, Share(10 * GIB, 40), others) is None  # exactly full
    memory = over_committed(SHARED, Share(11 * GIB), others)
    assert memory is not None and "its 11Gi of gpu-0 and the 70Gi other claims hold" in memory
    compute = over_committed(SHARED, Share(GIB, 41), others)
    assert compute is not None and "exceed 100%" in compute


def test_a_shares_clients_are_limited_to_its_memory_and_compute_only_when_asked() -> None:
    held = limits(SHARED, Share(10 * GIB))
    assert client_env("GPU-0000", held) == ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=GPU-0000=10240M",)
    assert client_env("GPU-0000", limits(SHARED, Share(20 * GIB, 25)))[1] == "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25"


@pytest.mark.parametrize(("version", "needed"), [((1, 34), True), ((1, 35), True), ((1, 36), False), ((1, 37), False)])
def test_the_gate_note_names_the_versions_that_need_the_gate(version: tuple[int, int], needed: bool) -> None:
    note = gate_note(version)
    assert (note is not None) == needed
    if note:
        assert "DRAConsumableCapacity" in note and f"1.{version[1]}" in note


def claim(consumed: dict[str, str] | None, *, config: dict | None = None) -> dict:
    result = {"request": "gpu", "driver": "gpu.nvidia.com", "pool": "node", "device": "gpu-0"}
    if consumed is not None:
        result |= {"shareID": "7f0c6d3e-0000-4000-8000-000000000002", "consumedCapacity": consumed}
    devices: dict = {"results": [result]}
    if config is not None:
        devices["config"] = [{"source": "FromClaim", "opaque": {"driver": "gpu.nvidia.com", "parameters": config}}]
    return {"metadata": {"uid": REF.uid}, "status": {"allocation": {"devices": devices}}}


def plan(raw: dict, **held: object) -> object:
    return plan_prepare(REF, raw, driver="gpu.nvidia.com", pool="node", devices={"gpu-0": SHARED}, **held)  # type: ignore[arg-type]


def test_a_planned_share_is_enforced_through_mps_unless_it_is_all_of_the_gpu() -> None:
    part = plan(claim({"memory": "10Gi", "computePercent": "30"}))
    assert part.devices[0].mps_share == Share(10 * GIB, 30)  # type: ignore[union-attr]
    full = plan(claim({"memory": "80Gi", "computePercent": "0"}))
    assert full.devices[0].share == Share(80 * GIB) and full.devices[0].mps_share is None  # type: ignore[union-attr]


def test_a_whole_allocation_of_a_gpu_others_hold_shares_of_is_refused() -> None:
    refused = plan(claim(None), shares_held={"gpu-0": {"default/a": Share(10 * GIB)}})
    assert "is allocated whole, but claims hold shares of it: default/a" in refused.message  # type: ignore[union-attr]


def test_a_share_of_a_gpu_a_claim_holds_whole_is_refused() -> None:
    refused = plan(claim({"memory": "10Gi"}), held_by={"gpu-0": ClaimRef("default", "whole", "other-uid")})
    assert "already allocated to different claim other-uid" in refused.message  # type: ignore[union-attr]


def test_a_share_with_a_time_slicing_config_is_refused() -> None:
    config = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig", "sharing": {"strategy": "TimeSlicing"}}
    refused = plan(claim({"memory": "10Gi"}, config=config))
    assert "asks for TimeSlicing sharing too" in refused.message  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("consumed", "message"),
    [
        ("10Gi", "consumedCapacity is not a map of capacities"),
        ({"memory": "lots"}, "consumedCapacity memory: 'lots' is not a quantity"),
        ({"memory": "1500m"}, "consumedCapacity memory 1500m is not a whole number"),
    ],
)
def test_a_consumed_capacity_that_is_not_a_share_is_refused_naming_it(consumed: object, message: str) -> None:
    refused = plan(claim(consumed))  # type: ignore[arg-type]
    assert message in refused.message  # type: ignore[union-attr]


def test_a_claim_holds_shares_of_one_gpu_only() -> None:
    other = replace(SHARED, name="gpu-1", uuid="GPU-0001", gpu_minor=1)
    raw = claim({"memory": "10Gi"})
    second = {
        **raw["status"]["allocation"]["devices"]["results"][0],
        "device": "gpu-1",
        "consumedCapacity": {"memory": "10Gi"},
    }
    raw["status"]["allocation"]["devices"]["results"].append(second)
    refused = plan_prepare(REF, raw, driver="gpu.nvidia.com", pool="node", devices={"gpu-0": SHARED, "gpu-1": other})
    assert "it holds shares of gpu-0, gpu-1" in refused.message  # type: ignore[union-attr]


def test_a_request_policy_for_a_capacity_the_device_lacks_is_refused_before_publishing() -> None:
    policies = {**SHARED.request_policies, "bandwidth": RequestPolicy(default=1, minimum=1, maximum=1, step=1)}
    with pytest.raises(SliceError, match="request policy for bandwidth, which is not a capacity of the device"):
        resource_slices("node", "uid", "gpu.nvidia.com", [replace(SHARED, request_policies=policies)], 1)


def test_a_default_share_is_what_a_claim_that_asks_for_no_memory_gets_and_never_more_than_the_gpu() -> None:
    assert shareable(GPU, 10 * GIB).request_policies["memory"].default == 10 * GIB
    assert shareable(GPU, 100 * GIB).request_policies["memory"].default == 80 * GIB


def test_a_shares_enforcement_follows_what_its_daemon_holds_now_and_the_driver_when_it_holds_memory() -> None:
    from agent.core.dra.mps import records_specs, share_enforcement, share_record

    small = share_record("GPU-0000", Limits(10240, None), 81920)
    large = share_record("GPU-0000", Limits(20480, 30), 81920)
    records = {"a": small, "b": large}
    (spec,) = records_specs(records)
    assert spec.limits == (100, (("GPU-0000", 20480),))  # the largest memory; a share without compute: no limit
    held = share_enforcement(small, records)
    assert held is not None and held.memory is Enforcement.MPS_SERVER_CEILING and held.advisory
    alone = {"a": small}
    assert records_specs(alone)[0].limits == (100, (("GPU-0000", 10240),))
    # the daemon still holds the old ceiling (it is being set to the new one): that is what a new client meets
    now = share_enforcement(small, alone, (100, (("GPU-0000", 20480),)))
    assert now is not None and now.memory is Enforcement.MPS_SERVER_CEILING
    done = share_enforcement(small, alone, records_specs(alone)[0].limits)
    assert done is not None and done.memory is Enforcement.MPS_SERVER_EXACT and not done.advisory
    driver = share_enforcement(small, records, driver_memory=True)  # issue 27
    assert driver is not None and driver.memory is Enforcement.DRIVER
    unlimited = {"a": small, "u": share_record("GPU-0000", Limits(None, None), 81920)}
    assert records_specs(unlimited)[0].limits == (100, (("GPU-0000", 81920),))  # no ceiling: the whole memory
    free = share_enforcement(small, unlimited, records_specs(unlimited)[0].limits)
    assert free is not None and free.memory is Enforcement.ADVISORY


def test_an_advisory_share_is_announced_on_its_claim_once_per_change() -> None:
    from agent.core.announce import _shares

    class View:
        def __init__(self, note: str | None) -> None:
            device = {"device": "gpu-0"}
            if note is not None:
                device["enforcement"] = {"advisory": "advisory" in note, "note": note}  # type: ignore[assignment]
            self.dra = {"claims": [{"claim": "ml/small", "uid": "u-1", "devices": [device]}]}

    exact, advisory = View("memory 10240Mi held by the MPS server"), View("memory 10240Mi advisory: …")
    assert _shares(exact, advisory)[0].regarding == {  # type: ignore[arg-type]
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "namespace": "ml", "name": "small", "uid": "u-1",
    }  # fmt: skip
    assert _shares(advisory, View("memory 10240Mi advisory: …")) == []  # type: ignore[arg-type]
    assert _shares(advisory, exact) == []  # type: ignore[arg-type]


def test_a_share_recorded_before_records_kept_limits_lifts_the_server_limit_rather_than_cap_it() -> None:
    from agent.core.dra.mps import MpsRecord, records_specs, share_record

    new = share_record("GPU-0000", Limits(10240, None), 81920)
    old = MpsRecord(new.key, new.devices, ("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=GPU-0000=20480M",))  # an older agent's
    assert records_specs({"a": new, "b": old})[0].limits == (100, (("GPU-0000", 81920),))
