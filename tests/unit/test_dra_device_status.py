"""A claim's status.devices as the driver reports it (``agent.core.dra.device_status``): pure values."""

from __future__ import annotations

from agent.core.dra.device_status import DeviceStatus, with_prepared, without_ours

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


def test_unprepare_takes_back_only_this_drivers_entries_of_those_devices() -> None:
    ours = with_prepared(claim([NIC]), DRIVER, [DeviceStatus(POOL, "gpu-0", "GPU-a")], "node-a", "t")
    other_pool = {**NIC, "driver": DRIVER, "pool": "node-b", "device": "gpu-0"}
    assert without_ours(claim([*ours, other_pool]), DRIVER, POOL, ["gpu-0"]) == [NIC, other_pool]
    assert without_ours(claim([NIC]), DRIVER, POOL, ["gpu-0"]) is None
    assert without_ours(claim(), DRIVER, POOL, ["gpu-0"]) is None
