"""The pure parts of the Node event recorder: validation, note truncation, bodies, token buckets, aggregation.

No HTTP and no threads here: every decision takes its clock reading as an argument.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import pytest

from agent.core.events import (
    NOTE_LIMIT,
    Correlator,
    MicroTime,
    Occurrence,
    RateLimiter,
    TokenBucket,
    classify_failure,
    event_body,
    event_name,
    micro_time,
    series_patch,
    truncate_note,
    validate_event,
)

T0 = datetime(2025, 3, 1, 12, 0, 0, 123456, tzinfo=UTC)
MICRO_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


# ----- validation: misuse is a ValueError, anything else goes ------------------------------------------


@pytest.mark.parametrize("reason", ["GPUUnhealthy", "A", "MIGChangeApplied", "Xid79", "A" + "b" * 127])
def test_camel_case_reasons_are_accepted(reason: str) -> None:
    validate_event("Warning", reason, "MarkUnhealthy", "note")


@pytest.mark.parametrize(
    "reason",
    ["", "gpuUnhealthy", "GPU_Unhealthy", "GPU Unhealthy", "GPU-Unhealthy", "GPUUnhealthy\n", "Ünhealthy", "1GPU",
     "A" + "b" * 128, None, 7],
)  # fmt: skip
def test_a_reason_that_is_not_camel_case_is_a_value_error(reason: object) -> None:
    with pytest.raises(ValueError, match="CamelCase"):
        validate_event("Warning", reason, "MarkUnhealthy", "note")


@pytest.mark.parametrize("type_", ["Error", "normal", "", None])
def test_only_normal_and_warning_are_types(type_: object) -> None:
    with pytest.raises(ValueError, match="Normal"):
        validate_event(type_, "GPUUnhealthy", "MarkUnhealthy", "note")


@pytest.mark.parametrize("action", ["", "a" * 129, "é" * 65, None])
def test_an_action_must_be_1_to_128_bytes(action: object) -> None:
    with pytest.raises(ValueError, match="action"):
        validate_event("Normal", "GPUHealthy", action, "note")


def test_an_action_of_128_bytes_and_an_empty_note_are_fine() -> None:
    validate_event("Normal", "GPUHealthy", "a" * 128, "")


def test_a_note_that_is_not_a_string_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="note"):
        validate_event("Normal", "GPUHealthy", "MarkHealthy", b"bytes")


# ----- the note: at most 1 KiB of UTF-8, cut with an ellipsis ---------------------------------------------


def test_a_short_note_is_kept_as_it_is() -> None:
    assert truncate_note("GPU 0: XID 79") == "GPU 0: XID 79"


def test_a_note_of_exactly_1_kib_is_not_cut() -> None:
    note = "x" * NOTE_LIMIT
    assert truncate_note(note) == note


def test_a_longer_note_is_cut_to_1_kib_ending_in_an_ellipsis() -> None:
    cut = truncate_note("x" * (NOTE_LIMIT + 1))
    assert cut.endswith("…")
    assert len(cut.encode()) == NOTE_LIMIT
    assert cut == "x" * (NOTE_LIMIT - 3) + "…"


def test_a_multibyte_note_is_cut_on_a_character_boundary() -> None:
    cut = truncate_note("é" * 600)  # 1200 bytes
    assert len(cut.encode()) <= NOTE_LIMIT
    assert cut == "é" * 510 + "…"  # 1020 + 3 bytes: one more é would not fit


def test_a_note_with_a_lone_surrogate_can_still_be_sent() -> None:
    assert truncate_note("bad \udc80 byte") == "bad ? byte"


# ----- names, times and bodies ---------------------------------------------------------------------------


def test_micro_time_is_rfc3339_utc_with_microseconds_and_z() -> None:
    assert micro_time(T0) == "2025-03-01T12:00:00.123456Z"
    assert micro_time(T0.replace(microsecond=0)) == "2025-03-01T12:00:00.000000Z"
    east = T0.astimezone(__import__("datetime").timezone(timedelta(hours=2)))
    assert micro_time(east) == "2025-03-01T12:00:00.123456Z"


def test_a_micro_time_serializes_like_client_go_even_with_no_fraction() -> None:
    """The client writes datetimes with isoformat(); the API server needs six digits and accepts Z."""
    moment = MicroTime.of(T0.replace(microsecond=0))
    assert moment.isoformat() == "2025-03-01T12:00:00.000000Z"
    assert moment == T0.replace(microsecond=0)


def test_event_names_are_the_node_name_and_16_hex_digits_and_unique() -> None:
    names = {event_name("gpu-node-1") for _ in range(1000)}
    assert len(names) == 1000
    assert all(re.fullmatch(r"gpu-node-1\.[0-9a-f]{16}", name) for name in names)


def test_an_event_name_for_the_longest_node_name_is_still_a_dns_subdomain() -> None:
    node = ("a" * 62 + ".") * 3 + "b" * 61  # 250 characters
    name = event_name(node)
    assert len(name) <= 253
    assert DNS_SUBDOMAIN.fullmatch(name)


def occurrence(count: int = 1) -> Occurrence:
    return Occurrence("gpu-node-1.0123456789abcdef", count, T0, T0 + timedelta(seconds=30))


def test_the_event_body_names_the_node_and_the_reporter() -> None:
    body = event_body("gpu-node-1", "6c1e8f0e", "Warning", "GPUUnhealthy", "MarkUnhealthy", "XID 79", occurrence())
    assert json.loads(json.dumps(body, default=str)) == {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": {"name": "gpu-node-1.0123456789abcdef", "namespace": "default"},
        "eventTime": "2025-03-01T12:00:00.123456Z",
        "reportingController": "tessera.dev/agent",
        "reportingInstance": "gpu-node-1",
        "action": "MarkUnhealthy",
        "reason": "GPUUnhealthy",
        "regarding": {"apiVersion": "v1", "kind": "Node", "name": "gpu-node-1", "uid": "6c1e8f0e"},
        "note": "XID 79",
        "type": "Warning",
    }


def test_without_the_node_uid_the_event_is_about_the_node_name_as_the_kubelet_does() -> None:
    """kubectl describe node looks for involvedObject.uid = the Node's UID, and = its name (the kubelet's)."""
    body = event_body("gpu-node-1", None, "Normal", "GPUHealthy", "MarkHealthy", "ok", occurrence())
    assert body["regarding"] == {"apiVersion": "v1", "kind": "Node", "name": "gpu-node-1", "uid": "gpu-node-1"}


def test_a_repeat_created_anew_carries_its_series() -> None:
    body = event_body("gpu-node-1", None, "Warning", "GPUUnhealthy", "MarkUnhealthy", "XID 79", occurrence(3))
    assert json.loads(json.dumps(body["series"], default=str)) == {
        "count": 3,
        "lastObservedTime": "2025-03-01T12:00:30.123456Z",
    }
    assert str(body["eventTime"]) == "2025-03-01T12:00:00.123456Z"  # when it was first seen


def test_the_series_patch_is_count_and_last_observed_time_only() -> None:
    patch = series_patch(occurrence(2))
    assert json.loads(json.dumps(patch, default=str)) == {
        "series": {"count": 2, "lastObservedTime": "2025-03-01T12:00:30.123456Z"}
    }


def test_a_long_node_name_is_cut_for_the_reporting_instance() -> None:
    node = "n" * 200
    assert event_body(node, None, "Normal", "A", "B", "", occurrence())["reportingInstance"] == "n" * 128


# ----- the token bucket (the kubelet's spam filter) --------------------------------------------------------


def test_a_bucket_gives_burst_tokens_then_one_per_refill_period() -> None:
    bucket = TokenBucket(3, 300.0, now=0.0)
    assert [bucket.take(0.0) for _ in range(4)] == [True, True, True, False]
    assert not bucket.take(299.0)
    assert bucket.take(300.0)
    assert not bucket.take(300.0)


def test_a_bucket_never_holds_more_than_burst() -> None:
    bucket = TokenBucket(2, 10.0, now=0.0)
    assert bucket.take(0.0) and bucket.take(0.0)
    assert [bucket.take(10_000.0) for _ in range(3)] == [True, True, False]


def test_a_clock_that_steps_back_gives_no_tokens() -> None:
    bucket = TokenBucket(1, 10.0, now=100.0)
    assert bucket.take(100.0)
    assert not bucket.take(50.0)
    assert not bucket.take(105.0)  # only 5 s since the last reading that counted
    assert bucket.take(110.0)


def test_fractions_of_a_token_add_up() -> None:
    bucket = TokenBucket(1, 10.0, now=0.0)
    assert bucket.take(0.0)
    assert not bucket.take(4.0)
    assert not bucket.take(8.0)
    assert bucket.take(10.0)


def test_each_reason_has_its_own_bucket() -> None:
    limiter = RateLimiter(burst=2, refill_seconds=300.0)
    assert [limiter.allow("GPUUnhealthy", 0.0) for _ in range(3)] == [True, True, False]
    assert limiter.allow("ConfigApplied", 0.0)
    assert limiter.allow("GPUUnhealthy", 300.0)


def test_a_limiter_holds_a_bounded_number_of_buckets_and_forgets_full_ones_first() -> None:
    limiter = RateLimiter(burst=1, refill_seconds=10.0, limit=3)
    assert limiter.allow("Busy", 0.0)
    assert limiter.allow("A", 0.0) and limiter.allow("B", 0.0)
    assert limiter.allow("C", 5.0)  # none is full yet: room is made by forgetting the least recently used (Busy)
    assert limiter.allow("Busy", 5.0)  # a fresh bucket for it
    assert not limiter.allow("C", 5.0)  # C's own bucket is kept and empty
    assert len(limiter._buckets) == 3


# ----- aggregation (client-go's event series) --------------------------------------------------------------


def names() -> object:
    counter = iter(range(1_000_000))
    return lambda: f"ev{next(counter)}"


KEY = ("Warning", "GPUUnhealthy", "MarkUnhealthy", "GPU 0: XID 79")


def test_the_first_sighting_is_a_new_event() -> None:
    correlator = Correlator(600.0, names())
    first = correlator.observe(KEY, 0.0, T0)
    assert (first.name, first.count, first.first_seen, first.last_seen) == ("ev0", 1, T0, T0)


def test_the_same_event_again_within_the_window_counts_on_the_first() -> None:
    correlator = Correlator(600.0, names())
    correlator.observe(KEY, 0.0, T0)
    later = T0 + timedelta(seconds=100)
    again = correlator.observe(KEY, 100.0, later)
    assert (again.name, again.count, again.first_seen, again.last_seen) == ("ev0", 2, T0, later)
    assert correlator.observe(KEY, 200.0, later).count == 3


def test_the_window_runs_from_the_last_sighting() -> None:
    correlator = Correlator(600.0, names())
    for now in (0.0, 500.0, 1000.0, 1600.0):
        last = correlator.observe(KEY, now, T0)
    assert (last.name, last.count) == ("ev0", 4)


def test_after_the_window_the_same_event_is_new_again() -> None:
    correlator = Correlator(600.0, names())
    correlator.observe(KEY, 0.0, T0)
    assert correlator.observe(KEY, 600.0, T0).count == 2  # at the edge: still the series
    fresh = correlator.observe(KEY, 1200.5, T0)
    assert (fresh.name, fresh.count) == ("ev1", 1)


@pytest.mark.parametrize("index", range(4))
def test_any_difference_in_type_reason_action_or_note_is_another_event(index: int) -> None:
    correlator = Correlator(600.0, names())
    correlator.observe(KEY, 0.0, T0)
    other = tuple(value + "X" if i == index else value for i, value in enumerate(KEY))
    assert correlator.observe(other, 1.0, T0) == Occurrence("ev1", 1, T0, T0)  # type: ignore[arg-type]


def test_expired_events_are_forgotten_and_the_memory_is_bounded() -> None:
    correlator = Correlator(600.0, names(), limit=3)
    for i in range(5):
        correlator.observe(("Normal", "R", "A", str(i)), float(i), T0)
    assert len(correlator) == 3
    assert correlator.observe(("Normal", "R", "A", "0"), 10.0, T0).count == 1  # forgotten: the oldest went first
    assert correlator.observe(("Normal", "R", "A", "4"), 11.0, T0).count == 2
    correlator.observe(("Normal", "R", "A", "x"), 2000.0, T0)
    assert len(correlator) == 1  # the rest expired


def test_a_zero_window_never_aggregates_apart_from_the_same_instant() -> None:
    correlator = Correlator(0.0, names())
    correlator.observe(KEY, 0.0, T0)
    assert correlator.observe(KEY, 0.5, T0).count == 1


# ----- what a failed write means ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "failure"),
    [(None, "retry"), (0, "retry"), (429, "retry"), (500, "retry"), (503, "retry"), (504, "retry"),
     (401, "refused"), (403, "refused"), (400, "rejected"), (404, "rejected"), (409, "rejected"),
     (413, "rejected"), (422, "rejected"), (501, "rejected")],
)  # fmt: skip
def test_failures_are_retried_refused_or_rejected_by_status(status: int | None, failure: str) -> None:
    assert classify_failure(status) == failure


# ----- no Kubernetes client until there is an API to send to ------------------------------------------------


def test_importing_the_recorder_loads_no_kubernetes_client() -> None:
    """The agent's run path must not pay for the Kubernetes client when it has no API (tests/unit/test_imports)."""
    script = "import agent.events, json, sys; print(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    loaded = set(json.loads(result.stdout.splitlines()[-1]))
    assert not {m for m in loaded if m.split(".")[0] in ("kubernetes", "urllib3", "pydantic", "yaml")}
