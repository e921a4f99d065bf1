"""The DRA kubelet emulator's plugin side: the plugin watcher, registration, endpoints per driver, ResourceSlice
wiping and the health stream (facts/dra.md A1, A3, A4). Mixed into ``agent.sim.kubelet.dra.DraKubeletEmulator``,
whose state it uses.

* ``RegistryWatcher`` (inotify, ``agent.fswatch``): an initial walk of the registry directory, then create and
  delete events; only unix sockets, names starting with ``.`` ignored. Each socket's operations (register,
  deregister) run in order on a worker of its own, as the plugin manager's operation executor keys them by path.
* Registration: blocking dial (10 s), ``GetInfo`` (1 s), type ``DRAPlugin``, an empty endpoint means the
  registration socket, the release's service choice (``dra_versions.DraRules.choose``), the "already registered"
  check (up to 1.32: a newer version replaces the driver's one endpoint), then
  ``NotifyRegistrationStatus`` (5 s). A registration that failed before the plugin reached the actual state of the
  world (dial, GetInfo, type, validation) is tried again with the executor's backoff (0.5 s doubling to 2m2s) while
  its socket stays; one refused at RegisterPlugin ("already registered") is in the actual state and is not retried,
  and the deletion of its socket deregisters ``(driver, endpoint)`` — the first registration of that endpoint, as
  the kubelet's ``DeRegisterPlugin(name, endpoint)`` does.
* Endpoints: one gRPC channel per registered endpoint, connectivity followed through the channel's state (READY is
  connected; an IDLE channel is asked to connect again, as the kubelet's ConnEnd handler does). Calls go to the most
  recent connected endpoint, else the most recent one (before 1.34: the most recent one).
* Wiping: at start every slice of the node (``spec.nodeName=<node>``), and the slices of a driver that went away
  (``spec.driver=<driver>,spec.nodeName=<node>``): up to 1.32 at once when its endpoint deregisters, and nothing
  cancels it; from 1.33 ``wipe_delay`` seconds after it has no endpoint (1.33) or no connected endpoint (1.34+) —
  a timer cancelled when one registers (connects). Every wipe retries with the kubelet's backoff (1 s, x2, jitter
  0.2, cap 5 min, 100 steps) after reading the Node (absent: retried too).
* Health (1.34+): per registered endpoint a ``NodeWatchResources`` stream (``v1alpha1.DRAResourceHealth``; from 1.37
  ``v1.DRAResourceHealth`` when the plugin advertises it, see ``dra_versions``); each message
  replaces the devices it names (receive time kept), a device older than its timeout reads Unknown, the end of a stream
  clears the driver's cache, and the stream is opened again ``health_retry_period`` (5 s) after it ended.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import stat
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from msgspec import Struct, field

from agent.api.dra.v1 import api_pb2 as dra_v1
from agent.api.dra.v1 import api_pb2_grpc as dra_v1_grpc
from agent.api.dra.v1beta1 import api_pb2 as dra_v1beta1
from agent.api.dra.v1beta1 import api_pb2_grpc as dra_v1beta1_grpc
from agent.api.drahealth.v1 import api_pb2 as health_v1_pb2
from agent.api.drahealth.v1 import api_pb2_grpc as health_v1_grpc
from agent.api.drahealth.v1alpha1 import api_pb2 as health_pb2
from agent.api.drahealth.v1alpha1 import api_pb2_grpc as health_grpc
from agent.api.pluginregistration.v1 import api_pb2 as reg_pb2
from agent.api.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from agent.fswatch import (
    ENTRY_CHANGES,
    IN_CREATE,
    IN_DELETE,
    IN_ISDIR,
    IN_MOVED_FROM,
    IN_MOVED_TO,
    InotifyWatcher,
    Watch,
    plan_for,
)
from agent.sim.kubelet.common import CHANNEL_OPTIONS, CONN_CLOSING, go_rpc_error
from agent.sim.kubelet.dra_common import (
    API_TIMEOUT,
    DEFAULT_HEALTH_TIMEOUT,
    GET_INFO_TIMEOUT,
    HEALTH_V1_SERVICE,
    HEALTHY,
    NOTIFY_TIMEOUT,
    PLUGIN_TYPE,
    REGISTRATION_BACKOFF_INITIAL,
    REGISTRATION_BACKOFF_MAX,
    UNHEALTHY,
    UNKNOWN,
    V1_SERVICE,
    V1ALPHA4_SERVICE,
    WIPE_BACKOFF_CAP,
    WIPE_BACKOFF_FACTOR,
    WIPE_BACKOFF_INITIAL,
    WIPE_BACKOFF_JITTER,
    WIPE_BACKOFF_STEPS,
    RegistrationEvent,
    WipeRecord,
    api_error_text,
)

if TYPE_CHECKING:
    from agent.sim.kubelet.dra import DraKubeletEmulator

log = logging.getLogger("agent.sim.kubelet.dra")

_JITTER = random.Random()  # noqa: S311 -- backoff jitter, not a secret
_HEALTH_NAMES = {health_pb2.HEALTHY: HEALTHY, health_pb2.UNHEALTHY: UNHEALTHY, health_pb2.UNKNOWN: UNKNOWN}


def _no_op(_state: grpc.ChannelConnectivity) -> None:
    """A subscription that exists only to make the channel try to connect (see ``_Plugin.on_connectivity``)."""


# --------------------------------------------------------------------------------------------------
# The plugin watcher
# --------------------------------------------------------------------------------------------------


def _is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False


class RegistryWatcher(InotifyWatcher):
    """Posts ``("add", path)`` for every socket that appears in the directory and ``("remove", path)`` for every
    one that goes (``plugin_watcher.go``: fsnotify Create / Remove plus an initial walk)."""

    def __init__(self, directory: Path, post: Callable[[object], None], *, safety_interval: float = 30.0) -> None:
        super().__init__(post, safety_interval=safety_interval, thread_name="kubelet-dra-plugin-watcher")
        self._dir = directory
        self._known: set[str] = set()

    def _plan(self) -> tuple[Watch, ...]:
        return plan_for(self._dir, ENTRY_CHANGES)

    def _initial(self) -> None:
        self._resync()

    def _resync(self) -> None:
        current: set[str] = set()
        try:
            with os.scandir(self._dir) as entries:
                for entry in entries:
                    if not entry.name.startswith(".") and _is_socket(Path(entry.path)):
                        current.add(entry.name)
        except OSError:
            pass
        for name in sorted(self._known - current):
            self._gone(name)
        for name in sorted(current - self._known):
            self._came(name)

    def _on_events(self, events: list[tuple[Watch, int, str]]) -> None:
        for watch, mask, name in events:
            if watch.names is not None or not name or name.startswith(".") or mask & IN_ISDIR:
                continue  # on the way to the directory (the plan is re-read), a hidden name, a sub-directory
            if mask & (IN_DELETE | IN_MOVED_FROM):
                if name in self._known:
                    self._gone(name)
            elif mask & (IN_CREATE | IN_MOVED_TO):
                if name in self._known:
                    self._gone(name)  # replaced under the same name: a new plugin to the watcher
                if _is_socket(self._dir / name):
                    self._came(name)

    def _came(self, name: str) -> None:
        self._known.add(name)
        self._post(("add", str(self._dir / name)))

    def _gone(self, name: str) -> None:
        self._known.discard(name)
        self._post(("remove", str(self._dir / name)))


# --------------------------------------------------------------------------------------------------
# Internal state
# --------------------------------------------------------------------------------------------------


class _SocketOps(Struct):
    """The operations queued for one registration socket and the retry of a failed registration."""

    queue: deque[str] = field(default_factory=deque)
    worker: threading.Thread | None = None
    retry_at: float | None = None
    backoff: float = 0.0


class _Plugin(Struct, eq=False):
    """``monitoredPlugin``: one registered endpoint of a driver with its channel, connectivity and health stream."""

    driver: str
    endpoint: str
    service: str
    channel: grpc.Channel
    kubelet: DraKubeletEmulator
    version: str = ""  # the semantic version a <= 1.32 kubelet registered it with
    health_service: str | None = None  # the health service streamed from it (None: no stream)
    connected: bool = False
    closed: bool = False
    stop: threading.Event = field(default_factory=threading.Event)
    health_call: Any = None
    health_thread: threading.Thread | None = None

    def on_connectivity(self, state: grpc.ChannelConnectivity) -> None:
        """``HandleConn``: READY is ConnBegin, anything else ConnEnd; an IDLE channel is asked to connect again
        (``go m.conn.Connect()``) so that a plugin coming back is noticed without a call."""
        if self.closed:
            return
        self.kubelet._set_connected(self, state == grpc.ChannelConnectivity.READY)
        if state == grpc.ChannelConnectivity.IDLE and not self.closed:
            try:
                self.channel.subscribe(_no_op, try_to_connect=True)
                self.channel.unsubscribe(_no_op)
            except ValueError:  # closed meanwhile
                pass

    def dra_stub(self) -> tuple[Any, Any]:
        """The stub and message module of the chosen service. ``v1alpha4.Node`` has the v1beta1 messages (the
        same fields and numbers) on its own method paths; the emulator has no v1alpha4 module of its own."""
        if self.service == V1_SERVICE:
            return dra_v1_grpc.DRAPluginStub(self.channel), dra_v1
        if self.service == V1ALPHA4_SERVICE:
            return _V1alpha4Stub(self.channel), dra_v1beta1
        return dra_v1beta1_grpc.DRAPluginStub(self.channel), dra_v1beta1


class _V1alpha4Stub:
    """``drapbv1alpha4.NodeClient``: NodePrepareResources / NodeUnprepareResources on ``/v1alpha4.Node/``."""

    def __init__(self, channel: grpc.Channel) -> None:
        for method, request, response in (
            ("NodePrepareResources", dra_v1beta1.NodePrepareResourcesRequest, dra_v1beta1.NodePrepareResourcesResponse),
            (
                "NodeUnprepareResources",
                dra_v1beta1.NodeUnprepareResourcesRequest,
                dra_v1beta1.NodeUnprepareResourcesResponse,
            ),
        ):
            call = channel.unary_unary(
                f"/{V1ALPHA4_SERVICE}/{method}",
                request_serializer=request.SerializeToString,
                response_deserializer=response.FromString,
            )
            setattr(self, method, call)


class _DeviceHealth(Struct):
    health: str
    received: float  # monotonic
    timeout: float
    message: str


class _PendingWipe(Struct):
    timer: threading.Timer
    cancel: threading.Event
    fire_at: float


class DraPluginsMixin:
    """Registration, endpoints, wiping and health (see the module docstring). Uses the emulator's ``_cond``,
    ``_stopping``, ``_changed``, the API clients and the options of ``DraKubeletEmulator.__init__``."""

    # ------------------------------------------------------------------------------------------ watcher events

    def _on_registry_event(self: DraKubeletEmulator, event: object) -> None:
        kind, path = event  # type: ignore[misc]
        with self._cond:
            if self._stopping.is_set():
                return
            if kind == "add":
                self._watched.add(path)
            else:
                self._watched.discard(path)
            ops = self._socket_ops.setdefault(path, _SocketOps())
            ops.queue.append(kind)
            if kind == "remove":
                ops.retry_at = None
                ops.backoff = 0.0
            if ops.worker is None:
                ops.worker = threading.Thread(
                    target=self._socket_worker, args=(path, ops), name="kubelet-dra-register", daemon=True
                )
                self._track(ops.worker)
                ops.worker.start()
            self._changed()

    def _socket_worker(self: DraKubeletEmulator, path: str, ops: _SocketOps) -> None:
        """Run the socket's operations in order; wait out a failed registration's backoff, then try again."""
        while True:
            with self._cond:
                if self._stopping.is_set():
                    ops.worker = None
                    return
                if ops.queue:
                    op = ops.queue.popleft()
                elif ops.retry_at is not None:
                    remaining = ops.retry_at - time.monotonic()
                    if remaining > 0:
                        self._cond.wait(remaining)
                        continue
                    ops.retry_at = None
                    op = "add"
                else:
                    ops.worker = None
                    if self._socket_ops.get(path) is ops and ops.backoff == 0.0:
                        del self._socket_ops[path]
                    return
            if op == "remove":
                self._deregister_socket(path)
                continue
            retry = self._register_socket(path)
            with self._cond:
                if retry and not ops.queue and not self._stopping.is_set():
                    ops.backoff = (
                        REGISTRATION_BACKOFF_INITIAL
                        if ops.backoff == 0.0
                        else min(ops.backoff * 2, REGISTRATION_BACKOFF_MAX)
                    )
                    ops.retry_at = time.monotonic() + ops.backoff
                elif not retry:
                    ops.backoff = 0.0

    # ------------------------------------------------------------------------------------------ registration

    def _register_socket(self: DraKubeletEmulator, path: str) -> bool:
        """``GenerateRegisterPluginFunc``; True when the executor would try again (the plugin is not in the ASW)."""
        channel = grpc.insecure_channel(f"unix:{path}", options=CHANNEL_OPTIONS)
        try:
            error = self._dial(channel, path)
            if error:
                self._event("failed", path, error=f"RegisterPlugin error -- dial failed at socket {path}, err: {error}")
                return True
            stub = reg_grpc.RegistrationStub(channel)
            try:
                info = stub.GetInfo(reg_pb2.InfoRequest(), timeout=GET_INFO_TIMEOUT)
            except grpc.RpcError as exc:
                text = (
                    f"RegisterPlugin error -- failed to get plugin info using RPC GetInfo at socket {path}, "
                    f"err: {go_rpc_error(exc)}"
                )
                self._event("failed", path, error=text)
                return True
            except ValueError:
                return False  # the channel was closed by stop()
            if info.type != PLUGIN_TYPE:
                text = f"RegisterPlugin error -- no handler registered for plugin type: {info.type} at socket {path}"
                self._notify(stub, path, False, text, driver=info.name, endpoint=info.endpoint)
                return True
            endpoint = info.endpoint or path
            service, version, validation = self._validate(info.name, endpoint, list(info.supported_versions))
            if validation:
                text = f"RegisterPlugin error -- plugin validation failed with err: {validation}"
                self._notify(stub, path, False, text, driver=info.name, endpoint=endpoint)
                return True
            with self._cond:
                if self._stopping.is_set():
                    return False
                self._asw[path] = (info.name, endpoint)  # AddPlugin before RegisterPlugin
            failure = self._add_plugin(info.name, endpoint, service, version, list(info.supported_versions))
            if failure and self._stopping.is_set():
                return False  # the kubelet is going away: nobody is told anything
            if failure:
                text = f"RegisterPlugin error -- plugin registration failed with err: {failure}"
                self._notify(stub, path, False, text, driver=info.name, endpoint=endpoint)
                return False
            self._notify(stub, path, True, "", driver=info.name, endpoint=endpoint, service=service)
            return False
        finally:
            close_channel(channel)

    def _dial(self: DraKubeletEmulator, channel: grpc.Channel, path: str) -> str:
        """A blocking dial (``grpc.WithBlock``) bounded by ``dial_timeout``; "" once the channel is READY."""
        ready = grpc.channel_ready_future(channel)
        deadline = time.monotonic() + self.dial_timeout
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return f"failed to dial socket {path}, err: context deadline exceeded"
                if self._stopping.is_set():
                    return f"failed to dial socket {path}, err: context canceled"
                try:
                    ready.result(timeout=min(0.1, remaining))
                    return ""
                except grpc.FutureTimeoutError:
                    continue
        finally:
            ready.cancel()

    def _validate(self: DraKubeletEmulator, driver: str, endpoint: str, offered: list[str]) -> tuple[str, str, str]:
        """``ValidatePlugin``: (service, semantic version or "", error or "") by the release's rules."""
        registered = None
        if self.rules.one_endpoint_per_driver:
            with self._cond:
                held = self._plugins.get(driver, [])
                registered = held[-1].version if held else None
        return self.rules.choose(driver, endpoint, offered, registered)

    def _notify(
        self: DraKubeletEmulator,
        stub: reg_grpc.RegistrationStub,
        path: str,
        registered: bool,
        error: str,
        *,
        driver: str,
        endpoint: str,
        service: str = "",
    ) -> None:
        notify_error = ""
        try:
            stub.NotifyRegistrationStatus(
                reg_pb2.RegistrationStatus(plugin_registered=registered, error=error), timeout=NOTIFY_TIMEOUT
            )
        except grpc.RpcError as exc:
            notify_error = go_rpc_error(exc)
        except ValueError:
            notify_error = CONN_CLOSING
        if registered:
            if notify_error:
                log.error(
                    "RegisterPlugin error -- failed to send registration status at socket %s, err: %s",
                    path,
                    notify_error,
                )
            log.info("Registered DRA plugin driver=%s endpoint=%s service=%s", driver, endpoint, service)
        else:
            log.error("DRA plugin registration refused socket=%s err=%s", path, error)
        self._event(
            "registered" if registered else "refused",
            path,
            driver=driver,
            endpoint=endpoint,
            service=service,
            error=error,
            notify_error=notify_error,
        )

    def _event(self: DraKubeletEmulator, kind: str, socket: str, **fields: str) -> None:
        if kind == "failed":
            log.error("%s", fields.get("error", ""))
        with self._cond:
            self._registration_events.append(RegistrationEvent(kind, socket, at=time.monotonic(), **fields))
            self._changed()

    def _add_plugin(
        self: DraKubeletEmulator,
        driver: str,
        endpoint: str,
        service: str,
        version: str = "",
        offered: list[str] | None = None,
    ) -> str:
        """``DRAPluginManager.add``: refuse an endpoint registered already, else connect and start the health
        stream; "" on success. Up to 1.32 the driver's endpoint is replaced (``draPlugins.add``)."""
        replaced: list[_Plugin] = []
        with self._cond:
            if self._stopping.is_set():
                return "kubelet is shutting down"
            if self.rules.one_endpoint_per_driver:
                replaced = self._plugins.pop(driver, [])
                if replaced:
                    log.info("Already registered, previous plugin was replaced driver=%s", driver)
            else:
                for other in self._plugins.get(driver, []):
                    if other.endpoint == endpoint:
                        name = "DRA driver plugin" if self.rules.follows_connections else "plugin"
                        return f"endpoint {endpoint} already registered for {name} {driver}"
            channel = grpc.insecure_channel(f"unix:{endpoint}", options=CHANNEL_OPTIONS)
            plugin = _Plugin(
                driver=driver,
                endpoint=endpoint,
                service=service,
                channel=channel,
                kubelet=self,
                version=version,
                health_service=self.rules.health_service(offered or []) if self.health else None,
            )
            self._plugins.setdefault(driver, []).append(plugin)
            if plugin.health_service is not None:
                plugin.health_thread = threading.Thread(
                    target=self._health_loop, args=(plugin,), name=f"kubelet-dra-health-{driver}", daemon=True
                )
                self._track(plugin.health_thread)
                plugin.health_thread.start()
            self._sync_locked(driver)
            self._changed()
        for old in replaced:
            self._close_plugin(old)
        channel.subscribe(plugin.on_connectivity, try_to_connect=True)  # conn.Connect()
        return ""

    def _deregister_socket(self: DraKubeletEmulator, path: str) -> None:
        """``GenerateUnregisterPluginFunc``: RemovePlugin(socket) then DeRegisterPlugin(name, endpoint)."""
        with self._cond:
            entry = self._asw.pop(path, None)
        if entry is None:
            return
        driver, endpoint = entry
        self._remove_plugin(driver, endpoint)
        log.info("Unregistered DRA plugin driver=%s endpoint=%s socket=%s", driver, endpoint, path)
        self._event("deregistered", path, driver=driver, endpoint=endpoint)

    def _remove_plugin(self: DraKubeletEmulator, driver: str, endpoint: str) -> None:
        """``remove(driver, endpoint)``; up to 1.32 ``draPlugins.delete(driver)``: whichever endpoint the driver has
        now goes (a replaced endpoint's socket going takes its successor with it), and its slices are wiped."""
        with self._cond:
            plugins = self._plugins.get(driver, [])
            if self.rules.one_endpoint_per_driver:
                index = len(plugins) - 1 if plugins else None
            else:
                index = next((i for i, p in enumerate(plugins) if p.endpoint == endpoint), None)
            if index is None:
                return
            plugin = plugins.pop(index)
            if not plugins:
                del self._plugins[driver]
            if self.rules.wipes_at_once:
                self._wipe_now_locked(driver)
            else:
                self._sync_locked(driver)
            self._changed()
        self._close_plugin(plugin)

    def _close_plugin(self: DraKubeletEmulator, plugin: _Plugin) -> None:
        self._detach_plugin(plugin)
        close_channel(plugin.channel)

    def _detach_plugin(self: DraKubeletEmulator, plugin: _Plugin) -> None:
        """Stop following the plugin: no more connectivity callbacks, the health stream cancelled."""
        with self._cond:
            plugin.closed = True
            plugin.stop.set()
            call = plugin.health_call
        if call is not None:
            call.cancel()
        with contextlib.suppress(ValueError):
            plugin.channel.unsubscribe(plugin.on_connectivity)

    def _set_connected(self: DraKubeletEmulator, plugin: _Plugin, connected: bool) -> None:
        with self._cond:
            if plugin.closed or plugin.connected == connected:
                return
            plugin.connected = connected
            log.info("Connection changed driver=%s endpoint=%s connected=%s", plugin.driver, plugin.endpoint, connected)
            self._sync_locked(plugin.driver)
            self._changed()

    def _get_plugin(self: DraKubeletEmulator, driver: str) -> _Plugin | None:
        """``get``: the most recently added connected endpoint, else the most recent one (before 1.34 the most
        recent one, connected or not)."""
        with self._cond:
            plugins = self._plugins.get(driver, [])
            if self.rules.follows_connections:
                for plugin in reversed(plugins):
                    if plugin.connected:
                        return plugin
            return plugins[-1] if plugins else None

    # ------------------------------------------------------------------------------------------ wiping

    def _sync_locked(self: DraKubeletEmulator, driver: str) -> None:
        """``sync`` (1.33+): a usable driver cancels its pending wipe; an unusable one gets one unless it has it
        already. Usable: an endpoint is connected (1.34+), or registered (1.33). Up to 1.32 nothing is scheduled:
        ``_remove_plugin`` wipes at once."""
        if self.rules.wipes_at_once:
            return
        plugins = self._plugins.get(driver, [])
        usable = any(p.connected for p in plugins) if self.rules.follows_connections else bool(plugins)
        if usable:
            pending = self._pending_wipes.pop(driver, None)
            if pending is not None:
                pending.timer.cancel()
                pending.cancel.set()
                self._record_wipe("driver", driver, "cancelled", fire_at=pending.fire_at)
                log.info("ResourceSlice wipe cancelled: driver=%s is usable again", driver)
            return
        if driver in self._pending_wipes or self._stopping.is_set():
            return
        cancel = threading.Event()
        fire_at = time.monotonic() + self.wipe_delay
        timer = threading.Timer(self.wipe_delay, self._wipe_driver, args=(driver, cancel, fire_at))
        timer.name = f"kubelet-dra-wipe-{driver}"
        timer.daemon = True
        self._pending_wipes[driver] = _PendingWipe(timer, cancel, fire_at)
        self._track(timer)
        timer.start()
        self._record_wipe("driver", driver, "scheduled", fire_at=fire_at)
        log.info("ResourceSlice wipe scheduled: driver=%s in=%gs", driver, self.wipe_delay)

    def _wipe_now_locked(self: DraKubeletEmulator, driver: str) -> None:
        """<= 1.32 ``DeRegisterPlugin``: ``go h.wipeResourceSlices(pluginName)`` — at once, with nothing that
        cancels it but the kubelet stopping (a driver registering again meanwhile loses what it publishes)."""
        if self._stopping.is_set():
            return
        now = time.monotonic()
        wiper = threading.Thread(
            target=self._wipe,
            args=("driver", driver, self._start_wipe_cancel, now),
            name=f"kubelet-dra-wipe-{driver}",
            daemon=True,
        )
        self._track(wiper)
        wiper.start()
        self._record_wipe("driver", driver, "scheduled", fire_at=now)
        log.info("ResourceSlice wipe started: driver=%s deregistered", driver)

    def _wipe_driver(self: DraKubeletEmulator, driver: str, cancel: threading.Event, fire_at: float) -> None:
        if cancel.is_set():
            return
        self._wipe("driver", driver, cancel, fire_at=fire_at)
        with self._cond:
            pending = self._pending_wipes.get(driver)
            if pending is not None and pending.cancel is cancel:
                del self._pending_wipes[driver]
                self._changed()

    def _wipe(
        self: DraKubeletEmulator, reason: str, driver: str, cancel: threading.Event, fire_at: float = 0.0
    ) -> None:
        """``wipeResourceSlices``: read the Node, then DeleteCollection by field selector, with backoff."""
        selector = f"spec.nodeName={self.node_name}"
        if driver:
            selector = f"spec.driver={driver},{selector}"  # fields.Set.String() sorts the keys
        delay = WIPE_BACKOFF_INITIAL
        error = ""
        attempts = 0
        while attempts < WIPE_BACKOFF_STEPS and not (cancel.is_set() or self._stopping.is_set()):
            attempts += 1
            error = self._delete_slices(selector)
            if not error:
                log.info("Deleted ResourceSlices fieldSelector=%s", selector)
                self._record_wipe(reason, driver, "done", fire_at=fire_at, attempts=attempts, selector=selector)
                return
            log.info("Deleting ResourceSlice failed, retrying fieldSelector=%s err=%s", selector, error)
            wait = delay + _JITTER.random() * WIPE_BACKOFF_JITTER * delay
            delay = min(delay * WIPE_BACKOFF_FACTOR, WIPE_BACKOFF_CAP)
            if cancel.wait(wait):
                break
        state = "cancelled" if cancel.is_set() or self._stopping.is_set() else "abandoned"
        self._record_wipe(reason, driver, state, fire_at=fire_at, attempts=attempts, error=error, selector=selector)

    def _delete_slices(self: DraKubeletEmulator, selector: str) -> str:
        """One attempt; "" when done (a 404 is done too: nothing to delete)."""
        try:
            self._core_api.read_node(self.node_name, _preload_content=False, _request_timeout=API_TIMEOUT).read()
        except self._api_exception as exc:
            return f"node {self.node_name}: {api_error_text(exc)}"
        except Exception as exc:  # connection refused, timeouts: the API server is not there
            return f"Unexpected error checking for node: {api_error_text(exc)}"
        try:
            self._resource_api.delete_collection_resource_slice(
                field_selector=selector, _preload_content=False, _request_timeout=API_TIMEOUT
            ).read()
        except self._api_exception as exc:
            return "" if exc.status == 404 else api_error_text(exc)
        except Exception as exc:
            return api_error_text(exc)
        return ""

    def _record_wipe(
        self: DraKubeletEmulator,
        reason: str,
        driver: str,
        state: str,
        *,
        fire_at: float = 0.0,
        attempts: int = 0,
        error: str = "",
        selector: str = "",
    ) -> None:
        if not selector:
            selector = f"spec.nodeName={self.node_name}"
            if driver:
                selector = f"spec.driver={driver},{selector}"
        with self._cond:
            self._wipes.append(
                WipeRecord(reason, driver, selector, state, fire_at, attempts, error, at=time.monotonic())
            )
            self._changed()

    # ------------------------------------------------------------------------------------------ health

    def _health_loop(self: DraKubeletEmulator, plugin: _Plugin) -> None:
        """``wait.UntilWithContext(streamCtx, ..., 5s)`` around NodeWatchResources + HandleWatchResourcesStream."""
        v1 = plugin.health_service == HEALTH_V1_SERVICE
        stub = (health_v1_grpc if v1 else health_grpc).DRAResourceHealthStub(plugin.channel)
        request = health_v1_pb2.NodeWatchResourcesRequest() if v1 else health_pb2.NodeWatchResourcesRequest()
        while not plugin.stop.is_set():
            error = "EOF"
            try:
                call = stub.NodeWatchResources(request)
                with self._cond:
                    plugin.health_call = call
                    closed = plugin.closed
                    self._health_streams[plugin.driver] = self._health_streams.get(plugin.driver, 0) + 1
                    self._changed()
                if closed:
                    call.cancel()
                for message in call:
                    self._on_health(plugin, message)
            except grpc.RpcError as exc:
                error = go_rpc_error(exc)
            except ValueError:
                error = CONN_CLOSING
            with self._cond:
                plugin.health_call = None
                self._health.pop(plugin.driver, None)  # the stream ended: the driver's cache is cleared
                self._changed()
            if not plugin.closed:
                log.info("WatchResources health stream has ended driver=%s err=%s", plugin.driver, error)
            if plugin.stop.wait(self.health_retry_period):
                return

    def _on_health(
        self: DraKubeletEmulator,
        plugin: _Plugin,
        message: health_pb2.NodeWatchResourcesResponse | health_v1_pb2.NodeWatchResourcesResponse,
    ) -> None:
        now = time.monotonic()
        with self._cond:
            if plugin.closed:
                return
            devices = self._health.setdefault(plugin.driver, {})
            for entry in message.devices:
                timeout = float(entry.health_check_timeout_seconds)
                devices[(entry.device.pool_name, entry.device.device_name)] = _DeviceHealth(
                    health=_HEALTH_NAMES.get(entry.health, UNKNOWN),
                    received=now,
                    timeout=timeout if timeout > 0 else DEFAULT_HEALTH_TIMEOUT,
                    message=entry.message,
                )
            self._health_messages[plugin.driver] = self._health_messages.get(plugin.driver, 0) + 1
            self._changed()


def close_channel(channel: grpc.Channel, timeout: float = 1.0) -> None:
    """Close ``channel`` once grpcio's connectivity-polling thread for it has ended.

    That thread (started by ``subscribe`` and ``channel_ready_future``) may call ``check_connectivity_state`` just
    after ``close()`` and die with "Cannot invoke RPC: Channel closed!" when a state change or a pending
    ``try_to_connect`` coincides with the close. With every subscription gone it ends within one 0.2 s watch, so
    the close waits for that, up to ``timeout`` (the flag is grpcio's own; without it the channel closes at once)."""
    state = getattr(channel, "_connectivity_state", None)
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while state is not None and getattr(state, "polling", False) and time.monotonic() < deadline:
        pause.wait(0.01)
    channel.close()
