"""Path (a) of the driver's per-container memory limits in CDI specs: the variables, the toolkit's hook, and how the
agent tells whether the node's hook binary has it (``<hook> --version``, asked once per binary file)."""

from __future__ import annotations

import os
from pathlib import Path

from agent.core.cdi_edits import (
    DriverFiles,
    Hook,
    device_plugin_spec,
    memory_limit_edits,
    memory_limits_hook,
)
from agent.core.dra.cdi import DeviceNode
from agent.gpu.driver_root import DriverRoot, HookVersions, discover_driver
from agent.sim.driver_root import make_driver_root

GPU = "GPU-2b4ba2a0-36ab-4a08-9d2b-1a3e8a6f0c11"
MIG = "MIG-9a1c7f7e-3b9b-5d7e-8a49-0f2b1c2d3e4f"


def files(path: str = "/usr/bin/nvidia-ctk", new_enough: bool = True) -> DriverFiles:
    return DriverFiles("615.71.09", hook=Hook(path), driver_root="/run/nvidia/driver", memory_limits_hook=new_enough)


def test_the_hook_is_the_toolkits_own_one_per_gpu_in_both_binary_forms() -> None:
    assert memory_limits_hook(files(), GPU) == {
        "hookName": "createRuntime", "path": "/usr/bin/nvidia-ctk",
        "args": ["nvidia-ctk", "hook", "apply-cuda-memory-limits", "--driver-root", "/run/nvidia/driver",
                 "--gpu-id", GPU],
    }  # fmt: skip
    cdi_hook = memory_limits_hook(files("/usr/bin/nvidia-cdi-hook"), GPU)
    assert cdi_hook is not None and cdi_hook["args"][:2] == ["nvidia-cdi-hook", "apply-cuda-memory-limits"]


def test_no_hook_for_a_mig_device_an_old_toolkit_or_no_binary() -> None:
    assert memory_limits_hook(files(), MIG) is None
    assert memory_limits_hook(files(new_enough=False), GPU) is None
    assert memory_limits_hook(DriverFiles("615.71.09"), GPU) is None
    assert memory_limit_edits(files(new_enough=False), GPU, 10240) == {
        "env": ["NVIDIA_GPU_MEMORY_REQUEST=10240", "NVIDIA_GPU_MEMORY_LIMIT=10240"]
    }


def test_the_device_plugins_spec_runs_the_hook_for_each_gpu_entry_not_for_mig_entries() -> None:
    nodes = {GPU: [DeviceNode("/dev/nvidia0")], MIG: [DeviceNode("/dev/nvidia1")]}
    spec = device_plugin_spec("k8s.device-plugin.nvidia.com/gpu", nodes, {}, files())
    by_name = {d["name"]: d["containerEdits"] for d in spec["devices"]}
    assert [h["args"][-1] for h in by_name[GPU]["hooks"]] == [GPU]
    assert "hooks" not in by_name[MIG] and spec["cdiVersion"] == "0.5.0"
    assert (
        "hooks" not in device_plugin_spec("k8s.device-plugin.nvidia.com/gpu", nodes, {})["devices"][0]["containerEdits"]
    )


def test_the_binary_is_asked_its_version_once_and_again_when_it_changes(tmp_path: Path) -> None:
    asked: list[str] = []
    output = {"text": "NVIDIA CDI Hook version 1.20.1\ncommit: x\n"}

    def run(path: str) -> str:
        asked.append(path)
        return output["text"]

    versions = HookVersions(run)
    root = make_driver_root(tmp_path / "driver", [0], hook=True)
    for _ in range(3):
        found = discover_driver(DriverRoot(root), hook_versions=versions)
    assert found.memory_limits_hook and found.driver_root == str(root) and len(asked) == 1
    binary = root / "usr/bin/nvidia-cdi-hook"
    output["text"] = "NVIDIA Container Toolkit CLI version 1.19.0\n"  # downgraded: a different file
    binary.write_text(binary.read_text() + "# other\n")
    os.utime(binary, ns=(1, 1))
    assert not discover_driver(DriverRoot(root), hook_versions=versions).memory_limits_hook and len(asked) == 2


def test_the_stand_in_hook_binary_says_its_version_as_the_toolkit_does(tmp_path: Path) -> None:
    old = make_driver_root(tmp_path / "old", [0], hook=True, toolkit="1.20.0")
    new = make_driver_root(tmp_path / "new", [0], hook=True)
    assert not discover_driver(DriverRoot(old)).memory_limits_hook
    assert discover_driver(DriverRoot(new)).memory_limits_hook
    assert not discover_driver(DriverRoot(make_driver_root(tmp_path / "none", [0]))).memory_limits_hook
