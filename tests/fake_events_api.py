"""A fake Kubernetes API server for ``events.k8s.io/v1`` Events, spoken to by the real Kubernetes client over HTTP.

It implements what :mod:`agent.events` calls: ``POST /apis/events.k8s.io/v1/namespaces/<ns>/events`` and
``PATCH .../events/<name>``. Like the API server it validates a created Event the way ``ValidateEventCreate``
does for ``events.k8s.io/v1`` (required fields, limits, a series counts at least 2), answers ``409`` for a name
that exists and ``404`` for a patch of one that does not. A patch is applied as a JSON merge patch, which is what
a strategic merge patch of an Event's ``series`` comes to; a JSON patch (a list) or another content type gets
``415``/``400`` as from the API server. Knobs: answer writes with an error status (all of them, or the next N),
or hold every answer until released (an API server that hangs). Use it with ``tests.fake_kube.write_kubeconfig``.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest

DEADLINE = 15.0  # seconds any expected request may take (generous: CI machines run other tests alongside)
HOLD_LIMIT = 60.0  # a held answer is given anyway after this long, so no handler thread outlives a test run

_PATH = re.compile(r"/apis/events\.k8s\.io/v1/namespaces/(?P<ns>[a-z0-9-]+)/events(?:/(?P<name>[^/?]+))?")
# what Go's time.Parse takes for the API server's MicroTime layout 2006-01-02T15:04:05.000000Z07:00
_MICRO_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}(Z|[+-]\d\d:\d\d)")
_DNS_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
_QUALIFIED = re.compile(rf"({_DNS_SUBDOMAIN}/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")  # prefix/name
_MERGE_TYPES = ("application/strategic-merge-patch+json", "application/merge-patch+json")
_REASONS = {400: "BadRequest", 403: "Forbidden", 404: "NotFound", 409: "AlreadyExists", 415: "UnsupportedMediaType",
            422: "Invalid", 429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable"}  # fmt: skip


def status_body(code: int, message: str) -> dict:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": _REASONS.get(code, "Unknown"),
        "code": code,
    }


@dataclass(frozen=True)
class Request:
    """One request as the fake saw it, and the status it answered."""

    method: str
    path: str
    content_type: str
    body: object
    status: int
    at: float


def validate_event(event: dict, namespace: str) -> list[str]:
    """What the API server's ``ValidateEventCreate`` (events.k8s.io/v1) would refuse, as field paths."""
    errors = []
    metadata = event.get("metadata") or {}
    if event.get("apiVersion") != "events.k8s.io/v1" or event.get("kind") != "Event":
        errors.append("apiVersion/kind: must be events.k8s.io/v1 Event")
    if not metadata.get("name"):
        errors.append("metadata.name: Required value")
    if metadata.get("namespace", namespace) != namespace:
        errors.append("metadata.namespace: does not match the namespace of the request")
    if not _MICRO_TIME.fullmatch(str(event.get("eventTime", ""))):
        errors.append("eventTime: Required value (a MicroTime)")
    if not _QUALIFIED.fullmatch(str(event.get("reportingController", ""))):
        errors.append("reportingController: Required value (a qualified name)")
    instance = str(event.get("reportingInstance", ""))
    if not 0 < len(instance) <= 128:
        errors.append("reportingInstance: Required value, at most 128 characters")
    for field in ("action", "reason"):
        if not 0 < len(str(event.get(field, "")).encode()) <= 128:
            errors.append(f"{field}: Required value, at most 128 characters")
    if len(str(event.get("note", "")).encode()) > 1024:
        errors.append("note: Too long: may not be longer than 1024")
    if event.get("type") not in ("Normal", "Warning"):
        errors.append("type: Unsupported value")
    regarding = event.get("regarding") or {}
    if not regarding.get("kind") or not regarding.get("name"):
        errors.append("regarding: Required value")
    errors += _series_errors(event)
    return errors


def _series_errors(event: dict) -> list[str]:
    series = event.get("series")
    if series is None:
        return []
    errors = []
    if not isinstance(series.get("count"), int) or series["count"] < 2:
        errors.append("series.count: Invalid value: should be at least 2")
    if not _MICRO_TIME.fullmatch(str(series.get("lastObservedTime", ""))):
        errors.append("series.lastObservedTime: Required value (a MicroTime)")
    return errors


def merge_patch(target: object, patch: object) -> object:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


class FakeEventsApi:
    """The Events the fake holds, the requests it saw, and the knobs the tests turn; every method is thread-safe."""

    def __init__(self) -> None:
        self.events: dict[tuple[str, str], dict] = {}  # (namespace, name) -> Event
        self.requests: list[Request] = []
        self.fail_status: int | None = None  # answer every write with this status
        self.fail_next: list[int] = []  # answer the next writes with these statuses, in turn
        self.held = False  # hold every answer until release()
        self.port = 0
        self.rv = 1
        self.cond = threading.Condition()

    # -- what the tests do

    def fail(self, status: int | None) -> None:
        with self.cond:
            self.fail_status = status

    def fail_then_answer(self, *statuses: int) -> None:
        with self.cond:
            self.fail_next = list(statuses)

    def hold(self) -> None:
        with self.cond:
            self.held = True

    def release(self) -> None:
        with self.cond:
            self.held = False
            self.cond.notify_all()

    def forget(self, name: str, namespace: str = "default") -> None:
        """Drop an Event, as the API server does at the end of its TTL."""
        with self.cond:
            del self.events[(namespace, name)]

    def stored(self) -> list[dict]:
        with self.cond:
            return [json.loads(json.dumps(event)) for event in self.events.values()]

    def seen(self, method: str | None = None, status: int | None = None) -> list[Request]:
        with self.cond:
            return [r for r in self.requests if (method in (None, r.method)) and (status in (None, r.status))]

    def wait_for(self, predicate: Callable[[], bool], timeout: float = DEADLINE) -> None:
        with self.cond:
            if not self.cond.wait_for(predicate, timeout=timeout):
                pytest.fail(f"fake events API: condition not met within {timeout}s; requests={self.requests}")

    def wait_for_requests(self, n: int, method: str | None = None, timeout: float = DEADLINE) -> None:
        self.wait_for(lambda: sum(1 for r in self.requests if method in (None, r.method)) >= n, timeout)

    # -- what the handler calls

    def answer(self, method: str, path: str, content_type: str, raw: bytes) -> tuple[int, dict]:
        try:
            body: object = json.loads(raw or b"null")
        except ValueError:
            body = raw.decode(errors="replace")
        with self.cond:
            self.requests.append(Request(method, path, content_type, body, 0, time.monotonic()))
            index = len(self.requests) - 1
            self.cond.notify_all()
            end = time.monotonic() + HOLD_LIMIT
            self.cond.wait_for(lambda: not self.held or time.monotonic() >= end, timeout=HOLD_LIMIT)
            status, answer = self._answer(method, path, content_type, body)
            self.requests[index] = Request(method, path, content_type, body, status, self.requests[index].at)
            self.cond.notify_all()
        return status, answer

    def _answer(self, method: str, path: str, content_type: str, body: object) -> tuple[int, dict]:
        """Called with the lock held."""
        match = _PATH.fullmatch(urlsplit(path).path)
        if match is None or (method == "POST") != (match["name"] is None):
            return 404, status_body(404, f"the fake does not serve {method} {path}")
        if self.fail_next:
            status = self.fail_next.pop(0)
            return status, status_body(status, "the fake API server was told to fail")
        if self.fail_status == 403:
            verb = "create" if method == "POST" else "patch"
            return 403, status_body(
                403,
                f'events.events.k8s.io is forbidden: User "system:serviceaccount:tessera:agent" cannot {verb} '
                f'resource "events" in API group "events.k8s.io" in the namespace "{match["ns"]}"',
            )
        if self.fail_status is not None:
            return self.fail_status, status_body(self.fail_status, "the fake API server was told to fail")
        if method == "POST":
            return self._create(match["ns"], body)
        return self._patch(match["ns"], match["name"], content_type, body)

    def _create(self, namespace: str, event: object) -> tuple[int, dict]:
        if not isinstance(event, dict):
            return 400, status_body(400, "the body is not an object")
        errors = validate_event(event, namespace)
        if errors:
            return 422, status_body(422, "Event is invalid: " + "; ".join(errors))
        name = event["metadata"]["name"]
        if (namespace, name) in self.events:
            return 409, status_body(409, f'events.events.k8s.io "{name}" already exists')
        self.rv += 1
        stored = json.loads(json.dumps(event))
        stored["metadata"].update(
            namespace=namespace, uid=f"00000000-0000-4000-8000-{self.rv:012d}", resourceVersion=str(self.rv)
        )
        self.events[(namespace, name)] = stored
        return 201, stored

    def _patch(self, namespace: str, name: str, content_type: str, patch: object) -> tuple[int, dict]:
        kind = content_type.split(";")[0].strip()
        if kind == "application/json-patch+json":
            if not isinstance(patch, list):
                return 400, status_body(400, "json: cannot unmarshal object into Go value of type jsonpatch.Patch")
            return 415, status_body(415, "the fake applies no JSON patches")
        if kind not in _MERGE_TYPES:
            return 415, status_body(415, f"the body of the request was in an unknown format - accepted: {_MERGE_TYPES}")
        current = self.events.get((namespace, name))
        if current is None:
            return 404, status_body(404, f'events.events.k8s.io "{name}" not found')
        patched = merge_patch(current, patch)
        assert isinstance(patched, dict)
        errors = validate_event(patched, namespace)
        if errors:
            return 422, status_body(422, "Event is invalid: " + "; ".join(errors))
        self.rv += 1
        patched["metadata"]["resourceVersion"] = str(self.rv)
        self.events[(namespace, name)] = patched
        return 200, patched


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def setup(self) -> None:
        super().setup()
        with self.server.lock:  # type: ignore[attr-defined]
            self.server.connections.add(self.connection)  # type: ignore[attr-defined]

    def finish(self) -> None:
        with self.server.lock:  # type: ignore[attr-defined]
            self.server.connections.discard(self.connection)  # type: ignore[attr-defined]
        super().finish()

    def _serve(self) -> None:
        fake: FakeEventsApi = self.server.fake  # type: ignore[attr-defined]
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        status, body = fake.answer(self.command, self.path, self.headers.get("Content-Type", ""), raw)
        data = json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            pass  # the client gave up waiting

    do_POST = _serve
    do_PATCH = _serve
    do_GET = _serve
    do_PUT = _serve
    do_DELETE = _serve


class Serving:
    """A running fake: ``port`` for the kubeconfig; ``close()`` takes the API server away (idempotent): nothing
    listens on the port any more and the connections the client keeps alive are cut."""

    def __init__(self, fake: FakeEventsApi) -> None:
        self.fake = fake
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        self._server.fake = fake  # type: ignore[attr-defined]
        self._server.lock = threading.Lock()  # type: ignore[attr-defined]
        self._server.connections = set()  # type: ignore[attr-defined]
        self.port = self._server.server_address[1]
        fake.port = self.port
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        self._closed = False

    def close(self) -> None:
        """Stop listening and cut every open (kept-alive) connection, as an API server that went away does."""
        if self._closed:
            return
        self._closed = True
        self.fake.release()
        self._server.shutdown()
        self._server.server_close()
        with self._server.lock:  # type: ignore[attr-defined]
            connections = list(self._server.connections)  # type: ignore[attr-defined]
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=5)


@contextmanager
def serving(fake: FakeEventsApi) -> Iterator[Serving]:
    """Serve ``fake`` on 127.0.0.1 (an ephemeral port) until the block ends."""
    server = Serving(fake)
    try:
        yield server
    finally:
        server.close()
