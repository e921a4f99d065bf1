"""Prepare and Unprepare of the DRA driver's claims: the work behind the kubelet's calls, one claim at a time.

``agent.dra.service`` translates the kubelet's gRPC calls and runs every method here on its one worker thread, so
one claim is worked on at a time across all calls and both API versions (as NVIDIA's driver serialises them with
its node-wide lock): the checkpoint has a single writer, and a Prepare racing an Unprepare of the same claim is
simply ordered. Each step (reading the claim from the API server, writing its CDI spec and the checkpoint, each
with an fsync) blocks, which is why none of it runs on the gRPC loop. The promises, which the kubelet relies on
(facts/dra.md A2, C8):

- Every claim of a batch gets an entry; one claim's error (naming the claim and the reason) never fails the others.
- Prepare is idempotent: a claim already prepared gets the same answer from the checkpoint, nothing redone (its CDI
  spec is written again if it is gone). The kubelet calls Prepare again after its own restart, for a second pod
  sharing the claim, and after a reboot.
- Nothing is left half-prepared: ``PrepareStarted`` is recorded before anything is done, ``PrepareCompleted`` once
  the CDI spec is written; a failure in between removes the spec and the record. A ``PrepareStarted`` record found
  later (the agent died mid-way) is rolled back and the claim prepared again.
- A device held by another prepared claim is refused (``agent.core.dra.claims.plan_prepare``), across agent restarts.
- Unprepare works from the checkpoint alone (the claim may be deleted from the API server by then) and does not
  assume this process prepared the claim; an unknown claim is a success.
- A call's deadline is honoured per claim: a claim whose turn comes after the kubelet gave up is not started.
- Once prepared, the claim's ``status.devices`` says so (``agent.core.dra.device_status``: a ``Ready`` condition and
  each device's UUID, a created MIG device's included), and Unprepare takes the entries back. Both are reports, not
  steps, written by ``report`` after the kubelet has its answer (the service queues it on this same thread, so
  reports keep the order of the calls): they never lengthen a call, and an API server that refuses them or hangs
  is logged while the Prepare or Unprepare stands.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
from msgspec import Struct, field

from agent.core.cdi_edits import DriverFiles, memory_limit_edits
from agent.core.dra.cdi import CdiError, cdi_device_ids, check_claim_uid, claim_spec
from agent.core.dra.checkpoint import (
    PREPARE_COMPLETED,
    Checkpoint,
    CreatedMig,
    PreparedClaim,
    PreparedDevice,
    held_devices,
    mps_records,
    planned_mig,
    prepare_completed,
    prepare_started,
    shares_held,
    unprepared,
    with_mps,
    without_mps,
)
from agent.core.dra.claims import ClaimError, ClaimRef, PreparableDevice, PreparePlan, plan_prepare
from agent.core.dra.mps import (
    MpsRecord,
    client_edits,
    memory_sizes,
    mps_record,
    pinned_over_memory,
    records_specs,
    share_record,
)
from agent.core.dra.opaque import OpaqueConfigError
from agent.core.dra.shares import MEMORY, limits
from agent.dra.cdi_store import CdiStore, CdiStoreError
from agent.dra.checkpoint_store import CheckpointSaveError, CheckpointStore
from agent.dra.claims_api import ClaimReader, ClaimStatus, ClaimsUnavailable, ClaimUnreadable
from agent.dra.devnodes import DeviceNodes
from agent.dra.partitions import MigModeBusy, PartitionError
from agent.dra.timeslices import TimesliceFailed

if TYPE_CHECKING:
    from agent.gpu.mig import MigModeState
    from agent.ledger import DeviceLedger

log = logging.getLogger(__name__)

Outcome = tuple[PreparedDevice, ...] | ClaimError  # one claim's Prepare: its devices, or why not
MPS_READY_SECONDS = 30.0  # a claim's MPS daemon must answer within this, or the Prepare fails (the kubelet retries)


class MpsNotReady(RuntimeError):
    """The claim's MPS daemon did not become ready; the message says why."""


class Devices(Protocol):
    """The pool's devices as the owner last handed them over (``agent.dra.service.DeviceView`` has this)."""

    @property
    def devices(self) -> Mapping[str, PreparableDevice]: ...
    @property
    def unhealthy(self) -> Mapping[str, str]: ...  # device name -> why


class Partitions(Protocol):
    """Creates and destroys the MIG devices of dynamic-MIG claims (``agent.dra.partitions.NvmlPartitions``)."""

    def create(self, mig: CreatedMig) -> CreatedMig: ...
    def destroy(self, mig: CreatedMig) -> None: ...
    def mig_mode(self, gpu_uuid: str) -> MigModeState: ...
    def set_mig_mode(self, gpu_uuid: str, enabled: bool) -> None: ...


class Timeslices(Protocol):
    """Sets and resets a GPU's compute time-slice (``agent.dra.timeslices.NvidiaSmiTimeslices``)."""

    def apply(self, gpu_uuid: str, level: int) -> None: ...
    def reset(self, gpu_uuid: str) -> None: ...


class _Done(Struct):
    """What one Prepare attempt has done so far: the MIG devices it made, the devices whose time-slice it set."""

    created: dict[str, CreatedMig] = field(default_factory=dict)
    timesliced: set[str] = field(default_factory=set)
    mig_on: set[str] = field(default_factory=set)  # GPUs whose MIG mode it turned on


class ClaimWorker:
    """Prepare and Unprepare, one claim at a time; every method runs on the service's one worker thread.

    ``checkpoint`` is the prepared claims as last saved; it is replaced whole (an immutable value), so other
    threads may read it at any time.
    """

    def __init__(
        self,
        *,
        driver: str,
        pool: str,
        read_claim: ClaimReader,
        cdi: CdiStore,
        checkpoints: CheckpointStore,
        view: Callable[[], Devices | None],
        node_wide: bool,
        node_cdi_kind: str,
        common_edits: Mapping[str, Any] | Callable[[], Mapping[str, Any]] | None,
        device_nodes: DeviceNodes,
        partitions: Partitions | None = None,
        timeslices: Timeslices | None = None,
        changed: Callable[[], None] = lambda: None,
        mps_ready: Callable[..., str | None] = lambda key, timeout, limits=None: "no MPS manager runs for DRA here",
        mps_root: Callable[[], str] = lambda: "/run/nvidia/mps",
        ledger: DeviceLedger | None = None,
        claim_status: ClaimStatus | None = None,
        memory_limits: bool = True,
    ) -> None:
        self._driver, self._pool = driver, pool
        self._memory_limits = memory_limits  # sized GPUs' entries get NVIDIA_GPU_MEMORY_* and the toolkit's hook
        self._claim_status = claim_status  # writes status.devices; None: not reported (a service without an API)
        self._unreported: list[tuple[ClaimRef, str, Callable[[ClaimStatus], bool]]] = []  # for report()
        # The agent's ledger: a Prepare records PrepareStarted in its critical section, after asking that each GPU is
        # still DRA's, and time-slices change in it. Without one (a service on its own) every device of the view is
        # the service's, and a lock of its own orders the same steps.
        self._ledger = ledger
        self._own_lock = threading.Lock()
        self._read_claim = read_claim
        self._cdi, self._store = cdi, checkpoints
        self._view = view
        self._node_wide, self._node_cdi_kind = node_wide, node_cdi_kind
        self._common_edits = common_edits
        self._device_nodes = device_nodes
        if partitions is None:
            from agent.dra.partitions import NvmlPartitions

            partitions = NvmlPartitions()
        self._partitions = partitions
        if timeslices is None:
            from agent.dra.timeslices import NvidiaSmiTimeslices

            timeslices = NvidiaSmiTimeslices()
        self._timeslices = timeslices
        self._changed = changed  # told after every Prepare and Unprepare call
        self._mps_ready = mps_ready  # (daemon key, timeout, limits) -> None once it is ready (holding them), else why
        self._mps_root = mps_root  # the MPS root on the host now (the config's mpsRoot), for the clients' mounts
        self.checkpoint: Checkpoint = checkpoints.load()
        self.mig_mode_changes = 0  # how often a Prepare or Unprepare changed a GPU's MIG mode (the node changed)

    # ----- Prepare ------------------------------------------------------------------------------------------------

    def prepare(self, refs: Sequence[ClaimRef], deadline: float | None) -> dict[str, Outcome]:
        outcomes: dict[str, Outcome] = {}
        for ref in refs:
            if deadline is not None and time.monotonic() > deadline:
                outcomes[ref.uid] = ClaimError(
                    ref, "not prepared: the kubelet's call timed out before its turn; the kubelet retries", True
                )
                continue
            try:
                outcome = self._prepare(ref)
            except Exception as error:  # a bug must cost one claim, never the batch or the worker
                log.exception("unexpected error preparing claim=%s/%s uid=%s", ref.namespace, ref.name, ref.uid)
                self._roll_back_started(ref)
                outcome = ClaimError(ref, f"internal error while preparing: {type(error).__name__}: {error}", True)
            _log_prepare(ref, outcome)
            outcomes[ref.uid] = outcome
        self._changed()
        return outcomes

    def _prepare(self, ref: ClaimRef) -> Outcome:
        try:
            check_claim_uid(ref.uid)
        except CdiError as error:
            return ClaimError(ref, str(error))
        existing = self.checkpoint.claims.get(ref.uid)
        if existing is not None and existing.state == PREPARE_COMPLETED:
            return self._prepared_before(ref, existing)
        if existing is not None:
            log.warning(
                "claim was left PrepareStarted by an earlier attempt; rolling it back claim=%s/%s uid=%s",
                ref.namespace,
                ref.name,
                ref.uid,
            )
            if (problem := self._roll_back(ref)) is not None:
                return ClaimError(ref, f"cannot roll back an earlier, unfinished prepare: {problem}", True)
        view = self._view()
        if view is None:
            return ClaimError(ref, "this node's devices are not known yet (the agent is starting); retry", True)
        try:
            claim = self._read_claim(ref.namespace, ref.name, ref.uid)
        except ClaimsUnavailable as error:
            return ClaimError(ref, f"cannot read the claim: {error}; the kubelet retries", True)
        except ClaimUnreadable as error:
            return ClaimError(ref, str(error))
        plan = plan_prepare(
            ref,
            claim,
            driver=self._driver,
            pool=self._pool,
            devices=view.devices,
            unhealthy=view.unhealthy,
            held_by=held_devices(self.checkpoint),
            shares_held=shares_held(self.checkpoint, other_than=ref.uid),
        )
        if isinstance(plan, ClaimError):
            return plan
        if (problem := _pinned_over_memory(plan)) is not None:  # refused before anything is done
            return ClaimError(ref, problem)
        try:  # a spec that cannot be built fails before anything is done
            if any(planned_mig(d) for d in plan.devices):
                self._common()  # the driver's files at least: the MIG devices' own nodes are known once made
            else:
                self._spec(ref.uid, [(d.device, d.info) for d in plan.devices])
        except CdiError as error:
            return ClaimError(ref, f"cannot build its CDI spec: {error}")
        gpus = {d.info.parent_uuid or d.info.uuid for d in plan.devices}
        with self._reserving(gpus) as foreign:  # no hand-over or destructive step slips in before PrepareStarted
            if foreign:
                return ClaimError(
                    ref,
                    f"its devices are on GPU(s) {', '.join(foreign)}, which DRA no longer serves (the config gave them "
                    "to the device plugin); delete the pod so the claim is allocated again",
                )
            plan = self._leave_others_timeslices(ref, plan)
            started = prepare_started(self.checkpoint, plan)  # with the placements of the MIG devices it creates
            try:
                self._store.save(started)
            except CheckpointSaveError as error:
                return ClaimError(ref, f"{error}; nothing was prepared", True)
            self.checkpoint = started
        done = _Done()
        created = done.created
        try:
            for planned in plan.devices:
                if (intent := planned_mig(planned)) is not None:
                    self._mig_mode(ref, intent.gpu_uuid, True, done)  # its first partition: MIG mode on
                    with self._section():  # MIG changes, of any room, one at a time in the ledger's section
                        created[planned.device] = self._partitions.create(intent)
                elif planned.info.consumes_counters and not planned.admin_access:  # a partitioned GPU, whole
                    self._mig_mode(ref, planned.info.uuid, False, done)
                if planned.timeslice is not None:
                    with self._section():
                        self._timeslices.apply(planned.info.uuid, planned.timeslice)
                    done.timesliced.add(planned.device)
            made = [(d.device, _concrete(d.info, created.get(d.device))) for d in plan.devices]
            record = self._start_mps(ref, plan, dict(made))
            spec, ids = self._spec(ref.uid, made, self._device_edits(ref, record, made))
            self._cdi.write(ref.uid, spec)
            completed = prepare_completed(self.checkpoint, plan, ids, created)
            self._store.save(completed)
        except (
            PartitionError, TimesliceFailed, MpsNotReady, OpaqueConfigError, CdiError, CdiStoreError,
            CheckpointSaveError,
        ) as error:  # fmt: skip
            reason = f"cannot build its CDI spec: {error}" if isinstance(error, CdiError) else str(error)
            if (problem := self._roll_back(ref, done)) is not None:
                return ClaimError(ref, f"{reason}; rolling back failed too ({problem}): the next attempt retries it")
            if isinstance(error, MigModeBusy):
                return ClaimError(ref, f"{reason}; nothing was prepared, the kubelet retries", True)
            return ClaimError(ref, f"{reason}; nothing was left prepared")
        self.checkpoint = completed
        prepared = completed.claims[ref.uid].devices
        self._report_prepared(ref, prepared, {name: info.uuid for name, info in made})
        return prepared

    # ----- status.devices -----------------------------------------------------------------------------------------

    def _report_prepared(self, ref: ClaimRef, devices: Sequence[PreparedDevice], uuids: Mapping[str, str]) -> None:
        if self._claim_status is None:
            return
        from agent.core.dra.device_status import DeviceStatus

        statuses = [DeviceStatus(d.pool, d.device, uuids.get(d.device, ""), d.share_id) for d in devices]
        self._report(ref, "prepared", lambda s: s.prepared(ref.namespace, ref.name, ref.uid, statuses))

    def _report_unprepared(self, ref: ClaimRef, devices: Sequence[PreparedDevice]) -> None:
        if self._claim_status is None or not devices:
            return
        names = [d.device for d in devices]
        self._report(ref, "unprepared", lambda s: s.unprepared(ref.namespace, ref.name, ref.uid, self._pool, names))

    def _report(self, ref: ClaimRef, what: str, write: Callable[[ClaimStatus], bool]) -> None:
        self._unreported.append((ref, what, write))

    def report(self) -> None:
        """Write the ``status.devices`` reports the calls since the last ``report`` left, in their order. A report
        only: whatever goes wrong is logged, the Prepare or Unprepare it follows stands."""
        reports, self._unreported = self._unreported, []
        for ref, what, write in reports:
            self._write_report(ref, what, write)

    def _write_report(self, ref: ClaimRef, what: str, write: Callable[[ClaimStatus], bool]) -> None:
        assert self._claim_status is not None
        try:
            written = write(self._claim_status)
        except Exception as error:  # ClaimStatusNotWritten, or a bug: never undoes what was done
            log.warning(
                "claim status.devices not written claim=%s/%s uid=%s after=%s error=%s",
                ref.namespace,
                ref.name,
                ref.uid,
                what,
                error,
            )
            return
        log.debug(
            "claim status.devices claim=%s/%s uid=%s after=%s written=%s",
            ref.namespace,
            ref.name,
            ref.uid,
            what,
            written,
        )

    # ----- the ledger's critical section ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _reserving(self, gpus: set[str]) -> Iterator[list[str]]:
        """The GPUs among ``gpus`` DRA does not serve (empty: all are), inside the ledger's critical section."""
        if self._ledger is None:
            with self._own_lock:
                yield []
        else:
            with self._ledger.reserving(gpus) as foreign:
                yield foreign

    def _section(self) -> contextlib.AbstractContextManager[None]:
        return self._own_lock if self._ledger is None else self._ledger.section()

    @contextlib.contextmanager
    def _acting_on_gpu(self, claim_uid: str, gpu_uuid: str) -> Iterator[list[str]]:
        """Who other than the claim holds the GPU (empty: nobody), inside the ledger's critical section: a step that
        disturbs the whole GPU (its MIG mode) acts only when that is empty."""
        if self._ledger is None:
            with self._own_lock:
                gpu_minor = next((d.gpu_minor for d in self._view_devices() if d.gpu_uuid == gpu_uuid), None)
                yield [f"claim {c}" for c in self._other_claims_on(claim_uid, gpu_minor, admin=True)]
            return
        from agent.core.ledger import Drain

        # MIG mode changes only on a GPU without MIG devices (``_mig_mode``): processes run on the GPU itself; a claim
        # holds it by its name, or by the UUID of a MIG device made for it (recorded, even if a reset took it)
        made = {h.device for h in self._ledger.recorded().on_gpu(gpu_uuid) if h.device.startswith("MIG-")}
        drain = Drain(frozenset({gpu_uuid, *made}), frozenset({gpu_uuid}))
        with self._ledger.acting(drain, other_than_claim=claim_uid) as busy:
            yield busy

    def _view_devices(self) -> list[Any]:
        view = self._view()
        return list(view.devices.values()) if view is not None else []

    def _mig_mode(self, ref: ClaimRef, gpu_uuid: str, enabled: bool, done: _Done) -> None:
        """Dynamic MIG (NVIDIA's): the GPU's MIG mode on for a partition, off for the whole GPU, changed only when
        nobody else holds the GPU; ``MigModeBusy`` naming who does (the kubelet retries), ``PartitionError`` when the
        GPU cannot change it without a reset or still holds MIG devices."""
        from agent.core.dra.partitions import reset_free_mig_mode

        mode = "on" if enabled else "off"
        state = self._partitions.mig_mode(gpu_uuid)
        if state.enabled == enabled:
            return
        if not reset_free_mig_mode(state.architecture):
            raise PartitionError(
                f"GPU {gpu_uuid} ({state.architecture}): its MIG mode is {'off' if enabled else 'on'} and changes only "
                f"with a GPU reset, which Tessera does not do under claims; turn it {mode} "
                f"(nvidia-smi -i {gpu_uuid} -mig {int(enabled)}, then a reset)"
            )
        if not enabled and state.mig_devices:
            raise MigModeBusy(
                f"GPU {gpu_uuid}: MIG mode cannot be turned off for the whole GPU while {state.mig_devices} MIG "
                "device(s) exist on it"
            )
        with self._acting_on_gpu(ref.uid, gpu_uuid) as busy:
            if busy:
                held = "; ".join(busy)
                raise MigModeBusy(f"GPU {gpu_uuid}: MIG mode cannot be turned {mode} while it is held: {held}")
            state = self._partitions.mig_mode(gpu_uuid)  # read again where it is acted on: no drift since the check
            if state.enabled == enabled:
                return
            if not enabled and state.mig_devices:
                raise MigModeBusy(f"GPU {gpu_uuid}: {state.mig_devices} MIG device(s) appeared on it meanwhile")
            self._partitions.set_mig_mode(gpu_uuid, enabled)
            self.mig_mode_changes += 1
        if enabled:
            done.mig_on.add(gpu_uuid)

    def _mig_mode_off_after_last(self, claim_uid: str, gpu_uuids: set[str]) -> None:
        """Unprepare (or a roll back) took a claim's last partition of these GPUs: MIG mode goes off again where it
        can change without a reset, no MIG device is left and nobody else holds the GPU (else it stays on; the next
        Prepare of the whole GPU turns it off)."""
        from agent.core.dra.partitions import reset_free_mig_mode

        for gpu_uuid in sorted(gpu_uuids):
            try:
                state = self._partitions.mig_mode(gpu_uuid)
                if not state.enabled or state.mig_devices or not reset_free_mig_mode(state.architecture):
                    continue
                with self._acting_on_gpu(claim_uid, gpu_uuid) as busy:
                    if busy:
                        log.info("MIG mode stays on gpu=%s held_by=%r", gpu_uuid, "; ".join(busy))
                        continue
                    if self._partitions.mig_mode(gpu_uuid).mig_devices:  # read again where it is acted on
                        continue
                    self._partitions.set_mig_mode(gpu_uuid, False)
                    self.mig_mode_changes += 1
            except PartitionError as error:
                log.warning("MIG mode stays on gpu=%s error=%r", gpu_uuid, str(error))

    def _other_claims_on(self, claim_uid: str, gpu_minor: int | None, *, admin: bool) -> list[str]:
        """The other recorded claims holding a device of the GPU (admin-access ones only when ``admin``)."""
        from agent.core.ledger import checkpoint_devices

        return sorted(
            {
                d.claim
                for d in checkpoint_devices(self.checkpoint)
                if d.claim_uid != claim_uid and d.gpu_minor == gpu_minor and (admin or not d.admin)
            }
        )

    def _leave_others_timeslices(self, ref: ClaimRef, plan: PreparePlan) -> PreparePlan:
        """An admin-access claim (monitoring, diagnostics) never changes the time-slice of a GPU another claim holds:
        that claim's workload keeps its own, and this claim records none to reset."""
        devices = []
        for planned in plan.devices:
            if planned.admin_access and planned.timeslice is not None:
                others = self._other_claims_on(ref.uid, planned.info.gpu_minor, admin=True)
                if others:
                    log.info(
                        "admin-access claim leaves the GPU's time-slice as it is claim=%s/%s device=%s held_by=%s",
                        ref.namespace, ref.name, planned.device, ",".join(others),
                    )  # fmt: skip
                    planned = msgspec.structs.replace(planned, leaves_timeslice=True)
            devices.append(planned)
        return msgspec.structs.replace(plan, devices=tuple(devices))

    def _reset_timeslice(self, claim_uid: str, device: PreparedDevice) -> None:
        """Put the GPU's time-slice back to Default, unless another (not admin-access) claim still holds the GPU: its
        workload keeps the time-slice it runs with."""
        from agent.core.dra.devices import gpu_minor_of

        assert device.timeslice is not None
        with self._section():
            others = self._other_claims_on(claim_uid, gpu_minor_of(device.device), admin=False)
            if others:
                log.info("time-slice left in place gpu=%s held_by=%s", device.timeslice.gpu_uuid, ",".join(others))
                return
            self._timeslices.reset(device.timeslice.gpu_uuid)

    def _start_mps(self, ref: ClaimRef, plan: PreparePlan, devices: Mapping[str, PreparableDevice]) -> MpsRecord | None:
        """Record the MPS daemon the claim's MPS devices (or its share of a GPU) need, have the loop start it (or
        keep it: claims on the same devices share it), and wait until it answers."""
        mps = [d for d in plan.devices if d.mps is not None]
        share = next((d for d in plan.devices if d.mps_share is not None), None)
        if share is not None:  # plan_prepare allows one share and no MPS devices beside it
            held = limits(share.info, share.mps_share)  # type: ignore[arg-type]
            record = share_record(devices[share.device].uuid, held, share.info.capacity.get(MEMORY, 0) >> 20)
        elif mps:
            record = mps_record([devices[d.device].uuid for d in mps], mps[0].mps)  # type: ignore[arg-type]
        else:
            return None
        staged = with_mps(self.checkpoint, ref.uid, record)
        self._store.save(staged)
        self.checkpoint = staged
        self._changed()  # the loop reads the daemons it must run from the checkpoint
        # a share's daemon holds the shares' limits: wait until it holds the ones with this claim's share in them
        wanted = next((s.limits for s in records_specs(mps_records(staged)) if s.key == record.key), None)
        problem = self._mps_ready(record.key, MPS_READY_SECONDS, wanted if record.share is not None else None)
        if problem is not None:
            devices_text = ", ".join(record.devices)
            raise MpsNotReady(f"its MPS daemon ({record.key}, devices {devices_text}) is not ready: {problem}")
        return record

    def _prepared_before(self, ref: ClaimRef, claim: PreparedClaim) -> Outcome:
        """The same answer as the first time; the CDI spec written again if it is gone (a reboot empties tmpfs)."""
        if self._cdi.exists(ref.uid):
            return claim.devices
        view = self._view()
        devices = view.devices if view is not None else {}
        missing = [d.device for d in claim.devices if d.device not in devices]
        if missing:
            return ClaimError(
                ref,
                f"its CDI spec {self._cdi.path(ref.uid)} is gone and its devices {', '.join(missing)} no longer exist "
                "on this node, so it cannot be written again; delete the pod so the claim is unprepared",
            )
        try:
            made = [(d.device, _concrete(devices[d.device], d.mig)) for d in claim.devices]
            spec, _ = self._spec(ref.uid, made, self._device_edits(ref, claim.mps, made))
            path = self._cdi.write(ref.uid, spec)
        except (CdiError, CdiStoreError) as error:
            return ClaimError(ref, f"its CDI spec is gone and cannot be written again: {error}")
        log.info("CDI spec written again claim=%s/%s uid=%s path=%s", ref.namespace, ref.name, ref.uid, path)
        return claim.devices

    def _spec(
        self,
        claim_uid: str,
        devices: Sequence[tuple[str, PreparableDevice]],
        device_edits: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> tuple[dict[str, Any], dict[str, tuple[str, ...]]]:
        nodes = {name: tuple(self._device_nodes(info)) for name, info in devices}
        spec = claim_spec(claim_uid, nodes, common_edits=self._common(), device_edits=device_edits)
        ids = {
            name: cdi_device_ids(
                claim_uid, name, info.uuid, node_wide=self._node_wide, node_cdi_kind=self._node_cdi_kind
            )
            for name, info in devices
        }
        return spec, ids

    def _device_edits(
        self, ref: ClaimRef, record: MpsRecord | None, made: Sequence[tuple[str, PreparableDevice]]
    ) -> dict[str, dict[str, list[Any]]]:
        """Per device entry: an MPS device's daemon edits (pipe, shared memory, limits) and, for a whole GPU with a
        memory size (a share, an MPS claim's pinned limit), the driver's per-container limit: the
        ``NVIDIA_GPU_MEMORY_*`` variables and the toolkit's hook where the node has it (``memory_limit_edits``).

        The variables are one per container: a claim whose GPUs have different sizes cannot say them all, so it
        gets none (the memory-limits room holds each GPU to its own size once the container runs)."""
        edits: dict[str, dict[str, list[Any]]] = {}
        for name, info in made:
            if record is not None and info.uuid in record.devices:
                edits[name] = {k: list(v) for k, v in client_edits(record, self._mps_root()).items()}
        sizes = {uuid: mib for uuid, mib in memory_sizes(record).items() if uuid.startswith("GPU-")}
        if not self._memory_limits:
            return edits
        if len(set(sizes.values())) > 1:
            log.info(
                "claim's GPUs have different memory sizes; no NVIDIA_GPU_MEMORY_* variables (one per container) "
                "claim=%s/%s uid=%s sizes=%s", ref.namespace, ref.name, ref.uid, sizes,
            )  # fmt: skip
            return edits
        files = self._driver_files()
        for name, info in made:
            if info.uuid in sizes:
                entry = edits.setdefault(name, {})
                for key, value in memory_limit_edits(files, info.uuid, sizes[info.uuid]).items():
                    entry[key] = [*entry.get(key, []), *value]
        return edits

    def _driver_files(self) -> DriverFiles | None:
        """What was found under the driver root (the hook binary and whether it has the memory-limits hook); None
        with a node-wide spec or fixed edits."""
        files = getattr(self._common_edits, "files", None)
        return files() if callable(files) else None

    def _common(self) -> Mapping[str, Any] | None:
        """The spec-level edits (the driver's files); ``CdiError`` (``DriverMissing``) when the node has no driver."""
        common = self._common_edits
        return common() if callable(common) else common

    def _roll_back(self, ref: ClaimRef, done: _Done | None = None) -> str | None:
        """Undo a prepare that did not complete (spec, time-slices, MIG devices, then the record); the reason when
        something cannot be undone (the record then stays, and the next attempt rolls back again).

        ``done`` is what this attempt did, and only that is undone: a MIG device found at the placement (made by
        hand) or a time-slice that could not be set is not this attempt's. A record left by an earlier attempt
        (an agent that died) names only the placements and levels it meant: whatever sits there of that profile
        is taken for what that attempt made."""
        try:
            self._cdi.remove(ref.uid)
            record = self.checkpoint.claims.get(ref.uid)
            partitioned = set(done.mig_on) if done is not None else set()
            for device in record.devices if record is not None else ():
                if device.timeslice is not None and (done is None or device.device in done.timesliced):
                    self._reset_timeslice(ref.uid, device)
                mig = device.mig if done is None else done.created.get(device.device)
                if mig is not None:
                    with self._section():  # it checks that no process runs there, and destroys, in one step
                        self._partitions.destroy(mig)
                    partitioned.add(mig.gpu_uuid)
            self._mig_mode_off_after_last(ref.uid, partitioned)
        except (CdiStoreError, PartitionError, TimesliceFailed) as error:
            log.error("cannot roll back claim=%s/%s uid=%s error=%r", ref.namespace, ref.name, ref.uid, str(error))
            return str(error)
        rolled = unprepared(self.checkpoint, ref.uid)
        self.checkpoint = rolled  # at once: a PrepareStarted record the disk may still hold is rolled back again
        try:
            self._store.save(rolled)
        except CheckpointSaveError as error:
            log.error("claim rolled back, checkpoint not saved uid=%s error=%r", ref.uid, str(error))
        return None

    def _roll_back_started(self, ref: ClaimRef) -> None:
        existing = self.checkpoint.claims.get(ref.uid)
        if existing is not None and existing.state != PREPARE_COMPLETED:
            with contextlib.suppress(Exception):
                self._roll_back(ref)

    # ----- Unprepare ----------------------------------------------------------------------------------------------

    def unprepare(self, refs: Sequence[ClaimRef], deadline: float | None) -> dict[str, str]:
        """Claim UID -> error message; ``""`` for success."""
        errors: dict[str, str] = {}
        for ref in refs:
            if deadline is not None and time.monotonic() > deadline:
                late = ClaimError(ref, "not unprepared: the kubelet's call timed out before its turn; it retries")
                errors[ref.uid] = late.message
                continue
            try:
                errors[ref.uid] = self._unprepare(ref)
            except Exception as error:
                log.exception("unexpected error unpreparing claim=%s/%s uid=%s", ref.namespace, ref.name, ref.uid)
                errors[ref.uid] = ClaimError(ref, f"internal error while unpreparing: {error}").message
        self._changed()
        return errors

    def _unprepare(self, ref: ClaimRef) -> str:
        claim = self.checkpoint.claims.get(ref.uid)
        try:
            check_claim_uid(ref.uid)
        except CdiError:
            if claim is None:
                log.info("unprepare of an unknown claim claim=%s/%s uid=%r", ref.namespace, ref.name, ref.uid)
                return ""  # no file of ours can carry such a name, and nothing is recorded for it
        try:
            removed = self._cdi.remove(ref.uid)
            if claim is not None and claim.mps is not None:
                self._release_mps(ref.uid)  # its daemon may go now; a MIG device it served is destroyed after it
            for device in claim.devices if claim is not None else ():
                if device.timeslice is not None:
                    self._reset_timeslice(ref.uid, device)
                if device.mig is not None:
                    with self._section():  # it checks that no process runs there, and destroys, in one step
                        self._partitions.destroy(device.mig)  # the record stays until it is gone: the kubelet retries
            self._mig_mode_off_after_last(ref.uid, {d.mig.gpu_uuid for d in claim.devices if d.mig} if claim else set())
        except (CdiStoreError, PartitionError, TimesliceFailed, CheckpointSaveError) as error:
            return _failed_unprepare(ref, str(error))
        if claim is None:
            log.info(
                "unprepare of an unknown claim claim=%s/%s uid=%s stale_spec_removed=%s",
                ref.namespace,
                ref.name,
                ref.uid,
                removed,
            )
            return ""
        rolled = unprepared(self.checkpoint, ref.uid)
        try:
            self._store.save(rolled)
        except CheckpointSaveError as error:
            return _failed_unprepare(ref, str(error))
        self.checkpoint = rolled
        self._report_unprepared(ref, claim.devices)
        log.info(
            "claim unprepared claim=%s/%s uid=%s devices=%s state=%s",
            ref.namespace,
            ref.name,
            ref.uid,
            ",".join(d.device for d in claim.devices),
            claim.state,
        )
        return ""

    def _release_mps(self, claim_uid: str) -> None:
        """The claim no longer needs its MPS daemon: recorded first, so the loop can retire the daemon (once no
        client runs) even while the claim's other devices are still being taken down."""
        released = without_mps(self.checkpoint, claim_uid)
        self._store.save(released)
        self.checkpoint = released
        self._changed()

    def sweep(self) -> list[str]:
        """Roll back every Prepare an earlier agent left unfinished (nothing of it reached a container: its MIG
        devices go now rather than when the kubelet calls again), then remove the CDI specs of ours that no
        recorded claim owns (``CdiStore.stale``); the claim UIDs of those specs."""
        for uid, claim in sorted(self.checkpoint.claims.items()):
            if claim.state != PREPARE_COMPLETED:
                ref = ClaimRef(claim.namespace, claim.name, uid)
                problem = self._roll_back(ref)
                log.info(
                    "unfinished prepare from before rolled back claim=%s/%s uid=%s%s",
                    ref.namespace,
                    ref.name,
                    uid,
                    f" error={problem!r} (retried when the kubelet calls)" if problem else "",
                )
        removed = []
        for uid in self._cdi.stale(self.checkpoint.claims.keys()):
            try:
                if self._cdi.remove(uid):
                    removed.append(uid)
            except CdiStoreError as error:
                log.warning("cannot remove a stale CDI spec uid=%s error=%r", uid, str(error))
        if removed:
            log.info("stale CDI specs removed claims=%s", ",".join(removed))
        return removed


def _concrete(info: PreparableDevice, mig: CreatedMig | None) -> PreparableDevice:
    """The device as the CDI spec names it: a dynamic-MIG partition as the MIG device created for it."""
    if mig is None or mig.uuid is None:
        return info
    return msgspec.structs.replace(info, uuid=mig.uuid, gi_id=mig.gi_id, ci_id=mig.ci_id)  # type: ignore[type-var]


def _pinned_over_memory(plan: PreparePlan) -> str | None:
    """Why the claim's MPS pinned memory limits cannot be held (a limit above its device's memory), before anything
    is done. A claim with a device this Prepare makes (dynamic MIG: no UUID yet, so no per-device key resolves) is
    not checked here; a limit above such a MIG device's memory holds nothing the device does not already."""
    mps = [d for d in plan.devices if d.mps is not None]
    if not mps or not all(d.info.uuid for d in mps):
        return None
    devices = [(d.device, d.info.uuid, d.info.capacity.get(MEMORY, 0)) for d in mps]
    try:
        return pinned_over_memory(mps[0].mps, devices)  # type: ignore[arg-type]
    except OpaqueConfigError as error:
        return str(error)


def _failed_unprepare(ref: ClaimRef, reason: str) -> str:
    log.error("claim not unprepared claim=%s/%s uid=%s reason=%r", ref.namespace, ref.name, ref.uid, reason)
    return ClaimError(ref, f"{reason}; the kubelet retries").message


def _log_prepare(ref: ClaimRef, outcome: Outcome) -> None:
    if isinstance(outcome, ClaimError):
        log.log(
            logging.WARNING if outcome.retriable else logging.ERROR,
            "claim not prepared claim=%s/%s uid=%s retriable=%s reason=%r",
            ref.namespace,
            ref.name,
            ref.uid,
            outcome.retriable,
            outcome.reason,
        )
    else:
        log.info(
            "claim prepared claim=%s/%s uid=%s devices=%s cdi_device_ids=%s",
            ref.namespace,
            ref.name,
            ref.uid,
            ",".join(d.device for d in outcome),
            ",".join(i for d in outcome for i in d.cdi_device_ids),
        )
