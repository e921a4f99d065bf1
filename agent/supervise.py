"""Supervision helpers: worker jobs whose failures always come back as events, and retry backoff.

The reconcile loop hands slow work (MIG changes, MPS daemons, registration) to worker pools. A job that
raises must never vanish into a ``Future`` nobody reads: ``submit`` attaches a callback that posts
``WorkerCrashed`` for any exception that escapes the job, so the owner of the job learns of it, logs it
once and retries.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

from msgspec import Struct


class WorkerCrashed(Struct, frozen=True):
    """A worker job raised: ``owner`` is the pool's owner (``mig``, ``mps``, ``register``), ``key`` its job."""

    owner: str
    key: str
    error: str
    traceback: str = ""


def submit(
    pool: Executor, post: Callable[[object], None], owner: str, key: str, job: Callable[..., Any], *args: Any
) -> Future[Any] | None:
    """Run ``job(*args)`` on ``pool``; anything it raises is posted as ``WorkerCrashed(owner, key, ...)``.

    A pool that is already shut down (the agent is stopping) takes nothing: None.
    """
    try:
        future = pool.submit(job, *args)
    except RuntimeError:  # "cannot schedule new futures after shutdown"
        return None

    def check(done: Future[Any]) -> None:
        if done.cancelled():
            return
        error = done.exception()
        if error is not None:
            trace = "".join(traceback.format_exception(type(error), error, error.__traceback__))
            post(WorkerCrashed(owner, key, f"{type(error).__name__}: {error}", trace))

    future.add_done_callback(check)
    return future


class Backoff(Struct):
    """Delays for a step that keeps failing: ``initial`` doubling up to ``maximum``; ``reset`` on success."""

    initial: float = 0.5
    maximum: float = 30.0
    failures: int = 0

    def next_delay(self) -> float:
        self.failures += 1
        return min(self.maximum, self.initial * 2 ** (self.failures - 1))

    def reset(self) -> None:
        self.failures = 0
