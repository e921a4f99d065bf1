"""Each GPU is served by exactly one front end, and a GPU in use never changes front end."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from agent.core.dra.ownership import OwnershipError, dra_gpus, transition, without
from agent.core.inventory import Inventory
from agent.gpu.discovery import discover


@pytest.fixture
def node(sim_node: Callable[[object], object]) -> Inventory:
    sim_node("dgx-a100")
    return discover()


def test_dra_off_serves_nothing_and_all_serves_every_gpu(node: Inventory) -> None:
    assert dra_gpus(None, node) == frozenset()
    assert dra_gpus("all", node) == {g.uuid for g in node.gpus}


def test_indices_and_uuids_pick_those_gpus_and_the_plugin_keeps_the_rest(node: Inventory) -> None:
    chosen = dra_gpus([0, node.gpus[3].uuid], node)
    assert chosen == {node.gpus[0].uuid, node.gpus[3].uuid}
    left = without(node, chosen)
    assert [g.index for g in left.gpus] == [1, 2, 4, 5, 6, 7]
    assert not chosen & {g.uuid for g in left.gpus}  # never both


def test_a_gpu_the_node_does_not_have_is_named_with_what_it_has(node: Inventory) -> None:
    with pytest.raises(OwnershipError, match=r"dra.gpus: 9, GPU-00000000-0000-0000-0000-000000000000 is not a GPU"):
        dra_gpus([9, "GPU-00000000-0000-0000-0000-000000000000"], node)


def test_a_gpu_in_use_waits_where_it_is() -> None:
    moved = transition(current={"a", "b"}, wanted={"b", "c", "d"}, busy_in_plugin={"c"}, busy_in_dra={"a"})
    assert moved.dra == {"a", "b", "d"}  # a: a claim holds it; c: a pod holds it; d: free, moved
    assert moved.waiting["a"].startswith("to the device plugin") and moved.waiting["c"].startswith("to DRA")
    assert set(moved.waiting) == {"a", "c"}


def test_free_gpus_move_at_once_both_ways() -> None:
    moved = transition(current={"a"}, wanted={"b"}, busy_in_plugin=set(), busy_in_dra=set())
    assert moved.dra == {"b"} and moved.waiting == {}
