"""A kubelet emulator: the device manager and the PodResources API, over real gRPC on real unix sockets.

``KubeletEmulator`` serves ``v1beta1.Registration`` on ``<dir>/kubelet.sock`` and, when asked, ``v1.PodResourcesLister``
on a second socket. It reaches device plugins only through the wire protocol, the way the kubelet does:

* ``Register``: version check, resource-name check (``IsExtendedResourceName``), a blocking dial of
  ``<dir>/<endpoint>``, ``GetDevicePluginOptions`` (stored; ``RegisterRequest.options`` is ignored), reply, then
  ``ListAndWatch`` in a background thread. Errors reach the plugin as gRPC ``UNKNOWN`` with the kubelet's texts.
* Each ``ListAndWatch`` message replaces the device set; only ``health == "Healthy"`` counts as healthy. When a stream
  ends the resource's devices are all marked unhealthy and the endpoint is stopped; nothing is re-dialled, and after
  ``grace_period`` seconds the resource is dropped.
* Pod admission follows ``devicesToAllocate``: init-container reuse, the availability check, GetPreferredAllocation
  when the plugin asks for it, then one ``Allocate`` RPC with one ``ContainerAllocateRequest`` per (container,
  resource). ``start_container`` makes the ``PreStartContainer`` call.
* ``restart`` is a kubelet restart: the checkpoint (allocations and registered resource names) survives, every other
  file in the directory is deleted (``CleanupPluginDirectory``, see ``_prepare_dir``), and restored resources read
  capacity 0 until their plugin registers again.

The rules and texts come from /work/shared/facts/kubelet-behaviour.md. Where the kubelet's behaviour is random (Go map
and set order) the emulator is deterministic: resources in request order, devices in the plugin's advertised order.
There is no topology manager (no NUMA hint), so every device is "no affinity" for the allocation algorithm.

Choices beyond the kubelet's own rules (all keyword arguments of ``KubeletEmulator``):

* ``start()`` cleans the directory as the kubelet's ``Start`` does (``cleanup_on_start``), so a plugin serving before
  the emulator starts loses its socket and must serve again and register, as on a real node.
* A replaced registration's stream ending only closes that stream (the fix of PR #135437);
  ``legacy_reregistration_race=True`` reproduces kubelet <= 1.36, where it disconnects the newer registration.
* ``<dir>/kubelet_internal_checkpoint`` is written in the kubelet's JSON format, with ``Checksum`` 0.
* Extended resources no plugin ever advertised fail admission as the predicate handler does (``OutOf<resource>``).
* ``start_container`` returns the merged ``RunContainerOptions`` (envs, mounts, devices, annotations, CDI devices).
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING

import grpc

from agent.api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from agent.api.podresources.v1 import api_pb2_grpc as pr_grpc
from agent.sim.kubelet.cgroups import ContainerFiles, StartedContainer
from agent.sim.kubelet.common import (
    CHECKPOINT_FILE,
    HEALTHY,
    KUBELET_SOCKET,
    PRE_START_TIMEOUT,
    UNHEALTHY,
    AdmissionError,
    ContainerAllocation,
    ContainerStartError,
    Endpoint,
    PluginClient,
    Pod,
    RunContainerOptions,
    TokenBucket,
    checkpoint_document,
    write_file_atomically,
)
from agent.sim.kubelet.podresources import PodResourcesServicer, dra_pod_resources
from agent.sim.kubelet.pods import PodsMixin
from agent.sim.kubelet.registration import RegistrationMixin, RegistrationServicer

if TYPE_CHECKING:
    from agent.api.podresources.v1 import api_pb2 as pr
    from agent.sim.kubelet.dra import DraKubeletEmulator

__all__ = [
    "AdmissionError",
    "ContainerAllocation",
    "ContainerStartError",
    "KubeletEmulator",
    "Pod",
    "RunContainerOptions",
]

log = logging.getLogger("agent.sim.kubelet")

_MAX_UNIX_PATH = 107  # sun_path is 108 bytes including the terminating NUL


class KubeletEmulator(RegistrationMixin, PodsMixin):
    """The kubelet's device manager and PodResources server, for tests and ``tessera demo``."""

    def __init__(
        self,
        device_plugin_dir: str | Path,
        pod_resources_socket: str | Path | None = None,
        *,
        grace_period: float = 300.0,
        dial_timeout: float = 10.0,
        pod_resources_get_enabled: bool = True,
        call_timeout: float | None = None,
        legacy_reregistration_race: bool = False,
        cleanup_on_start: bool = True,
        checkpoint: bool = True,
        pod_resources_qps: float = 100.0,
        pod_resources_burst: int = 10,
        cgroup_root: str | Path | None = None,
        log_root: str | Path | None = None,
    ) -> None:
        """``call_timeout`` bounds GetDevicePluginOptions / GetPreferredAllocation / Allocate (the kubelet uses none).
        ``legacy_reregistration_race`` reproduces kubelet <= 1.36 (clients keyed by resource name: when a replaced
        stream ends it disconnects the NEW registration); off, a stale stream's end only affects itself.
        ``cgroup_root`` / ``log_root``: where started containers get their cgroup directories and log links
        (``agent.sim.kubelet.cgroups``); both or neither."""
        self.device_plugin_dir = Path(device_plugin_dir)
        self.kubelet_socket = self.device_plugin_dir / KUBELET_SOCKET
        self.checkpoint_path = self.device_plugin_dir / CHECKPOINT_FILE
        self.pod_resources_socket = Path(pod_resources_socket) if pod_resources_socket is not None else None
        self.grace_period = float(grace_period)
        self.dial_timeout = float(dial_timeout)
        self.pod_resources_get_enabled = bool(pod_resources_get_enabled)
        self.call_timeout = call_timeout
        self.pre_start_timeout = PRE_START_TIMEOUT
        self.legacy_reregistration_race = legacy_reregistration_race
        self.cleanup_on_start = cleanup_on_start
        self.checkpoint_enabled = checkpoint
        self._limiter_args = (pod_resources_qps, pod_resources_burst)
        self._dra: DraKubeletEmulator | None = None  # the node's DRA side, whose pods PodResources lists too

        self._cond = threading.Condition(threading.RLock())
        self._version = 0
        self._checkpoint_taken = 0  # checkpoints taken (under _cond): a later one holds a newer state
        self._checkpoint_written_lock = threading.Lock()  # taken after _cond, never before it
        self._checkpoint_written = 0  # which of them is on disk
        self._running = False
        self._stopping = threading.Event()
        self._servers: list[tuple[grpc.Server, futures.ThreadPoolExecutor]] = []
        # device manager state (manager.go)
        self._healthy: dict[str, set[str]] = {}
        self._unhealthy: dict[str, set[str]] = {}
        self._all: dict[str, dict[str, api_pb2.Device]] = {}
        self._endpoints: dict[str, Endpoint] = {}
        self._clients_by_name: dict[str, PluginClient] = {}  # handler.go s.clients (legacy mode)
        self._clients: set[PluginClient] = set()  # every open connection of this incarnation
        self._threads: list[threading.Thread] = []  # ListAndWatch threads of this incarnation
        self._registrations: dict[str, int] = {}
        # pods
        self._admission = threading.Lock()  # the kubelet admits pods one at a time
        self._pods: dict[tuple[str, str], Pod] = {}
        self._admitting: Pod | None = None
        self._pending: dict[str, set[str]] = {}  # devices taken by the admission in progress, not yet cached
        self._reuse: dict[str, dict[str, list[str]]] = {}  # devicesToReuse, only for the pod being admitted
        # containers started, with their cgroups and log links, when the emulator makes them
        if (cgroup_root is None) != (log_root is None):
            raise ValueError("cgroup_root and log_root go together: give both or neither")
        self.container_files = ContainerFiles(Path(cgroup_root), Path(log_root)) if cgroup_root and log_root else None
        self._started: dict[tuple[str, str, str], StartedContainer] = {}  # (namespace, pod, container) -> it

    # ------------------------------------------------------------------------------------------ lifecycle

    def serve_dra(self, dra: DraKubeletEmulator | None) -> None:
        """List the pods ``dra`` runs, with their claims, on this emulator's PodResources socket: the kubelet has
        one socket per node for device-plugin devices and DRA claims alike."""
        self._dra = dra

    def _dra_pod_resources(self) -> list[pr.PodResources]:
        """The DRA pods' ``dynamic_resources``, when the DRA side's release fills them (1.34+: the
        ``KubeletPodResourcesDynamicResources`` gate is beta and on; alpha and off before)."""
        dra = self._dra
        if dra is None or not dra.rules.pod_resources_dynamic:
            return []
        return dra_pod_resources(dra.pods(), dra.claims())

    def start(self) -> None:
        """Create the directory (0750), delete every file in it but the checkpoint, serve kubelet.sock (and the
        PodResources socket)."""
        with self._cond:
            if self._running:
                raise RuntimeError("kubelet emulator already running")
        self._prepare_dir(cleanup=self.cleanup_on_start)
        self._serve()

    def stop(self) -> None:
        """Stop serving, close every plugin connection and stream, remove the sockets this emulator created."""
        with self._cond:
            if not self._running:
                return
            self._running = False
            self._stopping.set()
            servers, self._servers = self._servers, []
            clients = list(self._clients)
            self._clients.clear()
            threads, self._threads = self._threads, []
            self._changed()
        for server, _ in servers:
            server.stop(None).wait(5)
        for client in clients:
            client.close(by_kubelet_shutdown=True)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(5)
        for _, executor in servers:
            executor.shutdown(wait=True)
        for sock in (self.kubelet_socket, self.pod_resources_socket):
            if sock is not None:
                self._remove_socket(sock)
        log.info("Kubelet emulator stopped: dir=%s", self.device_plugin_dir)

    def restart(self) -> None:
        """A kubelet restart: stop, restore from the checkpoint, delete every file in the dir but the checkpoint,
        serve again."""
        self.stop()
        with self._cond:
            self._gc_locked()
            registered = list(self._healthy)  # RegisteredDevices = keys of healthyDevices
            now = time.monotonic()
            self._healthy = {r: set() for r in registered}
            self._unhealthy = {r: set() for r in registered}
            self._all = {r: {} for r in registered}
            self._endpoints = {r: Endpoint(client=None, options=None, stop_time=now, resource=r) for r in registered}
            self._clients_by_name = {}
            self._reuse = {}
            self._changed()
        log.info("Kubelet restarting: restored resources=%s pods=%d", registered, len(self._pods))
        self._prepare_dir(cleanup=True)
        self._serve()

    def __enter__(self) -> KubeletEmulator:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._running

    def _prepare_dir(self, *, cleanup: bool) -> None:
        d = self.device_plugin_dir
        if not d.is_dir():
            d.mkdir(mode=0o750, parents=True, exist_ok=True)
            d.chmod(0o750)
        if cleanup:
            self._cleanup_plugin_directory()

    def _cleanup_plugin_directory(self) -> None:
        """``ManagerImpl.CleanupPluginDirectory`` (``pkg/kubelet/cm/devicemanager/manager.go``, the code of 1.32 and
        the releases around it): every entry but the checkpoint that ``os.Lstat`` does not call a directory is
        removed — plugin sockets, the old ``kubelet.sock``, regular files, symlinks (not followed). Directories
        stay (a plugin keeps its own files in one, e.g. Tessera's ``.tessera/`` lock). The source's comment names
        golang/go#33357 (no socket mode on Windows) as why it does not check for sockets. One later version of the
        file checks ``os.Stat`` for ``ModeSocket`` and keeps other files; its release is not known here."""
        d = self.device_plugin_dir
        for entry in sorted(d.iterdir()):
            if entry == self.checkpoint_path:
                continue
            try:
                mode = entry.lstat().st_mode
            except OSError as exc:
                log.error("Failed to stat file: path=%s err=%s", entry, exc)
                continue
            if stat.S_ISDIR(mode):
                continue
            try:
                entry.unlink()
            except FileNotFoundError:
                continue
            except OSError as exc:
                log.error("Failed to remove file: path=%s err=%s", entry, exc)
                continue
            log.info("Deleted file in device plugin directory: path=%s", entry)

    def _serve(self) -> None:
        self._stopping.clear()
        servers: list[tuple[grpc.Server, futures.ThreadPoolExecutor]] = []
        try:
            servicer = RegistrationServicer(self)
            servers.append(self._start_server(self.kubelet_socket, "kubelet-registration", 8, servicer.register_with))
            if self.pod_resources_socket is not None:
                parent = self.pod_resources_socket.parent
                if not parent.is_dir():
                    parent.mkdir(mode=0o750, parents=True, exist_ok=True)
                pr_servicer = PodResourcesServicer(
                    list_pods=self.pods,
                    find_pod=self._find_pod_copy,
                    healthy_devices=self._healthy_device_list,
                    get_enabled=lambda: self.pod_resources_get_enabled,
                    limiter=TokenBucket(*self._limiter_args),
                    dra_pods=self._dra_pod_resources,
                )
                servers.append(
                    self._start_server(
                        self.pod_resources_socket,
                        "kubelet-podresources",
                        4,
                        lambda srv: pr_grpc.add_PodResourcesListerServicer_to_server(pr_servicer, srv),
                    )
                )
        except BaseException:
            for server, executor in servers:
                server.stop(None).wait(5)
                executor.shutdown(wait=True)
            raise
        with self._cond:
            self._servers = servers
            self._running = True
            self._changed()
        log.info(
            "Kubelet emulator serving: registration=%s podresources=%s", self.kubelet_socket, self.pod_resources_socket
        )

    def _start_server(
        self, path: Path, name: str, workers: int, add: Callable[[grpc.Server], None]
    ) -> tuple[grpc.Server, futures.ThreadPoolExecutor]:
        if len(os.fsencode(str(path))) > _MAX_UNIX_PATH:
            raise ValueError(f"unix socket path longer than {_MAX_UNIX_PATH} bytes: {path}")
        executor = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)
        server = grpc.server(executor)
        try:
            add(server)
            self._remove_socket(path)
            server.add_insecure_port(f"unix:{path}")
            server.start()
            path.chmod(0o600)
        except BaseException:
            server.stop(None).wait(5)
            executor.shutdown(wait=True)
            raise
        return server, executor

    @staticmethod
    def _remove_socket(path: Path) -> None:
        try:
            if stat.S_ISSOCK(path.lstat().st_mode):
                path.unlink()
        except FileNotFoundError:
            pass

    # ------------------------------------------------------------------------------------------ state helpers

    def _changed(self) -> None:
        """Call with the lock held after every state change: wakes wait_for."""
        self._version += 1
        self._cond.notify_all()

    def _gc_locked(self) -> None:
        """GetCapacity's clean-up: drop resources whose endpoint is gone or stopped longer than the grace period."""
        now = time.monotonic()
        dropped = []
        for name in list(dict.fromkeys([*self._healthy, *self._unhealthy])):
            ep = self._endpoints.get(name)
            if ep is None or (ep.stop_time is not None and now - ep.stop_time > self.grace_period):
                self._endpoints.pop(name, None)
                self._healthy.pop(name, None)
                self._unhealthy.pop(name, None)
                self._all.pop(name, None)
                dropped.append(name)
        if dropped:
            for name in dropped:
                log.info("Resource removed from node capacity (endpoint stop grace period expired): resource=%s", name)
            self._write_checkpoint_locked()
            self._changed()

    def _allocated_locked(self, resource: str) -> set[str]:
        """``allocatedDevices[resource]``: every cached allocation plus what the admission in progress has taken."""
        out = set(self._pending.get(resource, ()))
        pods = list(self._pods.values())
        if self._admitting is not None:
            pods.append(self._admitting)
        for pod in pods:
            for group in (pod.init_containers, pod.containers):
                for allocations in group.values():
                    if resource in allocations:
                        out.update(allocations[resource].device_ids)
        return out

    def _is_device_plugin_resource_locked(self, resource: str) -> bool:
        return resource in self._healthy or bool(self._allocated_locked(resource))

    def _write_checkpoint_locked(self) -> None:
        self._write_checkpoint(self._checkpoint_locked())

    def _checkpoint_locked(self) -> tuple[int, str] | None:
        """The checkpoint of the state as it is now (call with the lock held); None when none is kept."""
        if not self.checkpoint_enabled or not self.device_plugin_dir.is_dir():
            return None
        registered = {r: [d for d in self._all.get(r, {}) if d in ids] for r, ids in self._healthy.items()}
        self._checkpoint_taken += 1
        return self._checkpoint_taken, json.dumps(checkpoint_document(self._pods.values(), registered))

    def _write_checkpoint(self, checkpoint: tuple[int, str] | None) -> None:
        """Write a checkpoint taken under the lock. Device updates write theirs after the lock is let go, as
        the kubelet's genericDeviceUpdateCallback does (state visible first, then writeCheckpoint), so a
        checkpoint older than one already written is dropped."""
        if checkpoint is None:
            return
        taken, text = checkpoint
        with self._checkpoint_written_lock:
            if taken < self._checkpoint_written:
                return
            try:
                write_file_atomically(self.checkpoint_path, text)
            except OSError as exc:
                log.error("Failed to write checkpoint file: path=%s err=%s", self.checkpoint_path, exc)
                return
            self._checkpoint_written = taken

    # ------------------------------------------------------------------------------------------ registration view

    def resources(self) -> list[str]:
        with self._cond:
            self._gc_locked()
            return sorted(set(self._healthy) | set(self._unhealthy))

    def registrations(self, resource: str) -> int:
        with self._cond:
            return self._registrations.get(resource, 0)

    def devices(self, resource: str) -> dict[str, str]:
        """Device ID -> health from the latest ListAndWatch message; "Unhealthy" where the kubelet marked it so."""
        with self._cond:
            self._gc_locked()
            healthy = self._healthy.get(resource, set())
            out = {}
            for dev_id, dev in self._all.get(resource, {}).items():
                out[dev_id] = UNHEALTHY if dev.health == HEALTHY and dev_id not in healthy else dev.health
            return out

    def capacity(self, resource: str) -> int:
        with self._cond:
            self._gc_locked()
            return len(self._healthy.get(resource, ())) + len(self._unhealthy.get(resource, ()))

    def allocatable(self, resource: str) -> int:
        with self._cond:
            self._gc_locked()
            return len(self._healthy.get(resource, ()))

    def options(self, resource: str) -> api_pb2.DevicePluginOptions:
        """The GetDevicePluginOptions reply (empty for an endpoint restored from the checkpoint)."""
        with self._cond:
            ep = self._endpoints.get(resource)
            if ep is None:
                raise KeyError(resource)
            out = api_pb2.DevicePluginOptions()
            if ep.options is not None:
                out.CopyFrom(ep.options)
            return out

    def topology(self, resource: str) -> dict[str, list[int]]:
        with self._cond:
            return {d: [n.ID for n in dev.topology.nodes] for d, dev in self._all.get(resource, {}).items()}

    def stopped(self, resource: str) -> bool:
        """True while the resource's endpoint is stopped (stream ended, or restored after a restart)."""
        with self._cond:
            ep = self._endpoints.get(resource)
            return ep is None or ep.stopped()

    def endpoint(self, resource: str) -> str | None:
        """The socket path of the resource's current connection, if any."""
        with self._cond:
            ep = self._endpoints.get(resource)
            return ep.client.socket_path if ep is not None and ep.client is not None else None

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 5.0, what: str = "") -> None:
        """Wait until ``predicate()`` is true: re-checked on every state change and at least every 50 ms."""
        deadline = time.monotonic() + timeout
        while True:
            with self._cond:
                version = self._version
            if predicate():
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"timed out after {timeout:g} s waiting for {what or 'condition'}")
            with self._cond:
                if self._version == version:
                    self._cond.wait(min(remaining, 0.05))

    def _healthy_device_list(self) -> list[tuple[str, api_pb2.Device]]:
        with self._cond:
            return [
                (r, dev) for r, devs in self._all.items() for d, dev in devs.items() if d in self._healthy.get(r, ())
            ]

    # ------------------------------------------------------------------------------------------ raw RPC helpers

    def _stub(self, resource: str) -> api_pb2_grpc.DevicePluginStub:
        with self._cond:
            ep = self._endpoints.get(resource)
            if ep is None:
                raise KeyError(resource)
            if ep.client is None or ep.client.stub is None:
                raise RuntimeError(f"no connection for resource {resource}")
            return ep.client.stub

    def allocate_raw(self, resource: str, device_ids: list[str]) -> api_pb2.AllocateResponse:
        """One Allocate RPC with one ContainerAllocateRequest through the kubelet's connection (no bookkeeping)."""
        request = api_pb2.AllocateRequest(container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=device_ids)])
        return self._stub(resource).Allocate(request, timeout=self.call_timeout)

    def preferred_raw(
        self, resource: str, available: list[str], must_include: list[str], size: int
    ) -> api_pb2.PreferredAllocationResponse:
        request = api_pb2.PreferredAllocationRequest(
            container_requests=[
                api_pb2.ContainerPreferredAllocationRequest(
                    available_deviceIDs=available, must_include_deviceIDs=must_include, allocation_size=size
                )
            ]
        )
        return self._stub(resource).GetPreferredAllocation(request, timeout=self.call_timeout)

    def pre_start_raw(self, resource: str, device_ids: list[str]) -> api_pb2.PreStartContainerResponse:
        request = api_pb2.PreStartContainerRequest(devices_ids=device_ids)
        return self._stub(resource).PreStartContainer(request, timeout=self.pre_start_timeout)
