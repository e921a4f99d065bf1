"""A metrics start that fails in a way nobody foresaw (unit: the Telemetry class is replaced by one that raises,
the only way to reach that branch; the integration tests in test_metrics_start.py run the real one)."""

from __future__ import annotations

from pathlib import Path

from agent.agent import Agent, AgentOptions
from agent.telemetry.service import TelemetrySettings


def test_a_metrics_start_that_fails_unforeseen_comes_back_to_the_loop(tmp_path: Path, monkeypatch):
    """Metrics start on their own thread: an exception nobody foresaw there is not lost with the thread, it
    reaches the reconcile loop as WorkerCrashed (counted and logged there like the loop's own errors)."""
    from agent import agent as agent_module
    from agent.supervise import WorkerCrashed

    class Broken:
        def __init__(self, *args, **kwargs) -> None:
            raise RuntimeError("a bug in the metrics")

    monkeypatch.setattr(agent_module, "Telemetry", Broken)  # the only stand-in: what metrics raise
    settings = TelemetrySettings(hostname="node-1", metrics_address="127.0.0.1:0", interval=5.0, proc_root=tmp_path)
    agent = Agent(
        AgentOptions(device_plugin_dir=tmp_path / "dp", pod_resources_socket=tmp_path / "pr.sock", telemetry=settings)
    )
    agent._start_telemetry()  # what the metrics-start thread runs
    posted = agent._events.get_nowait()
    assert isinstance(posted, WorkerCrashed) and posted.owner == "metrics"
    assert posted.error == "RuntimeError: a bug in the metrics" and agent.metrics_port is None
