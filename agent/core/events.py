"""Node Events, the pure part: validation, request bodies, aggregation (client-go's correlator), the
kubelet's per-reason token buckets and how a failed write is treated. No threads, no I/O, no Kubernetes
client: ``agent.events`` queues and sends what these decide."""

from __future__ import annotations

import os
import re
from collections import OrderedDict
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Literal

from msgspec import Struct

EventType = Literal["Normal", "Warning"]
EventKey = tuple[str, str, str, str]  # (type, reason, action, note): what makes two emits the same event
Failure = Literal["retry", "refused", "rejected"]

NAMESPACE = "default"  # a Node has no namespace; its Events live in default (kubelet, client-go)
REPORTING_CONTROLLER = "tessera.dev/agent"
NOTE_LIMIT = 1024  # bytes of UTF-8: the API server rejects a longer note
ACTION_LIMIT = 128  # bytes, as the API server counts them
INSTANCE_LIMIT = 128  # reportingInstance (a node name may be longer: it is cut)
NAME_LIMIT = 253  # an Event's name is a DNS subdomain
ELLIPSIS = "…"
SERIES_LIMIT = 4096  # events remembered for aggregation (client-go's cache holds as many)
BUCKET_LIMIT = 256  # reasons with a bucket of their own; full buckets are forgotten first
_REASON = re.compile(r"[A-Z][A-Za-z0-9]{0,127}")


def validate_event(type_: object, reason: object, action: object, note: object) -> None:
    """:class:`ValueError` for what the caller got wrong (a programming error, never the node's)."""
    if type_ not in ("Normal", "Warning"):
        raise ValueError(f"event type must be 'Normal' or 'Warning', got {type_!r}")
    if not isinstance(reason, str) or not _REASON.fullmatch(reason):
        raise ValueError(
            f"event reason must be CamelCase, a capital letter then letters or digits, at most 128 characters "
            f"(like GPUUnhealthy), got {reason!r}"
        )
    if not isinstance(action, str) or not 0 < len(action.encode("utf-8", "replace")) <= ACTION_LIMIT:
        raise ValueError(f"event action must be a non-empty string of at most {ACTION_LIMIT} bytes, got {action!r}")
    if not isinstance(note, str):
        raise ValueError(f"event note must be a string, got {type(note).__name__}")


def truncate_note(note: str, limit: int = NOTE_LIMIT) -> str:
    """``note`` as the API server takes it: at most ``limit`` bytes of UTF-8, cut with "…" (whole characters)."""
    data = note.encode("utf-8", "replace")  # a lone surrogate cannot be sent: it becomes "?"
    if len(data) <= limit:
        return data.decode("utf-8")
    return data[: limit - len(ELLIPSIS.encode())].decode("utf-8", "ignore") + ELLIPSIS


def micro_time(moment: datetime) -> str:
    """A MicroTime: RFC 3339 in UTC with microseconds and Z (``2025-01-01T00:00:00.000000Z``)."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class MicroTime(datetime):
    """A moment that the Kubernetes client writes as a MicroTime.

    Both client generations (31 to 37) write a datetime in a request body with its ``isoformat()``, which gives
    ``+00:00`` and drops a zero fraction, while the API server parses a MicroTime with the layout
    ``2006-01-02T15:04:05.000000Z07:00``: six digits are required. (Client 37 also turns a dict body into its
    model, so a string would be parsed back into a datetime.) This datetime's ``isoformat()`` is the exact
    format client-go writes.
    """

    @classmethod
    def of(cls, moment: datetime) -> MicroTime:
        utc = moment.astimezone(UTC)
        return cls(utc.year, utc.month, utc.day, utc.hour, utc.minute, utc.second, utc.microsecond, tzinfo=UTC)

    def isoformat(self, sep: str = "T", timespec: str = "auto") -> str:
        return micro_time(self)

    def __str__(self) -> str:
        return micro_time(self)


def event_name(node_name: str) -> str:
    """``<node>.<16 hex>``: unique, and a DNS subdomain even for the longest node name."""
    prefix = node_name[: NAME_LIMIT - 17].rstrip(".-")
    return f"{prefix}.{os.urandom(8).hex()}"  # what secrets.token_hex does, without loading hmac and hashlib


class Occurrence(Struct, frozen=True):
    """What one emit becomes: Event ``name``; ``count`` 1 is a new Event, more is the count of its series."""

    name: str
    count: int
    first_seen: datetime  # the Event's eventTime
    last_seen: datetime  # its series' lastObservedTime


class _Series(Struct):
    name: str
    count: int
    first_seen: datetime
    seen_at: float  # the recorder's clock at the last sighting


class Correlator:
    """Aggregation: the same event again within ``window`` seconds of its last sighting joins its series.

    Remembers at most ``limit`` events (least recently seen forgotten first); a forgotten or expired one starts
    a new Event. ``now`` is a monotonic clock's reading, ``wall`` the same moment in UTC.
    """

    def __init__(self, window: float, new_name: Callable[[], str], limit: int = SERIES_LIMIT) -> None:
        self._window = float(window)
        self._new_name = new_name
        self._limit = limit
        self._series: OrderedDict[EventKey, _Series] = OrderedDict()  # least recently seen first

    def __len__(self) -> int:
        return len(self._series)

    def observe(self, key: EventKey, now: float, wall: datetime) -> Occurrence:
        self._expire(now)
        series = self._series.get(key)
        if series is None:
            series = self._series[key] = _Series(self._new_name(), 1, wall, now)
            while len(self._series) > self._limit:
                self._series.popitem(last=False)
        else:
            series.count += 1
            series.seen_at = max(series.seen_at, now)
            self._series.move_to_end(key)
        return Occurrence(series.name, series.count, series.first_seen, wall)

    def _expire(self, now: float) -> None:
        while self._series:
            oldest = next(iter(self._series.values()))
            if now - oldest.seen_at <= self._window:
                return
            self._series.popitem(last=False)


class TokenBucket:
    """``burst`` tokens, one more every ``refill_seconds`` (never above ``burst``); each event takes one."""

    __slots__ = ("_burst", "_refill", "_stamp", "_tokens")

    def __init__(self, burst: int, refill_seconds: float, now: float) -> None:
        self._burst = float(burst)
        self._refill = float(refill_seconds)
        self._tokens = float(burst)
        self._stamp = now

    def take(self, now: float) -> bool:
        self._top_up(now)
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False

    def full(self, now: float) -> bool:
        self._top_up(now)
        return self._tokens >= self._burst

    def _top_up(self, now: float) -> None:
        if now > self._stamp:  # a clock that steps back never takes tokens away, nor gives any
            self._tokens = min(self._burst, self._tokens + (now - self._stamp) / self._refill)
            self._stamp = now


class RateLimiter:
    """The kubelet's spam filter: one :class:`TokenBucket` per key (here: per reason, on this node)."""

    def __init__(self, burst: int, refill_seconds: float, limit: int = BUCKET_LIMIT) -> None:
        self._burst = burst
        self._refill = refill_seconds
        self._limit = limit
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()  # least recently used first

    def allow(self, key: str, now: float) -> bool:
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= self._limit:
                self._forget(now)
            bucket = self._buckets[key] = TokenBucket(self._burst, self._refill, now)
        self._buckets.move_to_end(key)
        return bucket.take(now)

    def _forget(self, now: float) -> None:
        """Room for a new key: forget the full buckets (a fresh one is the same), else the least recently used."""
        for key in [k for k, bucket in self._buckets.items() if bucket.full(now)]:
            del self._buckets[key]
        while len(self._buckets) >= self._limit:
            self._buckets.popitem(last=False)


def classify_failure(status: int | None) -> Failure:
    """How to treat a failed write, by its HTTP status (None: no answer, a network failure).

    ``retry``: the API server is away or busy (network, 0, 429, 5xx but 501); ``refused``: the agent may not
    write Events (401, 403); ``rejected``: the API server will not take this Event (any other status, and 501
    Not Implemented: a server that does not serve the method will not learn it).
    """
    if status is None or status == 0 or status == 429 or (status >= 500 and status != 501):
        return "retry"
    if status in (401, 403):
        return "refused"
    return "rejected"


def regarding(node_name: str, node_uid: str | None) -> dict[str, str]:
    """The Node as an Event's subject; without its UID, its name (as the kubelet does: kubectl looks for both)."""
    return {"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node_uid or node_name}


Regarding = tuple[tuple[str, str], ...]  # another subject than the Node (a ResourceClaim), as sorted (key, value)
_REGARDING_KEYS = frozenset({"apiVersion", "kind", "namespace", "name", "uid"})
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def validate_regarding(subject: object) -> Regarding:
    """A namespaced object as an Event's subject (``apiVersion``, ``kind``, ``namespace``, ``name``, ``uid``, all
    non-empty strings, the namespace a DNS label); ValueError naming what is wrong."""
    if not isinstance(subject, dict) or set(subject) != _REGARDING_KEYS:
        raise ValueError(f"an Event's subject needs exactly {sorted(_REGARDING_KEYS)}, got {subject!r:.200}")
    if not all(isinstance(v, str) and v and len(v) <= 253 for v in subject.values()):
        raise ValueError(f"an Event's subject has an empty or overlong field: {subject!r:.200}")
    if not _DNS_LABEL.fullmatch(subject["namespace"]):
        raise ValueError(f"an Event's subject namespace {subject['namespace']!r:.80} is not a DNS label")
    return tuple(sorted(subject.items()))


def event_body(
    node_name: str,
    node_uid: str | None,
    type_: str,
    reason: str,
    action: str,
    note: str,
    occurrence: Occurrence,
    subject: Regarding | None = None,
) -> dict[str, object]:
    """The ``events.k8s.io/v1`` Event to create (about the Node, or ``subject`` in its namespace); with its series
    when ``occurrence`` is a repeat."""
    about = dict(subject) if subject is not None else regarding(node_name, node_uid)
    body: dict[str, object] = {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": {"name": occurrence.name, "namespace": about.get("namespace", NAMESPACE)},
        "eventTime": MicroTime.of(occurrence.first_seen),
        "reportingController": REPORTING_CONTROLLER,
        "reportingInstance": node_name[:INSTANCE_LIMIT],
        "action": action,
        "reason": reason,
        "regarding": about,
        "note": note,
        "type": type_,
    }
    if occurrence.count > 1:
        body.update(series_patch(occurrence))
    return body


def series_patch(occurrence: Occurrence) -> dict[str, object]:
    """The patch that counts a repeat: what client-go's two-way merge patch of an Event's series comes to."""
    return {"series": {"count": occurrence.count, "lastObservedTime": MicroTime.of(occurrence.last_seen)}}
