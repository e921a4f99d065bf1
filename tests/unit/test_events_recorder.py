"""The event recorder without an API server: it logs each event instead, rate-limited and aggregated the same.

The recorder's own thread does the logging; the tests wait for it with ``flush`` (a condition with a deadline).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import pytest

from agent.events import EventRecorder

NODE = "gpu-node-1"
LOGGER = "agent.events"
DEADLINE = 15.0


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def recorders() -> Iterator[list[EventRecorder]]:
    made: list[EventRecorder] = []
    yield made
    for recorder in made:
        recorder.stop()


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    return caplog


def make(recorders: list[EventRecorder], clock: Clock, *, start: bool = True, **options) -> EventRecorder:
    recorder = EventRecorder(None, NODE, clock=clock, **options)
    recorders.append(recorder)
    if start:
        recorder.start()
    return recorder


def flushed(recorder: EventRecorder) -> EventRecorder:
    assert recorder.flush(DEADLINE), "the recorder did not empty its queue in time"
    return recorder


def lines(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


def event_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [line for line in lines(caplog, logging.INFO) if line.startswith("event type=")]


def test_without_an_api_each_event_is_logged_as_one_line(recorders, clock, logs) -> None:
    recorder = make(recorders, clock)
    recorder.emit("Warning", "GPUUnhealthy", "MarkUnhealthy", "GPU 0: XID 79\nsecond line")
    flushed(recorder)
    assert event_lines(logs) == [
        "event type=Warning reason=GPUUnhealthy action=MarkUnhealthy count=1 note='GPU 0: XID 79\\nsecond line'"
    ]
    assert (recorder.logged, recorder.sent, recorder.dropped, recorder.failures) == (1, 0, 0, 0)


def test_a_bad_reason_raises_at_emit_and_nothing_is_recorded(recorders, clock) -> None:
    recorder = make(recorders, clock)
    with pytest.raises(ValueError, match="CamelCase"):
        recorder.emit("Warning", "gpu unhealthy", "MarkUnhealthy", "note")
    with pytest.raises(ValueError, match="action"):
        recorder.emit("Warning", "GPUUnhealthy", "", "note")
    flushed(recorder)
    assert (recorder.logged, recorder.dropped) == (0, 0)


def test_a_repeat_is_logged_with_its_count(recorders, clock, logs) -> None:
    recorder = make(recorders, clock)
    recorder.emit("Normal", "ConfigApplied", "ApplyConfig", "sharing config mps-4")
    clock.now += 60
    recorder.emit("Normal", "ConfigApplied", "ApplyConfig", "sharing config mps-4")
    flushed(recorder)
    assert [line.split(" note=")[0].rsplit(" ", 1)[1] for line in event_lines(logs)] == ["count=1", "count=2"]


def test_repeats_waiting_in_the_queue_become_one_write_with_the_latest_count(recorders, clock, logs) -> None:
    recorder = make(recorders, clock, start=False)
    for _ in range(4):
        recorder.emit("Warning", "MPSDaemonFailing", "StartMPSDaemon", "MPS daemon gpu0 fails to start")
    recorder.start()
    flushed(recorder)
    assert [line.split(" note=")[0].rsplit(" ", 1)[1] for line in event_lines(logs)] == ["count=1", "count=4"]
    assert recorder.dropped == 0


def test_a_burst_beyond_the_bucket_is_dropped_counted_and_warned_once(recorders, clock, logs) -> None:
    recorder = make(recorders, clock, burst=2, refill_seconds=300.0)
    for i in range(5):
        recorder.emit("Warning", "GPUUnhealthy", "MarkUnhealthy", f"GPU {i}: XID 79")
    recorder.emit("Normal", "ConfigApplied", "ApplyConfig", "another reason has its own bucket")
    flushed(recorder)
    assert (recorder.logged, recorder.dropped) == (3, 3)
    warned = lines(logs, logging.WARNING)
    assert len(warned) == 1
    assert "rate-limited reason=GPUUnhealthy burst=2" in warned[0]

    clock.now += 300  # one token back
    recorder.emit("Warning", "GPUUnhealthy", "MarkUnhealthy", "GPU 7: XID 79")
    recorder.emit("Warning", "GPUUnhealthy", "MarkUnhealthy", "GPU 8: XID 79")  # a new streak: warned again
    flushed(recorder)
    assert (recorder.logged, recorder.dropped) == (4, 4)
    assert len(lines(logs, logging.WARNING)) == 2


def test_the_count_keeps_growing_while_rate_limited(recorders, clock, logs) -> None:
    recorder = make(recorders, clock, burst=1, refill_seconds=60.0, aggregate_seconds=600.0)
    for _ in range(3):
        recorder.emit("Warning", "MPSDaemonRestarted", "RestartMPSDaemon", "MPS daemon gpu0 restarted")
    clock.now += 60
    recorder.emit("Warning", "MPSDaemonRestarted", "RestartMPSDaemon", "MPS daemon gpu0 restarted")
    flushed(recorder)
    assert [" count=1 " in line for line in event_lines(logs)] == [True, False]
    assert " count=4 " in event_lines(logs)[1]
    assert recorder.dropped == 2


def test_a_full_queue_drops_the_oldest_and_warns_once(recorders, clock, logs) -> None:
    recorder = make(recorders, clock, start=False, queue_limit=2)
    for i in range(5):
        recorder.emit("Normal", "GPUHealthy", "MarkHealthy", f"GPU {i}: healthy again")
    assert recorder.dropped == 3
    warned = lines(logs, logging.WARNING)
    assert len(warned) == 1 and "queue full limit=2" in warned[0]
    recorder.start()
    flushed(recorder)
    assert [line.rsplit("note=", 1)[1] for line in event_lines(logs)] == [
        "'GPU 3: healthy again'",
        "'GPU 4: healthy again'",
    ]


def test_stop_drops_what_is_unsent_and_returns_at_once(recorders, clock, logs) -> None:
    recorder = make(recorders, clock, start=False)
    for i in range(3):
        recorder.emit("Normal", "GPUHealthy", "MarkHealthy", f"GPU {i}")
    started = time.monotonic()
    recorder.stop(timeout=1.0)
    assert time.monotonic() - started < 1.0
    assert recorder.dropped == 3
    assert any("unsent events dropped count=3" in line for line in lines(logs, logging.DEBUG))


def test_an_idle_recorder_lets_the_moment_pass_before_it_writes(recorders, clock, logs) -> None:
    """What caused an Event (a device turned Unhealthy, on its way to the kubelet) goes before the Event's own
    JSON and HTTP: an idle recorder waits ``send_delay``, then writes everything the moment queued."""
    recorder = make(recorders, clock, send_delay=60.0)
    recorder.emit("Warning", "GPUUnhealthy", "MarkUnhealthy", "GPU 1: XID 79")
    recorder.emit("Normal", "GPUHealthy", "MarkHealthy", "GPU 2")
    assert not recorder.flush(0.3)  # a deadline, not a sleep: still waiting out the moment
    assert recorder.logged == 0
    quick = make(recorders, clock, send_delay=0.01)
    quick.emit("Warning", "GPUUnhealthy", "MarkUnhealthy", "GPU 1: XID 79")
    quick.emit("Normal", "GPUHealthy", "MarkHealthy", "GPU 2")
    assert flushed(quick).logged == 2
    started = time.monotonic()
    recorder.stop(timeout=1.0)  # the wait ends with the recorder
    assert time.monotonic() - started < 1.0
    assert recorder.dropped == 2


def test_an_event_after_stop_goes_to_the_log(recorders, clock, logs) -> None:
    recorder = make(recorders, clock)
    recorder.stop()
    recorder.emit("Warning", "MIGChangeFailed", "ApplyMIGLayout", "the MIG layout could not be applied")
    assert event_lines(logs) == [
        "event type=Warning reason=MIGChangeFailed action=ApplyMIGLayout count=1 "
        "note='the MIG layout could not be applied'"
    ]
    assert recorder.logged == 1


def test_emit_never_raises_what_goes_wrong_inside(recorders, logs) -> None:
    def broken_clock() -> float:
        raise RuntimeError("clock broke")

    recorder = EventRecorder(None, NODE, clock=broken_clock)
    recorders.append(recorder)
    recorder.emit("Normal", "GPUHealthy", "MarkHealthy", "one")
    recorder.emit("Normal", "GPUHealthy", "MarkHealthy", "two")
    warned = lines(logs, logging.WARNING)
    assert len(warned) == 1 and "internal error" in warned[0]


def test_emit_from_many_threads_loses_nothing_it_does_not_count(recorders, clock) -> None:
    recorder = make(recorders, clock, burst=1000, queue_limit=10_000)
    barrier = threading.Barrier(8)

    def emit_many(worker: int) -> None:
        barrier.wait()
        for i in range(100):
            recorder.emit("Normal", f"Worker{worker}", "Work", f"item {i}")

    threads = [threading.Thread(target=emit_many, args=(w,)) for w in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(DEADLINE)
    flushed(recorder)
    assert (recorder.logged, recorder.dropped) == (800, 0)


@pytest.mark.parametrize(
    "options",
    [{"burst": 0}, {"refill_seconds": 0}, {"aggregate_seconds": -1}, {"queue_limit": 0}, {"max_attempts": 0},
     {"node_uid": ""}, {"send_delay": -1}],
)  # fmt: skip
def test_nonsense_settings_are_refused(options: dict) -> None:
    with pytest.raises(ValueError):
        EventRecorder(None, NODE, **options)


def test_a_node_name_that_is_not_one_is_refused() -> None:
    with pytest.raises(ValueError, match="node name"):
        EventRecorder(None, "Not A Node")
