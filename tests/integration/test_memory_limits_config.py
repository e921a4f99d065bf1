"""Memory sizes from the sharing config, end to end: time-sliced replicas given a size (and a burst ceiling) are held
to it by the driver, Allocate gives their containers the toolkit hook's variables, a config that resizes them
reaches running containers at once, a bad size is refused with the old limits kept, and ``tessera status`` says
which enforcement holds each container.

The same node as ``test_memory_limits``: a simulated r615 driver beneath pynvml, the kubelet emulator making real
cgroup directories and log links, an in-process agent.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from agent.sim.kubelet import KubeletEmulator, Pod
from agent.sim.nvml.codes import Return
from agent.status_report import render_text, status_document
from tests.fake_events_api import FakeEventsApi
from tests.fake_kube import FakeKube, serving, write_kubeconfig
from tests.integration import test_memory_limits as path_b
from tests.integration.test_memory_limits import GIB, OLD, Node
from tests.integration.test_telemetry import wait_until

SHARED = "nvidia.com/gpu-shared"
NODE_NAME = "gpu-node-1"
TIME_SLICED = """
version: v1
sharing:
  timeSlicing:
    resources:
      - {name: nvidia.com/gpu, rename: nvidia.com/gpu-shared, replicas: 4, memoryLimit: @SIZE@, memoryBurstLimit: 20Gi}
"""
make_node = path_b.make_node  # the fixture: a node whose agent holds containers to their sizes
RECHECK = 300.0  # no safety re-check during a test: whatever happens comes from an event


def config(size: str) -> str:
    return TIME_SLICED.replace("@SIZE@", size)


def start(node: Node, pod: Pod) -> tuple[str, dict[str, str]]:
    """Start the pod's container: its cgroup and the environment the kubelet gives it (the Allocate answers)."""
    options = node.kubelet.start_container(pod.name, "main", pod.namespace)
    return str(node.kubelet.started_container(pod.name, "main", pod.namespace).cgroup), dict(options.envs)


def rewrite(node: Node, text: str) -> None:
    path = node.base / "config.yaml"
    path.with_suffix(".new").write_text(text)
    path.with_suffix(".new").replace(path)  # as a ConfigMap update lands: one rename


def test_time_sliced_replicas_are_held_to_their_size_with_a_burst_ceiling(make_node: Callable[..., Node]) -> None:
    node = make_node(config=config("10Gi"), recheck=RECHECK)
    node.wait_registered(timeout=30, resources=(SHARED,))
    pod = node.kubelet.create_pod("burst", {"main": {SHARED: 1}})
    cgroup, envs = start(node, pod)
    assert (envs["NVIDIA_GPU_MEMORY_REQUEST"], envs["NVIDIA_GPU_MEMORY_LIMIT"]) == ("10240", "20480")
    wait_until(lambda: node.limits().get(cgroup) == (10 * GIB, 20 * GIB), 10, "request 10Gi, limit 20Gi")
    assert [(row["enforcement"], row["applied"]) for row in node.report()] == [("driver", True)]


def test_a_config_resize_reaches_running_containers_at_once(make_node: Callable[..., Node]) -> None:
    node = make_node(config=config("10Gi"), recheck=RECHECK)
    node.wait_registered(timeout=30, resources=(SHARED,))
    cgroup, _ = start(node, node.kubelet.create_pod("resized", {"main": {SHARED: 1}}))
    wait_until(lambda: node.limits().get(cgroup) == (10 * GIB, 20 * GIB), 10, "the first size")
    rewrite(node, config("15Gi"))
    wait_until(lambda: node.limits().get(cgroup) == (15 * GIB, 20 * GIB), 10, "the new size, without a re-check")


UNSIZED = config("10Gi").replace(", memoryLimit: 10Gi, memoryBurstLimit: 20Gi", "")  # the same replicas, no size


def held_container(make_node: Callable[..., Node], pod: str) -> tuple[Node, str]:
    """A node whose config sizes its replicas at 10Gi (20Gi burst), and a container held to that: its cgroup."""
    node = make_node(config=config("10Gi"), recheck=RECHECK)
    node.wait_registered(timeout=30, resources=(SHARED,))
    cgroup, _ = start(node, node.kubelet.create_pod(pod, {"main": {SHARED: 1}}))
    wait_until(lambda: node.limits().get(cgroup) == (10 * GIB, 20 * GIB), 10, "the size")
    return node, cgroup


def test_a_config_that_drops_the_size_lifts_the_limit_from_running_containers(make_node: Callable[..., Node]) -> None:
    """The size goes from the config (the replicas stay, unsized): the running container's limit is lifted at once,
    as a resize would be applied — not left in the driver for the container's life; the status holds no row."""
    node, cgroup = held_container(make_node, "unsized")
    agent = node.agent
    assert agent is not None
    sets = node.driver.memory_limit_sets
    node.driver.inject_error("nvmlDeviceSetMemoryLimits_v1", Return.ERROR_UNKNOWN, times=1)  # the first lift fails
    rewrite(node, UNSIZED)
    wait_until(lambda: cgroup not in node.limits(), 10, "the limit lifted, tried again, without a re-check")
    assert node.driver.memory_limit_sets == sets + 1  # the failed try set nothing; the second lifted it
    wait_until(lambda: agent.status.memory_limits == (), 10, "no row in the status")
    rewrite(node, config("15Gi"))  # sized again: held again
    wait_until(lambda: node.limits().get(cgroup) == (15 * GIB, 20 * GIB), 10, "the new size")


def test_a_container_gone_before_its_limit_is_lifted_is_not_retried_nor_warned_about(
    make_node: Callable[..., Node], caplog
) -> None:
    """The driver says the cgroup is not there (NOT_FOUND: the container went between the look and the call):
    nothing is left to lift, so it is neither tried again nor reported as a failure."""
    node, _ = held_container(make_node, "going")
    sets = node.driver.memory_limit_sets
    node.driver.inject_error("nvmlDeviceSetMemoryLimits_v1", Return.ERROR_NOT_FOUND, times=1)
    with caplog.at_level(logging.INFO, logger="agent.memlimits.manager"):
        rewrite(node, UNSIZED)
        wait_until(lambda: any("memory limit lifted" in r.getMessage() for r in caplog.records), 10, "given up")
    assert not [r for r in caplog.records if "not lifted" in r.getMessage()]
    assert node.driver.memory_limit_sets == sets  # the one call was refused; none was made again


def test_a_bad_size_is_refused_by_name_and_the_old_limits_stay(make_node: Callable[..., Node]) -> None:
    node = make_node(config=config("10Gi"), recheck=RECHECK)
    node.wait_registered(timeout=30, resources=(SHARED,))
    agent = node.agent
    assert agent is not None
    cgroup, _ = start(node, node.kubelet.create_pod("steady", {"main": {SHARED: 1}}))
    wait_until(lambda: node.limits().get(cgroup) == (10 * GIB, 20 * GIB), 10, "the limits")
    sets = node.driver.memory_limit_sets
    rewrite(node, config("30Gi"))  # 4 replicas x 30Gi guaranteed do not fit in 80 GiB (and 30Gi > the 20Gi ceiling)
    wait_until(lambda: agent.status.config_error is not None, 10, "the config rejected")
    assert "memoryBurstLimit 20Gi (20480 MiB) is below memoryLimit 30Gi" in agent.status.config_error
    rewrite(node, config("30Gi").replace("memoryBurstLimit: 20Gi", "memoryBurstLimit: 40Gi"))
    wait_until(lambda: "guaranteed is more than" in (agent.status.config_error or ""), 10, "the second rejection")
    assert "sharing.timeSlicing.resources[0].memoryLimit: 4 replicas x 30720 MiB" in agent.status.config_error
    assert agent.responsive()  # the loop turned after the rejections; nothing was applied half-way:
    assert node.limits() == {cgroup: (10 * GIB, 20 * GIB)} and node.driver.memory_limit_sets == sets
    assert agent.status.plan is not None
    assert agent.status.plan.resource(SHARED).memory.request_mib == 10240


def test_status_says_which_enforcement_holds_each_container(make_node: Callable[..., Node]) -> None:
    held = make_node(config=config("10Gi"), recheck=RECHECK)
    held.wait_registered(timeout=30, resources=(SHARED,))
    start(held, held.kubelet.create_pod("held", {"main": {SHARED: 1}}, namespace="team-a"))
    agent = held.agent
    assert agent is not None
    wait_until(lambda: [r.applied for r in agent.status.memory_limits] == [True], 10, "the status")
    text = render_text(status_document(agent.status, version="test"))
    assert "Memory limits:\n  team-a/held/main on GPU " in text
    assert ": request 10Gi, limit 20Gi; driver\n" in text

    old = make_node(OLD, config("10Gi"), recheck=RECHECK)  # a driver without the call: said, not pretended
    old.wait_registered(timeout=30, resources=(SHARED,))
    start(old, old.kubelet.create_pod("unheld", {"main": {SHARED: 1}}, namespace="team-a"))
    agent = old.agent
    assert agent is not None
    wait_until(lambda: [r.enforcement for r in agent.status.memory_limits] == ["advisory"], 10, "the fallback")
    document = status_document(agent.status, version="test")
    (row,) = document["memory_limits"]
    assert (row["pod"], row["enforcement"], row["applied"]) == ("unheld", "advisory", False)
    text = render_text(document)
    assert "team-a/unheld/main on GPU " in text
    assert "advisory: the driver has no nvmlDeviceSetMemoryLimits_v1 (it needs r615 or newer); nothing holds" in text


def test_a_fallback_is_one_warning_event_on_the_node_not_one_per_container(sim_node) -> None:
    """A driver without the call: the Node gets one MemoryLimitFallback Event, however many containers it holds."""
    base = Path(tempfile.mkdtemp(prefix="mle", dir="/tmp"))
    (base / "config.yaml").write_text(config("10Gi"))
    kubelet = KubeletEmulator(
        base / "dp", base / "pr" / "kubelet.sock", cgroup_root=base / "cgroup", log_root=base / "log"
    )
    node = Node(sim_node(OLD), base, kubelet)
    events = FakeEventsApi()
    with serving(FakeKube(NODE_NAME, {"kubernetes.io/hostname": NODE_NAME}), events) as kube:
        kubelet.start()
        try:
            node.start_agent(
                memory_limits=path_b.settings(node, RECHECK),
                node_name=NODE_NAME,
                kubeconfig=str(write_kubeconfig(base / "kubeconfig", kube.port)),
            )
            node.wait_registered(timeout=30, resources=(SHARED,))
            agent = node.agent
            assert agent is not None
            start(node, node.kubelet.create_pod("first", {"main": {SHARED: 1}}))
            events.wait_for(lambda: _fallbacks(events) != [])
            start(node, node.kubelet.create_pod("second", {"main": {SHARED: 1}}))
            wait_until(lambda: len(agent.status.memory_limits) == 2, 10, "both containers in the status")
            rewrite(node, config("30Gi"))  # a rejection: its Event comes after any the second container caused
            events.wait_for(lambda: any(e.get("reason") == "ConfigRejected" for e in events.events.values()))
            (said,) = _fallbacks(events)
            assert said["type"] == "Warning" and said["regarding"]["name"] == NODE_NAME
            assert "(advisory), not the driver: the driver has no nvmlDeviceSetMemoryLimits_v1" in said["note"]
            assert said.get("series") is None  # said once: the second container did not repeat it
        finally:
            node.stop()


def _fallbacks(events: FakeEventsApi) -> list[dict]:
    return [e for e in events.events.values() if e.get("reason") == "MemoryLimitFallback"]


def test_the_room_is_loaded_with_the_first_sized_replica_and_not_before(make_node: Callable[..., Node]) -> None:
    """A node whose config sizes nothing (whole GPUs, most nodes) runs no memory-limits room: no worker, no watcher,
    none of its modules; the config that first gives replicas a size loads it, and its containers are held."""
    node = make_node(config="version: v1\n", recheck=RECHECK)
    node.wait_registered(timeout=30, resources=("nvidia.com/gpu",))
    assert node.agent is not None and node.agent._memlimits is None
    rewrite(node, config("10Gi"))
    node.wait_registered(timeout=30, resources=(SHARED,))
    pod = node.kubelet.create_pod("sized", {"main": {SHARED: 1}})
    cgroup, _ = start(node, pod)
    wait_until(lambda: node.limits().get(cgroup) == (10 * GIB, 20 * GIB), 10, "held once a size is given")


TWO_SIZED = """
version: v1
sharing:
  timeSlicing:
    resources:
      - {name: nvidia.com/gpu, rename: nvidia.com/gpu-shared, replicas: 4, memoryLimit: 10Gi, devices: [0]}
      - {name: nvidia.com/gpu, rename: nvidia.com/gpu-other, replicas: 4, memoryLimit: 10Gi, devices: [1]}
"""
OTHER = "nvidia.com/gpu-other"


def test_a_size_dropped_while_no_agent_ran_is_lifted_by_the_next_agent(make_node: Callable[..., Node]) -> None:
    """An agent held two containers, then stopped; meanwhile the config dropped one resource's size. The next agent
    never set that limit, but finds it on the container of the now unsized replica and lifts it; the other
    container keeps its limit, read and kept, not set again."""
    node = make_node(config=TWO_SIZED, recheck=RECHECK)
    node.wait_registered(timeout=30, resources=(SHARED, OTHER))
    kept, _ = start(node, node.kubelet.create_pod("kept", {"main": {SHARED: 1}}))
    left, _ = start(node, node.kubelet.create_pod("left", {"main": {OTHER: 1}}))
    wait_until(lambda: node.limits() == {kept: (10 * GIB, 10 * GIB), left: (10 * GIB, 10 * GIB)}, 10, "both held")
    assert node.agent is not None and node.thread is not None
    node.agent.stop()
    node.thread.join(timeout=20)
    rewrite(node, TWO_SIZED.replace(", memoryLimit: 10Gi, devices: [1]", ", devices: [1]"))
    sets = node.driver.memory_limit_sets

    node.start_agent(memory_limits=path_b.settings(node, RECHECK))
    wait_until(lambda: left not in node.limits(), 15, "the left-over limit lifted by the new agent")
    assert node.limits() == {kept: (10 * GIB, 10 * GIB)}
    assert node.driver.memory_limit_sets == sets + 1  # the one lift; the kept limit was read, not set again

    reads = node.driver.memory_limit_reads[left]  # looked at once for what was left: not at every look after
    later, _ = start(node, node.kubelet.create_pod("later", {"main": {SHARED: 1}}))
    wait_until(lambda: node.limits().get(later) == (10 * GIB, 10 * GIB), 10, "a new look: the new container held")
    assert node.driver.memory_limit_reads[left] == reads


def test_a_left_over_limit_whose_read_fails_is_read_again_and_lifted(make_node: Callable[..., Node]) -> None:
    """The driver fails the new agent's read of the container's limits (UNKNOWN: a driver in trouble for a moment):
    the read is tried again at the next look, and the left-over limit is still lifted — not taken for none."""
    node = make_node(config=TWO_SIZED, recheck=RECHECK)
    node.wait_registered(timeout=30, resources=(SHARED, OTHER))
    left, _ = start(node, node.kubelet.create_pod("left", {"main": {OTHER: 1}}))
    wait_until(lambda: node.limits().get(left) == (10 * GIB, 10 * GIB), 10, "held")
    assert node.agent is not None and node.thread is not None
    node.agent.stop()
    node.thread.join(timeout=20)
    rewrite(node, TWO_SIZED.replace(", memoryLimit: 10Gi, devices: [1]", ", devices: [1]"))
    gpu = node.gpu_of(node.kubelet.pod("left", "default"), OTHER)
    # on that GPU: the room's probe of the driver at its load, then the first read of the container's limits
    node.driver.inject_error("nvmlDeviceGetMemoryLimits_v1", Return.ERROR_UNKNOWN, times=2, gpu_index=gpu)
    node.start_agent(memory_limits=path_b.settings(node, RECHECK))
    wait_until(lambda: left not in node.limits(), 15, "the left-over limit lifted after the failed read")


def test_a_read_the_driver_answers_for_good_is_not_tried_again(make_node: Callable[..., Node]) -> None:
    """The driver answers the read of an unsized container's limits with NOT_SUPPORTED (no limits on this GPU, so
    none was ever set): the room takes the answer and goes idle, it does not read again at every backoff step."""
    node = make_node(config=TWO_SIZED.replace(", memoryLimit: 10Gi, devices: [1]", ", devices: [1]"), recheck=RECHECK)
    node.wait_registered(timeout=30, resources=(SHARED, OTHER))
    pod = node.kubelet.create_pod("unsized", {"main": {OTHER: 1}})
    # the room probed the driver at its load, before registering: the next read on that GPU is the container's
    node.driver.inject_error(
        "nvmlDeviceGetMemoryLimits_v1", Return.ERROR_NOT_SUPPORTED, times=1, gpu_index=node.gpu_of(pod, OTHER)
    )
    start(node, pod)
    read = "nvmlDeviceGetMemoryLimits_v1"
    wait_until(lambda: not node.driver.faults_armed, 10, "the container's limits read (and refused)")
    reads = node.driver.calls[read]
    time.sleep(1.0)  # the point: nothing happens for a second (a look tried again would come within 0.6 s)
    assert node.driver.calls[read] == reads
