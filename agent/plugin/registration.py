"""Registering resources with the kubelet (``v1beta1.Registration/Register`` on ``kubelet.sock``).

A registration costs one connection to ``kubelet.sock`` and one Register call; inside that call the kubelet
dials the plugin back and asks ``GetDevicePluginOptions``. ``register_all`` sends every resource's Register
at once over one connection (the kubelet handles each call on its own), so registering several resources
after a kubelet restart takes about as long as registering one.

The call is made with ``grpc.aio`` on the agent's gRPC loop (``agent.grpc_loop``), the loop that serves the
resources and so answers the kubelet's dial-back: grpcio's synchronous client (``grpc._channel`` with its
channel-spin thread, ~0.5 MB and a few milliseconds to load) is not loaded on the way to the first registration.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from pathlib import Path

import grpc
import grpc.aio
from msgspec import Struct

from agent.grpc_loop import GrpcLoop, grpc_loop
from agent.plugin import wire
from agent.plugin.server import PLUGIN_OPTIONS
from agent.plugin.watch import SocketIdentity, socket_identity

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
REGISTER_TIMEOUT = 15.0  # the kubelet dials the plugin back within Register, with its own 10 s limit
REGISTER_METHOD = "/v1beta1.Registration/Register"
# A unix socket needs no proxy lookup; a refused Register is answered by the caller's backoff, not retried;
# and every registration connects afresh (a shared connection could still be backing off from a kubelet
# that was down a moment ago).
CHANNEL_OPTIONS = (("grpc.enable_http_proxy", 0), ("grpc.enable_retries", 0), ("grpc.use_local_subchannel_pool", 1))


class RegistrationError(RuntimeError):
    """The kubelet refused or could not be reached; ``str()`` carries the kubelet's own text."""


def register(kubelet_socket: Path, endpoint: str, resource: str) -> None:
    """Register ``resource`` served on ``endpoint`` (a bare socket file name next to ``kubelet_socket``).

    The options go in the request too: kubelets before 1.26 read them from there, newer ones ask
    ``GetDevicePluginOptions``; both get the same answer.
    """
    error = register_all(kubelet_socket, [(endpoint, resource)])[resource]
    if error is not None:
        raise RegistrationError(error)


def register_all(
    kubelet_socket: Path, endpoints: Iterable[tuple[str, str]], *, loop: GrpcLoop | None = None
) -> dict[str, str | None]:
    """Register every ``(endpoint, resource)`` concurrently over one connection (from any thread but the loop's).

    Returns, per resource, ``None`` when the kubelet accepted it, else why not (the kubelet's own text).
    """
    return (loop or grpc_loop()).run(_register_all(kubelet_socket, tuple(endpoints)), REGISTER_TIMEOUT + 5.0)


def register_soon(
    kubelet_socket: Path,
    endpoints: Iterable[tuple[str, str]],
    answered: Callable[[dict[str, str | None]], None],
    *,
    loop: GrpcLoop | None = None,
) -> None:
    """Register like ``register_all``, without waiting: ``answered`` gets the answers on the gRPC loop's thread
    (it only hands them over). An attempt that fails as a whole answers every resource with why."""
    register_batch_soon(kubelet_socket, endpoints, lambda batch: answered(batch.answers), loop=loop)


class Answered(Struct, frozen=True):
    """The kubelet's answers to one batch of Registers, and which ``kubelet.sock`` gave them."""

    answers: dict[str, str | None]  # resource -> None (accepted) or why not
    kubelet: SocketIdentity | None  # the kubelet.sock there when they came (None: none)


def register_batch_soon(
    kubelet_socket: Path,
    endpoints: Iterable[tuple[str, str]],
    answered: Callable[[Answered], None],
    *,
    loop: GrpcLoop | None = None,
) -> None:
    """``register_soon`` that also tells which kubelet answered: a Register that reached a kubelet which had
    just started (before the agent heard of its ``kubelet.sock``) counts as that kubelet's registration.

    Only a live kubelet accepts a Register, so an accepted one was accepted by the ``kubelet.sock`` there when the
    answer came — unless in the milliseconds of the call one kubelet accepted it, died, and another started
    (then the first one's stream ends, and the agent registers again because of that)."""
    endpoints = tuple(endpoints)

    async def attempt() -> None:
        try:
            answers = await _register_all(kubelet_socket, endpoints)
        except Exception as error:  # a bug, not the kubelet: every resource hears of it and is retried
            answers = {resource: f"registration failed: {type(error).__name__}: {error}" for _, resource in endpoints}
        answered(Answered(answers, socket_identity(kubelet_socket)))

    (loop or grpc_loop()).submit(attempt())


async def _register_all(kubelet_socket: Path, endpoints: tuple[tuple[str, str], ...]) -> dict[str, str | None]:
    # No wait-for-ready: a socket nobody answers on fails at once (UNAVAILABLE) and is retried with backoff.
    async with grpc.aio.insecure_channel(f"unix://{kubelet_socket}", options=CHANNEL_OPTIONS) as channel:
        call = channel.unary_unary(
            REGISTER_METHOD,
            request_serializer=None,  # written by agent.plugin.wire
            response_deserializer=None,  # Empty: nothing to read
            _registered_method=True,
        )

        async def one(endpoint: str, resource: str) -> tuple[str, str | None]:
            request = wire.register_request(API_VERSION, endpoint, resource, PLUGIN_OPTIONS)
            try:
                await call(request, timeout=REGISTER_TIMEOUT)
            except grpc.RpcError as error:
                return resource, f"kubelet refused the registration: {error.code().name}: {error.details()}"
            return resource, None

        return dict(await asyncio.gather(*(one(endpoint, resource) for endpoint, resource in endpoints)))
