"""Nothing destructive under a workload, and a truthful inventory, inside a running agent.

The agent runs in-process on a simulated node with the kubelet emulator (device plugin and PodResources);
MPS through the MPS control emulator. Every disruptive step — a MIG mode change, destroying an instance,
quitting an MPS daemon — must first withdraw the devices it touches, then wait until no pod holds them and
NVML shows no process there; unknown counts as busy. The simulator's call log tells whether a destructive
NVML call ever ran while something was there.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest

from agent.config.effective import FlagOverrides
from agent.config.labels import MIG_CONFIG_LABEL, NodeLabelChanged
from agent.core.health import HealthPolicy
from agent.sim.nvml.codes import Return
from agent.sim.nvml.driver import SimDriver
from tests.agent_node import running_node

GPU = "nvidia.com/gpu"
SMALL = "nvidia.com/mig-1g.10gb"
LAYOUTS = """
migLayout:
  config: {initial}
  layouts:
    version: v1
    mig-configs:
      all-disabled:
        - devices: all
          mig-enabled: false
      all-1g.10gb:
        - devices: all
          mig-enabled: true
          mig-devices: {{1g.10gb: 7}}
"""
PLAIN_A100 = {"name": "safety", "gpus": [{"model": "A100-SXM4-80GB"}]}


def _mig_config(initial: str, sharing: str = "") -> str:
    return "version: v1\nflags: {migStrategy: mixed}\n" + sharing + LAYOUTS.format(initial=initial)


def _destructive_under_load(driver: SimDriver) -> list[object]:
    return [call for call in driver.destructive_calls if call.processes]


TIME_SLICED = """
sharing:
  timeSlicing:
    resources:
      - name: nvidia.com/gpu
        replicas: 4
"""


@pytest.mark.parametrize("sharing", ["", TIME_SLICED], ids=["whole-gpu", "time-sliced-replica"])
def test_mig_mode_never_changes_under_a_pod_that_holds_the_gpu(sim_node, sharing: str) -> None:
    driver = sim_node(PLAIN_A100)
    with running_node(driver, _mig_config("all-disabled", sharing)) as node:
        kubelet, agent = node.kubelet, node.agent
        node.wait(lambda: agent.status.mig_state == "success" and kubelet.allocatable(GPU) >= 1, "GPU served")
        pod = kubelet.create_pod("holder", {"main": {GPU: 1}})
        (held,) = pod.containers["main"][GPU].device_ids

        agent.post(NodeLabelChanged(MIG_CONFIG_LABEL, "all-1g.10gb"))
        node.wait(lambda: "held by default/holder" in node.waiting_for("mig"), "the change waits for the pod")
        assert held.split("::")[0] == driver.gpus[0].uuid
        assert not driver.gpus[0].mig_current and not driver.gpus[0].mig_pending, "MIG changed under the pod"
        assert not node.healthy_ids(GPU), "the GPU is still offered to new pods while it is being drained"
        assert agent.status.mig_state == "pending"

        kubelet.delete_pod("holder")
        node.wait(lambda: agent.status.mig_state == "success", "applied once the pod is gone")
        node.wait(lambda: len(node.healthy_ids(SMALL)) == 7, "7 x 1g.10gb advertised")
        assert driver.gpus[0].mig_current
        assert not _destructive_under_load(driver)


def test_mig_mode_never_changes_under_a_running_process_or_an_unknown_one(sim_node) -> None:
    driver = sim_node(PLAIN_A100)
    with running_node(driver, _mig_config("all-disabled")) as node:
        agent = node.agent
        node.wait(lambda: agent.status.mig_state == "success", "MIG off in place")
        driver.add_process(0, 4242, 2048)  # a process no pod accounts for (e.g. a host job)
        agent.post(NodeLabelChanged(MIG_CONFIG_LABEL, "all-1g.10gb"))
        node.wait(lambda: "runs 1 process(es) (pid 4242)" in node.waiting_for("mig"), "waits for the process")
        assert not driver.gpus[0].mig_pending

        # NVML refuses the process list: unknown is busy, the change still waits.
        driver.inject_error("nvmlDeviceGetComputeRunningProcesses_v3", Return.ERROR_NO_PERMISSION, times=None)
        driver.remove_process(4242)
        node.wait(lambda: "NO_PERMISSION" in node.waiting_for("mig"), "waits while processes cannot be listed")
        assert not driver.gpus[0].mig_pending

        driver.clear_injected_errors()
        node.wait(lambda: agent.status.mig_state == "success", "applied once NVML shows the GPU free")
        node.wait(lambda: len(node.healthy_ids(SMALL)) == 7, "7 x 1g.10gb advertised")
        assert not _destructive_under_load(driver)


def test_a_held_mig_device_is_never_destroyed(sim_node) -> None:
    driver = sim_node("a100-mig")
    with running_node(driver, _mig_config("all-1g.10gb")) as node:
        kubelet, agent = node.kubelet, node.agent
        node.wait(lambda: len(node.healthy_ids(SMALL)) == 7, "7 x 1g.10gb advertised")
        pod = kubelet.create_pod("holder", {"main": {SMALL: 1}})
        (held,) = pod.containers["main"][SMALL].device_ids

        agent.post(NodeLabelChanged(MIG_CONFIG_LABEL, "all-disabled"))
        node.wait(lambda: f"{held} held by default/holder" in node.waiting_for("mig"), "the change waits for the pod")
        assert held in {ci.uuid for _, ci in driver.gpus[0].mig_devices()}, "the pod's MIG device was destroyed"
        assert not node.healthy_ids(SMALL), "devices about to go are still offered"

        kubelet.delete_pod("holder")
        node.wait(lambda: agent.status.mig_state == "success", "applied once the pod is gone")
        node.wait(lambda: node.healthy_ids(GPU) == {driver.gpus[0].uuid}, "the whole GPU advertised")
        assert not _destructive_under_load(driver)


def test_nvml_failing_to_initialise_in_the_mig_worker_is_retried_not_stranded(sim_node) -> None:
    driver = sim_node(PLAIN_A100)
    with running_node(driver, _mig_config("all-disabled")) as node:
        agent = node.agent
        node.wait(lambda: agent.status.mig_state == "success", "MIG off in place")
        driver.fail_init(Return.ERROR_DRIVER_NOT_LOADED)
        agent.post(NodeLabelChanged(MIG_CONFIG_LABEL, "all-1g.10gb"))
        node.wait(lambda: "DRIVER_NOT_LOADED" in node.waiting_for("mig"), "the worker reports NVML down")
        assert not driver.gpus[0].mig_pending
        driver.fail_init(None)
        node.wait(lambda: agent.status.mig_state == "success", "converged once NVML is back")
        node.wait(lambda: len(node.healthy_ids(SMALL)) == 7, "7 x 1g.10gb advertised")


def test_a_gpu_back_from_the_dead_is_read_again_before_anything_is_advertised(sim_node) -> None:
    """A lost GPU that comes back has lost its MIG instances: the old UUIDs must never be offered again."""
    driver = sim_node("a100-mig")
    quick = HealthPolicy(quiet_seconds=0.2)
    with running_node(driver, _mig_config("all-1g.10gb"), health=quick) as node:
        kubelet = node.kubelet
        node.wait(lambda: len(node.healthy_ids(SMALL)) == 7, "7 x 1g.10gb advertised")
        before = node.healthy_ids(SMALL)

        driver.lose_gpu(0)
        node.wait(lambda: not node.healthy_ids(SMALL), "the lost GPU's devices are Unhealthy")
        driver.recover_gpu(0)  # answers again; its MIG instances are gone

        node.wait(lambda: len(node.healthy_ids(SMALL)) == 7 and not node.healthy_ids(SMALL) & before, "new devices")
        existing = {ci.uuid for _, ci in driver.gpus[0].mig_devices()}
        assert node.healthy_ids(SMALL) == existing, "a device the driver does not have is advertised"
        assert set(kubelet.devices(SMALL)) <= existing
        pod = kubelet.create_pod("after", {"main": {SMALL: 1}})
        assert set(pod.containers["main"][SMALL].device_ids) <= existing


def test_a_gpu_that_failed_discovery_at_start_joins_when_it_answers(sim_node) -> None:
    driver = sim_node({"name": "late", "gpus": [{"model": "A100-SXM4-80GB", "count": 2}]})
    driver.inject_error("nvmlDeviceGetName", Return.ERROR_UNKNOWN, times=1, gpu_index=1)
    with running_node(driver, "version: v1\n") as node:
        node.wait(lambda: node.healthy_ids(GPU) == {g.uuid for g in driver.gpus}, "both GPUs advertised")
        assert not node.agent.status.inventory.failures


def test_discovery_skips_a_gpu_instance_profile_this_pynvml_does_not_know(nvml_node, caplog) -> None:
    """A driver newer than the installed pynvml has profiles pynvml cannot enumerate: skip, say so, go on."""
    from agent.gpu.discovery import discover

    driver = nvml_node({"gpus": [{"model": "A100-SXM4-80GB", "mig": {"instances": ["1g.10gb", "3g.40gb"]}}]})
    small = next(gi for gi, _ in driver.gpus[0].mig_devices() if gi.profile.name == "1g.10gb")
    driver.hide_gi_profile(small.profile.index)
    inventory = discover()
    assert [m.profile for m in inventory.gpus[0].mig_devices] == ["3g.40gb"]
    assert any("cannot describe" in r.getMessage() for r in caplog.records)


MPS = """
version: v1
sharing:
  mps:
    resources:
      - name: nvidia.com/gpu
        replicas: {replicas}
        activeThreadPercentage: 50
"""


def test_an_mps_spec_change_never_quits_a_daemon_under_its_clients(sim_node, mps_bin: Path) -> None:
    driver = sim_node(PLAIN_A100)
    mps_root = Path(tempfile.mkdtemp(prefix="m", dir="/tmp"))
    options = {
        "mps_control": str(mps_bin / "nvidia-cuda-mps-control"),
        "overrides": FlagOverrides(mps_root=str(mps_root)),
    }
    with running_node(driver, MPS.format(replicas=2), **options) as node:
        kubelet, agent = node.kubelet, node.agent
        node.wait(lambda: len(node.healthy_ids(GPU)) == 2, "2 MPS replicas advertised", timeout=20)
        daemons = agent.status.mps
        pod = kubelet.create_pod("client", {"main": {GPU: 1}})
        assert pod.containers["main"][GPU].device_ids
        driver.add_process(0, 777, 1024, kind="mps_client")

        node.reload(MPS.format(replicas=3))
        node.wait(lambda: "held by default/client" in node.waiting_for("mps"), "the daemon waits for its clients")
        assert [k for k, d in agent.status.mps.items() if d["state"] == "draining"]
        assert driver.gpus[0].compute_mode != 0, "compute mode went back to DEFAULT under a client"
        assert not node.healthy_ids(GPU), "replicas of a retiring daemon are still offered"

        kubelet.delete_pod("client")
        node.wait(lambda: "runs 1 process(es) (pid 777)" in node.waiting_for("mps"), "then for the client process")
        driver.remove_process(777)
        node.wait(lambda: len(node.healthy_ids(GPU)) == 3, "the new spec's 3 replicas advertised", timeout=20)
        assert not node.waiting_for("mps")
        assert set(agent.status.mps) == set(daemons)
    _stop_daemons(mps_root)


def _stop_daemons(root: Path) -> None:
    """MPS daemons outlive the agent by design; a test ends its own."""
    for pid_file in root.glob("**/pipe/nvidia-cuda-mps-control.pid"):
        with contextlib.suppress(ValueError, OSError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
    shutil.rmtree(root, ignore_errors=True)


def test_the_mig_manager_checks_again_right_before_acting(sim_node, tmp_path: Path) -> None:
    """A process that starts between the check and the change stops the change: nothing is destroyed."""
    import queue

    from agent.gpu.discovery import discover
    from agent.ledger import DeviceLedger
    from agent.mig.layout_file import layouts_for_node, parse_layout_file
    from agent.mig.manager import MigApplied, MigBusyChecked, MigManager
    from agent.sim.kubelet import KubeletEmulator

    driver = sim_node(PLAIN_A100)
    kubelet = KubeletEmulator(tmp_path / "dp", tmp_path / "pr.sock")  # PodResources: nothing allocated
    kubelet.start()
    events: queue.Queue[object] = queue.Queue()
    ledger = DeviceLedger(tmp_path / "pr.sock")
    manager = MigManager(events.put, ledger)
    try:
        inventory = ledger.inventory = discover()
        layouts = parse_layout_file(
            {"version": "v1", "mig-configs": {"all-1g": [{"devices": "all", "mig-enabled": True, "mig-devices": {}}]}},
            "t",
        )
        manager.desire(layouts_for_node(layouts, "all-1g", inventory.gpus), inventory, 0.0)
        manager.tick(0.0)
        checked = events.get(timeout=10)
        assert isinstance(checked, MigBusyChecked) and not checked.busy  # free at the check
        driver.add_process(0, 5150, 100)  # ... and then a job starts
        manager.on_busy_checked(checked, 0.0)
        applied = events.get(timeout=10)
        assert isinstance(applied, MigApplied) and "runs 1 process(es) (pid 5150)" in " ".join(applied.busy)
        assert not driver.destructive_calls and not driver.gpus[0].mig_pending
        manager.on_applied(applied, 0.0)
        assert manager.state == "pending"
    finally:
        manager.shutdown()
        kubelet.stop()


def test_without_the_kubelet_s_word_nothing_is_destroyed(sim_node) -> None:
    driver = sim_node(PLAIN_A100)
    with running_node(
        driver, _mig_config("all-disabled"), pod_resources_socket=Path("/nonexistent/kubelet.sock")
    ) as node:
        node.wait(lambda: node.agent.status.mig_state == "success", "MIG off in place")
        node.agent.post(NodeLabelChanged(MIG_CONFIG_LABEL, "all-1g.10gb"))
        node.wait(
            lambda: "cannot tell whether pods hold the devices" in node.waiting_for("mig"), "waits for the kubelet"
        )
        assert not driver.gpus[0].mig_pending and not driver.destructive_calls
