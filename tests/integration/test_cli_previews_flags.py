"""Previews that do not mislead and flags that are not accepted silently (issue 26, items 4 and 5), as a user runs
``tessera``: a MIG-enabled GPU offered whole under ``none`` is named in the plan's warnings, an MPS slice shows its
own memory, ``validate --strict`` fails on any warning, and the ``plan`` flags that cannot work (a Kubernetes
version without ``resource.k8s.io/v1``, a Node UID that is no UUID, ``--dra`` flags without ``--dra``, an empty
node spec) are usage errors that say what to give instead. Errors speak the user's terms (YAML's, not pydantic's)
and the no-GPU hint names the flag of the command that failed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MPS_10GB = str(ROOT / "configs" / "mps-10gb.yaml")
NODE_UID = "4f5b1c2e-8d3a-4b6f-9e1d-2a3b4c5d6e7f"


def tessera(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    result = subprocess.run(
        [sys.executable, "-m", "agent", *args], capture_output=True, text=True, env=environ, timeout=60, check=False,
        cwd=cwd,
    )  # fmt: skip
    assert "Traceback" not in result.stdout + result.stderr
    assert "internal error" not in result.stderr
    return result


def exits(code: int, *args: str) -> subprocess.CompletedProcess[str]:
    result = tessera(*args)
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    return result


# ----- previews ----------------------------------------------------------------------------------------------


def test_a_mig_enabled_gpu_offered_whole_under_none_is_a_warning_naming_it():
    document = json.loads(exits(0, "plan", "--node", "a100-mig", "--config", MPS_10GB, "--format", "json").stdout)
    assert document["mig_strategy"] == "none"
    (device,) = {d["gpu"] for d in document["resources"]["nvidia.com/gpu-10gb"]["devices"]}
    (warning,) = document["warnings"]
    assert warning.startswith(f"GPU 0 ({device}) has MIG enabled: with mig-strategy none it is advertised whole")
    assert "CUDA in a pod given it finds no device it can use" in warning
    assert "use mig-strategy mixed (or single)" in warning
    table = exits(0, "plan", "--node", "a100-mig", "--mig-strategy", "none").stdout
    assert f"warning: GPU 0 ({device}) has MIG enabled" in table
    mixed = json.loads(exits(0, "plan", "--node", "a100-mig", "--mig-strategy", "mixed", "--format", "json").stdout)
    assert mixed["warnings"] == []  # its MIG devices are advertised: nothing to warn about


def test_an_mps_slice_shows_its_own_memory_not_the_whole_gpus():
    document = json.loads(exits(0, "plan", "--node", "a100-mig", "--config", MPS_10GB, "--format", "json").stdout)
    resource = document["resources"]["nvidia.com/gpu-10gb"]
    assert [d["memory_mib"] for d in resource["devices"]] == [10240] * 7  # memoryLimit: 10Gi, not 81920
    table = exits(0, "plan", "--node", "a100-mig", "--config", MPS_10GB).stdout
    rows = [line for line in table.splitlines() if line.startswith("nvidia.com/gpu-10gb ")]
    assert len(rows) == 7 and all(row.endswith("10240 MiB of 81920") for row in rows)
    shared = exits(0, "plan", "--node", "t4x4", "--config", str(ROOT / "configs" / "time-slicing-4.yaml")).stdout
    assert "15360 MiB shared" in shared  # a time-sliced replica may use the whole GPU, with the others


def test_validate_strict_fails_a_resource_that_shares_nothing(tmp_path: Path):
    path = tmp_path / "typo.yaml"
    path.write_text(
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n      - {name: nvidia.com/gpuu, replicas: 2}\n"
    )
    lenient = exits(0, "validate", str(path))
    assert "  warning: sharing.timeSlicing.resources[0].name: no GPU is ever advertised as nvidia.com/gpuu" in (
        lenient.stdout
    )
    strict = exits(1, "validate", "--strict", str(path)).stdout.splitlines()
    assert strict[0] == "typo.yaml: INVALID (--strict: warnings are errors)"
    assert strict[1].startswith("  error: sharing.timeSlicing.resources[0].name: no GPU is ever advertised as")
    assert strict[-1] == "0 of 1 config valid (strict)"
    assert exits(0, "validate", "--strict", str(ROOT / "configs")).stdout.splitlines()[-1].endswith("valid (strict)")


# ----- flags -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("version", "message"),
    [
        ("1.20", "Kubernetes 1.20 is not supported: Tessera's DRA driver publishes resource.k8s.io/v1 ResourceSlices"),
        ("1.33", "give 1.34 or a later 1.x"),
        ("2.0", "Kubernetes 2.0 is not supported"),
        ("banana", "'banana' is not a Kubernetes version; give 1.34 or later, e.g. 1.35"),
    ],
)
def test_a_kubernetes_version_the_driver_cannot_serve_is_refused_naming_the_range(version: str, message: str):
    result = exits(2, "plan", "--dra", "--node", "t4x4", "--kubernetes-version", version)
    assert "tessera plan: error: argument --kubernetes-version: " in result.stderr
    assert message in result.stderr and "1.34" in result.stderr


@pytest.mark.parametrize(("version", "layout"), [("v1.34.2", "combined"), ("1.35.0-gke.1", "split"), ("1.36", "split")])
def test_the_supported_versions_in_the_forms_a_server_reports_them(version: str, layout: str):
    result = exits(0, "plan", "--dra", "--node", "t4x4", "--kubernetes-version", version)
    assert f"{layout} layout" in result.stdout.splitlines()[0]


def test_a_node_uid_must_be_a_uuid():
    result = exits(2, "plan", "--dra", "--node", "t4x4", "--node-uid", "node-1")
    assert "argument --node-uid: 'node-1' is not a Node UID (a UUID" in result.stderr
    assert "kubectl get node NAME -o jsonpath='{.metadata.uid}'" in result.stderr
    good = exits(0, "plan", "--dra", "--node", "t4x4", "--node-uid", NODE_UID, "--format", "json")
    (item,) = json.loads(good.stdout)["items"]
    assert item["metadata"]["ownerReferences"][0]["uid"] == NODE_UID


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (("--node-name", "gpu-7"), "--node-name is read only with --dra"),
        (("--node-uid", NODE_UID), "--node-uid is read only with --dra"),
        (("--kubernetes-version", "1.35"), "--kubernetes-version is read only with --dra"),
        (("--node-name", "gpu-7", "--node-uid", NODE_UID), "--node-name, --node-uid are read only with --dra"),
    ],
)
def test_dra_flags_without_dra_are_a_usage_error(flags: tuple[str, ...], named: str):
    result = exits(2, "plan", "--node", "t4x4", *flags)
    assert f"tessera plan: error: {named} (the ResourceSlices preview); add --dra" in result.stderr


@pytest.mark.parametrize(("text", "what"), [("", "is empty"), ("name: my-node\n", "has no gpus")])
def test_an_empty_node_spec_is_refused_not_a_node_without_gpus(tmp_path: Path, text: str, what: str):
    spec = tmp_path / "node.yaml"
    spec.write_text(text)
    result = exits(2, "plan", "--node", str(spec))
    assert f"tessera: {spec} {what}: a node spec lists its GPUs, e.g. gpus: [{{model: A100-SXM4-80GB" in result.stderr
    assert result.stdout == ""
    spec.write_text("name: bare\ngpus: []\n")  # said on purpose: a node without GPUs
    assert "Advertised (mig-strategy none): nothing" in exits(0, "plan", "--node", str(spec)).stdout


# ----- errors in the user's terms ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("- version: v1\n", "(top level): expected a mapping of keys to values, got a list"),
        ("version: v1\nsharing: 5\n", "sharing: expected a mapping of keys to values, got the number 5"),
        ("version: v1\nflags: [a]\n", "flags: expected a mapping of keys to values, got a list"),
        ("version: v1\nsharing: {timeSlicing: {resources: x}}\n", "resources: expected a list, got the text 'x'"),
    ],
)
def test_config_errors_say_what_is_wrong_in_yaml_terms_not_pydantic_s(tmp_path: Path, text: str, problem: str):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    for result in (exits(1, "validate", str(path)), exits(1, "plan", "--node", "t4x4", "--config", str(path))):
        output = result.stdout + result.stderr
        assert problem in output
        assert "instance of" not in output and "Model" not in output and "Input should be" not in output


@pytest.mark.parametrize("command", [("plan",), ("inventory",), ("mig", "export")])
def test_the_no_gpu_hint_names_the_flag_of_the_command_that_failed(command: tuple[str, ...]):
    result = exits(3, *command)  # --node local: the real driver, which this machine does not have
    assert f"Without a GPU: `tessera {' '.join(command)} --node dgx-a100` (a simulated node)" in result.stderr
    assert "--simulate" not in result.stderr  # `tessera run`'s flag: these commands do not take it
