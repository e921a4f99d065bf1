"""Benchmarks for the agent process's life: start, idle, stop. Simulated dgx-a100, the kubelet emulator.

Run: python tests/bench/bench_lifecycle.py [--rounds 5] [--quick]

Prints medians over the rounds (each round runs every measure once, so a noisy neighbour spreads over all
of them), with the issue's targets:
- process start -> registered and the first ListAndWatch received by the kubelet (all 8 GPUs healthy):
  with the default features (metrics on, here on an ephemeral port), with ``--metrics-address off`` and
  with a ``--config`` file (target < 200 ms for the default)
- RSS after start (< 45 MB), and after the idle window
- idle CPU of the agent process after start (utime + stime from /proc/<pid>/stat; 60 s, ``--quick`` 10 s;
  target < 0.1 % of a core)
- SIGTERM -> exit (< 100 ms), and whether every run exited 0 with its plugin sockets removed
- SIGTERM -> exit of an agent waiting for the device-plugin directory's lock (another agent holds it; < 1 s, exit 0)
Floors measured in the same run: ``python -c pass`` (process start and exit) and the bare ``import grpc``.

The agent runs from a copy of this tree's ``agent`` package with its bytecode compiled, as the image has it
(pip compiles what it installs). A development venv with PYTHONDONTWRITEBYTECODE=1 and an editable install
compiles every module of the package again at each start; one row measures that too ("no bytecode").
"""

from __future__ import annotations

import argparse
import compileall
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from agent.plugin.lock import PluginDirLock
from agent.sim.kubelet import KubeletEmulator

PACKAGE = Path(__file__).resolve().parents[2] / "agent"  # this tree's, whatever `import agent` finds
RESOURCE = "nvidia.com/gpu"
GPUS = 8  # dgx-a100
SETTLE_SECONDS = 1.0  # after registration, before the idle window opens (the start's tail: first collection...)
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
CONFIG = "version: v1\nflags:\n  migStrategy: none\n  plugin:\n    deviceListStrategy: envvar\n"


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _cpu_seconds(pid: int) -> float:
    """utime + stime of every thread of ``pid`` (not its children), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # fields 14 and 15 of proc(5), after "pid (comm)"


def _python_seconds(code: str) -> float:
    """Wall time of ``python -c code``, process start to exit."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - started


def _import_seconds(module: str) -> float:
    """The bare import of ``module`` in a fresh interpreter, timed inside it."""
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    return float(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout)


def package_copy(directory: Path, *, compiled: bool) -> Path:
    """A copy of the ``agent`` package under ``directory`` (run with it as the working directory, ``python -m
    agent`` imports the copy), with its bytecode compiled or without any."""
    shutil.copytree(PACKAGE, directory / "agent", ignore=shutil.ignore_patterns("__pycache__"))
    if compiled and not compileall.compile_dir(directory / "agent", quiet=1):
        raise RuntimeError("the agent package does not compile")
    return directory


class Run:
    """One agent process against its own kubelet emulator in a fresh directory."""

    def __init__(self, extra: list[str], base: Path, package: Path) -> None:
        self.base = base
        self.package = package
        self.plugin_dir = base / "dp"
        self.kubelet = KubeletEmulator(self.plugin_dir, base / "pr" / "kubelet.sock")
        self.extra = extra
        self.agent: subprocess.Popen[bytes] | None = None

    def start(self) -> float:
        """Seconds from process start to the kubelet holding all GPUs healthy from the first ListAndWatch."""
        self.kubelet.start()
        started = time.perf_counter()
        self._spawn()
        try:
            self.kubelet.wait_for(lambda: self.kubelet.allocatable(RESOURCE) == GPUS, timeout=60, what="registered")
        except TimeoutError:
            raise RuntimeError(f"the agent did not register: {self.log_tail()}") from None
        return time.perf_counter() - started

    def stop_while_waiting_for_the_lock(self) -> tuple[float, bool]:
        """(seconds from SIGTERM to exit, whether it exited 0) of an agent that waits for the device-plugin
        directory's lock, held by another agent (this process) as in a rolling update."""
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        holder = PluginDirLock(self.plugin_dir)
        holder.acquire()
        try:
            self._spawn()
            assert self.agent is not None
            deadline = time.monotonic() + 60
            while "held by another agent" not in (self.base / "agent.log").read_text(errors="replace"):
                if self.agent.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the agent did not wait for the lock: {self.log_tail()}")
                time.sleep(0.01)
            started = time.perf_counter()
            self.agent.send_signal(signal.SIGTERM)
            code = self.agent.wait(timeout=60)
            return time.perf_counter() - started, code == 0
        finally:
            holder.release()

    def _spawn(self) -> None:
        command = [
            sys.executable, "-m", "agent", "run", "--simulate", "dgx-a100", "--device-plugin-dir", str(self.plugin_dir),
            "--pod-resources-socket", str(self.base / "pr" / "kubelet.sock"), "--log-level", "warning", *self.extra,
        ]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
        env["PYTHONDONTWRITEBYTECODE"] = "1"  # as in the image: a copy without bytecode stays without
        log = (self.base / "agent.log").open("wb")
        self.agent = subprocess.Popen(command, env=env, cwd=self.package, stdout=log, stderr=log)
        log.close()

    def stop(self) -> tuple[float, bool]:
        """(seconds from SIGTERM to exit, whether it exited 0 with every plugin socket removed)."""
        assert self.agent is not None
        sockets = [p for p in self.plugin_dir.glob("*.sock") if p.name != "kubelet.sock"]
        started = time.perf_counter()
        self.agent.send_signal(signal.SIGTERM)
        code = self.agent.wait(timeout=60)
        seconds = time.perf_counter() - started
        clean = code == 0 and bool(sockets) and not any(p.exists() for p in sockets)
        if not clean:
            left = [p.name for p in sockets if p.exists()]
            print(f"  unclean stop: exit {code}, {left} left of {len(sockets)}; {self.log_tail()}", file=sys.stderr)
        return seconds, clean

    def close(self) -> None:
        if self.agent is not None and self.agent.poll() is None:
            self.agent.kill()
            self.agent.wait()
        self.kubelet.stop()

    def log_tail(self) -> str:
        text = (self.base / "agent.log").read_text(errors="replace")
        return " | ".join(text.strip().splitlines()[-5:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--idle-seconds", type=float, default=60.0)
    parser.add_argument("--quick", action="store_true", help="a 10 s idle window instead of 60 s")
    args = parser.parse_args()
    logging.disable(logging.ERROR)  # the kubelet emulator's notes on streams the agent closes at exit
    idle_seconds = 10.0 if args.quick else args.idle_seconds

    results: dict[str, list[float]] = {}
    clean_stops = 0

    def add(name: str, value: float) -> None:
        results.setdefault(name, []).append(value)

    def default_round(run: Run) -> None:
        nonlocal clean_stops
        add("start", run.start())
        assert run.agent is not None
        pid = run.agent.pid
        add("rss", _rss_mib(pid))
        time.sleep(SETTLE_SECONDS)
        cpu, t = _cpu_seconds(pid), time.perf_counter()
        time.sleep(idle_seconds)
        add("idle", (_cpu_seconds(pid) - cpu) / (time.perf_counter() - t) * 100)
        add("rss_idle", _rss_mib(pid))
        seconds, clean = run.stop()
        add("stop", seconds)
        clean_stops += clean

    def start_only(name: str) -> Callable[[Run], None]:
        def body(run: Run) -> None:
            nonlocal clean_stops
            add(name, run.start())
            seconds, clean = run.stop()
            add("stop", seconds)
            clean_stops += clean

        return body

    def lock_wait_round(run: Run) -> None:
        seconds, clean = run.stop_while_waiting_for_the_lock()
        add("stop_lock_wait", seconds)
        results.setdefault("stop_lock_wait_clean", []).append(float(clean))

    work = Path(tempfile.mkdtemp(prefix="bench-life", dir="/tmp"))
    packages = {
        True: package_copy(work / "compiled", compiled=True),
        False: package_copy(work / "source", compiled=False),
    }

    def with_run(extra: list[str], body: Callable[[Run], None], *, compiled: bool = True) -> None:
        base = Path(tempfile.mkdtemp(prefix="run", dir=work))
        (base / "tessera.yaml").write_text(CONFIG)
        run = Run([a.replace("{base}", str(base)) for a in extra], base, packages[compiled])
        try:
            body(run)
        finally:
            run.close()
            shutil.rmtree(base, ignore_errors=True)

    try:
        for n in range(args.rounds):
            print(f"round {n + 1}/{args.rounds}", file=sys.stderr)
            add("floor_pass", _python_seconds("pass"))
            add("floor_grpc", _import_seconds("grpc"))
            with_run(["--metrics-address", "127.0.0.1:0"], default_round)
            with_run(["--metrics-address", "off"], start_only("start_off"))
            with_run(["--metrics-address", "off", "--config", "{base}/tessera.yaml"], start_only("start_config"))
            with_run(["--metrics-address", "127.0.0.1:0"], start_only("start_source"), compiled=False)
            with_run(["--metrics-address", "off"], lock_wait_round)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def row(label: str, key: str, unit: str, target: str, scale: float = 1000.0, digits: int = 1) -> str:
        values = [v * scale for v in results[key]]
        return (
            f"| {label} | {statistics.median(values):.{digits}f} {unit} | {min(values):.{digits}f} | "
            f"{max(values):.{digits}f} | {len(values)} | {target} |"
        )

    stops = len(results["stop"])
    print(f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; simulated dgx-a100 ({GPUS} GPUs); "
          f"{args.rounds} rounds; idle window {idle_seconds:g} s after a {SETTLE_SECONDS:g} s settle")  # fmt: skip
    print(f"agent package: {PACKAGE}")
    print()
    print("| measure | median | min | max | n | target |")
    print("|---|---|---|---|---|---|")
    print(row("floor: `python -c pass` (start to exit)", "floor_pass", "ms", "-"))
    print(row("floor: bare `import grpc`", "floor_grpc", "ms", "-"))
    print(row("start -> registered + first ListAndWatch (metrics on)", "start", "ms", "< 200 ms"))
    print(row("start -> registered + first ListAndWatch (metrics off)", "start_off", "ms", "-"))
    print(row("start -> registered + first ListAndWatch (--config, metrics off)", "start_config", "ms", "-"))
    print(row("start -> registered, no bytecode (metrics on)", "start_source", "ms", "-"))
    print(row("RSS after start (metrics on)", "rss", "MB", "< 45 MB", scale=1.0))
    print(row(f"RSS after {idle_seconds:g} s idle", "rss_idle", "MB", "-", scale=1.0))
    print(row(f"idle CPU over {idle_seconds:g} s (% of a core)", "idle", "%", "< 0.1 %", scale=1.0, digits=3))
    print(row("SIGTERM -> exit (every run)", "stop", "ms", "< 100 ms"))
    print(f"| exit 0 with plugin sockets removed | {clean_stops}/{stops} | | | {stops} | all |")
    print(row("SIGTERM -> exit while waiting for the plugin-directory lock", "stop_lock_wait", "ms", "< 1 s"))
    lock_stops = results["stop_lock_wait_clean"]
    print(f"| exit 0 after SIGTERM while waiting for the lock | {int(sum(lock_stops))}/{len(lock_stops)} | | | "
          f"{len(lock_stops)} | all |")  # fmt: skip


if __name__ == "__main__":
    main()
