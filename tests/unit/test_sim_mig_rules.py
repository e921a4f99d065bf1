"""MIG rules of the simulated driver, checked through real pynvml against the MIG facts.

Every test installs a simulated node beneath pynvml, calls the same pynvml functions the agent would call
on a real GPU, and compares what comes back with ``agent/data/mig-profiles.json`` (the MIG facts) and the rules
of NVIDIA's MIG user guide and mig-parted. Nothing here reaches into the simulator to check its state; the driver
object is only used for what a test would do to a real node (start a process).
"""

from __future__ import annotations

import ctypes
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pynvml
import pytest

import agent.data
import agent.sim
from agent.core.mig_naming import mig_memory_gb, mig_profile_name
from agent.sim.nvml.driver import SimDriver
from agent.sim.nvml.hardware import hardware_table
from agent.sim.nvml.spec import SimSpecError, build_driver, parse_node_spec

MIB = 1 << 20
GIB = 1 << 30
PACKAGED_FACTS = Path(agent.data.__file__).parent / "mig-profiles.json"  # the facts' table (agent/data/README.md)
FACTS: dict[str, Any] = json.loads(PACKAGED_FACTS.read_text())

# NVML_GPU_INSTANCE_PROFILE_* indices (what GetGpuInstanceProfileInfo takes) and profile ids (what Create takes).
INDEX_1_SLICE = pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE  # 0
INDEX_3_SLICE = pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE  # 2
INDEX_8_SLICE = pynvml.NVML_GPU_INSTANCE_PROFILE_8_SLICE  # 5
INDEX_1_SLICE_REV2 = pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2  # 9
PROFILE_COUNT = pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT  # 18
ID_7G, ID_4G, ID_3G, ID_2G, ID_1G_REV2, ID_1G, ID_1G_ME = 0, 5, 9, 14, 15, 19, 20  # 8-slice GPUs
CI_1C, CI_3C_FULL = 0, 2  # compute instance profile ids inside a 3g GI

MIG_MODELS = [model for model in hardware_table().values() if model.mig_capable]


def facts_profile(model_key: str, profile_id: int) -> dict[str, Any]:
    """The facts' entry for one GPU instance profile, found by its profile id."""
    profiles = FACTS["gpus"][model_key]["gpu_instance_profiles"]
    return next(p for p in profiles if p["profile_id"] == profile_id)


PROFILE_CASES = [
    pytest.param(model.key, profile.id, id=f"{model.key}-{profile.name}")
    for model in MIG_MODELS
    for profile in model.gi_profiles
]


def mig_spec(model: str, instances: list[str] | None = None, **gpu: Any) -> dict[str, Any]:
    return {"gpus": [{"model": model, "mig": {"instances": instances or []}, **gpu}]}


@pytest.fixture
def node(nvml_node: Callable[[object], SimDriver]) -> Callable[[object], SimDriver]:
    """``node(spec)``: a simulated node with NVML initialised (the shared ``nvml_node`` fixture)."""
    return nvml_node


def gpu0() -> Any:
    return pynvml.nvmlDeviceGetHandleByIndex(0)


def gi_info(gi: Any) -> tuple[int, int, int, int]:
    """(GI id, profile id, placement start, placement size) as nvmlGpuInstanceGetInfo reports them."""
    info = pynvml.nvmlGpuInstanceGetInfo(gi)
    return info.id, info.profileId, info.placement.start, info.placement.size


def placed(start: int, size: int) -> Any:
    return ctypes.byref(pynvml.c_nvmlGpuInstancePlacement_t(start, size))


def profile_id_by_name(device: Any, name: str) -> int:
    """Find a profile the way a user would: walk the profile indices and match the driver's name."""
    for index in range(PROFILE_COUNT):
        try:
            info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(device, index)
        except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument):
            continue
        if info.name == f"MIG {name}":
            return info.id
    raise AssertionError(f"no GPU instance profile named {name}")


def gpu_instance_count(device: Any, profile_id: int) -> int:
    capacity = 8
    array = (pynvml.c_nvmlGpuInstance_t * capacity)()
    count = ctypes.c_uint(capacity)
    pynvml.nvmlDeviceGetGpuInstances(device, profile_id, array, ctypes.byref(count))
    return count.value


def possible_placements(device: Any, profile_id: int) -> list[tuple[int, int]]:
    count = ctypes.c_uint(0)
    pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(device, profile_id, None, ctypes.byref(count))
    array = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
    pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(device, profile_id, array, ctypes.byref(count))
    return [(array[i].start, array[i].size) for i in range(count.value)]


def mig_devices() -> list[Any]:
    """MIG device handles of GPU 0 by index, stopping at the first empty index (NOT_FOUND)."""
    device = gpu0()
    handles = []
    for position in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(device)):
        try:
            handles.append(pynvml.nvmlDeviceGetMigDeviceHandleByIndex(device, position))
        except pynvml.NVMLError_NotFound:
            break
    return handles


# ----- the hardware table agrees with the facts ---------------------------------------------------


def test_every_mig_model_of_the_facts_is_in_the_hardware_table_with_the_same_profiles() -> None:
    table = {m.key: sorted(p.id for p in m.gi_profiles) for m in MIG_MODELS}
    facts = {
        key: sorted(p["profile_id"] for p in gpu["gpu_instance_profiles"])
        for key, gpu in FACTS["gpus"].items()
        if gpu["mig_capable"]
    }
    assert table == facts


# ----- 1. every profile fills up at exactly its instance count -------------------------------------


@pytest.mark.parametrize(("model", "profile_id"), PROFILE_CASES)
def test_create_gpu_instance_reaches_instance_count_then_insufficient_resources(
    node: Callable[[object], SimDriver], model: str, profile_id: int
) -> None:
    expected = facts_profile(model, profile_id)["instance_count"]
    node(mig_spec(model))
    device = gpu0()
    assert pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(device, profile_id) == expected

    for _ in range(expected):
        gi = pynvml.nvmlDeviceCreateGpuInstance(device, profile_id)
        assert gi_info(gi)[1] == profile_id
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        pynvml.nvmlDeviceCreateGpuInstance(device, profile_id)

    assert gpu_instance_count(device, profile_id) == expected
    assert pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(device, profile_id) == 0


# ----- 2. impossible layouts fail at the first instance that does not fit ---------------------------


@pytest.mark.parametrize(
    ("model", "profile", "count"),
    [
        pytest.param("H100-SXM5-80GB", "3g.40gb", 3, id="H100-3x3g.40gb"),
        pytest.param("A100-SXM4-80GB", "1g.10gb", 8, id="A100-80GB-8x1g.10gb"),
    ],
)
def test_impossible_layout_fails_at_the_last_instance_via_pynvml(
    node: Callable[[object], SimDriver], model: str, profile: str, count: int
) -> None:
    node(mig_spec(model))
    device = gpu0()
    profile_id = profile_id_by_name(device, profile)
    for _ in range(count - 1):
        pynvml.nvmlDeviceCreateGpuInstance(device, profile_id)
    with pytest.raises(pynvml.NVMLError_InsufficientResources) as failure:
        pynvml.nvmlDeviceCreateGpuInstance(device, profile_id)
    assert failure.value.value == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
    assert str(failure.value) == "Insufficient Resources"
    assert gpu_instance_count(device, profile_id) == count - 1


@pytest.mark.parametrize(
    ("model", "profile", "count"),
    [
        pytest.param("H100-SXM5-80GB", "3g.40gb", 3, id="H100-3x3g.40gb"),
        pytest.param("A100-SXM4-80GB", "1g.10gb", 8, id="A100-80GB-8x1g.10gb"),
    ],
)
def test_impossible_layout_in_a_node_spec_names_the_failing_entry(model: str, profile: str, count: int) -> None:
    spec = parse_node_spec(mig_spec(model, [profile] * count))
    with pytest.raises(SimSpecError) as failure:
        build_driver(spec)
    message = str(failure.value)
    assert f"instances[{count - 1}]" in message
    assert "INSUFFICIENT_RESOURCES" in message
    # one instance fewer is a valid layout
    build_driver(parse_node_spec(mig_spec(model, [profile] * (count - 1))))


# ----- 3. profile names derived from the NVML profile info -----------------------------------------


@pytest.mark.parametrize(("model", "profile_id"), PROFILE_CASES)
def test_profile_name_from_nvml_profile_info_matches_the_facts(
    node: Callable[[object], SimDriver], model: str, profile_id: int
) -> None:
    facts = facts_profile(model, profile_id)
    node(mig_spec(model))
    device = gpu0()
    info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(device, facts["profile_index"])
    assert info.id == profile_id
    name = mig_profile_name(
        gi_slices=info.sliceCount,
        ci_slices=info.sliceCount,
        memory_mib=info.memorySizeMB,
        parent_total_bytes=pynvml.nvmlDeviceGetMemoryInfo(device).total,
        gi_profile_index=facts["profile_index"],
    )
    assert name == facts["name"]
    assert info.name == f"MIG {facts['name']}"


def test_h200_three_and_four_slice_profiles_are_named_71gb(node: Callable[[object], SimDriver]) -> None:
    node(mig_spec("H200-141GB"))
    device = gpu0()
    total = pynvml.nvmlDeviceGetMemoryInfo(device).total
    for index, expected in ((INDEX_3_SLICE, "3g.71gb"), (pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE, "4g.71gb")):
        info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(device, index)
        name = mig_profile_name(
            gi_slices=info.sliceCount,
            ci_slices=info.sliceCount,
            memory_mib=info.memorySizeMB,
            parent_total_bytes=total,
            gi_profile_index=index,
        )
        assert name == expected


@pytest.mark.parametrize(
    ("memory_mib", "parent_total_bytes", "expected"),
    [
        pytest.param(71552, 143771 * MIB, 71, id="H200-half-of-141GiB-70.5-rounds-up"),
        pytest.param(2560, 5 * GIB, 3, id="2.5-rounds-up-not-to-even"),
        pytest.param(4864, 40960 * MIB, 5, id="A100-40GB-1g"),
        pytest.param(5200, 40 * GIB, 10, id="just-over-an-eighth-rounds-up-to-two-eighths"),
        pytest.param(81152, 81559 * MIB, 80, id="H100-7g"),
    ],
)
def test_mig_memory_gb_rounds_half_up(memory_mib: int, parent_total_bytes: int, expected: int) -> None:
    assert mig_memory_gb(memory_mib, parent_total_bytes) == expected


def test_mig_memory_gb_differs_from_python_round_on_h200() -> None:
    assert round(70.5) == 70  # the trap the naming rule must avoid
    assert mig_memory_gb(71552, 143771 * MIB) == 71


def test_compute_instance_names_carry_the_compute_slice_prefix() -> None:
    name = mig_profile_name(
        gi_slices=3, ci_slices=1, memory_mib=40448, parent_total_bytes=81559 * MIB, gi_profile_index=INDEX_3_SLICE
    )
    assert name == "1c.3g.40gb"


# ----- 4. default placements reproduce the observed sequences ---------------------------------------


def _row_model(row: str) -> str | None:
    if row.startswith("A100"):
        return "A100-SXM4-40GB"  # the MIG user guide's examples run on an A100-SXM4-40GB
    if row.startswith("H100 80GB"):
        return "H100-SXM5-80GB"
    return None


def _row_profile_ids(row: str) -> list[int]:
    match = re.search(r"-cgi ([\d,]+)(?: x(\d+))?", row)
    assert match, row
    ids = [int(part) for part in match[1].split(",")]
    return ids * int(match[2]) if match[2] else ids


def _placement_rows() -> list[Any]:
    rows = []
    for row, observed in FACTS["observed_default_placement_sequences"].items():
        if not isinstance(observed, list):
            continue
        model = _row_model(row)
        marks = [] if model else [pytest.mark.skip(reason="the documented heuristic does not reproduce this row")]
        readable = re.sub(r"[^\w,.]+", "-", row).strip("-")
        rows.append(pytest.param(model, row, observed, id=readable, marks=marks))
    return rows


@pytest.mark.parametrize(("model", "row", "observed"), _placement_rows())
def test_default_placement_reproduces_observed_sequence(
    node: Callable[[object], SimDriver], model: str, row: str, observed: list[str]
) -> None:
    node(mig_spec(model))
    device = gpu0()
    profile_ids = _row_profile_ids(row)
    assert len(profile_ids) == len(observed)
    for profile_id, expected in zip(profile_ids, observed, strict=True):
        if "fails" in expected:
            assert "Insufficient Resources" in expected
            with pytest.raises(pynvml.NVMLError_InsufficientResources):
                pynvml.nvmlDeviceCreateGpuInstance(device, profile_id)
            continue
        gi_id, got_profile, start, size = gi_info(pynvml.nvmlDeviceCreateGpuInstance(device, profile_id))
        want_gi = int(re.search(r"GI(\d+)", expected)[1])
        want_start, want_size = (int(x) for x in re.search(r"(\d+):(\d+)", expected).groups())
        assert (gi_id, start, size) == (want_gi, want_start, want_size), f"{row}: {expected}"
        assert got_profile == profile_id
        slices = re.match(r"(\d+)g", expected)
        if slices:
            info = pynvml.nvmlDeviceGetGpuInstanceProfileInfoById(device, profile_id)
            assert info.sliceCount == int(slices[1])


# ----- 5. rules ------------------------------------------------------------------------------------


def test_profile_info_takes_the_profile_index_not_the_id(node: Callable[[object], SimDriver]) -> None:
    node(mig_spec("A100-SXM4-80GB"))
    device = gpu0()
    three = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(device, INDEX_3_SLICE)
    assert (three.id, three.sliceCount, three.memorySizeMB) == (ID_3G, 3, 40192)
    rev2 = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(device, INDEX_1_SLICE_REV2)
    assert (rev2.id, rev2.sliceCount, rev2.memorySizeMB) == (ID_1G_REV2, 1, 19968)
    by_id = pynvml.nvmlDeviceGetGpuInstanceProfileInfoById(device, ID_3G)
    assert (by_id.sliceCount, by_id.memorySizeMB) == (3, 40192)


def test_profile_index_mistaken_for_an_id_creates_a_different_profile(node: Callable[[object], SimDriver]) -> None:
    node(mig_spec("A100-SXM4-80GB"))
    device = gpu0()
    # NVML_GPU_INSTANCE_PROFILE_1_SLICE is 0, but profile id 0 is the whole-GPU 7g.80gb
    gi = pynvml.nvmlDeviceCreateGpuInstance(device, INDEX_1_SLICE)
    assert gi_info(gi) == (0, ID_7G, 0, 8)
    assert pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(device, ID_1G) == 0


def test_profile_index_the_model_lacks_is_not_supported(node: Callable[[object], SimDriver]) -> None:
    node(mig_spec("A100-SXM4-80GB"))
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetGpuInstanceProfileInfo(gpu0(), INDEX_8_SLICE)


@pytest.mark.parametrize("index", [PROFILE_COUNT, PROFILE_COUNT + 1, 0xFF])
def test_profile_index_past_the_count_is_invalid_argument(node: Callable[[object], SimDriver], index: int) -> None:
    node(mig_spec("A100-SXM4-80GB"))
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetGpuInstanceProfileInfo(gpu0(), index)


def test_profile_info_v1_struct_carries_the_same_numbers(node: Callable[[object], SimDriver]) -> None:
    node(mig_spec("H100-SXM5-80GB"))
    info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(gpu0(), INDEX_3_SLICE, version=1)
    assert (info.id, info.sliceCount, info.instanceCount, info.memorySizeMB) == (ID_3G, 3, 2, 40448)


def test_only_one_media_extension_instance_per_gpu(node: Callable[[object], SimDriver]) -> None:
    node(mig_spec("A100-SXM4-80GB"))
    device = gpu0()
    pynvml.nvmlDeviceCreateGpuInstance(device, ID_1G_ME)
    assert pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(device, ID_1G_ME) == 0
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        pynvml.nvmlDeviceCreateGpuInstance(device, ID_1G_ME)
    # plain 1g instances still fit in the free slices
    assert pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(device, ID_1G) == 6
    pynvml.nvmlDeviceCreateGpuInstance(device, ID_1G)


def test_a30_one_media_extension_instance_across_both_plus_me_profiles(node: Callable[[object], SimDriver]) -> None:
    node(mig_spec("A30-24GB"))
    device = gpu0()
    one_me = facts_profile("A30-24GB", 21)
    two_me = facts_profile("A30-24GB", 6)
    assert (one_me["name"], two_me["name"]) == ("1g.6gb+me", "2g.12gb+me")
    pynvml.nvmlDeviceCreateGpuInstance(device, one_me["profile_id"])
    assert pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(device, two_me["profile_id"]) == 0
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        pynvml.nvmlDeviceCreateGpuInstance(device, two_me["profile_id"])


def test_create_with_placement_uses_exactly_that_placement(node: Callable[[object], SimDriver]) -> None:
    node(mig_spec("A100-SXM4-80GB"))
    device = gpu0()
    assert gi_info(pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(device, ID_3G, placed(0, 4))) == (1, ID_3G, 0, 4)
    assert gi_info(pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(device, ID_1G, placed(6, 1))) == (13, ID_1G, 6, 1)


def test_create_with_an_occupied_placement_is_insufficient_resources(node: Callable[[object], SimDriver]) -> None:
    node(mig_spec("A100-SXM4-80GB"))
    device = gpu0()
    pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(device, ID_3G, placed(4, 4))
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(device, ID_1G, placed(5, 1))
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(device, ID_2G, placed(4, 2))
    # the free half still takes instances
    pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(device, ID_2G, placed(2, 2))


@pytest.mark.parametrize(
    ("profile_id", "start", "size"),
    [
        pytest.param(ID_3G, 2, 4, id="3g-misaligned-start"),
        pytest.param(ID_3G, 0, 3, id="3g-wrong-size"),
        pytest.param(ID_1G, 7, 1, id="1g-at-slice-7"),
        pytest.param(ID_2G, 6, 2, id="2g-at-6"),
    ],
)
def test_create_with_a_placement_not_in_the_list_is_invalid_argument(
    node: Callable[[object], SimDriver], profile_id: int, start: int, size: int
) -> None:
    node(mig_spec("A100-SXM4-80GB"))
    device = gpu0()
    assert (start, size) not in possible_placements(device, profile_id)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(device, profile_id, placed(start, size))
    assert gpu_instance_count(device, profile_id) == 0


def test_remaining_capacity_counts_free_aligned_placements(node: Callable[[object], SimDriver]) -> None:
    node(mig_spec("A100-SXM4-80GB"))
    device = gpu0()

    def capacity() -> dict[int, int]:
        ids = (ID_7G, ID_4G, ID_3G, ID_2G, ID_1G_REV2, ID_1G, ID_1G_ME)
        return {i: pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(device, i) for i in ids}

    assert capacity() == {ID_7G: 1, ID_4G: 1, ID_3G: 2, ID_2G: 3, ID_1G_REV2: 4, ID_1G: 7, ID_1G_ME: 1}
    pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(device, ID_3G, placed(0, 4))
    assert capacity() == {ID_7G: 0, ID_4G: 0, ID_3G: 1, ID_2G: 1, ID_1G_REV2: 2, ID_1G: 3, ID_1G_ME: 1}
    pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(device, ID_2G, placed(4, 2))
    assert capacity() == {ID_7G: 0, ID_4G: 0, ID_3G: 0, ID_2G: 0, ID_1G_REV2: 1, ID_1G: 1, ID_1G_ME: 1}


def test_possible_placements_answer_with_mig_disabled_while_create_is_not_supported(
    node: Callable[[object], SimDriver],
) -> None:
    node({"gpus": [{"model": "A100-SXM4-80GB"}]})
    device = gpu0()
    assert pynvml.nvmlDeviceGetMigMode(device) == [0, 0]
    for profile_id in (ID_3G, ID_1G, ID_2G):
        want = [(p["start"], p["size"]) for p in facts_profile("A100-SXM4-80GB", profile_id)["placements"]]
        assert possible_placements(device, profile_id) == want
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceCreateGpuInstance(device, ID_3G)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetGpuInstanceProfileInfo(device, INDEX_3_SLICE)
    assert pynvml.nvmlDeviceGetMaxMigDeviceCount(device) == 0


def test_possible_placements_size_query_with_a_null_array(node: Callable[[object], SimDriver]) -> None:
    node(mig_spec("H100-SXM5-80GB"))
    count = ctypes.c_uint(0)
    pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(gpu0(), ID_1G, None, ctypes.byref(count))
    assert count.value == 7


def test_destroying_a_gpu_instance_with_compute_instances_is_in_use(node: Callable[[object], SimDriver]) -> None:
    node(mig_spec("A100-SXM4-80GB"))
    device = gpu0()
    gi = pynvml.nvmlDeviceCreateGpuInstance(device, ID_3G)
    ci = pynvml.nvmlGpuInstanceCreateComputeInstance(gi, CI_3C_FULL)
    with pytest.raises(pynvml.NVMLError_InUse):
        pynvml.nvmlGpuInstanceDestroy(gi)
    assert gpu_instance_count(device, ID_3G) == 1
    pynvml.nvmlComputeInstanceDestroy(ci)
    pynvml.nvmlGpuInstanceDestroy(gi)
    assert gpu_instance_count(device, ID_3G) == 0
    assert pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(device, ID_3G) == 2


def test_destroying_a_compute_instance_with_a_process_is_in_use(node: Callable[[object], SimDriver]) -> None:
    driver = node(mig_spec("A100-SXM4-80GB", ["3g.40gb"]))
    device = gpu0()
    [mig] = mig_devices()
    driver.add_process(0, 4321, 1024, mig_uuid=pynvml.nvmlDeviceGetUUID(mig))
    gi = pynvml.nvmlDeviceGetGpuInstanceById(device, pynvml.nvmlDeviceGetGpuInstanceId(mig))
    ci = pynvml.nvmlGpuInstanceGetComputeInstanceById(gi, pynvml.nvmlDeviceGetComputeInstanceId(mig))
    with pytest.raises(pynvml.NVMLError_InUse):
        pynvml.nvmlComputeInstanceDestroy(ci)
    with pytest.raises(pynvml.NVMLError_InUse):
        pynvml.nvmlGpuInstanceDestroy(gi)
    driver.remove_process(4321)
    pynvml.nvmlComputeInstanceDestroy(ci)
    pynvml.nvmlGpuInstanceDestroy(gi)
    assert mig_devices() == []


def test_gpu_instance_handle_is_stale_after_destroy(node: Callable[[object], SimDriver]) -> None:
    node(mig_spec("A100-SXM4-80GB"))
    device = gpu0()
    gi = pynvml.nvmlDeviceCreateGpuInstance(device, ID_2G)
    gi_id = gi_info(gi)[0]
    pynvml.nvmlGpuInstanceDestroy(gi)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlGpuInstanceGetInfo(gi)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlGpuInstanceDestroy(gi)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlGpuInstanceCreateComputeInstance(gi, 1)
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetGpuInstanceById(device, gi_id)


def test_stale_handle_stays_stale_when_an_instance_is_recreated_at_the_same_place(
    node: Callable[[object], SimDriver],
) -> None:
    node(mig_spec("A100-SXM4-80GB"))
    device = gpu0()
    old = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(device, ID_3G, placed(4, 4))
    pynvml.nvmlGpuInstanceDestroy(old)
    new = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(device, ID_3G, placed(4, 4))
    assert gi_info(new)[0] == 2
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlGpuInstanceGetInfo(old)


def test_three_one_slice_compute_instances_fill_a_3g_instance(node: Callable[[object], SimDriver]) -> None:
    node(mig_spec("A100-SXM4-80GB"))
    device = gpu0()
    gi = pynvml.nvmlDeviceCreateGpuInstance(device, ID_3G)
    info = pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE, 0)
    assert (info.id, info.sliceCount, info.instanceCount) == (CI_1C, 1, 3)
    assert pynvml.nvmlGpuInstanceGetComputeInstanceRemainingCapacity(gi, CI_1C) == 3

    ids = []
    for _ in range(3):
        ci = pynvml.nvmlGpuInstanceCreateComputeInstance(gi, CI_1C)
        ci_info = pynvml.nvmlComputeInstanceGetInfo(ci)
        assert ci_info.profileId == CI_1C
        assert ci_info.placement.size == 1
        ids.append(ci_info.id)
    assert ids == [0, 1, 2]
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        pynvml.nvmlGpuInstanceCreateComputeInstance(gi, CI_1C)
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        pynvml.nvmlGpuInstanceCreateComputeInstance(gi, CI_3C_FULL)
    assert pynvml.nvmlGpuInstanceGetComputeInstanceRemainingCapacity(gi, CI_1C) == 0


def test_compute_instance_ids_start_at_zero_in_each_gpu_instance(node: Callable[[object], SimDriver]) -> None:
    node(mig_spec("A100-SXM4-80GB"))
    device = gpu0()
    first = pynvml.nvmlDeviceCreateGpuInstance(device, ID_3G)
    second = pynvml.nvmlDeviceCreateGpuInstance(device, ID_3G)
    assert gi_info(first)[0] != gi_info(second)[0]
    for gi in (first, second):
        ids = [
            pynvml.nvmlComputeInstanceGetInfo(pynvml.nvmlGpuInstanceCreateComputeInstance(gi, CI_1C)).id
            for _ in range(2)
        ]
        assert ids == [0, 1]


def test_mig_device_handles_are_ordered_by_gpu_instance_then_compute_instance(
    node: Callable[[object], SimDriver],
) -> None:
    node(mig_spec("A100-SXM4-80GB"))
    device = gpu0()
    # created in the opposite order of their GI ids: 1g at slice 0 is GI 7, 3g at 4:4 is GI 2
    one = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(device, ID_1G, placed(0, 1))
    pynvml.nvmlGpuInstanceCreateComputeInstance(one, 0)
    three = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(device, ID_3G, placed(4, 4))
    for _ in range(3):
        pynvml.nvmlGpuInstanceCreateComputeInstance(three, CI_1C)

    order = [(pynvml.nvmlDeviceGetGpuInstanceId(h), pynvml.nvmlDeviceGetComputeInstanceId(h)) for h in mig_devices()]
    assert order == [(2, 0), (2, 1), (2, 2), (7, 0)]
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetMigDeviceHandleByIndex(device, 4)


def test_mig_device_handle_identity(node: Callable[[object], SimDriver]) -> None:
    node(mig_spec("H100-SXM5-80GB", ["1c.3g.40gb", "1c.3g.40gb", "2g.20gb"]))
    device = gpu0()
    parent_uuid = pynvml.nvmlDeviceGetUUID(device)
    handles = mig_devices()
    assert len(handles) == 3
    assert pynvml.nvmlDeviceIsMigDeviceHandle(device).value == 0
    names = []
    for mig in handles:
        assert pynvml.nvmlDeviceIsMigDeviceHandle(mig).value == 1
        uuid = pynvml.nvmlDeviceGetUUID(mig)
        assert uuid.startswith("MIG-")
        assert pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByUUID(uuid)) == uuid
        assert pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)) == parent_uuid
        names.append(pynvml.nvmlDeviceGetName(mig))
    assert len({pynvml.nvmlDeviceGetUUID(h) for h in handles}) == 3
    assert sorted(names) == sorted(["NVIDIA H100 80GB HBM3 MIG 1c.3g.40gb"] * 2 + ["NVIDIA H100 80GB HBM3 MIG 2g.20gb"])


def test_mig_attributes_describe_the_instance(node: Callable[[object], SimDriver]) -> None:
    node(mig_spec("A100-SXM4-80GB", ["3g.40gb"]))
    [mig] = mig_devices()
    attrs = pynvml.nvmlDeviceGetAttributes(mig)
    assert (attrs.gpuInstanceSliceCount, attrs.computeInstanceSliceCount, attrs.memorySizeMB) == (3, 3, 40192)
    assert attrs.multiprocessorCount == facts_profile("A100-SXM4-80GB", ID_3G)["multiprocessor_count"]


def test_mig_uuid_is_new_after_destroy_and_recreate(node: Callable[[object], SimDriver]) -> None:
    node(mig_spec("A100-SXM4-80GB"))
    device = gpu0()
    gi = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(device, ID_2G, placed(0, 2))
    ci = pynvml.nvmlGpuInstanceCreateComputeInstance(gi, 1)
    [mig] = mig_devices()
    before = pynvml.nvmlDeviceGetUUID(mig)
    pynvml.nvmlComputeInstanceDestroy(ci)
    pynvml.nvmlGpuInstanceDestroy(gi)
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetHandleByUUID(before)

    gi = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(device, ID_2G, placed(0, 2))
    pynvml.nvmlGpuInstanceCreateComputeInstance(gi, 1)
    [mig] = mig_devices()
    after = pynvml.nvmlDeviceGetUUID(mig)
    assert after.startswith("MIG-")
    assert after != before
    assert (pynvml.nvmlDeviceGetGpuInstanceId(mig), pynvml.nvmlDeviceGetComputeInstanceId(mig)) == (3, 0)


@pytest.mark.parametrize(
    ("profile_id", "start", "size", "gi_id"),
    [
        pytest.param(ID_7G, 0, 8, 0, id="8-wide-0"),
        pytest.param(ID_4G, 0, 4, 1, id="4-wide-at-0"),
        pytest.param(ID_3G, 4, 4, 2, id="4-wide-at-4"),
        pytest.param(ID_2G, 4, 2, 5, id="2-wide-at-4"),
        pytest.param(ID_1G_REV2, 6, 2, 6, id="2-wide-at-6"),
        pytest.param(ID_1G, 0, 1, 7, id="1-wide-at-0"),
        pytest.param(ID_1G, 6, 1, 13, id="1-wide-at-6"),
    ],
)
def test_gpu_instance_id_comes_from_the_placement(
    node: Callable[[object], SimDriver], profile_id: int, start: int, size: int, gi_id: int
) -> None:
    node(mig_spec("H100-SXM5-80GB"))
    gi = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(gpu0(), profile_id, placed(start, size))
    assert gi_info(gi) == (gi_id, profile_id, start, size)
