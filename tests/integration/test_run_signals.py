"""``tessera run`` stops at once on SIGTERM, whichever of its threads the kernel hands the signal to.

Python runs signal handlers on the main thread only; a signal delivered to another thread (a gRPC thread) used
to wait until the reconcile loop's sleep ended, up to 30 s. Here the signal is sent to each kind of thread on
purpose (``kill`` with a thread's ID makes the kernel try that thread first). The agent runs as its own
process, simulated dgx-a100 against the kubelet emulator, metrics off (so nothing else wakes its loop).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from agent.sim.kubelet import KubeletEmulator


def _threads(pid: int) -> dict[int, str]:
    threads = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            threads[int(task.name)] = (task / "comm").read_text().strip()
        except OSError:
            continue  # it ended meanwhile
    return threads


@pytest.mark.parametrize("which", ["main", "another"])
def test_sigterm_stops_the_agent_whichever_thread_receives_it(which: str) -> None:
    base = Path(tempfile.mkdtemp(prefix="trs", dir="/tmp"))  # short: unix socket paths are limited
    plugin_dir = base / "dp"
    kubelet = KubeletEmulator(plugin_dir, base / "pr" / "kubelet.sock")
    kubelet.start()
    log = base / "agent.log"
    command = [
        sys.executable, "-m", "agent", "run", "--simulate", "dgx-a100", "--metrics-address", "off",
        "--device-plugin-dir", str(plugin_dir), "--pod-resources-socket", str(base / "pr" / "kubelet.sock"),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TESSERA_", "DP_"))}
    with log.open("w") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    try:
        kubelet.wait_for(lambda: kubelet.allocatable("nvidia.com/gpu") == 8, timeout=30, what="registered")
        others = [tid for tid in _threads(process.pid) if tid != process.pid]
        target = process.pid if which == "main" else others[-1]
        os.kill(target, signal.SIGTERM)  # a thread's ID: the kernel hands the signal to that thread if it can
        assert process.wait(timeout=10) == 0, log.read_text(errors="replace")[-2000:]  # not 30 s later
        assert "stopping signal=SIGTERM" in log.read_text(errors="replace")
        assert not list(plugin_dir.glob("nvidia-*.sock"))
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
        kubelet.stop()
        shutil.rmtree(base, ignore_errors=True)
