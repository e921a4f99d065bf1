"""What the node has: an immutable snapshot of its GPUs and MIG devices, as discovered through NVML."""

from __future__ import annotations

from msgspec import Struct, field
from msgspec.structs import replace


class Placement(Struct, frozen=True):
    """Where an instance sits: GPU instances in memory slices, compute instances in compute slices."""

    start: int
    size: int

    def __str__(self) -> str:
        return f"{self.start}:{self.size}"


class GiProfileCounts(Struct, frozen=True):
    """What NVML's GPU instance profile info (``nvmlDeviceGetGpuInstanceProfileInfo``) says one GPU instance of a
    profile holds: the DRA capacities of a MIG device, as NVIDIA's driver reads them."""

    id: int  # the GPU instance profile ID
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpeg_engines: int
    ofa_engines: int
    memory_mib: int


class MigDevice(Struct, frozen=True):
    """One compute instance, which the driver exposes as one MIG device."""

    uuid: str
    parent_uuid: str
    gpu_index: int
    mig_index: int
    profile: str  # e.g. "1g.10gb", "1c.3g.40gb", "1g.10gb+me" (derived by the naming rule)
    gi_id: int
    ci_id: int
    gi_profile_id: int
    ci_profile_id: int
    gi_slices: int
    ci_slices: int
    placement: Placement
    memory_mib: int
    multiprocessor_count: int

    @property
    def is_full_instance(self) -> bool:
        """True when the compute instance spans its whole GPU instance (C == G)."""
        return self.ci_slices == self.gi_slices

    @property
    def index(self) -> str:
        """NVIDIA's device index for a MIG device: ``"<gpu>:<mig>"``."""
        return f"{self.gpu_index}:{self.mig_index}"


class Gpu(Struct, frozen=True):
    """One physical GPU."""

    index: int
    uuid: str
    name: str
    memory_mib: int
    compute_capability: tuple[int, int]
    pci_bus_id: str
    pci_device_id: int  # NVML's 0xDDDDVVVV form
    minor_number: int
    architecture: str
    mig_capable: bool
    mig_enabled: bool = False
    mig_pending: bool | None = None  # the mode after the next reset; None when not MIG capable
    mig_devices: tuple[MigDevice, ...] = ()
    nvlink_peers: tuple[int, ...] = ()  # indices of GPUs reachable over NVLink
    numa_node: int | None = None
    compute_mode: str | None = None  # None when the driver does not say (e.g. parent of a MIG GPU)
    brand: str = ""  # go-nvlib's brand string ("Nvidia", "Tesla", ...); "" when NVML does not say
    addressing_mode: str | None = None  # NVML's addressing mode: "HMM", "ATS" or "None"; None when not reported
    # the GPU instance profiles NVML describes, by ascending ID; read while MIG mode is on (empty otherwise)
    gi_profiles: tuple[GiProfileCounts, ...] = ()

    def gi_profile(self, profile_id: int) -> GiProfileCounts | None:
        """NVML's description of the GPU instance profile ``profile_id``, when discovery read one."""
        return next((p for p in self.gi_profiles if p.id == profile_id), None)

    @property
    def mig_change_pending(self) -> bool:
        """A MIG mode change was requested and waits for a GPU reset."""
        return self.mig_pending is not None and self.mig_pending != self.mig_enabled

    @property
    def cc_string(self) -> str:
        return f"{self.compute_capability[0]}.{self.compute_capability[1]}"


class GpuFailure(Struct, frozen=True):
    """A GPU that NVML could not describe, with the NVML error name (e.g. ``GPU_IS_LOST``)."""

    index: int
    error: str
    operation: str
    uuid: str | None = None

    def __str__(self) -> str:
        who = f"GPU {self.index}" + (f" ({self.uuid})" if self.uuid else "")
        return f"{who}: {self.operation} failed with NVML_ERROR_{self.error}"


class Inventory(Struct, frozen=True):
    """The node as NVML describes it at one moment."""

    driver_version: str
    nvml_version: str
    cuda_driver_version: int | None
    gpus: tuple[Gpu, ...] = ()
    failures: tuple[GpuFailure, ...] = field(default=())

    def gpu_by_uuid(self, uuid: str) -> Gpu | None:
        return next((g for g in self.gpus if g.uuid == uuid), None)


def keep_unanswered(inventory: Inventory, previous: Inventory | None) -> tuple[Inventory, dict[str, GpuFailure]]:
    """``inventory`` with the last description of each known GPU that failed to answer this time, and what each of
    them failed with, by UUID.

    A GPU that fell off the bus, or errs for a moment, is still in the node (``nvmlDeviceGetCount`` counts it, at
    its index): its devices are to be reported Unhealthy or withdrawn, not dropped as though it had left."""
    if previous is None or not inventory.failures:
        return inventory, {}
    read = {g.uuid for g in inventory.gpus}
    by_uuid = {g.uuid: g for g in previous.gpus}
    by_index = {g.index: g for g in previous.gpus}
    kept: dict[str, tuple[Gpu, GpuFailure]] = {}
    for failure in inventory.failures:
        gpu = by_uuid.get(failure.uuid) if failure.uuid else by_index.get(failure.index)
        if gpu is not None and gpu.index == failure.index and gpu.uuid not in read:
            kept[gpu.uuid] = (gpu, failure)
    if not kept:
        return inventory, {}
    gpus = sorted((*inventory.gpus, *(gpu for gpu, _ in kept.values())), key=lambda g: g.index)
    return replace(inventory, gpus=tuple(gpus)), {uuid: failure for uuid, (_, failure) in kept.items()}
