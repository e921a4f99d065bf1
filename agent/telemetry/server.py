"""``/metrics``, ``/healthz`` (the loops are alive) and ``/readyz`` (registered with the kubelet), on the metrics
port that a Service, Prometheus and the kubelet's probes reach.

``/status`` (what the agent is doing: every claim, the pods holding GPUs) is not served here: it is the node's
business, served on a unix socket for ``tessera status`` (``agent.telemetry.status_socket``). A request for it here
gets a 404 that says where it went."""

from __future__ import annotations

import logging
import os
import selectors
import socketserver
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agent.telemetry.collector import LastCollection

log = logging.getLogger(__name__)

# The classic text format, which every scraper reads. (Newer prometheus_client's CONTENT_TYPE_LATEST says
# version=1.0.0, which its own server only sends to a scraper that asks for it.)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def parse_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``:PORT`` (all interfaces); port 0 picks a free port (``TelemetryServer.port`` tells)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"metrics address {address!r} must be HOST:PORT or :PORT")
    return host.strip("[]") or "0.0.0.0", int(port)  # noqa: S104 - a node agent's metrics port, by design


class TelemetryServer:
    def __init__(
        self,
        address: str,
        last: LastCollection,
        healthy: Callable[[], tuple[bool, str]],
        ready: Callable[[], tuple[bool, str]],
        status_socket: str | None = None,
    ) -> None:
        """``status_socket``: where ``/status`` is served instead (None: nowhere), for the 404 that says so."""
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer  # not for parse_address's callers

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._reply(200, last.rendered, CONTENT_TYPE)
                elif path in ("/healthz", "/readyz"):
                    ok, why = (healthy if path == "/healthz" else ready)()
                    self._reply(200 if ok else 503, (why + "\n").encode(), "text/plain; charset=utf-8")
                elif path == "/status":
                    self._reply(404, moved, "text/plain; charset=utf-8")
                else:
                    self._reply(404, b"not found: /metrics, /healthz, /readyz\n", "text/plain; charset=utf-8")

            def _reply(self, code: int, body: bytes, content_type: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                return  # scrapes are not log events

        moved = (
            f"not found: /status is not served on the metrics port; it moved to the agent's unix socket on the node, "
            f"{status_socket} (--status-socket), which `tessera status` reads there "
            "(kubectl exec -n tessera-system ds/tessera -- tessera status)\n"
            if status_socket is not None
            else "not found: /status is not served on the metrics port; it is served only on the agent's unix socket "
            "(--status-socket), which this agent has off\n"
        ).encode()

        class Server(ThreadingHTTPServer):
            def server_bind(self) -> None:
                """HTTPServer's own asks the resolver for the host's FQDN (a reverse DNS lookup of the node's
                hostname for 0.0.0.0), which nothing here uses and which can hang for as long as DNS does."""
                socketserver.TCPServer.server_bind(self)
                self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])

        self._server = Server(parse_address(address), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._wake_read, self._wake_write = os.pipe2(os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._serve, name="metrics-http", daemon=True)

    def start(self) -> None:
        self._thread.start()
        log.info("serving metrics port=%d paths=/metrics,/healthz,/readyz", self.port)

    def stop(self, timeout: float = 2.0) -> None:
        """Wake the serving thread and wait for it (at most ``timeout`` seconds); its sockets are closed once it
        is gone (a process about to exit, ``timeout=0``, leaves that to the kernel)."""
        os.write(self._wake_write, b"x")
        if self._thread.ident is not None:
            self._thread.join(timeout=timeout)
            if self._thread.is_alive():
                return
        self._server.server_close()
        os.close(self._wake_read)
        os.close(self._wake_write)

    def _serve(self) -> None:
        """Block until a connection or ``stop`` arrives (``serve_forever`` would wake twice a second to look
        for a shutdown request, and make ``stop`` wait for that)."""
        with selectors.DefaultSelector() as selector:
            selector.register(self._server, selectors.EVENT_READ)
            selector.register(self._wake_read, selectors.EVENT_READ)
            while True:
                ready = {key.fileobj for key, _ in selector.select()}
                if self._wake_read in ready:
                    return
                self._server.handle_request()  # the listening socket is readable: this does not block
