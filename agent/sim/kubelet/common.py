"""Helpers of the kubelet emulator (``agent.sim.kubelet``): names, error texts, records, rate limiting.

Everything here mirrors a piece of the kubelet or of the Go libraries it uses; the source each rule
comes from is named next to it (see /work/shared/facts/kubelet-behaviour.md).
"""

from __future__ import annotations

import base64
import json
import os
import re
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import grpc
from msgspec import Struct, field

from agent.api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc

API_VERSION = "v1beta1"
SUPPORTED_VERSIONS = ("v1beta1",)
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
KUBELET_SOCKET = "kubelet.sock"
CHECKPOINT_FILE = "kubelet_internal_checkpoint"
PRE_START_TIMEOUT = 30.0  # KubeletPreStartContainerRPCTimeoutInSecs
NO_TOPOLOGY = -1  # nodeWithoutTopology: the checkpoint's NUMA key for devices without topology

# --------------------------------------------------------------------------------------------------
# Resource names: pkg/apis/core/v1/helper IsExtendedResourceName + apimachinery IsQualifiedName
# --------------------------------------------------------------------------------------------------

_DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = re.compile(rf"{_DNS1123_LABEL}(\.{_DNS1123_LABEL})*")
_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")


def is_qualified_name(value: str) -> bool:
    """apimachinery ``validation.IsQualifiedName`` (true when it returns no errors)."""
    parts = value.split("/")
    if len(parts) == 1:
        name = parts[0]
    elif len(parts) == 2:
        prefix, name = parts
        if not prefix or len(prefix) > 253 or not _DNS1123_SUBDOMAIN.fullmatch(prefix):
            return False
    else:
        return False
    return 0 < len(name) <= 63 and _QUALIFIED_NAME.fullmatch(name) is not None


def is_native_resource(name: str) -> bool:
    """``IsNativeResource``: unprefixed, or containing ``kubernetes.io/`` anywhere (a plain substring test)."""
    return "/" not in name or "kubernetes.io/" in name


def is_extended_resource_name(name: str) -> bool:
    """``v1helper.IsExtendedResourceName``, the kubelet's check of ``RegisterRequest.resource_name``."""
    if is_native_resource(name) or name.startswith("requests."):
        return False
    return is_qualified_name("requests." + name)


# --------------------------------------------------------------------------------------------------
# Go-style error texts
# --------------------------------------------------------------------------------------------------

_GO_CODE_NAMES = {
    grpc.StatusCode.OK: "OK",
    grpc.StatusCode.CANCELLED: "Canceled",
    grpc.StatusCode.UNKNOWN: "Unknown",
    grpc.StatusCode.INVALID_ARGUMENT: "InvalidArgument",
    grpc.StatusCode.DEADLINE_EXCEEDED: "DeadlineExceeded",
    grpc.StatusCode.NOT_FOUND: "NotFound",
    grpc.StatusCode.ALREADY_EXISTS: "AlreadyExists",
    grpc.StatusCode.PERMISSION_DENIED: "PermissionDenied",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "ResourceExhausted",
    grpc.StatusCode.FAILED_PRECONDITION: "FailedPrecondition",
    grpc.StatusCode.ABORTED: "Aborted",
    grpc.StatusCode.OUT_OF_RANGE: "OutOfRange",
    grpc.StatusCode.UNIMPLEMENTED: "Unimplemented",
    grpc.StatusCode.INTERNAL: "Internal",
    grpc.StatusCode.UNAVAILABLE: "Unavailable",
    grpc.StatusCode.DATA_LOSS: "DataLoss",
    grpc.StatusCode.UNAUTHENTICATED: "Unauthenticated",
}


def go_rpc_error(err: BaseException) -> str:
    """Render an RPC failure the way grpc-go's ``status.Error`` prints: ``rpc error: code = X desc = Y``."""
    if isinstance(err, grpc.RpcError) and hasattr(err, "code"):
        code = err.code()
        details = err.details() or ""
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and details == "Deadline Exceeded":
            details = "context deadline exceeded"  # what a Go client's context timeout reports
        return f"rpc error: code = {_GO_CODE_NAMES.get(code, str(code))} desc = {details}"
    return str(err)


# --------------------------------------------------------------------------------------------------
# Plugin connections
# --------------------------------------------------------------------------------------------------

CONN_CLOSING = "rpc error: code = Canceled desc = grpc: the client connection is closing"
# Authority "localhost" as the kubelet dials; shorter reconnect backoff than gRPC's 1 s so that a plugin which starts
# serving during the blocking dial is picked up quickly.
CHANNEL_OPTIONS = (
    ("grpc.default_authority", "localhost"),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.enable_http_proxy", 0),
)


def go_quote(value: str) -> str:
    return json.dumps(value, ensure_ascii=False)


class PluginClient:
    """One connection to a plugin socket and its ListAndWatch stream (``plugin/v1beta1/client.go``)."""

    def __init__(self, resource: str, endpoint: str, socket_path: str) -> None:
        self.resource = resource
        self.endpoint = endpoint
        self.socket_path = socket_path
        self.channel: grpc.Channel | None = None
        self.stub: api_pb2_grpc.DevicePluginStub | None = None
        self.call = None
        self.thread: threading.Thread | None = None
        self.closing = False  # the emulator itself shut this connection (stop / restart): not an "unexpected" end
        self.lock = threading.Lock()

    def close(self, *, by_kubelet_shutdown: bool) -> None:
        with self.lock:
            if by_kubelet_shutdown:
                self.closing = True
            call, channel = self.call, self.channel
        if call is not None:
            call.cancel()
        if channel is not None:
            channel.close()


class Endpoint(Struct):
    """``endpointInfo``: the current connection for a resource plus the options GetDevicePluginOptions returned."""

    client: PluginClient | None  # None: restored from the checkpoint (newStoppedEndpointImpl)
    options: api_pb2.DevicePluginOptions | None
    stop_time: float | None = None
    resource: str = ""

    def stopped(self) -> bool:
        return self.stop_time is not None

    def describe(self) -> str:
        path = self.client.socket_path if self.client else ""
        return f"&{{resourceName:{self.resource} socketPath:{path}}}"


# --------------------------------------------------------------------------------------------------
# Errors raised to the emulator's caller
# --------------------------------------------------------------------------------------------------


class AdmissionError(Exception):
    """The kubelet rejected the pod at admission; ``reason`` is the pod status reason."""

    def __init__(self, message: str, reason: str = "UnexpectedAdmissionError") -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason


class ContainerStartError(Exception):
    """Container creation failed (the kubelet reports ``CreateContainerConfigError`` and retries)."""

    def __init__(self, message: str, reason: str = "CreateContainerConfigError") -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason


class DeviceManagerError(Exception):
    """A plain Go error inside the device manager (wrapped into AdmissionError / ContainerStartError)."""


# --------------------------------------------------------------------------------------------------
# Pod records
# --------------------------------------------------------------------------------------------------


class ContainerAllocation(Struct, frozen=True):
    """The device manager's cache entry for one (pod, container, resource): ``pod_devices.go`` insert."""

    device_ids: list[str]
    response: api_pb2.ContainerAllocateResponse
    numa: dict[str, list[int]] = field(default_factory=dict)  # device ID -> NUMA nodes at allocation; [] = none


class Pod(Struct):
    """An admitted pod. ``containers`` holds the app containers, ``init_containers`` the init containers
    (``sidecars`` names the restartable ones); each maps container -> resource -> ContainerAllocation."""

    name: str
    namespace: str
    uid: str
    containers: dict[str, dict[str, ContainerAllocation]]
    init_containers: dict[str, dict[str, ContainerAllocation]] = field(default_factory=dict)
    sidecars: tuple[str, ...] = ()
    requests: dict[str, dict[str, int]] = field(default_factory=dict)  # every container's limits, by name

    def allocation(self, container: str) -> dict[str, ContainerAllocation]:
        if container in self.containers:
            return self.containers[container]
        return self.init_containers[container]

    def copy(self) -> Pod:
        return Pod(
            name=self.name,
            namespace=self.namespace,
            uid=self.uid,
            containers={c: dict(r) for c, r in self.containers.items()},
            init_containers={c: dict(r) for c, r in self.init_containers.items()},
            sidecars=self.sidecars,
            requests={c: dict(r) for c, r in self.requests.items()},
        )


class RunContainerOptions(Struct):
    """What the cached Allocate responses turn into for the CRI (``pod_devices.go`` deviceRunContainerOptions)."""

    envs: dict[str, str] = field(default_factory=dict)
    mounts: list[api_pb2.Mount] = field(default_factory=list)
    devices: list[api_pb2.DeviceSpec] = field(default_factory=list)
    annotations: dict[str, str] = field(default_factory=dict)
    cdi_devices: list[str] = field(default_factory=list)


def merge_run_options(responses: Iterable[api_pb2.ContainerAllocateResponse], log) -> RunContainerOptions:
    """Merge a container's cached responses; on a duplicate key the first wins and a conflict is logged."""
    opts = RunContainerOptions()
    mounts: dict[str, api_pb2.Mount] = {}
    devices: dict[str, api_pb2.DeviceSpec] = {}
    for resp in responses:
        for k, v in resp.envs.items():
            if k in opts.envs and opts.envs[k] != v:
                log.error("Environment variable has conflicting setting: key=%s first=%s second=%s", k, opts.envs[k], v)
            opts.envs.setdefault(k, v)
        for m in resp.mounts:
            if m.container_path in mounts and mounts[m.container_path] != m:
                log.error("Container path has conflicting mount: path=%s", m.container_path)
            mounts.setdefault(m.container_path, m)
        for d in resp.devices:
            if d.container_path in devices and devices[d.container_path] != d:
                log.error("Container device has conflicting mapping host devices: path=%s", d.container_path)
            devices.setdefault(d.container_path, d)
        for k, v in resp.annotations.items():
            if k in opts.annotations and opts.annotations[k] != v:
                log.error("Annotation has conflicting setting: key=%s", k)
            opts.annotations.setdefault(k, v)
        for cdi in resp.cdi_devices:
            if cdi.name not in opts.cdi_devices:
                opts.cdi_devices.append(cdi.name)
    opts.mounts = list(mounts.values())
    opts.devices = list(devices.values())
    return opts


# --------------------------------------------------------------------------------------------------
# Rate limiting: golang.org/x/time/rate as used by pkg/kubelet/apis/podresources/grpc/ratelimit.go
# --------------------------------------------------------------------------------------------------


class TokenBucket:
    """A token bucket that starts full (``burst`` tokens) and refills at ``qps`` tokens a second."""

    def __init__(self, qps: float, burst: int) -> None:
        self.qps = float(qps)
        self.burst = int(burst)
        self._tokens = float(burst)
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def allow(self) -> bool:
        with self._lock:
            now = time.monotonic()
            self._tokens = min(float(self.burst), self._tokens + (now - self._last) * self.qps)
            self._last = now
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                return True
            return False


# --------------------------------------------------------------------------------------------------
# Checkpoint file (checkpoint/checkpoint.go format)
# --------------------------------------------------------------------------------------------------


def checkpoint_document(pods: Iterable[Pod], registered: Mapping[str, Iterable[str]]) -> dict:
    """The checkpoint JSON. ``Checksum`` is 0: the kubelet's value hashes a Go struct dump and is not reproduced."""
    entries = []
    for pod in pods:
        for group in (pod.init_containers, pod.containers):
            for cname, resources in group.items():
                for rname, alloc in resources.items():
                    per_numa: dict[str, list[str]] = {}
                    for dev in alloc.device_ids:
                        for node in alloc.numa.get(dev) or [NO_TOPOLOGY]:
                            per_numa.setdefault(str(node), []).append(dev)
                    entries.append(
                        {
                            "PodUID": pod.uid,
                            "ContainerName": cname,
                            "ResourceName": rname,
                            "DeviceIDs": per_numa,
                            "AllocResp": base64.b64encode(alloc.response.SerializeToString()).decode(),
                        }
                    )
    data = {"PodDeviceEntries": entries, "RegisteredDevices": {r: list(ids) for r, ids in registered.items()}}
    return {"Data": data, "Checksum": 0}


def write_file_atomically(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        Path(tmp).chmod(0o600)
        Path(tmp).replace(path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
