"""The node label watcher against a fake Kubernetes API server spoken to by the real Kubernetes client.

The fake implements only what the client calls: ``GET /api/v1/nodes/<name>`` and the field-selected watch
``GET /api/v1/nodes?fieldSelector=metadata.name%3D<name>&watch=true`` as a chunked stream of newline-delimited
events. Like the real API server it keeps an event history, so a watch from resourceVersion N replays every
event after N, and a compaction makes older resourceVersions answer ``410 Gone``.
"""

from __future__ import annotations

import itertools
import logging
import queue
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.config import node_label
from agent.config.node_label import (
    CONFIG_LABEL,
    MIG_CONFIG_LABEL,
    NodeLabelChanged,
    NodeLabelError,
    NodeLabelWatcher,
    load_kube_api,
    read_node_labels,
    read_node_metadata,
)
from tests.fake_kube import FakeKube, serving, write_kubeconfig

pytestmark = pytest.mark.timeout(30)

NODE = "gpu-node-1"
DEADLINE = 15.0  # seconds any expected event may take (generous: CI machines run other tests alongside)
LOGGER = "agent.config.node_label"
KEYS = (CONFIG_LABEL, MIG_CONFIG_LABEL)


# ----- the fake API server ----------------------------------------------------------------------------


@pytest.fixture
def fake() -> Iterator[FakeKube]:
    with serving(FakeKube(NODE, {CONFIG_LABEL: "mps-4", "kubernetes.io/hostname": NODE})) as kube:
        yield kube


@pytest.fixture
def api(fake: FakeKube, tmp_path: Path):
    return load_kube_api(str(write_kubeconfig(tmp_path / "kubeconfig", fake.port)))


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


def test_a_watcher_given_the_callers_get_reads_nothing_again_and_misses_no_change_made_since(
    fake: FakeKube, api, watch
) -> None:
    """The agent's start reads the node once (its labels pick the config before anything is advertised) and opens
    the watch later, from that read: the watch is the only request after it, and a label changed in between is
    its first event."""
    known = read_node_metadata(api, NODE)
    assert known.labels[CONFIG_LABEL] == "mps-4" and known.resource_version == str(fake.rv)
    fake.update({CONFIG_LABEL: "time-slicing-8"})  # after the read, before the watch

    _, events = watch(known=known)
    expect_initial(events, config="mps-4")  # what the read found, as a GET's values are posted
    assert next_event(events) == NodeLabelChanged(CONFIG_LABEL, "time-slicing-8")
    assert fake.count("get") == 1  # the caller's read; the watcher made none
    assert fake.count("watch") == 1


def test_a_watcher_given_a_read_without_a_resource_version_gets_the_node_itself(fake: FakeKube, watch) -> None:
    _, events = watch(known=node_label.NodeRead({CONFIG_LABEL: "old"}, {}, None))
    assert next_event(events) == NodeLabelChanged(CONFIG_LABEL, "old")
    assert next_event(events) == NodeLabelChanged(MIG_CONFIG_LABEL, None)
    assert next_event(events) == NodeLabelChanged(CONFIG_LABEL, "mps-4")  # its own GET: where to watch from
    fake.wait_for_requests("watch", 1)
    assert fake.count("get") == 1


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
    fake.wait_for(lambda: fake.open_streams == 1)  # the watch is open: closing it now is what ends it
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


# ----- a watch line without end ----------------------------------------------------------------------------


def test_a_watch_line_longer_than_the_bound_is_a_failed_watch_that_is_re_established(
    fake: FakeKube, watch, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One watch event longer than MAX_WATCH_LINE (here 1 MiB; a 3 MiB annotation) is not buffered whole: the
    watch fails, once, said in one warning, the node is read again (the change is not lost) and followed on."""
    monkeypatch.setattr(node_label, "MAX_WATCH_LINE", 1 << 20)
    _, events = watch()
    expect_initial(events)
    fake.wait_for(lambda: fake.open_streams == 1)

    fake.update({CONFIG_LABEL: "big"}, annotate={"example.com/blob": "x" * (3 << 20)})
    assert next_event(events) == NodeLabelChanged(CONFIG_LABEL, "big")  # from the re-read node
    fake.wait_for_requests("watch", 2)
    failures = warnings(caplog)
    assert len(failures) == 1 and "a watch event longer than 1 MiB" in failures[0], failures
    assert fake.count("get") == 2

    fake.update({CONFIG_LABEL: "after"}, annotate={"example.com/blob": None})  # and it follows the label on
    assert next_event(events) == NodeLabelChanged(CONFIG_LABEL, "after")
    assert len(warnings(caplog)) == 1


def test_a_watch_line_that_never_ends_is_cut_at_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream that sends bytes and never a newline ends the watch after about MAX_WATCH_LINE bytes, not when
    memory runs out (the stream stands in for the open answer: it gives 64 KiB at each read, for ever)."""
    monkeypatch.setattr(node_label, "MAX_WATCH_LINE", 1 << 20)

    class Endless:
        reads = 0

        def read1(self, amount: int) -> bytes:
            self.reads += 1
            assert self.reads < 1000, "the watch buffered 64 MiB of one line"
            return b"x" * amount

    stream = Endless()
    with pytest.raises(Exception, match="a watch event longer than 1 MiB"):
        next(iter(node_label.watch_events(stream)))
    assert stream.reads <= 17  # 1 MiB and one read past it
