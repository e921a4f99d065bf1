"""The few Kubernetes API calls the device-plugin agent makes, over the standard library's HTTP, without the
official client.

``import kubernetes`` costs a node agent about 26 MB of RSS and 0.2-0.3 s of start (its configuration loader,
oauthlib, requests, the dynamic client, the generated models) for what is, here, one GET and one WATCH of the
agent's own Node and a POST or PATCH of an Event. kopf talks to the API without the official client for the
same reason. This module speaks to the API server with ``http.client`` and ``ssl`` (1.4 MB on top of grpc, where
urllib3, the official client's transport, costs 4.6 MB: it loads ``importlib.metadata`` and ``email`` for its
HTTP/2 probe) and understands the credentials a node agent meets:

- in a pod: the ServiceAccount token (re-read once a minute, as the official client does: bound tokens rotate),
  its CA bundle, ``KUBERNETES_SERVICE_HOST`` / ``KUBERNETES_SERVICE_PORT`` (an IPv6 host is bracketed);
- a kubeconfig whose current context names a server, a CA (file or data) or ``insecure-skip-tls-verify``, and a
  token / ``tokenFile`` or a client certificate and key (file or data).

A kubeconfig that needs anything else (``exec`` or ``auth-provider`` plugins, a username and password, a proxy,
``tls-server-name``) raises :class:`Unsupported`; the caller then uses the official client
(:class:`agent.kube_api.CoreApi`), imported only then. Both raise :class:`KubeApiError` for an answer that is
not a success, so the callers handle one exception type.

Objects in and out are plain dicts. Every name that reaches a URL is checked against Kubernetes' own rules and
then quoted.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import re
import socket
import ssl
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

from msgspec import Struct

from agent.kube_status import MAX_STATUS_BODY, status_message

JSON = "application/json"
PATCH = "application/strategic-merge-patch+json"  # what client-go sends, and the typed classes for a dict
RequestTimeout = float | tuple[float, float] | None

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TOKEN_REFRESH_SECONDS = 60.0  # the official client's in-cluster loader re-reads the token file this often
MAX_KUBECONFIG_BYTES = 1 << 20
MAX_ANSWER_BYTES = 64 << 20  # a Node with many images is large, but never this large
MAX_IDLE_CONNECTIONS = 2  # kept open for the next request (the node watch holds one more while it runs)
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")

# The query parameters of a list or watch, as the official client's typed methods name them.
_QUERY_NAMES = {
    "field_selector": "fieldSelector",
    "label_selector": "labelSelector",
    "resource_version": "resourceVersion",
    "allow_watch_bookmarks": "allowWatchBookmarks",
    "timeout_seconds": "timeoutSeconds",
    "watch": "watch",
}


class KubeApiError(Exception):
    """The API server answered with an error (``status``: its HTTP status; 0: TLS failed before any answer).

    ``reason`` is the HTTP reason phrase, ``body`` the answer (a Status, usually; at most 64 KiB of it) and
    ``message`` the Status's own message when there is one. The same attributes as the official client's
    ``ApiException``, so a caller reads either the same way.
    """

    def __init__(self, status: int, reason: str, body: bytes | str | None = None) -> None:
        self.status = status
        self.reason = reason
        self.body = body
        super().__init__(f"({status}) Reason: {reason}" + (f": {self.message}" if self.message != reason else ""))

    @property
    def message(self) -> str:
        return status_message(self) or self.reason


class KubeUnreachable(ConnectionError):
    """No answer from the API server: the connection failed, or it ended in the middle of an answer."""


class KubeConfigError(ValueError):
    """The credentials cannot be used; the message names the file or the field and what is wrong."""


class Unsupported(KubeConfigError):
    """A kubeconfig this client does not speak (exec, auth-provider, basic auth, proxy...): use the official one."""


def valid_name(value: object, what: str, *, label: bool = False) -> str:
    """``value`` if it is a valid object name (a DNS-1123 subdomain, or label for a namespace); else ValueError."""
    pattern, limit = (_DNS_LABEL, 63) if label else (_DNS_SUBDOMAIN, 253)
    if not isinstance(value, str) or len(value) > limit or not pattern.fullmatch(value):
        raise ValueError(
            f"{what} {value!r} is not a valid Kubernetes name: lower-case letters, digits, '-'"
            + ("" if label else " and '.'")
            + f", at most {limit} characters, starting and ending with a letter or digit"
        )
    return value


# ----- credentials ---------------------------------------------------------------------------------------


class Credentials(Struct, frozen=True):
    """Where the API server is and how to prove who we are to it."""

    server: str  # scheme://host[:port], no trailing slash
    ca_file: str | None = None
    ca_data: bytes | None = None  # PEM
    insecure: bool = False
    token: str | None = None
    token_file: str | None = None  # re-read every TOKEN_REFRESH_SECONDS
    cert_file: str | None = None
    cert_data: bytes | None = None  # PEM
    key_file: str | None = None
    key_data: bytes | None = None  # PEM
    origin: str = "kubeconfig"  # for messages


def in_cluster_credentials(environ: Mapping[str, str] = os.environ, root: Path = SERVICE_ACCOUNT) -> Credentials:
    """The pod's ServiceAccount, as the official client's ``load_incluster_config`` finds it."""
    host, port = environ.get("KUBERNETES_SERVICE_HOST", ""), environ.get("KUBERNETES_SERVICE_PORT", "")
    if not host or not port:
        raise KubeConfigError("in-cluster: KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT must both be set")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise KubeConfigError(f"in-cluster: KUBERNETES_SERVICE_PORT {port!r} is not a port number")
    token, ca = root / "token", root / "ca.crt"
    for path, what in ((token, "token"), (ca, "CA bundle")):
        if not path.is_file():
            raise KubeConfigError(f"in-cluster: the ServiceAccount {what} {path} is missing")
    if not token.read_text().strip():
        raise KubeConfigError(f"in-cluster: the ServiceAccount token {token} is empty")
    shown = f"[{host}]" if ":" in host and not host.startswith("[") else host  # an IPv6 address
    return Credentials(f"https://{shown}:{port}", ca_file=str(ca), token_file=str(token), origin="in-cluster")


def kubeconfig_credentials(path: str | Path) -> Credentials:
    """The current context's cluster and user of a kubeconfig; :class:`Unsupported` for what only the official
    client speaks, :class:`KubeConfigError` naming the field for a kubeconfig that cannot work at all."""
    path = Path(path)
    origin = str(path)
    try:
        with path.open("rb") as file:
            raw = file.read(MAX_KUBECONFIG_BYTES + 1)
    except OSError as error:
        raise KubeConfigError(f"{origin}: cannot read: {error.strerror or error}") from error
    if len(raw) > MAX_KUBECONFIG_BYTES:
        raise KubeConfigError(f"{origin}: larger than 1 MiB; this is not a kubeconfig")
    import yaml  # a kubeconfig is YAML (or JSON, which YAML reads); read only when one is given

    try:
        document = yaml.load(raw, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # noqa: S506 - safe loader
    except yaml.YAMLError as error:
        raise KubeConfigError(f"{origin}: not YAML: {error}") from None
    if not isinstance(document, dict):
        raise KubeConfigError(f"{origin}: not a kubeconfig (a map with clusters, users and contexts)")
    current = document.get("current-context")
    if not current:
        raise KubeConfigError(f"{origin}: current-context is not set; set it with kubectl config use-context")
    context = _named(document, "contexts", "context", current, origin)
    cluster = _named(document, "clusters", "cluster", context.get("cluster"), origin)
    user_name = context.get("user")
    user = _named(document, "users", "user", user_name, origin) if user_name else {}
    known_cluster = {"server", "certificate-authority", "certificate-authority-data", "insecure-skip-tls-verify"}
    known_user = {"token", "tokenFile", "client-certificate", "client-certificate-data", "client-key",
                  "client-key-data"}  # fmt: skip
    others = sorted(f"cluster.{k}" for k in cluster if k not in known_cluster and k != "extensions")
    others += sorted(f"user.{k}" for k in user if k not in known_user and k != "extensions")
    if others:
        raise Unsupported(f"{origin}: {', '.join(others)} need the official Kubernetes client")
    server = cluster.get("server")
    if not isinstance(server, str) or urlsplit(server).scheme not in ("http", "https") or not urlsplit(server).hostname:
        raise KubeConfigError(f"{origin}: cluster {context.get('cluster')!r}: server {server!r} is not an http(s) URL")
    base = path.parent

    def file_of(key: str, source: Mapping[str, Any]) -> str | None:
        value = source.get(key)
        return None if not value else str(base / str(value))  # relative paths are relative to the kubeconfig

    def data_of(key: str, source: Mapping[str, Any]) -> bytes | None:
        value = source.get(key)
        if not value:
            return None
        try:
            return base64.b64decode(str(value), validate=True)
        except ValueError:
            raise KubeConfigError(f"{origin}: {key} is not base64") from None

    token = user.get("token")
    return Credentials(
        server.rstrip("/"),
        ca_file=file_of("certificate-authority", cluster),
        ca_data=data_of("certificate-authority-data", cluster),
        insecure=cluster.get("insecure-skip-tls-verify") is True,
        token=str(token) if token else None,
        token_file=file_of("tokenFile", user),
        cert_file=file_of("client-certificate", user),
        cert_data=data_of("client-certificate-data", user),
        key_file=file_of("client-key", user),
        key_data=data_of("client-key-data", user),
        origin=origin,
    )


def _named(document: Mapping[str, Any], section: str, key: str, name: object, origin: str) -> dict[str, Any]:
    entries = document.get(section) or []
    if isinstance(entries, list):
        for entry in entries:
            if isinstance(entry, dict) and entry.get("name") == name:
                value = entry.get(key)
                if isinstance(value, dict):
                    return value
                if value is None:
                    return {}
    raise KubeConfigError(f"{origin}: {section} has no entry named {name!r} (needed by the current context)")


# ----- the client ------------------------------------------------------------------------------------------


class KubeHttp:
    """The core-group and events.k8s.io calls the agent makes (the methods of :class:`agent.kube_api.CoreApi`)."""

    def __init__(
        self,
        credentials: Credentials,
        *,
        token_refresh_seconds: float = TOKEN_REFRESH_SECONDS,
        official: Callable[[], Any] | None = None,
    ) -> None:
        """``official``: makes the official client's ``ApiClient`` for the same credentials, for the callers that
        need it (the DRA front end: ResourceSlices, ResourceClaims), imported only when one asks."""
        self.credentials = credentials
        self._official = official
        self._official_client: Any = None
        self._token_refresh = token_refresh_seconds
        self._token_lock = threading.Lock()
        self._token: str | None = credentials.token
        self._token_read_at = -float("inf")
        if credentials.token_file:
            self._bearer()  # a token file that cannot be read is an error now, not at the first request
        self._transport = _Transport(credentials)

    @property
    def api_client(self) -> Any:
        """The official client's ``ApiClient`` for the same API server and credentials, made on first use."""
        with self._token_lock:
            if self._official_client is None:
                if self._official is None:
                    raise AttributeError("this client was made without the official client's configuration")
                self._official_client = self._official()
            return self._official_client

    # ----- Nodes ----------------------------------------------------------------------------------

    def read_node(self, name: str, *, _request_timeout: RequestTimeout = None) -> dict[str, Any]:
        return self._call("GET", f"/api/v1/nodes/{_path(name, 'node name')}", timeout=_request_timeout)

    def patch_node(
        self, name: str, patch: Mapping[str, Any], *, _request_timeout: RequestTimeout = None
    ) -> dict[str, Any]:
        """A strategic merge patch; for labels and annotations it is a JSON merge patch: ``None`` removes the key."""
        return self._call(
            "PATCH", f"/api/v1/nodes/{_path(name, 'node name')}", body=patch, content_type=PATCH,
            timeout=_request_timeout,
        )  # fmt: skip

    def list_node(
        self, *, _request_timeout: RequestTimeout = None, _preload_content: bool = True, **query: object
    ) -> Any:
        """A list (a dict), or with ``watch=True, _preload_content=False`` the open :class:`Stream` of a watch."""
        return self._call("GET", "/api/v1/nodes", query=_query(query), timeout=_request_timeout,
                          preload=_preload_content)  # fmt: skip

    # ----- Events (events.k8s.io/v1) --------------------------------------------------------------

    def create_event(
        self, namespace: str, body: Mapping[str, Any], *, _request_timeout: RequestTimeout = None
    ) -> dict[str, Any]:
        return self._call(
            "POST", f"/apis/events.k8s.io/v1/namespaces/{_path(namespace, 'namespace', label=True)}/events",
            body=body, content_type=JSON, timeout=_request_timeout,
        )  # fmt: skip

    def patch_event(
        self, name: str, namespace: str, patch: Mapping[str, Any], *, _request_timeout: RequestTimeout = None
    ) -> dict[str, Any]:
        return self._call(
            "PATCH",
            f"/apis/events.k8s.io/v1/namespaces/{_path(namespace, 'namespace', label=True)}/events/"
            f"{_path(name, 'event name')}",
            body=patch, content_type=PATCH, timeout=_request_timeout,
        )  # fmt: skip

    # ----- one request ----------------------------------------------------------------------------

    def _call(
        self,
        method: str,
        path: str,
        *,
        query: list[tuple[str, str]] | None = None,
        body: object = None,
        content_type: str | None = None,
        timeout: RequestTimeout = None,
        preload: bool = True,
    ) -> Any:
        headers = {"Accept": JSON, "User-Agent": "tessera-agent"}
        if content_type is not None:
            headers["Content-Type"] = content_type
        token = self._bearer()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        target = path + (f"?{urlencode(query)}" if query else "")
        data = None if body is None else json.dumps(body, default=_json_value).encode()
        connection, response = self._transport.send(method, target, data, headers, timeout)
        if not 200 <= response.status <= 299:
            try:
                answer = response.read(MAX_STATUS_BODY + 1)
            finally:
                connection.close()  # what is left of an error answer is not read: the connection is not reused
            raise KubeApiError(response.status, response.reason or "", answer[:MAX_STATUS_BODY])
        if not preload:
            return Stream(connection, response)  # a watch: read line by line by the caller, who closes it
        try:
            answer = response.read(MAX_ANSWER_BYTES + 1)
            if response.length and len(answer) <= MAX_ANSWER_BYTES:  # read(n) ends short, silently, at a close
                raise http.client.IncompleteRead(answer, response.length)
        except (OSError, http.client.HTTPException) as error:
            connection.close()
            raise KubeUnreachable(f"the answer was cut: {type(error).__name__}: {error}") from error
        if len(answer) > MAX_ANSWER_BYTES:
            connection.close()
            raise KubeApiError(response.status, "answer too large", None)
        self._transport.done(connection, response)
        try:
            return json.loads(answer) if answer else {}
        except ValueError as error:
            raise KubeApiError(response.status, f"the answer is not JSON: {error}", None) from None

    def _bearer(self) -> str | None:
        """The token: given, or the token file's, re-read once a minute (a rotated bound token is picked up)."""
        if not self.credentials.token_file or self.credentials.token:
            return self._token
        with self._token_lock:
            now = time.monotonic()
            if now - self._token_read_at >= self._token_refresh or self._token is None:
                try:
                    self._token = Path(self.credentials.token_file).read_text().strip()
                except OSError as error:
                    if self._token is None:
                        raise KubeConfigError(
                            f"{self.credentials.origin}: cannot read the token file {self.credentials.token_file}: "
                            f"{error.strerror or error}"
                        ) from error
                    # a rotation in progress: keep the last token and try again at the next request
                else:
                    self._token_read_at = now
            return self._token


class Stream:
    """An open watch answer: :meth:`read1` gives what has arrived; :meth:`close` ends it (and its connection);
    ``connection.sock`` is what another thread shuts down to cut it."""

    def __init__(self, connection: http.client.HTTPConnection, response: http.client.HTTPResponse) -> None:
        self.connection = connection
        self.status = response.status
        self._response = response

    def read1(self, amount: int) -> bytes:
        return self._response.read1(amount)

    def close(self) -> None:
        self._response.close()
        self.connection.close()

    def release_conn(self) -> None:
        """Nothing to release: a watch's connection is closed with it, never reused."""


class _Transport:
    """Connections to the API server: a new one per watch; for other requests one of a few kept alive, and a
    kept one the server had closed meanwhile is replaced once, at once (urllib3 and the official client do the
    same). Safe to use from several threads."""

    def __init__(self, credentials: Credentials) -> None:
        parts = urlsplit(credentials.server)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or ""
        self._port = parts.port or (443 if self._https else 80)
        self._prefix = parts.path.rstrip("/")
        self._context = _ssl_context(credentials) if self._https else None
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def send(
        self, method: str, target: str, data: bytes | None, headers: dict[str, str], timeout: RequestTimeout
    ) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """The connection and the answer's status and headers (its body unread); ``KubeUnreachable`` or
        ``KubeApiError`` (status 0: TLS) when no answer came."""
        connect, read = _timeouts(timeout)
        for attempt in range(2):
            with self._lock:
                kept = self._idle.pop() if self._idle and attempt == 0 else None
            connection = kept or self._connection(connect)
            try:
                if connection.sock is None:
                    connection.connect()
                assert connection.sock is not None
                connection.sock.settimeout(read)
                connection.request(method, self._prefix + target, body=data, headers=headers)
                return connection, connection.getresponse()
            except ssl.SSLError as error:  # as the official client says it: status 0, and what TLS said
                connection.close()
                raise KubeApiError(0, f"SSLError: {error}") from error
            except (OSError, http.client.HTTPException) as error:
                connection.close()
                if kept is not None and not isinstance(error, TimeoutError):
                    continue  # the server closed the kept connection meanwhile: once more on a new one
                raise KubeUnreachable(
                    f"{self._host}:{self._port}: {type(error).__name__}: {error or 'no answer'}"
                ) from error
        raise AssertionError("unreachable")

    def done(self, connection: http.client.HTTPConnection, response: http.client.HTTPResponse) -> None:
        """The answer was read whole: keep the connection for the next request, unless the server ends it."""
        with self._lock:
            if response.will_close or len(self._idle) >= MAX_IDLE_CONNECTIONS:
                connection.close()
            else:
                self._idle.append(connection)

    def _connection(self, connect: float | None) -> http.client.HTTPConnection:
        connection: http.client.HTTPConnection
        if self._https:
            connection = http.client.HTTPSConnection(self._host, self._port, timeout=connect, context=self._context)
        else:
            connection = http.client.HTTPConnection(self._host, self._port, timeout=connect)
        connection._create_connection = _connect  # type: ignore[attr-defined]  # http.client's own hook
        return connection


def _connect(address: tuple[str, int], timeout: object = None, source_address: object = None) -> socket.socket:
    """``socket.create_connection`` with an ASCII host given as bytes: a str host is encoded with the ``idna``
    codec, which loads ``unicodedata`` and ``stringprep`` (~0.4 MB) for what is nearly always an IP address."""
    host, port = address
    name: str | bytes = host.encode("ascii") if host.isascii() else host
    return socket.create_connection((name, port), timeout, source_address)  # type: ignore[arg-type]


def _ssl_context(credentials: Credentials) -> ssl.SSLContext:
    origin = credentials.origin
    try:
        context = ssl.create_default_context(
            cafile=credentials.ca_file, cadata=credentials.ca_data.decode() if credentials.ca_data else None
        )
    except (OSError, ssl.SSLError, UnicodeDecodeError) as error:
        raise KubeConfigError(f"{origin}: the certificate authority cannot be loaded: {error}") from error
    if credentials.insecure:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    has_cert = credentials.cert_file or credentials.cert_data
    has_key = credentials.key_file or credentials.key_data
    if bool(has_cert) != bool(has_key):
        raise KubeConfigError(f"{origin}: a client certificate needs its key, and a key its certificate")
    if has_cert:
        with tempfile.TemporaryDirectory(prefix="tessera-tls-") as scratch:  # ssl reads a chain from files only
            cert = credentials.cert_file or _scratch(scratch, "cert.pem", credentials.cert_data)
            key = credentials.key_file or _scratch(scratch, "key.pem", credentials.key_data)
            try:
                context.load_cert_chain(cert, key)
            except (OSError, ssl.SSLError) as error:
                raise KubeConfigError(f"{origin}: the client certificate and key cannot be loaded: {error}") from error
    return context


def _scratch(directory: str, name: str, data: bytes | None) -> str:
    path = str(Path(directory) / name)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as file:
        file.write(data or b"")
    return path


def _json_value(value: object) -> str:
    """A datetime in a body as the official client writes it: its ``isoformat()`` (``agent.core.events.MicroTime``
    gives the six-digit form the API server wants)."""
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _path(value: str, what: str, *, label: bool = False) -> str:
    return quote(valid_name(value, what, label=label), safe="")


def _timeouts(timeout: RequestTimeout) -> tuple[float | None, float | None]:
    """(connect, read) seconds; a single number is both, as the official client takes it."""
    if isinstance(timeout, tuple):
        return timeout[0], timeout[1]
    return timeout, timeout


def _query(arguments: Mapping[str, object]) -> list[tuple[str, str]]:
    query = []
    for name, value in arguments.items():
        if name not in _QUERY_NAMES:
            raise TypeError(f"list_node() got an unexpected argument {name!r}")
        if value is None:
            continue
        query.append((_QUERY_NAMES[name], ("true" if value else "false") if isinstance(value, bool) else str(value)))
    return query
