"""``tessera run`` keeps the garbage collector off while the agent starts, and on again once the kubelet is served.

Nearly everything the start makes lives as long as the process, so collecting while it is made only costs
start time (issue 13). What a user would notice if this went wrong: a slower start (collections during it), or
an agent whose collector never comes back (memory that grows), or a failed start that leaves an embedding
process without one. The agent runs as its own process, simulated dgx-a100 against the kubelet emulator, and
reports what its collector did (the same ``main`` as ``tessera``, called with the command line as arguments so
that it returns instead of ending the process at once).
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agent.cli import EXIT_USAGE, main
from agent.sim.kubelet import KubeletEmulator

AGENT = """
import argparse, gc, json, sys, threading, time, weakref
from agent.cli import main
parsers = []  # every command-line parser made, weakly: what the start leaves in cycles should not outlive it
_init = argparse.ArgumentParser.__init__
def _tracked(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    parsers.append(weakref.ref(self))
argparse.ArgumentParser.__init__ = _tracked
passes = []  # the freeze count at each collection: 0 while nothing of the start is frozen yet
gc.callbacks.append(lambda phase, info: phase == "start" and passes.append(gc.get_freeze_count()))

def report():  # once the collector is off for the start, then on again (before any SIGTERM: the agent's doing)
    deadline = time.monotonic() + 30
    while gc.isenabled() and time.monotonic() < deadline:
        time.sleep(0.001)
    while not gc.isenabled() and time.monotonic() < deadline:
        time.sleep(0.01)
    state = {"enabled": gc.isenabled(), "frozen": gc.get_freeze_count(), "passes": list(passes),
             "parsers_made": len(parsers), "parsers_alive": sum(ref() is not None for ref in parsers)}
    with open(sys.argv[1], "w") as out:
        json.dump(state, out)

threading.Thread(target=report, daemon=True).start()
sys.exit(main(sys.argv[2:]))
"""


def test_the_start_runs_without_collections_and_the_collector_resumes_once_the_kubelet_is_served() -> None:
    result = _run_and_report(AGENT, "off")
    assert result["enabled"]
    assert result["frozen"] > 1000  # the start's modules, classes and values: out of the collector's way
    # Before the freeze: the handful while the command line is parsed, before `run` begins (collecting during
    # the start is ~80 passes).
    assert len([p for p in result["passes"] if p == 0]) <= 20, result["passes"][:30]
    # What the start left in cycles is freed before the freeze, not frozen for the life of the agent: the command
    # line's parser (every command's flags and help) among it.
    assert result["parsers_made"] > 1 and result["parsers_alive"] == 0, result


def test_the_collector_resumes_even_when_metrics_fail_to_start_with_an_unexpected_error() -> None:
    """A bug in the metrics' start (here made one on purpose) must not leave the agent without a collector."""
    broken = AGENT.replace(
        "from agent.cli import main\n",
        "from agent.cli import main\nimport agent.telemetry.service as service\n"
        "def fail(*args, **kwargs): raise RuntimeError('a bug in the metrics start')\n"
        "service.Telemetry.__init__ = fail\n",
    )
    assert broken != AGENT
    assert _run_and_report(broken, "127.0.0.1:0")["enabled"]


def _run_and_report(script: str, metrics: str) -> dict:
    """Run ``tessera run`` on a simulated dgx-a100 under ``script``; what it reported of its collector."""
    base = Path(tempfile.mkdtemp(prefix="trc", dir="/tmp"))  # short: unix socket paths are limited
    plugin_dir = base / "dp"
    kubelet = KubeletEmulator(plugin_dir, base / "pr" / "kubelet.sock")
    kubelet.start()
    report, log = base / "gc.json", base / "agent.log"
    command = [
        sys.executable, "-c", script, str(report), "run", "--simulate", "dgx-a100", "--metrics-address", metrics,
        "--device-plugin-dir", str(plugin_dir), "--pod-resources-socket", str(base / "pr" / "kubelet.sock"),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TESSERA_", "DP_"))}
    with log.open("w") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    try:
        kubelet.wait_for(lambda: kubelet.allocatable("nvidia.com/gpu") == 8, timeout=30, what="registered")
        deadline = time.monotonic() + 30
        while not report.exists() or not report.read_text():
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-2000:]
            assert process.poll() is None, log.read_text(errors="replace")[-2000:]
            time.sleep(0.05)
        result = json.loads(report.read_text())
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0, log.read_text(errors="replace")[-2000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
        kubelet.stop()
        shutil.rmtree(base, ignore_errors=True)
    return result


def test_a_run_that_cannot_start_leaves_the_collector_on() -> None:
    assert gc.isenabled()
    assert main(["run", "--metrics-address", "not an address"]) == EXIT_USAGE
    assert gc.isenabled()
