"""Benchmarks for MPS, with the agent as a process and the MPS control emulator on PATH.

Run: python tests/bench/bench_mps.py

- MPS resource ready (daemon started + limits applied + registered) for 8 GPUs (target < 2 s)
- daemon killed -> devices Healthy again at the kubelet (target < 5 s)
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agent.sim.kubelet import KubeletEmulator

RESOURCE = "nvidia.com/gpu"
CONFIG = "version: v1\nsharing:\n  mps:\n    resources:\n      - name: nvidia.com/gpu\n        replicas: 4\n"
RUNS = 5


def main() -> None:
    base = Path(tempfile.mkdtemp(prefix="bm", dir="/tmp"))
    bin_dir = base / "bin"
    bin_dir.mkdir()
    launcher = bin_dir / "nvidia-cuda-mps-control"
    launcher.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m agent.sim.mps.control "$@"\n')
    launcher.chmod(0o755)
    (base / "config.yaml").write_text(CONFIG)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TESSERA_", "MPS_", "CUDA_"))}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    ready, recovered = [], []
    try:
        for run in range(RUNS):
            root = base / f"m{run}"
            kubelet = KubeletEmulator(base / f"dp{run}")
            kubelet.start()
            command = [
                sys.executable, "-m", "agent", "run", "--simulate", "dgx-a100", "--config", str(base / "config.yaml"),
                "--device-plugin-dir", str(base / f"dp{run}"), "--mps-root", str(root), "--log-level", "warning",
            ]  # fmt: skip
            start = time.perf_counter()
            agent = subprocess.Popen(command, env=env, stderr=subprocess.DEVNULL)
            try:
                kubelet.wait_for(
                    lambda k=kubelet: RESOURCE in k.resources() and k.allocatable(RESOURCE) == 32, 30, "MPS ready"
                )
                ready.append(time.perf_counter() - start)
                pid = int((root / RESOURCE / "pipe" / "nvidia-cuda-mps-control.pid").read_text())
                start = time.perf_counter()
                os.kill(pid, signal.SIGKILL)
                kubelet.wait_for(lambda k=kubelet: k.allocatable(RESOURCE) < 32, 10, "Unhealthy")
                kubelet.wait_for(lambda k=kubelet: k.allocatable(RESOURCE) == 32, 10, "Healthy again")
                recovered.append(time.perf_counter() - start)
            finally:
                agent.terminate()
                agent.wait(timeout=10)
                kubelet.stop()
                pid_file = root / RESOURCE / "pipe" / "nvidia-cuda-mps-control.pid"
                if pid_file.exists():
                    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"machine: {os.cpu_count()} cores; simulated dgx-a100, MPS x4 on 8 GPUs (32 replicas), {RUNS} runs")
    print(
        f"agent start -> MPS daemon up, limits applied, registered  p50 {statistics.median(ready):5.2f} s  "
        f"max {max(ready):5.2f} s   target < 2 s"
    )
    print(
        f"daemon SIGKILLed -> Healthy again at the kubelet           p50 {statistics.median(recovered):5.2f} s  "
        f"max {max(recovered):5.2f} s   target < 5 s"
    )


if __name__ == "__main__":
    main()
