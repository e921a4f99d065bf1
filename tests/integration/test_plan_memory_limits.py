"""``tessera plan`` says, per sized resource, what would hold its containers to their size on the node: the driver
(r615+, a full GPU), the MPS server (a MIG device, or an older driver under MPS), or nothing (advisory)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.test_cli import tessera

CONFIG = """
version: v1
flags: {migStrategy: mixed}
sharing:
  timeSlicing:
    resources:
      - {name: nvidia.com/gpu, rename: nvidia.com/gpu-shared, replicas: 4, memoryLimit: 10Gi, memoryBurstLimit: 20Gi}
"""
MPS_ON_MIG = """
version: v1
flags: {migStrategy: mixed}
sharing:
  mps:
    resources:
      - {name: nvidia.com/gpu, rename: nvidia.com/gpu-20gb, replicas: 2, memoryLimit: 20Gi, devices: [0]}
      - {name: nvidia.com/mig-3g.40gb, replicas: 2}
"""


def node(tmp_path: Path, driver: str, *, mig: bool = False) -> str:
    gpus = '[{model: A100-SXM4-80GB}, {model: A100-SXM4-80GB, mig: {instances: ["3g.40gb", "3g.40gb"]}}]'
    spec = tmp_path / "node.yaml"
    spec.write_text(f"driver_version: '{driver}'\ngpus: {gpus if mig else '[{model: A100-SXM4-80GB, count: 2}]'}\n")
    return str(spec)


def plan(tmp_path: Path, config: str, spec: str, *extra: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(config)
    result = tessera("plan", "--node", spec, "--config", str(path), *extra)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize(
    ("driver", "said"),
    [
        (
            "615.71.09",
            "nvidia.com/gpu-shared: request 10240 MiB, limit 20480 MiB; driver: nvmlDeviceSetMemoryLimits_v1",
        ),
        (
            "580.95.05",
            "nvidia.com/gpu-shared: request 10240 MiB, limit 20480 MiB; advisory: driver 580.95.05 has no "
            "nvmlDeviceSetMemoryLimits_v1 (it needs r615 or newer); nothing holds a time-sliced replica",
        ),
    ],
)
def test_plan_says_what_would_hold_a_time_sliced_size(tmp_path: Path, driver: str, said: str) -> None:
    out = plan(tmp_path, CONFIG, node(tmp_path, driver))
    assert "10240 MiB of 81920, bursts to 20480" in out  # the table's memory column
    assert f"Memory limits (per container, each replica's size):\n  {said}" in out


def test_plan_json_names_the_enforcement_per_resource_mig_falls_back_to_mps(tmp_path: Path) -> None:
    document = json.loads(plan(tmp_path, MPS_ON_MIG, node(tmp_path, "615.71.09", mig=True), "--format", "json"))
    held = document["memory_limits"]
    assert held["nvidia.com/gpu-20gb"]["enforcement"] == "driver"
    assert held["nvidia.com/gpu-20gb"]["request_mib"] == held["nvidia.com/gpu-20gb"]["limit_mib"] == 20480
    assert held["nvidia.com/mig-3g.40gb"]["enforcement"] == "mps"
    assert "MIG devices have no per-cgroup limits" in held["nvidia.com/mig-3g.40gb"]["reason"]


def test_plan_without_sized_resources_says_nothing_of_limits(tmp_path: Path) -> None:
    config = "version: v1\nsharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 2}]}}\n"
    out = plan(tmp_path, config, node(tmp_path, "615.71.09"))
    assert "Memory limits" not in out
    assert "memory_limits" not in json.loads(plan(tmp_path, config, node(tmp_path, "615.71.09"), "--format", "json"))
