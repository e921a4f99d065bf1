"""HTTP: routing of API paths to verbs, request bodies, JSON answers, chunked watch streams, injected faults.

Paths: ``/api/v1/nodes[/<name>]``, ``/apis/resource.k8s.io/v1/{resourceslices,deviceclasses}[/<name>]``,
``/apis/resource.k8s.io/v1/namespaces/<ns>/resourceclaims[/<name>[/status]]`` and
``/apis/resource.k8s.io/v1/resourceclaims`` (list and watch across namespaces); ``/version``; discovery documents at
``/api``, ``/api/v1``, ``/apis``, ``/apis/resource.k8s.io[/v1]``; ``/healthz``, ``/livez``, ``/readyz``.

Request bodies: at most 3 MiB (``MaxRequestBodyBytes`` of the real server: 413 beyond); JSON (also without a
Content-Type header: the Kubernetes Python client sends POST and PUT bodies without one, and the real server then
assumes JSON) or YAML; anything else is 415. PATCH takes JSON patch, merge patch and strategic merge patch
(server-side apply is 415).
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import yaml
from msgspec import Struct, field

from agent.sim.apiserver import patch as patches
from agent.sim.apiserver import watch as watches
from agent.sim.apiserver.errors import ApiError, bad_request, status_body
from agent.sim.apiserver.faults import Faults
from agent.sim.apiserver.kinds import KINDS, Kind, by_path
from agent.sim.apiserver.observe import Request, RequestLog, stamp
from agent.sim.apiserver.registry import Registry
from agent.sim.apiserver.selectors import FieldSelector, LabelSelector

MAX_BODY = 3 * 1024 * 1024  # the API server's default MaxRequestBodyBytes
IDLE_TIMEOUT = 120.0  # seconds an idle keep-alive connection is kept
_GO_TRUE = {"1", "t", "T", "TRUE", "true", "True"}  # strconv.ParseBool's true values
_NOT_FOUND = "the server could not find the requested resource"


class Context(Struct):
    """What the handlers reach: set up by ``ApiServer``."""

    registry: Registry
    log: RequestLog
    faults: Faults
    version_info: dict
    stopping: threading.Event
    discovery_address: list[str] = field(default_factory=lambda: ["127.0.0.1:0"])


class Target(Struct):
    verb: str
    resource: str
    kind: Kind | None = None
    namespace: str | None = None
    name: str | None = None
    subresource: str | None = None


def route(method: str, path: str, query: dict[str, str]) -> Target:
    parts = [p for p in path.split("/") if p]
    if parts in (["version"], ["api"], ["apis"], ["healthz"], ["livez"], ["readyz"]):
        return Target("discovery", parts[0])
    if parts and parts[0] == "api" and len(parts) >= 2:
        group, version, rest = "", parts[1], parts[2:]
    elif parts and parts[0] == "apis" and len(parts) >= 3:
        group, version, rest = parts[1], parts[2], parts[3:]
    elif parts and parts[0] == "apis" and len(parts) == 2:
        return Target("discovery", f"group:{parts[1]}")
    else:
        raise ApiError(404, _NOT_FOUND)
    if not rest:
        return Target("discovery", f"resources:{group}/{version}")
    namespace = None
    if rest[0] == "namespaces" and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    kind = by_path(group, version, rest[0])
    if kind is None or len(rest) > 3 or (namespace is not None and not kind.namespaced):
        raise ApiError(404, _NOT_FOUND)
    name = rest[1] if len(rest) >= 2 else None
    sub = rest[2] if len(rest) == 3 else None
    if sub is not None and not (sub == "status" and kind.status):
        raise ApiError(404, _NOT_FOUND)
    resource = kind.plural + (f"/{sub}" if sub else "")
    if kind.namespaced and namespace is None and (name is not None or method != "GET"):
        raise ApiError(404, _NOT_FOUND)
    if method == "GET":
        verb = "get" if name else ("watch" if query.get("watch") in _GO_TRUE else "list")
    elif method == "POST" and name is None:
        verb = "create"
    elif method == "PUT" and name is not None:
        verb = "update"
    elif method == "PATCH" and name is not None:
        verb = "patch"
    elif method == "DELETE" and sub is None:
        verb = "delete" if name else "deletecollection"
    else:
        raise ApiError(405, f"the server does not allow this method on the requested resource ({method} {resource})")
    return Target(verb, resource, kind, namespace, name, sub)


def _discovery(target: Target, ctx: Context) -> tuple[int, object]:
    what = target.resource
    if what == "version":
        return 200, ctx.version_info
    if what in ("healthz", "livez", "readyz"):
        return 200, "ok"
    groups = sorted({k.group for k in KINDS if k.group})
    if what == "api":
        return 200, {
            "kind": "APIVersions",
            "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": ctx.discovery_address[0]}],
        }

    def group_doc(group: str) -> dict:
        versions = sorted({k.version for k in KINDS if k.group == group})
        listed = [{"groupVersion": f"{group}/{v}", "version": v} for v in versions]
        return {"name": group, "versions": listed, "preferredVersion": listed[0]}

    if what == "apis":
        return 200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": [group_doc(g) for g in groups]}
    if what.startswith("group:") and what[6:] in groups:
        return 200, {"kind": "APIGroup", "apiVersion": "v1", **group_doc(what[6:])}
    if what.startswith("resources:"):
        group_version = what[len("resources:") :]
        kinds = [k for k in KINDS if k.api_version == group_version.lstrip("/")]
        if kinds:
            resources = []
            for k in kinds:
                verbs = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
                entry = {"name": k.plural, "singularName": k.kind.lower(), "namespaced": k.namespaced, "kind": k.kind}
                resources.append({**entry, "verbs": verbs})
                if k.status:
                    resources.append({**entry, "name": f"{k.plural}/status", "verbs": ["get", "patch", "update"]})
            return 200, {
                "kind": "APIResourceList",
                "apiVersion": "v1",
                "groupVersion": group_version.lstrip("/"),
                "resources": resources,
            }
    raise ApiError(404, _NOT_FOUND)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out in two writes: no 40 ms delayed-ACK stall
    timeout = IDLE_TIMEOUT
    server: HttpServer
    _raw = b""

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    # -- the request

    def _dispatch(self, method: str) -> None:
        ctx = self.server.ctx
        url = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        target = Target("unknown", url.path)
        headers: dict[str, str] = {}
        try:
            self._raw = self._read_raw() if method in ("POST", "PUT", "PATCH", "DELETE") else b""
            target = route(method, url.path, query)
            if ctx.faults.down_status is not None:
                code = ctx.faults.down_status
                raise ApiError(code, f"the API server stand-in is down (answering {code})")
            failure = ctx.faults.take(target.verb, target.resource)
            if failure is not None:
                status, message = failure
                if status == 0:
                    self._drop(method, target, url.path)
                    return
                retry = {"Retry-After": "1"} if status == 429 else None
                raise ApiError(status, message or f"injected failure ({status})", headers=retry)
            if ctx.faults.latency > 0:
                ctx.stopping.wait(ctx.faults.latency)
            if target.verb == "watch":
                self._watch(method, target, query, url.path)
                return
            code, body = self._serve(method, target, query)
        except ApiError as e:
            code, body, headers = e.code, e.status(), e.headers
        except (OSError, ValueError) as e:  # a client that went away mid-request, or a malformed number
            if isinstance(e, OSError):
                return
            code, body = 400, status_body(400, str(e), "BadRequest")
        self._record(method, target, url.path, code)  # before answering: a test that got the answer sees it logged
        with contextlib.suppress(OSError):
            self._send(code, body, headers)

    def _record(self, method: str, target: Target, path: str, code: int) -> None:
        self.server.ctx.log.record(
            Request(stamp(), method, target.verb, target.resource, target.namespace, target.name, path, code)
        )

    def _drop(self, method: str, target: Target, path: str) -> None:
        """An injected connection reset: no answer at all."""
        self.close_connection = True
        self._record(method, target, path, 0)
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def _serve(self, method: str, target: Target, query: dict[str, str]) -> tuple[int, object]:
        ctx = self.server.ctx
        if target.verb == "discovery":
            return _discovery(target, ctx)
        kind, namespace, name, sub = target.kind, target.namespace, target.name, target.subresource
        assert kind is not None
        registry = ctx.registry
        dry_run = query.get("dryRun") == "All"
        verb = target.verb
        if verb == "get":
            return 200, registry.get(kind, namespace, name or "")
        if verb in ("list", "deletecollection"):
            fields = FieldSelector.parse(kind, query.get("fieldSelector"))
            labels = LabelSelector.parse(query.get("labelSelector"))
            if verb == "list":
                limit = int(query.get("limit") or 0) or None
                return 200, registry.list(kind, namespace, fields, labels, limit, query.get("continue") or None)
            options = self._body(method, allow_empty=True)
            return 200, registry.delete_collection(kind, namespace, fields, labels, _options(options), dry_run=dry_run)
        if verb == "delete":
            options = self._body(method, allow_empty=True)
            return registry.delete(kind, namespace, name or "", _options(options), dry_run=dry_run)
        body = self._body(method)
        if verb == "create":
            return 201, registry.create(kind, namespace, body, dry_run=dry_run)
        if verb == "update":
            return 200, registry.update(kind, namespace, name or "", body, subresource=sub, dry_run=dry_run)
        content_type = self._content_type()
        return 200, registry.patch(kind, namespace, name or "", content_type, body, subresource=sub, dry_run=dry_run)

    # -- bodies

    def _content_type(self) -> str:
        return (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()

    def _read_raw(self) -> bytes:
        """The request body, read before anything is answered (an unread body would be taken for the next
        request on the connection); one that is too large is left unread and the connection closed."""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            self.close_connection = True
            raise bad_request("chunked request bodies are not supported by the API server stand-in")
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError as e:
            self.close_connection = True
            raise bad_request("invalid Content-Length") from e
        if length > MAX_BODY:
            self.close_connection = True
            raise ApiError(413, f"Request entity too large: limit is {MAX_BODY}", "RequestEntityTooLarge")
        return self.rfile.read(length) if length > 0 else b""

    def _body(self, method: str, *, allow_empty: bool = False) -> object:
        raw = self._raw
        content_type = self._content_type()
        if method == "PATCH":
            if content_type.startswith("application/apply-patch"):
                raise ApiError(415, "server-side apply is not supported by the API server stand-in")
            if content_type not in patches.PATCH_TYPES:
                raise ApiError(
                    415,
                    "the body of the request was in an unknown format - accepted media types include: "
                    + ", ".join(patches.PATCH_TYPES),
                )
        elif content_type not in ("", "application/json", "application/yaml"):
            raise ApiError(
                415,
                "the body of the request was in an unknown format - accepted media types include: "
                "application/json, application/yaml",
            )
        if not raw.strip():
            if allow_empty:
                return None
            raise bad_request("the body of the request was empty")
        try:
            if content_type == "application/yaml":
                return yaml.safe_load(raw)
            return json.loads(raw)
        except (ValueError, yaml.YAMLError) as e:
            raise bad_request(f"couldn't get version/kind; json parse error: {e}") from e

    # -- answers

    def _send(self, code: int, body: object, headers: dict[str, str] | None = None) -> None:
        if isinstance(body, str):
            data, content_type = body.encode(), "text/plain; charset=utf-8"
        else:
            data, content_type = json.dumps(body).encode(), "application/json"
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _watch(self, method: str, target: Target, query: dict[str, str], path: str) -> None:
        ctx = self.server.ctx
        assert target.kind is not None
        request = watches.WatchRequest(
            target.kind,
            target.namespace,
            FieldSelector.parse(target.kind, query.get("fieldSelector")),
            LabelSelector.parse(query.get("labelSelector")),
            query.get("resourceVersion"),
            float(query.get("timeoutSeconds") or watches.DEFAULT_TIMEOUT),
            query.get("allowWatchBookmarks") in _GO_TRUE,
        )
        self.close_connection = True
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Cache-Control", "no-cache, private")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        opened = False

        def on_open(code: int) -> None:
            nonlocal opened
            if code == 200:
                opened = True
                ctx.log.watch_opened(target.resource)
            self._record(method, target, path, code)

        try:
            watches.stream(ctx.registry.store, request, self._send_chunk, self._client_gone, on_open)
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:
            pass  # the client went away
        finally:
            if opened:
                ctx.log.watch_closed(target.resource)

    def _send_chunk(self, event: dict) -> None:
        data = json.dumps(event).encode() + b"\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _client_gone(self) -> bool:
        """The client closed its end (a watch client sends nothing more, so readable means EOF or reset)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True


def _options(body: object) -> dict | None:
    return body if isinstance(body, dict) else None


class HttpServer(ThreadingHTTPServer):
    """A threading HTTP server that can cut every open connection (an outage or a stop)."""

    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, address: tuple[str, int], ctx: Context) -> None:
        self.ctx = ctx
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        super().__init__(address, Handler)

    def process_request(self, request, client_address) -> None:  # type: ignore[no-untyped-def]
        with self._connections_lock:
            self._connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request) -> None:  # type: ignore[no-untyped-def]
        with self._connections_lock:
            self._connections.discard(request)
        super().shutdown_request(request)

    def handle_error(self, request, client_address) -> None:  # type: ignore[no-untyped-def]
        """A client that went away mid-request (a killed agent) is routine, as for a real API server: no
        traceback on stderr. Anything else is still printed."""
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)

    def cut_connections(self) -> None:
        with self._connections_lock:
            connections = list(self._connections)
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
