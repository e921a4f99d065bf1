"""The MPS manager's slow safety re-check finds a daemon whose exit no event announced.

A pidfd per daemon (``agent.mps.exits``) reports a daemon's exit the moment it happens. Where the kernel has no
pidfd (before Linux 5.3) nothing announces it: only the re-check, every ``SAFETY_CHECK_INTERVAL`` (30 s) of the
agent's clock, finds the dead daemon, turns its replicas Unhealthy and starts it again. The agent runs in process
on a simulated A100 with the kubelet emulator and the MPS control emulator; its clock is the monotonic clock plus
an offset the test moves, so the 30 s pass at once (the interval itself is a constant, not an option).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.agent import Agent, AgentOptions
from agent.config.effective import FlagOverrides
from agent.config.labels import NodeLabelChanged
from agent.mps.manager import SAFETY_CHECK_INTERVAL
from agent.sim.kubelet import KubeletEmulator

GPU = "nvidia.com/gpu"
NODE = {"name": "mps-recheck", "gpus": [{"model": "A100-SXM4-80GB"}]}
CONFIG = "version: v1\nsharing:\n  mps:\n    resources:\n      - name: nvidia.com/gpu\n        replicas: 2\n"


class MovableClock:
    """``time.monotonic`` plus an offset the test can move forward: everything else keeps real time."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


def wait(predicate, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    pace = threading.Event()
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        pace.wait(0.01)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def node(
    sim_node, mps_bin: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Agent, KubeletEmulator, Path, MovableClock]]:
    monkeypatch.delattr(os, "pidfd_open")  # a kernel without pidfds: no daemon's exit is ever announced
    sim_node(NODE)
    base = Path(tempfile.mkdtemp(prefix="sr", dir="/tmp"))  # short: unix socket and MPS pipe paths are limited
    (base / "config.yaml").write_text(CONFIG)
    kubelet = KubeletEmulator(base / "dp", base / "pr" / "kubelet.sock")
    kubelet.start()
    options = AgentOptions(
        device_plugin_dir=base / "dp",
        pod_resources_socket=base / "pr" / "kubelet.sock",
        config_path=base / "config.yaml",
        mps_control=str(mps_bin / "nvidia-cuda-mps-control"),
        overrides=FlagOverrides(mps_root=str(base / "mps")),
    )
    clock = MovableClock()
    agent = Agent(options, clock=clock)
    thread = threading.Thread(target=agent.run, name="agent-under-test")
    thread.start()
    try:
        assert agent.started.wait(20)
        yield agent, kubelet, base / "mps" / GPU / "pipe", clock
        assert thread.is_alive(), "the agent's reconcile loop ended by itself"
    finally:
        agent.stop()
        thread.join(timeout=20)
        kubelet.stop()
        for pid_file in (base / "mps").glob("**/nvidia-cuda-mps-control.pid"):  # daemons outlive the agent
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
        shutil.rmtree(base, ignore_errors=True)


def _healthy(kubelet: KubeletEmulator) -> set[str]:
    if GPU not in kubelet.resources():
        return set()
    return {i for i, health in kubelet.devices(GPU).items() if health == "Healthy"}


def _turn(agent: Agent) -> None:
    """Have the loop take one turn (an event it ignores, then its tick) and wait until it has."""
    before = agent.heartbeat
    agent.post(NodeLabelChanged("example.com/unrelated", "x"))
    wait(lambda: agent.heartbeat != before, "a turn of the loop")


def test_a_daemon_whose_exit_no_event_announced_is_found_by_the_safety_recheck(node) -> None:
    agent, kubelet, pipe, clock = node
    wait(lambda: len(_healthy(kubelet)) == 2, "the 2 MPS replicas advertised")
    ((key, daemon),) = agent.status.mps.items()
    assert daemon["state"] == "ready" and daemon["restarts"] == 0
    pid = int((pipe / "nvidia-cuda-mps-control.pid").read_text())

    os.kill(pid, signal.SIGKILL)
    wait(lambda: not alive(pid), "the killed daemon reaped")
    _turn(agent)  # nothing announced the exit: the loop turns and still believes in the daemon
    assert agent.status.mps[key]["state"] == "ready" and agent.status.mps[key]["restarts"] == 0
    assert len(_healthy(kubelet)) == 2

    clock.offset += SAFETY_CHECK_INTERVAL  # the re-check is due
    _turn(agent)
    wait(lambda: agent.status.mps[key]["restarts"] == 1, "the re-check to find the dead daemon")
    wait(lambda: agent.status.mps[key]["state"] == "ready", "the daemon started again")
    new_pid = int((pipe / "nvidia-cuda-mps-control.pid").read_text())
    assert new_pid != pid and alive(new_pid)
    wait(lambda: len(_healthy(kubelet)) == 2, "the replicas Healthy again")
