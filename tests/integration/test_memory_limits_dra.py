"""GPU memory the driver enforces for DRA shares, path (b): a claim's ``memory`` share holds its container.

The DRA world of ``test_dra_e2e`` (the agent in process, both kubelet emulators, the API server stand-in, the
simulated scheduler) on a node with driver r615; GPU 0 shared by memory (``dra.gpuShares``). A pod's container using
a claim for a 10 GiB share starts (its cgroup and log link made as the kubelet and the runtime make them); the agent
finds it through PodResources' dynamic resources and holds its cgroup to 10 GiB on GPU 0 through the driver.
Without the driver the share is said to be advisory: only the client-side MPS variable holds it.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.memlimits.settings import MemoryLimitSettings
from agent.sim.kubelet.cgroups import ContainerFiles
from agent.sim.nvml.driver import OutOfMemory
from agent.status_report import render_text, status_document

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
    # the room's report follows its look (the limit is set in the driver first, the row shown when the look ends)
    poll(lambda: len(report()) == 1, "the container's row in the memory-limits report")
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


def status_text(world: World) -> str:
    return render_text(status_document(world.agent.status, version="t"))


def advisory_events(caplog: pytest.LogCaptureFixture, claim: str) -> list[str]:
    return [
        r.getMessage() for r in caplog.records
        if "reason=ShareLimitAdvisory" in r.getMessage() and f"ResourceClaim/default/{claim}" in r.getMessage()
    ]  # fmt: skip


@pytest.mark.parametrize("world", [NEW], indirect=True)
def test_unequal_shares_are_each_held_to_their_own_share_by_the_driver_and_status_says_so(
    world: World, containers: ContainerFiles, shares: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The MPS server can hold only the larger of two unequal shares; with driver r615 the driver holds each
    container to its own, whatever variables the client has: no share is advisory, no Warning on either claim."""
    caplog.set_level(logging.INFO, logger="agent.events")  # the stand-in API server serves no Events: they are logged
    small, _ = run(world, containers, "small", "10Gi")
    large, _ = run(world, containers, "large", "20Gi")
    text = poll_status(world, "memory 10240Mi held by the driver", "memory 20480Mi held by the driver")
    assert "advisory" not in text.split("claim default/small", 1)[1].split("\n")[0]
    driver = world.driver
    poll(lambda: {(0, small), (0, large)} <= driver.memory_limit_table().keys(), "both containers limited")
    # a client of each, in its container's cgroup, with no CUDA_MPS_* variables: held to its own share
    driver.add_process(0, 5200, 10 * 1024, kind="mps_client", cgroup=small)
    driver.add_process(0, 5201, 20 * 1024, kind="mps_client", cgroup=large)
    for pid in (5200, 5201):
        with pytest.raises(OutOfMemory):
            driver.allocate(pid, 1)
    assert advisory_events(caplog, "small") == [] and advisory_events(caplog, "large") == []


@pytest.mark.parametrize("world", [OLD], indirect=True)
def test_unequal_shares_without_the_driver_call_stay_advisory_with_the_claims_event(
    world: World, containers: ContainerFiles, shares: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="agent.events")
    run(world, containers, "small", "10Gi")
    run(world, containers, "large", "20Gi")
    text = poll_status(world, "memory 10240Mi advisory: the MPS server holds 20480Mi")
    assert "held by the driver" not in text
    poll(lambda: advisory_events(caplog, "small"), "a Warning Event on the small claim")


@pytest.mark.parametrize("world", [NEW], indirect=True)
def test_when_the_driver_path_falls_back_the_share_turns_advisory_with_the_claims_event(
    world: World, containers: ContainerFiles, shares: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """r615, but the agent may not set limits (not root): said as soon as the driver refuses."""
    caplog.set_level(logging.INFO, logger="agent.events")
    world.driver.set_caller_root(False)
    run(world, containers, "large", "20Gi")
    run(world, containers, "small", "10Gi")
    poll_status(world, "memory 10240Mi advisory: the MPS server holds 20480Mi")
    event = poll(lambda: advisory_events(caplog, "small"), "a Warning Event on the small claim")
    assert "type=Warning" in event[-1]


def poll_status(world: World, *texts: str) -> str:
    def saying() -> str | None:
        text = status_text(world)
        return text if all(t in text for t in texts) else None

    return poll(saying, f"status: {'; '.join(texts)}")  # type: ignore[return-value]


@pytest.mark.parametrize("world", [NEW], indirect=True)
def test_after_an_agent_restart_the_driver_held_shares_are_never_said_advisory(
    world: World, containers: ContainerFiles, shares: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The driver is asked before the first status: a restarted agent does not announce the smaller share as
    advisory for the moment before its first look."""
    small, _ = run(world, containers, "small", "10Gi")
    run(world, containers, "large", "20Gi")
    poll_status(world, "memory 10240Mi held by the driver", "memory 20480Mi held by the driver")
    caplog.set_level(logging.INFO, logger="agent.events")
    caplog.clear()
    world.agent.stop()
    world.thread.join(timeout=20)
    settings = MemoryLimitSettings(containers.cgroup_root, containers.container_logs, 30.0)
    world.agent, world.thread = start_agent(world.base, world.api, memory_limits=settings)
    assert "memory 10240Mi held by the driver" in status_text(world)  # the first status already
    poll(lambda: any("ConfigApplied" in r.getMessage() for r in caplog.records), "the restarted agent's Events")
    assert advisory_events(caplog, "small") == []
    assert world.driver.memory_limit_table()[(0, small)].hard == 10 * GIB  # found in place and kept
