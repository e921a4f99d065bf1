"""``ApiServer``: the stand-in as tests and the demo use it — start/stop, outages and faults, Python-side object
access that bypasses HTTP, observation, and a kubeconfig (or client Configuration) pointing at it.

It binds loopback only. State (objects, resourceVersion, history) survives ``down()``/``up()``, as etcd survives an
API server restart.
"""

from __future__ import annotations

import copy
import logging
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from agent.sim.apiserver.faults import Faults
from agent.sim.apiserver.http import Context, HttpServer
from agent.sim.apiserver.kinds import NODE, Kind, lookup
from agent.sim.apiserver.observe import Request, RequestLog
from agent.sim.apiserver.registry import Registry
from agent.sim.apiserver.store import DEFAULT_HISTORY, Store
from agent.sim.apiserver.strategy import GATES, prepare_create
from agent.sim.apiserver.validate import DEFAULT_SCHEMA_VERSIONS, Validator, parse_version

if TYPE_CHECKING:
    import kubernetes.client

log = logging.getLogger("agent.sim.apiserver")

T = TypeVar("T")

DEFAULT_GIT_VERSION = "v1.36.3"  # the newest Kubernetes release named in dra.md
_LOOPBACK = ("127.0.0.1", "::1", "localhost")


def version_info(git_version: str) -> dict:
    """``/version`` as the real server answers it (every field the Python client's VersionInfo requires)."""
    major, minor = parse_version(git_version)
    match = re.match(r"v?\d+\.\d+(\.\d+)?", git_version)
    assert match is not None
    return {
        "major": str(major),
        "minor": str(minor),
        "emulationMajor": str(major),
        "emulationMinor": str(minor),
        "minCompatibilityMajor": str(major),
        "minCompatibilityMinor": str(minor - 1),
        "gitVersion": git_version if git_version.startswith("v") else "v" + git_version,
        "gitCommit": "0" * 40,
        "gitTreeState": "clean",
        "buildDate": "2026-01-01T00:00:00Z",
        "goVersion": "go1.24.0",
        "compiler": "gc",
        "platform": "linux/amd64",
    }


class ApiServer:
    """The API server stand-in. ``with ApiServer() as api:`` starts it on an ephemeral loopback port."""

    def __init__(
        self,
        *,
        git_version: str = DEFAULT_GIT_VERSION,
        schema_versions: Iterable[str] = DEFAULT_SCHEMA_VERSIONS,
        validate: bool = True,
        host: str = "127.0.0.1",
        port: int = 0,
        history_limit: int = DEFAULT_HISTORY,
        disabled_gates: Iterable[str] = (),
    ) -> None:
        """``disabled_gates``: feature gates that are off (of ``strategy.GATES``), whose fields the stand-in drops
        from what is written, as a cluster without them does."""
        if host not in _LOOPBACK:
            raise ValueError(f"the API server stand-in binds loopback only, not {host!r}")
        self.host = "127.0.0.1" if host == "localhost" else host
        self.port = port
        self.git_version = git_version
        self.store = Store(history_limit)
        self.validator = Validator(schema_versions, git_version, schema=validate)
        unknown = set(disabled_gates) - set(GATES)
        if unknown:
            raise ValueError(f"the stand-in can turn off {', '.join(GATES)}, not {', '.join(sorted(unknown))}")
        self.registry = Registry(self.store, self.validator, frozenset(disabled_gates))
        self.log = RequestLog(self.store.cond)
        self.faults = Faults()
        self._stopping = threading.Event()
        self._ctx = Context(self.registry, self.log, self.faults, version_info(git_version), self._stopping)
        self._http: HttpServer | None = None
        self._thread: threading.Thread | None = None
        self._lifecycle = threading.Lock()

    # -- lifecycle

    def start(self) -> ApiServer:
        with self._lifecycle:
            if self._http is None:
                self._listen()
        return self

    def stop(self) -> None:
        with self._lifecycle:
            self._stopping.set()
            with self.store.cond:
                self.store.closing = True
                self.store.cond.notify_all()
            self._close_listener()

    def __enter__(self) -> ApiServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _listen(self) -> None:
        self._http = HttpServer((self.host, self.port), self._ctx)
        self.port = self._http.server_address[1]
        self._ctx.discovery_address[0] = f"{self.host}:{self.port}"
        self._thread = threading.Thread(
            target=self._http.serve_forever, kwargs={"poll_interval": 0.05}, name="apiserver-standin", daemon=True
        )
        self._thread.start()
        log.info(
            "apiserver stand-in listening url=%s version=%s schema=%s",
            self.url,
            self.git_version,
            ",".join(self.validator.schema_versions) if self.validator.schema_enabled else "off",
        )

    def _close_listener(self) -> None:
        if self._http is None:
            return
        self._http.shutdown()
        self._http.server_close()
        self._http.cut_connections()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._http = None
        self._thread = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    # -- faults

    def down(self, status: int | None = None) -> None:
        """An outage. ``status=None``: the listener closes and open connections are cut, so clients get
        "connection refused" (an API server restart). ``status=503`` (or any code): every request is answered with
        that status and a Status body (an overloaded server or a failing load balancer). Watches end either way."""
        with self._lifecycle:
            self.store.close_watches()
            if status is None:
                self._close_listener()
            else:
                self.faults.down_status = status
                if self._http is not None:
                    self._http.cut_connections()

    def up(self) -> None:
        """End the outage: listen again on the same port, answer normally."""
        with self._lifecycle:
            self.faults.down_status = None
            if self._http is None and not self._stopping.is_set():
                self._listen()

    @property
    def is_down(self) -> bool:
        return self._http is None or self.faults.down_status is not None

    def fail_next(self, verb: str, resource: str, status: int, n: int = 1, message: str | None = None) -> None:
        """Answer the next ``n`` requests of ``verb`` (get, list, watch, create, update, patch, delete,
        deletecollection, or ``"*"``) on ``resource`` (a plural such as ``resourceslices``, ``resourceclaims/status``,
        a kind name, or ``"*"``) with ``status`` and a Status body; ``status=0`` drops the connection unanswered."""
        if resource != "*" and "/" not in resource:
            resource = lookup(resource).plural
        self.faults.fail_next(verb, resource, status, n, message)

    def set_latency(self, seconds: float) -> None:
        """Delay every request's answer by ``seconds`` (0 to stop)."""
        self.faults.latency = max(0.0, seconds)

    def compact(self) -> None:
        """Drop the event history: a watch from any older resourceVersion gets 410 Gone."""
        self.store.compact()

    def close_watches(self) -> None:
        """End every open watch stream, as the server does at its timeout or on a restart."""
        self.store.close_watches()

    # -- objects, bypassing HTTP (validated all the same)

    def create(self, kind: str | Kind, obj: dict, *, namespace: str | None = None, validate: bool = True) -> dict:
        """Create ``obj`` as a POST would, but keeping its ``status`` (so tests can create allocated claims)."""
        k = lookup(kind)
        ns = namespace or (obj.get("metadata") or {}).get("namespace") or ("default" if k.namespaced else None)
        if validate:
            return copy.deepcopy(self.registry.create(k, ns, obj, keep_status=True))
        prepared = prepare_create(k, ns, obj, keep_status=True)
        return copy.deepcopy(self.store.insert(k, prepared))

    def update(self, kind: str | Kind, obj: dict, *, status: bool = False) -> dict:
        """PUT ``obj`` (its ``metadata.resourceVersion``, when set, must be current); ``status=True`` is a PUT of
        the status subresource."""
        k = lookup(kind)
        meta = obj.get("metadata") or {}
        ns = meta.get("namespace") or ("default" if k.namespaced else None)
        sub = "status" if status else None
        return copy.deepcopy(self.registry.update(k, ns, meta.get("name", ""), obj, subresource=sub))

    def delete(self, kind: str | Kind, name: str, namespace: str | None = None) -> None:
        k = lookup(kind)
        self.registry.delete(k, namespace or ("default" if k.namespaced else None), name)

    def get(self, kind: str | Kind, name: str, namespace: str | None = None) -> dict | None:
        k = lookup(kind)
        obj = self.store.get(k, namespace or ("default" if k.namespaced else None), name)
        return copy.deepcopy(obj) if obj is not None else None

    def objects(self, kind: str | Kind, namespace: str | None = None) -> list[dict]:
        """Every stored object of ``kind`` (of one namespace, or all), as deep copies."""
        items, _ = self.store.list(lookup(kind), namespace)
        return copy.deepcopy(items)

    def add_node(self, name: str, uid: str | None = None, labels: dict[str, str] | None = None) -> dict:
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}
        if labels:
            body["metadata"]["labels"] = dict(labels)
        obj = prepare_create(NODE, None, body)
        if uid:
            obj["metadata"]["uid"] = uid
        self.validator.check(NODE, obj)
        return copy.deepcopy(self.store.insert(NODE, obj))

    @property
    def resource_version(self) -> int:
        return self.store.rv

    @property
    def schema_validation(self) -> bool:
        """True when written objects are checked against the OpenAPI schemas (kubernetes_validate installed)."""
        return self.validator.schema_enabled

    # -- observation

    def requests(
        self, verb: str | None = None, resource: str | None = None, status: int | None = None
    ) -> list[Request]:
        return self.log.records(verb, resource, status)

    def count(self, verb: str | None = None, resource: str | None = None, status: int | None = None) -> int:
        return self.log.count(verb, resource, status)

    def request_counts(self) -> Counter[tuple[str, str]]:
        """How many requests per (verb, resource)."""
        return self.log.counts()

    def open_watches(self, resource: str | None = None) -> int:
        return self.log.open_watches(resource)

    def wait_for(self, predicate: Callable[[], T], timeout: float = 10.0) -> T:
        """Block until ``predicate()`` is truthy (re-checked on every object change and every request; no
        polling) and return its value; TimeoutError after ``timeout`` seconds."""
        return self.store.wait_for(predicate, timeout)

    # -- clients

    def write_kubeconfig(self, path: str | Path) -> Path:
        """A kubeconfig for the stand-in (plain HTTP, no credentials: it asks for none)."""
        path = Path(path)
        path.write_text(
            f"""apiVersion: v1
kind: Config
clusters:
- name: apiserver-standin
  cluster:
    server: {self.url}
users:
- name: anonymous
  user: {{}}
contexts:
- name: apiserver-standin
  context:
    cluster: apiserver-standin
    user: anonymous
current-context: apiserver-standin
"""
        )
        return path

    def configuration(self) -> kubernetes.client.Configuration:
        import kubernetes.client  # the agent's dependency, imported when a client is wanted

        configuration = kubernetes.client.Configuration()
        configuration.host = self.url
        return configuration

    def api_client(self) -> kubernetes.client.ApiClient:
        import kubernetes.client

        return kubernetes.client.ApiClient(self.configuration())
