"""The simulated GPU driver: node state and the hardware's rules, in plain Python.

``SimDriver`` is what ``libnvidia-ml.so.1`` would talk to: GPUs, MIG GPU and compute instances, processes,
events, memory health. Its operations raise ``NvmlFault`` with a real ``nvmlReturn_t`` code wherever the
real driver fails, and ``libnvml`` turns them into return codes for pynvml. Tests drive it through its
control methods (``add_process``, ``inject_xid``, ``lose_gpu``, ``fail_init``, ``set_fault_rate``,
``set_health_signals`` ...), never through the agent, and read back what the agent did to the node
through ``destructive_calls``.

All state sits behind one lock; ``wait_event`` sleeps on a condition of that lock, so the event thread
of the agent blocks exactly as it would in ``nvmlEventSetWait``.
"""

from __future__ import annotations

import itertools
import os
import random
import threading
import time
import uuid as uuidlib
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

import msgspec

from agent.sim.nvml.codes import (
    ARCH_AMPERE,
    COMPUTE_MODES,
    ECC_COUNTER_AGGREGATE,
    ECC_COUNTER_VOLATILE,
    EVENT_CLOCK,
    EVENT_DOUBLE_BIT_ECC,
    EVENT_MIG_CONFIG_CHANGE,
    EVENT_PSTATE,
    EVENT_SINGLE_BIT_ECC,
    EVENT_XID_CRITICAL,
    FI_ECC_CURRENT,
    FI_ECC_DBE_AGG_TOTAL,
    FI_ECC_DBE_VOL_TOTAL,
    FI_ECC_PENDING,
    FI_ECC_SBE_AGG_TOTAL,
    FI_ECC_SBE_VOL_TOTAL,
    FI_GPU_RECOVERY_ACTION,
    FI_REMAPPED_COR,
    FI_REMAPPED_FAILURE,
    FI_REMAPPED_PENDING,
    FI_REMAPPED_UNC,
    FI_RETIRED_DBE,
    FI_RETIRED_PENDING,
    FI_RETIRED_SBE,
    GPU_INSTANCE_PROFILE_COUNT,
    INVALID_INSTANCE_ID,
    MEMORY_ERROR_CORRECTED,
    MEMORY_ERROR_UNCORRECTED,
    RECOVERY_ACTION_MIN_DRIVER,
    VALUE_TYPE_UINT,
    VALUE_TYPE_ULONGLONG,
    XID_FALLEN_OFF_THE_BUS,
    Return,
)
from agent.sim.nvml.hardware import CiProfile, GiProfile, GpuModel

_UUID_NAMESPACE = uuidlib.UUID("5d1e4c1e-7e55-4e7a-9a3c-7e55e7a0c0de")
EVENT_QUEUE_LIMIT = 4096  # per event set; the oldest events are dropped past it, as a bounded kernel queue would
DESTRUCTIVE_LOG_LIMIT = 100_000  # destructive calls remembered; the oldest are dropped past it

PROCESS_KINDS = ("compute", "mps_server", "mps_client")
SAMPLE_BUFFER_SECONDS = 30.0  # how far back per-process utilization goes when asked with lastSeenTimeStamp 0
Load = tuple[int, int, int, int]  # per-process utilization in percent: SM, memory, encoder, decoder
_IDLE: Load = (0, 0, 0, 0)
COMPUTE_LIST_KINDS = frozenset({"compute", "mps_server"})  # nvmlDeviceGetComputeRunningProcesses: the MPS server too
MPS_LIST_KINDS = frozenset({"mps_client"})  # nvmlDeviceGetMPSComputeRunningProcesses: only the MPS clients

_INIT_SYMBOLS = frozenset({"nvmlInit", "nvmlInit_v2", "nvmlInitWithFlags"})
_NEVER_FAULTED = frozenset({"nvmlShutdown", "nvmlErrorString"})
_UINT32_MAX = 0xFFFFFFFF
_MIB = 1 << 20
MEMORY_LIMITS_MIN_DRIVER = 615  # nvmlDeviceSet/GetMemoryLimits_v1 came with driver r615 (CUDA 13.4)
MEMORY_LIMIT_MAX = 0xFFFFFFFFFFFFFFFF  # NVML_DEVICE_MEMORY_LIMIT_MAX: no limit


class NvmlFault(Exception):
    """A failure the real driver would report with ``code``."""

    def __init__(self, code: Return, detail: str = "") -> None:
        super().__init__(f"{code.name}: {detail}" if detail else code.name)
        self.code = code


class OutOfMemory(Exception):
    """A simulated process's allocation the driver refused (``CUDA_ERROR_OUT_OF_MEMORY`` in the process)."""


@dataclass(frozen=True, slots=True)
class MemoryLimit:
    """What ``nvmlDeviceSetMemoryLimits_v1`` set on one cgroup for one GPU (bytes)."""

    soft: int
    hard: int
    set_at: float = field(default=0.0, compare=False)  # time.monotonic() of the call that set it


class SimComputeInstance(msgspec.Struct, eq=False):
    id: int
    profile: CiProfile
    placement: tuple[int, int]
    uuid: str
    compute_mode: int = 0


class SimGpuInstance(msgspec.Struct, eq=False):
    id: int
    profile: GiProfile
    placement: tuple[int, int]
    cis: dict[int, SimComputeInstance] = msgspec.field(default_factory=dict)

    def memory_slices(self) -> set[int]:
        start, size = self.placement
        return set(range(start, start + size))


class SimProcess(msgspec.Struct, eq=False):
    pid: int
    used_mib: int
    gi_id: int = INVALID_INSTANCE_ID
    ci_id: int = INVALID_INSTANCE_ID
    kind: str = "compute"  # one of PROCESS_KINDS
    started: float = msgspec.field(default_factory=time.time)  # wall clock, as NVML's sample timestamps
    loads: list[tuple[float, Load]] = msgspec.field(default_factory=list)  # (since, load), oldest first; none: idle
    ended: float | None = None  # set when it exits; its samples stay in the driver's buffer a while
    cgroup: str | None = None  # its cgroup (v2) directory, as a full path; None: not in any container

    def load_at(self, when: float) -> Load:
        current = _IDLE
        for since, load in self.loads:
            if since > when:
                break
            current = load
        return current

    def sample(self, since: float, until: float) -> tuple[float, Load] | None:
        """(timestamp of its last busy moment, mean load) over ``(since, until]``; None when it did no work then.

        This is what one ``nvmlProcessUtilizationSample_t`` carries: only a process with some non-zero
        utilization in the window is listed, stamped with the CPU time of its sample."""
        start, end = max(since, self.started), until if self.ended is None else min(until, self.ended)
        if end <= start or not self.loads:
            return None
        totals = [0.0, 0.0, 0.0, 0.0]
        last_busy: float | None = None
        edges = [t for t, _ in self.loads if start < t < end]
        points = [start, *edges, end]
        for left, right in itertools.pairwise(points):
            load = self.load_at(left)
            if any(load) and right - left >= 1e-6:  # finer than NVML's µs timestamps: not a sample of its own
                last_busy = right
                for n in range(4):
                    totals[n] += load[n] * (right - left)
        if last_busy is None:
            return None
        span = end - start
        return last_busy, tuple(round(total / span) for total in totals)  # type: ignore[return-value]


class SimGpu(msgspec.Struct, eq=False):
    index: int
    model: GpuModel
    uuid: str
    pci_bus_id: str  # "00000000:07:00.0"
    minor_number: int
    numa_node: int
    pcie_switch: int
    serial: str
    mig_current: bool = False
    mig_pending: bool = False
    mig_needs_reset: bool = False  # a MIG mode change only takes effect at the next GPU reset
    compute_mode: int = 0
    timeslice: int = 0  # nvidia-smi compute-policy --set-timeslice: 0 Default, 1 Short, 2 Medium, 3 Long
    gis: dict[int, SimGpuInstance] = msgspec.field(default_factory=dict)
    processes: dict[int, SimProcess] = msgspec.field(default_factory=dict)
    exited: list[SimProcess] = msgspec.field(default_factory=list)  # recently ended, still in the sample buffer
    utilization: tuple[int, int] | None = None  # set_utilization's override; None: from the processes' loads
    lost: bool = False
    nvlink_peers: frozenset[int] = frozenset()
    nvswitch: bool = False
    mig_generation: int = 0  # counts compute instances ever created, so MIG UUIDs are new on re-creation
    # memory health (facts gpu-health §2.1, §2.2)
    recovery_action: int | None = 0  # NVML_GPU_RECOVERY_ACTION_*; None: the field is not supported
    remapped_rows_pending: bool = False
    remapped_rows_failure: bool = False
    remapped_rows_correctable: int = 0
    remapped_rows_uncorrectable: int = 0
    retired_pages_pending: bool = False
    ecc_uncorrected_volatile: int = 0
    ecc_uncorrected_aggregate: int = 0  # lifetime; grows with the volatile count, survives its reset

    def mig_devices(self) -> list[tuple[SimGpuInstance, SimComputeInstance]]:
        """MIG devices in index order: by GPU instance id, then compute instance id."""
        devices = []
        for gi_id in sorted(self.gis):
            gi = self.gis[gi_id]
            devices += [(gi, gi.cis[ci_id]) for ci_id in sorted(gi.cis)]
        return devices

    def used_memory_slices(self) -> set[int]:
        return set().union(*(gi.memory_slices() for gi in self.gis.values())) if self.gis else set()

    def processes_in_gi(self, gi_id: int) -> int:
        return sum(1 for p in self.processes.values() if p.gi_id == gi_id)

    @property
    def remaps_rows(self) -> bool:
        """Ampere and newer repair memory by row remapping; older GPUs retire pages instead."""
        return self.model.architecture_id >= ARCH_AMPERE


class SimEventSet(msgspec.Struct, eq=False):
    registrations: dict[int, int] = msgspec.field(default_factory=dict)  # GPU index -> event mask
    queue: deque[SimEvent] = msgspec.field(default_factory=lambda: deque(maxlen=EVENT_QUEUE_LIMIT))
    freed: bool = False


class SimEvent(msgspec.Struct, frozen=True):
    gpu_index: int
    event_type: int
    data: int
    gi_id: int = INVALID_INSTANCE_ID
    ci_id: int = INVALID_INSTANCE_ID


class DestructiveCall(msgspec.Struct, frozen=True):
    """One call that could destroy work, as the driver saw it when it arrived.

    ``processes`` counts processes of any kind on the affected scope at that moment: the whole GPU for a
    MIG mode change, a GPU compute mode change or a reset; the GPU instance for a destroy or a MIG device's
    compute mode. Refused calls are recorded too, with the code they failed with in ``result``.
    """

    symbol: str  # the C symbol, or "reset_gpu" (a reset is not an NVML call)
    gpu_index: int
    target: str  # GPU UUID, or the MIG UUID of a compute instance
    processes: int
    at: float  # time.monotonic()
    result: Return = Return.SUCCESS
    gpu_instance_id: int | None = None


class _InjectedFault(msgspec.Struct):
    symbol: str
    code: Return
    remaining: int | None  # None: until cleared
    gpu_index: int | None


class _InitFailure(msgspec.Struct):
    code: Return
    remaining: int | None  # None: until fail_init(None)


class _FaultRate(msgspec.Struct):
    rate: float
    code: Return
    symbols: frozenset[str] | None  # None: every symbol but nvmlInit
    rng: random.Random

    def applies_to(self, symbol: str) -> bool:
        if symbol in _NEVER_FAULTED:
            return False
        if self.symbols is None:
            return symbol not in _INIT_SYMBOLS
        return symbol in self.symbols or (symbol in _INIT_SYMBOLS and "nvmlInit" in self.symbols)


class _Keep(Enum):
    """A keyword left out of ``set_health_signals`` (None means something there)."""

    KEEP = 0


def gpu_uuid(node_name: str, index: int) -> str:
    return f"GPU-{uuidlib.uuid5(_UUID_NAMESPACE, f'{node_name}/gpu/{index}')}"


def gi_id_for_placement(model: GpuModel, start: int, size: int) -> int:
    """GPU instance ids follow the placement (recent drivers): a binary tree over the memory slices.

    On 8-slice GPUs 8-wide is 0, 4-wide 1 + start/4, 2-wide 3 + start/2, 1-wide 7 + start.
    """
    return model.memory_slices // size - 1 + start // size


class SimDriver:
    """A node's GPUs under the hardware's rules."""

    def __init__(
        self,
        gpus: Iterable[SimGpu],
        *,
        driver_version: str = "580.95.05",
        cuda_driver_version: int = 13000,
    ) -> None:
        self.gpus: list[SimGpu] = list(gpus)
        self.driver_version = driver_version
        self.nvml_version = f"13.{driver_version}"
        self.cuda_driver_version = cuda_driver_version
        self.lock = threading.RLock()
        self._event_ready = threading.Condition(self.lock)
        self._event_sets: list[SimEventSet] = []
        self._faults: list[_InjectedFault] = []
        self._stalls: dict[str, float] = {}  # C function -> seconds its next call blocks before it runs
        self._init_failure: _InitFailure | None = None
        self._fault_rate: _FaultRate | None = None
        self._hidden_gi_profiles: set[int] = set()
        self._destructive_calls: deque[DestructiveCall] = deque(maxlen=DESTRUCTIVE_LOG_LIMIT)
        self._uuid_index: dict[str, tuple[SimGpu, SimGpuInstance | None, SimComputeInstance | None]] = {}
        self._exit_after_listing: dict[int, Callable[[], None] | None] = {}
        self.init_count = 0
        self.random_faults = 0  # calls failed by set_fault_rate so far
        self.caller_is_root = True  # set_caller_root(False): privileged calls fail with NO_PERMISSION
        self._memory_limits: dict[tuple[int, str], MemoryLimit] = {}  # (GPU index, cgroup directory) -> limit
        self.memory_limit_sets = 0  # successful nvmlDeviceSetMemoryLimits_v1 calls so far
        self.memory_limit_reads: Counter[str] = Counter()  # cgroup directory -> nvmlDeviceGetMemoryLimits_v1 answers
        self.calls: Counter[str] = Counter()  # C symbol -> the calls the library took (failed ones too), after init

    @property
    def faults_armed(self) -> bool:
        """Whether any call may fail or stall on purpose (``inject_error``, ``set_fault_rate``, ``stall``).

        Read without the lock: the library skips the fault bookkeeping of every call while it is False,
        which is what that bookkeeping would find anyway.
        """
        return bool(self._faults) or self._fault_rate is not None or bool(self._stalls)

    # ----- lookups -------------------------------------------------------------------------------

    def gpu(self, index: int) -> SimGpu:
        """The GPU at ``index``; a lost GPU fails every call with GPU_IS_LOST."""
        if not 0 <= index < len(self.gpus):
            raise NvmlFault(Return.ERROR_INVALID_ARGUMENT, f"no GPU {index}")
        gpu = self.gpus[index]
        if gpu.lost:
            raise NvmlFault(Return.ERROR_GPU_IS_LOST, f"GPU {index} has fallen off the bus")
        return gpu

    def mig_gpu(self, index: int) -> SimGpu:
        """A GPU for a GPU/compute instance call: MIG capable and MIG enabled, else NOT_SUPPORTED."""
        gpu = self.gpu(index)
        if not gpu.model.mig_capable or not gpu.mig_current:
            raise NvmlFault(Return.ERROR_NOT_SUPPORTED, f"MIG is not enabled on GPU {index}")
        return gpu

    def find_uuid(self, uuid: str) -> tuple[int, SimGpuInstance | None, SimComputeInstance | None]:
        """The GPU (and MIG device) with ``uuid``.

        An index remembers where each UUID was last found; a hit counts only while that device still sits
        there (MIG devices come and go, tests edit the node), otherwise the node is searched again.
        """
        hit = self._uuid_index.get(uuid)
        if hit is not None and self._still_there(uuid, *hit):
            gpu, gi, ci = hit
            self.gpu(gpu.index)
            return gpu.index, gi, ci
        for gpu in self.gpus:
            if gpu.uuid == uuid:
                self._uuid_index[uuid] = (gpu, None, None)
                self.gpu(gpu.index)
                return gpu.index, None, None
            for gi, ci in gpu.mig_devices():
                if ci.uuid == uuid:
                    self._uuid_index[uuid] = (gpu, gi, ci)
                    self.gpu(gpu.index)
                    return gpu.index, gi, ci
        self._uuid_index.pop(uuid, None)
        raise NvmlFault(Return.ERROR_NOT_FOUND, f"no device with UUID {uuid}")

    def _still_there(self, uuid: str, gpu: SimGpu, gi: SimGpuInstance | None, ci: SimComputeInstance | None) -> bool:
        index = gpu.index
        if not 0 <= index < len(self.gpus) or self.gpus[index] is not gpu:
            return False
        if gi is None or ci is None:
            return gpu.uuid == uuid
        return ci.uuid == uuid and gpu.gis.get(gi.id) is gi and gi.cis.get(ci.id) is ci

    def find_bus_id(self, bus_id: str) -> int:
        wanted = _normalise_bus_id(bus_id)
        for gpu in self.gpus:
            if _normalise_bus_id(gpu.pci_bus_id) == wanted:
                return self.gpu(gpu.index).index
        raise NvmlFault(Return.ERROR_NOT_FOUND, f"no GPU at {bus_id}")

    def live_gi(self, gpu_index: int, gi: SimGpuInstance) -> SimGpuInstance:
        """Check that a GPU instance handle still names a live instance (handles die with it)."""
        gpu = self.mig_gpu(gpu_index)
        if gpu.gis.get(gi.id) is not gi:
            raise NvmlFault(Return.ERROR_INVALID_ARGUMENT, "stale GPU instance handle")
        return gi

    def live_ci(self, gpu_index: int, gi: SimGpuInstance, ci: SimComputeInstance) -> SimComputeInstance:
        self.live_gi(gpu_index, gi)
        if gi.cis.get(ci.id) is not ci:
            raise NvmlFault(Return.ERROR_INVALID_ARGUMENT, "stale compute instance handle")
        return ci

    # ----- MIG mode ------------------------------------------------------------------------------

    def set_mig_mode(self, index: int, enabled: bool) -> Return:
        """Request a MIG mode; returns the activation status (an NVML code that pynvml does not raise).

        The change applies at once when the GPU is idle and can be reset in place; otherwise it stays
        pending until ``reset_gpu``. Changing the mode destroys every GPU and compute instance.
        """
        with self.lock:
            gpu = self.gpu(index)
            if not gpu.model.mig_capable:
                raise NvmlFault(Return.ERROR_NOT_SUPPORTED, f"GPU {index} ({gpu.model.nvml_name}) is not MIG capable")
            before, processes = (gpu.mig_current, gpu.mig_pending), len(gpu.processes)
            status = self._request_mig_mode(gpu, enabled)
            if (gpu.mig_current, gpu.mig_pending) != before:
                self._log_destructive("nvmlDeviceSetMigMode", gpu, gpu.uuid, processes, status)
            return status

    def _request_mig_mode(self, gpu: SimGpu, enabled: bool) -> Return:
        gpu.mig_pending = enabled
        if gpu.mig_current == enabled:
            return Return.SUCCESS
        if gpu.processes:
            return Return.ERROR_IN_USE
        if gpu.mig_needs_reset:
            return Return.ERROR_RESET_REQUIRED
        self._activate_mig_mode(gpu)
        return Return.SUCCESS

    def _activate_mig_mode(self, gpu: SimGpu) -> None:
        gpu.mig_current = gpu.mig_pending
        gpu.gis.clear()
        gpu.compute_mode = 0
        self._emit(gpu.index, EVENT_MIG_CONFIG_CHANGE, 0)

    def reset_gpu(self, index: int) -> None:
        """``nvidia-smi -r``: refused while any process runs on the GPU (``IN_USE``).

        A reset destroys every GPU and compute instance (MIG devices come back with new UUIDs when they
        are created again), puts the compute mode back to DEFAULT, applies a pending MIG mode, carries
        out pending row remaps and page retirements, and clears the recovery action.
        """
        with self.lock:
            gpu = self.gpu(index)
            with self._destructive("reset_gpu", gpu, gpu.uuid, len(gpu.processes)):
                if gpu.processes:
                    raise NvmlFault(Return.ERROR_IN_USE, f"GPU {index} has running processes")
                self._reset(gpu)

    def _reset(self, gpu: SimGpu) -> None:
        if gpu.mig_current != gpu.mig_pending:
            self._activate_mig_mode(gpu)
        elif gpu.gis:
            gpu.gis.clear()
            self._emit(gpu.index, EVENT_MIG_CONFIG_CHANGE, 0)
        gpu.compute_mode = 0
        gpu.timeslice = 0
        gpu.utilization = None
        if gpu.recovery_action is not None:
            gpu.recovery_action = 0
        gpu.remapped_rows_pending = False
        gpu.retired_pages_pending = False

    # ----- GPU instances -------------------------------------------------------------------------

    def gi_profile_by_index(self, index: int, profile_index: int) -> GiProfile:
        gpu = self.gpu(index)
        if profile_index >= GPU_INSTANCE_PROFILE_COUNT or profile_index < 0:
            raise NvmlFault(Return.ERROR_INVALID_ARGUMENT, f"profile index {profile_index} out of range")
        if profile_index in self._hidden_gi_profiles:
            raise NvmlFault(Return.ERROR_INVALID_ARGUMENT, f"profile index {profile_index} is unknown here")
        gpu = self.mig_gpu(index)
        profile = gpu.model.gi_profile_by_index(profile_index)
        if profile is None:
            raise NvmlFault(Return.ERROR_NOT_SUPPORTED, f"{gpu.model.nvml_name} has no profile index {profile_index}")
        return profile

    def gi_profile_by_id(self, index: int, profile_id: int, *, need_mig: bool = True) -> GiProfile:
        gpu = self.mig_gpu(index) if need_mig else self.gpu(index)
        if not gpu.model.mig_capable:
            raise NvmlFault(Return.ERROR_NOT_SUPPORTED, f"GPU {index} is not MIG capable")
        profile = gpu.model.gi_profile_by_id(profile_id)
        if profile is None:
            raise NvmlFault(Return.ERROR_INVALID_ARGUMENT, f"{gpu.model.nvml_name} has no GI profile id {profile_id}")
        return profile

    def gi_possible_placements(self, index: int, profile_id: int) -> list[tuple[int, int]]:
        """Every placement of the profile, occupied or not; answers even while MIG is off."""
        return list(self.gi_profile_by_id(index, profile_id, need_mig=False).placements)

    def gi_remaining_capacity(self, index: int, profile_id: int) -> int:
        with self.lock:
            gpu = self.mig_gpu(index)
            profile = self.gi_profile_by_id(index, profile_id)
            return _remaining(gpu, profile, gpu.used_memory_slices(), _me_used(gpu))

    def create_gpu_instance(
        self, index: int, profile_id: int, placement: tuple[int, int] | None = None
    ) -> SimGpuInstance:
        """Create a GPU instance, at ``placement`` or where this driver would put it."""
        with self.lock:
            gpu = self.mig_gpu(index)
            profile = self.gi_profile_by_id(index, profile_id)
            used = gpu.used_memory_slices()
            if placement is not None and placement not in profile.placements:
                raise NvmlFault(Return.ERROR_INVALID_ARGUMENT, f"{placement} is not a placement of {profile.name}")
            if _remaining(gpu, profile, used, _me_used(gpu)) == 0:
                raise NvmlFault(Return.ERROR_INSUFFICIENT_RESOURCES, f"no room for {profile.name} on GPU {index}")
            if placement is None:
                placement = _default_placement(gpu, profile, used)
            elif not _is_free(placement, used):
                raise NvmlFault(Return.ERROR_INSUFFICIENT_RESOURCES, f"placement {placement} is occupied")
            if placement is None:
                raise NvmlFault(Return.ERROR_INSUFFICIENT_RESOURCES, f"no free placement for {profile.name}")
            gi = SimGpuInstance(gi_id_for_placement(gpu.model, *placement), profile, placement)
            gpu.gis[gi.id] = gi
            self._emit(index, EVENT_MIG_CONFIG_CHANGE, 0)
            return gi

    def destroy_gpu_instance(self, index: int, gi: SimGpuInstance) -> None:
        with self.lock:
            gpu = self.mig_gpu(index)
            self.live_gi(index, gi)
            processes = gpu.processes_in_gi(gi.id)
            with self._destructive("nvmlGpuInstanceDestroy", gpu, gpu.uuid, processes, gi.id):
                if gi.cis:
                    raise NvmlFault(Return.ERROR_IN_USE, f"GPU instance {gi.id} still has compute instances")
                if processes:
                    raise NvmlFault(Return.ERROR_IN_USE, f"GPU instance {gi.id} has running processes")
                del gpu.gis[gi.id]
                self._emit(index, EVENT_MIG_CONFIG_CHANGE, 0)

    def gpu_instances(self, index: int, profile_id: int) -> list[SimGpuInstance]:
        with self.lock:
            gpu = self.mig_gpu(index)
            self.gi_profile_by_id(index, profile_id)
            return [gpu.gis[i] for i in sorted(gpu.gis) if gpu.gis[i].profile.id == profile_id]

    def gpu_instance_by_id(self, index: int, gi_id: int) -> SimGpuInstance:
        with self.lock:
            gpu = self.mig_gpu(index)
            if gi_id not in gpu.gis:
                raise NvmlFault(Return.ERROR_NOT_FOUND, f"no GPU instance {gi_id} on GPU {index}")
            return gpu.gis[gi_id]

    # ----- compute instances ---------------------------------------------------------------------

    def ci_profile_by_index(self, index: int, gi: SimGpuInstance, profile_index: int) -> CiProfile:
        self.live_gi(index, gi)
        if not 0 <= profile_index < 9:
            raise NvmlFault(Return.ERROR_INVALID_ARGUMENT, f"CI profile index {profile_index} out of range")
        profile = next((p for p in gi.profile.ci_profiles if p.index == profile_index), None)
        if profile is None:
            raise NvmlFault(Return.ERROR_NOT_SUPPORTED, f"{gi.profile.name} has no CI profile index {profile_index}")
        return profile

    def ci_profile_by_id(self, index: int, gi: SimGpuInstance, profile_id: int) -> CiProfile:
        self.live_gi(index, gi)
        profile = next((p for p in gi.profile.ci_profiles if p.id == profile_id), None)
        if profile is None:
            raise NvmlFault(Return.ERROR_INVALID_ARGUMENT, f"{gi.profile.name} has no CI profile id {profile_id}")
        return profile

    def ci_remaining_capacity(self, index: int, gi: SimGpuInstance, profile_id: int) -> int:
        with self.lock:
            profile = self.ci_profile_by_id(index, gi, profile_id)
            free = len(_free_ci_placements(gi, profile))
            return max(0, min(profile.instance_count - _ci_count(gi, profile), free))

    def create_compute_instance(
        self, index: int, gi: SimGpuInstance, profile_id: int, placement: tuple[int, int] | None = None
    ) -> SimComputeInstance:
        with self.lock:
            gpu = self.mig_gpu(index)
            profile = self.ci_profile_by_id(index, gi, profile_id)
            free = _free_ci_placements(gi, profile)
            if _ci_count(gi, profile) >= profile.instance_count or not free:
                raise NvmlFault(Return.ERROR_INSUFFICIENT_RESOURCES, f"no room for the CI in GPU instance {gi.id}")
            if placement is None:
                placement = free[0]
            elif placement not in profile.placements:
                raise NvmlFault(Return.ERROR_INVALID_ARGUMENT, f"{placement} is not a CI placement")
            elif placement not in free:
                raise NvmlFault(Return.ERROR_INSUFFICIENT_RESOURCES, f"CI placement {placement} is occupied")
            ci_id = next(i for i in range(len(gi.cis) + 1) if i not in gi.cis)
            gpu.mig_generation += 1
            mig_uuid = f"MIG-{uuidlib.uuid5(_UUID_NAMESPACE, f'{gpu.uuid}/mig/{gpu.mig_generation}')}"
            ci = SimComputeInstance(ci_id, profile, placement, mig_uuid)
            gi.cis[ci_id] = ci
            self._emit(index, EVENT_MIG_CONFIG_CHANGE, 0)
            return ci

    def destroy_compute_instance(self, index: int, gi: SimGpuInstance, ci: SimComputeInstance) -> None:
        with self.lock:
            gpu = self.mig_gpu(index)
            self.live_ci(index, gi, ci)
            processes = gpu.processes_in_gi(gi.id)
            with self._destructive("nvmlComputeInstanceDestroy", gpu, ci.uuid, processes, gi.id):
                if any(p.gi_id == gi.id and p.ci_id == ci.id for p in gpu.processes.values()):
                    raise NvmlFault(Return.ERROR_IN_USE, f"compute instance {gi.id}/{ci.id} has running processes")
                del gi.cis[ci.id]
                self._emit(index, EVENT_MIG_CONFIG_CHANGE, 0)

    def compute_instances(self, index: int, gi: SimGpuInstance, profile_id: int) -> list[SimComputeInstance]:
        with self.lock:
            self.ci_profile_by_id(index, gi, profile_id)
            return [gi.cis[i] for i in sorted(gi.cis) if gi.cis[i].profile.id == profile_id]

    def compute_instance_by_id(self, index: int, gi: SimGpuInstance, ci_id: int) -> SimComputeInstance:
        with self.lock:
            self.live_gi(index, gi)
            if ci_id not in gi.cis:
                raise NvmlFault(Return.ERROR_NOT_FOUND, f"no compute instance {ci_id} in GPU instance {gi.id}")
            return gi.cis[ci_id]

    def max_mig_device_count(self, index: int) -> int:
        gpu = self.gpu(index)
        return gpu.model.max_gpu_instances if gpu.model.mig_capable and gpu.mig_current else 0

    # ----- compute mode, processes, utilization ---------------------------------------------------

    def set_timeslice(self, index: int, level: int) -> None:
        """``nvidia-smi compute-policy --set-timeslice``: the GPU's time-slice for contexts sharing it."""
        with self.lock:
            gpu = self.gpu(index)
            if level not in (0, 1, 2, 3):
                raise NvmlFault(Return.ERROR_INVALID_ARGUMENT, f"time-slice {level} is not one of 0-3")
            if gpu.mig_current:
                raise NvmlFault(Return.ERROR_NOT_SUPPORTED, "the time-slice of a GPU in MIG mode cannot be set")
            gpu.timeslice = level

    def set_compute_mode(self, index: int, mode: int, ci: SimComputeInstance | None = None) -> None:
        with self.lock:
            gpu = self.gpu(index)
            if mode not in COMPUTE_MODES:
                raise NvmlFault(Return.ERROR_INVALID_ARGUMENT, f"compute mode {mode} is not supported")
            if ci is not None:
                if ci.compute_mode != mode:
                    gi_id = next(gi.id for gi in gpu.gis.values() if gi.cis.get(ci.id) is ci)
                    processes = gpu.processes_in_gi(gi_id)
                    self._log_destructive("nvmlDeviceSetComputeMode", gpu, ci.uuid, processes, gpu_instance_id=gi_id)
                ci.compute_mode = mode
            elif gpu.mig_current:
                raise NvmlFault(Return.ERROR_NOT_SUPPORTED, "with MIG enabled the compute mode is set per MIG device")
            else:
                if gpu.compute_mode != mode:
                    self._log_destructive("nvmlDeviceSetComputeMode", gpu, gpu.uuid, len(gpu.processes))
                gpu.compute_mode = mode

    def processes(
        self,
        index: int,
        mig: tuple[SimGpuInstance, SimComputeInstance] | None = None,
        kinds: Iterable[str] = PROCESS_KINDS,
    ) -> list[SimProcess]:
        """Processes on a GPU or MIG device by pid, of the given kinds (every kind unless told)."""
        wanted = frozenset(kinds)
        with self.lock:
            gpu = self.gpu(index)
            if not gpu.processes:
                return []
            procs = sorted((p for p in gpu.processes.values() if p.kind in wanted), key=lambda p: p.pid)
            if mig is None:
                return procs
            gi, ci = mig
            return [p for p in procs if p.gi_id == gi.id and p.ci_id == ci.id]

    def used_memory_mib(self, index: int, mig: tuple[SimGpuInstance, SimComputeInstance] | None = None) -> int:
        if mig is None:
            with self.lock:
                return sum(p.used_mib for p in self.gpu(index).processes.values())
        gi, _ = mig
        return sum(p.used_mib for p in self.gpu(index).processes.values() if p.gi_id == gi.id)

    def utilization(self, index: int) -> tuple[int, int]:
        """The GPU's utilization: ``set_utilization``'s value, else what its processes' loads add up to."""
        with self.lock:
            gpu = self.gpu(index)
            if gpu.mig_current:
                raise NvmlFault(Return.ERROR_NOT_SUPPORTED, "utilization is not reported on a MIG-enabled GPU")
            if gpu.utilization is not None:
                return gpu.utilization
            now = time.time()
            loads = [p.load_at(now) for p in gpu.processes.values()]
            return min(100, sum(load[0] for load in loads)), min(100, sum(load[1] for load in loads))

    def process_utilization(
        self, index: int, mig: tuple[SimGpuInstance, SimComputeInstance] | None, last_seen_us: int
    ) -> list[tuple[int, int, Load]]:
        """``nvmlDeviceGetProcessUtilization``'s samples: (pid, timestamp in µs, load) per process that did
        some work after ``last_seen_us`` (0: as far back as the buffer goes), processes that exited since
        included. NOT_SUPPORTED on a MIG-enabled GPU and its MIG devices, as NVML documents."""
        with self.lock:
            gpu = self.gpu(index)
            if mig is not None or gpu.mig_current:
                raise NvmlFault(Return.ERROR_NOT_SUPPORTED, "per-process utilization is not reported with MIG enabled")
            now = time.time()
            horizon = now - SAMPLE_BUFFER_SECONDS
            gpu.exited = [p for p in gpu.exited if p.ended is not None and p.ended > horizon]
            since = max(horizon, last_seen_us / 1e6)
            samples = []
            for process in [*gpu.exited, *gpu.processes.values()]:
                sample = process.sample(since, now)
                if sample is not None:
                    samples.append((process.pid, int(sample[0] * 1e6), sample[1]))
            return samples

    def set_process_utilization(self, pid: int, sm: int, memory: int = 0, encoder: int = 0, decoder: int = 0) -> None:
        """From now on the process keeps the GPU's SM, memory, encoder and decoder this busy (percent)."""
        load = (sm, memory, encoder, decoder)
        _check_load(load)
        with self.lock:
            process = self._running(pid)
            process.loads.append((time.time(), load))

    def exit_after_listing(self, pid: int, then: Callable[[], None] | None = None) -> None:
        """The process exits right after the next process list (compute or MPS) that names it is read: a
        reader that goes on to read its utilization or its /proc entry finds it gone. ``then`` runs right after
        (in-process tests: give its PID to another process in a fake /proc)."""
        with self.lock:
            self._running(pid)
            self._exit_after_listing[pid] = then

    def listed(self, pids: Iterable[int]) -> None:
        """A process list naming ``pids`` was just read (the library calls this)."""
        if not self._exit_after_listing:
            return
        with self.lock:
            for pid in self._exit_after_listing.keys() & set(pids):
                then = self._exit_after_listing.pop(pid)
                self.remove_process(pid)
                if then is not None:
                    then()

    def _running(self, pid: int) -> SimProcess:
        for gpu in self.gpus:
            if pid in gpu.processes:
                return gpu.processes[pid]
        raise ValueError(f"no process {pid} runs on any GPU")

    # ----- per-cgroup memory limits (driver r615+, facts memory-limits) -----------------------------

    @property
    def has_memory_limits(self) -> bool:
        """Whether this driver has ``nvmlDeviceSet/GetMemoryLimits_v1`` (r615 and newer)."""
        return self._driver_major() >= MEMORY_LIMITS_MIN_DRIVER

    def set_memory_limits(
        self, index: int, mig: tuple[SimGpuInstance, SimComputeInstance] | None, namespace: str, soft: int, hard: int
    ) -> None:
        """``nvmlDeviceSetMemoryLimits_v1``: root only, never with MIG (a MIG device, or a GPU in MIG mode: MPS v3
        memory partitioning needs "a non-MIG device"), on a cgroup directory that exists.

        A cgroup that does not exist is NOT_FOUND, as NVIDIA's MPS v3 page says of a cgroup without the dmem
        files ("returns not found"); a limit above the GPU's memory or a soft limit above the hard one is
        INVALID_ARGUMENT. soft 0 with hard MAX clears the limits.
        """
        with self.lock:
            gpu = self.gpu(index)
            if mig is not None or gpu.mig_current:
                raise NvmlFault(Return.ERROR_NOT_SUPPORTED, "memory limits are not supported with MIG")
            if not self.caller_is_root:
                raise NvmlFault(Return.ERROR_NO_PERMISSION, "setting memory limits needs root")
            directory = self._cgroup(namespace)
            total = gpu.model.memory_mib * _MIB
            if hard != MEMORY_LIMIT_MAX and hard > total:
                raise NvmlFault(Return.ERROR_INVALID_ARGUMENT, f"hard limit {hard} is above the GPU's {total} bytes")
            if soft > total or (hard != MEMORY_LIMIT_MAX and soft > hard):
                raise NvmlFault(Return.ERROR_INVALID_ARGUMENT, f"soft limit {soft} is above the hard limit or memory")
            if soft == 0 and hard == MEMORY_LIMIT_MAX:
                self._memory_limits.pop((index, directory), None)
            else:
                self._memory_limits[(index, directory)] = MemoryLimit(soft, hard, time.monotonic())
            self.memory_limit_sets += 1

    def memory_limits(
        self, index: int, mig: tuple[SimGpuInstance, SimComputeInstance] | None, namespace: str
    ) -> tuple[int, int, int]:
        """``nvmlDeviceGetMemoryLimits_v1``: (soft, hard, current used) in bytes; any caller may read.

        No limit reads soft 0, hard MAX. ``currentUsed`` is what the processes in the cgroup and below use on
        the GPU."""
        with self.lock:
            gpu = self.gpu(index)
            if mig is not None:
                raise NvmlFault(Return.ERROR_NOT_SUPPORTED, "memory limits are not supported on MIG device handles")
            directory = self._cgroup(namespace)
            limit = self._memory_limits.get((index, directory), MemoryLimit(0, MEMORY_LIMIT_MAX))
            used = sum(p.used_mib for p in gpu.processes.values() if _within(p.cgroup, directory)) * _MIB
            self.memory_limit_reads[directory] += 1
            return limit.soft, limit.hard, used

    def _cgroup(self, namespace: str) -> str:
        """The cgroup directory ``namespace`` names; NOT_FOUND when there is none (its limits went with it)."""
        if not namespace:
            raise NvmlFault(Return.ERROR_INVALID_ARGUMENT, "no cgroup path")
        directory = os.path.normpath(namespace)
        if not Path(directory).is_dir():
            self._forget_removed_cgroups()
            raise NvmlFault(Return.ERROR_NOT_FOUND, f"no cgroup {namespace}")
        return directory

    def _forget_removed_cgroups(self) -> None:
        """Removing a cgroup clears its limits (NVML's documentation of nvmlSetMemoryLimits_v1_t)."""
        for key in [key for key in self._memory_limits if not Path(key[1]).is_dir()]:
            del self._memory_limits[key]

    def _hard_limit_room(self, gpu: SimGpu, cgroup: str | None, exclude_pid: int | None = None) -> int | None:
        """MiB a process in ``cgroup`` may still allocate on the GPU under the nearest limited cgroup at or above
        its own (the misc backend's rule: limits do not nest); None when no hard limit applies."""
        if cgroup is None:
            return None
        self._forget_removed_cgroups()
        directory = os.path.normpath(cgroup)
        while True:
            limit = self._memory_limits.get((gpu.index, directory))
            if limit is not None and limit.hard != MEMORY_LIMIT_MAX:
                used = sum(
                    p.used_mib for p in gpu.processes.values() if p.pid != exclude_pid and _within(p.cgroup, directory)
                )
                return limit.hard // _MIB - used
            parent = str(Path(directory).parent)
            if parent == directory:
                return None
            directory = parent

    def set_caller_root(self, root: bool) -> None:
        """Whether the agent calls NVML as root: not root, the privileged calls fail with NO_PERMISSION."""
        with self.lock:
            self.caller_is_root = bool(root)

    def memory_limit_table(self) -> dict[tuple[int, str], MemoryLimit]:
        """Read-only: every limit set, by (GPU index, cgroup directory)."""
        with self.lock:
            self._forget_removed_cgroups()
            return dict(self._memory_limits)

    def allocate(self, pid: int, mib: int) -> None:
        """The process allocates ``mib`` more of its GPU's memory; OutOfMemory (nothing allocated) when that would
        take its cgroup above its hard limit or the GPU above its memory."""
        if mib < 0:
            raise ValueError(f"an allocation of {mib} MiB")
        with self.lock:
            process = self._running(pid)
            gpu = next(g for g in self.gpus if g.processes.get(pid) is process)
            self._check_room(gpu, process.cgroup, process.used_mib + mib, pid)
            process.used_mib += mib

    def _check_room(self, gpu: SimGpu, cgroup: str | None, wanted_mib: int, pid: int) -> None:
        room = self._hard_limit_room(gpu, cgroup, exclude_pid=pid)
        if room is not None and wanted_mib > room:
            raise OutOfMemory(
                f"CUDA_ERROR_OUT_OF_MEMORY: process {pid} in {cgroup} asked for {wanted_mib} MiB on GPU {gpu.index}; "
                f"its cgroup's hard limit leaves {max(room, 0)} MiB"
            )
        free = gpu.model.memory_mib - sum(p.used_mib for p in gpu.processes.values() if p.pid != pid)
        if cgroup is not None and wanted_mib > free:
            raise OutOfMemory(f"CUDA_ERROR_OUT_OF_MEMORY: GPU {gpu.index} has {free} MiB free, not {wanted_mib}")

    # ----- memory health (facts gpu-health §2.1, §2.2) ------------------------------------------------

    def field_value(self, index: int, field_id: int) -> tuple[int, int]:
        """One ``nvmlDeviceGetFieldValues`` entry: (value type, value), or NvmlFault for its ``nvmlReturn``."""
        with self.lock:
            gpu = self.gpu(index)
            reader = _FIELD_READERS.get(field_id)
            if reader is None:
                raise NvmlFault(Return.ERROR_NOT_SUPPORTED, f"field {field_id} is not supported")
            return reader(self, gpu)

    def _recovery_action(self, gpu: SimGpu) -> int:
        """Field 230: unknown to drivers before R565, and None where a test made it unsupported."""
        if gpu.recovery_action is None or self._driver_major() < RECOVERY_ACTION_MIN_DRIVER:
            raise NvmlFault(Return.ERROR_NOT_SUPPORTED, "GPU recovery action is not supported")
        return gpu.recovery_action

    def remapped_rows(self, index: int) -> tuple[int, int, bool, bool]:
        """``nvmlDeviceGetRemappedRows``: (correctable, uncorrectable, pending, failure occurred)."""
        with self.lock:
            gpu = _row_remapping(self.gpu(index))
            return (
                gpu.remapped_rows_correctable,
                gpu.remapped_rows_uncorrectable,
                gpu.remapped_rows_pending,
                gpu.remapped_rows_failure,
            )

    def retired_pages_pending(self, index: int) -> bool:
        with self.lock:
            return _page_retiring(self.gpu(index)).retired_pages_pending

    def retired_pages(self, index: int) -> list[int]:
        """``nvmlDeviceGetRetiredPages``: addresses of retired pages (none in the simulator)."""
        with self.lock:
            return [0] * _retired_page_count(self.gpu(index))

    def total_ecc_errors(self, index: int, error_type: int, counter_type: int) -> int:
        """``nvmlDeviceGetTotalEccErrors``: corrected errors are 0; uncorrected as set by a test."""
        with self.lock:
            gpu = self.gpu(index)
            if error_type not in (MEMORY_ERROR_CORRECTED, MEMORY_ERROR_UNCORRECTED):
                raise NvmlFault(Return.ERROR_INVALID_ARGUMENT, f"memory error type {error_type}")
            if counter_type not in (ECC_COUNTER_VOLATILE, ECC_COUNTER_AGGREGATE):
                raise NvmlFault(Return.ERROR_INVALID_ARGUMENT, f"ECC counter type {counter_type}")
            if error_type == MEMORY_ERROR_CORRECTED:
                return 0
            if counter_type == ECC_COUNTER_VOLATILE:
                return gpu.ecc_uncorrected_volatile
            return gpu.ecc_uncorrected_aggregate

    def _driver_major(self) -> int:
        head = self.driver_version.split(".")[0]
        return int(head) if head.isdigit() else 0

    # ----- events --------------------------------------------------------------------------------

    def supported_events(self, index: int) -> int:
        gpu = self.gpu(index)
        mask = EVENT_SINGLE_BIT_ECC | EVENT_DOUBLE_BIT_ECC | EVENT_PSTATE | EVENT_XID_CRITICAL | EVENT_CLOCK
        return mask | (EVENT_MIG_CONFIG_CHANGE if gpu.model.mig_capable else 0)

    def create_event_set(self) -> SimEventSet:
        with self.lock:
            event_set = SimEventSet()
            self._event_sets.append(event_set)
            return event_set

    def register_events(self, event_set: SimEventSet, index: int, mask: int) -> None:
        with self.lock:
            unsupported = mask & ~self.supported_events(index)
            if unsupported:
                raise NvmlFault(Return.ERROR_NOT_SUPPORTED, f"event types {unsupported:#x} are not supported")
            self._check_event_set(event_set)
            event_set.registrations[index] = event_set.registrations.get(index, 0) | mask

    def free_event_set(self, event_set: SimEventSet) -> None:
        with self.lock:
            self._check_event_set(event_set)
            event_set.freed = True
            self._event_sets.remove(event_set)
            self._event_ready.notify_all()

    def wait_event(self, event_set: SimEventSet, timeout_ms: int) -> SimEvent:
        """Block until an event arrives in the set, or fail with TIMEOUT after ``timeout_ms``.

        Queued events come first (a lost GPU's Xid 79 among them); after that, while any GPU the set is
        registered on is lost, every wait fails at once with GPU_IS_LOST without saying which GPU.
        """
        with self._event_ready:
            self._check_event_set(event_set)
            self._event_ready.wait_for(
                lambda: event_set.queue or event_set.freed or self._lost_in(event_set), timeout_ms / 1000
            )
            self._check_event_set(event_set)
            if event_set.queue:
                return event_set.queue.popleft()
            if self._lost_in(event_set):
                raise NvmlFault(Return.ERROR_GPU_IS_LOST, "a GPU of the event set has fallen off the bus")
            raise NvmlFault(Return.ERROR_TIMEOUT, f"no event within {timeout_ms} ms")

    def _lost_in(self, event_set: SimEventSet) -> bool:
        return any(self.gpus[index].lost for index in event_set.registrations)

    def _check_event_set(self, event_set: SimEventSet) -> None:
        if event_set.freed:
            raise NvmlFault(Return.ERROR_INVALID_ARGUMENT, "event set was freed")

    def _emit(
        self, index: int, event_type: int, data: int, gi_id: int = INVALID_INSTANCE_ID, ci_id: int = INVALID_INSTANCE_ID
    ) -> float:
        """Queue the event for every set registered for it; the ``time.monotonic()`` at which it was queued."""
        event = SimEvent(index, event_type, data, gi_id, ci_id)
        delivered = False
        for event_set in self._event_sets:
            if event_set.registrations.get(index, 0) & event_type:
                event_set.queue.append(event)
                delivered = True
        queued = time.monotonic()
        if delivered:
            self._event_ready.notify_all()
        return queued

    # ----- control: what tests and the demo do to the node ----------------------------------------

    def inject_xid(self, index: int, xid: int, *, mig_uuid: str | None = None) -> float:
        """An Xid critical error on a GPU, or attributed to one MIG device of it. Returns when the driver
        had it (``time.monotonic()``, the clock every process of the machine shares), so a benchmark can time
        what follows from the XID itself rather than from its request to the simulator."""
        with self.lock:
            gpu = self.gpus[index]
            gi_id = ci_id = INVALID_INSTANCE_ID
            if mig_uuid is not None:
                gi, ci = next((gi, ci) for gi, ci in gpu.mig_devices() if ci.uuid == mig_uuid)
                gi_id, ci_id = gi.id, ci.id
            return self._emit(index, EVENT_XID_CRITICAL, xid, gi_id, ci_id)

    def lose_gpu(self, index: int) -> None:
        """The GPU falls off the bus (Xid 79): from now on every call on it fails with GPU_IS_LOST.

        Event sets registered on it get the Xid 79 event, then fail every wait with GPU_IS_LOST.
        """
        with self.lock:
            self._emit(index, EVENT_XID_CRITICAL, XID_FALLEN_OFF_THE_BUS)
            self.gpus[index].lost = True
            self._event_ready.notify_all()

    def recover_gpu(self, index: int) -> None:
        """The GPU answers again (as after a node-level recovery); its MIG instances are gone.

        Event registrations on it stay, so waits on its event sets behave normally again.
        """
        with self.lock:
            gpu = self.gpus[index]
            gpu.lost = False
            gpu.gis.clear()
            gpu.processes.clear()
            gpu.exited.clear()

    def add_process(
        self,
        index: int,
        pid: int,
        used_mib: int,
        *,
        mig_uuid: str | None = None,
        kind: str = "compute",
        sm: int = 0,
        memory: int = 0,
        encoder: int = 0,
        decoder: int = 0,
        cgroup: str | None = None,
    ) -> None:
        """A process starts on a GPU or MIG device: a CUDA process, an MPS server, or an MPS client, keeping
        the GPU's engines as busy as ``sm``, ``memory``, ``encoder`` and ``decoder`` say (percent).

        ``cgroup``: the container's cgroup directory (full path). Its first ``used_mib`` is an allocation like
        any other: above the cgroup's hard limit it fails with OutOfMemory and the process does not start."""
        if kind not in PROCESS_KINDS:
            raise ValueError(f"process kind {kind!r} is not one of {', '.join(PROCESS_KINDS)}")
        _check_load((sm, memory, encoder, decoder))
        with self.lock:
            gpu = self.gpu(index)
            gi_id = ci_id = INVALID_INSTANCE_ID
            if mig_uuid is not None:
                gi, ci = next(((gi, ci) for gi, ci in gpu.mig_devices() if ci.uuid == mig_uuid), (None, None))
                if gi is None or ci is None:
                    raise ValueError(f"GPU {index} has no MIG device {mig_uuid}")
                gi_id, ci_id = gi.id, ci.id
            elif gpu.mig_current:
                raise ValueError(f"GPU {index} is in MIG mode: a process runs on one of its MIG devices")
            if cgroup is not None and mig_uuid is None:
                self._check_room(gpu, cgroup, used_mib, pid)
            process = SimProcess(pid, used_mib, gi_id, ci_id, kind, cgroup=cgroup)
            if any((sm, memory, encoder, decoder)):
                process.loads.append((process.started, (sm, memory, encoder, decoder)))
            gpu.processes[pid] = process

    def remove_process(self, pid: int) -> None:
        """The process exits; its utilization samples stay in the driver's buffer for a while."""
        with self.lock:
            for gpu in self.gpus:
                process = gpu.processes.pop(pid, None)
                if process is not None:
                    process.ended = time.time()
                    gpu.exited.append(process)

    def set_utilization(self, index: int, gpu_percent: int, memory_percent: int = 0) -> None:
        """Pin the GPU's utilization (else it is what its processes' loads add up to)."""
        with self.lock:
            self.gpus[index].utilization = (gpu_percent, memory_percent)

    def set_health_signals(
        self,
        index: int,
        *,
        recovery_action: int | _Keep | None = _Keep.KEEP,
        remap_pending: bool | None = None,
        remap_failure: bool | None = None,
        remapped_correctable: int | None = None,
        remapped_uncorrectable: int | None = None,
        retired_pages_pending: bool | None = None,
        ecc_uncorrected: int | None = None,
    ) -> None:
        """Set a GPU's memory-health evidence; only the keywords given change (also on a lost GPU).

        ``recovery_action=None`` makes field 230 unsupported. Row-remap signals exist only on Ampere and
        newer, page retirement only before Ampere, as on real GPUs: asking for the other one is a
        ValueError. ``ecc_uncorrected`` is the volatile count; the aggregate count grows with it.
        """
        if not 0 <= index < len(self.gpus):
            raise ValueError(f"no GPU {index}")
        with self.lock:
            gpu = self.gpus[index]
            remaps = (remap_pending, remap_failure, remapped_correctable, remapped_uncorrectable)
            if any(value is not None for value in remaps) and not gpu.remaps_rows:
                raise ValueError(f"GPU {index} ({gpu.model.nvml_name}) retires pages; it has no row remapping")
            if retired_pages_pending is not None and gpu.remaps_rows:
                raise ValueError(f"GPU {index} ({gpu.model.nvml_name}) remaps rows; it does not retire pages")
            if recovery_action is not _Keep.KEEP:
                gpu.recovery_action = _uint32("recovery_action", recovery_action)
            _update_remaps(gpu, *remaps)
            if retired_pages_pending is not None:
                gpu.retired_pages_pending = retired_pages_pending
            if ecc_uncorrected is not None:
                _update_ecc(gpu, ecc_uncorrected)

    def hide_gi_profile(self, profile_index: int) -> None:
        """From now on the GPU instance profile at ``profile_index`` is unknown to the profile-info calls.

        ``nvmlDeviceGetGpuInstanceProfileInfo(V)`` fails with INVALID_ARGUMENT for it, as a driver newer
        than the installed pynvml would look; instances of it live on and report their profile id.
        """
        with self.lock:
            self._hidden_gi_profiles.add(profile_index)

    # ----- control: failures of the library itself ------------------------------------------------

    def fail_init(self, code: Return | None, *, times: int | None = None) -> None:
        """``nvmlInit`` fails with ``code`` (the library stays uninitialised): ``times`` inits, or until None."""
        if code is not None and Return(code) == Return.SUCCESS:
            raise ValueError("fail_init needs an error code, or None to stop failing")
        if times is not None and times < 0:
            raise ValueError(f"times must be at least 0, not {times}")
        with self.lock:
            self._init_failure = None if code is None or times == 0 else _InitFailure(Return(code), times)

    def take_init_failure(self) -> Return | None:
        with self.lock:
            failure = self._init_failure
            if failure is None:
                return None
            if failure.remaining is not None:
                failure.remaining -= 1
                if failure.remaining <= 0:
                    self._init_failure = None
            return failure.code

    def set_fault_rate(
        self,
        rate: float,
        *,
        seed: int = 0,
        code: Return = Return.ERROR_UNKNOWN,
        symbols: Iterable[str] | None = None,
    ) -> None:
        """Fail each NVML call with ``code`` with probability ``rate`` (0 turns it off).

        The draws come from ``random.Random(seed)``, so the same calls in the same order fail the same
        way. ``symbols`` limits it to those C symbols; nvmlInit (``nvmlInit``, ``nvmlInit_v2``,
        ``nvmlInitWithFlags``) fails only when listed, nvmlShutdown and nvmlErrorString never.
        """
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"fault rate {rate} is not within [0, 1]")
        if Return(code) == Return.SUCCESS:
            raise ValueError("set_fault_rate needs an error code")
        wanted = None if symbols is None else frozenset(symbols)
        rng = random.Random(seed)  # noqa: S311 - reproducible draws, not secrets
        with self.lock:
            self._fault_rate = _FaultRate(rate, Return(code), wanted, rng) if rate > 0 else None

    def take_random_fault(self, symbol: str) -> Return | None:
        with self.lock:
            plan = self._fault_rate
            if plan is None or not plan.applies_to(symbol) or plan.rng.random() >= plan.rate:
                return None
            self.random_faults += 1
            return plan.code

    def inject_error(self, symbol: str, code: Return, *, times: int | None = 1, gpu_index: int | None = None) -> None:
        """Make the next ``times`` calls of the C function ``symbol`` (optionally on one GPU) fail with ``code``.

        ``times=None`` fails every call until ``clear_injected_errors``.
        """
        if times is not None and times < 1:
            raise ValueError(f"times must be at least 1 (or None for until cleared), not {times}")
        with self.lock:
            self._faults.append(_InjectedFault(symbol, code, times, gpu_index))

    def stall(self, symbol: str, seconds: float) -> None:
        """Make the next call of the C function ``symbol`` block for ``seconds`` before it runs, as a real driver's
        does: a MIG mode change takes seconds on real hardware, a driver in trouble far longer."""
        if not 0 < seconds <= 3600:
            raise ValueError(f"a stall lasts more than 0 and at most 3600 seconds, not {seconds}")
        with self.lock:
            self._stalls[symbol] = seconds

    def take_stall(self, symbol: str) -> float:
        with self.lock:
            return self._stalls.pop(symbol, 0.0)

    def clear_injected_errors(self) -> None:
        """Forget every error queued by ``inject_error``."""
        with self.lock:
            self._faults.clear()

    def take_injected_fault(self, symbol: str, gpu_index: int | None) -> Return | None:
        with self.lock:
            for fault in self._faults:
                if fault.symbol == symbol and fault.gpu_index in (None, gpu_index):
                    if fault.remaining is not None:
                        fault.remaining -= 1
                        if fault.remaining <= 0:
                            self._faults.remove(fault)
                    return fault.code
            return None

    # ----- the destructive-call log ----------------------------------------------------------------

    @property
    def destructive_calls(self) -> list[DestructiveCall]:
        """A snapshot, oldest first, of the calls that could destroy work (at most DESTRUCTIVE_LOG_LIMIT)."""
        with self.lock:
            return list(self._destructive_calls)

    def clear_destructive_calls(self) -> None:
        with self.lock:
            self._destructive_calls.clear()

    def _log_destructive(
        self,
        symbol: str,
        gpu: SimGpu,
        target: str,
        processes: int,
        result: Return = Return.SUCCESS,
        gpu_instance_id: int | None = None,
    ) -> None:
        call = DestructiveCall(symbol, gpu.index, target, processes, time.monotonic(), result, gpu_instance_id)
        self._destructive_calls.append(call)

    @contextmanager
    def _destructive(
        self, symbol: str, gpu: SimGpu, target: str, processes: int, gpu_instance_id: int | None = None
    ) -> Iterator[None]:
        """Log the call around its body, with the code it was refused with if it raises NvmlFault."""
        try:
            yield
        except NvmlFault as fault:
            self._log_destructive(symbol, gpu, target, processes, fault.code, gpu_instance_id)
            raise
        self._log_destructive(symbol, gpu, target, processes, Return.SUCCESS, gpu_instance_id)


# ----- memory health --------------------------------------------------------------------------------


def _within(cgroup: str | None, directory: str) -> bool:
    """Whether ``cgroup`` is ``directory`` or below it."""
    if cgroup is None:
        return False
    path = os.path.normpath(cgroup)
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _check_load(load: Load) -> None:
    if not all(isinstance(value, int) and 0 <= value <= 100 for value in load):
        raise ValueError(f"utilization {load} is not within 0-100 %")


def _uint32(name: str, value: int | None) -> int | None:
    if value is not None and not 0 <= value <= _UINT32_MAX:
        raise ValueError(f"{name}={value} is not an unsigned 32-bit value")
    return value


def _update_remaps(
    gpu: SimGpu, pending: bool | None, failure: bool | None, correctable: int | None, uncorrectable: int | None
) -> None:
    if pending is not None:
        gpu.remapped_rows_pending = pending
    if failure is not None:
        gpu.remapped_rows_failure = failure
    if correctable is not None:
        gpu.remapped_rows_correctable = correctable
    if uncorrectable is not None:
        gpu.remapped_rows_uncorrectable = uncorrectable


def _update_ecc(gpu: SimGpu, volatile: int) -> None:
    """A new volatile count; the aggregate (lifetime) count takes every increase and keeps it."""
    if volatile < 0:
        raise ValueError(f"ecc_uncorrected={volatile} is negative")
    gpu.ecc_uncorrected_aggregate += max(0, volatile - gpu.ecc_uncorrected_volatile)
    gpu.ecc_uncorrected_volatile = volatile


def _row_remapping(gpu: SimGpu) -> SimGpu:
    """The GPU, if it reports remapped rows now: Ampere or newer, and no MIG instances."""
    if not gpu.remaps_rows:
        raise NvmlFault(Return.ERROR_NOT_SUPPORTED, f"{gpu.model.nvml_name} retires pages, it does not remap rows")
    if gpu.mig_current and gpu.gis:
        raise NvmlFault(Return.ERROR_NOT_SUPPORTED, "remapped rows are not reported while MIG instances exist")
    return gpu


def _page_retiring(gpu: SimGpu) -> SimGpu:
    """The GPU, if it retires pages (before Ampere; row-remapping GPUs report page retirement as N/A)."""
    if gpu.remaps_rows:
        raise NvmlFault(Return.ERROR_NOT_SUPPORTED, f"{gpu.model.nvml_name} remaps rows, it does not retire pages")
    return gpu


def _retired_page_count(gpu: SimGpu) -> int:
    _page_retiring(gpu)
    return 0  # the simulator keeps no retired page addresses, only the pending flag


_FieldReader = Callable[["SimDriver", SimGpu], tuple[int, int]]


def _uint(read: Callable[[SimGpu], int | bool]) -> _FieldReader:
    return lambda driver, gpu: (VALUE_TYPE_UINT, int(read(gpu)))


def _ulonglong(read: Callable[[SimGpu], int]) -> _FieldReader:
    return lambda driver, gpu: (VALUE_TYPE_ULONGLONG, read(gpu))


# nvmlDeviceGetFieldValues: how each supported field reads; an NvmlFault is that entry's nvmlReturn.
_FIELD_READERS: dict[int, _FieldReader] = {
    FI_ECC_CURRENT: _uint(lambda gpu: 1),
    FI_ECC_PENDING: _uint(lambda gpu: 1),
    FI_ECC_SBE_VOL_TOTAL: _ulonglong(lambda gpu: 0),
    FI_ECC_DBE_VOL_TOTAL: _ulonglong(lambda gpu: gpu.ecc_uncorrected_volatile),
    FI_ECC_SBE_AGG_TOTAL: _ulonglong(lambda gpu: 0),
    FI_ECC_DBE_AGG_TOTAL: _ulonglong(lambda gpu: gpu.ecc_uncorrected_aggregate),
    FI_RETIRED_SBE: _ulonglong(lambda gpu: _retired_page_count(gpu)),
    FI_RETIRED_DBE: _ulonglong(lambda gpu: _retired_page_count(gpu)),
    FI_RETIRED_PENDING: _uint(lambda gpu: _page_retiring(gpu).retired_pages_pending),
    FI_REMAPPED_COR: _uint(lambda gpu: _row_remapping(gpu).remapped_rows_correctable),
    FI_REMAPPED_UNC: _uint(lambda gpu: _row_remapping(gpu).remapped_rows_uncorrectable),
    FI_REMAPPED_PENDING: _uint(lambda gpu: _row_remapping(gpu).remapped_rows_pending),
    FI_REMAPPED_FAILURE: _uint(lambda gpu: _row_remapping(gpu).remapped_rows_failure),
    FI_GPU_RECOVERY_ACTION: lambda driver, gpu: (VALUE_TYPE_UINT, driver._recovery_action(gpu)),
}


# ----- placement rules ---------------------------------------------------------------------------


def _is_free(placement: tuple[int, int], used: set[int]) -> bool:
    start, size = placement
    return used.isdisjoint(range(start, start + size))


def _me_used(gpu: SimGpu) -> bool:
    return any(gi.profile.has_media_extensions for gi in gpu.gis.values())


def _remaining(gpu: SimGpu, profile: GiProfile, used: set[int], me_used: bool, trial: GiProfile | None = None) -> int:
    """``nvmlDeviceGetGpuInstanceRemainingCapacity``: min(instances left, free aligned placements).

    ``trial`` is one more instance that a caller is trying out (its slices are already in ``used``).
    """
    if profile.has_media_extensions and me_used:
        return 0
    existing = sum(1 for gi in gpu.gis.values() if gi.profile.id == profile.id)
    existing += 1 if trial is not None and trial.id == profile.id else 0
    if len(gpu.gis) + (trial is not None) >= gpu.model.max_gpu_instances:
        return 0
    free = sum(1 for p in profile.placements if _is_free(p, used))
    return max(0, min(profile.instance_count - existing, free))


def _default_placement(gpu: SimGpu, profile: GiProfile, used: set[int]) -> tuple[int, int] | None:
    """Where ``nvmlDeviceCreateGpuInstance`` puts an instance when the caller does not say.

    The driver's choice is undocumented; this heuristic reproduces the sequences observed on A100 and
    H100 80GB (facts: ``observed_default_placement_sequences``): take the free placement that leaves the
    most remaining capacity summed over all profiles, ties to the lowest start.
    """
    free = [p for p in profile.placements if _is_free(p, used)]
    if not free:
        return None
    me_used = _me_used(gpu) or profile.has_media_extensions

    def score(placement: tuple[int, int]) -> tuple[int, int]:
        after = used | set(range(placement[0], placement[0] + placement[1]))
        total = sum(_remaining(gpu, other, after, me_used, trial=profile) for other in gpu.model.gi_profiles)
        return total, -placement[0]

    return max(free, key=score)


def _ci_count(gi: SimGpuInstance, profile: CiProfile) -> int:
    return sum(1 for ci in gi.cis.values() if ci.profile.id == profile.id)


def _free_ci_placements(gi: SimGpuInstance, profile: CiProfile) -> list[tuple[int, int]]:
    used = set().union(*(range(ci.placement[0], ci.placement[0] + ci.placement[1]) for ci in gi.cis.values()))
    return [p for p in profile.placements if _is_free(p, used)]


def _normalise_bus_id(bus_id: str) -> str:
    """NVML accepts ``0000:07:00.0`` and ``00000000:07:00.0``; compare on one form."""
    parts = bus_id.strip().lower().split(":")
    if len(parts) == 3:
        return f"{int(parts[0], 16):08x}:{parts[1]}:{parts[2]}"
    if len(parts) == 2:
        return f"00000000:{parts[0]}:{parts[1]}"
    return bus_id.strip().lower()
