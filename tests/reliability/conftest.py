"""Reliability suite: the agent as a real process under sustained load and injected faults.

Fast bounded versions run in CI; ``--long`` runs the long versions (tests marked ``long``). Every test
records its figures through the ``figures`` fixture: they are printed at the end of the run and, with
``--figures-out PATH``, written as JSON (tests/bench/RESULTS.md is written from such a file).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from agent.sim.kubelet import KubeletEmulator
from agent.sim.nvml.control import SimControlClient

_FIGURES: list[tuple[str, dict[str, object]]] = []


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("reliability")
    group.addoption("--long", action="store_true", default=False, help="run the long reliability scenarios")
    group.addoption("--figures-out", default=None, help="write the reliability figures as JSON to this file")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "long: a long reliability scenario, run only with --long")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--long"):
        return
    skip = pytest.mark.skip(reason="long scenario: run with --long")
    for item in items:
        if "long" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if not _FIGURES:
        return
    terminalreporter.section("reliability figures")
    for name, values in _FIGURES:
        terminalreporter.write_line(name)
        for key, value in values.items():
            terminalreporter.write_line(f"    {key}: {value}")
    out = config.getoption("--figures-out")
    if out:
        Path(out).write_text(json.dumps(dict(_FIGURES), indent=2, default=str) + "\n")


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> Iterator[dict[str, object]]:
    """A dict the test fills with its figures; printed (and recorded) whatever the outcome."""
    values: dict[str, object] = {}
    yield values
    _FIGURES.append((request.node.nodeid, values))
    print(f"\n{request.node.nodeid}: {json.dumps(values, default=str)}")


# ----------------------------------------------------------------------------------------------- helpers


CONTAINER_INIT = Path(__file__).parents[1] / "container_init.py"


def percentile(samples: list[float], q: float) -> float:
    """The q-th percentile (0..100) of ``samples``, nearest-rank; 0.0 for no samples."""
    if not samples:
        return 0.0
    ordered = sorted(samples)
    rank = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[rank]


def ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


def summary_ms(samples: list[float]) -> dict[str, float]:
    return {
        "n": len(samples),
        "p50_ms": ms(percentile(samples, 50)),
        "p99_ms": ms(percentile(samples, 99)),
        "max_ms": ms(max(samples, default=0.0)),
        "mean_ms": ms(statistics.fmean(samples) if samples else 0.0),
    }


def poll(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.02) -> None:
    """Wait until ``predicate()`` is truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    return dict(entry.split("=", 1) for entry in raw.split("\0") if "=" in entry)


def session_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3])


def mps_daemons(pipe_dir: Path) -> list[int]:
    """One pid per MPS control daemon (the emulator run with ``-d``) whose CUDA_MPS_PIPE_DIRECTORY is ``pipe_dir``.

    ``-d`` double-forks into a new session; the foreground caller (in our session) and the short-lived
    intermediate are the same start-up, not a second daemon, so daemons are counted per new session.
    """
    own = session_of(os.getpid())
    sessions: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            if b"agent.sim.mps.control" not in argv or b"-d" not in argv:
                continue
            if environ_of(int(entry)).get("CUDA_MPS_PIPE_DIRECTORY") != str(pipe_dir):
                continue
            sid = session_of(int(entry))
        except (OSError, IndexError, ValueError):
            continue
        if sid != own:
            sessions.setdefault(sid, []).append(int(entry))
    return sorted(max(pids, key=lambda p: p != sid) for sid, pids in sessions.items())


# ----------------------------------------------------------------------------------------------- the node


@dataclass
class Node:
    """A short socket directory with a kubelet emulator (PodResources served) and ``tessera run --simulate``."""

    base: Path
    kubelet: KubeletEmulator
    env: dict[str, str]
    args: tuple[str, ...]
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    daemons: list[int] = field(default_factory=list)
    containers: list[Container] = field(default_factory=list)

    @property
    def plugin_dir(self) -> Path:
        return self.base / "dp"

    @property
    def pod_resources_socket(self) -> Path:
        return self.base / "pr" / "kubelet.sock"

    @property
    def control_socket(self) -> Path:
        return self.base / "ctl.sock"

    @property
    def mps_root(self) -> Path:
        return self.base / "mps"

    @property
    def process(self) -> subprocess.Popen[bytes]:
        return self.processes[-1]

    @property
    def control(self) -> SimControlClient:
        return SimControlClient(self.control_socket)

    def start_agent(self, *, container: bool = False) -> subprocess.Popen[bytes]:
        """The agent, as a process of its own or (``container``) as the main process of an emulated container:
        then ``node.container`` is it, and what it starts dies with it (``tests/container_init.py``)."""
        command = [
            sys.executable, "-m", "agent", "run",
            "--simulate", str(self.base / "node.yaml"),
            "--sim-control", str(self.control_socket),
            "--device-plugin-dir", str(self.plugin_dir),
            "--pod-resources-socket", str(self.pod_resources_socket),
            "--mps-root", str(self.mps_root),
            "--metrics-address", "off",
            *self.args,
        ]  # fmt: skip
        log = self.base / f"agent{len(self.processes)}.log"
        if container:
            self.containers.append(Container.start(command, log, self.env))
            process = self.containers[-1].init
        else:
            with log.open("w") as out:
                process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        self.processes.append(process)
        return process

    @property
    def container(self) -> Container:
        return self.containers[-1]

    def log(self) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.base.glob("agent*.log")))

    def wait_registered(self, expected: dict[str, int], timeout: float = 30.0) -> None:
        """Every resource registered with exactly ``expected`` healthy devices."""
        kubelet = self.kubelet
        kubelet.wait_for(
            lambda: all(r in kubelet.resources() and kubelet.allocatable(r) == n for r, n in expected.items()),
            timeout=timeout,
            what=f"resources registered: {expected}",
        )

    def close(self) -> None:
        for container in self.containers:
            container.kill()
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
        for pid_file in self.mps_root.glob("**/nvidia-cuda-mps-control.pid"):
            with contextlib.suppress(OSError, ValueError):
                self.daemons.append(int(pid_file.read_text()))
        self.daemons.extend(mps_daemons_under(self.mps_root))
        for pid in set(self.daemons):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        self.kubelet.stop()
        shutil.rmtree(self.base, ignore_errors=True)


@dataclass
class Container:
    """A process run as an emulated container's main process (``tests/container_init.py``): when it ends,
    whatever it started ends too, double-forked daemons included — as when a pod's container restarts."""

    init: subprocess.Popen[bytes]
    pid_file: Path

    @classmethod
    def start(cls, command: list[str], log: Path, env: dict[str, str]) -> Container:
        pid_file = log.with_suffix(".pid")
        wrapped = [sys.executable, str(CONTAINER_INIT), "--pid-file", str(pid_file), "--", *command]
        with log.open("w") as out:
            init = subprocess.Popen(wrapped, stdout=out, stderr=subprocess.STDOUT, env=env)
        container = cls(init, pid_file)
        poll(lambda: container.pid_file.exists() and container.pid_file.read_text().strip(), 10, "container started")
        return container

    @property
    def main_pid(self) -> int:
        return int(self.pid_file.read_text())

    def kill(self) -> None:
        """The main process is SIGKILLed (a crash, an OOM kill, a forced restart): the container ends."""
        if self.init.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.main_pid, signal.SIGKILL)
            self.init.wait(timeout=10)


def mps_daemons_under(root: Path) -> list[int]:
    """Pids of MPS emulator daemons whose pipe directory lies under ``root`` (for teardown)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes()
            if b"agent.sim.mps.control" in argv and environ_of(int(entry)).get(
                "CUDA_MPS_PIPE_DIRECTORY", ""
            ).startswith(str(root)):
                found.append(int(entry))
        except OSError:
            continue
    return found


@pytest.fixture
def make_node(mps_bin: Path) -> Iterator[Callable[..., Node]]:
    """``make_node(node_yaml, config_yaml=None, *extra_args)``: kubelet started, agent started; all stopped after."""
    nodes: list[Node] = []

    def make(node_yaml: str, config_yaml: str | None = None, *extra: str, start: bool = True) -> Node:
        base = Path(tempfile.mkdtemp(prefix="r", dir="/tmp"))  # unix socket paths must stay short
        (base / "node.yaml").write_text(node_yaml)
        args = list(extra)
        if config_yaml is not None:
            (base / "config.yaml").write_text(config_yaml)
            args += ["--config", str(base / "config.yaml")]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TESSERA_", "DP_", "MPS_", "CUDA_"))}
        env["PATH"] = f"{mps_bin}{os.pathsep}{env.get('PATH', '')}"
        kubelet = KubeletEmulator(base / "dp", base / "pr" / "kubelet.sock", dial_timeout=2.0)
        node = Node(base, kubelet, env, tuple(args))
        nodes.append(node)
        kubelet.start()
        if start:
            node.start_agent()
        return node

    yield make
    for node in nodes:
        node.close()


def sim_uuids(node_yaml: str) -> dict[int, set[str]]:
    """GPU index -> the UUIDs of its devices (the GPU and its MIG devices), as the simulator derives them."""
    import yaml

    from agent.sim.nvml.spec import build_driver, parse_node_spec

    driver = build_driver(parse_node_spec(yaml.safe_load(node_yaml)))
    return {i: {gpu.uuid} | {ci.uuid for _, ci in gpu.mig_devices()} for i, gpu in enumerate(driver.gpus)}
