"""The resource server and registration against the kubelet emulator, over real unix sockets, in-process.

What the kubelet sees: registration, the device list and its updates, Allocate / GetPreferredAllocation
answers, a clean end of stream on stop, and the socket brought back after a kubelet restart.
"""

from __future__ import annotations

import shutil
import stat
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from agent.api.deviceplugin.v1beta1 import api_pb2
from agent.core.allocation import AllocationError, DeviceListStrategy, container_allocation
from agent.core.preferred import preferred
from agent.core.resources import Device
from agent.core.snapshot import AllocationOptions, ResourceSnapshot
from agent.plugin.lock import LOCK_DIRECTORY
from agent.plugin.registration import RegistrationError, register, register_all, register_soon
from agent.plugin.server import ResourceServer, send_updates
from agent.sim.kubelet import KubeletEmulator
from agent.sim.kubelet.common import CHANNEL_OPTIONS

GPU = "nvidia.com/gpu"


def uuid(n: int) -> str:
    return f"GPU-{n:08x}-7777-4000-8000-{n:012x}"


def snapshot(name: str = GPU, unhealthy: tuple[int, ...] = (), **options: object) -> ResourceSnapshot:
    devices = tuple(
        Device(id=uuid(n), gpu_uuid=uuid(n), gpu_index=n, index=str(n), memory_mib=81920, numa_node=n // 2)
        for n in range(4)
    )
    return ResourceSnapshot(
        name,
        devices,
        {d.id: d.gpu_index not in unhealthy for d in devices},
        nvlink_peers={n: frozenset(range(4)) - {n} for n in range(4)},
        options=AllocationOptions(**options),  # type: ignore[arg-type]
    )


@pytest.fixture
def plugin_dir() -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="ps", dir="/tmp"))  # unix socket paths must stay short
    (base / "dp").mkdir()
    yield base / "dp"
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def kubelet(plugin_dir: Path) -> Iterator[KubeletEmulator]:
    emulator = KubeletEmulator(plugin_dir, dial_timeout=2.0, call_timeout=5.0)
    emulator.start()
    yield emulator
    emulator.stop()


@pytest.fixture
def serve(plugin_dir: Path) -> Iterator:
    servers: list[ResourceServer] = []

    def start(snap: ResourceSnapshot, **kwargs: object) -> ResourceServer:
        server = ResourceServer(snap, plugin_dir, **kwargs)  # type: ignore[arg-type]
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


class Reader:
    """A ListAndWatch stream read as the kubelet reads it, keeping every message and how the stream ended."""

    def __init__(self, path: Path) -> None:
        self.channel = grpc.insecure_channel(f"unix://{path}", options=CHANNEL_OPTIONS)
        self.call = self.channel.unary_stream(
            "/v1beta1.DevicePlugin/ListAndWatch",
            request_serializer=api_pb2.Empty.SerializeToString,
            response_deserializer=api_pb2.ListAndWatchResponse.FromString,
        )(api_pb2.Empty())
        self.messages: list[api_pb2.ListAndWatchResponse] = []
        self.error: grpc.RpcError | None = None
        self.ended = threading.Event()
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for message in self.call:
                with self._changed:
                    self.messages.append(message)
                    self._changed.notify_all()
        except grpc.RpcError as error:
            self.error = error
        finally:
            self.ended.set()
            with self._changed:
                self._changed.notify_all()

    def wait_for(self, count: int, timeout: float = 5.0) -> list[api_pb2.ListAndWatchResponse]:
        with self._changed:
            assert self._changed.wait_for(lambda: len(self.messages) >= count or self.ended.is_set(), timeout)
            return list(self.messages)

    def health(self, index: int = -1) -> dict[str, str]:
        return {d.ID: d.health for d in self.messages[index].devices}

    def close(self) -> None:
        self.call.cancel()
        self.ended.wait(5)
        self.channel.close()


def test_served_resource_registers_with_its_devices_health_and_topology(kubelet, serve, plugin_dir):
    server = serve(snapshot(unhealthy=(3,)))
    register(kubelet.kubelet_socket, server.socket_path.name, GPU)
    kubelet.wait_for(lambda: kubelet.capacity(GPU) == 4, what="the first ListAndWatch message")
    assert kubelet.devices(GPU) == {uuid(0): "Healthy", uuid(1): "Healthy", uuid(2): "Healthy", uuid(3): "Unhealthy"}
    assert kubelet.topology(GPU) == {uuid(0): [0], uuid(1): [0], uuid(2): [1], uuid(3): [1]}
    assert kubelet.options(GPU).get_preferred_allocation_available
    assert not kubelet.options(GPU).pre_start_required
    assert stat.S_IMODE(server.socket_path.stat().st_mode) == 0o600


def test_update_reaches_the_stream_and_an_unchanged_listing_sends_nothing(serve):
    server = serve(snapshot())
    reader = Reader(server.socket_path)
    try:
        assert len(reader.wait_for(1)) == 1
        assert not server.update(snapshot(strategies=(DeviceListStrategy.CDI_CRI,)))  # options only: no message
        assert server.update(snapshot(unhealthy=(1,)))
        send_updates([server])  # returns once the stream has handed the message to gRPC
        messages = reader.wait_for(2)
        assert len(messages) == 2  # the options-only change sent nothing
        assert reader.health() == {uuid(0): "Healthy", uuid(1): "Unhealthy", uuid(2): "Healthy", uuid(3): "Healthy"}
        server.update(snapshot())
        reader.wait_for(3)
        assert set(reader.health().values()) == {"Healthy"}
    finally:
        reader.close()


def test_allocate_answers_from_the_current_snapshot(kubelet, serve):
    strategies = (DeviceListStrategy.ENVVAR, DeviceListStrategy.VOLUME_MOUNTS, DeviceListStrategy.CDI_CRI)
    server = serve(snapshot(strategies=strategies))
    register(kubelet.kubelet_socket, server.socket_path.name, GPU)
    kubelet.wait_for(lambda: kubelet.allocatable(GPU) == 4, what="registered")

    (answer,) = kubelet.allocate_raw(GPU, [uuid(2), uuid(0)]).container_responses
    expected = container_allocation(GPU, [server.snapshot.by_id[uuid(2)], server.snapshot.by_id[uuid(0)]], strategies)
    assert dict(answer.envs) == dict(expected.envs)
    assert [(m.container_path, m.host_path, m.read_only) for m in answer.mounts] == [
        (m.container_path, m.host_path, m.read_only) for m in expected.mounts
    ]
    assert [d.name for d in answer.cdi_devices] == list(expected.cdi_devices)

    server.update(snapshot(unhealthy=(2,), strategies=strategies))
    with pytest.raises(grpc.RpcError) as refused:
        kubelet.allocate_raw(GPU, [uuid(2)])
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert uuid(2) in refused.value.details() and "Unhealthy" in refused.value.details()


def test_preferred_allocation_and_pre_start_over_the_wire(kubelet, serve):
    server = serve(snapshot())
    register(kubelet.kubelet_socket, server.socket_path.name, GPU)
    kubelet.wait_for(lambda: kubelet.allocatable(GPU) == 4, what="registered")
    snap = server.snapshot
    everything = [uuid(n) for n in (3, 1, 2, 0)]
    answer = kubelet.preferred_raw(GPU, everything, [uuid(2)], 2).container_responses[0].deviceIDs
    assert list(answer) == preferred(everything, [uuid(2)], 2, snap.by_id, snap.nvlink_peers)
    with pytest.raises(grpc.RpcError) as refused:
        kubelet.preferred_raw(GPU, everything, ["GPU-bogus"], 2)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "GPU-bogus" in refused.value.details()
    assert kubelet.pre_start_raw(GPU, [uuid(0)]) == api_pb2.PreStartContainerResponse()


def test_stop_ends_every_stream_cleanly_and_removes_both_names_of_the_socket(serve, plugin_dir):
    closed: list[str] = []
    server = serve(snapshot(), on_stream_closed=closed.append)
    standby = plugin_dir / LOCK_DIRECTORY / server.socket_path.name
    assert standby.stat().st_ino == server.socket_path.stat().st_ino
    reader = Reader(server.socket_path)
    try:
        reader.wait_for(1)
        server.stop()
        assert reader.ended.wait(5)
        assert reader.error is None  # a clean end of stream (OK), not a cancellation
        assert len(reader.messages) == 1  # nothing more was sent
    finally:
        reader.close()
    assert closed == []  # our own stop is not "closed by the kubelet"
    assert not server.socket_path.exists() and not standby.exists()
    assert not server.serving


def test_a_stream_the_kubelet_closes_is_reported_once(serve):
    closed = threading.Event()
    calls: list[str] = []

    def on_closed(resource: str) -> None:
        calls.append(resource)
        closed.set()

    server = serve(snapshot(), on_stream_closed=on_closed)
    reader = Reader(server.socket_path)
    reader.wait_for(1)
    reader.close()
    assert closed.wait(5)
    assert calls == [GPU]


def test_after_a_kubelet_restart_the_same_server_serves_its_socket_again(kubelet, serve):
    server = serve(snapshot())
    register(kubelet.kubelet_socket, server.socket_path.name, GPU)
    kubelet.wait_for(lambda: kubelet.allocatable(GPU) == 4, what="registered")
    count = kubelet.registrations(GPU)

    kubelet.restart()  # deletes every socket in the directory, ours included
    assert not server.socket_present()
    assert server.restore_socket()
    assert server.socket_present()
    assert stat.S_IMODE(server.socket_path.stat().st_mode) == 0o600
    register(kubelet.kubelet_socket, server.socket_path.name, GPU)
    kubelet.wait_for(lambda: kubelet.registrations(GPU) > count and kubelet.allocatable(GPU) == 4, what="re-registered")
    assert kubelet.allocate_raw(GPU, [uuid(1)]).container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == uuid(1)


def test_restore_socket_leaves_a_path_someone_else_took_and_says_so(serve):
    server = serve(snapshot())
    server.socket_path.unlink()
    server.socket_path.write_text("not ours")
    assert not server.restore_socket()
    assert server.socket_path.read_text() == "not ours"


def test_restore_socket_needs_a_running_server(plugin_dir):
    server = ResourceServer(snapshot(), plugin_dir)
    assert not server.restore_socket()


def test_start_replaces_a_stale_standby_name(serve, plugin_dir):
    (plugin_dir / LOCK_DIRECTORY).mkdir()
    stale = plugin_dir / LOCK_DIRECTORY / "nvidia-gpu.sock"
    stale.write_text("left by an agent that was killed")
    server = serve(snapshot())
    assert stale.stat().st_ino == server.socket_path.stat().st_ino


def test_register_all_registers_every_resource_and_reports_each_refusal(kubelet, serve):
    gpu = serve(snapshot())
    shared = serve(snapshot("nvidia.com/gpu.shared"))
    results = register_all(
        kubelet.kubelet_socket,
        [(gpu.socket_path.name, GPU), (shared.socket_path.name, "nvidia.com/gpu.shared"), ("x.sock", "gpu")],
    )
    assert results[GPU] is None and results["nvidia.com/gpu.shared"] is None
    assert results["gpu"] == 'kubelet refused the registration: UNKNOWN: the ResourceName "gpu" is invalid'
    kubelet.wait_for(
        lambda: kubelet.allocatable(GPU) == 4 and kubelet.allocatable("nvidia.com/gpu.shared") == 4,
        what="both registered",
    )


def test_register_raises_with_the_kubelets_text(kubelet, serve):
    server = serve(snapshot())
    with pytest.raises(RegistrationError, match='UNKNOWN: the ResourceName "gpu" is invalid'):
        register(kubelet.kubelet_socket, server.socket_path.name, "gpu")


def test_register_without_a_kubelet_fails_at_once(plugin_dir):
    with pytest.raises(RegistrationError, match="UNAVAILABLE"):
        register(plugin_dir / "kubelet.sock", "nvidia-gpu.sock", GPU)


def test_register_succeeds_as_soon_as_the_kubelet_is_back(serve, plugin_dir):
    server = serve(snapshot())
    with pytest.raises(RegistrationError, match="UNAVAILABLE"):
        register(plugin_dir / "kubelet.sock", server.socket_path.name, GPU)  # the kubelet is down
    kubelet = KubeletEmulator(plugin_dir, dial_timeout=2.0, cleanup_on_start=False)
    kubelet.start()
    try:
        register(kubelet.kubelet_socket, server.socket_path.name, GPU)  # no backoff left over from the failure
        kubelet.wait_for(lambda: kubelet.allocatable(GPU) == 4, what="registered")
    finally:
        kubelet.stop()


PLUGIN_PROCESS = """
import sys
from pathlib import Path
from agent.plugin.registration import register
from agent.plugin.server import ResourceServer
from agent.core.resources import Device
from agent.core.snapshot import ResourceSnapshot
device = Device(id="GPU-1", gpu_uuid="GPU-1", gpu_index=0, index="0", memory_mib=81920, numa_node=0)
server = ResourceServer(ResourceSnapshot("nvidia.com/gpu", (device,), {"GPU-1": True}), Path(sys.argv[1]))
server.start()
register(Path(sys.argv[1]) / "kubelet.sock", server.socket_path.name, "nvidia.com/gpu")
print("grpc._channel" in sys.modules, any(m.startswith("google.protobuf") for m in sys.modules))
"""


def test_serving_and_registering_load_no_synchronous_grpc_client_and_no_protobuf(kubelet, plugin_dir):
    """The plugin serves and registers on its gRPC loop: grpcio's synchronous client stack (``grpc._channel``)
    stays unloaded on the way to the first registration, and so does the protobuf runtime (the messages are
    written by agent.plugin.wire) (issue 13: start time and RSS)."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-c", PLUGIN_PROCESS, str(plugin_dir)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]
    kubelet.wait_for(lambda: GPU in kubelet.resources(), what="registered")


def test_register_soon_hands_every_answer_over_without_waiting(kubelet, serve):
    gpu = serve(snapshot())
    answered: list[dict[str, str | None]] = []
    done = threading.Event()

    def hand_over(answers: dict[str, str | None]) -> None:
        answered.append(answers)
        done.set()

    register_soon(kubelet.kubelet_socket, [(gpu.socket_path.name, GPU), ("x.sock", "gpu")], hand_over)
    assert done.wait(10)
    assert answered == [
        {GPU: None, "gpu": 'kubelet refused the registration: UNKNOWN: the ResourceName "gpu" is invalid'}
    ]
    kubelet.wait_for(lambda: kubelet.allocatable(GPU) == 4, what="registered")


def test_register_soon_answers_every_resource_when_the_attempt_itself_fails(plugin_dir):
    answered: list[dict[str, str | None]] = []
    done = threading.Event()

    def hand_over(answers: dict[str, str | None]) -> None:
        answered.append(answers)
        done.set()

    endpoints = [(5, GPU), ("b.sock", "nvidia.com/gpu.shared")]  # an endpoint that is no string: a bug of ours
    register_soon(plugin_dir / "kubelet.sock", endpoints, hand_over)  # type: ignore[list-item]
    assert done.wait(10)
    assert set(answered[0]) == {GPU, "nvidia.com/gpu.shared"}
    assert all(text and text.startswith("registration failed: AttributeError") for text in answered[0].values())


def test_send_updates_hands_every_stream_what_update_held_back(serve):
    """The reconcile loop updates without waking (``wake=False``) and hands the change over once, with
    ``send_updates``: every open stream (two: a kubelet that restarted keeps its old one a moment) sends it, and
    the allocator built after that answers from the new snapshot."""
    server = serve(snapshot())
    readers = [Reader(server.socket_path), Reader(server.socket_path)]
    try:
        for reader in readers:
            assert len(reader.wait_for(1)) == 1
        assert server.update(snapshot(unhealthy=(1,)), wake=False)
        send_updates([server])
        for reader in readers:
            assert len(reader.wait_for(2)) == 2
            assert reader.health()[uuid(1)] == "Unhealthy"
        server.prepare()
        with pytest.raises(AllocationError, match="Unhealthy"):
            server._served.allocator.allocate([uuid(1)])
    finally:
        for reader in readers:
            reader.close()


def test_send_updates_has_nothing_to_wait_for_without_a_running_server(plugin_dir):
    server = ResourceServer(snapshot(), plugin_dir)  # never started
    assert not server.update(snapshot(unhealthy=(1,)))
    send_updates([server])


def test_send_updates_gives_up_when_the_grpc_loop_is_held(serve):
    """The reconcile thread lets the gRPC loop send first, but never waits on a loop that is held (a handler
    that blocked, a bug): after its timeout it goes on, without an error, and the update is still sent later."""
    server = serve(snapshot())
    reader = Reader(server.socket_path)
    released, held = threading.Event(), threading.Event()
    let_go: list[bool] = []  # True: the test let the loop go; False: its own 10 s ran out first

    def hold() -> None:
        held.set()
        let_go.append(released.wait(10))

    try:
        assert len(reader.wait_for(1)) == 1
        server._loop.call_soon(hold)
        assert held.wait(10)  # the loop's thread is held before the update is handed over
        assert server.update(snapshot(unhealthy=(2,)))
        send_updates([server], timeout=0.05)
        released.set()  # only now: send_updates returned while the loop was held
        reader.wait_for(2)
        assert reader.health()[uuid(2)] == "Unhealthy"
        assert let_go == [True]
    finally:
        released.set()
        reader.close()
