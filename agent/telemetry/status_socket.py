"""``/status`` on a unix socket of the node, for ``tessera status`` only.

The status names every claim, every pod holding a GPU and why each device is unhealthy: the node's business, not
the cluster network's. So it is not served on the metrics port (which a Service and Prometheus reach), but on a unix
socket in a directory of the agent's pod (``--status-socket``), mode 0600: ``kubectl exec … -- tessera status``
reaches it from inside the agent's container, root on the node through the pod's volume, nobody else. The metrics
port answers ``/status`` with a 404 that says where it went (``agent.telemetry.server``).

The socket file gets its mode before ``bind`` creates it (Linux takes a unix socket file's mode from the socket's
inode, which ``fchmod`` sets), so there is no moment at which it is open to others. A socket file left by an agent
that died is replaced; a path where another process answers, or that is not a socket, is refused (the caller logs
it and serves on without ``/status``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import socketserver
import stat
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

SOCKET_MODE = 0o600  # the agent's user only: root in the agent's container (kubectl exec) and on the node
DIRECTORY_MODE = 0o700  # a directory the agent creates for it
PROBE_SECONDS = 0.5  # how long an existing socket file may take to answer before it counts as left behind


class StatusSocketServer:
    """Serves ``GET /status`` (the document ``status()`` returns) over HTTP/1.0 on a unix socket; nothing else."""

    def __init__(self, path: Path, status: Callable[[], bytes]) -> None:
        from agent.telemetry.serving import BoundedThreadingMixIn, GetHandler, ServingThread  # loaded with metrics

        class Handler(GetHandler):
            def do_GET(self) -> None:
                if self.path.split("?", 1)[0] == "/status":
                    self.reply(200, status(), "application/json")
                else:
                    self.reply(404, b"not found: this socket serves /status only\n", "text/plain; charset=utf-8")

        class Server(BoundedThreadingMixIn, socketserver.UnixStreamServer):
            def server_bind(self) -> None:
                os.fchmod(self.socket.fileno(), SOCKET_MODE)  # the file bind creates has this mode from the start
                super().server_bind()
                Path(self.server_address).chmod(SOCKET_MODE)  # and keeps it whatever the umask did

        self.path = path
        _make_room(path)
        self._serving = ServingThread(Server(str(path), Handler), "status-socket")
        self._inode = path.stat().st_ino

    def start(self) -> None:
        self._serving.start()
        log.info("serving /status path=%s mode=%o", self.path, SOCKET_MODE)

    def stop(self, timeout: float = 2.0) -> None:
        """Remove the socket file (if it is still this server's) at once, even for a process about to exit
        (``timeout=0``), then stop serving."""
        with contextlib.suppress(OSError):
            if self.path.stat().st_ino == self._inode:
                self.path.unlink()
        self._serving.stop(timeout)


def _make_room(path: Path) -> None:
    """Create the socket's directory (0700) if it is missing, and remove a socket file an agent left behind.

    Raises ``OSError`` naming the problem for a path that is not a socket or where another process answers."""
    if not path.parent.is_dir():
        path.parent.mkdir(mode=DIRECTORY_MODE, parents=True, exist_ok=True)
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise OSError(errno.EEXIST, f"{path} exists and is not a socket; remove it or give another --status-socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(PROBE_SECONDS)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        path.unlink(missing_ok=True)  # nobody listens: a previous agent's
        return
    except OSError:
        pass  # it does not answer in time: someone holds it
    finally:
        probe.close()
    raise OSError(errno.EADDRINUSE, f"another process serves {path}; is a second agent running on this node?")
