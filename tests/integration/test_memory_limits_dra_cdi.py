"""GPU memory the driver enforces for DRA claims, path (a): what the claim's CDI spec gives its containers.

The DRA world of ``test_dra_e2e`` on a node with driver r615, its driver root holding a stand-in of the toolkit's
hook binary (``agent.sim.driver_root``: it says its version and records its calls). A claim whose GPU has a memory
size — a share of a GPU shared by memory, or a whole GPU whose ``GpuConfig`` MPS settings pin its memory — gets
``NVIDIA_GPU_MEMORY_REQUEST`` / ``NVIDIA_GPU_MEMORY_LIMIT`` (whole MiB) in its CDI entry and, where the hook binary is
v1.20.1 or newer, the toolkit's ``apply-cuda-memory-limits`` createRuntime hook for its GPU; the memory-limits room
(path (b)) holds the same size once the container runs. Bad pinned limits are refused by name at Prepare, before
anything is done.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.memlimits.settings import MemoryLimitSettings
from agent.sim.driver_root import sim_driver_root
from agent.sim.kubelet.cgroups import ContainerFiles
from agent.sim.kubelet.dra_common import PodStartError
from agent.sim.scheduler import allocate

from . import test_dra_e2e, test_dra_shares
from .test_dra_e2e import DEADLINE, DRIVER, NODE, World, poll, start_agent
from .test_dra_shares import share_claim
from .test_dra_sharing import gpu_config

world = test_dra_e2e.world
shares = test_dra_shares.shares
GIB = 1 << 30
NEW = {"name": "ml-dra", "driver_version": "615.71.09", "gpus": [{"model": "A100-SXM4-80GB", "count": 2}]}
UUID_IS = "device.attributes['gpu.nvidia.com'].uuid == '{}'"


@pytest.fixture(params=["1.20.1"])
def toolkit(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def hooked(world: World, toolkit: str) -> tuple[ContainerFiles, Path]:
    """The agent restarted with memory limits on and a driver root whose hook binary is toolkit ``toolkit``."""
    files = ContainerFiles(world.base / "cg", world.base / "log")
    registered = len(world.dra.registration_events("registered", DRIVER))
    world.agent.stop()
    world.thread.join(timeout=20)
    settings = MemoryLimitSettings(files.cgroup_root, files.container_logs, 30.0)
    driver_root = sim_driver_root(world.base / "driver-hook", hook=True, toolkit=toolkit)
    world.agent, world.thread = start_agent(world.base, world.api, memory_limits=settings, driver_root=driver_root)
    world.kubelet.serve_dra(world.dra)
    world.dra.wait_for(
        lambda: len(world.dra.registration_events("registered", DRIVER)) > registered, DEADLINE, "registered again"
    )
    return files, driver_root.root


def entry(world: World, claim: dict) -> dict[str, Any]:
    """The claim's one device entry in its CDI spec (and the spec's version beside it)."""
    path = world.base / "cdi" / f"k8s.gpu.nvidia.com-claim_{claim['metadata']['uid']}.yaml"
    spec = yaml.safe_load(path.read_text())
    (device,) = spec["devices"]
    return {**device["containerEdits"], "cdiVersion": spec["cdiVersion"]}


def whole_gpu_claim(world: World, name: str, index: int, mps: dict) -> dict:
    """A claim for GPU ``index`` whole, with a ``GpuConfig`` of MPS settings ``mps``."""
    gpu = world.driver.gpus[index].uuid
    exactly = {"deviceClassName": DRIVER, "selectors": [{"cel": {"expression": UUID_IS.format(gpu)}}]}
    claim = world.api.create("resourceclaims", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {
            "requests": [{"name": "gpu", "exactly": exactly}],
            "config": [{"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": gpu_config(
                {"strategy": "MPS", "mpsConfig": mps})}}],
        }},
    })  # fmt: skip
    classes = {c["metadata"]["name"]: c for c in world.api.objects("deviceclasses")}
    return world.api.update("resourceclaims", allocate(claim, world.slices(), classes, set(), NODE), status=True)


def start(world: World, files: ContainerFiles, claim: str) -> Path:
    uid = str(uuid.uuid4())
    world.dra.run_pod("default", f"pod-{claim}", uid, [("gpu", claim)], {"main": [("gpu", None)]})
    return files.start("default", f"pod-{claim}", uid, "main").cgroup


@pytest.mark.parametrize("world", [NEW], indirect=True)
def test_a_shares_cdi_entry_carries_the_memory_variables_and_the_toolkits_hook_for_its_gpu(
    world: World, shares: Path, hooked: tuple[ContainerFiles, Path]
) -> None:
    files, root = hooked
    claim = share_claim(world, "small", memory="10Gi")
    cgroup = start(world, files, "small")
    edits = entry(world, claim)
    gpu = world.driver.gpus[0].uuid
    assert {"NVIDIA_GPU_MEMORY_REQUEST=10240", "NVIDIA_GPU_MEMORY_LIMIT=10240"} <= set(edits["env"])
    assert edits["hooks"] == [{
        "hookName": "createRuntime", "path": f"{root}/usr/bin/nvidia-cdi-hook",
        "args": ["nvidia-cdi-hook", "apply-cuda-memory-limits", "--driver-root", str(root), "--gpu-id", gpu],
    }]  # fmt: skip
    assert edits["cdiVersion"] == "0.5.0"  # hooks need nothing newer
    # path (b) holds the same size once the container runs
    poll(lambda: (0, str(cgroup)) in world.driver.memory_limit_table(), "the container limited")
    held = world.driver.memory_limit_table()[(0, str(cgroup))]
    assert (held.soft, held.hard) == (10 * GIB, 10 * GIB)


@pytest.mark.parametrize("toolkit", ["1.20.0"], indirect=True)
@pytest.mark.parametrize("world", [NEW], indirect=True)
def test_a_hook_binary_older_than_1_20_1_gets_the_variables_but_no_hook_it_does_not_have(
    world: World, shares: Path, hooked: tuple[ContainerFiles, Path]
) -> None:
    files, _ = hooked
    claim = share_claim(world, "small", memory="10Gi")
    start(world, files, "small")
    edits = entry(world, claim)
    assert "NVIDIA_GPU_MEMORY_LIMIT=10240" in edits["env"]
    assert not any("apply-cuda-memory-limits" in h["args"] for h in edits.get("hooks", []))


@pytest.mark.parametrize("world", [NEW], indirect=True)
def test_an_mps_claims_pinned_memory_limit_is_its_size_in_the_spec_and_through_the_driver(
    world: World, shares: Path, hooked: tuple[ContainerFiles, Path]
) -> None:
    files, _ = hooked
    claim = whole_gpu_claim(world, "pinned", 1, {
        "defaultPinnedDeviceMemoryLimit": "10Gi", "defaultPerDevicePinnedMemoryLimit": {"0": "12Gi"},
    })  # fmt: skip
    cgroup = start(world, files, "pinned")
    edits = entry(world, claim)
    gpu = world.driver.gpus[1].uuid
    assert {"NVIDIA_GPU_MEMORY_REQUEST=12288", "NVIDIA_GPU_MEMORY_LIMIT=12288"} <= set(edits["env"])
    assert f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={gpu}=12288M" in edits["env"]
    assert [h["args"][-1] for h in edits["hooks"] if "apply-cuda-memory-limits" in h["args"]] == [gpu]
    poll(lambda: (1, str(cgroup)) in world.driver.memory_limit_table(), "the container limited on GPU 1")
    assert world.driver.memory_limit_table()[(1, str(cgroup))].hard == 12 * GIB


@pytest.mark.parametrize(
    ("mps", "named"),
    [
        ({"defaultPinnedDeviceMemoryLimit": "100Gi"}, "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: 102400Mi"),
        ({"defaultPerDevicePinnedMemoryLimit": {"0": "81921Mi"}}, "defaultPerDevicePinnedMemoryLimit: 81921Mi"),
        ({"defaultPinnedDeviceMemoryLimit": "10GiB"}, "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit"),
    ],
)
@pytest.mark.parametrize("world", [NEW], indirect=True)
def test_a_pinned_limit_the_gpu_cannot_hold_is_refused_by_name_and_nothing_is_prepared(
    world: World, shares: Path, hooked: tuple[ContainerFiles, Path], mps: dict, named: str
) -> None:
    claim = whole_gpu_claim(world, "bad", 1, mps)
    with pytest.raises(PodStartError) as refused:
        world.dra.run_pod("default", "pod-bad", str(uuid.uuid4()), [("gpu", "bad")], {"main": [("gpu", None)]})
    assert named in str(refused.value)
    if "Mi" in named:  # above the GPU's memory: the device and what it has named too
        assert "device gpu-1" in str(refused.value) and "81920Mi of memory" in str(refused.value)
    else:
        assert "'10GiB' is not a quantity" in str(refused.value)
    assert not (world.base / "cdi" / f"k8s.gpu.nvidia.com-claim_{claim['metadata']['uid']}.yaml").exists()
    assert not any(k.startswith("dra/") for k in world.agent.status.mps)  # no MPS daemon started for it


@pytest.mark.parametrize("world", [NEW], indirect=True)
def test_with_memory_limits_off_a_shares_entry_has_neither_the_variables_nor_the_hook(
    world: World, shares: Path
) -> None:
    """``--memory-limits off`` (the world's agent runs without the room): neither path (a) nor (b)."""
    claim = share_claim(world, "small", memory="10Gi")
    world.dra.run_pod("default", "pod-small", str(uuid.uuid4()), [("gpu", "small")], {"main": [("gpu", None)]})
    edits = entry(world, claim)
    assert not any(e.startswith("NVIDIA_GPU_MEMORY_") for e in edits["env"])
    assert f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={world.driver.gpus[0].uuid}=10240M" in edits["env"]
