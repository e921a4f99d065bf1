"""MPS end to end: the agent as a process, the kubelet emulator, and the MPS control emulator on PATH.

An MPS config starts a daemon with the right environment, sets compute mode, applies the limits before
the resource is registered, and Allocate hands out the pipe directory, mounts and limits. A killed daemon
turns the devices Unhealthy and comes back; a restarted agent adopts the daemon; a removed resource
quits it (once its clients are gone) and restores the compute mode.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.sim.kubelet import AdmissionError, KubeletEmulator
from agent.sim.nvml.control import SimControlClient

RESOURCE = "nvidia.com/gpu"
NODE = "name: mps-node\ngpus:\n  - model: A100-SXM4-80GB\n    count: 2\n"
MPS_CONFIG = textwrap.dedent(
    """
    version: v1
    sharing:
      mps:
        resources:
          - name: nvidia.com/gpu
            replicas: 4
            memoryLimit: 10Gi
            activeThreadPercentage: 25
    """
)


@dataclass
class World:
    base: Path
    kubelet: KubeletEmulator
    config: Path
    env: dict[str, str]
    processes: list[subprocess.Popen[bytes]]

    @property
    def pipe(self) -> Path:
        return self.base / "mps" / RESOURCE / "pipe"

    def start_agent(self) -> subprocess.Popen[bytes]:
        command = [
            sys.executable, "-m", "agent", "run", "--simulate", str(self.base / "node.yaml"),
            "--sim-control", str(self.base / "ctl.sock"), "--device-plugin-dir", str(self.base / "dp"),
            "--config", str(self.config), "--mps-root", str(self.base / "mps"),
            "--pod-resources-socket", str(self.base / "pr.sock"),
        ]  # fmt: skip
        log = (self.base / f"agent{len(self.processes)}.log").open("w")
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        self.processes.append(process)
        return process

    def log(self) -> str:
        return "".join(p.read_text() for p in sorted(self.base.glob("agent*.log")))

    def client(self, *commands: str) -> list[str]:
        """Ask the daemon, as an operator would, through the control binary's client mode."""
        result = subprocess.run(
            ["nvidia-cuda-mps-control"],
            input="".join(f"{c}\n" for c in commands),
            capture_output=True,
            text=True,
            env={**self.env, "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe)},
            timeout=10,
            check=True,
        )
        return result.stdout.split()

    def daemon_pid(self) -> int | None:
        try:
            pid = int((self.pipe / "nvidia-cuda-mps-control.pid").read_text())
            os.kill(pid, 0)
        except (OSError, ValueError):
            return None
        return pid


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def world(mps_bin: Path) -> Iterator[World]:
    base = Path(tempfile.mkdtemp(prefix="p", dir="/tmp"))
    (base / "node.yaml").write_text(NODE)
    config = base / "config.yaml"
    config.write_text(MPS_CONFIG)
    kubelet = KubeletEmulator(base / "dp", base / "pr.sock")
    kubelet.start()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TESSERA_", "DP_", "MPS_", "CUDA_"))}
    env["PATH"] = f"{mps_bin}{os.pathsep}{env.get('PATH', '')}"
    world = World(base, kubelet, config, env, [])
    yield world
    for process in world.processes:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
    pid = world.daemon_pid()
    if pid:
        os.kill(pid, signal.SIGKILL)
    kubelet.stop()
    shutil.rmtree(base, ignore_errors=True)


def _registered(world: World, devices: int = 8) -> None:
    kubelet = world.kubelet
    kubelet.wait_for(
        lambda: RESOURCE in kubelet.resources() and kubelet.allocatable(RESOURCE) == devices, 30, "MPS resource"
    )


def test_mps_daemon_limits_allocate_crash_adoption_and_removal(world: World) -> None:
    kubelet = world.kubelet
    agent = world.start_agent()
    _registered(world)
    control = SimControlClient(world.base / "ctl.sock")

    # the daemon: its environment, the compute mode, the limits — all before the resource was registered
    pid = world.daemon_pid()
    assert pid is not None
    environ = dict(
        entry.split("=", 1) for entry in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in entry
    )
    gpus = sorted({device.split("::")[0] for device in kubelet.devices(RESOURCE)})
    assert environ["CUDA_MPS_PIPE_DIRECTORY"] == str(world.pipe)
    assert sorted(environ["CUDA_VISIBLE_DEVICES"].split(",")) == gpus
    assert all(control.call("compute_mode", uuid=uuid) == 3 for uuid in gpus)  # EXCLUSIVE_PROCESS
    assert world.client("get_default_active_thread_percentage") == ["25.0"]
    control_log = (world.base / "mps" / RESOURCE / "log" / "control.log").read_text()
    assert "Cmd:set_default_active_thread_percentage 25" in control_log
    for uuid in gpus:
        assert f"Cmd:set_default_device_pinned_mem_limit {uuid} 10240M" in control_log
    log = world.log()
    assert log.index("MPS daemon ready") < log.index(f"registered resource={RESOURCE}")
    assert all("::" in device for device in kubelet.devices(RESOURCE))

    # Allocate: pipe directory, mounts, the client's own limits; more than one replica is refused
    pod = kubelet.create_pod("mps-client", {"main": {RESOURCE: 1}})
    response = pod.containers["main"][RESOURCE].response
    (replica,) = pod.containers["main"][RESOURCE].device_ids
    assert response.envs["CUDA_MPS_PIPE_DIRECTORY"] == f"/mps/{RESOURCE}/pipe"
    assert response.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert response.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{replica.split('::')[0]}=10240M"
    assert response.envs["NVIDIA_VISIBLE_DEVICES"] == replica.split("::")[0]
    mounts = {m.container_path: (m.host_path, m.read_only) for m in response.mounts}
    assert mounts[f"/mps/{RESOURCE}/pipe"] == (str(world.pipe), False)
    assert mounts["/dev/shm"] == (str(world.base / "mps" / "shm"), False)
    with pytest.raises(AdmissionError, match="maximum request size for shared resources is 1; found 2"):
        kubelet.create_pod("greedy", {"main": {RESOURCE: 2}})

    # the daemon dies: devices Unhealthy, restarted, limits applied again, Healthy
    os.kill(pid, signal.SIGKILL)
    kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 0, 5, "devices Unhealthy after the daemon died")
    _registered(world)
    new_pid = world.daemon_pid()
    assert new_pid not in (None, pid)
    assert world.client("get_default_active_thread_percentage") == ["25.0"]

    # the agent restarts: the daemon is adopted, not restarted
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(timeout=15) == 0
    assert world.daemon_pid() == new_pid
    world.start_agent()
    _wait(lambda: "adopted=True" in world.log(), 30, "the daemon adopted")
    _registered(world)
    assert world.daemon_pid() == new_pid

    # the resource goes away: the daemon waits for its client, then quits and the compute mode is DEFAULT again
    world.config.write_text("version: v1\n")
    _wait(lambda: "MPS daemon change waits for its clients" in world.log(), 10, "the daemon to wait for its client")
    assert "held by default/mps-client" in world.log()
    assert world.daemon_pid() == new_pid, "the daemon was quit under its client"
    kubelet.delete_pod("mps-client")
    _wait(lambda: world.daemon_pid() is None, 10, "the daemon to quit")
    kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == 2, 10, "dedicated GPUs again")
    _wait(lambda: all(control.call("compute_mode", uuid=uuid) == 0 for uuid in gpus), 10, "DEFAULT compute mode")


def test_a_missing_control_binary_is_reported_and_nothing_is_advertised(world: World) -> None:
    world.env["PATH"] = "/usr/bin:/bin"  # no nvidia-cuda-mps-control anywhere
    world.start_agent()
    _wait(lambda: "nvidia-cuda-mps-control not found" in world.log(), 20, "the error")
    assert RESOURCE not in world.kubelet.resources()
    assert world.log().count("nvidia-cuda-mps-control not found") <= 2  # said once per streak, not in a loop


def test_mps_on_mig_devices_runs_one_daemon_per_mig_device(world: World) -> None:
    """NVIDIA's plugin refuses MPS on MIG; the hardware allows it with one daemon per MIG device."""
    (world.base / "node.yaml").write_text(
        "name: mps-mig\ngpus:\n  - model: A100-SXM4-80GB\n    mig:\n      instances: [1g.10gb, 1g.10gb]\n"
    )
    world.config.write_text(
        "version: v1\nflags: {migStrategy: mixed}\n"
        "sharing:\n  mps:\n    resources:\n      - name: nvidia.com/mig-1g.10gb\n        replicas: 2\n"
    )
    world.start_agent()
    kubelet = world.kubelet
    resource = "nvidia.com/mig-1g.10gb"
    kubelet.wait_for(lambda: resource in kubelet.resources() and kubelet.allocatable(resource) == 4, 30, "MIG MPS")
    migs = sorted({device.split("::")[0] for device in kubelet.devices(resource)})
    daemons = sorted((world.base / "mps" / resource).glob("mig-*/pipe/nvidia-cuda-mps-control.pid"))
    assert len(daemons) == 2
    visible = set()
    for pid_file in daemons:
        environ = Path(f"/proc/{int(pid_file.read_text())}/environ").read_text().split("\0")
        visible |= {e.split("=", 1)[1] for e in environ if e.startswith("CUDA_VISIBLE_DEVICES=")}
    assert sorted(visible) == migs  # each daemon sees exactly its own MIG device
    pod = kubelet.create_pod("mig-client", {"main": {resource: 1}})
    envs = pod.containers["main"][resource].response.envs
    assert envs["CUDA_MPS_PIPE_DIRECTORY"].startswith(f"/mps/{resource}/mig-0-")
    assert envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    for pid_file in daemons:  # the fixture kills one daemon; make sure neither outlives the test
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
