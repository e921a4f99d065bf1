"""Telemetry for a running agent: the collection thread, the HTTP endpoint and the NFD feature file."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from msgspec import Struct

if TYPE_CHECKING:
    from agent.core.inventory import Inventory
    from agent.core.resources import ResourcePlan
    from agent.kube_api import CoreApi
    from agent.status import StatusSource
    from agent.telemetry.dra_claims import ClaimDevice
    from agent.telemetry.latency import OperationLatency
    from agent.telemetry.nfd import FeatureFile
    from agent.telemetry.node_labels_api import NodeLabelPublisher
    from agent.telemetry.status_socket import StatusSocketServer

log = logging.getLogger(__name__)

DEFAULT_METRICS_ADDRESS = ":9479"  # not 9400, which dcgm-exporter uses on the same nodes
FEATURE_FILE = "tessera"
LOOP_ANSWER_SECONDS = 2.0  # /healthz asks the loop; an idle loop answers at once, a stuck one not


class TelemetrySettings(Struct, frozen=True):
    hostname: str
    metrics_address: str = DEFAULT_METRICS_ADDRESS
    interval: float = 10.0
    idle_threshold_percent: float = 5.0
    proc_root: Path = Path("/proc")
    kubelet_dir: Path | None = None  # where the kubelet's dra_manager_state is; None: the device plugin dir's parent
    nfd_features_dir: Path | None = None
    status_socket: Path | None = None  # where /status is served (a unix socket, 0600); None: not served
    shared_product_suffix: bool = False
    label_node: bool = False  # also patch the labels onto the Node (no NFD): needs the node-labels overlay's RBAC


class Telemetry:
    """Metrics, health endpoints, ``/status`` (on its unix socket) and node labels for one agent, read from its
    published status (``source``), never from the agent itself."""

    def __init__(
        self,
        settings: TelemetrySettings,
        source: StatusSource,
        device_plugin_dir: Path,
        pod_resources_socket: Path,
        *,
        node_api: CoreApi | None = None,
        latency: OperationLatency | None = None,
        claims: Callable[[], Sequence[ClaimDevice]] | None = None,
        memory_limits: Callable[[], Sequence[object]] | None = None,
    ) -> None:
        """``node_api`` is where ``settings.label_node`` writes the labels; ``latency`` holds the timings the
        device plugin servers and the DRA service record (one is made when none is given: its histograms are
        then served empty); ``claims`` gives the devices of the DRA front end's prepared claims
        (``agent.telemetry.dra_claims.claim_devices`` of its checkpoint), attributed like dcgm-exporter does."""
        # Imported here, not with this module: an agent without metrics never loads http.server or the
        # PodResources stubs (``tessera run`` imports TelemetrySettings either way). prometheus_client is
        # loaded by none of them (exposition.py writes the text format itself).
        from agent.plugin.podresources import list_pod_resources
        from agent.telemetry.collector import TelemetryCollector, TelemetryOptions
        from agent.telemetry.latency import OperationLatency
        from agent.telemetry.server import TelemetryServer

        self.settings = settings
        self._source = source
        options = TelemetryOptions(
            hostname=settings.hostname,
            interval=settings.interval,
            idle_threshold_percent=settings.idle_threshold_percent,
            proc_root=settings.proc_root,
            kubelet_dir=settings.kubelet_dir,
            device_plugin_dir=device_plugin_dir,
            pod_resources_socket=pod_resources_socket,
        )
        self.collector = TelemetryCollector(
            options,
            status=lambda: source.status,
            holders=lambda: list_pod_resources(pod_resources_socket),
            on_collected=self._write_labels,
            latency=latency if latency is not None else OperationLatency(),
            claims=claims,
            memory_limits=memory_limits,
        )
        status_socket = str(settings.status_socket) if settings.status_socket is not None else None
        self.server = TelemetryServer(settings.metrics_address, self.collector.last, self.healthy, self.ready,
                                      status_socket)  # fmt: skip
        self.status_server: StatusSocketServer | None = None
        if settings.status_socket is not None:
            from agent.telemetry.status_socket import StatusSocketServer

            try:  # /status is not worth the metrics: without its socket, the agent serves on and says why once
                self.status_server = StatusSocketServer(settings.status_socket, self.status_json)
            except OSError as error:
                log.error("no /status: cannot serve its socket path=%s error=%r; `tessera status` will not answer",
                          settings.status_socket, error.strerror or str(error))  # fmt: skip
        self._labels_error: str | None = None
        self._labels_of: tuple[Inventory, ResourcePlan, str | None] | None = None  # what _labels come from
        self._labels: dict[str, str] = {}
        self._feature_file: FeatureFile | None = None
        self._publisher: NodeLabelPublisher | None = None
        if settings.label_node and node_api is not None:
            from agent.telemetry.node_labels_api import NodeLabelPublisher

            self._publisher = NodeLabelPublisher(node_api, settings.hostname)
        elif settings.label_node:
            log.warning("node labels are not written on the Node: no Kubernetes API (a node name and in-cluster "
                        "credentials or a kubeconfig are needed)")  # fmt: skip
        self._machine: str | None = None
        self._machine_read = False

    def start(self) -> None:
        self.collector.start()
        self.server.start()
        if self.status_server is not None:
            self.status_server.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving and collecting; each thread is waited for at most ``timeout`` seconds."""
        self.server.stop(timeout)
        if self.status_server is not None:
            self.status_server.stop(timeout)
        self.collector.stop(timeout)

    def healthy(self) -> tuple[bool, str]:
        """The reconcile loop answers and metrics are collected."""
        if not self._source.responsive(LOOP_ANSWER_SECONDS):
            loop_age = time.monotonic() - self._source.heartbeat
            return False, f"the reconcile loop does not answer (last turn {loop_age:.0f} s ago)"
        collected = self.collector.last.collected_at
        if collected is not None and time.time() - collected > 3 * self.settings.interval + 10:
            return False, f"metrics were last collected {time.time() - collected:.0f} s ago"
        return True, "ok"

    def ready(self) -> tuple[bool, str]:
        """Every advertised resource is registered with the kubelet, and so is the DRA driver when it serves
        GPUs: a rollout stops at a node where either front end does not come up."""
        status = self._source.status
        if not status.kubelet_present:
            return False, "waiting for the kubelet"
        missing = sorted(set(status.resources) - status.registered)
        if missing:
            return False, f"not registered yet: {', '.join(missing)}"
        dra = status.dra
        if dra is not None and dra.get("served") and dra.get("registered") is not True:
            why = f": {dra['error']}" if dra.get("error") else ""
            return False, f"the DRA driver is not registered with the kubelet{why}"
        return True, f"ok: {len(status.resources)} resources registered"

    def status_json(self) -> bytes:
        """``/status`` (on the status socket): the published status as the document ``tessera status`` reads."""
        import json

        from agent import __version__
        from agent.status_report import status_document

        collected = self.collector.last.collected_at is not None
        allocated = [
            {"resource": d.resource, "device_id": d.device_id, "namespace": d.namespace, "pod": d.pod,
             "container": d.container, "idle_seconds": round(d.idle_seconds, 1),
             "utilization_percent": d.utilization_percent}
            for d in self.collector.pods.idle_devices
        ] if collected else None  # fmt: skip
        document = status_document(self._source.status, version=__version__, allocated=allocated)
        return (json.dumps(document, indent=2, default=str) + "\n").encode()

    def _write_labels(self, status: object) -> None:
        directory = self.settings.nfd_features_dir
        inventory, plan = getattr(status, "inventory", None), getattr(status, "plan", None)
        if (directory is None and self._publisher is None) or inventory is None or plan is None:
            return
        if self._publisher is not None:
            self._publisher.publish(self._node_labels(inventory, plan, getattr(status, "mig_state", None)))
        if directory is None:
            return
        from agent.telemetry.nfd import FeatureFile

        if self._feature_file is None:
            self._feature_file = FeatureFile(directory / FEATURE_FILE)
        try:
            labels = self._node_labels(inventory, plan, getattr(status, "mig_state", None))
            if self._feature_file.update(labels):
                log.info("node labels written path=%s labels=%d", directory / FEATURE_FILE, len(labels))
            self._labels_error = None
        except (OSError, ValueError) as error:
            if str(error) != self._labels_error:
                log.error("cannot write node labels path=%s error=%r", directory, str(error))
            self._labels_error = str(error)

    def _node_labels(self, inventory: Inventory, plan: ResourcePlan, mig_state: str | None) -> dict[str, str]:
        """The node's labels, computed again only for another inventory, plan or MIG state (all immutable)."""
        last = self._labels_of
        if last is not None and last[0] is inventory and last[1] is plan and last[2] == mig_state:
            return self._labels
        from agent.telemetry.labels import node_labels

        if not self._machine_read:  # the DMI product name does not change while the node runs
            self._machine, self._machine_read = _machine(), True
        self._labels = node_labels(
            inventory,
            plan,
            mig_config_state=mig_state,
            shared_suffix=self.settings.shared_product_suffix,
            machine=self._machine,
        )
        self._labels_of = (inventory, plan, mig_state)
        return self._labels


def _machine() -> str | None:
    """The machine type for nvidia.com/gpu.machine, as GFD reads it (DMI product name)."""
    try:
        return Path("/sys/class/dmi/id/product_name").read_text(errors="replace").strip() or None
    except OSError:
        return None
