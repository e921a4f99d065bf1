"""Which devices the kubelet has allocated to pods: a client of the kubelet's PodResources API (v1).

The answer is bounded: gRPC refuses a message larger than ``MAX_RECEIVE_BYTES`` (16 MiB, the limit the
kubelet's own PodResources client uses), at most ``MAX_DEVICE_IDS`` device IDs are kept, and names longer than
``MAX_NAME_CHARS`` are refused. Whatever goes wrong — no socket, a failed call, an answer too big or
malformed — is a :class:`PodResourcesError`, never another exception; callers treat it as "unknown", which
counts as busy.

The same answer names the DRA claims each container uses (``dynamic_resources``, filled by kubelets from 1.34,
where the ``KubeletPodResourcesDynamicResources`` gate is on by default): telemetry reads from it which pods a
claim's devices serve, as dcgm-exporter does, in the one List call it makes anyway.

The answer is read from protobuf's wire format by :mod:`agent.plugin.podresources_wire`: the protobuf runtime
(~2.4 MB for the process's life) is never loaded for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from msgspec import Struct, field

if TYPE_CHECKING:
    from agent.plugin.podresources_wire import ListPodResourcesResponse

TIMEOUT = 5.0
MAX_RECEIVE_BYTES = 16 << 20  # as the kubelet's own PodResources client (DefaultPodResourcesMaxSize, 16 MiB)
MAX_DEVICE_IDS = 1 << 18  # 262,144: 8 GPUs x 7 MIG devices x 1,024 replicas is 57,344, plus other vendors' devices
MAX_NAME_CHARS = 1024  # a device ID, resource, pod, namespace or container name; Kubernetes' own are far shorter
CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
    ("grpc.max_send_message_length", 1 << 20),
)


class PodResourcesError(RuntimeError):
    pass


class DeviceHolder(Struct, frozen=True):
    namespace: str
    pod: str
    container: str
    resource: str


ClaimDeviceKey = tuple[str, str, str, str]  # the claim's namespace and name, the device's pool and name
PodName = tuple[str, str]  # namespace, name
ContainerName = tuple[str, str, str]  # namespace, pod, container


class PodAllocations(Struct, frozen=True):
    """One PodResources List: ``devices`` as ``allocated_devices`` gives them, and ``claims``: each DRA claim
    device a container uses -> the pods using it (empty when the kubelet does not report dynamic resources)."""

    devices: dict[str, DeviceHolder]
    claims: dict[ClaimDeviceKey, frozenset[PodName]]
    claim_containers: dict[ClaimDeviceKey, frozenset[ContainerName]] = field(default_factory=dict)


def allocated_devices(socket: Path) -> dict[str, DeviceHolder]:
    """Device ID (as advertised, replicas included) -> the pod and container holding it."""
    return list_pod_resources(socket).devices


def list_pod_resources(socket: Path) -> PodAllocations:
    """The device-plugin devices and the DRA claim devices the kubelet has given to pods, from one List."""
    try:
        if not socket.exists():
            raise PodResourcesError(f"the kubelet's PodResources socket {socket} does not exist")
        from agent.plugin.podresources_wire import LIST_METHOD, list_response

        with grpc.insecure_channel(f"unix://{socket}", options=CHANNEL_OPTIONS) as channel:
            answer = channel.unary_unary(LIST_METHOD)(b"", timeout=TIMEOUT)  # bytes out and in: no protobuf runtime
        response = list_response(answer)
        return PodAllocations(_holders(response), _claim_users(response), _claim_containers(response))
    except PodResourcesError:
        raise
    except grpc.RpcError as error:
        raise PodResourcesError(f"PodResources List failed: {_rpc_error(error)}") from error
    except Exception as error:  # a malformed answer, an unusable socket path: the answer is unknown
        raise PodResourcesError(
            f"PodResources List gave an unusable answer: {type(error).__name__}: {error}"
        ) from error


def _rpc_error(error: grpc.RpcError) -> str:
    code = getattr(error, "code", None)
    details = getattr(error, "details", None)
    if callable(code) and callable(details):
        return f"{code().name}: {details()}"
    return str(error) or type(error).__name__


def _holders(response: ListPodResourcesResponse) -> dict[str, DeviceHolder]:
    holders: dict[str, DeviceHolder] = {}
    for pod in response.pod_resources:
        for container in pod.containers:
            for devices in container.devices:
                names = (pod.namespace, pod.name, container.name, devices.resource_name)
                if any(len(name) > MAX_NAME_CHARS for name in names):
                    raise PodResourcesError(
                        f"PodResources answer names a pod, container or resource longer than {MAX_NAME_CHARS} "
                        "characters; it is not a kubelet's answer"
                    )
                for device_id in devices.device_ids:
                    if len(device_id) > MAX_NAME_CHARS:
                        raise PodResourcesError(
                            f"PodResources answer has a device ID longer than {MAX_NAME_CHARS} characters "
                            f"({devices.resource_name}); it is not a kubelet's answer"
                        )
                    holders[device_id] = DeviceHolder(pod.namespace, pod.name, container.name, devices.resource_name)
                    if len(holders) > MAX_DEVICE_IDS:
                        raise PodResourcesError(
                            f"PodResources answer lists more than {MAX_DEVICE_IDS:,} allocated device IDs; "
                            "it is not a kubelet's answer"
                        )
    return holders


def _claim_users(response: ListPodResourcesResponse) -> dict[ClaimDeviceKey, frozenset[PodName]]:
    users: dict[ClaimDeviceKey, set[PodName]] = {}
    count = 0
    for pod in response.pod_resources:
        for container in pod.containers:
            for claim in container.dynamic_resources:
                for device in claim.claim_resources:
                    key = (claim.claim_namespace, claim.claim_name, device.pool_name, device.device_name)
                    if any(len(name) > MAX_NAME_CHARS for name in (*key, pod.namespace, pod.name)):
                        raise PodResourcesError(
                            f"PodResources answer names a pod, claim or claim device longer than {MAX_NAME_CHARS} "
                            "characters; it is not a kubelet's answer"
                        )
                    count += 1
                    if count > MAX_DEVICE_IDS:
                        raise PodResourcesError(
                            f"PodResources answer lists more than {MAX_DEVICE_IDS:,} claim devices; "
                            "it is not a kubelet's answer"
                        )
                    users.setdefault(key, set()).add((pod.namespace, pod.name))
    return {key: frozenset(pods) for key, pods in users.items()}


def _claim_containers(response: ListPodResourcesResponse) -> dict[ClaimDeviceKey, frozenset[ContainerName]]:
    """Each claim device -> the containers using it (the memory limits hold each container); called after
    ``_claim_users``, which refused an answer with names too long or too many claim devices."""
    containers: dict[ClaimDeviceKey, set[ContainerName]] = {}
    for pod in response.pod_resources:
        for container in pod.containers:
            for claim in container.dynamic_resources:
                for device in claim.claim_resources:
                    key = (claim.claim_namespace, claim.claim_name, device.pool_name, device.device_name)
                    if len(container.name) <= MAX_NAME_CHARS:
                        containers.setdefault(key, set()).add((pod.namespace, pod.name, container.name))
    return {key: frozenset(names) for key, names in containers.items()}
