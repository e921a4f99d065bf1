"""The reconcile loop: the one place that owns Tessera's mutable state.

Everything that happens — an XID from the NVML event thread, a new ``kubelet.sock``, a closed
ListAndWatch stream, a registration result, the clock — arrives as an event on one queue. The loop
consumes them in order, recomputes the plan and device health with the pure core, and applies the
difference: it starts and stops resource servers, hands them new immutable snapshots, and (re)registers
resources with the kubelet. gRPC handler threads only read the snapshots they are given.

Like the kubelet's sync loop driving its managers, the loop dispatches each concern to a room of its own and
acts on what the room answers (``agent.news.News``: read the node again, publish, or refresh the status):

- registration with the kubelet: ``agent.plugin.registrations``; the resource servers: ``agent.plugin.servers``;
- device health (XIDs, lost GPUs, recovery, the liveness re-check): ``agent.health_keeper``;
- the node's labels, cordon annotations and Events: ``agent.node_metadata``;
- MIG layouts: ``agent.mig.selection`` (which layout) and ``agent.mig.manager`` (getting there); MPS daemons:
  ``agent.mps.manager``; the DRA front end and GPU hand-overs: ``agent.dra.manager``;
- below them all, the ledger of who holds each device (``agent.ledger``): every destructive step and hand-over
  asks it, in its critical section.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from msgspec import Struct, field
from msgspec.structs import replace

from agent.config.check_worker import CheckWorker, ConfigChecked
from agent.config.early import stamp
from agent.config.effective import FlagOverrides, effective
from agent.config.isolated import Check, CheckerFailed
from agent.config.labels import (
    CONFIG_LABEL,
    CORDON_ANNOTATIONS,
    MIG_CONFIG_LABEL,
    NodeAnnotationChanged,
    NodeLabelChanged,
)
from agent.config.model import ConfigError, ConfigModel, DraSection
from agent.config.source import LoadedConfig
from agent.config.watch import ConfigSourceChanged, ConfigWatcher
from agent.core.allocation import DEFAULT_CDI_KIND, DeviceListStrategy
from agent.core.dra.cdi import NODE_WIDE_CDI_KIND
from agent.core.health import HealthPolicy, HealthState
from agent.core.inventory import Inventory, keep_unanswered
from agent.core.mps import MpsDaemonSpec, mps_daemons
from agent.core.plan import plan
from agent.core.resources import MigStrategy, PlanError, ResourcePlan, Sharing
from agent.core.snapshot import AllocationOptions, ResourceSnapshot, build_snapshots
from agent.gpu.discovery import discover
from agent.gpu.driver_root import DriverRoot
from agent.gpu.health import GpuLost, NvmlEventWatcher, WatchFailed, WatchRestored, XidEvent
from agent.gpu.mig_recheck import MigRecheck
from agent.health_keeper import HealthKeeper
from agent.ledger import DeviceLedger
from agent.memlimits.settings import MemoryLimitSettings
from agent.news import News
from agent.node_metadata import NodeMetadata
from agent.plugin.lock import PluginDirLock, PluginDirLocked
from agent.plugin.registration import KUBELET_SOCKET
from agent.plugin.registrations import RegistrationDone, Registrations
from agent.plugin.server import send_updates
from agent.plugin.servers import ResourceServers
from agent.plugin.watch import KubeletSocketChanged, PluginDirChanged, PluginDirWatcher, PluginSocketRemoved
from agent.status import AgentStatus
from agent.supervise import Backoff, WorkerCrashed
from agent.telemetry.service import Telemetry, TelemetrySettings

if TYPE_CHECKING:
    from agent.dra.manager import DraManager
    from agent.dra.types import DraSettings
    from agent.memlimits.manager import MemoryLimits
    from agent.mig.manager import MigManager
    from agent.mig.selection import LayoutSelection
    from agent.mps.manager import MpsManager
    from agent.telemetry.latency import OperationLatency

log = logging.getLogger(__name__)

SAFETY_SECONDS = 30.0  # the loop wakes at least this often with nothing to do: a missed event cannot strand it
TELEMETRY_WAIT_SECONDS = 2.0  # metrics (what comes second) start once the kubelet is served, or after this
STREAM_RETRY_DELAY = 0.2  # after a closed stream, give a restarting kubelet a moment to clean up
MAX_BACKOFF = 30.0


class AgentExit(RuntimeError):
    """A start-up condition that retrying cannot fix; the message says what to do."""


class AgentOptions(Struct, frozen=True):
    device_plugin_dir: Path = Path("/var/lib/kubelet/device-plugins")
    pod_resources_socket: Path = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
    overrides: FlagOverrides = field(default_factory=FlagOverrides)  # flags given explicitly (or by env)
    mig_strategy: MigStrategy | None = None  # for embedding: an explicit MIG strategy
    allocation: AllocationOptions | None = None  # for embedding: explicit allocation options
    config_path: Path | None = None  # a config file, or a directory of named configs (a mounted ConfigMap)
    config_check: Check | None = None  # the config checker already running on config_path (tessera run starts it first)
    config_name: str | None = None  # which named config to use (else node label, match, default)
    node_name: str | None = None  # this node, for its nvidia.com/device-plugin.config label
    mps_control: str | None = None  # the nvidia-cuda-mps-control binary (default: found on PATH)
    mps_keeper: Path | None = None  # a `tessera mps-keeper` socket: MPS daemons start in its container
    dra_registry_dir: Path = Path("/var/lib/kubelet/plugins_registry")  # the kubelet's plugin watcher
    dra_plugins_dir: Path = Path("/var/lib/kubelet/plugins")  # <dir>/<driver>/: the DRA socket and checkpoint
    cdi_root: Path = Path("/var/run/cdi")  # CDI specs of prepared DRA claims (and the device plugin's, for cdi-*)
    driver_root: DriverRoot = field(default_factory=DriverRoot)  # the driver's files, for self-contained CDI specs
    node_wide_cdi: bool = False  # CDI IDs name nvidia-ctk cdi generate's node-wide spec instead (no spec of ours)
    sys_root: Path = Path("/sys")  # the host's sysfs: each DRA GPU's PCIe root
    nvidia_smi: str = "nvidia-smi"  # sets the time-slice of DRA claims' time-sliced GPUs
    pod_uid: str | None = None  # this agent's pod: DRA socket names that allow a rolling update
    mig_config: Path | None = None  # a MIG layout file (mig-parted's format); else the config's migLayout
    mig_config_name: str | None = None  # which layout (else the node label nvidia.com/mig.config, else the config's)
    kubeconfig: str | None = None  # outside a pod: how to reach the Kubernetes API
    health: HealthPolicy = field(default_factory=HealthPolicy)
    liveness_probe_seconds: float = SAFETY_SECONDS  # the slow re-check for a GPU lost without an event
    lock_wait_seconds: float = 15.0  # how long a predecessor on this plugin directory gets to let go
    thread_join_seconds: float | None = None  # on stop, wait this long for each thread (None: each its own bound)
    # How long one nvmlEventSetWait may block. It cannot be interrupted, so it bounds how soon the watcher
    # stops and takes up a changed GPU set; each return is a wake-up of an idle agent. `tessera run` uses
    # NVIDIA's 5 s (its process does not wait for the watcher on the way out); in-process agents stop faster.
    health_event_wait_ms: int = 500
    telemetry: TelemetrySettings | None = None  # None: no metrics endpoint, no node labels
    memory_limits: MemoryLimitSettings | None = None  # None: no per-container memory limits through the driver

    @property
    def kubelet_socket(self) -> Path:
        return self.device_plugin_dir / KUBELET_SOCKET


class StreamClosed(Struct, frozen=True):
    resource: str


class StreamOpened(Struct, frozen=True):
    """The kubelet watches a resource: posted only while metrics wait for the first ListAndWatch of each."""

    resource: str


class Stop(Struct, frozen=True):
    pass


class Ping(Struct, frozen=True):
    """Answered by the loop: proof that it turns (``/healthz``), without waking it when nobody asks."""

    answered: threading.Event


class Agent:
    """Discovers the node, serves its resources to the kubelet and keeps them healthy and registered."""

    def __init__(self, options: AgentOptions, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.options = options
        self._clock = clock
        self._events: queue.Queue[object] = queue.Queue()
        self._registrations = Registrations(options.kubelet_socket, self.post, clock)  # one Register per kubelet
        self._inventory: Inventory | None = None
        self._plan: ResourcePlan | None = None
        self._loaded: LoadedConfig | None = None
        self._effective = effective(ConfigModel(), self._overrides())
        self._config_error: str | None = None
        self._said: set[str] = set()  # warnings already logged, so a reload does not repeat them
        self._config_watcher: ConfigWatcher | None = None
        self._config_check: Check | None = None  # the config checker's run (a child process) in use
        self._check_worker: CheckWorker | None = None  # once started, reloads are checked off the loop
        self._config_force = False  # a forced apply waits for the check it asked for
        follow_labels = bool(options.config_path and options.config_path.is_dir())  # labels pick the config
        self._node = NodeMetadata(
            options.node_name,
            options.kubeconfig,
            follow_labels=follow_labels,
            hold_events_seconds=TELEMETRY_WAIT_SECONDS,  # the start's Events wait for _settle, as metrics do
        )
        # The features a config may ask for are loaded when it first does (their modules are not even imported
        # before): the MPS manager with the first MPS daemon (of a resource or a DRA claim), the MIG manager
        # with the first MIG layout, the DRA front end with a config that gives it GPUs. Each one's events are
        # routed to it by the module that defines them (``_routes``).
        self._mps: MpsManager | None = None
        self._mig: MigManager | None = None
        self._dra: DraManager | None = None
        self._routes: dict[str, Callable[[object, float], News]] = {}  # event module -> (event, now) -> what to do
        self._memlimits: MemoryLimits | None = None  # containers held to their devices' memory by the driver
        # Who holds each device, and which GPUs DRA serves: every destructive step and hand-over asks it, in its
        # critical section (the features above act on their workers; the loop itself never waits for it).
        self._ledger = DeviceLedger(options.pod_resources_socket)
        self._layouts: LayoutSelection | None = None  # which MIG layout: loaded with the MIG manager
        self._mig_recheck = MigRecheck()  # MIG changes no event announces (a reset, a change by hand)
        self._keeper = HealthKeeper(options.health, liveness_seconds=options.liveness_probe_seconds, clock=clock)
        self._snapshots: dict[str, ResourceSnapshot] = {}
        self._plugin_dir_present: bool | None = None
        self._event_watcher: NvmlEventWatcher | None = None
        self._kubelet_watcher: PluginDirWatcher | None = None  # kubelet.sock, plugin sockets, the directory
        self._config_errors = 0
        self._telemetry: Telemetry | None = None  # set by the metrics-start thread, under _telemetry_lock
        self._telemetry_lock = threading.Lock()
        self._telemetry_closed = False  # the agent stopped: metrics still loading never start
        # Allocate / GetPreferredAllocation / Prepare / Unprepare times, recorded only when metrics are served
        self._latency: OperationLatency | None = None
        if options.telemetry is not None:
            from agent.telemetry.latency import OperationLatency

            self._latency = OperationLatency()
        self._servers = ResourceServers(
            options.device_plugin_dir,
            self._registrations,
            clock=clock,
            on_stream_closed=lambda resource: self.post(StreamClosed(resource)),
            on_stream_opened=self._on_stream_opened,
            on_allocate=self._ledger.note_allocated,
            latency=self._latency,
        )
        self._plugin_cdi: Any = None  # agent.plugin.cdi_spec.DevicePluginCdi, once a cdi-* strategy is in force
        self._settling = False  # started, the kubelet not served yet: what comes second (metrics) waits
        self._settle_by = 0.0  # what comes second starts by then even if the kubelet has not watched everything
        self._kubelet_known = False  # the watcher has said whether kubelet.sock is there
        self._lock: PluginDirLock | None = None
        self.stopping = threading.Event()
        """Set by ``stop()``: a wait that only a stop may cut short (the plugin-directory lock) ends at once."""
        self._internal_errors: dict[str, int] = {}
        self._said_errors: set[tuple[str, str]] = set()
        self._resync_at: float | None = None  # a failed step is retried by a full, idempotent resync
        self._resync_backoff = Backoff(0.5, MAX_BACKOFF)
        self._rediscover_at: float | None = None  # the inventory is read again at this time
        self._rediscover_backoff = Backoff(0.5, 60.0)
        self._recheck_config_at: float | None = None  # the config checker failed: its files are checked again then
        self._recheck_config_backoff = Backoff(1.0, 60.0)
        self._stale_gpus: frozenset[str] = frozenset()  # their devices are withdrawn until a good re-read
        self._discovery_error: str | None = None
        self.status = AgentStatus()
        self.heartbeat = self._clock()  # the loop's last turn, for /healthz
        self.started = threading.Event()
        self.served = threading.Event()
        """Set once the start is over for the kubelet: every resource it was offered is watched (or failed to
        register), or ``TELEMETRY_WAIT_SECONDS`` passed. What comes second waits for it: metrics, the start's
        Events, and the process's clean-up of what only the start needed (``agent.run``)."""

    @property
    def metrics_port(self) -> int | None:
        """The port /metrics is served on (useful with an ephemeral ``:0`` address), or None."""
        return self._telemetry.server.port if self._telemetry else None

    # ----- the outside world talks to the loop only through events --------------------------------

    def post(self, event: object) -> None:
        self._events.put(event)

    def stop(self) -> None:
        self.stopping.set()  # before the loop hears it: the start may be waiting for the plugin-directory lock
        check = self._config_check
        if check is not None and not self.started.is_set():
            check.cancel()  # or for its config check: a hung checker does not hold the exit
        self.post(Stop())

    def responsive(self, timeout: float = 2.0) -> bool:
        """Does the reconcile loop answer within ``timeout``? (It is idle, not stuck, when it does.)"""
        ping = Ping(threading.Event())
        self.post(ping)
        return ping.answered.wait(timeout)

    # ----- the loop -------------------------------------------------------------------------------

    def run(self) -> None:
        """Start, then reconcile until ``stop()``; on the way out stop every server and remove its socket.

        Nothing that happens inside the loop ends it: an unexpected exception in a handler or a tick is
        logged once with its context, counted, the last good state keeps being served, and a full resync
        is retried with backoff. Only ``stop()`` (SIGTERM) and ``AgentExit`` at start end ``run``.
        """
        try:
            self._start()
            self.started.set()
            while True:
                try:
                    event = self._events.get(timeout=self._seconds_to_next_deadline())
                except queue.Empty:
                    event = None
                if isinstance(event, Stop):
                    break
                if event is not None:
                    self._guarded("event", self._handle, event)
                self._guarded("tick", self._tick)
                self.heartbeat = self._clock()
        finally:
            self._shutdown()

    def _seconds_to_next_deadline(self) -> float:
        """How long the loop may sleep: until the nearest real deadline (a retry, a backoff, a health quiet
        period, a MIG or MPS drain re-check), at most ``SAFETY_SECONDS``. Nothing else wakes it but events."""
        now = self._clock()
        deadlines = [self._keeper.next_deadline(), self._resync_at, self._rediscover_at, self._recheck_config_at]
        deadlines += [feature.next_deadline() for feature in (self._mps, self._mig, self._dra) if feature is not None]
        if self._settling:
            deadlines.append(self._settle_by)
        deadlines.append(self._registrations.next_deadline(self._servers.servers))
        deadlines += self._servers.retry_deadlines()
        nearest = min((d for d in deadlines if d is not None), default=now + SAFETY_SECONDS)
        return min(SAFETY_SECONDS, max(0.0, nearest - now))

    def _guarded(self, where: str, step: Callable[..., None], *args: object) -> None:
        try:
            step(*args)
        except AgentExit:
            raise
        except Exception as error:
            self._internal_error(where, error, context=type(args[0]).__name__ if args else "")
            self._schedule_resync()

    def _internal_error(self, where: str, error: BaseException, *, context: str = "") -> None:
        """Log an unexpected exception once per kind (traceback at debug), count it, and carry on."""
        self._internal_errors[where] = self._internal_errors.get(where, 0) + 1
        said = (where, f"{type(error).__name__}: {error}")
        if said not in self._said_errors:
            self._said_errors.add(said)
            log.error(
                "internal error survived where=%s context=%s error=%r; keeping the last good state and retrying",
                where, context or "-", said[1],
            )  # fmt: skip
        log.debug("internal error traceback where=%s\n%s", where, "".join(traceback.format_exception(error)))
        self._refresh_status()

    def _schedule_resync(self) -> None:
        if self._resync_at is None:
            self._resync_at = self._clock() + self._resync_backoff.next_delay()

    def _resync(self) -> None:
        """Re-apply everything from scratch (config, MIG, servers): what a failed step is retried as."""
        self._resync_at = None
        try:
            self._apply_config(force=True)
            self._update_mig(publish=False)
            self._publish()
        except Exception as error:
            self._internal_error("resync", error)
            self._schedule_resync()
        else:
            self._resync_backoff.reset()

    def _start(self) -> None:
        path, early = self.options.config_path, self.options.config_check
        if path is not None:  # checked in a child process while the GPUs and the Node are read
            self._config_check = early if early is not None and early.path == path else Check(path)
        self._plan = ResourcePlan((), MigStrategy.NONE)
        self._inventory = Inventory("", "", None, (), ())
        self._take_lock()
        self._read_inventory("start")
        self._node.start(self.post, self._inventory)
        self._guarded("config", self._apply_config)
        self._publish()
        if self.options.config_path is not None:
            self._config_watcher = ConfigWatcher(self.options.config_path, self.post)
            self._config_watcher.start()
            self._check_worker = CheckWorker(self.post)
        self._event_watcher = NvmlEventWatcher(
            [g.uuid for g in self._inventory.gpus], self.post, wait_ms=self.options.health_event_wait_ms
        )
        self._event_watcher.start()
        self._kubelet_watcher = PluginDirWatcher(self.options.device_plugin_dir, self.post)
        self._kubelet_watcher.start()
        if self._memlimits is not None:  # loaded by the first config: its worker looks once the start has published
            self._memlimits.start()
        self._settling, self._settle_by = True, self._clock() + TELEMETRY_WAIT_SECONDS

    def _load_memory_limits(self, dra: bool = False) -> None:
        """Load the memory-limits room once something asks the driver to hold memory: a sized replica of the plan,
        or the DRA front end (its shares; ``dra``: a config enables it). Until then — whole GPUs, MIG devices, plain
        time-slicing, most nodes — nothing of it is loaded (its modules, its worker and its watcher: ~0.5 MB, a
        thread, inotify watches). Called where the plan changes (a config applied, the node read again), before the
        status that follows, and before the DRA front end configures (a restarted agent's re-prepared shares are said
        held by the driver, never advisory, from the start) — not on every publish (an XID's)."""
        if self.options.memory_limits is None or self._memlimits is not None or self._plan is None:
            return
        if not dra and self._dra is None and not self._plan.sizes_memory():
            return
        self._memlimits = self._memory_limits(self.options.memory_limits)
        self._routes["agent.memlimits.watch"] = self._routes["agent.memlimits.manager"] = self._memlimits.on_event
        if self.started.is_set():  # at the start its worker starts last, once the claims are prepared (_start)
            self._memlimits.start()

    def _memory_limits(self, settings: MemoryLimitSettings) -> MemoryLimits:
        """The memory-limits room (its worker calls NVML and the kubelet; the loop only routes its events and hands
        its report to the DRA front end), with the driver probed so the first status knows what the driver holds."""
        from agent.memlimits.manager import MemoryLimits
        from agent.plugin.podresources import list_pod_resources

        socket = self.options.pod_resources_socket
        room = MemoryLimits(
            settings,
            plan=lambda: self._plan,
            holders=lambda: list_pod_resources(socket),
            section=self._ledger.section,
            post=self.post,
            claims=self._ledger.claims_checkpoint,
            inventory=lambda: self._inventory,
        )
        try:
            room.probe()
        except Exception as error:  # NVML did not answer: the worker's looks probe again
            log.warning("memory limits: cannot probe the driver yet error=%r", str(error))
        return room

    def _settle(self) -> None:
        """The kubelet is served (or waited for long enough): what comes second starts."""
        self._settling = False
        self.served.set()  # what waits for the kubelet to be served (the collector, metrics, Events) goes on
        self._node.follow()  # the Node's watch, from the start's GET: a change made meanwhile is its first event
        self._node.release_events()
        if self.options.telemetry is not None:
            threading.Thread(target=self._start_telemetry, name="metrics-start", daemon=True).start()

    def _start_telemetry(self) -> None:
        """Metrics come second, on a thread of their own: loading and starting them (~40 ms on two cores) would
        hold the reconcile loop just after the node is served, and an XID or a SIGTERM would wait behind them.
        Telemetry reads the published status only, never the loop's state; a failure it did not foresee comes
        back to the loop as ``WorkerCrashed`` (counted like the loop's own)."""
        settings = self.options.telemetry
        assert settings is not None
        try:
            telemetry = Telemetry(
                settings,
                self,
                self.options.device_plugin_dir,
                self.options.pod_resources_socket,
                node_api=self._node.api,
                latency=self._latency,
                claims=lambda: self._dra.prepared_claim_devices() if self._dra is not None else (),  # type: ignore[misc]
                memory_limits=lambda: self._memlimits.snapshot() if self._memlimits is not None else (),
            )
        except (OSError, ValueError) as error:  # metrics are not worth failing the node's GPUs for
            log.error("no metrics endpoint address=%s error=%r", settings.metrics_address, str(error))
            return
        except Exception as error:
            self.post(WorkerCrashed("metrics", "start", f"{type(error).__name__}: {error}"))
            return
        with self._telemetry_lock:
            if self._telemetry_closed:
                telemetry.stop(timeout=0)  # the agent stopped while metrics loaded: they never start (port freed)
                return
            telemetry.start()
            self._telemetry = telemetry

    def _shutdown(self) -> None:
        """What the kubelet sees goes first (every socket removed, ListAndWatch streams ended), then the
        threads are told to stop. ``thread_join_seconds`` bounds the wait for each of them (one blocked in the
        driver, a watcher closing its inotify instance): ``tessera run`` exits right after, so it does not wait
        for them; MPS daemons keep serving."""
        self.started.set()  # a caller waiting for the start learns that it is over
        self.served.set()
        self._servers.stop_all()
        join = self.options.thread_join_seconds
        if self._event_watcher is not None:
            self._event_watcher.stop(timeout=join)
        with self._telemetry_lock:
            self._telemetry_closed = True
            telemetry = self._telemetry
        for watcher in (
            telemetry,
            self._memlimits,
            self._kubelet_watcher,
            self._config_watcher,
            self._check_worker,  # a running checker child is killed: a hung check does not hold the exit
            *self._node.threads(),
        ):
            if watcher is None:
                continue
            if join is None:
                watcher.stop()  # each waits for its thread as long as it needs (bounded by its own limit)
            else:
                watcher.stop(timeout=join)
        for feature in (self._mps, self._mig, self._dra):
            if feature is not None:
                feature.shutdown(
                    wait=join is None or join > 0
                )  # `tessera run` exits next: no work in flight waited for
        if self._lock is not None:
            self._lock.release()
        log.info("stopped")

    def _take_lock(self) -> None:
        """One agent per device-plugin directory; a predecessor (rolling update) gets a moment to let go."""
        if self._lock is not None or not self.options.device_plugin_dir.is_dir():
            return  # taken once the directory appears (_plugin_dir_ready)
        lock = PluginDirLock(self.options.device_plugin_dir)
        try:
            lock.acquire(wait=0.0)
        except PluginDirLocked as error:
            wait = self.options.lock_wait_seconds
            log.warning("device-plugin directory is held by another agent; waiting up to %.0fs error=%r",
                        wait, str(error))  # fmt: skip
            try:
                lock.acquire(wait=wait, stop=self.stopping)
            except PluginDirLocked as still:  # or LockWaitStopped: SIGTERM came first ("stopped while waiting ...")
                raise AgentExit(str(still)) from None
        self._lock = lock

    def _handle(self, event: object) -> None:
        match event:
            case Ping(answered=answered):
                answered.set()
            case XidEvent():
                self._on_xid(event)
            case WatchFailed(gpu_uuid=uuid, error=error):
                self._keeper.on_watch_failed([uuid] if uuid else [g.uuid for g in self._gpus()], error)
                self._publish()
            case GpuLost(gpu_uuid=uuid):
                self._keeper.on_gpu_lost(uuid)
                self._publish()
            case WatchRestored(gpu_uuid=uuid):
                self._on_watch_restored(uuid)
            case WorkerCrashed():
                self._on_worker_crashed(event)
            case PluginSocketRemoved() | PluginDirChanged() | StreamOpened():
                pass  # the tick that follows every event serves missing sockets, takes the lock, starts metrics
            case KubeletSocketChanged(present=present):
                self._on_kubelet(present)
            case StreamClosed(resource=resource):
                self._want_registration(resource, delay=STREAM_RETRY_DELAY, unless_watched=True)
            case RegistrationDone():
                self._on_registered(event)
            case ConfigSourceChanged():
                self._apply_config()
            case ConfigChecked(generation=generation, check=check):
                if self._check_worker is not None and generation == self._check_worker.generation:
                    self._config_check, force, self._config_force = check, self._config_force, False
                    self._apply_config(force=force)  # else a newer change is being checked: this one is stale
            case NodeLabelChanged(key=key, value=value) if key == CONFIG_LABEL:
                if value != self._node.config_label:
                    log.info("node label changed key=%s value=%s", key, value)
                    self._node.config_label = value
                    self._apply_config()
            case NodeLabelChanged(key=key, value=value) if key == MIG_CONFIG_LABEL:
                if value != self._node.mig_label:
                    log.info("node label changed key=%s value=%s", key, value)
                    self._node.mig_label = value
                    self._update_mig()
            case NodeLabelChanged():
                pass
            case NodeAnnotationChanged(key=key, value=value) if key in CORDON_ANNOTATIONS:
                if self._node.on_annotation(key, value, self._inventory):
                    self._publish()
            case _ if type(event).__module__ in self._routes:  # a feature's own news (MPS, MIG, DRA)
                self._act(self._routes[type(event).__module__](event, self._clock()))
            case _:
                log.error("unknown event %r", event)

    def _tick(self) -> None:
        now = self._clock()
        if self._resync_at is not None and now >= self._resync_at:
            self._resync()
        if self._rediscover_at is not None and now >= self._rediscover_at:
            self._rediscover("retry")
        if self._recheck_config_at is not None and now >= self._recheck_config_at:
            self._recheck_config_at = None
            self._apply_config(force=True)
        self._probe_faults(now)
        if self._mps is not None and self._mps.tick(now):
            self._publish()
        if self._mig is not None and self._mig.tick(now):
            self._rediscover("MIG reset check", stale=self._mig.changing_uuids)
        if self._dra is not None and self._inventory is not None and self._dra.tick(now, self._inventory):
            self._publish()  # a GPU leaving DRA is free of claims: the device plugin offers it again
        if self._keeper.liveness_due(now):
            self._check_liveness(now)
        self._supervise_watchers(now)
        if not self._plugin_dir_ready():
            if self._settling:
                self._settle()  # nothing to register with: metrics and health say why
            return
        self._servers.serve_missing(now)
        self._registrations.start_due(self._servers.servers)
        if self._settling and ((self._kubelet_known and self._kubelet_served()) or now >= self._settle_by):
            self._settle()

    def _kubelet_served(self) -> bool:
        """The kubelet has what it needs from us: every resource is watched (ListAndWatch open) or failed to
        register. Metrics start only then, so importing and starting them does not hold the GIL while the
        kubelet's first ListAndWatch is answered (``served``)."""
        return self._registrations.served(self._servers.servers)

    def _on_stream_opened(self, resource: str) -> None:
        """Called on a gRPC thread: wake the loop only while what comes second waits for the kubelet."""
        if self._settling:
            self.post(StreamOpened(resource))

    def _plugin_dir_ready(self) -> bool:
        """The device-plugin directory exists; said once when it does not, and once when it appears."""
        present = self.options.device_plugin_dir.is_dir()
        if present and self._lock is None:
            self._take_lock()
        if present != self._plugin_dir_present:
            self._plugin_dir_present = present
            if present:
                log.info("device-plugin directory is there path=%s", self.options.device_plugin_dir)
            else:
                log.error(
                    "device-plugin directory does not exist path=%s fix='mount the kubelet device-plugin "
                    "directory (hostPath /var/lib/kubelet/device-plugins) or pass --device-plugin-dir'; waiting",
                    self.options.device_plugin_dir,
                )
        return present

    # ----- config ---------------------------------------------------------------------------------

    def _overrides(self) -> FlagOverrides:
        """The explicit settings: from flags (``options.overrides``), or set directly by an embedding caller."""
        given, explicit = self.options.overrides, self.options.allocation
        if self.options.mig_strategy is not None:
            given = replace(given, mig_strategy=str(self.options.mig_strategy))
        if explicit is not None:
            given = replace(
                given,
                device_list_strategy=tuple(str(s) for s in explicit.strategies),
                allocation_policy=str(explicit.policy),
                cdi_kind=explicit.cdi_kind,
            )
        if self.options.node_wide_cdi and given.cdi_kind in (None, DEFAULT_CDI_KIND):  # nvidia-ctk's names then
            given = replace(given, cdi_kind=NODE_WIDE_CDI_KIND)
        return given

    def _apply_config(self, *, force: bool = False) -> None:
        """Load the config for this node; apply it if it is valid here, else keep the last good one.

        Whatever a config does to the loader — even an exception nobody foresaw — rejects that config and
        nothing else: the last good one stays in force.
        """
        assert self._inventory is not None
        try:
            loaded = self._load_config()
            if loaded is None:  # being checked off the loop: ConfigChecked applies it
                self._config_force = self._config_force or force
                return
            same = self._loaded is not None and (loaded.name, loaded.digest) == (self._loaded.name, self._loaded.digest)
            if same and not force:
                return  # same config: nothing to do
            chosen = effective(loaded.model, self._overrides())
            new_plan = plan(chosen.plan, self._inventory)
            if loaded.model.dra is not None and loaded.model.dra.enabled:  # before the front end (re-)prepares its
                self._guarded("memory limits", self._load_memory_limits, True)  # claims: what holds shares is known
            self._configure_dra(loaded.model.dra)  # a PlanError when dra.gpus names GPUs this node lacks
        except Exception as error:
            if not isinstance(error, ConfigError | PlanError):
                self._internal_error("config", error)
            if isinstance(error, CheckerFailed):  # not the config's fault: check its files again later
                self._recheck_config_at = self._clock() + self._recheck_config_backoff.next_delay()
            message = str(error) or type(error).__name__
            if message != self._config_error:
                self._config_errors += 1
                kept = f"keeping config {self._loaded.name!r}" if self._loaded else "advertising nothing until fixed"
                log.error("config rejected; %s error=%r", kept, message)
            self._config_error = message
            self._refresh_status()
            return
        for warning in (*loaded.warnings, *new_plan.warnings):
            if warning not in self._said:
                self._said.add(warning)
                log.warning("config: %s", warning)
        log.info(
            "config applied name=%s reason=%r resources=%s",
            loaded.name,
            loaded.reason,
            ",".join(r.name for r in new_plan.resources) or "none",
        )
        self._loaded, self._effective, self._plan, self._config_error = loaded, chosen, new_plan, None
        self._guarded("memory limits", self._load_memory_limits)  # a plan that sizes replicas: before any status
        self._recheck_config_backoff.reset()
        self._policy = self.options.health.with_config_overrides(chosen.health_overrides)
        self._reconcile_mps(new_plan, Path(chosen.allocation.mps_root))
        self._update_mig(publish=False)
        self._publish()  # also when nothing was served before (an agent that started on a bad config)

    # ----- MIG layout ------------------------------------------------------------------------------

    def _update_mig(self, *, publish: bool = True) -> None:
        """The layout this node wants (``agent.mig.selection``), minus DRA's GPUs, to the MIG manager."""
        assert self._inventory is not None
        section = self._loaded.model.mig_layout if self._loaded else None
        if self._mig is None or self._layouts is None:
            if self.options.mig_config is None and (section is None or section.layouts is None):
                self._refresh_status()
                return  # no layout was ever configured: MIG is left as it is, its manager not even loaded
            from agent.mig.manager import MigManager
            from agent.mig.selection import LayoutSelection

            self._mig = MigManager(self.post, self._ledger)
            self._layouts = LayoutSelection(self.options.mig_config, self.options.mig_config_name)
            self._routes["agent.mig.manager"] = self._mig.on_event
        from agent.core.mig_layout import LayoutError

        before = self._mig.withdrawn
        try:
            layouts = self._layouts.desired(section, self._inventory.gpus, self._node.mig_label)
        except LayoutError as error:
            self._mig.fail(str(error))
        else:
            if layouts and self._dra is not None:
                dra = self._dra.dra_indices(self._inventory)
                layouts = self._layouts.leaving_alone(layouts, dra, self._dra.dynamic_mig_indices(self._inventory))
            self._mig.desire(layouts, self._inventory, self._clock())
        if publish and self._mig.withdrawn != before:
            self._publish()
        else:
            self._refresh_status()

    def _rediscover(self, reason: str, *, stale: frozenset[str] = frozenset()) -> None:
        """The node's devices may be different (a MIG change, a reset, a GPU back, a retry): read them again,
        plan and advertise. Until a read succeeds, the GPUs in ``stale`` are withdrawn: a device that may
        not exist is never advertised."""
        if self._read_inventory(reason, stale):
            try:
                self._plan = plan(self._effective.plan, self._inventory)
                self._guarded("memory limits", self._load_memory_limits)  # GPUs back may bring sized replicas
            except PlanError as error:
                log.error("the node's devices do not fit the config; advertising nothing error=%r", str(error))
                self._plan = ResourcePlan((), self._plan.mig_strategy if self._plan else MigStrategy.NONE)
            self._reconcile_mps(self._plan, Path(self._effective.allocation.mps_root))
            self._update_mig(publish=False)
            try:
                self._configure_dra(self._loaded.model.dra if self._loaded else None)
            except PlanError as error:  # a GPU named by dra.gpus is gone: DRA keeps what it serves
                log.error("the node's GPUs do not fit dra.gpus error=%r", str(error))
        self._publish()

    def _configure_dra(self, section: DraSection | None) -> None:
        """The config's ``dra`` section; the DRA manager (and the front end with it) loads on first use."""
        assert self._inventory is not None
        enabled = section is not None and section.enabled
        if self._dra is None:
            if not enabled:
                return
            from agent.dra.manager import DraManager

            self._dra = DraManager(
                self._dra_settings,
                lambda: self._node.api.api_client if self._node.api is not None else None,
                self.post,
                self.options.pod_resources_socket,
                self._ledger,
            )
            self._routes["agent.dra.types"] = self._dra.on_event
        driver = section.driver_name if section is not None else "gpu.nvidia.com"
        self._dra.configure(
            enabled,
            driver,
            section.gpus if section else None,
            self._inventory,
            self._clock(),
            dynamic_mig=section.dynamic_mig if section else None,
            gpu_shares=section.shared_gpus if section else None,
            default_share=section.default_share if section else None,
            share_mode=section.share_mode if section else "memory",
        )

    def _dra_settings(self, driver: str) -> DraSettings:
        from agent.dra.types import DraSettings

        return DraSettings(
            driver=driver,
            node_name=self.options.node_name or "",
            registry_dir=self.options.dra_registry_dir,
            plugins_dir=self.options.dra_plugins_dir,
            cdi_root=self.options.cdi_root,
            sys_root=self.options.sys_root,
            nvidia_smi=self.options.nvidia_smi,
            pod_uid=self.options.pod_uid,
            cdi_kind=self._effective.allocation.cdi_kind,
            node_wide_cdi=self.options.node_wide_cdi,
            driver_root=self.options.driver_root,
            mps_root=self._effective.allocation.mps_root,
            latency=self._latency,
            memory_limits=self.options.memory_limits is not None,
        )

    def _read_inventory(self, reason: str, stale: frozenset[str] = frozenset()) -> bool:
        """Read the GPUs from NVML; on failure keep the last inventory (minus ``stale`` GPUs) and retry with
        backoff. A GPU that failed to answer is retried the same way until it joins."""
        self._stale_gpus |= stale
        try:
            inventory = discover()
        except Exception as error:  # NvmlUnavailable, DiscoveryError, or anything else a driver does
            delay = self._rediscover_backoff.next_delay()
            self._rediscover_at = self._clock() + delay
            message = str(error) or type(error).__name__
            if message != self._discovery_error:
                log.error(
                    "cannot read the GPUs reason=%s retry_in=%.1fs withdrawn=%s error=%r",
                    reason, delay, ",".join(sorted(self._stale_gpus)) or "none", message,
                )  # fmt: skip
            self._discovery_error = message
            self._refresh_status()
            return False
        inventory, unanswered = keep_unanswered(inventory, self._inventory)
        self._ledger.inventory = inventory
        before = {g.uuid for g in self._gpus()}
        lost = [uuid for uuid, failure in unanswered.items() if failure.error == "GPU_IS_LOST"]
        unreadable = frozenset(unanswered) - set(lost)  # withdrawn until a read succeeds
        self._inventory, self._stale_gpus, self._discovery_error = inventory, unreadable, None
        after = {g.uuid for g in inventory.gpus}
        if after != before or reason == "start":
            log.info(
                "discovered reason=%s gpus=%d joined=%s left=%s failed=%d driver=%s",
                reason, len(after), ",".join(sorted(after - before)) or "-", ",".join(sorted(before - after)) or "-",
                len(inventory.failures), inventory.driver_version,
            )  # fmt: skip
        self._health = _without_vanished_mig_faults(self._health, inventory)
        self._record_lost([uuid for uuid in lost if uuid not in self._health.faults])  # before its XID 79 arrives
        self._node.recut_cordon(inventory)  # indices and MIG UUIDs may name other devices now
        if inventory.failures:
            delay = self._rediscover_backoff.next_delay()
            self._rediscover_at = self._clock() + delay
            said = "; ".join(map(str, inventory.failures))
            if said not in self._said:
                self._said.add(said)
                log.warning("GPUs did not answer; trying again retry_in=%.1fs failures=%r", delay, said)
        else:
            self._rediscover_backoff.reset()
            self._rediscover_at = None
        if after != before and self._event_watcher is not None:
            self._event_watcher.set_gpus([g.uuid for g in inventory.gpus])
        return True

    def _load_config(self) -> LoadedConfig | None:
        """This node's config from the last check of its files (PyYAML and the schema stay out of this process); None
        when the files changed since: once the agent runs, their check runs off the loop and ``ConfigChecked``
        brings it (the start waits for its own, before the first advertise)."""
        path = self.options.config_path
        if path is None:
            return LoadedConfig(None, ConfigModel(), (), "", "no --config given")
        check, now = self._config_check, stamp(path)
        if check is None or check.stamp != now:
            if self._check_worker is not None:
                self._check_worker.request(path, now)
                return None
            check = self._config_check = Check(path)
        try:
            checked = check.result()
        except ConfigError:
            self._config_check = None  # not kept: the next try runs the checker again
            raise
        return checked.choose(self.options.config_name, self._node.config_label, [g.name for g in self._gpus()])

    # ----- health ---------------------------------------------------------------------------------

    @property
    def _health(self) -> HealthState:
        """Device health, as the health room keeps it (``_publish`` reads it, a read of the node prunes it)."""
        return self._keeper.state

    @_health.setter
    def _health(self, state: HealthState) -> None:
        self._keeper.state = state

    @property
    def _policy(self) -> HealthPolicy:
        return self._keeper.policy

    @_policy.setter
    def _policy(self, policy: HealthPolicy) -> None:  # a config's health.xids
        self._keeper.policy = policy

    def _on_xid(self, event: XidEvent) -> None:
        units = self._keeper.on_xid(event, self._inventory)
        if not units:
            self._refresh_status()  # the count
            return
        try:
            self._publish()  # the kubelet first; then the log, and what recovery will be judged against (an NVML read)
        finally:
            self._keeper.say_xid(event, units)
        if self._keeper.take_ecc_baseline(event, units):
            self._refresh_status()

    def _on_watch_restored(self, gpu_uuid: str) -> None:
        self._act(self._keeper.on_watch_restored(gpu_uuid))

    def _probe_faults(self, now: float) -> None:
        self._act(self._keeper.probe(now, self._gpus(), self._event_watcher))

    def _act(self, news: News) -> None:
        """What a room asked for, strongest first. A GPU back from the bus may come back changed (a reset loses
        its MIG instances): it is read again before anything of it is advertised."""
        if news.mps and self._plan is not None:  # DRA's claims need other MPS daemons
            self._reconcile_mps(self._plan, Path(self._effective.allocation.mps_root))
        if news.dra_mps:
            self._tell_dra_mps()
        if news.reread is not None:
            self._rediscover(news.reread, stale=news.stale)
        elif news.publish:
            self._publish()
        elif news.status:
            self._refresh_status()

    def _check_liveness(self, now: float) -> None:
        """Catch what no event reaches us for: a GPU that fell off the bus, MIG devices a reset or a hand changed."""
        if self._keeper.find_lost(self._gpus()):
            self._publish()
        self._check_mig_devices()

    def _record_lost(self, uuids: list[str]) -> None:
        self._keeper.record_lost(uuids)

    def _check_mig_devices(self) -> None:
        """Read the node again when a GPU's MIG mode or MIG devices are not what the inventory says: vanished devices
        leave ListAndWatch, a layout the config wants is made again once nothing runs there, a DRA claim whose MIG
        device is gone is reported. One caught while the agent's own MIG change is under way costs a read the change
        makes anyway."""
        differ = self._mig_recheck.differing(self._gpus())
        if differ:
            log.info(
                "MIG devices differ from the inventory gpus=%s (a GPU reset or a change by hand); reading them again",
                ",".join(sorted(differ)),
            )
            self._rediscover("MIG devices changed", stale=differ)

    def _gpus(self) -> tuple:
        return self._inventory.gpus if self._inventory else ()

    # ----- serving --------------------------------------------------------------------------------

    def _publish(self) -> None:
        """Recompute every resource's snapshot and apply the difference to the running servers."""
        assert self._plan is not None and self._inventory is not None
        # Withdrawn devices leave ListAndWatch first: those a MIG change or an MPS daemon's retirement will
        # disturb, and every device of a GPU whose inventory could not be read again.
        stale = {d.physical_id for r in self._plan.resources for d in r.devices if d.gpu_uuid in self._stale_gpus}
        if self._dra is not None and self._dra.settle(self._inventory) and self._mig is not None:
            self._update_mig(publish=False)  # a GPU DRA let go of is the device plugin's again: its layout too
        dra = self._dra.withdrawn(self._inventory) if self._dra else frozenset()  # one front end per GPU
        mig = self._mig.withdrawn if self._mig is not None else frozenset()
        mps = self._mps.withdrawn() if self._mps is not None else frozenset()
        visible = self._plan.without(mig | mps | stale | dra)
        if self._dra is not None:
            self._dra.publish(self._inventory, self._health, self._node.cordon.units, self._stale_gpus)
        allocation = self._effective.allocation
        if self.options.memory_limits is not None:
            allocation = replace(allocation, memory_envs=True)  # sized replicas get the toolkit hook's variables
        snapshots = build_snapshots(
            visible,
            self._health,
            self._inventory,
            allocation,
            unavailable=self._mps.unavailable() if self._mps is not None else frozenset(),
            cordoned=self._node.cordon.units,
            previous=self._snapshots,
        )
        snapshots = {
            name: snapshot
            for name, snapshot in snapshots.items()
            if snapshot.sharing is not Sharing.MPS or (self._mps is not None and self._mps.advertised(name))
            # an MPS resource is advertised once its daemons have their limits in place, then clients connect
        }
        snapshots = self._refresh_cdi(snapshots)  # the names Allocate returns resolve before the kubelet hears them
        changed = self._servers.apply(snapshots)
        self._snapshots = snapshots
        before = self._set_status()  # what `tessera status` says never lags what the kubelet hears
        updated = [server for server, snapshot in changed if server.update(snapshot, wake=False)]
        if updated:
            send_updates(updated)  # the kubelet next: the events, logs and NVML reads that follow come after
        for server in self._servers.servers.values():
            server.prepare()  # what Allocate answers from, once the kubelet has the listing
        self._node.announce(before, self.status)
        if self._memlimits is not None:
            self._memlimits.plan_published(self._plan)  # a resized replica reaches running containers now

    def _refresh_cdi(self, snapshots: dict[str, ResourceSnapshot]) -> dict[str, ResourceSnapshot]:
        """With a cdi-* strategy, the device plugin's CDI spec holds exactly the advertised devices; where it
        cannot be written (no driver found), Allocate refuses with the reason rather than hand out names that do
        not resolve."""
        allocation = self._effective.allocation
        cdi = {DeviceListStrategy.CDI_CRI, DeviceListStrategy.CDI_ANNOTATIONS}
        if self.options.node_wide_cdi or not cdi.intersection(allocation.strategies) or self._inventory is None:
            return snapshots
        if self._plugin_cdi is None:
            from agent.plugin.cdi_spec import DevicePluginCdi

            self._plugin_cdi = DevicePluginCdi(self.options.cdi_root, self.options.driver_root)
        if self._plugin_cdi.refresh(allocation.cdi_kind, self._inventory, snapshots) is not None:
            return snapshots
        unavailable = replace(allocation, cdi_unavailable=self._plugin_cdi.error)
        return {name: s.with_options(unavailable) for name, s in snapshots.items()}

    # ----- registration ---------------------------------------------------------------------------

    def _on_kubelet(self, present: bool) -> None:
        self._kubelet_known = True
        if present:
            due = self._registrations.kubelet_up()
            log.info("kubelet is up socket=%s; registering %d resources", self.options.kubelet_socket, due)
        else:
            self._registrations.kubelet_gone()
            log.warning("waiting for the kubelet socket=%s", self.options.kubelet_socket)
        self._refresh_status()

    def _want_registration(self, name: str, *, delay: float = 0.0, unless_watched: bool = False) -> None:
        """A reason to register ``name`` (a closed stream: ``unless_watched``), weighed when it comes due."""
        self._registrations.want(name, self._clock() + delay, unless_watched=unless_watched)

    def _on_worker_crashed(self, event: WorkerCrashed) -> None:
        """A worker job raised past its own guard: counted, and its owner treats it as a failed attempt."""
        self._internal_error(f"worker:{event.owner}", RuntimeError(event.error), context=event.key)
        now = self._clock()
        if event.owner == "mig" and self._mig is not None:
            self._mig.on_crashed(event, now)
            self._rediscover("MIG worker crash", stale=self._mig.changing_uuids)
        elif event.owner == "mps" and self._mps is not None:
            if self._mps.on_crashed(event, now):
                self._publish()
        elif event.owner == "dra" and self._dra is not None:
            self._dra.on_crashed(event.key, now)

    def _supervise_watchers(self, now: float) -> None:
        """A watcher thread that died is noticed here and started again (counted, said once per death)."""
        for name in ("_event_watcher", "_kubelet_watcher", "_config_watcher"):
            watcher = getattr(self, name)
            if watcher is None or watcher.alive():
                continue
            self._internal_error("thread", RuntimeError(f"{name.strip('_')} thread died"), context=name.strip("_"))
            setattr(self, name, self._new_watcher(name))

    def _new_watcher(self, name: str) -> NvmlEventWatcher | PluginDirWatcher | ConfigWatcher:
        watcher: NvmlEventWatcher | PluginDirWatcher | ConfigWatcher
        if name == "_event_watcher":
            watcher = NvmlEventWatcher(
                [g.uuid for g in self._gpus()], self.post, wait_ms=self.options.health_event_wait_ms
            )
        elif name == "_kubelet_watcher":
            watcher = PluginDirWatcher(self.options.device_plugin_dir, self.post)
        else:
            assert self.options.config_path is not None
            watcher = ConfigWatcher(self.options.config_path, self.post)
            self.post(ConfigSourceChanged())  # a change may have been missed while it was dead
        watcher.start()
        return watcher

    def _on_registered(self, done: RegistrationDone) -> None:
        self._registrations.on_done(done)
        self._refresh_status()

    def _refresh_status(self) -> None:
        before = self._set_status()
        self._node.announce(before, self.status)

    def _set_status(self) -> AgentStatus:
        """Build the status from the state now (it is one attribute: readers see the old one or the new one);
        returns the one it replaced, for the Events it calls for (``NodeMetadata.announce``)."""
        before = self.status
        self.status = AgentStatus(
            resources=dict(self._snapshots),
            registered=self._registrations.registered(),
            kubelet_present=self._registrations.kubelet_present,
            config_name=self._loaded.name if self._loaded else None,
            config_digest=self._loaded.digest if self._loaded else None,
            config_error=self._config_error,
            mps=self._mps.status() if self._mps is not None else {},
            mig_state=str(self._mig.state) if self._mig is not None and self._mig.state else None,
            mig_error=self._mig.error if self._mig is not None else None,
            inventory=self._inventory,
            plan=self._plan,
            config_errors_total=self._config_errors,
            xid_counts=dict(self._keeper.xid_counts),
            internal_errors=dict(self._internal_errors),
            waiting_for=self._waiting_for(),
            stale_gpus=self._stale_gpus,
            discovery_error=self._discovery_error,
            faults=self._health.faults,
            cordoned=self._node.cordon.sources,
            cordon_problems=self._node.cordon.problems,
            dra=self._dra.status(self._memlimits.driver_report() if self._memlimits else None) if self._dra else None,
            memory_limits=self._memlimits.snapshot() if self._memlimits is not None else (),
        )
        return before

    def _reconcile_mps(self, resource_plan: ResourcePlan, root: Path) -> None:
        """One MPS manager for both front ends: the device plugin's MPS resources and the DRA claims' daemons."""
        specs: tuple[MpsDaemonSpec, ...] = (*mps_daemons(resource_plan), *(self._dra.mps_specs() if self._dra else ()))
        if self._mps is None and specs:  # the first daemon ever wanted: the manager loads now
            from agent.mps.manager import MpsManager

            options = self.options
            self._mps = MpsManager(options.mps_control, self.post, self._ledger, options.mps_keeper)
            self._routes["agent.mps.manager"] = self._routes["agent.mps.exits"] = self._mps.on_event
        if self._mps is not None:
            self._mps.reconcile(specs, root, self._clock())
        self._tell_dra_mps()

    def _tell_dra_mps(self) -> None:
        if self._dra is not None:
            status = self._mps.status() if self._mps is not None else {}
            self._dra.mps_changed(status, self._effective.allocation.mps_root)

    def _waiting_for(self) -> dict[str, tuple[str, ...]]:
        waiting = {f"mps:{key}": why for key, why in self._mps.waiting_for().items()} if self._mps is not None else {}
        if self._dra is not None:
            waiting |= {f"dra:{uuid}": why for uuid, why in self._dra.waiting_for().items()}
        if self._mig is not None and self._mig.waiting_for:
            waiting["mig"] = self._mig.waiting_for
        return waiting


def _without_vanished_mig_faults(health: HealthState, inventory: Inventory) -> HealthState:
    """Faults of MIG devices that no longer exist go with them (a GPU's own fault stays: it may come back)."""
    existing = {m.uuid for g in inventory.gpus for m in g.mig_devices}
    kept = {u: f for u, f in health.faults.items() if not u.startswith("MIG-") or u in existing}
    return health if len(kept) == len(health.faults) else HealthState(kept)
