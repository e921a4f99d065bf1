"""The metrics port's and the status socket's HTTP (agent.telemetry.serving), as a client on the network sees it.

What a user would notice: Prometheus, the kubelet's probes and ``tessera status`` get their answer; a client that
connects and says nothing, or sends more than a request can hold, is cut off within bounds and never stops the
endpoint from answering the next scrape; ``HEAD`` gets the headers, other methods a 405.
"""

from __future__ import annotations

import socket
import socketserver
import time
from collections.abc import Iterator

import pytest

from agent.telemetry.serving import MAX_HEADERS, MAX_LINE, BoundedThreadingMixIn, GetHandler, ServingThread

pytestmark = pytest.mark.timeout(60)

DEADLINE = 10.0
TOO_LARGE = "HTTP/1.0 431 Request Header Fields Too Large"
QUIET_SECONDS = 0.5  # the test server's REQUEST_SECONDS: how long a silent client holds a connection


class Echo(GetHandler):
    timeout = QUIET_SECONDS

    def do_GET(self) -> None:
        self.reply(200, f"path={self.path}\n".encode(), "text/plain; charset=utf-8")


class Server(BoundedThreadingMixIn, socketserver.TCPServer):
    allow_reuse_address = True
    max_connections = 2


@pytest.fixture
def port() -> Iterator[int]:
    server = Server(("127.0.0.1", 0), Echo)
    serving = ServingThread(server, "test-http")
    serving.start()
    yield server.server_address[1]
    serving.stop()


def _ask(port: int, request: bytes) -> bytes:
    """Send ``request`` and read the answer to its end (the server closes the connection)."""
    with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE) as conn:
        conn.sendall(request)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    return answer


def _status(answer: bytes) -> str:
    return answer.split(b"\r\n", 1)[0].decode()


def test_a_get_is_answered_with_its_length_and_the_connection_closed(port: int) -> None:
    answer = _ask(port, b"GET /metrics?x=1 HTTP/1.1\r\nHost: node\r\nAccept-Encoding: gzip\r\n\r\n")
    head, body = answer.split(b"\r\n\r\n", 1)
    assert _status(answer) == "HTTP/1.0 200 OK"
    assert b"Content-Length: %d" % len(body) in head and b"Connection: close" in head
    assert body == b"path=/metrics?x=1\n"


def test_head_gets_the_headers_only_and_other_methods_a_405(port: int) -> None:
    answer = _ask(port, b"HEAD /metrics HTTP/1.1\r\n\r\n")
    assert _status(answer) == "HTTP/1.0 200 OK" and answer.endswith(b"\r\n\r\n")
    assert (
        _status(_ask(port, b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n")) == "HTTP/1.0 405 Method Not Allowed"
    )


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", "HTTP/1.0 400 Bad Request"),  # TLS to a plain port
        (b"GET /metrics\r\n\r\n", "HTTP/1.0 400 Bad Request"),  # HTTP/0.9
        (b"GET /" + b"m" * MAX_LINE + b" HTTP/1.1\r\n\r\n", "HTTP/1.0 414 Request-URI Too Long"),
        (b"GET / HTTP/1.1\r\nX: " + b"y" * MAX_LINE + b"\r\n\r\n", TOO_LARGE),
        (
            b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * (MAX_HEADERS + 1) + b"\r\n",
            TOO_LARGE,
        ),
    ],
    ids=["tls", "http-0.9", "long-line", "long-header", "many-headers"],
)
def test_what_is_no_bounded_http_request_gets_a_4xx(port: int, request_bytes: bytes, status: str) -> None:
    assert _status(_ask(port, request_bytes)) == status
    assert _status(_ask(port, b"GET / HTTP/1.1\r\n\r\n")) == "HTTP/1.0 200 OK"  # and the next one is served


def test_clients_that_say_nothing_are_cut_off_and_never_stop_the_next_scrape(port: int) -> None:
    """Two silent connections hold the test server's two slots: a third connection is closed unanswered at once,
    and once the silent ones are cut off (after the request deadline) a scrape is answered again."""
    silent = [socket.create_connection(("127.0.0.1", port), timeout=DEADLINE) for _ in range(2)]
    try:
        deadline = time.monotonic() + DEADLINE
        while (answer := _ask(port, b"GET / HTTP/1.1\r\n\r\n")) != b"":  # the slots may not be taken yet
            assert time.monotonic() < deadline, "a third connection was still served with two held"
            time.sleep(0.01)
        for conn in silent:  # each is cut off by the server within its deadline: the read ends, empty
            assert conn.recv(1) == b""
        deadline = time.monotonic() + DEADLINE
        while _status(answer := _ask(port, b"GET / HTTP/1.1\r\n\r\n")) != "HTTP/1.0 200 OK":
            assert time.monotonic() < deadline, answer
            time.sleep(0.01)
    finally:
        for conn in silent:
            conn.close()
