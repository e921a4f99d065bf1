"""Telemetry end to end: an in-process agent, the kubelet emulator with PodResources, scrapes over real HTTP.

The node is DGX-A100-like: GPU 0 in MIG mode (3g.40gb + 2x 1g.10gb, ``mixed``), GPUs 1 and 2 full and
time-sliced four ways. Pods are created through the emulator (so PodResources and the device-manager
checkpoint are the kubelet's), GPU processes are placed in the simulated driver, and a fake ``/proc`` tree
gives each process the cgroup of its pod. Every assertion reads the Prometheus text the agent serves.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.agent import Agent, AgentOptions
from agent.sim.kubelet import KubeletEmulator, Pod
from agent.sim.nvml.codes import Return
from agent.sim.nvml.driver import SimDriver
from agent.status_client import fetch_status
from agent.status_report import render_idle
from agent.telemetry.service import TelemetrySettings

HOST = "dgx-a100-7"
GPU = "nvidia.com/gpu"
SMALL = "nvidia.com/mig-1g.10gb"
LARGE = "nvidia.com/mig-3g.40gb"
MIB = 1 << 20
NODE = {
    "name": "dgx-a100-telemetry",
    "nvlink": "nvswitch",
    "numa_nodes": 2,
    "gpus": [
        {"model": "A100-SXM4-80GB", "mig": {"instances": ["3g.40gb", "1g.10gb", "1g.10gb"]}},
        {"model": "A100-SXM4-80GB", "count": 2},
    ],
}
MIG_LAYOUT = """
migLayout:
  config: dgx-mixed
  layouts:
    version: v1
    mig-configs:
      dgx-mixed:
        - devices: [0]
          mig-enabled: true
          mig-devices: {3g.40gb: 1, 1g.10gb: 2}
        - devices: [1, 2]
          mig-enabled: false
"""
TIME_SLICED = (
    "version: v1\nflags: {migStrategy: mixed}\n"
    "sharing:\n  timeSlicing:\n    resources:\n      - name: nvidia.com/gpu\n        replicas: 4\n" + MIG_LAYOUT
)
MPS_SHARED = (
    "version: v1\nflags: {migStrategy: mixed, mpsRoot: '@BASE@/mps'}\n"
    "sharing:\n  mps:\n    resources:\n      - name: nvidia.com/gpu\n        replicas: 4\n" + MIG_LAYOUT
)
DOCS = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
TELEMETRY_DOCS = DOCS.with_name("telemetry.md")  # the per-pod metrics (issue 17); its rows win over metrics.md's

Samples = dict[str, list[tuple[dict[str, str], float]]]


def cgroup_line(uid: str) -> str:
    """What /proc/<pid>/cgroup says for a container of a BestEffort pod (cgroup v2, systemd driver, containerd)."""
    slice_uid = uid.replace("-", "_")
    return (
        "0::/kubepods.slice/kubepods-besteffort.slice/"
        f"kubepods-besteffort-pod{slice_uid}.slice/cri-containerd-abc123.scope\n"
    )


def stat_line(pid: int, started: float | None = None) -> str:
    """``/proc/<pid>/stat`` of a process that started at ``started`` (the boot clock; now by default)."""
    ticks = int((time.clock_gettime(time.CLOCK_BOOTTIME) if started is None else started) * os.sysconf("SC_CLK_TCK"))
    return f"{pid} (python3 worker) S 1 {pid} {pid} 0 -1 4194560 " + "0 " * 12 + f"{ticks} 1000 10\n"


def wait_until(predicate: Callable[[], object], timeout: float, what: str) -> object:
    """Poll ``predicate`` until it returns something truthy (returned) or the deadline passes."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)


@dataclass
class TelemetryNode:
    """A simulated node, the kubelet emulator and an in-process agent serving metrics on a free loopback port."""

    driver: SimDriver
    base: Path
    kubelet: KubeletEmulator
    agent: Agent | None = None
    thread: threading.Thread | None = None
    proc: Path = field(init=False)

    def __post_init__(self) -> None:
        self.proc = self.base / "proc"
        self.proc.mkdir(exist_ok=True)

    @classmethod
    def create(
        cls, driver: SimDriver, config: str, *, pod_resources: bool = True, cgroups: bool = False
    ) -> TelemetryNode:
        """``@BASE@`` in ``config`` becomes the node's temporary directory (for an MPS root, say). ``cgroups``: the
        kubelet makes started containers cgroup directories and log links under it (``cgroup``, ``log``)."""
        base = Path(tempfile.mkdtemp(prefix="tm", dir="/tmp"))  # short: unix socket paths are limited
        (base / "config.yaml").write_text(config.replace("@BASE@", str(base)))
        roots = {"cgroup_root": base / "cgroup", "log_root": base / "log"} if cgroups else {}
        kubelet = KubeletEmulator(base / "dp", base / "pr" / "kubelet.sock" if pod_resources else None, **roots)
        return cls(driver, base, kubelet)

    def start_agent(self, **options: object) -> Agent:
        settings = TelemetrySettings(
            hostname=HOST, metrics_address="127.0.0.1:0", interval=0.2, proc_root=self.proc,
            status_socket=self.base / "status.sock",
        )  # fmt: skip
        self.agent = Agent(
            AgentOptions(
                device_plugin_dir=self.base / "dp",
                pod_resources_socket=self.base / "pr" / "kubelet.sock",
                config_path=self.base / "config.yaml",
                telemetry=settings,
                **options,
            )
        )
        self.thread = threading.Thread(target=self.agent.run, name="agent-under-test")
        self.thread.start()
        assert self.agent.started.wait(20)
        agent = self.agent
        wait_until(lambda: agent.metrics_port is not None, 15, "the metrics endpoint (started after registration)")
        return agent

    def wait_registered(self, timeout: float = 15, resources: tuple[str, ...] = (GPU, SMALL, LARGE)) -> None:
        """Until ``resources`` are advertised, everything advertised is registered, and the kubelet has its devices.

        The Register call returns before the plugin's first ListAndWatch message reaches the kubelet; a pod created
        in between is refused (capacity 0), as a real kubelet would refuse it."""
        agent, kubelet = self.agent, self.kubelet
        assert agent is not None

        def done() -> bool:
            status = agent.status
            return (
                set(resources) <= status.registered
                and status.registered == set(status.resources)
                and status.registered <= set(kubelet.resources())
            )

        wait_until(done, timeout, f"{', '.join(resources)} registered")

    def stop(self) -> None:
        if self.agent is not None and self.thread is not None:
            self.agent.stop()
            self.thread.join(timeout=20)
        self.kubelet.stop()
        for pid_file in self.base.glob("mps/**/nvidia-cuda-mps-control.pid"):  # MPS daemons outlive agents
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
        shutil.rmtree(self.base, ignore_errors=True)

    # ----- HTTP -----------------------------------------------------------------------------------------

    @property
    def port(self) -> int:
        assert self.agent is not None and self.agent._telemetry is not None
        return self.agent.metrics_port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str) -> tuple[int, str, str]:
        """(status, content type, body) of a GET on the metrics server."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=5) as response:
                return response.status, response.headers["Content-Type"], response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.headers["Content-Type"], error.read().decode()

    def text(self) -> str:
        status, _, body = self.get("/metrics")
        assert status == 200
        return body

    def scrape(self) -> Samples:
        """Sample name -> [(labels, value)], parsed with prometheus_client's parser."""
        samples: Samples = {}
        for family in text_string_to_metric_families(self.text()):
            for sample in family.samples:
                samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
        return samples

    def wait_samples(self, predicate: Callable[[Samples], object], timeout: float, what: str) -> Samples:
        """Scrape until ``predicate(samples)`` holds (``wait_for_samples``); the collection runs every 0.2 s."""
        return wait_for_samples(self.scrape, predicate, timeout, what)

    # ----- pods and processes -----------------------------------------------------------------------------

    def run_process(
        self,
        pod: Pod,
        gpu: int,
        pid: int,
        used_mib: int,
        *,
        mig_uuid: str | None = None,
        kind: str = "compute",
        sm: int = 0,
        memory: int = 0,
        cgroup: str | None = None,
    ) -> None:
        """A process of ``pod`` on the GPU: in the driver, and in the fake /proc with the pod's cgroup and its
        start time; it keeps the GPU's SM and memory controller ``sm`` and ``memory`` percent busy. ``cgroup``: its
        container's cgroup directory, where the driver counts it against the container's memory limit."""
        self.proc_entry(pid, cgroup_line(pod.uid))
        self.driver.add_process(gpu, pid, used_mib, mig_uuid=mig_uuid, kind=kind, sm=sm, memory=memory, cgroup=cgroup)

    def proc_entry(self, pid: int, cgroup: str) -> None:
        """``/proc/<pid>``: its cgroup, and its stat with a start time of now (replacing an earlier process's)."""
        entry = self.proc / str(pid)
        entry.mkdir(exist_ok=True)
        (entry / "cgroup").write_text(cgroup)
        (entry / "stat").write_text(stat_line(pid))


def wait_for_samples(
    scrape: Callable[[], Samples], predicate: Callable[[Samples], object], timeout: float, what: str
) -> Samples:
    """Scrape until ``predicate(samples)`` holds and return those samples. A scrape that has not what the predicate
    needs is "not yet", polled again until ``timeout``: an empty one (nothing collected yet, where a predicate such
    as "no series of the deleted pod" would hold vacuously) and one without a series ``value`` reads (``NoSeries``).
    The ``TimeoutError`` names ``what`` and what the last scrape lacked."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape()
        lacking = "" if samples else "it was empty"
        if not lacking:
            try:
                if predicate(samples):
                    return samples
            except NoSeries as missing:
                lacking = str(missing)
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"timed out after {timeout:g} s waiting for {what}" + (f"; {lacking}" if lacking else "")
            )
        time.sleep(0.05)


class NoSeries(LookupError):
    """The scrape has no series of that name and labels (not collected yet, or gone)."""


def series(samples: Samples, name: str, **match: str) -> list[tuple[dict[str, str], float]]:
    return [
        (labels, value) for labels, value in samples.get(name, []) if all(labels.get(k) == v for k, v in match.items())
    ]


def value(samples: Samples, name: str, **match: str) -> float:
    """The value of the one series of ``name`` matching the labels; ``NoSeries`` when there is none."""
    found = series(samples, name, **match)
    if not found:
        raise NoSeries(f"no series {name}{match or ''} in the scrape")
    assert len(found) == 1, f"{len(found)} series {name}{match} where one was expected: {found}"
    return found[0][1]


def maybe(samples: Samples, name: str, **match: str) -> float | None:
    """The one series' value, or None while there is none (yet)."""
    found = series(samples, name, **match)
    return found[0][1] if len(found) == 1 else None


def held_device(pod: Pod, container: str, resource: str) -> str:
    (device,) = pod.containers[container][resource].device_ids
    return device


def gpu_of(node: TelemetryNode, device_id: str) -> int:
    """The GPU index of an advertised device (a replica ``GPU-…::n`` or a MIG UUID)."""
    index, _, _ = node.driver.find_uuid(device_id.split("::")[0])
    return index


@pytest.fixture
def make_node(sim_node) -> Iterator[Callable[..., TelemetryNode]]:
    nodes: list[TelemetryNode] = []

    def make(config: str = TIME_SLICED, *, pod_resources: bool = True, start_kubelet: bool = True) -> TelemetryNode:
        node = TelemetryNode.create(sim_node(NODE), config, pod_resources=pod_resources)
        nodes.append(node)
        if start_kubelet:
            node.kubelet.start()
        return node

    yield make
    for node in nodes:
        node.stop()


@pytest.fixture
def node(make_node) -> TelemetryNode:
    node = make_node()
    node.start_agent()
    node.wait_registered()
    return node


# ----- the documented metrics ---------------------------------------------------------------------------------


def documented() -> dict[str, tuple[str, list[str]]]:
    """The metric tables of docs/metrics.md and docs/telemetry.md: exposed name -> (type, labels in order)."""
    rows = {}
    for line in DOCS.read_text().splitlines() + TELEMETRY_DOCS.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and cells[0].startswith("`tessera_"):
            rows[cells[0].strip("`")] = (cells[1], re.findall(r"`([^`]+)`", cells[2]))
    return rows


def test_the_exposition_matches_docs_and_uses_dcgm_label_names(node: TelemetryNode) -> None:
    kubelet = node.kubelet
    status, content_type, _ = node.get("/metrics")
    assert status == 200 and content_type.startswith("text/plain; version=0.0.4")
    pod = kubelet.create_pod("trainer-0", {"main": {GPU: 1}}, namespace="team-a")
    node.wait_samples(lambda s: series(s, "tessera_device_allocated", pod="trainer-0"), 5, "the pod's device")

    docs = documented()
    assert len(docs) >= 20, "the metric table of docs/metrics.md was not found"
    families = list(text_string_to_metric_families(node.text()))
    exposed = {f.name + ("_total" if f.type == "counter" else ""): f for f in families}
    assert set(exposed) == set(docs), "every exposed metric is documented, and every documented one is exposed"
    for name, family in exposed.items():
        kind, labels = docs[name]
        assert family.type == kind, name
        for sample in family.samples:  # a histogram's buckets add their le
            extra = {"le"} if sample.name.endswith("_bucket") and family.type == "histogram" else set()
            assert set(sample.labels) - extra == set(labels), (name, sample.labels)

    samples = node.scrape()
    gpu_labels = {"gpu", "UUID", "modelName", "Hostname"}
    assert {frozenset(labels) for labels, _ in samples["tessera_gpu_up"]} == {frozenset(gpu_labels)}
    mig = samples["tessera_mig_memory_total_bytes"]
    assert {(labels["GPU_I_PROFILE"], labels["gpu"]) for labels, _ in mig} == {("3g.40gb", "0"), ("1g.10gb", "0")}
    assert len(mig) == 3 and all(labels["GPU_I_ID"].isdigit() for labels, _ in mig)
    assert all(labels["Hostname"] == HOST and labels["modelName"] == "NVIDIA A100-SXM4-80GB" for labels, _ in mig)
    allocated = samples["tessera_device_allocated"]
    assert {frozenset(labels) for labels, _ in allocated} == {
        frozenset(
            {*gpu_labels - {"modelName"}, "GPU_I_PROFILE", "pod", "namespace", "container", "resource", "device_id"}
        )
    }
    (mine,) = [labels for labels, v in allocated if v == 1]
    assert mine["device_id"] == held_device(pod, "main", GPU)
    assert (mine["pod"], mine["namespace"], mine["container"], mine["resource"]) == ("trainer-0", "team-a", "main", GPU)
    assert value(samples, "tessera_mig_config_state", state="success") == 1
    assert value(samples, "tessera_config_valid") == 1
    assert value(samples, "tessera_resource_registered", resource=SMALL) == 1


def test_pods_from_the_emulator_label_their_devices(node: TelemetryNode) -> None:
    kubelet = node.kubelet
    shared = kubelet.create_pod("web", {"server": {GPU: 1}, "sidecar": {}}, namespace="shop")
    small = kubelet.create_pod("notebook", {"jupyter": {SMALL: 1}}, namespace="research")
    large = kubelet.create_pod("finetune", {"trainer": {LARGE: 1}}, namespace="research")

    samples = node.wait_samples(
        lambda s: len([v for _, v in s.get("tessera_device_allocated", []) if v == 1]) == 3, 5, "three held devices"
    )
    expected = {
        (held_device(shared, "server", GPU), GPU, "web", "shop", "server"),
        (held_device(small, "jupyter", SMALL), SMALL, "notebook", "research", "jupyter"),
        (held_device(large, "trainer", LARGE), LARGE, "finetune", "research", "trainer"),
    }
    held = {
        (labels["device_id"], labels["resource"], labels["pod"], labels["namespace"], labels["container"])
        for labels, v in samples["tessera_device_allocated"]
        if v == 1
    }
    assert held == expected
    assert "::" in held_device(shared, "server", GPU)  # a time-sliced replica, as NVIDIA's plugin names them
    small_labels = series(samples, "tessera_device_allocated", pod="notebook")[0][0]
    assert small_labels["GPU_I_PROFILE"] == "1g.10gb" and small_labels["gpu"] == "0"
    free = [labels for labels, v in samples["tessera_device_allocated"] if v == 0]
    assert free and all(labels["pod"] == labels["namespace"] == labels["container"] == "" for labels in free)
    assert value(samples, "tessera_resource_devices", resource=GPU, state="allocated") == 1
    assert value(samples, "tessera_resource_devices", resource=GPU, state="total") == 8
    assert value(samples, "tessera_resource_devices", resource=SMALL, state="total") == 2

    kubelet.delete_pod("web", namespace="shop")
    node.wait_samples(
        lambda s: not series(s, "tessera_device_allocated", pod="web"), 5, "the deleted pod's labels gone"
    )


def test_per_pod_memory_on_a_time_sliced_gpu(node: TelemetryNode) -> None:
    kubelet = node.kubelet
    pods = [kubelet.create_pod(f"worker-{n}", {"main": {GPU: 1}}, namespace="batch") for n in range(3)]
    by_gpu: dict[int, list[Pod]] = {}
    for pod in pods:
        by_gpu.setdefault(gpu_of(node, held_device(pod, "main", GPU)), []).append(pod)
    shared_gpu, pair = next((g, p) for g, p in by_gpu.items() if len(p) == 2)  # spread: three pods, two GPUs
    first, second = pair
    node.run_process(first, shared_gpu, 4242, 3000)
    node.run_process(second, shared_gpu, 4343, 5000)
    node.run_process(second, shared_gpu, 4344, 1000)  # a second process of the same pod adds up
    node.driver.add_process(shared_gpu, 4545, 700)  # no /proc entry (a host process): not any pod's
    notebook = kubelet.create_pod("notebook", {"jupyter": {SMALL: 1}}, namespace="research")
    mig_uuid = held_device(notebook, "jupyter", SMALL)
    node.run_process(notebook, 0, 5151, 2048, mig_uuid=mig_uuid)

    samples = node.wait_samples(
        lambda s: len(s.get("tessera_pod_gpu_memory_used_bytes", [])) == 3, 5, "per-pod memory of three pods"
    )
    per_pod = {
        (labels["pod"], labels["namespace"], labels["container"], labels["gpu"]): v
        for labels, v in samples["tessera_pod_gpu_memory_used_bytes"]
    }
    assert per_pod == {
        (first.name, "batch", "main", str(shared_gpu)): 3000 * MIB,
        (second.name, "batch", "main", str(shared_gpu)): 6000 * MIB,
        ("notebook", "research", "jupyter", "0"): 2048 * MIB,
    }
    # the GPU's own numbers still count every process, the host one included
    assert value(samples, "tessera_gpu_memory_used_bytes", gpu=str(shared_gpu)) == 9700 * MIB
    assert value(samples, "tessera_gpu_processes", gpu=str(shared_gpu)) == 4
    assert value(samples, "tessera_mig_memory_used_bytes", device_id=mig_uuid) == 2048 * MIB
    assert value(samples, "tessera_mig_processes", device_id=mig_uuid) == 1


def test_mps_clients_are_attributed_to_their_pods_as_a_real_driver_lists_them(node: TelemetryNode) -> None:
    """A real driver lists an MPS server among the compute processes and its clients only in the MPS list."""
    kubelet = node.kubelet
    pods = [kubelet.create_pod(f"mps-{n}", {"main": {GPU: 1}}, namespace="infer") for n in range(3)]
    by_gpu: dict[int, list[Pod]] = {}
    for pod in pods:
        by_gpu.setdefault(gpu_of(node, held_device(pod, "main", GPU)), []).append(pod)
    gpu, (first, second) = next((g, p) for g, p in by_gpu.items() if len(p) == 2)
    node.driver.add_process(gpu, 900, 300, kind="mps_server")  # the server: no pod's cgroup
    node.run_process(first, gpu, 4242, 3000, kind="mps_client")
    node.run_process(second, gpu, 4343, 5000, kind="mps_client")

    samples = node.wait_samples(
        lambda s: len(s.get("tessera_pod_gpu_memory_used_bytes", [])) == 2, 5, "per-pod memory of the MPS clients"
    )
    per_pod = {labels["pod"]: v for labels, v in samples["tessera_pod_gpu_memory_used_bytes"]}
    assert per_pod == {first.name: 3000 * MIB, second.name: 5000 * MIB}
    assert value(samples, "tessera_gpu_processes", gpu=str(gpu)) == 3


def shared_pair(node: TelemetryNode, pods: list[Pod]) -> tuple[int, Pod, Pod, int, Pod]:
    """Three pods holding one replica each, spread over GPUs 1 and 2: (shared GPU, its two pods, other GPU, its pod)."""
    by_gpu: dict[int, list[Pod]] = {}
    for pod in pods:
        by_gpu.setdefault(gpu_of(node, held_device(pod, "main", GPU)), []).append(pod)
    shared, pair = next((g, p) for g, p in by_gpu.items() if len(p) == 2)
    other, (single,) = next((g, p) for g, p in by_gpu.items() if len(p) == 1)
    return shared, pair[0], pair[1], other, single


def test_idle_is_per_pod_a_silent_pod_next_to_a_busy_one_is_idle(node: TelemetryNode) -> None:
    kubelet, driver = node.kubelet, node.driver
    pods = [kubelet.create_pod(f"share-{n}", {"main": {GPU: 1}}, namespace="ml") for n in range(3)]
    shared, busy, quiet, other, lonely = shared_pair(node, pods)
    node.run_process(busy, shared, 5100, 1000, sm=60, memory=20)
    node.run_process(quiet, shared, 5200, 3000)  # holds memory, computes nothing
    node.proc_entry(5300, "0::/system.slice/inference.service\n")  # a host process keeps the lonely pod's GPU busy
    driver.add_process(other, 5300, 500, sm=80)
    working_mig = kubelet.create_pod("mig-working", {"main": {SMALL: 1}})
    node.run_process(working_mig, 0, 6161, 1024, mig_uuid=held_device(working_mig, "main", SMALL))
    empty_mig = kubelet.create_pod("mig-empty", {"main": {LARGE: 1}})

    name = "tessera_partition_allocated_idle_seconds_total"
    samples = node.wait_samples(
        lambda s: all(series(s, name, pod=p) and value(s, name, pod=p) >= 1.0 for p in (quiet.name, lonely.name)),
        10,
        "1 idle second for the quiet pod and the lonely one",
    )
    # the whole GPUs are busy, yet only the pod whose own process works is
    assert value(samples, "tessera_gpu_utilization_percent", gpu=str(shared)) == 60
    assert value(samples, "tessera_gpu_utilization_percent", gpu=str(other)) == 80
    assert value(samples, name, pod=busy.name) == 0
    pod_util = "tessera_pod_gpu_utilization_percent"
    assert value(samples, pod_util, pod=busy.name) == 60
    assert value(samples, "tessera_pod_gpu_memory_copy_utilization_percent", pod=busy.name) == 20
    assert value(samples, pod_util, pod=quiet.name) == 0 and value(samples, pod_util, pod=lonely.name) == 0
    assert value(samples, "tessera_pod_device_idle", pod=quiet.name) == 1
    assert value(samples, "tessera_pod_device_idle", pod=busy.name) == 0
    assert value(samples, "tessera_pod_device_memory_used_bytes", pod=quiet.name) == 3000 * MIB
    ((labels, _),) = series(samples, pod_util, pod=busy.name)
    assert labels["device_id"] == held_device(busy, "main", GPU) and labels["device"].startswith("nvidia")
    assert labels["container"] == "main" and labels["GPU_I_PROFILE"] == ""
    # the host process is nobody's, and says so
    assert value(samples, "tessera_unattributed_gpu_processes", gpu=str(other), reason="no_pod") == 1
    assert value(samples, "tessera_unattributed_gpu_utilization_percent", gpu=str(other), reason="no_pod") == 80
    # a MIG device has no per-process utilization: no process on it counts as idle, a process as busy
    assert value(samples, name, pod=empty_mig.name) > 0
    assert value(samples, name, pod=working_mig.name) == 0
    assert not series(samples, pod_util, pod=working_mig.name), "unknown is not 0"
    assert value(samples, "tessera_pod_device_memory_used_bytes", pod=working_mig.name) == 1024 * MIB
    assert value(samples, "tessera_gpu_process_utilization_available", gpu="0", reason="MIG") == 0
    assert value(samples, "tessera_gpu_process_utilization_available", gpu=str(shared)) == 1
    # GPU-seconds: each replica of a 4-way time-sliced GPU is a quarter of a GPU, a MIG device its share of the memory
    ml = value(samples, "tessera_namespace_allocated_idle_gpu_seconds_total", namespace="ml")
    assert ml == pytest.approx(0.25 * (value(samples, name, pod=quiet.name) + value(samples, name, pod=lonely.name)))
    default = value(samples, "tessera_namespace_allocated_idle_gpu_seconds_total", namespace="default")
    large = value(samples, "tessera_mig_memory_total_bytes", device_id=held_device(empty_mig, "main", LARGE))
    share = large / value(samples, "tessera_gpu_memory_total_bytes", gpu="0")
    assert 0.45 < share <= 0.5 and default == pytest.approx(share * value(samples, name, pod=empty_mig.name))
    node_hours = value(samples, "tessera_node_allocated_idle_gpu_seconds_total")
    assert node_hours == pytest.approx(ml + default)

    driver.set_process_utilization(5200, 45)  # the quiet pod starts working: its idle time stops growing
    later = node.wait_samples(lambda s: value(s, pod_util, pod=quiet.name) == 45, 5, "the quiet pod at 45 %")
    before = value(later, name, pod=quiet.name)
    collector = node.agent._telemetry.collector
    seen = collector.last.collected_at
    wait_until(lambda: collector.last.collected_at > seen + 0.5, 5, "two more collections")
    assert value(node.scrape(), name, pod=quiet.name) == before


def test_an_xid_is_counted_and_turns_the_devices_unhealthy(node: TelemetryNode) -> None:
    node.driver.inject_xid(1, 48)
    samples = node.wait_samples(
        lambda s: series(s, "tessera_gpu_xid_errors_total", gpu="1", xid="48"), 5, "the XID counted"
    )
    ((labels, count),) = series(samples, "tessera_gpu_xid_errors_total")
    assert count == 1 and labels["UUID"] == node.driver.gpus[1].uuid and labels["Hostname"] == HOST
    samples = node.wait_samples(
        lambda s: all(v == 0 for _, v in series(s, "tessera_device_healthy", gpu="1")), 5, "GPU 1 unhealthy"
    )
    assert len(series(samples, "tessera_device_healthy", gpu="1")) == 4
    assert all(v == 1 for labels, v in samples["tessera_device_healthy"] if labels["gpu"] != "1")
    assert value(samples, "tessera_resource_devices", resource=GPU, state="healthy") == 4
    assert value(samples, "tessera_gpu_up", gpu="1") == 1  # unhealthy for pods, but NVML still answers

    node.driver.inject_xid(1, 48)
    node.wait_samples(lambda s: value(s, "tessera_gpu_xid_errors_total", gpu="1", xid="48") == 2, 5, "two XIDs")


def test_healthz_and_readyz_follow_the_kubelet(make_node) -> None:
    node = make_node(start_kubelet=False)
    node.start_agent()
    assert node.get("/healthz")[0] == 200
    status, _, body = node.get("/readyz")
    assert status == 503 and "waiting for the kubelet" in body
    node.wait_samples(lambda s: "tessera_gpu_up" in s, 5, "metrics before the kubelet")  # served meanwhile

    node.kubelet.start()
    wait_until(lambda: node.get("/readyz")[0] == 200, 15, "/readyz 200 after registration")
    assert "3 resources registered" in node.get("/readyz")[2]
    assert node.get("/healthz") == (200, "text/plain; charset=utf-8", "ok\n")
    assert node.get("/nope")[0] == 404


def test_without_pod_resources_metrics_are_served_without_pod_labels_and_one_warning(
    make_node, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="agent.telemetry.collector")
    node = make_node(pod_resources=False)
    node.start_agent()
    node.wait_registered()
    node.kubelet.create_pod("unseen", {"main": {GPU: 1}})
    collector = node.agent._telemetry.collector
    first = collector.last.collected_at
    wait_until(lambda: collector.last.collected_at and collector.last.collected_at > first + 1.0, 5, "5+ collections")
    for _ in range(3):
        samples = node.scrape()
        assert len(samples["tessera_device_allocated"]) == 8 + 2 + 1
        assert all(v == 0 and labels["pod"] == "" for labels, v in samples["tessera_device_allocated"])
        assert len(samples["tessera_gpu_up"]) == 3
        assert not samples.get("tessera_pod_gpu_memory_used_bytes")
    warnings = [r for r in caplog.records if "without pod labels" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "PodResources" in warnings[0].getMessage()


def test_a_lost_gpu_reports_down_and_the_others_keep_their_series(node: TelemetryNode) -> None:
    node.driver.lose_gpu(2)
    samples = node.wait_samples(lambda s: value(s, "tessera_gpu_up", gpu="2") == 0, 10, "GPU 2 down")
    assert value(samples, "tessera_gpu_up", gpu="0") == 1 and value(samples, "tessera_gpu_up", gpu="1") == 1
    for name in ("tessera_gpu_memory_total_bytes", "tessera_gpu_memory_used_bytes", "tessera_gpu_processes"):
        assert {labels["gpu"] for labels, _ in samples[name]} == {"0", "1"}, name
    assert {labels["gpu"] for labels, _ in samples["tessera_gpu_utilization_percent"]} == {"1"}
    assert len(samples["tessera_mig_memory_total_bytes"]) == 3  # the MIG GPU is untouched
    samples = node.wait_samples(
        lambda s: all(v == 0 for _, v in series(s, "tessera_device_healthy", gpu="2")), 5, "GPU 2's devices unhealthy"
    )
    assert all(v == 1 for _, v in series(samples, "tessera_device_healthy", gpu="1"))
    assert value(samples, "tessera_gpu_xid_errors_total", gpu="2", xid="79") == 1


# ----- faults: never a crash, never a wrong pod ----------------------------------------------------------------


def test_a_pid_reused_between_listing_and_reading_is_nobodys(node: TelemetryNode) -> None:
    """Pod A's process exits right after NVML lists it and its PID goes to a new process of pod B, which holds
    a replica of the same GPU: reading /proc then names pod B, but the start time gives the newcomer away."""
    kubelet, driver = node.kubelet, node.driver
    pods = [kubelet.create_pod(f"reuse-{n}", {"main": {GPU: 1}}, namespace="ml") for n in range(3)]
    shared, first, second, _, _ = shared_pair(node, pods)
    node.run_process(first, shared, 7000, 5000, sm=50)
    node.run_process(second, shared, 7001, 1000)
    node.wait_samples(lambda s: series(s, "tessera_pod_device_processes", pod=first.name), 5, "A's process")

    def reuse() -> None:  # runs between NVML's listing and the agent's /proc read
        (node.proc / "7000" / "cgroup").write_text(cgroup_line(second.uid))
        (node.proc / "7000" / "stat").write_text(stat_line(7000, time.clock_gettime(time.CLOCK_BOOTTIME) + 1))

    driver.exit_after_listing(7000, then=reuse)
    samples = node.wait_samples(
        lambda s: series(s, "tessera_unattributed_gpu_processes", reason="pid_reused"), 5, "the reused PID"
    )
    assert value(samples, "tessera_unattributed_gpu_memory_used_bytes", reason="pid_reused") == 5000 * MIB
    assert value(samples, "tessera_pod_device_memory_used_bytes", pod=second.name) == 1000 * MIB, "not A's memory"
    assert value(samples, "tessera_pod_device_processes", pod=second.name) == 1


def test_a_process_gone_before_its_proc_entry_is_read_is_counted_apart(node: TelemetryNode) -> None:
    kubelet, driver = node.kubelet, node.driver
    pod = kubelet.create_pod("short-lived", {"main": {GPU: 1}}, namespace="ml")
    gpu = gpu_of(node, held_device(pod, "main", GPU))
    node.run_process(pod, gpu, 7100, 2000, sm=30)
    node.wait_samples(
        lambda s: series(s, "tessera_pod_device_processes", pod=pod.name, device_id=held_device(pod, "main", GPU)),
        5,
        "its process",
    )
    driver.exit_after_listing(7100, then=lambda: shutil.rmtree(node.proc / "7100"))
    samples = node.wait_samples(
        lambda s: series(s, "tessera_unattributed_gpu_processes", reason="exited"), 5, "the exited process"
    )
    assert value(samples, "tessera_unattributed_gpu_memory_used_bytes", reason="exited") == 2000 * MIB
    assert value(samples, "tessera_pod_device_processes", pod=pod.name) == 0
    assert value(samples, "tessera_gpu_up", gpu=str(gpu)) == 1


def test_when_nvml_has_no_per_process_utilization_the_series_say_so_and_nobody_is_called_idle(
    node: TelemetryNode, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="agent.telemetry.pods")
    kubelet, driver = node.kubelet, node.driver
    pods = [kubelet.create_pod(f"ns-{n}", {"main": {GPU: 1}}, namespace="ml") for n in range(3)]
    shared, working, empty, _, _ = shared_pair(node, pods)
    node.run_process(working, shared, 7200, 1000)  # does nothing, but NVML cannot tell
    driver.inject_error("nvmlDeviceGetProcessUtilization", Return.ERROR_NOT_SUPPORTED, times=None, gpu_index=shared)
    name = "tessera_partition_allocated_idle_seconds_total"
    samples = node.wait_samples(
        lambda s: series(s, name, pod=empty.name) and value(s, name, pod=empty.name) >= 1.0, 10, "the empty pod idle"
    )
    assert value(samples, "tessera_gpu_process_utilization_available", gpu=str(shared), reason="NOT_SUPPORTED") == 0
    assert not series(samples, "tessera_pod_gpu_utilization_percent", pod=working.name), "unknown, not 0"
    assert value(samples, "tessera_pod_device_idle", pod=working.name) == 0, "a process NVML cannot measure is busy"
    assert value(samples, name, pod=working.name) == 0
    assert value(samples, "tessera_pod_device_memory_used_bytes", pod=working.name) == 1000 * MIB
    node.wait_samples(lambda s: value(s, name, pod=empty.name) >= 1.5, 5, "more collections")
    driver.remove_process(7200)  # with no process left the GPU is not asked, and still said not to report it
    available = "tessera_gpu_process_utilization_available"
    processes = "tessera_pod_device_processes"
    samples = node.wait_samples(lambda s: value(s, processes, pod=working.name) == 0, 5, "the process gone")
    assert value(samples, available, gpu=str(shared), reason="NOT_SUPPORTED") == 0
    warnings = [r.getMessage() for r in caplog.records if "per-process GPU utilization" in r.getMessage()]
    assert len(warnings) == 1 and "NOT_SUPPORTED" in warnings[0], warnings


def test_an_mps_client_is_idle_or_busy_by_its_own_work(
    make_node, mps_bin: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", f"{mps_bin}{os.pathsep}{os.environ.get('PATH', '')}")
    node = make_node(MPS_SHARED)
    node.start_agent()
    node.wait_registered(timeout=30)
    kubelet, driver = node.kubelet, node.driver
    pods = [kubelet.create_pod(f"mps-{n}", {"main": {GPU: 1}}, namespace="infer") for n in range(3)]
    shared, busy, quiet, _, _ = shared_pair(node, pods)
    driver.add_process(shared, 900, 300, kind="mps_server", sm=70)  # the server's own line: nobody's
    node.proc_entry(900, "0::/system.slice/nvidia-mps.service\n")
    node.run_process(busy, shared, 7300, 3000, kind="mps_client", sm=70)
    node.run_process(quiet, shared, 7301, 2000, kind="mps_client")
    name = "tessera_partition_allocated_idle_seconds_total"
    samples = node.wait_samples(
        lambda s: series(s, name, pod=quiet.name) and value(s, name, pod=quiet.name) >= 1.0, 10, "the quiet client"
    )
    assert value(samples, name, pod=busy.name) == 0
    assert value(samples, "tessera_pod_gpu_utilization_percent", pod=busy.name) == 70
    assert value(samples, "tessera_pod_device_memory_used_bytes", pod=quiet.name) == 2000 * MIB
    assert value(samples, "tessera_unattributed_gpu_processes", gpu=str(shared), reason="no_pod") == 1


# ----- tessera status --idle ----------------------------------------------------------------------------------


def test_status_lists_each_allocated_device_with_its_pod_and_how_long_it_has_been_idle(node: TelemetryNode) -> None:
    kubelet = node.kubelet
    pods = [kubelet.create_pod(f"st-{n}", {"main": {GPU: 1}}, namespace="team") for n in range(3)]
    shared, busy, quiet, _, lonely = shared_pair(node, pods)
    node.run_process(busy, shared, 7400, 1000, sm=55)
    kubelet.create_pod("notebook", {"jupyter": {SMALL: 1}}, namespace="research")

    def idle_for(document: dict, pod: str) -> float:
        (entry,) = [e for e in document["allocated"] if e["pod"] == pod]
        return entry["idle_seconds"]

    address = str(node.base / "status.sock")  # /status is served on the agent's unix socket, not the metrics port
    document = wait_until(
        lambda: (
            (d := fetch_status(address))["allocated"]
            and len(d["allocated"]) == 4
            and idle_for(d, quiet.name) >= 1.0
            and d
        ),
        10,
        "a second of idleness in /status",
    )
    assert idle_for(document, busy.name) == 0 and idle_for(document, lonely.name) >= 1.0
    (busy_entry,) = [e for e in document["allocated"] if e["pod"] == busy.name]
    assert busy_entry["utilization_percent"] == 55 and busy_entry["device_id"] == held_device(busy, "main", GPU)
    (mig_entry,) = [e for e in document["allocated"] if e["pod"] == "notebook"]
    assert mig_entry["utilization_percent"] is None and mig_entry["idle_seconds"] > 0  # no process on it
    assert mig_entry["container"] == "jupyter" and mig_entry["resource"] == SMALL

    text = render_idle(document)
    lines = text.splitlines()
    assert lines[0].split() == ["POD", "CONTAINER", "RESOURCE", "DEVICE", "IDLE", "FOR", "SM", "%"]
    busy_line = next(line for line in lines if f"team/{busy.name} " in line)
    assert "busy" in busy_line and busy_line.split()[-1] == "55"
    assert "n/a" in next(line for line in lines if "research/notebook" in line)
    assert lines[-1].startswith("3 of 4 allocated devices idle")
    later = wait_until(
        lambda: (d := fetch_status(address)) and idle_for(d, quiet.name) >= idle_for(document, quiet.name) + 0.5 and d,
        5,
        "the idle time growing",
    )
    assert idle_for(later, busy.name) == 0
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    command = [sys.executable, "-m", "agent", "status", "--idle", "--status-socket", address]
    shown = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env, check=False)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.splitlines()[0].split()[:2] == ["POD", "CONTAINER"] and "research/notebook" in shown.stdout


def test_the_mps_client_list_unsupported_or_failing_costs_the_clients_not_the_node(node: TelemetryNode) -> None:
    kubelet, driver = node.kubelet, node.driver
    pods = [kubelet.create_pod(f"mps-fault-{n}", {"main": {GPU: 1}}, namespace="infer") for n in range(3)]
    shared, first, second, other, third = shared_pair(node, pods)
    node.run_process(first, shared, 7500, 1000, sm=20)  # a compute process: listed either way
    node.run_process(second, shared, 7501, 2000, kind="mps_client", sm=30)
    node.run_process(third, other, 7502, 3000, sm=40)
    memory = "tessera_pod_device_memory_used_bytes"
    node.wait_samples(lambda s: maybe(s, memory, pod=second.name) == 2000 * MIB, 5, "the MPS client's memory")

    symbol = "nvmlDeviceGetMPSComputeRunningProcesses_v3"
    driver.inject_error(symbol, Return.ERROR_NOT_SUPPORTED, times=None, gpu_index=shared)  # an older driver
    samples = node.wait_samples(lambda s: maybe(s, memory, pod=second.name) == 0, 5, "the client unlisted")
    assert value(samples, memory, pod=first.name) == 1000 * MIB and value(samples, "tessera_gpu_up", gpu=str(shared))
    driver.clear_injected_errors()
    driver.inject_error(symbol, Return.ERROR_UNKNOWN, times=None, gpu_index=shared)  # the call fails
    samples = node.wait_samples(lambda s: maybe(s, "tessera_gpu_up", gpu=str(shared)) == 0, 5, "the GPU unread")
    assert value(samples, memory, pod=third.name) == 3000 * MIB, "the other GPU keeps its pods' numbers"
    assert value(samples, "tessera_pod_device_idle", pod=first.name) == 0, "unread is unknown, not idle"
    driver.clear_injected_errors()
    node.wait_samples(lambda s: maybe(s, memory, pod=second.name) == 2000 * MIB, 5, "back once NVML answers")


def test_allocate_and_preferred_allocation_calls_are_timed_as_the_kubelet_times_them(node: TelemetryNode) -> None:
    """tessera_device_plugin_alloc_duration_seconds{resource_name} next to the kubelet's own histogram."""
    node.kubelet.create_pod("timed", {"main": {GPU: 1}}, namespace="shop")
    node.kubelet.create_pod("timed-2", {"main": {SMALL: 1}}, namespace="shop")
    samples = node.wait_samples(
        lambda s: maybe(s, "tessera_device_plugin_alloc_duration_seconds_count", resource_name=SMALL),
        5,
        "both Allocate calls in the histogram",
    )
    assert value(samples, "tessera_device_plugin_alloc_duration_seconds_count", resource_name=GPU) == 1
    assert value(samples, "tessera_device_plugin_alloc_duration_seconds_bucket", resource_name=GPU, le="+Inf") == 1
    assert value(samples, "tessera_device_plugin_alloc_duration_seconds_sum", resource_name=GPU) > 0
