"""preferred(): GetPreferredAllocation (device plugin §7) over hand-built nodes, no driver involved.

Nodes used below:
- an 8-GPU NVLink node: GPUs 0-3 are NVLink peers of each other (NUMA 0), 4-7 likewise (NUMA 1);
- an 8-GPU PCIe node without NVLink: GPUs 0-3 on NUMA 0, 4-7 on NUMA 1, so NUMA decides;
- a 2-GPU MIG node with seven 1g.10gb devices per GPU;
- a 24-GPU node with three NVLink islands of 8, big enough for the greedy fallback.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import combinations
from math import comb

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.core.preferred import EXHAUSTIVE_LIMIT, DeviceLayout, PreferenceError, preferred
from agent.core.resources import Device


def gpu_uuid(index: int) -> str:
    return f"GPU-{index:08x}-1111-4000-8000-000000000000"


def mig_uuid(gpu_index: int, mig_index: int) -> str:
    return f"MIG-{gpu_index:08x}-2222-5000-8000-{mig_index:012x}"


def gpu_device(index: int, numa: int | None) -> Device:
    return Device(
        id=gpu_uuid(index),
        gpu_uuid=gpu_uuid(index),
        gpu_index=index,
        index=str(index),
        memory_mib=81920,
        numa_node=numa,
    )


def mig_device(gpu_index: int, mig_index: int) -> Device:
    return Device(
        id=mig_uuid(gpu_index, mig_index),
        gpu_uuid=gpu_uuid(gpu_index),
        gpu_index=gpu_index,
        index=f"{gpu_index}:{mig_index}",
        memory_mib=9728,
        mig_uuid=mig_uuid(gpu_index, mig_index),
        mig_profile="1g.10gb",
        numa_node=gpu_index,
    )


class Node:
    """A resource's devices in plan order, the node's NVLink peers, and ``preferred`` bound to them."""

    def __init__(
        self,
        devices: Sequence[Device],
        islands: Sequence[Sequence[int]] = (),
        extra_links: Sequence[tuple[int, int]] = (),
    ):
        self.devices = {d.id: d for d in devices}
        peers: dict[int, set[int]] = {d.gpu_index: set() for d in devices}
        for island in islands:
            for a, b in combinations(island, 2):
                peers[a].add(b)
                peers[b].add(a)
        for a, b in extra_links:
            peers[a].add(b)
            peers[b].add(a)
        self.nvlink_peers = {gpu: frozenset(p) for gpu, p in peers.items()}

    def pick(self, available: Sequence[str], size: int, must_include: Sequence[str] = ()) -> list[str]:
        return preferred(list(available), list(must_include), size, self.devices, self.nvlink_peers)


def nvlink_node(gpus: int = 8, island_size: int = 4) -> Node:
    islands = [range(start, start + island_size) for start in range(0, gpus, island_size)]
    return Node([gpu_device(i, i // island_size) for i in range(gpus)], islands=islands)


def pcie_node() -> Node:
    return Node([gpu_device(i, i // 4) for i in range(8)])


def mig_node() -> Node:
    return Node([mig_device(g, m) for g in range(2) for m in range(7)])


def ids(*indices: int) -> list[str]:
    return [gpu_uuid(i) for i in indices]


def indices(picked: Sequence[str]) -> list[int]:
    return [int(uuid[4:12], 16) for uuid in picked]


ALL8 = ids(*range(8))


# ----- NVLink node ---------------------------------------------------------------------------------


def test_four_gpu_request_on_two_nvlink_islands_lands_on_one_island_the_lowest():
    assert indices(nvlink_node().pick(ALL8, 4)) == [0, 1, 2, 3]


def test_must_include_gpu_5_pulls_the_set_to_island_4_to_7_with_gpu_5_first():
    picked = nvlink_node().pick(ALL8, 4, must_include=ids(5))
    assert indices(picked) == [5, 4, 6, 7]


def test_three_gpu_request_goes_to_the_island_that_can_hold_it_whole():
    # island 0-3 has only 0 and 1 left; island 4-7 still has 4, 5 and 6
    picked = nvlink_node().pick(ids(0, 1, 4, 5, 6), 3)
    assert indices(picked) == [4, 5, 6]


def test_two_gpu_request_takes_nvlink_pair_over_lower_indexed_gpus_on_different_islands():
    assert indices(nvlink_node().pick(ids(0, 4, 5), 2)) == [4, 5]


def test_must_include_on_both_islands_fills_up_from_the_lowest_island():
    # {0, 4} + {1, 2} and {0, 4} + {5, 6} score the same; the tie goes to the lower GPUs
    assert indices(nvlink_node().pick(ALL8, 4, must_include=ids(0, 4))) == [0, 4, 1, 2]


def test_whole_node_request_returns_every_gpu_in_plan_order():
    assert indices(nvlink_node().pick(list(reversed(ALL8)), 8)) == list(range(8))


def test_single_gpu_request_takes_the_lowest_available_gpu():
    assert indices(nvlink_node().pick(ids(6, 3, 5), 1)) == [3]


def test_nvlink_beats_same_numa_node():
    # GPU 0 has an NVLink to GPU 4 across the sockets; GPU 1 only shares its NUMA node
    node = Node([gpu_device(i, i // 4) for i in range(8)], extra_links=[(0, 4)])
    assert indices(node.pick(ALL8, 2, must_include=ids(0))) == [0, 4]


# ----- PCIe node: NUMA decides ---------------------------------------------------------------------


def test_pcie_node_keeps_a_two_gpu_request_on_one_numa_node():
    assert indices(pcie_node().pick(ids(3, 4, 5), 2)) == [4, 5]


def test_pcie_node_must_include_picks_partners_on_the_same_numa_node():
    assert indices(pcie_node().pick(ALL8, 3, must_include=ids(6))) == [6, 4, 5]


def test_pcie_node_with_unknown_numa_falls_back_to_plan_order():
    node = Node([gpu_device(i, None) for i in range(4)])
    assert indices(node.pick(ids(3, 1, 2), 2)) == [1, 2]


def test_pcie_node_spans_sockets_when_no_numa_node_has_enough():
    assert indices(pcie_node().pick(ids(0, 1, 4), 3)) == [0, 1, 4]


# ----- determinism and input handling --------------------------------------------------------------


def test_same_inputs_same_answer():
    answers = {tuple(nvlink_node().pick(ids(0, 2, 3, 5, 6, 7), 3, must_include=ids(2))) for _ in range(20)}
    assert len(answers) == 1


def test_answer_does_not_depend_on_the_order_of_available():
    node = nvlink_node()
    assert node.pick(ids(7, 1, 5, 0, 4), 3) == node.pick(ids(0, 1, 4, 5, 7), 3) == ids(4, 5, 7)


def test_unknown_ids_in_available_are_ignored():
    picked = nvlink_node().pick(["GPU-stale", *ids(4, 5), "GPU-gone::0"], 2)
    assert indices(picked) == [4, 5]


def test_duplicate_ids_are_counted_once():
    assert indices(nvlink_node().pick(ids(4, 4, 5), 2, must_include=ids(4, 4))) == [4, 5]


def test_size_equal_to_must_include_returns_exactly_must_include_in_its_order():
    assert indices(nvlink_node().pick(ALL8, 2, must_include=ids(6, 1))) == [6, 1]


# ----- errors the kubelet gets back as INVALID_ARGUMENT --------------------------------------------


def test_unknown_must_include_id_is_an_error_naming_it():
    with pytest.raises(PreferenceError, match="GPU-nope"):
        nvlink_node().pick(ALL8, 2, must_include=["GPU-nope"])


@pytest.mark.parametrize(("size", "must_include"), [(0, ()), (-1, ()), (1, (0, 1))])
def test_size_below_what_is_required_is_an_error(size: int, must_include: tuple[int, ...]):
    with pytest.raises(PreferenceError, match=f"size {size}"):
        nvlink_node().pick(ALL8, size, must_include=ids(*must_include))


def test_more_than_available_is_an_error_with_the_counts():
    with pytest.raises(PreferenceError, match="3 requested, 2 available"):
        nvlink_node().pick(ids(0, 1), 3)


def test_unknown_available_ids_do_not_count_towards_availability():
    with pytest.raises(PreferenceError, match="not enough available devices"):
        nvlink_node().pick([*ids(0), "GPU-stale"], 2)


def test_preference_error_is_a_value_error():
    assert issubclass(PreferenceError, ValueError)


# ----- MIG devices keep plan order -----------------------------------------------------------------


def test_mig_devices_keep_plan_order_whatever_order_they_are_offered_in():
    node = mig_node()
    offered = [mig_uuid(1, 3), mig_uuid(0, 6), mig_uuid(1, 0), mig_uuid(0, 2)]
    assert node.pick(offered, 3) == [mig_uuid(0, 2), mig_uuid(0, 6), mig_uuid(1, 0)]


def test_mig_must_include_comes_first_then_plan_order():
    node = mig_node()
    offered = [mig_uuid(g, m) for g in range(2) for m in range(7)]
    assert node.pick(offered, 3, must_include=[mig_uuid(1, 5)]) == [mig_uuid(1, 5), mig_uuid(0, 0), mig_uuid(0, 1)]


# ----- big nodes: greedy fallback ------------------------------------------------------------------


def test_big_node_falls_back_to_greedy_and_still_fills_one_island():
    node = nvlink_node(gpus=24, island_size=8)
    assert comb(24, 8) > EXHAUSTIVE_LIMIT  # too many sets to score them all
    assert indices(node.pick(ids(*range(24)), 8)) == list(range(8))


def test_big_node_greedy_follows_must_include_to_its_island():
    node = nvlink_node(gpus=24, island_size=8)
    picked = node.pick(ids(*range(24)), 8, must_include=ids(17))
    assert picked[0] == gpu_uuid(17)
    assert sorted(indices(picked)) == list(range(16, 24))


# ----- properties ----------------------------------------------------------------------------------


@st.composite
def requests(draw: st.DrawFn, gpus: int = 8) -> tuple[list[str], list[str], int]:
    """(available in random order, must_include drawn from it, a feasible size)."""
    available = draw(st.lists(st.integers(0, gpus - 1), min_size=1, max_size=gpus, unique=True))
    must = draw(st.lists(st.sampled_from(available), max_size=len(available), unique=True))
    size = draw(st.integers(max(1, len(must)), len(available)))
    return ids(*available), ids(*must), size


NODES = {"nvlink": nvlink_node(), "pcie": pcie_node()}


@settings(max_examples=150, deadline=None)
@given(kind=st.sampled_from(sorted(NODES)), request=requests())
def test_property_answer_is_size_unique_available_ids_starting_with_must_include(
    kind: str, request: tuple[list[str], list[str], int]
):
    available, must, size = request
    picked = NODES[kind].pick(available, size, must_include=must)
    assert len(picked) == size
    assert len(set(picked)) == size
    assert set(picked) <= set(available)
    assert picked[: len(must)] == must


@settings(max_examples=100, deadline=None)
@given(kind=st.sampled_from(sorted(NODES)), request=requests(), seed=st.randoms(use_true_random=False))
def test_property_deterministic_and_independent_of_available_order(
    kind: str, request: tuple[list[str], list[str], int], seed
):
    available, must, size = request
    node = NODES[kind]
    first = node.pick(available, size, must_include=must)
    shuffled = list(available)
    seed.shuffle(shuffled)
    assert node.pick(available, size, must_include=must) == first
    assert node.pick(shuffled, size, must_include=must) == first


@settings(max_examples=150, deadline=None)
@given(request=requests())
def test_property_request_that_fits_in_one_island_stays_in_one_island(request: tuple[list[str], list[str], int]):
    available, _, size = request
    islands = [set(ids(0, 1, 2, 3)), set(ids(4, 5, 6, 7))]
    if not any(len(island & set(available)) >= size for island in islands):
        return
    picked = set(nvlink_node().pick(available, size))
    assert any(picked <= island for island in islands)


@settings(max_examples=150, deadline=None)
@given(request=requests())
def test_property_pcie_request_that_fits_in_one_numa_node_stays_there(request: tuple[list[str], list[str], int]):
    available, _, size = request
    numa_nodes = [set(ids(0, 1, 2, 3)), set(ids(4, 5, 6, 7))]
    if not any(len(numa & set(available)) >= size for numa in numa_nodes):
        return
    picked = set(pcie_node().pick(available, size))
    assert any(picked <= numa for numa in numa_nodes)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_property_mig_answer_is_must_include_then_plan_order(data: st.DataObject):
    node = mig_node()
    plan_order = list(node.devices)
    available = data.draw(st.lists(st.sampled_from(plan_order), min_size=1, unique=True))
    must = data.draw(st.lists(st.sampled_from(available), max_size=len(available), unique=True))
    size = data.draw(st.integers(max(1, len(must)), len(available)))
    picked = node.pick(available, size, must_include=must)
    rest = [i for i in plan_order if i in available and i not in must]
    assert picked == must + rest[: size - len(must)]


@settings(max_examples=100, deadline=None)
@given(
    gpus=st.integers(1, 10),
    data=st.data(),
)
def test_property_random_topologies_give_valid_deterministic_answers(gpus: int, data: st.DataObject):
    numa = data.draw(st.lists(st.one_of(st.none(), st.integers(0, 2)), min_size=gpus, max_size=gpus))
    pairs = list(combinations(range(gpus), 2))
    links = data.draw(st.lists(st.sampled_from(pairs), unique=True)) if pairs else []
    node = Node([gpu_device(i, numa[i]) for i in range(gpus)], extra_links=links)
    available, must, size = data.draw(requests(gpus))
    picked = node.pick(available, size, must_include=must)
    assert len(picked) == len(set(picked)) == size
    assert set(picked) <= set(available)
    assert picked[: len(must)] == must
    assert node.pick(list(reversed(available)), size, must_include=must) == picked


@settings(max_examples=50, deadline=None)
@given(request=requests(), extra=st.integers(1, 3))
def test_property_asking_for_more_than_available_is_always_an_error(
    request: tuple[list[str], list[str], int], extra: int
):
    available, must, _ = request
    with pytest.raises(PreferenceError):
        nvlink_node().pick(available, len(available) + extra, must_include=must)


def link_score(a: Device, b: Device, nvlink_peers: dict[int, frozenset[int]]) -> int:
    """The scoring rule, written out independently: same GPU, NVLink, same NUMA node, else across sockets."""
    if a.gpu_index == b.gpu_index:
        return 200
    if b.gpu_index in nvlink_peers.get(a.gpu_index, frozenset()):
        return 100
    return 20 if a.numa_node is not None and a.numa_node == b.numa_node else 10


@settings(max_examples=150, deadline=None)
@given(gpus=st.integers(1, 10), data=st.data())
def test_property_answer_is_the_best_connected_set_with_ties_to_plan_order(gpus: int, data: st.DataObject):
    """The per-snapshot score table and the shortcuts give what scoring every candidate set by hand gives."""
    numa = data.draw(st.lists(st.one_of(st.none(), st.integers(0, 2)), min_size=gpus, max_size=gpus))
    pairs = list(combinations(range(gpus), 2))
    links = data.draw(st.lists(st.sampled_from(pairs), unique=True)) if pairs else []
    node = Node([gpu_device(i, numa[i]) for i in range(gpus)], extra_links=links)
    available, must, size = data.draw(requests(gpus))
    layout = DeviceLayout.of(node.devices, node.nvlink_peers)
    picked = preferred(available, must, size, node.devices, node.nvlink_peers, layout=layout)

    plan_order = [i for i in node.devices if i in available and i not in must]
    if comb(len(plan_order), size - len(must)) > EXHAUSTIVE_LIMIT:
        return

    def total(chosen: Sequence[str]) -> int:
        return sum(link_score(node.devices[a], node.devices[b], node.nvlink_peers) for a, b in combinations(chosen, 2))

    best = max(combinations(plan_order, size - len(must)), key=lambda rest: total([*must, *rest]))
    assert picked == [*must, *best]


def test_a_layout_scored_for_other_links_is_not_used_for_these():
    node = Node([gpu_device(i, i // 4) for i in range(8)], extra_links=[(0, 4)])
    stale = DeviceLayout.of(node.devices, pcie_node().nvlink_peers)  # scored without the 0-4 NVLink
    assert indices(preferred(ids(0, 1, 4), [], 2, node.devices, pcie_node().nvlink_peers, layout=stale)) == [0, 1]
    picked = preferred(ids(0, 1, 4), [], 2, node.devices, node.nvlink_peers, layout=stale)
    assert indices(picked) == [0, 4]  # the NVLink pair, as the links passed in say
