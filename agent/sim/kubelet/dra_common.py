"""Names, timeouts, texts and records of the DRA kubelet emulator (``agent.sim.kubelet.dra``).

Every number and every error text is the kubelet's, from /work/shared/facts/dra.md section A and the kubelet
sources it names (``pluginmanager/operationexecutor/operation_generator.go``, ``cm/dra/plugin/dra_plugin_manager.go``,
``cm/dra/manager.go``, ``cm/dra/healthinfo.go``); the source of each is named next to it.
"""

from __future__ import annotations

import json

from msgspec import Struct, field

from agent.sim.kubelet.common import go_quote

PLUGIN_TYPE = "DRAPlugin"  # PluginInfo.type the DRA handler is registered under
V1_SERVICE = "v1.DRAPlugin"
V1BETA1_SERVICE = "v1beta1.DRAPlugin"
V1ALPHA4_SERVICE = "v1alpha4.Node"  # drapbv1alpha4.NodeService (package v1alpha4, service Node): kubelets <= 1.33
HEALTH_SERVICE = "v1alpha1.DRAResourceHealth"
HEALTH_V1_SERVICE = "v1.DRAResourceHealth"  # 1.37+ (k/k #139477): the same messages in package v1

DIAL_TIMEOUT = 10.0  # operation_generator.go dialTimeoutDuration
GET_INFO_TIMEOUT = 1.0
NOTIFY_TIMEOUT = 5.0  # notifyTimeoutDuration
CALL_TIMEOUT = 45.0  # dra_plugin.go defaultClientCallTimeout
WIPING_DELAY = 30.0  # manager.go defaultWipingDelay (1.33+; a kubelet <= 1.32 wipes at once: see dra_versions)
HEALTH_RETRY_PERIOD = 5.0  # wait.UntilWithContext(..., 5*time.Second) around NodeWatchResources
DEFAULT_HEALTH_TIMEOUT = 30.0  # healthinfo.go DefaultHealthTimeout
# goroutinemap (exponentialBackOffOnError) under the plugin manager's operation executor: a registration that
# failed before the plugin reached the actual state of the world is tried again after 0.5 s, 1 s, ... 2m2s
REGISTRATION_BACKOFF_INITIAL = 0.5
REGISTRATION_BACKOFF_MAX = 122.0
# wipeResourceSlices: wait.Backoff{Duration: 1s, Factor: 2, Jitter: 0.2, Cap: 5m, Steps: 100}
WIPE_BACKOFF_INITIAL = 1.0
WIPE_BACKOFF_FACTOR = 2.0
WIPE_BACKOFF_JITTER = 0.2
WIPE_BACKOFF_CAP = 300.0
WIPE_BACKOFF_STEPS = 100

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
UNKNOWN = "Unknown"

API_TIMEOUT = (3.0, 10.0)  # (connect, read) of every API server request the emulator makes
PREPARE = "NodePrepareResources"
UNPREPARE = "NodeUnprepareResources"


def go_string_list(values: list[str] | tuple[str, ...]) -> str:
    """Go's ``%q`` of a ``[]string``: ``["a" "b"]``."""
    return "[" + " ".join(go_quote(v) for v in values) + "]"


def api_error_text(error: BaseException) -> str:
    """What client-go's error prints: the Status ``message`` of an API answer, else the error itself."""
    body = getattr(error, "body", None)
    status = getattr(error, "status", None)
    if body:
        try:
            message = json.loads(body).get("message")
        except (ValueError, AttributeError):
            message = None
        if message:
            return str(message)
    if status is not None:
        reason = getattr(error, "reason", "") or ""
        return f"the server responded with HTTP {status} {reason}".rstrip()
    return f"{type(error).__name__}: {error}"


# --------------------------------------------------------------------------------------------------
# Errors raised to the emulator's caller
# --------------------------------------------------------------------------------------------------


class PodStartError(Exception):
    """``PrepareResources`` failed: the sandbox is not created and the kubelet's pod worker retries later.
    ``message`` is the kubelet's error (``prepare dynamic resources: ...``), ``reason`` the event's reason."""

    def __init__(self, message: str, reason: str = "FailedPrepareDynamicResources") -> None:
        super().__init__(message)
        self.message = message
        self.reason = reason


class PodStopError(Exception):
    """``UnprepareResources`` failed: the pod stays terminating and ``stop_pod`` may be called again."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class KubeletError(Exception):
    """A Go error inside the DRA manager, before it is wrapped for the pod."""


# --------------------------------------------------------------------------------------------------
# Records handed out for observation (copies: the emulator's own state is never exposed)
# --------------------------------------------------------------------------------------------------


class RegistrationEvent(Struct, frozen=True):
    """One outcome of the plugin watcher. ``kind``: ``registered`` (NotifyRegistrationStatus true), ``refused``
    (told false with ``error``), ``failed`` (dial or GetInfo failed: the plugin was told nothing),
    ``deregistered`` (its socket went). ``notify_error`` is set when NotifyRegistrationStatus itself failed."""

    kind: str
    socket: str
    driver: str = ""
    endpoint: str = ""
    service: str = ""
    error: str = ""
    notify_error: str = ""
    at: float = 0.0


class PreparedDevice(Struct, frozen=True):
    """``state.Device`` of the kubelet's claim info: one device a NodePrepareResources answer named."""

    driver: str
    pool: str
    device: str
    request_names: tuple[str, ...]
    cdi_device_ids: tuple[str, ...]
    share_id: str | None = None


class ClaimState(Struct, frozen=True):
    """A claim in the kubelet's claim info cache: the pods referencing it, its devices, whether it is prepared."""

    uid: str
    name: str
    namespace: str
    pod_uids: frozenset[str]
    drivers: tuple[str, ...]
    devices: tuple[PreparedDevice, ...]
    prepared: bool


class DraCall(Struct, frozen=True):
    """One NodePrepareResources / NodeUnprepareResources RPC the emulator made. ``errors`` holds the non-empty
    per-claim errors of the answer by claim UID, ``answered`` the UIDs the answer had an entry for, ``error`` the
    RPC's own failure (Go text) if it failed, ``outcome`` the kubelet's error for the whole batch ("" if none)."""

    method: str
    driver: str
    endpoint: str
    service: str
    pod_uid: str
    claim_uids: tuple[str, ...]
    claim_names: tuple[str, ...]
    answered: tuple[str, ...] = ()
    errors: dict[str, str] = field(default_factory=dict)
    error: str = ""
    outcome: str = ""
    at: float = 0.0


class WipeRecord(Struct, frozen=True):
    """A DeleteCollection of ResourceSlices. ``reason``: ``start`` (every slice of the node) or ``driver`` (a
    driver without a connected endpoint); ``state``: ``scheduled`` (fires at ``fire_at``, monotonic),
    ``cancelled``, ``done`` or ``abandoned`` (stopped or out of retries); ``attempts`` DeleteCollection tries."""

    reason: str
    driver: str
    field_selector: str
    state: str
    fire_at: float = 0.0
    attempts: int = 0
    error: str = ""
    at: float = 0.0


class PluginView(Struct, frozen=True):
    """A registered endpoint of a driver: its socket, the service the kubelet chose, whether it is connected."""

    driver: str
    endpoint: str
    service: str
    connected: bool


class DraPod(Struct, frozen=True):
    """A pod the emulator was asked to run. ``claims``: (pod claim name, ResourceClaim name or None when no
    claim was generated); ``containers``: container -> [(pod claim name, request or None)]; ``cdi``: container
    -> CDI device IDs once running; ``running`` False while its preparation has not succeeded (or it stops)."""

    namespace: str
    name: str
    uid: str
    claims: tuple[tuple[str, str | None], ...]
    containers: dict[str, tuple[tuple[str, str | None], ...]]
    cdi: dict[str, tuple[str, ...]] = field(default_factory=dict)
    running: bool = False
    error: str = ""
