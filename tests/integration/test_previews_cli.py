"""Previews that tell the truth (issue 14): ``tessera plan``, ``validate`` and ``mig apply --dry-run`` as a
migrating platform engineer runs them, on the shipped configs and on the inputs they really have.

Each case runs ``python -m agent`` as a subprocess and checks the exit code (0 ok, 1 invalid input, 2 usage,
5 not in the layout) and the sentence a person acts on; none may print a traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
LAYOUTS = ROOT / "daemonset" / "overlays" / "mig-manager" / "mig-layouts.yaml"

NOFIT = (
    "version: v1\nmig-configs:\n  x:\n    - devices: all\n      mig-enabled: true\n"
    "      mig-devices: {7g.80gb: 1, 1g.10gb: 1}\n"
)
MANIFEST = """\
apiVersion: v1
kind: ConfigMap
metadata:
  name: tessera-config
data:
  time-slicing-4: |
    version: v1
    sharing:
      timeSlicing:
        resources:
        - name: nvidia.com/gpu
          replicas: 4
  typo: |
    version: v1
    sharing:
      timeSlicing:
        resources:
        - name: nvidia.com/gpuu
          replicas: 2
  broken: |
    version: v1
    sharing: [
"""


def tessera(*args: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    result = subprocess.run(
        [sys.executable, "-m", "agent", *args], capture_output=True, text=True, env=environ, timeout=60, check=False,
        cwd=ROOT,
    )  # fmt: skip
    assert "Traceback" not in result.stdout + result.stderr
    assert "internal error" not in result.stderr
    return result


def exits(code: int, *args: str) -> subprocess.CompletedProcess[str]:
    result = tessera(*args)
    assert result.returncode == code, (result.stdout, result.stderr)
    return result


def advertised(*args: str) -> dict[str, int]:
    document = json.loads(exits(0, "plan", *args, "--format", "json").stdout)
    return {name: resource["count"] for name, resource in document["resources"].items()}


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


# ----- plan: names resolve as the agent resolves them, or it is an error -------------------------------------


def test_plan_with_a_node_label_finds_the_file_of_that_name():
    """A local copy of the ConfigMap keeps `.yaml`; the label mps-10gb still finds mps-10gb.yaml."""
    assert advertised("--node", "dgx-a100", "--config", "configs/", "--node-label", "mps-10gb") == {
        "nvidia.com/gpu-10gb": 56
    }
    assert advertised("--node", "t4x4", "--config", "configs/", "--config-name", "time-slicing-4") == {
        "nvidia.com/gpu": 16
    }


@pytest.mark.parametrize("flag", ["--config-name", "--node-label"])
def test_plan_with_a_name_that_names_nothing_is_an_error_naming_what_exists(flag: str):
    result = exits(1, "plan", "--node", "dgx-a100", "--config", "configs/", flag, "nonexistent")
    assert result.stdout == ""
    assert "'nonexistent' names no config here; it has: a100-80gb-mig-mixed.yaml, by-model.yaml" in result.stderr
    assert "time-slicing-4.yaml" in result.stderr
    assert "the agent would warn and fall back: no config applies" in result.stderr


def test_plan_reads_a_configmap_manifest_by_its_keys(tmp_path: Path):
    manifest = write(tmp_path, "cm.yaml", MANIFEST)
    assert advertised("--node", "t4x4", "--config", manifest, "--config-name", "time-slicing-4") == {
        "nvidia.com/gpu": 16
    }
    result = exits(1, "plan", "--node", "t4x4", "--config", manifest, "--node-label", "mps")
    assert "it has: time-slicing-4, typo, broken" in result.stderr


def test_plan_of_a_manifest_key_with_a_yaml_error_points_into_the_manifest(tmp_path: Path):
    manifest = write(tmp_path, "cm.yaml", MANIFEST)
    result = exits(1, "plan", "--node", "t4x4", "--config", manifest, "--config-name", "broken")
    first, *excerpt = result.stderr.splitlines()
    assert first.startswith(f"tessera: {manifest}:23:5: not valid YAML or JSON: did not find expected node content")
    assert first.endswith("(in data key broken)")
    assert excerpt[0] == "  22 |     sharing: ["
    assert excerpt[1].endswith("^")
    assert "<unicode string>" not in result.stderr


# ----- plan: the MIG layout the config applies, and the resources after it -----------------------------------


def test_plan_shows_the_config_s_mig_layout_and_the_resources_after_it():
    result = exits(0, "plan", "--node", "dgx-h100", "--config", "configs/h100-balanced.yaml")
    lines = result.stdout.splitlines()
    assert lines[:2] == [
        "MIG layout all-balanced (configs/h100-balanced.yaml migLayout.layouts):",
        "  GPUs 0-7 (H100-SXM5-80GB): MIG disabled -> MIG enabled: 3g.40gb + 2g.20gb + 2 × 1g.10gb (5 operations each)",
    ]
    assert (
        "Advertised (mig-strategy mixed): nvidia.com/mig-1g.10gb × 16, nvidia.com/mig-2g.20gb × 8, "
        "nvidia.com/mig-3g.40gb × 8"
    ) in lines
    assert "nvidia.com/gpu " not in result.stdout


def test_plan_json_carries_the_layout_per_gpu():
    document = json.loads(
        exits(0, "plan", "--node", "dgx-a100", "--config", "configs/", "--node-label", "a100-80gb-mig-mixed",
              "--format", "json").stdout
    )  # fmt: skip
    assert {name: r["count"] for name, r in document["resources"].items()} == {"nvidia.com/mig-1g.10gb": 56}
    layout = document["mig_layout"]
    assert (layout["name"], layout["resources_after_layout"]) == ("all-1g.10gb", True)
    assert sorted(layout["gpus"], key=int) == [str(i) for i in range(8)]
    gpu = layout["gpus"]["0"]
    assert gpu["before"] == {"mig_enabled": False, "devices": {}}
    assert gpu["after"] == {"mig_enabled": True, "devices": {"1g.10gb": 7}}
    assert gpu["operations"][0] == "set MIG mode enabled" and len(gpu["operations"]) == 8


def test_plan_on_a_node_that_has_the_layout_changes_nothing():
    result = exits(0, "plan", "--node", "a100-mig", "--config", "configs/a100-80gb-mig-mixed.yaml")
    assert "  GPU 0 (A100-SXM4-80GB): MIG enabled: 7 × 1g.10gb, as it is now" in result.stdout.splitlines()


def test_plan_applies_a_mode_change_that_waits_for_a_reset_and_says_so(tmp_path: Path):
    spec = write(tmp_path, "node.yaml", "gpus:\n  - model: A100-SXM4-80GB\n    count: 2\n    mig_needs_reset: true\n")
    result = exits(0, "plan", "--node", spec, "--config", "configs/a100-80gb-mig-mixed.yaml")
    assert "waits for a GPU reset (reset-required), shown as after it" in result.stdout
    assert "Advertised (mig-strategy mixed): nvidia.com/mig-1g.10gb × 14" in result.stdout


def test_plan_with_a_mig_label_picks_the_layout_or_names_the_ones_there_are():
    result = exits(1, "plan", "--node", "dgx-a100", "--config", "configs/a100-80gb-mig-mixed.yaml",
                   "--mig-label", "all-2g")  # fmt: skip
    assert "selected mig-config not present: all-2g (have: all-1g.10gb)" in result.stderr


def test_plan_of_a_config_whose_layout_does_not_fit_the_node_is_an_error_grouped_once(tmp_path: Path):
    config = write(
        tmp_path,
        "c.yaml",
        "version: v1\nflags: {migStrategy: mixed}\nmigLayout:\n  layouts:\n"
        "    version: v1\n    mig-configs:\n      x: [{devices: all, mig-enabled: true, mig-devices: {1g.5gb: 7}}]\n",
    )
    result = exits(1, "plan", "--node", "dgx-a100", "--config", config)
    assert result.stderr == (
        "tessera: GPUs 0-7 (A100-SXM4-80GB): 7 × 1g.5gb does not fit: 1g.5gb is not a MIG profile of the GPU "
        "(its profiles: 1g.10gb, 1g.10gb+me, 1g.20gb, 2g.20gb, 3g.40gb, 4g.40gb, 7g.80gb)\n"
    )


# ----- mig apply / assert -------------------------------------------------------------------------------------


def test_mig_apply_dry_run_takes_a_sharing_config_with_a_layout():
    result = exits(0, "mig", "apply", "--dry-run", "--node", "dgx-h100", "--config", "configs/h100-balanced.yaml")
    lines = result.stdout.splitlines()
    assert lines[0] == "MIG layout all-balanced from configs/h100-balanced.yaml migLayout.layouts"
    assert "GPU 0: set MIG mode enabled" in lines
    assert "GPU 7: create 3g.40gb at 4:4" in lines
    assert lines[-1] == "dry run: nothing was changed"


def test_mig_apply_of_a_config_whose_match_excludes_the_node_is_refused():
    result = exits(1, "mig", "apply", "--dry-run", "--node", "dgx-a100", "--config", "configs/h100-balanced.yaml")
    assert "the agent would apply no config of it on this node" in result.stderr
    assert "h100-balanced.yaml matches only NVIDIA H100 80GB HBM3" in result.stderr


def test_mig_apply_of_a_config_without_a_layout_says_so():
    result = exits(1, "mig", "apply", "--dry-run", "--node", "dgx-a100", "--config", "configs/time-slicing-4.yaml")
    assert "a sharing config without migLayout.layouts: it asks for no MIG layout" in result.stderr


def test_mig_apply_of_a_directory_names_a_file_to_give():
    result = exits(1, "mig", "apply", "--node", "dgx-a100", "--config", "configs/")
    assert (
        result.stderr == "tessera: configs/ is a directory; name a file in it, e.g. configs/a100-80gb-mig-mixed.yaml\n"
    )
    assert "Errno" not in result.stderr


def test_mig_apply_of_a_layout_that_does_not_fit_groups_the_gpus_and_exits_1(tmp_path: Path):
    nofit = write(tmp_path, "nofit.yaml", NOFIT)
    result = exits(1, "mig", "apply", "--dry-run", "--node", "dgx-a100", "--config", nofit)
    assert result.stderr == (
        "tessera: GPUs 0-7 (A100-SXM4-80GB): 7g.80gb + 1g.10gb does not fit: together they take 8 compute slices "
        "and the GPU has 7\n"
    )
    assert result.stdout == ""


def test_mig_apply_of_a_layout_that_fits_no_gpu_on_a_node_without_mig_is_not_currently_applied(tmp_path: Path):
    nofit = write(tmp_path, "nofit.yaml", NOFIT)
    result = exits(1, "mig", "apply", "--node", "t4x4", "--config", nofit)
    assert "currently applied" not in result.stdout + result.stderr
    assert "mig-configs.x[0]: 7g.80gb + 1g.10gb fits no GPU model" in result.stderr


def test_mig_apply_on_a_node_without_mig_says_nothing_is_selected():
    result = exits(0, "mig", "apply", "--dry-run", "--node", "t4x4", "--config", str(LAYOUTS), "--name", "all-1g.10gb")
    assert "currently applied" not in result.stdout
    assert "Nothing to do: the layout selects no GPU of this node" in result.stdout
    assert "  GPUs 0-3 (Tesla T4): not MIG-capable, left as is" in result.stdout


def test_mig_assert_of_a_node_without_the_layout_exits_5():
    result = exits(5, "mig", "assert", "--node", "dgx-a100", "--config", "configs/a100-80gb-mig-mixed.yaml")
    assert result.stdout.splitlines() == [
        "assertion failure: selected configuration not currently applied",
        "  GPUs 0-7: 8 operations needed each",
    ]
    exits(0, "mig", "assert", "--node", "a100-mig", "--config", "configs/a100-80gb-mig-mixed.yaml")


def test_mig_apply_that_waits_for_a_reset_exits_5(tmp_path: Path):
    spec = write(tmp_path, "node.yaml", "gpus:\n  - model: A100-SXM4-80GB\n    count: 2\n    mig_needs_reset: true\n")
    result = exits(5, "mig", "apply", "--node", spec, "--config", str(LAYOUTS), "--name", "all-1g.10gb")
    assert result.stdout.splitlines()[-1] == "reset-required: GPUs 0, 1 need a reset for the MIG mode change"


# ----- validate: what is not a sharing config, resources no GPU gets, YAML errors ------------------------------


def test_validate_the_shipped_configs():
    result = exits(0, "validate", "configs/")
    assert result.stdout.splitlines()[-1] == "8 of 8 configs valid"
    assert "h100-balanced.yaml: valid (no sharing, migStrategy mixed, MIG layout all-balanced" in result.stdout


def test_validate_a_configmap_manifest_key_by_key(tmp_path: Path):
    manifest = write(tmp_path, "cm.yaml", MANIFEST)
    result = exits(1, "validate", manifest)
    lines = result.stdout.splitlines()
    assert lines[0] == f"{manifest}: ConfigMap tessera-config, data keys: time-slicing-4, typo, broken"
    assert "time-slicing-4: valid (sharing timeSlicing, migStrategy default)" in lines
    assert "typo: valid (sharing timeSlicing, migStrategy default)" in lines
    warning = "  warning: sharing.timeSlicing.resources[0].name: no GPU is ever advertised as nvidia.com/gpuu"
    assert any(line.startswith(warning) and line.endswith("did you mean nvidia.com/gpu?") for line in lines)
    assert "broken: INVALID" in lines
    assert f"  error: {manifest}:23:5: not valid YAML or JSON: did not find expected node content" in result.stdout
    assert lines[-1] == "2 of 3 configs valid"
    only = exits(0, "validate", manifest, "--config-name", "time-slicing-4.yaml")
    assert only.stdout.splitlines()[-1] == "1 of 1 config valid"
    assert (
        "names no config; it has: time-slicing-4, typo, broken"
        in exits(1, "validate", manifest, "--config-name", "nope").stderr
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("apiVersion: v1\nkind: Pod\nmetadata: {name: cuda}\nspec: {containers: []}\n", "a Kubernetes Pod 'cuda'"),
        ("apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: web}\n", "a Kubernetes Deployment 'web'"),
        (NOFIT, "a MIG layout file (mig-parted's format: version and mig-configs), not a sharing config"),
    ],
    ids=["pod", "deployment", "mig-parted"],
)
def test_validate_refuses_what_is_not_a_sharing_config_saying_what_it_is(tmp_path: Path, text: str, expected: str):
    path = write(tmp_path, "thing.yaml", text)
    result = exits(1, "validate", path)
    lines = result.stdout.splitlines()
    assert lines[0] == "thing.yaml: INVALID"
    assert lines[1].startswith("  error: ")
    assert expected in result.stdout
    assert result.stdout.splitlines()[-1] == "0 of 1 config valid"
    exits(1, "plan", "--node", "t4x4", "--config", path)  # the preview refuses it too, as the agent would


def test_validate_a_configmap_of_layouts_says_none_of_its_keys_is_a_config(tmp_path: Path):
    indented = "".join(f"    {line}\n" for line in NOFIT.splitlines())
    path = write(tmp_path, "cm.yaml", f"apiVersion: v1\nkind: ConfigMap\nmetadata: {{name: mig-parted}}\n"
                 f"data:\n  config.yaml: |\n{indented}")  # fmt: skip
    result = exits(1, "validate", path)
    assert "config.yaml: INVALID" in result.stdout
    assert f"{path}: none of the ConfigMap's data keys is a sharing config" in result.stdout


def test_validate_a_yaml_error_gives_the_place_and_the_line(tmp_path: Path):
    path = write(tmp_path, "bad.yaml", "version: v1\nsharing:\n  timeSlicing: {resources: [}\n")
    result = exits(1, "validate", path)
    lines = result.stdout.splitlines()
    assert lines[0] == "bad.yaml: INVALID"
    assert lines[1].startswith(f"  error: {path}:3:")
    assert lines[2] == "    3 |   timeSlicing: {resources: [}"
    assert lines[3].strip().startswith("|") and lines[3].endswith("^")
    assert "<unicode string>" not in result.stdout + result.stderr


def test_validate_a_layout_that_fits_no_gpu_model_in_a_config(tmp_path: Path):
    indented = "".join(f"    {line}\n" for line in NOFIT.splitlines())
    path = write(tmp_path, "c.yaml", f"version: v1\nmigLayout:\n  layouts:\n{indented}")
    result = exits(1, "validate", path)
    assert "  error: migLayout.layouts.mig-configs.x[0]: 7g.80gb + 1g.10gb fits no GPU model" in result.stdout


def test_an_empty_manifest_is_nothing_to_check(tmp_path: Path):
    path = write(tmp_path, "cm.yaml", "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: empty}\n")
    assert (
        exits(1, "validate", path).stdout.splitlines()[-1]
        == f"{path}: the ConfigMap has no data keys: nothing to check"
    )


def test_plan_of_a_config_whose_layouts_name_none_says_mig_is_left_alone(tmp_path: Path):
    config = write(
        tmp_path,
        "c.yaml",
        "version: v1\nmigLayout:\n  layouts:\n    version: v1\n    mig-configs:\n"
        "      a: [{devices: all, mig-enabled: false}]\n      b: [{devices: all, mig-enabled: false}]\n",
    )
    result = exits(0, "plan", "--node", "dgx-a100", "--config", config)
    assert "migLayout holds several layouts (a, b) and migLayout.config names none" in result.stderr
    assert "MIG layout" not in result.stdout
    picked = exits(0, "plan", "--node", "dgx-a100", "--config", config, "--mig-label", "b")
    assert "  GPUs 0-7 (A100-SXM4-80GB): MIG disabled, as it is now" in picked.stdout


def test_plan_with_a_mig_label_but_no_layout_warns():
    result = exits(0, "plan", "--node", "t4x4", "--mig-label", "all-1g.10gb")
    assert (
        "warning: --mig-label is not used: it picks a layout of the config's migLayout, and there is none"
        in result.stderr
    )
    other = exits(0, "plan", "--node", "t4x4", "--config", "configs/time-slicing-4.yaml", "--mig-label", "x")
    assert "warning: --mig-label is not used" in other.stderr
