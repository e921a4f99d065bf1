"""Per-GPU cordon entries: what an annotation names on this node, and what it cannot."""

from __future__ import annotations

import pytest

from agent.core.cordon import MAX_ENTRIES, NO_CORDON, parse_cordon
from agent.gpu.discovery import discover

TESSERA = "tessera.dev/gpu-cordon"
HAMI = "hami.io/device-cordon"


@pytest.fixture
def inventory(sim_node):
    sim_node({"gpus": [{"model": "A100-SXM4-80GB", "count": 2, "mig": {"instances": ["3g.40gb", "3g.40gb"]}},
                       {"model": "A100-SXM4-80GB", "count": 2}]})  # fmt: skip
    return discover()


def test_gpus_by_index_and_uuid_and_mig_devices_by_uuid(inventory):
    gpu0, _, gpu2, gpu3 = inventory.gpus
    mig = gpu0.mig_devices[1].uuid
    cordon = parse_cordon({TESSERA: f"2, {gpu3.uuid} {mig}", HAMI: None}, inventory)
    assert cordon.units == {gpu2.uuid, gpu3.uuid, mig}
    assert cordon.problems == ()
    assert cordon.sources[gpu2.uuid] == (TESSERA,)


def test_hamis_annotation_is_read_the_same_way_and_both_keys_are_named(inventory):
    gpu = inventory.gpus[3]
    cordon = parse_cordon({TESSERA: "3", HAMI: gpu.uuid}, inventory)
    assert cordon.units == {gpu.uuid}
    assert cordon.sources[gpu.uuid] == (HAMI, TESSERA)


@pytest.mark.parametrize("value", [None, "", " , ,"])
def test_an_absent_or_empty_annotation_cordons_nothing(inventory, value):
    assert parse_cordon({TESSERA: value}, inventory) == NO_CORDON


def test_entries_that_name_nothing_here_are_reported_and_the_rest_still_apply(inventory):
    cordon = parse_cordon({TESSERA: "GPU-00000000-0000-0000-0000-000000000000,4,-1,gpu1,\x1b[31m,1"}, inventory)
    assert cordon.units == {inventory.gpus[1].uuid}
    assert len(cordon.problems) == 5
    assert all(p.startswith(f"{TESSERA}: ") and "is not a GPU or MIG device of this node" in p for p in cordon.problems)
    assert "name GPUs by index (0-3) or UUID" in cordon.problems[0]
    assert not any("\x1b" in p for p in cordon.problems)  # control characters never reach a log line


def test_a_huge_annotation_is_read_up_to_a_bound(inventory):
    cordon = parse_cordon({TESSERA: ",".join(["0"] * (MAX_ENTRIES + 10))}, inventory)
    assert cordon.units == {inventory.gpus[0].uuid}
    assert cordon.problems == (
        f"{TESSERA}: {MAX_ENTRIES + 10} entries, at most {MAX_ENTRIES} are read; the rest are ignored",
    )
