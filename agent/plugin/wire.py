"""The device-plugin messages the agent sends and reads, in protobuf's wire format, without the protobuf runtime.

The plugin speaks a handful of small v1beta1 messages (``proto/deviceplugin/v1beta1/api.proto``). Writing and
reading them here keeps the protobuf runtime out of ``tessera run`` until a feature that needs it loads (the
PodResources client of drains and metrics attribution, DRA): importing the generated classes costs ~17 ms and
~2.4 MB, a sixth of what a start may take. The generated classes (``agent.api.deviceplugin.v1beta1.api_pb2``) stay
the reference: the unit tests hold every message written here equal to theirs, byte for byte where protobuf's
own output is deterministic, and read back what they write.

The format (https://protobuf.dev/programming-guides/encoding/): each field is a key (field number << 3 | wire
type) and a value: a varint (type 0: bool, int32, int64) or a length and that many bytes (type 2: strings, nested
messages, map entries, one per entry). proto3 leaves out singular fields at their default (empty, 0, false);
a repeated field repeats its key; a map entry is a message of its key (1) and value (2), both always written.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agent.core.allocation import ContainerAllocation

VARINT, LENGTH = 0, 2  # the wire types these messages use
MAX_VARINT_BYTES = 10
Container = tuple[str, ...]  # the device IDs of one container's AllocateRequest
PreferredContainer = tuple[tuple[str, ...], tuple[str, ...], int]  # available IDs, must-include IDs, size


class WireError(ValueError):
    """The bytes are not a message of the expected type; the text says where they went wrong."""


# ----- writing -------------------------------------------------------------------------------------------


def _varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64  # int32 and int64 write negative numbers as their 64-bit two's complement
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(number: int, data: bytes) -> bytes:
    """A length-delimited field (a string, a nested message or a map entry), written even when empty."""
    return _varint(number << 3 | LENGTH) + _varint(len(data)) + data


def _string(number: int, value: str) -> bytes:
    """A singular string: left out when empty."""
    return _field(number, value.encode()) if value else b""


def _bool(number: int, value: bool) -> bytes:
    return _varint(number << 3 | VARINT) + b"\x01" if value else b""


def _integer(number: int, value: int) -> bytes:
    return _varint(number << 3 | VARINT) + _varint(value) if value else b""


def _map(number: int, entries: Iterable[tuple[str, str]]) -> bytes:
    return b"".join(_field(number, _field(1, key.encode()) + _field(2, value.encode())) for key, value in entries)


def device_plugin_options(*, pre_start_required: bool, get_preferred_allocation_available: bool) -> bytes:
    """``DevicePluginOptions``."""
    return _bool(1, pre_start_required) + _bool(2, get_preferred_allocation_available)


def register_request(version: str, endpoint: str, resource_name: str, options: bytes) -> bytes:
    """``RegisterRequest``; ``options`` is a serialized ``DevicePluginOptions``."""
    return _string(1, version) + _string(2, endpoint) + _string(3, resource_name) + _field(4, options)


def list_and_watch_device(device_id: str, health: str, numa_node: int | None) -> bytes:
    """One device as a ``ListAndWatchResponse`` of its own. Repeated fields concatenate on the wire, so the
    devices' parts joined in order are the response listing all of them."""
    device = _string(1, device_id) + _string(2, health)
    if numa_node is not None:
        device += _field(3, _field(1, _integer(1, numa_node)))  # TopologyInfo{nodes: [NUMANode{ID}]}
    return _field(1, device)


def container_allocate_response(allocation: ContainerAllocation) -> bytes:
    """One ``ContainerAllocateResponse`` (a field of ``AllocateResponse``: ``allocate_response``)."""
    mounts = b"".join(
        _field(2, _string(1, m.container_path) + _string(2, m.host_path) + _bool(3, m.read_only))
        for m in allocation.mounts
    )
    cdi_devices = b"".join(_field(5, _string(1, name)) for name in allocation.cdi_devices)
    return _map(1, allocation.envs.items()) + mounts + _map(4, allocation.annotations.items()) + cdi_devices


def allocate_response(containers: Iterable[bytes]) -> bytes:
    """``AllocateResponse`` of serialized ``ContainerAllocateResponse``s, in the request's order."""
    return b"".join(_field(1, container) for container in containers)


def preferred_allocation_response(containers: Iterable[Sequence[str]]) -> bytes:
    """``PreferredAllocationResponse``: the device IDs chosen for each container, in the request's order."""
    return b"".join(_field(1, b"".join(_field(1, i.encode()) for i in ids)) for ids in containers)


# ----- reading -------------------------------------------------------------------------------------------


def _read_varint(data: bytes, position: int) -> tuple[int, int]:
    value = shift = 0
    for offset in range(MAX_VARINT_BYTES):
        if position + offset >= len(data):
            raise WireError("a number runs past the end of the message")
        byte = data[position + offset]
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position + offset + 1
        shift += 7
    raise WireError("a number is longer than 10 bytes")


def _fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of each varint (an int) and length-delimited field (bytes) of one message, in the
    order written; fixed-size fields (no field of these messages is one) are skipped as unknown."""
    position, end = 0, len(data)
    while position < end:
        key, position = _read_varint(data, position)
        number, kind = key >> 3, key & 7
        if number == 0:
            raise WireError("a field numbered 0")
        if kind == VARINT:
            value, position = _read_varint(data, position)
            yield number, value
        elif kind == LENGTH:
            length, position = _read_varint(data, position)
            if position + length > end:
                raise WireError(f"field {number} runs past the end of the message")
            yield number, data[position : position + length]
            position += length
        elif kind in (1, 5):  # 64 and 32 bits
            position += 8 if kind == 1 else 4
            if position > end:
                raise WireError(f"field {number} runs past the end of the message")
        else:
            raise WireError(f"field {number} has wire type {kind}, which proto3 does not write")


def _text(value: bytes) -> str:
    try:
        return value.decode()
    except UnicodeDecodeError:
        raise WireError("a string is not valid UTF-8") from None


def allocate_request(data: bytes) -> tuple[Container, ...]:
    """``AllocateRequest``: the device IDs asked for, per container."""
    return tuple(
        tuple(_text(i) for n, i in _fields(container) if n == 1 and isinstance(i, bytes))
        for number, container in _fields(data)
        if number == 1 and isinstance(container, bytes)
    )


def preferred_allocation_request(data: bytes) -> tuple[PreferredContainer, ...]:
    """``PreferredAllocationRequest``: per container, the available IDs, the IDs it must include, and how many."""
    containers = []
    for number, container in _fields(data):
        if number != 1 or not isinstance(container, bytes):
            continue
        available: list[str] = []
        must_include: list[str] = []
        size = 0
        for field, value in _fields(container):
            if field in (1, 2) and isinstance(value, bytes):
                (available if field == 1 else must_include).append(_text(value))
            elif field == 3 and isinstance(value, int):
                size = value & 0xFFFFFFFF  # int32: the low 32 bits, signed
                size = size - (1 << 32) if size >= 1 << 31 else size
        containers.append((tuple(available), tuple(must_include), size))
    return tuple(containers)
