"""The MIG layout manager's pure part (agent.core.mig_layout), checked on paper and then for real.

"For real" means: the operations ``diff_gpu`` returns are executed through pynvml on the simulated driver
(which enforces the placement rules of the facts), the node is rediscovered, and ``diff_gpu`` must then
return ``()`` — mig-parted's ``assert`` passing.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Callable

import pytest
from msgspec.structs import replace

from agent.core.inventory import Gpu, MigDevice, Placement
from agent.core.mig_catalog import MigCatalog, mig_catalog, mig_catalogs, parse_profile_name
from agent.core.mig_layout import (
    CreateInstance,
    DesiredLayout,
    DestroyInstance,
    LayoutError,
    PlacedInstance,
    SetMigMode,
    current_layout,
    diff_gpu,
    diff_node,
    fit,
    validate_layout,
)
from agent.gpu.discovery import discover
from agent.sim.nvml.driver import SimDriver
from tests.unit.mig_ops import execute

CATALOGS = {catalog.key: catalog for catalog in mig_catalogs()}

# mig-parted's "all-balanced" per product (facts: mig-mps.md §(a)). H100 NVL and GH200 are not in the facts;
# their shapes are those of mig-parted's deployments/systemd/config-default.yaml.
BALANCED = {
    "A100-SXM4-40GB": {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1},
    "A100-SXM4-80GB": {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1},
    "A30-24GB": {"1g.6gb": 2, "2g.12gb": 1},
    "H100-SXM5-80GB": {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1},
    "H100-PCIE-80GB": {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1},
    "H200-141GB": {"1g.18gb": 2, "2g.35gb": 1, "3g.71gb": 1},
    "H100-NVL-94GB": {"1g.12gb": 2, "2g.24gb": 1, "3g.47gb": 1},
    "GH200-H100-96GB": {"1g.12gb": 2, "2g.24gb": 1, "3g.48gb": 1},
}


def shapes(catalog: MigCatalog) -> dict[str, DesiredLayout]:
    """mig-parted's shipped shapes for one model: all-disabled, all-enabled, all-<profile>, all-balanced."""
    result = {"all-disabled": DesiredLayout(False), "all-enabled": DesiredLayout(True)}
    for profile in catalog.profiles:
        label = "all-" + profile.name.replace("+", ".")
        result[label] = DesiredLayout(True, ((profile.name, profile.instance_count),))
    if catalog.key in BALANCED:
        result["all-balanced"] = DesiredLayout(True, tuple(BALANCED[catalog.key].items()))
    return result


SHAPE_CASES = [
    pytest.param(key, label, id=f"{key}-{label}") for key, catalog in CATALOGS.items() for label in shapes(catalog)
]


def test_the_catalog_covers_the_facts_models() -> None:
    assert set(CATALOGS) >= set(BALANCED)
    a100 = CATALOGS["A100-SXM4-80GB"]
    assert mig_catalog(0x20B210DE) is a100
    assert mig_catalog(0x1EB810DE) is None  # T4: not MIG capable
    assert a100.product == "NVIDIA A100-SXM4-80GB"
    assert (a100.memory_slices, a100.compute_slices, a100.max_gpu_instances) == (8, 7, 7)
    me = a100.profile("1g.10gb+me")
    assert me is not None and me.media_extensions and me.id == 20 and me.index == 7
    rev2 = a100.profile("1g.20gb")
    assert rev2 is not None and rev2.full_ci_profile_id == 7 and rev2.memory_slices == 2  # 1_SLICE_REV2
    assert a100.profile("3g.40gb").full_ci_profile_id == 2  # type: ignore[union-attr]
    h200_3g = CATALOGS["H200-141GB"].profile("3g.71gb")
    assert h200_3g is not None and h200_3g.memory_mib > 0  # the facts' estimate stands in for "unverified"


@pytest.mark.parametrize(("key", "label"), SHAPE_CASES)
def test_every_shipped_shape_validates_and_fits(key: str, label: str) -> None:
    catalog = CATALOGS[key]
    layout = shapes(catalog)[label]
    assert validate_layout(catalog, layout) == []
    if not layout.enabled:
        return
    placed = fit(catalog, layout.counts)
    assert Counter(p.profile for p in placed) == Counter(layout.counts)
    used: set[int] = set()
    for instance in placed:
        profile = catalog.profile(instance.profile)
        assert profile is not None
        assert instance.placement in profile.placements
        assert instance.profile_id == profile.id and instance.ci_profile_id == profile.full_ci_profile_id
        slices = set(range(instance.placement.start, instance.placement.start + instance.placement.size))
        assert used.isdisjoint(slices)
        used |= slices


# ----- impossible layouts -----------------------------------------------------------------------


def _problems(key: str, devices: dict[str, int]) -> list[str]:
    return validate_layout(CATALOGS[key], DesiredLayout(True, tuple(devices.items())))


def test_an_unknown_profile_names_the_model_and_lists_its_profiles() -> None:
    (problem,) = _problems("A100-SXM4-80GB", {"1g.5gb": 1})  # an A100-40GB profile
    assert "1g.5gb is not a MIG profile of NVIDIA A100-SXM4-80GB" in problem
    assert "1g.10gb, 1g.10gb+me, 1g.20gb, 2g.20gb, 3g.40gb, 4g.40gb, 7g.80gb" in problem


def test_a_compute_instance_profile_is_refused_for_now() -> None:
    (problem,) = _problems("A100-SXM4-80GB", {"1c.3g.40gb": 3})
    assert "compute-instance profile" in problem and "full GPU instances only" in problem
    assert "NVIDIA A100-SXM4-80GB" in problem


def test_a_malformed_profile_is_a_problem() -> None:
    (problem,) = _problems("A30-24GB", {"big": 1})
    assert "'big' is not a MIG profile" in problem and "NVIDIA A30" in problem


def test_over_the_profiles_instance_count() -> None:
    problems = _problems("A100-SXM4-80GB", {"1g.10gb": 8})
    assert "8x 1g.10gb requested but NVIDIA A100-SXM4-80GB allows at most 7" in problems
    assert "8 GPU instances requested but NVIDIA A100-SXM4-80GB allows at most 7" in problems
    assert "no placement can hold {1g.10gb: 8} on NVIDIA A100-SXM4-80GB" in problems


def test_three_3g_on_h100_have_only_two_placements() -> None:
    problems = _problems("H100-SXM5-80GB", {"3g.40gb": 3})
    assert "3x 3g.40gb requested but NVIDIA H100 80GB HBM3 allows at most 2" in problems
    assert "no placement can hold {3g.40gb: 3} on NVIDIA H100 80GB HBM3" in problems


def test_two_media_extension_instances() -> None:
    (problem,) = _problems("A30-24GB", {"1g.6gb+me": 1, "2g.12gb+me": 1})
    assert "2 +me instances" in problem and "NVIDIA A30" in problem and "at most 1" in problem


def test_counts_within_limits_that_still_do_not_fit() -> None:
    assert _problems("H100-SXM5-80GB", {"3g.40gb": 1, "4g.40gb": 1, "1g.10gb": 1}) == [
        "no placement can hold {1g.10gb: 1, 3g.40gb: 1, 4g.40gb: 1} on NVIDIA H100 80GB HBM3"
    ]
    assert _problems("A100-SXM4-80GB", {"1g.20gb": 4, "1g.10gb": 1}) == [
        "no placement can hold {1g.10gb: 1, 1g.20gb: 4} on NVIDIA A100-SXM4-80GB"
    ]


def test_fit_raises_for_what_validation_reports() -> None:
    with pytest.raises(LayoutError, match=r"no placement can hold \{3g.40gb: 2, 4g.40gb: 1\} on NVIDIA H100 80GB HBM3"):
        fit(CATALOGS["H100-SXM5-80GB"], {"3g.40gb": 2, "4g.40gb": 1})
    with pytest.raises(LayoutError, match="allows at most 2") as caught:
        fit(CATALOGS["H100-SXM5-80GB"], {"3g.40gb": 3})
    assert caught.value.problems


def test_devices_listed_while_mig_is_disabled() -> None:
    (problem,) = validate_layout(CATALOGS["A30-24GB"], DesiredLayout(False, (("1g.6gb", 1),)))
    assert "MIG is disabled" in problem and "NVIDIA A30" in problem


def test_desired_layout_is_normalised() -> None:
    layout = DesiredLayout(True, (("3g.40gb", 1), ("1g.10gb", 1), ("2g.20gb", 0), ("1g.10gb", 1)))
    assert layout.devices == (("1g.10gb", 2), ("3g.40gb", 1))
    assert DesiredLayout(True, {"1g.10gb": 2, "3g.40gb": 1}) == layout  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-negative"):
        DesiredLayout(True, (("1g.10gb", -1),))


# ----- fit: complete, deterministic, and it keeps what it can ------------------------------------


def _packings(catalog: MigCatalog) -> set[tuple[tuple[str, int], ...]]:
    """Every multiset of GPU instances that fits on the memory slices, found by brute force."""
    items = [(p.name, pl) for p in catalog.profiles for pl in p.placements]
    found: set[tuple[tuple[str, int], ...]] = set()

    def walk(start: int, used: frozenset[int], chosen: tuple[str, ...]) -> None:
        found.add(tuple(sorted(Counter(chosen).items())))
        for i in range(start, len(items)):
            name, placement = items[i]
            slices = frozenset(range(placement.start, placement.start + placement.size))
            if used.isdisjoint(slices):
                walk(i + 1, used | slices, (*chosen, name))

    walk(0, frozenset(), ())
    return found


@pytest.mark.parametrize("key", ["A100-SXM4-40GB", "A30-24GB", "H100-SXM5-80GB"])
def test_fit_finds_a_placement_whenever_one_exists(key: str) -> None:
    catalog = CATALOGS[key]
    packings = _packings(catalog)
    names = [p.name for p in catalog.profiles]
    limits = [min(p.instance_count, catalog.max_gpu_instances) for p in catalog.profiles]
    checked = 0
    for counts in itertools.product(*(range(limit + 1) for limit in limits)):
        devices = {name: count for name, count in zip(names, counts, strict=True) if count}
        if not devices or sum(counts) > catalog.max_gpu_instances:
            continue
        if sum(c for p, c in zip(catalog.profiles, counts, strict=True) if p.media_extensions) > 1:
            continue
        possible = tuple(sorted(devices.items())) in packings
        problems = validate_layout(catalog, DesiredLayout(True, tuple(devices.items())))
        assert (problems == []) == possible, (devices, problems)
        checked += 1
    assert checked > 20


def test_the_examples_of_the_brief_fit() -> None:
    a100 = CATALOGS["A100-SXM4-80GB"]
    for devices in ({"1g.10gb": 7}, {"2g.20gb": 3, "1g.10gb": 1}, {"4g.40gb": 1, "3g.40gb": 1}, {"7g.80gb": 1}):
        assert len(fit(a100, devices)) == sum(devices.values())
    balanced = fit(a100, BALANCED["A100-SXM4-80GB"])
    assert {(p.profile, str(p.placement)) for p in balanced} == {
        ("3g.40gb", "4:4"),
        ("2g.20gb", "0:2"),
        ("1g.10gb", "2:1"),
        ("1g.10gb", "3:1"),
    }


def test_fit_is_deterministic() -> None:
    catalog = CATALOGS["A100-SXM4-80GB"]
    devices = {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}
    first = fit(catalog, devices)
    assert fit(catalog, dict(reversed(list(devices.items())))) == first
    keep = list(fit(catalog, {"1g.10gb": 7}))
    expected = fit(catalog, devices, keep)
    shuffler = random.Random(7)
    for _ in range(5):
        shuffler.shuffle(keep)
        assert fit(catalog, devices, keep) == expected


def test_fit_leaves_room_at_the_aligned_starts_when_nothing_is_kept() -> None:
    """A lone small instance goes to the end, so a later 4g (which only fits at 0:4) need not move it."""
    a100 = CATALOGS["A100-SXM4-80GB"]
    (alone,) = fit(a100, {"1g.10gb": 1})
    assert alone.placement == Placement(6, 1)
    (three,) = fit(a100, {"3g.40gb": 1})
    assert three.placement == Placement(4, 4)


def test_fit_prefers_kept_placements() -> None:
    a100 = CATALOGS["A100-SXM4-80GB"]
    three_at_0 = PlacedInstance("3g.40gb", 9, Placement(0, 4), 2)
    (placed,) = fit(a100, {"3g.40gb": 1}, [three_at_0])
    assert placed == three_at_0
    ones = [PlacedInstance("1g.10gb", 19, Placement(i, 1), 0) for i in (0, 1)]
    placed_all = fit(a100, BALANCED["A100-SXM4-80GB"], ones)
    assert set(ones) <= set(placed_all)
    # Something that cannot be kept is simply not kept.
    seven = PlacedInstance("7g.80gb", 0, Placement(0, 8), 4)
    assert seven not in fit(a100, {"1g.10gb": 1}, [seven])


# ----- diff on paper -------------------------------------------------------------------------------


def paper_gpu(key: str, instances: list[tuple[str, int]] | None, index: int = 0) -> Gpu:
    """A GPU of model ``key`` with full GPU instances ``(profile, start)``; None: MIG disabled."""
    catalog = CATALOGS[key]
    devices = []
    for n, (name, start) in enumerate(instances or []):
        profile = catalog.profile(name)
        assert profile is not None
        placement = next(p for p in profile.placements if p.start == start)
        devices.append(
            MigDevice(
                uuid=f"MIG-{index}-{n}",
                parent_uuid=f"GPU-{index}",
                gpu_index=index,
                mig_index=n,
                profile=name,
                gi_id=100 + n,
                ci_id=0,
                gi_profile_id=profile.id,
                ci_profile_id=profile.full_ci_profile_id,
                gi_slices=profile.slices,
                ci_slices=profile.slices,
                placement=placement,
                memory_mib=profile.memory_mib,
                multiprocessor_count=14 * profile.slices,
            )
        )
    return Gpu(
        index=index,
        uuid=f"GPU-{index}",
        name=catalog.product,
        memory_mib=81920,
        compute_capability=(8, 0),
        pci_bus_id=f"00000000:{index + 7:02x}:00.0",
        pci_device_id=catalog.pci_device_id,
        minor_number=index,
        architecture="Ampere",
        mig_capable=True,
        mig_enabled=instances is not None,
        mig_pending=instances is not None,
        mig_devices=tuple(devices),
    )


def test_diff_on_paper() -> None:
    a100 = CATALOGS["A100-SXM4-80GB"]
    balanced = DesiredLayout(True, tuple(BALANCED["A100-SXM4-80GB"].items()))
    # Same multiset at other placements: nothing to do.
    gpu = paper_gpu("A100-SXM4-80GB", [("3g.40gb", 0), ("2g.20gb", 4), ("1g.10gb", 6), ("1g.10gb", 5)])
    assert current_layout(gpu) == balanced
    assert diff_gpu(gpu, balanced, a100) == ()
    # Disabling destroys first, then sets the mode.
    ops = diff_gpu(gpu, DesiredLayout(False), a100)
    assert [type(op) for op in ops] == [DestroyInstance] * 4 + [SetMigMode]
    assert ops[-1] == SetMigMode(0, False)
    # Enabling sets the mode, then creates.
    off = paper_gpu("A100-SXM4-80GB", None)
    ops = diff_gpu(off, balanced, a100)
    assert ops[0] == SetMigMode(0, True)
    assert Counter(op.profile for op in ops[1:] if isinstance(op, CreateInstance)) == Counter(balanced.counts)
    assert diff_gpu(off, DesiredLayout(False), a100) == ()
    # Enabled with no instances, wanted "all-enabled": nothing to do; from balanced: destroy all.
    empty = paper_gpu("A100-SXM4-80GB", [])
    assert diff_gpu(empty, DesiredLayout(True), a100) == ()
    assert [type(op) for op in diff_gpu(gpu, DesiredLayout(True), a100)] == [DestroyInstance] * 4


def test_diff_keeps_what_the_target_keeps() -> None:
    a100 = CATALOGS["A100-SXM4-80GB"]
    gpu = paper_gpu("A100-SXM4-80GB", [("1g.10gb", i) for i in range(7)])
    ops = diff_gpu(gpu, DesiredLayout(True, tuple(BALANCED["A100-SXM4-80GB"].items())), a100)
    destroyed = [op for op in ops if isinstance(op, DestroyInstance)]
    created = [op for op in ops if isinstance(op, CreateInstance)]
    assert len(destroyed) == 5 and len(created) == 2
    assert sorted(op.profile for op in created) == ["2g.20gb", "3g.40gb"]
    assert all(len(op.mig_uuids) == 1 for op in destroyed)
    assert ops.index(destroyed[-1]) < ops.index(created[0])  # destroys before creates


def test_a_pending_mode_change_is_cancelled() -> None:
    a100 = CATALOGS["A100-SXM4-80GB"]
    gpu = paper_gpu("A100-SXM4-80GB", [("7g.80gb", 0)])
    waiting = replace(gpu, mig_pending=False)  # a disable waits for a reset
    assert diff_gpu(waiting, DesiredLayout(True, (("7g.80gb", 1),)), a100) == (SetMigMode(0, True),)


def test_diff_raises_for_an_invalid_layout() -> None:
    gpu = paper_gpu("H100-SXM5-80GB", [])
    with pytest.raises(LayoutError, match=r"GPU 0 \(NVIDIA H100 80GB HBM3\).*allows at most 2"):
        diff_gpu(gpu, DesiredLayout(True, (("3g.40gb", 3),)), CATALOGS["H100-SXM5-80GB"])
    with pytest.raises(LayoutError, match="wrong MIG catalog"):
        diff_gpu(gpu, DesiredLayout(True), CATALOGS["H200-141GB"])


def test_diff_node_skips_matching_and_non_mig_gpus() -> None:
    t4 = Gpu(
        index=1,
        uuid="GPU-t4",
        name="Tesla T4",
        memory_mib=15360,
        compute_capability=(7, 5),
        pci_bus_id="00000000:08:00.0",
        pci_device_id=0x1EB810DE,
        minor_number=1,
        architecture="Turing",
        mig_capable=False,
    )
    a100 = paper_gpu("A100-SXM4-80GB", [("7g.80gb", 0)])
    a100_b = paper_gpu("A100-SXM4-80GB", [], index=2)
    layouts = {
        0: DesiredLayout(True, (("7g.80gb", 1),)),
        1: DesiredLayout(False),
        2: DesiredLayout(True, (("4g.40gb", 1),)),
    }
    result = diff_node([a100, t4, a100_b], layouts)
    assert list(result) == [2]
    assert diff_node([a100, t4], {}) == {}
    with pytest.raises(LayoutError, match="cannot set MIG mode on non MIG-capable GPU 1"):
        diff_node([a100, t4], {1: DesiredLayout(True)})
    with pytest.raises(LayoutError) as caught:
        diff_node([a100, a100_b], {0: DesiredLayout(True, (("9g.1gb", 1),)), 2: DesiredLayout(True, (("1g.5gb", 1),))})
    assert len(caught.value.problems) == 2


# ----- for real, on the simulated driver ----------------------------------------------------------


@pytest.fixture
def node(nvml_node: Callable[[object], SimDriver]) -> Callable[[object], SimDriver]:
    """``node(spec)``: a simulated node with NVML initialised (the shared ``nvml_node`` fixture)."""
    return nvml_node


def the_gpu() -> Gpu:
    inventory = discover()
    assert not inventory.failures
    return inventory.gpus[0]


@pytest.mark.parametrize(("key", "label"), SHAPE_CASES)
def test_every_shipped_shape_applies_on_the_simulator(
    node: Callable[[object], SimDriver], key: str, label: str
) -> None:
    catalog = CATALOGS[key]
    layout = shapes(catalog)[label]
    node({"gpus": [{"model": key, "mig": {"instances": []}}]})
    ops = diff_gpu(the_gpu(), layout, catalog)
    if layout.enabled:
        assert all(isinstance(op, CreateInstance) for op in ops)
        assert len(ops) == layout.instance_count
    else:
        assert ops == (SetMigMode(0, False),)
    execute(ops)
    gpu = the_gpu()
    assert current_layout(gpu) == layout  # the names the driver gives are the names of the table
    assert diff_gpu(gpu, layout, catalog) == ()  # mig-parted's "assert" passes


@pytest.mark.parametrize("key", list(CATALOGS))
def test_walking_through_every_shape_converges(node: Callable[[object], SimDriver], key: str) -> None:
    """From MIG off, through every shape and back, executing only what diff_gpu asks for."""
    catalog = CATALOGS[key]
    node({"gpus": [{"model": key}]})
    order = [*shapes(catalog).values(), DesiredLayout(False)]
    for layout in order:
        execute(diff_gpu(the_gpu(), layout, catalog))
        gpu = the_gpu()
        assert diff_gpu(gpu, layout, catalog) == (), layout
        assert gpu.mig_enabled == layout.enabled


def test_a_transition_keeps_the_mig_devices_it_can(node: Callable[[object], SimDriver]) -> None:
    catalog = CATALOGS["A100-SXM4-80GB"]
    node({"gpus": [{"model": "A100-SXM4-80GB", "mig": {"instances": ["1g.10gb"] * 7}}]})
    before = the_gpu()
    balanced = DesiredLayout(True, tuple(BALANCED["A100-SXM4-80GB"].items()))
    ops = diff_gpu(before, balanced, catalog)
    destroyed = {uuid for op in ops if isinstance(op, DestroyInstance) for uuid in op.mig_uuids}
    assert len(destroyed) == 5 and sum(isinstance(op, CreateInstance) for op in ops) == 2
    execute(ops)
    after = the_gpu()
    assert diff_gpu(after, balanced, catalog) == ()
    survivors = {d.uuid for d in before.mig_devices} - destroyed
    assert len(survivors) == 2
    assert survivors <= {d.uuid for d in after.mig_devices}  # kept instances keep their MIG UUIDs
    # ... and back: the two 1g instances stay again.
    all_1g = DesiredLayout(True, (("1g.10gb", 7),))
    ops = diff_gpu(after, all_1g, catalog)
    assert sum(isinstance(op, DestroyInstance) for op in ops) == 2
    execute(ops)
    final = the_gpu()
    assert diff_gpu(final, all_1g, catalog) == ()
    assert survivors <= {d.uuid for d in final.mig_devices}


def test_a_3g_is_kept_on_h100(node: Callable[[object], SimDriver]) -> None:
    catalog = CATALOGS["H100-SXM5-80GB"]
    node({"gpus": [{"model": "H100-SXM5-80GB", "mig": {"instances": ["3g.40gb", "3g.40gb"]}}]})
    before = the_gpu()
    balanced = DesiredLayout(True, tuple(BALANCED["H100-SXM5-80GB"].items()))
    ops = diff_gpu(before, balanced, catalog)
    assert [type(op) for op in ops] == [DestroyInstance, CreateInstance, CreateInstance, CreateInstance]
    execute(ops)
    after = the_gpu()
    assert diff_gpu(after, balanced, catalog) == ()
    kept = next(d for d in before.mig_devices if d.placement == Placement(4, 4))
    assert kept.uuid in {d.uuid for d in after.mig_devices}


def test_partial_compute_instances_are_a_different_layout(node: Callable[[object], SimDriver]) -> None:
    catalog = CATALOGS["A100-SXM4-80GB"]
    node({"gpus": [{"model": "A100-SXM4-80GB", "mig": {"instances": ["1c.3g.40gb", "1c.3g.40gb", "2g.20gb"]}}]})
    gpu = the_gpu()
    assert current_layout(gpu) == DesiredLayout(True, (("1c.3g.40gb", 2), ("2g.20gb", 1)))
    wanted = DesiredLayout(True, (("3g.40gb", 1), ("2g.20gb", 1)))
    ops = diff_gpu(gpu, wanted, catalog)
    (destroy,) = [op for op in ops if isinstance(op, DestroyInstance)]
    assert destroy.profile == "1c.3g.40gb" and len(destroy.mig_uuids) == 2  # the whole GPU instance goes
    assert [op.profile for op in ops if isinstance(op, CreateInstance)] == ["3g.40gb"]
    execute(ops)
    assert diff_gpu(the_gpu(), wanted, catalog) == ()


def test_where_instances_sit_does_not_matter(node: Callable[[object], SimDriver]) -> None:
    """The driver's own placement (mig-parted's way) already satisfies the layout."""
    catalog = CATALOGS["A100-SXM4-80GB"]
    node({"gpus": [{"model": "A100-SXM4-80GB", "mig": {"instances": ["3g.40gb", "1g.10gb", "2g.20gb", "1g.10gb"]}}]})
    gpu = the_gpu()
    assert diff_gpu(gpu, DesiredLayout(True, tuple(BALANCED["A100-SXM4-80GB"].items())), catalog) == ()


def test_a_whole_node_on_the_simulator(node: Callable[[object], SimDriver]) -> None:
    node(
        {
            "gpus": [
                {"model": "A100-SXM4-80GB", "count": 2},
                {"model": "T4"},
                {"model": "H100-SXM5-80GB", "mig": {"instances": ["7g.80gb"]}},
            ]
        }
    )
    gpus = discover().gpus
    layouts = {
        0: DesiredLayout(True, tuple(BALANCED["A100-SXM4-80GB"].items())),
        1: DesiredLayout(False),
        2: DesiredLayout(False),
        3: DesiredLayout(True, (("7g.80gb", 1),)),
    }
    operations = diff_node(gpus, layouts)
    assert sorted(operations) == [0]
    for ops in operations.values():
        execute(ops)
    assert diff_node(discover().gpus, layouts) == {}


def test_profile_names_parse() -> None:
    name = parse_profile_name("1c.3g.40gb")
    assert (name.compute_slices, name.gpu_slices, name.memory_gb, name.is_compute_instance) == (1, 3, 40, True)
    assert str(parse_profile_name("1g.24gb+me.all")) == "1g.24gb+me.all"
    assert parse_profile_name("2g.48gb-me").negative_attributes == ("me",)
    for bad in ("", "1g", "1g.10", "g.10gb", "1g.10gb+", "1g.10gb+me,me", "1g.10gb+me-me", "1g.10gb+1x", "0g.1gb"):
        with pytest.raises(ValueError):
            parse_profile_name(bad)
