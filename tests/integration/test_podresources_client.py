"""The PodResources client against a fake kubelet on a real unix socket: a good answer is read, and an answer
that is too big, too long, malformed or refused is a PodResourcesError — never another exception type."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from agent.api.podresources.v1 import api_pb2
from agent.plugin import podresources
from agent.plugin.podresources import MAX_RECEIVE_BYTES, DeviceHolder, PodResourcesError, allocated_devices

SERVICE = "v1.PodResourcesLister"
Answer = Callable[[bytes, grpc.ServicerContext], bytes]


def answer(pods: list[tuple[str, str, str, str, list[str]]]) -> bytes:
    """A serialized ListPodResourcesResponse: (namespace, pod, container, resource, device IDs) per container."""
    response = api_pb2.ListPodResourcesResponse()
    for namespace, pod, container, resource, ids in pods:
        entry = response.pod_resources.add(name=pod, namespace=namespace)
        entry.containers.add(name=container).devices.add(resource_name=resource, device_ids=ids)
    return response.SerializeToString()


@pytest.fixture
def kubelet(tmp_path: Path) -> Iterator[Callable[[Answer], Path]]:
    """Serve List with a raw handler (bytes in, bytes out), so that any answer can be sent, even garbage."""
    servers: list[grpc.Server] = []

    def serve(handler: Answer) -> Path:
        socket = tmp_path / f"kubelet-{len(servers)}.sock"
        server = grpc.server(ThreadPoolExecutor(2), options=[("grpc.max_send_message_length", 64 << 20)])
        method = grpc.unary_unary_rpc_method_handler(handler)  # no (de)serializers: raw bytes
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {"List": method})])
        server.add_insecure_port(f"unix://{socket}")
        server.start()
        servers.append(server)
        return socket

    yield serve
    for server in servers:
        server.stop(None)


def test_a_good_answer_maps_device_ids_to_their_holders(kubelet):
    socket = kubelet(lambda _r, _c: answer([("ml", "train-0", "main", "nvidia.com/gpu", ["GPU-a::0", "GPU-a::1"])]))
    assert allocated_devices(socket) == {
        "GPU-a::0": DeviceHolder("ml", "train-0", "main", "nvidia.com/gpu"),
        "GPU-a::1": DeviceHolder("ml", "train-0", "main", "nvidia.com/gpu"),
    }


def test_an_answer_over_16_mib_is_refused_by_the_channel(kubelet):
    big = ["x" * 1000] * (MAX_RECEIVE_BYTES // 1000 + 10)
    socket = kubelet(lambda _r, _c: answer([("ns", "pod", "c", "example.com/thing", big)]))
    with pytest.raises(PodResourcesError, match="RESOURCE_EXHAUSTED"):
        allocated_devices(socket)


def test_garbage_bytes_are_a_pod_resources_error(kubelet):
    socket = kubelet(lambda _r, _c: b"\xff\xff\xff\xff not protobuf")
    with pytest.raises(PodResourcesError):
        allocated_devices(socket)


def test_invalid_utf8_in_a_name_is_a_pod_resources_error(kubelet):
    # field 1 (pod_resources) -> field 1 (name) holding bytes that are not UTF-8
    socket = kubelet(lambda _r, _c: b"\x0a\x04\x0a\x02\xc3\x28")
    with pytest.raises(PodResourcesError):
        allocated_devices(socket)


def test_too_many_device_ids_are_refused(kubelet, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(podresources, "MAX_DEVICE_IDS", 3)
    socket = kubelet(lambda _r, _c: answer([("ns", "pod", "c", "nvidia.com/gpu", [f"GPU-{i}" for i in range(4)])]))
    with pytest.raises(PodResourcesError, match="more than 3 allocated device IDs"):
        allocated_devices(socket)


def test_an_absurdly_long_name_is_refused(kubelet):
    socket = kubelet(lambda _r, _c: answer([("ns", "pod", "c", "nvidia.com/gpu", ["GPU-" + "0" * 5000])]))
    with pytest.raises(PodResourcesError, match="device ID longer than 1024 characters"):
        allocated_devices(socket)


def test_a_refusal_and_a_missing_socket_are_pod_resources_errors(kubelet, tmp_path: Path):
    def refuse(_request: bytes, context: grpc.ServicerContext) -> bytes:
        context.abort(grpc.StatusCode.PERMISSION_DENIED, "not for you")
        raise AssertionError("unreachable")

    with pytest.raises(PodResourcesError, match="PERMISSION_DENIED: not for you"):
        allocated_devices(kubelet(refuse))
    with pytest.raises(PodResourcesError, match="does not exist"):
        allocated_devices(tmp_path / "nowhere.sock")


def test_a_list_call_loads_no_protobuf_runtime(kubelet):
    """The answer is read from the wire format (agent.plugin.podresources_wire): ~2.4 MB the agent never loads."""
    socket = kubelet(lambda _r, _c: answer([("ml", "train-0", "main", "nvidia.com/gpu", ["GPU-a::0"])]))
    code = (
        "import sys\nfrom pathlib import Path\nfrom agent.plugin.podresources import allocated_devices\n"
        f"print(sorted(allocated_devices(Path({str(socket)!r}))))\n"
        "print(sorted(m for m in sys.modules if m.startswith(('google.protobuf', 'agent.api'))))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.splitlines() == ["['GPU-a::0']", "[]"]
