"""Scenario: workloads under MIG and MPS changes, config bombs, and NVML failing at random.

Each runs the real agent in-process on a simulated node (the simulator's call log is read directly) with
the kubelet emulator; fast bounded versions in CI, the long ones with ``--long``. Figures are recorded.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from agent.config.effective import FlagOverrides
from agent.config.labels import MIG_CONFIG_LABEL, NodeLabelChanged
from agent.core.health import HealthPolicy
from agent.sim.nvml.codes import Return
from agent.sim.nvml.driver import DestructiveCall, SimDriver
from agent.telemetry.service import TelemetrySettings
from tests import bombs
from tests.agent_node import Node, running_node

GPU = "nvidia.com/gpu"
LAYOUT_NAMES = ["all-1g.10gb", "all-3g.40gb", "mixed", "all-disabled"]
MIG_CONFIG = """
version: v1
flags: {migStrategy: mixed}
migLayout:
  config: all-1g.10gb
  layouts:
    version: v1
    mig-configs:
      all-disabled:
        - {devices: all, mig-enabled: false}
      all-1g.10gb:
        - {devices: all, mig-enabled: true, mig-devices: {1g.10gb: 7}}
      all-3g.40gb:
        - {devices: all, mig-enabled: true, mig-devices: {3g.40gb: 2}}
      mixed:
        - {devices: [0], mig-enabled: true, mig-devices: {3g.40gb: 1, 2g.20gb: 1, 1g.10gb: 1}}
        - {devices: [1], mig-enabled: false}
"""
MPS_CONFIG = """
version: v1
sharing:
  mps:
    resources:
      - name: nvidia.com/gpu
        replicas: {replicas}
        activeThreadPercentage: {percent}
"""
TWO_A100 = {"name": "churn", "gpus": [{"model": "A100-SXM4-80GB", "count": 2}]}


@dataclass(frozen=True)
class Held:
    """One physical device a pod held: where it sits, and when."""

    physical: str
    gpu: str  # the GPU UUID
    gpu_instance: int | None  # the MIG device's GPU instance, None for a whole GPU
    since: float
    until: float = float("inf")

    def disturbed_by(self, call: DestructiveCall) -> bool:
        """A call at a moment the pod held the device, that acts on the device, its GPU instance or its GPU."""
        if not self.since <= call.at <= self.until:
            return False
        if call.target == self.physical:
            return True
        if call.target != self.gpu:
            return False
        if call.symbol == "nvmlGpuInstanceDestroy":  # logged against the GPU, with the instance it destroys
            return self.gpu_instance is None or call.gpu_instance_id == self.gpu_instance
        return True  # MIG mode, the GPU's compute mode, a reset: everything on the GPU


class Holdings:
    """Which physical devices pods (and their processes) hold, over time, to check the call log against."""

    def __init__(self, driver: SimDriver) -> None:
        self.driver = driver
        self.done: list[Held] = []
        self.open: dict[str, list[Held]] = {}  # pod -> what it holds

    def hold(self, pod: str, physical: list[str]) -> None:
        now = time.monotonic()
        self.open[pod] = [Held(p, *self._where(p), since=now) for p in physical]

    def release(self, pod: str) -> None:
        now = time.monotonic()
        self.done += [replace(held, until=now) for held in self.open.pop(pod)]

    def _where(self, physical: str) -> tuple[str, int | None]:
        with self.driver.lock:
            for gpu in self.driver.gpus:
                if gpu.uuid == physical:
                    return gpu.uuid, None
                for gi, ci in gpu.mig_devices():
                    if ci.uuid == physical:
                        return gpu.uuid, gi.id
        raise AssertionError(f"a pod was given {physical}, which the driver does not have")

    def violations(self) -> list[str]:
        calls = self.driver.destructive_calls
        held = self.done + [h for pod in self.open.values() for h in pod]
        bad = [f"{c.symbol} on {c.target} with {c.processes} process(es)" for c in calls if c.processes]
        bad += [
            f"{c.symbol} on {c.target} while a pod held {h.physical}" for c in calls for h in held if h.disturbed_by(c)
        ]
        return bad


def _random_pods(node: Node, rng: random.Random, holdings: Holdings, step: int, kind: str = "compute") -> None:
    """Create or delete a pod on a random advertised resource; each held device runs one process."""
    kubelet, driver = node.kubelet, node.driver
    if holdings.open and rng.random() < 0.5:
        pod = rng.choice(sorted(holdings.open))
        for pid in _pids(pod):
            driver.remove_process(pid)
        kubelet.delete_pod(pod)
        holdings.release(pod)
        return
    offered = [r for r in kubelet.resources() if node.healthy_ids(r) and not kubelet.stopped(r)]
    if not offered:
        return
    resource = rng.choice(sorted(offered))
    name = f"p{step}"
    try:
        pod = kubelet.create_pod(name, {"main": {resource: 1}})
    except Exception:
        return
    ids = pod.containers["main"][resource].device_ids
    physical = [i.split("::")[0] for i in ids]
    holdings.hold(name, physical)
    for n, device in enumerate(physical):
        _start_process(driver, device, _pids(name)[n], kind)


def _pids(pod: str) -> list[int]:
    return [100000 + int(pod[1:]) * 4]


def _start_process(driver: SimDriver, device: str, pid: int, kind: str) -> None:
    for gpu in driver.gpus:
        if gpu.uuid == device:
            driver.add_process(gpu.index, pid, 512, kind=kind)
        elif any(ci.uuid == device for _, ci in gpu.mig_devices()):
            driver.add_process(gpu.index, pid, 512, mig_uuid=device, kind=kind)


EXPECTED = {  # per layout name: each GPU's MIG profiles, None for MIG disabled
    "all-disabled": [None, None],
    "all-1g.10gb": [["1g.10gb"] * 7] * 2,
    "all-3g.40gb": [["3g.40gb"] * 2] * 2,
    "mixed": [["1g.10gb", "2g.20gb", "3g.40gb"], None],
}


def _layout(driver: SimDriver) -> list[list[str] | None]:
    with driver.lock:
        return [sorted(gi.profile.name for gi in g.gis.values()) if g.mig_current else None for g in driver.gpus]


def _release_all(node: Node, holdings: Holdings) -> None:
    for pod in sorted(holdings.open):
        for pid in _pids(pod):
            node.driver.remove_process(pid)
        node.kubelet.delete_pod(pod)
        holdings.release(pod)


@pytest.mark.parametrize(
    "changes",
    [pytest.param(20, id="ci"), pytest.param(200, id="long", marks=[pytest.mark.long, pytest.mark.timeout(900)])],
)
def test_random_mig_layout_changes_never_destroy_under_a_held_device(sim_node, figures, changes: int) -> None:
    driver = sim_node(TWO_A100)
    rng = random.Random(12)
    holdings = Holdings(driver)
    started = time.monotonic()
    completed = 0
    with running_node(driver, MIG_CONFIG) as node:
        node.wait(lambda: _layout(driver) == EXPECTED["all-1g.10gb"], "the first layout", timeout=20)
        for step in range(changes):
            wanted = rng.choice(LAYOUT_NAMES)
            node.agent.post(NodeLabelChanged(MIG_CONFIG_LABEL, wanted))
            for n in range(rng.randint(1, 3)):
                _random_pods(node, rng, holdings, step * 4 + n)
            if rng.random() < 0.3:  # now and then every workload ends, so that the change can go through
                _release_all(node, holdings)
                node.wait(lambda w=wanted: _layout(driver) == EXPECTED[w], f"layout {wanted}", timeout=30)
                completed += 1
        violations = holdings.violations()
        figures.update(
            changes=changes,
            changes_completed_while_running=completed,
            destructive_calls=len(driver.destructive_calls),
            destructive_calls_under_a_workload=len(violations),
            seconds=round(time.monotonic() - started, 1),
        )
        assert not violations, violations[:5]
        assert completed, "no MIG change ever went through: the scenario tested nothing"


@pytest.mark.parametrize(
    "changes",
    [pytest.param(8, id="ci"), pytest.param(200, id="long", marks=[pytest.mark.long, pytest.mark.timeout(900)])],
)
def test_random_mps_spec_changes_never_quit_a_daemon_under_a_client(sim_node, mps_bin: Path, figures, changes) -> None:
    driver = sim_node(TWO_A100)
    rng = random.Random(7)
    holdings = Holdings(driver)
    root = Path(tempfile.mkdtemp(prefix="m", dir="/tmp"))
    options = {"mps_control": str(mps_bin / "nvidia-cuda-mps-control"), "overrides": FlagOverrides(mps_root=str(root))}
    try:
        with running_node(driver, MPS_CONFIG.format(replicas=2, percent=50), **options) as node:
            node.wait(lambda: node.healthy_ids(GPU), "MPS replicas advertised", timeout=30)
            daemons: set[str] = set()
            completed = 0
            for step in range(changes):
                replicas, percent = rng.randint(2, 4), rng.choice([25, 50, 100])
                node.reload(MPS_CONFIG.format(replicas=replicas, percent=percent))
                _random_pods(node, rng, holdings, step * 4, kind="mps_client")
                if rng.random() < 0.4:
                    _release_all(node, holdings)
                    node.wait(lambda r=replicas, p=percent: _mps_in_force(node, r, p), "the new spec", timeout=30)
                    daemons |= {f.read_text() for f in root.glob("**/nvidia-cuda-mps-control.pid")}
                    completed += 1
            violations = holdings.violations()
            figures.update(
                changes=changes,
                changes_completed_while_running=completed,
                daemons_started=len(daemons),
                destructive_calls=len(driver.destructive_calls),
                destructive_calls_under_a_workload=len(violations),
            )
            assert not violations, violations[:5]
            assert len(daemons) > 1, "no daemon was ever replaced: the scenario tested nothing"
    finally:
        for pid_file in root.glob("**/nvidia-cuda-mps-control.pid"):
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)


def _mps_in_force(node: Node, replicas: int, percent: int) -> bool:
    """The spec is served: its replicas advertised Healthy, with its limits, and nothing waits to retire."""
    snapshot = node.agent.status.resources.get(GPU)
    return (
        snapshot is not None
        and snapshot.mps is not None
        and (snapshot.replicas, snapshot.mps.active_thread_percentage) == (replicas, percent)
        and len(node.healthy_ids(GPU)) == 2 * replicas
        and not node.waiting_for("mps")
    )


BOMBS: list[tuple[str, bytes]] = [
    ("deep nesting", bombs.deep_nesting(600)),
    ("alias expansion", bombs.billion_laughs()),
    ("100 MB file", b""),  # made sparse with truncate: the agent must refuse it by its size, not read it
    ("binary garbage", bombs.binary_garbage()),
]


@pytest.mark.parametrize(
    "reloads",
    # each reload is checked by a child process of its own (agent.config.check: no PyYAML in the agent), ~0.1-0.3 s
    [pytest.param(25, id="ci"), pytest.param(1000, id="long", marks=[pytest.mark.long, pytest.mark.timeout(900)])],
)
def test_config_bombs_hot_reloaded_never_stop_the_agent(sim_node, figures, reloads: int) -> None:
    good = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n      - {name: nvidia.com/gpu, replicas: 4}\n"
    with running_node(sim_node(TWO_A100), good) as node:
        kubelet, agent = node.kubelet, node.agent
        node.wait(lambda: len(node.healthy_ids(GPU)) == 8, "8 replicas")
        pods = [kubelet.create_pod(f"held{n}", {"main": {GPU: 1}}) for n in range(3)]
        started = time.monotonic()
        for n in range(reloads):
            name, bomb = BOMBS[n % len(BOMBS)]
            errors = agent.status.config_errors_total
            rejected = lambda errors=errors: agent.status.config_errors_total > errors  # noqa: E731
            node.reload(bomb, size=(100 << 20) if name == "100 MB file" else None)
            node.wait(rejected, f"reload {n} ({name}) rejected")
            assert str(node.config) in (agent.status.config_error or ""), agent.status.config_error
            assert len(node.healthy_ids(GPU)) == 8, f"after reload {n} ({name}) the last good config is not served"
        elapsed = time.monotonic() - started
        assert node.thread.is_alive()
        assert all(p.containers["main"][GPU].device_ids for p in pods)
        figures.update(reloads=reloads, rejected=agent.status.config_errors_total, seconds=round(elapsed, 2),
                       loop_alive=node.thread.is_alive(), devices_served=len(node.healthy_ids(GPU)))  # fmt: skip


@pytest.mark.parametrize(
    "seconds",
    [pytest.param(6, id="ci"), pytest.param(600, id="long", marks=[pytest.mark.long, pytest.mark.timeout(900)])],
)
def test_one_percent_of_nvml_calls_failing_never_advertises_a_phantom(sim_node, figures, seconds: float) -> None:
    driver: SimDriver = sim_node(TWO_A100)
    rng = random.Random(3)
    policy = HealthPolicy(quiet_seconds=0.5)
    telemetry = TelemetrySettings(hostname="faults", metrics_address="127.0.0.1:0", interval=0.2)  # NVML reads
    with running_node(driver, MIG_CONFIG, health=policy, liveness_probe_seconds=0.5, telemetry=telemetry) as node:
        node.wait(lambda: node.agent.status.mig_state == "success", "the first layout", timeout=20)
        driver.set_fault_rate(0.01, seed=5, code=Return.ERROR_UNKNOWN)
        deadline = time.monotonic() + seconds
        samples = phantoms = 0
        pace = threading.Event()
        seen: list[str] = []
        while time.monotonic() < deadline:
            if rng.random() < 0.05:
                node.agent.post(NodeLabelChanged(MIG_CONFIG_LABEL, rng.choice(LAYOUT_NAMES)))
            if rng.random() < 0.02:
                driver.inject_xid(rng.randrange(2), 48)
            before = _existing(driver)
            advertised = {i for r in node.kubelet.resources() for i in node.healthy_ids(r)}
            after = _existing(driver)
            phantom = {i.split("::")[0] for i in advertised} - before - after
            samples += 1
            if phantom:
                phantoms += 1
                seen.append(", ".join(sorted(phantom)))
            pace.wait(0.01)  # the sampling rate of a monitor, not a wait for an event
        driver.set_fault_rate(0)
        node.wait(lambda: node.agent.status.mig_state in ("success", "failed", "reset-required"), "settled", 60)
        node.wait(lambda: node.agent.status.stale_gpus == frozenset(), "inventory read", 60)
        assert node.thread.is_alive()
        figures.update(seconds=seconds, random_faults=driver.random_faults, samples=samples, phantom_samples=phantoms,
                       mig_changes=sum(1 for c in driver.destructive_calls if "Destroy" in c.symbol),
                       internal_errors=dict(node.agent.status.internal_errors))  # fmt: skip
        assert not phantoms, seen[:5]
        node.wait(lambda: _known(node) == _existing(driver), "the agent's inventory matches the driver", 60)


def _known(node: Node) -> set[str]:
    inventory = node.agent.status.inventory
    return {g.uuid for g in inventory.gpus} | {m.uuid for g in inventory.gpus for m in g.mig_devices}


def _existing(driver: SimDriver) -> set[str]:
    with driver.lock:
        return {g.uuid for g in driver.gpus} | {ci.uuid for g in driver.gpus for _, ci in g.mig_devices()}
