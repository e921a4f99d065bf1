"""A GPU that does not answer a read of the node is still in the node: its last description is kept."""

from __future__ import annotations

from agent.core.inventory import GpuFailure, Inventory, keep_unanswered
from tests.unit.builders import a100


def inventory(*gpus, failures=()) -> Inventory:
    return Inventory("580.95.05", "13.580.95.05", 13000, gpus=tuple(gpus), failures=tuple(failures))


def test_a_gpu_that_fell_off_the_bus_keeps_its_place_and_says_why() -> None:
    before = inventory(a100(0, "GPU-a"), a100(1, "GPU-b"), a100(2, "GPU-c"))
    now = inventory(a100(0, "GPU-a"), a100(2, "GPU-c"), failures=[GpuFailure(1, "GPU_IS_LOST", "get handle")])
    kept, unanswered = keep_unanswered(now, before)
    assert [g.uuid for g in kept.gpus] == ["GPU-a", "GPU-b", "GPU-c"]
    assert unanswered == {"GPU-b": GpuFailure(1, "GPU_IS_LOST", "get handle")}
    assert kept.failures == now.failures


def test_a_failure_that_names_its_uuid_is_matched_by_it() -> None:
    before = inventory(a100(0, "GPU-a"), a100(1, "GPU-b"))
    failure = GpuFailure(1, "UNKNOWN", "nvmlDeviceGetPciInfo", uuid="GPU-b")
    kept, unanswered = keep_unanswered(inventory(a100(0, "GPU-a"), failures=[failure]), before)
    assert [g.uuid for g in kept.gpus] == ["GPU-a", "GPU-b"] and unanswered == {"GPU-b": failure}


def test_nothing_is_kept_that_cannot_be_the_same_gpu() -> None:
    before = inventory(a100(0, "GPU-a"), a100(1, "GPU-b"))
    cases = [
        GpuFailure(2, "GPU_IS_LOST", "get handle"),  # a slot the last read did not have: a GPU never described
        GpuFailure(0, "UNKNOWN", "nvmlDeviceGetName", uuid="GPU-z"),  # another GPU at that index now
        GpuFailure(0, "UNKNOWN", "nvmlDeviceGetName", uuid="GPU-b"),  # GPU-b, but not where it was
    ]
    for failure in cases:
        now = inventory(a100(1, "GPU-b") if failure.uuid != "GPU-b" else a100(1, "GPU-y"), failures=[failure])
        assert keep_unanswered(now, before) == (now, {}), failure


def test_the_first_read_and_a_read_without_failures_are_as_they_are() -> None:
    now = inventory(a100(0, "GPU-a"), failures=[GpuFailure(1, "GPU_IS_LOST", "get handle")])
    assert keep_unanswered(now, None) == (now, {})
    clean = inventory(a100(0, "GPU-a"))
    assert keep_unanswered(clean, inventory(a100(0, "GPU-a"), a100(1, "GPU-b"))) == (clean, {})  # it left
