"""``/metrics``, ``/healthz`` (the loops are alive) and ``/readyz`` (registered with the kubelet), on the metrics
port that a Service, Prometheus and the kubelet's probes reach.

``/status`` (what the agent is doing: every claim, the pods holding GPUs) is not served here: it is the node's
business, served on a unix socket for ``tessera status`` (``agent.telemetry.status_socket``). A request for it here
gets a 404 that says where it went."""

from __future__ import annotations

import logging
import socketserver
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
        from agent.telemetry.serving import BoundedThreadingMixIn, GetHandler, ServingThread  # not for parse_address

        class Handler(GetHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self.reply(200, last.rendered, CONTENT_TYPE)
                elif path in ("/healthz", "/readyz"):
                    ok, why = (healthy if path == "/healthz" else ready)()
                    self.reply(200 if ok else 503, (why + "\n").encode(), "text/plain; charset=utf-8")
                elif path == "/status":
                    self.reply(404, moved, "text/plain; charset=utf-8")
                else:
                    self.reply(404, b"not found: /metrics, /healthz, /readyz\n", "text/plain; charset=utf-8")

        moved = (
            f"not found: /status is not served on the metrics port; it moved to the agent's unix socket on the node, "
            f"{status_socket} (--status-socket), which `tessera status` reads there "
            "(kubectl exec -n tessera-system ds/tessera -- tessera status)\n"
            if status_socket is not None
            else "not found: /status is not served on the metrics port; it is served only on the agent's unix socket "
            "(--status-socket), which this agent has off\n"
        ).encode()

        class Server(BoundedThreadingMixIn, socketserver.TCPServer):
            allow_reuse_address = True  # a restarted agent binds its port again at once

        server = Server(parse_address(address), Handler)
        self.port = server.server_address[1]
        self._serving = ServingThread(server, "metrics-http")

    def start(self) -> None:
        self._serving.start()
        log.info("serving metrics port=%d paths=/metrics,/healthz,/readyz", self.port)

    def stop(self, timeout: float = 2.0) -> None:
        """Stop serving (at most ``timeout`` seconds; ``timeout=0`` for a process about to exit)."""
        self._serving.stop(timeout)
