"""An XID reaches the kubelet first; everything else it causes still follows.

The reconcile loop tells the kubelet before anything else (``send_updates`` waits until gRPC has written the new
listing), then logs the XID, reads the ECC baseline, and the Event recorder writes the Node's Event after a short
wait. These tests hold the other user-visible effects of an XID to account: the status and the metrics, the log
line, the Event on the Node, Allocate answering from the new listing. Real agent, simulated node, kubelet
emulator, a fake API server spoken to over HTTP.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from agent.agent import Agent, AgentOptions
from agent.sim.kubelet import AdmissionError, KubeletEmulator
from agent.telemetry.service import TelemetrySettings
from tests.fake_events_api import FakeEventsApi
from tests.fake_kube import FakeKube, serving, write_kubeconfig

pytestmark = pytest.mark.timeout(60)

NODE = "gpu-node-1"
GPU = "nvidia.com/gpu"
DEADLINE = 15.0


class Node:
    def __init__(self, kubelet: KubeletEmulator, agent: Agent, events: FakeEventsApi, driver) -> None:
        self.kubelet, self.agent, self.events, self.driver = kubelet, agent, events, driver

    def unhealthy(self) -> set[str]:
        return {device for device, health in self.kubelet.devices(GPU).items() if health != "Healthy"}


@pytest.fixture
def node(sim_node, caplog: pytest.LogCaptureFixture) -> Iterator[Node]:
    caplog.set_level(logging.INFO, logger="agent")
    base = Path(tempfile.mkdtemp(prefix="xf", dir="/tmp"))  # short: unix socket paths are limited
    events = FakeEventsApi()
    with serving(FakeKube(NODE, {"kubernetes.io/hostname": NODE}), events) as kube:
        driver = sim_node("dgx-a100")
        kubelet = KubeletEmulator(base / "dp", base / "pr" / "kubelet.sock")
        kubelet.start()
        options = AgentOptions(
            device_plugin_dir=base / "dp",
            pod_resources_socket=base / "pr" / "kubelet.sock",
            node_name=NODE,
            kubeconfig=str(write_kubeconfig(base / "kubeconfig", kube.port)),
            telemetry=TelemetrySettings(hostname=NODE, metrics_address="127.0.0.1:0", interval=0.5, proc_root=base),
        )
        agent = Agent(options)
        thread = threading.Thread(target=agent.run, name="agent-under-test")
        thread.start()
        try:
            kubelet.wait_for(lambda: kubelet.allocatable(GPU) == 8, timeout=DEADLINE, what="8 GPUs registered")
            kubelet.wait_for(lambda: agent.metrics_port is not None, timeout=DEADLINE, what="the metrics endpoint")
            yield Node(kubelet, agent, events, driver)
        finally:
            agent.stop()
            thread.join(timeout=20)
            kubelet.stop()
    assert not thread.is_alive()
    shutil.rmtree(base, ignore_errors=True)


def _metrics(agent: Agent) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{agent.metrics_port}/metrics", timeout=5) as answer:
        return answer.read().decode()


def _event(events: FakeEventsApi, reason: str) -> dict | None:
    return next((e for e in events.events.values() if e.get("reason") == reason), None)


def test_after_the_kubelet_hears_of_an_xid_the_status_log_and_event_follow(node: Node, caplog) -> None:
    gpu = node.agent.status.inventory.gpus[3]
    node.driver.inject_xid(3, 48)
    node.kubelet.wait_for(lambda: len(node.unhealthy()) == 1, timeout=DEADLINE, what="GPU 3 Unhealthy")
    (device,) = node.unhealthy()
    assert device in {d.id for d in node.agent.status.resources[GPU].devices if d.gpu_uuid == gpu.uuid}
    # The status the kubelet's news came with: `tessera status` never lags what the kubelet hears.
    assert gpu.uuid in node.agent.status.faults
    assert node.agent.status.xid_counts[("3", gpu.uuid, "48")] == 1
    # The metrics, at the collector's next turn (it reads the status).
    counted = f'tessera_gpu_xid_errors_total{{Hostname="{NODE}",UUID="{gpu.uuid}",gpu="3",xid="48"}} 1.0'
    node.kubelet.wait_for(lambda: counted in _metrics(node.agent), timeout=DEADLINE, what="the XID counted")
    # The log line, said once the kubelet was told (not before, not never).
    node.kubelet.wait_for(
        lambda: any("critical XID" in r.getMessage() and gpu.uuid in r.getMessage() for r in caplog.records),
        timeout=DEADLINE,
        what="the critical XID logged",
    )
    # The Event on the Node, written after the recorder's short wait.
    node.events.wait_for(lambda: _event(node.events, "GPUUnhealthy") is not None)
    unhealthy = _event(node.events, "GPUUnhealthy")
    assert unhealthy["regarding"]["name"] == NODE and "GPU 3 (" in unhealthy["note"] and "XID 48" in unhealthy["note"]


def test_allocate_refuses_the_device_an_xid_made_unhealthy_at_once(node: Node) -> None:
    """The allocator's answers are worked out after the kubelet has the listing; an Allocate that comes first
    still answers from the new snapshot (the device the XID took is refused, the others are given)."""
    node.driver.inject_xid(5, 48)
    node.kubelet.wait_for(lambda: len(node.unhealthy()) == 1, timeout=DEADLINE, what="GPU 5 Unhealthy")
    (device,) = node.unhealthy()
    with pytest.raises(grpc.RpcError) as refused:
        node.kubelet.allocate_raw(GPU, [device])
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "Unhealthy" in refused.value.details()
    pod = node.kubelet.create_pod("train", {"main": {GPU: 7}})
    assert device not in pod.containers["main"][GPU].device_ids
    with pytest.raises(AdmissionError):
        node.kubelet.create_pod("greedy", {"main": {GPU: 1}})
