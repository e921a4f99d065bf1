"""The DRA driver's registration socket, which the kubelet's plugin watcher finds and calls.

The kubelet dials the socket, asks ``GetInfo`` (1 s timeout), registers the driver if it speaks one of the
services listed, and reports the outcome with ``NotifyRegistrationStatus`` (false plus its own error text on
failure). The order of ``supported_versions`` decides the version: the kubelet takes the first entry it
knows, so ``v1.DRAPlugin`` comes before ``v1beta1.DRAPlugin`` (a 1.34+ kubelet takes v1, an older one v1beta1).
A refusal is logged with the kubelet's words and handed to ``on_status``; the owner registers again by
serving a fresh socket (``restart``), which the watcher sees as a new plugin.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc
import grpc.aio

from agent.api.dra.v1 import api_pb2 as dra_v1
from agent.api.dra.v1beta1 import api_pb2 as dra_v1beta1
from agent.api.drahealth.v1 import api_pb2 as dra_health_v1
from agent.api.drahealth.v1alpha1 import api_pb2 as dra_health
from agent.api.pluginregistration.v1 import api_pb2
from agent.grpc_loop import GrpcLoop, grpc_loop

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"
REGISTRATION_SERVICE = api_pb2.DESCRIPTOR.services_by_name["Registration"].full_name
SOCKET_MODE = 0o600


def service_name(descriptor: object) -> str:
    """What the kubelet calls a DRA service in ``supported_versions``: ``<last package segment>.<Service>``."""
    full_name: str = descriptor.full_name  # type: ignore[attr-defined]
    return ".".join(full_name.split(".")[-2:])


DRA_SERVICES = (
    service_name(dra_v1.DESCRIPTOR.services_by_name["DRAPlugin"]),  # v1.DRAPlugin: kubelet 1.34+
    service_name(dra_v1beta1.DESCRIPTOR.services_by_name["DRAPlugin"]),  # v1beta1.DRAPlugin: older kubelets
)
HEALTH_SERVICE = service_name(dra_health.DESCRIPTOR.services_by_name["DRAResourceHealth"])  # v1alpha1
# the health services, in the order a kubelet is to prefer them: v1 (1.37+), then v1alpha1 (until the 1.40 era)
HEALTH_SERVICES = (service_name(dra_health_v1.DESCRIPTOR.services_by_name["DRAResourceHealth"]), HEALTH_SERVICE)


class DraRegistrar:
    """Serves ``pluginregistration.Registration`` for one driver on ``socket_path``."""

    def __init__(
        self,
        socket_path: Path,
        driver: str,
        endpoint: Path,
        services: Sequence[str] = DRA_SERVICES,
        *,
        on_status: Callable[[bool, str], None] = lambda registered, error: None,
        loop: GrpcLoop | None = None,
    ) -> None:
        if not services:
            raise ValueError("a DRA driver must name at least one service (the kubelet refuses an empty list)")
        self.socket_path = socket_path
        self._info = api_pb2.PluginInfo(
            type=PLUGIN_TYPE, name=driver, endpoint=str(endpoint), supported_versions=list(services)
        ).SerializeToString()
        self._on_status = on_status
        self._loop = loop or grpc_loop()
        self._server: grpc.aio.Server | None = None
        self.registered: bool | None = None  # the kubelet's last word; None before it spoke

    def start(self) -> None:
        """Serve on a fresh socket (a stale one of ours is removed first): the plugin watcher's create event."""
        self.socket_path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
        self.socket_path.unlink(missing_ok=True)
        self._loop.run(self._start())
        self.socket_path.chmod(SOCKET_MODE)
        log.info("DRA registration socket serving socket=%s", self.socket_path)

    async def _start(self) -> None:
        server = grpc.aio.server()
        handlers = {
            "GetInfo": grpc.unary_unary_rpc_method_handler(self._get_info),
            "NotifyRegistrationStatus": grpc.unary_unary_rpc_method_handler(
                self._notify, request_deserializer=api_pb2.RegistrationStatus.FromString
            ),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(REGISTRATION_SERVICE, handlers),))
        server.add_registered_method_handlers(REGISTRATION_SERVICE, handlers)
        if server.add_insecure_port(f"unix://{self.socket_path}") == 0:
            raise OSError(f"cannot listen on {self.socket_path}")
        await server.start()
        self._server = server

    def stop(self) -> None:
        """Stop serving and remove the socket: the plugin watcher deregisters the driver."""
        if self._server is not None:
            server, self._server = self._server, None
            self._loop.run(server.stop(0))
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()

    def restart(self) -> None:
        """Register again: a new socket under the same name is a new plugin to the watcher."""
        self.stop()
        self.registered = None
        self.start()

    async def _get_info(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return self._info

    async def _notify(self, status: api_pb2.RegistrationStatus, context: grpc.aio.ServicerContext) -> bytes:
        self.registered = status.plugin_registered
        if status.plugin_registered:
            log.info("DRA driver registered with the kubelet socket=%s", self.socket_path)
        else:
            log.error("the kubelet refused the DRA driver error=%r socket=%s", status.error, self.socket_path)
        self._on_status(status.plugin_registered, status.error)
        if not status.plugin_registered:  # as the Go helper does: the kubelet logs that we heard it
            await context.abort(grpc.StatusCode.UNKNOWN, f"registration failed: {status.error}")
        return b""
