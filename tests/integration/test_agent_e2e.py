"""End to end: ``tessera run --simulate`` as a real process, the kubelet emulator over real unix sockets.

The agent process holds the simulated driver; the test acts on it through the simulation control socket
(an XID, a lost GPU) and watches what the kubelet sees.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from agent.sim.kubelet import AdmissionError, KubeletEmulator
from agent.sim.nvml.control import SimControlClient

NODE = textwrap.dedent(
    """
    name: e2e-node
    nvlink: nvswitch
    numa_nodes: 2
    gpus:
      - model: A100-SXM4-80GB
        mig:
          instances: [3g.40gb, 1g.10gb, 1g.10gb]
      - model: A100-SXM4-80GB
        count: 3
    """
)


@dataclass
class Running:
    process: subprocess.Popen[str]
    kubelet: KubeletEmulator
    control: SimControlClient
    plugin_dir: Path
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text()


@pytest.fixture
def agent() -> Iterator[Running]:
    base = Path(tempfile.mkdtemp(prefix="e2e", dir="/tmp"))  # unix socket paths must stay short
    plugin_dir = base / "dp"
    kubelet = KubeletEmulator(plugin_dir, base / "pr" / "kubelet.sock", dial_timeout=2.0)
    kubelet.start()
    spec = base / "node.yaml"
    spec.write_text(NODE)
    log_path = base / "agent.log"
    command = [
        sys.executable, "-m", "agent", "run",
        "--simulate", str(spec),
        "--sim-control", str(base / "ctl.sock"),
        "--device-plugin-dir", str(plugin_dir),
        "--mig-strategy", "mixed",
        "--health-recovery-seconds", "0.5",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TESSERA_", "DP_"))}
    with log_path.open("w") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, text=True, env=env)
    running = Running(process, kubelet, SimControlClient(base / "ctl.sock"), plugin_dir, log_path)
    try:
        kubelet.wait_for(
            lambda: {"nvidia.com/gpu", "nvidia.com/mig-1g.10gb", "nvidia.com/mig-3g.40gb"} <= set(kubelet.resources()),
            timeout=20,
            what="the agent's resources registered",
        )
        yield running
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
        kubelet.stop()
        shutil.rmtree(base, ignore_errors=True)


def _gpu_ids(kubelet: KubeletEmulator) -> list[str]:
    return sorted(kubelet.devices("nvidia.com/gpu"))


def test_registers_every_resource_with_its_devices(agent: Running) -> None:
    kubelet = agent.kubelet
    assert kubelet.capacity("nvidia.com/gpu") == 3
    assert kubelet.capacity("nvidia.com/mig-1g.10gb") == 2
    assert kubelet.capacity("nvidia.com/mig-3g.40gb") == 1
    assert all(h == "Healthy" for h in kubelet.devices("nvidia.com/gpu").values())
    assert kubelet.options("nvidia.com/gpu").get_preferred_allocation_available
    assert not kubelet.options("nvidia.com/gpu").pre_start_required
    assert sorted(kubelet.topology("nvidia.com/gpu").values()) == [[0], [1], [1]]
    sockets = sorted(p.name for p in agent.plugin_dir.glob("nvidia-*.sock"))
    assert sockets == ["nvidia-gpu.sock", "nvidia-mig-1g.10gb.sock", "nvidia-mig-3g.40gb.sock"]
    assert all((agent.plugin_dir / s).stat().st_mode & 0o077 == 0 for s in sockets)


def test_pods_get_their_devices_and_bad_requests_change_nothing(agent: Running) -> None:
    kubelet = agent.kubelet
    pod = kubelet.create_pod("train", {"main": {"nvidia.com/gpu": 2}})
    allocation = pod.containers["main"]["nvidia.com/gpu"]
    assert len(allocation.device_ids) == 2
    assert allocation.response.envs["NVIDIA_VISIBLE_DEVICES"].split(",") == allocation.device_ids
    mig = kubelet.create_pod("nb", {"main": {"nvidia.com/mig-1g.10gb": 1}})
    (mig_id,) = mig.containers["main"]["nvidia.com/mig-1g.10gb"].device_ids
    assert mig_id.startswith("MIG-")

    for bad in (["GPU-does-not-exist"], [], [allocation.device_ids[0], allocation.device_ids[0]]):
        with pytest.raises(grpc.RpcError) as refused:
            kubelet.allocate_raw("nvidia.com/gpu", bad)
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details()
    assert kubelet.allocatable("nvidia.com/gpu") == 3  # nothing changed on the agent's side

    with pytest.raises(AdmissionError, match="Requested: 2, Available: 1"):
        kubelet.create_pod("greedy", {"main": {"nvidia.com/gpu": 2}})


def test_xid_makes_a_gpu_unhealthy_and_it_recovers(agent: Running) -> None:
    kubelet = agent.kubelet
    before = _gpu_ids(kubelet)
    agent.control.call("inject_xid", gpu=2, xid=48)
    kubelet.wait_for(lambda: kubelet.allocatable("nvidia.com/gpu") == 2, timeout=5, what="one GPU Unhealthy")
    unhealthy = [i for i, h in kubelet.devices("nvidia.com/gpu").items() if h == "Unhealthy"]
    assert len(unhealthy) == 1
    kubelet.wait_for(lambda: kubelet.allocatable("nvidia.com/gpu") == 3, timeout=10, what="the GPU recovered")
    assert _gpu_ids(kubelet) == before
    assert "critical XID" in agent.log() and "recovered" in agent.log()


def test_ignored_xid_changes_nothing_and_mig_xid_hits_one_device(agent: Running) -> None:
    kubelet = agent.kubelet
    agent.control.call("inject_xid", gpu=1, xid=13)  # RESTART_APP in NVIDIA's catalog: the device stays Healthy
    mig_ids = sorted(kubelet.devices("nvidia.com/mig-1g.10gb"))
    agent.control.call("inject_xid", gpu=0, xid=48, mig_uuid=mig_ids[0])
    kubelet.wait_for(
        lambda: kubelet.devices("nvidia.com/mig-1g.10gb")[mig_ids[0]] == "Unhealthy", timeout=5, what="MIG device down"
    )
    assert kubelet.devices("nvidia.com/mig-1g.10gb")[mig_ids[1]] == "Healthy"
    assert kubelet.allocatable("nvidia.com/mig-3g.40gb") == 1
    assert kubelet.allocatable("nvidia.com/gpu") == 3
    assert "application XID" in agent.log() and "xid=13" in agent.log()


def test_lost_gpu_goes_unhealthy_the_rest_keep_serving(agent: Running) -> None:
    kubelet = agent.kubelet
    agent.control.call("lose_gpu", gpu=3)
    kubelet.wait_for(lambda: kubelet.allocatable("nvidia.com/gpu") == 2, timeout=5, what="lost GPU Unhealthy")
    pod = kubelet.create_pod("after-loss", {"main": {"nvidia.com/gpu": 2}})
    assert len(pod.containers["main"]["nvidia.com/gpu"].device_ids) == 2
    agent.control.call("recover_gpu", gpu=3)
    kubelet.wait_for(lambda: kubelet.allocatable("nvidia.com/gpu") == 3, timeout=10, what="found GPU Healthy")


def test_kubelet_restart_reregisters_every_resource(agent: Running) -> None:
    kubelet = agent.kubelet
    resources = kubelet.resources()
    counts = {r: kubelet.registrations(r) for r in resources}
    kubelet.restart()
    kubelet.wait_for(
        lambda: all(kubelet.registrations(r) > counts[r] and kubelet.allocatable(r) > 0 for r in resources),
        timeout=5,
        what="re-registered after the kubelet restart",
    )
    assert kubelet.capacity("nvidia.com/gpu") == 3


def test_deleted_socket_is_served_again(agent: Running) -> None:
    """The same server serves its socket again; the kubelet's stream carries on, so no second Register (a
    kubelet holding two streams for one resource may drop the newer one when the older ends)."""
    kubelet = agent.kubelet
    count = kubelet.registrations("nvidia.com/gpu")
    socket = agent.plugin_dir / "nvidia-gpu.sock"
    inode = socket.stat().st_ino
    socket.unlink()
    kubelet.wait_for(lambda: socket.is_socket(), timeout=5, what="the socket served again")
    assert socket.stat().st_ino == inode  # the same listening socket, under its name again
    assert kubelet.create_pod("again", {"main": {"nvidia.com/gpu": 1}})
    assert kubelet.allocatable("nvidia.com/gpu") == 3 and not kubelet.stopped("nvidia.com/gpu")
    assert kubelet.registrations("nvidia.com/gpu") == count


def test_sigterm_stops_cleanly_and_removes_sockets(agent: Running) -> None:
    agent.process.send_signal(signal.SIGTERM)
    assert agent.process.wait(timeout=10) == 0
    assert not list(agent.plugin_dir.glob("nvidia-*.sock"))
    assert "stopping signal=SIGTERM" in agent.log()
