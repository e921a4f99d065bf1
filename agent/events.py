"""Kubernetes Events on the agent's Node, recorded the way the kubelet records its own (``kubectl describe node``).

The reconcile loop calls :meth:`EventRecorder.emit`; a thread of the recorder's own sends ``events.k8s.io/v1``
Events to the API server, so the loop never waits for it, and an idle one waits ``SEND_DELAY`` (20 ms) before it
writes, so that what caused the Events (a device turned Unhealthy, sent to the kubelet) is not slowed by their
JSON and HTTP. For the same reason the agent's start holds its Events (``hold_seconds``) until the kubelet is
served (:meth:`EventRecorder.release`). On the way:

- **Aggregation**, as client-go's ``tools/events`` broadcaster does it: the same (type, reason, action, note)
  again within ``aggregate_seconds`` of its last sighting is no new Event but a PATCH of the first one's
  ``series`` (``{count, lastObservedTime}``; count 2 on the first repeat, as the API server requires). A PATCH
  that finds the Event gone (expired, or never written) creates it whole, series included, as client-go does.
  A repeat whose patch is still queued updates that patch: a storm of one event is one write per send.
- **Rate limiting**, as the kubelet's spam filter does it: one token bucket per reason (this recorder speaks
  for one node), ``burst`` tokens refilled one per ``refill_seconds``. An emit without a token is dropped and
  counted; the series count still grows, so the next write carries the true count.
- **Degrading to the log**: without an API, or when the API server refuses (401/403: one warning per streak
  naming the RBAC rule), rejects (other 4xx) or keeps failing (5xx, 429, network: a few attempts with
  backoff), the event is written to the log instead (``event type=... reason=... note=...``) and the recorder
  carries on. Nothing here ends the agent; nothing but the event's own fields is sent or logged.

``kubectl describe node`` finds a Node's events by ``involvedObject.uid``: the Node's UID, or its name, which
is what the kubelet puts there. So ``regarding.uid`` is the Node's UID when known, else its name.

The decisions (validation, note truncation, the token buckets, aggregation, how to treat a failure, the
request bodies) are pure, in :mod:`agent.core.events`, and tested without HTTP; :class:`EventRecorder` only
queues and sends, through the API the agent reached the Node with (:mod:`agent.kube_http`, or the official
client for the kubeconfigs only it speaks): both raise :class:`agent.kube_http.KubeApiError`.
"""

from __future__ import annotations

import logging
import random
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from msgspec import Struct

from agent.config.labels import validate_node_name
from agent.core.events import (
    NAMESPACE,
    Correlator,
    EventKey,
    EventType,
    Failure,
    Occurrence,
    RateLimiter,
    Regarding,
    classify_failure,
    event_body,
    event_name,
    series_patch,
    truncate_note,
    validate_event,
    validate_regarding,
)
from agent.kube_status import status_message

if TYPE_CHECKING:
    from agent.config.node_label import NodeApi

__all__ = ["EventRecorder"]

log = logging.getLogger(__name__)

REQUEST_TIMEOUT = (5.0, 10.0)  # (connect, read) seconds for one write
RETRY_DELAY_MAX = 5.0
_RBAC_RULE = 'ClusterRole rule: apiGroups ["events.k8s.io"], resources [events], verbs [create, patch]'
MAX_MESSAGE = 512  # characters of the API server's message kept for one log line
SEND_DELAY = 0.02  # an idle recorder waits this long before it writes: the moment's urgent work goes first

# ----- the shell: a queue and the thread that sends it -------------------------------------------------


class _Pending(Struct):
    key: EventKey
    occurrence: Occurrence
    subject: Regarding | None = None  # None: the Node

    @property
    def namespace(self) -> str:
        return dict(self.subject).get("namespace", NAMESPACE) if self.subject is not None else NAMESPACE

    @property
    def series(self) -> bool:
        return self.occurrence.count > 1


def _describe(error: BaseException) -> tuple[int | None, str]:
    """The HTTP status of a failed write (None: no answer) and the API server's own message, for one log line.

    Only the Status body's ``message`` is kept: never the response headers nor anything of the request.
    """
    status = getattr(error, "status", None)
    if not isinstance(status, int):
        return None, f"{type(error).__name__}: {str(error)[:MAX_MESSAGE]}"
    message = status_message(error) or str(getattr(error, "reason", None) or "").strip() or "no reason given"
    return status, message[:MAX_MESSAGE]


class EventRecorder:
    """Events on one Node: :meth:`emit` from any thread, a daemon thread sends (see the module's docstring).

    Counters: ``sent`` (writes the API server took), ``dropped`` (rate-limited, pushed out of a full queue, or
    unsent at :meth:`stop`), ``failures`` (writes that failed for good), ``logged`` (events written to the log
    in place of the API).
    """

    def __init__(
        self,
        api: NodeApi | None,
        node_name: str,
        *,
        node_uid: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        burst: int = 25,
        refill_seconds: float = 300.0,
        aggregate_seconds: float = 600.0,
        queue_limit: int = 1000,
        max_attempts: int = 4,
        retry_delay: float = 0.5,
        send_delay: float = SEND_DELAY,
        hold_seconds: float = 0.0,
    ) -> None:
        self._node = validate_node_name(node_name)
        if node_uid is not None and (not isinstance(node_uid, str) or not node_uid):
            raise ValueError(f"node_uid must be a non-empty string or None, got {node_uid!r}")
        if burst < 1 or refill_seconds <= 0 or aggregate_seconds < 0 or queue_limit < 1:
            raise ValueError("burst and queue_limit must be >= 1, refill_seconds > 0 and aggregate_seconds >= 0")
        if max_attempts < 1 or retry_delay < 0 or send_delay < 0 or hold_seconds < 0:
            raise ValueError("max_attempts must be >= 1, retry_delay, send_delay and hold_seconds >= 0")
        self._api = api  # its create_event and patch_event; None: events go to the log
        self._uid = node_uid
        self._clock = clock
        self._burst = burst
        self._refill = float(refill_seconds)
        self._queue_limit = queue_limit
        self._max_attempts = max_attempts
        self._retry_delay = float(retry_delay)
        self._send_delay = float(send_delay)
        self._hold_seconds = float(hold_seconds)  # > 0: nothing is written until release(), or this long
        self._held = self._hold_seconds > 0
        self._correlator = Correlator(aggregate_seconds, lambda: event_name(self._node))
        self._limiter = RateLimiter(burst, refill_seconds)
        self._queue: deque[_Pending] = deque()
        self._queued_series: dict[str, _Pending] = {}  # Event name -> its series patch waiting in the queue
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._in_flight = False
        self._limited: set[str] = set()  # reasons in a rate-limit streak (warned once)
        self._overflowing = False  # in a queue-full streak (warned once)
        self._trouble: str | None = None  # the API failure streak we are in (warned once): refused, failing, ...
        self._internal_warned = False
        self._sent = self._dropped = self._failures = self._logged = 0

    def release(self) -> None:
        """Events held since the start (``hold_seconds``) may be written now."""
        with self._cond:
            self._held = False
            self._cond.notify_all()

    # -- counters

    @property
    def sent(self) -> int:
        return self._sent

    @property
    def dropped(self) -> int:
        return self._dropped

    @property
    def failures(self) -> int:
        return self._failures

    @property
    def logged(self) -> int:
        return self._logged

    # -- lifecycle

    def start(self) -> None:
        """Start the sending thread (once; a stopped recorder stays stopped)."""
        with self._cond:
            if self._thread is not None or self._stopping:
                return
            self._thread = threading.Thread(target=self._run, name=f"event-recorder-{self._node}", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Stop sending: what is still queued is dropped; returns within ``timeout`` even if a write hangs."""
        with self._cond:
            self._stopping = True
            unsent = len(self._queue)
            self._queue.clear()
            self._queued_series.clear()
            self._dropped += unsent
            self._cond.notify_all()
            thread = self._thread
        if unsent:
            log.debug("event recorder stopped; unsent events dropped count=%d", unsent)
        if thread is not None and thread is not threading.current_thread():
            thread.join(max(0.0, timeout))

    def flush(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` seconds) until every queued event is sent or given up; True if so."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._in_flight, timeout=timeout)

    # -- the caller's side

    def emit(
        self, type_: EventType, reason: str, action: str, note: str, *, regarding: Mapping[str, str] | None = None
    ) -> None:
        """Record an event on the Node, or on ``regarding`` (a namespaced object such as a ResourceClaim:
        ``apiVersion``, ``kind``, ``namespace``, ``name``, ``uid``; its Event goes to its namespace). Thread-safe
        and never blocks; raises only :class:`ValueError`, for an invalid type, reason (CamelCase, at most 128
        characters), action (1 to 128 bytes), subject, or a note that is not a string. The note is cut to 1 KiB."""
        validate_event(type_, reason, action, note)
        subject = validate_regarding(dict(regarding)) if regarding is not None else None
        try:
            self._observe((type_, reason, action, truncate_note(note)), subject)
        except Exception:  # a bug here must not reach the reconcile loop
            if not self._internal_warned:
                self._internal_warned = True
                log.warning("event recorder internal error; this event is lost reason=%s", reason, exc_info=True)

    def _observe(self, key: EventKey, subject: Regarding | None = None) -> None:
        """Aggregate, rate-limit and queue under the lock; log (if anything) after it."""
        wall = datetime.now(UTC)
        reason = key[1]
        limited = overflowed = False
        with self._cond:
            stopped = self._stopping
            if stopped:
                self._logged += 1
            else:
                now = self._clock()
                occurrence = self._correlator.observe(key + (subject or ()), now, wall)  # type: ignore[arg-type]
                if self._limiter.allow(reason, now):
                    self._limited.discard(reason)
                    overflowed = self._enqueue(_Pending(key, occurrence, subject))
                else:
                    self._dropped += 1
                    limited = reason not in self._limited  # the first of a streak
                    self._limited.add(reason)
        if stopped:
            self._log_event(_Pending(key, Occurrence("", 1, wall, wall), subject))
        if limited:
            log.warning(
                "events rate-limited reason=%s burst=%d refill_seconds=%g; dropping this reason's events until a "
                "token is free (their repeat count is kept)",
                reason,
                self._burst,
                self._refill,
            )
        if overflowed:
            log.warning(
                "event queue full limit=%d; dropping the oldest unsent events (the API server is slow or away)",
                self._queue_limit,
            )

    def _enqueue(self, item: _Pending) -> bool:
        """Called with the lock held. A repeat whose patch is still queued updates that patch instead.
        True when a full queue starts dropping (the first of a streak)."""
        if item.series:
            queued = self._queued_series.get(item.occurrence.name)
            if queued is not None:
                queued.occurrence = item.occurrence
                return False
        overflow = len(self._queue) >= self._queue_limit
        if overflow:
            oldest = self._queue.popleft()
            if oldest.series:
                self._queued_series.pop(oldest.occurrence.name, None)
            self._dropped += 1
        first = overflow and not self._overflowing
        self._overflowing = overflow
        self._queue.append(item)
        if item.series:
            self._queued_series[item.occurrence.name] = item
        self._cond.notify_all()
        return first

    # -- the sending thread

    def _run(self) -> None:
        events_api = self._api
        with self._cond:  # the start's Events wait until what they are about is done (release), at most that long
            self._cond.wait_for(lambda: self._stopping or not self._held, timeout=self._hold_seconds)
        idle = True  # nothing written since the queue was last empty
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._stopping)
                if idle:  # what the moment was about goes first (a device turned Unhealthy reaches the kubelet's
                    # ListAndWatch), then its Events, whose JSON and HTTP would compete with it
                    self._cond.wait_for(lambda: self._stopping, timeout=self._send_delay)
                if self._stopping:
                    return
                item = self._queue.popleft()
                if item.series:
                    self._queued_series.pop(item.occurrence.name, None)
                self._in_flight = True
            try:
                self._deliver(events_api, item)
            except Exception:  # a bug in this module: logged once, never the end of the thread
                with self._cond:
                    self._failures += 1
                if not self._internal_warned:
                    self._internal_warned = True
                    log.warning("event recorder internal error reason=%s", item.key[1], exc_info=True)
            finally:
                with self._cond:
                    self._in_flight = False
                    idle = not self._queue
                    self._cond.notify_all()

    def _deliver(self, events_api: NodeApi | None, item: _Pending) -> None:
        if events_api is None:
            with self._cond:
                self._logged += 1
            self._log_event(item)
            return
        attempts = 1 if self._trouble == "failing" else self._max_attempts  # while away: no waiting per event
        for attempt in range(1, attempts + 1):
            try:
                self._write(events_api, item)
            except Exception as error:  # whatever the client raises: the API server, the network, or the client
                status, message = _describe(error)
                failure = classify_failure(status) if status is not None or _is_network(error) else "rejected"
                if failure == "retry" and attempt < attempts:
                    log.debug(
                        "writing an Event failed; retrying status=%s error=%r attempt=%d", status, message, attempt
                    )
                    if self._wait_stopping(self._backoff(attempt)):
                        with self._cond:
                            self._dropped += 1  # stopping: this one is dropped with the rest
                        log.debug("event recorder stopped; an event waiting for its retry dropped")
                        return
                    continue
                self._failed(item, failure, status, message, attempt)
                return
            self._succeeded()
            return

    def _write(self, events_api: NodeApi, item: _Pending) -> None:
        from agent.kube_http import KubeApiError

        occurrence = item.occurrence
        if item.series:
            try:
                events_api.patch_event(
                    occurrence.name, item.namespace, series_patch(occurrence), _request_timeout=REQUEST_TIMEOUT
                )
                return
            except KubeApiError as error:
                if error.status != 404:
                    raise
            # the Event to count on is gone (expired, or never written): create it, series and all
        type_, reason, action, note = item.key
        body = event_body(self._node, self._uid, type_, reason, action, note, occurrence, item.subject)
        try:
            events_api.create_event(item.namespace, body, _request_timeout=REQUEST_TIMEOUT)
        except KubeApiError as error:
            if error.status != 409:  # AlreadyExists: an earlier attempt got through, only its answer was lost
                raise

    def _backoff(self, attempt: int) -> float:
        delay = min(RETRY_DELAY_MAX, self._retry_delay * 2 ** (attempt - 1))
        return delay * random.uniform(0.8, 1.0)  # noqa: S311 - jitter, so a fleet of agents does not retry in step

    def _wait_stopping(self, seconds: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._stopping, timeout=seconds)

    def _succeeded(self) -> None:
        with self._cond:
            self._sent += 1
            trouble, self._trouble = self._trouble, None
        if trouble is not None:
            log.info("events reach the API server again after=%s", trouble)

    def _failed(self, item: _Pending, failure: Failure, status: int | None, message: str, attempts: int) -> None:
        streak = "failing" if failure == "retry" else failure if failure == "refused" else f"rejected-{status}"
        with self._cond:
            self._failures += 1
            self._logged += 1
            first, self._trouble = streak != self._trouble, streak
        if first:
            if failure == "refused":
                log.warning(
                    "cannot write Events status=%s error=%r; grant the agent's ServiceAccount create and patch on "
                    "events in API group events.k8s.io (%s); events go to the log meanwhile",
                    status,
                    message,
                    _RBAC_RULE,
                )
            elif failure == "retry":
                log.warning(
                    "cannot write Events: the API server fails or is out of reach status=%s error=%r attempts=%d; "
                    "events go to the log until it answers",
                    status,
                    message,
                    attempts,
                )
            else:
                log.warning(
                    "the API server rejected an Event status=%s error=%r reason=%s; events go to the log",
                    status,
                    message,
                    item.key[1],
                )
        self._log_event(item)

    @staticmethod
    def _log_event(item: _Pending) -> None:
        type_, reason, action, note = item.key
        about = dict(item.subject) if item.subject is not None else None
        regarding = f" regarding={about['kind']}/{about['namespace']}/{about['name']}" if about else ""
        log.info(
            "event type=%s reason=%s action=%s count=%d%s note=%r",
            type_, reason, action, item.occurrence.count, regarding, note,
        )  # fmt: skip


def _is_network(error: BaseException) -> bool:
    """No answer from the API server: the connection failed or timed out (urllib3 and socket errors)."""
    if isinstance(error, OSError):  # the lean client's KubeUnreachable too
        return True
    urllib3 = sys.modules.get("urllib3.exceptions")  # the official client's, when it is the one in use
    return urllib3 is not None and isinstance(error, urllib3.HTTPError)
