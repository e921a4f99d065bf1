"""Benchmarks for the DRA front end (issue 15): the agent as its own process (``python -m agent run --simulate``)
against the API server stand-in (in this process, on loopback, every written object schema-validated), the DRA
kubelet emulator and the device-plugin kubelet emulator.

Run: python tests/bench/bench_dra.py [--rounds 5] [--prepares 200] [--pods 30] [--xids 20] [--restarts 10] [--writes 30]
(the self-contained CDI spec's Prepare, in process: python tests/bench/bench_dra.py self-contained [ROUNDS [PREPARES]])

Every round runs every part once with a fresh agent process, stand-in and emulators (a noisy neighbour spreads
over all of them); the figures printed are the medians over the rounds of each round's p50 and p99 (single
values per round: their median), with min / max over every sample and the issue's targets. Floors are measured
in the same rounds.

1. NodePrepareResources on a dgx-a100 (8 full GPUs, config ``dra: {enabled: true, gpus: all}``). Claims are
   allocated by the simulated scheduler with NVIDIA's DeviceClass selector (eight 1-GPU claims, one per GPU, and
   one claim for 8 GPUs, ``count: 8``), written with their allocation to the stand-in, and then prepared and
   unprepared in pairs by calling the agent's DRA socket directly, dialled as the kubelet does (the DRA kubelet
   emulator's channel options, the v1 service it chose at registration): the time of the gRPC call from call to
   return, prepare and unprepare separately, every answer checked for per-claim errors. Interleaved with them,
   the floors: an empty NodePrepareResources (NVIDIA's liveness probe: answered without reaching the claim
   worker), the stand-in's GET of a ResourceClaim over HTTP through the Kubernetes client (the read inside every
   prepare), and an atomic write in the same filesystem (``agent.atomic.write_atomically``: fsync of the file and
   of the directory; a prepare does three: checkpoint started, CDI spec, checkpoint completed; an unprepare a CDI
   removal and one). Then the kubelet's whole view, ``DraKubeletEmulator.run_pod`` / ``stop_pod`` timed from call
   to return (the claim GET, the ``reservedFor`` PUT the scheduler would have made, NodePrepareResources; and
   back), with the stand-in's PUT of a claim's status over HTTP as its floor.
2. A dgx-a100 in MIG mode: 8 A100-SXM4-80GB with seven 1g.10gb each, 56 MIG devices, all served by DRA
   (``--mig-strategy none``; the device plugin registers nothing). Process spawn -> the stand-in holds a complete
   pool (every slice of the highest generation, as many as ``resourceSliceCount``) with the 56 devices, and ->
   registered with the DRA kubelet; the start's parts from the stand-in's request log (the agent's first request
   answered, its first ResourceSlice write). XIDs through ``--sim-control`` (48, 79, 95, 74: critical in
   ``agent.core.xid_catalog``; 94 is an application error and taints nothing), each on the next GPU, with
   ``--health-recovery-seconds 0.05`` so every device recovers before the next: XID call -> every MIG device of
   the GPU carries the ``gpu.nvidia.com/xid`` taint in the stored slice, and -> the DRA kubelet's health cache
   reads Unhealthy (NodeWatchResources); taint visible -> taint gone again after recovery. Kubelet restarts
   (``DraKubeletEmulator.restart()``: DeleteCollection of the node's slices, the registry walked again) -> a
   complete pool of new slice objects with the 56 devices, from the call and from the wipe's answer. Floors: a
   fresh interpreter importing grpc and the Kubernetes client APIs the agent uses (ApiClient, CustomObjectsApi,
   VersionApi), and apart what the typed CoreV1Api would add (the pydantic models of the core group, which
   agent/kube_api.py avoids), the
   stand-in's PUT of the 56-device slice over HTTP (through the Kubernetes client, for another node), and the
   validation alone of that slice in process (the strict OpenAPI schemas of both versions, then the rules).
   SIGTERM -> exit.
3. Both front ends on a dgx-a100: DRA serves GPUs 0-3, the device plugin 4-7. Spawn -> the kubelet holds the
   plugin's 4 GPUs and the stand-in a complete pool of 4; RSS after start and after a loop of prepare/unprepare
   pairs (1-GPU and 4-GPU claims) and device-plugin pods (Allocate) of 1 GPU. Floor: the RSS of the fresh
   interpreter of part 2 (grpc and the Kubernetes client APIs imported, nothing else).

4. Dynamic MIG (issue 16): a dgx-h100 with its 8 GPUs in MIG mode and no MIG device, every GPU in dynamic-MIG
   mode: spawn -> complete pool; Prepare creating a 1g.10gb and Unprepare destroying it; a churn of claims of
   random profiles, the node's MIG devices checked against the prepared partitions every 10 steps.
5. Dynamic MIG and GPU shares together (issue 16): a dgx-h100 whose GPUs 0-3 are in dynamic-MIG mode and 4-7
   shared by memory (``gpuShares``), the MPS emulator as ``nvidia-cuda-mps-control``. A churn of claims, each a
   MIG partition of a random profile or a memory share (5-40 GiB, some with a compute share), allocated by the
   simulated scheduler around the live claims (consumable capacity), prepared and unprepared through the agent's
   DRA socket. Every 10 steps: the node's MIG devices are exactly the prepared partitions, and each shared GPU's
   live shares — read back from their CDI specs' ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` — equal what the scheduler
   allocated and add up to at most the GPU's memory. After the churn: no MIG device, CDI spec or MPS daemon left.

Cross-process times use CLOCK_MONOTONIC (``time.monotonic``), which every process on the host shares; the
stand-in's request log stamps answers with it too. The stand-in, both emulators and the measuring client share
this process (one GIL); the agent has its own.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import kubernetes

from agent.api.dra.v1 import api_pb2 as dra_v1
from agent.api.dra.v1 import api_pb2_grpc as dra_v1_grpc
from agent.atomic import write_atomically
from agent.sim.apiserver import DEFAULT_SCHEMA_VERSIONS, RESOURCE_SLICE, ApiServer
from agent.sim.kubelet import DraKubeletEmulator, KubeletEmulator
from agent.sim.kubelet.common import CHANNEL_OPTIONS
from agent.sim.nvml.control import SimControlClient
from agent.sim.scheduler import Unschedulable, allocate

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from tests.bench.bench_lifecycle import package_copy  # noqa: E402

# `python -m agent` from here runs a copy of this tree's agent with its bytecode compiled, as the image has it
# (PYTHONDONTWRITEBYTECODE=1 in a development venv would otherwise recompile every changed module at each start)
AGENT_HOME = REPO  # main() points it at the compiled copy
NODE, DRIVER = "bench-node", "gpu.nvidia.com"
RESOURCE = "nvidia.com/gpu"
GIT_VERSION = "v1.36.3"
GPU_CLASS = "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'"  # NVIDIA's
MIG_SPEC = (
    "# dgx-a100 in MIG mode: 8x A100-SXM4-80GB, seven 1g.10gb each (56 MIG devices)\n"
    "name: dgx-a100-mig\nnvlink: nvswitch\nnuma_nodes: 2\ngpus:\n  - model: A100-SXM4-80GB\n    count: 8\n"
    "    mig:\n      instances: [1g.10gb, 1g.10gb, 1g.10gb, 1g.10gb, 1g.10gb, 1g.10gb, 1g.10gb]\n"
)
MIG_DEVICES = 56
DYNAMIC_SPEC = "name: dgx-h100-dynamic\ngpus:\n  - model: H100-SXM5-80GB\n    count: 8\n    mig:\n      instances: []\n"
DYNAMIC_DEVICES = 8 * 26  # per GPU: the whole GPU and 25 profile placements (mig-profiles.json, H100 80GB)
MIG_CLASS = "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'mig'"  # NVIDIA's
CHURN_PROFILES = ("1g.10gb", "1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")
SHARES_SPEC = (
    "name: dgx-h100-shares\ngpus:\n  - model: H100-SXM5-80GB\n    count: 4\n    mig:\n      instances: []\n"
    "  - model: H100-SXM5-80GB\n    count: 4\n"
)
SHARES_DEVICES = 4 * 26 + 4  # GPUs 0-3: the whole GPU and 25 placements each; GPUs 4-7: one shared device each
SHARE_MEMORY_GIB = (5, 10, 10, 20, 30, 40)
SHARE_COMPUTE = (None, None, 10, 25)
GPUS = 8
XIDS = (48, 79, 95, 74)  # critical in the catalog: each taints its GPU's devices, and recovers
RECOVERY_SECONDS = "0.05"
DEADLINE = 30.0
WARM_UP = 20
FLOOR_CODE = """
import time
from pathlib import Path
def rss():
    status = Path("/proc/self/status").read_text().splitlines()
    return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024
began = time.perf_counter()
import grpc, kubernetes.client as k
k.ApiClient, k.CustomObjectsApi, k.VersionApi
taken, rss_taken = time.perf_counter() - began, rss()
before = time.perf_counter()
k.CoreV1Api
print(taken, time.perf_counter() - before, rss_taken, rss() - rss_taken)
"""  # grpc and the Kubernetes client APIs the agent uses: time and RSS; then what CoreV1Api would add to each


# ----- helpers ------------------------------------------------------------------------------------------


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


@dataclass
class Figure:
    """One measure: per round its p50 and p99 (or one value), and every sample for min / max."""

    name: str
    target: str = "-"
    unit: str = "ms"
    p50: list[float] = field(default_factory=list)
    p99: list[float] = field(default_factory=list)
    samples: list[float] = field(default_factory=list)
    single: bool = False

    def add(self, samples: list[float]) -> None:
        if samples:
            self.p50.append(statistics.median(samples))
            self.p99.append(_percentile(samples, 0.99))
            self.samples.extend(samples)

    def add_one(self, value: float) -> None:
        self.single = True
        self.p50.append(value)
        self.samples.append(value)


def _timed(into: list[float], call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``call(*args, **kwargs)``, its wall time appended to ``into``."""
    began = time.perf_counter()
    result = call(*args, **kwargs)
    into.append(time.perf_counter() - began)
    return result


def _node_slices(api: ApiServer) -> list[dict]:
    """This node's slices of the driver as stored (the store never mutates them: no copies needed)."""
    items, _ = api.store.list(RESOURCE_SLICE)
    return [s for s in items if s["spec"].get("nodeName") == NODE and s["spec"].get("driver") == DRIVER]


def _complete_pool(api: ApiServer) -> list[dict] | None:
    """The slices of the pool's highest generation when they are all there (``resourceSliceCount``), else None."""
    slices = _node_slices(api)
    if not slices:
        return None
    generation = max(s["spec"]["pool"]["generation"] for s in slices)
    current = [s for s in slices if s["spec"]["pool"]["generation"] == generation]
    if len(current) != current[0]["spec"]["pool"]["resourceSliceCount"]:
        return None
    return current


def _devices(slices: Iterable[dict]) -> list[dict]:
    return [d for s in slices for d in s["spec"].get("devices") or []]


def _pool_with(api: ApiServer, count: int, test: Callable[[list[dict], list[dict]], bool] = lambda s, d: True):
    """A predicate for ``api.wait_for``: the time (truthy) at which the pool was complete with ``count`` devices
    and ``test(slices, devices)`` held; checked under the store's lock on every change."""

    def predicate() -> float | None:
        slices = _complete_pool(api)
        if slices is None:
            return None
        devices = _devices(slices)
        if len(devices) != count or len({d["name"] for d in devices}) != count or not test(slices, devices):
            return None
        return time.monotonic()

    return predicate


class _Until(threading.Thread):
    """Waits on the stand-in for a predicate from before an action starts, so a state the action leaves quickly
    is still seen; ``at`` is the predicate's time (None on timeout)."""

    def __init__(self, api: ApiServer, predicate: Callable[[], float | None], timeout: float = DEADLINE) -> None:
        super().__init__(daemon=True)
        self.api, self.predicate, self.timeout = api, predicate, timeout
        self.at: float | None = None
        self.start()

    def run(self) -> None:
        try:
            self.at = self.api.wait_for(self.predicate, self.timeout)
        except TimeoutError:
            self.at = None

    def result(self, what: str) -> float:
        self.join(self.timeout + 5)
        if self.at is None:
            raise RuntimeError(f"timed out waiting for {what}")
        return self.at


# ----- one node: the stand-in, both kubelet emulators and the agent process -----------------------------


class World:
    def __init__(self, base: Path, simulate: str, gpus: str, log_level: str, dra_extra: str = "") -> None:
        self.base = base
        (base / "config.yaml").write_text(f"version: v1\ndra:\n  enabled: true\n  gpus: {gpus}\n{dra_extra}")
        self.api = ApiServer(git_version=GIT_VERSION)
        self.api.start()
        self.api.add_node(NODE)
        selectors = [{"cel": {"expression": GPU_CLASS}}]
        self.api.create(
            "deviceclasses",
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "DeviceClass",
                "metadata": {"name": DRIVER},
                "spec": {"selectors": selectors},
            },
        )
        self.client = self.api.api_client()
        self.custom = kubernetes.client.CustomObjectsApi(self.client)
        self.kubelet = KubeletEmulator(base / "dp", base / "pr" / "kubelet.sock")
        self.kubelet.start()
        self.dra = DraKubeletEmulator(base / "registry", NODE, self.api.api_client(), wipe_delay=1.0)
        self.dra.start()
        self.command = [
            sys.executable, "-m", "agent", "run", "--simulate", simulate, "--sim-control", str(base / "ctl.sock"),
            "--config", str(base / "config.yaml"), "--node-name", NODE,
            "--kubeconfig", str(self.api.write_kubeconfig(base / "kubeconfig")),
            "--device-plugin-dir", str(base / "dp"), "--pod-resources-socket", str(base / "pr" / "kubelet.sock"),
            "--dra-registry-dir", str(base / "registry"), "--dra-plugins-dir", str(base / "plugins"),
            "--cdi-root", str(base / "cdi"), "--mig-strategy", "none", "--metrics-address", "off",
            "--health-recovery-seconds", RECOVERY_SECONDS, "--log-level", log_level,
        ]  # fmt: skip
        self.agent: subprocess.Popen[bytes] | None = None
        self.spawned = 0.0
        self.channel: grpc.Channel | None = None

    def spawn(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_") and k not in ("KUBECONFIG",)}
        log = (self.base / "agent.log").open("wb")
        self.spawned = time.monotonic()
        self.agent = subprocess.Popen(self.command, env=env, cwd=AGENT_HOME, stdout=log, stderr=log)
        log.close()

    def spawn_until_pool(self, devices: int) -> float:
        """Start the agent; when (monotonic) the stand-in held its complete pool of ``devices`` devices."""
        self.spawn()
        return self.api.wait_for(_pool_with(self.api, devices), DEADLINE)

    def registered(self) -> float:
        """When the DRA kubelet emulator registered the driver (monotonic)."""
        self.dra.wait_for(lambda: DRIVER in self.dra.drivers(), DEADLINE, "the DRA driver registered")
        return self.dra.registration_events(kind="registered", driver=DRIVER)[0].at

    def stub(self) -> dra_v1_grpc.DRAPluginStub:
        """The agent's DRA socket, dialled as the kubelet emulator dials it, on the v1 service."""
        plugin = self.dra.plugin(DRIVER)
        assert plugin is not None and plugin.service == "v1.DRAPlugin", plugin
        self.channel = grpc.insecure_channel(f"unix:{plugin.endpoint}", options=CHANNEL_OPTIONS)
        return dra_v1_grpc.DRAPluginStub(self.channel)

    def claim(self, name: str, count: int, allocated: set[tuple[str, str, str]]) -> dict:
        """A claim for ``count`` GPUs of NVIDIA's class, allocated by the simulated scheduler and stored with its
        allocation (``allocated``: devices other claims hold; the new ones are added)."""
        body = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {
                "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER, "count": count}}]}
            },
        }
        created = self.api.create("resourceclaims", body)
        classes = {c["metadata"]["name"]: c for c in self.api.objects("deviceclasses")}
        claim = allocate(created, _node_slices(self.api), classes, allocated, NODE)
        for result in claim["status"]["allocation"]["devices"]["results"]:
            allocated.add((result["driver"], result["pool"], result["device"]))
        return self.api.update("resourceclaims", claim, status=True)

    def rss(self) -> float:
        assert self.agent is not None
        return _rss_mib(self.agent.pid)

    def terminate(self) -> float:
        """SIGTERM -> exit, seconds."""
        assert self.agent is not None
        began = time.monotonic()
        self.agent.send_signal(signal.SIGTERM)
        self.agent.wait(timeout=DEADLINE)
        return time.monotonic() - began

    def log_tail(self) -> str:
        text = (self.base / "agent.log").read_text(errors="replace")
        return " | ".join(text.strip().splitlines()[-8:])

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
        if self.agent is not None and self.agent.poll() is None:
            self.agent.kill()
            self.agent.wait()
        self.dra.stop()
        self.kubelet.stop()
        self.client.close()
        self.api.stop()


def _with_world(
    base: Path, simulate: str, gpus: str, args: argparse.Namespace, body: Callable[[World], None], dra_extra: str = ""
) -> None:
    world = World(base, simulate, gpus, args.agent_log_level, dra_extra)
    try:
        body(world)
    except Exception:
        print(f"agent log: {world.log_tail()}", file=sys.stderr)
        raise
    finally:
        world.close()


def _request(claim: dict) -> tuple[dra_v1.NodePrepareResourcesRequest, dra_v1.NodeUnprepareResourcesRequest]:
    meta = claim["metadata"]
    wire = [dra_v1.Claim(namespace=meta["namespace"], uid=meta["uid"], name=meta["name"])]
    return dra_v1.NodePrepareResourcesRequest(claims=wire), dra_v1.NodeUnprepareResourcesRequest(claims=wire)


def _check(response: Any, claim: dict, devices: int | None) -> None:
    """The answer has the claim without an error (and, for a prepare, its ``devices`` devices)."""
    uid = claim["metadata"]["uid"]
    entry = response.claims[uid]
    if entry.error or (devices is not None and len(entry.devices) != devices):
        raise RuntimeError(f"claim {claim['metadata']['name']}: error {entry.error!r}, {len(entry.devices)} devices")


def _pairs(stub: dra_v1_grpc.DRAPluginStub, claim: dict, count: int, prepare: list[float], unprepare: list[float]):
    prepare_request, unprepare_request = _request(claim)
    _check(_timed(prepare, stub.NodePrepareResources, prepare_request, timeout=45), claim, count)
    _check(_timed(unprepare, stub.NodeUnprepareResources, unprepare_request, timeout=45), claim, None)


# ----- the parts ----------------------------------------------------------------------------------------


def floors(figures: dict[str, Figure]) -> None:
    """A fresh interpreter importing grpc and the Kubernetes client APIs the agent uses: seconds and RSS."""
    out = subprocess.run([sys.executable, "-c", FLOOR_CODE], check=True, capture_output=True, text=True).stdout
    seconds, core_seconds, rss, core_rss = map(float, out.split())
    figures["floor import"].add_one(seconds)
    figures["floor import core"].add_one(core_seconds)
    figures["floor rss"].add_one(rss)
    figures["floor rss core"].add_one(core_rss)


def prepare_node(base: Path, args: argparse.Namespace, figures: dict[str, Figure]) -> None:
    def body(world: World) -> None:
        world.spawn()
        world.api.wait_for(_pool_with(world.api, GPUS), DEADLINE)
        world.registered()
        figures["full rss start"].add_one(world.rss())
        allocated: set[tuple[str, str, str]] = set()
        ones = [world.claim(f"one-{n}", 1, allocated) for n in range(GPUS)]  # gpu-0 ... gpu-7, one each
        eight = world.claim("eight", GPUS, set())  # all eight (prepared only while no 1-GPU claim is)
        stub = world.stub()
        probe = dra_v1.NodePrepareResourcesRequest()
        floor_dir = base / "floor"
        floor_dir.mkdir()
        payload = b"x" * 1024
        get = world.custom.get_namespaced_custom_object
        scratch: list[float] = []
        for n in range(WARM_UP):  # connections, worker threads, caches
            stub.NodePrepareResources(probe, timeout=45)
            get("resource.k8s.io", "v1", "default", "resourceclaims", "one-0")
            _pairs(stub, ones[n % GPUS], 1, scratch, scratch)
        times: dict[str, list[float]] = {
            k: [] for k in ("probe", "get", "atomic", "prepare 1", "unprepare 1", "prepare 8", "unprepare 8")
        }
        for n in range(args.prepares):
            _timed(times["probe"], stub.NodePrepareResources, probe, timeout=45)
            _timed(times["get"], get, "resource.k8s.io", "v1", "default", "resourceclaims", "one-0")
            _timed(times["atomic"], write_atomically, floor_dir / "floor.json", payload, 0o644)
            _pairs(stub, ones[n % GPUS], 1, times["prepare 1"], times["unprepare 1"])
            _pairs(stub, eight, GPUS, times["prepare 8"], times["unprepare 8"])
        for key, values in times.items():
            figures[key].add(values)

        # the kubelet's view: run_pod / stop_pod; and the stand-in's PUT of a claim's status as their floor
        pods: dict[str, list[float]] = {k: [] for k in ("run 1", "stop 1", "run 8", "stop 8", "put")}
        floor_claim = world.claim("floor", 1, set())
        status_body = copy.deepcopy(floor_claim)
        reserved = [{"resource": "pods", "name": "floor", "uid": "00000000-0000-4000-8000-000000000000"}]
        put = world.custom.replace_namespaced_custom_object_status
        for n in range(args.pods):
            for count, claim in ((1, ones[n % GPUS]), (GPUS, eight)):
                uid = f"{n:08d}-0000-4000-8000-{count:012d}"
                name = claim["metadata"]["name"]
                pod, containers = f"pod-{n}-{count}", {"c": [("gpu", None)]}
                ids = _timed(pods[f"run {count}"], world.dra.run_pod, "default", pod, uid, [("gpu", name)], containers)
                if len(ids["c"]) != count:  # the claim's own ID for each GPU (its spec stands alone)
                    raise RuntimeError(f"pod of {name}: CDI IDs {ids}")
                _timed(pods[f"stop {count}"], world.dra.stop_pod, uid)
            for _ in range(2):  # add the reservation, take it away: the two writes of a pod's life
                if status_body["status"].get("reservedFor"):
                    del status_body["status"]["reservedFor"]
                else:
                    status_body["status"]["reservedFor"] = reserved
                status_body = _timed(
                    pods["put"], put, "resource.k8s.io", "v1", "default", "resourceclaims", "floor", status_body
                )
        for key, values in pods.items():
            figures[key].add(values)
        figures["full rss loop"].add_one(world.rss())

    _with_world(base, "dgx-a100", "all", args, body)


def mig_node(base: Path, args: argparse.Namespace, figures: dict[str, Figure]) -> None:
    spec = base / "dgx-a100-mig.yaml"
    spec.write_text(MIG_SPEC)

    def body(world: World) -> None:
        api = world.api
        complete = world.spawn_until_pool(MIG_DEVICES)
        registered = world.registered()
        figures["mig start"].add_one(complete - world.spawned)
        figures["mig registered"].add_one(registered - world.spawned)
        deadline = time.monotonic() + DEADLINE
        while True:  # the stand-in logs a request after storing what it wrote: the pool can be seen first
            agent_requests = [r for r in api.requests() if r.time > world.spawned]
            writes = [r for r in agent_requests if r.resource == "resourceslices" and r.verb in ("create", "update")]
            if writes or time.monotonic() > deadline:
                break
            time.sleep(0.001)
        figures["mig first request"].add_one(agent_requests[0].time - world.spawned)
        figures["mig first write"].add_one(writes[0].time - world.spawned)
        figures["mig writes"].add_one(len(writes))
        figures["mig rss start"].add_one(world.rss())

        # floors: the stand-in's PUT of this very slice (for another node) over HTTP, and its validation alone
        (published,) = _complete_pool(api) or [None]
        assert published is not None, "the 56 devices are expected in one slice"
        api.add_node("floor-node")
        floor_slice = copy.deepcopy(published)
        floor_slice["metadata"] = {"name": "floor-slice"}
        floor_slice["spec"]["nodeName"] = "floor-node"
        floor_slice["spec"]["pool"]["name"] = "floor-node"
        create = world.custom.create_cluster_custom_object
        replace = world.custom.replace_cluster_custom_object
        stored = create("resource.k8s.io", "v1", "resourceslices", floor_slice)
        put, validate = [], []
        for n in range(args.writes):
            stored["spec"]["pool"]["generation"] = n + 2
            stored = _timed(put, replace, "resource.k8s.io", "v1", "resourceslices", "floor-slice", stored)
            _timed(validate, api.validator.check, RESOURCE_SLICE, stored)
        figures["slice put"].add(put)
        figures["slice validate"].add(validate)
        world.custom.delete_cluster_custom_object("resource.k8s.io", "v1", "resourceslices", "floor-slice")

        control = SimControlClient(world.base / "ctl.sock")
        devices = [d["name"] for d in _devices(_complete_pool(api) or [])]
        names = {g: [d for d in devices if d.startswith(f"gpu-{g}-")] for g in range(GPUS)}  # 7 MIG devices each
        health, taint, untaint = [], [], []
        for n in range(args.xids):
            gpu, xid = n % GPUS, XIDS[n % len(XIDS)]

            def tainted(slices: list[dict], devices: list[dict], gpu: int = gpu, xid: int = xid) -> bool:
                mine = [d for d in devices if d["name"] in names[gpu]]
                return len(mine) == len(names[gpu]) and all(
                    any(t["key"] == f"{DRIVER}/xid" and t["value"] == str(xid) for t in d.get("taints") or [])
                    for d in mine
                )

            seen = _Until(api, _pool_with(api, MIG_DEVICES, tainted))
            began = time.monotonic()
            control.call("inject_xid", gpu=gpu, xid=xid)
            world.dra.wait_for(
                lambda gpu=gpu: all(world.dra.device_health(DRIVER, NODE, d) == "Unhealthy" for d in names[gpu]),
                DEADLINE,
                "Unhealthy in the kubelet's health cache",
            )
            health.append(time.monotonic() - began)
            at = seen.result("the taint in the slice")
            taint.append(at - began)
            clean = api.wait_for(
                _pool_with(api, MIG_DEVICES, lambda s, d: not any(x.get("taints") for x in d)), DEADLINE
            )
            untaint.append(clean - at)
            world.dra.wait_for(
                lambda gpu=gpu: all(world.dra.device_health(DRIVER, NODE, d) == "Healthy" for d in names[gpu]),
                DEADLINE,
                "Healthy again in the kubelet's health cache",
            )
        figures["xid health"].add(health)
        figures["xid taint"].add(taint)
        figures["xid untaint"].add(untaint)

        from_call, from_wipe, call = [], [], []
        for _ in range(args.restarts):
            before = {s["metadata"]["uid"] for s in _node_slices(api)}
            wipes = api.count("deletecollection", "resourceslices")
            back = _Until(
                api,
                _pool_with(api, MIG_DEVICES, lambda s, d, old=before: not any(x["metadata"]["uid"] in old for x in s)),
            )
            began = time.monotonic()
            world.dra.restart()
            call.append(time.monotonic() - began)
            at = back.result("the slices back after a kubelet restart")
            wipe = api.requests("deletecollection", "resourceslices")
            if len(wipe) <= wipes:
                raise RuntimeError("the kubelet restart wiped nothing")
            from_call.append(at - began)
            from_wipe.append(at - wipe[-1].time)
            world.dra.wait_for(lambda: DRIVER in world.dra.drivers(), DEADLINE, "registered again")
        figures["restart"].add(from_call)
        figures["restart wipe"].add(from_wipe)
        figures["restart call"].add(call)
        figures["mig rss end"].add_one(world.rss())
        figures["sigterm"].add_one(world.terminate())

    _with_world(base, str(spec), "all", args, body)


def dynamic_node(base: Path, args: argparse.Namespace, figures: dict[str, Figure]) -> None:
    """A dgx-h100 in MIG mode with no MIG device, every GPU in dynamic-MIG mode."""
    spec = base / "dgx-h100-dynamic.yaml"
    spec.write_text(DYNAMIC_SPEC)

    def body(world: World) -> None:
        api = world.api
        complete = world.spawn_until_pool(DYNAMIC_DEVICES)
        figures["dyn start"].add_one(complete - world.spawned)
        figures["dyn slices"].add_one(len(_complete_pool(api) or []))
        figures["dyn devices"].add_one(DYNAMIC_DEVICES)
        world.registered()
        api.create("deviceclasses", {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
                                     "metadata": {"name": "mig.nvidia.com"},
                                     "spec": {"selectors": [{"cel": {"expression": MIG_CLASS}}]}})  # fmt: skip
        classes = {c["metadata"]["name"]: c for c in api.objects("deviceclasses")}
        slices = _complete_pool(api) or []
        control = SimControlClient(world.base / "ctl.sock")
        stub = world.stub()

        def claim(name: str, profile: str, held: set[tuple[str, str, str]]) -> dict | None:
            """A claim for one MIG device of ``profile``, allocated around ``held``; None when nothing fits."""
            return _allocated_claim(api, name, _mig_request(profile), slices, classes, held)

        # Prepare (creates the MIG device) and Unprepare (destroys it), one 1g.10gb claim at a time
        one = claim("timed", "1g.10gb", set())
        assert one is not None
        prepare, unprepare = [], []
        for _ in range(args.prepares // 4):
            _pairs(stub, one, 1, prepare, unprepare)
        figures["dyn prepare"].add(prepare)
        figures["dyn unprepare"].add(unprepare)

        # churn: claims of random profiles come and go; the node's MIG devices must always be exactly the prepared
        # claims' partitions, at their placements
        rng = random.Random(len(prepare))
        live: dict[str, tuple[dict, tuple[str, str, str]]] = {}
        refused = checks = 0
        for n in range(args.churn):
            if live and (rng.random() < 0.45 or len(live) > 40):
                name = rng.choice(sorted(live))
                done, _ = live.pop(name)
                _check(stub.NodeUnprepareResources(_request(done)[1], timeout=45), done, None)
                api.delete("resourceclaims", name, namespace="default")
            else:
                made = claim(f"churn-{n}", rng.choice(CHURN_PROFILES), {d for _, d in live.values()})
                if made is None:
                    refused += 1
                    continue
                (result,) = made["status"]["allocation"]["devices"]["results"]
                _check(stub.NodePrepareResources(_request(made)[0], timeout=45), made, 1)
                live[made["metadata"]["name"]] = (made, (result["driver"], result["pool"], result["device"]))
            if n % 10 == 0 or n == args.churn - 1:
                checks += 1
                _same_partitions(control.call("mig_devices"), [device for _, (_, _, device) in live.values()])
        for done, _ in live.values():
            _check(stub.NodeUnprepareResources(_request(done)[1], timeout=45), done, None)
        left = control.call("mig_devices")
        specs = list((world.base / "cdi").glob("*.yaml"))
        if left or specs:
            raise RuntimeError(f"after the churn: MIG devices {left}, CDI specs {[p.name for p in specs]}")
        figures["dyn churn"].add_one(args.churn)
        figures["dyn refused"].add_one(refused)
        figures["dyn checks"].add_one(checks)
        figures["dyn rss"].add_one(world.rss())

    _with_world(base, str(spec), "all", args, body, dra_extra="  dynamicMig: all\n")


def shares_node(base: Path, args: argparse.Namespace, figures: dict[str, Figure]) -> None:
    """A dgx-h100: GPUs 0-3 in dynamic-MIG mode, 4-7 shared by memory; a churn of MIG partitions and shares."""
    from agent.sim.scheduler import devices_in_use

    spec = base / "dgx-h100-shares.yaml"
    spec.write_text(SHARES_SPEC)
    launcher = base / "bin" / "nvidia-cuda-mps-control"
    launcher.parent.mkdir()
    launcher.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m agent.sim.mps.control "$@"\n')
    launcher.chmod(0o755)
    root = base / "mps"

    def body(world: World) -> None:
        api = world.api
        config = (world.base / "config.yaml").read_text()
        (world.base / "config.yaml").write_text(
            config.replace("version: v1\n", f"version: v1\nflags: {{mpsRoot: '{root}'}}\n")
        )
        world.command += ["--mps-control", str(launcher)]
        complete = world.spawn_until_pool(SHARES_DEVICES)
        figures["mix start"].add_one(complete - world.spawned)
        world.registered()
        api.create("deviceclasses", {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
                                     "metadata": {"name": "mig.nvidia.com"},
                                     "spec": {"selectors": [{"cel": {"expression": MIG_CLASS}}]}})  # fmt: skip
        classes = {c["metadata"]["name"]: c for c in api.objects("deviceclasses")}
        slices = _complete_pool(api) or []
        memory = {
            d["name"]: d["capacity"]["memory"]["value"] for d in _devices(slices) if d.get("allowMultipleAllocations")
        }
        uuids = {d["name"]: d["attributes"]["uuid"]["string"] for d in _devices(slices) if d["name"] in memory}
        control = SimControlClient(world.base / "ctl.sock")
        stub = world.stub()
        rng = random.Random(7)
        live: dict[str, dict] = {}
        times: dict[str, list[float]] = {
            "share prepare": [],
            "first share": [],
            "share unprepare": [],
            "mig prepare": [],
        }
        counts = {"shares": 0, "refused": 0, "peak": 0, "checks": 0}

        def new_claim(name: str) -> dict | None:
            if rng.random() < 0.5:
                exactly = _mig_request(rng.choice(CHURN_PROFILES))
            else:
                asked = {"memory": f"{rng.choice(SHARE_MEMORY_GIB)}Gi"}
                compute = rng.choice(SHARE_COMPUTE)
                if compute is not None:
                    asked["computePercent"] = str(compute)
                exactly = {"deviceClassName": DRIVER, "capacity": {"requests": asked},
                           "selectors": [{"cel": {"expression": "device.allowMultipleAllocations"}}]}  # fmt: skip
            held, consumed = devices_in_use(live.values())
            return _allocated_claim(api, name, exactly, slices, classes, held, consumed)

        def check() -> None:
            results = {n: c["status"]["allocation"]["devices"]["results"][0] for n, c in live.items()}
            _same_partitions(
                control.call("mig_devices"), [r["device"] for r in results.values() if "-mig-" in r["device"]]
            )
            by_gpu: dict[str, int] = {}
            for name, result in results.items():
                if "consumedCapacity" not in result:
                    continue
                spec_text = (
                    world.base / "cdi" / f"k8s.gpu.nvidia.com-claim_{live[name]['metadata']['uid']}.yaml"
                ).read_text()
                limit = f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={uuids[result['device']]}="
                mib = next(int(line.split(limit, 1)[1].rstrip("M")) for line in spec_text.splitlines() if limit in line)
                wanted = int(result["consumedCapacity"]["memory"].removesuffix("Gi")) * 1024
                if mib != wanted:
                    raise RuntimeError(f"claim {name}: MPS memory limit {mib} MiB, allocated {wanted} MiB")
                by_gpu[result["device"]] = by_gpu.get(result["device"], 0) + mib
            for device, used in by_gpu.items():
                total = int(memory[device].removesuffix("Mi"))
                if used > total:
                    raise RuntimeError(f"{device}: shares of {used} MiB on a GPU of {total} MiB")
            counts["peak"] = max(
                [
                    counts["peak"],
                    *(sum(1 for r in results.values() if r["device"] == d and "consumedCapacity" in r) for d in memory),
                ]
            )
            counts["checks"] += 1

        for n in range(args.churn):
            if live and (rng.random() < 0.45 or len(live) > 40):
                name = rng.choice(sorted(live))
                done = live.pop(name)
                share = "consumedCapacity" in done["status"]["allocation"]["devices"]["results"][0]
                response = _timed(
                    times["share unprepare"] if share else [],
                    stub.NodeUnprepareResources,
                    _request(done)[1],
                    timeout=45,
                )
                _check(response, done, None)
                api.delete("resourceclaims", name, namespace="default")
            else:
                made = new_claim(f"churn-{n}")
                if made is None:
                    counts["refused"] += 1
                    continue
                result = made["status"]["allocation"]["devices"]["results"][0]
                share = "consumedCapacity" in result
                running = any(
                    c["status"]["allocation"]["devices"]["results"][0]["device"] == result["device"]
                    for c in live.values()
                )
                into = times["mig prepare" if not share else "share prepare" if running else "first share"]
                _check(_timed(into, stub.NodePrepareResources, _request(made)[0], timeout=45), made, 1)
                counts["shares"] += share
                live[made["metadata"]["name"]] = made
            if n % 10 == 0 or n == args.churn - 1:
                check()
        for done in live.values():
            _check(stub.NodeUnprepareResources(_request(done)[1], timeout=45), done, None)
        deadline = time.monotonic() + DEADLINE
        while (
            daemons := sorted(p.parent.parent.name for p in root.glob("dra/*/pipe/*.pid"))
        ) and time.monotonic() < deadline:
            time.sleep(0.05)  # the last share's daemon drains and quits on the agent's loop
        left = control.call("mig_devices")
        specs = list((world.base / "cdi").glob("*.yaml"))
        if left or specs or daemons:
            raise RuntimeError(
                f"after the churn: MIG devices {left}, CDI specs {[p.name for p in specs]}, MPS daemons {daemons}"
            )
        for key, samples in times.items():
            figures[f"mix {key}"].add(samples)
        figures["mix churn"].add_one(args.churn)
        for key, value in counts.items():
            figures[f"mix {key}"].add_one(value)
        figures["mix rss"].add_one(world.rss())

    _with_world(base, str(spec), "all", args, body, dra_extra="  dynamicMig: [0, 1, 2, 3]\n  gpuShares: [4, 5, 6, 7]\n")


def _mig_request(profile: str) -> dict:
    """One MIG device of ``profile`` through NVIDIA's ``mig.nvidia.com`` class."""
    selector = f"device.attributes['gpu.nvidia.com'].profile == '{profile}'"
    return {"deviceClassName": "mig.nvidia.com", "selectors": [{"cel": {"expression": selector}}]}


def _allocated_claim(
    api: ApiServer,
    name: str,
    exactly: dict,
    slices: list[dict],
    classes: dict[str, dict],
    held: set[tuple[str, str, str]],
    consumed: dict | None = None,
) -> dict | None:
    """A claim of one request (``exactly``), allocated by the simulated scheduler around what other claims hold and
    consume, and stored; None (and nothing stored) when nothing fits."""
    body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"devices": {"requests": [{"name": "r", "exactly": exactly}]}}}  # fmt: skip
    created = api.create("resourceclaims", body)
    try:
        allocated = allocate(created, slices, classes, held, NODE, consumed=consumed)
    except Unschedulable:
        api.delete("resourceclaims", name, namespace="default")
        return None
    return api.update("resourceclaims", allocated, status=True)


def _same_partitions(made: list[dict], prepared: list[str]) -> None:
    """The node's MIG devices are exactly the prepared partitions (``gpu-<minor>-mig-<profile>-<id>-<start>``):
    none missing, none left over, none overlapping another on its GPU."""
    have = sorted((m["gpu"], m["start"]) for m in made)
    want = sorted((int(d.split("-")[1]), int(d.rsplit("-", 1)[1])) for d in prepared)
    if have != want:
        raise RuntimeError(f"MIG devices at {have}, prepared partitions at {want}")
    for gpu in {m["gpu"] for m in made}:
        used: set[int] = set()
        for m in (m for m in made if m["gpu"] == gpu):
            slices = set(range(m["start"], m["start"] + m["size"]))
            if used & slices:
                raise RuntimeError(f"overlapping MIG devices on GPU {gpu}: {made}")
            used |= slices


def both_front_ends(base: Path, args: argparse.Namespace, figures: dict[str, Figure]) -> None:
    def body(world: World) -> None:
        world.spawn()
        pool = _Until(world.api, _pool_with(world.api, 4))
        world.kubelet.wait_for(
            lambda: RESOURCE in world.kubelet.resources() and world.kubelet.allocatable(RESOURCE) == 4,
            timeout=DEADLINE,
            what="4 GPUs through the device plugin",
        )
        plugin = time.monotonic()
        both = max(plugin, pool.result("a complete pool of 4"), world.registered())
        figures["both start"].add_one(both - world.spawned)
        figures["both rss start"].add_one(world.rss())
        allocated: set[tuple[str, str, str]] = set()
        ones = [world.claim(f"one-{n}", 1, allocated) for n in range(4)]
        four = world.claim("four", 4, set())
        stub = world.stub()
        scratch: list[float] = []
        for n in range(args.prepares):
            _pairs(stub, ones[n % 4], 1, scratch, scratch)
            _pairs(stub, four, 4, scratch, scratch)
        for n in range(args.pods):
            world.kubelet.create_pod(f"dp-{n}", {"main": {RESOURCE: 1}})
            world.kubelet.delete_pod(f"dp-{n}")
        figures["both rss loop"].add_one(world.rss())

    _with_world(base, "dgx-a100", "[0, 1, 2, 3]", args, body)


# ----- report -------------------------------------------------------------------------------------------


SECTIONS: tuple[tuple[str, dict[str, tuple[str, ...]]], ...] = (
    (
        "1. NodePrepareResources, dgx-a100 (8 GPUs, DRA all): the gRPC call on the agent's DRA socket",
        {
            "probe": ("floor: empty NodePrepareResources (NVIDIA's probe)", "-"),
            "get": ("floor: stand-in GET ResourceClaim over HTTP (k8s client)", "-"),
            "atomic": ("floor: atomic 1 KiB write (fsync file + dir), same fs", "-"),
            "prepare 1": ("NodePrepareResources, 1-GPU claim", "p99 < 50 ms"),
            "unprepare 1": ("NodeUnprepareResources, 1-GPU claim", "-"),
            "prepare 8": ("NodePrepareResources, 8-GPU claim", "p99 < 50 ms"),
            "unprepare 8": ("NodeUnprepareResources, 8-GPU claim", "-"),
            "put": ("floor: stand-in PUT ResourceClaim status over HTTP", "-"),
            "run 1": ("kubelet run_pod, 1-GPU claim (GET + PUT + Prepare)", "-"),
            "stop 1": ("kubelet stop_pod, 1-GPU claim (Unprepare + GET + PUT)", "-"),
            "run 8": ("kubelet run_pod, 8-GPU claim", "-"),
            "stop 8": ("kubelet stop_pod, 8-GPU claim", "-"),
            "full rss start": ("RSS after start (DRA only)", "-", "MB"),
            "full rss loop": ("RSS after the prepare and pod loops", "-", "MB"),
        },
    ),
    (
        "2. dgx-a100 in MIG mode (56 x 1g.10gb, DRA all)",
        {
            "floor import": ("floor: fresh interpreter, import grpc + k8s client APIs", "-"),
            "floor import core": ("  the typed CoreV1Api would add (not used)", "-"),
            "mig first request": ("spawn -> the agent's first API request answered", "-"),
            "mig first write": ("spawn -> its first ResourceSlice write answered", "-"),
            "mig start": ("spawn -> complete pool with 56 MIG devices", "< 1 s"),
            "mig registered": ("spawn -> registered with the DRA kubelet", "-"),
            "mig writes": ("ResourceSlice writes until then (count)", "-", "n"),
            "slice put": ("floor: stand-in PUT of the 56-device slice over HTTP", "-"),
            "slice validate": ("  of which schema (x2 versions) + rules, in process", "-"),
            "xid health": ("XID -> Unhealthy in the kubelet's health cache", "-"),
            "xid taint": ("XID -> taint on the GPU's 7 devices in the slice", "p99 < 500 ms"),
            "xid untaint": ("taint -> taint gone (recovery, quiet 0.05 s)", "-"),
            "restart": ("kubelet restart() -> complete pool of new slices", "< 2 s"),
            "restart wipe": ("  from the wipe's DeleteCollection answer", "-"),
            "restart call": ("  the emulator's restart() call itself", "-"),
            "sigterm": ("SIGTERM -> exit", "-"),
            "mig rss start": ("RSS after start (DRA only, 56 devices)", "-", "MB"),
            "mig rss end": ("RSS after the XIDs and restarts", "-", "MB"),
        },
    ),
    (
        "3. both front ends, dgx-a100 (DRA GPUs 0-3, device plugin 4-7)",
        {
            "floor rss": ("floor: RSS of the fresh interpreter of part 2", "-", "MB"),
            "floor rss core": ("  the typed CoreV1Api would add (not used)", "-", "MB"),
            "both start": ("spawn -> plugin has 4 GPUs, DRA pool of 4, registered", "-"),
            "both rss start": ("RSS after start, both front ends", "< 100 MB", "MB"),
            "both rss loop": ("RSS after prepare pairs + device-plugin pods", "< 100 MB", "MB"),
        },
    ),
    (
        "4. dgx-h100 in dynamic-MIG mode (8 GPUs, MIG on, no MIG device; issue 16)",
        {
            "dyn start": ("spawn -> complete pool (whole GPUs + every profile placement)", "< 2 s"),
            "dyn devices": ("devices in the pool", "-", "n"),
            "dyn slices": ("slices in the pool (1.36: counter slice + device slices)", "-", "n"),
            "dyn prepare": ("NodePrepareResources, 1g.10gb (creates the MIG device)", "p99 < 200 ms"),
            "dyn unprepare": ("NodeUnprepareResources, 1g.10gb (destroys it)", "p99 < 200 ms"),
            "dyn churn": ("churn steps (claims of random profiles, prepared and unprepared)", "-", "n"),
            "dyn refused": ("  of which no room (the allocator found no free placement)", "-", "n"),
            "dyn checks": ("  node's MIG devices == prepared partitions, no overlap: checks passed", "-", "n"),
            "dyn rss": ("RSS after the churn", "-", "MB"),
        },
    ),
    (
        "5. dgx-h100, GPUs 0-3 dynamic MIG and 4-7 shared by memory (issue 16)",
        {
            "mix start": ("spawn -> complete pool", "< 2 s"),
            "mix share prepare": ("NodePrepareResources, a memory share, its GPU's MPS daemon running", "-"),
            "mix first share": ("NodePrepareResources, the first share of a GPU (waits for its daemon)", "-"),
            "mix share unprepare": ("NodeUnprepareResources, a memory share", "-"),
            "mix mig prepare": ("NodePrepareResources, a MIG partition (created)", "-"),
            "mix churn": ("churn steps (MIG partitions and memory shares, prepared and unprepared)", "-", "n"),
            "mix shares": ("  of which shares prepared", "-", "n"),
            "mix refused": ("  of which no room (the allocator found nothing free)", "-", "n"),
            "mix peak": ("  most shares live on one GPU at once", "-", "n"),
            "mix checks": ("  MIG devices == partitions; shares' MPS limits == allocations, <= GPU memory", "-", "n"),
            "mix rss": ("RSS after the churn", "-", "MB"),
        },
    ),
)


def _figures() -> dict[str, Figure]:
    return {key: Figure(*row) for _, rows in SECTIONS for key, row in rows.items()}


def _value(value: float, unit: str) -> str:
    if unit == "ms":
        return f"{value * 1000:.1f} ms"
    if unit == "MB":
        return f"{value:.1f} MB"
    return f"{value:g}"


def _row(figure: Figure) -> str:
    if not figure.p50:
        return f"| {figure.name} | - | - | - | - | 0 | {figure.target} |"
    p50 = _value(statistics.median(figure.p50), figure.unit)
    p99 = "-" if figure.single else _value(statistics.median(figure.p99), figure.unit)
    low, high = _value(min(figure.samples), figure.unit), _value(max(figure.samples), figure.unit)
    return f"| {figure.name} | {p50} | {p99} | {low} | {high} | {len(figure.samples)} | {figure.target} |"


def report(figures: dict[str, Figure], args: argparse.Namespace) -> None:
    print(
        f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}, Python {platform.python_version()}, "
        f"grpcio {grpc.__version__}, kubernetes {kubernetes.__version__}; stand-in {GIT_VERSION}, schemas "
        f"{', '.join(DEFAULT_SCHEMA_VERSIONS)}; {args.rounds} rounds; p50 / p99: medians of the per-round values "
        "(one value per round: its median); min / max over every sample"
    )
    print(
        f"per round: {args.prepares} prepare/unprepare pairs of each size, {args.pods} pods of each size, "
        f"{args.xids} XIDs, {args.restarts} kubelet restarts, {args.writes} slice writes"
    )
    for title, rows in SECTIONS:
        print()
        print(title)
        print()
        print("| measure | p50 | p99 | min | max | n | target |")
        print("|---|---|---|---|---|---|---|")
        for key in rows:
            print(_row(figures[key]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prepares", type=int, default=200, help="prepare/unprepare pairs per size per round")
    parser.add_argument("--pods", type=int, default=30, help="run_pod/stop_pod per size per round")
    parser.add_argument("--xids", type=int, default=20, help="XIDs per round")
    parser.add_argument("--restarts", type=int, default=10, help="kubelet restarts per round")
    parser.add_argument("--writes", type=int, default=30, help="stand-in slice writes per round (floor)")
    parser.add_argument("--agent-log-level", default="warning")
    parser.add_argument("--churn", type=int, default=1000, help="dynamic-MIG claim churn steps per round")
    parser.add_argument(
        "--parts", default="prepare,mig,both,dynamic,shares,dynamic-mode", help="which parts to run (comma-separated)"
    )
    args = parser.parse_args()
    logging.disable(logging.ERROR)  # the emulators' and the stand-in's notes are not the report

    figures = _figures()
    parts: dict[str, Callable[[Path], None]] = {
        "prepare": lambda base: prepare_node(base, args, figures),
        "mig": lambda base: (floors(figures), mig_node(base, args, figures)),
        "both": lambda base: both_front_ends(base, args, figures),
        "dynamic": lambda base: dynamic_node(base, args, figures),
        "shares": lambda base: shares_node(base, args, figures),
        "dynamic-mode": lambda base: bench_prepare_dynamic_mig_mode(base, args, figures),
    }
    steps = [parts[name] for name in args.parts.split(",")]
    global AGENT_HOME
    home = Path(tempfile.mkdtemp(prefix="bench-dra-"))
    AGENT_HOME = package_copy(home, compiled=True)
    try:
        run_rounds(args, steps)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    report(figures, args)


def run_rounds(args: argparse.Namespace, steps: list[Callable[[Path], None]]) -> None:
    for n in range(args.rounds):
        for step in steps[n % len(steps) :] + steps[: n % len(steps)]:  # each round starts elsewhere
            base = Path(tempfile.mkdtemp(prefix="bd", dir="/tmp"))  # unix socket paths must stay short
            try:
                step(base)
            finally:
                shutil.rmtree(base, ignore_errors=True)
        print(f"round {n + 1}/{args.rounds} done", file=sys.stderr, flush=True)


# ----- 6. dynamic MIG with the MIG-mode toggle (issue 25) --------------------------------------------------------

DYNAMIC_MODE_DEVICES = 8 * 26  # a dgx-h100 with MIG mode off: per GPU the whole GPU and 25 profile placements
SECTIONS += (
    (
        "6. Dynamic MIG with MIG mode off (issue 25): dgx-h100, MIG mode turned on at Prepare and off at Unprepare",
        {
            "mode floor": ("floor: NodePrepareResources, 1g.10gb on a GPU already in MIG mode", "-"),
            "mode prepare": ("NodePrepareResources, 1g.10gb (MIG mode on, then the MIG device)", "p99 < 200 ms"),
            "mode unprepare": ("NodeUnprepareResources, 1g.10gb (the MIG device, then MIG mode off)", "-"),
            "mode toggles": ("  nvmlDeviceSetMigMode calls per prepare/unprepare pair", "2", "n"),
        },
    ),
)


def bench_prepare_dynamic_mig_mode(base: Path, args: argparse.Namespace, figures: dict[str, Figure]) -> None:
    """A dgx-h100 whose GPUs are in dynamic-MIG mode with MIG mode off (NVIDIA's dynamic MIG): Prepare of a
    1g.10gb turns its GPU's MIG mode on (in the ledger's critical section: who holds the GPU is read first) and
    creates the MIG device; Unprepare destroys it and turns MIG mode off. The floor, in the same run: the same
    claim prepared while another claim keeps a 1g.10gb on that GPU, so its MIG mode is on already (no toggle)."""

    def body(world: World) -> None:
        api = world.api
        world.spawn_until_pool(DYNAMIC_MODE_DEVICES)
        world.registered()
        api.create("deviceclasses", {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
                                     "metadata": {"name": "mig.nvidia.com"},
                                     "spec": {"selectors": [{"cel": {"expression": MIG_CLASS}}]}})  # fmt: skip
        classes = {c["metadata"]["name"]: c for c in api.objects("deviceclasses")}
        slices = _complete_pool(api) or []
        control = SimControlClient(world.base / "ctl.sock")
        stub = world.stub()

        def toggles() -> int:
            return sum(1 for c in control.call("destructive_calls") if c["symbol"] == "nvmlDeviceSetMigMode")

        timed = _allocated_claim(api, "timed", _mig_request("1g.10gb"), slices, classes, set())
        assert timed is not None
        (result,) = timed["status"]["allocation"]["devices"]["results"]
        held = {(result["driver"], result["pool"], result["device"])}
        pairs = max(1, args.prepares // 4)
        before, prepare, unprepare = toggles(), [], []
        for _ in range(pairs):
            _pairs(stub, timed, 1, prepare, unprepare)
        figures["mode toggles"].add_one((toggles() - before) / pairs)
        if control.call("mig_devices"):
            raise RuntimeError(f"MIG devices left after the pairs: {control.call('mig_devices')}")
        figures["mode prepare"].add(prepare)
        figures["mode unprepare"].add(unprepare)

        # the floor: another 1g.10gb on the same GPU keeps its MIG mode on
        gpu = next(d for d in _devices(slices) if d["name"] == result["device"])["attributes"]["parentUUID"]["string"]
        same_gpu = {**_mig_request("1g.10gb")}
        same_gpu["selectors"] = [
            *same_gpu["selectors"],
            {"cel": {"expression": f"device.attributes['gpu.nvidia.com'].parentUUID == '{gpu}'"}},
        ]
        keeper = _allocated_claim(api, "keeper", same_gpu, slices, classes, held)
        assert keeper is not None
        _check(stub.NodePrepareResources(_request(keeper)[0], timeout=45), keeper, 1)
        floor: list[float] = []
        after_floor: list[float] = []
        for _ in range(pairs):
            _pairs(stub, timed, 1, floor, after_floor)
        figures["mode floor"].add(floor)
        _check(stub.NodeUnprepareResources(_request(keeper)[1], timeout=45), keeper, None)

    _with_world(base, "dgx-h100", "all", args, body, dra_extra="  dynamicMig: all\n")


def bench_prepare_self_contained(rounds: int = 5, prepares: int = 200) -> None:
    """Prepare p99 of a whole GPU with the self-contained claim spec (issue 25: < 50 ms), in process.

    The DRA service alone (``tests/integration/test_dra_service.py``'s node: real gRPC on its unix socket, the
    checkpoint and the CDI spec fsynced on this disk) on a simulated A100 node whose driver lies on disk
    (``agent.sim.driver_root``): per round, ``prepares`` prepare/unprepare pairs of a 1-GPU claim with the spec
    holding the driver's common edits (control nodes, libraries, binaries, firmware), then as many with
    ``--node-wide-cdi`` (the claim spec holds the GPU's node only: what the self-contained spec adds is the
    difference), and the floor: ``write_atomically`` of the self-contained spec's bytes in the same directory (a
    prepare writes the spec once and the checkpoint twice). Also the driver root's discovery uncached (what a
    Prepare pays once a minute, ``agent.gpu.driver_root.CACHE_SECONDS``). Medians over the rounds of each round's
    p50 and p99.
    """
    from agent.core.dra.devices import dra_devices
    from agent.gpu.discovery import discover
    from agent.gpu.driver_root import CommonEdits
    from agent.sim.nvml.install import simulated_node
    from agent.sim.nvml.spec import parse_node_spec
    from tests.integration.test_dra_service import NODE_SPEC, Claims, Node, claim, ref, uid

    figures = {
        "self-contained": Figure("Prepare, 1 GPU, self-contained spec", "< 50 ms p99"),
        "node-wide": Figure("Prepare, 1 GPU, --node-wide-cdi (GPU node only)"),
        "unprepare": Figure("Unprepare, 1 GPU, self-contained spec"),
        "floor": Figure("floor: atomic write of the spec's bytes (fsync file + directory)"),
        "discovery": Figure("driver root discovery, uncached"),
    }
    logging.disable(logging.ERROR)
    with simulated_node(parse_node_spec(NODE_SPEC)):
        devices = dra_devices(discover())
        for n in range(rounds):
            base = Path(tempfile.mkdtemp(prefix="bs", dir="/tmp"))  # unix socket paths must stay short
            try:
                node = Node(base, devices, Claims())
                node.claims.add(claim(1, "gpu-0"))
                times: dict[str, list[float]] = {key: [] for key in figures}
                modes = [("self-contained", {}), ("node-wide", {"node_wide_cdi": True, "cdi_common_edits": None})]
                for mode, options in modes[n % 2 :] + modes[: n % 2]:  # each round starts with the other
                    node.start(**options)
                    assert node.kubelet is not None
                    for i in range(WARM_UP + prepares):
                        began = time.perf_counter()
                        answer = node.kubelet.prepare(ref(1)).claims[uid(1)]
                        took = time.perf_counter() - began
                        if answer.error or len(answer.devices) != 1:
                            raise RuntimeError(f"prepare ({mode}): {answer.error!r}")
                        if i >= WARM_UP:
                            times[mode].append(took)
                        if mode == "self-contained":
                            spec = node.spec_file(1).read_bytes()
                        measured = times["unprepare"] if mode == "self-contained" and i >= WARM_UP else []
                        _timed(measured, node.kubelet.unprepare, ref(1))
                    node.stop()
                source = CommonEdits(node.driver_root, ttl=0)
                for _ in range(prepares):
                    _timed(times["floor"], write_atomically, base / "floor.yaml", spec, 0o644)
                    _timed(times["discovery"], source)
                for key, values in times.items():
                    figures[key].add(values)
            finally:
                shutil.rmtree(base, ignore_errors=True)
            print(f"round {n + 1}/{rounds} done", file=sys.stderr, flush=True)
    print(
        f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}, Python {platform.python_version()}; "
        f"{rounds} rounds of {prepares} prepare/unprepare pairs per mode; p50 / p99: medians of the per-round values"
    )
    print()
    print("| measure | p50 | p99 | min | max | n | target |")
    print("|---|---|---|---|---|---|---|")
    for figure in figures.values():
        print(_row(figure))


if __name__ == "__main__":
    if sys.argv[1:2] == ["self-contained"]:  # python tests/bench/bench_dra.py self-contained [ROUNDS [PREPARES]]
        bench_prepare_self_contained(*(int(a) for a in sys.argv[2:4]))
    else:
        main()
