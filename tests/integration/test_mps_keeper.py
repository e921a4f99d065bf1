"""The MPS keeper (``tessera mps-keeper``): a real unix socket, real requests, real emulated MPS daemons.

Each test runs an ``MpsKeeper`` in a thread of the test process, pointed at the MPS control emulator under the real
binary's name (the ``mps_bin`` fixture). The agent's side is ``start_through_keeper``; requests the agent would never
send go over a raw socket. What an operator notices: a daemon with the right pipe directory, devices and limits that
answers its clients; one daemon per key however often it is asked; every bad request refused with a reason and the
keeper still serving; nothing created outside the MPS root; a private socket; one keeper per socket; daemons that
outlive the keeper; peers of other users refused.

Socket and pipe paths live under short ``tempfile.mkdtemp(dir="/tmp")`` bases (an MPS pipe directory may not be
longer than 87 characters). Every emulated daemon whose pipe directory lies under a test's base is SIGKILLed in
teardown.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import select
import shutil
import signal
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import agent.mps.keeper as keeper_module
from agent.core.mps import MpsDaemonSpec
from agent.mps.control import MpsControl, MpsError, control_for
from agent.mps.keeper import MAX_REQUEST_BYTES, KeeperError, MpsKeeper, start_through_keeper

GPU0 = "GPU-8f6e3c2a-1b4d-4e5f-9a0b-c1d2e3f4a5b6"
GPU1 = "GPU-0a1b2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d"
MIG = "MIG-1a2b3c4d-5e6f-4a7b-8c9d-0e1f2a3b4c5d"
KEY = "nvidia.com/gpu"
MIG_KEY = "nvidia.com/mig-1g.10gb/mig-0-3"
NOBODY = 65534
ABS = Path("/abs")  # where the key "/abs" would lead if it were let through


# ----- helpers ------------------------------------------------------------------------------------------------------


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


def process_alive(pid: int) -> bool:
    """True while ``pid`` runs; a zombie counts as gone."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat_line.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    return dict(entry.split("=", 1) for entry in raw.split("\0") if "=" in entry)


def emulator_daemons_under(*bases: Path) -> list[int]:
    """Pids of emulated MPS control daemons (``-d``) whose pipe directory lies under one of ``bases``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            if b"agent.sim.mps.control" not in argv or b"-d" not in argv or not process_alive(int(entry)):
                continue
            pipe = environ_of(int(entry)).get("CUDA_MPS_PIPE_DIRECTORY", "")
            if any(pipe.startswith(f"{base}/") or pipe.startswith(f"{base}-") for base in bases):
                found.append(int(entry))
        except OSError:
            continue
    return sorted(found)


def make_spec(
    key: str = KEY,
    devices: tuple[str, ...] = (GPU0, GPU1),
    percent: int = 50,
    pinned: tuple[tuple[str, int], ...] = ((GPU0, 10240), (GPU1, 2048)),
) -> MpsDaemonSpec:
    return MpsDaemonSpec(key, key.split("/mig-")[0], devices, percent, pinned)


def start_request(root: Path, /, **overrides: object) -> dict[str, object]:
    """A well-formed start request for ``KEY`` under ``root``, with some of its ``start`` fields replaced."""
    fields: dict[str, object] = {
        "root": str(root),
        "key": KEY,
        "visible_devices": [GPU0, GPU1],
        "active_thread_percentage": 50,
        "pinned_memory_mib": [[GPU0, 10240], [GPU1, 2048]],
    }
    fields.update(overrides)
    return {"protocol": 1, "start": fields}


def encode(request: object) -> bytes:
    return json.dumps(request).encode() + b"\n"


def read_reply(connection: socket.socket) -> dict[str, object]:
    """The keeper's one JSON line (a reset after it, for a request the keeper did not read to the end, is fine)."""
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while b"\n" not in data:
            chunk = connection.recv(4096)
            if not chunk:
                break
            data += chunk
    assert data.endswith(b"\n"), f"no complete reply, got {data!r}"
    reply = json.loads(data)
    assert isinstance(reply, dict)
    return reply


def ask(socket_path: Path, payload: bytes, timeout: float = 10.0) -> dict[str, object]:
    """Send raw bytes as one request (then end writing) and return the keeper's reply."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.settimeout(timeout)
        connection.connect(str(socket_path))
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # refused unread: the reply still waits
            connection.sendall(payload)
            connection.shutdown(socket.SHUT_WR)
        return read_reply(connection)


def ask_as(uid: int, socket_path: Path, payload: bytes, timeout: float = 10.0) -> dict[str, object]:
    """``ask`` from a forked child running as ``uid``: ``{"reply": ...}`` or ``{"errno": ..., "error": ...}``."""
    read_fd, write_fd = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        try:
            os.close(read_fd)
            outcome: dict[str, object]
            try:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
                outcome = {"reply": ask(socket_path, payload, timeout)}
            except OSError as error:
                outcome = {"errno": error.errno, "error": str(error)}
            except BaseException as error:  # everything goes back to the parent
                outcome = {"error": repr(error)}
            os.write(write_fd, json.dumps(outcome).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    data = b""
    deadline = time.monotonic() + timeout
    try:
        while True:
            remaining = deadline - time.monotonic()
            assert remaining > 0, "the child running as another user did not report back"
            readable, _, _ = select.select([read_fd], [], [], remaining)
            if readable:
                chunk = os.read(read_fd, 65536)
                if not chunk:
                    break
                data += chunk
    finally:
        os.close(read_fd)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(child, 0)
    return json.loads(data)


@dataclass
class Keeper:
    """One ``MpsKeeper`` serving in a thread, with its MPS root and the emulator binary it runs."""

    keeper: MpsKeeper
    thread: threading.Thread
    socket: Path
    root: Path
    binary: str

    def start(self, spec: MpsDaemonSpec) -> int | None:
        return start_through_keeper(self.socket, self.root, spec)

    def ask(self, payload: bytes) -> dict[str, object]:
        return ask(self.socket, payload)

    def control(self, spec: MpsDaemonSpec) -> MpsControl:
        return control_for(self.binary, self.root, spec)

    def stop(self, timeout: float = 5.0) -> None:
        self.keeper.stop()
        self.thread.join(timeout)


@dataclass
class Base:
    """A short directory under /tmp: the MPS root ``<base>/mps``, by default the socket ``<base>/run/keeper.sock``."""

    path: Path
    binary: str
    keepers: list[Keeper] = field(default_factory=list)

    @property
    def root(self) -> Path:
        return self.path / "mps"

    def keeper(self, socket_path: Path | None = None, root: Path | None = None) -> Keeper:
        socket_path = socket_path or self.path / "run" / "keeper.sock"
        root = root or self.root
        keeper = MpsKeeper(socket_path, root, self.binary)
        thread = threading.Thread(target=keeper.serve, name="mps-keeper", daemon=True)
        running = Keeper(keeper, thread, socket_path, root, self.binary)
        self.keepers.append(running)
        thread.start()
        return running


@pytest.fixture
def base(mps_bin: Path) -> Iterator[Base]:
    made = Base(Path(tempfile.mkdtemp(prefix="k", dir="/tmp")), str(mps_bin / "nvidia-cuda-mps-control"))
    abs_existed = ABS.exists()
    try:
        yield made
    finally:
        for running in made.keepers:
            running.stop()
        escaped = [] if abs_existed else [ABS]  # a keeper that let the key "/abs" through started a daemon there
        daemons = emulator_daemons_under(made.path, *escaped)
        for pid in daemons:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not any(process_alive(pid) for pid in daemons), what="the daemons to die")
        for directory in [made.path, Path(f"{made.path}-abs"), *escaped]:
            shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def keeper(base: Base) -> Keeper:
    return base.keeper()


def assert_serves(keeper: Keeper) -> int:
    """A good request still starts (or finds) the daemon of ``KEY``; its pid."""
    pid = keeper.start(make_spec())
    assert pid is not None and process_alive(pid)
    return pid


def stale_socket(path: Path) -> None:
    """The socket file a keeper that died leaves behind: bound once, nobody listening."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(path))


# ----- starting daemons ---------------------------------------------------------------------------------------------


def test_start_runs_a_daemon_with_the_pipe_directory_devices_and_limits(keeper: Keeper) -> None:
    spec = make_spec()

    pid = keeper.start(spec)

    assert pid is not None and process_alive(pid)
    environ = environ_of(pid)
    assert environ["CUDA_MPS_PIPE_DIRECTORY"] == str(keeper.root / KEY / "pipe")
    assert environ["CUDA_VISIBLE_DEVICES"] == f"{GPU0},{GPU1}"
    assert environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert environ["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{GPU0}=10240M,{GPU1}=2048M"
    replies = keeper.control(spec).commands(
        ["get_default_active_thread_percentage", f"get_default_device_pinned_mem_limit {GPU1}"]
    )
    assert replies == ["50.0", "2048M"]


def test_the_daemon_runs_in_a_session_of_its_own(keeper: Keeper) -> None:
    pid = keeper.start(make_spec())

    assert pid is not None
    assert os.getsid(pid) != os.getsid(0)  # detached: nothing of the keeper's process group ends it


def test_the_same_request_again_returns_the_same_daemon(keeper: Keeper) -> None:
    first = keeper.start(make_spec())

    second = keeper.start(make_spec())

    assert first is not None and second == first
    assert emulator_daemons_under(keeper.root) == [first]


def test_a_mig_daemon_key_and_mig_uuid_start_a_daemon(keeper: Keeper) -> None:
    spec = make_spec(key=MIG_KEY, devices=(MIG,), percent=100, pinned=((MIG, 4864),))

    pid = keeper.start(spec)

    assert pid is not None and process_alive(pid)
    environ = environ_of(pid)
    assert environ["CUDA_MPS_PIPE_DIRECTORY"] == str(keeper.root / MIG_KEY / "pipe")
    assert environ["CUDA_VISIBLE_DEVICES"] == MIG
    assert keeper.control(spec).commands([f"get_default_device_pinned_mem_limit {MIG}"]) == ["4864M"]


def test_daemons_of_different_keys_run_side_by_side(keeper: Keeper) -> None:
    gpu = keeper.start(make_spec())
    mig = keeper.start(make_spec(key=MIG_KEY, devices=(MIG,), pinned=()))

    assert gpu is not None and mig is not None and gpu != mig
    assert emulator_daemons_under(keeper.root) == sorted([gpu, mig])


# ----- bad requests -------------------------------------------------------------------------------------------------

Build = Callable[[Path], bytes]


def bad(name: str, build: Build, *fragments: str | re.Pattern[str]) -> object:
    """A bad request and what its error must name: literal text or a pattern (``_`` and spaces are alike)."""
    return pytest.param(build, fragments, id=name)


def percentage(value: str) -> re.Pattern[str]:
    """An error about the active thread percentage that quotes ``value`` as a token of its own."""
    return re.compile(rf"active thread percentage\b.*(?<![\w']){re.escape(value)}(?![\w'])")


BAD_REQUESTS = [
    bad(
        "another-root",
        lambda root: encode(start_request(root, root="/run/nvidia/mps")),
        "'/run/nvidia/mps'",
        "--mps-root",
    ),
    bad("key-dotdot", lambda root: encode(start_request(root, key="../etc")), "'../etc'", "not an MPS daemon key"),
    bad(
        "key-dotdot-inside",
        lambda root: encode(start_request(root, key="nvidia.com/gpu/../../x")),
        "'nvidia.com/gpu/../../x'",
        "not an MPS daemon key",
    ),
    bad("key-absolute", lambda root: encode(start_request(root, key=str(ABS))), "'/abs'", "not an MPS daemon key"),
    bad(
        "key-absolute-beside-base",
        lambda root: encode(start_request(root, key=f"{root.parent}-abs")),
        "not an MPS daemon key",
    ),
    bad("key-empty", lambda root: encode(start_request(root, key="")), "''", "not an MPS daemon key"),
    bad("key-not-a-string", lambda root: encode(start_request(root, key=7)), "not an MPS daemon key"),
    bad(
        "device-not-a-uuid",
        lambda root: encode(start_request(root, visible_devices=["0"], pinned_memory_mib=[])),
        "not a device UUID: '0'",
    ),
    bad("no-devices", lambda root: encode(start_request(root, visible_devices=[])), "visible_devices must be"),
    bad("devices-not-a-list", lambda root: encode(start_request(root, visible_devices=GPU0)), "visible_devices"),
    bad(
        "percentage-0",
        lambda root: encode(start_request(root, active_thread_percentage=0)),
        percentage("0"),
    ),
    bad(
        "percentage-101",
        lambda root: encode(start_request(root, active_thread_percentage=101)),
        percentage("101"),
    ),
    bad(
        "percentage-string",
        lambda root: encode(start_request(root, active_thread_percentage="50")),
        percentage("'50'"),
    ),
    bad(
        "percentage-true",
        lambda root: encode(start_request(root, active_thread_percentage=True)),
        percentage("True"),
    ),
    bad(
        "pinned-missing-mib",
        lambda root: encode(start_request(root, pinned_memory_mib=[[GPU0]])),
        "pinned_memory_mib must be a list of [device UUID, MiB] pairs",
    ),
    bad(
        "pinned-mib-string",
        lambda root: encode(start_request(root, pinned_memory_mib=[[GPU0, "1G"]])),
        "pinned_memory_mib must be a list of [device UUID, MiB] pairs",
    ),
    bad(
        "pinned-mib-0",
        lambda root: encode(start_request(root, pinned_memory_mib=[[GPU0, 0]])),
        f"MPS limit for '{GPU0}' of 0 MiB",
    ),
    bad(
        "pinned-not-a-uuid",
        lambda root: encode(start_request(root, pinned_memory_mib=[["0", 1024]])),
        "MPS limit for '0' of 1024 MiB",
    ),
    bad(
        "missing-field",
        lambda root: encode({"protocol": 1, "start": {"root": str(root), "key": KEY}}),
        "start needs exactly the fields",
    ),
    bad(
        "extra-field",
        lambda root: encode(start_request(root, command="rm -rf /")),
        "start needs exactly the fields",
        "'command'",
    ),
    bad("unknown-operation", lambda root: encode({"protocol": 1, "stop": {}}), "unknown request ['stop']"),
    bad(
        "protocol-2",
        lambda root: encode({**start_request(root), "protocol": 2}),
        "protocol 2 is not spoken here",
    ),
    bad("no-protocol", lambda root: encode({"start": start_request(root)["start"]}), "protocol None"),
    bad("a-json-array", lambda root: b"[1, 2]\n", "one JSON object"),
    bad("not-json", lambda root: b"start nvidia.com/gpu please\n", "unreadable request"),
    bad("not-utf8", lambda root: b"\xff\xfe\x00{\n", "unreadable request"),
    bad(
        "larger-than-16-KiB",
        lambda root: json.dumps(start_request(root, key="x" * MAX_REQUEST_BYTES)).encode() + b"\n",
        "unreadable request",
        f"at most {MAX_REQUEST_BYTES} bytes",
    ),
    bad("nothing-then-end-of-writing", lambda root: b"", "one JSON object"),
]


@pytest.mark.parametrize(("build", "fragments"), BAD_REQUESTS)
def test_a_bad_request_is_refused_with_its_reason_and_the_keeper_keeps_serving(
    keeper: Keeper, build: Build, fragments: tuple[str | re.Pattern[str], ...]
) -> None:
    reply = keeper.ask(build(keeper.root))

    assert reply["ok"] is False and set(reply) == {"ok", "error"}
    error = str(reply["error"]).replace("_", " ")
    for fragment in fragments:
        if isinstance(fragment, str):
            assert fragment.replace("_", " ") in error
        else:
            assert fragment.search(error), f"{fragment.pattern!r} not in {error!r}"
    assert emulator_daemons_under(keeper.root) == []
    assert_serves(keeper)


def test_the_agent_side_raises_the_keepers_reason(keeper: Keeper) -> None:
    with pytest.raises(MpsError, match=r"could not start the daemon: .*active.thread.percentage\b.*\b0\b"):
        keeper.start(make_spec(percent=0))

    with pytest.raises(MpsError, match="the agent's MPS root is '/run/nvidia/mps'"):
        start_through_keeper(keeper.socket, Path("/run/nvidia/mps"), make_spec())


def test_a_pipe_directory_too_long_for_mps_is_refused(base: Base) -> None:
    long_root = base.path / ("r" * 70)  # with /nvidia.com/gpu/pipe beyond the 87-character limit
    keeper = base.keeper(root=long_root)

    with pytest.raises(MpsError, match="longer than 87 characters"):
        keeper.start(make_spec())
    assert not long_root.exists()


def test_a_connection_that_sends_nothing_and_closes_does_not_stop_the_keeper(keeper: Keeper) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        silent.connect(str(keeper.socket))

    assert_serves(keeper)


def test_a_silent_open_connection_holds_the_keeper_only_for_its_read_timeout(
    keeper: Keeper, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(keeper_module, "READ_TIMEOUT", 0.3)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
        silent.settimeout(10)
        silent.connect(str(keeper.socket))

        reply = ask(keeper.socket, encode(start_request(keeper.root)), timeout=10)  # queued behind the silent one

        assert reply["ok"] is True and isinstance(reply["pid"], int) and process_alive(reply["pid"])
        silent_reply = read_reply(silent)
    assert silent_reply["ok"] is False and "timed out" in str(silent_reply["error"])


def test_nothing_is_created_outside_the_mps_root(keeper: Keeper) -> None:
    for build, _ in (param.values for param in BAD_REQUESTS):
        keeper.ask(build(keeper.root))

    assert sorted(p.name for p in keeper.root.parent.iterdir()) == ["run"]  # the socket's directory, no MPS root
    assert not Path(f"{keeper.root.parent}-abs").exists() and not (ABS / "pipe").exists()
    assert emulator_daemons_under(keeper.root.parent) == []
    assert_serves(keeper)
    assert sorted(str(p.relative_to(keeper.root)) for p in keeper.root.glob("*/*")) == [KEY]


# ----- requests that slipped past the first checks -----------------------------------------------------------------


def test_deeply_nested_json_is_refused_and_the_keeper_keeps_serving(keeper: Keeper) -> None:
    reply = keeper.ask(b"[" * 4096 + b"\n")

    assert reply["ok"] is False and "unreadable request" in str(reply["error"])
    assert_serves(keeper)


def test_a_key_with_a_trailing_newline_is_refused(keeper: Keeper) -> None:
    reply = keeper.ask(encode(start_request(keeper.root, key=KEY + "\n")))

    assert reply["ok"] is False and "not an MPS daemon key" in str(reply["error"])
    assert emulator_daemons_under(keeper.root) == []


def test_a_missing_thread_percentage_is_refused(keeper: Keeper) -> None:
    reply = keeper.ask(encode(start_request(keeper.root, active_thread_percentage=None)))

    assert reply["ok"] is False and percentage("None").search(str(reply["error"]).replace("_", " "))
    assert emulator_daemons_under(keeper.root) == []


# ----- the socket ---------------------------------------------------------------------------------------------------


def test_the_socket_is_0600_and_its_missing_directory_0700_whatever_the_umask(base: Base) -> None:
    socket_path = base.path / "run" / "tessera" / "keeper.sock"
    old = os.umask(0)
    try:
        keeper = base.keeper(socket_path)
    finally:
        os.umask(old)

    mode = keeper.socket.lstat().st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    assert stat.S_IMODE(socket_path.parent.stat().st_mode) == 0o700
    assert_serves(keeper)


def test_a_second_keeper_on_a_served_socket_is_refused(keeper: Keeper, base: Base) -> None:
    with pytest.raises(KeeperError, match="another MPS keeper serves"):
        MpsKeeper(keeper.socket, base.root, base.binary)

    assert stat.S_ISSOCK(keeper.socket.lstat().st_mode)
    assert_serves(keeper)  # the first keeper's socket was left alone


def test_the_stale_socket_of_a_keeper_that_died_is_replaced(base: Base) -> None:
    socket_path = base.path / "run" / "keeper.sock"
    stale_socket(socket_path)

    keeper = base.keeper(socket_path)

    assert_serves(keeper)


# ----- stopping -----------------------------------------------------------------------------------------------------


def test_stop_returns_promptly_removes_the_socket_and_leaves_the_daemons_running(keeper: Keeper) -> None:
    pid = assert_serves(keeper)

    began = time.monotonic()
    keeper.stop(timeout=5)

    assert not keeper.thread.is_alive() and time.monotonic() - began < 2
    assert not keeper.socket.exists()
    assert process_alive(pid)
    assert keeper.control(make_spec()).answers()


def test_an_idle_keeper_stops_promptly(keeper: Keeper) -> None:
    began = time.monotonic()
    keeper.stop(timeout=5)

    assert not keeper.thread.is_alive() and time.monotonic() - began < 2
    assert not keeper.socket.exists()


# ----- who may ask --------------------------------------------------------------------------------------------------

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the test forks a child that setuid()s")


@needs_root
def test_a_peer_of_another_user_cannot_reach_the_0600_socket(keeper: Keeper) -> None:
    os.chmod(keeper.root.parent, 0o711)  # only the socket's own mode stands in the way
    os.chmod(keeper.socket.parent, 0o711)

    outcome = ask_as(NOBODY, keeper.socket, encode(start_request(keeper.root)))

    assert outcome.get("errno") == errno.EACCES, outcome
    assert emulator_daemons_under(keeper.root) == []


@needs_root
def test_a_peer_of_another_user_is_refused_even_when_the_socket_is_opened_up(keeper: Keeper) -> None:
    os.chmod(keeper.root.parent, 0o711)  # an operator loosened the socket: the keeper checks the peer itself
    os.chmod(keeper.socket.parent, 0o711)
    os.chmod(keeper.socket, 0o666)

    outcome = ask_as(NOBODY, keeper.socket, encode(start_request(keeper.root)))

    assert "reply" in outcome, outcome
    reply = outcome["reply"]
    assert reply["ok"] is False and f"runs as uid {NOBODY}" in reply["error"]
    assert emulator_daemons_under(keeper.root) == []
    assert not (keeper.root / KEY).exists()


# ----- no keeper ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stale", [False, True], ids=["no-socket", "stale-socket"])
def test_without_a_keeper_the_agent_is_told_where_it_looked(base: Base, stale: bool) -> None:
    socket_path = base.path / "run" / "keeper.sock"
    if stale:
        stale_socket(socket_path)

    with pytest.raises(MpsError, match="tessera-mps-keeper") as raised:
        start_through_keeper(socket_path, base.root, make_spec())

    assert str(socket_path) in str(raised.value)
