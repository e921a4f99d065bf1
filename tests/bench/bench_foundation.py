"""Benchmarks for the foundation: `tessera plan` start to finish, and NVML discovery.

Run: python tests/bench/bench_foundation.py
Targets (2-core machine): `tessera plan --node dgx-a100` < 1 s wall, import time included.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

from agent.gpu.discovery import discover
from agent.sim.nvml.install import install, uninstall
from agent.sim.nvml.spec import build_driver, parse_node_spec

RUNS = 15


def _plan_wall_times() -> list[float]:
    command = [sys.executable, "-m", "agent", "plan", "--node", "dgx-a100", "--format", "json"]
    times = []
    for _ in range(RUNS):
        start = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return times


def _discovery_times() -> tuple[list[float], int]:
    spec = parse_node_spec(
        {
            "name": "dgx-a100",
            "nvlink": "nvswitch",
            "numa_nodes": 2,
            "gpus": [{"model": "A100-SXM4-80GB", "count": 8, "mig": {"instances": ["1g.10gb"] * 7}}],
        }
    )
    install(build_driver(spec))
    try:
        times = []
        devices = 0
        for _ in range(RUNS):
            start = time.perf_counter()
            inventory = discover()
            times.append(time.perf_counter() - start)
            devices = sum(len(g.mig_devices) for g in inventory.gpus)
        return times, devices
    finally:
        uninstall()


def _row(name: str, times: list[float], target: str) -> str:
    ordered = sorted(times)
    p50 = statistics.median(ordered) * 1000
    worst = ordered[-1] * 1000
    return f"{name:<52} p50 {p50:8.1f} ms   max {worst:8.1f} ms   target {target}"


def main() -> None:
    plan_times = _plan_wall_times()
    discovery, devices = _discovery_times()
    print(f"runs per figure: {RUNS}")
    print(_row("tessera plan --node dgx-a100 (process wall time)", plan_times, "< 1000 ms"))
    print(_row(f"discover() dgx-a100, 8 GPUs x 7 MIG ({devices} devices)", discovery, "-"))


if __name__ == "__main__":
    main()
