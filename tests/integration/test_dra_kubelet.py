"""The DRA kubelet emulator (``agent.sim.kubelet.dra``) against a small DRA plugin: the driver's real registration
socket (``agent.dra.registration.DraRegistrar``) and a canned DRAPlugin + health server written here, over real gRPC
on real unix sockets, with the API server stand-in spoken to through the real Kubernetes client."""

from __future__ import annotations

import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from agent.api.dra.v1 import api_pb2 as dra_v1
from agent.api.dra.v1 import api_pb2_grpc as dra_v1_grpc
from agent.api.dra.v1beta1 import api_pb2 as dra_v1beta1
from agent.api.dra.v1beta1 import api_pb2_grpc as dra_v1beta1_grpc
from agent.api.drahealth.v1alpha1 import api_pb2 as health_pb2
from agent.api.drahealth.v1alpha1 import api_pb2_grpc as health_grpc
from agent.api.pluginregistration.v1 import api_pb2 as reg_pb2
from agent.api.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from agent.dra.names import dra_socket, registration_socket
from agent.dra.registration import DRA_SERVICES, HEALTH_SERVICE, DraRegistrar
from agent.sim.apiserver import ApiServer
from agent.sim.kubelet.dra import PREPARE, UNPREPARE, DraKubeletEmulator, PodStartError
from tests.apiserver_fixtures import nvidia_gpu, nvidia_slice

DRIVER = "gpu.nvidia.com"
OTHER_DRIVER = "example.com"
NODE = "node-a"
POD_UID = "0b6b3d4e-1234-4cde-8f00-123456789abc"


# --------------------------------------------------------------------------------------------------
# A small DRA plugin with canned answers
# --------------------------------------------------------------------------------------------------


class DraPluginServer:
    """NodePrepareResources answers from the claim's allocation in the API server stand-in: one device per result of
    this driver, ``request_names`` = the result's request (none for requests in ``no_request_names``), CDI ID
    ``k8s.gpu.nvidia.com/claim=<uid>-<device>``. ``fail`` (claim name -> error) answers a per-claim error, ``skip``
    leaves claims out, ``extra_uid`` adds an entry nobody asked for. Health: ``send`` puts a message on every open
    NodeWatchResources stream, ``end_streams`` ends them."""

    def __init__(self, socket_path: Path, api: ApiServer) -> None:
        self.socket_path = socket_path
        self.api = api
        self.fail: dict[str, str] = {}
        self.skip: set[str] = set()
        self.extra_uid = ""
        self.no_request_names: set[str] = set()
        self.calls: list[tuple[str, str, list[str]]] = []  # (service, method, claim names)
        self.streams = 0  # NodeWatchResources streams opened
        self._open: list[queue.Queue[health_pb2.NodeWatchResourcesResponse | None]] = []
        self._lock = threading.Lock()
        self._server: grpc.Server | None = None

    def start(self, serve: tuple[str, ...] = ("v1.DRAPlugin", "v1beta1.DRAPlugin")) -> None:
        """Serve the DRA services in ``serve`` (and health) on the endpoint."""
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="test-dra-plugin"))
        if "v1.DRAPlugin" in serve:
            dra_v1_grpc.add_DRAPluginServicer_to_server(_DraServicer(self, "v1.DRAPlugin", dra_v1), server)
        if "v1beta1.DRAPlugin" in serve:
            servicer = _DraServicer(self, "v1beta1.DRAPlugin", dra_v1beta1)
            dra_v1beta1_grpc.add_DRAPluginServicer_to_server(servicer, server)
        health_grpc.add_DRAResourceHealthServicer_to_server(_HealthServicer(self), server)
        server.add_insecure_port(f"unix:{self.socket_path}")
        server.start()
        self._server = server

    def stop(self) -> None:
        if self._server is not None:
            self.end_streams()
            self._server.stop(0).wait(5)
            self._server = None
        self.socket_path.unlink(missing_ok=True)

    def send(self, message: health_pb2.NodeWatchResourcesResponse) -> None:
        with self._lock:
            for stream in self._open:
                stream.put(message)

    def end_streams(self) -> None:
        with self._lock:
            for stream in self._open:
                stream.put(None)

    def stream(self, context: grpc.ServicerContext) -> Iterator[health_pb2.NodeWatchResourcesResponse]:
        messages: queue.Queue[health_pb2.NodeWatchResourcesResponse | None] = queue.Queue()
        if not context.add_callback(lambda: messages.put(None)):  # the kubelet went: wake the loop below
            return  # the call ended before its callback could be added: nobody would ever wake the loop
        with self._lock:
            self._open.append(messages)
            self.streams += 1
        try:
            while context.is_active():  # a stream the server cancelled ends too, woken or not
                try:
                    message = messages.get(timeout=1.0)
                except queue.Empty:
                    continue
                if message is None:
                    return
                yield message
        finally:
            with self._lock:
                self._open.remove(messages)

    def calls_of(self, method: str) -> list[tuple[str, str, list[str]]]:
        with self._lock:
            return [c for c in self.calls if c[1] == method]

    def answer(self, service: str, method: str, request: Any, messages: Any) -> Any:
        names = [c.name for c in request.claims]
        with self._lock:
            self.calls.append((service, method, names))
        if method == "NodeUnprepareResources":
            response = messages.NodeUnprepareResourcesResponse()
            for claim in request.claims:
                if claim.name in self.skip:
                    continue
                response.claims[claim.uid].SetInParent()
                if claim.name in self.fail:
                    response.claims[claim.uid].error = self.fail[claim.name]
            return response
        response = messages.NodePrepareResourcesResponse()
        for claim in request.claims:
            if claim.name in self.skip:
                continue
            entry = response.claims[claim.uid]
            if claim.name in self.fail:
                entry.error = self.fail[claim.name]
                continue
            stored = self.api.get("ResourceClaim", claim.name, claim.namespace) or {}
            for result in stored.get("status", {}).get("allocation", {}).get("devices", {}).get("results", []):
                if result["driver"] != DRIVER:
                    continue
                entry.devices.add(
                    request_names=[] if result["request"] in self.no_request_names else [result["request"]],
                    pool_name=result["pool"],
                    device_name=result["device"],
                    cdi_device_ids=[f"k8s.{DRIVER}/claim={claim.uid}-{result['device']}"],
                )
        if self.extra_uid:
            response.claims[self.extra_uid].SetInParent()
        return response


class _DraServicer:
    def __init__(self, plugin: DraPluginServer, service: str, messages: Any) -> None:
        self._plugin, self._service, self._messages = plugin, service, messages

    def NodePrepareResources(self, request, context):
        return self._plugin.answer(self._service, "NodePrepareResources", request, self._messages)

    def NodeUnprepareResources(self, request, context):
        return self._plugin.answer(self._service, "NodeUnprepareResources", request, self._messages)


class _HealthServicer(health_grpc.DRAResourceHealthServicer):
    def __init__(self, plugin: DraPluginServer) -> None:
        self._plugin = plugin

    def NodeWatchResources(self, request, context):
        yield from self._plugin.stream(context)


def health_message(*devices: tuple[str, int], timeout: int = 0) -> health_pb2.NodeWatchResourcesResponse:
    return health_pb2.NodeWatchResourcesResponse(
        devices=[
            health_pb2.DeviceHealth(
                device=health_pb2.DeviceIdentifier(pool_name=NODE, device_name=name),
                health=status,
                last_updated_time=int(time.time()),
                health_check_timeout_seconds=timeout,
            )
            for name, status in devices
        ]
    )


# --------------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="drak", dir="/tmp"))  # unix socket paths must stay short
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def api() -> Iterator[ApiServer]:
    with ApiServer() as server:
        server.add_node(NODE)
        server.add_node("node-b")
        yield server


class Plugin:
    """The driver as a node runs it: the real registration socket plus the canned DRA server."""

    def __init__(
        self,
        base: Path,
        api: ApiServer,
        services: tuple[str, ...],
        pod_uid: str | None = None,
        serve: tuple[str, ...] = ("v1.DRAPlugin", "v1beta1.DRAPlugin"),
    ) -> None:
        self.endpoint = dra_socket(base / "plugins", DRIVER)
        self.server = DraPluginServer(self.endpoint, api)
        self.serve = serve
        self.heard: list[tuple[bool, str]] = []
        self.registrar = DraRegistrar(
            registration_socket(base / "plugins_registry", DRIVER, pod_uid),
            DRIVER,
            self.endpoint,
            services,
            on_status=lambda registered, error: self.heard.append((registered, error)),
        )

    def start(self) -> Plugin:
        self.server.start(self.serve)
        self.registrar.start()
        return self

    def stop(self) -> None:
        self.registrar.stop()
        self.server.stop()


@pytest.fixture
def make_plugin(base: Path, api: ApiServer) -> Iterator[Callable[..., Plugin]]:
    plugins: list[Plugin] = []

    def make(
        services: tuple[str, ...] = (*DRA_SERVICES, HEALTH_SERVICE),
        pod_uid: str | None = None,
        serve: tuple[str, ...] = ("v1.DRAPlugin", "v1beta1.DRAPlugin"),
    ) -> Plugin:
        """``services``: what the registration socket advertises; ``serve``: the DRA services the endpoint serves."""
        plugin = Plugin(base, api, services, pod_uid, serve)
        plugins.append(plugin)
        return plugin.start()

    yield make
    for plugin in plugins:
        plugin.stop()


@pytest.fixture
def make_kubelet(base: Path, api: ApiServer) -> Iterator[Callable[..., DraKubeletEmulator]]:
    kubelets: list[DraKubeletEmulator] = []

    def make(**options: Any) -> DraKubeletEmulator:
        kubelet = DraKubeletEmulator(base / "plugins_registry", NODE, api.api_client(), **options)
        kubelets.append(kubelet)
        kubelet.start()
        return kubelet

    yield make
    for kubelet in kubelets:
        kubelet.stop()
    left = [t.name for t in threading.enumerate() if t.name.startswith("kubelet-dra")]
    assert left == [], f"threads left behind by stop(): {left}"


def allocated_claim(api: ApiServer, name: str, devices: list[tuple[str, str]], driver: str = DRIVER) -> dict:
    """A claim with one request per (request, device) pair, allocated to those devices of this node's pool."""
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": r, "exactly": {"deviceClassName": DRIVER}} for r, _ in devices]}},
        "status": {
            "allocation": {
                "devices": {
                    "results": [{"request": r, "driver": driver, "pool": NODE, "device": d} for r, d in devices]
                }
            }
        },
    }
    return api.create("ResourceClaim", claim)


def registered(kubelet: DraKubeletEmulator, plugin: Plugin, times: int = 1) -> None:
    """Wait until the kubelet has registered the plugin ``times`` times (NotifyRegistrationStatus answered) and its
    DRA connection is up."""
    socket = str(plugin.registrar.socket_path)
    kubelet.wait_for(
        lambda: len([e for e in kubelet.registration_events("registered") if e.socket == socket]) >= times,
        what="registration",
    )
    kubelet.wait_for(lambda: (view := kubelet.plugin(DRIVER)) is not None and view.connected, what="the connection")


def slices_of(api: ApiServer, node: str, driver: str | None = None) -> list[dict]:
    return [
        s
        for s in api.objects("ResourceSlice")
        if s["spec"].get("nodeName") == node and driver in (None, s["spec"]["driver"])
    ]


# --------------------------------------------------------------------------------------------------
# Start: the node's slices go, nobody else's
# --------------------------------------------------------------------------------------------------


def test_start_wipes_only_this_nodes_slices(api: ApiServer, make_kubelet) -> None:
    api.create("ResourceSlice", nvidia_slice(NODE, [nvidia_gpu(0)]))
    api.create("ResourceSlice", nvidia_slice(NODE, [nvidia_gpu(1)], driver=OTHER_DRIVER))
    api.create("ResourceSlice", nvidia_slice("node-b", [nvidia_gpu(0)]))

    kubelet = make_kubelet()

    assert slices_of(api, NODE) == []
    assert [s["spec"]["nodeName"] for s in api.objects("ResourceSlice")] == ["node-b"]
    (wipe,) = kubelet.wipes(reason="start")
    assert (wipe.state, wipe.field_selector, wipe.attempts) == ("done", f"spec.nodeName={NODE}", 1)
    assert api.count("deletecollection", "resourceslices") == 1


def test_start_wipe_retries_while_the_api_server_fails(api: ApiServer, make_kubelet) -> None:
    api.create("ResourceSlice", nvidia_slice(NODE, [nvidia_gpu(0)]))
    api.fail_next("deletecollection", "resourceslices", 503)

    kubelet = make_kubelet()  # start() waits for the wipe: one failure, then the retry after ~1 s

    assert slices_of(api, NODE) == []
    (wipe,) = kubelet.wipes(reason="start")
    assert (wipe.state, wipe.attempts) == ("done", 2)


# --------------------------------------------------------------------------------------------------
# Registration
# --------------------------------------------------------------------------------------------------


def test_the_watcher_takes_sockets_only_and_no_hidden_names(base: Path, make_kubelet, make_plugin) -> None:
    registry = base / "plugins_registry"
    registry.mkdir(parents=True)
    (registry / "notes-reg.sock").write_text("a regular file, not a socket")
    hidden = DraRegistrar(registry / ".hidden-reg.sock", DRIVER, base / "plugins" / "hidden.sock")
    hidden.start()
    try:
        kubelet = make_kubelet()  # the initial walk runs in start()
        assert kubelet.watched_sockets() == []
        plugin = make_plugin()
        registered(kubelet, plugin)
        assert kubelet.watched_sockets() == [str(plugin.registrar.socket_path)]
        assert {e.socket for e in kubelet.registration_events()} == {str(plugin.registrar.socket_path)}
        assert hidden.registered is None  # never called
    finally:
        hidden.stop()


@pytest.mark.parametrize(
    ("version", "offered", "service"),
    [
        ("1.36", DRA_SERVICES, "v1.DRAPlugin"),
        ("1.33", DRA_SERVICES, "v1beta1.DRAPlugin"),  # 1.33 knows no v1
        ("1.36", ("v1beta1.DRAPlugin", "v1.DRAPlugin"), "v1beta1.DRAPlugin"),  # 1.34+: the plugin's order decides
        ("1.36", ("v1beta1.DRAPlugin",), "v1beta1.DRAPlugin"),  # a plugin offering only v1beta1 is still called
        ("1.33", ("v1alpha4.Node", "v1beta1.DRAPlugin"), "v1beta1.DRAPlugin"),  # 1.33: the kubelet's own order
    ],
)
def test_registration_picks_the_service_by_the_releases_rule(
    api: ApiServer, make_kubelet, make_plugin, version: str, offered: tuple[str, ...], service: str
) -> None:
    kubelet = make_kubelet(kubelet_version=version)
    plugin = make_plugin(services=(*offered, HEALTH_SERVICE), serve=(service,))
    registered(kubelet, plugin)

    assert plugin.heard == [(True, "")]
    view = kubelet.plugin(DRIVER)
    assert (view.endpoint, view.service) == (str(plugin.endpoint), service)
    (event,) = kubelet.registration_events("registered")
    assert (event.socket, event.driver, event.service) == (str(plugin.registrar.socket_path), DRIVER, service)

    # calls go through the chosen service's wire path
    allocated_claim(api, "c1", [("gpu", "gpu-0")])
    kubelet.run_pod("default", "p1", POD_UID, [("gpu", "c1")], {"main": [("gpu", None)]})
    assert plugin.server.calls_of("NodePrepareResources") == [(service, "NodePrepareResources", ["c1"])]


def test_a_1_33_kubelet_falls_back_to_v1alpha4_which_the_plugin_does_not_serve(
    api: ApiServer, make_kubelet, make_plugin
) -> None:
    """1.33 refuses no plugin that lists services: none it knows means v1alpha4 (plugins of 1.32 listed none), so
    the plugin registers and every call fails. It opens no health stream (1.34+)."""
    kubelet = make_kubelet(kubelet_version="1.33", wipe_delay=0.2)
    plugin = make_plugin(services=("v1.DRAPlugin", HEALTH_SERVICE))
    registered(kubelet, plugin)

    assert plugin.heard == [(True, "")]
    assert kubelet.plugin(DRIVER).service == "v1alpha4.Node"
    allocated_claim(api, "c1", [("gpu", "gpu-0")])
    with pytest.raises(PodStartError) as failure:
        kubelet.run_pod("default", "p1", POD_UID, [("gpu", "c1")], {"main": [("gpu", None)]})
    assert failure.value.message.startswith(
        "prepare dynamic resources: NodePrepareResources: rpc error: code = Unimplemented desc ="
    )
    assert plugin.server.calls == []
    assert (kubelet.health_streams(DRIVER), plugin.server.streams) == (0, 0)


def test_the_service_is_not_chosen_again_at_call_time(api: ApiServer, make_kubelet, make_plugin) -> None:
    """A plugin that advertises v1 but serves only v1beta1: the kubelet calls v1 and fails; nothing falls back."""
    kubelet = make_kubelet()
    plugin = make_plugin(serve=("v1beta1.DRAPlugin",))
    registered(kubelet, plugin)
    allocated_claim(api, "c1", [("gpu", "gpu-0")])

    with pytest.raises(PodStartError, match="code = Unimplemented"):
        kubelet.run_pod("default", "p1", POD_UID, [("gpu", "c1")], {"main": [("gpu", None)]})
    assert plugin.server.calls == []


def test_a_1_32_kubelet_refuses_a_plugin_that_lists_grpc_services(api: ApiServer, make_kubelet, make_plugin) -> None:
    """Up to 1.32 ``supported_versions`` are semantic versions: Tessera's service names are no versions at all."""
    kubelet = make_kubelet(kubelet_version="1.32")
    plugin = make_plugin()
    kubelet.wait_for(lambda: plugin.heard, what="NotifyRegistrationStatus")

    listed = " ".join((*DRA_SERVICES, HEALTH_SERVICE))
    assert plugin.heard[0] == (
        False,
        "RegisterPlugin error -- plugin validation failed with err: invalid versions of plugin "
        f"{DRIVER}: none of the versions are supported: could not find a highest supported version from versions "
        f'([{listed}]) reported: illegal version string "{DRA_SERVICES[0]}"',
    )
    assert kubelet.plugin(DRIVER) is None


def test_a_1_32_kubelet_wipes_a_deregistered_drivers_slices_at_once(api: ApiServer, make_kubelet, make_plugin) -> None:
    """No 30 s grace before 1.33: the slices go as soon as the registration socket does, and the driver coming back
    at once does not save them (nothing cancels the wipe)."""
    kubelet = make_kubelet(kubelet_version="1.32")  # wipe_delay keeps its 30 s default, unused up to 1.32
    plugin = make_plugin(services=("1.0.0",))
    registered(kubelet, plugin)
    assert (kubelet.plugin(DRIVER).service, plugin.heard) == ("v1alpha4.Node", [(True, "")])
    api.create("ResourceSlice", nvidia_slice(NODE, [nvidia_gpu(0)]))
    api.create("ResourceSlice", nvidia_slice(NODE, [nvidia_gpu(1)], driver=OTHER_DRIVER))

    plugin.registrar.restart()  # socket deleted and served again

    api.wait_for(lambda: not slices_of(api, NODE, DRIVER), timeout=5)  # long before any 30 s delay
    kubelet.wait_for(lambda: len(kubelet.registration_events("registered")) == 2, what="the second registration")
    (wipe,) = kubelet.wait_for(lambda: kubelet.wipes(reason="driver", state="done"), what="the wipe record")
    assert wipe.field_selector == f"spec.driver={DRIVER},spec.nodeName={NODE}"
    assert kubelet.wipes(reason="driver", state="cancelled") == []
    assert len(slices_of(api, NODE, OTHER_DRIVER)) == 1


def test_a_1_32_kubelet_holds_one_endpoint_per_driver(base: Path, api: ApiServer, make_kubelet, make_plugin) -> None:
    """A second registration of the driver needs a higher version, and replaces the first; the first one's socket
    going then deregisters the driver, successor included."""
    kubelet = make_kubelet(kubelet_version="1.32")
    first = make_plugin(services=("1.0.0",))
    registered(kubelet, first)
    heard: list[tuple[bool, str]] = []

    def second(version: str, uid: str) -> DraRegistrar:
        return DraRegistrar(
            registration_socket(first.registrar.socket_path.parent, DRIVER, uid),
            DRIVER,
            dra_socket(base / "plugins", DRIVER, uid),
            (version,),
            on_status=lambda registered, error: heard.append((registered, error)),
        )

    same = second("1.0.0", POD_UID)
    same.start()
    try:
        kubelet.wait_for(lambda: heard, what="the equal version's outcome")
        assert heard == [
            (
                False,
                "RegisterPlugin error -- plugin validation failed with err: invalid versions of plugin "
                f'{DRIVER}: another plugin instance is already registered with a higher supported version: "1.0.0" '
                '< "1.0.0"',
            )
        ]
    finally:
        same.stop()
    newer_uid = "0b6b3d4e-1234-4cde-8f00-123456789abd"
    newer = second("1.1.0", newer_uid)
    newer.start()
    try:
        kubelet.wait_for(lambda: len(heard) == 2, what="the higher version's outcome")
        assert heard[1] == (True, "")
        assert [p.endpoint for p in kubelet.endpoints(DRIVER)] == [str(dra_socket(base / "plugins", DRIVER, newer_uid))]

        first.registrar.stop()

        kubelet.wait_for(lambda: kubelet.endpoints(DRIVER) == [], what="the driver deregistered")
        kubelet.wait_for(lambda: kubelet.wipes(reason="driver", state="done"), what="its slices wiped")
    finally:
        newer.stop()


def test_a_1_33_kubelet_wipes_after_deregistration_not_after_a_lost_connection(
    api: ApiServer, make_kubelet, make_plugin
) -> None:
    kubelet = make_kubelet(kubelet_version="1.33", wipe_delay=0.2)
    plugin = make_plugin()
    registered(kubelet, plugin)
    api.create("ResourceSlice", nvidia_slice(NODE, [nvidia_gpu(0)]))

    plugin.server.stop()  # the DRA endpoint goes, the registration socket stays
    kubelet.wait_for(lambda: not kubelet.plugin(DRIVER).connected, what="the lost connection")
    assert (kubelet.pending_wipes(), kubelet.wipes(reason="driver")) == ({}, [])
    assert len(slices_of(api, NODE, DRIVER)) == 1

    plugin.registrar.stop()
    api.wait_for(lambda: not slices_of(api, NODE, DRIVER), timeout=5)
    (done,) = kubelet.wait_for(lambda: kubelet.wipes(reason="driver", state="done"), what="the wipe record")
    assert done.at - done.fire_at >= 0  # after the delay, not before


def test_an_empty_service_list_is_refused_and_an_empty_endpoint_means_the_socket(base: Path, make_kubelet) -> None:
    """A hand-written registration server: the kubelet's checks on what GetInfo says."""
    kubelet = make_kubelet()
    heard: list[tuple[bool, str]] = []

    class Registration(reg_grpc.RegistrationServicer):
        def __init__(self, info: reg_pb2.PluginInfo) -> None:
            self.info = info

        def GetInfo(self, request, context):
            return self.info

        def NotifyRegistrationStatus(self, request, context):
            heard.append((request.plugin_registered, request.error))
            return reg_pb2.RegistrationStatusResponse()

    def serve(name: str, info: reg_pb2.PluginInfo) -> tuple[grpc.Server, Path]:
        path = base / "plugins_registry" / name
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        reg_grpc.add_RegistrationServicer_to_server(Registration(info), server)
        server.add_insecure_port(f"unix:{path}")
        server.start()
        return server, path

    empty, empty_path = serve("empty-reg.sock", reg_pb2.PluginInfo(type="DRAPlugin", name=DRIVER, endpoint="/x.sock"))
    itself, itself_path = serve(
        "self-reg.sock", reg_pb2.PluginInfo(type="DRAPlugin", name=OTHER_DRIVER, supported_versions=["v1.DRAPlugin"])
    )
    try:
        kubelet.wait_for(lambda: len(heard) >= 2, what="two registrations")
        assert (
            False,
            "RegisterPlugin error -- plugin validation failed with err: invalid supported gRPC versions of DRA "
            f"driver plugin {DRIVER} at endpoint /x.sock: empty list of supported gRPC services (aka supported "
            "versions)",
        ) in heard
        assert (True, "") in heard
        assert [p.endpoint for p in kubelet.endpoints(OTHER_DRIVER)] == [str(itself_path)]
    finally:
        for server, path in ((empty, empty_path), (itself, itself_path)):
            server.stop(0).wait(5)
            path.unlink(missing_ok=True)


def test_a_second_registration_of_the_same_endpoint_is_refused(api: ApiServer, make_kubelet, make_plugin) -> None:
    kubelet = make_kubelet()
    first = make_plugin()
    registered(kubelet, first)
    # a second registration socket (a rolling update's name) pointing at the same DRA endpoint
    second = DraRegistrar(
        registration_socket(first.registrar.socket_path.parent, DRIVER, POD_UID),
        DRIVER,
        first.endpoint,
        DRA_SERVICES,
        on_status=lambda registered, error: heard.append((registered, error)),
    )
    heard: list[tuple[bool, str]] = []
    second.start()
    try:
        kubelet.wait_for(lambda: heard, what="the second registration's outcome")
        assert heard == [
            (
                False,
                "RegisterPlugin error -- plugin registration failed with err: endpoint "
                f"{first.endpoint} already registered for DRA driver plugin {DRIVER}",
            )
        ]
        assert [p.endpoint for p in kubelet.endpoints(DRIVER)] == [str(first.endpoint)]
    finally:
        second.stop()


def test_calls_go_to_the_newest_connected_endpoint(base: Path, api: ApiServer, make_kubelet, make_plugin) -> None:
    """A rolling update: a second instance registers its own endpoint; when its DRA server goes (its registration
    socket staying), the kubelet falls back to the older, connected endpoint and schedules no wipe."""
    kubelet = make_kubelet(wipe_delay=0.2)
    old = make_plugin()
    registered(kubelet, old)
    new_endpoint = dra_socket(base / "plugins", DRIVER, POD_UID)
    new_server = DraPluginServer(new_endpoint, api)
    new_server.start()
    new = DraRegistrar(
        registration_socket(old.registrar.socket_path.parent, DRIVER, POD_UID), DRIVER, new_endpoint, DRA_SERVICES
    )
    new.start()
    try:
        kubelet.wait_for(lambda: (v := kubelet.plugin(DRIVER)) and v.endpoint == str(new_endpoint) and v.connected)
        assert [p.endpoint for p in kubelet.endpoints(DRIVER)] == [str(old.endpoint), str(new_endpoint)]

        new_server.stop()

        kubelet.wait_for(lambda: kubelet.plugin(DRIVER).endpoint == str(old.endpoint), what="the fallback")
        allocated_claim(api, "c1", [("gpu", "gpu-0")])
        kubelet.run_pod("default", "p1", POD_UID, [("gpu", "c1")], {"main": [("gpu", None)]})
        assert len(old.server.calls_of("NodePrepareResources")) == 1
        assert new_server.calls_of("NodePrepareResources") == []
        assert kubelet.pending_wipes() == {}
    finally:
        new.stop()
        new_server.stop()


# --------------------------------------------------------------------------------------------------
# Pods: prepare batched per driver, the kubelet's answer rules, CDI per container, shared claims
# --------------------------------------------------------------------------------------------------


def test_a_pod_with_two_claims_of_one_driver_makes_one_prepare_call(api: ApiServer, make_kubelet, make_plugin) -> None:
    kubelet = make_kubelet()
    plugin = make_plugin()
    registered(kubelet, plugin)
    c1 = allocated_claim(api, "c1", [("gpu", "gpu-0")])
    c2 = allocated_claim(api, "c2", [("gpu", "gpu-1")])

    cdi = kubelet.run_pod(
        "default", "p1", POD_UID, [("a", "c1"), ("b", "c2")], {"one": [("a", None)], "two": [("b", None)]}
    )

    uid1, uid2 = c1["metadata"]["uid"], c2["metadata"]["uid"]
    assert cdi == {"one": [f"k8s.{DRIVER}/claim={uid1}-gpu-0"], "two": [f"k8s.{DRIVER}/claim={uid2}-gpu-1"]}
    assert plugin.server.calls_of("NodePrepareResources") == [("v1.DRAPlugin", "NodePrepareResources", ["c1", "c2"])]
    (call,) = kubelet.calls(PREPARE)
    assert (call.claim_uids, call.outcome, call.pod_uid) == ((uid1, uid2), "", POD_UID)
    assert set(kubelet.prepared_claims()) == {uid1, uid2}
    # the pod was added to reservedFor, as the scheduler would have
    reserved = api.get("ResourceClaim", "c1", "default")["status"]["reservedFor"]
    assert reserved == [{"resource": "pods", "name": "p1", "uid": POD_UID}]
    device = kubelet.prepared_claims()[uid1].devices[0]
    assert (device.pool, device.device, device.request_names, device.share_id) == (NODE, "gpu-0", ("gpu",), None)


@pytest.mark.parametrize(
    ("fault", "text"),
    [
        ("fail", "NodePrepareResources failed for ResourceClaim c2: device gpu-1 is not healthy"),
        ("skip", "NodePrepareResources skipped 1 ResourceClaims"),
        ("extra", "NodePrepareResources returned result for unknown claim UID 00000000-dead-beef-0000-000000000000"),
    ],
)
def test_a_bad_answer_fails_the_pod_with_the_kubelets_text_and_a_retry_succeeds(
    api: ApiServer, make_kubelet, make_plugin, fault: str, text: str
) -> None:
    kubelet = make_kubelet()
    plugin = make_plugin()
    registered(kubelet, plugin)
    allocated_claim(api, "c1", [("gpu", "gpu-0")])
    allocated_claim(api, "c2", [("gpu", "gpu-1")])
    if fault == "fail":
        plugin.server.fail["c2"] = "device gpu-1 is not healthy"
    elif fault == "skip":
        plugin.server.skip.add("c2")
    else:
        plugin.server.extra_uid = "00000000-dead-beef-0000-000000000000"

    with pytest.raises(PodStartError) as failure:
        kubelet.run_pod("default", "p1", POD_UID, [("a", "c1"), ("b", "c2")], {"main": [("a", None), ("b", None)]})
    assert failure.value.message == f"prepare dynamic resources: {text}"
    assert failure.value.reason == "FailedPrepareDynamicResources"
    assert kubelet.prepared_claims() == {}  # nothing is marked prepared when a batch fails
    assert kubelet.pod(POD_UID).error == failure.value.message

    plugin.server.fail.clear()
    plugin.server.skip.clear()
    plugin.server.extra_uid = ""
    cdi = kubelet.retry_pod(POD_UID)

    assert len(cdi["main"]) == 2
    calls = plugin.server.calls_of("NodePrepareResources")
    assert [names for _, _, names in calls] == [["c1", "c2"], ["c1", "c2"]]  # neither was prepared the first time
    assert [c.outcome for c in kubelet.calls(PREPARE)] == [text, ""]


def test_containers_get_the_cdi_ids_of_their_requests(api: ApiServer, make_kubelet, make_plugin) -> None:
    kubelet = make_kubelet()
    plugin = make_plugin()
    registered(kubelet, plugin)
    plugin.server.no_request_names.add("shared")  # a device answered without request_names goes to every container
    claim = allocated_claim(api, "c1", [("train", "gpu-0"), ("infer", "gpu-1"), ("shared", "gpu-2")])
    uid = claim["metadata"]["uid"]

    cdi = kubelet.run_pod(
        "default",
        "p1",
        POD_UID,
        [("gpus", "c1")],
        {"trainer": [("gpus", "train")], "server": [("gpus", "infer")], "all": [("gpus", None)], "none": []},
    )

    cdi_id = f"k8s.{DRIVER}/claim={uid}-gpu-{{}}".format
    assert cdi == {
        "trainer": [cdi_id(0), cdi_id(2)],
        "server": [cdi_id(1), cdi_id(2)],
        "all": [cdi_id(0), cdi_id(1), cdi_id(2)],
        "none": [],
    }


def test_a_shared_claim_is_unprepared_only_when_its_last_pod_stops(api: ApiServer, make_kubelet, make_plugin) -> None:
    kubelet = make_kubelet()
    plugin = make_plugin()
    registered(kubelet, plugin)
    claim = allocated_claim(api, "shared", [("gpu", "gpu-0")])
    uid = claim["metadata"]["uid"]
    second_uid = "0b6b3d4e-1234-4cde-8f00-123456789abd"

    first = kubelet.run_pod("default", "p1", POD_UID, [("gpu", "shared")], {"main": [("gpu", None)]})
    second = kubelet.run_pod("default", "p2", second_uid, [("gpu", "shared")], {"main": [("gpu", None)]})

    assert first == second
    assert len(kubelet.calls(PREPARE)) == 1  # the second pod found the claim prepared
    assert kubelet.prepared_claims()[uid].pod_uids == {POD_UID, second_uid}

    kubelet.stop_pod(POD_UID)
    assert kubelet.calls(UNPREPARE) == []
    assert kubelet.prepared_claims()[uid].pod_uids == {second_uid}

    kubelet.stop_pod(second_uid)
    (call,) = kubelet.calls(UNPREPARE)
    assert (call.claim_uids, call.outcome) == ((uid,), "")
    assert plugin.server.calls_of("NodeUnprepareResources") == [("v1.DRAPlugin", "NodeUnprepareResources", ["shared"])]
    assert kubelet.claims() == []
    assert "reservedFor" not in api.get("ResourceClaim", "shared", "default")["status"]


# --------------------------------------------------------------------------------------------------
# Deregistration and the delayed wipe of the driver's slices
# --------------------------------------------------------------------------------------------------


def test_a_deleted_socket_deregisters_and_the_drivers_slices_go_after_the_delay(
    api: ApiServer, make_kubelet, make_plugin
) -> None:
    kubelet = make_kubelet(wipe_delay=0.2)
    plugin = make_plugin()
    registered(kubelet, plugin)
    api.create("ResourceSlice", nvidia_slice(NODE, [nvidia_gpu(0)]))
    api.create("ResourceSlice", nvidia_slice(NODE, [nvidia_gpu(1)], driver=OTHER_DRIVER))
    api.create("ResourceSlice", nvidia_slice("node-b", [nvidia_gpu(0)]))

    plugin.registrar.stop()  # the registration socket goes

    kubelet.wait_for(lambda: kubelet.registration_events("deregistered"), what="deregistration")
    assert kubelet.endpoints(DRIVER) == []
    api.wait_for(lambda: not slices_of(api, NODE, DRIVER), timeout=5)
    assert len(slices_of(api, NODE, OTHER_DRIVER)) == 1
    assert len(slices_of(api, "node-b")) == 1
    done = kubelet.wait_for(lambda: kubelet.wipes(reason="driver", state="done"), what="the wipe record")
    assert done[0].field_selector == f"spec.driver={DRIVER},spec.nodeName={NODE}"
    assert done[0].at - done[0].fire_at >= 0  # not before its deadline


def test_a_driver_that_registers_again_in_time_keeps_its_slices(api: ApiServer, make_kubelet, make_plugin) -> None:
    kubelet = make_kubelet(wipe_delay=1.0)
    plugin = make_plugin()
    registered(kubelet, plugin)
    api.create("ResourceSlice", nvidia_slice(NODE, [nvidia_gpu(0)]))

    plugin.registrar.restart()  # socket deleted and served again: deregistered, then registered anew

    kubelet.wait_for(lambda: len(kubelet.registration_events("registered")) == 2, what="the second registration")
    kubelet.wait_for(lambda: kubelet.plugin(DRIVER).connected and not kubelet.pending_wipes(), what="no pending wipe")
    scheduled = [w for w in kubelet.wipes(reason="driver", state="scheduled")]
    assert scheduled, "the deregistration scheduled a wipe"
    deadline = max(w.fire_at for w in scheduled)
    kubelet.wait_for(lambda: time.monotonic() > deadline + 0.2, timeout=3, what="the wipe's deadline to pass")

    assert kubelet.wipes(reason="driver", state="done") == []
    assert len(slices_of(api, NODE, DRIVER)) == 1
    assert api.count("deletecollection", "resourceslices") == 1  # only the one at start


# --------------------------------------------------------------------------------------------------
# Health stream
# --------------------------------------------------------------------------------------------------


def test_device_health_follows_the_stream_and_times_out(api: ApiServer, make_kubelet, make_plugin) -> None:
    kubelet = make_kubelet(health_retry_period=0.2)
    plugin = make_plugin()
    registered(kubelet, plugin)
    kubelet.wait_for(lambda: plugin.server.streams == 1, what="the health stream")

    def health(device: str) -> str:
        return kubelet.device_health(DRIVER, NODE, device)

    assert health("gpu-0") == "Unknown"
    plugin.server.send(health_message(("gpu-0", health_pb2.UNHEALTHY), ("gpu-1", health_pb2.HEALTHY)))
    kubelet.wait_for(lambda: health("gpu-0") == "Unhealthy", what="Unhealthy")
    assert health("gpu-1") == "Healthy"

    plugin.server.send(health_message(("gpu-0", health_pb2.HEALTHY), ("gpu-1", health_pb2.HEALTHY)))
    kubelet.wait_for(lambda: health("gpu-0") == "Healthy", what="Healthy again")

    # a report with a 1 s timeout and nothing after it: Unknown once it is older than that
    plugin.server.send(health_message(("gpu-0", health_pb2.HEALTHY), timeout=1))
    kubelet.wait_for(lambda: kubelet.health_messages(DRIVER) == 3, what="the third message")
    received = time.monotonic()
    assert health("gpu-0") == "Healthy"
    kubelet.wait_for(lambda: health("gpu-0") == "Unknown", timeout=3, what="Unknown after the timeout")
    assert time.monotonic() - received >= 0.9
    assert health("gpu-1") == "Healthy"  # its 30 s have not passed

    # the stream ends: the driver's cache is cleared, and the kubelet opens it again after the retry period
    plugin.server.end_streams()
    kubelet.wait_for(lambda: health("gpu-1") == "Unknown", what="the cache cleared")
    kubelet.wait_for(lambda: plugin.server.streams == 2, what="the stream opened again")
    plugin.server.send(health_message(("gpu-1", health_pb2.UNHEALTHY)))
    kubelet.wait_for(lambda: health("gpu-1") == "Unhealthy", what="Unhealthy on the new stream")


# --------------------------------------------------------------------------------------------------
# Kubelet restart
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("version", "copies"), [("1.36", 2), ("1.37", 1)])
def test_a_kubelet_restart_wipes_slices_and_prepares_a_shared_claim_again(
    api: ApiServer, make_kubelet, make_plugin, version: str, copies: int
) -> None:
    """Up to 1.36 the claim prepared again after the restart holds its devices twice (the answer is appended to
    what the checkpoint restored): the new pod's container gets each CDI ID twice (kubernetes#140471)."""
    kubelet = make_kubelet(kubelet_version=version)
    plugin = make_plugin()
    registered(kubelet, plugin)
    claim = allocated_claim(api, "c1", [("gpu", "gpu-0")])
    first = kubelet.run_pod("default", "p1", POD_UID, [("gpu", "c1")], {"main": [("gpu", None)]})
    api.create("ResourceSlice", nvidia_slice(NODE, [nvidia_gpu(0)]))  # what the driver had published

    kubelet.restart()

    assert slices_of(api, NODE) == []
    assert [w.state for w in kubelet.wipes(reason="start")] == ["done", "done"]
    registered(kubelet, plugin, times=2)
    assert plugin.heard == [(True, ""), (True, "")]
    assert kubelet.prepared_claims() == {}  # the prepared flags were in memory only
    assert kubelet.pod(POD_UID).running  # the running pod was not prepared again
    assert kubelet.run_pod("default", "p1", POD_UID, [("gpu", "c1")], {"main": [("gpu", None)]}) == first
    assert len(plugin.server.calls_of("NodePrepareResources")) == 1

    second_uid = "0b6b3d4e-1234-4cde-8f00-123456789abd"
    second = kubelet.run_pod("default", "p2", second_uid, [("gpu", "c1")], {"main": [("gpu", None)]})

    assert second == {"main": first["main"] * copies}
    assert [names for _, _, names in plugin.server.calls_of("NodePrepareResources")] == [["c1"], ["c1"]]
    state = kubelet.prepared_claims()[claim["metadata"]["uid"]]
    assert state.pod_uids == {POD_UID, second_uid}
    assert [d.device for d in state.devices] == ["gpu-0"] * copies
    assert kubelet.pod(POD_UID).cdi == {"main": tuple(first["main"])}  # the running pod's containers were made before
