"""The kubelet emulator (agent.sim.kubelet) against a tiny fake device plugin, over real gRPC on unix sockets."""

from __future__ import annotations

import json
import shutil
import stat
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from agent.api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from agent.api.podresources.v1 import api_pb2 as pr_pb2
from agent.api.podresources.v1 import api_pb2_grpc as pr_grpc
from agent.sim.kubelet import AdmissionError, ContainerStartError, KubeletEmulator
from agent.sim.kubelet.common import is_extended_resource_name

RES = "example.com/gpu"


def dev(dev_id: str, health: str = "Healthy", numa: int | None = None) -> api_pb2.Device:
    d = api_pb2.Device(ID=dev_id, health=health)
    if numa is not None:
        d.topology.nodes.add(ID=numa)
    return d


class FakePlugin(api_pb2_grpc.DevicePluginServicer):
    """A device plugin serving a fixed (replaceable) device list on ``<dir>/<name>``, recording every call."""

    def __init__(self, sock_dir: Path, name: str, devices, options=None, resource: str = RES) -> None:
        self.path = sock_dir / name
        self.name = name
        self.resource = resource
        self.options = options or api_pb2.DevicePluginOptions()
        self._cond = threading.Condition()
        self._devices = list(devices)
        self._version = 0
        self._stopped = False
        self.law_calls = 0
        self.allocate_calls: list[api_pb2.AllocateRequest] = []
        self.preferred_calls: list[api_pb2.PreferredAllocationRequest] = []
        self.prestart_calls: list[api_pb2.PreStartContainerRequest] = []
        self.preferred_answer: list[str] = []
        self.allocate_error: tuple[grpc.StatusCode, str] | None = None
        self.fail_allocate_containing: str | None = None
        self.empty_allocate = False
        self.prestart_error: tuple[grpc.StatusCode, str] | None = None
        self.unimplemented_options = False
        self._server = None
        self._executor = None

    # -- servicer
    def GetDevicePluginOptions(self, request, context):
        if self.unimplemented_options:
            return super().GetDevicePluginOptions(request, context)
        return self.options

    def ListAndWatch(self, request, context):
        with self._cond:
            self.law_calls += 1
        sent = -1
        while context.is_active():
            with self._cond:
                if self._version == sent and not self._stopped:
                    self._cond.wait(0.05)
                if self._stopped:
                    return
                if self._version == sent:
                    continue
                sent = self._version
                devices = list(self._devices)
            yield api_pb2.ListAndWatchResponse(devices=devices)

    def GetPreferredAllocation(self, request, context):
        self.preferred_calls.append(request)
        return api_pb2.PreferredAllocationResponse(
            container_responses=[api_pb2.ContainerPreferredAllocationResponse(deviceIDs=self.preferred_answer)]
        )

    def Allocate(self, request, context):
        self.allocate_calls.append(request)
        ids = list(request.container_requests[0].devices_ids)
        if self.allocate_error or (self.fail_allocate_containing in ids):
            code, text = self.allocate_error or (grpc.StatusCode.INVALID_ARGUMENT, "bad device")
            context.abort(code, text)
        if self.empty_allocate:
            return api_pb2.AllocateResponse()
        resp = api_pb2.ContainerAllocateResponse(envs={"FAKE_DEVICES": ",".join(ids)})
        resp.devices.add(container_path="/dev/fake0", host_path="/dev/fake0", permissions="rw")
        resp.cdi_devices.add(name=f"example.com/gpu={ids[0]}")
        return api_pb2.AllocateResponse(container_responses=[resp])

    def PreStartContainer(self, request, context):
        self.prestart_calls.append(request)
        if self.prestart_error:
            context.abort(*self.prestart_error)
        return api_pb2.PreStartContainerResponse()

    # -- control
    def set_devices(self, devices) -> None:
        with self._cond:
            self._devices = list(devices)
            self._version += 1
            self._cond.notify_all()

    def start(self) -> FakePlugin:
        with self._cond:
            self._stopped = False
            self._version += 1
        self._executor = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="fake-plugin")
        self._server = grpc.server(self._executor)
        api_pb2_grpc.add_DevicePluginServicer_to_server(self, self._server)
        self.path.unlink(missing_ok=True)
        self._server.add_insecure_port(f"unix:{self.path}")
        self._server.start()
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._server.stop(None).wait(5)
        self._executor.shutdown(wait=True)
        self._server = self._executor = None

    def register(self, kubelet_sock: Path, *, version: str = "v1beta1", resource: str | None = None) -> None:
        with grpc.insecure_channel(f"unix:{kubelet_sock}") as channel:
            api_pb2_grpc.RegistrationStub(channel).Register(
                api_pb2.RegisterRequest(
                    version=version, endpoint=self.name, resource_name=resource or self.resource, options=self.options
                ),
                timeout=15,
            )


@pytest.fixture
def sock_dir():
    d = Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def env(sock_dir):
    """(make_kubelet, make_plugin); everything is stopped at teardown and no thread may outlive the test."""
    baseline = threading.active_count()
    kubelets: list[KubeletEmulator] = []
    plugins: list[FakePlugin] = []

    def make_kubelet(**kw) -> KubeletEmulator:
        kw.setdefault("dial_timeout", 2.0)
        k = KubeletEmulator(sock_dir / "dp", sock_dir / "pr" / "kubelet.sock", **kw)
        k.start()
        kubelets.append(k)
        return k

    def make_plugin(name="p.sock", devices=None, options=None, resource=RES) -> FakePlugin:
        devices = devices if devices is not None else [dev(f"gpu-{i}") for i in range(4)]
        p = FakePlugin(sock_dir / "dp", name, devices, options, resource).start()
        plugins.append(p)
        return p

    yield make_kubelet, make_plugin
    for p in plugins:
        p.stop()
    for k in kubelets:
        k.stop()
    deadline = time.monotonic() + 5
    while threading.active_count() > baseline and time.monotonic() < deadline:
        time.sleep(0.02)  # polling with a deadline for threads to finish
    assert threading.active_count() <= baseline, [t.name for t in threading.enumerate()]


def registered(kubelet: KubeletEmulator, plugin: FakePlugin, count: int = 4) -> None:
    plugin.register(kubelet.kubelet_socket)
    kubelet.wait_for(lambda: kubelet.capacity(plugin.resource) == count, what="first ListAndWatch message")


def rpc_error(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn()
    return info.value


# ---------------------------------------------------------------------------------------------------- registration


def test_register_reports_devices_capacity_allocatable(env, sock_dir):
    make_kubelet, make_plugin = env
    kubelet = make_kubelet()
    opts = api_pb2.DevicePluginOptions(get_preferred_allocation_available=True)
    plugin = make_plugin(devices=[dev("gpu-0", numa=0), dev("gpu-1", numa=1), dev("gpu-2", "Unhealthy")], options=opts)
    registered(kubelet, plugin, 3)
    assert kubelet.resources() == [RES]
    assert kubelet.registrations(RES) == 1
    assert kubelet.devices(RES) == {"gpu-0": "Healthy", "gpu-1": "Healthy", "gpu-2": "Unhealthy"}
    assert (kubelet.capacity(RES), kubelet.allocatable(RES)) == (3, 2)
    assert kubelet.options(RES).get_preferred_allocation_available
    assert kubelet.topology(RES) == {"gpu-0": [0], "gpu-1": [1], "gpu-2": []}
    assert kubelet.endpoint(RES) == str(plugin.path)
    assert stat.S_IMODE(kubelet.kubelet_socket.stat().st_mode) == 0o600
    assert stat.S_IMODE((sock_dir / "dp").stat().st_mode) == 0o750
    assert plugin.law_calls == 1


def test_register_options_come_from_get_device_plugin_options(env):
    make_kubelet, make_plugin = env
    kubelet = make_kubelet()
    plugin = make_plugin(options=api_pb2.DevicePluginOptions(pre_start_required=True))
    # the RegisterRequest carries different options: the kubelet must ignore them
    with grpc.insecure_channel(f"unix:{kubelet.kubelet_socket}") as ch:
        api_pb2_grpc.RegistrationStub(ch).Register(
            api_pb2.RegisterRequest(
                version="v1beta1",
                endpoint=plugin.name,
                resource_name=RES,
                options=api_pb2.DevicePluginOptions(get_preferred_allocation_available=True),
            ),
            timeout=10,
        )
    opts = kubelet.options(RES)
    assert opts.pre_start_required and not opts.get_preferred_allocation_available


def test_register_rejects_unsupported_version(env):
    make_kubelet, make_plugin = env
    kubelet = make_kubelet()
    plugin = make_plugin()
    err = rpc_error(lambda: plugin.register(kubelet.kubelet_socket, version="v1alpha"))
    assert err.code() == grpc.StatusCode.UNKNOWN
    assert (
        err.details() == 'requested API version "v1alpha" is not supported by kubelet. Supported version is ["v1beta1"]'
    )
    assert kubelet.resources() == [] and kubelet.registrations(RES) == 0


@pytest.mark.parametrize("name", ["gpu", "kubernetes.io/x", "foo.kubernetes.io/x", "requests.x/y", "Example.com/gpu"])
def test_register_rejects_invalid_resource_name(env, name):
    make_kubelet, make_plugin = env
    kubelet = make_kubelet()
    plugin = make_plugin()
    err = rpc_error(lambda: plugin.register(kubelet.kubelet_socket, resource=name))
    assert err.code() == grpc.StatusCode.UNKNOWN
    assert err.details() == f'the ResourceName "{name}" is invalid'
    assert plugin.law_calls == 0


@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("nvidia.com/gpu", True),
        ("k8s.io/x", True),
        ("example.com/My_Name.1", True),
        ("mykubernetes.io/x", False),
        ("a/b/c", False),
        ("example.com/", False),
        ("-bad.com/x", False),
        ("example.com/" + "x" * 64, False),
        ("a" * 244 + "/x", True),
        ("a" * 245 + "/x", False),
    ],
)
def test_extended_resource_name_rule(name, ok):
    assert is_extended_resource_name(name) is ok


def test_register_fails_when_endpoint_not_served(env):
    make_kubelet, _ = env
    kubelet = make_kubelet(dial_timeout=0.5)
    with grpc.insecure_channel(f"unix:{kubelet.kubelet_socket}") as ch:
        err = rpc_error(
            lambda: api_pb2_grpc.RegistrationStub(ch).Register(
                api_pb2.RegisterRequest(version="v1beta1", endpoint="nobody.sock", resource_name=RES), timeout=10
            )
        )
    assert err.code() == grpc.StatusCode.UNKNOWN
    assert err.details() == "failed to dial device plugin: context deadline exceeded"
    assert kubelet.resources() == []


def test_register_waits_for_plugin_to_serve(env, sock_dir):
    make_kubelet, _ = env
    kubelet = make_kubelet(dial_timeout=5.0)
    plugin = FakePlugin(sock_dir / "dp", "late.sock", [dev("gpu-0")])
    errors: list[BaseException] = []

    def register() -> None:
        try:
            plugin.register(kubelet.kubelet_socket)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=register)
    t.start()
    kubelet.wait_for(lambda: len(kubelet._clients) == 1, what="blocking dial in progress")
    plugin.start()  # the blocking dial succeeds once the plugin serves
    try:
        t.join(10)
        assert errors == []
        kubelet.wait_for(lambda: kubelet.capacity(RES) == 1, what="devices")
    finally:
        plugin.stop()


def test_stop_interrupts_blocking_dial(env):
    make_kubelet, _ = env
    kubelet = make_kubelet(dial_timeout=30.0)
    errors: list[grpc.RpcError] = []

    def register() -> None:
        with grpc.insecure_channel(f"unix:{kubelet.kubelet_socket}") as ch:
            try:
                api_pb2_grpc.RegistrationStub(ch).Register(
                    api_pb2.RegisterRequest(version="v1beta1", endpoint="nobody.sock", resource_name=RES), timeout=30
                )
            except grpc.RpcError as exc:
                errors.append(exc)

    t = threading.Thread(target=register)
    t.start()
    kubelet.wait_for(lambda: len(kubelet._clients) == 1, what="blocking dial in progress")
    started = time.monotonic()
    kubelet.stop()
    t.join(10)
    assert time.monotonic() - started < 5
    assert len(errors) == 1 and kubelet.resources() == []


def test_register_fails_when_options_unimplemented(env):
    make_kubelet, make_plugin = env
    kubelet = make_kubelet()
    plugin = make_plugin()
    plugin.unimplemented_options = True
    err = rpc_error(lambda: plugin.register(kubelet.kubelet_socket))
    assert err.code() == grpc.StatusCode.UNKNOWN
    assert err.details().startswith("failed to get device plugin options: rpc error: code = Unimplemented desc = ")


# ---------------------------------------------------------------------------------------------------- health


def test_list_and_watch_updates_replace_device_set(env):
    make_kubelet, make_plugin = env
    kubelet = make_kubelet()
    plugin = make_plugin()
    registered(kubelet, plugin)
    plugin.set_devices([dev("gpu-0"), dev("gpu-1", "Unhealthy"), dev("gpu-2", ""), dev("gpu-3")])
    kubelet.wait_for(lambda: kubelet.allocatable(RES) == 2, what="health update")
    assert kubelet.capacity(RES) == 4
    assert kubelet.devices(RES)["gpu-2"] == ""
    plugin.set_devices([dev("gpu-0")])  # full replacement: missing devices disappear
    kubelet.wait_for(lambda: kubelet.capacity(RES) == 1, what="device removal")
    assert kubelet.devices(RES) == {"gpu-0": "Healthy"}


def test_a_device_update_written_late_never_takes_the_checkpoint_back_in_time(env, sock_dir):
    """A device update writes the checkpoint after the lock is let go (the kubelet's order: the state is
    visible first); one that lands after a pod's newer checkpoint is dropped, so the file never goes back."""
    make_kubelet, make_plugin = env
    kubelet = make_kubelet()
    registered(kubelet, make_plugin())
    kubelet.create_pod("p", {"main": {RES: 1}})
    with kubelet._cond:
        late = kubelet._checkpoint_locked()  # a device update's, taken while the pod still held its device
    kubelet.delete_pod("p")  # nothing else changed in between: the same state version, a newer checkpoint
    kubelet._write_checkpoint(late)
    checkpoint = json.loads((sock_dir / "dp" / "kubelet_internal_checkpoint").read_text())
    assert checkpoint["Data"]["PodDeviceEntries"] == []  # the deleted pod does not come back


def test_plugin_stop_marks_unhealthy_and_never_redials(env):
    make_kubelet, make_plugin = env
    kubelet = make_kubelet()
    plugin = make_plugin()
    registered(kubelet, plugin)
    plugin.stop()
    kubelet.wait_for(lambda: kubelet.allocatable(RES) == 0, what="resource marked unhealthy")
    assert kubelet.capacity(RES) == 4
    assert kubelet.stopped(RES)
    assert set(kubelet.devices(RES).values()) == {"Unhealthy"}
    with pytest.raises(AdmissionError) as info:
        kubelet.create_pod("p", {"c": {RES: 1}})
    assert str(info.value) == (
        "Allocate failed due to no healthy devices present; "
        f"cannot allocate unhealthy devices {RES}, which is unexpected"
    )
    plugin.start()  # serving again is not enough: only a new Register brings it back
    registered_again = plugin.law_calls
    plugin.register(kubelet.kubelet_socket)
    kubelet.wait_for(lambda: kubelet.allocatable(RES) == 4, what="re-registration")
    assert plugin.law_calls == registered_again + 1 == 2
    assert kubelet.registrations(RES) == 2 and not kubelet.stopped(RES)


def test_grace_period_expiry_drops_resource(env):
    make_kubelet, make_plugin = env
    kubelet = make_kubelet(grace_period=0.3)
    plugin = make_plugin()
    registered(kubelet, plugin)
    plugin.stop()
    kubelet.wait_for(lambda: kubelet.allocatable(RES) == 0, what="unhealthy")
    assert RES in kubelet.resources()
    kubelet.wait_for(lambda: RES not in kubelet.resources(), timeout=5, what="grace period expiry")
    assert kubelet.capacity(RES) == 0 and kubelet.devices(RES) == {}
    with pytest.raises(AdmissionError) as info:
        kubelet.create_pod("p", {"c": {RES: 1}})
    assert info.value.reason == f"OutOf{RES}"
    assert str(info.value) == f"Node didn't have enough resource: {RES}, requested: 1, used: 0, capacity: 0"


def test_reregistration_replaces_endpoint(env):
    make_kubelet, make_plugin = env
    kubelet = make_kubelet()
    old = make_plugin("old.sock")
    registered(kubelet, old)
    new = make_plugin("new.sock", devices=[dev("gpu-0"), dev("gpu-1")])
    new.register(kubelet.kubelet_socket)
    kubelet.wait_for(lambda: kubelet.endpoint(RES) == str(new.path), what="new endpoint")
    kubelet.wait_for(lambda: kubelet.capacity(RES) == 2, what="new device list")
    old.stop()  # the replaced stream ends: the current registration is unaffected (fixed kubelet behaviour)
    new.set_devices([dev("gpu-0"), dev("gpu-1"), dev("gpu-2")])
    kubelet.wait_for(lambda: kubelet.allocatable(RES) == 3, what="update from the new plugin")
    assert not kubelet.stopped(RES)
    assert kubelet.registrations(RES) == 2


def test_legacy_reregistration_race(env):
    make_kubelet, make_plugin = env
    kubelet = make_kubelet(legacy_reregistration_race=True)
    old = make_plugin("old.sock")
    registered(kubelet, old)
    new = make_plugin("new.sock", devices=[dev("gpu-0"), dev("gpu-1")])
    new.register(kubelet.kubelet_socket)
    kubelet.wait_for(lambda: kubelet.capacity(RES) == 2, what="new device list")
    old.stop()  # kubelet <= 1.36: the old stream's end disconnects the NEW client
    kubelet.wait_for(lambda: kubelet.stopped(RES) and kubelet.allocatable(RES) == 0, what="race disconnect")


# ---------------------------------------------------------------------------------------------------- allocation


def test_create_pod_prefers_then_allocates_once_per_container_and_resource(env):
    make_kubelet, make_plugin = env
    kubelet = make_kubelet()
    plugin = make_plugin(
        devices=[dev("gpu-0", numa=0), dev("gpu-1", numa=0), dev("gpu-2", numa=1), dev("gpu-3", numa=1)],
        options=api_pb2.DevicePluginOptions(get_preferred_allocation_available=True),
    )
    other = make_plugin("o.sock", devices=[dev("x-0")], resource="example.com/other")
    registered(kubelet, plugin)
    registered(kubelet, other, 1)
    plugin.preferred_answer = ["bogus", "gpu-3", "gpu-2", "gpu-1"]  # unknown and extra IDs are dropped
    pod = kubelet.create_pod("p1", {"a": {RES: 2, "example.com/other": 1, "cpu": 2}, "b": {RES: 1}})

    first = plugin.preferred_calls[0].container_requests
    assert len(first) == 1
    assert sorted(first[0].available_deviceIDs) == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]
    assert list(first[0].must_include_deviceIDs) == [] and first[0].allocation_size == 2
    assert [len(c.container_requests) for c in plugin.allocate_calls] == [1, 1]
    assert list(plugin.allocate_calls[0].container_requests[0].devices_ids) == ["gpu-3", "gpu-2"]
    assert len(other.allocate_calls) == 1 and len(other.preferred_calls) == 0

    a = pod.containers["a"][RES]
    assert a.device_ids == ["gpu-3", "gpu-2"]
    assert a.response.envs["FAKE_DEVICES"] == "gpu-3,gpu-2"
    assert a.numa == {"gpu-3": [1], "gpu-2": [1]}
    assert pod.containers["b"][RES].device_ids == ["gpu-1"]  # preferred again, intersected with the free set
    assert sorted(plugin.preferred_calls[1].container_requests[0].available_deviceIDs) == ["gpu-0", "gpu-1"]
    assert [p.name for p in kubelet.pods()] == ["p1"]

    kubelet.delete_pod("p1")
    assert kubelet.pods() == []
    plugin.preferred_answer = []
    pod2 = kubelet.create_pod("p2", {"c": {RES: 4}})  # everything free again; the kubelet fills in order
    assert pod2.containers["c"][RES].device_ids == ["gpu-0", "gpu-1", "gpu-2", "gpu-3"]


def test_init_container_devices_are_reused(env):
    make_kubelet, make_plugin = env
    kubelet = make_kubelet()
    plugin = make_plugin(options=api_pb2.DevicePluginOptions(get_preferred_allocation_available=True))
    registered(kubelet, plugin)
    pod = kubelet.create_pod("p", {"app": {RES: 2}}, init_containers={"init": {RES: 1}})
    init_dev = pod.init_containers["init"][RES].device_ids
    assert init_dev == ["gpu-0"]
    app_devs = pod.containers["app"][RES].device_ids
    assert app_devs[0] == "gpu-0" and len(app_devs) == 2
    req = plugin.preferred_calls[-1].container_requests[0]
    assert list(req.must_include_deviceIDs) == ["gpu-0"] and "gpu-0" in req.available_deviceIDs
    assert req.allocation_size == 2
    assert list(plugin.allocate_calls[-1].container_requests[0].devices_ids) == app_devs
    assert kubelet.create_pod("q", {"c": {RES: 2}}).containers["c"][RES].device_ids == ["gpu-2", "gpu-3"]


def test_insufficient_devices_fail_admission(env):
    make_kubelet, make_plugin = env
    kubelet = make_kubelet()
    plugin = make_plugin(devices=[dev("gpu-0"), dev("gpu-1"), dev("gpu-2", "Unhealthy")])
    registered(kubelet, plugin, 3)
    with pytest.raises(AdmissionError) as info:
        kubelet.create_pod("p", {"c": {RES: 3}})
    assert info.value.reason == "UnexpectedAdmissionError"
    assert str(info.value) == (
        f"Allocate failed due to requested number of devices unavailable for {RES}. Requested: 3, Available: 2, "
        "which is unexpected"
    )
    assert plugin.allocate_calls == [] and kubelet.pods() == []


def test_allocate_rpc_error_fails_admission_and_rolls_back(env):
    make_kubelet, make_plugin = env
    kubelet = make_kubelet()
    plugin = make_plugin()
    registered(kubelet, plugin)
    plugin.fail_allocate_containing = "gpu-2"
    with pytest.raises(AdmissionError) as info:
        kubelet.create_pod("p", {"a": {RES: 2}, "b": {RES: 1}})
    assert str(info.value) == (
        "Allocate failed due to rpc error: code = InvalidArgument desc = bad device, which is unexpected"
    )
    assert len(plugin.allocate_calls) == 2 and kubelet.pods() == []
    plugin.fail_allocate_containing = None
    assert kubelet.create_pod("q", {"c": {RES: 4}}).containers["c"][RES].device_ids == [f"gpu-{i}" for i in range(4)]
    plugin.empty_allocate = True
    kubelet.delete_pod("q")
    with pytest.raises(AdmissionError, match="no containers return in allocation response"):
        kubelet.create_pod("r", {"c": {RES: 1}})


def test_start_container_calls_prestart(env):
    make_kubelet, make_plugin = env
    kubelet = make_kubelet()
    plugin = make_plugin(options=api_pb2.DevicePluginOptions(pre_start_required=True))
    registered(kubelet, plugin)
    kubelet.create_pod("p", {"c": {RES: 2}})
    assert plugin.prestart_calls == []  # only at container start
    opts = kubelet.start_container("p", "c")
    assert [list(r.devices_ids) for r in plugin.prestart_calls] == [["gpu-0", "gpu-1"]]
    assert opts.envs == {"FAKE_DEVICES": "gpu-0,gpu-1"} and opts.cdi_devices == ["example.com/gpu=gpu-0"]
    assert [d.container_path for d in opts.devices] == ["/dev/fake0"]
    plugin.prestart_error = (grpc.StatusCode.INTERNAL, "not ready")
    with pytest.raises(ContainerStartError) as info:
        kubelet.start_container("p", "c")
    assert str(info.value) == (
        "device plugin PreStartContainer rpc failed with err: rpc error: code = Internal desc = not ready"
    )


def test_raw_rpc_helpers(env):
    make_kubelet, make_plugin = env
    kubelet = make_kubelet()
    plugin = make_plugin()
    registered(kubelet, plugin)
    plugin.preferred_answer = ["gpu-1"]
    assert list(kubelet.preferred_raw(RES, ["gpu-1", "gpu-2"], [], 1).container_responses[0].deviceIDs) == ["gpu-1"]
    assert kubelet.allocate_raw(RES, ["gpu-0"]).container_responses[0].envs["FAKE_DEVICES"] == "gpu-0"
    plugin.allocate_error = (grpc.StatusCode.FAILED_PRECONDITION, "nope")
    err = rpc_error(lambda: kubelet.allocate_raw(RES, ["gpu-0"]))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and err.details() == "nope"
    assert kubelet.pods() == []  # raw calls do no bookkeeping


# ---------------------------------------------------------------------------------------------------- PodResources


def test_pod_resources_api(env, sock_dir):
    make_kubelet, make_plugin = env
    kubelet = make_kubelet()
    plugin = make_plugin(devices=[dev("gpu-0", numa=0), dev("gpu-1"), dev("gpu-2", numa=1), dev("gpu-3", "Unhealthy")])
    registered(kubelet, plugin)
    kubelet.create_pod(
        "p",
        {"app": {RES: 1}, "idle": {}},
        "ns1",
        init_containers={"init": {RES: 1}, "side": {RES: 1}},
        sidecars=["side"],
    )
    with grpc.insecure_channel(f"unix:{sock_dir / 'pr' / 'kubelet.sock'}") as ch:
        stub = pr_grpc.PodResourcesListerStub(ch)
        listed = stub.List(pr_pb2.ListPodResourcesRequest(), timeout=5).pod_resources
        assert [(p.name, p.namespace) for p in listed] == [("p", "ns1")]
        containers = listed[0].containers
        assert [c.name for c in containers] == ["side", "app", "idle"]  # sidecar first, ordinary init omitted
        side, app, idle = containers
        # the sidecar reuses the ordinary init container's device and keeps it; the app container gets the next one
        assert [(d.resource_name, list(d.device_ids)) for d in side.devices] == [(RES, ["gpu-0"])]
        assert [n.ID for n in side.devices[0].topology.nodes] == [0]
        assert [list(d.device_ids) for d in app.devices] == [["gpu-1"]]
        assert not app.devices[0].HasField("topology")
        assert list(idle.devices) == []

        alloc = stub.GetAllocatableResources(pr_pb2.AllocatableResourcesRequest(), timeout=5).devices
        assert sorted(d.device_ids[0] for d in alloc) == ["gpu-0", "gpu-1", "gpu-2"]  # healthy, in use included
        assert all(len(d.device_ids) == 1 for d in alloc)

        got = stub.Get(pr_pb2.GetPodResourcesRequest(pod_name="p", pod_namespace="ns1"), timeout=5).pod_resources
        assert got == listed[0]
        err = rpc_error(lambda: stub.Get(pr_pb2.GetPodResourcesRequest(pod_name="x", pod_namespace="ns1"), timeout=5))
        assert (err.code(), err.details()) == (grpc.StatusCode.UNKNOWN, "pod x in namespace ns1 not found")
        kubelet.pod_resources_get_enabled = False
        err = rpc_error(lambda: stub.Get(pr_pb2.GetPodResourcesRequest(pod_name="p", pod_namespace="ns1"), timeout=5))
        assert (err.code(), err.details()) == (grpc.StatusCode.UNKNOWN, "PodResources API Get method disabled")

        kubelet.delete_pod("p", "ns1")
        assert list(stub.List(pr_pb2.ListPodResourcesRequest(), timeout=5).pod_resources) == []


def test_pod_resources_rate_limit(env, sock_dir):
    make_kubelet, _ = env
    make_kubelet()
    with grpc.insecure_channel(f"unix:{sock_dir / 'pr' / 'kubelet.sock'}") as ch:
        stub = pr_grpc.PodResourcesListerStub(ch)
        codes = []
        for _ in range(200):
            try:
                stub.List(pr_pb2.ListPodResourcesRequest(), timeout=5)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as exc:
                codes.append(exc.code())
                assert exc.details() == "rejected by rate limit"
                break
    assert codes[-1] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert codes.count(grpc.StatusCode.OK) >= 10  # the burst


# ---------------------------------------------------------------------------------------------------- restart


def plant(directory: Path) -> dict[str, Path]:
    """What a device-plugin directory may hold besides sockets: a regular file, a symlink (to a file outside, which
    must survive), a plugin's own sub-directory with a file in it (Tessera keeps its lock in ``.tessera/``)."""
    directory.mkdir(parents=True, exist_ok=True)
    outside = directory.parent / "outside.txt"
    outside.write_text("not in the directory")
    (directory / "notes.txt").write_text("regular file")
    (directory / "link").symlink_to(outside)
    (directory / ".tessera").mkdir()
    (directory / ".tessera" / "agent.lock").write_text("")
    return {
        "file": directory / "notes.txt",
        "link": directory / "link",
        "outside": outside,
        "lock": directory / ".tessera" / "agent.lock",
    }


def test_start_deletes_every_file_but_the_checkpoint_and_leaves_directories(env, sock_dir):
    make_kubelet, _ = env
    planted = plant(sock_dir / "dp")
    (sock_dir / "dp" / "kubelet_internal_checkpoint").write_text('{"Data":{},"Checksum":0}')

    make_kubelet()

    assert not planted["file"].exists()
    assert not planted["link"].is_symlink()
    assert planted["outside"].read_text() == "not in the directory"  # the link went, not what it pointed to
    assert planted["lock"].is_file()  # directories and what they hold stay
    assert (sock_dir / "dp" / "kubelet_internal_checkpoint").is_file()


def test_restart_keeps_allocations_and_deletes_every_file_but_the_checkpoint(env, sock_dir):
    make_kubelet, make_plugin = env
    kubelet = make_kubelet()
    plugin = make_plugin()
    registered(kubelet, plugin)
    pod = kubelet.create_pod("p", {"c": {RES: 2}})
    planted = plant(sock_dir / "dp")

    kubelet.restart()
    assert not planted["file"].exists()  # CleanupPluginDirectory removes every non-directory, not only sockets
    assert not planted["link"].is_symlink()
    assert planted["lock"].is_file()
    assert (sock_dir / "dp" / "kubelet_internal_checkpoint").is_file()
    assert not plugin.path.exists()  # plugin socket deleted
    assert stat.S_ISSOCK(kubelet.kubelet_socket.stat().st_mode)  # a fresh kubelet.sock
    assert kubelet.resources() == [RES]
    assert (kubelet.capacity(RES), kubelet.allocatable(RES)) == (0, 0)
    assert kubelet.stopped(RES)
    assert kubelet.options(RES) == api_pb2.DevicePluginOptions()
    assert kubelet.pods()[0].containers["c"][RES].device_ids == pod.containers["c"][RES].device_ids
    with pytest.raises(AdmissionError, match="no healthy devices present"):
        kubelet.create_pod("q", {"c": {RES: 1}})

    checkpoint = json.loads((sock_dir / "dp" / "kubelet_internal_checkpoint").read_text())
    entries = checkpoint["Data"]["PodDeviceEntries"]
    assert [(e["PodUID"], e["ContainerName"], e["ResourceName"]) for e in entries] == [(pod.uid, "c", RES)]
    assert entries[0]["DeviceIDs"] == {"-1": ["gpu-0", "gpu-1"]}

    plugin.stop()
    plugin.start()  # what a plugin does on seeing kubelet.sock recreated
    registered(kubelet, plugin)
    assert kubelet.allocatable(RES) == 4 and not kubelet.stopped(RES)
    assert kubelet.create_pod("q", {"c": {RES: 2}}).containers["c"][RES].device_ids == ["gpu-2", "gpu-3"]


def test_restart_unregistered_resource_dropped_after_grace(env):
    make_kubelet, make_plugin = env
    kubelet = make_kubelet(grace_period=0.3)
    plugin = make_plugin()
    registered(kubelet, plugin)
    kubelet.restart()
    assert kubelet.resources() == [RES]
    kubelet.wait_for(lambda: kubelet.resources() == [], what="restored resource dropped")


def test_stop_removes_sockets_and_threads(env, sock_dir):
    make_kubelet, make_plugin = env
    kubelet = make_kubelet()
    plugin = make_plugin()
    registered(kubelet, plugin)
    kubelet.stop()
    assert not kubelet.kubelet_socket.exists()
    assert not (sock_dir / "pr" / "kubelet.sock").exists()
    assert plugin.path.exists()  # stop alone deletes nothing of the plugin's
