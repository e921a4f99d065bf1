"""agent.plugin.wire against the generated protobuf classes: what the kubelet reads from the agent, and what the
agent reads from the kubelet, is what protobuf itself would write and read."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.api.deviceplugin.v1beta1 import api_pb2
from agent.core.allocation import ContainerAllocation, Mount
from agent.plugin import wire

TEXT = st.text(max_size=12)


@pytest.mark.parametrize("pre_start", [False, True])
@pytest.mark.parametrize("preferred", [False, True])
def test_options_are_protobufs_bytes(pre_start: bool, preferred: bool) -> None:
    expected = api_pb2.DevicePluginOptions(pre_start_required=pre_start, get_preferred_allocation_available=preferred)
    written = wire.device_plugin_options(pre_start_required=pre_start, get_preferred_allocation_available=preferred)
    assert written == expected.SerializeToString()


def test_a_register_request_is_protobufs_bytes() -> None:
    options = api_pb2.DevicePluginOptions(get_preferred_allocation_available=True)
    expected = api_pb2.RegisterRequest(
        version="v1beta1", endpoint="nvidia-gpu.sock", resource_name="nvidia.com/gpu", options=options
    )
    written = wire.register_request("v1beta1", "nvidia-gpu.sock", "nvidia.com/gpu", options.SerializeToString())
    assert written == expected.SerializeToString()


@pytest.mark.parametrize("numa_node", [None, 0, 1, 300])
@pytest.mark.parametrize("health", ["Healthy", "Unhealthy"])
def test_a_listed_device_is_protobufs_bytes(numa_node: int | None, health: str) -> None:
    expected = api_pb2.ListAndWatchResponse()
    device = expected.devices.add(ID="GPU-8a1b", health=health)
    if numa_node is not None:
        device.topology.nodes.add(ID=numa_node)
    assert wire.list_and_watch_device("GPU-8a1b", health, numa_node) == expected.SerializeToString()


def test_listed_devices_joined_are_the_whole_listing() -> None:
    parts = [wire.list_and_watch_device(f"GPU-{n}", "Healthy", n // 2) for n in range(8)]
    listing = api_pb2.ListAndWatchResponse.FromString(b"".join(parts))
    assert [(d.ID, d.health, [n.ID for n in d.topology.nodes]) for d in listing.devices] == [
        (f"GPU-{n}", "Healthy", [n // 2]) for n in range(8)
    ]


ALLOCATIONS = st.builds(
    ContainerAllocation,
    envs=st.dictionaries(TEXT, TEXT, max_size=4),
    mounts=st.lists(st.builds(Mount, TEXT, TEXT, st.booleans()), max_size=3).map(tuple),
    cdi_devices=st.lists(TEXT, max_size=3).map(tuple),
    annotations=st.dictionaries(TEXT, TEXT, max_size=3),
)


def _protobufs(allocation: ContainerAllocation) -> api_pb2.ContainerAllocateResponse:
    message = api_pb2.ContainerAllocateResponse()
    message.envs.update(allocation.envs)
    for mount in allocation.mounts:
        message.mounts.add(container_path=mount.container_path, host_path=mount.host_path, read_only=mount.read_only)
    message.annotations.update(allocation.annotations)
    for name in allocation.cdi_devices:
        message.cdi_devices.add(name=name)
    return message


@settings(max_examples=200, deadline=None, database=None)
@given(st.lists(ALLOCATIONS, max_size=3))
def test_an_allocate_response_reads_back_as_protobuf_writes_it(allocations: list[ContainerAllocation]) -> None:
    written = wire.allocate_response(wire.container_allocate_response(a) for a in allocations)
    expected = api_pb2.AllocateResponse(container_responses=[_protobufs(a) for a in allocations])
    assert api_pb2.AllocateResponse.FromString(written) == expected


def test_an_allocate_response_with_sorted_maps_is_protobufs_deterministic_bytes() -> None:
    allocation = ContainerAllocation(
        envs={"NVIDIA_VISIBLE_DEVICES": "GPU-1,GPU-2", "EMPTY": ""},
        mounts=(Mount("/dev/null", "/var/run/nvidia-container-devices/GPU-1"), Mount("/a", "/b", read_only=True)),
        cdi_devices=("nvidia.com/gpu=GPU-1",),
        annotations={"cdi.k8s.io/x": "nvidia.com/gpu=GPU-1"},
    )
    ordered = ContainerAllocation(
        dict(sorted(allocation.envs.items())), allocation.mounts, allocation.cdi_devices, allocation.annotations
    )
    expected = api_pb2.AllocateResponse(container_responses=[_protobufs(allocation)])
    assert wire.allocate_response([wire.container_allocate_response(ordered)]) == expected.SerializeToString(
        deterministic=True
    )


@given(st.lists(st.lists(TEXT, max_size=4), max_size=3))
def test_a_preferred_allocation_response_is_protobufs_bytes(containers: list[list[str]]) -> None:
    expected = api_pb2.PreferredAllocationResponse(
        container_responses=[api_pb2.ContainerPreferredAllocationResponse(deviceIDs=ids) for ids in containers]
    )
    assert wire.preferred_allocation_response(containers) == expected.SerializeToString()


@given(st.lists(st.lists(st.text(max_size=40), max_size=8), max_size=4))
def test_an_allocate_request_reads_as_protobuf_wrote_it(containers: list[list[str]]) -> None:
    request = api_pb2.AllocateRequest(
        container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids) for ids in containers]
    )
    assert wire.allocate_request(request.SerializeToString()) == tuple(tuple(ids) for ids in containers)


@given(
    st.lists(
        st.tuples(st.lists(TEXT, max_size=5), st.lists(TEXT, max_size=3), st.integers(-(2**31), 2**31 - 1)),
        max_size=3,
    )
)
def test_a_preferred_allocation_request_reads_as_protobuf_wrote_it(containers: list) -> None:
    request = api_pb2.PreferredAllocationRequest(
        container_requests=[
            api_pb2.ContainerPreferredAllocationRequest(
                available_deviceIDs=available, must_include_deviceIDs=must, allocation_size=size
            )
            for available, must, size in containers
        ]
    )
    assert wire.preferred_allocation_request(request.SerializeToString()) == tuple(
        (tuple(available), tuple(must), size) for available, must, size in containers
    )


def test_fields_the_agent_does_not_know_are_skipped() -> None:
    request = api_pb2.AllocateRequest(container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=["GPU-1"])])
    unknown = bytes([7 << 3 | 0, 5, 8 << 3 | 1]) + bytes(8) + bytes([9 << 3 | 5]) + bytes(4) + bytes([10 << 3 | 2, 0])
    assert wire.allocate_request(request.SerializeToString() + unknown) == (("GPU-1",),)


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"\x0a\x05\x0a\x01", id="truncated message"),
        pytest.param(b"\x0a\x03\x0a\x01\xff", id="bad UTF-8"),
        pytest.param(b"\x0a\x80", id="truncated length"),
        pytest.param(b"\x0b", id="group wire type"),
        pytest.param(b"\x02\x00", id="field 0"),
        pytest.param(b"\x08" + b"\xff" * 10 + b"\x01", id="varint too long"),
        pytest.param(b"\x09\x01", id="truncated 64-bit field"),
    ],
)
def test_malformed_requests_are_refused_as_protobuf_refuses_them(data: bytes) -> None:
    with pytest.raises(DecodeError):
        api_pb2.AllocateRequest.FromString(data)
    with pytest.raises(wire.WireError):
        wire.allocate_request(data)
    with pytest.raises(wire.WireError):
        wire.preferred_allocation_request(data)
