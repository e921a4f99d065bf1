"""From a ResourceClaim (as the API server returns it) to a PreparePlan, or an error naming claim and reason."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import pytest

from agent.core.dra.claims import ClaimError, ClaimRef, PreparePlan, plan_prepare
from agent.core.dra.opaque import API_VERSION

DRIVER = "gpu.nvidia.com"
POOL = "node-a"
UID = "0b6f3a52-9f1c-4c1e-8d0e-6c1a2b3c4d5e"
REF = ClaimRef("ml", "train", UID)
OTHER = ClaimRef("ml", "other", "7d4c2f0e-1111-4222-8333-944455556666")


@dataclass(frozen=True)
class Dev:
    name: str
    kind: Literal["gpu", "mig"]
    uuid: str
    parent_uuid: str | None = None
    gpu_minor: int = 0
    gi_id: int | None = None
    ci_id: int | None = None
    consumes_counters: dict[str, dict[str, int]] = field(default_factory=dict)
    gi_profile_id: int | None = None
    placement: tuple[int, int] | None = None
    capacity: dict[str, int] = field(default_factory=dict)
    allow_multiple_allocations: bool = False


DEVICES = {
    "gpu-0": Dev("gpu-0", "gpu", "GPU-aaaa", gpu_minor=0),
    "gpu-1": Dev("gpu-1", "gpu", "GPU-bbbb", gpu_minor=1),
    "gpu-2-mig-1g10gb-19-0": Dev("gpu-2-mig-1g10gb-19-0", "mig", "MIG-cccc", "GPU-2222", 2),
}


def result(device: str, request: str = "gpu", **extra: Any) -> dict[str, Any]:
    return {"request": request, "driver": DRIVER, "pool": POOL, "device": device, **extra}


def opaque(kind: str = "GpuConfig", requests: list[str] | None = None, source: str = "FromClaim", **fields: Any):
    config: dict[str, Any] = {
        "source": source,
        "opaque": {"driver": DRIVER, "parameters": {"apiVersion": API_VERSION, "kind": kind, **fields}},
    }
    if requests:
        config["requests"] = requests
    return config


def claim(results: list[dict[str, Any]], configs: list[dict[str, Any]] | None = None, uid: str = UID):
    """A ResourceClaim as resource.k8s.io/v1 returns it once allocated and reserved for a pod."""
    allocated: dict[str, Any] = {"results": results}
    if configs:
        allocated["config"] = configs
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "train", "namespace": "ml", "uid": uid, "resourceVersion": "4242"},
        "spec": {
            "devices": {
                "requests": [
                    {"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}},
                    {"name": "mig", "exactly": {"deviceClassName": "mig.nvidia.com"}},
                ]
            }
        },
        "status": {
            "allocation": {
                "devices": allocated,
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [POOL]}]}
                    ]
                },
                "allocationTimestamp": "2026-08-01T10:00:00Z",
            },
            "reservedFor": [{"resource": "pods", "name": "train-0", "uid": "5e5e5e5e-0000-4000-8000-000000000001"}],
        },
    }


def plan(document: dict[str, Any] | None, **kwargs: Any) -> PreparePlan | ClaimError:
    return plan_prepare(REF, document, driver=DRIVER, pool=POOL, devices=DEVICES, **kwargs)


def planned(document: dict[str, Any] | None, **kwargs: Any) -> PreparePlan:
    answer = plan(document, **kwargs)
    assert isinstance(answer, PreparePlan), answer.message
    return answer


def refused(document: dict[str, Any] | None, **kwargs: Any) -> ClaimError:
    answer = plan(document, **kwargs)
    assert isinstance(answer, ClaimError), answer
    assert answer.message.startswith(f"ResourceClaim ml/train (uid {UID}): ")
    return answer


def test_a_claim_with_two_gpus_plans_both_with_the_default_config():
    answer = planned(claim([result("gpu-0"), result("gpu-1")]))
    assert answer.claim == REF
    assert [(d.pool, d.device, d.request_name, d.config) for d in answer.devices] == [
        (POOL, "gpu-0", "gpu", None),
        (POOL, "gpu-1", "gpu", None),
    ]
    assert answer.devices[0].info is DEVICES["gpu-0"]
    assert answer.devices[0].config_source == "default GpuConfig"


def test_other_drivers_results_and_configs_are_skipped_even_when_ours_would_refuse_them():
    foreign_config = {"source": "FromClaim", "opaque": {"driver": "nic.example.com", "parameters": {"any": "thing"}}}
    document = claim(
        [result("gpu-0"), {"request": "nic", "driver": "nic.example.com", "pool": POOL, "device": "eth0"}],
        [foreign_config, {"source": "FromClaim", "requests": ["nic"]}],  # the second has no opaque: skipped too
    )
    assert [d.device for d in planned(document).devices] == ["gpu-0"]


def test_results_of_this_driver_in_another_pool_are_skipped_when_some_are_in_ours():
    document = claim([result("gpu-0"), {**result("gpu-9"), "pool": "fabric-pool"}])
    assert [d.device for d in planned(document).devices] == ["gpu-0"]


GPU_SHORT = {"sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Short"}}}


@pytest.mark.parametrize(
    ("configs", "request_name", "device", "chosen"),
    [
        pytest.param([opaque(source="FromClass")], "gpu", "gpu-0", "config[0]", id="a class config applies"),
        pytest.param(
            [opaque(requests=["gpu"]), opaque(source="FromClass", requests=["gpu"])],
            "gpu",
            "gpu-0",
            "config[0]",
            id="a claim config beats a class config whatever the order",
        ),
        pytest.param(
            [opaque(requests=["gpu"]), opaque(requests=["gpu"])],
            "gpu",
            "gpu-0",
            "config[1]",
            id="the later claim config wins",
        ),
        pytest.param(
            [opaque(requests=["gpu"]), opaque()],
            "gpu",
            "gpu-0",
            "config[0]",
            id="a config naming the request beats one for all requests",
        ),
        pytest.param(
            [opaque(), opaque("MigDeviceConfig")],
            "gpu",
            "gpu-0",
            "config[0]",
            id="a config for all requests of another type is passed over",
        ),
        pytest.param(
            [opaque(requests=["mig"])],
            "gpu",
            "gpu-0",
            "default GpuConfig",
            id="a config naming another request does not apply",
        ),
        pytest.param(
            [opaque("MigDeviceConfig", requests=["gpu"])],
            "gpu/mig-1g",
            "gpu-2-mig-1g10gb-19-0",
            "config[0]",
            id="a config naming the main request applies to its subrequest",
        ),
        pytest.param(
            [opaque("MigDeviceConfig", requests=["gpu/mig-2g"])],
            "gpu/mig-1g",
            "gpu-2-mig-1g10gb-19-0",
            "default MigDeviceConfig",
            id="a config naming another subrequest does not apply",
        ),
    ],
)
def test_the_config_that_applies_follows_nvidias_precedence(
    configs: list[dict[str, Any]], request_name: str, device: str, chosen: str
):
    (only,) = planned(claim([result(device, request_name)], configs)).devices
    assert only.config_source.startswith(chosen)


def test_a_config_naming_the_request_of_the_wrong_type_is_refused_in_nvidias_words():
    answer = refused(claim([result("gpu-2-mig-1g10gb-19-0", "mig")], [opaque("GpuConfig", requests=["mig"])]))
    assert (
        'config[0] (FromClaim, GpuConfig, requests [mig]): cannot apply GpuConfig to device "gpu-2-mig-1g10gb-19-0" '
        'of type "mig" (request: mig)' in answer.reason
    )
    assert not answer.retriable


def test_time_slicing_plans_the_interval_on_whole_gpus_only():
    answer = planned(claim([result("gpu-0"), result("gpu-1")], [opaque(requests=["gpu"], **GPU_SHORT)]))
    assert [d.timeslice for d in answer.devices] == [1, 1]  # Short
    mig = {"sharing": {"strategy": "TimeSlicing"}}
    answer = planned(
        claim([result("gpu-2-mig-1g10gb-19-0", "mig")], [opaque("MigDeviceConfig", requests=["mig"], **mig)])
    )
    assert answer.devices[0].timeslice is None  # accepted and does nothing, as on NVIDIA's driver


def test_mps_plans_the_claims_settings_for_its_devices():
    mps = {"sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}}}
    answer = planned(claim([result("gpu-0"), result("gpu-1")], [opaque(source="FromClass", **mps)]))
    assert [d.mps.default_active_thread_percentage for d in answer.devices] == [50, 50]
    assert all(d.timeslice is None for d in answer.devices)


def test_one_claims_mps_devices_must_share_one_config():
    fifty = {"sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 50}}}
    twenty = {"sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 20}}}
    answer = refused(
        claim([result("gpu-0"), result("gpu-1", request="other")],
              [opaque(requests=["gpu"], **fifty), opaque(requests=["other"], **twenty)])
    )  # fmt: skip
    assert "have different MPS settings; one claim's MPS devices share one daemon" in answer.reason


def test_a_misspelt_field_in_a_claim_config_names_the_claim_the_config_and_the_field():
    answer = refused(claim([result("gpu-0")], [opaque(sharing={"stratgy": "MPS"})]))
    assert answer.reason == (
        "config[0] (FromClaim, requests [all]): error decoding config parameters: "
        'strict decoding error: unknown field "sharing.stratgy" (did you mean "strategy"?)'
    )


@pytest.mark.parametrize("kind", ["VfioDeviceConfig", "ComputeDomainChannelConfig", "ComputeDomainDaemonConfig"])
def test_a_config_for_devices_tessera_does_not_publish_is_skipped_when_it_names_no_request(kind):
    """NVIDIA skips a class-wide config whose type matches no device of the claim: a plain GPU claim is prepared."""
    answer = planned(claim([result("gpu-0"), result("gpu-2-mig-1g10gb-19-0", request="mig")], [opaque(kind)]))
    assert [(d.device, d.config) for d in answer.devices] == [("gpu-0", None), ("gpu-2-mig-1g10gb-19-0", None)]


def test_a_vfio_config_naming_a_gpu_request_fails_the_claim_as_on_nvidias_driver():
    answer = refused(claim([result("gpu-0")], [opaque("VfioDeviceConfig", requests=["gpu"])]))
    assert 'cannot apply VfioDeviceConfig to device "gpu-0" of type "gpu" (request: gpu)' in answer.reason


def test_a_vfio_config_naming_another_request_does_not_touch_the_gpu():
    answer = planned(claim([result("gpu-0")], [opaque("VfioDeviceConfig", requests=["vfio"])]))
    assert [(d.device, d.config) for d in answer.devices] == [("gpu-0", None)]


def test_a_multi_user_mps_config_fails_the_claim_it_applies_to_by_name_and_no_other():
    mps = {"sharing": {"strategy": "MPS", "mpsConfig": {"multiUser": True}}}
    answer = refused(claim([result("gpu-0")], [opaque(**mps)]))
    assert answer.reason.startswith(
        "config[0] (FromClaim, GpuConfig, requests [all]): sharing.mpsConfig.multiUser: true"
    )
    assert "is not supported by Tessera" in answer.reason
    elsewhere = planned(claim([result("gpu-0")], [opaque(requests=["mig"], **mps)]))  # applies to no device here
    assert [(d.device, d.config) for d in elsewhere.devices] == [("gpu-0", None)]


def test_an_invalid_config_source_is_refused():
    answer = refused(claim([result("gpu-0")], [opaque(source="FromNowhere")]))
    assert "invalid config source: FromNowhere" in answer.reason


@pytest.mark.parametrize(
    ("kwargs", "document", "message"),
    [
        pytest.param(
            {},
            claim([result("gpu-7")]),
            'requested device "gpu-7" does not exist on this node (pool node-a)',
            id="device not on this node",
        ),
        pytest.param(
            {"unhealthy": {"gpu-0": "XID 79"}},
            claim([result("gpu-0")]),
            'requested device "gpu-0" (GPU-aaaa) is Unhealthy: XID 79',
            id="unhealthy device",
        ),
        pytest.param(
            {"held_by": {"gpu-1": OTHER}},
            claim([result("gpu-1")]),
            f"requested device gpu-1 is already allocated to different claim {OTHER.uid} (ml/other)",
            id="device prepared for another claim",
        ),
    ],
)
def test_a_device_that_cannot_be_used_is_named_with_the_reason(
    kwargs: dict[str, Any], document: dict[str, Any], message: str
):
    answer = refused(document, **kwargs)
    assert message in answer.reason
    assert not answer.retriable


def test_every_problem_of_a_claim_is_reported_at_once():
    answer = refused(claim([result("gpu-0"), result("gpu-1")]), unhealthy={"gpu-0": ""}, held_by={"gpu-1": OTHER})
    assert answer.reason == (
        'requested device "gpu-0" (GPU-aaaa) is Unhealthy; '
        f"requested device gpu-1 is already allocated to different claim {OTHER.uid} (ml/other)"
    )


def test_a_device_this_claim_already_holds_is_fine():
    assert isinstance(plan(claim([result("gpu-1")]), held_by={"gpu-1": REF}), PreparePlan)


def test_admin_access_may_use_a_device_another_claim_holds_and_an_unhealthy_one():
    answer = planned(
        claim([result("gpu-1", adminAccess=True)]), held_by={"gpu-1": OTHER}, unhealthy={"gpu-1": "XID 48"}
    )
    assert answer.devices[0].admin_access


def test_share_id_is_kept_for_the_kubelet():
    share = "9a9a9a9a-0000-4000-8000-000000000002"
    assert planned(claim([result("gpu-0", shareID=share)])).devices[0].share_id == share


@pytest.mark.parametrize(
    ("document", "message", "retriable"),
    [
        pytest.param(None, "not found in the API server: it was deleted before it could be prepared", True, id="gone"),
        pytest.param(
            claim([result("gpu-0")], uid="11111111-2222-4333-8444-555555555555"),
            "the API server has a claim of that name with uid 11111111-2222-4333-8444-555555555555",
            True,
            id="deleted and re-created",
        ),
        pytest.param({**claim([]), "status": {}}, "not allocated yet (no status.allocation)", True, id="not allocated"),
        pytest.param(
            claim([{**result("gpu-0"), "pool": "node-b"}]),
            "is allocated devices of driver gpu.nvidia.com in pool node-b, not in this node's pool node-a",
            False,
            id="another node's pool",
        ),
        pytest.param(
            claim([{**result("x"), "driver": "nic.example.com"}]),
            "has no devices from driver gpu.nvidia.com",
            False,
            id="no devices of ours",
        ),
        pytest.param(
            claim([result("gpu-0")] * 33), "has 33 allocation results, more than the API's limit of 32", False, id="33"
        ),
    ],
)
def test_a_claim_that_cannot_be_prepared_says_why_and_whether_a_retry_can_help(
    document: dict[str, Any] | None, message: str, retriable: bool
):
    answer = refused(document)
    assert message in answer.reason
    assert answer.retriable is retriable


def test_a_partition_and_the_whole_of_a_dynamic_mig_gpu_are_planned():
    """The whole GPU is published only where it can be prepared (MIG mode off, or switched off at Prepare)."""
    counters = {"gpu-0-counter-set": {"memory-slice-0": 1}}
    devices = {
        "gpu-0": Dev("gpu-0", "gpu", "GPU-aaaa", consumes_counters=counters),
        "gpu-0-mig-1g10gb-19-0": Dev(
            "gpu-0-mig-1g10gb-19-0", "mig", "", "GPU-aaaa", consumes_counters=counters, gi_profile_id=19,
            placement=(0, 1),
        ),
    }  # fmt: skip
    answer = plan_prepare(REF, claim([result("gpu-0-mig-1g10gb-19-0")]), driver=DRIVER, pool=POOL, devices=devices)
    assert isinstance(answer, PreparePlan) and answer.devices[0].info.placement == (0, 1)
    answer = plan_prepare(REF, claim([result("gpu-0")]), driver=DRIVER, pool=POOL, devices=devices)
    assert isinstance(answer, PreparePlan) and answer.devices[0].info.placement is None
