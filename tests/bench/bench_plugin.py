"""Benchmarks for the device-plugin path, on a simulated dgx-a100 with the kubelet emulator.

Run: python tests/bench/bench_plugin.py [--allocations 10000]

Prints, with the issue's targets:
- process start -> every resource registered (target < 1.5 s)
- Allocate round trip p50/p99 through the kubelet's connection, next to an empty unary RPC on a unix
  socket measured in the same run (target: Allocate p50 <= 1.5x the empty RPC)
- XID injected -> the kubelet sees the device Unhealthy (p99 < 100 ms)
- kubelet restart -> every resource registered again (p99 < 1 s)
- the agent's RSS after start (< 80 MB) and its growth over N Allocate calls (< 2 MB)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path

import grpc

from agent.sim.control import SimControlClient
from agent.sim.kubelet import KubeletEmulator

RESOURCE = "nvidia.com/gpu"


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def _serve_empty(path: str) -> None:
    """Run in a separate process, like the agent: a gRPC server whose one method does nothing."""
    handler = grpc.method_handlers_generic_handler(
        "bench.Empty",
        {"Call": grpc.unary_unary_rpc_method_handler(lambda request, context: b"")},
    )
    server = grpc.server(futures.ThreadPoolExecutor(8))
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"unix://{path}")
    server.start()
    server.wait_for_termination()


def _empty_rpc_times(directory: Path, count: int) -> list[float]:
    """An empty unary RPC over a unix socket to another process: the floor any plugin RPC pays."""
    path = directory / "empty.sock"
    server = subprocess.Popen([sys.executable, __file__, "--serve-empty", str(path)])
    try:
        deadline = time.monotonic() + 10
        while not path.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        with grpc.insecure_channel(f"unix://{path}") as channel:
            call = channel.unary_unary("/bench.Empty/Call")
            for _ in range(200):
                call(b"")
            times = []
            for _ in range(count):
                start = time.perf_counter()
                call(b"")
                times.append(time.perf_counter() - start)
            return times
    finally:
        server.terminate()
        server.wait(timeout=10)


def _row(name: str, values: list[float], target: str, unit: float = 1000.0, suffix: str = "ms") -> str:
    return (
        f"{name:<44} p50 {statistics.median(values) * unit:8.2f} {suffix}  "
        f"p99 {_percentile(values, 0.99) * unit:8.2f} {suffix}  n={len(values):<6} target {target}"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--allocations", type=int, default=10_000)
    parser.add_argument("--restarts", type=int, default=20)
    parser.add_argument("--xids", type=int, default=100)
    parser.add_argument("--serve-empty", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_empty:
        _serve_empty(args.serve_empty)
        return

    base = Path(tempfile.mkdtemp(prefix="bench", dir="/tmp"))
    plugin_dir = base / "dp"
    kubelet = KubeletEmulator(plugin_dir, base / "pr" / "kubelet.sock")
    kubelet.start()
    command = [
        sys.executable, "-m", "agent", "run", "--simulate", "dgx-a100", "--sim-control", str(base / "ctl.sock"),
        "--device-plugin-dir", str(plugin_dir), "--health-recovery-seconds", "0.05", "--log-level", "warning",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    started = time.perf_counter()
    agent = subprocess.Popen(command, env=env, stderr=subprocess.DEVNULL)
    try:
        kubelet.wait_for(
            lambda: kubelet.allocatable(RESOURCE) == 8 if RESOURCE in kubelet.resources() else False,
            timeout=30,
            what="registered",
        )
        start_seconds = time.perf_counter() - started
        rss_after_start = _rss_kib(agent.pid)
        control = SimControlClient(base / "ctl.sock")
        ids = sorted(kubelet.devices(RESOURCE))

        empty = _empty_rpc_times(base, args.allocations)
        for _ in range(200):  # warm-up
            kubelet.allocate_raw(RESOURCE, ids[:1])
        rss_before = _rss_kib(agent.pid)
        allocate = []
        for n in range(args.allocations):
            chosen = [ids[n % 8], ids[(n + 1) % 8]]
            t = time.perf_counter()
            kubelet.allocate_raw(RESOURCE, chosen)
            allocate.append(time.perf_counter() - t)
        rss_growth = _rss_kib(agent.pid) - rss_before
        pre_start = []
        for _ in range(2000):
            t = time.perf_counter()
            kubelet.pre_start_raw(RESOURCE, [])
            pre_start.append(time.perf_counter() - t)

        xid = []
        for n in range(args.xids):
            gpu = n % 8
            t = time.perf_counter()
            control.call("inject_xid", gpu=gpu, xid=48)
            kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) < 8, timeout=5, what="Unhealthy")
            xid.append(time.perf_counter() - t)
            kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 8, timeout=5, what="recovered")

        restarts = []
        for _ in range(args.restarts):
            count = kubelet.registrations(RESOURCE)
            t = time.perf_counter()
            kubelet.restart()
            kubelet.wait_for(
                lambda c=count: kubelet.registrations(RESOURCE) > c and kubelet.allocatable(RESOURCE) == 8,
                timeout=10,
                what="re-registered",
            )
            restarts.append(time.perf_counter() - t)
    finally:
        agent.terminate()
        agent.wait(timeout=10)
        kubelet.stop()
        shutil.rmtree(base, ignore_errors=True)

    ratio = statistics.median(allocate) / statistics.median(empty)
    print(f"machine: {os.cpu_count()} cores; simulated dgx-a100 (8 GPUs), agent and empty server as separate processes")
    print(f"{'process start -> all resources registered':<44} {start_seconds * 1000:8.1f} ms{'':32}target < 1500 ms")
    print(_row("empty unary RPC (unix socket, other process)", empty, "-"))
    print(_row("PreStartContainer (a no-op on the agent)", pre_start, "-"))
    print(_row("Allocate round trip (2 GPUs)", allocate, f"p50 <= 1.5x empty (is {ratio:.2f}x)"))
    print(_row("XID injected -> kubelet sees Unhealthy", xid, "p99 < 100 ms"))
    print(_row("kubelet restart -> re-registered", restarts, "p99 < 1000 ms"))
    print(f"{'RSS after start':<44} {rss_after_start / 1024:8.1f} MB{'':32}target < 80 MB")
    print(f"{f'RSS growth over {args.allocations} Allocate calls':<44} {rss_growth / 1024:8.2f} MB{'':32}target < 2 MB")


if __name__ == "__main__":
    main()
