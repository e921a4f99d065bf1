"""The DRA driver's gRPC service: NodePrepareResources / NodeUnprepareResources and the device health stream.

One ``grpc.aio`` server on the agent's gRPC loop, on the driver's DRA socket (mode 0600), serves four services:
``k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin`` (kubelet 1.34+), ``...dra.v1beta1.DRAPlugin`` (older kubelets; the same
behaviour, without ``Device.share_id``), ``v1.DRAResourceHealth`` (kubelet 1.37+ prefers it) and
``v1alpha1.DRAResourceHealth`` (1.34-1.36, and 1.37-1.39 for drivers without v1): the two health services have the
same messages in two packages, so one handler serves both with the same bytes.

Prepare and Unprepare: the handlers only translate. The work blocks (reading claims from the API server, writing
CDI specs and the checkpoint, each with an fsync), so it runs on one worker thread, never on the loop: the
``agent.dra.prepare.ClaimWorker``, whose docstring holds the promises the kubelet relies on (one entry per claim,
idempotence, nothing left half-prepared, Unprepare from the checkpoint alone). One worker means one claim at a
time across all calls and both API versions. An empty request (NVIDIA's liveness probe sends one) gets an empty
answer without reaching the worker; a call that arrives while the service stops is refused as UNAVAILABLE.

Health (KEP-4680): ``NodeWatchResources`` sends the complete device list of the pool with each device's health at
once, again on every change the owner hands over with ``update``, and again every third of
``health_check_timeout_seconds`` even without a change: the kubelet reads a device as Unknown once it has not
been reported for that long (facts A4). 60 s is long enough that a busy node never flaps to Unknown and short
enough that a wedged agent shows within a minute; when the agent dies the stream ends and the kubelet clears the
driver's health at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
import time
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import MappingProxyType, ModuleType
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio
from msgspec import Struct

from agent.api.dra.v1 import api_pb2 as dra_v1
from agent.api.dra.v1beta1 import api_pb2 as dra_v1beta1
from agent.api.drahealth.v1 import api_pb2 as dra_health_v1
from agent.api.drahealth.v1alpha1 import api_pb2 as dra_health
from agent.core.dra.cdi import NODE_WIDE_CDI_KIND
from agent.core.dra.checkpoint import PREPARE_COMPLETED, Checkpoint, mps_records
from agent.core.dra.claims import ClaimError, ClaimRef
from agent.core.dra.devices import DraDevice
from agent.core.dra.mps import MpsRecord
from agent.dra.cdi_store import CdiStore
from agent.dra.checkpoint_store import CheckpointStore
from agent.dra.claims_api import ClaimReader, ClaimStatus
from agent.dra.devnodes import DeviceNodes, default_device_nodes
from agent.dra.names import MAX_SOCKET_PATH, check_driver_name
from agent.dra.prepare import ClaimWorker, Timeslices
from agent.grpc_loop import GrpcLoop, grpc_loop

if TYPE_CHECKING:
    from agent.ledger import DeviceLedger

log = logging.getLogger(__name__)

SOCKET_MODE = 0o600
SOCKET_DIR_MODE = 0o750
HEALTH_TIMEOUT_SECONDS = 60
MAX_HEALTH_MESSAGE = 1024  # the kubelet truncates longer messages
STOP_GRACE = 0.1
DRA_V1 = dra_v1.DESCRIPTOR.services_by_name["DRAPlugin"].full_name
DRA_V1BETA1 = dra_v1beta1.DESCRIPTOR.services_by_name["DRAPlugin"].full_name
HEALTH = dra_health.DESCRIPTOR.services_by_name["DRAResourceHealth"].full_name  # v1alpha1.DRAResourceHealth
HEALTH_V1 = dra_health_v1.DESCRIPTOR.services_by_name["DRAResourceHealth"].full_name  # v1.DRAResourceHealth


class DeviceView(Struct, frozen=True):
    """The pool's devices and their health as the owner last handed them over (immutable; swapped whole)."""

    devices: Mapping[str, DraDevice]
    unhealthy: Mapping[str, str]  # device name -> why (e.g. "XID 79"), shown in the health message
    health: tuple[tuple[str, int, str], ...]  # (device, HealthStatus, message), in the owner's device order

    @classmethod
    def of(
        cls, devices: Mapping[str, DraDevice], unhealthy: Mapping[str, str], unknown: Collection[str] = ()
    ) -> DeviceView:
        def status(name: str) -> tuple[str, int, str]:
            if name in unhealthy:
                return name, dra_health.UNHEALTHY, unhealthy[name][:MAX_HEALTH_MESSAGE]
            return name, dra_health.UNKNOWN if name in unknown else dra_health.HEALTHY, ""

        health = tuple(status(name) for name in devices)
        return cls(MappingProxyType(dict(devices)), MappingProxyType(dict(unhealthy)), health)


class DraService:
    """Serves the kubelet's DRA services for one driver and pool on ``socket_path``.

    The owner (the reconcile thread) calls ``start``, ``update`` whenever the devices or their health change,
    ``prepared`` to learn which devices claims hold, and ``stop``. A stopped service may be started again.
    """

    def __init__(
        self,
        socket_path: Path,
        *,
        driver: str,
        pool: str,
        read_claim: ClaimReader,
        cdi: CdiStore,
        checkpoints: CheckpointStore,
        node_wide_cdi: bool = False,
        node_cdi_kind: str = NODE_WIDE_CDI_KIND,
        cdi_common_edits: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None = None,
        device_nodes: DeviceNodes | None = None,
        timeslices: Timeslices | None = None,
        claims_changed: Callable[[], None] = lambda: None,
        mps_ready: Callable[..., str | None] = lambda key, timeout, limits=None: "no MPS manager runs for DRA here",
        mps_root: Callable[[], str] = lambda: "/run/nvidia/mps",
        health_timeout_seconds: int = HEALTH_TIMEOUT_SECONDS,
        loop: GrpcLoop | None = None,
        latency: Any = None,
        ledger: DeviceLedger | None = None,
        claim_status: ClaimStatus | None = None,
        memory_limits: bool = True,
    ) -> None:
        """``pool`` is the node's name; ``cdi_common_edits`` (edits, or a callable giving them:
        ``agent.gpu.driver_root.CommonEdits``, which raises ``DriverMissing`` on a node without a driver) go at the
        spec level of every claim's spec, so the claim's IDs resolve to its spec alone. ``node_wide_cdi`` (off by
        default) instead adds each device's ``<node_cdi_kind>=<uuid>`` CDI ID of the spec ``nvidia-ctk cdi generate``
        writes (see ``agent.core.dra.cdi``).
        ``device_nodes`` gives each device's nodes for its claim entry; by default
        ``agent.dra.devnodes.default_device_nodes``: the GPU's node, and without node-wide CDI a MIG device's
        capability nodes read from the driver's ``/proc``. ``latency`` (``agent.telemetry.latency.OperationLatency``)
        records each Prepare and Unprepare call as the kubelet's ``dra_operations_duration_seconds`` does.
        ``claim_status`` writes each prepared claim's ``status.devices`` (and takes it back at Unprepare).
        ``memory_limits``: a GPU with a memory size gets the driver's per-container limit in its claim entry
        (``NVIDIA_GPU_MEMORY_*``, the toolkit's hook; off with ``--memory-limits off``). The
        checkpoint is read here, so ``prepared`` answers before ``start``."""
        if health_timeout_seconds < 3:
            raise ValueError("health_timeout_seconds must be at least 3 (the stream reports every third of it)")
        self.socket_path = socket_path
        self.driver = check_driver_name(driver)
        self.pool = pool
        self._health_timeout = health_timeout_seconds
        self._latency = latency
        self._loop = loop or grpc_loop()
        self._view: DeviceView | None = None
        self._claims = ClaimWorker(
            driver=driver,
            pool=pool,
            read_claim=read_claim,
            cdi=cdi,
            checkpoints=checkpoints,
            view=lambda: self._view,
            node_wide=node_wide_cdi,
            node_cdi_kind=node_cdi_kind,
            common_edits=cdi_common_edits,
            device_nodes=device_nodes or default_device_nodes(node_wide_cdi),
            timeslices=timeslices,
            changed=claims_changed,
            mps_ready=mps_ready,
            mps_root=mps_root,
            ledger=ledger,
            claim_status=claim_status,
            memory_limits=memory_limits,
        )
        self._executor: ThreadPoolExecutor | None = None
        self._server: grpc.aio.Server | None = None
        self._socket_inode: int | None = None
        # Loop-thread state: the event health streams wait on (replaced at each wake-up), open streams.
        self._wakeup = asyncio.Event()
        self._stopping = False
        self._open_streams = 0

    # ----- owner's side -------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Serve on a fresh socket (a stale one of ours is removed first)."""
        if len(os.fsencode(self.socket_path)) > MAX_SOCKET_PATH:
            raise OSError(f"cannot listen on {self.socket_path}: longer than {MAX_SOCKET_PATH} bytes")
        self.socket_path.parent.mkdir(mode=SOCKET_DIR_MODE, parents=True, exist_ok=True)
        self.socket_path.unlink(missing_ok=True)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dra-claims")
        self._loop.run(self._start())
        self.socket_path.chmod(SOCKET_MODE)
        self._socket_inode = self.socket_path.stat().st_ino
        log.info(
            "DRA service serving socket=%s driver=%s pool=%s prepared_claims=%d",
            self.socket_path,
            self.driver,
            self.pool,
            len(self._claims.checkpoint.claims),
        )

    def stop(self, grace: float = STOP_GRACE) -> None:
        """Stop serving: health streams end, the server goes, the claim being worked on finishes (claims queued
        behind it are dropped: their calls have ended), the socket is removed."""
        if self._server is not None:
            self._loop.run(self._stop(grace))
        if self._executor is not None:
            executor, self._executor = self._executor, None
            executor.shutdown(wait=True, cancel_futures=True)
        with contextlib.suppress(OSError):
            info = self.socket_path.stat()
            if stat.S_ISSOCK(info.st_mode) and info.st_ino == self._socket_inode:
                self.socket_path.unlink()

    def update(
        self, devices: Mapping[str, DraDevice], unhealthy: Mapping[str, str], *, unknown: Collection[str] = ()
    ) -> None:
        """The pool's devices by name and the unhealthy ones with why (``unknown``: health cannot be told).

        Called by the reconcile thread: the view is built, swapped in with one attribute write (Prepare reads it
        once per claim), and the health streams are woken through the loop when what they report changed.
        """
        view = DeviceView.of(devices, unhealthy, unknown)
        previous, self._view = self._view, view
        if self._server is not None and (previous is None or previous.health != view.health):
            self._loop.call_soon(self._wake)

    def prepared(self) -> dict[str, tuple[str, ...]]:
        """Claim UID -> its device names, for every claim recorded (completed or still being prepared): a GPU
        holding one must stay with DRA."""
        return {uid: tuple(d.device for d in c.devices) for uid, c in self._claims.checkpoint.claims.items()}

    def made_mig_devices(self) -> dict[str, str]:
        """Device name -> the UUID of the MIG device Prepare made for it, for every completed claim."""
        return {
            d.device: d.mig.uuid
            for claim in self._claims.checkpoint.claims.values()
            if claim.state == PREPARE_COMPLETED
            for d in claim.devices
            if d.mig is not None and d.mig.uuid is not None
        }

    def mig_mode_changes(self) -> int:
        """How many times a Prepare or Unprepare changed a GPU's MIG mode (dynamic MIG)."""
        return self._claims.mig_mode_changes

    def checkpoint(self) -> Checkpoint:
        """The prepared claims now (an immutable value, replaced whole by the worker: safe to read anywhere)."""
        return self._claims.checkpoint

    def mps_records(self) -> dict[str, MpsRecord]:
        """Claim UID -> the MPS daemon it needs (a consistent view: the checkpoint is replaced whole)."""
        return mps_records(self._claims.checkpoint)

    LEGACY_SHARE = (
        "limits advisory: prepared before the MPS server held shares, only the client's CUDA_MPS_* variables hold "
        "them until the claim is prepared again"
    )

    def claims(self, held: Mapping[str, object] | None = None, driver: Any = None) -> list[dict[str, object]]:
        """The recorded claims as the status shows them: name, state, devices, and what Prepare made for them; for a
        share, what holds its limits (``held``: daemon key -> the limits the daemon holds now; ``driver``: where the
        driver holds containers to their memory, ``agent.core.memlimits.DriverReport``, None: nowhere)."""
        from agent.core.dra.mps import enforcement_entry, share_enforcement
        from agent.core.dra.opaque import INTERVALS

        levels = {level: name for name, level in INTERVALS.items()}
        records = mps_records(self._claims.checkpoint)
        shown = []
        for uid, claim in sorted(self._claims.checkpoint.claims.items(), key=lambda c: (c[1].namespace, c[1].name)):
            devices = []
            for device in claim.devices:
                entry: dict[str, object] = {"device": device.device}
                if device.mig is not None:
                    entry["mig"] = device.mig.uuid or f"being made at memory slice {device.mig.start}"
                if device.timeslice is not None:
                    entry["timeslice"] = levels.get(device.timeslice.level, str(device.timeslice.level))
                if device.share is not None:
                    entry["share"] = {"memory": device.share.memory, "computePercent": device.share.compute_percent}
                    if device.share.shares:
                        entry["share"]["shares"] = device.share.shares  # type: ignore[index]
                    record = claim.mps if claim.state == PREPARE_COMPLETED else None  # held once prepared
                    now = (held or {}).get(record.key) if record is not None else None
                    by_driver = (
                        driver is not None
                        and record is not None
                        and driver.holds(f"{claim.namespace}/{claim.name}", record.devices[0])
                    )
                    enforced = share_enforcement(record, records, now, driver_memory=by_driver) if record else None
                    if enforced is not None:
                        entry["enforcement"] = enforcement_entry(enforced)
                    elif record is not None:  # recorded by a Tessera whose MPS server did not hold shares
                        entry["enforcement"] = {"advisory": True, "note": self.LEGACY_SHARE}
                devices.append(entry)
            shown.append({"claim": f"{claim.namespace}/{claim.name}", "uid": uid, "state": claim.state,
                          "devices": devices})  # fmt: skip
        return shown

    def sweep_stale_specs(self) -> list[str]:
        """Remove CDI specs of ours that no recorded claim owns, on the worker (between calls); their claim UIDs.

        Not done at start on its own: during a rolling update the other instance may be writing one right now."""
        if self._executor is None:
            return self._claims.sweep()
        return self._executor.submit(self._claims.sweep).result()

    def take_over(self, wait: Callable[[], bool], load: Callable[[], Checkpoint]) -> Future[list[str] | None]:
        """Another instance works the checkpoint (a rolling update): the worker, before any claim, waits for it
        (``wait``: True once it is this one's, False when the agent stops first), reads it again (``load``: the
        other instance wrote it since) and sweeps (``sweep_stale_specs``). The swept claim UIDs, None when the
        wait was stopped: then nothing queued behind it runs (it would work a checkpoint that is not ours)."""
        executor = self._executor
        if executor is None:
            raise RuntimeError("the DRA service is not started")

        def job() -> list[str] | None:
            if not wait():
                executor.shutdown(wait=False, cancel_futures=True)  # the claims queued behind: their calls fail
                return None
            self._claims.checkpoint = load()
            return self._claims.sweep()

        return executor.submit(job)

    @property
    def serving(self) -> bool:
        return self._server is not None

    @property
    def open_health_streams(self) -> int:
        return self._open_streams

    # ----- the loop's side ----------------------------------------------------------------------------------------

    async def _start(self) -> None:
        server = grpc.aio.server()
        for service, handlers in (
            (DRA_V1, self._plugin_handlers(dra_v1)),
            (DRA_V1BETA1, self._plugin_handlers(dra_v1beta1)),
            (HEALTH_V1, {"NodeWatchResources": grpc.unary_stream_rpc_method_handler(self._watch_resources)}),
            (HEALTH, {"NodeWatchResources": grpc.unary_stream_rpc_method_handler(self._watch_resources)}),
        ):
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
            server.add_registered_method_handlers(service, handlers)
        try:
            bound = server.add_insecure_port(f"unix://{self.socket_path}")
        except RuntimeError:  # grpcio raises when it cannot bind (older releases returned 0)
            bound = 0
        if bound == 0:
            raise OSError(f"cannot listen on {self.socket_path}")
        await server.start()
        self._stopping, self._server = False, server

    async def _stop(self, grace: float) -> None:
        self._stopping = True
        self._wake()
        deadline = asyncio.get_running_loop().time() + grace
        while self._open_streams and (left := deadline - asyncio.get_running_loop().time()) > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), left)  # a closing stream wakes the others
        if self._server is not None:
            server, self._server = self._server, None
            await server.stop(grace)
            log.info("DRA service stopped socket=%s", self.socket_path)

    def _plugin_handlers(self, api: ModuleType) -> dict[str, grpc.RpcMethodHandler]:
        share_ids = "share_id" in api.Device.DESCRIPTOR.fields_by_name  # v1 only

        async def prepare(request: Any, context: grpc.aio.ServicerContext) -> Any:
            response = api.NodePrepareResourcesResponse()
            if not request.claims:
                return response  # NVIDIA's liveness probe: the service answers (and is not timed)
            started, failed = time.perf_counter(), True
            try:
                outcomes = await self._on_worker(context, self._claims.prepare, _refs(request.claims))
                failed = any(isinstance(outcome, ClaimError) for outcome in outcomes.values())
            finally:
                if self._latency is not None:
                    self._latency.observe_prepare(time.perf_counter() - started, error=failed)
            for uid, outcome in outcomes.items():
                entry = response.claims[uid]
                if isinstance(outcome, ClaimError):
                    entry.error = outcome.message
                    continue
                for device in outcome:
                    added = entry.devices.add(
                        request_names=device.requests,
                        pool_name=device.pool,
                        device_name=device.device,
                        cdi_device_ids=device.cdi_device_ids,
                    )
                    if share_ids and device.share_id:
                        added.share_id = device.share_id
            return response

        async def unprepare(request: Any, context: grpc.aio.ServicerContext) -> Any:
            response = api.NodeUnprepareResourcesResponse()
            if not request.claims:
                return response
            started, failed = time.perf_counter(), True
            try:
                errors = await self._on_worker(context, self._claims.unprepare, _refs(request.claims))
                failed = any(errors.values())
            finally:
                if self._latency is not None:
                    self._latency.observe_unprepare(time.perf_counter() - started, error=failed)
            for uid, error in errors.items():
                response.claims[uid].SetInParent()  # an entry even without an error: the kubelet counts them
                if error:
                    response.claims[uid].error = error
            return response

        return {
            "NodePrepareResources": grpc.unary_unary_rpc_method_handler(
                prepare,
                request_deserializer=api.NodePrepareResourcesRequest.FromString,
                response_serializer=api.NodePrepareResourcesResponse.SerializeToString,
            ),
            "NodeUnprepareResources": grpc.unary_unary_rpc_method_handler(
                unprepare,
                request_deserializer=api.NodeUnprepareResourcesRequest.FromString,
                response_serializer=api.NodeUnprepareResourcesResponse.SerializeToString,
            ),
        }

    async def _on_worker(
        self,
        context: grpc.aio.ServicerContext,
        work: Callable[[list[ClaimRef], float | None], Any],
        refs: list[ClaimRef],
    ) -> Any:
        """Run ``work(refs, deadline)`` on the worker thread and wait for it without blocking the loop."""
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        executor = self._executor
        if executor is None or self._stopping:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the DRA driver is stopping")
        try:
            result = await asyncio.get_running_loop().run_in_executor(executor, work, refs, deadline)
        except RuntimeError:  # the executor was shut down while the call waited: the agent is stopping
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the DRA driver is stopping")
        with contextlib.suppress(RuntimeError):  # stopping: the reports are lost, as a report may be
            executor.submit(self._claims.report)  # status.devices, after the kubelet has its answer
        return result

    async def _watch_resources(self, request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        """The complete device list now, on every change, and every third of the timeout; until the stream ends.

        No polling: ``update`` and ``stop`` wake the waiting stream through the loop; the resend is a timed wait.
        """
        loop = asyncio.get_running_loop()
        resend = self._health_timeout / 3
        sent: tuple[tuple[str, int, str], ...] | None = None
        last = 0.0
        self._open_streams += 1
        try:
            while not self._stopping:
                view, wakeup = self._view, self._wakeup
                if view is not None and (view.health != sent or loop.time() - last >= resend):
                    sent, last = view.health, loop.time()
                    yield self._health_message(view)
                    continue
                timeout = None if view is None else resend - (loop.time() - last)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wakeup.wait(), timeout)
        finally:
            self._open_streams -= 1
            if self._stopping:
                self._wake()  # a stop waiting for the streams to close

    def _health_message(self, view: DeviceView) -> bytes:
        now = int(time.time())
        response = dra_health.NodeWatchResourcesResponse()
        for name, health, message in view.health:
            response.devices.add(
                device=dra_health.DeviceIdentifier(pool_name=self.pool, device_name=name),
                health=health,
                last_updated_time=now,
                health_check_timeout_seconds=self._health_timeout,
                message=message,
            )
        return response.SerializeToString()

    def _wake(self) -> None:
        """On the loop: every waiting health stream looks again."""
        wakeup, self._wakeup = self._wakeup, asyncio.Event()
        wakeup.set()


def _refs(claims: Sequence[Any]) -> list[ClaimRef]:
    """The batch's claims, each UID once (the answer is a map by UID)."""
    refs: dict[str, ClaimRef] = {}
    for claim in claims:
        refs.setdefault(claim.uid, ClaimRef(claim.namespace, claim.name, claim.uid))
    return list(refs.values())
