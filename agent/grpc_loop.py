"""One asyncio event loop, in one thread, for every gRPC server the agent runs.

Why one loop and ``grpc.aio``: grpcio's thread-pool server keeps a thread per server that wakes five to eight
times a second to look for signals (its completion queue is polled with a 200 ms deadline), so an idle
agent serving eight resources spent ~0.24 % of a core in gRPC alone; ``grpc.aio`` servers wait on their
completion queue without a deadline, and all of them together cost what gRPC core's own threads cost
(~0.03 %), however many resources are served. Latency is the same (``tests/bench/bench_grpc_models.py``).

The rules that come with it: a ``grpc.aio`` server is created and stopped on the loop (``run``); state the
reconcile thread hands over reaches the loop through ``call_soon``; handlers run on the loop thread, so they
do only CPU work that takes microseconds and never block.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class GrpcLoop:
    """The loop starts with its first use and runs until the process ends (a daemon thread, idle in
    ``epoll_wait`` while nothing happens)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._pending: set[Future[Any]] = set()  # submitted coroutines, referenced until they are done

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coroutine`` on the loop and wait for its result (its exception is raised here)."""
        loop = self._started()
        if threading.current_thread() is self._thread:
            coroutine.close()
            raise RuntimeError("GrpcLoop.run called on the loop's own thread: it would wait for itself")
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result(timeout)

    def submit(self, coroutine: Coroutine[Any, Any, object]) -> None:
        """Run ``coroutine`` on the loop, from any thread, without waiting for it: it handles its own outcome
        (what it raises is lost)."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self._started())
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)

    def call_soon(self, callback: Callable[..., object], *args: object) -> None:
        """Run ``callback(*args)`` on the loop, from any thread, without waiting."""
        self._started().call_soon_threadsafe(callback, *args)

    def _started(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="grpc-loop", daemon=True)
                thread.start()
                self._loop, self._thread = loop, thread
            return self._loop


_LOOP = GrpcLoop()


def grpc_loop() -> GrpcLoop:
    """The process's gRPC loop."""
    return _LOOP
