"""One kubelet device-plugin gRPC server per resource, on its own unix socket.

The server holds the resource's current ``ResourceSnapshot``; the reconcile loop replaces it with
``update``. ``ListAndWatch`` sends the full device list at once and again whenever the listing changes.
Handlers are read-only: a bad request gets ``INVALID_ARGUMENT`` with a message and changes nothing.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc

from agent.api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from agent.core.allocation import (
    AllocationError,
    ContainerAllocation,
    MpsClient,
    container_allocation,
    validate_request,
)
from agent.core.preferred import PreferenceError, preferred
from agent.core.snapshot import ResourceSnapshot
from agent.plugin.names import socket_name

log = logging.getLogger(__name__)

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
SOCKET_MODE = 0o600
MAX_SOCKET_PATH = 107  # sun_path is 108 bytes with the terminating NUL
_WAKE_INTERVAL = 1.0  # a ListAndWatch stream re-checks that it is still wanted at least this often


class ResourceServer:
    """Serves ``v1beta1.DevicePlugin`` for one resource on ``<socket_dir>/<socket name>``."""

    def __init__(
        self,
        snapshot: ResourceSnapshot,
        socket_dir: Path,
        *,
        on_stream_closed: Callable[[str], None] = lambda resource: None,
        max_workers: int = 8,
    ) -> None:
        self.resource = snapshot.name
        self.socket_path = socket_dir / socket_name(snapshot.name)
        self._snapshot = snapshot
        self._version = 0
        self._changed = threading.Condition()
        self._stopping = False
        self._on_stream_closed = on_stream_closed
        self._max_workers = max_workers
        self._server: grpc.Server | None = None
        self._socket_inode: int | None = None

    @property
    def snapshot(self) -> ResourceSnapshot:
        return self._snapshot

    def start(self) -> None:
        """Serve on a fresh socket (a stale one of ours is removed first)."""
        if len(os.fsencode(self.socket_path)) > MAX_SOCKET_PATH:
            raise OSError(
                f"cannot listen on {self.socket_path}: longer than {MAX_SOCKET_PATH} bytes (unix socket limit)"
            )
        self.socket_path.unlink(missing_ok=True)
        executor = futures.ThreadPoolExecutor(self._max_workers, thread_name_prefix=f"plugin-{self.socket_path.stem}")
        server = grpc.server(executor)
        api_pb2_grpc.add_DevicePluginServicer_to_server(_DevicePluginServicer(self), server)
        try:
            bound = server.add_insecure_port(f"unix://{self.socket_path}")
        except RuntimeError:  # grpcio raises when it cannot bind (older releases returned 0)
            bound = 0
        if bound == 0:
            raise OSError(f"cannot listen on {self.socket_path}")
        server.start()
        self.socket_path.chmod(SOCKET_MODE)
        self._socket_inode = self.socket_path.stat().st_ino
        self._server = server
        log.info(
            "serving resource=%s socket=%s devices=%d", self.resource, self.socket_path, len(self._snapshot.devices)
        )

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

    def update(self, snapshot: ResourceSnapshot) -> None:
        with self._changed:
            self._snapshot = snapshot
            self._version += 1
            self._changed.notify_all()

    def stop(self, grace: float = 0.5) -> None:
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
        if self._server is not None:
            self._server.stop(grace).wait()
            self._server = None
            log.info("stopped resource=%s", self.resource)
        if self.socket_present():
            self.socket_path.unlink(missing_ok=True)

    def watch(self, context: grpc.ServicerContext) -> Iterator[ResourceSnapshot]:
        """Yield the snapshot now and after every change, until the stream ends or the server stops."""
        context.add_callback(self._wake)
        version = -1
        try:
            while context.is_active():
                with self._changed:
                    self._changed.wait_for(lambda seen=version: self._version != seen or self._stopping, _WAKE_INTERVAL)
                    if self._stopping:
                        return
                    snapshot, changed = self._snapshot, self._version != version
                    version = self._version
                if changed:
                    yield snapshot
        finally:
            if not self._stopping:
                log.warning("ListAndWatch stream closed by the kubelet resource=%s", self.resource)
                self._on_stream_closed(self.resource)

    def _wake(self) -> None:
        with self._changed:
            self._changed.notify_all()


class _DevicePluginServicer(api_pb2_grpc.DevicePluginServicer):
    def __init__(self, server: ResourceServer) -> None:
        self._server = server

    def GetDevicePluginOptions(
        self, request: api_pb2.Empty, context: grpc.ServicerContext
    ) -> api_pb2.DevicePluginOptions:
        return plugin_options()

    def ListAndWatch(
        self, request: api_pb2.Empty, context: grpc.ServicerContext
    ) -> Iterator[api_pb2.ListAndWatchResponse]:
        sent: tuple[object, ...] | None = None
        for snapshot in self._server.watch(context):
            listing = snapshot.listing()
            if listing != sent:
                sent = listing
                yield list_and_watch_response(snapshot)

    def Allocate(self, request: api_pb2.AllocateRequest, context: grpc.ServicerContext) -> api_pb2.AllocateResponse:
        snapshot = self._server.snapshot
        if not request.container_requests:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"empty allocation request for {snapshot.name}")
        responses = []
        for container in request.container_requests:
            try:
                devices = validate_request(
                    snapshot.name,
                    container.devices_ids,
                    snapshot.by_id,
                    snapshot.health,
                    fail_requests_greater_than_one=snapshot.fail_requests_greater_than_one,
                )
            except AllocationError as error:
                log.warning("allocation refused resource=%s reason=%r", snapshot.name, str(error))
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
            mps = None
            if snapshot.mps is not None:
                mps = MpsClient(snapshot.options.mps_root, snapshot.mps, snapshot.replicas)
            try:
                allocation = container_allocation(
                    snapshot.name, devices, snapshot.options.strategies, cdi_kind=snapshot.options.cdi_kind, mps=mps
                )
            except AllocationError as error:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
            responses.append(container_response(allocation))
            log.info("allocated resource=%s devices=%s", snapshot.name, ",".join(container.devices_ids))
        return api_pb2.AllocateResponse(container_responses=responses)

    def GetPreferredAllocation(
        self, request: api_pb2.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> api_pb2.PreferredAllocationResponse:
        snapshot = self._server.snapshot
        responses = []
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
            responses.append(api_pb2.ContainerPreferredAllocationResponse(deviceIDs=ids))
        return api_pb2.PreferredAllocationResponse(container_responses=responses)

    def PreStartContainer(
        self, request: api_pb2.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> api_pb2.PreStartContainerResponse:
        return api_pb2.PreStartContainerResponse()


def plugin_options() -> api_pb2.DevicePluginOptions:
    return api_pb2.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)


def list_and_watch_response(snapshot: ResourceSnapshot) -> api_pb2.ListAndWatchResponse:
    devices = []
    for device in snapshot.devices:
        topology = None
        if device.numa_node is not None:
            topology = api_pb2.TopologyInfo(nodes=[api_pb2.NUMANode(ID=device.numa_node)])
        health = HEALTHY if snapshot.health[device.id] else UNHEALTHY
        devices.append(api_pb2.Device(ID=device.id, health=health, topology=topology))
    return api_pb2.ListAndWatchResponse(devices=devices)


def container_response(allocation: ContainerAllocation) -> api_pb2.ContainerAllocateResponse:
    return api_pb2.ContainerAllocateResponse(
        envs=dict(allocation.envs),
        mounts=[
            api_pb2.Mount(container_path=m.container_path, host_path=m.host_path, read_only=m.read_only)
            for m in allocation.mounts
        ],
        annotations=dict(allocation.annotations),
        cdi_devices=[api_pb2.CDIDevice(name=name) for name in allocation.cdi_devices],
    )
