"""``tessera demo``: a simulated node, the emulated kubelet and the real agent, end to end, on one machine.

Nothing is mocked: the agent discovers the simulated GPUs through pynvml, serves them over gRPC on unix
sockets, and the kubelet emulator registers, schedules and restarts exactly as a kubelet would. The demo
plays the scheduler's part itself: a pod that does not fit stays Pending with the scheduler's message and
never reaches the kubelet, as in a real cluster.

Bad input (an unknown node, a MIG strategy the node cannot take) is one ``tessera: ...`` line on stderr
naming the problem and the fix, and a non-zero exit, before anything starts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shlex
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from agent.config.effective import FlagOverrides, effective
from agent.config.model import ConfigError, ConfigModel
from agent.config.source import parse_document
from agent.core.health import HealthPolicy
from agent.core.plan import plan
from agent.core.resources import MigStrategy, PlanError
from agent.gpu.discovery import DiscoveryError, discover
from agent.sim.nvml.driver import SimDriver
from agent.sim.nvml.install import simulated_node
from agent.sim.nvml.spec import NodeSpec, SimSpecError, load_node_spec, preset_names
from agent.terminate import EXIT_TERMINATED, Terminated, terminated_on_sigterm

if TYPE_CHECKING:
    from agent.sim.kubelet.common import Pod

# The modules that load gRPC (the agent, the kubelet emulator) are imported in _Demo, after run_demo has set
# GRPC_VERBOSITY: gRPC core reads it once, when it is loaded.

EXIT_PLAN_ERROR = 1  # as `tessera plan`: this node cannot take this MIG strategy or config
EXIT_USAGE = 2  # as every `tessera` command: a bad flag or input
EXIT_STOPPED = 1  # as `tessera plan | head`: the reader of the output went away before the end

RECOVERY_SECONDS = 2.0
PRODUCTION_RECOVERY_SECONDS = HealthPolicy().quiet_seconds  # what `tessera run` waits (60 s)
KUBELET_STATUS_SYNC_SECONDS = 10  # a kubelet publishes new capacity at its next node-status sync (10 s default)
CONFIG_NAME = "demo-time-slicing"
CONFIG_FILE = f"{CONFIG_NAME}.yaml"  # what the demo tells a reader to save its config as, for `tessera plan`
SHARING_CONFIG = """version: v1
sharing:
  timeSlicing:
    renameByDefault: true
    resources:
      - name: nvidia.com/gpu
        replicas: 4
        devices: [{index}]
        memoryLimit: 10Gi
"""
SHARED = "nvidia.com/gpu.shared"
REPLICA_GIB = 10  # each replica's memoryLimit: the driver holds a container to 10 GiB per replica it holds
GREEDY_ALLOCATION_GIB = 12  # what shared-b's process asks for: more than its one replica's 10 GiB
DEMO_PID = 4242
UNIFORM_MIG_PRESET = "a100-mig"  # a preset where --mig-strategy single applies (one MIG profile on every GPU)
XID_DOUBLE_BIT_ECC = 48
GREEDY_REQUEST = 8
STRATEGY_MEANING = {
    MigStrategy.NONE: "MIG is ignored: every GPU is one nvidia.com/gpu, MIG or not",
    MigStrategy.SINGLE: "every MIG device is one nvidia.com/gpu (all of them must be alike)",
    MigStrategy.MIXED: "each MIG profile is its own resource, nvidia.com/mig-<profile>",
}


def run_demo(node: str, mig_strategy: str) -> int:
    logging.basicConfig(level=logging.ERROR)  # the demo tells its own story; only real errors get through
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # no gRPC core INFO lines ("Got goaway") as streams end
    logging.getLogger("agent.sim.kubelet").setLevel(logging.CRITICAL)  # its stream-ended errors are expected here
    try:
        strategy = MigStrategy(mig_strategy)
    except ValueError:
        choices = ", ".join(s.value for s in MigStrategy)
        return _fail(f"--mig-strategy {mig_strategy!r} is not a MIG strategy; use one of: {choices}", EXIT_USAGE)
    try:
        spec = load_node_spec(node)
    except SimSpecError as error:
        return _fail(_node_problem(node, str(error)), EXIT_USAGE)
    with terminated_on_sigterm():
        try:
            return _run_in(node, spec, strategy)
        except Terminated:  # everything is stopped and the work directory gone (the finally blocks ran)
            with contextlib.suppress(OSError, ValueError):
                sys.stdout.flush()
            return _fail("demo stopped by SIGTERM; the agent, the kubelet emulator and its files are gone",
                         EXIT_TERMINATED)  # fmt: skip


def _run_in(node: str, spec: NodeSpec, strategy: MigStrategy) -> int:
    workdir: Path | None = None
    try:
        workdir = Path(tempfile.mkdtemp(prefix="tessera-demo-", dir="/tmp"))
        with contextlib.ExitStack() as stack:
            try:
                driver = stack.enter_context(simulated_node(spec))
            except SimSpecError as error:
                return _fail(_node_problem(node, f"{node}: {str(error).removeprefix('node spec: ')}"), EXIT_USAGE)
            demo = _Demo(driver, workdir, node, spec, strategy)
            problem = demo.problem()
            if problem is not None:
                return _fail(problem, EXIT_PLAN_ERROR)
            try:
                code = demo.run()
                sys.stdout.flush()  # a reader that left shows here, not in the interpreter's teardown
                return code
            except BrokenPipeError:  # `tessera demo | head`: the reader left; run() has stopped the agent
                with contextlib.suppress(OSError):
                    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                return EXIT_STOPPED
    finally:
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)


def _fail(message: str, code: int) -> int:
    print(f"tessera: {message}", file=sys.stderr)
    return code


def _node_problem(node: str, error: str) -> str:
    if node in preset_names() or Path(node).exists():
        return f"{error}; the node spec format is in docs/simulated-node.md, or pick a preset with --node"
    example = preset_names()[0]
    return f"{error}; run e.g. `tessera demo --node {example}`, or give a node spec file (docs/simulated-node.md)"


class _Demo:
    def __init__(self, driver: SimDriver, workdir: Path, node: str, spec: NodeSpec, strategy: MigStrategy) -> None:
        from agent.agent import Agent, AgentOptions
        from agent.memlimits.settings import MemoryLimitSettings
        from agent.sim.kubelet import KubeletEmulator

        self.driver = driver
        self.node = node
        self.spec = spec
        self.strategy = strategy
        # the kubelet makes each started container a cgroup directory and a log link, as on a node: the agent finds
        # a container's cgroup from them and names it to the (simulated) driver, which holds it to its memory limit
        self.cgroup_root = workdir / "cgroup"
        self.kubelet = KubeletEmulator(
            workdir / "device-plugins",
            workdir / "pod-resources" / "kubelet.sock",
            cgroup_root=self.cgroup_root,
            log_root=workdir / "log",
        )
        self.shared_gpu = _last_whole_gpu(driver)
        self.config_text: str | None = None
        self.warnings: tuple[str, ...] = ()  # the plan's, as `tessera plan` prints them (problem() reads them)
        config_dir = None
        if self.shared_gpu is not None:  # time-slice one whole GPU, to show sharing next to dedicated GPUs
            self.config_text = SHARING_CONFIG.format(index=self.shared_gpu)
            config_dir = workdir / "config"  # laid out like a mounted ConfigMap: one file per named config
            config_dir.mkdir()
            (config_dir / CONFIG_NAME).write_text(self.config_text)
        self.options = AgentOptions(
            device_plugin_dir=workdir / "device-plugins",
            pod_resources_socket=workdir / "pod-resources" / "kubelet.sock",
            mig_strategy=strategy,
            config_path=config_dir,
            config_name=CONFIG_NAME if config_dir else None,
            health=HealthPolicy(quiet_seconds=RECOVERY_SECONDS),
            memory_limits=MemoryLimitSettings(self.cgroup_root, workdir / "log" / "containers"),
        )
        self.agent = Agent(self.options)

    def problem(self) -> str | None:
        """Why the agent could not serve this node with this strategy and config (the check `tessera plan`
        makes, on the same inventory), as one line with the fix; None when the demo can run."""
        try:
            inventory = discover()
            model = parse_document(self.config_text, CONFIG_NAME)[0] if self.config_text else ConfigModel()
            result = plan(effective(model, FlagOverrides(mig_strategy=self.strategy.value)).plan, inventory)
        except PlanError as error:
            if self.strategy is MigStrategy.SINGLE:
                return (
                    f"--mig-strategy single cannot apply to node {self.node!r}: "
                    f"{str(error).removeprefix('mig-strategy single: ')} (single advertises every GPU and MIG "
                    f"device as nvidia.com/gpu, so all must be alike). Try --mig-strategy mixed, or "
                    f"--node {UNIFORM_MIG_PRESET} --mig-strategy single"
                )
            return f"node {self.node!r} with --mig-strategy {self.strategy.value}: {error}"
        except (ConfigError, DiscoveryError) as error:
            return f"node {self.node!r}: {error}"
        self.warnings = result.warnings
        if not result.resources:
            why = "; ".join(result.warnings) or "it has no GPUs"
            return (
                f"node {self.node!r} offers nothing to schedule with --mig-strategy {self.strategy.value} ({why}); "
                f"give it a GPU or MIG devices (docs/simulated-node.md), or pick a preset: {', '.join(preset_names())}"
            )
        return None

    def run(self) -> int:
        self._frame()
        self._show_node()
        self.kubelet.start()
        thread = threading.Thread(target=self.agent.run, name="agent")
        started = time.perf_counter()
        thread.start()
        try:
            self._show_registration(started)
            self._schedule_pods()
            self._memory_limits()
            self._xid_and_recovery()
            self._kubelet_restart()
        finally:
            self.agent.stop()
            thread.join(timeout=10)
            self.kubelet.stop()
        sockets = sorted(p.name for p in self.options.device_plugin_dir.glob("nvidia-*.sock"))
        print(f"\nAgent stopped; plugin sockets left behind: {', '.join(sockets) or 'none'}.")
        self._show_plan_command()
        print("Done. Next: `tessera plan --node dgx-a100` to see another node, or run the tests (README).")
        return 0

    def plan_command(self) -> str:
        """The ``tessera plan`` command that shows what this demo's agent advertised (its config saved as
        ``CONFIG_FILE``); the MIG strategy is given, since the demo's default (mixed) is not plan's (none)."""
        words = ["tessera", "plan", "--node", self.node, "--mig-strategy", self.strategy.value]
        if self.config_text is not None:
            words += ["--config", CONFIG_FILE]
        return shlex.join(words)

    def _show_plan_command(self) -> None:
        print("\nThe same resources, without running anything:", end=" ")
        if self.config_text is None:
            print(f"`{self.plan_command()}`")
            return
        print(f"save the demo's sharing config as {CONFIG_FILE}")
        print("\n".join(f"      {line}" for line in self.config_text.splitlines()))
        print(f"  and run `{self.plan_command()}`")

    def _frame(self) -> None:
        """What this run is made of, before anything happens: node, sharing config, MIG strategy, timings."""
        gpus = self.driver.gpus
        models = ", ".join(f"{n}× {name}" for name, n in Counter(g.model.nvml_name for g in gpus).items())
        preset = self.node in preset_names() and not Path(self.node).is_file()  # as load_node_spec decides
        where = f"preset {self.node!r}" if preset else f"file {self.node}"
        nvswitch = ", NVSwitch" if self.spec.nvlink == "nvswitch" else ""
        if self.shared_gpu is not None:
            config = (
                f"{CONFIG_NAME}: GPU {self.shared_gpu} time-sliced ×4 as nvidia.com/gpu.shared ({REPLICA_GIB} GiB "
                "each), the others dedicated\n"
                f"{'':18}(built into the demo, agent/demo.py; on a cluster, the node label "
                f"nvidia.com/device-plugin.config picks it;\n{'':18}printed at the end, with the `tessera plan` "
                "command that shows what it advertises)"
            )
        else:
            config = "none, every device dedicated (the demo time-slices a GPU only when the node has two whole GPUs)"
        print("Tessera demo: a simulated GPU node, an emulated kubelet and the real agent, all on this machine.")
        print(f"  node            {self.spec.name} ({where}, chosen with --node): {models}{nvswitch}")
        print(f"  sharing config  {config}")
        print(f"  MIG strategy    {self.strategy.value} (--mig-strategy): {STRATEGY_MEANING[self.strategy]}")
        print(
            f"  timings         health recovery after {RECOVERY_SECONDS:.0f} s without errors "
            f"(shortened from {PRODUCTION_RECOVERY_SECONDS:.0f} s for the demo)"
        )
        for warning in self.warnings:  # what `tessera plan` warns about this node and strategy
            print(f"  warning         {warning}")

    def _show_node(self) -> None:
        print(f"\n[1/5] The node's GPUs, as the agent finds them through NVML (driver {self.driver.driver_version}):")
        for gpu in self.driver.gpus:
            layout = ", ".join(gi.profile.name for gi, _ in gpu.mig_devices()) if gpu.mig_current else "whole GPU"
            if gpu.index == self.shared_gpu:
                layout += f", time-sliced x4 by the sharing config (nvidia.com/gpu.shared, {REPLICA_GIB} GiB each)"
            print(f"      GPU {gpu.index}  {gpu.uuid}  {'MIG: ' if gpu.mig_current else ''}{layout}")

    def _show_registration(self, started: float) -> None:
        self.agent.started.wait(timeout=30)
        names = list(self.agent.status.resources)
        self.kubelet.wait_for(
            lambda: all(r in self.kubelet.resources() and self.kubelet.capacity(r) > 0 for r in names),
            timeout=15,
            what="every resource registered",
        )
        elapsed = time.perf_counter() - started
        registered = _count(len(names), "resource")
        print(f"\n[2/5] The agent registered {registered} with the kubelet ({elapsed:.2f} s after start):")
        for name in names:
            print(
                f"      {name:<26} capacity {self.kubelet.capacity(name)}, allocatable {self.kubelet.allocatable(name)}"
            )
        print(
            f"      (a real kubelet shows them in the Node's status at its next status sync, every "
            f"{KUBELET_STATUS_SYNC_SECONDS} s by default)"
        )

    def _schedule_pods(self) -> None:
        print("\n[3/5] Scheduling pods: the scheduler checks what the node has free, the kubelet allocates")
        print("      (GetPreferredAllocation, then Allocate):")
        resources = self.agent.status.resources
        wanted = [
            ("trainer", "nvidia.com/gpu", 1),
            ("notebook", "nvidia.com/mig-1g.10gb", 1),
            ("inference", "nvidia.com/mig-3g.40gb", 1),
            ("shared-a", "nvidia.com/gpu.shared", 1),
            ("shared-b", "nvidia.com/gpu.shared", 1),
        ]
        for pod, resource, count in wanted:
            if resource in resources:
                self._schedule(pod, resource, count)
        # one pod that does not fit: more of the node's most common kind of device than are free
        greedy = "nvidia.com/gpu" if "nvidia.com/gpu" in resources else max(resources, key=self.kubelet.capacity)
        self._schedule("greedy", greedy, max(GREEDY_REQUEST, self._free(greedy) + 1))

    def _schedule(self, pod: str, resource: str, count: int) -> None:
        from agent.sim.kubelet import AdmissionError

        free = self._free(resource)
        label = f"pod {pod:<10} {resource} × {count}"
        if count > free:  # the scheduler's NodeResourcesFit: the pod is never bound, the kubelet never sees it
            print(f"      {label} -> Pending: {_unschedulable(resource)}")
            print(
                f"{'':21}(the scheduler's FailedScheduling event: {free} of {self.kubelet.allocatable(resource)} "
                "free on this node; the pod waits, the kubelet never sees it)"
            )
            return
        try:
            created = self.kubelet.create_pod(pod, {"main": {resource: count}})
        except AdmissionError as error:  # bound, then refused at admission: the pod fails, it does not wait
            print(f"      {label} -> Failed ({error.reason}): {error.message}")
            return
        allocation = created.containers["main"][resource]
        env = dict(allocation.response.envs).get("NVIDIA_VISIBLE_DEVICES", "")
        print(f"      {label} -> NVIDIA_VISIBLE_DEVICES={env}")
        whole_mig = [g for g in self.driver.gpus if g.mig_current and g.uuid in env.split(",")]
        for gpu in whole_mig:  # mig-strategy none: a MIG-enabled GPU handed over whole
            print(
                f"{'':21}(GPU {gpu.index} has MIG enabled: CUDA in this pod finds no device it can use; "
                "--mig-strategy mixed hands out its MIG devices instead)"
            )

    def _memory_limits(self) -> None:
        """Two pods on the shared GPU held to 10 GiB and 20 GiB by the driver (one and two replicas of 10 GiB), and
        a third whose process asks for more than its limit and gets the error CUDA would give it."""
        if SHARED not in self.agent.status.resources or self._free(SHARED) < 2:
            return
        print(
            f"      GPU memory: each replica of {SHARED} is {REPLICA_GIB} GiB (the config's memoryLimit); the agent "
            "holds each\n      container to its replicas' sum through the driver (nvmlDeviceSetMemoryLimits_v1 on "
            "its cgroup)"
        )
        self._schedule("shared-big", SHARED, 2)
        names = [p.name for p in self.kubelet.pods() if _request(p, SHARED)]
        for name in names:  # the containers start: their cgroups appear, and the agent sees them through inotify
            self.kubelet.start_container(name, "main")
        agent = self.agent
        try:
            self.kubelet.wait_for(
                lambda: (
                    {h.container.pod for h in agent.status.memory_limits if h.applied or h.enforcement != "driver"}
                    >= set(names)
                ),
                timeout=10,
                what="every shared container held to its size",
            )
        except TimeoutError:  # said, not a traceback: what the agent holds is shown below as it is
            print("      (the agent did not hold every container to its size within 10 s; what it holds now:)")
        for held in sorted(self.agent.status.memory_limits, key=lambda h: h.limit):
            how = "by the driver" if held.enforcement == "driver" else f"only {held.enforcement}: {held.reason}"
            print(f"      pod {held.container.pod:<10} held to {held.limit >> 30} GiB on GPU {held.gpu_index} {how}")
        self._exceed("shared-b" if "shared-b" in names else names[0])

    def _exceed(self, pod: str) -> None:
        """The pod's process allocates more than its limit: CUDA's out-of-memory error, nothing allocated."""
        from agent.sim.nvml.driver import OutOfMemory

        started = self.kubelet.started_container(pod, "main")
        cgroup = str(started.cgroup)
        gpu = self.shared_gpu
        assert gpu is not None
        asked = GREEDY_ALLOCATION_GIB * 1024
        self.driver.add_process(gpu, DEMO_PID, 1024, cgroup=cgroup)
        try:
            self.driver.allocate(DEMO_PID, asked - 1024)
        except OutOfMemory as error:
            said = str(error).replace(str(self.cgroup_root), "/sys/fs/cgroup")  # the path it has on a node
            print(f"      pod {pod:<10} its process asks for {GREEDY_ALLOCATION_GIB} GiB -> the allocation fails:")
            print(f"{'':21}{said}")  # one line, as the process would log it
        else:
            print(
                f"      pod {pod:<10} its process asks for {GREEDY_ALLOCATION_GIB} GiB -> succeeds: nothing holds it "
                "(the driver cannot here; `tessera status` says why)"
            )
        finally:
            self.driver.remove_process(DEMO_PID)

    def _free(self, resource: str) -> int:
        """What the scheduler sees free: the node's allocatable minus the requests of the pods bound to it."""
        used = sum(_request(pod, resource) for pod in self.kubelet.pods())
        return max(self.kubelet.allocatable(resource) - used, 0)

    def _xid_and_recovery(self) -> None:
        target = next((g for g in self.driver.gpus if not g.mig_current), self.driver.gpus[0])
        resources = self.agent.status.resources
        resource = next(
            (name for name, snap in resources.items() if any(d.gpu_uuid == target.uuid for d in snap.devices)), None
        )
        print(
            f"\n[4/5] Injecting XID {XID_DOUBLE_BIT_ECC} (double-bit ECC error) on GPU {target.index} ({target.uuid})"
        )
        if resource is None:
            print("      skipped: no advertised device lives on that GPU")
            return
        before = self.kubelet.allocatable(resource)
        started = time.perf_counter()
        self.driver.inject_xid(target.index, XID_DOUBLE_BIT_ECC)
        self.kubelet.wait_for(lambda: self._unhealthy(resource, target.uuid), timeout=5, what="device Unhealthy")
        print(
            f"      the kubelet saw its devices Unhealthy after {1000 * (time.perf_counter() - started):.0f} ms; "
            f"allocatable {resource}: {before} -> {self.kubelet.allocatable(resource)}"
        )
        self._show_pods_on(target.index, target.uuid)
        self.kubelet.wait_for(
            lambda: not self._unhealthy(resource, target.uuid),
            timeout=RECOVERY_SECONDS + 10,
            what="device Healthy again",
        )
        print(
            f"      no new errors for {RECOVERY_SECONDS:.0f} s (shortened from {PRODUCTION_RECOVERY_SECONDS:.0f} s "
            f"for the demo) and the driver shows it recovered: Healthy again after "
            f"{time.perf_counter() - started:.1f} s"
        )
        print("      (NVIDIA's plugin would keep it Unhealthy until the plugin is restarted)")

    def _show_pods_on(self, index: int, gpu_uuid: str) -> None:
        """What became of the pods holding a device on the GPU that had the error: they keep it (a kubelet evicts
        no pod for an Unhealthy device), and only new pods are kept off it."""
        ids = {d.id for snap in self.agent.status.resources.values() for d in snap.devices if d.gpu_uuid == gpu_uuid}
        holders = [
            p.name
            for p in self.kubelet.pods()
            if any(set(a.device_ids) & ids for c in p.containers.values() for a in c.values())
        ]
        if not holders:
            print(f"      no pod holds a device on GPU {index}: no running work was hit, only capacity went")
            return
        pods = f"pod {holders[0]}" if len(holders) == 1 else f"pods {', '.join(holders)}"
        print(
            f"      {pods} on GPU {index}: still Running, with the same device (a kubelet evicts no pod for an "
            "Unhealthy device);\n      its CUDA work sees the error (a double-bit ECC error usually ends the "
            "process; the container restarts on\n      the same GPU). No new pod is given the device while it is "
            "Unhealthy"
        )

    def _unhealthy(self, resource: str, gpu_uuid: str) -> bool:
        snapshot = self.agent.status.resources.get(resource)
        ids = [d.id for d in snapshot.devices if d.gpu_uuid == gpu_uuid] if snapshot else []
        health = self.kubelet.devices(resource)
        return bool(ids) and all(health.get(i) == "Unhealthy" for i in ids)

    def _kubelet_restart(self) -> None:
        names = list(self.agent.status.resources)
        counts = {n: self.kubelet.registrations(n) for n in names}
        print("\n[5/5] Restarting the kubelet (it deletes every plugin socket and never dials plugins back)")
        started = time.perf_counter()
        self.kubelet.restart()
        self.kubelet.wait_for(
            lambda: all(self.kubelet.registrations(n) > counts[n] and self.kubelet.allocatable(n) > 0 for n in names),
            timeout=10,
            what="every resource registered again",
        )
        print(
            f"      {_count(len(names), 'resource')} registered again after {time.perf_counter() - started:.2f} s; "
            f"pods kept their devices: {', '.join(p.name for p in self.kubelet.pods())}"
        )


def _unschedulable(resource: str) -> str:
    """kube-scheduler's message for a pod no node has room for, on a one-node cluster (what `kubectl describe
    pod` shows in the FailedScheduling event; every pod here has the same priority, so preemption finds none)."""
    return (
        f"0/1 nodes are available: 1 Insufficient {resource}. "
        "preemption: 0/1 nodes are available: 1 No preemption victims found for incoming pod."
    )


def _request(pod: Pod, resource: str) -> int:
    """A pod's effective request (Kubernetes' rule): the larger of its app containers' sum and its largest init
    container."""
    apps = sum(pod.requests.get(c, {}).get(resource, 0) for c in pod.containers)
    inits = max((pod.requests.get(c, {}).get(resource, 0) for c in pod.init_containers), default=0)
    return max(apps, inits)


def _last_whole_gpu(driver: SimDriver) -> int | None:
    """The last GPU without MIG, if the node has at least two (one stays dedicated)."""
    whole = [g.index for g in driver.gpus if not g.mig_current]
    return whole[-1] if len(whole) >= 2 else None


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"
