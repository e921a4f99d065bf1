"""The sharing configs of configs/ and the pods of configs/pods/, checked with the agent's own CLI.

- every config passes ``tessera validate --strict``;
- every pod example requests a resource that its config advertises on a suitable simulated node
  (``tessera plan --node ... --config ... --format json``);
- every MIG layout (embedded in a config, or in the mig-manager overlay's layouts file) can be applied to
  the GPU models it is for (``tessera mig apply --dry-run``), and the node specs the MIG pods are planned
  on are exactly those layouts (``tessera mig assert``);
- the ConfigMaps as the kubelet mounts them (one file per key) select the configs they should on
  unlabelled, labelled and matching nodes;
- every config with a ``match`` applies, alone (``--config FILE``), to the nodes it names and to no other:
  a node it does not match advertises exactly what it would with no config, and says why.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.conftest import CONFIGS, DAEMONSET, PODS, ROOT, config_files, has_mig_layout

NODES = Path(__file__).parent / "nodes"
H100_BALANCED = str(NODES / "dgx-h100-balanced.yaml")
L4 = str(NODES / "l4x2.yaml")

# (pod example, config in configs/ or None for no config, node, resources the plan must advertise)
EXAMPLES = [
    ("gpu.yaml", None, "t4x4", {"nvidia.com/gpu": 4}),
    ("gpu.yaml", "time-slicing-4.yaml", "t4x4", {"nvidia.com/gpu": 16}),
    ("gpu.yaml", "time-slicing-4.yaml", "dgx-a100", {"nvidia.com/gpu": 32}),
    ("gpu.yaml", "by-model.yaml", L4, {"nvidia.com/gpu": 8}),
    ("gpu.yaml", "by-model.yaml", "t4x4", {"nvidia.com/gpu": 16}),
    ("gpu.yaml", "per-gpu-sharing.yaml", "dgx-a100", {"nvidia.com/gpu": 4, "nvidia.com/gpu.shared": 32}),
    ("gpu-shared.yaml", "per-gpu-sharing.yaml", "dgx-h100", {"nvidia.com/gpu": 4, "nvidia.com/gpu.shared": 32}),
    ("gpu-10gb.yaml", "mps-10gb.yaml", "dgx-a100", {"nvidia.com/gpu-10gb": 56}),
    ("gpu-10gb.yaml", "mps-10gb.yaml", "dgx-h100", {"nvidia.com/gpu-10gb": 56}),
    ("mig-1g.10gb.yaml", "a100-80gb-mig-mixed.yaml", "a100-mig", {"nvidia.com/mig-1g.10gb": 7}),
    (
        "mig-1g.10gb.yaml",
        "h100-balanced.yaml",
        H100_BALANCED,
        {"nvidia.com/mig-1g.10gb": 16, "nvidia.com/mig-2g.20gb": 8, "nvidia.com/mig-3g.40gb": 8},
    ),
    ("mig-2g.20gb.yaml", "h100-balanced.yaml", H100_BALANCED, {"nvidia.com/mig-2g.20gb": 8}),
    ("mig-3g.40gb.yaml", "h100-balanced.yaml", H100_BALANCED, {"nvidia.com/mig-3g.40gb": 8}),
]
# Configs with a MIG layout: the GPU models (simulated nodes) it must apply to, and the node that shows
# the layout applied (the node its MIG pod examples are planned on).
LAYOUT_TARGETS = {
    "a100-80gb-mig-mixed.yaml": (["dgx-a100", "a100-mig"], "a100-mig"),
    "h100-balanced.yaml": (["dgx-h100"], H100_BALANCED),
}


def tessera(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent", *args], capture_output=True, text=True, cwd=ROOT, timeout=120, check=False
    )


def plan(node: str, *config_args: str) -> dict[str, Any]:
    result = tessera("plan", "--node", node, *config_args, "--format", "json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def counts(planned: dict[str, Any]) -> dict[str, int]:
    return {name: r["count"] for name, r in planned["resources"].items()}


def requests(pod_file: str) -> dict[str, int]:
    pod = yaml.safe_load((PODS / pod_file).read_text(encoding="utf-8"))
    wanted: dict[str, int] = {}
    for c in pod["spec"]["containers"]:
        for name, value in c["resources"]["limits"].items():
            if name.startswith("nvidia.com/"):
                wanted[name] = wanted.get(name, 0) + int(value)
    return wanted


# ----- validation ------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", config_files(), ids=lambda p: p.name)
def test_config_passes_strict_validation(path):
    result = tessera("validate", "--strict", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 of 1 config valid (strict)" in result.stdout


def test_catalogue_directory_passes_strict_validation():
    """As a directory too: what `tessera run --config configs/` would read (pods/ is not a config)."""
    result = tessera("validate", "--strict", str(CONFIGS))
    assert result.returncode == 0, result.stdout + result.stderr
    n = len(config_files())
    assert f"{n} of {n} configs valid (strict)" in result.stdout


def test_catalogue_holds_what_it_promises():
    names = {p.name for p in config_files()}
    assert {"time-slicing-4.yaml", "mps-10gb.yaml", "a100-80gb-mig-mixed.yaml", "h100-balanced.yaml"} <= names
    assert {p.name for p in config_files() if "match" in yaml.safe_load(p.read_text(encoding="utf-8"))} == {
        "by-model.yaml",
        "h100-balanced.yaml",
    }
    mps = yaml.safe_load((CONFIGS / "mps-10gb.yaml").read_text(encoding="utf-8"))["sharing"]["mps"]["resources"][0]
    assert (mps["rename"], mps["memoryLimit"]) == ("nvidia.com/gpu-10gb", "10Gi")


# ----- pods against what the configs advertise ----------------------------------------------------------


@pytest.mark.parametrize(
    ("pod", "config", "node", "expected"), EXAMPLES, ids=[f"{p}-{c}-{Path(n).stem}" for p, c, n, _ in EXAMPLES]
)
def test_pod_example_requests_what_its_config_advertises(pod, config, node, expected):
    planned = plan(node, *(["--config", str(CONFIGS / config)] if config else []))
    assert planned["warnings"] == []
    advertised = counts(planned)
    assert expected.items() <= advertised.items(), advertised
    for resource, amount in requests(pod).items():
        assert advertised.get(resource, 0) >= amount, f"{pod} asks for {amount} {resource}; {config} on {node}"


def test_every_pod_and_every_config_has_an_example():
    assert {pod for pod, *_ in EXAMPLES} == {p.name for p in PODS.glob("*.yaml")}
    dra_only = {p.name for p in config_files() if "dra" in yaml.safe_load(p.read_text(encoding="utf-8"))}
    assert dra_only == {"dra-dynamic-mig.yaml", "dra-gpu-shares.yaml"}  # claims for them: test_dra.py
    assert {config for _, config, *_ in EXAMPLES if config} == {p.name for p in config_files()} - dra_only


# ----- MIG layouts ------------------------------------------------------------------------------------------


def _layouts_file(tmp_path: Path, config: Path) -> Path:
    section = yaml.safe_load(config.read_text(encoding="utf-8"))["migLayout"]
    path = tmp_path / f"{config.stem}-layouts.yaml"
    path.write_text(yaml.safe_dump(section["layouts"]), encoding="utf-8")
    return path


@pytest.mark.parametrize("config", sorted(LAYOUT_TARGETS))
def test_embedded_mig_layout_fits_its_gpu_models(tmp_path, config):
    path = CONFIGS / config
    name = yaml.safe_load(path.read_text(encoding="utf-8"))["migLayout"]["config"]
    layouts = _layouts_file(tmp_path, path)
    nodes, applied = LAYOUT_TARGETS[config]
    for node in nodes:
        result = tessera("mig", "apply", "--dry-run", "--node", node, "--config", str(layouts), "--name", name)
        assert result.returncode == 0, f"{config} on {node}: {result.stderr}"
    result = tessera("mig", "assert", "--node", applied, "--config", str(layouts), "--name", name)
    assert result.returncode == 0, f"{applied} is not {config}'s layout: {result.stdout}{result.stderr}"


def test_every_config_with_a_layout_is_covered():
    assert set(LAYOUT_TARGETS) == {p.name for p in config_files() if has_mig_layout(p)}


def test_mig_manager_layouts_fit_a100_and_h100():
    path = DAEMONSET / "overlays" / "mig-manager" / "mig-layouts.yaml"
    names = yaml.safe_load(path.read_text(encoding="utf-8"))["mig-configs"]
    assert {"all-disabled", "all-1g.10gb", "all-balanced"} <= set(names)
    cases = [(name, node) for name in names for node in ("dgx-a100", "dgx-h100", "t4x4")]  # t4x4: no MIG, skipped

    def dry_run(case: tuple[str, str]) -> subprocess.CompletedProcess[str]:
        return tessera("mig", "apply", "--dry-run", "--node", case[1], "--config", str(path), "--name", case[0])

    with ThreadPoolExecutor(8) as pool:
        results = pool.map(dry_run, cases)
        for (name, node), result in zip(cases, results, strict=True):
            assert result.returncode == 0, f"{name} on {node}: {result.stderr}"


# ----- the ConfigMaps as the agent sees them ------------------------------------------------------------


def _mounted(tmp_path: Path, rendered: dict[str, list[dict[str, Any]]], variant: str) -> str:
    """The rendered tessera-config ConfigMap written out as the kubelet mounts it: one file per key."""
    objects = rendered[variant]
    (cm,) = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "tessera-config"]
    directory = tmp_path / variant
    directory.mkdir()
    for key, text in cm["data"].items():
        (directory / key).write_text(text, encoding="utf-8")
    return str(directory)


def test_base_config_map_leaves_unlabelled_nodes_alone_except_by_model(tmp_path, rendered):
    mounted = _mounted(tmp_path, rendered, "base")
    for node in ("dgx-a100", "dgx-h100", "a100-mig"):
        planned = plan(node, "--config", mounted)
        assert planned["mig_strategy"] == "none" and set(counts(planned)) == {"nvidia.com/gpu"}, node
    assert counts(plan("t4x4", "--config", mounted)) == {"nvidia.com/gpu": 16}  # by-model's match
    labelled = plan("dgx-a100", "--config", mounted, "--node-label", "mps-10gb")
    assert counts(labelled) == {"nvidia.com/gpu-10gb": 56}


def test_mig_manager_config_map_selects_by_model_and_label(tmp_path, rendered):
    mounted = _mounted(tmp_path, rendered, "mig-manager")
    assert plan("dgx-h100", "--config", mounted)["mig_strategy"] == "mixed"  # h100-balanced's match
    assert counts(plan(H100_BALANCED, "--config", mounted))["nvidia.com/mig-3g.40gb"] == 8
    labelled = plan("a100-mig", "--config", mounted, "--node-label", "a100-80gb-mig-mixed")
    assert counts(labelled) == {"nvidia.com/mig-1g.10gb": 7}
    assert plan("dgx-a100", "--config", mounted)["mig_strategy"] == "none"


# ----- match: on the nodes a config names, and on no other --------------------------------------------------

H100_NVL = """\
# An H100 NVL (94 GB; MIG profiles 1g.12gb...): an H100, but not one h100-balanced's layout fits.
name: h100-nvl
gpus:
  - model: H100-NVL-94GB
    count: 2
"""
# config with `match` -> (nodes it applies to: what they must advertise or their MIG strategy, nodes it must not touch)
MATCH_CASES: dict[str, tuple[dict[str, dict[str, Any]], list[str]]] = {
    "by-model.yaml": (
        {"t4x4": {"resources": {"nvidia.com/gpu": 16}}, L4: {"resources": {"nvidia.com/gpu": 8}}},
        ["dgx-a100", "dgx-h100", "a100-mig", "demo"],
    ),
    "h100-balanced.yaml": (
        {"dgx-h100": {"mig_strategy": "mixed"}, H100_BALANCED: {"mig_strategy": "mixed"}},
        ["dgx-a100", "a100-mig", "t4x4", "demo", "h100-nvl"],
    ),
}


def test_every_config_with_a_match_is_covered():
    with_match = {p.name for p in config_files() if "match" in yaml.safe_load(p.read_text(encoding="utf-8"))}
    assert set(MATCH_CASES) == with_match


def _plan_with_stderr(node: str, *config_args: str) -> tuple[dict[str, Any], str]:
    result = tessera("plan", "--node", node, *config_args, "--format", "json")
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    return json.loads(result.stdout), result.stderr


@pytest.mark.parametrize("config", sorted(MATCH_CASES))
def test_a_config_with_match_applies_alone_to_its_nodes_and_to_no_other(tmp_path, config):
    nvl = tmp_path / "h100-nvl.yaml"
    nvl.write_text(H100_NVL, encoding="utf-8")
    matching, others = MATCH_CASES[config]
    patterns = yaml.safe_load((CONFIGS / config).read_text(encoding="utf-8"))["match"]
    nodes = [str(nvl) if n == "h100-nvl" else n for n in others]
    runs = [(node, True) for node in matching] + [(node, False) for node in nodes]
    config_args = ("--config", str(CONFIGS / config))

    def both(case: tuple[str, bool]) -> tuple[tuple[dict[str, Any], str], tuple[dict[str, Any], str]]:
        return _plan_with_stderr(case[0], *config_args), _plan_with_stderr(case[0])

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(both, runs))
    for (node, matches), ((planned, stderr), (bare, _)) in zip(runs, results, strict=True):
        name = Path(node).stem
        if matches:
            expected = matching[node]
            assert "whose match selects" in stderr, (name, stderr)
            if "resources" in expected:
                assert counts(planned) == expected["resources"], name
            if "mig_strategy" in expected:
                assert planned["mig_strategy"] == expected["mig_strategy"], name
        else:
            assert planned == bare, f"{config} changed what {name} advertises"
            assert f"no config applies: {config} matches only {', '.join(patterns)}; this node has" in stderr, (
                name,
                stderr,
            )
