"""Scenario 1: the kubelet restarts N times in a row while pods are being created.

Every resource registers again each time; no thread leaks in the test process, no file descriptor leaks
in the agent, no stray sockets in the device-plugin directory.
"""

from __future__ import annotations

import signal
import threading
import time

import pytest

from .conftest import fd_count, poll, summary_ms
from .nodes import SMALL_NODE, SMALL_RESOURCES

GPU = "nvidia.com/gpu"


@pytest.mark.parametrize("restarts", [pytest.param(20, id="ci"), pytest.param(100, id="long", marks=pytest.mark.long)])
def test_kubelet_restarts_reregister_everything_without_leaks(make_node, figures, restarts: int) -> None:
    node = make_node(SMALL_NODE, None, "--mig-strategy", "mixed")
    kubelet = node.kubelet
    node.wait_registered(SMALL_RESOURCES)
    pid = node.process.pid
    fds_before = fd_count(pid)
    threads_before = threading.active_count()

    stop = threading.Event()
    load = {"created": 0, "refused": 0}

    def create_pods() -> None:  # load held: one pod created and deleted after another
        i = 0
        while not stop.is_set():
            name = f"load-{i}"
            try:
                kubelet.create_pod(name, {"main": {GPU: 1}})
                load["created"] += 1
                kubelet.delete_pod(name)
            except Exception:  # the kubelet is down or the resource not yet back: a refusal, not a loss
                load["refused"] += 1
            i += 1
            stop.wait(0.01)

    loader = threading.Thread(target=create_pods, name="pod-load", daemon=True)
    loader.start()
    times = []
    try:
        for n in range(restarts):
            counts = {r: kubelet.registrations(r) for r in SMALL_RESOURCES}
            started = time.monotonic()
            kubelet.restart()
            kubelet.wait_for(
                lambda: all(
                    kubelet.registrations(r) > counts[r] and kubelet.allocatable(r) == c  # noqa: B023
                    for r, c in SMALL_RESOURCES.items()
                ),
                timeout=20,
                what=f"every resource re-registered after restart {n + 1}",
            )
            times.append(time.monotonic() - started)
    finally:
        stop.set()
        loader.join(10)
    assert not loader.is_alive()
    assert load["created"] > 0

    # settle, then count: the agent's descriptors, our threads, the sockets on disk
    poll(lambda: fd_count(pid) <= fds_before + 4, 10, f"agent fds back near {fds_before}")
    poll(lambda: threading.active_count() <= threads_before + 2, 10, f"test threads back near {threads_before}")
    fds_after = fd_count(pid)
    sockets = sorted(p.name for p in node.plugin_dir.iterdir() if p.is_socket())
    assert sockets == ["kubelet.sock", "nvidia-gpu.sock", "nvidia-mig-1g.10gb.sock", "nvidia-mig-3g.40gb.sock"]
    assert node.process.poll() is None

    figures.update(
        restarts=restarts,
        reregistration=summary_ms(times),
        pods_created=load["created"],
        pod_creations_refused_while_down=load["refused"],
        agent_fds_before=fds_before,
        agent_fds_after=fds_after,
        test_threads_before=threads_before,
        test_threads_after=threading.active_count(),
    )

    node.process.send_signal(signal.SIGTERM)
    assert node.process.wait(timeout=15) == 0
    assert not list(node.plugin_dir.glob("nvidia-*.sock"))
