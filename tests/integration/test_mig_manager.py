"""The MIG layout manager inside a running agent: drain, wait for the pod, reconfigure, advertise.

In-process agent on a simulated A100 with 7x 1g.10gb, the kubelet emulator serving PodResources; the
layout comes from the sharing config (Tessera's ``migLayout`` extension) and the node label.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
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
MIXED = "version: v1\nflags: {migStrategy: mixed}\n"  # no layout: MIG is left as it is
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
def running_node(driver: SimDriver, config: str = CONFIG, **options: object) -> Iterator[Node]:
    """The agent (in a thread) and the kubelet emulator on the simulated node, with the layouts config."""
    base = Path(tempfile.mkdtemp(prefix="g", dir="/tmp"))
    (base / "config.yaml").write_text(config)
    kubelet = KubeletEmulator(base / "dp", base / "pr" / "kubelet.sock")
    kubelet.start()
    agent = Agent(
        AgentOptions(
            device_plugin_dir=base / "dp",
            pod_resources_socket=base / "pr" / "kubelet.sock",
            config_path=base / "config.yaml",
            **options,  # type: ignore[arg-type]
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


def test_a_compute_instance_that_fails_takes_its_gpu_instance_with_it_and_the_retry_converges(node: Node) -> None:
    """A GPU instance without its compute instance is no MIG device: the inventory does not see it, and left behind it
    would hold its placement against every retry."""
    kubelet, agent = node.kubelet, node.agent
    node.driver.inject_error("nvmlGpuInstanceCreateComputeInstance", Return.ERROR_UNKNOWN, times=1)
    agent.post(NodeLabelChanged(MIG_CONFIG_LABEL, "all-3g.40gb"))
    kubelet.wait_for(lambda: agent.status.mig_state == "failed", 10, "failed")
    assert "its compute instance" in (agent.status.mig_error or "")
    kubelet.wait_for(lambda: agent.status.mig_state == "success", 15, "the retry converged")
    kubelet.wait_for(lambda: kubelet.allocatable(LARGE) == 2 if LARGE in kubelet.resources() else False, 10, "3g")


def test_a_gpu_instance_left_without_its_compute_instance_does_not_block_the_layout(sim_node) -> None:
    """A creation cut short whose undo failed too leaves a GPU instance with no compute instance: no inventory lists
    it, yet it holds its placement. The manager destroys such instances before it creates."""
    driver = sim_node({"gpus": [{"model": "A100-SXM4-80GB", "mig": {"instances": []}}]})
    driver.create_gpu_instance(0, 9, (4, 4))  # a 3g.40gb GPU instance, no compute instance in it
    with running_node(driver, CONFIG.replace("config: all-1g.10gb", "config: all-3g.40gb")) as running:
        kubelet, agent = running.kubelet, running.agent
        kubelet.wait_for(lambda: agent.status.mig_state == "success", 15, "the layout made over it")
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


# ----- MIG changes no event announces ----------------------------------------------------------------------------


def test_a_gpu_reset_by_hand_is_noticed_and_the_layout_is_made_again(sim_node) -> None:
    """``nvidia-smi -r`` destroys every MIG device and sends no event: the slow re-check notices, the vanished
    devices leave the kubelet and the layout the config wants is made again (nothing runs there)."""
    driver = sim_node("a100-mig")
    with running_node(driver, liveness_probe_seconds=0.1) as running:
        kubelet, agent = running.kubelet, running.agent
        kubelet.wait_for(lambda: SMALL in kubelet.resources() and kubelet.allocatable(SMALL) == 7, 10, "1g")
        before = _mig_uuids(driver)
        assert set(kubelet.devices(SMALL)) == before
        driver.reset_gpu(0)  # by hand, behind the agent's back
        assert not _mig_uuids(driver)
        kubelet.wait_for(
            lambda: len(made := _mig_uuids(driver)) == 7 and set(kubelet.devices(SMALL)) == made,
            10,
            "the layout made again and its new devices advertised",
        )
        assert not _mig_uuids(driver) & before  # new MIG devices, new UUIDs
        assert agent.status.mig_state == "success"


def test_a_gpu_reset_by_hand_while_a_change_waits_for_a_pod_lets_the_change_go_on(sim_node) -> None:
    """The pod's MIG device went with the reset: nothing is left to wait for, the new layout is made at once
    (making instances on an empty GPU destroys nothing), not when the pod ends."""
    driver = sim_node("a100-mig")
    with running_node(driver, liveness_probe_seconds=0.1) as running:
        kubelet, agent = running.kubelet, running.agent
        kubelet.wait_for(lambda: SMALL in kubelet.resources() and kubelet.allocatable(SMALL) == 7, 10, "1g")
        pod = kubelet.create_pod("holder", {"main": {SMALL: 1}})
        (held,) = pod.containers["main"][SMALL].device_ids
        agent.post(NodeLabelChanged(MIG_CONFIG_LABEL, "all-3g.40gb"))
        held_by = f"{held} held by default/holder"
        kubelet.wait_for(lambda: any(held_by in r for r in agent.status.waiting_for.get("mig", ())), 10, "pod found")
        driver.reset_gpu(0)  # by hand: the held device is gone with the others
        kubelet.wait_for(lambda: agent.status.mig_state == "success", 10, "applied without waiting for the pod")
        kubelet.wait_for(lambda: LARGE in kubelet.resources() and kubelet.allocatable(LARGE) == 2, 10, "3g")
        assert sorted(gi.profile.name for gi in driver.gpus[0].gis.values()) == ["3g.40gb", "3g.40gb"]
        assert "holder" in [p.name for p in kubelet.pods()]  # the pod was never the agent's to end


def test_a_mig_device_the_inventory_leaves_out_is_not_read_again_and_again(
    sim_node, caplog: pytest.LogCaptureFixture
) -> None:
    """A MIG device of a profile the installed nvidia-ml-py cannot describe is never in the inventory: the re-check
    reads the node once for it, not at every pass."""
    driver = sim_node({"gpus": [{"model": "A100-SXM4-80GB", "mig": {"instances": ["1g.10gb", "3g.40gb"]}}]})
    large = next(gi for gi, _ in driver.gpus[0].mig_devices() if gi.profile.name == "3g.40gb")
    # Not 1g's: discovery says each warning once per process, and test_workload_safety waits for the 1g one.
    driver.hide_gi_profile(large.profile.index)
    caplog.set_level(logging.INFO, logger="agent.agent")
    changed = "MIG devices differ from the inventory"
    with running_node(driver, MIXED, liveness_probe_seconds=0.02) as running:
        kubelet = running.kubelet
        kubelet.wait_for(lambda: SMALL in kubelet.resources() and kubelet.allocatable(SMALL) == 1, 10, "1g")
        kubelet.wait_for(lambda: _said(caplog, changed), 5, "the first re-check read the node again")
        deadline = time.monotonic() + 1.0  # some 50 re-checks
        while time.monotonic() < deadline:
            assert len(_said(caplog, changed)) == 1, _said(caplog, changed)
            threading.Event().wait(0.02)
        assert LARGE not in kubelet.resources()


def _said(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "agent.agent" and text in r.getMessage()]


def test_a_mig_device_made_by_hand_is_advertised_by_the_next_re_check(sim_node) -> None:
    """``nvidia-smi mig -cgi 19 -C`` on a node with no layout configured: the device is offered without a restart."""
    driver = sim_node({"gpus": [{"model": "A100-SXM4-80GB", "mig": {"instances": ["3g.40gb"]}}]})
    with running_node(driver, MIXED, liveness_probe_seconds=0.1) as running:
        kubelet = running.kubelet
        kubelet.wait_for(lambda: LARGE in kubelet.resources() and kubelet.allocatable(LARGE) == 1, 10, "3g")
        assert SMALL not in kubelet.resources()
        instance = driver.create_gpu_instance(0, 19, (0, 1))  # by hand, in the free half
        driver.create_compute_instance(0, instance, 0)
        made = {ci.uuid for gi, ci in driver.gpus[0].mig_devices() if gi.id == instance.id}
        kubelet.wait_for(lambda: SMALL in kubelet.resources() and set(kubelet.devices(SMALL)) == made, 10, "1g")
        assert kubelet.allocatable(LARGE) == 1


TWO_3G = {"gpus": [{"model": "A100-SXM4-80GB", "count": 2, "mig": {"instances": ["3g.40gb"]}}]}


@pytest.fixture
def two_3g(sim_node) -> Iterator[Node]:
    """Two A100s with a 3g.40gb each, the mixed strategy and no layout; the slow re-check every 0.1 s."""
    with running_node(sim_node(TWO_3G), MIXED, liveness_probe_seconds=0.1) as running:
        kubelet = running.kubelet
        kubelet.wait_for(lambda: LARGE in kubelet.resources() and kubelet.allocatable(LARGE) == 2, 10, "2x 3g")
        yield running


def _read_again_for_a_device_made_by_hand(node: Node, gpu: int = 1) -> None:
    """A 1g.10gb made by hand on ``gpu``; returns once the re-check read the node again and offers it."""
    instance = node.driver.create_gpu_instance(gpu, 19, (0, 1))
    node.driver.create_compute_instance(gpu, instance, 0)
    node.kubelet.wait_for(lambda: SMALL in node.kubelet.resources(), 10, "the node read again, the new device offered")


def _only_mig_device(driver: SimDriver, gpu: int) -> str:
    (uuid,) = {ci.uuid for _, ci in driver.gpus[gpu].mig_devices()}
    return uuid


def test_a_lost_gpu_stays_at_the_kubelet_unhealthy_when_the_node_is_read_again(two_3g: Node) -> None:
    """A GPU off the bus still counts in NVML. A read of the node while it is gone (here for a MIG device made by
    hand on the other GPU) keeps its devices at the kubelet, Unhealthy, instead of dropping them as if it had left."""
    driver, kubelet = two_3g.driver, two_3g.kubelet
    lost, other = _only_mig_device(driver, 0), _only_mig_device(driver, 1)
    driver.lose_gpu(0)
    kubelet.wait_for(lambda: kubelet.devices(LARGE).get(lost) == "Unhealthy", 10, "the lost GPU's device")
    _read_again_for_a_device_made_by_hand(two_3g)
    assert kubelet.devices(LARGE) == {lost: "Unhealthy", other: "Healthy"}
    assert two_3g.agent.status.faults[driver.gpus[0].uuid].lost


def test_a_gpu_that_errs_while_the_node_is_read_again_is_withdrawn_until_it_answers(two_3g: Node) -> None:
    """Its last description is kept, but nothing is advertised from it while NVML cannot confirm it."""
    driver, kubelet = two_3g.driver, two_3g.kubelet
    erring, other = _only_mig_device(driver, 0), _only_mig_device(driver, 1)
    driver.inject_error("nvmlDeviceGetCudaComputeCapability", Return.ERROR_UNKNOWN, times=None, gpu_index=0)
    _read_again_for_a_device_made_by_hand(two_3g)
    assert kubelet.devices(LARGE) == {other: "Healthy"}
    driver.clear_injected_errors()
    kubelet.wait_for(lambda: kubelet.devices(LARGE) == {erring: "Healthy", other: "Healthy"}, 10, "back")


def test_a_gpu_whose_mig_devices_cannot_be_listed_does_not_stop_the_re_check_of_the_others(two_3g: Node) -> None:
    two_3g.driver.inject_error("nvmlDeviceGetMigDeviceHandleByIndex", Return.ERROR_UNKNOWN, times=None, gpu_index=1)
    _read_again_for_a_device_made_by_hand(two_3g, gpu=0)
    assert not two_3g.agent.status.internal_errors
