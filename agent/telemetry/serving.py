"""The agent's two small HTTP endpoints — the metrics port (``agent.telemetry.server``) and the ``/status`` unix
socket (``agent.telemetry.status_socket``): how a request is read and answered, and the one thread serving each.

A request is one ``GET`` (or ``HEAD``) of HTTP/1.x, answered with a body of known length and the connection closed,
which is all that Prometheus, the kubelet's probes and ``tessera status`` ask. It is read within bounds — a request
line and headers of at most ``MAX_LINE`` bytes each, ``MAX_HEADERS`` headers, ``REQUEST_SECONDS`` for the whole of
it — and at most ``MAX_CONNECTIONS`` are served at once: a client that connects and says nothing, or says too much,
holds a thread for seconds, never for good (the metrics port is reachable from the cluster). ``http.server``'s
request handler has neither bound, and loads what only its error pages and file serving use (``html`` and its
entity tables, ``mimetypes``: ~0.5 MB of an idle agent's memory).

``serve_forever`` wakes twice a second to look for a shutdown request and makes ``shutdown`` wait for that; the
serving thread blocks in ``select`` on the listening socket and a wake pipe instead, so an idle server costs no CPU
and ``stop`` returns at once.
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import socketserver
import threading
from http import HTTPStatus

log = logging.getLogger(__name__)

MAX_LINE = 8192  # bytes of the request line, and of each header line
MAX_HEADERS = 100
REQUEST_SECONDS = 10.0  # to send the whole request; and to take the answer
MAX_CONNECTIONS = 16  # served at once; more are closed unanswered until one ends


class _BadRequest(Exception):
    def __init__(self, status: HTTPStatus, why: str) -> None:
        super().__init__(why)
        self.status = status


class GetHandler(socketserver.StreamRequestHandler):
    """Reads one bounded ``GET``/``HEAD`` request, sets ``path`` and calls ``do_GET``, which answers with
    :meth:`reply`. Nothing is logged per request."""

    timeout = REQUEST_SECONDS  # socketserver puts it on the connection's socket
    path = ""
    _head = False

    def handle(self) -> None:
        try:
            method = self._read_request()
        except _BadRequest as error:
            self.reply(error.status, f"{error}\n".encode(), "text/plain; charset=utf-8")
            return
        except (OSError, ValueError):  # a timeout, a reset: nobody to answer
            return
        if method is None:
            return  # connected and closed without a word (a TCP probe)
        if method not in ("GET", "HEAD"):
            self.reply(HTTPStatus.METHOD_NOT_ALLOWED, b"only GET is served here\n", "text/plain; charset=utf-8")
            return
        self._head = method == "HEAD"
        self.do_GET()

    def do_GET(self) -> None:
        raise NotImplementedError

    def reply(self, code: int, body: bytes, content_type: str) -> None:
        status = HTTPStatus(code)
        head = (
            f"HTTP/1.0 {status.value} {status.phrase}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode("latin-1")
        try:
            self.wfile.write(head if self._head else head + body)
        except OSError:  # the client left before its answer
            return

    def _read_request(self) -> str | None:
        """The method, with ``path`` set; None for a connection closed before it said anything."""
        line = self._line(too_long=HTTPStatus.REQUEST_URI_TOO_LONG)  # 414, as http.server says for a long URI
        if not line:
            return None
        words = line.decode("latin-1").split()
        if len(words) != 3 or not words[2].startswith("HTTP/1."):
            raise _BadRequest(HTTPStatus.BAD_REQUEST, "not an HTTP/1 request line")
        for _ in range(MAX_HEADERS):
            if self._line().strip() == b"":  # the blank line that ends the headers (or the end of the stream)
                break
        else:
            raise _BadRequest(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, f"more than {MAX_HEADERS} headers")
        self.path = words[1]
        return words[0]

    def _line(self, too_long: HTTPStatus = HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE) -> bytes:
        line = self.rfile.readline(MAX_LINE + 1)
        if len(line) > MAX_LINE:
            raise _BadRequest(too_long, f"a line longer than {MAX_LINE} bytes")
        return line


class BoundedThreadingMixIn(socketserver.ThreadingMixIn):
    """A thread per connection, at most ``MAX_CONNECTIONS`` at once: beyond that a connection is closed at once."""

    daemon_threads = True
    max_connections = MAX_CONNECTIONS

    def __init__(self, *args: object, **kwargs: object) -> None:
        self._slots = threading.BoundedSemaphore(self.max_connections)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def process_request(self, request: socket.socket, client_address: object) -> None:  # type: ignore[override]
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # type: ignore[attr-defined]
            return
        try:
            super().process_request(request, client_address)  # type: ignore[arg-type]
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: socket.socket, client_address: object) -> None:  # type: ignore[override]
        try:
            super().process_request_thread(request, client_address)  # type: ignore[arg-type]
        finally:
            self._slots.release()


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
