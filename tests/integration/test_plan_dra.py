"""``tessera plan --dra``: the ResourceSlices the agent would publish, as complete objects a user can inspect or send
to an API server (``kubectl create --dry-run=server -f -``; ``apply`` does not take generateName)."""

from __future__ import annotations

import json
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from .test_previews_cli import exits

UID = "6f1c1f0e-3f7b-4c1e-9a7e-2b1d3c4e5f60"


def slices(stdout: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(stdout) if d is not None]


def test_every_gpu_of_the_node_as_complete_valid_objects() -> None:
    result = exits(0, "plan", "--dra", "--node", "dgx-a100", "--format", "yaml", "--node-uid", UID)
    (item,) = slices(result.stdout)
    for version in ("1.34", "1.37"):
        kubernetes_validate.validate(item, version, strict=True)
    assert item["kind"] == "ResourceSlice" and item["apiVersion"] == "resource.k8s.io/v1"
    assert item["spec"]["nodeName"] == "dgx-a100" and item["spec"]["pool"]["name"] == "dgx-a100"
    assert [d["name"] for d in item["spec"]["devices"]] == [f"gpu-{i}" for i in range(8)]
    assert item["metadata"]["ownerReferences"][0]["uid"] == UID
    assert "placeholder" not in result.stderr


def test_mig_devices_carry_nvidias_names_and_the_uid_placeholder_is_said() -> None:
    result = exits(0, "plan", "--dra", "--node", "a100-mig", "--format", "json")
    document = json.loads(result.stdout)
    assert document["kind"] == "List"
    names = [d["name"] for d in document["items"][0]["spec"]["devices"]]
    assert names == [f"gpu-0-mig-1g10gb-19-{start}" for start in range(7)]
    assert "placeholder UID" in result.stderr and "kubectl get node a100-mig" in result.stderr


def test_the_configs_dra_gpus_and_driver_name_decide(tmp_path: Path) -> None:
    config = tmp_path / "dra.yaml"
    config.write_text("version: v1\ndra:\n  enabled: true\n  driverName: gpu.example.com\n  gpus: [0, 3]\n")
    result = exits(0, "plan", "--dra", "--node", "dgx-a100", "--config", str(config), "--format", "yaml")
    (item,) = slices(result.stdout)
    assert item["spec"]["driver"] == "gpu.example.com"
    assert [d["name"] for d in item["spec"]["devices"]] == ["gpu-0", "gpu-3"]
    assert "GPUs 1, 2, 4, 5, 6, 7 stay with the device plugin" in result.stderr


def test_a_gpu_the_node_does_not_have_is_an_error_naming_it(tmp_path: Path) -> None:
    config = tmp_path / "dra.yaml"
    config.write_text("version: v1\ndra:\n  enabled: true\n  gpus: [9]\n")
    result = exits(1, "plan", "--dra", "--node", "t4x4", "--config", str(config))
    assert "dra.gpus: 9 is not a GPU of this node" in result.stderr


@pytest.mark.parametrize(("version", "layout"), [("1.34", "combined"), ("1.36", "split")])
def test_the_kubernetes_version_picks_the_layout(version: str, layout: str) -> None:
    result = exits(0, "plan", "--dra", "--node", "t4x4", "--kubernetes-version", version)
    assert f"{layout} layout" in result.stdout.splitlines()[0]


def test_plan_without_dra_shows_only_what_the_device_plugin_keeps(tmp_path: Path) -> None:
    config = tmp_path / "dra.yaml"
    config.write_text("version: v1\ndra:\n  enabled: true\n  gpus: [0, 1]\n")
    result = exits(0, "plan", "--node", "dgx-a100", "--config", str(config), "--format", "json")
    assert json.loads(result.stdout)["resources"]["nvidia.com/gpu"]["count"] == 6
    assert "GPUs 0, 1 are served through DRA" in result.stderr


@pytest.mark.parametrize(
    ("dra", "code", "message"),
    [
        (
            "{enabled: true, gpus: [0], gpuShares: [1]}",
            1,
            "dra.gpuShares: GPU 1 is not served by DRA (add it to dra.gpus)",
        ),
        (
            "{enabled: true, dynamicMig: all, gpuShares: [0]}",
            1,
            "GPU 0 is in dra.dynamicMig: a GPU is split by MIG or shared",
        ),
        ("{enabled: true, gpuShares: all, defaultShare: 1500.5Mi}", 1, "'1500.5Mi' is not a whole number of MiB"),
        ("{enabled: true, consumableShares: 0}", 1, "dra.consumableShares: 0 is not a consumableShares value"),
        (
            "{enabled: true, gpuShares: all, defaultShare: true}",
            1,
            "dra.defaultShare: write a memory size such as 10Gi",
        ),
        ("{enabled: true, defaultShare: 10Gi}", 1, "defaultShare is set but gpuShares names no GPU to share"),
    ],
)
def test_a_share_config_that_cannot_work_is_an_error_naming_the_field(
    tmp_path: Path, dra: str, code: int, message: str
) -> None:
    config = tmp_path / "dra.yaml"
    config.write_text(f"version: v1\ndra: {dra}\n")
    result = exits(code, "plan", "--dra", "--node", "dgx-a100", "--config", str(config))
    assert message in result.stderr
