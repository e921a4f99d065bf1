"""The ledger's property (issue 24): random interleavings of device-plugin allocations, DRA claims (admin access
included, each Prepare split where the real one is — reading the claim outside the lock, recording PrepareStarted
inside it), config changes moving GPUs between the front ends, destructive steps (MIG changes, compute mode,
time-slice, an MPS quit) and kubelet restarts never leave a GPU with holders of both front ends, a claim on a GPU
DRA does not serve, nor a destructive step done under a holder.

The ledger under test is the agent's (``agent.ledger.DeviceLedger``); only its two outside sources — the kubelet's
PodResources answer and NVML's process list — are this model's, in memory.
"""

from __future__ import annotations

from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from agent.core.dra.checkpoint import PREPARE_COMPLETED, PREPARE_STARTED, Checkpoint, PreparedClaim, PreparedDevice
from agent.core.inventory import Inventory
from agent.core.ledger import Drain
from agent.gpu.processes import ProcessesUnknown
from agent.ledger import DeviceLedger
from agent.plugin.podresources import DeviceHolder, PodAllocations, PodResourcesError

from .builders import a100

GPUS = tuple(a100(i, f"GPU-0000000{i}-0000-4000-8000-000000000000") for i in range(2))
UUIDS = tuple(g.uuid for g in GPUS)
POOL = "node-a"
gpu_index = st.integers(0, len(GPUS) - 1)


class Node(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pods: dict[str, str] = {}  # device-plugin pod -> the GPU the kubelet allocated it
        self.claims: dict[str, PreparedClaim] = {}  # the DRA checkpoint: uid -> record
        self.reading: dict[str, tuple[str, bool]] = {}  # Prepares that read their claim: uid -> (GPU, admin)
        self.processes: dict[str, set[int]] = {}
        self.wanted: set[str] = set()  # the config's dra.gpus
        self.arriving: set[str] = set()  # withdrawn from the device plugin, waiting to be free
        self.kubelet_down = False
        self.next_id = 0
        self.acted_under: list[str] = []  # destructive steps done while something held the GPU
        self.ledger = DeviceLedger(Path("/nonexistent"), pod_resources=self._pod_resources, processes=self._nvml)
        self.ledger.inventory = Inventory("", "", None, GPUS, ())
        self.ledger.attach_claims(lambda: Checkpoint("boot", dict(self.claims)), POOL)

    # ----- the outside world, as the ledger reads it --------------------------------------------------------------

    def _pod_resources(self) -> PodAllocations:
        if self.kubelet_down:
            raise PodResourcesError("the kubelet's PodResources socket does not exist (it restarts)")
        devices = {
            f"{gpu}::{pod}": DeviceHolder("default", pod, "main", "nvidia.com/gpu") for pod, gpu in self.pods.items()
        }
        return PodAllocations(devices, {})

    def _nvml(self, uuids: object, exclude: object) -> dict[str, tuple[int, ...]]:
        if self.kubelet_down and self.next_id % 7 == 0:
            raise ProcessesUnknown("NVML_ERROR_UNKNOWN")
        return {uuid: tuple(sorted(self.processes.get(uuid, ()))) for uuid in uuids}  # type: ignore[attr-defined]

    def _uid(self) -> str:
        self.next_id += 1
        return f"3d3c9b1e-0000-4000-8000-{self.next_id:012d}"

    def _recorded(self, gpu: str, *, admin: bool = True) -> bool:
        """A claim recorded in the checkpoint (being prepared or prepared) holds a device of ``gpu``."""
        return any(
            UUIDS[int(d.device.removeprefix("gpu-"))] == gpu and (admin or not d.admin_access)
            for c in self.claims.values()
            for d in c.devices
        )

    def _advertised_by_device_plugin(self, gpu: str) -> bool:
        return gpu not in self.ledger.dra_gpus() and gpu not in self.arriving

    # ----- the kubelet's device manager -----------------------------------------------------------------------------

    @rule(index=gpu_index)
    def device_plugin_pod_starts(self, index: int) -> None:
        gpu = UUIDS[index]
        if self._advertised_by_device_plugin(gpu):  # the kubelet allocates only what ListAndWatch offers
            self.pods[f"pod-{self._uid()[-4:]}"] = gpu

    @precondition(lambda self: self.pods)
    @rule(data=st.data())
    def device_plugin_pod_ends(self, data: st.DataObject) -> None:
        del self.pods[data.draw(st.sampled_from(sorted(self.pods)))]

    @rule(index=gpu_index, start=st.booleans())
    def a_process_starts_or_ends(self, index: int, start: bool) -> None:
        pids = self.processes.setdefault(UUIDS[index], set())
        if start:
            pids.add(1000 + self.next_id)
        elif pids:
            pids.pop()

    @rule()
    def kubelet_restarts(self) -> None:
        self.kubelet_down = not self.kubelet_down

    # ----- the scheduler and the DRA kubelet ------------------------------------------------------------------------

    @rule(index=gpu_index, admin=st.booleans())
    def a_prepare_reads_its_claim(self, index: int, admin: bool) -> None:
        """The scheduler allocated a device DRA offered; the Prepare reads the claim (outside any lock)."""
        gpu = UUIDS[index]
        offered = gpu in self.ledger.dra_gpus() and gpu in self.wanted
        allocated = any(g == gpu and not a for g, a in self.reading.values()) or self._recorded(gpu, admin=False)
        if offered and (admin or not allocated):  # the scheduler gives a whole GPU to one claim (admin access aside)
            self.reading[self._uid()] = (gpu, admin)

    @precondition(lambda self: self.reading)
    @rule(data=st.data())
    def the_prepare_records_prepare_started(self, data: st.DataObject) -> None:
        """``ClaimWorker._prepare``: in the ledger's section, its GPU must still be DRA's; then PrepareStarted."""
        uid = data.draw(st.sampled_from(sorted(self.reading)))
        gpu, admin = self.reading.pop(uid)
        with self.ledger.reserving([gpu]) as foreign:
            if foreign:
                return  # refused: the GPU went back to the device plugin meanwhile
            device = PreparedDevice(POOL, f"gpu-{UUIDS.index(gpu)}", ("gpu",), admin_access=admin)
            self.claims[uid] = PreparedClaim(PREPARE_STARTED, "default", f"claim-{uid[-4:]}", (device,))

    @precondition(lambda self: any(c.state == PREPARE_STARTED for c in self.claims.values()))
    @rule(data=st.data())
    def the_prepare_completes(self, data: st.DataObject) -> None:
        uid = data.draw(st.sampled_from(sorted(u for u, c in self.claims.items() if c.state == PREPARE_STARTED)))
        claim = self.claims[uid]
        self.claims[uid] = PreparedClaim(PREPARE_COMPLETED, claim.namespace, claim.name, claim.devices)

    @precondition(lambda self: self.claims)
    @rule(data=st.data())
    def a_claim_is_unprepared(self, data: st.DataObject) -> None:
        del self.claims[data.draw(st.sampled_from(sorted(self.claims)))]

    # ----- the config and the reconcile loop ------------------------------------------------------------------------

    @rule(index=gpu_index, to_dra=st.booleans())
    def the_config_moves_a_gpu(self, index: int, to_dra: bool) -> None:
        gpu = UUIDS[index]
        if to_dra:
            self.wanted.add(gpu)
            if gpu not in self.ledger.dra_gpus():
                self.arriving.add(gpu)  # withdrawn from ListAndWatch at once
        else:
            self.wanted.discard(gpu)
            self.arriving.discard(gpu)

    @precondition(lambda self: self.arriving)
    @rule(data=st.data())
    def a_worker_checks_an_arriving_gpu(self, data: st.DataObject) -> None:
        gpu = data.draw(st.sampled_from(sorted(self.arriving)))
        if not self.ledger.take_for_dra(gpu, Drain(frozenset({gpu}), frozenset({gpu}))):
            self.arriving.discard(gpu)

    @rule()
    def the_loop_settles_leaving_gpus(self) -> None:
        self.ledger.release_from_dra(self.ledger.dra_gpus() - self.wanted)

    @rule(index=gpu_index, step=st.sampled_from(["MIG mode", "destroy a MIG device", "compute mode", "MPS quit"]))
    def a_destructive_step(self, index: int, step: str) -> None:
        gpu = UUIDS[index]
        with self.ledger.acting(Drain(frozenset({gpu}), frozenset({gpu}))) as busy:
            if busy:
                return
            holders = [p for p, g in self.pods.items() if g == gpu]
            if holders or self._recorded(gpu) or self.processes.get(gpu):  # a claim only read has done nothing yet
                self.acted_under.append(f"{step} on {gpu} under {holders or 'a claim or a process'}")

    # ----- what must always hold -----------------------------------------------------------------------------------

    @invariant()
    def no_destructive_step_under_a_holder(self) -> None:
        assert self.acted_under == []

    @invariant()
    def no_gpu_is_held_through_both_front_ends(self) -> None:
        for gpu in UUIDS:
            pods = [p for p, g in self.pods.items() if g == gpu]
            recorded = any(
                UUIDS[int(d.device.removeprefix("gpu-"))] == gpu for c in self.claims.values() for d in c.devices
            )
            assert not (pods and recorded), f"{gpu}: device-plugin pods {pods} and a DRA claim"

    @invariant()
    def every_recorded_claim_is_on_a_gpu_dra_serves(self) -> None:
        for claim in self.claims.values():
            for device in claim.devices:
                assert UUIDS[int(device.device.removeprefix("gpu-"))] in self.ledger.dra_gpus()

    @invariant()
    def a_gpu_dra_serves_has_no_device_plugin_pod(self) -> None:
        assert not {g for g in self.pods.values()} & self.ledger.dra_gpus()


Node.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestLedgerInterleavings = Node.TestCase


def test_the_race_the_reviewer_found_is_one_of_the_interleavings() -> None:
    """Issue 24, defect 2, step by step: the config takes GPU 0 from DRA while a Prepare reads its claim."""
    node = Node()
    node.the_config_moves_a_gpu(0, to_dra=True)
    node.a_worker_checks_an_arriving_gpu(_Drawn(UUIDS[0]))  # type: ignore[arg-type]
    node.a_prepare_reads_its_claim(0, admin=False)
    node.the_config_moves_a_gpu(0, to_dra=False)
    node.the_loop_settles_leaving_gpus()
    assert UUIDS[0] not in node.ledger.dra_gpus()  # the device plugin offers it again
    (uid,) = node.reading
    node.the_prepare_records_prepare_started(_Drawn(uid))  # type: ignore[arg-type]
    assert node.claims == {}  # refused: it would be the second front end holding GPU 0
    node.every_recorded_claim_is_on_a_gpu_dra_serves()


class _Drawn:
    """``st.data()`` for a step called by hand: draws the one value it was given."""

    def __init__(self, value: object) -> None:
        self.value = value

    def draw(self, strategy: object) -> object:
        return self.value
