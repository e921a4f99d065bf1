"""The PodResources v1 server of the kubelet emulator (``pkg/kubelet/apis/podresources/server_v1.go``)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import grpc

from agent.api.deviceplugin.v1beta1 import api_pb2 as dp
from agent.api.podresources.v1 import api_pb2 as pr
from agent.api.podresources.v1 import api_pb2_grpc as pr_grpc
from agent.sim.kubelet.common import ContainerAllocation, Pod, TokenBucket

log = logging.getLogger("agent.sim.kubelet")

RATE_LIMIT_MESSAGE = "rejected by rate limit"


def _entry(resource: str, device_id: str, node: int | None) -> pr.ContainerDevices:
    entry = pr.ContainerDevices(resource_name=resource, device_ids=[device_id])
    if node is not None:
        entry.topology.nodes.add(ID=node)
    return entry


def allocatable_entries(devices: Iterable[tuple[str, dp.Device]]) -> list[pr.ContainerDevices]:
    """``containerDevicesFromResourceDeviceInstances`` over (resource, Device) pairs: one entry per device per
    NUMA node; no topology -> one entry without ``topology``; a topology with no nodes -> no entry at all."""
    out = []
    for resource, dev in devices:
        if not dev.HasField("topology"):
            out.append(_entry(resource, dev.ID, None))
            continue
        out.extend(_entry(resource, dev.ID, node.ID) for node in dev.topology.nodes)
    return out


def container_entries(allocations: dict[str, ContainerAllocation]) -> list[pr.ContainerDevices]:
    """A container's devices as the pod-devices cache gives them: NUMA nodes recorded at allocation time."""
    out = []
    for resource, alloc in allocations.items():
        for dev in alloc.device_ids:
            nodes = alloc.numa.get(dev) or []
            if not nodes:
                out.append(_entry(resource, dev, None))
            else:
                out.extend(_entry(resource, dev, n) for n in nodes)
    return out


def pod_resources(pod: Pod) -> pr.PodResources:
    """One pod: restartable init containers (sidecars) first, then app containers; ordinary init containers omitted."""
    msg = pr.PodResources(name=pod.name, namespace=pod.namespace)
    for cname in pod.init_containers:
        if cname in pod.sidecars:
            msg.containers.append(
                pr.ContainerResources(name=cname, devices=container_entries(pod.init_containers[cname]))
            )
    for cname, allocations in pod.containers.items():
        msg.containers.append(pr.ContainerResources(name=cname, devices=container_entries(allocations)))
    return msg


class PodResourcesServicer(pr_grpc.PodResourcesListerServicer):
    """List / GetAllocatableResources / Get over the emulator's state, behind a 100 QPS / burst 10 limiter."""

    def __init__(
        self,
        list_pods: Callable[[], list[Pod]],
        find_pod: Callable[[str, str], Pod | None],
        healthy_devices: Callable[[], list[tuple[str, dp.Device]]],
        get_enabled: Callable[[], bool],
        limiter: TokenBucket,
    ) -> None:
        self._list_pods = list_pods
        self._find_pod = find_pod
        self._healthy_devices = healthy_devices
        self._get_enabled = get_enabled
        self._limiter = limiter

    def _admit(self, context: grpc.ServicerContext, method: str) -> None:
        if not self._limiter.allow():
            log.debug("PodResources %s rejected by rate limit", method)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, RATE_LIMIT_MESSAGE)

    def List(self, request, context):
        self._admit(context, "List")
        return pr.ListPodResourcesResponse(pod_resources=[pod_resources(p) for p in self._list_pods()])

    def GetAllocatableResources(self, request, context):
        self._admit(context, "GetAllocatableResources")
        return pr.AllocatableResourcesResponse(devices=allocatable_entries(self._healthy_devices()))

    def Get(self, request, context):
        self._admit(context, "Get")
        if not self._get_enabled():
            context.abort(grpc.StatusCode.UNKNOWN, "PodResources API Get method disabled")
        pod = self._find_pod(request.pod_namespace, request.pod_name)
        if pod is None:
            context.abort(
                grpc.StatusCode.UNKNOWN, f"pod {request.pod_name} in namespace {request.pod_namespace} not found"
            )
        return pr.GetPodResourcesResponse(pod_resources=pod_resources(pod))
