"""Metrics: collected on their own interval in the background; a scrape serves the last collection.

A scrape never calls NVML or the kubelet: it only renders the families the collection thread built. One
failing GPU never breaks a collection (its series carry no numbers, ``tessera_gpu_up`` says 0), a missing
PodResources socket or unreadable /proc gives metrics without pod labels and one warning.

Label names follow dcgm-exporter's where they overlap (``gpu``, ``UUID``, ``modelName``, ``Hostname``,
``GPU_I_PROFILE``, ``GPU_I_ID``, ``pod``, ``namespace``, ``container``) so dashboards and alerts carry
over; ``resource`` and ``device_id`` name Tessera's advertised devices, replicas included.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

from agent.gpu.telemetry import GpuStats, read_stats
from agent.plugin.podresources import DeviceHolder as Holder
from agent.telemetry.attribution import devices_by_pod_uid, pod_uid_of

log = logging.getLogger(__name__)

MIG_STATES = ("pending", "applying", "success", "failed", "reset-required")


@dataclass(frozen=True, slots=True)
class TelemetryOptions:
    hostname: str
    interval: float = 10.0
    idle_threshold_percent: float = 5.0
    proc_root: Path = Path("/proc")
    device_plugin_dir: Path = Path("/var/lib/kubelet/device-plugins")
    pod_resources_socket: Path = Path("/var/lib/kubelet/pod-resources/kubelet.sock")


class LastCollection(Collector):
    """What ``/metrics`` serves: the last collection, rendered once when it is made, swapped in whole.

    Rendering thousands of series costs milliseconds; done once per collection instead of once per
    scrape, a scrape is a copy of bytes.
    """

    def __init__(self) -> None:
        self.families: list[Metric] = []
        self.rendered: bytes = b""
        self.collected_at: float | None = None

    def collect(self) -> Iterable[Metric]:
        return list(self.families)

    def publish(self, families: list[Metric]) -> None:
        registry = CollectorRegistry(auto_describe=False)
        self.families = families
        registry.register(self)
        self.rendered = generate_latest(registry)
        self.collected_at = time.time()


class TelemetryCollector:
    """The collection thread. ``status`` gives the agent's latest immutable status."""

    def __init__(
        self,
        options: TelemetryOptions,
        status: Callable[[], object],
        holders: Callable[[], dict[str, Holder]],
        on_collected: Callable[[object], None] = lambda status: None,
    ) -> None:
        self.options = options
        self.last = LastCollection()
        self._status = status
        self._holders = holders
        self._on_collected = on_collected
        self._idle_seconds: dict[tuple[str, ...], float] = defaultdict(float)
        self._last_collection: float | None = None  # monotonic time of the previous collection
        self._warned: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="telemetry", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

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
        if inventory is not None:
            try:
                stats = read_stats(inventory)
            except Exception as error:  # NVML gone entirely: report the GPUs as down, keep the rest
                self._warn_once("nvml", f"cannot read GPU telemetry error={error!r}")
        try:
            holders = self._holders()
        except Exception as error:
            self._warn_once("podresources", f"metrics without pod labels: cannot read PodResources error={error!r}")
            holders = {}
        now = time.monotonic()
        elapsed = 0.0 if self._last_collection is None else now - self._last_collection
        self._last_collection = now
        families = self._families(status, stats, holders, elapsed)
        self.last.publish(families)
        self._on_collected(status)

    # ----- building the families ----------------------------------------------------------------------

    def _families(
        self, status: object, stats: dict[str, GpuStats], holders: dict[str, Holder], elapsed: float
    ) -> list[Metric]:
        """``elapsed``: seconds since the previous collection, credited to the devices that are idle now."""
        host = self.options.hostname
        inventory = getattr(status, "inventory", None)
        gpus = inventory.gpus if inventory is not None else ()
        gpu_labels = ["gpu", "UUID", "modelName", "Hostname"]

        up = GaugeMetricFamily("tessera_gpu_up", "1 when NVML answers for the GPU, else 0", labels=gpu_labels)
        mem_total = GaugeMetricFamily("tessera_gpu_memory_total_bytes", "GPU memory", labels=gpu_labels)
        mem_used = GaugeMetricFamily("tessera_gpu_memory_used_bytes", "GPU memory in use", labels=gpu_labels)
        util = GaugeMetricFamily(
            "tessera_gpu_utilization_percent",
            "GPU utilization; absent on MIG-enabled GPUs, where the driver does not report it",
            labels=gpu_labels,
        )
        procs = GaugeMetricFamily("tessera_gpu_processes", "processes on the GPU", labels=gpu_labels)
        mig_labels = ["gpu", "UUID", "modelName", "GPU_I_PROFILE", "GPU_I_ID", "device_id", "Hostname"]
        mig_total = GaugeMetricFamily("tessera_mig_memory_total_bytes", "MIG device memory", labels=mig_labels)
        mig_used = GaugeMetricFamily("tessera_mig_memory_used_bytes", "MIG device memory in use", labels=mig_labels)
        mig_procs = GaugeMetricFamily("tessera_mig_processes", "processes on the MIG device", labels=mig_labels)
        for gpu in gpus:
            base = [str(gpu.index), gpu.uuid, gpu.name, host]
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
                labels = [str(gpu.index), gpu.uuid, gpu.name, mig.profile, str(mig.gi_id), mig.uuid, host]
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
        healthy = GaugeMetricFamily(
            "tessera_device_healthy", "1 when the advertised device is Healthy", labels=device_labels
        )
        allocated = GaugeMetricFamily("tessera_device_allocated", "1 when a pod holds the device", labels=device_labels)
        idle = CounterMetricFamily(
            "tessera_partition_allocated_idle_seconds",
            "seconds a pod held the device while it stayed under the idle threshold (allocated but idle)",
            labels=["resource", "device_id", "gpu", "UUID", "pod", "namespace", "container", "Hostname"],
        )
        resource_devices = GaugeMetricFamily(
            "tessera_resource_devices", "devices of a resource by state", labels=["resource", "state", "Hostname"]
        )
        registered = GaugeMetricFamily(
            "tessera_resource_registered",
            "1 when the resource is registered with the kubelet",
            labels=["resource", "Hostname"],
        )
        resources = getattr(status, "resources", {})
        registered_names = getattr(status, "registered", frozenset())
        held_now: set[tuple[str, ...]] = set()
        for name, snapshot in sorted(resources.items()):
            counts = {"total": 0, "healthy": 0, "allocated": 0}
            for device in snapshot.devices:
                holder = holders.get(device.id)
                who = [holder.pod, holder.namespace, holder.container] if holder else ["", "", ""]
                labels = [name, device.id, str(device.gpu_index), device.gpu_uuid, device.mig_profile or "", *who, host]
                is_healthy = snapshot.health.get(device.id, False)
                healthy.add_metric(labels, 1 if is_healthy else 0)
                allocated.add_metric(labels, 1 if holder else 0)
                counts["total"] += 1
                counts["healthy"] += int(is_healthy)
                counts["allocated"] += int(holder is not None)
                if holder is not None:
                    key = (name, device.id, str(device.gpu_index), device.gpu_uuid, *who, host)
                    held_now.add(key)
                    if self._is_idle(stats.get(device.gpu_uuid), device.mig_uuid):
                        self._idle_seconds[key] += elapsed
                    idle.add_metric(list(key), self._idle_seconds[key])
            for state, value in counts.items():
                resource_devices.add_metric([name, state, host], value)
            registered.add_metric([name, host], 1 if name in registered_names else 0)
        for gone in self._idle_seconds.keys() - held_now:  # a released device's series ends; its memory too
            del self._idle_seconds[gone]

        pod_memory = self._pod_memory(gpus, stats, holders, host)
        families: list[Metric] = [
            up, mem_total, mem_used, util, procs, mig_total, mig_used, mig_procs,
            healthy, allocated, idle, resource_devices, registered, pod_memory,
        ]  # fmt: skip
        families += self._agent_families(status, host)
        return families

    def _is_idle(self, stat: GpuStats | None, mig_uuid: str | None) -> bool:
        """Under the threshold; on a MIG device, where the driver gives no utilization, no process at all."""
        if stat is None or stat.gpu is None:
            return False
        if mig_uuid is not None:
            mig = stat.migs.get(mig_uuid)
            return mig is not None and not mig.processes
        if stat.gpu.utilization_percent is None:
            return not stat.gpu.processes
        return stat.gpu.utilization_percent < self.options.idle_threshold_percent

    def _pod_memory(
        self, gpus: Iterable[object], stats: dict[str, GpuStats], holders: dict[str, Holder], host: str
    ) -> Metric:
        family = GaugeMetricFamily(
            "tessera_pod_gpu_memory_used_bytes",
            "GPU memory used by a pod's processes, from the process's cgroup (works on shared GPUs)",
            labels=["gpu", "UUID", "modelName", "pod", "namespace", "container", "Hostname"],
        )
        devices_of_pod = devices_by_pod_uid(self.options.device_plugin_dir)
        if not devices_of_pod:
            return family
        totals: dict[tuple[str, ...], int] = defaultdict(int)
        for gpu in gpus:
            stat = stats.get(gpu.uuid)
            if stat is None or stat.gpu is None:
                continue
            for process in stat.gpu.processes:
                uid = pod_uid_of(process.pid, self.options.proc_root)
                if uid is None or process.used_bytes is None:
                    continue
                held = [holders[d] for d in devices_of_pod.get(uid, ()) if d in holders and d.split("::")[0] in (
                    gpu.uuid, *(m.uuid for m in gpu.mig_devices))]  # fmt: skip
                if not held:
                    continue
                who = held[0]
                containers = {h.container for h in held}
                container = who.container if len(containers) == 1 else ""
                totals[(str(gpu.index), gpu.uuid, gpu.name, who.pod, who.namespace, container, host)] += (
                    process.used_bytes
                )
        for labels, used in sorted(totals.items()):
            family.add_metric(list(labels), used)
        return family

    def _agent_families(self, status: object, host: str) -> list[Metric]:
        families: list[Metric] = []
        info = GaugeMetricFamily("tessera_config_info", "the config in force", labels=["name", "hash", "Hostname"])
        name = getattr(status, "config_name", None)
        digest = getattr(status, "config_digest", None) or ""
        info.add_metric([name or "", digest[:12], host], 1)
        valid = GaugeMetricFamily(
            "tessera_config_valid",
            "0 while the newest config is rejected (the last good one is in force)",
            labels=["Hostname"],
        )
        valid.add_metric([host], 0 if getattr(status, "config_error", None) else 1)
        errors = CounterMetricFamily(
            "tessera_config_reload_errors", "configs rejected since start", labels=["Hostname"]
        )
        errors.add_metric([host], getattr(status, "config_errors_total", 0))
        families += [info, valid, errors]

        mps_up = GaugeMetricFamily(
            "tessera_mps_daemon_up", "1 when the MPS daemon answers", labels=["resource", "daemon", "Hostname"]
        )
        mps_restarts = CounterMetricFamily(
            "tessera_mps_daemon_restarts",
            "MPS daemon restarts after it died",
            labels=["resource", "daemon", "Hostname"],
        )
        for key, daemon in sorted(getattr(status, "mps", {}).items()):
            labels = [str(daemon["resource"]), key, host]
            mps_up.add_metric(labels, 1 if daemon["state"] == "ready" else 0)
            mps_restarts.add_metric(labels, int(daemon["restarts"]))
        mps_limits = GaugeMetricFamily(
            "tessera_mps_active_thread_percentage",
            "per-client SM share of an MPS resource",
            labels=["resource", "Hostname"],
        )
        mps_memory = GaugeMetricFamily(
            "tessera_mps_pinned_memory_limit_bytes",
            "per-client pinned memory limit",
            labels=["resource", "UUID", "Hostname"],
        )
        for name_, snapshot in sorted(getattr(status, "resources", {}).items()):
            if snapshot.mps is None:
                continue
            mps_limits.add_metric([name_, host], snapshot.mps.active_thread_percentage)
            for device in {d.physical_id: d for d in snapshot.devices}.values():
                limit = snapshot.mps.memory_for(device.memory_mib, snapshot.replicas)
                mps_memory.add_metric([name_, device.physical_id, host], limit << 20)
        families += [mps_up, mps_restarts, mps_limits, mps_memory]

        mig_state = GaugeMetricFamily(
            "tessera_mig_config_state", "1 for the MIG layout manager's current state", labels=["state", "Hostname"]
        )
        current = getattr(status, "mig_state", None)
        if current is not None:
            for state in MIG_STATES:
                mig_state.add_metric([state, host], 1 if state == current else 0)
        families.append(mig_state)
        xids = CounterMetricFamily(
            "tessera_gpu_xid_errors", "XID events seen", labels=["gpu", "UUID", "xid", "Hostname"]
        )
        for (gpu, uuid, xid), count in sorted(getattr(status, "xid_counts", {}).items()):
            xids.add_metric([gpu, uuid, xid, host], count)
        families.append(xids)
        internal = CounterMetricFamily(
            "tessera_internal_errors",
            "unexpected exceptions the agent survived (logged once each; the step was retried)",
            labels=["where", "Hostname"],
        )
        for where, count in sorted(getattr(status, "internal_errors", {}).items()):
            internal.add_metric([where, host], count)
        waiting = GaugeMetricFamily(
            "tessera_drain_waiting",
            "reasons a disruptive operation (MIG change, MPS daemon retirement) is waiting for: pods, processes",
            labels=["operation", "Hostname"],
        )
        for operation, reasons in sorted(getattr(status, "waiting_for", {}).items()):
            waiting.add_metric([operation, host], len(reasons))
        stale = GaugeMetricFamily(
            "tessera_gpus_withdrawn",
            "GPUs whose devices are withdrawn until NVML can be read again",
            labels=["Hostname"],
        )
        stale.add_metric([host], len(getattr(status, "stale_gpus", ())))
        families += [internal, waiting, stale]
        return families
