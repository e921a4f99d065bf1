"""Watch streams: what events one watch sends, independent of HTTP.

* ``resourceVersion`` unset or ``"0"``: a synthetic ``ADDED`` for every matching object, then every later change.
* ``resourceVersion=N``: every kept change after N, then later ones; N older than the kept history → one ``ERROR``
  event carrying a 410 ``Expired`` Status ("too old resource version"), as the watch cache answers.
* Selectors filter as the server does: a MODIFIED object that starts matching arrives as ``ADDED``, one that stops
  matching as ``DELETED``.
* The stream ends at ``timeoutSeconds`` (default 1800 s, the server's minimum request timeout), on
  ``close_watches()``, on shutdown, when the client goes away, and when the history was compacted past the point the
  stream had reached (a watcher that fell behind; the client's re-watch then gets 410). With
  ``allowWatchBookmarks=true`` a ``BOOKMARK`` with the current resourceVersion is sent before a timeout ends it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from msgspec import Struct

from agent.sim.apiserver.errors import status_body
from agent.sim.apiserver.kinds import Kind
from agent.sim.apiserver.selectors import FieldSelector, LabelSelector
from agent.sim.apiserver.store import Event, Store

DEFAULT_TIMEOUT = 1800.0
_POLL = 0.25  # how often a quiet stream checks whether its client went away


class WatchRequest(Struct):
    kind: Kind
    namespace: str | None
    fields: FieldSelector
    labels: LabelSelector
    resource_version: str | None
    timeout: float = DEFAULT_TIMEOUT
    bookmarks: bool = False

    def matches(self, obj: dict | None) -> bool:
        if obj is None:
            return False
        if self.namespace and (obj.get("metadata") or {}).get("namespace") != self.namespace:
            return False
        return self.fields.matches(obj) and self.labels.matches(obj)

    def translate(self, event: Event) -> tuple[str, dict] | None:
        if event.kind is not self.kind:
            return None
        now_matches = self.matches(event.object)
        if event.type == "ADDED":
            return ("ADDED", event.object) if now_matches else None
        if event.type == "DELETED":
            return ("DELETED", event.object) if now_matches else None
        was_matching = self.matches(event.previous)
        if was_matching and now_matches:
            return "MODIFIED", event.object
        if now_matches:
            return "ADDED", event.object
        if was_matching:
            return "DELETED", event.object
        return None


def stream(
    store: Store,
    request: WatchRequest,
    send: Callable[[dict], None],
    client_gone: Callable[[], bool],
    on_open: Callable[[int], None] = lambda code: None,
) -> None:
    """Send the watch's events with ``send`` until it ends (see the module doc). ``on_open(200)`` runs once the
    initial events are out, ``on_open(410)`` just before the ERROR event of a too old resourceVersion."""
    end = time.monotonic() + request.timeout
    with store.cond:
        generation = store.close_generation
        rv = request.resource_version
        if rv in (None, "", "0"):
            items, since = store.list(request.kind, request.namespace)
            initial = [{"type": "ADDED", "object": o} for o in items if request.matches(o)]
        else:
            try:
                since = int(rv)
            except ValueError:
                since = -1
            if since < store.horizon:
                message = f"too old resource version: {rv} ({store.horizon})"
                on_open(410)
                send({"type": "ERROR", "object": status_body(410, message, "Expired")})
                return
            initial = []
    for event in initial:
        send(event)
    on_open(200)

    def ready() -> bool:
        return store.closing or store.close_generation != generation or store.rv > since

    while True:
        with store.cond:
            store.cond.wait_for(ready, timeout=max(0.0, min(_POLL, end - time.monotonic())))
            if since < store.horizon:  # compacted past what this stream had sent: the real server drops it
                return
            events = store.events_after(since)
            since = store.rv
            closed = store.closing or store.close_generation != generation
            timed_out = time.monotonic() >= end
        if client_gone():
            return
        for event in events:
            translated = request.translate(event)
            if translated is not None:
                send({"type": translated[0], "object": translated[1]})
        if closed:
            return
        if timed_out:
            if request.bookmarks:
                bookmark = {"kind": request.kind.kind, "apiVersion": request.kind.api_version}
                send({"type": "BOOKMARK", "object": {**bookmark, "metadata": {"resourceVersion": str(since)}}})
            return
