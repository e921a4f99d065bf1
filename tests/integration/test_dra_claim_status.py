"""A claim's ``status.devices`` written through the API server stand-in by the driver's real client code
(``agent.dra.claims_api.KubernetesClaimStatus``): entries of other drivers survive, a claim changed meanwhile is read
again, a claim gone or re-created is left alone, and what the API server refuses is said."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from agent.core.dra.device_status import DeviceStatus
from agent.dra.claims_api import ClaimStatusNotWritten, KubernetesClaimStatus
from agent.sim.apiserver import ApiServer

DRIVER, NODE = "gpu.nvidia.com", "node-a"
NIC = {"driver": "nic.example.com", "pool": NODE, "device": "eth1", "networkData": {"interfaceName": "eth1"}}


@pytest.fixture
def api() -> Iterator[ApiServer]:
    server = ApiServer(git_version="v1.37.0")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def allocated(api: ApiServer, name: str = "train") -> dict:
    """A claim allocated gpu-0 of this driver and eth1 of a NIC driver, the NIC's status already written."""
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {"requests": [
            {"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}},
            {"name": "nic", "exactly": {"deviceClassName": "nic.example.com"}},
        ]}},
    }  # fmt: skip
    created = api.create("resourceclaims", claim)
    results = [
        {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0"},
        {"request": "nic", "driver": NIC["driver"], "pool": NODE, "device": "eth1"},
    ]
    created["status"] = {"allocation": {"devices": {"results": results}}, "devices": [NIC]}
    return api.update("resourceclaims", created, status=True)


def writer(api: ApiServer) -> KubernetesClaimStatus:
    return KubernetesClaimStatus(api.api_client(), DRIVER, NODE, now=lambda: datetime(2026, 9, 1, 12, tzinfo=UTC))


def test_prepared_devices_are_added_beside_other_drivers_entries_and_taken_back(api: ApiServer) -> None:
    claim = allocated(api)
    uid = claim["metadata"]["uid"]
    assert writer(api).prepared("default", "train", uid, [DeviceStatus(NODE, "gpu-0", "GPU-1234")]) is True
    devices = api.get("resourceclaims", "train", "default")["status"]["devices"]
    assert devices[0] == NIC
    assert devices[1] == {
        "driver": DRIVER,
        "pool": NODE,
        "device": "gpu-0",
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "Prepared",
                "message": f"prepared on node {NODE}",
                "lastTransitionTime": "2026-09-01T12:00:00Z",
                "observedGeneration": claim["metadata"]["generation"],
            }
        ],
        "data": {"uuid": "GPU-1234"},
    }
    assert writer(api).prepared("default", "train", uid, [DeviceStatus(NODE, "gpu-0", "GPU-1234")]) is False  # said
    assert writer(api).unprepared("default", "train", uid, NODE, ["gpu-0"]) is True
    assert api.get("resourceclaims", "train", "default")["status"]["devices"] == [NIC]


def test_a_claim_changed_between_read_and_write_is_read_again(api: ApiServer) -> None:
    """The patch tests the resourceVersion it read; when another writer got there first the claim is read again."""
    claim = allocated(api)
    api.faults.fail_next("patch", "*", 422, message="testing value /metadata/resourceVersion failed")
    assert writer(api).prepared("default", "train", claim["metadata"]["uid"], [DeviceStatus(NODE, "gpu-0", "GPU-1")])
    devices = api.get("resourceclaims", "train", "default")["status"]["devices"]
    assert [d["device"] for d in devices] == ["eth1", "gpu-0"]
    assert api.faults.pending() == 0


def test_a_claim_that_keeps_changing_is_given_up_on_and_said(api: ApiServer) -> None:
    claim = allocated(api)
    api.faults.fail_next("patch", "*", 409, n=3)
    with pytest.raises(ClaimStatusNotWritten, match=r"kept changing while its status.devices was written"):
        writer(api).prepared("default", "train", claim["metadata"]["uid"], [DeviceStatus(NODE, "gpu-0", "GPU-1")])


def test_a_claim_gone_or_re_created_is_left_alone(api: ApiServer) -> None:
    claim = allocated(api)
    assert writer(api).prepared("default", "train", "not-its-uid", [DeviceStatus(NODE, "gpu-0", "GPU-1")]) is False
    assert api.get("resourceclaims", "train", "default")["status"]["devices"] == [NIC]
    assert writer(api).unprepared("default", "gone", claim["metadata"]["uid"], NODE, ["gpu-0"]) is False


def test_a_device_the_claim_was_not_allocated_is_refused_by_the_api_server_and_said(api: ApiServer) -> None:
    claim = allocated(api)
    with pytest.raises(ClaimStatusNotWritten, match=r"writing status.devices of ResourceClaim default/train: HTTP 422"):
        writer(api).prepared("default", "train", claim["metadata"]["uid"], [DeviceStatus(NODE, "gpu-7", "GPU-7")])


def test_a_slow_api_server_holds_a_report_no_longer_than_its_one_budget(api: ApiServer) -> None:
    """The report runs on the claim worker (the next Prepare waits behind it): its read and its write share one
    time budget, so an API server that answers each request just in time cannot stretch it to several budgets."""
    claim = allocated(api)
    api.set_latency(0.4)  # each request answers within a 0.6 s budget, a read and a write together do not
    slow = KubernetesClaimStatus(api.api_client(), DRIVER, NODE, read_timeout=0.6)
    with pytest.raises(ClaimStatusNotWritten, match=r"no answer within 0\.6 s in all|timed out|Timeout"):
        slow.prepared("default", "train", claim["metadata"]["uid"], [DeviceStatus(NODE, "gpu-0", "GPU-1234")])
    api.set_latency(0)
    assert api.get("resourceclaims", "train", "default")["status"]["devices"] == [NIC]  # nothing written


def test_a_report_that_would_overflow_status_devices_is_refused_naming_the_claim_and_nothing_is_written(
    api: ApiServer,
) -> None:
    """31 entries already there (30 NICs, and another driver's entry for a share of one of them: not ours to
    delete) and two devices prepared: 33, past the API server's 32. Cut to 32, the last of the devices just
    prepared would silently go unreported; nothing is written and the claim is named instead."""
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "wide", "namespace": "default"},
        "spec": {"devices": {"requests": [
            {"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com", "count": 2}},
            {"name": "nic", "exactly": {"deviceClassName": "nic.example.com", "count": 30}},
        ]}},
    }  # fmt: skip
    created = api.create("resourceclaims", claim)
    nics = [{"driver": NIC["driver"], "pool": NODE, "device": f"eth{i}"} for i in range(30)]
    gpus = [{"driver": DRIVER, "pool": NODE, "device": f"gpu-{i}"} for i in range(2)]
    theirs = {**nics[0], "shareID": "0b6f3a52-9f1c-4c1e-8d0e-000000000000"}
    results = [{"request": "gpu", **g} for g in gpus] + [{"request": "nic", **n} for n in nics]
    created["status"] = {"allocation": {"devices": {"results": results}}, "devices": [*nics, theirs]}
    before = api.update("resourceclaims", created, status=True)["status"]["devices"]
    ours = [DeviceStatus(NODE, "gpu-0", "GPU-0"), DeviceStatus(NODE, "gpu-1", "GPU-1")]
    with pytest.raises(ClaimStatusNotWritten) as error:
        writer(api).prepared("default", "wide", created["metadata"]["uid"], ours)
    assert str(error.value).startswith("ResourceClaim default/wide: status.devices would hold 33 entries")
    assert api.get("resourceclaims", "wide", "default")["status"]["devices"] == before  # nothing dropped
