"""The nvidia-cuda-mps-control emulator (agent.sim.mps.control): real processes, a real unix socket, the real CLI.

The emulator is put on PATH as ``nvidia-cuda-mps-control`` (a tiny ``#!/bin/sh`` exec script), exactly as Tessera's
MPS manager finds the real binary. Every daemon a test starts is SIGKILLed in teardown if it is still alive.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import shlex
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

import pytest

import agent
from agent.sim.mps.control import ControlState, format_log_line

BINARY = "nvidia-cuda-mps-control"
LOG_LINE = re.compile(r"^\[\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}\.\d{3} (Control|Other|Server) [ \d]{5}\d*\] .*$")
GPU0 = "GPU-8f6e3c2a-1b4d-4e5f-9a0b-c1d2e3f4a5b6"
GPU1 = "GPU-0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d"


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


def process_alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie (exited, not yet reaped by whoever adopted it) counts as gone."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat_line.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def is_emulator(pid: int) -> bool:
    try:
        return b"agent.sim.mps.control" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def make_bin_dir(root: Path) -> Path:
    """A directory holding an executable ``nvidia-cuda-mps-control`` that runs the emulator."""
    bin_dir = root / "bin"
    bin_dir.mkdir()
    repo = Path(agent.__file__).resolve().parents[1]
    script = bin_dir / BINARY
    script.write_text(
        "#!/bin/sh\n"
        f"PYTHONPATH={shlex.quote(str(repo))}${{PYTHONPATH:+:$PYTHONPATH}}\n"
        "export PYTHONPATH\n"
        f'exec {shlex.quote(sys.executable)} -m agent.sim.mps.control "$@"\n'
    )
    script.chmod(0o755)
    return bin_dir


class Mps:
    """One pipe/log directory pair with helpers to run the emulator against it."""

    def __init__(self, root: Path, bin_dir: Path) -> None:
        self.root = root
        self.pipe = root / "p"
        self.log_dir = root / "l"
        self.pipe.mkdir()
        self.log_dir.mkdir()
        self.env = {
            "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
            "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe),
            "CUDA_MPS_LOG_DIRECTORY": str(self.log_dir),
            "CUDA_VISIBLE_DEVICES": f"{GPU0},{GPU1}",
        }
        self.started: set[int] = set()

    @property
    def socket(self) -> Path:
        return self.pipe / "control"

    @property
    def pid_file(self) -> Path:
        return self.pipe / "nvidia-cuda-mps-control.pid"

    @property
    def log(self) -> Path:
        return self.log_dir / "control.log"

    def run(self, *args: str, stdin: str = "", env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [BINARY, *args],
            input=stdin,
            capture_output=True,
            text=True,
            env=env or self.env,
            timeout=10,
            check=False,
        )

    def start(self, env: dict[str, str] | None = None) -> int:
        result = self.run("-d", env=env)
        assert result.returncode == 0, result
        assert result.stdout == "" and result.stderr == ""
        pid = self.daemon_pid()
        self.started.add(pid)
        assert process_alive(pid)
        return pid

    def daemon_pid(self) -> int:
        return int(self.pid_file.read_text().strip())

    def send(self, text: str) -> str:
        result = self.run(stdin=text)
        assert result.returncode == 0, result
        assert result.stderr == ""
        return result.stdout

    def log_messages(self) -> list[str]:
        return [line.split("] ", 1)[1] for line in self.log.read_text().splitlines()]

    def kill_all(self) -> None:
        pids = set(self.started)
        with contextlib.suppress(OSError, ValueError):
            pids.add(self.daemon_pid())
        for pid in pids:
            if process_alive(pid) and is_emulator(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def bin_dir() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="mb", dir="/tmp"))
    try:
        yield make_bin_dir(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def mps_factory(bin_dir: Path) -> Iterator[Callable[[], Mps]]:
    made: list[Mps] = []

    def make() -> Mps:
        mps = Mps(Path(tempfile.mkdtemp(prefix="m", dir="/tmp")), bin_dir)
        made.append(mps)
        return mps

    yield make
    for mps in made:
        mps.kill_all()
        shutil.rmtree(mps.root, ignore_errors=True)


@pytest.fixture
def mps(mps_factory: Callable[[], Mps]) -> Mps:
    return mps_factory()


# ----- the command interpreter on its own (no processes) -----------------------------------------------------------


def fresh_state() -> ControlState:
    return ControlState(1000, visible_devices=GPU0, namespace="4026531836", pid_in_use=lambda pid: False)


@pytest.mark.parametrize(
    ("commands", "expected"),
    [
        (["get_default_active_thread_percentage"], "100.0"),
        (["set_default_active_thread_percentage 10"], "10.0"),
        (["set_default_active_thread_percentage 33.33", "get_default_active_thread_percentage"], "33.3"),
        (["set_default_active_thread_percentage 100"], "100.0"),
        (["set_default_active_thread_percentage 0"], "Invalid active thread percentage: 0 (must be > 0 and <= 100)"),
        (
            ["set_default_active_thread_percentage 101"],
            "Invalid active thread percentage: 101 (must be > 0 and <= 100)",
        ),
        (["set_default_active_thread_percentage -5"], "Invalid active thread percentage: -5 (must be > 0 and <= 100)"),
        (
            ["set_default_active_thread_percentage nan"],
            "Invalid active thread percentage: nan (must be > 0 and <= 100)",
        ),
        (
            ["set_default_active_thread_percentage"],
            "Invalid arguments. Usage: set_default_active_thread_percentage <percentage>",
        ),
        (["set_default_device_pinned_mem_limit 0 10G"], ""),
        (["set_default_device_pinned_mem_limit 0 10G", "get_default_device_pinned_mem_limit 0"], "10G"),
        ([f"set_default_device_pinned_mem_limit {GPU0} 4096M", f"get_default_device_pinned_mem_limit {GPU0}"], "4096M"),
        (["set_default_device_pinned_mem_limit 0 10G", f"get_default_device_pinned_mem_limit {GPU0}"], ""),
        (["get_default_device_pinned_mem_limit 0"], ""),
        (
            ["set_default_device_pinned_mem_limit 0 10"],
            "Invalid pinned memory limit: 10 (expected an integer followed by G or M)",
        ),
        (
            ["set_default_device_pinned_mem_limit 0 10K"],
            "Invalid pinned memory limit: 10K (expected an integer followed by G or M)",
        ),
        (
            ["set_default_device_pinned_mem_limit 0 0G"],
            "Invalid pinned memory limit: 0G (expected an integer followed by G or M)",
        ),
        (["set_default_device_pinned_mem_limit 0;rm 1G"], "Invalid device: 0;rm"),
        (["get_server_list"], ""),
        (["start_server -uid 0"], ""),
        (["start_server -uid 0", "get_server_list"], "1001"),
        (["start_server -uid 0", "start_server -uid 0", "get_server_list"], "1001"),
        (["start_server -uid 0", "start_server -uid 1000 -mlopart", "get_server_list"], "1001\n1002"),
        (["start_server -uid root"], "Invalid arguments. Usage: start_server -uid <uid> [-mlopart]"),
        (["start_server 0"], "Invalid arguments. Usage: start_server -uid <uid> [-mlopart]"),
        (["start_server -uid 0", "get_server_status 1001"], "ACTIVE"),
        (["start_server -uid 0", "get_client_list 1001"], ""),
        (["get_client_list 1001"], "Server 1001 not found"),
        (["get_client_list abc"], "Invalid PID: abc"),
        (["start_server -uid 0", "shutdown_server 1001 -f", "get_server_list"], ""),
        (["start_server -uid 0", "shutdown_server 1001 -x"], "Invalid arguments. Usage: shutdown_server <PID> [-f]"),
        (["shutdown_server 77"], "Server 77 not found"),
        (["start_server -uid 0", "get_active_thread_percentage 1001"], "100.0"),
        (["start_server -uid 0", "set_active_thread_percentage 1001 20"], "20.0"),
        (["start_server -uid 0", "set_active_thread_percentage 1001 20", "get_active_thread_percentage 1001"], "20.0"),
        (
            ["set_default_active_thread_percentage 25", "start_server -uid 0", "get_active_thread_percentage 1001"],
            "25.0",
        ),
        (
            ["start_server -uid 0", "set_default_active_thread_percentage 25", "get_active_thread_percentage 1001"],
            "100.0",
        ),
        (
            ["set_default_device_pinned_mem_limit 0 2G", "start_server -uid 0", "get_device_pinned_mem_limit 1001 0"],
            "2G",
        ),
        (["start_server -uid 0", "set_default_device_pinned_mem_limit 0 2G", "get_device_pinned_mem_limit 1001 0"], ""),
        (
            ["start_server -uid 0", "set_device_pinned_mem_limit 1001 1 512M", "get_device_pinned_mem_limit 1001 1"],
            "512M",
        ),
        (["start_server -uid 0", "terminate_client 1001 4242"], "0"),
        (["terminate_client 1001 4242"], "Server 1001 not found"),
        (["ps"], "PID ID SERVER DEVICE NAMESPACE COMMAND"),
        (
            ["start_server -uid 0", "ps"],
            "PID ID SERVER DEVICE NAMESPACE COMMAND\n1001 0 - GPU-8f6e3c2 4026531836 nvidia-cuda-mps-server",
        ),
        (["start_server -uid 0", "ps -p 999"], "PID ID SERVER DEVICE NAMESPACE COMMAND"),
        (["get_default_client_priority"], "0"),
        (["set_default_client_priority 1", "get_default_client_priority"], "1"),
        (["set_default_client_priority 2"], "Invalid client priority: 2 (must be 0 or 1)"),
        (["quit -t abc"], "Invalid arguments. Usage: quit [-t <timeout>]"),
        (["quit -t 5"], ""),
        (["frobnicate 1 2"], "Unrecognized command: frobnicate"),
        (["sm_partition add GPU-x 2"], "Unrecognized command: sm_partition"),
        (["   get_default_active_thread_percentage   "], "100.0"),
    ],
)
def test_command_outputs(commands: list[str], expected: str) -> None:
    state = fresh_state()
    replies = [state.execute(command) for command in commands]
    assert replies[-1].text == expected


def test_quit_reports_and_forgets_servers() -> None:
    state = fresh_state()
    state.execute("start_server -uid 0")
    reply = state.execute("quit")
    assert reply.quit and reply.text == ""
    assert reply.log == [(1000, "Server 1001 exited with status 0")]


def test_server_pids_avoid_live_processes() -> None:
    state = ControlState(1000, pid_in_use=lambda pid: pid in (1001, 1002))
    state.execute("start_server -uid 0")
    assert state.execute("get_server_list").text == "1003"


def test_log_line_format() -> None:
    when = datetime(2026, 5, 31, 23, 46, 49, 893512)
    assert format_log_line(6, "NEW UI", now=when) == "[2026-05-31 23:46:49.893 Control     6] NEW UI"
    assert format_log_line(11107, "UI closed", now=when) == "[2026-05-31 23:46:49.893 Control 11107] UI closed"
    assert LOG_LINE.match(format_log_line(1234567, "x", now=when))


# ----- the executable: daemon, client, control log -----------------------------------------------------------------


def test_daemon_starts_listens_and_answers(mps: Mps) -> None:
    pid = mps.start()
    assert stat.S_ISSOCK(mps.socket.stat().st_mode)
    assert stat.S_IMODE(mps.socket.stat().st_mode) == 0o600
    assert mps.pid_file.read_text() == f"{pid}\n"
    out = mps.send(
        "get_default_active_thread_percentage\n"
        "set_default_active_thread_percentage 10\n"
        "get_default_active_thread_percentage\n"
        f"set_default_device_pinned_mem_limit 0 20389M\n"
        f"set_default_device_pinned_mem_limit {GPU1} 4096M\n"
        "get_default_device_pinned_mem_limit 0\n"
        f"get_default_device_pinned_mem_limit {GPU1}\n"
        f"get_default_device_pinned_mem_limit {GPU0}\n"
        "get_server_list\n"
        "get_default_client_priority\n"
    )
    assert out == "100.0\n10.0\n10.0\n20389M\n4096M\n0\n"


def test_limits_are_remembered_across_clients_and_copied_into_later_servers(mps: Mps) -> None:
    mps.start()
    assert mps.send("set_default_active_thread_percentage 25\n") == "25.0\n"
    assert mps.send("set_default_device_pinned_mem_limit 0 10G\n") == ""
    assert mps.send("start_server -uid 0\n") == ""
    (server,) = mps.send("get_server_list\n").split()
    assert mps.send("set_default_active_thread_percentage 50\nset_default_device_pinned_mem_limit 0 5G\n") == "50.0\n"
    out = mps.send(
        f"get_active_thread_percentage {server}\n"
        f"get_device_pinned_mem_limit {server} 0\n"
        "get_default_active_thread_percentage\n"
        "get_default_device_pinned_mem_limit 0\n"
        f"set_active_thread_percentage {server} 20\n"
        f"get_active_thread_percentage {server}\n"
        f"terminate_client {server} 4242\n"
        f"get_client_list {server}\n"
    )
    assert out == "25.0\n10G\n50.0\n5G\n20.0\n20.0\n0\n"
    ps = mps.send("ps\n").splitlines()
    assert ps[0] == "PID ID SERVER DEVICE NAMESPACE COMMAND"
    assert ps[1].split()[0] == server and ps[1].split()[3] == GPU0[:11]
    assert ps[1].endswith(" nvidia-cuda-mps-server")
    assert mps.send(f"shutdown_server {server}\nget_server_list\n") == ""


def test_errors_are_lines_on_stdout_and_the_client_still_exits_zero(mps: Mps) -> None:
    mps.start()
    out = mps.send(
        "frobnicate\n"
        "set_default_active_thread_percentage 0\n"
        "set_default_active_thread_percentage 100.5\n"
        "set_default_device_pinned_mem_limit 0 10K\n"
        "set_default_device_pinned_mem_limit 0\n"
        "get_active_thread_percentage 99999\n"
        "get_default_active_thread_percentage\n"
    )
    assert out.splitlines() == [
        "Unrecognized command: frobnicate",
        "Invalid active thread percentage: 0 (must be > 0 and <= 100)",
        "Invalid active thread percentage: 100.5 (must be > 0 and <= 100)",
        "Invalid pinned memory limit: 10K (expected an integer followed by G or M)",
        "Invalid arguments. Usage: set_default_device_pinned_mem_limit <dev> <value>",
        "Server 99999 not found",
        "100.0",
    ]


def test_hostile_input_is_bounded_and_rejected(mps: Mps) -> None:
    mps.start()
    result = mps.run(stdin="x" * 100_000 + "\nget_default_active_thread_percentage\n")
    assert result.returncode == 0
    assert result.stdout == "Command too long (more than 4096 bytes)\n100.0\n"
    result = subprocess.run(
        [BINARY],
        input="get_default_active_thread_percentage \u00e9\n$(touch /tmp/pwned)\nquit`id`\n".encode(),
        capture_output=True,
        env=mps.env,
        timeout=10,
        check=False,
    )
    assert result.returncode == 0
    assert result.stdout.decode().splitlines() == [
        "Invalid command: only printable ASCII is accepted",
        "Unrecognized command: $(touch",
        "Unrecognized command: quit`id`",
    ]
    # a raw client that ignores the client's own check: the daemon drops the overlong line and carries on
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
        raw.settimeout(5)
        raw.connect(str(mps.socket))
        raw.sendall(b"UI\n" + b"y" * 100_000 + b"\nget_default_client_priority\n")
        raw.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := raw.recv(65536):
            data += chunk
    too_long = b"Command too long (more than 4096 bytes)"
    assert data == struct.pack(">I", len(too_long)) + too_long + struct.pack(">I", 1) + b"0"
    assert mps.send("get_default_active_thread_percentage\n") == "100.0\n"


def test_last_command_without_trailing_newline(mps: Mps) -> None:
    mps.start()
    assert mps.send("set_default_device_pinned_mem_limit 0 1024M") == ""
    assert mps.send("set_default_active_thread_percentage 10") == "10.0\n"
    assert mps.send("get_default_device_pinned_mem_limit 1\r\nget_default_device_pinned_mem_limit 0") == "1024M\n"
    assert mps.send("\n\n  \nget_default_active_thread_percentage") == "10.0\n"
    assert mps.send("") == ""


def test_control_log_has_the_real_format_and_messages(mps: Mps) -> None:
    pid = mps.start()
    mps.send("set_default_active_thread_percentage 10\nstart_server -uid 0\n")
    server = mps.send("get_server_list\n").strip()
    lines = mps.log.read_text().splitlines()
    assert lines and all(LOG_LINE.match(line) for line in lines), lines
    assert all(f"Control {pid:>5}] " in line for line in lines if f"server {server} " not in line)
    messages = mps.log_messages()
    assert messages[:3] == [
        f"Starting control daemon using socket {mps.pipe}/control",
        f"To connect CUDA applications to this daemon, set env CUDA_MPS_PIPE_DIRECTORY={mps.pipe}",
        "CUDA MPS Control binary version: 13000",
    ]
    assert messages[4:] == [
        "Accepting connection...",
        "NEW UI",
        "Cmd:set_default_active_thread_percentage 10",
        "10.0",
        "Cmd:start_server -uid 0",
        f"Starting new server {server} for user 0",
        f"NEW SERVER {server}: Ready",
        "UI closed",
        "Accepting connection...",
        "NEW UI",
        "Cmd:get_server_list",
        server,
        "UI closed",
    ]
    assert f"Control {int(server):>5}] Starting new server" in mps.log.read_text()


def test_cuda_visible_devices_reaches_the_daemon(mps: Mps) -> None:
    pid = mps.start()
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert f"CUDA_VISIBLE_DEVICES={GPU0},{GPU1}".encode() in environ
    assert f"CUDA_MPS_PIPE_DIRECTORY={mps.pipe}".encode() in environ
    assert f"[emulator] CUDA_VISIBLE_DEVICES={GPU0},{GPU1}" in mps.log_messages()


def test_daemon_environment_sets_the_defaults(mps: Mps) -> None:
    env = dict(
        mps.env,
        CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="25",
        CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=f"0=1G,{GPU1}=512MB,bad",
    )
    mps.start(env=env)
    out = mps.send(
        "get_default_active_thread_percentage\n"
        "get_default_device_pinned_mem_limit 0\n"
        f"get_default_device_pinned_mem_limit {GPU1}\n"
    )
    assert out == "25.0\n1G\n512M\n"


def test_second_daemon_on_the_same_pipe_is_refused(mps: Mps) -> None:
    pid = mps.start()
    result = mps.run("-d")
    assert result.returncode != 0
    assert "An instance of this daemon is already running" in result.stderr
    assert mps.daemon_pid() == pid and process_alive(pid)
    assert mps.send("get_default_active_thread_percentage\n") == "100.0\n"
    foreground = mps.run("-f")
    assert foreground.returncode != 0 and "already running" in foreground.stderr


def test_client_without_daemon_fails(mps: Mps) -> None:
    result = mps.run(stdin="get_default_active_thread_percentage\n")
    assert result.returncode != 0
    assert result.stdout == ""
    assert "Cannot find MPS control daemon process" in result.stderr
    result = mps.run(stdin="get_server_list\n", env=dict(mps.env, CUDA_MPS_PIPE_DIRECTORY=str(mps.root / "nope")))
    assert result.returncode != 0 and "Cannot find MPS control daemon process" in result.stderr


def test_quit_removes_socket_and_pid_file_and_exits(mps: Mps) -> None:
    pid = mps.start()
    mps.send("set_default_active_thread_percentage 10\nstart_server -uid 0\n")
    assert mps.send("quit\n") == ""
    assert not mps.socket.exists() and not mps.pid_file.exists()  # gone by the time the client returns
    wait_until(lambda: not process_alive(pid), what="the daemon to exit")
    messages = mps.log_messages()
    assert messages[-3] == "Cmd:quit" and messages[-1] == "Exit"
    assert re.fullmatch(r"Server \d+ exited with status 0", messages[-2])
    assert mps.run(stdin="get_server_list\n").returncode != 0
    # limits are lost on quit
    pid2 = mps.start()
    assert pid2 != pid
    assert mps.send("get_default_active_thread_percentage\nget_server_list\n") == "100.0\n"
    assert mps.send("quit -t 5\nget_server_list\n") == ""  # nothing after quit reaches a daemon
    wait_until(lambda: not process_alive(pid2), what="the second daemon to exit")


def test_sigterm_is_a_clean_exit(mps: Mps) -> None:
    pid = mps.start()
    os.kill(pid, signal.SIGTERM)
    wait_until(lambda: not process_alive(pid), what="the daemon to exit on SIGTERM")
    assert not mps.socket.exists() and not mps.pid_file.exists()
    assert mps.log_messages()[-1] == "Exit"


def test_sigkill_leaves_stale_files_and_a_new_daemon_replaces_them(mps: Mps) -> None:
    pid = mps.start()
    mps.send("set_default_active_thread_percentage 10\n")
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not process_alive(pid), what="the daemon to die")
    assert mps.socket.exists() and mps.pid_file.exists()  # stale
    failed = mps.run(stdin="get_default_active_thread_percentage\n")
    assert failed.returncode != 0 and "Cannot find MPS control daemon process" in failed.stderr
    pid2 = mps.start()
    assert pid2 != pid
    assert mps.send("get_default_active_thread_percentage\n") == "100.0\n"
    assert stat.S_IMODE(mps.socket.stat().st_mode) == 0o600


def test_stale_socket_without_pid_file_is_replaced(mps: Mps) -> None:
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(mps.socket))
    stale.close()  # the socket file stays, nobody listens
    mps.start()
    assert mps.send("get_default_client_priority\n") == "0\n"


def test_concurrent_clients(mps: Mps) -> None:
    mps.start()
    results: list[str] = []
    lock = threading.Lock()

    def client(n: int) -> None:
        out = mps.send(f"set_default_device_pinned_mem_limit {n} {n + 1}G\nget_default_device_pinned_mem_limit {n}\n")
        with lock:
            results.append(out)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=15)
    assert sorted(results) == sorted(f"{n + 1}G\n" for n in range(8))


def test_long_pipe_directory_is_refused(mps: Mps) -> None:
    base = str(mps.root / "q")
    too_long = Path(base + "x" * (88 - len(base)))
    just_fits = Path(base + "y" * (87 - len(base)))
    too_long.mkdir()
    just_fits.mkdir()
    result = mps.run("-d", env=dict(mps.env, CUDA_MPS_PIPE_DIRECTORY=str(too_long)))
    assert result.returncode != 0 and "87" in result.stderr
    assert not (too_long / "control").exists()
    fits = dict(mps.env, CUDA_MPS_PIPE_DIRECTORY=str(just_fits))
    assert mps.run("-d", env=fits).returncode == 0
    mps.started.add(int((just_fits / "nvidia-cuda-mps-control.pid").read_text()))
    assert mps.run(stdin="quit\n", env=fits).returncode == 0


def test_missing_pipe_directory_is_refused(mps: Mps) -> None:
    result = mps.run("-d", env=dict(mps.env, CUDA_MPS_PIPE_DIRECTORY=str(mps.root / "missing")))
    assert result.returncode != 0 and "does not exist" in result.stderr
    assert not (mps.root / "missing").exists()


def test_foreground_mode_logs_on_stdout_too(mps: Mps) -> None:
    proc = subprocess.Popen([BINARY, "-f"], env=mps.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    mps.started.add(proc.pid)  # the exec script keeps the pid
    try:
        wait_until(mps.socket.exists, what="the foreground daemon's socket")
        assert mps.daemon_pid() == proc.pid
        assert mps.send("set_default_active_thread_percentage 40\n") == "40.0\n"
        assert proc.stdout is not None
        seen = b""
        deadline = time.monotonic() + 5
        while b"] UI closed\n" not in seen and time.monotonic() < deadline:
            if select.select([proc.stdout], [], [], 0.1)[0]:
                seen += os.read(proc.stdout.fileno(), 65536)
        lines = seen.decode().splitlines()
        assert all(LOG_LINE.match(line) for line in lines)
        assert [line.split("] ", 1)[1] for line in lines] == mps.log_messages()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
        assert not mps.socket.exists() and not mps.pid_file.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def test_version_and_bad_options(mps: Mps) -> None:
    version = mps.run("-v")
    assert version.returncode == 0 and "13000" in version.stdout
    bad = mps.run("-x")
    assert bad.returncode != 0 and "Usage" in bad.stderr


# ----- clients (agent.sim.mps.client): held to the server's limits, which their own variables can only lower ------


def run_app(mps: Mps, *allocations: int, device: str = GPU0, **env: str) -> tuple[int, list[dict]]:
    """A CUDA application (``agent.sim.mps.client``) with the pipe directory and ``env``; its status and lines."""
    import json

    environment = {"PATH": mps.env["PATH"], "CUDA_MPS_PIPE_DIRECTORY": str(mps.pipe), **env}
    command = [sys.executable, "-m", "agent.sim.mps.client", "--device", device]
    command += [f"--allocate={mib}" for mib in allocations]
    done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode in (0, 2), done
    return done.returncode, [json.loads(line) for line in done.stdout.splitlines()]


def test_a_client_is_held_to_its_servers_limits_and_its_own_variables_can_only_lower_them(mps: Mps) -> None:
    mps.start()
    mps.send(f"set_default_device_pinned_mem_limit {GPU0} 2G\nset_default_active_thread_percentage 50\n")
    status, lines = run_app(mps, 2048, 1)  # no variables: the server's limits
    assert (lines[0]["pinned_limit_mib"], lines[0]["active_thread_percentage"]) == (2048, 50.0)
    assert status == 2 and lines[2] == {
        "allocate_mib": 1,
        "ok": False,
        "error": "cudaErrorMemoryAllocation: out of memory",
    }
    _, lines = run_app(mps, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=8G", CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="90")
    assert (lines[0]["pinned_limit_mib"], lines[0]["active_thread_percentage"]) == (2048, 50.0)  # not raised
    _, lines = run_app(mps, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=f"{GPU0}=512MB", CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="20")
    assert (lines[0]["pinned_limit_mib"], lines[0]["active_thread_percentage"]) == (512, 20.0)  # lowered
    _, lines = run_app(mps, device=GPU1)  # no limit set for the second device
    assert lines[0]["pinned_limit_mib"] is None
    assert "NEW CLIENT 0 from user" in "\n".join(mps.log_messages())  # the first client started the server


def test_defaults_reach_later_servers_and_a_running_servers_limit_its_new_clients(mps: Mps) -> None:
    mps.start()
    mps.send("set_default_device_pinned_mem_limit 0 4G\n")  # by ordinal: GPU0 is CUDA_VISIBLE_DEVICES' first
    _, lines = run_app(mps)
    server = lines[0]["server"]
    assert lines[0]["pinned_limit_mib"] == 4096
    mps.send("set_default_device_pinned_mem_limit 0 1G\n")  # defaults: for servers started later only
    assert run_app(mps)[1][0]["pinned_limit_mib"] == 4096
    mps.send(f"set_device_pinned_mem_limit {server} {GPU0} 1G\n")  # the running server: its new clients
    assert run_app(mps)[1][0]["pinned_limit_mib"] == 1024
