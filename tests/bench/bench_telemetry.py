"""Benchmarks for telemetry on a simulated DGX A100: 8 GPUs x 7 MIG devices x 8 replicas, 100 pods.

Run: python tests/bench/bench_telemetry.py

- scrape latency of /metrics (p99 target < 20 ms)
- CPU used by one collection, as a share of one core at a 10 s interval (target < 2 %)
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from agent.agent import Agent, AgentOptions
from agent.sim.install import install, uninstall
from agent.sim.kubelet import KubeletEmulator
from agent.sim.spec import build_driver, parse_node_spec
from agent.telemetry.service import TelemetrySettings

NODE = {
    "name": "bench",
    "nvlink": "nvswitch",
    "gpus": [{"model": "A100-SXM4-80GB", "count": 8, "mig": {"instances": ["1g.10gb"] * 7}}],
}
CONFIG = """
version: v1
flags: {migStrategy: mixed}
sharing:
  timeSlicing:
    resources: [{name: nvidia.com/mig-1g.10gb, replicas: 8}]
"""
RESOURCE = "nvidia.com/mig-1g.10gb"
INTERVAL = 10.0


def main() -> None:
    install(build_driver(parse_node_spec(NODE)))
    base = Path(tempfile.mkdtemp(prefix="bt", dir="/tmp"))
    (base / "config.yaml").write_text(CONFIG)
    kubelet = KubeletEmulator(base / "dp", base / "pr" / "kubelet.sock")
    kubelet.start()
    agent = Agent(
        AgentOptions(
            device_plugin_dir=base / "dp",
            pod_resources_socket=base / "pr" / "kubelet.sock",
            config_path=base / "config.yaml",
            telemetry=TelemetrySettings(hostname="bench", metrics_address="127.0.0.1:0", interval=3600),
        )
    )
    thread = threading.Thread(target=agent.run)
    thread.start()
    try:
        kubelet.wait_for(lambda: RESOURCE in kubelet.resources() and kubelet.allocatable(RESOURCE) == 448, 30, "up")
        for n in range(100):
            kubelet.create_pod(f"pod-{n}", {"main": {RESOURCE: 1}})
        collector = agent._telemetry.collector  # the bench drives collections itself
        cpu = []
        for _ in range(20):
            start = time.process_time()
            collector.collect_once()
            cpu.append(time.process_time() - start)
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
    ordered = sorted(scrape)
    series = sum(1 for line in body.decode().splitlines() if line and not line.startswith("#"))
    print(f"machine: {os.cpu_count()} cores; 8 GPUs x 7 MIG x 8 replicas (448 devices), 100 pods, {series} series")
    print(
        f"/metrics scrape over HTTP            p50 {statistics.median(scrape) * 1000:6.2f} ms  "
        f"p99 {ordered[int(0.99 * (len(ordered) - 1))] * 1000:6.2f} ms   target p99 < 20 ms"
    )
    per_collection = statistics.median(cpu)
    print(
        f"CPU per collection                   p50 {per_collection * 1000:6.1f} ms  "
        f"= {100 * per_collection / INTERVAL:.2f} % of one core at a {INTERVAL:.0f} s interval   target < 2 %"
    )


if __name__ == "__main__":
    main()
