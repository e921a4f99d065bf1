"""Scenario 6: the agent is SIGKILLed while pods hold devices and started again; SIGTERM stops it cleanly."""

from __future__ import annotations

import os
import signal
import time

import pytest

from .conftest import mps_daemons, poll, summary_ms
from .nodes import DGX_CONFIG, DGX_NODE, DGX_RESOURCES, MPS_CONFIG, MPS_NODE, MPS_RESOURCES

MIG = "nvidia.com/mig-1g.10gb.shared"


@pytest.mark.parametrize("crashes", [pytest.param(2, id="ci"), pytest.param(10, id="long", marks=pytest.mark.long)])
def test_sigkill_then_restart_keeps_ids_allocations_and_mig(make_node, figures, crashes: int) -> None:
    node = make_node(DGX_NODE, DGX_CONFIG)
    kubelet = node.kubelet
    node.wait_registered(DGX_RESOURCES)
    ids = {r: sorted(kubelet.devices(r)) for r in DGX_RESOURCES}
    migs = sorted({d.split("::")[0] for d in ids[MIG]})
    held = {}
    for resource in DGX_RESOURCES:
        pod = kubelet.create_pod(f"hold-{resource.split('/')[1]}", {"main": {resource: 1}})
        held[resource] = pod.containers["main"][resource].device_ids
    restart_times = []
    for n in range(crashes):
        node.process.send_signal(signal.SIGKILL)
        node.process.wait(timeout=10)
        started = time.monotonic()
        node.start_agent()
        counts = {r: kubelet.registrations(r) for r in DGX_RESOURCES}
        kubelet.wait_for(
            lambda: all(kubelet.registrations(r) > counts[r] for r in DGX_RESOURCES),  # noqa: B023
            timeout=30,
            what=f"re-registered after crash {n + 1}",
        )
        node.wait_registered(DGX_RESOURCES)
        restart_times.append(time.monotonic() - started)
        assert {r: sorted(kubelet.devices(r)) for r in DGX_RESOURCES} == ids  # the same device IDs
        for resource, devices in held.items():  # existing allocations still valid: advertised Healthy
            assert all(kubelet.devices(resource)[d] == "Healthy" for d in devices)
            kubelet.allocate_raw(resource, devices)  # and the agent still accepts them
        assert sorted({d.split("::")[0] for d in kubelet.devices(MIG)}) == migs  # no MIG change
    assert "reconfigur" not in node.log().lower()
    figures.update(
        crashes=crashes,
        pods_holding_devices=len(held),
        restart_to_registered=summary_ms(restart_times),
        mig_uuids_unchanged=len(migs),
    )


def test_sigkill_with_mps_adopts_the_daemon(make_node, figures) -> None:
    node = make_node(MPS_NODE, MPS_CONFIG)
    kubelet = node.kubelet
    node.wait_registered(MPS_RESOURCES)
    pipe = node.mps_root / "nvidia.com/gpu" / "pipe"
    (pid,) = mps_daemons(pipe)
    pod = kubelet.create_pod("mps-holder", {"main": {"nvidia.com/gpu": 1}})
    held = pod.containers["main"]["nvidia.com/gpu"].device_ids
    node.process.send_signal(signal.SIGKILL)
    node.process.wait(timeout=10)
    os.kill(pid, 0)  # the daemon outlives the agent
    started = time.monotonic()
    node.start_agent()
    poll(lambda: "adopted=True" in node.log(), 30, "the daemon adopted")
    node.wait_registered(MPS_RESOURCES)
    elapsed = time.monotonic() - started
    assert mps_daemons(pipe) == [pid]
    assert all(kubelet.devices("nvidia.com/gpu")[d] == "Healthy" for d in held)
    figures.update(daemon_pid_kept=pid, restart_to_registered_ms=round(elapsed * 1000, 1))


def test_sigterm_stops_cleanly_and_removes_sockets(make_node, figures) -> None:
    node = make_node(DGX_NODE, DGX_CONFIG)
    node.wait_registered(DGX_RESOURCES)
    started = time.monotonic()
    node.process.send_signal(signal.SIGTERM)
    assert node.process.wait(timeout=15) == 0
    assert not list(node.plugin_dir.glob("nvidia-*.sock"))
    assert not node.control_socket.exists()
    assert "stopping signal=SIGTERM" in node.log()
    figures.update(sigterm_to_exit_ms=round((time.monotonic() - started) * 1000, 1))
