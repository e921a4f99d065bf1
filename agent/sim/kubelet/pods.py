"""Pod admission and container start of the kubelet emulator (``manager.go`` Allocate / devicesToAllocate /
GetDeviceRunContainerOptions). Mixed into ``agent.sim.kubelet.KubeletEmulator``, whose state it uses."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Mapping

import grpc

from agent.api.deviceplugin.v1beta1 import api_pb2
from agent.sim.kubelet.cgroups import StartedContainer
from agent.sim.kubelet.common import (
    CONN_CLOSING,
    AdmissionError,
    ContainerAllocation,
    ContainerStartError,
    DeviceManagerError,
    Endpoint,
    Pod,
    RunContainerOptions,
    go_rpc_error,
    is_extended_resource_name,
    merge_run_options,
)

log = logging.getLogger("agent.sim.kubelet")


class PodsMixin:
    """Pods: admission (device allocation), deletion, container start, listing."""

    def pods(self) -> list[Pod]:
        with self._cond:
            return [p.copy() for p in self._pods.values()]

    def pod(self, name: str, namespace: str = "default") -> Pod:
        with self._cond:
            return self._pods[(namespace, name)].copy()

    def _find_pod_copy(self, namespace: str, name: str) -> Pod | None:
        with self._cond:
            pod = self._pods.get((namespace, name))
            return pod.copy() if pod is not None else None

    def delete_pod(self, name: str, namespace: str = "default") -> None:
        with self._cond:
            pod = self._pods.pop((namespace, name))
            self._write_checkpoint_locked()
            self._changed()
        if self.container_files is not None:
            with self._cond:
                for key in [key for key in self._started if key[:2] == (namespace, name)]:
                    del self._started[key]
            self.container_files.remove_pod(namespace, name, pod.uid)
        log.info("Pod deleted, devices freed: pod=%s/%s uid=%s", namespace, name, pod.uid)

    def create_pod(
        self,
        name: str,
        containers: Mapping[str, Mapping[str, int]],
        namespace: str = "default",
        init_containers: Mapping[str, Mapping[str, int]] | None = None,
        *,
        sidecars: Iterable[str] = (),
    ) -> Pod:
        """Admit a pod: allocate devices for init containers, then app containers; raise AdmissionError on failure.

        ``containers`` / ``init_containers`` map a container name to its limits (resource -> count); ``sidecars``
        names the init containers that are restartable (they keep their devices and are listed by PodResources)."""
        inits = {c: dict(r) for c, r in (init_containers or {}).items()}
        apps = {c: dict(r) for c, r in containers.items()}
        sidecar_names = tuple(sidecars)
        if set(inits) & set(apps):
            raise ValueError(f"container names repeat: {sorted(set(inits) & set(apps))}")
        if not set(sidecar_names) <= set(inits):
            raise ValueError("sidecars must name init containers")
        with self._admission:
            with self._cond:
                if (namespace, name) in self._pods:
                    raise ValueError(f"pod {namespace}/{name} already exists")
                self._gc_locked()
                pod = Pod(
                    name=name,
                    namespace=namespace,
                    uid=str(uuid.uuid4()),
                    containers={c: {} for c in apps},
                    init_containers={c: {} for c in inits},
                    sidecars=sidecar_names,
                    requests={**inits, **apps},
                )
                self._admitting = pod
                self._pending = {}
                self._reuse = {pod.uid: {}}  # Allocate drops reuse sets of other pods
            try:
                for cname in (*inits, *apps):
                    self._allocate(pod, cname)
                self._check_node_resources(pod)
            except DeviceManagerError as exc:
                self._rollback(pod)
                message = f"Allocate failed due to {exc}, which is unexpected"
                log.info(
                    "Pod admission failed: pod=%s/%s reason=UnexpectedAdmissionError: %s", namespace, name, message
                )
                raise AdmissionError(message) from None
            except AdmissionError as exc:
                self._rollback(pod)
                log.info("Pod admission failed: pod=%s/%s reason=%s: %s", namespace, name, exc.reason, exc.message)
                raise
            except BaseException:
                self._rollback(pod)
                raise
            with self._cond:
                self._admitting = None
                self._pending = {}
                self._pods[(namespace, name)] = pod
                self._write_checkpoint_locked()
                self._changed()
                result = pod.copy()
        log.info("Pod admitted: pod=%s/%s uid=%s", namespace, name, pod.uid)
        return result

    def _rollback(self, pod: Pod) -> None:
        with self._cond:
            self._admitting = None
            self._pending = {}
            self._reuse.pop(pod.uid, None)
            self._changed()

    def _allocate(self, pod: Pod, cname: str) -> None:
        """manager.go Allocate(pod, container): init-container devices become reusable by later containers."""
        reuse = self._reuse.setdefault(pod.uid, {})
        self._allocate_container_resources(pod, cname, reuse)
        with self._cond:
            allocations = pod.allocation(cname)
            keep = cname in pod.init_containers and cname not in pod.sidecars
            for resource, alloc in allocations.items():
                current = reuse.setdefault(resource, [])
                if keep:  # addContainerAllocatedResources
                    current.extend(d for d in alloc.device_ids if d not in current)
                else:  # removeContainerAllocatedResources
                    reuse[resource] = [d for d in current if d not in alloc.device_ids]

    def _allocate_container_resources(self, pod: Pod, cname: str, reuse: dict[str, list[str]]) -> None:
        for resource, needed in pod.requests[cname].items():
            with self._cond:
                if not self._is_device_plugin_resource_locked(resource):
                    continue
            devs = self._devices_to_allocate(pod, cname, resource, int(needed), reuse.get(resource, []))
            if not devs:
                continue
            with self._cond:
                ep = self._endpoints.get(resource)
            if ep is None:
                with self._cond:
                    self._pending.pop(resource, None)
                raise DeviceManagerError(f"unknown Device Plugin {resource}")
            log.info("Making allocation request for device plugin: resource=%s devices=%s", resource, devs)
            request = api_pb2.AllocateRequest(container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=devs)])
            try:
                if ep.stopped() or ep.client is None or ep.client.stub is None:
                    raise DeviceManagerError(f"endpoint {ep.describe()} has been stopped")
                response = ep.client.stub.Allocate(request, timeout=self.call_timeout)
            except grpc.RpcError as exc:
                with self._cond:
                    self._pending.pop(resource, None)  # allocatedDevices = podDevices.devices()
                raise DeviceManagerError(go_rpc_error(exc)) from None
            except ValueError:
                with self._cond:
                    self._pending.pop(resource, None)
                raise DeviceManagerError(CONN_CLOSING) from None
            except DeviceManagerError:
                with self._cond:
                    self._pending.pop(resource, None)
                raise
            if not response.container_responses:
                raise DeviceManagerError(
                    "no containers return in allocation response "
                    "&AllocateResponse{ContainerResponses:[]*ContainerAllocateResponse{},}"
                )
            with self._cond:
                known = self._all.get(resource, {})
                numa = {d: [n.ID for n in known[d].topology.nodes] if d in known else [] for d in devs}
                first = api_pb2.ContainerAllocateResponse()
                first.CopyFrom(response.container_responses[0])
                pod.allocation(cname)[resource] = ContainerAllocation(device_ids=list(devs), response=first, numa=numa)
                pending = self._pending.get(resource, set())
                pending.difference_update(devs)
                self._changed()

    def _devices_to_allocate(
        self, pod: Pod, cname: str, resource: str, required: int, reusable: list[str]
    ) -> list[str]:
        """manager.go devicesToAllocate, without a topology hint (everything is "no affinity")."""
        chosen: list[str] = []
        needed = required

        def take(candidates: Iterable[str]) -> bool:
            nonlocal needed
            for dev in candidates:
                if needed == 0:
                    break
                if dev in chosen:
                    continue
                self._pending.setdefault(resource, set()).add(dev)
                chosen.append(dev)
                needed -= 1
            return needed == 0

        with self._cond:
            cached = pod.allocation(cname).get(resource)
            if cached is not None:
                needed -= len(cached.device_ids)
                if needed != 0:
                    raise DeviceManagerError(
                        f'pod "{pod.uid}" container "{cname}" changed request for resource "{resource}" '
                        f"from {len(cached.device_ids)} to {required}"
                    )
            if resource not in self._healthy:
                raise DeviceManagerError(f"cannot allocate unregistered device {resource}")
            healthy = self._healthy[resource]
            if not healthy:
                raise DeviceManagerError(f"no healthy devices present; cannot allocate unhealthy devices {resource}")
            if cached is not None and not set(cached.device_ids) <= healthy:
                raise DeviceManagerError(
                    f"previously allocated devices are no longer healthy; cannot allocate unhealthy devices {resource}"
                )
            if needed == 0:
                return []
            if take(reusable):
                return chosen
            in_use = self._allocated_locked(resource)
            available = [d for d in self._all.get(resource, {}) if d in healthy and d not in in_use]
            if len(available) < needed:
                raise DeviceManagerError(
                    f"requested number of devices unavailable for {resource}. "
                    f"Requested: {needed}, Available: {len(available)}"
                )
            ep = self._endpoints.get(resource)
            if ep is None:
                raise DeviceManagerError(f"endpoint not found in cache for a registered resource: {resource}")
            must_include = list(chosen)
        preferred: list[str] = []
        if ep.options is not None and ep.options.get_preferred_allocation_available:
            preferred = self._call_preferred(ep, resource, must_include + available, must_include, required)
        with self._cond:
            candidates = set(available)
            if take(d for d in preferred if d in candidates):
                return chosen
            if take(available):
                return chosen
        raise DeviceManagerError(
            f"unexpectedly allocated less resources than required. Requested: {required}, Got: {required - needed}"
        )

    def _call_preferred(
        self, ep: Endpoint, resource: str, available: list[str], must_include: list[str], size: int
    ) -> list[str]:
        prefix = "device plugin GetPreferredAllocation rpc failed with err: "
        if ep.stopped() or ep.client is None or ep.client.stub is None:
            raise DeviceManagerError(prefix + f"endpoint {ep.describe()} has been stopped")
        request = api_pb2.PreferredAllocationRequest(
            container_requests=[
                api_pb2.ContainerPreferredAllocationRequest(
                    available_deviceIDs=available, must_include_deviceIDs=must_include, allocation_size=size
                )
            ]
        )
        log.info("Issuing a GetPreferredAllocation call: resource=%s size=%d", resource, size)
        try:
            response = ep.client.stub.GetPreferredAllocation(request, timeout=self.call_timeout)
        except grpc.RpcError as exc:
            raise DeviceManagerError(prefix + go_rpc_error(exc)) from None
        except ValueError:
            raise DeviceManagerError(prefix + CONN_CLOSING) from None
        if response.container_responses:
            return list(response.container_responses[0].deviceIDs)
        return []

    def _check_node_resources(self, pod: Pod) -> None:
        """The predicate admit handler, for extended resources the device manager does not know (capacity 0).

        For device-plugin resources it cannot fail once the device manager succeeded: sanitizeNodeAllocatable
        raises node allocatable to at least the allocated device count."""
        for resource, requested in self._effective_requests(pod).items():
            if requested <= 0 or not is_extended_resource_name(resource):
                continue
            with self._cond:
                if self._is_device_plugin_resource_locked(resource):
                    continue
                used = sum(self._effective_requests(p).get(resource, 0) for p in self._pods.values())
            raise AdmissionError(
                f"Node didn't have enough resource: {resource}, requested: {requested}, used: {used}, capacity: 0",
                reason=f"OutOf{resource}",
            )

    @staticmethod
    def _effective_requests(pod: Pod) -> dict[str, int]:
        totals: dict[str, int] = {}
        for cname in (*pod.sidecars, *pod.containers):
            for r, n in pod.requests[cname].items():
                totals[r] = totals.get(r, 0) + int(n)
        for cname in pod.init_containers:
            if cname not in pod.sidecars:
                for r, n in pod.requests[cname].items():
                    totals[r] = max(totals.get(r, 0), int(n))
        return totals

    def start_container(self, pod: str, container: str, namespace: str = "default") -> RunContainerOptions:
        """GetDeviceRunContainerOptions: PreStartContainer (30 s timeout) for every resource whose plugin asked for
        it, then the merged Allocate responses. Raises ContainerStartError like CreateContainerConfigError."""
        with self._cond:
            record = self._pods[(namespace, pod)]
            limits = dict(record.requests[container])
        for resource, count in limits.items():
            with self._cond:
                if count == 0 or not self._is_device_plugin_resource_locked(resource):
                    continue
                ep = self._endpoints.get(resource)
                alloc = record.allocation(container).get(resource)
            if ep is None:
                raise ContainerStartError(f"endpoint not found in cache for a registered resource: {resource}")
            if ep.options is None or not ep.options.pre_start_required:
                continue
            if alloc is None:
                raise ContainerStartError(
                    f"no devices found allocated in local cache for pod {record.uid}, container {container}, "
                    f"resource {resource}"
                )
            prefix = "device plugin PreStartContainer rpc failed with err: "
            if ep.stopped() or ep.client is None or ep.client.stub is None:
                raise ContainerStartError(prefix + f"endpoint {ep.describe()} has been stopped")
            log.info("Issuing a PreStartContainer call: resource=%s container=%s", resource, container)
            try:
                ep.client.stub.PreStartContainer(
                    api_pb2.PreStartContainerRequest(devices_ids=alloc.device_ids), timeout=self.pre_start_timeout
                )
            except grpc.RpcError as exc:
                raise ContainerStartError(prefix + go_rpc_error(exc)) from None
            except ValueError:
                raise ContainerStartError(prefix + CONN_CLOSING) from None
        with self._cond:
            responses = [a.response for a in record.allocation(container).values()]
            if self.container_files is not None and (namespace, pod, container) not in self._started:
                started = self.container_files.start(namespace, pod, record.uid, container)
                self._started[(namespace, pod, container)] = started
        log.info("Container started: pod=%s/%s container=%s", namespace, pod, container)
        return merge_run_options(responses, log)

    def started_container(self, pod: str, container: str, namespace: str = "default") -> StartedContainer:
        """The started container's ID, cgroup and /proc line (the emulator was given a cgroup and a log root)."""
        with self._cond:
            return self._started[(namespace, pod, container)]
