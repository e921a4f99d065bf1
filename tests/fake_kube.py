"""A fake Kubernetes API server for one Node, spoken to by the real Kubernetes client over HTTP.

It implements only what the agent's node watcher calls: ``GET /api/v1/nodes/<name>`` and the field-selected
watch ``GET /api/v1/nodes?fieldSelector=metadata.name%3D<name>&watch=true`` as a chunked stream of
newline-delimited events. Like the real API server it keeps an event history, so a watch from resourceVersion N
replays every event after N, and a compaction makes older resourceVersions answer ``410 Gone``.
"""

from __future__ import annotations

import functools
import json
import select
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

DEADLINE = 15.0  # seconds any expected event may take (generous: CI machines run other tests alongside)


def _status(code: int, reason: str, message: str) -> dict:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


_GO_TRUE = {"1", "t", "T", "TRUE", "true", "True"}  # what the API server's strconv.ParseBool takes as true
_REASONS = {403: "Forbidden", 404: "NotFound", 410: "Expired", 500: "InternalError"}


class FakeKube:
    """One node, its label history and the knobs the tests turn; every method is thread-safe."""

    def __init__(self, node_name: str, labels: dict[str, str], annotations: dict[str, str] | None = None) -> None:
        self.node_name = node_name
        self.labels = dict(labels)
        self.annotations = dict(annotations or {})
        self.rv = 100
        self.horizon = 0  # watches from a resourceVersion older than this get 410 Gone
        self.history: list[tuple[int, dict]] = []  # (resourceVersion, watch event)
        self.requests: list[tuple[float, str, int]] = []  # (time, "get" | "watch" | "other", status answered)
        self.get_status: int | None = None  # answer GETs with this error status
        self.watch_status: int | None = None  # answer watches with this error status
        self.patch_status: int | None = None  # answer patches with this error status
        self.patches: list[dict] = []  # the metadata of every patch that was applied
        self.open_streams = 0
        self.authorizations: list[str | None] = []  # the Authorization header of every GET, in order
        self.close_generation = 0  # bumped to end every open watch stream
        self.closing = False
        self.cond = threading.Condition()

    # -- what the tests do

    def node(self) -> dict:
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.node_name,
                "uid": "6c1e8f0e-0000-4000-8000-000000000001",
                "resourceVersion": str(self.rv),
                "creationTimestamp": "2025-01-01T00:00:00Z",
                "labels": dict(self.labels),
                "annotations": dict(self.annotations),
            },
            "spec": {},
            "status": {},
        }

    def update(
        self,
        set_: dict[str, str] | None = None,
        remove: tuple[str, ...] = (),
        *,
        notify: bool = True,
        annotate: dict[str, str | None] | None = None,
    ) -> None:
        """Change labels (and ``annotate``: annotations, None removes one) in a new resourceVersion;
        ``notify=False`` changes them without a watch event."""
        with self.cond:
            self.labels.update(set_ or {})
            for key in remove:
                self.labels.pop(key, None)
            for key, value in (annotate or {}).items():
                if value is None:
                    self.annotations.pop(key, None)
                else:
                    self.annotations[key] = value
            self.rv += 1
            if notify:
                self.history.append((self.rv, {"type": "MODIFIED", "object": self.node()}))
            self.cond.notify_all()

    def compact(self) -> None:
        """Forget the history: a watch from any older resourceVersion now gets 410 Gone."""
        with self.cond:
            self.history.clear()
            self.horizon = self.rv
            self.cond.notify_all()

    def close_streams(self) -> None:
        """End every open watch stream, as the API server does at its timeout or on a restart."""
        with self.cond:
            self.close_generation += 1
            self.cond.notify_all()

    def count(self, kind: str, status: int | None = None) -> int:
        with self.cond:
            return sum(1 for _, k, s in self.requests if k == kind and (status is None or s == status))

    def times(self, kind: str) -> list[float]:
        with self.cond:
            return [t for t, k, _ in self.requests if k == kind]

    def wait_for(self, predicate, timeout: float = DEADLINE) -> None:
        with self.cond:
            if not self.cond.wait_for(predicate, timeout=timeout):
                pytest.fail(f"fake API server: condition not met within {timeout}s; requests={self.requests}")

    def wait_for_requests(self, kind: str, n: int, timeout: float = DEADLINE) -> None:
        self.wait_for(lambda: sum(1 for _, k, _ in self.requests if k == kind) >= n, timeout)

    # -- what the handler calls

    def record(self, kind: str, status: int) -> None:
        with self.cond:
            self.requests.append((time.monotonic(), kind, status))
            self.cond.notify_all()

    def serve_get(self, handler: BaseHTTPRequestHandler, name: str) -> None:
        with self.cond:
            status = self.get_status
            if status is None and name != self.node_name:
                status = 404
            body = self.node() if status is None else None
        if status == 404:
            body = _status(404, "NotFound", f'nodes "{name}" not found')
        elif status == 403:
            body = _status(
                403,
                "Forbidden",
                f'nodes "{name}" is forbidden: User "system:serviceaccount:tessera:agent" cannot get resource '
                '"nodes" in API group "" at the cluster scope',
            )
        elif status is not None:
            body = _status(status, _REASONS.get(status, "Unknown"), "the fake API server was told to fail")
        self.record("get", status or 200)
        _send_json(handler, status or 200, body)

    def serve_patch(self, name: str, content_type: str, raw: bytes) -> tuple[int, dict]:
        """A strategic-merge or merge patch of the node's labels and annotations (None removes a key)."""
        with self.cond:
            status = self.patch_status
        if status is not None:
            self.record("patch", status)
            return status, _status(status, _REASONS.get(status, "Unknown"), "the fake API server was told to fail")
        if name != self.node_name:
            self.record("patch", 404)
            return 404, _status(404, "NotFound", f'nodes "{name}" not found')
        if "merge-patch" not in content_type:
            self.record("patch", 415)
            return 415, _status(415, "UnsupportedMediaType", f"unsupported patch type {content_type}")
        metadata = json.loads(raw or b"{}").get("metadata", {})
        with self.cond:
            self.patches.append(metadata)
        self.update(
            {k: v for k, v in (metadata.get("labels") or {}).items() if v is not None},
            tuple(k for k, v in (metadata.get("labels") or {}).items() if v is None),
            annotate=metadata.get("annotations") or {},
        )
        self.record("patch", 200)
        with self.cond:
            return 200, self.node()

    def serve_watch(self, handler: BaseHTTPRequestHandler, query: dict[str, list[str]]) -> None:
        if query.get("fieldSelector") != [f"metadata.name={self.node_name}"]:
            self.record("watch", 400)
            _send_json(handler, 400, _status(400, "BadRequest", f"unexpected fieldSelector {query}"))
            return
        since = int(query.get("resourceVersion", ["0"])[0] or 0)
        timeout = float(query.get("timeoutSeconds", ["3600"])[0])
        with self.cond:
            status = self.watch_status
            gone = status is None and since < self.horizon
        if status is not None:
            self.record("watch", status)
            _send_json(handler, status, _status(status, _REASONS.get(status, "Unknown"), "told to fail"))
            return
        self.record("watch", 410 if gone else 200)
        handler.close_connection = True
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.end_headers()
        try:
            if gone:  # what the API server sends for a resourceVersion it no longer has
                message = f"too old resource version: {since} ({self.horizon})"
                _send_chunk(handler, {"type": "ERROR", "object": _status(410, "Expired", message)})
            else:
                self._stream(handler, since, time.monotonic() + timeout)
            handler.wfile.write(b"0\r\n\r\n")
            handler.wfile.flush()
        except OSError:
            pass  # the client went away (the watcher stopped)

    def _stream_ready(self, generation: int, since: int) -> bool:
        """Called with the lock held: the stream has something to send or must end."""
        return self.closing or self.close_generation != generation or any(rv > since for rv, _ in self.history)

    def _stream(self, handler: BaseHTTPRequestHandler, since: int, end: float) -> None:
        with self.cond:
            generation = self.close_generation
            self.open_streams += 1
            self.cond.notify_all()
        try:
            while True:
                with self.cond:
                    self.cond.wait_for(
                        functools.partial(self._stream_ready, generation, since),
                        timeout=max(0.0, min(0.2, end - time.monotonic())),
                    )
                    pending = [(rv, event) for rv, event in self.history if rv > since]
                    done = self.closing or self.close_generation != generation or time.monotonic() >= end
                if _client_gone(handler):
                    return
                for rv, event in pending:
                    _send_chunk(handler, event)
                    since = rv
                if done:
                    return
        finally:
            with self.cond:
                self.open_streams -= 1
                self.cond.notify_all()


def _client_gone(handler: BaseHTTPRequestHandler) -> bool:
    """The client closed or cut its end of the connection (a watch sends no request body to read)."""
    readable, _, _ = select.select([handler.connection], [], [], 0)
    if not readable:
        return False
    try:
        return handler.connection.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def _send_json(handler: BaseHTTPRequestHandler, status: int, body: object) -> None:
    data = json.dumps(body).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def _send_chunk(handler: BaseHTTPRequestHandler, event: dict) -> None:
    data = json.dumps(event).encode() + b"\n"
    handler.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
    handler.wfile.flush()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        fake: FakeKube = self.server.fake  # type: ignore[attr-defined]
        with fake.cond:
            fake.authorizations.append(self.headers.get("Authorization"))
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        if url.path == "/api/v1/nodes" and query.get("watch", [""])[0] in _GO_TRUE:
            fake.serve_watch(self, query)
        elif url.path.startswith("/api/v1/nodes/") and url.path.count("/") == 4:
            fake.serve_get(self, url.path.rsplit("/", 1)[1])
        else:
            fake.record("other", 404)
            _send_json(self, 404, _status(404, "NotFound", f"the fake does not serve {self.path}"))

    def do_POST(self) -> None:
        self._to_events("POST")

    def do_PATCH(self) -> None:
        self._to_events("PATCH")

    def _to_events(self, method: str) -> None:
        """A PATCH of the node is the node's; other writes go to the Events fake, when the node has one
        (``serving(kube, events=...)``)."""
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        fake: FakeKube = self.server.fake  # type: ignore[attr-defined]
        path = urlsplit(self.path).path
        if method == "PATCH" and path.startswith("/api/v1/nodes/") and path.count("/") == 4:
            status, body = fake.serve_patch(path.rsplit("/", 1)[1], self.headers.get("Content-Type", ""), raw)
            _send_json(self, status, body)
            return
        events = getattr(self.server, "events", None)
        if events is None:
            _send_json(self, 404, _status(404, "NotFound", f"the fake does not serve {method} {self.path}"))
            return
        status, body = events.answer(method, urlsplit(self.path).path, self.headers.get("Content-Type", ""), raw)
        _send_json(self, status, body)


@contextmanager
def serving(kube: FakeKube, events: object | None = None, tls: ssl.SSLContext | None = None) -> Iterator[FakeKube]:
    """Serve ``kube`` on 127.0.0.1 (an ephemeral port, as ``kube.port``) until the block ends; with ``events``
    (a ``tests.fake_events_api.FakeEventsApi``) the same server takes the agent's Events too; with ``tls`` (a
    server-side context) over HTTPS."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    server.daemon_threads = True
    server.fake = kube  # type: ignore[attr-defined]
    server.events = events  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    kube.port = server.server_address[1]  # type: ignore[attr-defined]
    yield kube
    with kube.cond:
        kube.closing = True
        kube.cond.notify_all()
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def write_kubeconfig(path: Path, port: int) -> Path:
    """A kubeconfig for the fake at ``port`` (no credentials: the fake asks for none)."""
    path.write_text(
        f"""apiVersion: v1
kind: Config
clusters:
- name: fake
  cluster:
    server: http://127.0.0.1:{port}
users:
- name: anonymous
  user: {{}}
contexts:
- name: fake
  context:
    cluster: fake
    user: anonymous
current-context: fake
"""
    )
    return path
