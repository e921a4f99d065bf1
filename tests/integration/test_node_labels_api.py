"""Node labels written on the Node itself (``--label-node``, for clusters without NFD): the real Kubernetes
client against a fake API server, the agent on a simulated node. Only the labels the agent set are ever
changed; a refused patch is one warning with the fix, and the agent keeps serving."""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.agent import Agent, AgentOptions
from agent.sim.kubelet import KubeletEmulator
from agent.telemetry.node_labels_api import MANAGED_ANNOTATION, label_patch
from agent.telemetry.service import TelemetrySettings
from tests.fake_kube import FakeKube, serving, write_kubeconfig

pytestmark = pytest.mark.timeout(60)
NODE = "gpu-node-1"


def test_a_patch_sets_ours_removes_ours_that_went_and_never_names_anyone_elses():
    patch = label_patch({"nvidia.com/gpu.count": "8", "bad key!": "x", "nvidia.com/gpu.product": "A" * 64},
                        managed_before={"nvidia.com/gpu.count", "nvidia.com/mig.config.state"})  # fmt: skip
    assert patch == {
        "metadata": {
            "labels": {"nvidia.com/mig.config.state": None, "nvidia.com/gpu.count": "8"},
            "annotations": {MANAGED_ANNOTATION: "nvidia.com/gpu.count"},
        }
    }


def wait_until(predicate, timeout: float, what: str) -> None:
    pace, deadline = threading.Event(), time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        pace.wait(0.01)


@pytest.fixture
def start(sim_node) -> Iterator:
    """``start(patch_status=None)``: the fake API server and the agent; all stopped at the end."""
    sim_node("dgx-a100")
    base = Path(tempfile.mkdtemp(prefix="nl", dir="/tmp"))
    running: list[tuple[Agent, threading.Thread, KubeletEmulator]] = []
    with serving(FakeKube(NODE, {"kubernetes.io/hostname": NODE, "team": "ml"})) as kube:

        def run(patch_status: int | None = None) -> tuple[FakeKube, Agent]:
            kube.patch_status = patch_status
            kubelet = KubeletEmulator(base / "dp", None)
            kubelet.start()
            settings = TelemetrySettings(
                hostname=NODE, metrics_address="127.0.0.1:0", interval=0.2, proc_root=base, label_node=True
            )
            options = AgentOptions(
                device_plugin_dir=base / "dp",
                pod_resources_socket=base / "pr.sock",
                node_name=NODE,
                kubeconfig=str(write_kubeconfig(base / "kubeconfig", kube.port)),
                telemetry=settings,
            )
            agent = Agent(options)
            thread = threading.Thread(target=agent.run, name="agent-under-test")
            thread.start()
            running.append((agent, thread, kubelet))
            return kube, agent

        yield run
        for agent, thread, kubelet in running:
            agent.stop()
            thread.join(timeout=20)
            kubelet.stop()
    shutil.rmtree(base, ignore_errors=True)


def collections(agent: Agent) -> float | None:
    telemetry = agent._telemetry
    return telemetry.collector.last.collected_at if telemetry is not None else None


def test_the_agent_labels_its_node_and_touches_nothing_else(start):
    kube, agent = start()
    kube.wait_for(lambda: kube.labels.get("nvidia.com/gpu.count") == "8")
    assert kube.labels["nvidia.com/gpu.product"].startswith("NVIDIA-A100")
    assert kube.labels["team"] == "ml" and kube.labels["kubernetes.io/hostname"] == NODE
    managed = set(kube.annotations[MANAGED_ANNOTATION].split(","))
    assert "nvidia.com/gpu.count" in managed and "team" not in managed
    patches = len(kube.patches)
    for _ in range(3):  # collections go on; the labels do not change: no patch
        seen = collections(agent)
        wait_until(lambda: collections(agent) != seen, 10, "another collection")  # noqa: B023
    assert len(kube.patches) == patches


def test_a_refused_patch_is_one_warning_with_the_fix(start, caplog):
    caplog.set_level(logging.WARNING, logger="agent.telemetry.node_labels_api")
    kube, agent = start(patch_status=403)
    kube.wait_for(lambda: kube.count("patch", 403) >= 3)  # retried after each collection
    warnings = [r.getMessage() for r in caplog.records if "cannot label the Node" in r.getMessage()]
    assert len(warnings) == 1
    assert "HTTP 403" in warnings[0] and "verbs [patch]" in warnings[0] and "node-labels overlay" in warnings[0]
    assert agent.responsive(5) and "team" in kube.labels
