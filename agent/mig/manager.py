"""The MIG layout manager: brings the GPUs to the selected layout without pulling a device from under a pod.

It belongs to the reconcile loop. ``desire`` computes the operations (pure, ``agent.core.mig_layout``) and
what they disturb (``agent.core.drain``): a MIG mode change the whole GPU — the GPU as a device, its
replicas, every MIG device on it and their replicas; destroying an instance its MIG devices and the whole
GPU where that is advertised as one device. Those devices are *withdrawn* at once, so no new pod gets them.
A worker then checks, through the kubelet's PodResources API and NVML (compute processes and MPS clients),
that none of them is allocated and nothing runs there — unknown counts as busy — and checks again right
before acting; only then are the operations applied, on the worker, and the result comes back as an event.
The agent then re-reads the inventory and advertises the new devices.

State, as the node label ``nvidia.com/mig.config.state`` will show it: ``pending`` (draining or waiting
for devices to be freed; ``waiting_for`` says for what), ``applying``, ``success``, ``failed`` (the NVML
error is named; the next attempt starts from a fresh inventory and converges), ``reset-required`` (a MIG
mode change waits for a GPU reset).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from enum import StrEnum
from typing import TYPE_CHECKING

from msgspec import Struct

from agent.core.drain import Drain, mig_drain
from agent.core.inventory import Inventory
from agent.core.mig_layout import (
    CreateInstance,
    DesiredLayout,
    DestroyInstance,
    LayoutError,
    Operation,
    SetMigMode,
    diff_node,
)
from agent.gpu.mig import create_instance, destroy_empty_instances, destroy_instance, set_mig_mode
from agent.news import STATUS, News
from agent.supervise import WorkerCrashed, submit

if TYPE_CHECKING:
    from agent.ledger import DeviceLedger

log = logging.getLogger(__name__)

CHECK_INTERVAL = 1.0  # how often a pending change looks again whether its devices are free
RESET_RECHECK_INTERVAL = 5.0  # how often a change waiting for a GPU reset looks whether it happened
MAX_BACKOFF = 60.0


class MigState(StrEnum):
    PENDING = "pending"
    APPLYING = "applying"
    SUCCESS = "success"
    FAILED = "failed"
    RESET_REQUIRED = "reset-required"


class MigBusyChecked(Struct, frozen=True):
    generation: int
    busy: tuple[str, ...]  # "MIG-… held by default/pod (container)", "GPU-… runs 2 process(es)", "cannot tell …"


class MigApplied(Struct, frozen=True):
    generation: int
    error: str | None = None
    reset_required: tuple[int, ...] = ()
    busy: tuple[str, ...] = ()  # the last check before acting found the devices in use: nothing was done


class MigManager:
    def __init__(self, post: Callable[[object], None], ledger: DeviceLedger) -> None:
        self._post = post
        self._ledger = ledger  # who holds each device; the changes are made in its critical section
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="mig")
        self.state: MigState | None = None  # None: no layout is managed
        self.error: str | None = None
        self.drain = Drain()
        self.waiting_for: tuple[str, ...] = ()  # why a pending change does not go ahead
        self._operations: dict[int, tuple[Operation, ...]] = {}
        self.changing_uuids: frozenset[str] = frozenset()  # the GPUs the current change operates on
        self._generation = 0
        self._in_flight = False
        self._next_check = 0.0
        self._failures = 0

    def desire(self, layouts: Mapping[int, DesiredLayout] | None, inventory: Inventory, now: float) -> None:
        """The layout to reach, per GPU index (None: leave MIG alone)."""
        if layouts is None:
            self._reset(None, None)
            return
        try:
            operations = diff_node(inventory.gpus, layouts)
        except LayoutError as error:
            if str(error) != self.error:
                log.error("MIG layout cannot be applied; nothing is changed error=%r", str(error))
            self._reset(MigState.FAILED, str(error))
            return
        if not operations:
            if self.state not in (MigState.SUCCESS, None) or self._operations:
                log.info("MIG layout in place gpus=%d", len(layouts))
            self._reset(MigState.SUCCESS, None)
            self._failures = 0
            return
        if operations == self._operations and self.state in (MigState.FAILED, MigState.RESET_REQUIRED):
            return  # the same change as before, waiting for its retry (or a reset)
        if operations != self._operations:
            self._generation += 1
            self.waiting_for = ()
            if self.state is not MigState.FAILED:  # a failed change keeps its backoff
                self._next_check = now
            if self.state is MigState.RESET_REQUIRED:
                self.state = MigState.PENDING  # the reset happened: what is left can be done now
            summary = "; ".join(f"GPU {i}: {len(ops)} operations" for i, ops in sorted(operations.items()))
            log.info("MIG layout change planned %s", summary)
        self._operations = operations
        self.changing_uuids = frozenset(g.uuid for g in inventory.gpus if g.index in operations)
        self.drain = mig_drain(operations, inventory)
        if self.state not in (MigState.APPLYING, MigState.FAILED, MigState.RESET_REQUIRED):
            self.state = MigState.PENDING

    def fail(self, error: str) -> None:
        """The layout itself is unusable (bad file, unknown name): change nothing, say why once."""
        if error != self.error:
            log.error("MIG layout cannot be applied; nothing is changed error=%r", error)
        self._reset(MigState.FAILED, error)

    def _reset(self, state: MigState | None, error: str | None) -> None:
        self.state, self.error, self.drain, self._operations, self.waiting_for = state, error, Drain(), {}, ()
        self.changing_uuids = frozenset()

    @property
    def withdrawn(self) -> frozenset[str]:
        """Physical device IDs not to advertise while a change is pending or applying."""
        return self.drain.withdrawn

    def next_deadline(self) -> float | None:
        """When ``tick`` has something to do next (None: nothing until an event)."""
        if self._in_flight:
            return None
        if self.state in (MigState.PENDING, MigState.RESET_REQUIRED) or (
            self.state is MigState.FAILED and self._operations
        ):
            return self._next_check
        return None

    def tick(self, now: float) -> bool:
        """Start due work; True when the agent should re-read the inventory (a reset may have happened)."""
        if self._in_flight or now < self._next_check:
            return False
        if self.state is MigState.RESET_REQUIRED:
            self._next_check = now + RESET_RECHECK_INTERVAL
            return True
        if self.state is MigState.FAILED and self._operations:
            self.state = MigState.PENDING  # retry
        if self.state is MigState.PENDING:
            self._in_flight = True
            self._submit("check", self._check_free, self._generation, self.drain)
        return False

    def on_busy_checked(self, event: MigBusyChecked, now: float) -> None:
        self._in_flight = False
        if event.generation != self._generation or self.state is not MigState.PENDING:
            return
        if event.busy:
            self._wait(event.busy, now)
            return
        self.state = MigState.APPLYING
        self._in_flight = True
        log.info("MIG layout change applying generation=%d", self._generation)
        self._submit("apply", self._apply, self._generation, dict(self._operations), self.drain)

    def _wait(self, busy: tuple[str, ...], now: float) -> None:
        if busy != self.waiting_for:
            log.info("MIG layout change waits for devices to be freed waiting_for=%r", "; ".join(busy))
        self.state, self.waiting_for, self._next_check = MigState.PENDING, busy, now + CHECK_INTERVAL

    def on_applied(self, event: MigApplied, now: float) -> None:
        """The worker is done; the agent re-reads the inventory and calls ``desire`` again after this."""
        self._in_flight = False
        if event.busy:
            self._wait(event.busy, now)
        elif event.error is not None:
            self._failures += 1
            backoff = min(MAX_BACKOFF, 2.0 ** (self._failures - 1))
            self.state, self.error, self._next_check = MigState.FAILED, event.error, now + backoff
            log.error("MIG layout change failed retry_in=%.0fs error=%r", backoff, event.error)
        elif event.reset_required:
            self.state, self._next_check = MigState.RESET_REQUIRED, now + RESET_RECHECK_INTERVAL
            self.error = f"GPU(s) {', '.join(map(str, event.reset_required))} need a reset for the MIG mode change"
            log.warning("MIG mode change pending until a GPU reset gpus=%s", ",".join(map(str, event.reset_required)))
        else:
            self.state, self.error, self._failures, self.waiting_for = MigState.SUCCESS, None, 0, ()
            log.info("MIG layout change applied generation=%d", event.generation)

    def on_event(self, event: object, now: float) -> News:
        """The worker's news: a pending change's devices checked, or the change applied (or not)."""
        if isinstance(event, MigBusyChecked):
            self.on_busy_checked(event, now)
        elif isinstance(event, MigApplied):
            self.on_applied(event, now)
            if not event.busy:  # the devices changed (or may have): read them, the changed GPUs withdrawn till then
                return News(reread="MIG change", stale=self.changing_uuids)
        return STATUS

    def on_crashed(self, event: WorkerCrashed, now: float) -> None:
        """A worker job raised past its own guard: treat it as a failed attempt, retried with backoff."""
        log.debug("MIG worker traceback:\n%s", event.traceback)
        self.on_applied(MigApplied(self._generation, f"{event.key} crashed: {event.error}"), now)

    def shutdown(self, wait: bool = True) -> None:
        """Stop the worker; ``wait=False`` (a process that exits next) does not wait for a change in flight: the
        driver finishes or drops the NVML call, and the next agent converges from a fresh inventory."""
        self._pool.shutdown(wait=wait, cancel_futures=True)

    # ----- worker -----------------------------------------------------------------------------------

    def _submit(self, key: str, job: object, *args: object) -> None:
        if submit(self._pool, self._post, "mig", key, job, *args) is None:
            self._in_flight = False  # shutting down

    def _check_free(self, generation: int, drain: Drain) -> None:
        self._post(MigBusyChecked(generation, tuple(self._busy(drain))))

    def _busy(self, drain: Drain) -> list[str]:
        return self._ledger.why_busy(drain)

    def _apply(self, generation: int, operations: dict[int, tuple[Operation, ...]], drain: Drain) -> None:
        # Asked again right before acting (something may have started since the check), and the change is made in
        # the ledger's critical section: no claim starts being prepared on these devices meanwhile.
        with self._ledger.acting(drain) as busy:
            if busy:
                self._post(MigApplied(generation, busy=tuple(busy)))
                return
            self._change(generation, operations)

    def _change(self, generation: int, operations: dict[int, tuple[Operation, ...]]) -> None:
        reset_required = []
        try:
            for gpu_index, ops in sorted(operations.items()):
                swept = False
                for op in ops:
                    if isinstance(op, CreateInstance) and not swept:
                        # a GPU instance with no compute instance (a creation cut short, its undo failed too) is
                        # nobody's and invisible to the inventory, but it would hold its placement: gone first
                        if destroyed := destroy_empty_instances(gpu_index):
                            log.warning("GPU instances without a compute instance destroyed gpu=%d count=%d",
                                        gpu_index, destroyed)  # fmt: skip
                        swept = True
                    if isinstance(op, SetMigMode):
                        if not set_mig_mode(gpu_index, op.enabled):
                            reset_required.append(gpu_index)
                            break  # nothing more can happen on this GPU until it is reset
                    elif isinstance(op, DestroyInstance):
                        destroy_instance(gpu_index, op.gi_id)
                    elif isinstance(op, CreateInstance):
                        create_instance(gpu_index, op.profile_id, op.placement, op.ci_profile_id)
        except Exception as error:  # an NVML error, NVML gone (NvmlUnavailable), anything: a failed attempt
            self._post(MigApplied(generation, str(error) or type(error).__name__))
            return
        self._post(MigApplied(generation, None, tuple(reset_required)))
