"""Metrics: collected on their own interval in the background; a scrape serves the last collection.

A scrape never calls NVML or the kubelet: it only writes out the families the collection thread built (once
per collection, on the first scrape after it). One failing GPU never breaks a collection (its series carry no
numbers, ``tessera_gpu_up`` says 0), a missing PodResources socket or unreadable /proc gives metrics without pod
labels and one warning.

Label names follow dcgm-exporter's where they overlap (``gpu``, ``UUID``, ``modelName``, ``Hostname``,
``GPU_I_PROFILE``, ``GPU_I_ID``, ``pod``, ``namespace``, ``container``) so dashboards and alerts carry
over; ``resource`` and ``device_id`` name Tessera's advertised devices, replicas included.

A collection runs every 10 s on every GPU node for the agent's whole life, so what does not change between
two collections is not recomputed: the kubelet's checkpoint is parsed again only when it changed, a resource's
per-device labels are built once per snapshot, PodResources is asked only while the checkpoint says one of this
node's devices may be held or a DRA claim is prepared (the same List names the claim's pods), and nothing is
rendered for a node nobody scrapes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from msgspec import Struct

from agent.gpu.nvml import nvml_session
from agent.gpu.process_utilization import ProcessUtilization, UtilizationRead
from agent.gpu.telemetry import GpuStats, read_stats
from agent.plugin.podresources import ClaimDeviceKey, PodAllocations, PodName
from agent.plugin.podresources import DeviceHolder as Holder
from agent.telemetry import memory_limits
from agent.telemetry.attribution import Checkpoint, CheckpointReader
from agent.telemetry.dra_claims import ClaimDevice, KubeletClaimPods, PhysicalClaim, resolve
from agent.telemetry.exposition import Family, Renderer, counter, gauge
from agent.telemetry.latency import OperationLatency
from agent.telemetry.pods import HeldDevice, PodTelemetry
from agent.telemetry.procfs import boot_clock

if TYPE_CHECKING:
    from agent.core.snapshot import ResourceSnapshot

log = logging.getLogger(__name__)

MIG_STATES = ("pending", "applying", "success", "failed", "reset-required")
_NO_HOLDER = ("", "", "")


class TelemetryOptions(Struct, frozen=True):
    hostname: str
    interval: float = 10.0
    idle_threshold_percent: float = 5.0
    proc_root: Path = Path("/proc")
    device_plugin_dir: Path = Path("/var/lib/kubelet/device-plugins")
    pod_resources_socket: Path = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
    kubelet_dir: Path | None = None  # where the kubelet's DRA checkpoint is; None: the device plugin dir's parent


class LastCollection:
    """What ``/metrics`` serves: the last collection, swapped in whole, rendered on the first scrape after it.

    Rendering waits for a scrape: a node nobody scrapes never pays for it, and however often it is scraped a
    collection is rendered once (a scrape is then a copy of bytes).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._families: list[Family] = []
        self._rendered: bytes | None = b""
        self._renderer = Renderer()
        self.collected_at: float | None = None

    @property
    def families(self) -> list[Family]:
        return self._families

    @property
    def rendered(self) -> bytes:
        """The last collection in the Prometheus text format."""
        with self._lock:
            if self._rendered is None:
                self._rendered = self._renderer.render(self._families)
            return self._rendered

    def publish(self, families: list[Family]) -> None:
        with self._lock:
            self._families = families
            self._rendered = None
            self.collected_at = time.time()


class _DeviceRow(Struct, frozen=True):
    """A device's labels that come from its resource snapshot (the holder's are added per collection)."""

    device_id: str
    gpu_uuid: str
    mig_uuid: str | None
    memory_mib: int
    base: tuple[str, ...]  # resource, device_id, gpu, UUID, GPU_I_PROFILE
    idle_base: tuple[str, ...]  # resource, device_id, gpu, UUID
    unheld: tuple[str, ...]  # base + no holder + Hostname


class TelemetryCollector:
    """The collection thread. ``status`` gives the agent's latest immutable status."""

    def __init__(
        self,
        options: TelemetryOptions,
        status: Callable[[], object],
        holders: Callable[[], dict[str, Holder] | PodAllocations],
        on_collected: Callable[[object], None] = lambda status: None,
        latency: OperationLatency | None = None,
        claims: Callable[[], Sequence[ClaimDevice]] | None = None,
        memory_limits: Callable[[], Sequence[object]] | None = None,
    ) -> None:
        """``latency``: the kubelet-facing servers' timings, exposed with every collection; ``claims``: the devices
        of the DRA front end's prepared claims (``dra_claims.claim_devices`` of its checkpoint); ``holders``:
        PodResources' answer (``list_pod_resources``: devices and DRA claims' users), or its devices alone."""
        self.options = options
        self.latency = latency
        self._claims = claims
        self._memory_limits = memory_limits  # the memory-limits room's snapshot (per container and GPU)
        self._claim_pods = KubeletClaimPods(options.kubelet_dir or options.device_plugin_dir.parent)
        self.last = LastCollection()
        self._status = status
        self._holders = holders
        self._on_collected = on_collected
        self._checkpoint = CheckpointReader(options.device_plugin_dir)
        self._asked_kubelet = False
        self._rows: dict[str, tuple[ResourceSnapshot, list[_DeviceRow]]] = {}  # resource -> (snapshot, its rows)
        self.pods = PodTelemetry(options.proc_root, options.idle_threshold_percent, options.hostname)
        self._utilization = ProcessUtilization()
        self._last_collection: float | None = None  # monotonic time of the previous collection
        self._warned: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="telemetry", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(timeout=timeout)

    def _run(self) -> None:
        while True:
            started = time.monotonic()
            try:
                self.collect_once()
            except Exception:  # a collection bug must not kill metrics for good
                log.exception("metrics collection failed")
            if self._stop.wait(max(0.0, self.options.interval - (time.monotonic() - started))):
                return

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("%s", message)

    def collect_once(self) -> None:
        status = self._status()
        inventory = getattr(status, "inventory", None)
        stats: dict[str, GpuStats] = {}
        utilization: dict[str, UtilizationRead] = {}
        limits = self._memory_limits() if self._memory_limits is not None else ()
        limits_used: dict[tuple[str, str], int] = {}
        listed_at = boot_clock()  # a process that started after this is not one NVML is about to list
        if inventory is not None:
            try:
                with nvml_session():
                    stats = read_stats(inventory)
                    utilization = self._read_utilization(inventory, stats)
                    if limits:
                        limits_used = memory_limits.read_used(limits)
            except Exception as error:  # NVML gone entirely: report the GPUs as down, keep the rest
                self._warn_once("nvml", f"cannot read GPU telemetry error={error!r}")
        checkpoint = self._checkpoint.read()
        claims = self._prepared_claims(inventory)
        holders: dict[str, Holder] = {}
        users: dict[ClaimDeviceKey, frozenset[PodName]] | None = None
        if claims or self._may_be_held(status, checkpoint):  # a prepared claim: PodResources names its pods
            self._asked_kubelet = True
            try:
                answer = self._holders()
                if isinstance(answer, PodAllocations):
                    holders, users = answer.devices, answer.claims
                else:
                    holders = answer
            except Exception as error:
                self._warn_once("podresources", f"metrics without pod labels: cannot read PodResources error={error!r}")
        now = time.monotonic()
        elapsed = 0.0 if self._last_collection is None else now - self._last_collection
        self._last_collection = now
        families = self._families(status, stats, holders, elapsed, checkpoint, utilization, listed_at, claims, users)
        families += memory_limits.families(limits, limits_used, self.options.hostname)  # empty without the room
        self.last.publish(families)
        self._on_collected(status)

    def _read_utilization(self, inventory: object, stats: dict[str, GpuStats]) -> dict[str, UtilizationRead]:
        """Per-process utilization of the GPUs NVML reports it for (not in MIG mode) that run processes now."""
        whole = [gpu.uuid for gpu in inventory.gpus if not gpu.mig_enabled]  # type: ignore[attr-defined]
        self._utilization.forget(whole)
        busy = [uuid for uuid in whole if (stat := stats.get(uuid)) is not None and stat.gpu and stat.gpu.processes]
        self._utilization.idle(set(whole) - set(busy))
        return self._utilization.unsupported(whole) | self._utilization.read(busy)

    def _may_be_held(self, status: object, checkpoint: Checkpoint | None) -> bool:
        """Whether PodResources may name a pod holding one of this node's devices (then it is asked).

        The kubelet writes its checkpoint right after it allocates devices, before the pod's containers start,
        and PodResources reports only devices it has allocated, so a complete checkpoint without any of this
        node's devices (advertised IDs, or IDs on one of its GPUs or MIG devices) means PodResources has none
        either. Everything else asks: the first collection (a missing socket is reported at start, not at the
        first pod), a missing or unreadable checkpoint, entries of an unknown shape, any device of ours.
        Released pods stay in the checkpoint until the kubelet writes it again, which only asks more often.
        """
        if not self._asked_kubelet or checkpoint is None or not checkpoint.complete:
            return True
        allocated = checkpoint.device_ids()
        if not allocated:
            return False
        ours = _device_ids(status)
        return any(device in ours or device.split("::", 1)[0] in ours for device in allocated)

    # ----- building the families ----------------------------------------------------------------------

    def _families(
        self,
        status: object,
        stats: dict[str, GpuStats],
        holders: dict[str, Holder],
        elapsed: float,
        checkpoint: Checkpoint | None = None,
        utilization: dict[str, UtilizationRead] | None = None,
        listed_at: float | None = None,
        claims: Sequence[PhysicalClaim] = (),
        users: dict[ClaimDeviceKey, frozenset[PodName]] | None = None,
    ) -> list[Family]:
        """``elapsed``: seconds since the previous collection, credited to the devices that are idle now;
        ``listed_at``: the boot clock before NVML's process lists were read; ``claims``: the prepared DRA claims'
        devices; ``users``: which pods PodResources says use each claim device (None when not asked)."""
        host = self.options.hostname
        inventory = getattr(status, "inventory", None)
        gpus = inventory.gpus if inventory is not None else ()
        gpu_labels = ["gpu", "UUID", "modelName", "Hostname"]

        up = gauge("tessera_gpu_up", "1 when NVML answers for the GPU, else 0", gpu_labels)
        mem_total = gauge("tessera_gpu_memory_total_bytes", "GPU memory", gpu_labels)
        mem_used = gauge("tessera_gpu_memory_used_bytes", "GPU memory in use", gpu_labels)
        util = gauge(
            "tessera_gpu_utilization_percent",
            "GPU utilization; absent on MIG-enabled GPUs, where the driver does not report it",
            gpu_labels,
        )
        procs = gauge("tessera_gpu_processes", "processes on the GPU", gpu_labels)
        mig_labels = ["gpu", "UUID", "modelName", "GPU_I_PROFILE", "GPU_I_ID", "device_id", "Hostname"]
        mig_total = gauge("tessera_mig_memory_total_bytes", "MIG device memory", mig_labels)
        mig_used = gauge("tessera_mig_memory_used_bytes", "MIG device memory in use", mig_labels)
        mig_procs = gauge("tessera_mig_processes", "processes on the MIG device", mig_labels)
        for gpu in gpus:
            base = (str(gpu.index), gpu.uuid, gpu.name, host)
            stat = stats.get(gpu.uuid)
            up.add_metric(base, 0 if stat is None or stat.error else 1)
            if stat is None or stat.gpu is None:
                continue
            mem_total.add_metric(base, stat.gpu.memory_total_bytes)
            mem_used.add_metric(base, stat.gpu.memory_used_bytes)
            procs.add_metric(base, len(stat.gpu.processes))
            if stat.gpu.utilization_percent is not None:
                util.add_metric(base, stat.gpu.utilization_percent)
            for mig in gpu.mig_devices:
                mig_stat = stat.migs.get(mig.uuid)
                if mig_stat is None:
                    continue
                labels = (str(gpu.index), gpu.uuid, gpu.name, mig.profile, str(mig.gi_id), mig.uuid, host)
                mig_total.add_metric(labels, mig_stat.memory_total_bytes)
                mig_used.add_metric(labels, mig_stat.memory_used_bytes)
                mig_procs.add_metric(labels, len(mig_stat.processes))

        device_labels = [
            "resource",
            "device_id",
            "gpu",
            "UUID",
            "GPU_I_PROFILE",
            "pod",
            "namespace",
            "container",
            "Hostname",
        ]
        healthy = gauge("tessera_device_healthy", "1 when the advertised device is Healthy", device_labels)
        allocated = gauge("tessera_device_allocated", "1 when a pod holds the device", device_labels)
        resource_devices = gauge(
            "tessera_resource_devices", "devices of a resource by state", ["resource", "state", "Hostname"]
        )
        registered = gauge(
            "tessera_resource_registered",
            "1 when the resource is registered with the kubelet",
            ["resource", "Hostname"],
        )
        resources = getattr(status, "resources", {})
        registered_names = getattr(status, "registered", frozenset())
        held: list[HeldDevice] = []
        for name, snapshot in sorted(resources.items()):
            total = healthy_count = allocated_count = 0
            health = snapshot.health
            for row in self._device_rows(name, snapshot):
                holder = holders.get(row.device_id) if holders else None
                is_healthy = health.get(row.device_id, False)
                total += 1
                healthy_count += 1 if is_healthy else 0
                if holder is None:
                    healthy.add_metric(row.unheld, 1 if is_healthy else 0)
                    allocated.add_metric(row.unheld, 0)
                    continue
                allocated_count += 1
                who = (holder.pod, holder.namespace, holder.container)
                labels = (*row.base, *who, host)
                healthy.add_metric(labels, 1 if is_healthy else 0)
                allocated.add_metric(labels, 1)
                held.append(
                    HeldDevice(name, row.device_id, row.mig_uuid or row.gpu_uuid, (*row.idle_base, *who, host),
                               holder.namespace, holder.pod, holder.container, snapshot.replicas, row.memory_mib)
                )  # fmt: skip
            for state, value in (("total", total), ("healthy", healthy_count), ("allocated", allocated_count)):
                resource_devices.add_metric((name, state, host), value)
            registered.add_metric((name, host), 1 if name in registered_names else 0)
        for gone in self._rows.keys() - resources.keys():
            del self._rows[gone]

        devices_of_pod = checkpoint.devices_by_pod if checkpoint is not None else {}
        pod_families = self.pods.families(
            inventory, stats, utilization or {}, boot_clock() if listed_at is None else listed_at, held, holders,
            devices_of_pod, elapsed, claims, self._fallback_claim_pods(claims, users), users,
        )  # fmt: skip
        families: list[Family] = [
            up, mem_total, mem_used, util, procs, mig_total, mig_used, mig_procs,
            healthy, allocated, resource_devices, registered, self._pod_memory(gpus, held), *pod_families,
        ]  # fmt: skip
        families += self._agent_families(status, host)
        if self.latency is not None:
            families += self.latency.families(host)
        return families

    def _fallback_claim_pods(
        self, claims: Sequence[PhysicalClaim], users: dict[ClaimDeviceKey, frozenset[PodName]] | None
    ) -> dict[str, frozenset[str]] | None:
        """The kubelet's DRA checkpoint, read only while a prepared claim has a device PodResources names no user of
        (a kubelet without dynamic resources in PodResources; a DaemonSet does not mount the file)."""
        named = users or {}
        if not any((c.claim.namespace, c.claim.name, c.claim.pool, c.claim.device) not in named for c in claims):
            return None
        return self._claim_pods.pods()

    def _prepared_claims(self, inventory: object) -> list[PhysicalClaim]:
        if self._claims is None:
            return []
        try:
            return resolve(self._claims(), inventory)  # type: ignore[arg-type]
        except Exception as error:  # the DRA front end's value: whatever it is, metrics go on without claims
            self._warn_once("dra", f"metrics without DRA claims: cannot read the prepared claims error={error!r}")
            return []

    def _device_rows(self, name: str, snapshot: ResourceSnapshot) -> list[_DeviceRow]:
        """The snapshot's devices with their labels, built once per snapshot (snapshots are immutable)."""
        cached = self._rows.get(name)
        if cached is not None and cached[0] is snapshot:
            return cached[1]
        host = self.options.hostname
        rows = []
        for device in snapshot.devices:
            idle_base = (name, device.id, str(device.gpu_index), device.gpu_uuid)
            base = (*idle_base, device.mig_profile or "")
            unheld = (*base, *_NO_HOLDER, host)
            rows.append(
                _DeviceRow(device.id, device.gpu_uuid, device.mig_uuid, device.memory_mib, base, idle_base, unheld)
            )
        self._rows[name] = (snapshot, rows)
        return rows

    def _pod_memory(self, gpus: Iterable[object], held: list[HeldDevice]) -> Family:
        """Per-pod memory per GPU (MIG devices summed into their GPU), from this collection's attribution."""
        family = gauge(
            "tessera_pod_gpu_memory_used_bytes",
            "GPU memory used by a pod's processes, from the process's cgroup (works on shared GPUs)",
            ["gpu", "UUID", "modelName", "pod", "namespace", "container", "Hostname"],
        )
        attribution = self.pods.attribution
        if attribution is None or not attribution.by_holder:
            return family
        gpu_of: dict[str, object] = {}
        for gpu in gpus:
            gpu_of[gpu.uuid] = gpu  # type: ignore[attr-defined]
            gpu_of.update((mig.uuid, gpu) for mig in gpu.mig_devices)  # type: ignore[attr-defined]
        containers: dict[tuple[str, str, str], set[str]] = defaultdict(set)
        for device in held:
            gpu = gpu_of.get(device.physical_uuid)
            if gpu is not None:
                containers[(device.namespace, device.pod, gpu.uuid)].add(device.container)  # type: ignore[attr-defined]
        totals: dict[tuple[str, ...], int] = defaultdict(int)
        for (holder, uuid), usage in attribution.by_holder.items():
            gpu = gpu_of.get(uuid)
            if gpu is None or not usage.processes or len(holder) != 2:  # a pod's, not a DRA claim's
                continue
            namespace, pod = holder
            names = containers.get((namespace, pod, gpu.uuid), set())  # type: ignore[attr-defined]
            container = next(iter(names)) if len(names) == 1 else ""
            key = (str(gpu.index), gpu.uuid, gpu.name, pod, namespace, container, self.options.hostname)  # type: ignore[attr-defined]
            totals[key] += usage.memory_bytes
        for labels, used in sorted(totals.items()):
            family.add_metric(labels, used)
        return family

    def _agent_families(self, status: object, host: str) -> list[Family]:
        families: list[Family] = []
        info = gauge("tessera_config_info", "the config in force", ["name", "hash", "Hostname"])
        name = getattr(status, "config_name", None)
        digest = getattr(status, "config_digest", None) or ""
        info.add_metric((name or "", digest[:12], host), 1)
        valid = gauge(
            "tessera_config_valid",
            "0 while the newest config is rejected (the last good one is in force)",
            ["Hostname"],
        )
        valid.add_metric((host,), 0 if getattr(status, "config_error", None) else 1)
        errors = counter("tessera_config_reload_errors", "configs rejected since start", ["Hostname"])
        errors.add_metric((host,), getattr(status, "config_errors_total", 0))
        families += [info, valid, errors]

        mps_up = gauge("tessera_mps_daemon_up", "1 when the MPS daemon answers", ["resource", "daemon", "Hostname"])
        mps_restarts = counter(
            "tessera_mps_daemon_restarts",
            "MPS daemon restarts after it died",
            ["resource", "daemon", "Hostname"],
        )
        for key, daemon in sorted(getattr(status, "mps", {}).items()):
            labels = (str(daemon["resource"]), key, host)
            mps_up.add_metric(labels, 1 if daemon["state"] == "ready" else 0)
            mps_restarts.add_metric(labels, int(daemon["restarts"]))
        mps_limits = gauge(
            "tessera_mps_active_thread_percentage",
            "per-client SM share of an MPS resource",
            ["resource", "Hostname"],
        )
        mps_memory = gauge(
            "tessera_mps_pinned_memory_limit_bytes",
            "per-client pinned memory limit",
            ["resource", "UUID", "Hostname"],
        )
        for name_, snapshot in sorted(getattr(status, "resources", {}).items()):
            if snapshot.mps is None:
                continue
            mps_limits.add_metric((name_, host), snapshot.mps.active_thread_percentage)
            for device in {d.physical_id: d for d in snapshot.devices}.values():
                limit = snapshot.mps.memory_for(device.memory_mib, snapshot.replicas)
                mps_memory.add_metric((name_, device.physical_id, host), limit << 20)
        families += [mps_up, mps_restarts, mps_limits, mps_memory]

        mig_state = gauge(
            "tessera_mig_config_state", "1 for the MIG layout manager's current state", ["state", "Hostname"]
        )
        current = getattr(status, "mig_state", None)
        if current is not None:
            for state in MIG_STATES:
                mig_state.add_metric((state, host), 1 if state == current else 0)
        families.append(mig_state)
        xids = counter("tessera_gpu_xid_errors", "XID events seen", ["gpu", "UUID", "xid", "Hostname"])
        for (gpu, uuid, xid), count in sorted(getattr(status, "xid_counts", {}).items()):
            xids.add_metric((gpu, uuid, xid, host), count)
        families.append(xids)
        internal = counter(
            "tessera_internal_errors",
            "unexpected exceptions the agent survived (logged once each; the step was retried)",
            ["where", "Hostname"],
        )
        for where, count in sorted(getattr(status, "internal_errors", {}).items()):
            internal.add_metric((where, host), count)
        waiting = gauge(
            "tessera_drain_waiting",
            "reasons a disruptive operation (MIG change, MPS daemon retirement) is waiting for: pods, processes",
            ["operation", "Hostname"],
        )
        for operation, reasons in sorted(getattr(status, "waiting_for", {}).items()):
            waiting.add_metric((operation, host), len(reasons))
        stale = gauge(
            "tessera_gpus_withdrawn",
            "GPUs whose devices are withdrawn until NVML can be read again",
            ["Hostname"],
        )
        stale.add_metric((host,), len(getattr(status, "stale_gpus", ())))
        families += [internal, waiting, stale]
        return families


def _device_ids(status: object) -> set[str]:
    """Every ID a holder of this node's devices can be known by: advertised IDs, GPU and MIG UUIDs."""
    ids = {device.id for snapshot in getattr(status, "resources", {}).values() for device in snapshot.devices}
    inventory = getattr(status, "inventory", None)
    for gpu in inventory.gpus if inventory is not None else ():
        ids.add(gpu.uuid)
        ids.update(mig.uuid for mig in gpu.mig_devices)
    return ids
