"""Metrics come second at start: they start once the kubelet watches every resource, so importing and
starting them never delays the kubelet's first ListAndWatch; a kubelet that accepts Register but never
watches does not keep them off (they start after ``TELEMETRY_WAIT_SECONDS``)."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from agent.agent import TELEMETRY_WAIT_SECONDS, Agent, AgentOptions
from agent.api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from agent.sim.kubelet import KubeletEmulator
from agent.telemetry.service import TelemetrySettings


class _SilentKubelet(api_pb2_grpc.RegistrationServicer):
    """Accepts every Register and never dials the plugin back: no ListAndWatch is ever opened."""

    def __init__(self) -> None:
        self.registered = threading.Event()

    def Register(self, request: api_pb2.RegisterRequest, context: grpc.ServicerContext) -> api_pb2.Empty:
        self.registered.set()
        return api_pb2.Empty()


@contextmanager
def silent_kubelet(plugin_dir: Path) -> Iterator[_SilentKubelet]:
    servicer = _SilentKubelet()
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    api_pb2_grpc.add_RegistrationServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix://{plugin_dir / 'kubelet.sock'}")
    server.start()
    try:
        yield servicer
    finally:
        server.stop(0).wait()


@contextmanager
def agent_with_metrics(base: Path) -> Iterator[Agent]:
    settings = TelemetrySettings(hostname="node-1", metrics_address="127.0.0.1:0", interval=5.0, proc_root=base)
    agent = Agent(
        AgentOptions(device_plugin_dir=base / "dp", pod_resources_socket=base / "pr.sock", telemetry=settings)
    )
    thread = threading.Thread(target=agent.run, name="agent-under-test")
    thread.start()
    try:
        yield agent
    finally:
        agent.stop()
        thread.join(timeout=20)
        assert not thread.is_alive()


def wait_until(predicate, timeout: float, what: str) -> float:
    """Seconds it took; fails after ``timeout`` naming ``what`` (polls every 5 ms)."""
    began = time.monotonic()
    pace = threading.Event()
    while not predicate():
        if time.monotonic() - began > timeout:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        pace.wait(0.005)
    return time.monotonic() - began


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ms", dir="/tmp"))  # short: unix socket paths are limited
    (path / "dp").mkdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_metrics_start_once_the_kubelet_watches(sim_node, base: Path):
    sim_node("dgx-a100")
    kubelet = KubeletEmulator(base / "dp", None)
    kubelet.start()
    try:
        with agent_with_metrics(base) as agent:
            wait_until(lambda: kubelet.allocatable("nvidia.com/gpu") == 8, 20, "the kubelet to hold 8 GPUs")
            seconds = wait_until(lambda: agent.metrics_port is not None, 20, "the metrics endpoint")
            assert seconds < TELEMETRY_WAIT_SECONDS  # on the kubelet's watch, not on the fallback deadline
    finally:
        kubelet.stop()


def test_metrics_start_when_the_kubelet_registers_but_never_watches(sim_node, base: Path):
    sim_node("dgx-a100")
    with silent_kubelet(base / "dp") as kubelet, agent_with_metrics(base) as agent:
        assert kubelet.registered.wait(20)
        wait_until(lambda: agent.metrics_port is not None, TELEMETRY_WAIT_SECONDS + 10, "the metrics endpoint")
        assert agent.status.registered == {"nvidia.com/gpu"}


def metrics_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name in ("metrics-start", "metrics-http", "telemetry")]


def test_an_agent_stopped_while_its_metrics_load_never_starts_them(sim_node, base: Path):
    """Metrics load on a thread of their own, so the reconcile loop stays free for an XID or a SIGTERM right
    after the node is served. No thread of theirs outlives the agent, whether they had started when it stopped
    or were still loading: a load that finishes after the stop does not start them."""
    sim_node("dgx-a100")
    kubelet = KubeletEmulator(base / "dp", None)
    kubelet.start()
    try:
        for _ in range(3):
            with agent_with_metrics(base) as agent:
                assert agent.served.wait(20)  # the metrics start now; the agent stops at once
            wait_until(lambda: not metrics_threads(), 10, "no thread of the metrics left")
        agent._start_telemetry()  # what the metrics-start thread does when its load ends after the stop
        assert not metrics_threads()
    finally:
        kubelet.stop()
