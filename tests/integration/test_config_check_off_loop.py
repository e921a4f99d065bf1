"""A config reload is checked off the reconcile loop (agent.config.check_worker).

What a user would notice: while the config checker child runs on an edited config (~0.25 s, up to its 30 s
timeout when it hangs), the agent keeps serving: an XID still reaches the kubelet at once and SIGTERM still stops
the agent at once, killing the child. Two quick edits apply only the newest (the check of the first is killed,
not waited for), and a check that fails keeps the last good config and names the file.

The checker is held from outside the project's code: ``tests/checker_hook/sitecustomize.py``, on the
``PYTHONPATH`` the agent's checker children inherit, makes the next checker hang or die when a test asks.
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
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.agent import Agent, AgentOptions
from agent.sim.kubelet import KubeletEmulator
from agent.sim.nvml.driver import SimDriver
from tests.integration.test_config_reload import MIXED, NODE, SHARED_GPUS, SHARED_MIG, ConfigMapDir

pytestmark = pytest.mark.timeout(120)

HOOK_DIR = Path(__file__).resolve().parents[1] / "checker_hook"
HELD = 120  # seconds a held checker sleeps: well past its 30 s timeout and every deadline below
PROMPT = 5.0  # what "at once" may take on a loaded two-core machine; far below the checker's 30 s timeout


class CheckerHold:
    """Makes the next config checker child hang or die (see tests/checker_hook/sitecustomize.py)."""

    def __init__(self, flag: Path) -> None:
        self.flag = flag

    def hang(self) -> None:
        self.flag.write_text(f"hang {HELD}")

    def fail(self, code: int) -> None:
        self.flag.write_text(f"exit {code}")

    def taken(self, timeout: float = 20.0) -> int:
        """The pid of the checker child that took the hold, once one has."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            taken = list(self.flag.parent.glob(f"{self.flag.name}.*"))
            if taken:
                return int(taken[0].suffix[1:])
            time.sleep(0.02)
        raise TimeoutError(f"no config checker took the hold within {timeout:g} s")


def running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.fixture
def hold(monkeypatch: pytest.MonkeyPatch) -> Iterator[CheckerHold]:
    base = Path(tempfile.mkdtemp(prefix="hold", dir="/tmp"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(HOOK_DIR), os.environ.get("PYTHONPATH")) if p))
    monkeypatch.setenv("CHECKER_HOOK", str(base / "hold"))
    yield CheckerHold(base / "hold")
    for taken in base.glob("hold.*"):  # a child the test failed to see killed does not outlive it
        pid = int(taken.suffix[1:])
        if running(pid):
            os.kill(pid, signal.SIGKILL)
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def world(
    sim_node,
) -> Iterator[tuple[SimDriver, KubeletEmulator, ConfigMapDir, Callable[[], tuple[Agent, threading.Thread]]]]:
    driver = sim_node(NODE)
    base = Path(tempfile.mkdtemp(prefix="col", dir="/tmp"))
    kubelet = KubeletEmulator(base / "dp")
    kubelet.start()
    configmap = ConfigMapDir(base / "cm")
    running_agents: list[tuple[Agent, threading.Thread]] = []

    def start() -> tuple[Agent, threading.Thread]:
        agent = Agent(AgentOptions(device_plugin_dir=base / "dp", config_path=configmap.root))
        thread = threading.Thread(target=agent.run, name="agent-under-test")
        thread.start()
        running_agents.append((agent, thread))
        assert agent.started.wait(20)
        return agent, thread

    yield driver, kubelet, configmap, start
    for agent, thread in running_agents:
        agent.stop()
        thread.join(timeout=40)
    kubelet.stop()
    shutil.rmtree(base, ignore_errors=True)


def test_a_hung_check_delays_neither_an_xid_nor_the_stop(world, hold: CheckerHold) -> None:
    driver, kubelet, configmap, start = world
    configmap.publish({"default": MIXED})
    agent, thread = start()
    kubelet.wait_for(lambda: kubelet.allocatable("nvidia.com/gpu") == 2, 10, "two whole GPUs")
    digest = agent.status.config_digest

    hold.hang()
    configmap.publish({"default": SHARED_GPUS})
    checker = hold.taken()  # the edit is being checked, and the check hangs
    driver.inject_xid(1, 48)
    kubelet.wait_for(lambda: kubelet.allocatable("nvidia.com/gpu") == 1, PROMPT, "the XID's GPU Unhealthy")
    assert list(kubelet.devices("nvidia.com/gpu").values()).count("Unhealthy") == 1
    assert running(checker), "the check was still running: the XID overtook it"
    assert agent.status.config_digest == digest and agent.status.config_error is None  # nothing applied meanwhile

    agent.stop()
    thread.join(timeout=PROMPT)
    assert not thread.is_alive(), "the agent did not stop while a config check hung"
    assert not running(checker), "the hung checker outlived the agent"


def test_two_quick_edits_apply_only_the_newest(world, hold: CheckerHold, caplog: pytest.LogCaptureFixture) -> None:
    _, kubelet, configmap, start = world
    configmap.publish({"default": MIXED})
    agent, _ = start()
    kubelet.wait_for(lambda: kubelet.allocatable("nvidia.com/gpu") == 2, 10, "two whole GPUs")

    hold.hang()
    configmap.publish({"default": SHARED_GPUS})  # the first edit: its check hangs
    first = hold.taken()
    configmap.publish({"default": SHARED_MIG})  # the second, while the first is being checked
    kubelet.wait_for(lambda: kubelet.allocatable("nvidia.com/small") == 4, PROMPT * 2, "the newest edit applied")
    assert not running(first), "the superseded check was left running"
    assert kubelet.registrations("nvidia.com/gpu.shared") == 0  # the first edit never reached the kubelet
    applied = [r.getMessage() for r in caplog.records if r.getMessage().startswith("config applied")]
    assert not any("gpu.shared" in message for message in applied), applied
    assert agent.status.config_error is None


def test_a_failing_check_keeps_the_last_good_config_and_names_the_file(world, hold: CheckerHold) -> None:
    _, kubelet, configmap, start = world
    configmap.publish({"default": SHARED_GPUS})
    agent, _ = start()
    kubelet.wait_for(lambda: kubelet.allocatable("nvidia.com/gpu.shared") == 8, 10, "the shared GPUs")
    digest, registrations = agent.status.config_digest, kubelet.registrations("nvidia.com/gpu.shared")

    hold.fail(3)
    configmap.publish({"default": SHARED_MIG})
    kubelet.wait_for(lambda: agent.status.config_error is not None, PROMPT * 2, "the failed check noticed")
    error = agent.status.config_error
    assert str(configmap.root) in error and "exit code 3" in error and "told to fail" in error
    assert agent.status.config_digest == digest  # the last good config stays in force
    assert kubelet.allocatable("nvidia.com/gpu.shared") == 8
    assert kubelet.registrations("nvidia.com/gpu.shared") == registrations

    configmap.publish({"default": SHARED_MIG + "\n"})  # the next edit is checked afresh
    kubelet.wait_for(lambda: kubelet.allocatable("nvidia.com/small") == 4, PROMPT * 2, "the next edit applied")
    assert agent.status.config_error is None


def _tessera_run(base: Path, config: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """``tessera run`` on a simulated dgx-a100 with ``config``, its device-plugin directory under ``base``."""
    log = base / "agent.log"
    command = [
        sys.executable, "-m", "agent", "run", "--simulate", "dgx-a100", "--metrics-address", "off",
        "--device-plugin-dir", str(base / "dp"), "--pod-resources-socket", str(base / "pr" / "kubelet.sock"),
        "--config", str(config),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TESSERA_", "DP_"))}
    with log.open("w") as log_file:
        return subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env), log


@pytest.fixture
def run_base() -> Iterator[tuple[Path, KubeletEmulator]]:
    base = Path(tempfile.mkdtemp(prefix="cst", dir="/tmp"))  # short: unix socket paths are limited
    kubelet = KubeletEmulator(base / "dp", base / "pr" / "kubelet.sock")
    kubelet.start()
    yield base, kubelet
    kubelet.stop()
    shutil.rmtree(base, ignore_errors=True)


def _stops_at_once(process: subprocess.Popen[bytes], log: Path, checker: int) -> None:
    try:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=PROMPT * 2) == 0, log.read_text(errors="replace")[-2000:]  # not 30 s later
        assert not running(checker), "the hung checker outlived the agent"
        assert "stopping signal=SIGTERM" in log.read_text(errors="replace")
    finally:
        _kill(process)


def _kill(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
        process.wait(timeout=10)


def test_sigterm_while_a_reload_check_hangs_stops_tessera_run_at_once(run_base, hold: CheckerHold) -> None:
    base, kubelet = run_base
    config = base / "config.yaml"
    config.write_text("version: v1\n")
    process, log = _tessera_run(base, config)
    try:
        kubelet.wait_for(lambda: kubelet.allocatable("nvidia.com/gpu") == 8, timeout=30, what="registered")
        hold.hang()
        config.write_text("version: v1\nsharing:\n  timeSlicing:\n    resources:\n      - name: nvidia.com/gpu\n"
                          "        replicas: 2\n")  # fmt: skip
        checker = hold.taken()
    except BaseException:
        _kill(process)
        raise
    _stops_at_once(process, log, checker)


def test_sigterm_while_the_first_check_hangs_stops_tessera_run_at_once(run_base, hold: CheckerHold) -> None:
    """The start waits for its config's check before its first advertise; a SIGTERM cuts that wait short."""
    base, _ = run_base
    config = base / "config.yaml"
    config.write_text("version: v1\n")
    hold.hang()
    process, log = _tessera_run(base, config)
    try:
        checker = hold.taken()
        deadline = time.monotonic() + 30
        while "discovered reason=start" not in log.read_text(errors="replace"):  # the agent is in its start
            assert time.monotonic() < deadline and process.poll() is None, log.read_text(errors="replace")[-2000:]
            time.sleep(0.02)
    except BaseException:
        _kill(process)
        raise
    _stops_at_once(process, log, checker)
