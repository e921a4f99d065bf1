"""GPU memory the driver enforces for DRA shares, path (b): a claim's ``memory`` share holds its container.

The DRA world of ``test_dra_e2e`` (the agent in process, both kubelet emulators, the API server stand-in, the
simulated scheduler) on a node with driver r615; GPU 0 shared by memory (``dra.gpuShares``). A pod's container using
a claim for a 10 GiB share starts (its cgroup and log link made as the kubelet and the runtime make them); the agent
finds it through PodResources' dynamic resources and holds its cgroup to 10 GiB on GPU 0 through the driver.
Without the driver the share is said to be advisory: only the client-side MPS variable holds it.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.memlimits.settings import MemoryLimitSettings
from agent.sim.kubelet.cgroups import ContainerFiles
from agent.sim.nvml.driver import OutOfMemory

from . import test_dra_e2e, test_dra_shares
from .test_dra_e2e import World, poll, start_agent

world = test_dra_e2e.world
shares = test_dra_shares.shares
GIB = 1 << 30
NEW = {"name": "ml-dra", "driver_version": "615.71.09", "gpus": [{"model": "A100-SXM4-80GB", "count": 2}]}
OLD = {"name": "ml-dra", "driver_version": "580.95.05", "gpus": [{"model": "A100-SXM4-80GB", "count": 2}]}


@pytest.fixture
def containers(world: World) -> ContainerFiles:
    """The agent restarted with memory limits on; the files a started container leaves (cgroup, log link)."""
    files = ContainerFiles(world.base / "cg", world.base / "log")
    world.agent.stop()
    world.thread.join(timeout=20)
    settings = MemoryLimitSettings(files.cgroup_root, files.container_logs, 30.0)
    world.agent, world.thread = start_agent(world.base, world.api, memory_limits=settings)
    world.kubelet.serve_dra(world.dra)  # PodResources lists the DRA pods' claims, per container
    return files


def run(world: World, files: ContainerFiles, claim: str, memory: str) -> tuple[str, Callable[[], list[dict]]]:
    """A pod whose container ``main`` uses a claim for a ``memory`` share of GPU 0, started; its cgroup, and the
    memory-limits report."""
    test_dra_shares.share_claim(world, claim, memory=memory)
    uid = str(uuid.uuid4())
    world.dra.run_pod("default", f"pod-{claim}", uid, [("gpu", claim)], {"main": [("gpu", None)]})
    started = files.start("default", f"pod-{claim}", uid, "main")

    def report() -> list[dict]:
        assert world.agent._memlimits is not None
        return world.agent._memlimits.report()["containers"]

    return str(started.cgroup), report


@pytest.mark.parametrize("world", [NEW], indirect=True)
def test_a_claims_share_holds_its_container_through_the_driver(
    world: World, containers: ContainerFiles, shares: Path
) -> None:
    cgroup, report = run(world, containers, "small", "10Gi")
    driver = world.driver

    def limit() -> tuple[int, int] | None:
        found = driver.memory_limit_table().get((0, cgroup))
        return None if found is None else (found.soft, found.hard)

    poll(lambda: limit() == (10 * GIB, 10 * GIB), "the claim's container held to 10 GiB on GPU 0")
    (row,) = report()
    assert (row["claim"], row["pod"], row["container"], row["enforcement"]) == (
        "default/small", "pod-small", "main", "driver",
    )  # fmt: skip
    driver.add_process(0, 5100, 8 * 1024, kind="mps_client", cgroup=cgroup)
    with pytest.raises(OutOfMemory):
        driver.allocate(5100, 3 * 1024)


@pytest.mark.parametrize("world", [OLD], indirect=True)
def test_without_the_driver_a_share_is_said_to_be_advisory(
    world: World, containers: ContainerFiles, shares: Path
) -> None:
    _, report = run(world, containers, "small", "10Gi")
    poll(lambda: report() and report()[0]["enforcement"] == "advisory", "the share reported advisory")
    (row,) = report()
    assert "r615" in row["reason"] and "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" in row["reason"]
    assert row["limit_bytes"] == 10 * GIB and world.driver.memory_limit_table() == {}
