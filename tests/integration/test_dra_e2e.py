"""One agent, two front ends: the config gives two GPUs to DRA, the device plugin keeps the rest.

Everything real but the hardware and the control plane: the agent (in process) talks to a simulated dgx-a100
through pynvml, to the device-plugin kubelet emulator and the DRA kubelet emulator over gRPC on unix sockets,
and to the API server stand-in through the Kubernetes client. Claims are allocated by the simulated scheduler
with NVIDIA's DeviceClass and a CEL selector, then prepared by the DRA kubelet for a pod.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.agent import Agent, AgentOptions
from agent.core.health import HealthPolicy
from agent.sim.apiserver import ApiServer
from agent.sim.driver_root import sim_driver_root
from agent.sim.kubelet import DraKubeletEmulator, KubeletEmulator
from agent.sim.kubelet.dra_common import PodStartError
from agent.sim.nvml.driver import SimDriver
from agent.sim.scheduler import allocate
from agent.telemetry.service import TelemetrySettings

NODE, DRIVER, NVIDIA_GPU = "dra-node", "gpu.nvidia.com", "nvidia.com/gpu"
GPU_CLASS = "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'"  # NVIDIA's
CONFIG = "version: v1\ndra:\n  enabled: true\n  gpus: [0, 1]\n"
DEADLINE = 20.0


def poll(predicate: Callable[[], object], what: str, timeout: float = DEADLINE) -> object:
    """The predicate's first truthy value, looked at every 20 ms until ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.02)


def start_agent(
    base: Path,
    api: ApiServer,
    telemetry: TelemetrySettings | None = None,
    health: HealthPolicy | None = None,
    liveness_seconds: float | None = None,
    **options: object,
) -> tuple[Agent, threading.Thread]:
    """An agent on the world's node and directories; ``options`` replace the defaults (``pod_uid``...)."""
    more = {} if liveness_seconds is None else {"liveness_probe_seconds": liveness_seconds}
    defaults: dict[str, object] = dict(
        telemetry=telemetry,
        health=health or HealthPolicy(),
        device_plugin_dir=base / "dp",
        pod_resources_socket=base / "pr" / "kubelet.sock",
        config_path=base / "config.yaml",
        node_name=NODE,
        kubeconfig=str(api.write_kubeconfig(base / "kubeconfig")),
        dra_registry_dir=base / "registry",
        dra_plugins_dir=base / "plugins",
        cdi_root=base / "cdi",
        driver_root=sim_driver_root(base / "driver"),  # the node's driver: the claims' CDI specs mount it
        sys_root=base / "sys",
    )
    agent = Agent(AgentOptions(**{**more, **defaults, **options}))  # type: ignore[arg-type]
    thread = threading.Thread(target=agent.run, name="agent-under-test")
    thread.start()
    assert agent.started.wait(20)
    return agent, thread


@dataclass
class World:
    driver: SimDriver
    api: ApiServer
    kubelet: KubeletEmulator
    dra: DraKubeletEmulator
    agent: Agent
    thread: threading.Thread
    base: Path

    def restart_agent(self, telemetry: TelemetrySettings | None = None) -> None:
        """The agent stops (a rollout, a crash's restart) and a new one starts on the same node."""
        self.agent.stop()
        self.thread.join(timeout=20)
        self.agent, self.thread = start_agent(self.base, self.api, telemetry)

    def slices(self) -> list[dict]:
        return [s for s in self.api.objects("resourceslices") if s["spec"]["nodeName"] == NODE]

    def devices(self) -> list[str]:
        return [d["name"] for s in self.slices() for d in s["spec"].get("devices", [])]

    def claim(self, name: str, selectors: list[str]) -> dict:
        """A claim for one GPU, allocated by the simulated scheduler from the published slices."""
        claim = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "gpu",
                            "exactly": {
                                "deviceClassName": DRIVER,
                                "selectors": [{"cel": {"expression": e}} for e in selectors],
                            },
                        }
                    ]
                }
            },
        }
        created = self.api.create("resourceclaims", claim)
        classes = {c["metadata"]["name"]: c for c in self.api.objects("deviceclasses")}
        allocated = allocate(created, self.slices(), classes, set(), NODE)
        return self.api.update("resourceclaims", allocated, status=True)


def fake_sysfs(root: Path, links: dict[str, str], numa_node: int = 1) -> None:
    """``/sys/bus/pci/devices/<bus ID>`` linked to the device under its root, as the kernel lays it out, with the
    device's ``numa_node``."""
    (root / "bus" / "pci" / "devices").mkdir(parents=True)
    for bus_id, pcie_root in links.items():
        device = root / "devices" / pcie_root / "0000:00:01.0" / bus_id
        device.mkdir(parents=True)
        (device / "numa_node").write_text(f"{numa_node}\n")
        (root / "bus" / "pci" / "devices" / bus_id).symlink_to(device)


@pytest.fixture
def world(request: pytest.FixtureRequest, sim_node: Callable[[object], SimDriver]) -> Iterator[World]:
    """A dgx-a100, or the node spec a test gives (``parametrize("world", [spec], indirect=True)``; a spec with
    ``"recovery_seconds"`` gives the agent that health quiet period, one with ``"liveness_seconds"`` that slow
    re-check period, one with ``"gates_off"`` an API server with those feature gates off)."""
    spec = getattr(request, "param", "dgx-a100")
    recovery = spec.pop("recovery_seconds", None) if isinstance(spec, dict) else None
    liveness = spec.pop("liveness_seconds", None) if isinstance(spec, dict) else None
    gates_off = spec.pop("gates_off", ()) if isinstance(spec, dict) else ()
    driver = sim_node(spec)
    base = Path(tempfile.mkdtemp(prefix="e", dir="/tmp"))  # unix socket paths stay short
    fake_sysfs(base / "sys", {driver.gpus[0].pci_bus_id.removeprefix("0000"): "pci0000:00"})  # GPU 1: no link
    (base / "config.yaml").write_text(CONFIG)
    api = ApiServer(git_version="v1.36.3", disabled_gates=gates_off)
    api.start()
    api.add_node(NODE)
    selectors = [{"cel": {"expression": GPU_CLASS}}]
    device_class = {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": DRIVER}}
    api.create("deviceclasses", {**device_class, "spec": {"selectors": selectors}})
    kubelet = KubeletEmulator(base / "dp", base / "pr" / "kubelet.sock")
    kubelet.start()
    dra = DraKubeletEmulator(base / "registry", NODE, api.api_client(), wipe_delay=1.0)
    dra.start()
    health = HealthPolicy(quiet_seconds=recovery) if recovery is not None else None
    world = World(driver, api, kubelet, dra, *start_agent(base, api, health=health, liveness_seconds=liveness), base)
    try:
        yield world
        assert world.thread.is_alive(), "the agent's reconcile loop ended by itself"
    finally:
        world.agent.stop()
        world.thread.join(timeout=20)
        world.dra.stop()  # the one in use (a test may have started another)
        kubelet.stop()
        api.stop()
        end_mps_daemons(base)
        shutil.rmtree(base, ignore_errors=True)


def end_mps_daemons(base: Path) -> None:
    """MPS daemons outlive the agent on purpose (a node keeps serving its clients); a test's own end them."""
    for pid_file in base.glob("**/pipe/nvidia-cuda-mps-control.pid"):
        try:
            pid = int(pid_file.read_text())
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue  # gone already
        if f"CUDA_MPS_PIPE_DIRECTORY={pid_file.parent}".encode() in environ:  # this daemon, not a reused PID
            os.kill(pid, signal.SIGKILL)


def test_two_gpus_go_to_dra_and_the_device_plugin_keeps_six(world: World) -> None:
    world.dra.wait_for(lambda: DRIVER in world.dra.drivers(), DEADLINE, "the DRA driver registered")
    world.api.wait_for(lambda: world.devices() == ["gpu-0", "gpu-1"], DEADLINE)
    world.kubelet.wait_for(
        lambda: world.kubelet.allocatable("nvidia.com/gpu") == 6, timeout=DEADLINE, what="six GPUs via the plugin"
    )
    uuids = {g.uuid for g in world.driver.gpus[:2]}
    assert not uuids & set(world.kubelet.devices("nvidia.com/gpu"))  # never offered by both
    owner = world.slices()[0]["metadata"]["ownerReferences"][0]
    assert owner["kind"] == "Node" and owner["uid"] == world.api.get("nodes", NODE)["metadata"]["uid"]


def test_a_gpu_names_its_pcie_root_where_sysfs_has_it(world: World) -> None:
    world.api.wait_for(lambda: world.devices() == ["gpu-0", "gpu-1"], DEADLINE)
    devices = {d["name"]: d["attributes"] for s in world.slices() for d in s["spec"]["devices"]}
    assert devices["gpu-0"]["resource.kubernetes.io/pcieRoot"] == {"string": "pci0000:00"}
    assert devices["gpu-0"]["resource.kubernetes.io/pciBusID"] == {"string": world.driver.gpus[0].pci_bus_id[4:]}
    assert "resource.kubernetes.io/pcieRoot" not in devices["gpu-1"]  # sysfs does not say: no attribute


def test_a_gpu_names_its_numa_node_from_sysfs_or_else_from_nvml(world: World) -> None:
    world.api.wait_for(lambda: world.devices() == ["gpu-0", "gpu-1"], DEADLINE)
    devices = {d["name"]: d["attributes"] for s in world.slices() for d in s["spec"]["devices"]}
    assert world.driver.gpus[0].numa_node == 0  # NVML's answer; sysfs (the kernel's) says 1 and wins
    assert devices["gpu-0"]["resource.kubernetes.io/numaNode"] == {"int": 1}
    assert devices["gpu-1"]["resource.kubernetes.io/numaNode"] == {"int": world.driver.gpus[1].numa_node}
    assert "addressingMode" not in devices["gpu-0"]  # an A100 on x86: NVML reports no addressing mode


def test_a_claim_selected_with_nvidias_class_is_prepared_for_a_pod_and_unprepared(world: World) -> None:
    world.api.wait_for(lambda: world.devices() == ["gpu-0", "gpu-1"], DEADLINE)
    world.dra.wait_for(lambda: DRIVER in world.dra.drivers(), DEADLINE, "the DRA driver registered")
    claim = world.claim("train", ["device.attributes['gpu.nvidia.com'].productName.contains('A100')"])
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert result["driver"] == DRIVER and result["pool"] == NODE and result["device"] in ("gpu-0", "gpu-1")
    uid = claim["metadata"]["uid"]
    ids = world.dra.run_pod("default", "trainer", "pod-1", [("gpu", "train")], {"main": [("gpu", None)]})
    assert ids["main"][0] == f"k8s.gpu.nvidia.com/claim={uid}-{result['device']}"
    spec = world.base / "cdi" / f"k8s.gpu.nvidia.com-claim_{uid}.yaml"
    assert spec.is_file() and (spec.stat().st_mode & 0o777) == 0o644
    world.dra.stop_pod("pod-1")
    assert not spec.exists()


def test_a_prepared_claim_says_so_in_its_status_devices_until_it_is_unprepared(world: World) -> None:
    """After Prepare the claim's status.devices names the device, Ready, with its UUID (kubectl get resourceclaim
    shows it); Unprepare takes the entry back."""
    world.api.wait_for(lambda: world.devices() == ["gpu-0", "gpu-1"], DEADLINE)
    world.dra.wait_for(lambda: DRIVER in world.dra.drivers(), DEADLINE, "the DRA driver registered")
    claim = world.claim("train", ["device.attributes['gpu.nvidia.com'].productName.contains('A100')"])
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert "devices" not in claim["status"]
    world.dra.run_pod("default", "trainer", "pod-1", [("gpu", "train")], {"main": [("gpu", None)]})

    def reported() -> list[dict]:
        return world.api.get("resourceclaims", "train", "default")["status"].get("devices", [])

    world.api.wait_for(reported, DEADLINE)  # written after the kubelet got its answer
    (entry,) = reported()
    gpu = world.driver.gpus[int(result["device"].removeprefix("gpu-"))]
    assert (entry["driver"], entry["pool"], entry["device"], entry["data"]) == (
        DRIVER, NODE, result["device"], {"uuid": gpu.uuid},
    )  # fmt: skip
    (ready,) = entry["conditions"]
    assert (ready["type"], ready["status"], ready["reason"]) == ("Ready", "True", "Prepared")
    world.dra.stop_pod("pod-1")
    world.api.wait_for(lambda: reported() == [], DEADLINE)


def test_an_xid_taints_the_dra_device_in_its_slice(world: World) -> None:
    world.api.wait_for(lambda: world.devices() == ["gpu-0", "gpu-1"], DEADLINE)
    world.driver.inject_xid(0, 79)  # fell off the bus: critical
    world.api.wait_for(
        lambda: any(t["key"] == f"{DRIVER}/xid" for t in world.slices()[0]["spec"]["devices"][0].get("taints", [])),
        DEADLINE,
    )
    taint = world.slices()[0]["spec"]["devices"][0]["taints"][0]
    assert taint["value"] == "79" and taint["effect"] == "NoSchedule"


@pytest.mark.parametrize(
    ("kubelet", "service"), [("1.37", "v1.DRAResourceHealth"), ("1.36", "v1alpha1.DRAResourceHealth")]
)
def test_the_kubelet_streams_device_health_over_the_health_service_it_prefers(
    world: World, kubelet: str, service: str
) -> None:
    """A 1.37 kubelet takes the v1 health service the agent advertises first; a 1.36 one knows v1alpha1 only. Both
    see a GPU fall off the bus."""
    world.api.wait_for(lambda: world.devices() == ["gpu-0", "gpu-1"], DEADLINE)
    world.dra.stop()
    world.dra = DraKubeletEmulator(
        world.base / "registry", NODE, world.api.api_client(), wipe_delay=1.0, kubelet_version=kubelet
    )
    world.dra.start()
    world.dra.wait_for(lambda: world.dra.health_services(DRIVER) == [service], DEADLINE, f"a {service} stream")
    world.dra.wait_for(lambda: world.dra.device_health(DRIVER, NODE, "gpu-0") == "Healthy", DEADLINE, "Healthy")
    world.driver.inject_xid(0, 79)
    world.dra.wait_for(lambda: world.dra.device_health(DRIVER, NODE, "gpu-0") == "Unhealthy", DEADLINE, "Unhealthy")
    assert world.dra.device_health(DRIVER, NODE, "gpu-1") == "Healthy"


def test_slices_wiped_by_a_kubelet_restart_come_back(world: World) -> None:
    world.api.wait_for(lambda: world.devices() == ["gpu-0", "gpu-1"], DEADLINE)
    world.dra.restart()  # the kubelet deletes every slice of its node when it starts
    world.api.wait_for(lambda: world.devices() == ["gpu-0", "gpu-1"], DEADLINE)
    world.dra.wait_for(lambda: DRIVER in world.dra.drivers(), DEADLINE, "registered again")


def test_a_gpu_a_pod_holds_moves_to_dra_only_when_the_pod_is_gone(world: World) -> None:
    """Nothing moves under a running workload: the GPU leaves the device plugin at once (no new pod gets it) but
    joins DRA's slices only when the pod holding it is gone."""
    world.api.wait_for(lambda: world.devices() == ["gpu-0", "gpu-1"], DEADLINE)
    world.kubelet.wait_for(lambda: world.kubelet.allocatable("nvidia.com/gpu") == 6, timeout=DEADLINE, what="6")
    pod = world.kubelet.create_pod("holder", {"main": {"nvidia.com/gpu": 1}})
    (held,) = pod.containers["main"]["nvidia.com/gpu"].device_ids
    index = next(g.index for g in world.driver.gpus if g.uuid == held)
    (world.base / "config.yaml").write_text(f"version: v1\ndra:\n  enabled: true\n  gpus: [0, 1, {index}]\n")
    world.kubelet.wait_for(
        lambda: world.kubelet.allocatable("nvidia.com/gpu") == 5, timeout=DEADLINE, what="withdrawn from the plugin"
    )
    why = poll(lambda: " ".join(world.agent.status.waiting_for.get(f"dra:{held}", ())), "the move waits for the pod")
    assert "holder" in why
    assert f"gpu-{index}" not in world.devices()  # not offered twice
    world.kubelet.delete_pod("holder")
    world.api.wait_for(lambda: f"gpu-{index}" in world.devices(), DEADLINE)
    assert not world.agent.status.waiting_for.get(f"dra:{held}")


def test_an_agent_restart_keeps_prepared_claims_and_the_published_slices(world: World) -> None:
    world.api.wait_for(lambda: world.devices() == ["gpu-0", "gpu-1"], DEADLINE)
    world.dra.wait_for(lambda: DRIVER in world.dra.drivers(), DEADLINE, "the DRA driver registered")
    claim = world.claim("kept", [])
    uid, device = claim["metadata"]["uid"], claim["status"]["allocation"]["devices"]["results"][0]["device"]
    world.dra.run_pod("default", "keeper", "pod-k", [("gpu", "kept")], {"main": [("gpu", None)]})
    generation = world.slices()[0]["spec"]["pool"]["generation"]
    writes = world.api.count("create", "resourceslices") + world.api.count("update", "resourceslices")

    world.restart_agent()
    world.dra.wait_for(
        lambda: len(world.dra.registration_events("registered", DRIVER)) >= 2, DEADLINE, "registered again"
    )
    assert world.slices()[0]["spec"]["pool"]["generation"] == generation  # the same slices: adopted, not rewritten
    assert world.api.count("create", "resourceslices") + world.api.count("update", "resourceslices") == writes
    # the new agent knows the claim: the device stays its own, and unprepare works
    other = dict(claim, metadata={"name": "thief", "namespace": "default"})
    other.pop("status")
    stolen = world.api.create("resourceclaims", other)
    stolen["status"] = claim["status"]  # allocated to the same device, as a confused scheduler might
    world.api.update("resourceclaims", stolen, status=True)
    with pytest.raises(PodStartError, match="already allocated to different claim"):
        world.dra.run_pod("default", "thief", "pod-t", [("gpu", "thief")], {"main": [("gpu", None)]})
    world.dra.stop_pod("pod-k")
    assert not (world.base / "cdi" / f"k8s.gpu.nvidia.com-claim_{uid}.yaml").exists()
    assert device in ("gpu-0", "gpu-1")


def test_a_cordoned_gpu_is_tainted_in_its_slice_and_the_taint_goes_with_the_cordon(world: World) -> None:
    world.api.wait_for(lambda: world.devices() == ["gpu-0", "gpu-1"], DEADLINE)
    node = world.api.get("nodes", NODE)
    node["metadata"]["annotations"] = {"tessera.dev/gpu-cordon": "0"}
    world.api.update("nodes", node)

    def cordon_taint() -> list[dict]:
        return [
            t for t in world.slices()[0]["spec"]["devices"][0].get("taints", []) if t["key"] == "tessera.dev/gpu-cordon"
        ]

    world.api.wait_for(cordon_taint, DEADLINE)
    assert cordon_taint()[0]["effect"] == "NoSchedule"
    assert "taints" not in world.slices()[0]["spec"]["devices"][1]
    node = world.api.get("nodes", NODE)
    node["metadata"]["annotations"] = {}
    world.api.update("nodes", node)
    world.api.wait_for(lambda: not cordon_taint(), DEADLINE)


def test_slices_the_api_server_refuses_are_said_in_the_status(world: World) -> None:
    world.api.wait_for(lambda: world.devices() == ["gpu-0", "gpu-1"], DEADLINE)
    world.api.fail_next("*", "resourceslices", 403, n=1000, message="resourceslices is forbidden")
    world.driver.inject_xid(1, 79)  # a change to publish
    error = poll(lambda: (world.agent.status.dra or {}).get("error"), "the refusal in the status")
    assert "cannot publish ResourceSlices" in error and "403" in error


def test_readyz_waits_for_the_dra_registration(world: World) -> None:
    """A rollout stops at a node whose DRA driver the kubelet has not registered, as it does for the plugins."""
    world.dra.stop()
    world.restart_agent(TelemetrySettings(hostname=NODE, metrics_address="127.0.0.1:0"))

    def readyz() -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{world.agent.metrics_port}/readyz", timeout=5) as reply:
                return reply.status, reply.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()

    poll(lambda: world.agent.metrics_port and "DRA driver is not registered" in readyz()[1], "readyz names DRA")
    assert readyz()[0] == 503
    world.dra = DraKubeletEmulator(world.base / "registry", NODE, world.api.api_client(), wipe_delay=1.0)
    world.dra.start()
    poll(lambda: readyz()[0] == 200, "readyz once the kubelet registered the driver")


def test_a_cdi_spec_no_claim_owns_is_removed_when_the_agent_starts(world: World) -> None:
    """A crash between writing a spec and recording its claim leaves a spec behind; the next agent removes it
    (one agent per node: no other instance can be writing one at that moment)."""
    world.api.wait_for(lambda: world.devices() == ["gpu-0", "gpu-1"], DEADLINE)
    leftover = world.base / "cdi" / "k8s.gpu.nvidia.com-claim_0b6b3d4e-1234-4cde-8f00-123456789abc.yaml"
    leftover.parent.mkdir(exist_ok=True)
    leftover.write_text("cdiVersion: 0.5.0\nkind: k8s.gpu.nvidia.com/claim\ndevices: []\n")
    unrelated = world.base / "cdi" / "vendor.example.com-device.yaml"
    unrelated.write_text("cdiVersion: 0.5.0\nkind: vendor.example.com/device\ndevices: []\n")
    world.restart_agent()
    poll(lambda: not leftover.exists(), "the leftover spec removed")
    assert unrelated.exists()  # never anyone else's
    poll(lambda: NVIDIA_GPU in world.agent.status.registered, "the device plugin registered again")


def test_a_gpu_a_claim_holds_returns_to_the_device_plugin_only_when_the_claim_is_unprepared(world: World) -> None:
    world.api.wait_for(lambda: world.devices() == ["gpu-0", "gpu-1"], DEADLINE)
    world.dra.wait_for(lambda: DRIVER in world.dra.drivers(), DEADLINE, "the DRA driver registered")
    world.kubelet.wait_for(lambda: world.kubelet.allocatable(NVIDIA_GPU) == 6, timeout=DEADLINE, what="6")
    claim = world.claim("held", [])
    device = claim["status"]["allocation"]["devices"]["results"][0]["device"]
    world.dra.run_pod("default", "holder", "pod-h", [("gpu", "held")], {"main": [("gpu", None)]})
    kept = "gpu-1" if device == "gpu-0" else "gpu-0"
    (world.base / "config.yaml").write_text(f"version: v1\ndra:\n  enabled: true\n  gpus: [{kept[-1]}]\n")
    world.api.wait_for(lambda: world.devices() == [kept], DEADLINE)  # no new claim gets it
    assert world.kubelet.allocatable(NVIDIA_GPU) == 6  # nor a device-plugin pod: a claim still holds it
    world.dra.stop_pod("pod-h")
    world.kubelet.wait_for(lambda: world.kubelet.allocatable(NVIDIA_GPU) == 7, timeout=DEADLINE, what="back: 7")
