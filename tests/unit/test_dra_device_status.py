"""A claim's status.devices as the driver reports it (``agent.core.dra.device_status``): pure values."""

from __future__ import annotations

import pytest

from agent.core.dra.device_status import (
    MAX_DEVICE_STATUSES,
    DeviceStatus,
    TooManyDeviceStatuses,
    with_prepared,
    without_ours,
)

DRIVER, POOL = "gpu.nvidia.com", "node-a"
NIC = {"driver": "nic.example.com", "pool": POOL, "device": "eth1"}


def claim(devices: list[dict] | None = None, generation: int = 3) -> dict:
    status: dict = {"allocation": {}}
    if devices is not None:
        status["devices"] = devices
    return {"metadata": {"uid": "u", "generation": generation}, "status": status}


def test_each_prepared_device_gets_a_ready_entry_with_its_uuid_and_share_beside_the_rest() -> None:
    devices = with_prepared(
        claim([NIC]),
        DRIVER,
        [DeviceStatus(POOL, "gpu-0", "GPU-a"), DeviceStatus(POOL, "gpu-1", "GPU-b", share_id="s-1")],
        "node-a",
        "2026-09-01T12:00:00Z",
    )
    assert devices is not None and devices[0] == NIC
    assert [(d["device"], d.get("shareID"), d["data"]["uuid"]) for d in devices[1:]] == [
        ("gpu-0", None, "GPU-a"),
        ("gpu-1", "s-1", "GPU-b"),
    ]
    assert devices[1]["conditions"][0] == {
        "type": "Ready",
        "status": "True",
        "reason": "Prepared",
        "message": "prepared on node node-a",
        "lastTransitionTime": "2026-09-01T12:00:00Z",
        "observedGeneration": 3,
    }


def test_a_report_already_there_is_not_written_again_and_keeps_its_transition_time() -> None:
    first = with_prepared(claim(), DRIVER, [DeviceStatus(POOL, "gpu-0", "GPU-a")], "node-a", "2026-09-01T12:00:00Z")
    assert (
        with_prepared(claim(first), DRIVER, [DeviceStatus(POOL, "gpu-0", "GPU-a")], "node-a", "2026-09-02T00:00:00Z")
        is None
    )
    changed = with_prepared(
        claim(first), DRIVER, [DeviceStatus(POOL, "gpu-0", "GPU-b")], "node-a", "2026-09-02T00:00:00Z"
    )
    assert changed is not None and len(changed) == 1 and changed[0]["data"] == {"uuid": "GPU-b"}


def test_an_entry_of_a_share_the_claim_no_longer_holds_is_replaced_not_kept_beside_the_new_one() -> None:
    """A device reported before under another shareID (an earlier allocation whose unprepare never reported) is
    this driver's stale entry: the new report replaces it. Another driver's entry for the same device stays."""
    old_share = with_prepared(
        claim([NIC]), DRIVER, [DeviceStatus(POOL, "gpu-1", "GPU-b", share_id="s-old")], "node-a", "2026-09-01T12:00:00Z"
    )
    assert old_share is not None
    theirs = {"driver": "other.example.com", "pool": POOL, "device": "gpu-1", "shareID": "s-x"}
    devices = with_prepared(
        claim([*old_share, theirs]),
        DRIVER,
        [DeviceStatus(POOL, "gpu-1", "GPU-b", share_id="s-new"), DeviceStatus(POOL, "gpu-2", "GPU-c", share_id="s-2")],
        "node-a",
        "2026-09-02T00:00:00Z",
    )
    assert devices is not None
    assert [(d["driver"], d["device"], d.get("shareID")) for d in devices] == [
        (NIC["driver"], "eth1", None),
        ("other.example.com", "gpu-1", "s-x"),
        (DRIVER, "gpu-1", "s-new"),
        (DRIVER, "gpu-2", "s-2"),
    ]


def test_unprepare_takes_back_only_this_drivers_entries_of_those_devices() -> None:
    ours = with_prepared(claim([NIC]), DRIVER, [DeviceStatus(POOL, "gpu-0", "GPU-a")], "node-a", "t")
    other_pool = {**NIC, "driver": DRIVER, "pool": "node-b", "device": "gpu-0"}
    assert without_ours(claim([*ours, other_pool]), DRIVER, POOL, ["gpu-0"]) == [NIC, other_pool]
    assert without_ours(claim([NIC]), DRIVER, POOL, ["gpu-0"]) is None
    assert without_ours(claim(), DRIVER, POOL, ["gpu-0"]) is None


def nics(n: int) -> list[dict]:
    return [{"driver": "nic.example.com", "pool": POOL, "device": f"eth{i}"} for i in range(n)]


def test_a_report_up_to_the_api_servers_bound_keeps_every_entry_ours_included() -> None:
    ours = [DeviceStatus(POOL, "gpu-0", "GPU-a"), DeviceStatus(POOL, "gpu-1", "GPU-b")]
    devices = with_prepared(claim(nics(MAX_DEVICE_STATUSES - 2)), DRIVER, ours, "node-a", "t")
    assert devices is not None and len(devices) == MAX_DEVICE_STATUSES
    assert devices[:-2] == nics(MAX_DEVICE_STATUSES - 2)
    assert [d["device"] for d in devices[-2:]] == ["gpu-0", "gpu-1"]


def test_a_report_past_the_bound_is_refused_whole_dropping_neither_ours_nor_anothers_entries() -> None:
    """Cut to the bound, the list would lose the entries appended last: the devices this Prepare just prepared,
    the claim then saying nothing of them. Making room by deleting another driver's entries is not ours to do."""
    ours = [DeviceStatus(POOL, "gpu-0", "GPU-a"), DeviceStatus(POOL, "gpu-1", "GPU-b")]
    with pytest.raises(TooManyDeviceStatuses) as error:
        with_prepared(claim(nics(MAX_DEVICE_STATUSES - 1)), DRIVER, ours, "node-a", "t")
    assert str(error.value) == (
        "status.devices would hold 33 entries with this driver's 2, more than the 32 the API server accepts; "
        "not written (no entry is dropped to make room)"
    )
