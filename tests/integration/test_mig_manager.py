"""The MIG layout manager inside a running agent: drain, wait for the pod, reconfigure, advertise.

In-process agent on a simulated A100 with 7x 1g.10gb, the kubelet emulator serving PodResources; the
layout comes from the sharing config (Tessera's ``migLayout`` extension) and the node label.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.agent import Agent, AgentOptions
from agent.config.labels import MIG_CONFIG_LABEL, NodeLabelChanged
from agent.sim.kubelet import KubeletEmulator
from agent.sim.nvml.codes import Return
from agent.sim.nvml.driver import SimDriver

SMALL = "nvidia.com/mig-1g.10gb"
LARGE = "nvidia.com/mig-3g.40gb"
CONFIG = """
version: v1
flags: {migStrategy: mixed}
migLayout:
  config: all-1g.10gb
  layouts:
    version: v1
    mig-configs:
      all-1g.10gb:
        - devices: all
          mig-enabled: true
          mig-devices: {1g.10gb: 7}
      all-3g.40gb:
        - devices: all
          mig-enabled: true
          mig-devices: {3g.40gb: 2}
"""


@dataclass
class Node:
    driver: SimDriver
    kubelet: KubeletEmulator
    agent: Agent


@contextmanager
def running_node(driver: SimDriver) -> Iterator[Node]:
    """The agent (in a thread) and the kubelet emulator on the simulated node, with the layouts config."""
    base = Path(tempfile.mkdtemp(prefix="g", dir="/tmp"))
    (base / "config.yaml").write_text(CONFIG)
    kubelet = KubeletEmulator(base / "dp", base / "pr" / "kubelet.sock")
    kubelet.start()
    agent = Agent(
        AgentOptions(
            device_plugin_dir=base / "dp",
            pod_resources_socket=base / "pr" / "kubelet.sock",
            config_path=base / "config.yaml",
        )
    )
    thread = threading.Thread(target=agent.run, name="agent-under-test")
    thread.start()
    try:
        assert agent.started.wait(20)
        yield Node(driver, kubelet, agent)
    finally:
        agent.stop()
        thread.join(timeout=20)
        kubelet.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def node(sim_node) -> Iterator[Node]:
    with running_node(sim_node("a100-mig")) as running:
        kubelet = running.kubelet
        kubelet.wait_for(lambda: kubelet.allocatable(SMALL) == 7 if SMALL in kubelet.resources() else False, 10, "1g")
        yield running


def _mig_uuids(driver: SimDriver) -> set[str]:
    return {ci.uuid for _, ci in driver.gpus[0].mig_devices()}


def test_a_held_device_is_never_destroyed_and_the_change_follows_the_pod(node: Node) -> None:
    kubelet, agent = node.kubelet, node.agent
    assert agent.status.mig_state == "success"
    pod = kubelet.create_pod("holder", {"main": {SMALL: 1}})
    (held,) = pod.containers["main"][SMALL].device_ids

    agent.post(NodeLabelChanged(MIG_CONFIG_LABEL, "all-3g.40gb"))
    kubelet.wait_for(lambda: agent.status.mig_state == "pending", 5, "pending")
    kubelet.wait_for(lambda: SMALL not in kubelet.resources() or kubelet.stopped(SMALL), 5, "1g drained")
    # Wait for the manager's own word that it checked and found the pod (not for a state that is already true).
    held_by = f"{held} held by default/holder"
    kubelet.wait_for(lambda: any(held_by in r for r in agent.status.waiting_for.get("mig", ())), 10, "pod found")
    assert held in _mig_uuids(node.driver)  # the pod's device is still there
    assert agent.status.mig_state == "pending"
    assert not [c for c in node.driver.destructive_calls if c.target == held]

    kubelet.delete_pod("holder")
    kubelet.wait_for(lambda: agent.status.mig_state == "success", 10, "applied after the pod ended")
    kubelet.wait_for(lambda: LARGE in kubelet.resources() and kubelet.allocatable(LARGE) == 2, 10, "3g advertised")
    assert held not in _mig_uuids(node.driver)
    assert sorted(gi.profile.name for gi in node.driver.gpus[0].gis.values()) == ["3g.40gb", "3g.40gb"]


def test_an_nvml_failure_midway_is_reported_and_the_next_attempt_converges(node: Node) -> None:
    kubelet, agent = node.kubelet, node.agent
    node.driver.inject_error("nvmlDeviceCreateGpuInstanceWithPlacement", Return.ERROR_UNKNOWN, times=1)
    agent.post(NodeLabelChanged(MIG_CONFIG_LABEL, "all-3g.40gb"))
    kubelet.wait_for(lambda: agent.status.mig_state == "failed", 10, "failed")
    assert "NVML_ERROR_UNKNOWN" in (agent.status.mig_error or "")
    kubelet.wait_for(lambda: agent.status.mig_state == "success", 15, "the retry converged")
    kubelet.wait_for(lambda: kubelet.allocatable(LARGE) == 2 if LARGE in kubelet.resources() else False, 10, "3g")


def test_an_unknown_layout_name_changes_nothing(node: Node) -> None:
    kubelet, agent = node.kubelet, node.agent
    before = _mig_uuids(node.driver)
    agent.post(NodeLabelChanged(MIG_CONFIG_LABEL, "all-7g.80gb"))
    kubelet.wait_for(lambda: agent.status.mig_state == "failed", 5, "failed")
    assert "all-7g.80gb" in (agent.status.mig_error or "")
    assert _mig_uuids(node.driver) == before
    assert kubelet.allocatable(SMALL) == 7


def test_a_mode_change_waits_for_a_reset_then_completes(sim_node) -> None:
    driver = sim_node({"gpus": [{"model": "A100-SXM4-80GB", "mig_needs_reset": True}]})
    with running_node(driver) as running:
        kubelet, agent = running.kubelet, running.agent
        kubelet.wait_for(lambda: agent.status.mig_state == "reset-required", 10, "reset-required")
        assert "GPU(s) 0 need a reset" in (agent.status.mig_error or "")
        assert driver.gpus[0].mig_pending and not driver.gpus[0].mig_current
        driver.reset_gpu(0)  # what an operator (or an allowed reset) does
        kubelet.wait_for(lambda: agent.status.mig_state == "success", 15, "applied after the reset")
        kubelet.wait_for(lambda: kubelet.allocatable(SMALL) == 7 if SMALL in kubelet.resources() else False, 10, "1g")
