"""The node label watcher against a fake Kubernetes API server spoken to by the real Kubernetes client.

The fake implements only what the client calls: ``GET /api/v1/nodes/<name>`` and the field-selected watch
``GET /api/v1/nodes?fieldSelector=metadata.name%3D<name>&watch=true`` as a chunked stream of newline-delimited
events. Like the real API server it keeps an event history, so a watch from resourceVersion N replays every
event after N, and a compaction makes older resourceVersions answer ``410 Gone``.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import queue
import select
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from agent.config.node_label import (
    CONFIG_LABEL,
    MIG_CONFIG_LABEL,
    NodeLabelChanged,
    NodeLabelError,
    NodeLabelWatcher,
    load_kube_api,
    read_node_labels,
)

pytestmark = pytest.mark.timeout(30)

NODE = "gpu-node-1"
DEADLINE = 15.0  # seconds any expected event may take (generous: CI machines run other tests alongside)
LOGGER = "agent.config.node_label"
KEYS = (CONFIG_LABEL, MIG_CONFIG_LABEL)


# ----- the fake API server ----------------------------------------------------------------------------


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

    def __init__(self, node_name: str, labels: dict[str, str]) -> None:
        self.node_name = node_name
        self.labels = dict(labels)
        self.rv = 100
        self.horizon = 0  # watches from a resourceVersion older than this get 410 Gone
        self.history: list[tuple[int, dict]] = []  # (resourceVersion, watch event)
        self.requests: list[tuple[float, str, int]] = []  # (time, "get" | "watch" | "other", status answered)
        self.get_status: int | None = None  # answer GETs with this error status
        self.watch_status: int | None = None  # answer watches with this error status
        self.open_streams = 0
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
            },
            "spec": {},
            "status": {},
        }

    def update(self, set_: dict[str, str] | None = None, remove: tuple[str, ...] = (), *, notify: bool = True) -> None:
        """Change labels (a new resourceVersion); ``notify=False`` changes them without a watch event."""
        with self.cond:
            self.labels.update(set_ or {})
            for key in remove:
                self.labels.pop(key, None)
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
        url = urlsplit(self.path)
        query = parse_qs(url.query)
        if url.path == "/api/v1/nodes" and query.get("watch", [""])[0] in _GO_TRUE:
            fake.serve_watch(self, query)
        elif url.path.startswith("/api/v1/nodes/") and url.path.count("/") == 4:
            fake.serve_get(self, url.path.rsplit("/", 1)[1])
        else:
            fake.record("other", 404)
            _send_json(self, 404, _status(404, "NotFound", f"the fake does not serve {self.path}"))


@pytest.fixture
def fake() -> Iterator[FakeKube]:
    kube = FakeKube(NODE, {CONFIG_LABEL: "mps-4", "kubernetes.io/hostname": NODE})
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    server.fake = kube  # type: ignore[attr-defined]
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


@pytest.fixture
def api(fake: FakeKube, tmp_path: Path):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        f"""apiVersion: v1
kind: Config
clusters:
- name: fake
  cluster:
    server: http://127.0.0.1:{fake.port}
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
    return load_kube_api(str(kubeconfig))


@pytest.fixture
def watch(api) -> Iterator:
    """``watch(**options)`` starts a watcher of KEYS on NODE; returns (watcher, events). All stop at teardown."""
    started: list[NodeLabelWatcher] = []

    def start(*, node: str = NODE, keys=KEYS, **options) -> tuple[NodeLabelWatcher, queue.Queue]:
        events: queue.Queue = queue.Queue()
        options.setdefault("backoff_initial", 0.05)
        options.setdefault("backoff_max", 0.2)
        watcher = NodeLabelWatcher(api, node, keys, events.put, **options)
        started.append(watcher)
        watcher.start()
        return watcher, events

    yield start
    for watcher in started:
        watcher.stop()


def next_event(events: queue.Queue, timeout: float = DEADLINE) -> object:
    try:
        return events.get(timeout=timeout)
    except queue.Empty:
        pytest.fail(f"no event posted within {timeout}s")


def expect_initial(events: queue.Queue, config: str | None = "mps-4", mig: str | None = None) -> None:
    assert next_event(events) == NodeLabelChanged(CONFIG_LABEL, config)
    assert next_event(events) == NodeLabelChanged(MIG_CONFIG_LABEL, mig)


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


def watcher_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("node-label-watch")]


# ----- read_node_labels and load_kube_api ----------------------------------------------------------------


def test_read_node_labels_returns_the_labels(fake: FakeKube, api) -> None:
    assert read_node_labels(api, NODE) == {CONFIG_LABEL: "mps-4", "kubernetes.io/hostname": NODE}
    assert fake.count("get") == 1


def test_read_node_labels_404_names_the_node(fake: FakeKube, api) -> None:
    with pytest.raises(NodeLabelError) as error:
        read_node_labels(api, "no-such-node")
    message = str(error.value)
    assert "no-such-node" in message
    assert "404" in message
    assert "NODE_NAME" in message


def test_read_node_labels_403_names_the_fix(fake: FakeKube, api) -> None:
    fake.get_status = 403
    with pytest.raises(NodeLabelError) as error:
        read_node_labels(api, NODE)
    message = str(error.value)
    assert "403" in message
    assert f"grant get on nodes/{NODE} to the agent's ServiceAccount" in message
    assert "cannot get resource" in message  # the API server's own words are kept


def test_unreachable_api_is_a_node_label_error(tmp_path: Path) -> None:
    with socket_closed_port() as port:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\n"
            f"clusters: [{{name: c, cluster: {{server: 'http://127.0.0.1:{port}'}}}}]\n"
            "users: [{name: u, user: {}}]\ncontexts: [{name: x, context: {cluster: c, user: u}}]\n"
            "current-context: x\n"
        )
        api = load_kube_api(kubeconfig)
        api.api_client.configuration.retries = 0
        with pytest.raises(NodeLabelError, match=NODE):
            read_node_labels(api, NODE)


class socket_closed_port:
    """A loopback port with nothing listening on it."""

    def __enter__(self) -> int:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        return self._sock.getsockname()[1]

    def __exit__(self, *exc: object) -> None:
        self._sock.close()


@pytest.mark.parametrize(
    "name",
    ["", "GPU-Node", "node_1", "-node", "node-", "node..a", "a/b", "../etc", "node 1", "a" * 254, None, 7],
)
def test_invalid_node_name_is_rejected_before_any_request(fake: FakeKube, api, name: object) -> None:
    with pytest.raises(ValueError, match="node name"):
        read_node_labels(api, name)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="node name"):
        NodeLabelWatcher(api, name, KEYS, lambda event: None)  # type: ignore[arg-type]
    assert fake.requests == []


def test_a_long_dotted_node_name_is_valid(fake: FakeKube, api) -> None:
    name = ".".join(["a" * 63] * 3) + "." + "b" * 61  # 253 characters
    assert len(name) == 253
    with pytest.raises(NodeLabelError, match="404"):
        read_node_labels(api, name)


def test_load_kube_api_outside_a_cluster_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert load_kube_api() is None


def test_load_kube_api_in_a_pod_without_a_token_is_none(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    if Path("/var/run/secrets/kubernetes.io/serviceaccount/token").exists():
        pytest.skip("this machine has a service account token")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert load_kube_api() is None
    assert any("in-cluster-config-failed" in m for m in warnings(caplog))


def test_load_kube_api_with_a_missing_kubeconfig_raises(tmp_path: Path) -> None:
    with pytest.raises(NodeLabelError, match="kubeconfig"):
        load_kube_api(tmp_path / "missing")


# ----- the watcher ------------------------------------------------------------------------------------------


def test_initial_values_are_posted_for_every_key(fake: FakeKube, watch) -> None:
    _, events = watch()
    expect_initial(events, config="mps-4", mig=None)  # the absent MIG label is None


def test_changes_are_posted_and_nothing_else(fake: FakeKube, watch) -> None:
    _, events = watch()
    expect_initial(events)

    fake.update({CONFIG_LABEL: "time-slicing-8"})
    assert next_event(events) == NodeLabelChanged(CONFIG_LABEL, "time-slicing-8")

    # an unrelated label, and a watched key set to its current value, post nothing: the next event is the MIG one
    fake.update({"example.com/unrelated": "x"})
    fake.update({CONFIG_LABEL: "time-slicing-8"})
    fake.update({MIG_CONFIG_LABEL: "all-1g.10gb"})
    assert next_event(events) == NodeLabelChanged(MIG_CONFIG_LABEL, "all-1g.10gb")

    fake.update(remove=(CONFIG_LABEL,))
    assert next_event(events) == NodeLabelChanged(CONFIG_LABEL, None)

    fake.update({CONFIG_LABEL: ""})  # passed through as it is: the consumer validates config names
    assert next_event(events) == NodeLabelChanged(CONFIG_LABEL, "")
    assert fake.count("get") == 1  # one GET, then the watch alone


def test_rewatches_when_the_server_closes_the_stream(fake: FakeKube, watch, caplog: pytest.LogCaptureFixture) -> None:
    _, events = watch()
    expect_initial(events)
    fake.update({CONFIG_LABEL: "a"})
    assert next_event(events) == NodeLabelChanged(CONFIG_LABEL, "a")

    fake.close_streams()
    fake.wait_for_requests("watch", 2)
    fake.update({CONFIG_LABEL: "b"})
    assert next_event(events) == NodeLabelChanged(CONFIG_LABEL, "b")
    assert fake.count("get") == 1  # a healthy watch is resumed from its resourceVersion, not re-listed
    assert warnings(caplog) == []


def test_rewatches_after_the_server_side_timeout(fake: FakeKube, watch, caplog: pytest.LogCaptureFixture) -> None:
    _, events = watch(timeout_seconds=1)
    expect_initial(events)
    fake.wait_for_requests("watch", 3)  # the server ended two idle watches after their timeoutSeconds
    fake.update({CONFIG_LABEL: "c"})
    assert next_event(events) == NodeLabelChanged(CONFIG_LABEL, "c")
    assert fake.count("get") == 1
    assert warnings(caplog) == []


def test_gone_relists(fake: FakeKube, watch, caplog: pytest.LogCaptureFixture) -> None:
    _, events = watch()
    expect_initial(events)
    fake.update({CONFIG_LABEL: "a"})
    assert next_event(events) == NodeLabelChanged(CONFIG_LABEL, "a")

    # a change the watcher never sees as an event, then the history is compacted and the stream ends:
    # the re-watch from the old resourceVersion gets 410 Gone, and only the re-list shows the change
    fake.update({CONFIG_LABEL: "mig-mixed"}, notify=False)
    fake.compact()
    fake.close_streams()
    assert next_event(events) == NodeLabelChanged(CONFIG_LABEL, "mig-mixed")
    assert fake.count("watch", 410) == 1
    assert fake.count("get") == 2

    fake.update({CONFIG_LABEL: "after"})  # and it watches again from the new resourceVersion
    assert next_event(events) == NodeLabelChanged(CONFIG_LABEL, "after")
    assert warnings(caplog) == []  # an expired watch is routine, not a failure


def test_forbidden_get_logs_once_backs_off_and_recovers(
    fake: FakeKube, watch, caplog: pytest.LogCaptureFixture
) -> None:
    fake.get_status = 403
    _, events = watch(backoff_initial=0.05, backoff_max=0.2)
    expect_initial(events, config=None, mig=None)  # the node cannot be read: None, for now
    fake.wait_for_requests("get", 6)

    times = fake.times("get")[:6]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # backoff: 0.05, 0.1, 0.2, 0.2, 0.2 (each x0.8-1.0 jitter); a hot loop would make these six GETs in a few ms
    assert times[-1] - times[0] >= 0.5, gaps
    assert gaps[2] >= 0.15, gaps  # it grew from 0.05

    failures = warnings(caplog)
    assert len(failures) == 1, failures  # once per failure streak, not per retry
    assert f"grant get on nodes/{NODE} to the agent's ServiceAccount" in failures[0]
    assert NODE in failures[0]

    fake.get_status = None
    assert next_event(events) == NodeLabelChanged(CONFIG_LABEL, "mps-4")  # MIG stays None: nothing to post
    fake.update({MIG_CONFIG_LABEL: "all-balanced"})
    assert next_event(events) == NodeLabelChanged(MIG_CONFIG_LABEL, "all-balanced")
    assert len(warnings(caplog)) == 1


def test_forbidden_watch_logs_once_and_backs_off(fake: FakeKube, watch, caplog: pytest.LogCaptureFixture) -> None:
    fake.watch_status = 403
    _, events = watch(backoff_initial=0.05, backoff_max=0.2)
    expect_initial(events)
    fake.wait_for_requests("watch", 5)
    times = fake.times("watch")[:5]
    assert times[-1] - times[0] >= 0.3
    failures = warnings(caplog)
    assert len(failures) == 1, failures
    assert f"grant list and watch on nodes/{NODE}" in failures[0]

    fake.watch_status = None
    fake.update({CONFIG_LABEL: "d"})
    assert next_event(events) == NodeLabelChanged(CONFIG_LABEL, "d")
    assert events.empty()  # the re-lists after each failure posted no repeats of unchanged values


def test_server_errors_keep_the_last_known_values(fake: FakeKube, watch, caplog: pytest.LogCaptureFixture) -> None:
    _, events = watch()
    expect_initial(events)
    fake.get_status = 500
    fake.watch_status = 500
    fake.close_streams()
    fake.wait_for_requests("get", 4)
    assert events.empty()  # an outage does not flap the config back to the default
    assert len(warnings(caplog)) == 1

    fake.get_status = fake.watch_status = None
    fake.update({CONFIG_LABEL: "e"})
    assert next_event(events) == NodeLabelChanged(CONFIG_LABEL, "e")


@pytest.mark.parametrize("state", ["watching", "backing-off"])
def test_stop_is_prompt_and_leaves_no_thread(fake: FakeKube, watch, state: str) -> None:
    if state == "watching":
        watcher, events = watch()
        expect_initial(events)
        fake.wait_for(lambda: fake.open_streams == 1)
    else:
        fake.get_status = 500
        watcher, events = watch(backoff_initial=30.0, backoff_max=30.0)
        expect_initial(events, config=None)
    assert watcher_threads()
    started = time.monotonic()
    watcher.stop()
    assert time.monotonic() - started < 1.0
    assert watcher_threads() == []
    if state == "watching":
        fake.wait_for(lambda: fake.open_streams == 0)  # the stream was cut, not left open
        assert fake.count("watch") == 1
