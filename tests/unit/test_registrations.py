"""One Register per resource per kubelet start (``agent.plugin.registrations``), in every order the reasons come in.

A kubelet restart gives the agent several reasons to register within milliseconds: its plugin sockets are deleted
(served again at once), a new ``kubelet.sock`` appears, the old kubelet's streams end; a Register may be in flight
when the next reason comes. Each test plays one order through ``Registrations`` the way the reconcile loop drives
it, with real ``kubelet.sock`` files (a kubelet is the file it listens on) and the kubelet's answers given by the
test, and counts the Registers sent.
"""

from __future__ import annotations

import os
import socket
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from agent.plugin.registration import Answered
from agent.plugin.registrations import RegistrationDone, Registrations
from agent.plugin.watch import SocketIdentity, socket_identity

GPU, MIG = "nvidia.com/gpu", "nvidia.com/mig-1g.10gb"
REFUSED = "kubelet refused the registration: UNAVAILABLE: connect failed"


@dataclass
class Server:
    """What registration reads of a resource server."""

    socket_path: Path
    serving: bool = True
    open_streams: int = 0
    present: bool = True

    def socket_present(self) -> bool:
        return self.present


class Node:
    """A kubelet (its ``kubelet.sock``), the resource servers and the loop's side of ``Registrations``."""

    def __init__(self, directory: Path, resources: tuple[str, ...] = (GPU, MIG)) -> None:
        self.socket = directory / "kubelet.sock"
        self.now = 100.0
        self.posted: list[RegistrationDone] = []
        self.calls: list[tuple[list[tuple[str, str]], Callable[[Answered], None]]] = []
        self.sent: Counter[str] = Counter()
        self.starts = 0
        self.registrations = Registrations(self.socket, self.posted.append, lambda: self.now, register=self._register)
        self.servers = {name: Server(directory / f"{name.replace('/', '-')}.sock") for name in resources}
        for name in resources:
            self.registrations.server_started(name)

    def _register(self, socket_path: Path, endpoints: list[tuple[str, str]], answered: Callable[[Answered], None]):
        assert socket_path == self.socket
        self.calls.append((endpoints, answered))
        self.sent.update(resource for _, resource in endpoints)

    def start_kubelet(self) -> SocketIdentity:
        """A kubelet (re)starts: a new ``kubelet.sock`` (the agent has not heard of it yet). Its mtime is set apart
        from the last one's: a new socket on a reused inode within one clock tick would look the same."""
        self.socket.unlink(missing_ok=True)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listening:
            listening.bind(str(self.socket))
        self.starts += 1
        os.utime(self.socket, ns=(self.starts * 10**9, self.starts * 10**9))
        identity = socket_identity(self.socket)
        assert identity is not None
        return identity

    def tick(self, seconds: float = 0.0) -> None:
        self.now += seconds
        self.registrations.start_due(self.servers)

    def answer(self, kubelet: SocketIdentity | None, error: str | None = None) -> None:
        """The kubelet answers the oldest batch not answered yet; the answers reach the loop as events."""
        endpoints, answered = self.calls.pop(0)
        answered(Answered({resource: error for _, resource in endpoints}, kubelet))
        events, self.posted[:] = list(self.posted), []
        for event in events:
            self.registrations.on_done(event)

    def registered_with(self, kubelet: SocketIdentity) -> None:
        """Every resource registered with the kubelet listening on ``kubelet`` (and watched by it)."""
        self.tick()
        self.answer(kubelet)
        for server in self.servers.values():
            server.open_streams = 1
        assert self.registrations.registered() == set(self.servers)

    def restart_kubelet_deleting_sockets(self) -> SocketIdentity:
        """The kubelet dies (its streams end) and starts again: it deletes every plugin socket, then listens on a
        new kubelet.sock."""
        for server in self.servers.values():
            server.open_streams, server.present = 0, False
        return self.start_kubelet()

    def sockets_served_again(self) -> None:
        for name, server in self.servers.items():
            server.present = True
            self.registrations.socket_restored(name)


@pytest.fixture
def node(tmp_path: Path) -> Node:
    node = Node(tmp_path)
    first = node.start_kubelet()
    assert node.registrations.kubelet_up() == 2
    node.registered_with(first)
    node.sent.clear()
    return node


def test_sockets_deleted_then_a_new_kubelet_sock_one_register_each(node: Node) -> None:
    """The kubelet's own order: the agent serves its sockets again before it hears of the new kubelet.sock."""
    new = node.restart_kubelet_deleting_sockets()
    node.sockets_served_again()
    node.tick()
    assert not node.sent  # the streams carry on with the kubelet the agent knows: nothing to register yet
    assert node.registrations.kubelet_up() == 2
    node.tick()
    node.answer(new)
    node.tick(60)
    assert node.sent == {GPU: 1, MIG: 1}
    assert node.registrations.registered() == {GPU, MIG}


def test_the_new_kubelet_sock_first_then_the_sockets_deleted_one_register_each(node: Node) -> None:
    new = node.start_kubelet()
    node.registrations.kubelet_up()
    node.tick()
    node.answer(new)
    for server in node.servers.values():
        server.present = False  # the deletion seen late: the registration is done, the stream open
        server.open_streams = 1
    node.sockets_served_again()
    node.tick(60)
    assert node.sent == {GPU: 1, MIG: 1}


def test_a_due_register_waits_until_its_socket_is_served_again(node: Node) -> None:
    new = node.restart_kubelet_deleting_sockets()
    node.registrations.kubelet_up()
    node.tick()
    assert not node.sent  # the kubelet would dial a socket that is not there
    node.sockets_served_again()
    node.tick()
    node.answer(new)
    node.tick(60)
    assert node.sent == {GPU: 1, MIG: 1}


def test_a_register_that_reached_the_new_kubelet_before_its_event_counts_for_it(node: Node) -> None:
    """A Register already due (here: one the dead kubelet refused) goes out when the new kubelet listens, before
    the agent hears of its kubelet.sock: the kubelet.sock event then costs no second one."""
    node.start_kubelet()  # a dead kubelet's socket: nobody listens
    node.registrations.kubelet_up()
    node.tick()
    node.answer(socket_identity(node.socket), error=REFUSED)
    new = node.restart_kubelet_deleting_sockets()
    node.sockets_served_again()
    node.tick(0.5)  # the retry after the refusal: it reaches the new kubelet
    node.answer(new)
    assert node.registrations.kubelet_up() == 0
    node.tick(60)
    assert node.sent == {GPU: 2, MIG: 2}  # the refused one and the one the new kubelet took
    assert node.registrations.registered() == {GPU, MIG}


def test_a_register_in_flight_when_the_new_kubelet_is_heard_of_counts_for_it(node: Node) -> None:
    node.start_kubelet()
    node.registrations.kubelet_up()
    node.tick()
    node.answer(socket_identity(node.socket), error=REFUSED)
    new = node.restart_kubelet_deleting_sockets()
    node.sockets_served_again()
    node.tick(0.5)  # sent; the new kubelet is heard of while it is in flight
    assert node.registrations.kubelet_up() == 2
    node.tick()
    assert node.sent == {GPU: 2, MIG: 2}  # one attempt at a time
    node.answer(new)
    node.tick(60)
    assert node.sent == {GPU: 2, MIG: 2}
    assert node.registrations.registered() == {GPU, MIG}


def test_reasons_that_come_while_a_register_is_in_flight_send_no_second_one(node: Node) -> None:
    new = node.restart_kubelet_deleting_sockets()
    node.registrations.kubelet_up()
    node.sockets_served_again()
    node.tick()
    for name in node.servers:  # the old kubelet's streams are seen closed only now, and the sockets again
        node.registrations.want(name, node.now + 0.2, unless_watched=True)
        node.registrations.socket_restored(name)
    node.answer(new)
    for server in node.servers.values():
        server.open_streams = 1  # the new kubelet watches
    node.tick(0.2)
    node.tick(60)
    assert node.sent == {GPU: 1, MIG: 1}


def test_a_stream_the_kubelet_ends_registers_again_once_unless_it_watches_again(node: Node) -> None:
    gpu = node.servers[GPU]
    gpu.open_streams = 0  # the kubelet ended the stream and did not come back
    node.registrations.want(GPU, node.now + 0.25, unless_watched=True)
    node.registrations.socket_restored(GPU)  # a reason that alone would not register (it is registered)
    node.tick(0.125)
    assert not node.sent  # a restarting kubelet gets a moment
    node.tick(0.125)
    node.answer(socket_identity(node.socket))
    node.tick(60)
    assert node.sent == {GPU: 1}
    node.servers[MIG].open_streams = 0  # ended, and watched again by the time it is weighed
    node.registrations.want(MIG, node.now + 0.2, unless_watched=True)
    node.servers[MIG].open_streams = 1
    node.tick(0.2)
    assert node.sent == {GPU: 1}


def test_a_stream_closed_before_the_new_kubelet_is_answered_by_its_register(node: Node) -> None:
    """The old kubelet's streams end, the new kubelet comes within the moment given to a closed stream: its one
    Register answers them, though the kubelet has not opened its ListAndWatch yet when the moment is over. A stream
    that ends after that Register went out is weighed on its own."""
    for name, server in node.servers.items():
        server.open_streams = 0
        node.registrations.want(name, node.now + 0.25, unless_watched=True)
    new = node.start_kubelet()
    node.registrations.kubelet_up()
    node.tick(0.125)
    node.answer(new)
    node.tick(0.125)
    assert node.sent == {GPU: 1, MIG: 1}
    node.registrations.want(GPU, node.now + 0.25, unless_watched=True)  # the new kubelet drops the stream
    node.tick(0.25)
    assert node.sent == {GPU: 2, MIG: 1}


def test_the_watcher_saying_again_that_the_kubelet_is_there_costs_no_register(node: Node) -> None:
    assert node.registrations.kubelet_up() == 0  # the same kubelet.sock (a watcher started again)
    node.tick(60)
    assert not node.sent
    assert node.registrations.registered() == {GPU, MIG}


def test_a_new_server_registers_even_with_the_kubelet_of_now(node: Node) -> None:
    """A server started again (its socket could not be restored): the kubelet's stream went with the old one. An
    answer for the old server, in flight meanwhile, does not count for the new one."""
    node.registrations.server_started(GPU)
    node.tick()
    node.registrations.server_started(GPU)  # started again while the first Register is in flight
    node.answer(socket_identity(node.socket))
    assert node.registrations.registered() == {MIG}
    node.tick()
    node.answer(socket_identity(node.socket))
    node.tick(60)
    assert node.sent == {GPU: 2}
    assert node.registrations.registered() == {GPU, MIG}


def test_a_refused_register_is_retried_with_backoff_and_at_once_with_a_new_kubelet(node: Node) -> None:
    registrations = node.registrations
    registrations.server_started(GPU)
    node.tick()
    node.answer(socket_identity(node.socket), error=REFUSED)
    assert registrations.next_deadline(node.servers) == node.now + 0.5
    node.tick(0.4)
    assert node.sent == {GPU: 1}
    node.tick(0.1)
    node.answer(socket_identity(node.socket), error=REFUSED)
    assert registrations.next_deadline(node.servers) == node.now + 1.0
    assert node.sent == {GPU: 2}
    registrations.kubelet_gone()
    assert registrations.next_deadline(node.servers) is None and registrations.registered() == set()
    node.tick(5)
    assert node.sent == {GPU: 2}  # nothing is tried while no kubelet is there
    new = node.start_kubelet()
    assert registrations.kubelet_up() == 2
    assert registrations.next_deadline(node.servers) <= node.now  # due at once
    node.tick()
    node.answer(new)
    assert node.sent == {GPU: 3, MIG: 1}
    assert registrations.registered() == {GPU, MIG}


def test_an_answer_for_a_resource_removed_meanwhile_is_ignored(node: Node) -> None:
    node.registrations.server_started(GPU)
    node.tick()
    node.registrations.forget(GPU)
    node.registrations.server_started(GPU)  # offered again, and registering, before the first answer came
    node.tick()
    node.answer(socket_identity(node.socket), error=REFUSED)  # the first answer: for its former self
    node.tick(0.5)
    assert node.sent == {GPU: 2}  # the new attempt is still in flight: no retry
    node.answer(socket_identity(node.socket))
    assert node.registrations.registered() == {GPU, MIG}
    node.registrations.forget(MIG)
    node.registrations.want(MIG, node.now, unless_watched=True)  # a stream of a removed resource closed
    node.tick(60)
    assert node.sent == {GPU: 2} and node.registrations.registered() == {GPU}


def test_served_once_every_resource_is_watched_or_failed(tmp_path: Path) -> None:
    node = Node(tmp_path)
    assert node.registrations.served(node.servers)  # no kubelet: nothing to give it
    kubelet = node.start_kubelet()
    node.registrations.kubelet_up()
    assert not node.registrations.served(node.servers)
    node.tick()
    node.answer(kubelet)
    assert not node.registrations.served(node.servers)  # registered, not watched yet
    node.servers[GPU].open_streams = 1
    node.registrations.server_started(MIG)
    node.tick()
    node.answer(kubelet, error=REFUSED)
    assert node.registrations.served(node.servers)  # watched, or failed to register
