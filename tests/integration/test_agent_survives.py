"""The agent cannot be killed by its input or its driver, and only one agent serves a plugin directory.

In-process agent on a simulated node, the kubelet emulator watching what a node would notice.
"""

from __future__ import annotations

import pytest

from agent.agent import Agent, AgentExit, AgentOptions
from agent.sim.nvml.codes import Return
from tests import bombs
from tests.agent_node import Node, running_node

GPU = "nvidia.com/gpu"
TWO_GPUS = {"name": "survive", "gpus": [{"model": "A100-SXM4-80GB", "count": 2}]}
GOOD = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n      - name: nvidia.com/gpu\n        replicas: {n}\n"
BOMBS: dict[str, bytes] = {
    "nested 500 deep": bombs.deep_nesting(500),
    "nested mappings": bombs.deep_mappings(400),
    "billion laughs": bombs.billion_laughs(),
    "binary garbage": bombs.binary_garbage(),
}


def _healthy(node: Node) -> int:
    return len(node.healthy_ids(GPU))


@pytest.mark.parametrize("bomb", list(BOMBS), ids=list(BOMBS))
def test_a_config_bomb_hot_reloaded_is_rejected_and_the_last_good_config_keeps_serving(sim_node, bomb: str) -> None:
    with running_node(sim_node(TWO_GPUS), GOOD.format(n=4)) as node:
        kubelet, agent = node.kubelet, node.agent
        kubelet.wait_for(lambda: _healthy(node) == 8, 10, "8 replicas")
        pod = kubelet.create_pod("busy", {"main": {GPU: 1}})

        node.config.write_bytes(BOMBS[bomb])
        kubelet.wait_for(lambda: agent.status.config_error is not None, 10, "the bomb rejected")
        assert str(node.config) in agent.status.config_error
        assert node.thread.is_alive(), "the reconcile loop died on a config"
        assert _healthy(node) == 8 and kubelet.allocatable(GPU) == 8, "the last good config is not served"
        assert pod.containers["main"][GPU].device_ids

        node.config.write_text(GOOD.format(n=2))  # the loop still reacts
        kubelet.wait_for(lambda: _healthy(node) == 4, 10, "the next good config applied")
        assert agent.status.config_error is None


def test_an_agent_started_on_a_config_bomb_runs_and_takes_the_fix(sim_node) -> None:
    with running_node(sim_node(TWO_GPUS), BOMBS["nested 500 deep"]) as node:
        assert node.thread.is_alive(), "the agent exited on a bad config (a crash loop in a DaemonSet)"
        assert "nest" in (node.agent.status.config_error or "")
        node.config.write_text(GOOD.format(n=3))
        node.kubelet.wait_for(lambda: _healthy(node) == 6, 10, "the fixed config applied")


def test_nvml_failing_to_initialise_never_stops_the_loop(sim_node) -> None:
    driver = sim_node(TWO_GPUS)
    with running_node(driver, "version: v1\n", liveness_probe_seconds=0.01) as node:
        kubelet, agent = node.kubelet, node.agent
        kubelet.wait_for(lambda: _healthy(node) == 2, 10, "2 GPUs")
        driver.fail_init(Return.ERROR_DRIVER_NOT_LOADED)
        beat = agent.heartbeat
        kubelet.wait_for(lambda: agent.heartbeat > beat + 0.2, 10, "the loop keeps turning with NVML down")
        assert agent.responsive(5), "the loop does not answer"
        assert node.thread.is_alive()
        assert not agent.status.internal_errors, "a re-check that cannot reach NVML is not an internal error"
        driver.fail_init(None)
        driver.inject_xid(0, 48)  # the loop still reacts to the driver
        kubelet.wait_for(lambda: _healthy(node) == 1, 10, "the XID seen after NVML came back")


def test_a_second_agent_on_the_same_plugin_directory_exits_naming_the_first(sim_node) -> None:
    with running_node(sim_node(TWO_GPUS), "version: v1\n") as node:
        node.kubelet.wait_for(lambda: _healthy(node) == 2, 10, "2 GPUs")
        registrations = node.kubelet.registrations(GPU)
        second = Agent(AgentOptions(device_plugin_dir=node.base / "dp", lock_wait_seconds=0.2))
        with pytest.raises(AgentExit, match=r"another Tessera agent \(pid \d+ on .+\) serves the device-plugin"):
            second.run()
        assert node.kubelet.registrations(GPU) == registrations, "the second agent touched the kubelet"
        assert _healthy(node) == 2


def test_a_dead_health_watcher_is_noticed_restarted_and_sees_xids_again(sim_node) -> None:
    driver = sim_node(TWO_GPUS)
    # the safety re-check (30 s by default) is where a dead thread is noticed: shortened here
    with running_node(driver, "version: v1\n", liveness_probe_seconds=0.2) as node:
        node.wait(lambda: _healthy(node) == 2, "2 GPUs")
        node.agent._event_watcher.stop()  # its thread ends, as if it had died
        node.wait(lambda: node.agent.status.internal_errors.get("thread"), "the dead thread noticed")
        driver.inject_xid(0, 48)
        node.wait(lambda: _healthy(node) == 1, "an XID seen by the restarted watcher")
