"""Registering a resource with the kubelet (``v1beta1.Registration/Register`` on ``kubelet.sock``)."""

from __future__ import annotations

from pathlib import Path

import grpc

from agent.api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from agent.plugin.server import plugin_options

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
REGISTER_TIMEOUT = 15.0  # the kubelet dials the plugin back within Register, with its own 10 s limit


class RegistrationError(RuntimeError):
    """The kubelet refused or could not be reached; ``str()`` carries the kubelet's own text."""


def register(kubelet_socket: Path, endpoint: str, resource: str) -> None:
    """Register ``resource`` served on ``endpoint`` (a bare socket file name next to ``kubelet_socket``).

    The options go in the request too: kubelets before 1.26 read them from there, newer ones ask
    ``GetDevicePluginOptions``; both get the same answer.
    """
    with grpc.insecure_channel(f"unix://{kubelet_socket}") as channel:
        # No wait-for-ready: a socket nobody answers on fails at once (UNAVAILABLE) and is retried with backoff.
        request = api_pb2.RegisterRequest(
            version=API_VERSION, endpoint=endpoint, resource_name=resource, options=plugin_options()
        )
        try:
            api_pb2_grpc.RegistrationStub(channel).Register(request, timeout=REGISTER_TIMEOUT)
        except grpc.RpcError as error:
            raise RegistrationError(
                f"kubelet refused the registration: {error.code().name}: {error.details()}"
            ) from error
