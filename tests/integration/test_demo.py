"""`tessera demo` — the README's main command — runs end to end and tells a newcomer what happened."""

from __future__ import annotations

import os
import subprocess
import sys


def test_demo_runs_end_to_end() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    result = subprocess.run(
        [sys.executable, "-m", "agent", "demo"], capture_output=True, text=True, timeout=120, env=env, check=False
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "The agent registered 5 resources with the kubelet" in out
    for resource in ("nvidia.com/gpu ", "nvidia.com/gpu.shared", "nvidia.com/mig-1g.10gb", "nvidia.com/mig-3g.40gb"):
        assert resource in out
    assert "pod trainer    nvidia.com/gpu × 1 -> NVIDIA_VISIBLE_DEVICES=GPU-" in out
    shared = [line.split("=")[-1] for line in out.splitlines() if "nvidia.com/gpu.shared × 1 ->" in line]
    assert len(shared) == 2 and shared[0] == shared[1]  # two pods time-slice one GPU
    assert "nvidia.com/gpu × 8 -> Pending: 0/1 nodes are available: 1 Insufficient nvidia.com/gpu." in out
    assert "the kubelet saw its devices Unhealthy" in out
    assert "Healthy again after" in out
    assert "5 resources registered again" in out
    assert "plugin sockets left behind: none" in out
    assert "Traceback" not in result.stderr
