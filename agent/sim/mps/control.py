"""An executable emulator of NVIDIA's ``nvidia-cuda-mps-control`` (Legacy MPS v2 interface), stdlib only.

Run it as ``python -m agent.sim.mps.control`` or as the console script ``tessera-sim-mps-control``; tests put it on
``PATH`` under the real name so that code driving ``nvidia-cuda-mps-control`` cannot tell the difference. It speaks
over a real unix socket between real processes:

* ``-d`` starts the control daemon in the background (double fork + ``setsid``). The caller gets exit status 0 only
  once the daemon listens on ``$CUDA_MPS_PIPE_DIRECTORY/control`` (mode 0600) and has written
  ``nvidia-cuda-mps-control.pid`` there; otherwise it prints the reason on stderr and exits 1, e.g.
  ``An instance of this daemon is already running``. ``-f`` runs the same daemon in the foreground and copies every
  log line to stdout. ``-v`` prints a version line.
* With no argument it is a client: it reads newline-separated commands from stdin until EOF (a last command without
  a trailing newline is accepted), sends each to the daemon and prints each reply on stdout. It exits 0 when it could
  talk to the daemon, even if a command was rejected (the error is a line on stdout), and 1 with
  ``Cannot find MPS control daemon process`` on stderr when there is no daemon or the connection breaks.
* The daemon appends to ``$CUDA_MPS_LOG_DIRECTORY/control.log`` in the real line format
  ``[YYYY-MM-DD HH:MM:SS.mmm Control <pid>] <msg>`` (local time, pid right-aligned in 5 columns after one space)
  with the real messages: ``Starting control daemon using socket ...``, ``To connect CUDA applications ...``,
  ``Accepting connection...``, ``NEW UI``, ``Cmd:<command>``, each reply line, ``UI closed``, ``Exit``.
* Both directories must exist (the NVIDIA k8s daemon creates them); a pipe directory path longer than 87 characters
  is refused, as the real daemon fails to start with one. ``CUDA_VISIBLE_DEVICES`` is kept in the daemon's
  environment (``/proc/<pid>/environ``), logged at start (an emulator-only line; the real log does not show it) and
  used for the DEVICE column of ``ps``. ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` and ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``
  (``0=1G,GPU-...=512MB``) on the daemon set the defaults that ``get_default_*`` report and new servers inherit.
* SIGTERM (and SIGINT) make the daemon remove its socket and pid file, log ``Exit`` and exit 0. After a SIGKILL the
  stale socket and pid file remain; a new daemon on the same directory replaces a socket nobody answers on. Single
  ownership is an exclusive ``flock`` on the pid file, held for the daemon's lifetime and released by the kernel
  when it dies.

MPS servers are records, not processes: ``start_server -uid <uid>`` gives a server a PID that no live process uses,
and ``get_server_list``/``ps``/the per-server commands report it. One server per UID (``start_server`` for a UID that
has one is a no-op); servers of different UIDs coexist (the real Legacy daemon would queue the second UID). Nothing
is written to server.log.

Clients are real processes: ``agent.sim.mps.client`` stands in for a CUDA application. It connects with its own
``CUDA_MPS_PIPE_DIRECTORY``, PID, UID and device, and with whatever ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` and
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` it has; the daemon gives it its UID's server (starting one that copies the
defaults, as the real control daemon does when a client arrives) and holds it to the **server's** limits, lowered by
the client's own variables but never raised by them (facts mig-mps.md (d)): a pinned-memory limit per device,
looked up by the device's UUID or its ordinal among the daemon's ``CUDA_VISIBLE_DEVICES``, and the active thread
percentage. The limits are fixed when the client connects (a client keeps the limits it started with). Each
allocation the client asks for succeeds only while its total stays within its memory limit; beyond it the answer is
CUDA's out-of-memory error. A connected client is in its server's ``get_client_list``; it leaves when it
disconnects. Defaults set with ``set_default_*`` are copied into servers
started later; existing servers keep their values; everything is lost on ``quit``, after which the client stops
reading stdin. SIGHUP is ignored. ``sm_partition``/``lspart``/``device_query`` (CUDA 13.1+) are unrecognized, as
the emulated binary version is 13000.

Parsing is strict and bounded: a command is one line of printable ASCII (at most ``MAX_COMMAND_BYTES`` bytes; a
longer line is dropped with an error line), split on whitespace, with every argument matched against a pattern
(PIDs, UIDs, percentages ``0 < p <= 100``, limits ``<int>G|M``, device strings ``[A-Za-z0-9][A-Za-z0-9_.:/-]*``).
Nothing is evaluated and nothing runs a shell. At most ``MAX_CONNECTIONS`` UIs are served at once.

Wire protocol between this client and this daemon (private to the emulator): the client sends ``UI\\n``, then one
command per line; the daemon answers each command with a 4-byte big-endian length and that many bytes of UTF-8
reply text (no trailing newline; empty for commands that print nothing).

Choices where no source gave the real text or behaviour [U]: the error lines (``Unrecognized command: <name>``,
``Invalid arguments. Usage: <usage>``, ``Server <pid> not found``, ``Invalid active thread percentage: ...``, ...),
the ``-v`` line, the ``ps`` rows (single spaces; ``ID`` a counter, ``SERVER`` ``-`` for a server, ``DEVICE`` the
first 11 characters of the first ``CUDA_VISIBLE_DEVICES`` entry, ``NAMESPACE`` the daemon's pid namespace inode),
``get_server_status`` printing ``ACTIVE``, ``shutdown_server``/``start_server``/``set_default_client_priority``
printing nothing, the refusal messages going to stderr, and ``get_default_device_pinned_mem_limit`` /
``get_device_pinned_mem_limit`` printing the value exactly as it was set (e.g. ``20389M``) and **nothing** when no
limit was set for that exact device string (``0`` and the GPU's UUID are different keys, stored as given).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import select
import signal
import socket
import stat
import struct
import sys
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import BinaryIO, TextIO

from msgspec import Struct, field

PROG = "nvidia-cuda-mps-control"
DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"  # noqa: S108 - NVIDIA's default, not a temp file of ours
DEFAULT_LOG_DIRECTORY = "/var/log/nvidia-mps"
CONTROL_SOCKET = "control"
PID_FILE = "nvidia-cuda-mps-control.pid"
CONTROL_LOG = "control.log"
BINARY_VERSION = 13000  # CUDA 13.0: before static partitioning (sm_partition, lspart, -S are 13.1+)
MAX_PIPE_DIRECTORY_CHARS = 87

MAX_COMMAND_BYTES = 4096
MAX_REPLY_BYTES = 1 << 20
MAX_CONNECTIONS = 64
MAX_SERVERS = 1024
MAX_LIMIT_KEYS = 1024
UI_IDLE_TIMEOUT = 600.0
START_TIMEOUT = 10.0
QUIT_REPLY_TIMEOUT = 5.0
HELLO = b"UI\n"
CLIENT_HELLO = b"CLIENT\n"  # an emulated CUDA application (agent.sim.mps.client), private to the emulator
OUT_OF_MEMORY = "cudaErrorMemoryAllocation: out of memory"
_ALLOC_RE = re.compile(r"ALLOC ([1-9][0-9]{0,9})")
_SIZE_RE = re.compile(r"([1-9][0-9]{0,11})(G|M|GB|MB)")

NO_DAEMON = "Cannot find MPS control daemon process"
ALREADY_RUNNING = "An instance of this daemon is already running"
USAGE = f"Usage: {PROG} [-d | -f | -v]"

_PID_RE = re.compile(r"[1-9][0-9]{0,9}")
_UID_RE = re.compile(r"[0-9]{1,10}")
_PCT_RE = re.compile(r"[0-9]{1,3}(?:\.[0-9]{1,6})?")
_LIMIT_RE = re.compile(r"[1-9][0-9]{0,11}[GM]")
_DEV_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}")
_TIMEOUT_RE = re.compile(r"[0-9]{1,6}")
_PRINTABLE = re.compile(r"[\x20-\x7e]*")


class CommandError(Exception):
    """A rejected command; its message is the error line the client prints on stdout."""


def format_log_line(pid: int, message: str, role: str = "Control", now: datetime | None = None) -> str:
    """``[2026-05-31 23:46:49.893 Control 11107] message``, the format of control.log and server.log."""
    now = now or datetime.now()
    return f"[{now:%Y-%m-%d %H:%M:%S}.{now.microsecond // 1000:03d} {role} {pid:>5}] {message}"


def _printable(text: str) -> str:
    return text if _PRINTABLE.fullmatch(text) else "".join(c if " " <= c <= "~" else "?" for c in text)


def _pct(token: str) -> float:
    value = float(token) if _PCT_RE.fullmatch(token) else -1.0
    if not 0.0 < value <= 100.0:
        raise CommandError(f"Invalid active thread percentage: {_printable(token)} (must be > 0 and <= 100)")
    return value


def _limit(token: str) -> str:
    if not _LIMIT_RE.fullmatch(token):
        raise CommandError(f"Invalid pinned memory limit: {_printable(token)} (expected an integer followed by G or M)")
    return token


def _dev(token: str) -> str:
    if not _DEV_RE.fullmatch(token):
        raise CommandError(f"Invalid device: {_printable(token)}")
    return token


def _pid(token: str) -> int:
    if not _PID_RE.fullmatch(token):
        raise CommandError(f"Invalid PID: {_printable(token)}")
    return int(token)


class Server(Struct):
    pid: int
    uid: int
    ident: int
    active_thread_percentage: float
    pinned_mem_limits: dict[str, str]
    client_priority: int
    clients: list[int] = field(default_factory=list)


class Client(Struct):
    """A connected client: its server and what it is held to (memory in MiB, None: unlimited)."""

    pid: int
    server: Server
    device: str
    pinned_limit_mib: int | None
    active_thread_percentage: float
    allocated_mib: int = 0

    def describe(self) -> dict[str, object]:
        return {
            "server": self.server.pid,
            "pinned_limit_mib": self.pinned_limit_mib,
            "active_thread_percentage": self.active_thread_percentage,
        }


def _mib(value: str) -> int | None:
    """A limit value (``10G``, ``512M``, ``512MB``) in MiB; None when it is not one."""
    match = _SIZE_RE.fullmatch(value.strip())
    if match is None:
        return None
    return int(match.group(1)) * (1024 if match.group(2).startswith("G") else 1)


def _client_limits(text: str | None) -> dict[str, int]:
    """A client's ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (``0=1G,GPU-...=512MB``): device string -> MiB."""
    limits: dict[str, int] = {}
    for entry in (text or "").split(",")[:MAX_LIMIT_KEYS]:
        dev, _, value = entry.partition("=")
        mib = _mib(value)
        if _DEV_RE.fullmatch(dev.strip()) and mib is not None:
            limits[dev.strip()] = mib
    return limits


class Reply(Struct):
    text: str = ""
    quit: bool = False
    log: list[tuple[int, str]] = field(default_factory=list)  # extra (pid, message) log lines, before the reply


class ControlState:
    """The daemon's state and command interpreter, without any I/O (the daemon serialises calls)."""

    def __init__(
        self,
        daemon_pid: int,
        visible_devices: str | None = None,
        default_active_thread_percentage: float = 100.0,
        namespace: str = "-",
        pid_in_use: Callable[[int], bool] | None = None,
    ) -> None:
        self.daemon_pid = daemon_pid
        self.visible_devices = visible_devices
        self.default_active_thread_percentage = default_active_thread_percentage
        self.default_pinned_mem_limits: dict[str, str] = {}
        self.default_client_priority = 0
        self.servers: dict[int, Server] = {}
        self.namespace = namespace
        self._pid_in_use = pid_in_use or (lambda pid: Path(f"/proc/{pid}").exists())
        self._next_pid = daemon_pid + 1
        self._next_ident = 0

    # -- helpers
    def _server(self, token: str) -> Server:
        pid = _pid(token)
        server = self.servers.get(pid)
        if server is None:
            raise CommandError(f"Server {pid} not found")
        return server

    def _fresh_pid(self) -> int:
        while self._pid_in_use(self._next_pid) or self._next_pid in self.servers:
            self._next_pid += 1
        pid = self._next_pid
        self._next_pid += 1
        return pid

    def _device_column(self) -> str:
        first = (self.visible_devices or "").split(",")[0].strip()
        if first.startswith(("GPU-", "MIG-")):
            return first[:11]
        return first if first else "-"

    @staticmethod
    def _store_limit(table: dict[str, str], dev: str, value: str) -> None:
        if dev not in table and len(table) >= MAX_LIMIT_KEYS:
            raise CommandError("Too many device pinned memory limits")
        table[dev] = value

    # -- the interpreter
    def execute(self, line: str) -> Reply:
        words = line.split()
        if not words:
            return Reply()
        name, args = words[0], words[1:]
        spec = _COMMANDS.get(name)
        if spec is None:
            return Reply(f"Unrecognized command: {_printable(name)[:64]}")
        usage, arity, handler = spec
        if not arity[0] <= len(args) <= arity[1]:
            return Reply(f"Invalid arguments. Usage: {usage}")
        try:
            return handler(self, args)
        except CommandError as error:
            return Reply(str(error))

    # -- clients (agent.sim.mps.client)
    def _device_keys(self, device: str) -> list[str]:
        """The strings a limit may name ``device`` by: itself, and its UUID or ordinal among the visible devices."""
        visible = [d.strip() for d in (self.visible_devices or "").split(",") if d.strip()]
        keys = [device]
        if device in visible:
            keys.append(str(visible.index(device)))
        elif device.isdigit() and int(device) < len(visible):
            keys.append(visible[int(device)])
        return keys

    def connect_client(
        self, pid: int, uid: int, device: str, env_limits: str | None, env_threads: str | None
    ) -> tuple[Client, list[tuple[int, str]]]:
        """A client arrives: its UID's server (started with the defaults if it has none) and its limits."""
        log: list[tuple[int, str]] = []
        server = next((s for s in self.servers.values() if s.uid == uid), None)
        ident = sum(len(s.clients) for s in self.servers.values())
        if server is None:
            log.append((self.daemon_pid, f"NEW CLIENT {ident} from user {uid}: Server is not ready, push client to "
                        "pending list"))  # fmt: skip
            started = self.start_server(["-uid", str(uid)])
            log += started.log
            server = next(s for s in self.servers.values() if s.uid == uid)
        else:
            log.append((self.daemon_pid, f"NEW CLIENT {ident} from user {uid}: Server already exists"))
        keys = self._device_keys(device)
        held = [m for m in (_mib(server.pinned_mem_limits.get(k, "")) for k in keys) if m is not None]
        own = _client_limits(env_limits)
        held += [own[k] for k in keys if k in own]  # the client's own can only lower the server's
        threads = server.active_thread_percentage
        with contextlib.suppress(CommandError):  # a malformed variable is ignored, as CUDA ignores it
            threads = min(threads, _pct(env_threads)) if env_threads else threads
        client = Client(pid, server, device, min(held) if held else None, threads)
        server.clients.append(pid)
        return client, log

    def allocate(self, client: Client, mib: int) -> str:
        """``OK`` when the client may pin ``mib`` more MiB on its device, else CUDA's out-of-memory error."""
        if client.pinned_limit_mib is not None and client.allocated_mib + mib > client.pinned_limit_mib:
            return OUT_OF_MEMORY
        client.allocated_mib += mib
        return "OK"

    def disconnect_client(self, client: Client) -> None:
        if client.pid in client.server.clients:
            client.server.clients.remove(client.pid)

    def get_server_list(self, args: list[str]) -> Reply:
        return Reply("\n".join(str(pid) for pid in self.servers))

    def get_server_status(self, args: list[str]) -> Reply:
        self._server(args[0])
        return Reply("ACTIVE")

    def start_server(self, args: list[str]) -> Reply:
        if args[0] != "-uid" or not _UID_RE.fullmatch(args[1]) or args[2:] not in ([], ["-mlopart"]):
            raise CommandError("Invalid arguments. Usage: start_server -uid <uid> [-mlopart]")
        uid = int(args[1])
        if uid > 0xFFFFFFFE:
            raise CommandError(f"Invalid uid: {uid}")
        if any(server.uid == uid for server in self.servers.values()):
            return Reply()
        if len(self.servers) >= MAX_SERVERS:
            raise CommandError("Too many servers")
        pid = self._fresh_pid()
        self.servers[pid] = Server(
            pid=pid,
            uid=uid,
            ident=self._next_ident,
            active_thread_percentage=self.default_active_thread_percentage,
            pinned_mem_limits=dict(self.default_pinned_mem_limits),
            client_priority=self.default_client_priority,
        )
        self._next_ident += 1
        # the real "Starting new server" line is written by the forked server process, with its own pid
        return Reply(
            log=[(pid, f"Starting new server {pid} for user {uid}"), (self.daemon_pid, f"NEW SERVER {pid}: Ready")]
        )

    def shutdown_server(self, args: list[str]) -> Reply:
        if args[1:] not in ([], ["-f"]):
            raise CommandError("Invalid arguments. Usage: shutdown_server <PID> [-f]")
        server = self._server(args[0])
        del self.servers[server.pid]
        return Reply(log=[(self.daemon_pid, f"Server {server.pid} exited with status 0")])

    def get_client_list(self, args: list[str]) -> Reply:
        return Reply("\n".join(str(pid) for pid in self._server(args[0]).clients))

    def get_device_client_list(self, args: list[str]) -> Reply:
        servers = [self._server(args[0])] if args else list(self.servers.values())
        return Reply("\n".join(str(pid) for server in servers for pid in server.clients))

    def set_default_active_thread_percentage(self, args: list[str]) -> Reply:
        self.default_active_thread_percentage = _pct(args[0])
        return Reply(f"{self.default_active_thread_percentage:.1f}")

    def get_default_active_thread_percentage(self, args: list[str]) -> Reply:
        return Reply(f"{self.default_active_thread_percentage:.1f}")

    def set_active_thread_percentage(self, args: list[str]) -> Reply:
        server = self._server(args[0])
        server.active_thread_percentage = _pct(args[1])
        return Reply(f"{server.active_thread_percentage:.1f}")

    def get_active_thread_percentage(self, args: list[str]) -> Reply:
        return Reply(f"{self._server(args[0]).active_thread_percentage:.1f}")

    def set_default_device_pinned_mem_limit(self, args: list[str]) -> Reply:
        self._store_limit(self.default_pinned_mem_limits, _dev(args[0]), _limit(args[1]))
        return Reply()

    def get_default_device_pinned_mem_limit(self, args: list[str]) -> Reply:
        return Reply(self.default_pinned_mem_limits.get(_dev(args[0]), ""))

    def set_device_pinned_mem_limit(self, args: list[str]) -> Reply:
        server = self._server(args[0])
        self._store_limit(server.pinned_mem_limits, _dev(args[1]), _limit(args[2]))
        return Reply()

    def get_device_pinned_mem_limit(self, args: list[str]) -> Reply:
        server = self._server(args[0])
        return Reply(server.pinned_mem_limits.get(_dev(args[1]), ""))

    def terminate_client(self, args: list[str]) -> Reply:
        self._server(args[0])
        _pid(args[1])
        return Reply("0")

    def ps(self, args: list[str]) -> Reply:
        if args and (args[0] != "-p" or len(args) != 2):
            raise CommandError("Invalid arguments. Usage: ps [-p PID]")
        only = _pid(args[1]) if args else None
        rows = ["PID ID SERVER DEVICE NAMESPACE COMMAND"]
        for server in self.servers.values():
            if only is None or only == server.pid:
                rows.append(
                    f"{server.pid} {server.ident} - {self._device_column()} {self.namespace} nvidia-cuda-mps-server"
                )
        return Reply("\n".join(rows))

    def set_default_client_priority(self, args: list[str]) -> Reply:
        if args[0] not in ("0", "1"):
            raise CommandError(f"Invalid client priority: {_printable(args[0])} (must be 0 or 1)")
        self.default_client_priority = int(args[0])
        return Reply()

    def get_default_client_priority(self, args: list[str]) -> Reply:
        return Reply(str(self.default_client_priority))

    def quit(self, args: list[str]) -> Reply:
        if args and (args[0] != "-t" or len(args) != 2 or not _TIMEOUT_RE.fullmatch(args[1])):
            raise CommandError("Invalid arguments. Usage: quit [-t <timeout>]")
        log = [(self.daemon_pid, f"Server {pid} exited with status 0") for pid in self.servers]
        self.servers.clear()
        return Reply(quit=True, log=log)


# name -> (usage, (min args, max args), handler). Outputs are the real ones from the facts, except those listed as [U]
# in the module docstring.
_COMMANDS: dict[str, tuple[str, tuple[int, int], Callable[[ControlState, list[str]], Reply]]] = {
    "get_server_list": ("get_server_list", (0, 0), ControlState.get_server_list),
    "get_server_status": ("get_server_status <PID>", (1, 1), ControlState.get_server_status),
    "start_server": ("start_server -uid <uid> [-mlopart]", (2, 3), ControlState.start_server),
    "shutdown_server": ("shutdown_server <PID> [-f]", (1, 2), ControlState.shutdown_server),
    "get_client_list": ("get_client_list <PID>", (1, 1), ControlState.get_client_list),
    "get_device_client_list": ("get_device_client_list [<PID>]", (0, 1), ControlState.get_device_client_list),
    "set_default_active_thread_percentage": (
        "set_default_active_thread_percentage <percentage>",
        (1, 1),
        ControlState.set_default_active_thread_percentage,
    ),
    "get_default_active_thread_percentage": (
        "get_default_active_thread_percentage",
        (0, 0),
        ControlState.get_default_active_thread_percentage,
    ),
    "set_active_thread_percentage": (
        "set_active_thread_percentage <PID> <percentage>",
        (2, 2),
        ControlState.set_active_thread_percentage,
    ),
    "get_active_thread_percentage": (
        "get_active_thread_percentage <PID>",
        (1, 1),
        ControlState.get_active_thread_percentage,
    ),
    "set_default_device_pinned_mem_limit": (
        "set_default_device_pinned_mem_limit <dev> <value>",
        (2, 2),
        ControlState.set_default_device_pinned_mem_limit,
    ),
    "get_default_device_pinned_mem_limit": (
        "get_default_device_pinned_mem_limit <dev>",
        (1, 1),
        ControlState.get_default_device_pinned_mem_limit,
    ),
    "set_device_pinned_mem_limit": (
        "set_device_pinned_mem_limit <PID> <dev> <value>",
        (3, 3),
        ControlState.set_device_pinned_mem_limit,
    ),
    "get_device_pinned_mem_limit": (
        "get_device_pinned_mem_limit <PID> <dev>",
        (2, 2),
        ControlState.get_device_pinned_mem_limit,
    ),
    "terminate_client": ("terminate_client <server PID> <client PID>", (2, 2), ControlState.terminate_client),
    "ps": ("ps [-p PID]", (0, 2), ControlState.ps),
    "set_default_client_priority": (
        "set_default_client_priority [0|1]",
        (1, 1),
        ControlState.set_default_client_priority,
    ),
    "get_default_client_priority": ("get_default_client_priority", (0, 0), ControlState.get_default_client_priority),
    "quit": ("quit [-t <timeout>]", (0, 2), ControlState.quit),
}


# ----- the daemon ---------------------------------------------------------------------------------------------------


class StartError(Exception):
    """The daemon could not start; the message is printed on stderr by ``-d``/``-f``."""


def _directories(env: dict[str, str] | os._Environ[str]) -> tuple[Path, Path]:
    pipe_dir = Path(env.get("CUDA_MPS_PIPE_DIRECTORY") or DEFAULT_PIPE_DIRECTORY).absolute()
    log_dir = Path(env.get("CUDA_MPS_LOG_DIRECTORY") or DEFAULT_LOG_DIRECTORY).absolute()
    return pipe_dir, log_dir


def _check_directories(pipe_dir: Path, log_dir: Path) -> None:
    if len(str(pipe_dir)) > MAX_PIPE_DIRECTORY_CHARS:
        raise StartError(
            f"CUDA_MPS_PIPE_DIRECTORY {pipe_dir} is {len(str(pipe_dir))} characters long; "
            f"the MPS control daemon cannot start with a pipe directory longer than {MAX_PIPE_DIRECTORY_CHARS}"
        )
    for variable, path in (("CUDA_MPS_PIPE_DIRECTORY", pipe_dir), ("CUDA_MPS_LOG_DIRECTORY", log_dir)):
        if not path.is_dir():
            raise StartError(f"{variable} {path} does not exist or is not a directory")


def _default_percentage(env: dict[str, str] | os._Environ[str]) -> float:
    token = (env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE") or "").strip()
    try:
        return _pct(token) if token else 100.0
    except CommandError:
        return 100.0


def _default_pinned_limits(env: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    """``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT='0=1G,GPU-...=512MB'`` on the daemon: the default limits, per device string.

    Values are stored in the command's form (``512MB`` becomes ``512M``); malformed entries are ignored.
    """
    limits: dict[str, str] = {}
    for entry in (env.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT") or "").split(",")[:MAX_LIMIT_KEYS]:
        dev, _, value = entry.strip().partition("=")
        value = value.strip().removesuffix("B")
        if _DEV_RE.fullmatch(dev.strip()) and _LIMIT_RE.fullmatch(value):
            limits[dev.strip()] = value
    return limits


def _pid_namespace() -> str:
    try:
        link = str(Path("/proc/self/ns/pid").readlink())
    except OSError:
        return "-"
    match = re.fullmatch(r"pid:\[(\d+)\]", link)
    return match.group(1) if match else "-"


def _answers(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(path)
    except OSError:
        return False
    finally:
        probe.close()
    return True


class ControlDaemon:
    def __init__(self, pipe_dir: Path, log_dir: Path, env: dict[str, str] | os._Environ[str], echo: TextIO | None):
        self.pipe_dir = pipe_dir
        self.log_dir = log_dir
        self.socket_path = pipe_dir / CONTROL_SOCKET
        self.pid_path = pipe_dir / PID_FILE
        self.pid = os.getpid()
        self.env = env
        self.echo = echo
        self.state = ControlState(
            self.pid,
            visible_devices=env.get("CUDA_VISIBLE_DEVICES"),
            default_active_thread_percentage=_default_percentage(env),
            namespace=_pid_namespace(),
        )
        self.state.default_pinned_mem_limits.update(_default_pinned_limits(env))
        self._state_lock = threading.Lock()
        self._log_lock = threading.Lock()
        self._cleanup_lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._log: TextIO | None = None
        self._pid_fd: int | None = None
        self._listener: socket.socket | None = None
        self._socket_ino: int | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._stopping = threading.Event()
        self._quitting = threading.Event()
        self._quit_replied = threading.Event()
        self._cleaned = False
        self._closed = False  # after "Exit" nothing more is logged

    # -- logging
    def log(self, message: str, pid: int | None = None) -> None:
        line = format_log_line(self.pid if pid is None else pid, message)
        with self._log_lock:
            if self._closed:
                return
            if self._log is not None:
                with contextlib.suppress(OSError):
                    self._log.write(line + "\n")
                    self._log.flush()
            if self.echo is not None:
                with contextlib.suppress(OSError, ValueError):
                    self.echo.write(line + "\n")
                    self.echo.flush()

    # -- start
    def start(self) -> None:
        """Take ownership of the pipe directory and listen; raises StartError (nothing left behind) on failure."""
        _check_directories(self.pipe_dir, self.log_dir)
        try:
            self._log = (self.log_dir / CONTROL_LOG).open("a", encoding="utf-8")
        except OSError as error:
            raise StartError(f"Cannot open log file {self.log_dir / CONTROL_LOG}: {error}") from None
        existed = os.path.lexists(self.pid_path)
        try:
            fd = os.open(self.pid_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as error:
            raise StartError(f"Cannot create {self.pid_path}: {error}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise StartError(ALREADY_RUNNING) from None
        self._pid_fd = fd
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{self.pid}\n".encode(), 0)
        try:
            self._bind()
        except BaseException:
            self._pid_fd = None
            if not existed:
                with contextlib.suppress(OSError):
                    self.pid_path.unlink()
            os.close(fd)  # releases the lock; a pid file that was there before stays, stale as it was
            raise
        self.log(f"Starting control daemon using socket {self.socket_path}")
        self.log(f"To connect CUDA applications to this daemon, set env CUDA_MPS_PIPE_DIRECTORY={self.pipe_dir}")
        self.log(f"CUDA MPS Control binary version: {BINARY_VERSION}")
        visible = self.env.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            self.log(f"[emulator] CUDA_VISIBLE_DEVICES={_printable(visible)}")

    def _bind(self) -> None:
        try:
            mode = self.socket_path.lstat().st_mode
        except FileNotFoundError:
            mode = None
        if mode is not None:
            if not stat.S_ISSOCK(mode):
                raise StartError(f"{self.socket_path} exists and is not a socket")
            if _answers(str(self.socket_path)):
                raise StartError(ALREADY_RUNNING)
            self.socket_path.unlink()  # stale: left by a daemon that was killed
        # bind under a temporary name and rename once listening: whoever sees "control" can connect to it
        staging = self.pipe_dir / f".{CONTROL_SOCKET}.{self.pid}"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            with contextlib.suppress(FileNotFoundError):
                staging.unlink()
            listener.bind(str(staging))
            staging.chmod(0o600)
            listener.listen(16)
            self._socket_ino = staging.stat().st_ino
            staging.rename(self.socket_path)
        except OSError as error:
            listener.close()
            with contextlib.suppress(OSError):
                staging.unlink()
            raise StartError(f"Cannot bind {self.socket_path}: {error}") from None
        finally:
            os.umask(old_umask)
        listener.setblocking(False)
        self._listener = listener

    # -- serve
    def serve(self) -> int:
        assert self._listener is not None
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        previous = {}
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            previous[signum] = signal.signal(signum, self._on_signal)
        old_wakeup = signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        try:
            while not self._stopping.is_set():
                readable, _, _ = select.select([self._listener, self._wake_r], [], [])
                if self._wake_r in readable:
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(4096)
                if self._listener in readable and not self._stopping.is_set():
                    self._accept()
        finally:
            signal.set_wakeup_fd(old_wakeup)
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            self.cleanup()
            self._listener.close()  # only here: another thread may not close what select() is watching
            if self._quitting.is_set():  # the loop may see the flag before the quit's reply is sent
                self._quit_replied.wait(QUIT_REPLY_TIMEOUT)
        return 0

    def _on_signal(self, signum: int, frame: object) -> None:
        if signum != signal.SIGHUP:  # SIGHUP: ignored, as by a daemon without a terminal
            self._stopping.set()

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            conn, _ = self._listener.accept()
        except OSError:  # BlockingIOError when another wake-up won the race, ECONNABORTED, EMFILE...
            return
        if not self._slots.acquire(blocking=False):
            conn.close()
            return
        conn.setblocking(True)
        conn.settimeout(UI_IDLE_TIMEOUT)
        thread = threading.Thread(target=self._handle, args=(conn,), daemon=True)
        try:
            thread.start()
        except RuntimeError:
            self._slots.release()
            conn.close()

    def _handle(self, conn: socket.socket) -> None:
        try:
            self.log("Accepting connection...")
            with conn, conn.makefile("rb") as stream:
                hello = stream.readline(len(CLIENT_HELLO))
                if hello == CLIENT_HELLO:
                    self._serve_client(conn, stream)
                    return
                if hello != HELLO:
                    return
                self.log("NEW UI")
                try:
                    self._converse(conn, stream)
                finally:
                    self.log("UI closed")
        except OSError:
            pass
        finally:
            self._slots.release()

    def _converse(self, conn: socket.socket, stream: BinaryIO) -> None:
        while not self._stopping.is_set():
            raw = stream.readline(MAX_COMMAND_BYTES + 1)
            if not raw:
                return
            if len(raw) > MAX_COMMAND_BYTES and not raw.endswith(b"\n"):
                while raw and not raw.endswith(b"\n"):  # drop the rest of the line, a bounded chunk at a time
                    raw = stream.readline(MAX_COMMAND_BYTES)
                self.log("Cmd:<too long>")
                self._reply(conn, f"Command too long (more than {MAX_COMMAND_BYTES} bytes)")
                continue
            try:
                line = raw.rstrip(b"\r\n").decode("ascii").strip()
            except UnicodeDecodeError:
                line = None
            if line is None or not _PRINTABLE.fullmatch(line):
                self.log("Cmd:<invalid characters>")
                self._reply(conn, "Invalid command: only printable ASCII is accepted")
                continue
            if not line:
                self._send(conn, "")
                continue
            self.log(f"Cmd:{line}")
            with self._state_lock:
                if self._stopping.is_set():
                    return
                reply = self.state.execute(line)
                for pid, message in reply.log:
                    self.log(message, pid=pid)
                if reply.quit:
                    self._quitting.set()
                    self._stopping.set()
                    self.cleanup()
            if not reply.quit:
                self._reply(conn, reply.text)
                continue
            try:
                self._reply(conn, reply.text)
            finally:
                self._quit_replied.set()  # the main thread waits for this before the process exits
                with contextlib.suppress(OSError):
                    self._wake_w.send(b"q")
            return

    def _serve_client(self, conn: socket.socket, stream: BinaryIO) -> None:
        """An emulated CUDA application: one JSON line (pid, uid, device, its CUDA_MPS_* variables), then one
        ``ALLOC <MiB>`` per line; each answered with a framed reply. It leaves its server when it disconnects."""
        raw = stream.readline(MAX_COMMAND_BYTES + 1)
        try:
            hello = json.loads(raw)
            pid, uid, device = int(hello["pid"]), int(hello["uid"]), _dev(str(hello["device"]))
            env_limits, env_threads = hello.get("pinned"), hello.get("threads")
        except (ValueError, KeyError, TypeError, CommandError):
            self._send(conn, "ERR malformed client hello")
            return
        with self._state_lock:
            if self._stopping.is_set():
                return
            client, log = self.state.connect_client(pid, uid, device, env_limits, env_threads)
            for where, message in log:
                self.log(message, pid=where)
        try:
            self._send(conn, json.dumps(client.describe()))
            while not self._stopping.is_set():
                line = stream.readline(64)
                if not line:
                    return
                match = _ALLOC_RE.fullmatch(line.decode("ascii", "replace").strip())
                if match is None:
                    self._send(conn, "ERR expected ALLOC <MiB>")
                    continue
                with self._state_lock:
                    answer = self.state.allocate(client, int(match.group(1)))
                self._send(conn, answer)
        finally:
            with self._state_lock:
                self.state.disconnect_client(client)

    def _reply(self, conn: socket.socket, text: str) -> None:
        for line in text.splitlines():
            self.log(line)
        self._send(conn, text)

    @staticmethod
    def _send(conn: socket.socket, text: str) -> None:
        payload = text.encode()
        conn.sendall(struct.pack(">I", len(payload)) + payload)

    # -- stop
    def cleanup(self) -> None:
        """Remove our socket (no new UI can connect) and pid file, log ``Exit``, release the lock. Idempotent."""
        with self._cleanup_lock:
            if self._cleaned:
                return
            self._cleaned = True
            with contextlib.suppress(OSError):
                if self.socket_path.lstat().st_ino == self._socket_ino:
                    self.socket_path.unlink()
            if self._pid_fd is not None:
                with contextlib.suppress(OSError):
                    if self.pid_path.stat().st_ino == os.fstat(self._pid_fd).st_ino:
                        self.pid_path.unlink()
            self.log("Exit")
            if self._pid_fd is not None:
                os.close(self._pid_fd)  # releases the lock, after the socket and pid file are gone
                self._pid_fd = None
            with self._log_lock:
                self._closed = True
                if self._log is not None:
                    self._log.close()
                    self._log = None


def _run_foreground(env: dict[str, str] | os._Environ[str]) -> int:
    pipe_dir, log_dir = _directories(env)
    daemon = ControlDaemon(pipe_dir, log_dir, env, echo=sys.stdout)
    try:
        daemon.start()
    except StartError as error:
        print(error, file=sys.stderr)
        return 1
    return daemon.serve()


def _run_background(env: dict[str, str] | os._Environ[str]) -> int:
    pipe_dir, log_dir = _directories(env)
    try:
        _check_directories(pipe_dir, log_dir)
    except StartError as error:
        print(error, file=sys.stderr)
        return 1
    sys.stdout.flush()
    sys.stderr.flush()
    status_r, status_w = os.pipe()
    child = os.fork()
    if child == 0:  # first child: new session, fork again so the daemon is not a session leader
        os.close(status_r)
        try:
            os.setsid()
            if os.fork() == 0:
                _daemon_main(pipe_dir, log_dir, env, status_w)  # never returns
        finally:
            os._exit(0)
    os.close(status_w)
    os.waitpid(child, 0)
    status = b""
    deadline = time.monotonic() + START_TIMEOUT
    try:
        while not status.endswith(b"\n") and len(status) < 4096:
            ready, _, _ = select.select([status_r], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(status_r, 4096) if ready else b""
            if not chunk:
                break
            status += chunk
    finally:
        os.close(status_r)
    message = status.decode(errors="replace").strip()
    if message == "OK":
        return 0
    print(message.removeprefix("ERR ") or "the MPS control daemon failed to start", file=sys.stderr)
    return 1


def _daemon_main(pipe_dir: Path, log_dir: Path, env: dict[str, str] | os._Environ[str], status_w: int) -> None:
    rc = 1
    try:
        os.chdir("/")
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.close(devnull)
        os.closerange(3, status_w)
        os.closerange(status_w + 1, 1 << 16)
        daemon = ControlDaemon(pipe_dir, log_dir, env, echo=None)
        try:
            daemon.start()
        except StartError as error:
            os.write(status_w, f"ERR {error}\n".encode())
            return
        os.write(status_w, b"OK\n")
        os.close(status_w)
        status_w = -1
        rc = daemon.serve()
    except BaseException as error:  # report anything to the waiting parent, then exit
        if status_w >= 0:
            with contextlib.suppress(OSError):
                os.write(status_w, f"ERR {type(error).__name__}: {error}\n".encode())
    finally:
        os._exit(rc)


# ----- the client ---------------------------------------------------------------------------------------------------


class _Broken(Exception):
    pass


def _recv_exact(conn: socket.socket, size: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < size:
        chunk = conn.recv(size - len(chunks))
        if not chunk:
            raise _Broken
        chunks += chunk
    return bytes(chunks)


def _run_client(env: dict[str, str] | os._Environ[str], stdin: BinaryIO, stdout: TextIO, stderr: TextIO) -> int:
    pipe_dir, _ = _directories(env)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(pipe_dir / CONTROL_SOCKET))
        conn.sendall(HELLO)
    except OSError:
        conn.close()
        print(NO_DAEMON, file=stderr)
        return 1
    with conn:
        while True:
            raw = stdin.readline(MAX_COMMAND_BYTES + 1)
            if not raw:
                return 0
            if len(raw) > MAX_COMMAND_BYTES and not raw.endswith(b"\n"):
                while raw and not raw.endswith(b"\n"):  # drop the rest of the overlong line
                    raw = stdin.readline(MAX_COMMAND_BYTES)
                print(f"Command too long (more than {MAX_COMMAND_BYTES} bytes)", file=stdout, flush=True)
                continue
            command = raw.rstrip(b"\r\n")
            if not command.strip():
                continue
            try:
                conn.sendall(command + b"\n")
                (size,) = struct.unpack(">I", _recv_exact(conn, 4))
                if size > MAX_REPLY_BYTES:
                    raise _Broken
                reply = _recv_exact(conn, size).decode(errors="replace")
            except (OSError, _Broken, struct.error):
                print(NO_DAEMON, file=stderr)
                return 1
            if reply:
                print(reply, file=stdout, flush=True)
            if command.split()[0] == b"quit" and reply == "":
                return 0  # the daemon is gone; whatever follows has nobody to go to


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    env = os.environ
    if not args:
        try:
            return _run_client(env, sys.stdin.buffer, sys.stdout, sys.stderr)
        except KeyboardInterrupt:
            return 130
    if len(args) == 1 and args[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if args == ["-v"]:
        print(f"NVIDIA CUDA MPS Control binary version: {BINARY_VERSION} (Tessera emulator)")
        return 0
    if args == ["-d"]:
        return _run_background(env)
    if args == ["-f"]:
        return _run_foreground(env)
    print(f"Unrecognized option: {' '.join(_printable(a) for a in args)[:200]}\n{USAGE}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
