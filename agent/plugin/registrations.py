"""Where each resource stands with the kubelet: one Register per resource per kubelet start.

The kubelet forgets every plugin when it restarts, so each resource registers again, but once: a kubelet that
gets two Registers for one resource holds two streams for it, and up to 1.36 the older one ending disconnects
the newer (the resource goes unavailable). A restart gives the agent several reasons to register within a few
milliseconds — the kubelet deletes the plugin sockets (served again at once), listens on a new ``kubelet.sock``,
and the old kubelet's streams end — and ``Registrations`` makes one Register per resource of them:

- A kubelet is one ``kubelet.sock`` file (device, inode, mtime): a new file is a new kubelet, and every resource
  registers with it once. A watcher saying again that the same file is there costs nothing.
- A reason to register is kept as *due* and weighed when it comes due, not when it is given: a resource
  registered with the kubelet of now is not registered again, whatever asked and however many asked. One
  attempt at a time: reasons that come while it is in flight are weighed after its answer, and it answers
  every reason given before it went out.
- An attempt knows which ``kubelet.sock`` accepted it (the one there when the answer came: only a live kubelet
  accepts): a Register that reached a kubelet before the agent heard of its socket is that kubelet's
  registration, and the kubelet's socket event then costs no second one.
- A plugin socket served again by the same server (its streams carry on) registers only if the resource is not
  registered with the kubelet of now: a restarting kubelet deletes the sockets before it listens, and its new
  ``kubelet.sock`` brings the one Register. A stream the kubelet ended registers again after a moment, unless
  the kubelet watches the resource again by then. A new server for a resource (a new resource, or its server
  started again) registers in any case: the kubelet's stream went with the old server.

The reconcile loop owns the object and calls it from its one thread; the kubelet's answers come back to the loop as
``RegistrationDone`` events, posted from the gRPC loop's thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

from msgspec import Struct, field

from agent.plugin.registration import Answered, register_batch_soon
from agent.plugin.watch import SocketIdentity, socket_identity
from agent.supervise import Backoff

log = logging.getLogger(__name__)

MAX_BACKOFF = 30.0
NO_ANSWER = "no answer from the kubelet"


class RegistrationDone(Struct, frozen=True):
    """The kubelet's answer to one resource's Register."""

    resource: str
    attempt: int  # which attempt (``Registrations`` numbers them): a late answer to an older one is ignored
    error: str | None
    kubelet: SocketIdentity | None = None  # the kubelet.sock that answered, when known


class Served(Protocol):
    """What registration needs of a resource's server (``agent.plugin.server.ResourceServer``)."""

    socket_path: Path

    @property
    def serving(self) -> bool: ...

    @property
    def open_streams(self) -> int: ...

    def socket_present(self) -> bool: ...


Register = Callable[[Path, list[tuple[str, str]], Callable[[Answered], None]], None]


class _Resource(Struct):
    """One resource's standing with the kubelet."""

    due_at: float | None = None  # then: registered unless registered with the kubelet of then
    watch_at: float | None = None  # a stream closed; then: registered again unless the kubelet watches it again
    server: int = 0  # which of the resource's servers serves it now (a new one needs its own Register)
    kubelet: int | None = None  # the kubelet (incarnation) it is registered with, for the server of now
    reached: SocketIdentity | None = None  # the kubelet.sock that registration reached, when known
    in_flight: int = 0  # the attempt being made, 0 if none
    sent_to: int = 0  # the kubelet of now when it was sent
    sent_for: int = 0  # the server it was made for
    backoff: Backoff = field(default_factory=lambda: Backoff(0.5, MAX_BACKOFF))  # its failures in a row
    last_error: str | None = None


class Registrations:
    """Each served resource's registration with the kubelet; the reconcile loop's room for it."""

    def __init__(
        self,
        kubelet_socket: Path,
        post: Callable[[object], None],
        clock: Callable[[], float],
        *,
        register: Register = register_batch_soon,
    ) -> None:
        self._socket = kubelet_socket
        self._post = post
        self._clock = clock
        self._register = register
        self._resources: dict[str, _Resource] = {}
        self._present = False
        self._incarnation = 0  # counts the kubelets seen: a registration is with one of them
        self._identity: SocketIdentity | None = None  # the socket of the kubelet of now, when it could be read
        self._attempts = 0

    @property
    def kubelet_present(self) -> bool:
        return self._present

    # ----- what the loop hears --------------------------------------------------------------------

    def kubelet_up(self) -> int:
        """``kubelet.sock`` appeared or was replaced (a kubelet started), or the watcher says again that it is there:
        every resource whose registration did not reach this ``kubelet.sock`` is due at once. Returns how many.

        The socket is looked at now: of several quick replacements the one there now is the kubelet that counts,
        and a watcher saying again what it said before (it was started again) costs no Register.
        """
        self._present = True
        self._incarnation += 1
        self._identity = socket_identity(self._socket)
        now, due = self._clock(), 0
        for resource in self._resources.values():
            if resource.kubelet is not None and self._identity is not None and resource.reached == self._identity:
                resource.kubelet = self._incarnation  # its Register reached this kubelet already
            else:
                resource.backoff.reset()
                self._want(resource, now)
                due += 1
        return due

    def kubelet_gone(self) -> None:
        """``kubelet.sock`` went away: nothing is registered, and nothing is tried until a kubelet is back."""
        self._present = False

    def server_started(self, name: str) -> None:
        """A new server serves ``name`` (a new resource, or its server started again): it registers, whatever
        the kubelet of now had (its stream was to the old server)."""
        resource = self._resources.setdefault(name, _Resource())
        resource.server += 1
        resource.kubelet = resource.reached = None
        self._want(resource, self._clock())

    def socket_restored(self, name: str) -> None:
        """``name``'s socket was deleted and the same server serves it again: registered only if it is not
        registered with the kubelet of now (the kubelet's stream carries on; a kubelet that starts deletes the
        sockets first, and its own ``kubelet.sock`` brings the Register)."""
        self.want(name, self._clock())

    def want(self, name: str, at: float, *, unless_watched: bool = False) -> None:
        """Register ``name`` at ``at`` unless it is registered with the kubelet then; with ``unless_watched``
        (a stream closed) even if registered, unless the kubelet watches it again by then. A resource no
        longer served is not registered."""
        resource = self._resources.get(name)
        if resource is not None:
            self._want(resource, at, unless_watched=unless_watched)

    def forget(self, name: str) -> None:
        """``name`` is no longer served."""
        self._resources.pop(name, None)

    def on_done(self, done: RegistrationDone) -> None:
        """The kubelet answered one attempt (on the loop, as an event)."""
        resource = self._resources.get(done.resource)
        if resource is None or done.attempt != resource.in_flight:
            return  # the resource went away meanwhile (or came back: this answer is for its former self)
        resource.in_flight = 0
        attempt = resource.backoff.failures + 1
        if done.error is None:
            if resource.sent_for != resource.server:
                return  # it registered a server stopped since: the one of now is due already
            resource.backoff.reset()
            resource.last_error = None
            resource.reached = done.kubelet
            reached_now = self._present and done.kubelet is not None and done.kubelet == self._identity
            resource.kubelet = self._incarnation if reached_now else resource.sent_to
            log.info("registered resource=%s attempt=%d", done.resource, attempt)
            return
        resource.kubelet = resource.reached = None
        delay = resource.backoff.next_delay()
        if done.error != resource.last_error or resource.backoff.failures in (1, 5, 10):
            log.warning(
                "registration failed resource=%s attempt=%d retry_in=%.1fs error=%r",
                done.resource, attempt, delay, done.error,
            )  # fmt: skip
        resource.last_error = done.error
        self._want(resource, self._clock() + delay)

    # ----- what the loop does ---------------------------------------------------------------------

    def start_due(self, servers: Mapping[str, Served]) -> None:
        """Every due registration at once: the kubelet gets them concurrently over one connection, made on the
        gRPC loop (the kubelet dials back inside Register, which can take seconds: the loop does not wait).
        A resource whose socket is missing waits until it is served again (the loop does that first)."""
        if not self._present:
            return
        now = self._clock()
        batch: list[tuple[str, str, int]] = []
        for name, resource in self._resources.items():
            due = resource.due_at is not None and now >= resource.due_at
            check = resource.watch_at is not None and now >= resource.watch_at
            if resource.in_flight or not (due or check):
                continue
            server = servers.get(name)
            if server is None or not server.socket_present():
                continue
            if resource.kubelet == self._incarnation and not (check and server.open_streams == 0):
                if due:  # registered with this kubelet (and watched again, if a stream had closed)
                    resource.due_at = None
                if check:
                    resource.watch_at = None
                continue
            resource.due_at = resource.watch_at = None  # this Register answers every reason given so far
            self._attempts += 1
            resource.in_flight, resource.sent_to, resource.sent_for = self._attempts, self._incarnation, resource.server
            batch.append((name, server.socket_path.name, resource.in_flight))
        if batch:
            endpoints = [(endpoint, name) for name, endpoint, _ in batch]
            self._register(self._socket, endpoints, lambda answered: self._answered(batch, answered))

    def _answered(self, batch: list[tuple[str, str, int]], answered: Answered) -> None:
        """On the gRPC loop's thread: the kubelet's answers go to the reconcile loop."""
        for name, _, attempt in batch:
            self._post(RegistrationDone(name, attempt, answered.answers.get(name, NO_ANSWER), answered.kubelet))

    # ----- what the loop reads --------------------------------------------------------------------

    def registered(self) -> frozenset[str]:
        """The resources registered with the kubelet of now."""
        if not self._present:
            return frozenset()
        return frozenset(name for name, r in self._resources.items() if r.kubelet == self._incarnation)

    def served(self, servers: Mapping[str, Served]) -> bool:
        """The kubelet has what it needs from us: every resource is watched (registered, its ListAndWatch open)
        or failed to register. There is nothing to give an absent kubelet."""
        if not self._present:
            return True
        for name, resource in self._resources.items():
            server = servers.get(name)
            watched = resource.kubelet == self._incarnation and server is not None and server.open_streams > 0
            if not (watched or resource.backoff.failures):
                return False
        return True

    def next_deadline(self, servers: Mapping[str, Served]) -> float | None:
        """When the next registration comes due (None: none can). One waiting for an answer waits for the answer's
        event, one whose server is not serving for the server's retry."""
        if not self._present:
            return None
        return min(
            (
                at
                for name, resource in self._resources.items()
                if not resource.in_flight and (server := servers.get(name)) is not None and server.serving
                for at in (resource.due_at, resource.watch_at)
                if at is not None
            ),
            default=None,
        )

    @staticmethod
    def _want(resource: _Resource, at: float, *, unless_watched: bool = False) -> None:
        """Reasons add up, each kind at its earliest time: however many there are, one Register at most."""
        if unless_watched:
            resource.watch_at = at if resource.watch_at is None else min(resource.watch_at, at)
        else:
            resource.due_at = at if resource.due_at is None else min(resource.due_at, at)
