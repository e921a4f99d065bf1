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
import time
from pathlib import Path

import pytest

from agent.plugin.lock import PluginDirLock
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


def _start(base: Path, *more: str) -> tuple[subprocess.Popen[bytes], Path]:
    """``tessera run`` on a simulated dgx-a100 with its device-plugin directory under ``base``; its log file."""
    log = base / "agent.log"
    command = [
        sys.executable, "-m", "agent", "run", "--simulate", "dgx-a100", "--metrics-address", "off",
        "--device-plugin-dir", str(base / "dp"), "--pod-resources-socket", str(base / "pr" / "kubelet.sock"), *more,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TESSERA_", "DP_"))}
    with log.open("w") as log_file:
        return subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env), log


def _wait_for_log(process: subprocess.Popen[bytes], log: Path, text: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text(errors="replace"):
        assert process.poll() is None, log.read_text(errors="replace")[-2000:]
        assert time.monotonic() < deadline, f"no {text!r} in the log:\n{log.read_text(errors='replace')[-2000:]}"
        time.sleep(0.02)


def test_sigterm_while_waiting_for_the_plugin_directory_lock_exits_at_once_with_status_0() -> None:
    """A rolling update: the old agent still holds the directory when the new one starts, and the new one is told
    to stop while it waits (15 s by default): it goes at once, saying so, and successfully."""
    base = Path(tempfile.mkdtemp(prefix="trs", dir="/tmp"))
    (base / "dp").mkdir()
    predecessor = PluginDirLock(base / "dp")
    predecessor.acquire()
    process, log = _start(base)
    try:
        _wait_for_log(process, log, "device-plugin directory is held by another agent; waiting")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=5) == 0, log.read_text(errors="replace")[-2000:]  # not 15 s later, nor 1
        text = log.read_text(errors="replace")
        assert f"stopped while waiting for the device-plugin directory {base / 'dp'}" in text
        assert f"pid {os.getpid()}" in text  # who held it
        assert not list((base / "dp").glob("nvidia-*.sock"))  # it never served the directory it did not hold
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
        predecessor.release()
        shutil.rmtree(base, ignore_errors=True)


def test_a_config_nested_too_deeply_is_refused_by_name_and_the_agent_runs_on() -> None:
    """``tessera run --config`` with 2,000 nested lists: no RecursionError at start; the agent says what is wrong
    with which file, serves what it would serve without a config's sharing (nothing) and stops on SIGTERM."""
    base = Path(tempfile.mkdtemp(prefix="trs", dir="/tmp"))
    (base / "dp").mkdir()
    config = base / "deep.yaml"
    config.write_text("version: v1\nsharing: " + "[" * 2000 + "]" * 2000 + "\n")
    process, log = _start(base, "--config", str(config))
    try:
        _wait_for_log(process, log, "config rejected")
        text = log.read_text(errors="replace")
        assert f"{config}: nested at least" in text and "RecursionError" not in text
        assert process.poll() is None  # running on, not crashed
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0, log.read_text(errors="replace")[-2000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
        shutil.rmtree(base, ignore_errors=True)


def test_sigterm_while_a_mig_change_is_in_the_driver_exits_at_once_with_status_0() -> None:
    """A MIG mode change takes seconds on real hardware (a driver in trouble, far longer): SIGTERM does not wait for
    it. The next agent converges from a fresh inventory."""
    from agent.sim.nvml.control import SimControlClient

    base = Path(tempfile.mkdtemp(prefix="trs", dir="/tmp"))
    kubelet = KubeletEmulator(base / "dp", base / "pr" / "kubelet.sock")  # PodResources: nothing allocated
    kubelet.start()
    config = base / "config.yaml"
    config.write_text("version: v1\n")
    process, log = _start(base, "--config", str(config), "--sim-control", str(base / "ctl.sock"))
    try:
        _wait_for_log(process, log, "registered resource=nvidia.com/gpu")
        SimControlClient(base / "ctl.sock").call("stall", symbol="nvmlDeviceSetMigMode", seconds=60)
        config.write_text(
            "version: v1\nmigLayout:\n  config: one\n  layouts:\n    version: v1\n    mig-configs:\n"
            "      one:\n        - devices: [0]\n          mig-enabled: true\n          mig-devices: {}\n"
        )
        _wait_for_log(process, log, "MIG layout change applying")
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=5) == 0, log.read_text(errors="replace")[-2000:]  # not after the 60 s call
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
        kubelet.stop()
        shutil.rmtree(base, ignore_errors=True)
