"""Shared fixtures: a simulated node installed beneath pynvml for the duration of one test.

Also the run's guard against threads a test leaves behind: a non-daemon thread still alive after its test
(an agent, server or executor not stopped) would keep the interpreter from exiting after the last test — the
run would print its summary and then hang until CI's deadline. Each such thread is reported with the test
that left it and where it is blocked, and an exit that still does not happen within ``EXIT_DEADLINE`` dumps
every thread's stack and ends the process with the tests' own status.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import suppress
from pathlib import Path
from types import FrameType

import pytest

from agent.sim.nvml.driver import SimDriver
from agent.sim.nvml.install import install, uninstall
from agent.sim.nvml.spec import build_driver, load_node_spec, parse_node_spec

THREAD_SETTLE = 2.0  # seconds a test's non-daemon threads get to finish after its teardown
EXIT_DEADLINE = 120  # seconds from the end of the run to the process's exit before a hung exit is ended

_leaked_threads: list[str] = []
_exit_status = 0


def _idle_executor_worker(thread: threading.Thread, frames: dict[int, FrameType]) -> bool:
    """A ThreadPoolExecutor's worker waiting for work: the interpreter wakes and joins it at exit."""
    frame = frames.get(thread.ident or -1)
    return frame is not None and frame.f_code.co_name == "_worker" and "concurrent/futures" in frame.f_code.co_filename


@pytest.fixture(autouse=True)
def _no_leaked_threads(request: pytest.FixtureRequest) -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    started = [t for t in threading.enumerate() if t not in before and not t.daemon]
    deadline = time.monotonic() + THREAD_SETTLE
    for thread in started:
        if not _idle_executor_worker(thread, sys._current_frames()):
            thread.join(max(0.0, deadline - time.monotonic()))
    frames = sys._current_frames()
    for thread in started:
        if thread.is_alive() and not _idle_executor_worker(thread, frames):
            frame = frames.get(thread.ident or -1)
            where = "".join(traceback.format_stack(frame)[-4:]) if frame is not None else "  (no frame)\n"
            _leaked_threads.append(f"{request.node.nodeid}: thread {thread.name!r} still running at\n{where}")


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if _leaked_threads:
        terminalreporter.section("threads left running by tests (they keep the process from exiting)")
        for entry in _leaked_threads:
            terminalreporter.write_line(entry)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _exit_status
    _exit_status = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Past ``EXIT_DEADLINE`` an exit that hangs (a thread or an atexit handler) dumps every thread's stack and ends
    the process with the tests' own status; a backstop in C ends it with status 1 should Python not run any more."""
    status = _exit_status

    def end_a_hung_exit() -> None:
        if not threading.Event().wait(EXIT_DEADLINE):
            sys.stderr.write(f"\nthe test process did not exit {EXIT_DEADLINE}s after the run; where it hangs:\n")
            faulthandler.dump_traceback(all_threads=True)
            sys.stderr.flush()
            os._exit(status)

    threading.Thread(target=end_a_hung_exit, name="exit-deadline", daemon=True).start()
    faulthandler.dump_traceback_later(EXIT_DEADLINE + 60, exit=True)


@pytest.fixture
def sim_node() -> Iterator[Callable[[object], SimDriver]]:
    """Install a simulated node: ``sim_node("dgx-a100")`` or ``sim_node({"gpus": [...]})``.

    The agent code under test then reaches it through real pynvml, exactly as it would reach a GPU.
    """

    def make(spec: object) -> SimDriver:
        node = load_node_spec(spec) if isinstance(spec, str) else parse_node_spec(spec)
        driver = build_driver(node)
        install(driver)
        return driver

    yield make
    uninstall()


def _emulator_bin(tmp_path_factory: pytest.TempPathFactory, binary: str, module: str) -> Path:
    """A directory holding ``binary``: a launcher running the emulator ``module`` under the real binary's name."""
    directory = tmp_path_factory.mktemp(f"{binary}-bin")
    launcher = directory / binary
    launcher.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m {module} "$@"\n')
    launcher.chmod(0o755)
    return directory


@pytest.fixture
def mps_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``nvidia-cuda-mps-control``: the MPS control emulator (``agent.sim.mps.control``)."""
    return _emulator_bin(tmp_path_factory, "nvidia-cuda-mps-control", "agent.sim.mps.control")


@pytest.fixture
def smi_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``nvidia-smi``: the emulator of its ``compute-policy --set-timeslice`` (``agent.sim.smi``)."""
    return _emulator_bin(tmp_path_factory, "nvidia-smi", "agent.sim.smi")


@pytest.fixture
def nvml_node(sim_node: Callable[[object], SimDriver]) -> Iterator[Callable[[object], SimDriver]]:
    """``nvml_node(spec)``: a simulated node with ``pynvml.nvmlInit`` done; shut down again afterwards."""
    import pynvml

    started = 0

    def start(spec: object) -> SimDriver:
        nonlocal started
        driver = sim_node(spec)
        pynvml.nvmlInit()
        started += 1
        return driver

    yield start
    for _ in range(started):
        with suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()
