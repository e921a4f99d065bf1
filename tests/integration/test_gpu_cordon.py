"""Per-GPU cordon through the Node's annotations, and the Node Events the agent records, end to end: a fake
API server spoken to by the real Kubernetes client, the agent on a simulated node, the kubelet emulator. A
cordoned GPU's devices go Unhealthy at once with the reason in the status, a pod already running on it keeps
its devices, removing the entry restores them, junk is reported without stopping anything; what an operator
must see arrives as Events on the Node."""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.agent import Agent, AgentOptions
from agent.config.labels import CORDON_ANNOTATION, HAMI_CORDON_ANNOTATION
from agent.sim.kubelet import KubeletEmulator
from tests.fake_events_api import FakeEventsApi
from tests.fake_kube import FakeKube, serving, write_kubeconfig

pytestmark = pytest.mark.timeout(60)

NODE = "gpu-node-1"
GPU = "nvidia.com/gpu"


class Node:
    def __init__(self, kube: FakeKube, kubelet: KubeletEmulator, agent: Agent, events: FakeEventsApi, driver) -> None:
        self.kube, self.kubelet, self.agent, self.events, self.driver = kube, kubelet, agent, events, driver

    def wait(self, predicate: Callable[[], object], what: str, timeout: float = 15.0) -> None:
        self.kubelet.wait_for(lambda: bool(predicate()), timeout=timeout, what=what)

    def unhealthy(self) -> set[str]:
        return {device for device, health in self.kubelet.devices(GPU).items() if health != "Healthy"}

    def device_of(self, index: int) -> str:
        uuid = self.agent.status.inventory.gpus[index].uuid
        return next(d.id for d in self.agent.status.resources[GPU].devices if d.gpu_uuid == uuid)

    def annotate(self, **values: str | None) -> None:
        keys = {"tessera": CORDON_ANNOTATION, "hami": HAMI_CORDON_ANNOTATION}
        self.kube.update(annotate={keys[name]: value for name, value in values.items()})


@pytest.fixture
def node(sim_node) -> Iterator[Callable[..., Node]]:
    base = Path(tempfile.mkdtemp(prefix="gc", dir="/tmp"))  # short: unix socket paths are limited
    started: list[tuple[Agent, threading.Thread, KubeletEmulator]] = []
    events = FakeEventsApi()
    with serving(FakeKube(NODE, {"kubernetes.io/hostname": NODE}), events) as kube:

        def start(annotations: dict[str, str] | None = None, get_status: int | None = None) -> Node:
            driver = sim_node("dgx-a100")
            kube.annotations.update(annotations or {})
            kube.get_status = get_status
            kubelet = KubeletEmulator(base / "dp", base / "pr" / "kubelet.sock")
            kubelet.start()
            options = AgentOptions(
                device_plugin_dir=base / "dp",
                pod_resources_socket=base / "pr" / "kubelet.sock",
                node_name=NODE,
                kubeconfig=str(write_kubeconfig(base / "kubeconfig", kube.port)),
            )
            agent = Agent(options)
            thread = threading.Thread(target=agent.run, name="agent-under-test")
            thread.start()
            started.append((agent, thread, kubelet))
            result = Node(kube, kubelet, agent, events, driver)
            result.wait(lambda: kubelet.capacity(GPU) == 8, "8 GPUs registered")
            return result

        yield start
        for agent, thread, kubelet in started:
            agent.stop()
            thread.join(timeout=20)
            assert not thread.is_alive()
            kubelet.stop()
    shutil.rmtree(base, ignore_errors=True)


def test_a_cordoned_gpu_goes_unhealthy_at_once_and_comes_back_when_the_entry_goes(node):
    n = node()
    pod = n.kubelet.create_pod("trainer", {"main": {GPU: 8}})  # every GPU is in use by a running pod
    n.annotate(tessera="1")
    n.wait(lambda: n.unhealthy() == {n.device_of(1)}, "GPU 1 Unhealthy at the kubelet")
    assert n.kubelet.allocatable(GPU) == 7
    status = n.agent.status
    assert status.cordoned == {status.inventory.gpus[1].uuid: (CORDON_ANNOTATION,)}
    assert n.kubelet.pod("trainer").containers == pod.containers  # the running pod keeps its devices

    n.annotate(tessera=None)
    n.wait(lambda: not n.unhealthy(), "GPU 1 Healthy again")
    assert n.agent.status.cordoned == {}


def test_the_status_already_says_why_when_the_kubelet_hears_of_a_change(node):
    """The agent builds its status before it tells the kubelet, so whoever sees a device turn Unhealthy at the
    kubelet finds the reason in ``tessera status`` at once (on the old order, status after the send, this
    failed about one turn in three)."""
    n = node()
    uuid, device = n.agent.status.inventory.gpus[4].uuid, n.device_of(4)
    for turn in range(20):
        n.annotate(tessera="4")
        n.wait(lambda: n.unhealthy() == {device}, f"GPU 4 Unhealthy at the kubelet (turn {turn})")
        assert n.agent.status.cordoned == {uuid: (CORDON_ANNOTATION,)}
        n.annotate(tessera=None)
        n.wait(lambda: not n.unhealthy(), f"GPU 4 Healthy again (turn {turn})")
        assert n.agent.status.cordoned == {}


def test_hamis_annotation_cordons_by_uuid_too(node):
    n = node()
    uuid = n.agent.status.inventory.gpus[6].uuid
    n.annotate(hami=uuid)
    n.wait(lambda: n.unhealthy() == {n.device_of(6)}, "GPU 6 Unhealthy at the kubelet")
    assert n.agent.status.cordoned == {uuid: (HAMI_CORDON_ANNOTATION,)}


def test_a_gpu_cordoned_before_the_agent_starts_is_never_offered_healthy(node):
    n = node({CORDON_ANNOTATION: "3"})
    assert n.kubelet.allocatable(GPU) == 7  # from the first ListAndWatch on
    assert n.unhealthy() == {n.device_of(3)}


def test_the_start_reads_the_node_once_and_then_follows_it_from_that_read(node):
    n = node()
    n.kube.wait_for_requests("watch", 1)  # opened once the kubelet is served, from the start's GET
    assert n.kube.count("get") == 1  # the labels and annotations the start chose by: read once, not again
    n.annotate(tessera="5")
    n.wait(lambda: n.unhealthy() == {n.device_of(5)}, "the cordon, through the watch")


def test_a_start_whose_node_read_fails_serves_and_catches_up_through_the_watcher(node):
    """The API server fails the start's GET: the GPUs are served all the same (the cordon unknown yet), and once it
    answers, the watcher's own GET brings the cordon that was there all along."""
    n = node({CORDON_ANNOTATION: "3"}, get_status=500)  # every GET answered 500 until told otherwise
    assert n.kube.count("get", 500) >= 1 and n.unhealthy() == set()  # served, nothing known to be cordoned
    n.kube.get_status = None
    n.wait(lambda: n.unhealthy() == {n.device_of(3)}, "the cordon, from the watcher's own GET")


def test_junk_entries_are_reported_and_the_valid_ones_still_apply(node):
    n = node()
    n.annotate(tessera="GPU-nope, 42, 2, \x07")
    n.wait(lambda: n.unhealthy() == {n.device_of(2)}, "GPU 2 Unhealthy at the kubelet")
    problems = n.agent.status.cordon_problems
    assert len(problems) == 3 and all("is not a GPU or MIG device of this node" in p for p in problems)
    n.annotate(tessera="x" * 300_000)  # larger than the API server would ever store: still just junk
    n.wait(lambda: not n.unhealthy(), "GPU 2 Healthy again after the annotation was replaced")
    assert n.agent.responsive(5)


def event_with(events: FakeEventsApi, reason: str) -> dict | None:
    """The stored Event with ``reason`` (called under the fake's lock, from its wait_for)."""
    return next((e for e in events.events.values() if e.get("reason") == reason), None)


def test_what_an_operator_must_see_arrives_as_events_on_the_node(node):
    n = node()
    gpu = n.agent.status.inventory.gpus[2]
    n.annotate(tessera="2")
    n.events.wait_for(lambda: event_with(n.events, "GPUCordoned") is not None)
    cordoned = event_with(n.events, "GPUCordoned")
    assert cordoned["regarding"]["kind"] == "Node" and cordoned["regarding"]["name"] == NODE
    assert cordoned["reportingController"] == "tessera.dev/agent" and cordoned["type"] == "Normal"
    assert cordoned["note"].startswith(f"GPU 2 ({gpu.uuid}) cordoned by tessera.dev/gpu-cordon")
    n.annotate(tessera="2, GPU-nope")
    n.events.wait_for(lambda: event_with(n.events, "CordonEntryIgnored") is not None)
    assert event_with(n.events, "CordonEntryIgnored")["type"] == "Warning"
    n.driver.inject_xid(5, 48)
    n.events.wait_for(lambda: event_with(n.events, "GPUUnhealthy") is not None)
    unhealthy = event_with(n.events, "GPUUnhealthy")
    assert unhealthy["type"] == "Warning" and unhealthy["action"] == "MarkUnhealthy"
    assert "GPU 5 (" in unhealthy["note"] and "XID 48" in unhealthy["note"]
