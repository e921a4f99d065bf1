"""``tessera status``: the running agent reports what it is doing, from its one published status, over its status
socket (a unix socket of the node, mode 0600; never the metrics port, which the cluster reaches) — resources with the
reason for every Unhealthy device, the config in force and the last one rejected, registration, cordons — and the
command says clearly when no agent answers."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.agent import Agent, AgentOptions
from agent.sim.kubelet import KubeletEmulator
from agent.status_client import StatusUnavailable, fetch_status
from agent.telemetry.service import TelemetrySettings

pytestmark = pytest.mark.timeout(60)
GPU = "nvidia.com/gpu"


def tessera(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")} | env
    return subprocess.run(
        [sys.executable, "-m", "agent", *args], capture_output=True, text=True, timeout=30, env=environ, check=False
    )


def status_socket(agent: Agent) -> str:
    assert agent._telemetry is not None and agent._telemetry.settings.status_socket is not None
    return str(agent._telemetry.settings.status_socket)


@pytest.fixture
def running(sim_node) -> Iterator[tuple[Agent, KubeletEmulator, object, Path]]:
    driver = sim_node("dgx-a100")
    base = Path(tempfile.mkdtemp(prefix="st", dir="/tmp"))  # short: unix socket paths are limited
    config = base / "config.yaml"
    config.write_text("version: v1\nsharing:\n  timeSlicing:\n    resources: [{name: nvidia.com/gpu, replicas: 2}]\n")
    kubelet = KubeletEmulator(base / "dp", None)
    kubelet.start()
    settings = TelemetrySettings(
        hostname="node-1", metrics_address="127.0.0.1:0", interval=5.0, proc_root=base,
        status_socket=base / "run" / "status.sock",  # a directory the agent creates, as in an empty emptyDir
    )  # fmt: skip
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
    address = status_socket(agent)
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

    text = tessera("status", "--status-socket", address)
    assert text.returncode == 0, text.stderr
    assert f"{GPU}" in text.stdout and "14/16 healthy" in text.stdout
    assert "(GPU 4): XID 48" in text.stdout
    # the environment twin, as in the agent's container (kubectl exec inherits the DaemonSet's variables)
    as_json = tessera("status", "--format", "json", TESSERA_STATUS_SOCKET=address)
    assert json.loads(as_json.stdout) == fetch_status(address)
    assert gpu.uuid in {g["uuid"] for g in document["gpus"]}


def test_a_rejected_config_is_reported_with_the_one_in_force(running):
    agent, kubelet, _, config = running
    config.write_text("version: v1\nsharing:\n  timeSlicing:\n    resources: [{name: nvidia.com/gpu, replicas: 0}]\n")
    from agent.config.watch import ConfigSourceChanged

    agent.post(ConfigSourceChanged())
    kubelet.wait_for(lambda: agent.status.config_error is not None, timeout=10, what="the config rejected")
    document = fetch_status(status_socket(agent))
    assert document["config"]["name"] == "config.yaml"
    assert "replicas" in document["config"]["rejected"]


def test_status_is_served_to_the_node_only_and_the_metrics_port_says_where_it_went(running):
    agent, _, _, _ = running
    path = Path(status_socket(agent))
    mode = path.stat().st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600  # the agent's user only
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700  # the directory it made for it
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"http://127.0.0.1:{agent.metrics_port}/status", timeout=5)
    assert refused.value.code == 404
    said = refused.value.read().decode()
    assert (
        "/status is not served on the metrics port" in said
        and f"moved to the agent's unix socket on the node, {path}" in said
    )
    with urllib.request.urlopen(f"http://127.0.0.1:{agent.metrics_port}/readyz", timeout=5) as ready:
        assert ready.status == 200  # the probes' paths stay on the metrics port
    with urllib.request.urlopen(f"http://127.0.0.1:{agent.metrics_port}/metrics", timeout=5) as metrics:
        assert b"tessera_" in metrics.read()


def test_the_socket_goes_with_the_agent_and_a_left_one_is_replaced(sim_node):
    """A socket file an agent left (killed, no clean-up) does not stop the next one; a stopped agent removes its own."""
    sim_node("t4x4")
    base = Path(tempfile.mkdtemp(prefix="sl", dir="/tmp"))
    path = base / "status.sock"
    left = socket.socket(socket.AF_UNIX)
    left.bind(str(path))  # bound, never listening, then closed: what a killed agent leaves
    left.close()
    kubelet = KubeletEmulator(base / "dp", None)
    kubelet.start()
    settings = TelemetrySettings(hostname="n", metrics_address="127.0.0.1:0", proc_root=base, status_socket=path)
    agent = Agent(
        AgentOptions(device_plugin_dir=base / "dp", pod_resources_socket=base / "pr.sock", telemetry=settings)
    )
    thread = threading.Thread(target=agent.run, name="agent-under-test")
    thread.start()
    try:
        kubelet.wait_for(lambda: agent.metrics_port is not None, timeout=20, what="the metrics endpoint")
        assert fetch_status(str(path))["schema"] == "tessera.dev/status/v1"
    finally:
        agent.stop()
        thread.join(timeout=20)
        kubelet.stop()
    assert not path.exists()
    shutil.rmtree(base, ignore_errors=True)


def test_a_path_that_is_not_a_socket_costs_status_only(sim_node, caplog):
    sim_node("t4x4")
    base = Path(tempfile.mkdtemp(prefix="sn", dir="/tmp"))
    path = base / "status.sock"
    path.write_text("someone's file\n")
    kubelet = KubeletEmulator(base / "dp", None)
    kubelet.start()
    settings = TelemetrySettings(hostname="n", metrics_address="127.0.0.1:0", proc_root=base, status_socket=path)
    agent = Agent(
        AgentOptions(device_plugin_dir=base / "dp", pod_resources_socket=base / "pr.sock", telemetry=settings)
    )
    thread = threading.Thread(target=agent.run, name="agent-under-test")
    thread.start()
    try:
        kubelet.wait_for(lambda: agent.metrics_port is not None, timeout=20, what="the metrics endpoint")
        with urllib.request.urlopen(f"http://127.0.0.1:{agent.metrics_port}/metrics", timeout=5) as metrics:
            assert metrics.status == 200
    finally:
        agent.stop()
        thread.join(timeout=20)
        kubelet.stop()
    assert path.read_text() == "someone's file\n"  # never removed
    assert any("no /status" in r.getMessage() and "is not a socket" in r.getMessage() for r in caplog.records)
    shutil.rmtree(base, ignore_errors=True)


def test_no_agent_is_a_clear_message_not_a_traceback(tmp_path: Path):
    missing = str(tmp_path / "status.sock")
    with pytest.raises(StatusUnavailable, match=rf"no agent answers on {missing}: "):
        fetch_status(missing, timeout=2)
    result = tessera("status", "--status-socket", missing)
    assert result.returncode == 1
    assert result.stderr.startswith("tessera: no agent answers") and "kubectl exec" in result.stderr
    assert "Traceback" not in result.stderr
    off = tessera("status", "--status-socket", "off")
    assert off.returncode == 2 and "names no socket" in off.stderr


def test_the_metrics_port_is_refused_saying_where_status_went():
    result = tessera("status", "--metrics-address", "127.0.0.1:9479")
    assert result.returncode == 2
    assert "/status is no longer served on the metrics port" in result.stderr
    assert "--status-socket (default /run/tessera-agent/status.sock)" in result.stderr
    # its environment twin, set for `tessera run` in the agent's container, is not an error for `tessera status`
    assert "no longer served" not in tessera("status", TESSERA_METRICS_ADDRESS=":9479").stderr


def _serve_unix(tmp_path: Path, handler: type) -> tuple[str, object]:
    from socketserver import ThreadingMixIn, UnixStreamServer

    class Server(ThreadingMixIn, UnixStreamServer):
        daemon_threads = True

    path = str(tmp_path / "s.sock")
    server = Server(path, handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return path, server


def test_something_else_on_the_socket_is_named(tmp_path: Path):
    """A socket that answers, but not as a Tessera agent (a plain HTTP server with no /status)."""
    from http.server import SimpleHTTPRequestHandler

    class Handler(SimpleHTTPRequestHandler):
        def address_string(self) -> str:
            return "unix"

        def log_message(self, format: str, *args: object) -> None:
            pass

    path, server = _serve_unix(tmp_path, lambda *a: Handler(*a, directory=str(tmp_path)))
    try:
        with pytest.raises(StatusUnavailable, match="has no /status"):
            fetch_status(path)
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
def test_an_answer_that_is_not_a_status_is_named(tmp_path: Path, body: bytes, expected: str):
    from http.server import BaseHTTPRequestHandler

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def address_string(self) -> str:
            return "unix"

        def log_message(self, format: str, *args: object) -> None:
            pass

    path, server = _serve_unix(tmp_path, Handler)
    try:
        with pytest.raises(StatusUnavailable, match=expected):
            fetch_status(path)
    finally:
        server.shutdown()
        server.server_close()


def test_an_agent_that_does_not_answer_is_a_timeout_not_a_hang(tmp_path: Path):
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(tmp_path / "s.sock"))
    listener.listen(1)  # accepts the connection (backlog) and never answers
    try:
        with pytest.raises(StatusUnavailable, match=r"did not answer within 0\.5 s"):
            fetch_status(str(tmp_path / "s.sock"), timeout=0.5)
    finally:
        listener.close()


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], Path("/run/tessera-agent/status.sock")),
        (["--status-socket", "/var/run/t/s.sock"], Path("/var/run/t/s.sock")),
        (["--status-socket", "off"], None),
        (["--metrics-address", "off"], "no telemetry"),
    ],
)
def test_tessera_run_serves_status_where_its_flag_says(flags: list[str], expected: object):
    from agent.cli import _parser
    from agent.run import build_options

    options = build_options(_parser().parse_args(["run", *flags]), {})
    if expected == "no telemetry":
        assert options.telemetry is None  # metrics off: no collection, so no status either (docs/metrics.md)
    else:
        assert options.telemetry is not None and options.telemetry.status_socket == expected


@pytest.mark.parametrize("path", ["relative/status.sock", "/tmp/" + "x" * 120 + "/status.sock"])
def test_a_status_socket_linux_cannot_bind_is_refused_at_start(path: str):
    from agent.cli import _parser
    from agent.run import OptionsError, build_options

    with pytest.raises(OptionsError, match="--status-socket: "):
        build_options(_parser().parse_args(["run", "--status-socket", path]), {})
