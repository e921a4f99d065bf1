"""Benchmarks for the MIG layout manager on a simulated DGX A100 (8 GPUs).

Run: python tests/bench/bench_mig.py

- planning 8 GPUs: all-1g.10gb -> all-balanced (target < 50 ms)
- applying all-1g.10gb -> all-balanced through NVML on the simulator (target < 2 s of agent time)
"""

from __future__ import annotations

import os
import statistics
import time

from agent.core.mig_layout import CreateInstance, DesiredLayout, DestroyInstance, SetMigMode, diff_node
from agent.gpu.discovery import discover
from agent.gpu.mig import create_instance, destroy_instance, set_mig_mode
from agent.sim.nvml.install import install, uninstall
from agent.sim.nvml.spec import build_driver, parse_node_spec

NODE = {
    "name": "dgx",
    "nvlink": "nvswitch",
    "gpus": [{"model": "A100-SXM4-80GB", "count": 8, "mig": {"instances": ["1g.10gb"] * 7}}],
}
BALANCED = DesiredLayout(True, (("1g.10gb", 2), ("2g.20gb", 1), ("3g.40gb", 1)))
RUNS = 5


def main() -> None:
    plan_times, apply_times = [], []
    for _ in range(RUNS):
        install(build_driver(parse_node_spec(NODE)))
        try:
            inventory = discover()
            layouts = {gpu.index: BALANCED for gpu in inventory.gpus}
            start = time.perf_counter()
            operations = diff_node(inventory.gpus, layouts)
            plan_times.append(time.perf_counter() - start)
            start = time.perf_counter()
            for gpu_index, ops in sorted(operations.items()):
                for op in ops:
                    if isinstance(op, SetMigMode):
                        set_mig_mode(gpu_index, op.enabled)
                    elif isinstance(op, DestroyInstance):
                        destroy_instance(gpu_index, op.gi_id)
                    elif isinstance(op, CreateInstance):
                        create_instance(gpu_index, op.profile_id, op.placement, op.ci_profile_id)
            after = discover()
            apply_times.append(time.perf_counter() - start)
            assert not diff_node(after.gpus, layouts), "the layout did not converge"
        finally:
            uninstall()
    count = sum(len(ops) for ops in operations.values())
    print(f"machine: {os.cpu_count()} cores; simulated dgx-a100, 8 GPUs x 7 1g.10gb -> all-balanced, {RUNS} runs")
    print(f"planning 8 GPUs ({count} operations)             p50 {statistics.median(plan_times) * 1000:7.2f} ms  "
          f"max {max(plan_times) * 1000:7.2f} ms   target < 50 ms")  # fmt: skip
    print(f"applying + re-reading the inventory             p50 {statistics.median(apply_times) * 1000:7.1f} ms  "
          f"max {max(apply_times) * 1000:7.1f} ms   target < 2000 ms")  # fmt: skip


if __name__ == "__main__":
    main()
