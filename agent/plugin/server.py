"""One kubelet device-plugin gRPC server per resource, on its own unix socket.

The server holds the resource's current ``ResourceSnapshot``; the reconcile loop replaces it with
``update``. ``ListAndWatch`` sends the full device list at once and again whenever the listing changes.
Handlers are read-only: a bad request gets ``INVALID_ARGUMENT`` with a message and changes nothing.

The hot path does only what a request needs. Everything that depends on the snapshot alone (the serialized
ListAndWatch message, the allocator's per-device answers, the preferred-allocation layout) is worked out
once, when the snapshot is handed over (``_Served``); a handler reads the current ``_Served`` once and
answers from it. Constant answers (options, PreStartContainer) are pre-serialized bytes.

Server model: grpcio's thread-pool server. ``tests/bench/bench_plugin.py`` measures it against
``grpc.aio`` with the same handlers and the same client on every run; aio was not faster for Allocate
(latency or CPU per call), and the thread pool lets the reconcile thread hand over snapshots with a
plain attribute write and a condition variable.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc

from agent.api.deviceplugin.v1beta1 import api_pb2
from agent.core.allocation import AllocationError, Allocator, ContainerAllocation, MpsClient
from agent.core.preferred import PreferenceError, preferred
from agent.core.snapshot import ResourceSnapshot
from agent.plugin.lock import LOCK_DIRECTORY
from agent.plugin.names import socket_name

log = logging.getLogger(__name__)

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
SOCKET_MODE = 0o600
MAX_SOCKET_PATH = 107  # sun_path is 108 bytes with the terminating NUL
SERVICE = "v1beta1.DevicePlugin"
# ``stop`` first ends every ListAndWatch stream itself (a clean end of stream, within a millisecond), so
# this only bounds a handler that is somehow still running; the stop returns as soon as none is.
STOP_GRACE = 0.1


def plugin_options() -> api_pb2.DevicePluginOptions:
    return api_pb2.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)


_OPTIONS = plugin_options().SerializeToString()
Entry = tuple[str, bool, int | None]  # a device as ListAndWatch lists it: ID, healthy, NUMA node
_EMPTY = b""  # PreStartContainerResponse has no fields


@dataclass(frozen=True, slots=True)
class _Served:
    """A snapshot and what the handlers derive from it, worked out once when it is handed over."""

    snapshot: ResourceSnapshot
    list_and_watch: bytes  # the serialized ListAndWatchResponse; the same object while the listing is unchanged
    entries: Mapping[Entry, bytes]  # each device's part of it, kept for the next snapshot
    allocator: Allocator

    @classmethod
    def of(cls, snapshot: ResourceSnapshot, previous: _Served | None = None) -> _Served:
        listing = snapshot.listing()
        if previous is not None and previous.snapshot.listing() == listing:
            message, entries = previous.list_and_watch, previous.entries
        else:  # only the devices that changed (health, a new device) are serialized again
            known = previous.entries if previous is not None else {}
            entries = {entry: known.get(entry) or _device_entry(entry) for entry in listing}
            message = b"".join(entries.values())
        options = snapshot.options
        mps = MpsClient(options.mps_root, snapshot.mps, snapshot.replicas) if snapshot.mps is not None else None
        allocator = Allocator.of(
            snapshot.name,
            snapshot.devices,
            snapshot.health,
            options.strategies,
            cdi_kind=options.cdi_kind,
            mps=mps,
            fail_requests_greater_than_one=snapshot.fail_requests_greater_than_one,
        )
        return cls(snapshot, message, entries, allocator)


def _device_entry(entry: Entry) -> bytes:
    """One device as a ListAndWatchResponse of its own. Repeated fields concatenate on the wire, so the
    devices' entries joined in order are the serialized response for all of them."""
    device_id, healthy, numa_node = entry
    response = api_pb2.ListAndWatchResponse()
    device = response.devices.add(ID=device_id, health=HEALTHY if healthy else UNHEALTHY)
    if numa_node is not None:
        device.topology.nodes.add(ID=numa_node)
    return response.SerializeToString()


class ResourceServer:
    """Serves ``v1beta1.DevicePlugin`` for one resource on ``<socket_dir>/<socket name>``."""

    def __init__(
        self,
        snapshot: ResourceSnapshot,
        socket_dir: Path,
        *,
        on_stream_closed: Callable[[str], None] = lambda resource: None,
        on_stream_opened: Callable[[str], None] = lambda resource: None,
        max_workers: int = 8,
    ) -> None:
        self.resource = snapshot.name
        self.socket_path = socket_dir / socket_name(snapshot.name)
        self._served = _Served.of(snapshot)
        self._version = 0  # bumped when the ListAndWatch message changes
        self._changed = threading.Condition()
        self._stopping = False
        self._open_streams = 0
        self._on_stream_closed = on_stream_closed
        self._on_stream_opened = on_stream_opened
        self._max_workers = max_workers
        self._server: grpc.Server | None = None
        self._executor: futures.ThreadPoolExecutor | None = None
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
        executor = futures.ThreadPoolExecutor(self._max_workers, thread_name_prefix=f"plugin-{self.socket_path.stem}")
        server = grpc.server(executor)
        handlers = self.method_handlers()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        server.add_registered_method_handlers(SERVICE, handlers)
        try:
            bound = server.add_insecure_port(f"unix://{self.socket_path}")
        except RuntimeError:  # grpcio raises when it cannot bind (older releases returned 0)
            bound = 0
        if bound == 0:
            executor.shutdown(wait=False)
            raise OSError(f"cannot listen on {self.socket_path}")
        server.start()
        self.socket_path.chmod(SOCKET_MODE)
        self._socket_inode = self.socket_path.stat().st_ino
        self._server, self._executor = server, executor
        self._link_standby()
        log.info(
            "serving resource=%s socket=%s devices=%d", self.resource, self.socket_path, len(self.snapshot.devices)
        )

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
        (tens of microseconds, where stopping and starting a server takes milliseconds). Streams and workers
        carry on. False when that cannot be done (not serving, no standby name, the path is taken): then
        stop this server and start a new one.
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

    def update(self, snapshot: ResourceSnapshot) -> None:
        """Serve ``snapshot`` from now on; ListAndWatch streams send it only if the listing changed.

        Called by the one reconcile thread. The derived answers are built before the swap, so a handler
        sees either the old snapshot or the new one with everything belonging to it.
        """
        served = _Served.of(snapshot, self._served)
        with self._changed:
            changed = served.list_and_watch is not self._served.list_and_watch
            self._served = served
            if changed:
                self._version += 1
                self._changed.notify_all()

    def stop(self, grace: float = STOP_GRACE) -> None:
        """Stop at once: every ListAndWatch stream sends nothing more and ends (the kubelet sees a clean end
        of stream), then the server goes; ``grace`` only bounds a handler that is still running."""
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
        if self._server is not None:
            self._server.stop(grace).wait()
            self._server = None
            log.info("stopped resource=%s", self.resource)
        if self._executor is not None:
            self._executor.shutdown(wait=False)  # idle workers exit now rather than at interpreter exit
            self._executor = None
        if self.socket_present():
            self.socket_path.unlink(missing_ok=True)
        if self._standby_linked:
            self._standby_linked = False
            with contextlib.suppress(OSError):
                if self._standby.stat().st_ino == self._socket_inode:
                    self._standby.unlink()

    def stream(self, context: grpc.ServicerContext) -> Iterator[bytes]:
        """The serialized listing now and after every change, until the stream ends or the server stops.

        No polling: ``update``, ``stop`` and the end of the RPC (a callback) all wake the waiting stream.
        """
        sent = -1
        with self._changed:
            self._open_streams += 1
        try:
            if not context.add_callback(self._wake):
                return  # the RPC is already over
            while True:
                with self._changed:
                    # the callback runs once the RPC is no longer active, under this lock: no wake-up is lost
                    while self._version == sent and not self._stopping and context.is_active():
                        self._changed.wait()
                    if self._stopping or not context.is_active():
                        return
                    first, sent, message = sent == -1, self._version, self._served.list_and_watch
                yield message  # resumed once gRPC has written it and wants the next
                if first:
                    self._on_stream_opened(self.resource)
        finally:
            with self._changed:
                self._open_streams -= 1
            if not self._stopping:
                log.warning("ListAndWatch stream closed by the kubelet resource=%s", self.resource)
                self._on_stream_closed(self.resource)

    @property
    def open_streams(self) -> int:
        """ListAndWatch streams being served now (a kubelet that restarted has opened a new one)."""
        with self._changed:
            return self._open_streams

    def _wake(self) -> None:
        with self._changed:
            self._changed.notify_all()


class _DevicePluginHandlers:
    """``v1beta1.DevicePlugin``'s methods for one ``ResourceServer``.

    Requests that carry nothing the answer depends on are not parsed, and constant or prepared answers are
    sent as bytes (no serializer), so those calls cost only what gRPC itself costs.
    """

    def __init__(self, server: ResourceServer) -> None:
        self._server = server

    def method_handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        return {
            "GetDevicePluginOptions": grpc.unary_unary_rpc_method_handler(self.get_device_plugin_options),
            "ListAndWatch": grpc.unary_stream_rpc_method_handler(self.list_and_watch),
            "GetPreferredAllocation": grpc.unary_unary_rpc_method_handler(
                self.get_preferred_allocation,
                request_deserializer=api_pb2.PreferredAllocationRequest.FromString,
                response_serializer=api_pb2.PreferredAllocationResponse.SerializeToString,
            ),
            "Allocate": grpc.unary_unary_rpc_method_handler(
                self.allocate,
                request_deserializer=api_pb2.AllocateRequest.FromString,
                response_serializer=api_pb2.AllocateResponse.SerializeToString,
            ),
            "PreStartContainer": grpc.unary_unary_rpc_method_handler(self.pre_start_container),
        }

    def get_device_plugin_options(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        return _OPTIONS

    def list_and_watch(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        return self._server.stream(context)

    def allocate(self, request: api_pb2.AllocateRequest, context: grpc.ServicerContext) -> api_pb2.AllocateResponse:
        served = self._server._served  # one read: the whole request is answered from one snapshot
        if not request.container_requests:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"empty allocation request for {served.snapshot.name}")
        response = api_pb2.AllocateResponse()
        for container in request.container_requests:
            try:
                allocation = served.allocator.allocate(container.devices_ids)
            except AllocationError as error:
                log.warning("allocation refused resource=%s reason=%r", served.snapshot.name, str(error))
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
            fill_container_response(response.container_responses.add(), allocation)
            if log.isEnabledFor(logging.INFO):
                log.info("allocated resource=%s devices=%s", served.snapshot.name, ",".join(container.devices_ids))
        return response

    def get_preferred_allocation(
        self, request: api_pb2.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> api_pb2.PreferredAllocationResponse:
        snapshot = self._server._served.snapshot
        response = api_pb2.PreferredAllocationResponse()
        for container in request.container_requests:
            try:
                ids = preferred(
                    container.available_deviceIDs,
                    container.must_include_deviceIDs,
                    container.allocation_size,
                    snapshot.by_id,
                    snapshot.nvlink_peers,
                    snapshot.options.policy,
                    snapshot.layout,
                )
            except PreferenceError as error:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{snapshot.name}: {error}")
            response.container_responses.add().deviceIDs.extend(ids)
        return response

    def pre_start_container(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        return _EMPTY


def fill_container_response(message: api_pb2.ContainerAllocateResponse, allocation: ContainerAllocation) -> None:
    """Write ``allocation`` into ``message`` in place (no intermediate messages to copy)."""
    message.envs.update(allocation.envs)
    for mount in allocation.mounts:
        message.mounts.add(container_path=mount.container_path, host_path=mount.host_path, read_only=mount.read_only)
    message.annotations.update(allocation.annotations)
    for name in allocation.cdi_devices:
        message.cdi_devices.add(name=name)
