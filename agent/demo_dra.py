"""``tessera demo --dra``: the agent's two front ends on one simulated node, DRA shown end to end.

What runs, all in this process and all real but the hardware and the control plane: the agent, discovering a
simulated node through pynvml; the device-plugin kubelet emulator and the DRA kubelet emulator, speaking gRPC on
unix sockets; the API server stand-in (``agent.sim.apiserver``), spoken to over HTTP by the real Kubernetes client;
and the structured-parameters allocator (``agent.sim.scheduler``), which plays the kube-scheduler's part and
evaluates NVIDIA's DeviceClass selectors and the claims' CEL selectors with a real CEL implementation.

The node is built in (``NODE_SPEC``): an H100 and three A100s, one of them in MIG mode with no MIG device yet,
on driver r615 (which holds a container to a memory limit: ``nvmlDeviceSetMemoryLimits_v1``).
The config gives DRA GPUs 0, 1 and 3 and leaves GPU 2 to the device plugin, so each GPU visibly belongs to one
front end; GPU 3 is in dynamic-MIG mode (``dra.dynamicMig``): its slice lists every MIG profile and placement.
The story: slices published, three claims allocated by selectors and prepared for a pod (CDI spec shown, the
1g.10gb MIG device created for its claim), an XID that taints a device and then recovers, a kubelet restart that
wipes the slices and the agent putting them back, the pod stopping (the MIG device destroyed). The health
recovery window is shortened, and the output says so. Step 7 shares a GPU by memory: two unequal shares, each
container held to its own share by the (simulated) driver, and a process that tries to take more than its share
and fails.

Exit status: 0 when every step happened as told; 1 (``EXIT_FAILED``) with one ``tessera: demo --dra: ...`` line
on stderr naming the step and what did not happen; 1 too when the reader of the output leaves early, as
``tessera demo``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from agent.core.health import HealthPolicy
from agent.core.resources import MigStrategy
from agent.memlimits.settings import MemoryLimitSettings
from agent.sim.driver_root import sim_driver_root
from agent.sim.kubelet.cgroups import ContainerFiles
from agent.sim.nvml.driver import SimDriver
from agent.sim.nvml.install import simulated_node
from agent.sim.nvml.spec import NodeSpec, parse_node_spec
from agent.terminate import EXIT_TERMINATED, Terminated, terminated_on_sigterm

EXIT_FAILED = 1  # a step did not happen as the demo says it does
EXIT_USAGE = 2  # as every `tessera` command: a flag the DRA demo does not take
EXIT_STOPPED = 1  # as `tessera demo | head`: the reader of the output went away before the end

DEFAULT_NODE_FLAG = "demo"  # `tessera demo`'s defaults for --node and --mig-strategy
DEFAULT_MIG_STRATEGY_FLAG = "mixed"
NODE = "dra-demo-node"
DRIVER = "gpu.nvidia.com"
NAMESPACE = "default"
KUBERNETES_VERSION = "v1.36.3"  # what the API server stand-in reports
NODE_SPEC: dict[str, Any] = {
    "name": NODE,
    "driver_version": "615.71.09",  # r615: per-container memory limits (the shares of step 7 are held by it)
    "gpus": [
        {"model": "H100-SXM5-80GB"},
        {"model": "A100-SXM4-80GB", "count": 2},
        {"model": "A100-SXM4-80GB", "mig": {"instances": []}},  # MIG mode on, no MIG device yet
    ],
}
DRA_GPUS = (0, 1, 3)  # GPU 2 stays with the device plugin (until step 8 moves the whole node to DRA)
DYNAMIC_MIG_GPUS = (3,)  # MIG devices made for each claim
SHARED_GPU = 1  # shared by memory (consumable capacity), its shares enforced through MPS
DRA_SECTION = (
    f"{{enabled: true, gpus: [{', '.join(map(str, DRA_GPUS))}], dynamicMig: [{', '.join(map(str, DYNAMIC_MIG_GPUS))}],"
    f" gpuShares: [{SHARED_GPU}]}}"
)
ALL_DRA_SECTION = DRA_SECTION.replace(f"gpus: [{', '.join(map(str, DRA_GPUS))}]", "gpus: all")
CONFIG = "version: v1\nflags: {{mpsRoot: {root}}}\ndra: {section}\n"  # the MPS root is in the demo's directory

# NVIDIA's DeviceClasses, with the chart's exact selectors (facts/dra.md C1). The chart adds `extendedResourceName:
# nvidia.com/gpu` to gpu.nvidia.com on resource.k8s.io/v1; left out here, where the device plugin serves that name.
DEVICE_CLASSES = {
    "gpu.nvidia.com": "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'",
    "mig.nvidia.com": "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'mig'",
}
# (claim name, capacity.requests, what it asks for): two shares of GPU 1, and one that does not fit next to them
SHARES = (
    ("share-a", {"memory": "10Gi"}, "10Gi of a GPU"),
    ("share-b", {"memory": "20Gi", "computePercent": "25"}, "20Gi and 25% of its compute"),
)
TOO_BIG_SHARE = ("share-c", {"memory": "60Gi"}, "60Gi next to them")
PLAIN_POD = ("plain", str(uuid.uuid5(uuid.NAMESPACE_DNS, "plain.dra-demo.tessera")))
# (claim name, DeviceClass, the request's CEL selector, what it asks for), allocated in this order
CLAIMS = (
    ("h100", "gpu.nvidia.com", "device.attributes['gpu.nvidia.com'].productName.contains('H100')", "an H100"),
    (
        "big-memory",
        "gpu.nvidia.com",
        "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0",
        "a GPU with at least 40 GiB",
    ),
    ("mig-small", "mig.nvidia.com", "device.attributes['gpu.nvidia.com'].profile == '1g.10gb'", "a MIG 1g.10gb"),
)
POD = ("trainer", str(uuid.uuid5(uuid.NAMESPACE_DNS, "trainer.dra-demo.tessera")))
POD_CONTAINERS = {"train": ["h100", "big-memory"], "notebook": ["mig-small"]}  # container -> pod claims it uses
XID_DOUBLE_BIT_ECC = 48
XID_GPU = 1  # a DRA GPU the pod uses
RECOVERY_SECONDS = 2.0
PRODUCTION_RECOVERY_SECONDS = HealthPolicy().quiet_seconds  # what `tessera run` waits (60 s)
STEP_TIMEOUT = 15.0
STEPS = 8


class DemoFailure(Exception):
    """A step did not happen as told; the message names what was expected."""


def run_dra_demo(node: str = DEFAULT_NODE_FLAG, mig_strategy: str = DEFAULT_MIG_STRATEGY_FLAG) -> int:
    """``node`` and ``mig_strategy`` are the `tessera demo` flags: the DRA demo runs its own node and publishes
    MIG devices as DRA devices, so anything but their defaults is refused rather than ignored."""
    if node != DEFAULT_NODE_FLAG or mig_strategy != DEFAULT_MIG_STRATEGY_FLAG:
        given = f"--node {node}" if node != DEFAULT_NODE_FLAG else f"--mig-strategy {mig_strategy}"
        print(
            f"tessera: demo --dra runs its own node (an H100 and three A100s, one in MIG mode) and takes no {given}; "
            "drop it, or run `tessera demo` without --dra for the device-plugin demo on that node",
            file=sys.stderr,
        )
        return EXIT_USAGE
    logging.basicConfig(level=logging.ERROR)  # the demo tells its own story; only real errors get through
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # no gRPC core INFO lines as streams end
    logging.getLogger("agent.sim.kubelet").setLevel(logging.CRITICAL)  # its stream-ended errors are expected here
    spec = parse_node_spec(NODE_SPEC, "the built-in node of `tessera demo --dra`")
    with terminated_on_sigterm():
        try:
            return _run(spec)
        except Terminated:  # everything is stopped and the work directory gone (the finally blocks ran)
            with contextlib.suppress(OSError, ValueError):
                sys.stdout.flush()
            print("tessera: demo --dra stopped by SIGTERM; the agent, the emulators and their files are gone",
                  file=sys.stderr)  # fmt: skip
            return EXIT_TERMINATED


def _run(spec: NodeSpec) -> int:
    workdir: Path | None = None
    try:
        workdir = Path(tempfile.mkdtemp(prefix="tessera-dra-", dir="/tmp"))  # short: unix socket paths have a limit
        with simulated_node(spec) as driver:
            demo = _DraDemo(driver, workdir)
            try:
                code = demo.run()
                sys.stdout.flush()  # a reader that left shows here, not in the interpreter's teardown
                return code
            except BrokenPipeError:  # `tessera demo --dra | head`: the reader left; run() has stopped everything
                with contextlib.suppress(OSError):
                    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                return EXIT_STOPPED
            except DemoFailure as error:
                sys.stdout.flush()
                print(f"tessera: demo --dra: {error}", file=sys.stderr)
                return EXIT_FAILED
    finally:
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)


class _DraDemo:
    def __init__(self, driver: SimDriver, workdir: Path) -> None:
        from agent.sim.apiserver import ApiServer

        self.driver = driver
        self.workdir = workdir
        self.cdi_root = workdir / "cdi"
        self.api = ApiServer(git_version=KUBERNETES_VERSION)
        self.kubelet: Any = None  # the kubelet's device-plugin side
        self.dra: Any = None  # the kubelet's DRA side
        self.agent: Any = None
        self.options: Any = None  # the agent's AgentOptions
        self.claims: dict[str, dict] = {}  # claim name -> the allocated claim
        self.chosen: dict[str, str] = {}  # claim name -> device
        self.device_count = 0
        self._step = "start"  # the step running, for failure messages
        self.mps_root = workdir / "mps"
        self.containers = ContainerFiles(workdir / "cgroup", workdir / "log")  # what a started container leaves

    # ---------------------------------------------------------------------------------------------- the story

    def run(self) -> int:
        # gRPC is loaded here, after run_dra_demo has set GRPC_VERBOSITY (gRPC core reads it once)
        from agent.agent import Agent, AgentOptions
        from agent.sim.kubelet import DraKubeletEmulator, KubeletEmulator

        self._frame()
        self._write_config(DRA_SECTION)
        self.api.start()
        thread: threading.Thread | None = None
        try:
            self.api.add_node(NODE)
            for name, selector in DEVICE_CLASSES.items():
                self.api.create("deviceclasses", _device_class(name, selector))
            self.options = options = AgentOptions(
                device_plugin_dir=self.workdir / "dp",
                pod_resources_socket=self.workdir / "pr" / "kubelet.sock",
                mig_strategy=MigStrategy.MIXED,
                config_path=self.workdir / "config.yaml",
                node_name=NODE,
                kubeconfig=str(self.api.write_kubeconfig(self.workdir / "kubeconfig")),
                dra_registry_dir=self.workdir / "registry",
                dra_plugins_dir=self.workdir / "plugins",
                cdi_root=self.cdi_root,
                driver_root=sim_driver_root(self.workdir / "driver"),  # the simulated node's driver files
                health=HealthPolicy(quiet_seconds=RECOVERY_SECONDS),
                mps_control=str(self._mps_control()),
                memory_limits=MemoryLimitSettings(self.containers.cgroup_root, self.containers.container_logs),
            )
            self.kubelet = KubeletEmulator(options.device_plugin_dir, options.pod_resources_socket)
            self.kubelet.start()
            self.dra = DraKubeletEmulator(options.dra_registry_dir, NODE, self.api.api_client())
            self.dra.start()
            self.kubelet.serve_dra(self.dra)  # PodResources lists the DRA pods' claims, per container
            self.agent = Agent(options)
            thread = threading.Thread(target=self.agent.run, name="agent")
            started = time.perf_counter()
            thread.start()
            self._started(started)
            self._allocate()
            self._run_pod()
            self._xid_and_recovery()
            self._kubelet_restart()
            self._stop_pod()
            self._shares()
            self._plain_pod()
        finally:
            if self.agent is not None:
                self.agent.stop()
            if thread is not None:
                thread.join(timeout=10)
            if self.dra is not None:
                self.dra.stop()
            if self.kubelet is not None:
                self.kubelet.stop()
            self.api.stop()
        options = self.options
        left = sorted(p.name for p in options.device_plugin_dir.glob("nvidia-*.sock"))
        left += sorted(p.name for p in options.dra_registry_dir.glob("*.sock"))
        left += sorted(p.name for p in options.dra_plugins_dir.glob("*/*.sock"))
        print(f"\nAgent stopped; plugin and DRA sockets left behind: {', '.join(left) or 'none'}.")
        self._summary()
        return 0

    def _frame(self) -> None:
        print(
            "Tessera demo --dra: a simulated GPU node, an API server stand-in, the kubelet (device plugins and DRA)\n"
            "and the real agent, all on this machine."
        )
        print(f"  node            {NODE} (built into agent/demo_dra.py):")
        for gpu in self.driver.gpus:
            profiles = Counter(gi.profile.name for gi, _ in gpu.mig_devices()) if gpu.mig_current else {}
            layout = "MIG: " + ", ".join(f"{n} × {p}" for p, n in profiles.items()) if profiles else "whole GPU"
            if gpu.index in DYNAMIC_MIG_GPUS:
                layout = "MIG, made per claim"
            elif gpu.index == SHARED_GPU:
                layout = "shared by memory"
            owner = "DRA (ResourceSlices)" if gpu.index in DRA_GPUS else "device plugin (nvidia.com/gpu)"
            print(f"{'':18}GPU {gpu.index}  {gpu.model.nvml_name:<24} {layout:<19} -> {owner}")
        print(f"  config          dra: {DRA_SECTION}:")
        print(
            f"{'':18}each GPU belongs to one front end, never both; GPU 3's MIG devices are made for each claim;\n"
            f"{'':18}GPU {SHARED_GPU} is shared by claims that each ask for an amount of its memory"
        )
        print(
            f"  control plane   an API server stand-in (Kubernetes {KUBERNETES_VERSION}, resource.k8s.io/v1), "
            "the scheduler's DRA allocator"
        )
        print(
            f"  timings         health recovery after {RECOVERY_SECONDS:.0f} s without errors "
            f"(shortened for the demo; {PRODUCTION_RECOVERY_SECONDS:.0f} s on a real node)"
        )

    def _started(self, started: float) -> None:
        self._step = "step 1"
        if not self.agent.started.wait(30):
            raise DemoFailure("step 1: the agent did not start within 30 s")
        names = list(self.agent.status.resources)
        self._wait_kubelet(
            lambda: names and all(self.kubelet.allocatable(r) > 0 for r in names), "the device plugin registered"
        )
        self._wait_dra(lambda: DRIVER in self.dra.drivers(), f"the DRA driver {DRIVER} registered with the kubelet")
        self._wait_api(self._published, "the ResourceSlices published")
        self.device_count = len(self._devices())
        elapsed = time.perf_counter() - started
        print(f"\n[1/{STEPS}] The agent started; both front ends serve the node ({elapsed:.2f} s after start).")
        print("      The device plugin advertises to the kubelet:")
        for name in names:
            ids = ", ".join(self.kubelet.devices(name))
            print(f"        {name:<24} allocatable {self.kubelet.allocatable(name)}: {ids}")
        plugin = self.dra.plugin(DRIVER)
        print(f"      The DRA driver registered with the kubelet's plugin watcher ({DRIVER}, {plugin.service}) and")
        slices = self._slices()
        pool = slices[0]["spec"]["pool"]
        print(
            f"      published {len(slices)} ResourceSlice(s), pool {pool['name']} generation {pool['generation']}, "
            f"owned by {_owner(slices[0])}:"
        )
        for item in slices:
            print(f"        {item['metadata']['name']}:")
            for counter_set in item["spec"].get("sharedCounters", []):
                print(f"          counter set {counter_set['name']}: what the partitions of its GPU share")
            partitions: dict[str, list[dict]] = {}
            for device in item["spec"].get("devices", []):
                if device.get("consumesCounters") and _attribute(device, "type") == "mig":
                    partitions.setdefault(_attribute(device, "profile"), []).append(device)
                else:
                    print(f"          {_describe(device)}")
            for profile, devices in partitions.items():
                first = devices[0]
                memory = first.get("capacity", {}).get("memory", {}).get("value", "?")
                stem = first["name"].rsplit("-", 1)[0]
                starts = ",".join(d["name"].rsplit("-", 1)[1] for d in devices)
                print(f"          {stem}-{{{starts}}}: {len(devices)} × MIG {profile}, memory {memory}")
        if any(s["spec"].get("sharedCounters") for s in slices):
            print(
                "      (GPU 3's partitions consume its counter set: overlapping placements exclude each other, the\n"
                "      whole GPU excludes them all; a partition's MIG device is created when a claim is prepared)"
            )
        print("      NVIDIA's DeviceClasses, created in the API server (the chart's exact selectors):")
        for cls in self.api.objects("deviceclasses"):
            selector = cls["spec"]["selectors"][0]["cel"]["expression"]
            print(f"        {cls['metadata']['name']:<16} {selector}")

    def _allocate(self) -> None:
        from agent.sim.scheduler import Unschedulable, allocate

        self._step = "step 2"
        print(
            f"\n[2/{STEPS}] Three ResourceClaims, allocated by the scheduler's DRA allocator: a device must pass the "
            "class's selector,"
        )
        print(
            "      then the claim's; devices other claims hold are skipped (so a 40 GiB claim after the H100 one "
            "gets an A100)"
        )
        classes = {c["metadata"]["name"]: c for c in self.api.objects("deviceclasses")}
        held: set[tuple[str, str, str]] = set()
        for name, device_class, selector, wanted in CLAIMS:
            created = self.api.create("resourceclaims", _claim(name, device_class, selector))
            try:
                allocated = allocate(created, self._slices(), classes, held, NODE)
            except Unschedulable as error:
                raise DemoFailure(f"step 2: claim {name} ({wanted}) could not be allocated: {error.reason}") from None
            claim = self.api.update("resourceclaims", allocated, status=True)
            (result,) = claim["status"]["allocation"]["devices"]["results"]
            held.add((result["driver"], result["pool"], result["device"]))
            self.claims[name] = claim
            self.chosen[name] = result["device"]
            device = next(d for d in self._slice_devices() if d["name"] == result["device"])
            print(f"      claim {name:<11} {wanted}: class {device_class}, selector")
            print(f"{'':24}{selector}")
            print(f"{'':24}-> {result['device']} ({_product(device)})")

    def _run_pod(self) -> None:
        from agent.sim.kubelet.dra_common import PodStartError

        self._step = "step 3"
        pod, uid = POD
        print(f"\n[3/{STEPS}] Pod {pod} uses the three claims; the DRA kubelet prepares them (NodePrepareResources):")
        claims = [(name, name) for name, *_ in CLAIMS]
        containers = {c: [(claim, None) for claim in used] for c, used in POD_CONTAINERS.items()}
        started = time.perf_counter()
        try:
            cdi = self.dra.run_pod(NAMESPACE, pod, uid, claims, containers)
        except PodStartError as error:
            raise DemoFailure(f"step 3: pod {pod} did not start: {error}") from None
        elapsed = 1000 * (time.perf_counter() - started)
        print(f"      prepared in {elapsed:.0f} ms; the CDI device IDs the container runtime gets, per container:")
        for container, ids in cdi.items():
            print(f"        {container}:")
            for cdi_id in ids:
                print(f"          {cdi_id}")
        made = self.driver.gpus[DYNAMIC_MIG_GPUS[0]].mig_devices()
        if len(made) != 1:
            raise DemoFailure(f"step 3: GPU 3 should hold the one MIG device made for claim mig-small, not {len(made)}")
        gi, ci = made[0]
        start, size = gi.placement
        print(
            f"      claim mig-small's MIG device was created for it: {ci.uuid} on GPU 3, GPU instance {gi.id}\n"
            f"      at memory slice {start}{'' if size == 1 else f'-{start + size - 1}'}, exactly the allocated "
            f"{self.chosen['mig-small']}"
        )
        mig_spec = self.cdi_root / f"k8s.gpu.nvidia.com-claim_{self.claims['mig-small']['metadata']['uid']}.yaml"
        nodes = [n["path"] for d in yaml.safe_load(mig_spec.read_text())["devices"] for n in d["containerEdits"]
                 ["deviceNodes"]]  # fmt: skip
        print(f"      its claim's CDI spec gives the container {', '.join(nodes)}")
        claim = self.claims["h100"]
        path = self.cdi_root / f"k8s.gpu.nvidia.com-claim_{claim['metadata']['uid']}.yaml"
        if not path.is_file():
            raise DemoFailure(f"step 3: claim h100 is prepared but its CDI spec {path.name} is not in the CDI root")
        specs = sorted(p.name for p in self.cdi_root.glob("*.yaml"))
        mode = path.stat().st_mode & 0o777
        print(f"      {len(specs)} CDI specs written in {self.cdi_root}, one per claim; claim h100's, mode {mode:04o}:")
        print(f"        {path.name}")
        spec = yaml.safe_load(path.read_text())
        for line in path.read_text().splitlines():
            if line.startswith("containerEdits:"):
                break  # the driver's files, the same in every spec: summed up below
            print(f"        | {line}")
        common = spec["containerEdits"]
        mounts = [m["containerPath"].rsplit("/", 1)[-1] for m in common.get("mounts", [])]
        print(
            f"        | containerEdits: {common['env'][0]}, {len(common.get('deviceNodes', []))} control nodes "
            f"({', '.join(n['path'] for n in common.get('deviceNodes', []))}), {len(mounts)} driver files mounted "
            f"({', '.join(mounts[:3])}, ...), {len(common.get('hooks', []))} hooks"
        )

    def _xid_and_recovery(self) -> None:
        self._step = "step 4"
        device = f"gpu-{self._minor(XID_GPU)}"
        gpu = self.driver.gpus[XID_GPU]
        holder = next((name for name, d in self.chosen.items() if d == device), None)
        used = f", held by claim {holder}" if holder else ""
        print(
            f"\n[4/{STEPS}] Injecting XID {XID_DOUBLE_BIT_ECC} (double-bit ECC error) on GPU {XID_GPU} ({gpu.uuid}),\n"
            f"      DRA device {device}{used}"
        )
        started = time.perf_counter()
        self.driver.inject_xid(XID_GPU, XID_DOUBLE_BIT_ECC)
        taint = self._wait_api(lambda: _xid_taint(self._device(device)), f"the taint on {device} in its slice")
        print(
            f"      after {1000 * (time.perf_counter() - started):.0f} ms its slice entry has the taint "
            f"{taint['key']}={taint.get('value', '')}:{taint['effect']}\n"
            "      (NVIDIA's key: new claims avoid the device unless they tolerate it; the running pod keeps it)"
        )
        self._wait_dra(
            lambda: self.dra.device_health(DRIVER, NODE, device) == "Unhealthy",
            f"the kubelet seeing {device} Unhealthy",
        )
        print(
            f"      the kubelet's health stream reads {device} Unhealthy\n"
            "      (with the ResourceHealthStatus gate on, a kubelet shows it in the pod's allocatedResourcesStatus)"
        )
        self._wait_api(
            lambda: not _xid_taint(self._device(device)), f"the taint on {device} removed", RECOVERY_SECONDS + 10
        )
        self._wait_dra(
            lambda: self.dra.device_health(DRIVER, NODE, device) == "Healthy", f"the kubelet seeing {device} Healthy"
        )
        print(
            f"      no new errors for {RECOVERY_SECONDS:.0f} s (shortened for the demo; "
            f"{PRODUCTION_RECOVERY_SECONDS:.0f} s on a real node) and the driver shows it recovered:"
        )
        print(
            f"      taint {DRIVER}/xid removed from {device}, Healthy again after {time.perf_counter() - started:.1f} s"
        )
        print("      (NVIDIA's DRA driver keeps the taint until someone removes it)")

    def _kubelet_restart(self) -> None:
        self._step = "step 5"
        before = {s["metadata"]["name"] for s in self._slices()}
        devices = sorted(self._devices())
        registered = len(self.dra.registration_events(driver=DRIVER))
        print(
            f"\n[5/{STEPS}] Restarting the kubelet: when it starts it deletes every ResourceSlice of its node\n"
            f"      (DeleteCollection, fieldSelector spec.nodeName={NODE})"
        )
        started = time.perf_counter()
        self.dra.restart()
        wipe = self.dra.wipes(reason="start", state="done")
        if not wipe:
            raise DemoFailure("step 5: the restarted kubelet did not delete the node's slices")
        print(f"      the kubelet deleted slice(s) {', '.join(sorted(before))}")

        def back() -> bool:
            now = self._slices()
            names = {s["metadata"]["name"] for s in now}
            return bool(now) and not names & before and sorted(self._devices()) == devices

        self._wait_api(back, "the slices published again after the kubelet restart")
        elapsed = time.perf_counter() - started
        self._wait_dra(
            lambda: len(self.dra.registration_events(driver=DRIVER)) > registered and DRIVER in self.dra.drivers(),
            "the DRA driver registered again",
        )
        slices = self._slices()
        pool = slices[0]["spec"]["pool"]
        print(
            f"      the agent saw them go and published them again: slices back after {elapsed:.2f} s\n"
            f"        {', '.join(s['metadata']['name'] for s in slices)}: {len(devices)} devices, pool generation "
            f"{pool['generation']}; the driver registered again"
        )
        running = [p.name for p in self.dra.pods() if p.running]
        print(f"      running pods keep their devices, nothing is prepared again: {', '.join(running) or 'none'}")

    def _stop_pod(self) -> None:
        from agent.sim.kubelet.dra_common import PodStopError

        self._step = "step 6"
        pod, uid = POD
        print(f"\n[6/{STEPS}] Pod {pod} stops; the DRA kubelet unprepares its claims (NodeUnprepareResources):")
        try:
            self.dra.stop_pod(uid)
        except PodStopError as error:
            raise DemoFailure(f"step 6: pod {pod}'s claims were not unprepared: {error}") from None
        left = sorted(p.name for p in self.cdi_root.glob("*.yaml"))
        if left:
            raise DemoFailure(f"step 6: CDI specs left behind after the claims were unprepared: {', '.join(left)}")
        unprepared = self.dra.calls("NodeUnprepareResources", DRIVER)
        if not unprepared or unprepared[-1].outcome or self.dra.prepared_claims():
            why = unprepared[-1].outcome if unprepared else "no NodeUnprepareResources call"
            raise DemoFailure(f"step 6: pod {pod}'s claims were not unprepared: {why or 'still prepared'}")
        names = ", ".join(name for name, *_ in CLAIMS)
        print(f"      claims {names} unprepared; CDI specs in {self.cdi_root}: none left")
        left_on_gpu = self.driver.gpus[DYNAMIC_MIG_GPUS[0]].mig_devices()
        if left_on_gpu:
            raise DemoFailure(
                f"step 6: the MIG device made for claim mig-small is still on GPU 3: {left_on_gpu[0][1].uuid}"
            )
        print("      the MIG device made for claim mig-small was destroyed (no process ran on it): GPU 3 is free again")
        print(
            f"      {', '.join(self.chosen.values())} stay allocated to the claims until they are deleted, "
            "then go to other claims"
        )

    def _summary(self) -> None:
        plugin_gpus = ", ".join(str(g.index) for g in self.driver.gpus if g.index not in DRA_GPUS)
        print("\nSummary:")
        print(
            f"  - one agent, two front ends: GPU {plugin_gpus} served by the device plugin, GPUs "
            f"{', '.join(map(str, DRA_GPUS))} published as {self.device_count} DRA devices"
        )
        chosen = ", ".join(f"{name} -> {device}" for name, device in self.chosen.items())
        print(f"  - NVIDIA's DeviceClasses and CEL selectors chose Tessera's devices unchanged:\n      {chosen}")
        print("  - prepared with one CDI spec per claim (k8s.gpu.nvidia.com/claim=<claim UID>-<device>), unprepared")
        print("  - the MIG 1g.10gb device was created for its claim at the allocated placement, and destroyed after")
        print("  - an XID tainted its device (gpu.nvidia.com/xid) and the taint went when the GPU recovered")
        print("  - the slices a kubelet restart wiped came back without the agent restarting")
        print(
            f"  - two claims shared GPU {SHARED_GPU} by 10Gi and 20Gi, each held to its own share by the driver"
            " (nvmlDeviceSetMemoryLimits_v1 on each container's cgroup); a third did not fit"
        )
        print("  - an unchanged nvidia.com/gpu pod ran on GPUs served by DRA, once the whole node was DRA's")
        print("Done. Next: `tessera plan --dra --node dgx-a100` to see the slices of another node, or `tessera demo`.")

    def _shares(self) -> None:
        from agent.sim.kubelet.dra_common import PodStartError, PodStopError
        from agent.sim.scheduler import Unschedulable, allocate, devices_in_use

        self._step = "step 7"
        device = f"gpu-{self._minor(SHARED_GPU)}"
        gpu = self.driver.gpus[SHARED_GPU]
        for name in list(self.claims):  # their pod is gone: deleted, they free their devices
            self.api.delete("resourceclaims", name, namespace=NAMESPACE)
        print(
            f"\n[7/{STEPS}] GPU shares: the claims of step 2 are deleted; two new claims each ask for an amount of "
            f"a GPU's memory\n      ({device} is published with allowMultipleAllocations, its memory and "
            "computePercent consumable):"
        )
        classes = {c["metadata"]["name"]: c for c in self.api.objects("deviceclasses")}
        uids: dict[str, str] = {}
        for name, capacity, wanted in (*SHARES, TOO_BIG_SHARE):
            created = self.api.create("resourceclaims", _share_claim(name, capacity))
            held, consumed = devices_in_use(self.api.objects("resourceclaims"))
            try:
                allocated = allocate(created, self._slices(), classes, held, NODE, consumed=consumed)
            except Unschedulable as error:
                if name != TOO_BIG_SHARE[0]:
                    raise DemoFailure(f"step 7: claim {name} ({wanted}) was not allocated: {error.reason}") from None
                why = error.reason.rsplit(", ", 1)[-1]  # the scheduler's last count: where the devices ran out
                print(f"      claim {name:<8} {wanted}: not allocated, its pod stays Pending (the scheduler: {why})")
                continue
            if name == TOO_BIG_SHARE[0]:
                raise DemoFailure(f"step 7: claim {name} ({wanted}) was allocated, but it does not fit")
            claim = self.api.update("resourceclaims", allocated, status=True)
            (result,) = claim["status"]["allocation"]["devices"]["results"]
            if result["device"] != device:
                raise DemoFailure(f"step 7: claim {name} got {result['device']}, not a share of {device}")
            uids[name] = claim["metadata"]["uid"]
            consumed_text = ", ".join(f"{k} {v}" for k, v in result["consumedCapacity"].items())
            asked = ", ".join(f"{k}: {v}" for k, v in capacity.items())
            print(f"      claim {name:<8} {wanted}: capacity.requests {{{asked}}}")
            print(f"{'':24}-> {device}, shareID {result['shareID'][:8]}…, consumedCapacity {consumed_text}")
        pods = {name: (f"pod-{name}", str(uuid.uuid5(uuid.NAMESPACE_DNS, f"{name}.dra-demo.tessera"))) for name in uids}
        try:
            for name, (pod, uid) in pods.items():
                self.dra.run_pod(NAMESPACE, pod, uid, [("gpu", name)], {"cuda": [("gpu", None)]})
        except PodStartError as error:
            raise DemoFailure(f"step 7: a share's pod did not start: {error}") from None
        daemons = {k: d for k, d in self.agent.status.mps.items() if k.startswith("dra/")}
        if len(daemons) != 1:
            raise DemoFailure(f"step 7: GPU {SHARED_GPU} should have one MPS daemon for its shares, not {daemons}")
        ((key, daemon),) = daemons.items()
        print(
            f"      pods {', '.join(p for p, _ in pods.values())} run; GPU {SHARED_GPU}'s MPS control daemon {key} "
            f"serves both ({daemon.get('state')}), the GPU in compute mode EXCLUSIVE_PROCESS"
        )
        print("      each share's limits, from its claim's CDI spec (the containers' environment):")
        for name, uid in uids.items():
            spec = (self.cdi_root / f"k8s.gpu.nvidia.com-claim_{uid}.yaml").read_text()
            limits = [line.strip().lstrip("- ") for line in spec.splitlines() if "CUDA_MPS_" in line or _SIZE in line]
            if not any("PINNED_DEVICE_MEM_LIMIT" in line for line in limits):
                raise DemoFailure(f"step 7: claim {name}'s CDI spec has no MPS memory limit")
            print(f"        {name}: {', '.join(line for line in limits if 'PIPE' not in line)}")
        self._held_by_the_driver(pods)
        try:
            for pod, uid in pods.values():
                self.dra.stop_pod(uid)
                self.containers.remove_pod(NAMESPACE, pod, uid)
        except PodStopError as error:
            raise DemoFailure(f"step 7: a share's pod did not stop cleanly: {error}") from None
        self._wait_agent(
            lambda: not any(k.startswith("dra/") for k in self.agent.status.mps), f"{key} stopped after its last share"
        )
        for name, *_ in (*SHARES, TOO_BIG_SHARE):
            self.api.delete("resourceclaims", name, namespace=NAMESPACE)
        mode = "DEFAULT" if gpu.compute_mode == 0 else f"mode {gpu.compute_mode}"
        print(f"      both pods stop: the claims are unprepared, {key} drains and stops, GPU {SHARED_GPU} in {mode}")

    def _held_by_the_driver(self, pods: dict[str, tuple[str, str]]) -> None:
        """The shares' containers start; the driver holds each to its own share (the MPS server alone could hold
        only the larger one), and a process that asks for more than its share is refused."""
        from agent.sim.nvml.driver import OutOfMemory
        from agent.status_report import render_text, status_document

        gpu = self.driver.gpus[SHARED_GPU]
        sizes = {name: _mib(capacity["memory"]) for name, capacity, _ in SHARES}
        cgroups = {name: self.containers.start(NAMESPACE, pod, uid, "cuda").cgroup for name, (pod, uid) in pods.items()}

        def held() -> bool:
            table = self.driver.memory_limit_table()
            found = [table.get((gpu.index, str(cgroups[name]))) for name in pods]
            return all(f is not None and f.hard == sizes[name] << 20 for f, name in zip(found, pods, strict=True))

        self._wait_agent(held, "the shares' containers held to their shares by the driver")
        texts = [f"memory {sizes[name]}Mi held by the driver" for name in pods]
        self._wait_agent(
            lambda: all(t in render_text(status_document(self.agent.status, version="demo")) for t in texts),
            "tessera status saying the driver holds each share",
        )
        release = self.driver.driver_version.split(".")[0]
        print(
            f"      the containers start; the agent finds their cgroups and the driver (r{release}) holds each to its "
            "own share\n      (nvmlDeviceSetMemoryLimits_v1, request = limit; the MPS server alone could hold only "
            "the larger one):"
        )
        for name in pods:
            scope = cgroups[name].name
            print(f"        {name}: container cuda, cgroup …/{scope[:27]}…{scope[-6:]}: {sizes[name]} MiB")
        print(f"      tessera status: claim share-a: {texts[0]}; claim share-b: {texts[1]}")
        name = SHARES[0][0]
        pid = 7100
        self.driver.add_process(gpu.index, pid, sizes[name] - 1024, kind="mps_client", cgroup=str(cgroups[name]))
        try:
            try:
                self.driver.allocate(pid, 2048)
            except OutOfMemory:
                refused = True
            else:
                refused = False
        finally:
            self.driver.remove_process(pid)
        if not refused:
            raise DemoFailure(f"step 7: a process of claim {name}'s container allocated more than its share")
        print(
            f"      a process of {name}'s container, its CUDA_MPS_* variables dropped, holds {sizes[name] - 1024} MiB "
            f"and asks for\n      2048 MiB more: out of memory, refused by the driver at its {sizes[name]} MiB share"
        )

    def _plain_pod(self) -> None:
        from agent.sim.kubelet.dra_common import PodStartError, PodStopError
        from agent.sim.scheduler import Unschedulable, allocate
        from agent.sim.scheduler.extended import extended_resource_claim

        self._step = "step 8"
        plugin_gpu = next(g for g in self.driver.gpus if g.index not in DRA_GPUS)
        print(
            f"\n[8/{STEPS}] Moving the whole node to DRA (dra.gpus: all): GPU {plugin_gpu.index}, which no pod uses, "
            "leaves the device plugin;\n      gpu.nvidia.com gets extendedResourceName: nvidia.com/gpu, as NVIDIA's "
            "chart has it (KEP-5004)"
        )
        self._write_config(ALL_DRA_SECTION)
        plain = f"gpu-{plugin_gpu.minor_number}"
        self._wait_api(lambda: self._device(plain) is not None, f"{plain} published by DRA")
        self._wait_kubelet(lambda: self.kubelet.allocatable("nvidia.com/gpu") == 0, "no nvidia.com/gpu from the plugin")
        print(f"      {plain} is in the node's ResourceSlices; the device plugin advertises no nvidia.com/gpu any more")
        device_class = self.api.get("deviceclasses", DRIVER)
        device_class["spec"]["extendedResourceName"] = "nvidia.com/gpu"
        self.api.update("deviceclasses", device_class)
        name, uid = PLAIN_POD
        container = {"name": "cuda", "resources": {"limits": {"nvidia.com/gpu": "1"}}}
        pod = {"metadata": {"name": name, "namespace": NAMESPACE, "uid": uid}, "spec": {"containers": [container]}}
        classes = {c["metadata"]["name"]: c for c in self.api.objects("deviceclasses")}
        built = extended_resource_claim(pod, classes)
        if built is None:
            raise DemoFailure("step 8: no DeviceClass serves nvidia.com/gpu")
        claim, mappings = built
        created = self.api.create("resourceclaims", claim)
        try:
            allocated = allocate(created, self._slices(), classes, set(), NODE)
        except Unschedulable as error:
            raise DemoFailure(f"step 8: the pod's nvidia.com/gpu could not be allocated: {error.reason}") from None
        allocated = self.api.update("resourceclaims", allocated, status=True)
        (result,) = allocated["status"]["allocation"]["devices"]["results"]
        claim_name = created["metadata"]["name"]
        request = mappings[0]["requestName"]
        print(
            f"      pod {name}, unchanged (resources.limits nvidia.com/gpu: 1): the scheduler writes claim "
            f"{claim_name}\n      (request {request}), allocated {result['device']}"
        )
        try:
            ids = self.dra.run_pod(NAMESPACE, name, uid, [("extended", claim_name)], {"cuda": [("extended", request)]})
            print(f"      prepared through DRA; container cuda gets {', '.join(ids['cuda'])}")
            self.dra.stop_pod(uid)
        except (PodStartError, PodStopError) as error:
            raise DemoFailure(f"step 8: pod {name} did not run through DRA: {error}") from None
        print(f"      pod {name} stops and its claim is unprepared: the same pod spec, DRA underneath")

    # ---------------------------------------------------------------------------------------------- helpers

    def _write_config(self, section: str) -> None:
        (self.workdir / "config.yaml").write_text(CONFIG.format(root=self.mps_root, section=section))

    def _mps_control(self) -> Path:
        """``nvidia-cuda-mps-control``: a launcher of the MPS control emulator under the real binary's name."""
        directory = self.workdir / "bin"
        directory.mkdir(exist_ok=True)
        launcher = directory / "nvidia-cuda-mps-control"
        launcher.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m agent.sim.mps.control "$@"\n')
        launcher.chmod(0o755)
        return launcher

    def _wait_agent(self, predicate: Callable[[], Any], what: str, timeout: float = STEP_TIMEOUT) -> None:
        """The agent's published status, looked at every 20 ms until ``timeout`` (it signals no one)."""
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise DemoFailure(f"{self._step}: timed out after {timeout:g} s waiting for {what}")
            time.sleep(0.02)

    def _slices(self) -> list[dict]:
        return sorted(
            (s for s in self.api.objects("resourceslices") if s["spec"].get("nodeName") == NODE),
            key=lambda s: s["metadata"]["name"],
        )

    def _slice_devices(self) -> list[dict]:
        return [d for s in self._slices() for d in s["spec"].get("devices", [])]

    def _devices(self) -> list[str]:
        return [d["name"] for d in self._slice_devices()]

    def _device(self, name: str) -> dict | None:
        return next((d for d in self._slice_devices() if d["name"] == name), None)

    def _minor(self, index: int) -> int:
        return self.driver.gpus[index].minor_number

    def _published(self) -> bool:
        """Every device the config gives DRA is in the slices, under NVIDIA's names: ``gpu-<minor>`` for a whole
        GPU, ``gpu-<minor>-mig-<profile>-<GI profile>-<placement>`` for each MIG device."""
        names = self._devices()
        expected = 0
        for index in DRA_GPUS:
            gpu = self.driver.gpus[index]
            if index in DYNAMIC_MIG_GPUS:  # its partitions; the whole GPU too unless it is in MIG mode (an A100)
                count = sum(n.startswith(f"gpu-{gpu.minor_number}-mig-") for n in names)
                whole = not gpu.mig_current
                if (f"gpu-{gpu.minor_number}" in names) != whole or not count:
                    return False
                expected += whole + count
            elif gpu.mig_current:
                prefix = f"gpu-{gpu.minor_number}-mig-"
                count = len(gpu.mig_devices())
                if sum(n.startswith(prefix) for n in names) != count:
                    return False
                expected += count
            else:
                if f"gpu-{gpu.minor_number}" not in names:
                    return False
                expected += 1
        return len(names) == expected

    def _wait_api(self, predicate: Callable[[], Any], what: str, timeout: float = STEP_TIMEOUT) -> Any:
        try:
            return self.api.wait_for(predicate, timeout)
        except TimeoutError:
            raise DemoFailure(f"{self._step}: timed out after {timeout:g} s waiting for {what}") from None

    def _wait_dra(self, predicate: Callable[[], Any], what: str, timeout: float = STEP_TIMEOUT) -> Any:
        try:
            return self.dra.wait_for(predicate, timeout, what)
        except TimeoutError:
            raise DemoFailure(f"{self._step}: timed out after {timeout:g} s waiting for {what}") from None

    def _wait_kubelet(self, predicate: Callable[[], Any], what: str, timeout: float = STEP_TIMEOUT) -> Any:
        try:
            return self.kubelet.wait_for(predicate, timeout=timeout, what=what)
        except TimeoutError:
            raise DemoFailure(f"{self._step}: timed out after {timeout:g} s waiting for {what}") from None


def _device_class(name: str, selector: str) -> dict:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": selector}}]},
    }


def _claim(name: str, device_class: str, selector: str) -> dict:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "exactly": {"deviceClassName": device_class, "selectors": [{"cel": {"expression": selector}}]},
                    }
                ]
            }
        },
    }


def _share_claim(name: str, capacity: dict[str, str]) -> dict:
    """A claim for a share of a GPU shared by memory (``capacity.requests``)."""
    exactly = {
        "deviceClassName": DRIVER,
        "selectors": [{"cel": {"expression": "device.allowMultipleAllocations"}}],
        "capacity": {"requests": capacity},
    }
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
    }


def _attribute(device: dict, name: str) -> str:
    value = device.get("attributes", {}).get(name, {})
    return str(next(iter(value.values()), "")) if value else ""


def _product(device: dict) -> str:
    profile = _attribute(device, "profile")
    product = _attribute(device, "productName")
    return f"{product}, MIG {profile}" if profile else product


def _describe(device: dict) -> str:
    memory = device.get("capacity", {}).get("memory", {}).get("value", "?")
    shared = ", shared: memory in 1Gi steps, computePercent 0-100" if device.get("allowMultipleAllocations") else ""
    return f"{device['name']:<24} type {_attribute(device, 'type'):<4} {_product(device):<38} memory {memory}{shared}"


def _xid_taint(device: dict | None) -> dict | None:
    if device is None:
        return None
    return next((t for t in device.get("taints", []) if t["key"] == f"{DRIVER}/xid"), None)


_SIZE = "NVIDIA_GPU_MEMORY_"  # the driver's per-container limit, as the CDI spec gives it (path (a))


def _mib(quantity: str) -> int:
    """``10Gi`` -> 10240 (the demo's share sizes, in whole Gi or Mi)."""
    return int(quantity[:-2]) << 10 if quantity.endswith("Gi") else int(quantity.removesuffix("Mi"))


def _owner(item: dict) -> str:
    refs = item["metadata"].get("ownerReferences") or []
    return ", ".join(f"{r['kind']} {r['name']}" for r in refs) or "nothing (no ownerReferences)"
