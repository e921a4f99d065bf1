"""One thread serving a ``socketserver`` server until told to stop, and the reply every handler of ours sends.

``serve_forever`` wakes twice a second to look for a shutdown request and makes ``shutdown`` wait for that; this
thread blocks in ``select`` on the listening socket and a wake pipe instead, so an idle server costs no CPU and
``stop`` returns at once. Shared by the metrics port (``agent.telemetry.server``) and the ``/status`` unix socket
(``agent.telemetry.status_socket``).
"""

from __future__ import annotations

import logging
import os
import selectors
import socketserver
import threading
from http.server import BaseHTTPRequestHandler

log = logging.getLogger(__name__)


class QuietHandler(BaseHTTPRequestHandler):
    """A handler whose requests are not log events, with one way to answer."""

    def reply(self, code: int, body: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        return


class ServingThread:
    """Serves ``server`` on a daemon thread named ``name`` between ``start`` and ``stop``."""

    def __init__(self, server: socketserver.BaseServer, name: str) -> None:
        self.server = server
        self._wake_read, self._wake_write = os.pipe2(os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Wake the thread and wait for it (at most ``timeout`` seconds); the sockets are closed once it is gone
        (a process about to exit, ``timeout=0``, leaves that to the kernel)."""
        os.write(self._wake_write, b"x")
        if self._thread.ident is not None:
            self._thread.join(timeout=timeout)
            if self._thread.is_alive():
                return
        self.server.server_close()
        os.close(self._wake_read)
        os.close(self._wake_write)

    def _serve(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self.server, selectors.EVENT_READ)
            selector.register(self._wake_read, selectors.EVENT_READ)
            while True:
                ready = {key.fileobj for key, _ in selector.select()}
                if self._wake_read in ready:
                    return
                self.server.handle_request()  # the listening socket is readable: this does not block
