"""Plugin registration and ListAndWatch handling of the kubelet emulator (``plugin/v1beta1/server.go``,
``handler.go``, ``client.go`` and ``manager.go`` PluginConnected / PluginDisconnected / genericDeviceUpdateCallback).
Mixed into ``agent.sim.kubelet.KubeletEmulator``, whose state it uses."""

from __future__ import annotations

import logging
import posixpath
import threading
import time

import grpc

from agent.api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from agent.sim.kubelet.common import (
    CHANNEL_OPTIONS,
    CONN_CLOSING,
    HEALTHY,
    SUPPORTED_VERSIONS,
    Endpoint,
    PluginClient,
    go_quote,
    go_rpc_error,
    is_extended_resource_name,
)

log = logging.getLogger("agent.sim.kubelet")


class RegistrationServicer(api_pb2_grpc.RegistrationServicer):
    def __init__(self, kubelet: RegistrationMixin) -> None:
        self._kubelet = kubelet

    def register_with(self, server: grpc.Server) -> None:
        api_pb2_grpc.add_RegistrationServicer_to_server(self, server)

    def Register(self, request, context):
        error = self._kubelet._register(request)
        if error is not None:
            context.abort(grpc.StatusCode.UNKNOWN, error)
        return api_pb2.Empty()


class RegistrationMixin:
    """Register (version, name, blocking dial, GetDevicePluginOptions), then one ListAndWatch thread per connection."""

    def _register(self, req: api_pb2.RegisterRequest) -> str | None:
        """server.go Register -> handler.go connectClient -> client.go Connect -> manager.go PluginConnected."""
        name = req.resource_name
        log.info(
            "Got registration request from device plugin with resource: resource=%s endpoint=%s version=%s",
            name,
            req.endpoint,
            req.version,
        )
        if req.version not in SUPPORTED_VERSIONS:
            supported = "[" + " ".join(go_quote(v) for v in SUPPORTED_VERSIONS) + "]"
            msg = (
                f"requested API version {go_quote(req.version)} is not supported by kubelet. "
                f"Supported version is {supported}"
            )
            log.error("Bad registration request from device plugin with resource: resource=%s err=%s", name, msg)
            return msg
        if not is_extended_resource_name(name):
            msg = f"the ResourceName {go_quote(name)} is invalid"
            log.error("Bad registration request from device plugin: resource=%s err=%s", name, msg)
            return msg
        # filepath.Join(dir, endpoint): an absolute endpoint is joined under the directory, ".." is resolved
        client = PluginClient(name, req.endpoint, posixpath.normpath(f"{self.device_plugin_dir}/{req.endpoint}"))
        with self._cond:
            if self._stopping.is_set():
                return "kubelet is shutting down"
            self._clients.add(client)
            if self.legacy_reregistration_race:
                self._clients_by_name[name] = client  # registerClient, before connecting
        error, options = self._connect(client)
        if error is not None:
            with self._cond:
                self._clients.discard(client)
                if self.legacy_reregistration_race:
                    self._clients_by_name.pop(name, None)  # deregisterClient(name)
            client.close(by_kubelet_shutdown=True)
            log.error("Failed to connect to new client: resource=%s path=%s err=%s", name, client.socket_path, error)
            return error
        with self._cond:
            if self._stopping.is_set():
                client.close(by_kubelet_shutdown=True)
                return "kubelet is shutting down"
            self._endpoints[name] = Endpoint(client=client, options=options, resource=name)
            self._registrations[name] = self._registrations.get(name, 0) + 1
            client.thread = threading.Thread(
                target=self._run_client, args=(client,), name=f"kubelet-listandwatch-{name}", daemon=True
            )
            client.thread.start()
            self._threads.append(client.thread)
            self._changed()
        log.info(
            "Device plugin connected: resource=%s path=%s pre_start_required=%s get_preferred_allocation_available=%s",
            name,
            client.socket_path,
            options.pre_start_required,
            options.get_preferred_allocation_available,
        )
        return None

    def _connect(self, client: PluginClient) -> tuple[str | None, api_pb2.DevicePluginOptions]:
        channel = grpc.insecure_channel(f"unix:{client.socket_path}", options=CHANNEL_OPTIONS)
        with client.lock:
            client.channel = channel
        ready = grpc.channel_ready_future(channel)
        deadline = time.monotonic() + self.dial_timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._stopping.is_set():
                ready.cancel()
                log.error("Unable to connect to device plugin client with socket path: path=%s", client.socket_path)
                return "failed to dial device plugin: context deadline exceeded", api_pb2.DevicePluginOptions()
            try:
                ready.result(timeout=min(0.1, remaining))
                break
            except grpc.FutureTimeoutError:
                continue
            except grpc.FutureCancelledError:
                return "failed to dial device plugin: context canceled", api_pb2.DevicePluginOptions()
        client.stub = api_pb2_grpc.DevicePluginStub(channel)
        try:
            options = client.stub.GetDevicePluginOptions(api_pb2.Empty(), timeout=self.call_timeout)
        except grpc.RpcError as exc:
            return f"failed to get device plugin options: {go_rpc_error(exc)}", api_pb2.DevicePluginOptions()
        except ValueError:  # channel closed under us by stop()
            return f"failed to get device plugin options: {CONN_CLOSING}", api_pb2.DevicePluginOptions()
        return None, options

    def _run_client(self, client: PluginClient) -> None:
        """client.go Run + handler.go runClient: feed every message in, and disconnect when the stream ends."""
        error = "EOF"
        try:
            call = client.stub.ListAndWatch(api_pb2.Empty())
            with client.lock:
                client.call = call
                closing = client.closing
            if closing:
                call.cancel()
            for response in call:
                self._on_devices(client, response)
        except grpc.RpcError as exc:
            error = go_rpc_error(exc)
        except ValueError:
            error = CONN_CLOSING
        if client.closing:
            log.debug("ListAndWatch stream closed by the kubelet: resource=%s", client.resource)
            return
        log.error("ListAndWatch ended unexpectedly for device plugin: resource=%s err=%s", client.resource, error)
        self._on_client_ended(client)

    def _on_devices(self, client: PluginClient, response: api_pb2.ListAndWatchResponse) -> None:
        """genericDeviceUpdateCallback: every message fully replaces the resource's device set."""
        if client.closing:
            return
        name = client.resource
        with self._cond:
            healthy: set[str] = set()
            unhealthy: set[str] = set()
            devices: dict[str, api_pb2.Device] = {}
            for dev in response.devices:
                devices[dev.ID] = dev
                (healthy if dev.health == HEALTHY else unhealthy).add(dev.ID)
            self._healthy[name] = healthy
            self._unhealthy[name] = unhealthy
            self._all[name] = devices
            self._changed()
            checkpoint = self._checkpoint_locked()
        self._write_checkpoint(checkpoint)
        log.info(
            "State pushed for device plugin: resource=%s resourceCapacity=%d healthy=%d",
            name,
            len(response.devices),
            len(healthy),
        )

    def _on_client_ended(self, client: PluginClient) -> None:
        name = client.resource
        with self._cond:
            if self.legacy_reregistration_race:
                current = self._clients_by_name.pop(name, None)  # getClient(name), then deregisterClient(name)
                if current is None:
                    return
                to_close = current
            else:
                ep = self._endpoints.get(name)
                if ep is None or ep.client is not client:
                    log.info("Replaced device plugin connection ended: resource=%s path=%s", name, client.socket_path)
                    self._clients.discard(client)
                    to_close = None
                else:
                    to_close = client
            if to_close is not None:
                self._clients.discard(to_close)
                self._plugin_disconnected_locked(name)
        if to_close is not None:
            to_close.close(by_kubelet_shutdown=False)
        client.close(by_kubelet_shutdown=False)

    def _plugin_disconnected_locked(self, name: str) -> None:
        ep = self._endpoints.get(name)
        if ep is None:
            return
        # markResourceUnhealthy: healthy -> unhealthy, capacity unchanged, allocatable 0
        moved = set()
        if name in self._healthy:
            moved, self._healthy[name] = self._healthy[name], set()
        self._unhealthy[name] = self._unhealthy.get(name, set()) | moved
        ep.stop_time = time.monotonic()
        self._changed()
        log.warning("Mark all resources Unhealthy for resource: resource=%s devices=%d", name, len(moved))
