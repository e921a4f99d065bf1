"""The MPS keeper: MPS control daemons started in a container of their own, so they outlive the agent's.

A container's processes end with it. ``nvidia-cuda-mps-control -d`` double-forks, but the daemon and its
MPS server still belong to the container that ran the command, so when the agent's container restarts (a
crash, an upgrade of the DaemonSet) every MPS client on the node loses its server. NVIDIA runs its daemons
in a DaemonSet of their own for this reason.

``tessera mps-keeper`` is that DaemonSet's process, and it does one thing: on the agent's request it runs
``nvidia-cuda-mps-control -d`` in its own container. Everything else stays with the agent, which reaches
the daemon the way clients do — its pipe directory under the shared MPS root, and its PID in the host PID
namespace both pods share (``hostPID``): limits and readiness commands, supervision by pidfd, adoption
after an agent restart, the drain before a daemon is quit, compute modes. So the keeper holds no state,
needs no NVML and no Kubernetes API, and is rarely upgraded (``updateStrategy: OnDelete``).

The protocol is one JSON object per connection on a unix socket (mode 0600; peers must run as root or as
the keeper's user), answered by one JSON object::

    {"protocol": 1, "start": {"root": "/run/nvidia/mps", "key": "nvidia.com/gpu",
                              "visible_devices": ["GPU-..."], "active_thread_percentage": 50,
                              "pinned_memory_mib": [["GPU-...", 10240]]}}
    {"ok": true, "pid": 4242}          or          {"ok": false, "error": "..."}

Every field is checked here again (the keeper trusts no peer): the root must be the keeper's own, the key a
daemon key (so the pipe directory stays under the root), the devices UUIDs, the limits in range. An agent
and a keeper of different versions must keep understanding each other: the keeper outlives agent upgrades.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import select
import socket
import stat
import struct
import threading
import time
from pathlib import Path

from agent.core.mps import MpsDaemonSpec
from agent.mps.control import PID_FILE, MpsError, control_for

log = logging.getLogger(__name__)

PROTOCOL = 1
DEFAULT_SOCKET = "/run/tessera/mps-keeper.sock"
MAX_REQUEST_BYTES = 16 * 1024
READ_TIMEOUT = 5.0  # a peer that connects and says nothing does not hold the keeper up for longer
START_TIMEOUT = 30.0  # the client's wait for a reply: the daemon's own start is bounded by COMMAND_TIMEOUT
MAX_DEVICES = 64
_SEGMENT = r"[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?"
_KEY = re.compile(rf"{_SEGMENT}/{_SEGMENT}(/mig-[0-9]{{1,3}}(-[0-9]{{1,3}}){{1,2}})?")
_SO_PEERCRED = struct.Struct("3i")  # pid, uid, gid


class KeeperError(ValueError):
    """A request the keeper refuses; the message goes back to the agent."""


# ----- the agent's side ---------------------------------------------------------------------------


def start_through_keeper(socket_path: Path, root: Path, spec: MpsDaemonSpec) -> int | None:
    """Ask the keeper at ``socket_path`` to start ``spec``'s daemon; its PID, or ``MpsError`` saying why not."""
    request = {"protocol": PROTOCOL, "start": _spec_fields(root, spec)}
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.settimeout(START_TIMEOUT)
            connection.connect(str(socket_path))
            connection.sendall(json.dumps(request).encode() + b"\n")
            connection.shutdown(socket.SHUT_WR)
            reply = _read_message(connection, time.monotonic() + START_TIMEOUT)
    except (OSError, ValueError) as error:
        raise MpsError(
            f"the MPS keeper does not answer at {socket_path} ({error}); is the tessera-mps-keeper pod running "
            "on this node, with the same --mps-root and socket directory?"
        ) from None
    if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
        raise MpsError(f"the MPS keeper at {socket_path} answered {reply!r}, not a reply of protocol {PROTOCOL}")
    if not reply["ok"]:
        raise MpsError(f"the MPS keeper could not start the daemon: {reply.get('error')}")
    pid = reply.get("pid")
    return pid if isinstance(pid, int) and not isinstance(pid, bool) else None


def _spec_fields(root: Path, spec: MpsDaemonSpec) -> dict[str, object]:
    return {
        "root": str(root),
        "key": spec.key,
        "visible_devices": list(spec.visible_devices),
        "active_thread_percentage": spec.active_thread_percentage,
        "pinned_memory_mib": [list(pair) for pair in spec.pinned_memory_mib],
    }


# ----- the keeper's side --------------------------------------------------------------------------


def parse_start(request: object, root: Path) -> MpsDaemonSpec:
    """The daemon a request asks for, checked field by field; ``KeeperError`` names the first bad one."""
    if not isinstance(request, dict):
        raise KeeperError("a request is one JSON object")
    if type(request.get("protocol")) is not int or request["protocol"] != PROTOCOL:
        raise KeeperError(f"protocol {request.get('protocol')!r} is not spoken here (this keeper speaks {PROTOCOL})")
    if set(request) != {"protocol", "start"}:
        raise KeeperError(f"unknown request {sorted(set(request) - {'protocol'})}; this keeper only starts daemons")
    fields = request["start"]
    expected = {"root", "key", "visible_devices", "active_thread_percentage", "pinned_memory_mib"}
    if not isinstance(fields, dict) or set(fields) != expected:
        got = sorted(fields) if isinstance(fields, dict) else type(fields).__name__
        raise KeeperError(f"start needs exactly the fields {sorted(expected)}, got {got}")
    if fields["root"] != str(root):
        raise KeeperError(
            f"the agent's MPS root is {fields['root']!r} but this keeper's is {str(root)!r}: give both the same "
            "--mps-root (TESSERA_MPS_ROOT)"
        )
    key = fields["key"]
    if not isinstance(key, str) or not _KEY.fullmatch(key):
        raise KeeperError(f"key {key!r} is not an MPS daemon key (<resource> or <resource>/mig-<gpu>-<gi>...)")
    devices = fields["visible_devices"]
    if not isinstance(devices, list) or not 0 < len(devices) <= MAX_DEVICES or not all(type(d) is str for d in devices):
        raise KeeperError(f"visible_devices must be 1 to {MAX_DEVICES} device UUIDs")
    percentage = fields["active_thread_percentage"]
    if type(percentage) is not int or not 1 <= percentage <= 100:
        raise KeeperError(f"active_thread_percentage {percentage!r} is not a whole number from 1 to 100")
    pinned = fields["pinned_memory_mib"]
    if not isinstance(pinned, list) or len(pinned) > MAX_DEVICES or not all(_is_pair(p) for p in pinned):
        raise KeeperError("pinned_memory_mib must be a list of [device UUID, MiB] pairs")
    return MpsDaemonSpec(
        key=key,
        resource=key.split("/mig-")[0],
        visible_devices=tuple(devices),
        active_thread_percentage=percentage,
        pinned_memory_mib=tuple((uuid, mib) for uuid, mib in pinned),
    )


def _is_pair(value: object) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and type(value[1]) is int


class MpsKeeper:
    """Serves start requests on ``socket_path`` one at a time until ``stop``; idle, it sleeps in ``select``."""

    def __init__(self, socket_path: Path, root: Path, binary: str) -> None:
        self._socket_path = socket_path
        self._root = root
        self._binary = binary
        self._uid = os.getuid()
        self._stopped = threading.Event()
        self._listener = self._listen()
        self._wake_read, self._wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def _listen(self) -> socket.socket:
        self._socket_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if self._socket_path.exists() or self._socket_path.is_symlink():
            if not stat.S_ISSOCK(self._socket_path.lstat().st_mode):
                raise KeeperError(f"{self._socket_path} exists and is not a socket; not replacing it")
            if _answers(self._socket_path):
                raise KeeperError(f"another MPS keeper serves {self._socket_path}")
            self._socket_path.unlink()  # a stale socket of a keeper that died
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket is born 0600: no moment where others could connect
        try:
            listener.bind(str(self._socket_path))
        finally:
            os.umask(old)
        listener.listen(8)
        return listener

    def serve(self) -> None:
        log.info("MPS keeper serving socket=%s mps_root=%s binary=%s", self._socket_path, self._root, self._binary)
        try:
            while not self._stopped.is_set():
                readable, _, _ = select.select([self._listener, self._wake_read], [], [])
                if self._listener in readable and not self._stopped.is_set():
                    self._serve_one()
        finally:
            self._listener.close()
            os.close(self._wake_read)
            os.close(self._wake_write)
            with contextlib.suppress(FileNotFoundError):
                self._socket_path.unlink()
            running = hosted_daemons(self._root)
            if running:
                log.warning(
                    "MPS keeper stopping with %d daemon(s) running keys=%s; in a container they stop with it",
                    len(running), ",".join(running),
                )  # fmt: skip

    def stop(self) -> None:
        """Safe from a signal handler: wakes ``serve``, which returns."""
        self._stopped.set()
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_write, b"x")

    def _serve_one(self) -> None:
        """One connection; nothing a peer sends ends the keeper."""
        try:
            connection, _ = self._listener.accept()
            with connection:
                self._handle(connection)
        except Exception:  # a bug, not input: logged, and the next request is served
            log.exception("MPS keeper failed serving a request")

    def _handle(self, connection: socket.socket) -> None:
        try:
            pid, uid, _ = _SO_PEERCRED.unpack(
                connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _SO_PEERCRED.size)
            )
            request = _read_message(connection, time.monotonic() + READ_TIMEOUT)
            if uid not in (0, self._uid):
                raise KeeperError(f"peer pid {pid} runs as uid {uid}; only root or uid {self._uid} may ask")
            spec = parse_start(request, self._root)
            reply: dict[str, object] = {"ok": True, "pid": self._start(spec)}
        except (KeeperError, MpsError) as error:
            log.warning("MPS keeper refused a request error=%r", str(error))
            reply = {"ok": False, "error": str(error)}
        except (OSError, ValueError) as error:  # the peer went away, sent junk or too much
            log.warning("MPS keeper could not read a request error=%r", str(error))
            reply = {"ok": False, "error": f"unreadable request: {error}"}
        with contextlib.suppress(OSError):
            connection.sendall(json.dumps(reply).encode() + b"\n")

    def _start(self, spec: MpsDaemonSpec) -> int | None:
        try:
            control = control_for(self._binary, self._root, spec)
        except ValueError as error:  # a device UUID or limit out of range
            raise KeeperError(str(error)) from None
        running = control.pid()
        if running is not None and control.answers():  # started already (a retried request): the same answer
            return running
        control.start()
        pid = control.pid()
        log.info("MPS keeper started daemon key=%s pid=%s devices=%s", spec.key, pid, ",".join(spec.visible_devices))
        return pid


def hosted_daemons(root: Path) -> list[str]:
    """Keys of the daemons under ``root`` whose process is alive (from their pid files)."""
    keys = []
    for pid_file in sorted(root.glob(f"**/pipe/{PID_FILE}")):
        try:
            os.kill(int(pid_file.read_text().strip()), 0)
        except (OSError, ValueError):
            continue
        keys.append(str(pid_file.parent.parent.relative_to(root)))
    return keys


def _answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def _read_message(connection: socket.socket, deadline: float) -> object:
    """One JSON object, ended by a newline or the peer's end of writing, complete by ``deadline``
    (``socket.timeout`` otherwise) and at most ``MAX_REQUEST_BYTES``."""
    data = b""
    while b"\n" not in data:
        connection.settimeout(max(0.001, deadline - time.monotonic()))
        chunk = connection.recv(4096)
        if not chunk:
            break
        data += chunk
        if len(data) > MAX_REQUEST_BYTES:
            raise ValueError(f"a message is at most {MAX_REQUEST_BYTES} bytes")
    try:
        return json.loads(data.split(b"\n", 1)[0] or b"null")
    except RecursionError:  # [[[[...: json's recursion limit, not a ValueError
        raise ValueError("a message nests too deeply") from None
