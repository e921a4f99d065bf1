"""Benchmarks for telemetry: what one metrics collection costs the agent, on two simulated nodes.

Run: python tests/bench/bench_telemetry.py

- a DGX A100 with 8 GPUs x 7 MIG devices x 8 replicas and 100 pods:
  scrape latency of /metrics (p99 target < 20 ms), CPU per collection (target < 2 % of a core at a 10 s interval);
- the plain ``dgx-a100`` preset (8 GPUs, no MIG, nothing allocated), the common idle node: CPU per collection
  (target < 5 ms, so that collecting every 10 s costs an idle agent < 0.05 % of a core).

CPU is the process's (``time.process_time``): the simulated NVML library runs in-process and counts, as does the
kubelet emulator's side of PodResources (on a real node that is the kubelet's). A collection builds the metric
families; they are rendered in the text format on the first scrape after it, reported apart ("rendering").
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent.agent import Agent, AgentOptions
from agent.sim.kubelet import KubeletEmulator
from agent.sim.nvml.install import install, uninstall
from agent.sim.nvml.spec import NodeSpec, build_driver, load_node_spec, parse_node_spec
from agent.telemetry.service import TelemetrySettings

MIG_NODE = {
    "name": "bench",
    "nvlink": "nvswitch",
    "gpus": [{"model": "A100-SXM4-80GB", "count": 8, "mig": {"instances": ["1g.10gb"] * 7}}],
}
MIG_CONFIG = """
version: v1
flags: {migStrategy: mixed}
sharing:
  timeSlicing:
    resources: [{name: nvidia.com/mig-1g.10gb, replicas: 8}]
"""
MIG_RESOURCE = "nvidia.com/mig-1g.10gb"
GPU_RESOURCE = "nvidia.com/gpu"
INTERVAL = 10.0
COLLECTIONS = 30
PAUSE = 0.05  # between collections: back to back they would meet PodResources' rate limit


@dataclass
class Figures:
    collection: list[float]  # process CPU seconds per collection
    rendering: list[float]  # process CPU seconds of the first scrape's rendering after a collection
    scrape: list[float]  # wall seconds of a /metrics GET over HTTP
    series: int


def measure(
    spec: NodeSpec, config: str | None, resource: str, devices: int, setup: Callable[[KubeletEmulator], None]
) -> Figures:
    install(build_driver(spec))
    base = Path(tempfile.mkdtemp(prefix="bt", dir="/tmp"))
    if config is not None:
        (base / "config.yaml").write_text(config)
    kubelet = KubeletEmulator(base / "dp", base / "pr" / "kubelet.sock")
    kubelet.start()
    agent = Agent(
        AgentOptions(
            device_plugin_dir=base / "dp",
            pod_resources_socket=base / "pr" / "kubelet.sock",
            config_path=base / "config.yaml" if config is not None else None,
            telemetry=TelemetrySettings(
                hostname="bench", metrics_address="127.0.0.1:0", interval=3600, nfd_features_dir=base / "nfd"
            ),
        )
    )
    thread = threading.Thread(target=agent.run)
    thread.start()
    try:
        kubelet.wait_for(
            lambda: agent._telemetry is not None and kubelet.allocatable(resource) == devices, 30, "registered"
        )
        setup(kubelet)
        collector = agent._telemetry.collector  # the bench drives collections itself
        last = collector.last
        for _ in range(3):  # warm up: first PodResources channel, first checkpoint read, first rendering
            collector.collect_once()
            last.rendered  # noqa: B018 - the rendering is what is measured
        collection, rendering = [], []
        for _ in range(COLLECTIONS):
            time.sleep(PAUSE)
            start = time.process_time()
            collector.collect_once()
            collection.append(time.process_time() - start)
            start = time.process_time()
            last.rendered  # noqa: B018
            rendering.append(time.process_time() - start)
        url = f"http://127.0.0.1:{agent.metrics_port}/metrics"
        body = urllib.request.urlopen(url, timeout=5).read()
        scrape = []
        for _ in range(200):
            start = time.perf_counter()
            urllib.request.urlopen(url, timeout=5).read()
            scrape.append(time.perf_counter() - start)
    finally:
        agent.stop()
        thread.join(timeout=20)
        kubelet.stop()
        uninstall()
        shutil.rmtree(base, ignore_errors=True)
    series = sum(1 for line in body.decode().splitlines() if line and not line.startswith("#"))
    return Figures(collection, rendering, scrape, series)


def report(figures: Figures, target: str) -> None:
    per_collection = statistics.median(figures.collection)
    rendering = statistics.median(figures.rendering)
    print(
        f"  CPU per collection                 p50 {per_collection * 1000:6.2f} ms  "
        f"= {100 * per_collection / INTERVAL:.3f} % of one core at a {INTERVAL:.0f} s interval   {target}"
    )
    print(
        f"  + rendering for a scrape           p50 {rendering * 1000:6.2f} ms  "
        f"= {100 * (per_collection + rendering) / INTERVAL:.3f} % of one core if scraped every collection"
    )


def main() -> None:
    print(f"machine: {os.cpu_count()} cores")

    def hundred_pods(kubelet: KubeletEmulator) -> None:
        for n in range(100):
            kubelet.create_pod(f"pod-{n}", {"main": {MIG_RESOURCE: 1}})

    mig = measure(parse_node_spec(MIG_NODE), MIG_CONFIG, MIG_RESOURCE, 448, hundred_pods)
    ordered = sorted(mig.scrape)
    print(f"8 GPUs x 7 MIG x 8 replicas (448 devices), 100 pods, {mig.series} series")
    print(
        f"  /metrics scrape over HTTP          p50 {statistics.median(mig.scrape) * 1000:6.2f} ms  "
        f"p99 {ordered[int(0.99 * (len(ordered) - 1))] * 1000:6.2f} ms   target p99 < 20 ms"
    )
    report(mig, "target < 2 %")

    plain = measure(load_node_spec("dgx-a100"), None, GPU_RESOURCE, 8, lambda kubelet: None)
    print(f"dgx-a100 preset: 8 GPUs, no MIG, nothing allocated, {plain.series} series")
    report(plain, "target < 5 ms (< 0.05 %)")


if __name__ == "__main__":
    main()
