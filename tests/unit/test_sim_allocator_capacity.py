"""Consumable capacity in the simulated scheduler's allocator (KEP-5075): a device with
``allowMultipleAllocations`` is shared by claims whose shares fit its capacity, each result carrying a ``shareID``
and what it consumed, requests rounded up to the device's request policy."""

from __future__ import annotations

import re
from typing import Any

import pytest

from agent.sim.scheduler import Unschedulable, allocate
from agent.sim.scheduler.allocator import devices_in_use
from tests.unit.test_sim_allocator import DRIVER, NODE, NVIDIA_GPU, gpu

CLASSES = {
    "gpu.nvidia.com": {
        "metadata": {"name": "gpu.nvidia.com"},
        "spec": {"selectors": [{"cel": {"expression": NVIDIA_GPU}}]},
    }
}
UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


def shared_gpu(minor: int, memory: str = "80Gi") -> dict[str, Any]:
    """A GPU as Tessera publishes a shareable one: memory in 1Gi steps (default: all of it), compute in percent
    (default 0: no limit, nothing reserved)."""
    device = gpu(minor, "NVIDIA A100-SXM4-80GB", "8.0.0", memory, allowMultipleAllocations=True)
    device["capacity"] = {
        "memory": {
            "value": memory,
            "requestPolicy": {"default": memory, "validRange": {"min": "1Gi", "max": memory, "step": "1Gi"}},
        },
        "computePercent": {
            "value": "100",
            "requestPolicy": {"default": "0", "validRange": {"min": "0", "max": "100", "step": "1"}},
        },
    }
    return device


def slices(*devices: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "spec": {
                "driver": DRIVER,
                "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1},
                "nodeName": NODE,
                "devices": list(devices),
            }
        }
    ]


def claim(name: str, count: int = 1, **capacity: str) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": "gpu.nvidia.com", "count": count}
    if capacity:
        exactly["capacity"] = {"requests": capacity}
    return {
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
    }


class Cluster:
    """Claims allocated one after another against the same slices, each seeing the others' shares."""

    def __init__(self, *devices: dict[str, Any]) -> None:
        self.slices = slices(*devices)
        self.claims: list[dict[str, Any]] = []

    def allocate(self, request: dict[str, Any]) -> list[dict[str, Any]]:
        held, consumed = devices_in_use(self.claims)
        done = allocate(request, self.slices, CLASSES, held, NODE, consumed=consumed)
        self.claims.append(done)
        return done["status"]["allocation"]["devices"]["results"]


def test_shares_of_one_gpu_are_allocated_until_its_memory_is_used_up() -> None:
    cluster = Cluster(shared_gpu(0))
    first = cluster.allocate(claim("a", memory="10Gi"))
    second = cluster.allocate(claim("b", memory="20Gi"))
    assert [r["device"] for r in first + second] == ["gpu-0", "gpu-0"]
    assert first[0]["consumedCapacity"] == {"computePercent": "0", "memory": "10Gi"}
    assert second[0]["consumedCapacity"]["memory"] == "20Gi"
    assert UUID.match(first[0]["shareID"]) and first[0]["shareID"] != second[0]["shareID"]
    cluster.allocate(claim("c", memory="50Gi"))  # 80Gi in all
    with pytest.raises(Unschedulable, match="have the requested capacity free"):
        cluster.allocate(claim("d", memory="1Gi"))


def test_a_request_is_rounded_up_to_the_policys_step_and_min() -> None:
    cluster = Cluster(shared_gpu(0))
    (result,) = cluster.allocate(claim("a", memory="1500Mi"))
    assert result["consumedCapacity"]["memory"] == "2Gi"
    (result,) = cluster.allocate(claim("b", memory="100Mi"))
    assert result["consumedCapacity"]["memory"] == "1Gi"


def test_a_request_above_the_policys_max_finds_no_device() -> None:
    with pytest.raises(Unschedulable):
        Cluster(shared_gpu(0)).allocate(claim("a", memory="81Gi"))


def test_a_claim_that_asks_for_no_capacity_takes_the_default_the_whole_memory() -> None:
    cluster = Cluster(shared_gpu(0))
    (whole,) = cluster.allocate(claim("a"))
    assert whole["consumedCapacity"] == {"computePercent": "0", "memory": "80Gi"}
    with pytest.raises(Unschedulable):
        cluster.allocate(claim("b", memory="1Gi"))


def test_compute_shares_add_up_to_at_most_100_percent() -> None:
    cluster = Cluster(shared_gpu(0))
    cluster.allocate(claim("a", memory="10Gi", computePercent="60"))
    with pytest.raises(Unschedulable):
        cluster.allocate(claim("b", memory="10Gi", computePercent="50"))
    (result,) = cluster.allocate(claim("c", memory="10Gi", computePercent="40"))
    assert result["consumedCapacity"]["computePercent"] == "40"


def test_a_share_that_does_not_fit_goes_to_the_next_gpu() -> None:
    cluster = Cluster(shared_gpu(0), shared_gpu(1))
    cluster.allocate(claim("a", memory="70Gi"))
    (result,) = cluster.allocate(claim("b", memory="20Gi"))
    assert result["device"] == "gpu-1"


def test_a_capacity_the_device_does_not_have_makes_it_ineligible() -> None:
    with pytest.raises(Unschedulable):
        Cluster(shared_gpu(0)).allocate(claim("a", bandwidth="1"))


def test_qualified_capacity_names_match_the_drivers_unqualified_ones() -> None:
    (result,) = Cluster(shared_gpu(0)).allocate(claim("a", **{"gpu.nvidia.com/memory": "4Gi"}))
    assert result["consumedCapacity"]["memory"] == "4Gi"


def test_a_device_without_multiple_allocations_is_allocated_whole_once_and_only_if_its_capacity_suffices() -> None:
    cluster = Cluster(gpu(0, "NVIDIA A100-SXM4-40GB", "8.0.0", "40Gi"))
    with pytest.raises(Unschedulable):
        cluster.allocate(claim("big", memory="41Gi"))
    (result,) = cluster.allocate(claim("a", memory="10Gi"))
    assert "shareID" not in result and "consumedCapacity" not in result
    with pytest.raises(Unschedulable):
        cluster.allocate(claim("b", memory="10Gi"))


def test_valid_values_round_up_to_the_next_listed_value() -> None:
    device = shared_gpu(0)
    device["capacity"]["memory"]["requestPolicy"] = {"default": "80Gi", "validValues": ["10Gi", "20Gi", "40Gi", "80Gi"]}
    (result,) = Cluster(device).allocate(claim("a", memory="11Gi"))
    assert result["consumedCapacity"]["memory"] == "20Gi"


def test_devices_in_use_counts_shares_and_whole_devices_apart() -> None:
    cluster = Cluster(shared_gpu(0), gpu(1, "NVIDIA A100-SXM4-80GB", "8.0.0", "80Gi"))
    cluster.allocate(claim("a", memory="10Gi"))
    cluster.allocate(claim("b", memory="30Gi"))
    held, consumed = devices_in_use(cluster.claims)
    assert held == set()
    assert consumed[(DRIVER, NODE, "gpu-0")]["memory"] == 40 * 2**30
