"""An MPS daemon's death is an event: a pidfd per process, no polling."""

from __future__ import annotations

import queue
import subprocess
import sys

import pytest

from agent.mps.exits import ProcessExited, ProcessExitWatcher

pytestmark = pytest.mark.skipif(not ProcessExitWatcher.supported(), reason="no os.pidfd_open on this system")


@pytest.fixture
def watcher():
    events: queue.Queue[object] = queue.Queue()
    watcher = ProcessExitWatcher(events.put)
    yield watcher, events
    watcher.stop()


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_a_watched_process_that_dies_is_reported_once(watcher) -> None:
    exits, events = watcher
    process = _sleeper()
    assert exits.watch("daemon-a", process.pid)
    process.kill()
    process.wait()
    assert events.get(timeout=5) == ProcessExited("daemon-a", process.pid)
    with pytest.raises(queue.Empty):
        events.get(timeout=0.2)


def test_a_forgotten_process_is_not_reported_and_others_still_are(watcher) -> None:
    exits, events = watcher
    quit_on_purpose, crashing = _sleeper(), _sleeper()
    exits.watch("retired", quit_on_purpose.pid)
    exits.watch("serving", crashing.pid)
    exits.forget("retired")
    quit_on_purpose.kill()
    quit_on_purpose.wait()
    crashing.kill()
    crashing.wait()
    assert events.get(timeout=5) == ProcessExited("serving", crashing.pid)
    with pytest.raises(queue.Empty):
        events.get(timeout=0.2)


def test_a_process_already_gone_is_reported_at_once(watcher) -> None:
    exits, events = watcher
    process = _sleeper()
    process.kill()
    process.wait()
    exits.watch("late", process.pid)
    assert events.get(timeout=5) == ProcessExited("late", process.pid)
