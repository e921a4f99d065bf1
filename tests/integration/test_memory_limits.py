"""GPU memory the driver enforces per container, path (b): the agent finds each container and sets its limits.

A simulated node with driver r615 beneath pynvml, the kubelet emulator making real cgroup directories and log links
for the containers it starts, the MPS control emulator, and an in-process agent. MPS replicas of 10 GiB each: a
container given n replicas of one GPU is held to n x 10 GiB there by ``nvmlDeviceSetMemoryLimits_v1`` on its cgroup.
Everything asserted is what a user sees: the driver's limits (as ``nvidia-smi memory-limits --get`` would show
them), a process that cannot allocate above its limit, the metrics, the room's report.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pynvml
import pytest

from agent.memlimits.settings import MemoryLimitSettings
from agent.sim.kubelet import KubeletEmulator, Pod
from agent.sim.kubelet.cgroups import write_proc_entry
from agent.sim.nvml.codes import Return
from agent.sim.nvml.driver import OutOfMemory, SimDriver
from tests.integration.test_telemetry import TelemetryNode, maybe, series, value, wait_until

GIB = 1 << 30
NEW = {"driver_version": "615.71.09", "gpus": [{"model": "A100-SXM4-80GB", "count": 2}]}
OLD = {"driver_version": "580.95.05", "gpus": [{"model": "A100-SXM4-80GB", "count": 2}]}
MIG = {
    "driver_version": "615.71.09",
    "gpus": [{"model": "A100-SXM4-80GB", "mig": {"instances": ["3g.40gb", "3g.40gb"]}}],
}
MPS = """
version: v1
flags: {mpsRoot: '@BASE@/mps'}
sharing:
  mps:
    resources:
      - {name: nvidia.com/gpu, rename: nvidia.com/gpu-10gb, replicas: 4, memoryLimit: 10Gi, devices: [0]}
      - {name: nvidia.com/gpu, rename: nvidia.com/gpu-20gb, replicas: 2, memoryLimit: 20Gi, devices: [1]}
"""
GPU = "nvidia.com/gpu-10gb"
LARGE = "nvidia.com/gpu-20gb"
MIG_MPS = (
    "version: v1\nflags: {migStrategy: mixed, mpsRoot: '@BASE@/mps'}\n"
    "sharing:\n  mps:\n    resources:\n      - name: nvidia.com/mig-3g.40gb\n        replicas: 2\n"
)
MIG_RESOURCE = "nvidia.com/mig-3g.40gb"


class Node(TelemetryNode):
    def limits(self) -> dict[str, tuple[int, int]]:
        """cgroup -> (soft, hard) of every limit the driver holds, as ``nvidia-smi memory-limits`` would list them."""
        return {cgroup: (limit.soft, limit.hard) for (_, cgroup), limit in self.driver.memory_limit_table().items()}

    def start(self, pod: Pod, container: str = "main") -> str:
        """Start the container; its cgroup directory."""
        self.kubelet.start_container(pod.name, container, pod.namespace)
        return str(self.kubelet.started_container(pod.name, container, pod.namespace).cgroup)

    def gpu_of(self, pod: Pod, resource: str = GPU) -> int:
        device = self.kubelet.pod(pod.name, pod.namespace).containers["main"][resource].device_ids[0]
        uuid = device.split("::")[0]
        return next(gpu.index for gpu in self.driver.gpus if gpu.uuid == uuid)

    def report(self) -> list[dict[str, object]]:
        assert self.agent is not None and self.agent._memlimits is not None
        return self.agent._memlimits.report()["containers"]


@pytest.fixture
def make_node(
    sim_node: Callable[[object], SimDriver], mps_bin: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., Node]]:
    monkeypatch.setenv("PATH", f"{mps_bin}{os.pathsep}{os.environ.get('PATH', '')}")
    nodes: list[Node] = []

    def make(spec: object = NEW, config: str = MPS, *, recheck: float = 30.0) -> Node:
        base = Path(tempfile.mkdtemp(prefix="ml", dir="/tmp"))
        (base / "config.yaml").write_text(config.replace("@BASE@", str(base)))
        kubelet = KubeletEmulator(
            base / "dp", base / "pr" / "kubelet.sock", cgroup_root=base / "cgroup", log_root=base / "log"
        )
        node = Node(sim_node(spec), base, kubelet)
        nodes.append(node)
        kubelet.start()
        node.start_agent(memory_limits=settings(node, recheck))
        return node

    yield make
    for node in nodes:
        node.stop()


def settings(node: Node, recheck: float = 30.0) -> MemoryLimitSettings:
    return MemoryLimitSettings(node.base / "cgroup", node.base / "log" / "containers", recheck)


def test_containers_are_held_to_their_replicas_memory_when_they_start(make_node: Callable[..., Node]) -> None:
    node = make_node()
    node.wait_registered(timeout=30, resources=(GPU, LARGE))
    kubelet = node.kubelet
    small = kubelet.create_pod("small", {"main": {GPU: 1}}, namespace="team-a")
    large = kubelet.create_pod("large", {"main": {LARGE: 1}}, namespace="team-a")
    assert node.limits() == {}  # admitted, not started: nothing to hold yet
    small_cgroup, large_cgroup = node.start(small), node.start(large)

    wait_until(lambda: len(node.limits()) == 2, 10, "both containers' limits")
    assert node.limits() == {small_cgroup: (10 * GIB, 10 * GIB), large_cgroup: (20 * GIB, 20 * GIB)}

    gpu = node.gpu_of(small)
    write_proc_entry(node.proc, 4100, kubelet.started_container("small", "main", "team-a"))  # its /proc/<pid>/cgroup
    node.driver.add_process(gpu, 4100, 6 * 1024, kind="mps_client", cgroup=small_cgroup)
    with pytest.raises(OutOfMemory, match="hard limit"):
        node.driver.allocate(4100, 5 * 1024)  # 11 GiB would be above its 10
    node.driver.allocate(4100, 4 * 1024)

    labels = {"pod": "small", "namespace": "team-a", "container": "main", "enforcement": "driver"}
    samples = node.wait_samples(  # a collection after the allocations
        lambda s: (
            maybe(s, "tessera_pod_gpu_memory_limit_used_bytes", **labels) == 10 * GIB
            and maybe(s, "tessera_pod_gpu_memory_used_bytes", pod="small") == 10 * GIB
        ),
        10,
        "the used-vs-limit series",
    )
    assert value(samples, "tessera_pod_gpu_memory_limit_bytes", **labels) == 10 * GIB
    assert value(samples, "tessera_pod_gpu_memory_request_bytes", **labels) == 10 * GIB
    assert value(samples, "tessera_pod_gpu_memory_limit_used_bytes", **labels) == 10 * GIB
    assert value(samples, "tessera_pod_gpu_memory_used_bytes", pod="small") == 10 * GIB  # the process is the pod's
    assert {row["pod"]: row["enforcement"] for row in node.report()} == {"small": "driver", "large": "driver"}

    node.driver.remove_process(4100)
    kubelet.delete_pod("large", "team-a")  # its cgroup goes, and its limit with it
    wait_until(lambda: [row["pod"] for row in node.report()] == ["small"], 10, "the deleted pod's row gone")
    assert node.limits() == {small_cgroup: (10 * GIB, 10 * GIB)}


def test_a_limit_changed_behind_the_agents_back_is_restored(make_node: Callable[..., Node]) -> None:
    node = make_node(recheck=0.3)
    node.wait_registered(timeout=30, resources=(GPU, LARGE))
    pod = node.kubelet.create_pod("victim", {"main": {GPU: 1}})
    cgroup = node.start(pod)
    wait_until(lambda: node.limits().get(cgroup) == (10 * GIB, 10 * GIB), 10, "the limit")

    widened = pynvml.c_nvmlSetMemoryLimits_v1_t()  # someone with root on the node lifts it
    widened.nameSpace, widened.softLimit, widened.hardLimit = cgroup.encode(), 0, 70 * GIB
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(node.gpu_of(pod))
        pynvml.nvmlDeviceSetMemoryLimits_v1(handle, widened)
    finally:
        pynvml.nvmlShutdown()
    assert node.limits()[cgroup] == (0, 70 * GIB)
    wait_until(lambda: node.limits().get(cgroup) == (10 * GIB, 10 * GIB), 10, "the limit restored")
    assert node.agent is not None and node.agent._memlimits is not None
    assert node.agent._memlimits.repaired_total >= 1


def test_limits_are_found_and_kept_after_an_agent_restart(make_node: Callable[..., Node]) -> None:
    node = make_node()
    node.wait_registered(timeout=30, resources=(GPU, LARGE))
    pod = node.kubelet.create_pod("steady", {"main": {GPU: 1}})
    cgroup = node.start(pod)
    wait_until(lambda: node.limits().get(cgroup) == (10 * GIB, 10 * GIB), 10, "the limit")
    assert node.agent is not None and node.thread is not None
    node.agent.stop()
    node.thread.join(timeout=20)
    assert node.limits()[cgroup] == (10 * GIB, 10 * GIB)  # a stopping agent leaves the workload held
    sets = node.driver.memory_limit_sets

    node.start_agent(memory_limits=settings(node))
    wait_until(lambda: [r["applied"] for r in node.report()] == [True], 15, "the limit found by the new agent")
    assert node.limits()[cgroup] == (10 * GIB, 10 * GIB)
    assert node.driver.memory_limit_sets == sets  # read back and kept, not set again


def not_root(driver: SimDriver) -> None:
    driver.set_caller_root(False)


def refuses_the_size(driver: SimDriver) -> None:
    driver.inject_error("nvmlDeviceSetMemoryLimits_v1", Return.ERROR_INVALID_ARGUMENT, times=None)


@pytest.mark.parametrize(
    ("spec", "change", "reason"),
    [(OLD, None, "r615"), (NEW, not_root, "NO_PERMISSION"), (NEW, refuses_the_size, "INVALID_ARGUMENT")],
    ids=["driver-without-the-call", "agent-not-root", "driver-refuses-the-size"],
)
def test_without_the_driver_the_mps_server_holds_the_size_and_says_so(
    make_node: Callable[..., Node], spec: object, change: Callable[[SimDriver], None] | None, reason: str
) -> None:
    node = make_node(spec)
    if change is not None:
        change(node.driver)
    node.wait_registered(timeout=30, resources=(GPU, LARGE))
    pod = node.kubelet.create_pod("fallback", {"main": {GPU: 1}})
    node.start(pod)
    wait_until(lambda: node.report() and node.report()[0]["enforcement"] == "mps", 10, "the MPS fallback reported")
    row = node.report()[0]
    assert reason in str(row["reason"]) and row["limit_bytes"] == 10 * GIB and not row["applied"]
    assert node.limits() == {}
    samples = node.wait_samples(
        lambda s: series(s, "tessera_pod_gpu_memory_limit_bytes", pod="fallback"), 10, "the fallback's limit series"
    )
    assert value(samples, "tessera_pod_gpu_memory_limit_bytes", pod="fallback", enforcement="mps") == 10 * GIB
    assert node.agent is not None and node.agent.responsive()


def test_mig_devices_fall_back_to_their_mps_server(make_node: Callable[..., Node]) -> None:
    node = make_node(MIG, MIG_MPS)
    node.wait_registered(timeout=30, resources=(MIG_RESOURCE,))
    pod = node.kubelet.create_pod("on-mig", {"main": {MIG_RESOURCE: 1}})
    node.start(pod)
    wait_until(lambda: node.report() and node.report()[0]["enforcement"] == "mps", 10, "the MIG fallback reported")
    half = node.driver.gpus[0].mig_devices()[0][0].profile.memory_mib // 2 << 20  # each of 2 replicas of 3g.40gb
    assert "MIG" in str(node.report()[0]["reason"]) and node.report()[0]["limit_bytes"] == half
    assert node.limits() == {}
