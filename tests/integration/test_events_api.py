"""The Node event recorder against a fake API server (tests/fake_events_api.py) spoken to by the real client.

What an operator would notice: the Event arrives on the Node with the fields ``kubectl describe node`` shows; a
repeat becomes the first Event's series count; a burst is cut by the rate limit; without RBAC the agent says
once which rule is missing and keeps the events in its log; an API server that goes away or hangs never holds up
the caller nor ``stop``.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.config.node_label import load_kube_api
from agent.events import EventRecorder
from tests.fake_events_api import FakeEventsApi, Serving, serving
from tests.fake_kube import write_kubeconfig

pytestmark = pytest.mark.timeout(60)

NODE = "gpu-node-1"
NODE_UID = "6c1e8f0e-0000-4000-8000-000000000001"
LOGGER = "agent.events"
DEADLINE = 15.0
EVENTS = "/apis/events.k8s.io/v1/namespaces/default/events"
MICRO_TIME_Z = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")
XID = ("Warning", "GPUUnhealthy", "MarkUnhealthy", "GPU 0 (GPU-5d3c…): XID 79; the catalog says RESET_GPU")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def fake() -> FakeEventsApi:
    return FakeEventsApi()


@pytest.fixture
def server(fake: FakeEventsApi) -> Iterator[Serving]:
    with serving(fake) as running:
        yield running


@pytest.fixture
def api_client(server: Serving, tmp_path: Path):
    """The agent's client, loaded from a kubeconfig the way the agent loads it (``load_kube_api``)."""
    return load_kube_api(write_kubeconfig(tmp_path / "kubeconfig", server.port))


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def recorder(api_client, clock: Clock) -> Iterator:
    """``recorder(**options)``: a started recorder on NODE; all stop at teardown."""
    made: list[EventRecorder] = []

    def make(**options) -> EventRecorder:
        options.setdefault("clock", clock)
        options.setdefault("retry_delay", 0.01)
        made.append(EventRecorder(api_client, NODE, **options))
        made[-1].start()
        return made[-1]

    yield make
    for each in made:
        each.stop()


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    return caplog


def flushed(recorder: EventRecorder) -> EventRecorder:
    assert recorder.flush(DEADLINE), "the recorder did not empty its queue in time"
    return recorder


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]


def event_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.getMessage().startswith("event type=")]


# ----- an Event arrives, and a repeat counts on it -----------------------------------------------------------


def test_an_event_arrives_on_the_node_with_the_fields_kubectl_shows(fake, recorder) -> None:
    events = flushed(recorder(node_uid=NODE_UID))
    events.emit(*XID)
    flushed(events)
    [stored] = fake.stored()
    assert re.fullmatch(r"gpu-node-1\.[0-9a-f]{16}", stored["metadata"]["name"])
    assert stored["metadata"]["namespace"] == "default"
    assert stored["regarding"] == {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": NODE_UID}
    assert (stored["type"], stored["reason"], stored["action"], stored["note"]) == XID
    assert stored["reportingController"] == "tessera.dev/agent"
    assert stored["reportingInstance"] == NODE
    assert MICRO_TIME_Z.fullmatch(stored["eventTime"])
    assert "series" not in stored
    [post] = fake.seen("POST")
    assert (post.path, post.status) == (EVENTS, 201)
    assert (events.sent, events.failures, events.dropped) == (1, 0, 0)


def test_without_a_node_uid_the_event_names_the_node_as_its_uid_like_the_kubelet(fake, recorder) -> None:
    events = recorder()
    events.emit("Normal", "GPUHealthy", "MarkHealthy", "GPU 0: healthy again after XID 79")
    flushed(events)
    assert fake.stored()[0]["regarding"]["uid"] == NODE


def test_a_repeat_patches_the_series_of_the_first_event(fake, recorder, clock) -> None:
    events = recorder()
    events.emit(*XID)
    flushed(events)
    clock.now += 30
    events.emit(*XID)
    flushed(events)
    [stored] = fake.stored()
    first_time = stored["eventTime"]
    assert stored["series"]["count"] == 2
    assert MICRO_TIME_Z.fullmatch(stored["series"]["lastObservedTime"])
    assert stored["series"]["lastObservedTime"] >= first_time
    [patch] = fake.seen("PATCH")
    assert patch.path == f"{EVENTS}/{stored['metadata']['name']}"
    assert patch.content_type == "application/strategic-merge-patch+json"  # what the client picks for a dict
    assert set(patch.body) == {"series"}  # type: ignore[arg-type]
    assert patch.status == 200

    clock.now += 30
    events.emit(*XID)
    flushed(events)
    [stored] = fake.stored()
    assert (stored["series"]["count"], stored["eventTime"]) == (3, first_time)
    assert (len(fake.seen("POST")), len(fake.seen("PATCH")), events.sent) == (1, 2, 3)


def test_another_note_is_another_event(fake, recorder) -> None:
    events = recorder()
    events.emit(*XID)
    events.emit(*XID[:3], "GPU 1 (GPU-9a1b…): XID 79; the catalog says RESET_GPU")
    flushed(events)
    assert len(fake.stored()) == 2
    assert not fake.seen("PATCH")


def test_the_same_event_after_the_aggregation_window_is_a_new_event(fake, recorder, clock) -> None:
    events = recorder(aggregate_seconds=600.0)
    events.emit(*XID)
    flushed(events)
    clock.now += 601
    events.emit(*XID)
    flushed(events)
    assert len(fake.stored()) == 2
    assert all("series" not in event for event in fake.stored())


def test_a_repeat_of_an_event_the_api_server_dropped_creates_it_with_its_series(fake, recorder) -> None:
    events = recorder()
    events.emit(*XID)
    flushed(events)
    [first] = fake.stored()
    fake.forget(first["metadata"]["name"])  # its TTL ran out
    events.emit(*XID)
    flushed(events)
    [again] = fake.stored()
    assert again["metadata"]["name"] == first["metadata"]["name"]
    assert again["series"]["count"] == 2
    assert MICRO_TIME_Z.fullmatch(again["series"]["lastObservedTime"])
    assert [(r.method, r.status) for r in fake.requests] == [("POST", 201), ("PATCH", 404), ("POST", 201)]
    assert (events.sent, events.failures) == (2, 0)


def test_a_long_note_arrives_cut_to_1_kib(fake, recorder) -> None:
    events = recorder()
    events.emit("Warning", "ConfigRejected", "ApplyConfig", "sharing.mps.resources[0].replicas: " + "é" * 2000)
    flushed(events)
    note = fake.stored()[0]["note"]
    assert len(note.encode()) <= 1024
    assert note.endswith("…")
    assert note.startswith("sharing.mps.resources[0].replicas: ")


# ----- the rate limit ------------------------------------------------------------------------------------------


def test_a_burst_beyond_the_limit_is_dropped_and_counted(fake, recorder, clock, logs) -> None:
    events = recorder(burst=3, refill_seconds=300.0)
    for gpu in range(5):
        events.emit("Warning", "GPUUnhealthy", "MarkUnhealthy", f"GPU {gpu}: XID 79")
    flushed(events)
    assert len(fake.stored()) == 3
    assert (events.sent, events.dropped) == (3, 2)
    [warned] = warnings(logs)
    assert "rate-limited reason=GPUUnhealthy" in warned

    clock.now += 300  # one token back
    events.emit("Warning", "GPUUnhealthy", "MarkUnhealthy", "GPU 5: XID 79")
    flushed(events)
    assert (len(fake.stored()), events.dropped) == (4, 2)


# ----- when the API server says no -----------------------------------------------------------------------------


def test_forbidden_gives_one_warning_naming_the_rbac_rule_and_events_go_to_the_log(fake, recorder, logs) -> None:
    fake.fail(403)
    events = recorder()
    for gpu in range(3):
        events.emit("Warning", "GPUUnhealthy", "MarkUnhealthy", f"GPU {gpu}: XID 79")
        flushed(events)
    [warned] = warnings(logs)
    assert "events.k8s.io" in warned
    assert "verbs [create, patch]" in warned
    assert "cannot create resource" in warned  # the API server's own words are kept
    assert len(event_lines(logs)) == 3
    assert all(line.startswith("event type=Warning reason=GPUUnhealthy") for line in event_lines(logs))
    assert len(fake.seen("POST")) == 3  # a refusal is not retried
    assert (events.failures, events.logged, events.sent) == (3, 3, 0)

    fake.fail(None)  # the ClusterRole was fixed
    events.emit("Normal", "GPUHealthy", "MarkHealthy", "GPU 0: healthy again after XID 79")
    flushed(events)
    assert events.sent == 1
    assert len(fake.stored()) == 1
    assert len(warnings(logs)) == 1


def test_a_server_error_is_retried_and_the_event_arrives(fake, recorder, logs) -> None:
    fake.fail_then_answer(500, 503)
    events = recorder()
    events.emit(*XID)
    flushed(events)
    assert [r.status for r in fake.seen("POST")] == [500, 503, 201]
    assert (events.sent, events.failures) == (1, 0)
    assert not warnings(logs)


def test_a_server_that_keeps_failing_is_given_up_on_after_bounded_attempts(fake, recorder, logs) -> None:
    fake.fail(500)
    events = recorder(max_attempts=3)
    events.emit(*XID)
    flushed(events)
    assert len(fake.seen("POST")) == 3
    events.emit("Warning", "GPUUnhealthy", "MarkUnhealthy", "GPU 1: XID 79")
    flushed(events)
    assert len(fake.seen("POST")) == 4  # while it fails, each later event gets one attempt
    [warned] = warnings(logs)
    assert "the API server fails or is out of reach" in warned
    assert len(event_lines(logs)) == 2
    assert (events.failures, events.logged, events.sent) == (2, 2, 0)


def test_a_rejected_event_is_logged_and_not_retried(fake, recorder, logs) -> None:
    fake.fail(422)
    events = recorder()
    events.emit(*XID)
    flushed(events)
    assert len(fake.seen("POST")) == 1
    [warned] = warnings(logs)
    assert "rejected an Event status=422" in warned
    assert len(event_lines(logs)) == 1


# ----- when the API server goes away ---------------------------------------------------------------------------


def test_an_api_server_that_went_away_never_blocks_emit_or_stop(fake, server, recorder, logs) -> None:
    events = recorder()
    events.emit(*XID)
    flushed(events)
    server.close()
    slowest = 0.0
    for gpu in range(50):
        started = time.monotonic()
        events.emit("Warning", "GPUUnhealthy", "MarkUnhealthy", f"GPU {gpu}: XID 79")
        slowest = max(slowest, time.monotonic() - started)
    assert slowest < 0.5
    started = time.monotonic()
    events.stop(timeout=1.0)
    assert time.monotonic() - started < 1.0 + 0.5
    assert events.flush(DEADLINE)  # the write in flight at stop (if any) has come back
    assert events.sent == 1
    assert events.failures + events.dropped == 50  # each one logged as it failed, or dropped at stop
    assert events.logged == events.failures


def test_a_hanging_api_server_never_blocks_emit_or_stop(fake, recorder) -> None:
    fake.hold()
    events = recorder()
    events.emit(*XID)
    fake.wait_for_requests(1, "POST")  # the write is in flight, and will not be answered
    started = time.monotonic()
    for gpu in range(20):
        events.emit("Warning", "GPUUnhealthy", "MarkUnhealthy", f"GPU {gpu}: XID 79")
    assert time.monotonic() - started < 0.5
    assert not events.flush(0.05)
    started = time.monotonic()
    events.stop(timeout=0.5)
    assert time.monotonic() - started < 0.5 + 0.5
    assert events.dropped == 20  # what was queued behind the hung write
    fake.release()


CLAIM = {
    "apiVersion": "resource.k8s.io/v1",
    "kind": "ResourceClaim",
    "namespace": "ml",
    "name": "small",
    "uid": "0b8e2f44-0000-4000-8000-000000000001",
}
ADVISORY = (
    "Warning",
    "ShareLimitAdvisory",
    "PrepareShare",
    "gpu-0: memory 10240Mi advisory: the MPS server holds 20480Mi",
)


def test_an_event_about_a_claim_arrives_in_its_namespace_regarding_it_and_repeats_count_there(fake, recorder) -> None:
    events = flushed(recorder(node_uid=NODE_UID))
    events.emit(*ADVISORY, regarding=CLAIM)
    events.emit(*ADVISORY, regarding=CLAIM)
    events.emit(*ADVISORY, regarding={**CLAIM, "name": "other", "uid": "0b8e2f44-0000-4000-8000-000000000002"})
    flushed(events)
    stored = sorted(fake.stored(), key=lambda e: e["regarding"]["name"])
    assert [e["metadata"]["namespace"] for e in stored] == ["ml", "ml"]  # kubectl describe resourceclaim finds them
    assert stored[1]["regarding"] == CLAIM and stored[1]["reason"] == "ShareLimitAdvisory"
    assert stored[1]["series"]["count"] == 2 and "series" not in stored[0]  # one claim's repeat, not the other's


@pytest.mark.parametrize(
    "subject",
    [{**CLAIM, "namespace": "Not_A_Label"}, {k: v for k, v in CLAIM.items() if k != "uid"}, {**CLAIM, "name": ""}],
)
def test_an_event_about_a_malformed_subject_is_refused_naming_it(recorder, subject: dict) -> None:
    with pytest.raises(ValueError, match="subject"):
        recorder().emit(*ADVISORY, regarding=subject)


# ----- the start's Events wait until the start is over ------------------------------------------------------


def test_events_held_for_the_start_are_written_only_once_released(fake, recorder) -> None:
    """The agent holds the Events it makes while it starts (ConfigApplied) until the kubelet is served: their JSON
    and HTTP do not compete with the registration. Nothing is written before; everything, in order, after."""
    events = recorder(hold_seconds=60)
    events.emit(*XID)
    events.emit("Normal", "ConfigApplied", "ApplyConfig", "sharing config default.yaml")
    assert not events.flush(0.3)  # held: still queued
    assert fake.stored() == []
    events.release()
    flushed(events)
    assert [e["reason"] for e in sorted(fake.stored(), key=lambda e: e["eventTime"])] == [XID[1], "ConfigApplied"]


def test_events_held_for_a_start_that_never_ends_are_written_after_the_hold(fake, recorder) -> None:
    events = recorder(hold_seconds=0.2)  # nobody releases them: the kubelet never watched
    events.emit(*XID)
    flushed(events)
    assert [e["reason"] for e in fake.stored()] == [XID[1]]


def test_a_recorder_stopped_while_it_holds_events_stops_at_once(fake, recorder) -> None:
    events = recorder(hold_seconds=60)
    events.emit(*XID)
    started = time.monotonic()
    events.stop(timeout=DEADLINE)
    assert time.monotonic() - started < DEADLINE / 2
    assert fake.stored() == [] and events.dropped == 1
