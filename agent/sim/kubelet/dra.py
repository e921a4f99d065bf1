"""A DRA kubelet emulator: the kubelet's plugin watcher, DRA plugin manager and DRA manager, over real gRPC on real
unix sockets and the real Kubernetes client, for tests and ``tessera demo --dra``.

``DraKubeletEmulator(registry_dir, node_name, api_client)`` reaches DRA drivers only through the wire, the way the
kubelet does (facts/dra.md section A; the rules and texts of each part are in ``dra_plugins`` and ``dra_pods``, and
what changes with ``kubelet_version`` in ``dra_versions``):

* ``start()``: DeleteCollection of every ResourceSlice of the node (``spec.nodeName=<node>``, retried with the
  kubelet's backoff while the API server is away), then the plugin watcher on ``registry_dir`` (created 0755):
  inotify plus an initial walk; each registration socket is dialled (10 s), asked ``GetInfo`` (1 s), checked
  (type ``DRAPlugin``; empty endpoint → the socket itself; the gRPC service is chosen by the release's rules: from
  1.34 the first of the plugin's ``supported_versions`` that is ``v1.DRAPlugin`` or ``v1beta1.DRAPlugin``, in 1.33
  the first of the kubelet's own ``v1beta1.DRAPlugin``, ``v1alpha4.Node`` the plugin offers, up to 1.32 semantic
  versions and ``v1alpha4.Node``; an endpoint registered already is refused) and told the outcome with
  ``NotifyRegistrationStatus``. A driver that goes away has its slices wiped: at once up to 1.32, ``wipe_delay``
  seconds (default 30) after its last endpoint deregistered (1.33) or lost its connection (1.34+) unless one comes
  back first.
* Health (``health=True``, 1.34+): a ``NodeWatchResources`` stream per registered endpoint, ``device_health``
  reading Healthy / Unhealthy / Unknown as the kubelet's health cache does.
* Pods: ``run_pod`` prepares the pod's claims (one NodePrepareResources per driver, 45 s) and returns per container
  the CDI device IDs the CRI would get; a failure raises ``PodStartError`` with the kubelet's text, and
  ``retry_pod`` is the pod worker's next attempt. ``stop_pod`` unprepares the claims no other pod references.
* ``restart()``: a kubelet restart — connections, streams and timers go; the claim cache (the kubelet's checkpoint)
  stays but loses every ``prepared`` flag; slices are wiped again and the registry re-walked. Running pods keep
  running and are not prepared again (NodePrepareResources runs only before a sandbox is created); a new pod using
  one of their claims calls NodePrepareResources again, and up to 1.36 the answer's devices are APPENDED to the
  claim's (kubernetes#140471): that pod's containers get, and PodResources lists for every pod of the claim, each
  device and CDI ID twice (one more copy each time it is prepared again). ``reprepare_appends=False`` emulates a release
  with the fix (1.37, late 1.34/1.36 patches).

Choices beyond the kubelet's rules:

* ``start()`` waits (up to ``start_wipe_wait`` seconds) for the start-up wipe before it walks the registry, so a
  driver registering at once does not race the wipe in tests; the kubelet runs both concurrently. If the API server
  is away the wipe goes on retrying in the background.
* ``reserve=True``: a claim that is allocated but does not list the pod in ``status.reservedFor`` gets it added
  (a PUT of the status, as the scheduler does before binding), and ``stop_pod`` removes it again (as the
  resourceclaim controller does). ``reserve=False`` leaves reservation to the caller and refuses such a pod with
  the kubelet's "is not allowed to use ResourceClaim" text.
* Ownership of template-generated claims is not checked; pods are prepared one at a time; the kubelet's checkpoint
  and health state are kept in memory (nothing is written next to the registry).
* The watcher looks at the registry directory itself, not sub-directories; a slow safety re-scan (30 s) backs up
  inotify. There is no 60 s reconcile loop: a pod that failed to start stays until ``stop_pod`` unprepares it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import msgspec

from agent.sim.kubelet.dra_common import (
    CALL_TIMEOUT,
    DIAL_TIMEOUT,
    HEALTH_RETRY_PERIOD,
    PREPARE,
    UNKNOWN,
    UNPREPARE,
    WIPING_DELAY,
    ClaimState,
    DraCall,
    DraPod,
    KubeletError,
    PluginView,
    PodStartError,
    PodStopError,
    PreparedDevice,
    RegistrationEvent,
    WipeRecord,
)
from agent.sim.kubelet.dra_plugins import (
    DraPluginsMixin,
    RegistryWatcher,
    _DeviceHealth,
    _PendingWipe,
    _Plugin,
    _SocketOps,
    close_channel,
)
from agent.sim.kubelet.dra_pods import DraPodsMixin, _ClaimInfo
from agent.sim.kubelet.dra_versions import rules_for

__all__ = [
    "PREPARE",
    "UNPREPARE",
    "ClaimState",
    "DraCall",
    "DraKubeletEmulator",
    "DraPod",
    "PluginView",
    "PodStartError",
    "PodStopError",
    "PreparedDevice",
    "RegistrationEvent",
    "WipeRecord",
]

log = logging.getLogger("agent.sim.kubelet.dra")

ClaimRefs = Iterable[tuple[str, str | None]]


class DraKubeletEmulator(DraPluginsMixin, DraPodsMixin):
    """The kubelet's DRA side for one node (see the module docstring)."""

    def __init__(
        self,
        registry_dir: str | Path,
        node_name: str,
        api_client: Any,
        *,
        kubelet_version: str = "1.36",
        wipe_delay: float = WIPING_DELAY,
        reprepare_appends: bool | None = None,
        health: bool = True,
        health_retry_period: float = HEALTH_RETRY_PERIOD,
        call_timeout: float = CALL_TIMEOUT,
        dial_timeout: float = DIAL_TIMEOUT,
        reserve: bool = True,
        start_wipe_wait: float = 10.0,
        safety_interval: float = 30.0,
    ) -> None:
        """``api_client``: a ``kubernetes.client.ApiClient`` (``ApiServer.api_client()`` for the stand-in).
        ``kubelet_version``: "1.<minor>" whose rules to follow (``dra_versions``); ``wipe_delay`` is unused up to
        1.32 (the wipe is immediate); ``reprepare_appends``: None follows the release (true up to 1.36)."""
        import kubernetes.client  # the emulator speaks to the API server through the real client

        self.registry_dir = Path(registry_dir)
        self.node_name = node_name
        self.kubelet_version = kubelet_version
        self.rules = rules_for(kubelet_version)
        self.supported_services = self.rules.services
        self.wipe_delay = float(wipe_delay)
        self.reprepare_appends = self.rules.appends_devices if reprepare_appends is None else bool(reprepare_appends)
        self.health = bool(health) and self.rules.health_stream
        self.health_retry_period = float(health_retry_period)
        self.call_timeout = float(call_timeout)
        self.dial_timeout = float(dial_timeout)
        self.reserve = bool(reserve)
        self.start_wipe_wait = float(start_wipe_wait)
        self.safety_interval = float(safety_interval)
        self._resource_api = kubernetes.client.ResourceV1Api(api_client)
        self._core_api = kubernetes.client.CoreV1Api(api_client)
        self._custom_api = kubernetes.client.CustomObjectsApi(api_client)
        self._api_exception = kubernetes.client.exceptions.ApiException

        self._cond = threading.Condition(threading.RLock())
        self._version = 0
        self._running = False
        self._stopping = threading.Event()
        self._lifecycle = threading.Lock()
        self._pod_lock = threading.Lock()  # pods are admitted and stopped one at a time
        self._watcher: RegistryWatcher | None = None
        self._threads: list[threading.Thread] = []
        self._start_wipe_cancel = threading.Event()
        # plugin manager (lost on restart)
        self._socket_ops: dict[str, _SocketOps] = {}
        self._watched: set[str] = set()  # registration sockets the watcher knows
        self._asw: dict[str, tuple[str, str]] = {}  # registration socket -> (driver, endpoint)
        self._plugins: dict[str, list[_Plugin]] = {}  # driver -> endpoints in the order they were added
        self._pending_wipes: dict[str, _PendingWipe] = {}
        self._health: dict[str, dict[tuple[str, str], _DeviceHealth]] = {}
        # DRA manager (the claim cache survives restarts as the kubelet's checkpoint does; `prepared` does not)
        self._claim_infos: dict[tuple[str, str], _ClaimInfo] = {}
        self._pods: dict[str, DraPod] = {}
        # observation
        self._registration_events: list[RegistrationEvent] = []
        self._calls: list[DraCall] = []
        self._wipes: list[WipeRecord] = []
        self._health_messages: dict[str, int] = {}
        self._health_streams: dict[str, int] = {}
        self._starts = 0

    # ------------------------------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Wipe the node's slices (waiting up to ``start_wipe_wait`` s), then watch the plugin registry."""
        with self._lifecycle:
            with self._cond:
                if self._running:
                    raise RuntimeError("DRA kubelet emulator already running")
                self._stopping.clear()
                self._running = True
                self._starts += 1
                self._changed()
            if not self.registry_dir.is_dir():
                self.registry_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
                self.registry_dir.chmod(0o755)
            self._start_wipe_cancel = threading.Event()
            wiper = threading.Thread(
                target=self._wipe, args=("start", "", self._start_wipe_cancel), name="kubelet-dra-wipe", daemon=True
            )
            with self._cond:
                self._track(wiper)
            wiper.start()
            wiper.join(self.start_wipe_wait)
            if wiper.is_alive():
                log.warning("ResourceSlice wipe at start still retrying; watching the plugin registry meanwhile")
            self._watcher = RegistryWatcher(
                self.registry_dir, self._on_registry_event, safety_interval=self.safety_interval
            )
            self._watcher.start()
            log.info(
                "DRA kubelet emulator started node=%s registry=%s kubelet=%s services=%s",
                self.node_name,
                self.registry_dir,
                self.kubelet_version,
                ",".join(self.supported_services),
            )

    def stop(self) -> None:
        """Stop watching, cancel registrations, timers and wipes, close every channel and stream, join threads."""
        with self._lifecycle:
            self._stop_locked()

    def _stop_locked(self) -> None:
        with self._cond:
            if not self._running:
                return
            self._running = False
            self._stopping.set()
            self._changed()
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        self._start_wipe_cancel.set()
        with self._cond:
            pending = list(self._pending_wipes.values())
            self._pending_wipes.clear()
            plugins = [p for ps in self._plugins.values() for p in ps]
            self._plugins.clear()
            self._asw.clear()
            self._socket_ops.clear()
            self._watched.clear()
            self._health.clear()
            threads, self._threads = self._threads, []
            self._changed()
        for wipe in pending:
            wipe.timer.cancel()
            wipe.cancel.set()
        for plugin in plugins:
            self._detach_plugin(plugin)
        for plugin in plugins:
            close_channel(plugin.channel)
        for thread in threads:
            if thread is not threading.current_thread() and thread.ident is not None:
                thread.join(15)
        log.info("DRA kubelet emulator stopped node=%s", self.node_name)

    def restart(self) -> None:
        """A kubelet restart (see the module docstring)."""
        with self._lifecycle:
            self._stop_locked()
            with self._cond:
                for info in self._claim_infos.values():
                    info.prepared = False
                self._changed()
        log.info("Kubelet restarting: claims in the checkpoint=%d", len(self._claim_infos))
        self.start()

    def __enter__(self) -> DraKubeletEmulator:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._running

    def _track(self, thread: threading.Thread) -> None:
        """Keep a thread to join at ``stop()`` (call with the lock held); finished ones are dropped."""
        self._threads = [t for t in self._threads if t.ident is None or t.is_alive()]
        self._threads.append(thread)

    def _changed(self) -> None:
        """Call with the lock held after every state change: wakes ``wait_for`` and waiting workers."""
        self._version += 1
        self._cond.notify_all()

    # ------------------------------------------------------------------------------------------ pods

    def run_pod(
        self,
        namespace: str,
        name: str,
        uid: str,
        claims: ClaimRefs,
        containers: Mapping[str, Iterable[tuple[str, str | None]]],
    ) -> dict[str, list[str]]:
        """Prepare the pod's claims and return container -> CDI device IDs, or raise ``PodStartError``.

        ``claims``: (pod claim name, ResourceClaim name or None); ``containers``: container -> [(pod claim name,
        request or None)] as in ``resources.claims`` (a ResourceClaim name is accepted where it is unambiguous).
        A pod running already is not prepared again (its sandbox exists): its CDI IDs come back as they were."""
        claim_refs = tuple((str(pc), None if cn is None else str(cn)) for pc, cn in claims)
        pod_claims = {pc for pc, _ in claim_refs}
        if len(pod_claims) != len(claim_refs):
            raise ValueError("pod claim names must be unique")
        by_claim_name = {cn: pc for pc, cn in claim_refs if cn is not None}
        refs: dict[str, tuple[tuple[str, str | None], ...]] = {}
        for container, container_refs in containers.items():
            resolved = []
            for ref, request in container_refs:
                if ref not in pod_claims:
                    if ref not in by_claim_name:
                        raise ValueError(f"container {container} refers to claim {ref!r}, which the pod does not have")
                    ref = by_claim_name[ref]
                resolved.append((ref, request or None))
            refs[container] = tuple(resolved)
        pod = DraPod(namespace=namespace, name=name, uid=uid, claims=claim_refs, containers=refs)
        return self._run(pod)

    def retry_pod(self, uid: str) -> dict[str, list[str]]:
        """The pod worker's next attempt at a pod whose start failed (or a no-op for a running pod)."""
        with self._cond:
            pod = self._pods.get(uid)
        if pod is None:
            raise KeyError(f"no pod with UID {uid}")
        return self._run(pod)

    def _run(self, pod: DraPod) -> dict[str, list[str]]:
        with self._pod_lock:
            with self._cond:
                if not self._running:
                    raise RuntimeError("DRA kubelet emulator is not running")
                known = self._pods.get(pod.uid)
                if known is not None and known.running:
                    return {c: list(ids) for c, ids in known.cdi.items()}
                self._pods[pod.uid] = _replace(pod, running=False, error="")
                self._changed()
            try:
                self._prepare_resources(pod)
                cdi = self._container_cdi(pod)
            except KubeletError as error:
                message = f"prepare dynamic resources: {error}"
                log.warning("Failed to prepare dynamic resources pod=%s/%s err=%s", pod.namespace, pod.name, message)
                with self._cond:
                    self._pods[pod.uid] = _replace(pod, running=False, error=message)
                    self._changed()
                raise PodStartError(message) from None
            with self._cond:
                self._pods[pod.uid] = _replace(pod, running=True, cdi=cdi, error="")
                self._changed()
            log.info("Pod started pod=%s/%s cdi=%s", pod.namespace, pod.name, cdi)
            return {c: list(ids) for c, ids in cdi.items()}

    def stop_pod(self, uid: str) -> None:
        """The pod's containers have stopped: unprepare its claims no other pod references, or raise
        ``PodStopError`` (the pod stays, and ``stop_pod`` may be called again)."""
        with self._pod_lock:
            with self._cond:
                if not self._running:
                    raise RuntimeError("DRA kubelet emulator is not running")
                pod = self._pods.get(uid)
                if pod is None:
                    raise KeyError(f"no pod with UID {uid}")
                self._pods[uid] = _replace(pod, running=False)
                self._changed()
            try:
                self._unprepare_resources(pod)
            except KubeletError as error:
                message = f"unprepare dynamic resources: {error}"
                with self._cond:
                    self._pods[uid] = _replace(pod, running=False, error=message)
                    self._changed()
                raise PodStopError(message) from None
            with self._cond:
                self._pods.pop(uid, None)
                self._changed()
            if self.reserve:
                self._release(pod)
            log.info("Pod stopped pod=%s/%s", pod.namespace, pod.name)

    # ------------------------------------------------------------------------------------------ observation

    def pods(self) -> list[DraPod]:
        with self._cond:
            return list(self._pods.values())

    def pod(self, uid: str) -> DraPod | None:
        with self._cond:
            return self._pods.get(uid)

    def claims(self) -> list[ClaimState]:
        """Every claim in the kubelet's claim cache, prepared or not."""
        with self._cond:
            return [_claim_state(info) for info in self._claim_infos.values()]

    def prepared_claims(self) -> dict[str, ClaimState]:
        """Claim UID -> state, for the claims marked prepared."""
        with self._cond:
            return {info.uid: _claim_state(info) for info in self._claim_infos.values() if info.prepared}

    def calls(self, method: str | None = None, driver: str | None = None) -> list[DraCall]:
        """Every NodePrepareResources / NodeUnprepareResources made, in order."""
        with self._cond:
            return [c for c in self._calls if method in (None, c.method) and driver in (None, c.driver)]

    def registration_events(self, kind: str | None = None, driver: str | None = None) -> list[RegistrationEvent]:
        with self._cond:
            return [
                e
                for e in self._registration_events
                if (kind is None or e.kind == kind) and (driver is None or e.driver == driver)
            ]

    def endpoints(self, driver: str) -> list[PluginView]:
        """The driver's registered endpoints, oldest first."""
        with self._cond:
            return [PluginView(p.driver, p.endpoint, p.service, p.connected) for p in self._plugins.get(driver, [])]

    def plugin(self, driver: str) -> PluginView | None:
        """The endpoint calls go to: the most recent connected one, else the most recent; None if none."""
        plugin = self._get_plugin(driver)
        if plugin is None:
            return None
        return PluginView(plugin.driver, plugin.endpoint, plugin.service, plugin.connected)

    def watched_sockets(self) -> list[str]:
        """The registration sockets the plugin watcher has seen and not seen go (sockets only, no hidden names)."""
        with self._cond:
            return sorted(self._watched)

    def drivers(self) -> list[str]:
        with self._cond:
            return sorted(self._plugins)

    def wipes(self, reason: str | None = None, state: str | None = None) -> list[WipeRecord]:
        with self._cond:
            return [w for w in self._wipes if reason in (None, w.reason) and state in (None, w.state)]

    def pending_wipes(self) -> dict[str, float]:
        """Driver -> monotonic time its slices will be wiped at."""
        with self._cond:
            return {d: w.fire_at for d, w in self._pending_wipes.items()}

    def device_health(self, driver: str, pool: str, device: str) -> str:
        """``getHealthInfo``: Healthy / Unhealthy from the latest report, Unknown when none is cached or it is
        older than its ``health_check_timeout_seconds`` (30 s when unset)."""
        with self._cond:
            entry = self._health.get(driver, {}).get((pool, device))
            if entry is None or time.monotonic() - entry.received > entry.timeout:
                return UNKNOWN
            return entry.health

    def health_messages(self, driver: str) -> int:
        """How many NodeWatchResources messages arrived from the driver."""
        with self._cond:
            return self._health_messages.get(driver, 0)

    def health_streams(self, driver: str) -> int:
        """How many NodeWatchResources streams were opened to the driver."""
        with self._cond:
            return self._health_streams.get(driver, 0)

    def health_services(self, driver: str) -> list[str | None]:
        """The health service streamed from each registered endpoint of the driver (None: no stream)."""
        with self._cond:
            return [plugin.health_service for plugin in self._plugins.get(driver, [])]

    @property
    def starts(self) -> int:
        """How many times the emulator started (1 + restarts)."""
        return self._starts

    def wait_for(self, predicate: Callable[[], Any], timeout: float = 5.0, what: str = "") -> Any:
        """Wait until ``predicate()`` is truthy and return its value: re-checked on every state change and at least
        every 50 ms (health reads Unknown by the clock alone); ``TimeoutError`` after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            with self._cond:
                version = self._version
            value = predicate()
            if value:
                return value
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"timed out after {timeout:g} s waiting for {what or 'condition'}")
            with self._cond:
                if self._version == version:
                    self._cond.wait(min(remaining, 0.05))


def _replace(pod: DraPod, **changes: Any) -> DraPod:
    return msgspec.structs.replace(pod, **changes)


def _claim_state(info: _ClaimInfo) -> ClaimState:
    return ClaimState(
        uid=info.uid,
        name=info.name,
        namespace=info.namespace,
        pod_uids=frozenset(info.pod_uids),
        drivers=tuple(info.drivers),
        devices=tuple(d for devices in info.drivers.values() for d in devices),
        prepared=info.prepared,
    )
