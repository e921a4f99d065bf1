"""The ledger's shell: reads every source of "who holds this device", and is the critical section every
destructive step acts in.

``agent.core.ledger`` says what is held from the sources' answers; this reads them — the kubelet's PodResources,
NVML's processes and MPS clients, the DRA checkpoint as the claim worker last saved it — and owns one lock. A step
that disturbs devices (a MIG change, a MIG device destroyed, a time-slice set or reset, an MPS daemon quit) runs
inside ``acting``: the ledger is read and the step done under the lock, so no claim can start being prepared
between the answer and the act (a Prepare records ``PrepareStarted`` under the same lock, in ``reserving``).

The ledger also keeps which front end serves each GPU: the GPUs DRA serves. A GPU moves to DRA only when nothing
holds it (``take_for_dra``, on a worker) and back to the device plugin only when no claim holds it or is being
prepared on it (``release_from_dra``, on the loop, which never waits for the lock: a busy lock is tried again later).
A Prepare asks, under the lock, that each GPU it would use is DRA's.

Reads run on worker threads (and on the claim worker), never on the reconcile loop, except ``release_from_dra``,
which reads memory only.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from agent.core.inventory import Inventory
from agent.core.ledger import (
    ClaimDevice,
    Drain,
    Hold,
    Ledger,
    admitting_holds,
    checkpoint_devices,
    claim_holds,
    pod_holds,
    process_holds,
)

if TYPE_CHECKING:
    from agent.core.dra.checkpoint import Checkpoint
    from agent.plugin.podresources import PodAllocations

log = logging.getLogger(__name__)

ALLOCATE_GRACE_SECONDS = 5.0  # the kubelet records an allocation right after Allocate answers; this is ample

EMPTY_INVENTORY = Inventory("", "", None, (), ())


class DeviceLedger:
    def __init__(
        self,
        pod_resources_socket: Path,
        *,
        pod_resources: Callable[[], PodAllocations] | None = None,
        processes: Callable[[Sequence[str], Collection[int]], Mapping[str, tuple[int, ...]]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``pod_resources`` and ``processes`` read the kubelet's PodResources and NVML's processes (by default
        through ``agent.plugin.podresources`` at ``pod_resources_socket`` and ``agent.gpu.processes``); each raises its
        module's error when it cannot tell."""
        self._socket = pod_resources_socket
        self._pod_resources = pod_resources or self._list_pod_resources
        self._processes = processes or _device_processes
        self._lock = threading.RLock()
        self._claims: Callable[[], Checkpoint | None] = lambda: None
        self._pool = ""  # the DRA driver's pool (this node's name): its claims in PodResources are ours
        self.inventory: Inventory = EMPTY_INVENTORY  # set by the loop whenever it reads the node (one write)
        self._dra: frozenset[str] = frozenset()  # GPU UUIDs DRA serves; replaced whole, under the lock
        self._clock = clock
        self._allocated: dict[str, float] = {}  # advertised device ID -> when an Allocate call asked for it
        self._allocated_lock = threading.Lock()  # a lock of its own: Allocate never waits for a step

    # ----- sources --------------------------------------------------------------------------------------------------

    def attach_claims(self, checkpoint: Callable[[], Checkpoint | None], pool: str) -> None:
        """The DRA front end's checkpoint (an immutable value, replaced whole by the claim worker)."""
        self._claims, self._pool = checkpoint, pool

    def claims_checkpoint(self) -> Checkpoint | None:
        """The DRA front end's checkpoint as last saved (None without DRA): any thread, memory only."""
        return self._claims()

    def claim_devices(self) -> list[ClaimDevice]:
        checkpoint = self._claims()
        return checkpoint_devices(checkpoint) if checkpoint is not None else []

    def recorded(self) -> Ledger:
        """The recorded claims only (memory: any thread, no I/O)."""
        return Ledger(tuple(claim_holds(self.claim_devices(), self.inventory)))

    def read(self, drain: Drain, *, exclude_pids: Collection[int] = ()) -> Ledger:
        """Every holder of what ``drain`` disturbs: recorded claims, and — only as far as ``drain`` needs them —
        PodResources (device-plugin pods, pods of claims) and NVML (processes, MPS clients). Blocks (I/O)."""
        from agent.core.ledger import claim_pod_holds
        from agent.gpu.processes import ProcessesUnknown
        from agent.plugin.podresources import PodResourcesError

        inventory = self.inventory
        claims = self.claim_devices()
        holds: list[Hold] = claim_holds(claims, inventory)
        unknown: list[str] = []
        if drain.withdrawn:
            try:
                answer = self._pod_resources()
            except PodResourcesError as error:
                unknown.append(f"cannot tell whether pods hold the devices: {error}")
            else:
                self._recorded_by_kubelet(answer.devices)
                holds += pod_holds(answer.devices, inventory)
                holds += claim_pod_holds(answer.claims, self._pool, claims, inventory)
            holds += self._being_allocated(inventory)  # what Allocate answered for and PodResources does not list
        if drain.scopes:
            try:
                holds += process_holds(self._processes(sorted(drain.scopes), exclude_pids), inventory)
            except ProcessesUnknown as error:
                unknown.append(f"cannot tell whether processes run on the devices: {error}")
        return Ledger(tuple(holds), tuple(unknown))

    def why_busy(
        self,
        drain: Drain,
        *,
        exclude_pids: Collection[int] = (),
        other_than_claim: str | None = None,
        for_daemon: str | None = None,
    ) -> list[str]:
        """Who holds what ``drain`` disturbs (empty: nobody). Whatever cannot be known counts as held."""
        try:
            ledger = self.read(drain, exclude_pids=exclude_pids)
        except Exception as error:  # nobody said the devices are free
            return [f"cannot tell whether the devices are free: {type(error).__name__}: {error}"]
        return ledger.blocking(drain, other_than_claim=other_than_claim, for_daemon=for_daemon)

    def note_allocated(self, device_ids: Iterable[str]) -> None:
        """A gRPC thread, in Allocate: the kubelet is giving these (advertised) devices to a pod. PodResources lists
        them only once the kubelet has the answer; until then (``ALLOCATE_GRACE_SECONDS`` at most) the ledger holds
        them itself. Allocate calls this before it reads its snapshot: a hand-over that withdrew a device first is
        refused by that snapshot, and one whose check comes after this sees the device held."""
        now = self._clock()
        with self._allocated_lock:
            self._allocated.update(dict.fromkeys(device_ids, now))

    def _recorded_by_kubelet(self, listed: Collection[str]) -> None:
        """Devices PodResources lists are the kubelet's word from now on: noted allocations of them end (a pod that
        ends is then free at once, not after the grace)."""
        with self._allocated_lock:
            for device_id in self._allocated.keys() & set(listed):
                del self._allocated[device_id]

    def _being_allocated(self, inventory: Inventory) -> list[Hold]:
        now = self._clock()
        with self._allocated_lock:
            for device_id, since in list(self._allocated.items()):
                if now - since > ALLOCATE_GRACE_SECONDS:
                    del self._allocated[device_id]
            recent = list(self._allocated)
        return admitting_holds(recent, inventory)

    def _list_pod_resources(self) -> PodAllocations:
        from agent.plugin.podresources import list_pod_resources  # the stubs load with the first read

        return list_pod_resources(self._socket)

    # ----- the critical section -------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def acting(
        self,
        drain: Drain,
        *,
        exclude_pids: Collection[int] = (),
        other_than_claim: str | None = None,
        for_daemon: str | None = None,
    ) -> Iterator[list[str]]:
        """Hold the lock, read who holds what ``drain`` disturbs and yield the reasons; the caller acts only when
        they are empty, still inside: nothing can start holding the devices between the answer and the act."""
        with self._lock:
            yield self.why_busy(
                drain, exclude_pids=exclude_pids, other_than_claim=other_than_claim, for_daemon=for_daemon
            )

    @contextlib.contextmanager
    def reserving(self, gpus: Iterable[str]) -> Iterator[list[str]]:
        """A Prepare's critical section: yields the GPUs among ``gpus`` that DRA does not serve (empty: all are
        DRA's); the caller records ``PrepareStarted`` inside, so no hand-over or destructive step slips between."""
        with self._lock:
            yield sorted(set(gpus) - self._dra)

    @contextlib.contextmanager
    def section(self) -> Iterator[None]:
        """The lock alone, for a step that reads the recorded claims itself (memory) before it acts."""
        with self._lock:
            yield

    # ----- which front end serves each GPU --------------------------------------------------------------------------

    def dra_gpus(self) -> frozenset[str]:
        return self._dra

    def adopt_for_dra(self, gpus: Iterable[str]) -> bool:
        """Loop: GPUs a recorded claim holds (an agent restart) are DRA's at once. False when a step holds the lock
        (the loop never waits for it): asked again later."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            self._dra |= frozenset(gpus)
            return True
        finally:
            self._lock.release()

    def take_for_dra(self, gpu: str, drain: Drain) -> list[str]:
        """Worker: the GPU becomes DRA's if nothing holds what ``drain`` names (its devices); else who does."""
        with self.acting(drain) as busy:
            if not busy:
                self._dra |= {gpu}
            return busy

    def release_from_dra(self, gpus: Iterable[str]) -> frozenset[str]:
        """Loop: of ``gpus``, those no recorded claim holds or is being prepared on go back to the device plugin;
        the ones released. Never waits: when a step holds the lock, nothing moves now (asked again later)."""
        if not self._lock.acquire(blocking=False):
            return frozenset()
        try:
            released = (frozenset(gpus) & self._dra) - self.recorded().claimed_gpus()
            self._dra -= released
            return released
        finally:
            self._lock.release()


def _device_processes(uuids: Sequence[str], exclude_pids: Collection[int]) -> Mapping[str, tuple[int, ...]]:
    from agent.gpu.processes import device_processes  # pynvml loads with the first read

    return device_processes(uuids, exclude_pids=exclude_pids)
