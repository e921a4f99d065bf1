"""The PodResources v1 server of the kubelet emulator (``pkg/kubelet/apis/podresources/server_v1.go``).

One socket per node, as the kubelet has: it lists the device-plugin devices of the emulator's pods and, once a DRA
kubelet emulator is attached (``KubeletEmulator.serve_dra``), the DRA claims of the pods that one runs
(``dynamic_resources``, as a kubelet with ``KubeletPodResourcesDynamicResources`` on, the default from 1.34).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import grpc

from agent.api.deviceplugin.v1beta1 import api_pb2 as dp
from agent.api.podresources.v1 import api_pb2 as pr
from agent.api.podresources.v1 import api_pb2_grpc as pr_grpc
from agent.sim.kubelet.common import ContainerAllocation, Pod, TokenBucket

if TYPE_CHECKING:
    from agent.sim.kubelet.dra_common import ClaimState, DraPod

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


def dra_pod_resources(pods: Iterable[DraPod], claims: Iterable[ClaimState]) -> list[pr.PodResources]:
    """The running DRA pods with, per container, each claim its ``resources.claims`` names and that claim's devices
    (only the request's, when the container names one), as ``containerDynamicResources`` builds them."""
    by_name = {(c.namespace, c.name): c for c in claims}
    out = []
    for pod in pods:
        if not pod.running:
            continue
        claim_of = dict(pod.claims)  # pod claim name -> ResourceClaim name (None: none was generated)
        msg = pr.PodResources(name=pod.name, namespace=pod.namespace)
        for cname, refs in pod.containers.items():
            dynamic = []
            for ref, request in refs:
                claim_name = claim_of.get(ref)
                claim = by_name.get((pod.namespace, claim_name)) if claim_name is not None else None
                if claim is None:
                    continue
                resources = [
                    pr.ClaimResource(
                        cdi_devices=[pr.CDIDevice(name=cdi) for cdi in d.cdi_device_ids],
                        driver_name=d.driver,
                        pool_name=d.pool,
                        device_name=d.device,
                        share_id=d.share_id or "",
                    )
                    for d in claim.devices
                    if request is None or request in d.request_names
                ]
                dynamic.append(
                    pr.DynamicResource(
                        claim_name=claim.name, claim_namespace=claim.namespace, claim_resources=resources
                    )
                )
            msg.containers.append(pr.ContainerResources(name=cname, dynamic_resources=dynamic))
        out.append(msg)
    return out


def merge_pods(device_pods: list[pr.PodResources], dra_pods: list[pr.PodResources]) -> list[pr.PodResources]:
    """One entry per pod: a pod with both device-plugin devices and DRA claims lists each container once."""
    merged = {(p.namespace, p.name): p for p in device_pods}
    for pod in dra_pods:
        known = merged.get((pod.namespace, pod.name))
        if known is None:
            merged[(pod.namespace, pod.name)] = pod
            continue
        containers = {c.name: c for c in known.containers}
        for container in pod.containers:
            if container.name in containers:
                containers[container.name].dynamic_resources.extend(container.dynamic_resources)
            else:
                known.containers.append(container)
    return list(merged.values())


class PodResourcesServicer(pr_grpc.PodResourcesListerServicer):
    """List / GetAllocatableResources / Get over the emulator's state, behind a 100 QPS / burst 10 limiter."""

    def __init__(
        self,
        list_pods: Callable[[], list[Pod]],
        find_pod: Callable[[str, str], Pod | None],
        healthy_devices: Callable[[], list[tuple[str, dp.Device]]],
        get_enabled: Callable[[], bool],
        limiter: TokenBucket,
        dra_pods: Callable[[], list[pr.PodResources]] = list,
    ) -> None:
        """``dra_pods``: the pods a DRA kubelet emulator runs, with their claims (``dra_pod_resources``)."""
        self._dra_pods = dra_pods
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
        device_pods = [pod_resources(p) for p in self._list_pods()]
        return pr.ListPodResourcesResponse(pod_resources=merge_pods(device_pods, self._dra_pods()))

    def GetAllocatableResources(self, request, context):
        self._admit(context, "GetAllocatableResources")
        return pr.AllocatableResourcesResponse(devices=allocatable_entries(self._healthy_devices()))

    def Get(self, request, context):
        self._admit(context, "Get")
        if not self._get_enabled():
            context.abort(grpc.StatusCode.UNKNOWN, "PodResources API Get method disabled")
        pod = self._find_pod(request.pod_namespace, request.pod_name)
        found = [pod_resources(pod)] if pod is not None else []
        dra = [p for p in self._dra_pods() if (p.namespace, p.name) == (request.pod_namespace, request.pod_name)]
        if not found and not dra:
            context.abort(
                grpc.StatusCode.UNKNOWN, f"pod {request.pod_name} in namespace {request.pod_namespace} not found"
            )
        return pr.GetPodResourcesResponse(pod_resources=merge_pods(found, dra)[0])
