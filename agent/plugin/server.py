"""One kubelet device-plugin gRPC server per resource, on its own unix socket.

The server holds the resource's current ``ResourceSnapshot``; the reconcile loop replaces it with
``update``. ``ListAndWatch`` sends the full device list at once and again whenever the listing changes.
Handlers are read-only: a bad request gets ``INVALID_ARGUMENT`` with a message and changes nothing.

The hot path does only what a request needs. Everything that depends on the snapshot alone (the serialized
ListAndWatch message, the allocator's per-device answers, the preferred-allocation layout) is worked out
once per snapshot (``_Served``: the message when it is handed over, the allocator once the kubelet has the
message); a handler reads the current ``_Served`` once and answers from it. Constant answers (options,
PreStartContainer) are pre-serialized bytes. Requests and answers are read and written by ``agent.plugin.wire``,
without the protobuf runtime.

Server model: ``grpc.aio``, every resource's server on the agent's one gRPC loop (``agent.grpc_loop``). Allocate
costs the same as on grpcio's thread-pool server, but an idle thread-pool server wakes five to eight times a
second and an aio server not at all (``tests/bench/bench_grpc_models.py``). The reconcile thread hands a
snapshot over with a plain attribute write (handlers read it once per call) and wakes the streams through
the loop; the handlers run on the loop thread and never block.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from agent.core.allocation import AllocationError, Allocator, MpsClient
from agent.core.preferred import PreferenceError, preferred
from agent.core.snapshot import ResourceSnapshot
from agent.grpc_loop import GrpcLoop, grpc_loop
from agent.plugin import wire
from agent.plugin.lock import LOCK_DIRECTORY
from agent.plugin.names import socket_name

log = logging.getLogger(__name__)

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
SOCKET_MODE = 0o600
MAX_SOCKET_PATH = 107  # sun_path is 108 bytes with the terminating NUL
SERVICE = "v1beta1.DevicePlugin"
# ``stop`` first ends every ListAndWatch stream itself (a clean end of stream, within a millisecond), so
# this only bounds how long that may take and a handler that is somehow still running.
STOP_GRACE = 0.1
SEND_WAIT = 0.05  # send_updates waits at most this long for the gRPC loop (it takes well under a millisecond)


PLUGIN_OPTIONS = wire.device_plugin_options(pre_start_required=False, get_preferred_allocation_available=True)
Entry = tuple[str, bool, int | None]  # a device as ListAndWatch lists it: ID, healthy, NUMA node
_EMPTY = b""  # PreStartContainerResponse has no fields


class _Served:
    """A snapshot and what the handlers derive from it, worked out once when it is handed over.

    The serialized listing is built at once (the kubelet is about to be sent it); the allocator's per-device
    answers only when first asked for (``prepare`` after the listing went out, or the first Allocate), so a
    device turning Unhealthy reaches the kubelet without waiting for them."""

    __slots__ = ("_allocator", "entries", "list_and_watch", "snapshot")

    def __init__(self, snapshot: ResourceSnapshot, list_and_watch: bytes, entries: Mapping[Entry, bytes]) -> None:
        self.snapshot = snapshot
        self.list_and_watch = list_and_watch  # the serialized ListAndWatchResponse; the same object while the
        self.entries = entries  # listing is unchanged; each device's part of it, kept for the next snapshot
        self._allocator: Allocator | None = None

    @classmethod
    def of(cls, snapshot: ResourceSnapshot, previous: _Served | None = None) -> _Served:
        listing = snapshot.listing()
        if previous is not None and previous.snapshot.listing() == listing:
            message, entries = previous.list_and_watch, previous.entries
        else:  # only the devices that changed (health, a new device) are serialized again
            known = previous.entries if previous is not None else {}
            entries = {entry: known.get(entry) or _device_entry(*entry) for entry in listing}
            message = b"".join(entries.values())
        return cls(snapshot, message, entries)

    @property
    def allocator(self) -> Allocator:
        """Built from this snapshot alone, so two threads building it at once build the same (one attribute
        write each): the reconcile thread in ``prepare``, the gRPC loop in a handler."""
        allocator = self._allocator
        if allocator is None:
            allocator = self._allocator = _allocator_of(self.snapshot)
        return allocator


def _allocator_of(snapshot: ResourceSnapshot) -> Allocator:
    options = snapshot.options
    mps = MpsClient(options.mps_root, snapshot.mps, snapshot.replicas) if snapshot.mps is not None else None
    return Allocator.of(
        snapshot.name,
        snapshot.devices,
        snapshot.health,
        options.strategies,
        cdi_kind=options.cdi_kind,
        mps=mps,
        fail_requests_greater_than_one=snapshot.fail_requests_greater_than_one,
        memory=snapshot.memory,
        replicas=snapshot.replicas,
        memory_envs=options.memory_envs,
        cdi_unavailable=options.cdi_unavailable,
    )


def _device_entry(device_id: str, healthy: bool, numa_node: int | None) -> bytes:
    """One device as a ListAndWatchResponse of its own: the devices' entries joined in order are the
    serialized response for all of them."""
    return wire.list_and_watch_device(device_id, HEALTHY if healthy else UNHEALTHY, numa_node)


class ResourceServer:
    """Serves ``v1beta1.DevicePlugin`` for one resource on ``<socket_dir>/<socket name>``."""

    def __init__(
        self,
        snapshot: ResourceSnapshot,
        socket_dir: Path,
        *,
        on_stream_closed: Callable[[str], None] = lambda resource: None,
        on_stream_opened: Callable[[str], None] = lambda resource: None,
        loop: GrpcLoop | None = None,
        latency: Any = None,
        on_allocate: Callable[[list[str]], None] | None = None,
    ) -> None:
        """``latency`` (``agent.telemetry.latency.OperationLatency``) times each Allocate and GetPreferredAllocation
        call, as the kubelet's ``kubelet_device_plugin_alloc_duration_seconds`` does from its side. ``on_allocate``
        hears the device IDs of each Allocate call before its snapshot is read (``DeviceLedger.note_allocated``)."""
        self.resource = snapshot.name
        self.latency = latency
        self.on_allocate = on_allocate
        self.socket_path = socket_dir / socket_name(snapshot.name)
        self._served = _Served.of(snapshot)
        self._loop = loop or grpc_loop()
        # Loop-thread state: the event streams wait on (replaced at each wake-up), the streams being served.
        self._wakeup = asyncio.Event()
        self._stopping = False
        self._open_streams = 0
        self._written: dict[object, bytes | None] = {}  # per open stream: the last listing gRPC has written
        self._progress = asyncio.Event()  # set (and replaced) when a stream has written or ended
        self._on_stream_closed = on_stream_closed
        self._on_stream_opened = on_stream_opened
        self._server: grpc.aio.Server | None = None
        self._socket_inode: int | None = None
        # A second name for the listening socket, in the directory the kubelet's clean-up never touches.
        self._standby = socket_dir / LOCK_DIRECTORY / self.socket_path.name
        self._standby_linked = False

    @property
    def snapshot(self) -> ResourceSnapshot:
        return self._served.snapshot

    def start(self) -> None:
        """Serve on a fresh socket (a stale one of ours is removed first)."""
        if len(os.fsencode(self.socket_path)) > MAX_SOCKET_PATH:
            raise OSError(
                f"cannot listen on {self.socket_path}: longer than {MAX_SOCKET_PATH} bytes (unix socket limit)"
            )
        self.socket_path.unlink(missing_ok=True)
        self._loop.run(self._start())
        self.socket_path.chmod(SOCKET_MODE)
        self._socket_inode = self.socket_path.stat().st_ino
        self._link_standby()
        log.info(
            "serving resource=%s socket=%s devices=%d", self.resource, self.socket_path, len(self.snapshot.devices)
        )

    async def _start(self) -> None:
        server = grpc.aio.server()
        handlers = self.method_handlers()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        server.add_registered_method_handlers(SERVICE, handlers)
        try:
            bound = server.add_insecure_port(f"unix://{self.socket_path}")
        except RuntimeError:  # grpcio raises when it cannot bind (older releases returned 0)
            bound = 0
        if bound == 0:
            raise OSError(f"cannot listen on {self.socket_path}")
        await server.start()
        self._stopping, self._server = False, server

    def method_handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        """``v1beta1.DevicePlugin``'s methods, by name, answering from this server's current snapshot."""
        return _DevicePluginHandlers(self).method_handlers()

    @property
    def serving(self) -> bool:
        """True from a successful ``start`` until ``stop``."""
        return self._server is not None

    def socket_present(self) -> bool:
        """False once our socket file is gone or replaced (the kubelet deletes plugin sockets on restart)."""
        try:
            info = self.socket_path.stat()
        except FileNotFoundError:
            return False
        return stat.S_ISSOCK(info.st_mode) and info.st_ino == self._socket_inode

    def restore_socket(self) -> bool:
        """Serve again after the socket file was deleted (the kubelet deletes plugin sockets when it restarts),
        without a new gRPC server: the listening socket is still open, so its standby name is linked back
        (tens of microseconds, where stopping and starting a server takes milliseconds). Streams carry on.
        False when that cannot be done (not serving, no standby name, the path is taken): then stop this
        server and start a new one.
        """
        if self._server is None or not self._standby_linked:
            return False
        if self.socket_present():
            return True
        try:
            if self._standby.stat().st_ino != self._socket_inode:
                return False
            os.link(self._standby, self.socket_path)
        except OSError as error:
            log.warning("cannot restore the plugin socket socket=%s error=%r", self.socket_path, str(error))
            return False
        log.info("plugin socket restored resource=%s socket=%s", self.resource, self.socket_path)
        return self.socket_present()

    def _link_standby(self) -> None:
        """Give the listening socket its standby name (``.tessera/<socket name>``, next to the agent's lock)."""
        try:
            self._standby.parent.mkdir(mode=0o700, exist_ok=True)
            self._standby.unlink(missing_ok=True)  # a stale one, from an agent that did not stop cleanly
            os.link(self.socket_path, self._standby)
        except OSError as error:  # e.g. a filesystem without hard links: restarts then start a new server
            log.info("no standby name for the plugin socket socket=%s error=%r", self.socket_path, str(error))
            return
        self._standby_linked = True

    def update(self, snapshot: ResourceSnapshot, *, wake: bool = True) -> bool:
        """Serve ``snapshot`` from now on; ListAndWatch streams send it only if the listing changed (True).

        Called by the one reconcile thread. The listing is built before the swap (one attribute write), so a
        handler sees either the old snapshot or the new one with everything belonging to it. The streams send
        on the gRPC loop; with ``wake=False`` they are woken by ``send_updates``, which waits until they have.
        """
        served = _Served.of(snapshot, self._served)
        changed = served.list_and_watch is not self._served.list_and_watch
        self._served = served
        if changed and self._server is not None:
            if wake:
                self._loop.call_soon(self._wake)
            return True
        return False

    def prepare(self) -> None:
        """Work out what Allocate answers from (the reconcile thread, once the kubelet has the listing)."""
        self._served.allocator  # noqa: B018 (built on first read)

    def stop(self, grace: float = STOP_GRACE) -> None:
        """Stop at once: every ListAndWatch stream sends nothing more and ends (the kubelet sees a clean end
        of stream), then the server goes and the socket with it."""
        stop_servers((self,), grace)

    async def _stop(self, grace: float) -> None:
        """On the loop: end the streams, wait (at most ``grace``) until they are closed, stop the server."""
        self._stopping = True
        self._wake()
        deadline = asyncio.get_running_loop().time() + grace
        while self._open_streams and (left := deadline - asyncio.get_running_loop().time()) > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), left)  # a closing stream wakes the others
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None
            log.info("stopped resource=%s", self.resource)

    def _remove_socket(self) -> None:
        if self.socket_present():
            self.socket_path.unlink(missing_ok=True)
        if self._standby_linked:
            self._standby_linked = False
            with contextlib.suppress(OSError):
                if self._standby.stat().st_ino == self._socket_inode:
                    self._standby.unlink()

    async def stream(self) -> AsyncIterator[bytes]:
        """The serialized listing now and after every change, until the stream ends or the server stops.

        No polling: ``update`` and ``stop`` wake the waiting stream through the loop; the end of the RPC
        cancels it where it waits.
        """
        sent: bytes | None = None
        stream = object()  # this stream's key in ``_written``
        self._open_streams += 1
        self._written[stream] = None
        try:
            while not self._stopping:
                message = self._served.list_and_watch
                if message is sent:
                    await self._wakeup.wait()
                    continue
                first, sent = sent is None, message
                yield message  # resumed once gRPC has written it and wants the next
                self._written[stream] = message
                self._wrote()
                if first:
                    self._on_stream_opened(self.resource)
        finally:
            self._open_streams -= 1
            del self._written[stream]
            self._wrote()  # a stream that ended has nothing more to write
            if self._stopping:
                self._wake()  # a stop waiting for the streams to close
            else:
                log.warning("ListAndWatch stream closed by the kubelet resource=%s", self.resource)
                self._on_stream_closed(self.resource)

    @property
    def open_streams(self) -> int:
        """ListAndWatch streams being served now (a kubelet that restarted has opened a new one)."""
        return self._open_streams

    def _wake(self) -> None:
        """On the loop: every waiting stream looks again."""
        wakeup, self._wakeup = self._wakeup, asyncio.Event()
        wakeup.set()

    def _wrote(self) -> None:
        """On the loop: a stream has handed a listing to gRPC, or ended (``_written_all`` may be true now)."""
        progress, self._progress = self._progress, asyncio.Event()
        progress.set()

    async def _written_all(self) -> None:
        """On the loop: until every open stream has written the listing served now (or ended)."""
        while any(message is not self._served.list_and_watch for message in self._written.values()):
            await self._progress.wait()


def send_updates(servers: Iterable[ResourceServer], timeout: float = SEND_WAIT) -> None:
    """Wake the streams of servers ``update``d with ``wake=False`` and wait until each has handed its new listing
    to gRPC and gRPC has written it (at most ``timeout``: the streams are woken all the same).

    The reconcile thread calls it after a change the kubelet must see (a device turned Unhealthy): one hand-over
    to the gRPC loop, after which the reconcile thread waits, off the GIL, rather than go on with what follows
    (logs, NVML reads, the status, the allocator's answers) while the loop waits for the GIL to send. Handlers
    on the loop never block, so this takes as long as the sending itself.
    """
    by_loop: dict[GrpcLoop, list[ResourceServer]] = {}
    for server in servers:
        if server._server is not None:
            by_loop.setdefault(server._loop, []).append(server)
    for loop, running in by_loop.items():
        with contextlib.suppress(TimeoutError):
            loop.run(_send(running, timeout), timeout)


async def _send(servers: list[ResourceServer], timeout: float) -> None:
    for server in servers:
        server._wake()
    with contextlib.suppress(TimeoutError):  # a kubelet that does not read leaves nothing waiting here
        async with asyncio.timeout(timeout):
            for server in servers:
                await server._written_all()


def stop_servers(servers: Iterable[ResourceServer], grace: float = STOP_GRACE) -> None:
    """Stop several servers at once (their streams end together), then remove their sockets."""
    servers = list(servers)
    running = [s for s in servers if s._server is not None]
    if running:
        loop = running[0]._loop

        async def stop_all() -> None:
            await asyncio.gather(*(s._stop(grace) for s in running))

        loop.run(stop_all())
    for server in servers:
        server._stopping = True
        server._remove_socket()


class _DevicePluginHandlers:
    """``v1beta1.DevicePlugin``'s methods for one ``ResourceServer``.

    Requests that carry nothing the answer depends on are not parsed, and constant or prepared answers are
    sent as bytes (no serializer), so those calls cost only what gRPC itself costs.
    """

    def __init__(self, server: ResourceServer) -> None:
        self._server = server

    def method_handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        latency, resource = self._server.latency, self._server.resource
        allocate, preferred_allocation = self.allocate, self.get_preferred_allocation
        if latency is not None:  # timed only when someone reads the times: no cost on the calls otherwise
            allocate = _timed(allocate, latency.observe_allocate, resource)
            preferred_allocation = _timed(preferred_allocation, latency.observe_preferred_allocation, resource)
        return {
            "GetDevicePluginOptions": grpc.unary_unary_rpc_method_handler(self.get_device_plugin_options),
            "ListAndWatch": grpc.unary_stream_rpc_method_handler(self.list_and_watch),
            "GetPreferredAllocation": grpc.unary_unary_rpc_method_handler(preferred_allocation),
            "Allocate": grpc.unary_unary_rpc_method_handler(allocate),
            "PreStartContainer": grpc.unary_unary_rpc_method_handler(self.pre_start_container),
        }

    async def get_device_plugin_options(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return PLUGIN_OPTIONS

    async def list_and_watch(self, request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        async for message in self._server.stream():  # (grpc.aio wants an async generator function here)
            yield message

    async def allocate(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            containers = wire.allocate_request(request)
        except wire.WireError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed AllocateRequest: {error}")
        if self._server.on_allocate is not None:  # first: a hand-over checking from now on sees these devices held
            self._server.on_allocate([device for ids in containers for device in ids])
        served = self._server._served  # one read, after that: the whole request is answered from one snapshot
        if not containers:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"empty allocation request for {served.snapshot.name}"
            )
        answers = []
        for devices_ids in containers:
            try:
                allocation = served.allocator.allocate(devices_ids)
            except AllocationError as error:
                log.warning("allocation refused resource=%s reason=%r", served.snapshot.name, str(error))
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
            answers.append(wire.container_allocate_response(allocation))
            if log.isEnabledFor(logging.INFO):
                log.info("allocated resource=%s devices=%s", served.snapshot.name, ",".join(devices_ids))
        return wire.allocate_response(answers)

    async def get_preferred_allocation(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        snapshot = self._server._served.snapshot
        try:
            containers = wire.preferred_allocation_request(request)
        except wire.WireError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed PreferredAllocationRequest: {error}")
        answers = []
        for available, must_include, size in containers:
            try:
                ids = preferred(
                    available,
                    must_include,
                    size,
                    snapshot.by_id,
                    snapshot.nvlink_peers,
                    snapshot.options.policy,
                    snapshot.layout,
                )
            except PreferenceError as error:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{snapshot.name}: {error}")
            answers.append(ids)
        return wire.preferred_allocation_response(answers)

    async def pre_start_container(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return _EMPTY


_Handler = Callable[[bytes, grpc.aio.ServicerContext], Awaitable[bytes]]


def _timed(handler: _Handler, observe: Callable[[str, float], None], resource: str) -> _Handler:
    """``handler`` with each call's time (refused and aborted calls too, as the kubelet counts them) given to
    ``observe(resource, seconds)``."""

    async def timed(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        started = time.perf_counter()
        try:
            return await handler(request, context)
        finally:
            observe(resource, time.perf_counter() - started)

    return timed
