"""``tessera run`` with DRA stops at once on SIGTERM while a Prepare waits for its MPS daemon, and the next agent
prepares the claim.

The claim's worker waits for the daemon to be ready, a state only the reconcile loop delivers — and the loop is the
first thing a SIGTERM stops: the agent used to sit out the whole wait (30 s, past the kubelet's grace period). Here
the agent runs as its own process (simulated dgx-a100, ``POD_UID`` set as in the DRA overlay) against the DRA kubelet
emulator and the API server stand-in; ``nvidia-cuda-mps-control`` is the MPS emulator behind a gate that holds the
first ``-d`` until the test has sent SIGTERM, so the signal arrives while the Prepare waits.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.core.dra.checkpoint import CHECKPOINT_FILE, PREPARE_COMPLETED, decode
from agent.sim.apiserver import ApiServer
from agent.sim.kubelet import DraKubeletEmulator, KubeletEmulator
from agent.sim.kubelet.dra_common import PodStartError
from agent.sim.scheduler import allocate

from .test_dra_e2e import DEADLINE, DRIVER, NODE, end_mps_daemons, poll

OLD_POD, NEW_POD = "3f1c2a4e-5b6d-4e7f-8a9b-0c1d2e3f4a5b", "9e8d7c6b-5a4f-4e3d-8c2b-1a0f9e8d7c6b"
MPS_CONFIG = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig", "sharing": {"strategy": "MPS"}}


@dataclass
class Cluster:
    base: Path
    api: ApiServer
    dra: DraKubeletEmulator
    mps_control: Path  # the MPS emulator behind the gate
    held: Path  # appears when the first `-d` waits at the gate

    def start_agent(self, pod_uid: str, log_name: str) -> tuple[subprocess.Popen[bytes], Path]:
        base = self.base
        log = base / log_name
        command = [
            sys.executable, "-m", "agent", "run", "--simulate", "dgx-a100", "--metrics-address", "off",
            "--device-plugin-dir", str(base / "dp"), "--pod-resources-socket", str(base / "pr" / "kubelet.sock"),
            "--config", str(base / "config.yaml"), "--node-name", NODE,
            "--kubeconfig", str(self.api.write_kubeconfig(base / "kubeconfig")),
            "--dra-registry-dir", str(base / "registry"), "--dra-plugins-dir", str(base / "plugins"),
            "--cdi-root", str(base / "cdi"), "--host-sys", str(base / "sys"),
            "--mps-control", str(self.mps_control), "--pod-uid", pod_uid,
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TESSERA_", "DP_", "KUBECONFIG", "POD_UID"))}
        with log.open("w") as log_file:
            return subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env), log

    def registrations(self) -> int:
        return len(self.dra.registration_events("registered", DRIVER))

    def devices(self) -> list[str]:
        slices = [s for s in self.api.objects("resourceslices") if s["spec"]["nodeName"] == NODE]
        return [d["name"] for s in slices for d in s["spec"].get("devices", [])]

    def mps_claim(self, name: str) -> dict:
        """A claim for one whole GPU shared through MPS (NVIDIA's GpuConfig), allocated and stored."""
        claim = self.api.create("resourceclaims", {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}],
                "config": [{"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": MPS_CONFIG}}],
            }},
        })  # fmt: skip
        slices = [s for s in self.api.objects("resourceslices") if s["spec"]["nodeName"] == NODE]
        classes = {c["metadata"]["name"]: c for c in self.api.objects("deviceclasses")}
        return self.api.update("resourceclaims", allocate(claim, slices, classes, set(), NODE), status=True)

    def open_gate(self) -> None:
        """Let the held ``-d`` go on (the FIFO's reader is waiting; nobody reading: nothing to let go)."""
        try:
            fd = os.open(self.base / "gate", os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            return
        try:
            os.write(fd, b"go\n")
        finally:
            os.close(fd)


@pytest.fixture
def cluster(mps_bin: Path) -> Iterator[Cluster]:
    base = Path(tempfile.mkdtemp(prefix="ds", dir="/tmp"))  # unix socket and MPS pipe paths stay short
    for directory in ("sys", "cdi"):
        (base / directory).mkdir()
    (base / "config.yaml").write_text(
        f"version: v1\nflags: {{mpsRoot: '{base / 'mps'}'}}\ndra:\n  enabled: true\n  gpus: [0, 1]\n"
    )
    os.mkfifo(base / "gate")
    held = base / "held"
    wrapper = base / "nvidia-cuda-mps-control"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = "-d" ] && [ ! -e {held} ]; then : > {held}; read go < {base / "gate"}; fi\n'
        f'exec {mps_bin / "nvidia-cuda-mps-control"} "$@"\n'
    )
    wrapper.chmod(0o755)
    api = ApiServer(git_version="v1.36.3")
    api.start()
    api.add_node(NODE)
    selectors = [{"cel": {"expression": f"device.driver == '{DRIVER}'"}}]
    api.create("deviceclasses", {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
                                 "metadata": {"name": DRIVER}, "spec": {"selectors": selectors}})  # fmt: skip
    kubelet = KubeletEmulator(base / "dp", base / "pr" / "kubelet.sock")  # PodResources: the GPUs are free for DRA
    kubelet.start()
    dra = DraKubeletEmulator(base / "registry", NODE, api.api_client(), wipe_delay=1.0)
    dra.start()
    cluster = Cluster(base, api, dra, wrapper, held)
    try:
        yield cluster
    finally:
        cluster.open_gate()
        dra.stop()
        kubelet.stop()
        api.stop()
        end_mps_daemons(base)
        shutil.rmtree(base, ignore_errors=True)


def _stopped(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
        process.wait(timeout=10)


def test_sigterm_while_a_prepare_waits_for_its_mps_daemon_exits_at_once_and_the_next_agent_prepares(
    cluster: Cluster,
) -> None:
    agent, log = cluster.start_agent(OLD_POD, "old.log")
    successor = None
    try:
        cluster.dra.wait_for(lambda: DRIVER in cluster.dra.drivers(), 30, "the DRA driver registered")
        cluster.api.wait_for(lambda: cluster.devices() == ["gpu-0", "gpu-1"], DEADLINE)
        claim = cluster.mps_claim("mps")
        uid = claim["metadata"]["uid"]
        outcome: list[BaseException | None] = []

        def run_pod() -> None:
            try:
                cluster.dra.run_pod("default", "mps", "pod-1", [("gpu", "mps")], {"a": [("gpu", None)]})
                outcome.append(None)
            except BaseException as error:
                outcome.append(error)

        kubelet_call = threading.Thread(target=run_pod, daemon=True)
        kubelet_call.start()
        poll(lambda: cluster.held.exists(), "the claim's MPS daemon is being started (held at the gate)")

        agent.send_signal(signal.SIGTERM)
        poll(lambda: "stopping signal=SIGTERM" in log.read_text(errors="replace"), "the agent heard SIGTERM")
        cluster.open_gate()  # the daemon comes up now: only the stopped reconcile loop could tell the claim
        assert agent.wait(timeout=5) == 0, log.read_text(errors="replace")[-3000:]  # not 30 s later
        text = log.read_text(errors="replace")
        assert "is not ready: the agent is stopping" in text  # the claim's wait ended with the stop
        kubelet_call.join(timeout=DEADLINE)
        assert outcome and isinstance(outcome[0], PodStartError)  # the kubelet got an error: it retries
        spec = cluster.base / "cdi" / f"k8s.gpu.nvidia.com-claim_{uid}.yaml"
        assert not spec.exists()
        (checkpoint,) = (cluster.base / "plugins").rglob(CHECKPOINT_FILE)
        record = decode(checkpoint.read_bytes()).claims.get(uid)
        assert record is None or record.state != PREPARE_COMPLETED  # rolled back, or left for the next to roll back

        registered = cluster.registrations()
        successor, _ = cluster.start_agent(NEW_POD, "new.log")
        cluster.dra.wait_for(lambda: cluster.registrations() > registered, 30, "the next agent registered")
        deadline = time.monotonic() + DEADLINE
        while True:  # the kubelet retries the pod until the new agent's slices and daemon are there
            try:
                cluster.dra.run_pod("default", "mps", "pod-2", [("gpu", "mps")], {"a": [("gpu", None)]})
                break
            except PodStartError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        assert spec.exists()
        assert decode(checkpoint.read_bytes()).claims[uid].state == PREPARE_COMPLETED
    finally:
        _stopped(agent)
        if successor is not None:
            successor.send_signal(signal.SIGTERM)
            try:
                successor.wait(timeout=10)
            finally:
                _stopped(successor)
