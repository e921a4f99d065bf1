"""Benchmark for driver-enforced memory limits, path (b): container start -> its limit set by the driver.

Run: python tests/bench/bench_memlimits.py [--rounds N]

A simulated DGX A100 (8 GPUs, driver r615) with MPS replicas of 6 GiB (13 per GPU, 104 in all), the kubelet
emulator making the containers' cgroups and log links, and the agent in-process (so the simulated driver's own
clock says when each limit was set). 100 pods are admitted, then their 100 containers are started at once (back to
back, as fast as the emulator can); for each container, from the moment its start began to the moment
``nvmlDeviceSetMemoryLimits_v1`` set its cgroup's limit. Target: p99 < 100 ms.

Floors, measured in the same run: one container started alone on the same node (the latency with nothing else to
do), and the work itself without the agent: one PodResources List plus a Get + Set + Get per container for 100
containers, called directly from the benchmark.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import pynvml

from agent.agent import Agent, AgentOptions
from agent.gpu.memory_limits import read_memory_limits, set_memory_limits
from agent.memlimits.settings import MemoryLimitSettings
from agent.plugin.podresources import list_pod_resources
from agent.sim.kubelet import KubeletEmulator
from agent.sim.nvml.driver import SimDriver
from agent.sim.nvml.install import install, uninstall
from agent.sim.nvml.spec import build_driver, parse_node_spec

NODE = {"name": "bench-ml", "driver_version": "615.71.09", "gpus": [{"model": "A100-SXM4-80GB", "count": 8}]}
CONFIG = """
version: v1
flags: {mpsRoot: '@BASE@/mps'}
sharing:
  mps:
    resources: [{name: nvidia.com/gpu, replicas: 13, memoryLimit: 6Gi}]
"""
RESOURCE = "nvidia.com/gpu"
CONTAINERS = 100


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.002)


def _nearest_rank(values: list[float], percent: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, -(-len(ordered) * percent // 100) - 1))]


def one_round(base: Path, driver: SimDriver) -> tuple[list[float], float, float]:
    (base / "config.yaml").write_text(CONFIG.replace("@BASE@", str(base)))
    kubelet = KubeletEmulator(base / "dp", base / "pr.sock", cgroup_root=base / "cg", log_root=base / "log")
    kubelet.start()
    settings = MemoryLimitSettings(base / "cg", base / "log" / "containers", 30.0)
    agent = Agent(
        AgentOptions(
            device_plugin_dir=base / "dp",
            pod_resources_socket=base / "pr.sock",
            config_path=base / "config.yaml",
            memory_limits=settings,
        )
    )
    thread = threading.Thread(target=agent.run, name="agent")
    thread.start()
    try:
        assert agent.started.wait(30)
        _wait(lambda: kubelet.allocatable(RESOURCE) == 104 if RESOURCE in kubelet.resources() else False, 60, "MPS")

        def applied(cgroup: str) -> float | None:
            limit = next((v for (_, c), v in driver.memory_limit_table().items() if c == cgroup), None)
            return None if limit is None else limit.set_at

        alone = kubelet.create_pod("alone", {"main": {RESOURCE: 1}})
        started = time.monotonic()
        kubelet.start_container("alone", "main")
        cgroup = str(kubelet.started_container("alone", "main").cgroup)
        _wait(lambda: applied(cgroup) is not None, 10, "the lone container's limit")
        floor_alone = applied(cgroup) - started  # type: ignore[operator]
        del alone

        pods = [kubelet.create_pod(f"p{n}", {"main": {RESOURCE: 1}}) for n in range(CONTAINERS - 1)]
        starts: dict[str, float] = {}
        for pod in pods:
            begun = time.monotonic()
            kubelet.start_container(pod.name, "main")
            starts[str(kubelet.started_container(pod.name, "main").cgroup)] = begun
        _wait(lambda: all(applied(c) is not None for c in starts), 30, "every container's limit")
        latencies = [applied(c) - begun for c, begun in starts.items()]  # type: ignore[operator]
        latencies.append(floor_alone)

        work_started = time.perf_counter()  # the work without the agent: List + Get/Set/Get per container
        holders = list_pod_resources(base / "pr.sock").devices
        pynvml.nvmlInit()
        try:
            for n, cgroup in enumerate(list(starts)[:CONTAINERS]):
                uuid = driver.gpus[n % len(driver.gpus)].uuid
                read_memory_limits(uuid, cgroup)
                set_memory_limits(uuid, cgroup, 6 << 30, 6 << 30)
                read_memory_limits(uuid, cgroup)
        finally:
            pynvml.nvmlShutdown()
        floor_work = time.perf_counter() - work_started
        assert holders
        return latencies, floor_alone, floor_work
    finally:
        agent.stop()
        thread.join(timeout=30)
        kubelet.stop()
        for pid_file in base.glob("mps/**/nvidia-cuda-mps-control.pid"):
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(pid_file.read_text()), 9)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    rounds = parser.parse_args().rounds
    bin_dir = Path(tempfile.mkdtemp(prefix="bmlbin", dir="/tmp"))
    launcher = bin_dir / "nvidia-cuda-mps-control"
    launcher.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m agent.sim.mps.control "$@"\n')
    launcher.chmod(0o755)
    os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    all_latencies: list[float] = []
    alone: list[float] = []
    work: list[float] = []
    try:
        for _ in range(rounds):
            base = Path(tempfile.mkdtemp(prefix="bml", dir="/tmp"))
            driver = build_driver(parse_node_spec(NODE))
            install(driver)
            try:
                latencies, floor_alone, floor_work = one_round(base, driver)
            finally:
                uninstall()
                shutil.rmtree(base, ignore_errors=True)
            all_latencies += latencies
            alone.append(floor_alone)
            work.append(floor_work)
    finally:
        shutil.rmtree(bin_dir, ignore_errors=True)
    ms = [1000 * x for x in all_latencies]
    print(f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; {rounds} rounds of {CONTAINERS} containers")
    print(
        f"container start -> limit set by the driver   p50 {statistics.median(ms):6.1f} ms  "
        f"p99 {_nearest_rank(ms, 99):6.1f} ms  max {max(ms):6.1f} ms   target p99 < 100 ms"
    )
    print(f"floor: one container started alone          median {1000 * statistics.median(alone):6.1f} ms")
    print(
        f"floor: the work without the agent (List + 100 x Get/Set/Get)  median {1000 * statistics.median(work):6.1f} ms"
    )


if __name__ == "__main__":
    main()
