"""Following this node's labels through the Kubernetes API: which sharing config (and MIG layout) applies here.

NVIDIA's config-manager picks the named config from the node label ``nvidia.com/device-plugin.config`` and
follows it with an informer on its own Node (facts §1.7). Tessera does the same with the least RBAC: one
GET of its own Node, then a WATCH of the Node list narrowed by ``fieldSelector=metadata.name=<node>``. Both
need only ``get``, ``list`` and ``watch`` on ``nodes``.

The watcher posts :class:`NodeLabelChanged` (and :class:`NodeAnnotationChanged`, for the annotation keys it is
given: the per-GPU cordon) to the reconcile loop: first the current value of every watched key, then one event
each time a watched key's value actually changes. It never crashes and never
busy-loops: an API or network failure is logged once per failure streak and retried with exponential backoff,
and the last known values are kept meanwhile. Label values are passed through as they are: the consumer
validates config names.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from msgspec import Struct

from agent.config.labels import (
    CONFIG_LABEL,
    MIG_CONFIG_LABEL,
    NodeAnnotationChanged,
    NodeLabelChanged,
    validate_node_name,
)
from agent.kube_http import KubeApiError, KubeConfigError, KubeHttp, Unsupported
from agent.kube_status import status_message

__all__ = [
    "CONFIG_LABEL",
    "MIG_CONFIG_LABEL",
    "NodeAnnotationChanged",
    "NodeLabelChanged",
    "NodeLabelError",
    "NodeLabelWatcher",
    "load_kube_api",
    "read_node_labels",
    "validate_node_name",
]

log = logging.getLogger(__name__)

IN_CLUSTER_ENV = "KUBERNETES_SERVICE_HOST"
GET_TIMEOUT = (5.0, 15.0)  # (connect, read) seconds for one GET of the node
WATCH_CONNECT_TIMEOUT = 5.0
WATCH_READ_SLACK = 30.0  # a watch idle this long past its server-side timeout is a dead connection
MIN_HEALTHY_WATCH = 1.0  # a watch the server ends sooner than this, with no event, counts as a failure
BACKOFF_INITIAL = 0.5
STOP_JOIN_TIMEOUT = 5.0
HTTP_GONE = 410
MAX_STATUS_MESSAGE = 1024  # characters of the API server's message kept for one log line
MAX_WATCH_LINE = 16 << 20  # one watch event (a whole Node) longer than this is a broken stream

_RBAC_RULE = 'ClusterRole rule: apiGroups [""], resources [nodes], verbs [get, list, watch]'


class NodeLabelError(RuntimeError):
    """The node's labels cannot be read; the message names the node, the status and the fix."""


class NodeApi(Protocol):
    """What the node watch and the Events need of an API: the lean client (:class:`agent.kube_http.KubeHttp`) or,
    for a kubeconfig only the official client speaks, :class:`agent.kube_api.FallbackCoreApi`. Both raise
    :class:`agent.kube_http.KubeApiError` for an error answer."""

    @property
    def api_client(self) -> Any: ...  # the official client's, for the DRA front end (made when first asked)
    def read_node(self, name: str, *, _request_timeout: Any = None) -> dict[str, Any]: ...
    def patch_node(self, name: str, patch: Mapping[str, Any], *, _request_timeout: Any = None) -> dict[str, Any]: ...
    def list_node(self, *, _request_timeout: Any = None, _preload_content: bool = True, **query: object) -> Any: ...
    def create_event(self, namespace: str, body: Mapping[str, Any], *, _request_timeout: Any = None) -> Any: ...
    def patch_event(
        self, name: str, namespace: str, patch: Mapping[str, Any], *, _request_timeout: Any = None
    ) -> Any: ...


def load_kube_api(kubeconfig: str | Path | None = None) -> NodeApi | None:
    """In a pod: in-cluster config. With kubeconfig: that file. Else None (not in a cluster; label selection off).

    The lean client (:mod:`agent.kube_http`) speaks both; a kubeconfig with an exec or auth-provider plugin (or
    anything else only the official client speaks) loads the official client instead.

    An explicit kubeconfig that cannot be loaded raises :class:`NodeLabelError`. In a pod whose service
    account credentials cannot be loaded (e.g. ``automountServiceAccountToken: false``) this logs a warning and
    returns None, like outside a cluster.
    """
    from agent.kube_http import in_cluster_credentials, kubeconfig_credentials

    if kubeconfig is not None:
        try:
            api: NodeApi = KubeHttp(
                kubeconfig_credentials(kubeconfig), official=partial(_official_api_client, kubeconfig)
            )
        except Unsupported as why:
            log.info("kube api: the official client reads this kubeconfig why=%r", str(why))
            return _official_client(kubeconfig)
        except Exception as e:  # KubeConfigError, OSError, YAML errors: all mean the same to the operator
            raise NodeLabelError(f"cannot load kubeconfig {kubeconfig}: {type(e).__name__}: {e}") from e
        log.info("kube api loaded source=kubeconfig path=%s", kubeconfig)
        return api
    if not os.environ.get(IN_CLUSTER_ENV):
        log.info("kube api off reason=not-in-cluster")
        return None
    try:
        credentials = in_cluster_credentials()
        api = KubeHttp(credentials, official=partial(_official_api_client, None))
    except (KubeConfigError, OSError) as e:
        log.warning(
            "kube api off reason=in-cluster-config-failed error=%s fix=mount the ServiceAccount token "
            "(automountServiceAccountToken: true)",
            e,
        )
        return None
    log.info("kube api loaded source=in-cluster host=%s", credentials.server)
    return api


def _official_api_client(kubeconfig: str | Path | None) -> Any:
    """The official client's ``ApiClient`` from the kubeconfig, or in a pod from its ServiceAccount (the DRA front
    end's client: it speaks ResourceSlices and ResourceClaims through it)."""
    import kubernetes.client
    import kubernetes.config

    if kubeconfig is not None:
        return kubernetes.config.new_client_from_config(config_file=str(kubeconfig), persist_config=False)
    configuration = kubernetes.client.Configuration()
    kubernetes.config.load_incluster_config(client_configuration=configuration)
    return kubernetes.client.ApiClient(configuration)


def _official_client(kubeconfig: str | Path) -> NodeApi:
    """The official client for a kubeconfig the lean one does not speak (imported only then: ~26 MB)."""
    try:
        import kubernetes.config

        from agent.kube_api import FallbackCoreApi

        api_client = kubernetes.config.new_client_from_config(config_file=str(kubeconfig), persist_config=False)
    except Exception as e:  # ConfigException, OSError, YAML errors, a client that is not installed
        raise NodeLabelError(f"cannot load kubeconfig {kubeconfig}: {type(e).__name__}: {e}") from e
    log.info("kube api loaded source=kubeconfig path=%s client=official", kubeconfig)
    return FallbackCoreApi(api_client)


def _status_message(e: KubeApiError) -> str:
    """The API server's own message from a Status body, else the HTTP reason."""
    message = status_message(e)
    if message:
        return message[:MAX_STATUS_MESSAGE]
    return str(e.reason or "").strip() or "no reason given"


def describe_api_error(e: BaseException, node_name: str, verb: str) -> str:
    """One line naming the node, what failed, the status and the fix."""
    if not isinstance(e, KubeApiError):
        return f"cannot {verb} node {node_name}: {type(e).__name__}: {e}; check the agent can reach the API server"
    status = e.status
    head = f"cannot {verb} node {node_name}: HTTP {status}: {_status_message(e)}"
    if status == 401:
        fix = "the API server rejected the agent's credentials; check its ServiceAccount token (or kubeconfig user)"
    elif status == 403:
        fix = f"grant {verb} on nodes/{node_name} to the agent's ServiceAccount ({_RBAC_RULE})"
    elif status == 404:
        fix = "no such node; set NODE_NAME from the downward API (fieldRef spec.nodeName)"
    elif status == 0:
        fix = "check the API server's address and TLS settings"
    else:
        fix = "the API server failed; retrying"
    return f"{head}; {fix}"


def _get_node(api: NodeApi, node_name: str) -> tuple[dict[str, str], dict[str, str], str | None]:
    """One GET of the node: its labels, annotations and resourceVersion."""
    try:
        node = api.read_node(node_name, _request_timeout=GET_TIMEOUT)
    except (KubeApiError, OSError, *_client_errors()) as e:
        raise NodeLabelError(describe_api_error(e, node_name, "get")) from e
    metadata = node.get("metadata") if isinstance(node, Mapping) else None
    if not isinstance(metadata, Mapping):
        raise NodeLabelError(f"cannot get node {node_name}: the API server's answer has no metadata")
    return (
        dict(metadata.get("labels") or {}),
        dict(metadata.get("annotations") or {}),
        metadata.get("resourceVersion"),
    )


def read_node_labels(api: NodeApi, node_name: str) -> dict[str, str]:
    """The node's labels from one GET; :class:`NodeLabelError` naming the node, status and fix if it fails."""
    return read_node_metadata(api, node_name).labels


def read_node_metadata(api: NodeApi, node_name: str) -> NodeRead:
    """The node's labels and annotations from one GET, with its resourceVersion (:class:`NodeLabelError` if it
    fails): a :class:`NodeLabelWatcher` given it watches from there, with no GET of its own."""
    validate_node_name(node_name)
    return NodeRead(*_get_node(api, node_name))


class NodeRead(Struct, frozen=True):
    """One GET of the node: what a watch given it starts from."""

    labels: dict[str, str]
    annotations: dict[str, str]
    resource_version: str | None


class _WatchFailed(Exception):
    """A watch that ended in a way that must count towards the failure streak."""


class _Stopped(Exception):
    pass


class NodeLabelWatcher:
    """Posts :class:`NodeLabelChanged` for ``keys`` of one node: their initial values, then every change.

    ``known``: the caller's own GET of the node (:func:`read_node_metadata`). Its values are posted first, as a
    GET's would be, and the first watch starts from its resourceVersion: nothing is read twice, and a change made
    between that GET and the watch (started as late as the caller likes) comes as the watch's first event.
    """

    def __init__(
        self,
        api: NodeApi,
        node_name: str,
        keys: Sequence[str],
        post: Callable[[object], None],
        *,
        annotation_keys: Sequence[str] = (),
        known: NodeRead | None = None,
        timeout_seconds: int = 300,
        backoff_max: float = 30.0,
        backoff_initial: float = BACKOFF_INITIAL,
    ) -> None:
        self._node = validate_node_name(node_name)
        for what, given in (("keys", keys), ("annotation_keys", annotation_keys)):
            if isinstance(given, str) or not all(isinstance(k, str) and k for k in given):
                raise ValueError(f"{what} must be a sequence of non-empty keys, got {given!r}")
        if not keys and not annotation_keys:
            raise ValueError("watch at least one label or annotation key")
        if timeout_seconds < 1 or backoff_max <= 0 or backoff_initial <= 0:
            raise ValueError("timeout_seconds must be >= 1 and the backoff bounds positive")
        self._api = api
        self._keys = tuple(dict.fromkeys(keys))
        self._annotation_keys = tuple(dict.fromkeys(annotation_keys))
        self._post = post
        self._known = known  # the caller's GET: the first watch starts from it, with no GET of its own
        self._timeout = int(timeout_seconds)
        self._backoff_max = float(backoff_max)
        self._backoff_initial = min(float(backoff_initial), self._backoff_max)
        self._values: dict[str, str | None] | None = None  # None until the first values were posted
        self._annotations: dict[str, str | None] | None = None
        self._failures = 0  # the current failure streak
        self._gone_streak = 0  # 410s in a row with no event between them
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._response: object | None = None  # the open watch response, so stop() can cut it
        self._thread = threading.Thread(target=self._run, name=f"node-label-watch-{self._node}", daemon=True)

    @property
    def node_name(self) -> str:
        return self._node

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = STOP_JOIN_TIMEOUT) -> None:
        """Stop promptly: cut the open watch and join the thread (at most ``timeout`` seconds)."""
        self._stop.set()
        with self._lock:
            response = self._response
        if response is not None:
            _shutdown(response)
        if self._thread.ident is not None and timeout > 0:
            self._thread.join(timeout=timeout)
            if self._thread.is_alive():
                log.warning("node label watch did not stop node=%s timeout=%.0fs", self._node, timeout)

    # ----- the thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        resource_version: str | None = None  # None: (re)list before watching
        if self._known is not None:  # what the caller's GET found is posted as a GET's would be, then watched from
            self._apply(self._known.labels, self._known.annotations)
            resource_version = self._known.resource_version
        while not self._stop.is_set():
            verb = "get"
            try:
                if resource_version is None:
                    labels, annotations, resource_version = _get_node(self._api, self._node)
                    if self._failures:
                        log.info("node label get ok node=%s after_failures=%d action=watch", self._node, self._failures)
                    self._apply(labels, annotations)
                    if resource_version is None:
                        raise _WatchFailed(f"node {self._node} has no resourceVersion")
                verb = "list and watch"
                resource_version = self._watch(resource_version)
            except _Stopped:
                break
            except KubeApiError as e:
                if self._stop.is_set():
                    break
                resource_version = None
                if e.status == HTTP_GONE and verb != "get":
                    self._gone_streak += 1
                    if self._gone_streak == 1:  # too old a resourceVersion: re-list at once; a second 410 backs off
                        log.info("node label watch expired node=%s action=relist", self._node)
                        continue
                self._failed(describe_api_error(e, self._node, verb))
            except NodeLabelError as e:
                resource_version = None
                self._failed(str(e))
            except Exception as e:  # never crash: network errors, malformed events, anything else
                if self._stop.is_set():
                    break
                resource_version = None
                self._failed(describe_api_error(e, self._node, verb))
        log.debug("node label watch stopped node=%s", self._node)

    def _watch(self, resource_version: str) -> str:
        """One WATCH from ``resource_version`` until the server ends it; returns the last resourceVersion seen."""
        started = time.monotonic()
        events = 0
        response = self._api.list_node(
            field_selector=f"metadata.name={self._node}",
            resource_version=resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=self._timeout,  # the server ends the watch then; it is resumed from resource_version
            watch=True,
            _preload_content=False,  # the open response, read line by line here, and cut by stop()
            _request_timeout=(WATCH_CONNECT_TIMEOUT, self._timeout + WATCH_READ_SLACK),
        )
        with self._lock:
            self._response = response
        if self._stop.is_set():
            _shutdown(response)
            _close(response)
            raise _Stopped
        stream = watch_events(response)
        try:
            for event in stream:
                if self._stop.is_set():
                    raise _Stopped
                if not isinstance(event, Mapping):
                    continue
                events += 1
                self._recovered()
                self._gone_streak = 0
                kind = event.get("type")
                obj = event.get("raw_object")
                metadata = obj.get("metadata") if isinstance(obj, Mapping) else None
                if not isinstance(metadata, Mapping):
                    continue
                resource_version = str(metadata.get("resourceVersion") or resource_version)
                if kind in ("ADDED", "MODIFIED"):
                    self._apply(metadata.get("labels") or {}, metadata.get("annotations") or {})
                elif kind == "DELETED":
                    log.warning("node deleted node=%s", self._node)
                    self._apply({}, {})
                # BOOKMARK: only the resourceVersion moves
        finally:
            stream.close()
            _close(response)  # now, not at garbage collection
            with self._lock:
                self._response = None
        if self._stop.is_set():
            raise _Stopped
        elapsed = time.monotonic() - started
        if not events and elapsed < MIN_HEALTHY_WATCH:
            raise _WatchFailed(f"the API server ended the watch of node {self._node} after {elapsed:.2f}s, no event")
        self._recovered()
        log.debug("node label watch ended node=%s rv=%s events=%d action=rewatch", self._node, resource_version, events)
        return resource_version

    def _apply(self, labels: Mapping[str, object], annotations: Mapping[str, object]) -> None:
        """Post the watched keys whose value differs from what was last posted (all of them the first time)."""
        labels = labels if isinstance(labels, Mapping) else {}  # a malformed event reads as "no values"
        annotations = annotations if isinstance(annotations, Mapping) else {}
        self._values = self._changed("label", self._keys, labels, self._values, NodeLabelChanged)
        self._annotations = self._changed(
            "annotation", self._annotation_keys, annotations, self._annotations, NodeAnnotationChanged
        )

    def _changed(
        self,
        what: str,
        keys: tuple[str, ...],
        given: Mapping[str, object],
        last: dict[str, str | None] | None,
        event: type[NodeLabelChanged] | type[NodeAnnotationChanged],
    ) -> dict[str, str | None]:
        current = {key: _value(given.get(key)) for key in keys}
        for key in keys:
            value = current[key]
            if last is None:
                log.info("node %s initial node=%s key=%s value=%s", what, self._node, key, value)
            elif value != last.get(key):
                log.info("node %s changed node=%s key=%s value=%s", what, self._node, key, value)
            else:
                continue
            self._post(event(key=key, value=value))
        return current

    def _failed(self, error: str) -> None:
        """Log once per failure streak, post None for every key if nothing was ever read, then back off."""
        if self._stop.is_set():
            return
        self._failures += 1
        delay = min(self._backoff_max, self._backoff_initial * 2 ** min(self._failures - 1, 30))
        delay *= random.uniform(0.8, 1.0)  # noqa: S311 - jitter, so a fleet of agents does not retry in step
        if self._failures == 1:
            log.warning(
                "node label watch failed node=%s error=%s action=retry backoff_max=%.1fs%s",
                self._node,
                error,
                self._backoff_max,
                "" if self._values is None else " keeping=last-known-values",
            )
        else:
            log.debug(
                "node label watch retry node=%s failures=%d delay=%.2fs error=%s",
                self._node,
                self._failures,
                delay,
                error,
            )
        if self._values is None:
            self._apply({}, {})  # the node cannot be read: the consumer falls back to its default, for now
        self._stop.wait(delay)

    def _recovered(self) -> None:
        if self._failures:
            log.info("node label watch recovered node=%s failures=%d", self._node, self._failures)
            self._failures = 0


def watch_events(response: Any) -> Iterator[object]:
    """The events of a watch stream, one JSON object a line (what ``kubernetes.watch.Watch`` reads, without it).

    A line that is not JSON is skipped, as the official client skips it; an ``ERROR`` event (a Status: 410 Gone
    for an expired resourceVersion) raises :class:`KubeApiError` with its code, reason and message. Each event
    carries its object twice, as the official client's do: ``object`` and ``raw_object``.
    """
    buffer = bytearray()
    while chunk := response.read1(1 << 16):
        buffer.extend(chunk)
        while (end := buffer.find(b"\n")) != -1:
            line, buffer = bytes(buffer[:end]), buffer[end + 1 :]
            event = _event(line)
            if event is not None:
                yield event
        if len(buffer) > MAX_WATCH_LINE:
            raise _WatchFailed(f"a watch event longer than {MAX_WATCH_LINE >> 20} MiB")
    event = _event(bytes(buffer))
    if event is not None:
        yield event


def _event(line: bytes) -> object:
    if not line.strip():
        return None
    try:
        event = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(event, dict):
        return event
    event["raw_object"] = event.get("object")
    if event.get("type") == "ERROR":
        status = event["raw_object"] if isinstance(event["raw_object"], Mapping) else {}
        code = status.get("code")
        raise KubeApiError(
            code if isinstance(code, int) else 500,
            f"{status.get('reason')}: {status.get('message')}",
            json.dumps(status),
        )
    return event


def _client_errors() -> tuple[type[BaseException], ...]:
    """The official client's network errors (urllib3's), when it is the one in use (it is loaded then)."""
    urllib3 = sys.modules.get("urllib3.exceptions")
    return (urllib3.HTTPError,) if urllib3 is not None else ()


def _close(response: Any) -> None:
    with contextlib.suppress(Exception):
        response.close()
    with contextlib.suppress(Exception):
        response.release_conn()


def _value(value: object) -> str | None:
    return None if value is None else str(value)


def _shutdown(response: object) -> None:
    """Cut an open streaming response from another thread: the reader unblocks and the server sees the close.

    Both directions are shut down (urllib3's own ``HTTPResponse.shutdown()`` only shuts down reading, which sends
    the server nothing while the socket's file objects are still open).
    """
    connection = getattr(response, "connection", None) or getattr(response, "_connection", None)
    sock = getattr(connection, "sock", None)
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
            return
    shutdown = getattr(response, "shutdown", None)  # urllib3 >= 2.3
    if callable(shutdown):
        with contextlib.suppress(Exception):
            shutdown()
