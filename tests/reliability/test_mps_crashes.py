"""Scenario 4: the MPS daemon SIGKILLed repeatedly under load.

Each time: the agent starts a new daemon, the limits are applied again (the client query answers 25.0),
and there is never more than one daemon for the resource's pipe directory.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import pytest

from .conftest import mps_daemons, poll, summary_ms
from .nodes import MPS_CONFIG, MPS_NODE, MPS_RESOURCES

GPU = "nvidia.com/gpu"


def _query(node, pipe) -> list[str]:
    result = subprocess.run(
        ["nvidia-cuda-mps-control"],
        input="get_default_active_thread_percentage\n",
        capture_output=True,
        text=True,
        env={**node.env, "CUDA_MPS_PIPE_DIRECTORY": str(pipe)},
        timeout=10,
        check=True,
    )
    return result.stdout.split()


@pytest.mark.parametrize("kills", [pytest.param(5, id="ci"), pytest.param(20, id="long", marks=pytest.mark.long)])
def test_mps_daemon_killed_is_restarted_with_limits_and_never_doubled(make_node, figures, kills: int) -> None:
    node = make_node(MPS_NODE, MPS_CONFIG)
    kubelet = node.kubelet
    node.wait_registered(MPS_RESOURCES)
    pipe = node.mps_root / GPU / "pipe"
    assert _query(node, pipe) == ["25.0"]

    stop = threading.Event()
    load = {"created": 0, "refused": 0}
    most_daemons = [0]

    def create_pods() -> None:
        i = 0
        while not stop.is_set():
            try:
                kubelet.create_pod(f"mps-{i}", {"main": {GPU: 1}})
                load["created"] += 1
                kubelet.delete_pod(f"mps-{i}")
            except Exception:  # devices Unhealthy while the daemon is down: refused, nothing lost
                load["refused"] += 1
            i += 1
            stop.wait(0.02)

    def count_daemons() -> None:
        while not stop.is_set():
            most_daemons[0] = max(most_daemons[0], len(mps_daemons(pipe)))
            stop.wait(0.05)

    threads = [threading.Thread(target=create_pods), threading.Thread(target=count_daemons)]
    for thread in threads:
        thread.start()
    restart_times, pids = [], []
    try:
        for n in range(kills):
            (pid,) = mps_daemons(pipe)
            pids.append(pid)
            started = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            poll(lambda: (d := mps_daemons(pipe)) and d != [pid], 30, f"a new daemon after kill {n + 1}")  # noqa: B023
            node.wait_registered(MPS_RESOURCES)
            restart_times.append(time.monotonic() - started)
            assert _query(node, pipe) == ["25.0"]  # limits applied again
            assert len(mps_daemons(pipe)) == 1
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
    assert most_daemons[0] == 1, f"{most_daemons[0]} daemons seen at once for {pipe}"
    assert len(set(pids)) == kills
    assert node.process.poll() is None
    figures.update(
        kills=kills,
        restart_to_healthy=summary_ms(restart_times),
        most_daemons_at_once=most_daemons[0],
        pods_created=load["created"],
        pod_creations_refused_while_down=load["refused"],
    )
