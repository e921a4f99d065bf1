"""MIG layout previews: every problem said once for the GPUs it applies to, a layout that fits no GPU model
refused on any node, and the exit codes every command shares.

``GPUs 0-7 (A100-SXM4-80GB): 7g.80gb + 1g.10gb does not fit: together they take 8 compute slices and the
GPU has 7`` instead of one sentence repeated for eight GPUs on one long line.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from msgspec.structs import replace

from agent import cli
from agent.config import validate
from agent.core.inventory import Inventory, Placement
from agent.core.mig_catalog import mig_catalogs
from agent.core.mig_layout import DesiredLayout, LayoutError
from agent.mig import commands
from agent.mig.layout_file import LayoutFileError, misfit, parse_layout_text, unfit_problems
from agent.render import gpu_list, instances_text
from tests.unit.builders import a100

ROOT = Path(__file__).resolve().parents[2]
CATALOGS = {catalog.key: catalog for catalog in mig_catalogs()}
A100_80 = CATALOGS["A100-SXM4-80GB"]
T4_CHANGES = {"name": "Tesla T4", "pci_device_id": 0x1EB810DE, "mig_capable": False, "memory_mib": 15360}


def layout(**devices: int) -> DesiredLayout:
    return DesiredLayout(True, tuple((name.replace("_", "."), count) for name, count in devices.items()))


def layout_file(devices: str, device_filter: str = "") -> str:
    return (
        f"version: v1\nmig-configs:\n  x:\n    - {device_filter}devices: all\n      mig-enabled: true\n"
        f"      mig-devices: {devices}\n"
    )


def node(count: int = 8) -> list:
    return [a100(i, f"GPU-{i:08d}-0000-0000-0000-000000000000") for i in range(count)]


# ----- text --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("indices", "text"),
    [([3], "GPU 3"), (range(8), "GPUs 0-7"), ([0, 1], "GPUs 0, 1"), ([5, 0, 1, 2, 3], "GPUs 0-3, 5")],
)
def test_gpu_list(indices, text: str):
    assert gpu_list(indices) == text


def test_instances_text_puts_the_largest_first_and_counts_repeats():
    assert instances_text({"1g.10gb": 2, "3g.40gb": 1, "2g.20gb": 1}) == "3g.40gb + 2g.20gb + 2 × 1g.10gb"
    assert instances_text({}) == "no instances"


# ----- why a layout does not fit a model --------------------------------------------------------------------


def test_misfit_in_compute_slices():
    assert misfit(A100_80, layout(**{"7g_80gb": 1, "1g_10gb": 1})) == (
        "together they take 8 compute slices and the GPU has 7"
    )


def test_misfit_in_memory_slices():
    assert misfit(A100_80, layout(**{"1g_20gb": 4, "3g_40gb": 1})) == (
        "together they take 12 memory slices and the GPU has 8"
    )


def test_misfit_in_placements():
    """Slices to spare, but no placement: said as such (a model whose 3g profile starts only at slice 0)."""
    narrow = tuple(replace(p, placements=(Placement(0, 4),)) if p.name == "3g.40gb" else p for p in A100_80.profiles)
    catalog = replace(A100_80, profiles=narrow)
    assert misfit(catalog, layout(**{"3g_40gb": 2})).startswith("no placement holds them together")  # type: ignore[union-attr]


def test_misfit_by_count_says_the_count_once_without_the_model():
    reason = misfit(A100_80, layout(**{"1g_10gb": 8}))
    assert reason == (
        "8x 1g.10gb requested but the GPU allows at most 7; 8 GPU instances requested but the GPU allows at most 7"
    )


def test_misfit_of_a_profile_the_model_lacks_and_of_a_layout_that_fits():
    assert "1g.5gb is not a MIG profile of the GPU" in (misfit(A100_80, layout(**{"1g_5gb": 1})) or "")
    assert misfit(A100_80, layout(**{"3g_40gb": 1, "2g_20gb": 1, "1g_10gb": 2})) is None


# ----- a layout no GPU model can take ------------------------------------------------------------------------


def test_a_layout_that_fits_no_model_is_refused_grouping_the_models():
    (problem,) = unfit_problems(parse_layout_text(layout_file("{7g.80gb: 1, 1g.10gb: 1}"), "f"))
    assert problem.startswith(
        "mig-configs.x[0]: 7g.80gb + 1g.10gb fits no GPU model: on A100-SXM4-80GB, H100-SXM5-80GB"
    )
    assert problem.endswith("together they take 8 compute slices and the GPU has 7")


def test_a_layout_that_fits_one_model_passes():
    assert unfit_problems(parse_layout_text(layout_file("{1g.5gb: 7}"), "f")) == []  # A100 40GB
    shipped = ROOT / "daemonset" / "overlays" / "mig-manager" / "mig-layouts.yaml"
    assert unfit_problems(parse_layout_text(shipped.read_text(), str(shipped))) == []


def test_profiles_no_model_has_together():
    (problem,) = unfit_problems(parse_layout_text(layout_file("{1g.5gb: 1, 1g.12gb: 1}"), "f"))
    assert problem == "mig-configs.x[0]: no GPU model has all of 1g.12gb, 1g.5gb as MIG profiles"


def test_a_device_filter_limits_the_models_judged_and_an_unknown_model_is_not_judged():
    a100_40 = "device-filter: '0x20B010DE'\n      "
    (problem,) = unfit_problems(parse_layout_text(layout_file("{3g.40gb: 1}", a100_40), "f"))
    assert (
        problem == "mig-configs.x[0]: none of the GPU models of its device-filter (A100-SXM4-40GB) has all of 3g.40gb"
    )
    (problem,) = unfit_problems(parse_layout_text(layout_file("{1g.10gb: 7}", a100_40), "f"))
    assert problem == (
        "mig-configs.x[0]: 7 × 1g.10gb fits none of the GPU models of its device-filter: on A100-SXM4-40GB: "
        "7x 1g.10gb requested but the GPU allows at most 4"
    )
    unknown = "device-filter: '0x999910DE'\n      "
    assert unfit_problems(parse_layout_text(layout_file("{7g.80gb: 2}", unknown), "f")) == []


# ----- the node's operations, grouped ------------------------------------------------------------------------


def test_the_same_misfit_on_eight_gpus_is_one_problem_naming_them():
    gpus = node()
    with pytest.raises(LayoutError) as raised:
        commands.node_operations(gpus, {g.index: layout(**{"7g_80gb": 1, "1g_10gb": 1}) for g in gpus})
    assert raised.value.problems == [
        "GPUs 0-7 (A100-SXM4-80GB): 7g.80gb + 1g.10gb does not fit: together they take 8 compute slices and the GPU "
        "has 7"
    ]


def test_different_problems_are_grouped_separately():
    gpus = [*node(2), a100(2, "GPU-t4", **T4_CHANGES), a100(3, "GPU-x", pci_device_id=0x123410DE)]
    layouts = {0: layout(**{"1g_10gb": 8}), 1: layout(**{"1g_10gb": 7}), 2: layout(**{"1g_10gb": 1}), 3: layout()}
    with pytest.raises(LayoutError) as raised:
        commands.node_operations(gpus, layouts)
    assert raised.value.problems == [
        "GPU 0 (A100-SXM4-80GB): 8 × 1g.10gb does not fit: 8x 1g.10gb requested but the GPU allows at most 7; "
        "8 GPU instances requested but the GPU allows at most 7",
        "GPU 2 (Tesla T4): not MIG-capable: MIG cannot be enabled",
        "GPU 3 (A100-SXM4-80GB): no MIG profiles are known for this model (PCI device id 0x123410DE)",
    ]


def test_operations_for_gpus_that_fit_and_nothing_for_those_left_alone():
    gpus = [*node(2), a100(2, "GPU-t4", **T4_CHANGES)]
    operations = commands.node_operations(gpus, {0: layout(**{"1g_10gb": 7}), 2: DesiredLayout(False)})
    assert list(operations) == [0]
    assert commands.left_alone(gpus, {0: layout(**{"1g_10gb": 7}), 2: DesiredLayout(False)}) == [
        "GPU 1 (A100-SXM4-80GB): selected by none of the layout's specs, left as is",
        "GPU 2 (Tesla T4): not MIG-capable, left as is",
    ]


def test_on_a_node_without_mig_a_layout_that_fits_no_model_is_refused():
    """On a T4 node nothing is judged per GPU; a layout that fits no model at all is still wrong, not 'applied'."""
    t4s = [a100(i, f"GPU-t4-{i}", **T4_CHANGES) for i in range(4)]
    nofit = parse_layout_text(layout_file("{7g.80gb: 1, 1g.10gb: 1}"), "nofit.yaml")
    with pytest.raises(LayoutFileError, match=re.escape("nofit.yaml: mig-configs.x[0]: 7g.80gb + 1g.10gb fits no GPU")):
        commands.layout_on_node(nofit, "x", t4s)
    fits = parse_layout_text(layout_file("{1g.10gb: 7}"), "fits.yaml")
    assert commands.layout_on_node(fits, "x", t4s).layouts == {}
    on_a100 = commands.layout_on_node(nofit, "x", node(2))  # judged per GPU there, by node_operations
    assert set(on_a100.layouts) == {0, 1}


def test_a_preview_on_the_real_driver_changes_nothing_and_says_the_resources_are_as_now():
    gpus = node(2)
    inventory = Inventory("580", "13", 13000, tuple(gpus))
    selected = commands.SelectedLayout("x", "f", {0: layout(**{"1g_10gb": 7}), 1: layout(**{"1g_10gb": 7})})
    preview, after = commands.preview(selected, inventory, None)
    assert after is inventory
    assert not preview.after_layout
    assert preview.lines() == [
        "MIG layout x (f):",
        "  GPUs 0, 1 (A100-SXM4-80GB): MIG disabled -> MIG enabled: 7 × 1g.10gb (8 operations each)",
    ]
    assert preview.to_json()["gpus"]["0"]["operations"][0] == "set MIG mode enabled"  # type: ignore[index]


# ----- exit codes ---------------------------------------------------------------------------------------------


def test_every_command_uses_one_set_of_exit_codes():
    assert (cli.EXIT_OK, cli.EXIT_INVALID, cli.EXIT_USAGE, cli.EXIT_NVML) == (0, 1, 2, 3)
    assert cli.EXIT_PLAN_ERROR == cli.EXIT_INVALID
    assert (validate.EXIT_VALID, validate.EXIT_INVALID) == (cli.EXIT_OK, cli.EXIT_INVALID)
    assert (commands.EXIT_OK, commands.EXIT_INVALID, commands.EXIT_FAILED) == (0, cli.EXIT_INVALID, cli.EXIT_NVML)
    assert (commands.EXIT_BUSY, commands.EXIT_NOT_APPLIED) == (cli.EXIT_BUSY, cli.EXIT_NOT_APPLIED)


def test_the_exit_codes_are_documented():
    text = (ROOT / "docs" / "configuration.md").read_text()
    table = text.split("### Exit codes", 1)[1].split("###", 1)[0]
    documented = {int(code) for code in re.findall(r"^\| (\d+) \|", table, re.MULTILINE)}
    defined = {value for name, value in vars(cli).items() if name.startswith("EXIT_")}
    assert documented == defined


# ----- which layout --config and --name select ----------------------------------------------------------------


TWO_LAYOUTS = (
    "version: v1\nmig-configs:\n  a: [{devices: all, mig-enabled: true, mig-devices: {1g.10gb: 7}}]\n"
    "  b: [{devices: all, mig-enabled: false}]\n"
)


def test_a_layout_file_with_several_configs_needs_a_name(tmp_path: Path):
    path = tmp_path / "layouts.yaml"
    path.write_text(TWO_LAYOUTS)
    with pytest.raises(LayoutFileError, match=re.escape("several mig-configs (a, b); choose one with --name")):
        commands.select_layout(str(path), None, node(1))
    assert commands.select_layout(str(path), "b", node(1)).layouts == {0: DesiredLayout(False)}


def test_a_sharing_config_s_layout_is_named_by_name_else_by_its_config(tmp_path: Path):
    indented = "".join(f"    {line}\n" for line in TWO_LAYOUTS.splitlines())
    path = tmp_path / "c.yaml"
    path.write_text(f"version: v1\nmigLayout:\n  layouts:\n{indented}")
    with pytest.raises(LayoutFileError, match=re.escape("has several mig-configs (a, b) and migLayout.config names")):
        commands.select_layout(str(path), None, node(1))
    assert commands.select_layout(str(path), "a", node(1)).name == "a"
    path.write_text(f"version: v1\nmigLayout:\n  config: b\n  layouts:\n{indented}")
    selected = commands.select_layout(str(path), None, node(1))
    assert (selected.name, selected.source) == ("b", f"{path} migLayout.layouts")
