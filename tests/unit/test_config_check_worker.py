"""The config check worker (agent.config.check_worker) on its own: what the agent's loop is sent, and when.

What a user would notice through the agent: a check is not restarted (nor its answer delayed) by a request for
files that have not changed, and a failure nobody foresaw in the worker is reported and does not stop later
config changes from being checked.
"""

from __future__ import annotations

import queue
import sys
from pathlib import Path

import pytest

from agent.config.check_worker import CheckWorker, ConfigChecked
from agent.config.model import ConfigError
from agent.supervise import WorkerCrashed

pytestmark = pytest.mark.timeout(60)


def _next(events: queue.Queue[object], timeout: float = 20.0) -> object:
    return events.get(timeout=timeout)


def test_a_request_for_unchanged_files_does_not_restart_the_check(tmp_path: Path) -> None:
    events: queue.Queue[object] = queue.Queue()
    slow = [sys.executable, "-c", "import sys, time; time.sleep(0.5); sys.exit(4)"]
    worker = CheckWorker(events.put, command=slow)
    try:
        worker.request(tmp_path, "stamp-1")
        worker.request(tmp_path, "stamp-1")  # the same files, asked again while they are being checked
        answer = _next(events)
        assert isinstance(answer, ConfigChecked) and answer.generation == 1 == worker.generation
        with pytest.raises(ConfigError, match="exit code 4"):  # the child ran to its end: it was not restarted
            answer.check.result()
        worker.request(tmp_path, "stamp-2")  # changed files are checked again
        answer = _next(events)
        assert isinstance(answer, ConfigChecked) and answer.generation == 2
    finally:
        worker.stop(timeout=10)
    assert events.empty()


def test_an_unforeseen_failure_is_reported_and_the_next_change_is_still_checked(tmp_path: Path) -> None:
    events: queue.Queue[object] = queue.Queue()
    worker = CheckWorker(events.put, command=["no\0such-interpreter"])  # Popen raises ValueError, not OSError
    try:
        worker.request(tmp_path, "stamp-1")
        crashed = _next(events)
        assert isinstance(crashed, WorkerCrashed) and "ValueError" in crashed.error and crashed.owner == "config"
        assert worker.alive()
        worker.request(tmp_path, "stamp-1")  # the same files again: tried again, not taken as in hand
        assert isinstance(_next(events), WorkerCrashed)
    finally:
        worker.stop(timeout=10)
    assert not worker.alive()
