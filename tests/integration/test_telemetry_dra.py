"""DRA claims' series on a node whose agent cannot see the kubelet's DRA checkpoint, as a deployed DaemonSet.

Everything real but the hardware and the control plane: the agent (in process) reads a simulated dgx-a100 through
pynvml, a fake /proc gives a GPU process its pod's cgroup, and the device-plugin kubelet emulator's PodResources
socket (one per node, as the kubelet's) lists the claims the DRA kubelet emulator prepared for its pods. No
``dra_manager_state`` exists anywhere: which pods a claim serves comes from PodResources' ``dynamic_resources``.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.request import urlopen

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.api.podresources.v1 import api_pb2 as pr
from agent.api.podresources.v1 import api_pb2_grpc as pr_grpc
from agent.sim.apiserver import ApiServer
from agent.sim.kubelet import DraKubeletEmulator, KubeletEmulator
from agent.sim.nvml.driver import SimDriver
from agent.telemetry.dra_claims import KUBELET_DRA_STATE
from agent.telemetry.service import TelemetrySettings
from tests.integration.test_dra_e2e import CONFIG, DEADLINE, DRIVER, GPU_CLASS, NODE, World, poll, start_agent
from tests.integration.test_telemetry import Samples, cgroup_line, maybe, stat_line, wait_for_samples

POD_UID = "7e1f0c2a-5b3d-4c8e-9f10-0a1b2c3d4e5f"
OTHER_UID = "8e1f0c2a-5b3d-4c8e-9f10-0a1b2c3d4e5f"
A100 = "device.attributes['gpu.nvidia.com'].productName.contains('A100')"


@dataclass
class DraTelemetry:
    world: World
    proc: Path
    kubelet_dir: Path

    def scrape(self) -> Samples:
        with urlopen(f"http://127.0.0.1:{self.world.agent.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        samples: Samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
        return samples

    def wait_samples(self, predicate: Callable[[Samples], object], what: str) -> Samples:
        return wait_for_samples(self.scrape, predicate, DEADLINE, what)

    def process(self, uid: str, gpu: int, pid: int, used_mib: int, sm: int) -> None:
        entry = self.proc / str(pid)
        entry.mkdir(exist_ok=True)
        (entry / "cgroup").write_text(cgroup_line(uid))
        (entry / "stat").write_text(stat_line(pid))
        self.world.driver.add_process(gpu, pid, used_mib, sm=sm)

    def prepared(self, claim_name: str, pod: str, uid: str) -> int:
        """A claim for one A100 prepared for a pod; the index of the GPU it got."""
        world = self.world
        claim = world.claim(claim_name, [A100])
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        world.dra.run_pod("default", pod, uid, [("gpu", claim_name)], {"main": [("gpu", None)]})
        minor = int(result["device"].removeprefix("gpu-"))
        return next(g.index for g in world.driver.gpus if g.minor_number == minor)


@pytest.fixture
def node(sim_node: Callable[[object], SimDriver]) -> Iterator[DraTelemetry]:
    driver = sim_node("dgx-a100")
    base = Path(tempfile.mkdtemp(prefix="dt", dir="/tmp"))  # unix socket paths stay short
    (base / "config.yaml").write_text(CONFIG)
    (base / "proc").mkdir()
    (base / "kubelet").mkdir()  # where a kubelet's dra_manager_state would be: empty, as in the DaemonSet
    api = ApiServer(git_version="v1.36.3")
    api.start()
    api.add_node(NODE)
    selectors = [{"cel": {"expression": GPU_CLASS}}]
    device_class = {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": DRIVER}}
    api.create("deviceclasses", {**device_class, "spec": {"selectors": selectors}})
    kubelet = KubeletEmulator(base / "dp", base / "pr" / "kubelet.sock")
    kubelet.start()
    dra = DraKubeletEmulator(base / "registry", NODE, api.api_client(), wipe_delay=1.0)
    dra.start()
    kubelet.serve_dra(dra)
    settings = TelemetrySettings(
        hostname="dt",
        metrics_address="127.0.0.1:0",
        interval=0.2,
        proc_root=base / "proc",
        kubelet_dir=base / "kubelet",
    )
    agent, thread = start_agent(base, api, telemetry=settings)
    world = World(driver, api, kubelet, dra, agent, thread, base)
    try:
        poll(lambda: agent.metrics_port is not None, "the metrics endpoint")
        world.api.wait_for(lambda: world.devices() == ["gpu-0", "gpu-1"], DEADLINE)
        world.dra.wait_for(lambda: DRIVER in world.dra.drivers(), DEADLINE, "the DRA driver registered")
        yield DraTelemetry(world, base / "proc", base / "kubelet")
    finally:
        world.agent.stop()
        world.thread.join(timeout=20)
        dra.stop()
        kubelet.stop()
        api.stop()
        shutil.rmtree(base, ignore_errors=True)


def claim_value(samples: Samples, name: str, claim: str) -> float | None:
    return maybe(samples, name, dra_claim_name=claim)


def test_a_claims_pod_process_is_the_claims_from_podresources_without_the_kubelets_checkpoint(
    node: DraTelemetry,
) -> None:
    gpu = node.prepared("train", "trainer", POD_UID)
    node.process(POD_UID, gpu, 7001, 4096, sm=70)
    samples = node.wait_samples(
        lambda s: (
            claim_value(s, "tessera_dra_claim_processes", "train") == 1
            and claim_value(s, "tessera_dra_claim_gpu_utilization_percent", "train") == 70
        ),
        "the trainer's process counted for its claim",
    )
    assert claim_value(samples, "tessera_dra_claim_memory_used_bytes", "train") == 4096 << 20
    assert claim_value(samples, "tessera_dra_claim_idle", "train") == 0
    assert maybe(samples, "tessera_unattributed_gpu_processes", reason="unknown_pod") in (None, 0)
    assert not list(node.world.base.rglob(KUBELET_DRA_STATE)), "no kubelet DRA checkpoint anywhere"


def test_a_process_of_a_pod_the_claim_does_not_serve_is_not_given_to_it(node: DraTelemetry) -> None:
    """Two pods on the claim's GPU while PodResources names one: whose process is whose cannot be told, so neither
    is the claim's (its utilization is unknown, not the pods' sum)."""
    gpu = node.prepared("train", "trainer", POD_UID)
    node.process(POD_UID, gpu, 7101, 1024, sm=30)
    node.wait_samples(
        lambda s: claim_value(s, "tessera_dra_claim_processes", "train") == 1, "the trainer's process first"
    )
    node.process(OTHER_UID, gpu, 7102, 2048, sm=40)  # a pod PodResources gives no claim of this GPU
    samples = node.wait_samples(
        lambda s: claim_value(s, "tessera_dra_claim_processes", "train") == 0, "the claim's processes unknown"
    )
    assert claim_value(samples, "tessera_dra_claim_gpu_utilization_percent", "train") is None
    assert maybe(samples, "tessera_unattributed_gpu_processes", reason="unknown_pod") == 2


def test_podresources_lists_the_claims_of_the_dra_kubelets_pods(node: DraTelemetry) -> None:
    node.prepared("train", "trainer", POD_UID)
    socket = node.world.base / "pr" / "kubelet.sock"
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        response = pr_grpc.PodResourcesListerStub(channel).List(pr.ListPodResourcesRequest(), timeout=5)
    (pod,) = [p for p in response.pod_resources if p.name == "trainer"]
    (container,) = pod.containers
    (claim,) = container.dynamic_resources
    (device,) = claim.claim_resources
    assert (claim.claim_namespace, claim.claim_name, container.name) == ("default", "train", "main")
    assert device.driver_name == DRIVER and device.pool_name == NODE and device.device_name.startswith("gpu-")
    assert f"k8s.{DRIVER}/claim={claim_uid(node)}-{device.device_name}" in [c.name for c in device.cdi_devices]
    node.world.dra.stop_pod(POD_UID)
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        response = pr_grpc.PodResourcesListerStub(channel).List(pr.ListPodResourcesRequest(), timeout=5)
    assert not [p for p in response.pod_resources if p.name == "trainer"], "a stopped pod is not listed"


def claim_uid(node: DraTelemetry) -> str:
    return next(
        c["metadata"]["uid"] for c in node.world.api.objects("resourceclaims") if c["metadata"]["name"] == "train"
    )
