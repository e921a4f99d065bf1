"""``tessera demo``: a simulated node, the emulated kubelet and the real agent, end to end, on one machine.

Nothing is mocked: the agent discovers the simulated GPUs through pynvml, serves them over gRPC on unix
sockets, and the kubelet emulator registers, schedules and restarts exactly as a kubelet would.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from agent.agent import Agent, AgentOptions
from agent.core.health import HealthPolicy
from agent.core.resources import MigStrategy
from agent.sim.driver import SimDriver
from agent.sim.install import simulated_node
from agent.sim.kubelet import AdmissionError, KubeletEmulator

RECOVERY_SECONDS = 2.0
SHARING_CONFIG = """version: v1
sharing:
  timeSlicing:
    renameByDefault: true
    resources:
      - name: nvidia.com/gpu
        replicas: 4
        devices: [{index}]
"""
XID_DOUBLE_BIT_ECC = 48


def run_demo(node: str, mig_strategy: str) -> int:
    logging.basicConfig(level=logging.ERROR)  # the demo tells its own story; only real errors get through
    logging.getLogger("agent.sim.kubelet").setLevel(logging.CRITICAL)  # its stream-ended errors are expected here
    workdir = Path(tempfile.mkdtemp(prefix="tessera-demo-", dir="/tmp"))
    try:
        with simulated_node(node) as driver:
            return _Demo(driver, workdir, node, MigStrategy(mig_strategy)).run()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


class _Demo:
    def __init__(self, driver: SimDriver, workdir: Path, node: str, strategy: MigStrategy) -> None:
        self.driver = driver
        self.node = node
        self.kubelet = KubeletEmulator(workdir / "device-plugins", workdir / "pod-resources" / "kubelet.sock")
        self.shared_gpu = _last_whole_gpu(driver)
        config = None
        if self.shared_gpu is not None:  # time-slice one whole GPU, to show sharing next to dedicated GPUs
            config = workdir / "sharing.yaml"
            config.write_text(SHARING_CONFIG.format(index=self.shared_gpu))
        self.options = AgentOptions(
            device_plugin_dir=workdir / "device-plugins",
            pod_resources_socket=workdir / "pod-resources" / "kubelet.sock",
            mig_strategy=strategy,
            config_path=config,
            health=HealthPolicy(quiet_seconds=RECOVERY_SECONDS),
        )
        self.agent = Agent(self.options)

    def run(self) -> int:
        print("Tessera demo: a simulated GPU node, an emulated kubelet and the real agent, all on this machine.\n")
        self._show_node()
        self.kubelet.start()
        thread = threading.Thread(target=self.agent.run, name="agent")
        started = time.perf_counter()
        thread.start()
        try:
            self._show_registration(started)
            self._schedule_pods()
            self._xid_and_recovery()
            self._kubelet_restart()
        finally:
            self.agent.stop()
            thread.join(timeout=10)
            self.kubelet.stop()
        sockets = sorted(p.name for p in self.options.device_plugin_dir.glob("nvidia-*.sock"))
        print(f"\nAgent stopped; plugin sockets left behind: {', '.join(sockets) or 'none'}.")
        print("Done. Next: `tessera plan --node dgx-a100` to see another node, or run the tests (README).")
        return 0

    def _show_node(self) -> None:
        gpus = self.driver.gpus
        models = Counter(g.model.nvml_name for g in gpus)
        summary = ", ".join(f"{n}× {name}" for name, n in models.items())
        print(f"[1/5] Simulated node {self.node!r}: {summary}, driver {self.driver.driver_version}")
        for gpu in gpus:
            layout = ", ".join(gi.profile.name for gi, _ in gpu.mig_devices()) if gpu.mig_current else "whole GPU"
            if gpu.index == self.shared_gpu:
                layout += ", time-sliced x4 by the sharing config (nvidia.com/gpu.shared)"
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

    def _schedule_pods(self) -> None:
        print("\n[3/5] Scheduling pods through the kubelet (GetPreferredAllocation, then Allocate):")
        resources = self.agent.status.resources
        wanted = [
            ("trainer", "nvidia.com/gpu", 1),
            ("notebook", "nvidia.com/mig-1g.10gb", 1),
            ("inference", "nvidia.com/mig-3g.40gb", 1),
            ("shared-a", "nvidia.com/gpu.shared", 1),
            ("shared-b", "nvidia.com/gpu.shared", 1),
            ("greedy", "nvidia.com/gpu", 8),
        ]
        for pod, resource, count in wanted:
            if resource not in resources:
                continue
            try:
                created = self.kubelet.create_pod(pod, {"main": {resource: count}})
            except AdmissionError as error:
                print(f"      pod {pod:<10} {resource} × {count}: refused by the kubelet: {error}")
                continue
            allocation = created.containers["main"][resource]
            env = dict(allocation.response.envs).get("NVIDIA_VISIBLE_DEVICES", "")
            print(f"      pod {pod:<10} {resource} × {count} -> NVIDIA_VISIBLE_DEVICES={env}")

    def _xid_and_recovery(self) -> None:
        target = next((g for g in self.driver.gpus if not g.mig_current), self.driver.gpus[0])
        resource = "nvidia.com/gpu" if not target.mig_current else next(iter(self.agent.status.resources))
        print(
            f"\n[4/5] Injecting XID {XID_DOUBLE_BIT_ECC} (double-bit ECC error) on GPU {target.index} ({target.uuid})"
        )
        before = self.kubelet.allocatable(resource)
        started = time.perf_counter()
        self.driver.inject_xid(target.index, XID_DOUBLE_BIT_ECC)
        self.kubelet.wait_for(lambda: self._unhealthy(resource, target.uuid), timeout=5, what="device Unhealthy")
        print(
            f"      the kubelet saw its devices Unhealthy after {1000 * (time.perf_counter() - started):.0f} ms; "
            f"allocatable {resource}: {before} -> {self.kubelet.allocatable(resource)}"
        )
        self.kubelet.wait_for(
            lambda: not self._unhealthy(resource, target.uuid),
            timeout=RECOVERY_SECONDS + 10,
            what="device Healthy again",
        )
        print(
            f"      no new errors for {RECOVERY_SECONDS:.0f} s and the driver shows it recovered: Healthy again after "
            f"{time.perf_counter() - started:.1f} s (NVIDIA's plugin would keep it Unhealthy until restarted)"
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


def _last_whole_gpu(driver: SimDriver) -> int | None:
    """The last GPU without MIG, if the node has at least two (one stays dedicated)."""
    whole = [g.index for g in driver.gpus if not g.mig_current]
    return whole[-1] if len(whole) >= 2 else None


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"
