"""The kubelet's PodResources ``List`` answer read from protobuf's wire format, without the protobuf runtime.

The agent lists the kubelet's pod resources once its devices are in use (metrics attribution, drains): the
generated classes would load the protobuf runtime with the first call, ~2.4 MB that stay for the process's life.
This reads the few fields the agent uses of ``ListPodResourcesResponse`` (``proto/podresources/v1/api.proto``)
into frozen structs with the generated classes' field names; every other field is skipped, as protobuf skips
an unknown one. ``tests/unit/test_podresources_wire.py`` holds it equal to the generated classes.
"""

from __future__ import annotations

from msgspec import Struct

from agent.plugin.wire import WireError, _fields, _text

LIST_METHOD = "/v1.PodResourcesLister/List"  # package v1, service PodResourcesLister; its request is empty

__all__ = ["LIST_METHOD", "ListPodResourcesResponse", "WireError", "list_response"]


class ContainerDevices(Struct, frozen=True):
    resource_name: str = ""
    device_ids: tuple[str, ...] = ()


class ClaimResource(Struct, frozen=True):
    pool_name: str = ""
    device_name: str = ""


class DynamicResource(Struct, frozen=True):
    claim_name: str = ""
    claim_namespace: str = ""
    claim_resources: tuple[ClaimResource, ...] = ()


class ContainerResources(Struct, frozen=True):
    name: str = ""
    devices: tuple[ContainerDevices, ...] = ()
    dynamic_resources: tuple[DynamicResource, ...] = ()


class PodResources(Struct, frozen=True):
    name: str = ""
    namespace: str = ""
    containers: tuple[ContainerResources, ...] = ()


class ListPodResourcesResponse(Struct, frozen=True):
    pod_resources: tuple[PodResources, ...] = ()


def list_response(data: bytes) -> ListPodResourcesResponse:
    """``ListPodResourcesResponse``; :class:`WireError` when the bytes are not one."""
    return ListPodResourcesResponse(tuple(_pod(m) for n, m in _fields(data) if n == 1 and _message(n, m)))


def _message(number: int, value: int | bytes) -> bool:
    if not isinstance(value, bytes):
        raise WireError(f"field {number} is a number where a message belongs")
    return True


def _string(number: int, value: int | bytes) -> str:
    if not isinstance(value, bytes):
        raise WireError(f"field {number} is a number where a string belongs")
    return _text(value)


def _pod(data: bytes) -> PodResources:
    name = namespace = ""
    containers = []
    for number, value in _fields(data):
        if number == 1:
            name = _string(number, value)
        elif number == 2:
            namespace = _string(number, value)
        elif number == 3 and _message(number, value):
            containers.append(_container(value))  # type: ignore[arg-type]
    return PodResources(name, namespace, tuple(containers))


def _container(data: bytes) -> ContainerResources:
    name = ""
    devices, dynamic = [], []
    for number, value in _fields(data):
        if number == 1:
            name = _string(number, value)
        elif number == 2 and _message(number, value):
            devices.append(_devices(value))  # type: ignore[arg-type]
        elif number == 5 and _message(number, value):
            dynamic.append(_dynamic(value))  # type: ignore[arg-type]
    return ContainerResources(name, tuple(devices), tuple(dynamic))


def _devices(data: bytes) -> ContainerDevices:
    resource = ""
    ids = []
    for number, value in _fields(data):
        if number == 1:
            resource = _string(number, value)
        elif number == 2:
            ids.append(_string(number, value))
    return ContainerDevices(resource, tuple(ids))


def _dynamic(data: bytes) -> DynamicResource:
    claim_name = claim_namespace = ""
    resources = []
    for number, value in _fields(data):
        if number == 2:
            claim_name = _string(number, value)
        elif number == 3:
            claim_namespace = _string(number, value)
        elif number == 4 and _message(number, value):
            resources.append(_claim_resource(value))  # type: ignore[arg-type]
    return DynamicResource(claim_name, claim_namespace, tuple(resources))


def _claim_resource(data: bytes) -> ClaimResource:
    pool = device = ""
    for number, value in _fields(data):
        if number == 3:
            pool = _string(number, value)
        elif number == 4:
            device = _string(number, value)
    return ClaimResource(pool, device)
