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
import selectors
import socket
import socketserver
import stat
import threading
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

SOCKET_MODE = 0o600  # the agent's user only: root in the agent's container (kubectl exec) and on the node
DIRECTORY_MODE = 0o700  # a directory the agent creates for it
PROBE_SECONDS = 0.5  # how long an existing socket file may take to answer before it counts as left behind


class StatusSocketServer:
    """Serves ``GET /status`` (the document ``status()`` returns) over HTTP/1.0 on a unix socket; nothing else."""

    def __init__(self, path: Path, status: Callable[[], bytes]) -> None:
        from http.server import BaseHTTPRequestHandler  # loaded with metrics only, as agent.telemetry.server does

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?", 1)[0] == "/status":
                    self._reply(200, status(), "application/json")
                else:
                    self._reply(404, b"not found: this socket serves /status only\n", "text/plain; charset=utf-8")

            def _reply(self, code: int, body: bytes, content_type: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def address_string(self) -> str:
                return "unix"  # a unix peer has no address (BaseHTTPRequestHandler would index an empty string)

            def log_message(self, format: str, *args: object) -> None:
                return  # a request is not a log event

        class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
            daemon_threads = True

            def server_bind(self) -> None:
                os.fchmod(self.socket.fileno(), SOCKET_MODE)  # the file bind creates has this mode from the start
                super().server_bind()
                Path(self.server_address).chmod(SOCKET_MODE)  # and keeps it whatever the umask did

        self.path = path
        _make_room(path)
        self._server = Server(str(path), Handler)
        self._inode = path.stat().st_ino
        self._wake_read, self._wake_write = os.pipe2(os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._serve, name="status-socket", daemon=True)

    def start(self) -> None:
        self._thread.start()
        log.info("serving /status path=%s mode=%o", self.path, SOCKET_MODE)

    def stop(self, timeout: float = 2.0) -> None:
        """Remove the socket file (if it is still this server's) at once, even for a process about to exit
        (``timeout=0``), then stop serving."""
        with contextlib.suppress(OSError):
            if self.path.stat().st_ino == self._inode:
                self.path.unlink()
        os.write(self._wake_write, b"x")
        if self._thread.ident is not None:
            self._thread.join(timeout=timeout)
            if self._thread.is_alive():
                return
        self._server.server_close()
        os.close(self._wake_read)
        os.close(self._wake_write)

    def _serve(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self._server, selectors.EVENT_READ)
            selector.register(self._wake_read, selectors.EVENT_READ)
            while True:
                ready = {key.fileobj for key, _ in selector.select()}
                if self._wake_read in ready:
                    return
                self._server.handle_request()


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
