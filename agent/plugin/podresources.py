"""Which devices the kubelet has allocated to pods: a client of the kubelet's PodResources API (v1)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from agent.api.podresources.v1 import api_pb2, api_pb2_grpc

TIMEOUT = 5.0


class PodResourcesError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class DeviceHolder:
    namespace: str
    pod: str
    container: str
    resource: str


def allocated_devices(socket: Path) -> dict[str, DeviceHolder]:
    """Device ID (as advertised, replicas included) -> the pod and container holding it."""
    if not socket.exists():
        raise PodResourcesError(f"the kubelet's PodResources socket {socket} does not exist")
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        try:
            response = api_pb2_grpc.PodResourcesListerStub(channel).List(
                api_pb2.ListPodResourcesRequest(), timeout=TIMEOUT
            )
        except grpc.RpcError as error:
            raise PodResourcesError(f"PodResources List failed: {error.code().name}: {error.details()}") from error
    holders = {}
    for pod in response.pod_resources:
        for container in pod.containers:
            for devices in container.devices:
                for device_id in devices.device_ids:
                    holders[device_id] = DeviceHolder(pod.namespace, pod.name, container.name, devices.resource_name)
    return holders
