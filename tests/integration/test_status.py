"""``tessera status``: the running agent reports what it is doing, from its one published status, over its
metrics port — resources with the reason for every Unhealthy device, the config in force and the last one
rejected, registration, cordons — and the command says clearly when no agent answers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.agent import Agent, AgentOptions
from agent.sim.kubelet import KubeletEmulator
from agent.status_client import StatusUnavailable, fetch_status
from agent.telemetry.service import TelemetrySettings

pytestmark = pytest.mark.timeout(60)
GPU = "nvidia.com/gpu"


def tessera(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent", *args], capture_output=True, text=True, timeout=30, check=False
    )


@pytest.fixture
def running(sim_node) -> Iterator[tuple[Agent, KubeletEmulator, object, Path]]:
    driver = sim_node("dgx-a100")
    base = Path(tempfile.mkdtemp(prefix="st", dir="/tmp"))  # short: unix socket paths are limited
    config = base / "config.yaml"
    config.write_text("version: v1\nsharing:\n  timeSlicing:\n    resources: [{name: nvidia.com/gpu, replicas: 2}]\n")
    kubelet = KubeletEmulator(base / "dp", None)
    kubelet.start()
    settings = TelemetrySettings(hostname="node-1", metrics_address="127.0.0.1:0", interval=5.0, proc_root=base)
    agent = Agent(
        AgentOptions(
            device_plugin_dir=base / "dp", pod_resources_socket=base / "pr.sock", config_path=config, telemetry=settings
        )
    )
    thread = threading.Thread(target=agent.run, name="agent-under-test")
    thread.start()
    try:
        kubelet.wait_for(lambda: kubelet.allocatable(GPU) == 16, timeout=20, what="16 shared GPUs registered")
        kubelet.wait_for(lambda: agent.metrics_port is not None, timeout=20, what="the metrics endpoint")
        yield agent, kubelet, driver, config
    finally:
        agent.stop()
        thread.join(timeout=20)
        kubelet.stop()
        shutil.rmtree(base, ignore_errors=True)


def test_status_reports_resources_config_and_why_a_device_is_unhealthy(running):
    agent, kubelet, driver, _ = running
    address = f"127.0.0.1:{agent.metrics_port}"
    gpu = agent.status.inventory.gpus[4]
    driver.inject_xid(4, 48)
    kubelet.wait_for(lambda: kubelet.allocatable(GPU) == 14, timeout=10, what="GPU 4's replicas Unhealthy")

    document = fetch_status(address)
    assert document["schema"] == "tessera.dev/status/v1"
    assert document["config"]["name"] == "config.yaml" and document["config"]["rejected"] is None
    assert document["kubelet"] == {"present": True, "registered": [GPU]}
    (resource,) = document["resources"]
    assert (resource["name"], resource["devices"], resource["healthy"]) == (GPU, 16, 14)
    assert {d["gpu"] for d in resource["unhealthy"]} == {4}
    assert all(d["reason"].startswith("XID 48") for d in resource["unhealthy"])

    text = tessera("status", "--metrics-address", address)
    assert text.returncode == 0, text.stderr
    assert f"{GPU}" in text.stdout and "14/16 healthy" in text.stdout
    assert "(GPU 4): XID 48" in text.stdout
    assert json.loads(tessera("status", "--metrics-address", address, "--format", "json").stdout) == fetch_status(
        address
    )
    assert gpu.uuid in {g["uuid"] for g in document["gpus"]}


def test_a_rejected_config_is_reported_with_the_one_in_force(running):
    agent, kubelet, _, config = running
    config.write_text("version: v1\nsharing:\n  timeSlicing:\n    resources: [{name: nvidia.com/gpu, replicas: 0}]\n")
    from agent.config.watch import ConfigSourceChanged

    agent.post(ConfigSourceChanged())
    kubelet.wait_for(lambda: agent.status.config_error is not None, timeout=10, what="the config rejected")
    document = fetch_status(f"127.0.0.1:{agent.metrics_port}")
    assert document["config"]["name"] == "config.yaml"
    assert "replicas" in document["config"]["rejected"]


def test_no_agent_is_a_clear_message_not_a_traceback(tmp_path: Path):
    with pytest.raises(StatusUnavailable, match=r"no agent answers on 127\.0\.0\.1:1: "):
        fetch_status("127.0.0.1:1", timeout=2)
    result = tessera("status", "--metrics-address", "127.0.0.1:1")
    assert result.returncode == 1
    assert result.stderr.startswith("tessera: no agent answers") and "kubectl exec" in result.stderr
    assert "Traceback" not in result.stderr
    off = tessera("status", "--metrics-address", "off")
    assert off.returncode == 1 and "metrics off" in off.stderr


def test_something_else_on_the_port_is_named(tmp_path: Path):
    """A port that answers, but not as a Tessera agent (here: a plain HTTP server with no /status)."""
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    server = ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: SimpleHTTPRequestHandler(*a, directory=str(tmp_path)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        with pytest.raises(StatusUnavailable, match="has no /status"):
            fetch_status(f"127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b"not json at all", "something that is not JSON"),
        (b'{"schema": "someone.else/v9"}', "a document Tessera does not know"),
        (b"[1, 2]", "a document Tessera does not know"),
    ],
)
def test_an_answer_that_is_not_a_status_is_named(body: bytes, expected: str):
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(StatusUnavailable, match=expected):
            fetch_status(f"127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
        server.server_close()


def test_an_agent_that_does_not_answer_is_a_timeout_not_a_hang():
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)  # accepts the connection (backlog) and never answers
    try:
        with pytest.raises(StatusUnavailable, match=r"did not answer within 0\.5 s"):
            fetch_status(f"127.0.0.1:{listener.getsockname()[1]}", timeout=0.5)
    finally:
        listener.close()
