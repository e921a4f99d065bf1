"""Benchmarks for the sharing config.

Run: python tests/bench/bench_config.py

- plan() for 8 GPUs x 7 MIG devices x 16 replicas (target < 20 ms)
- config change -> new resources visible at the kubelet emulator (target < 50 ms: inotify, no poll)
- GetPreferredAllocation over 1,024 available replicas (p99 target < 5 ms)
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[2]))

from agent.agent import Agent, AgentOptions
from agent.config.effective import FlagOverrides, effective
from agent.config.source import parse_document
from agent.core.plan import plan
from agent.core.preferred import DeviceLayout, preferred
from agent.core.resources import AllocationPolicy
from agent.gpu.discovery import discover
from agent.sim.kubelet import KubeletEmulator
from agent.sim.nvml.install import install, uninstall
from agent.sim.nvml.spec import build_driver, parse_node_spec
from tests.integration.test_config_reload import ConfigMapDir

MIG_NODE = {
    "name": "bench",
    "nvlink": "nvswitch",
    "gpus": [{"model": "A100-SXM4-80GB", "count": 8, "mig": {"instances": ["1g.10gb"] * 7}}],
}
SHARED_MIG = """
version: v1
flags: {migStrategy: mixed}
sharing:
  timeSlicing:
    resources: [{name: nvidia.com/mig-1g.10gb, replicas: 16}]
"""


SHARED_GPUS = """
version: v1
sharing:
  timeSlicing:
    resources: [{name: nvidia.com/gpu, replicas: 128}]
"""


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def bench_plan_and_preferred() -> None:
    install(build_driver(parse_node_spec(MIG_NODE)))
    try:
        inventory = discover()
    finally:
        uninstall()
    model, _ = parse_document(SHARED_MIG, "bench")
    settings = effective(model, FlagOverrides())
    times = []
    for _ in range(50):
        start = time.perf_counter()
        result = plan(settings.plan, inventory)
        times.append(time.perf_counter() - start)
    resource = result.resource("nvidia.com/mig-1g.10gb")
    assert resource is not None
    print(
        f"plan() 8 GPUs x 7 MIG x 16 replicas ({len(resource.devices)} devices)   "
        f"p50 {statistics.median(times) * 1000:6.2f} ms  max {max(times) * 1000:6.2f} ms   target < 20 ms"
    )

    install(build_driver(parse_node_spec({"name": "ts", "gpus": [{"model": "A100-SXM4-80GB", "count": 8}]})))
    try:
        full_gpus = discover()
    finally:
        uninstall()
    shared, _ = parse_document(SHARED_GPUS, "bench")
    replicas = plan(effective(shared, FlagOverrides()).plan, full_gpus).resource("nvidia.com/gpu")
    assert replicas is not None and len(replicas.devices) == 1024
    by_id = {d.id: d for d in replicas.devices}
    ids = list(by_id)
    layout = DeviceLayout.of(by_id)  # once per snapshot, as the resource server does
    for policy in AllocationPolicy:
        latencies = []
        for n in range(500):
            size = 1 + n % 4
            start = time.perf_counter()
            preferred(ids, [], size, by_id, {}, policy, layout)
            latencies.append(time.perf_counter() - start)
        print(
            f"GetPreferredAllocation, 8 GPUs x 128 replicas, {policy:<11}  "
            f"p50 {statistics.median(latencies) * 1000:6.2f} ms  p99 {_percentile(latencies, 0.99) * 1000:6.2f} ms"
            "   target p99 < 5 ms"
        )


def bench_reload() -> None:
    install(build_driver(parse_node_spec({"name": "reload", "gpus": [{"model": "A100-SXM4-80GB", "count": 4}]})))
    base = Path(tempfile.mkdtemp(prefix="bc", dir="/tmp"))
    kubelet = KubeletEmulator(base / "dp")
    kubelet.start()
    configmap = ConfigMapDir(base / "cm")
    configmap.publish({"default": "version: v1\n"})
    agent = Agent(AgentOptions(device_plugin_dir=base / "dp", config_path=configmap.root))
    thread = threading.Thread(target=agent.run)
    thread.start()
    try:
        kubelet.wait_for(lambda: "nvidia.com/gpu" in kubelet.resources(), 10, "start")
        times = []
        for replicas in range(2, 12):
            text = (
                "version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: true\n    resources:\n"
                f"      - name: nvidia.com/gpu\n        replicas: {replicas}\n"
            )
            start = time.perf_counter()
            configmap.publish({"default": text})
            kubelet.wait_for(lambda r=replicas: kubelet.allocatable("nvidia.com/gpu.shared") == 4 * r, 10, "reload")
            times.append(time.perf_counter() - start)
        print(
            f"config change -> visible at the kubelet (n={len(times)})           "
            f"p50 {statistics.median(times) * 1000:6.0f} ms  max {max(times) * 1000:6.0f} ms   target < 50 ms"
        )
    finally:
        agent.stop()
        thread.join(timeout=20)
        kubelet.stop()
        uninstall()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    print(f"machine: {os.cpu_count()} cores")
    bench_plan_and_preferred()
    bench_reload()
