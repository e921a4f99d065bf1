"""`tessera demo` shows GPU memory the driver enforces: two pods on the time-sliced GPU held to 10 GiB and 20 GiB
(one and two replicas of 10 GiB) by the simulated r615 driver, and a third whose process asks for more than its
limit and gets CUDA's out-of-memory error; on a node whose driver cannot, the demo says nothing holds it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.integration.test_demo_story import _demo


@pytest.fixture(scope="module")
def default_run() -> subprocess.CompletedProcess[str]:
    return _demo()


def _step(out: str, n: int) -> str:
    return out[out.index(f"[{n}/5]") : out.index(f"[{n + 1}/5]")]


def test_two_pods_on_one_gpu_are_held_to_10_and_20_gib_by_the_driver(default_run) -> None:
    step = _step(default_run.stdout, 3)
    assert "each replica of nvidia.com/gpu.shared is 10 GiB (the config's memoryLimit)" in step
    held = dict(re.findall(r"pod (\S+) +held to (\d+ GiB on GPU \d) by the driver", step))
    assert held == {"shared-a": "10 GiB on GPU 3", "shared-b": "10 GiB on GPU 3", "shared-big": "20 GiB on GPU 3"}


def test_a_process_asking_above_its_limit_gets_cudas_out_of_memory_error(default_run) -> None:
    step = _step(default_run.stdout, 3)
    assert "pod shared-b   its process asks for 12 GiB -> the allocation fails:" in step
    error = re.search(r"CUDA_ERROR_OUT_OF_MEMORY: process \d+ in (\S+) asked for 12288 MiB on GPU 3; (.*)", step)
    assert error is not None, step
    assert error[1].startswith("/sys/fs/cgroup/kubepods.slice/") and error[1].endswith(".scope")
    assert error[2] == "its cgroup's hard limit leaves 10240 MiB"


def test_on_a_driver_without_limits_the_demo_says_nothing_holds_them(tmp_path: Path) -> None:
    spec = tmp_path / "old.yaml"
    spec.write_text("driver_version: '580.95.05'\ngpus: [{model: A100-SXM4-80GB, count: 2}]\n")
    step = _step(_demo("--node", str(spec)).stdout, 3)
    assert (
        "pod shared-big held to 20 GiB on GPU 1 only advisory: the driver has no nvmlDeviceSetMemoryLimits_v1" in step
    )
    assert "its process asks for 12 GiB -> succeeds: nothing holds it" in step
