"""``tessera run`` with metrics on never loads prometheus_client (issue 13, "RSS after start < 45 MB").

The agent writes the Prometheus text format itself (agent/telemetry/exposition.py); prometheus_client is a
test dependency only. The agent runs as its own process, simulated dgx-a100 against the kubelet emulator, is
scraped once and stopped; the process then says which modules it loaded (the same ``main`` as ``tessera``,
called with the command line as arguments so that it returns instead of ending the process at once).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from agent.sim.kubelet import KubeletEmulator

AGENT = """
import json, sys
from agent.cli import main
code = main(sys.argv[2:])
with open(sys.argv[1], "w") as out:
    json.dump(sorted(sys.modules), out)
sys.exit(code)
"""


def _metrics_port(log: Path, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(r"serving metrics port=(\d+)", log.read_text(errors="replace"))
        if found:
            return int(found.group(1))
        time.sleep(0.05)
    raise TimeoutError(f"metrics never served: {log.read_text(errors='replace')[-2000:]}")


def test_a_running_agent_scraped_once_has_not_loaded_prometheus_client() -> None:
    base = Path(tempfile.mkdtemp(prefix="tmi", dir="/tmp"))  # short: unix socket paths are limited
    plugin_dir = base / "dp"
    kubelet = KubeletEmulator(plugin_dir, base / "pr" / "kubelet.sock")
    kubelet.start()
    modules, log = base / "modules.json", base / "agent.log"
    command = [
        sys.executable, "-c", AGENT, str(modules), "run", "--simulate", "dgx-a100",
        "--metrics-address", "127.0.0.1:0", "--device-plugin-dir", str(plugin_dir),
        "--pod-resources-socket", str(base / "pr" / "kubelet.sock"), "--log-level", "info",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TESSERA_", "DP_"))}
    with log.open("w") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    try:
        kubelet.wait_for(lambda: kubelet.allocatable("nvidia.com/gpu") == 8, timeout=30, what="registered")
        port = _metrics_port(log, 30)
        deadline = time.monotonic() + 30
        while b"tessera_gpu_up{" not in (body := _scrape(port)):  # the first collection
            assert time.monotonic() < deadline, body[:500]
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0, log.read_text(errors="replace")[-2000:]
        loaded = set(json.loads(modules.read_text()))
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
        kubelet.stop()
        shutil.rmtree(base, ignore_errors=True)
    assert {"agent.agent", "agent.telemetry.collector", "agent.telemetry.server", "agent.telemetry.serving"} <= loaded
    assert not {"http.server", "html", "mimetypes"} & loaded  # the endpoints read their requests themselves
    assert not [m for m in loaded if m == "prometheus_client" or m.startswith("prometheus_client.")]
    assert not {"agent.core.memlimits", "agent.memlimits.manager"} & loaded  # whole GPUs: nothing is sized


def _scrape(port: int) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read()
