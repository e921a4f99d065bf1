"""Dynamic MIG as partitionable devices: every MIG profile and placement a GPU could hold, sharing its counters.

On a GPU in dynamic-MIG mode nothing is partitioned ahead of time. The pool lists the full GPU and one abstract
device per GPU-instance profile and placement (facts ``dra.md`` C4, NVIDIA's ``partitions.go``); the scheduler
picks any set of them that fits, and Prepare creates the instance at exactly the allocated placement. What
makes a set fit is the GPU's counter set, ``gpu-<minor>-counter-set``:

- one counter per MIG capacity dimension (``multiprocessors``, ``copy-engines``, ``decoders``, ``encoders``,
  ``jpeg-engines``, ``ofa-engines``, ``memory``), each the largest any profile of the GPU needs, and
  ``memory-slice-<i>`` = 1 for every memory slice a placement can cover;
- each abstract MIG device consumes its own capacities and the memory slices of its placement, so placements
  that overlap exclude each other through the memory-slice counters;
- the full GPU consumes the whole set, so it excludes every partition and they exclude it.

Abstract devices are named as NVIDIA names MIG devices (``gpu-<minor>-mig-<profile>-<GI profile ID>-<start>``),
carry the parent's attributes with ``type: mig``, ``parentUUID`` and ``profile`` but no ``uuid`` (they do not exist
yet), and the capacities of their profile. The full GPU advertises, per dimension, the largest value over the
profiles (NVIDIA's ``PartCapacities``), its memory included. Only profiles whose compute instance spans the GPU
instance are listed (the catalog's profiles are GPU-instance profiles with their full compute instance).

MIG mode follows the claims where the GPU allows it (NVIDIA's dynamic MIG): from Hopper on MIG mode changes without a
GPU reset, so such a GPU is published partitioned even with MIG mode off; Prepare turns MIG mode on for its first
partition and Unprepare off after its last, and a claim for the whole GPU gets it with MIG mode off. An Ampere GPU
(A100, A30) resets itself to change MIG mode (held GPUs stay pending; a VM needs a reboot), so Tessera never changes
it under claims: with MIG mode off it is published whole, as a plain GPU, and with MIG mode on only its partitions
(it could never be prepared whole). A GPU that cannot be prepared whole is never published whole.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from types import MappingProxyType

from msgspec import Struct

from agent.core.dra.devices import GPU, MIG, AttributeValue, DraDevice, canonical_profile
from agent.core.inventory import GiProfileCounts, Gpu, MigDevice
from agent.core.mig_catalog import GiProfileInfo, MigCatalog

_MIB = 1 << 20
# capacity name (a device's) -> counter name (the set's: DNS labels)
DIMENSIONS = {
    "multiprocessors": "multiprocessors",
    "copyEngines": "copy-engines",
    "decoders": "decoders",
    "encoders": "encoders",
    "jpegEngines": "jpeg-engines",
    "ofaEngines": "ofa-engines",
    "memory": "memory",
}


# From Hopper on MIG mode changes without a GPU reset (NVIDIA's MIG user guide); architectures NVML names that this
# table does not ("Unknown") are taken to need one: Tessera then never changes their MIG mode.
_RESET_FREE_MIG_MODE = frozenset({"Hopper", "Blackwell"})


def reset_free_mig_mode(architecture: str) -> bool:
    """GPUs of this architecture (NVML's name: ``Hopper``) change MIG mode without a reset."""
    return architecture in _RESET_FREE_MIG_MODE


def mig_mode_switchable(gpu: Gpu) -> bool:
    """``gpu``'s MIG mode can be changed without a GPU reset, so Prepare and Unprepare may change it."""
    return gpu.mig_capable and reset_free_mig_mode(gpu.architecture)


def partitioned(gpu: Gpu) -> bool:
    """A GPU in dynamic-MIG mode is published as partitionable devices: MIG mode on, or switchable at Prepare."""
    return gpu.mig_enabled or mig_mode_switchable(gpu)


def whole_preparable(gpu: Gpu) -> bool:
    """A partitioned GPU can be prepared whole: MIG mode off, or switchable off at Prepare."""
    return not gpu.mig_enabled or mig_mode_switchable(gpu)


def counter_set_name(gpu_minor: int) -> str:
    return f"gpu-{gpu_minor}-counter-set"


def memory_slice_counter(index: int) -> str:
    return f"memory-slice-{index}"


def partition_device_name(gpu_minor: int, profile: GiProfileInfo, start: int) -> str:
    return f"gpu-{gpu_minor}-mig-{canonical_profile(profile.name)}-{profile.id}-{start}"


def profile_capacity(profile: GiProfileInfo, nvml: GiProfileCounts | None = None) -> dict[str, int]:
    """A profile's MIG capacities, in base units (memory in bytes), by the device's capacity names: NVML's GPU
    instance profile info (``nvml``) where discovery read it (MIG mode on), else the packaged table's."""
    if nvml is not None:
        return {
            "multiprocessors": nvml.multiprocessors,
            "copyEngines": nvml.copy_engines,
            "decoders": nvml.decoders,
            "encoders": nvml.encoders,
            "jpegEngines": nvml.jpeg_engines,
            "ofaEngines": nvml.ofa_engines,
            "memory": nvml.memory_mib * _MIB,
        }
    return {
        "multiprocessors": profile.multiprocessors,
        "copyEngines": profile.copy_engines,
        "decoders": profile.decoders,
        "encoders": profile.encoders,
        "jpegEngines": profile.jpeg_engines,
        "ofaEngines": profile.ofa_engines,
        "memory": profile.memory_mib * _MIB,
    }


def partitionable_devices(gpu: Gpu, catalog: MigCatalog, common: Mapping[str, AttributeValue]) -> tuple[DraDevice, ...]:
    """The full GPU (where it can be prepared whole: ``whole_preparable``) and every profile and placement of ``gpu``
    (whose model ``catalog`` describes), by name.

    ``common`` are the attributes the GPU and its MIG devices share (``devices._common_attributes``).
    """
    profiles = [p for p in catalog.profiles if p.placements]
    if not profiles:
        return ()
    set_name = counter_set_name(gpu.minor_number)
    largest = {name: max(profile_capacity(p, gpu.gi_profile(p.id))[name] for p in profiles) for name in DIMENSIONS}
    slices = max(placement.start + placement.size for p in profiles for placement in p.placements)
    whole = {DIMENSIONS[name]: value for name, value in largest.items()}
    whole |= {memory_slice_counter(i): 1 for i in range(slices)}
    full = DraDevice(
        name=f"gpu-{gpu.minor_number}",
        kind=GPU,
        uuid=gpu.uuid,
        parent_uuid=None,
        gpu_minor=gpu.minor_number,
        attributes=MappingProxyType({"type": GPU, "uuid": gpu.uuid, **common}),
        capacity=MappingProxyType(largest),
        consumes_counters=MappingProxyType({set_name: MappingProxyType(whole)}),
    )
    partitions = []
    for profile in profiles:
        capacity = profile_capacity(profile, gpu.gi_profile(profile.id))
        attributes = {"type": MIG, "parentUUID": gpu.uuid, "profile": profile.name, **common}
        for placement in profile.placements:
            consumed = {DIMENSIONS[name]: value for name, value in capacity.items()}
            consumed |= {memory_slice_counter(i): 1 for i in range(placement.start, placement.start + placement.size)}
            partitions.append(
                DraDevice(
                    name=partition_device_name(gpu.minor_number, profile, placement.start),
                    kind=MIG,
                    uuid="",  # created by Prepare; the abstract device has none
                    parent_uuid=gpu.uuid,
                    gpu_minor=gpu.minor_number,
                    attributes=MappingProxyType(attributes),
                    capacity=MappingProxyType(capacity),
                    consumes_counters=MappingProxyType({set_name: MappingProxyType(consumed)}),
                    gi_profile_id=profile.id,
                    placement=(placement.start, placement.size),
                )
            )
    ordered = sorted(partitions, key=lambda d: d.name)
    return (full, *ordered) if whole_preparable(gpu) else tuple(ordered)


def counter_sets(devices: Iterable[DraDevice]) -> dict[str, dict[str, int]]:
    """The counter sets ``devices`` consume: each counter is the most any device takes of it (the full GPU takes the
    whole set; where it is not published its partitions together name every counter, each at that largest value)."""
    sets: dict[str, dict[str, int]] = {}
    for device in devices:
        for name, counters in device.consumes_counters.items():
            counter_set = sets.setdefault(name, {})
            for counter, amount in counters.items():
                counter_set[counter] = max(amount, counter_set.get(counter, 0))
    return {name: _ordered(counters) for name, counters in sets.items()}


def _ordered(counters: Mapping[str, int]) -> dict[str, int]:
    """The dimensions first (in ``DIMENSIONS`` order), then the memory slices by index: the full GPU's own order."""
    prefix = memory_slice_counter(0)[:-1]
    dimensions = [DIMENSIONS[name] for name in DIMENSIONS if DIMENSIONS[name] in counters]
    memory_slices = sorted((c for c in counters if c.startswith(prefix)), key=lambda c: int(c.removeprefix(prefix)))
    rest = sorted(c for c in counters if c not in dimensions and c not in memory_slices)
    return {name: counters[name] for name in (*dimensions, *memory_slices, *rest)}


class Unclaimed(Struct, frozen=True):
    """A GPU instance on a dynamic-MIG GPU that no recorded claim made: made by hand, or left by a claim whose record
    was lost (a lost or corrupt checkpoint). Its placement is not offered, and it is destroyed once nothing holds it:
    on a dynamic-MIG GPU every MIG device is a claim's."""

    gpu_uuid: str
    gi_id: int
    profile_id: int
    start: int
    size: int
    mig_uuids: tuple[str, ...]

    def __str__(self) -> str:
        return f"GPU instance {self.gi_id} (profile {self.profile_id} at {self.start}+{self.size}) of {self.gpu_uuid}"


def unclaimed_instances(
    gpu: Gpu, claimed_placements: Collection[tuple[int, int]], claimed_migs: Collection[str]
) -> tuple[Unclaimed, ...]:
    """The GPU instances of ``gpu`` that no claim made or is making: by the made MIG device's UUID, or by the
    (profile ID, start) a claim recorded before making it."""
    instances: dict[int, list[MigDevice]] = {}
    for mig in gpu.mig_devices:
        instances.setdefault(mig.gi_id, []).append(mig)
    found = []
    for gi_id, migs in sorted(instances.items()):
        first = migs[0]
        if (
            any(m.uuid in claimed_migs for m in migs)
            or (first.gi_profile_id, first.placement.start) in claimed_placements
        ):
            continue
        uuids = tuple(sorted(m.uuid for m in migs))
        found.append(
            Unclaimed(gpu.uuid, gi_id, first.gi_profile_id, first.placement.start, first.placement.size, uuids)
        )
    return tuple(found)


def without_overlaps(devices: Iterable[DraDevice], unclaimed: Iterable[Unclaimed]) -> tuple[DraDevice, ...]:
    """``devices`` minus the dynamic-MIG devices whose memory slices an unclaimed GPU instance covers (the full GPU
    among them): a claim allocated one could never be prepared."""
    taken: dict[str, set[int]] = {}
    for instance in unclaimed:
        taken.setdefault(instance.gpu_uuid, set()).update(range(instance.start, instance.start + instance.size))
    return tuple(d for d in devices if not (taken.get(d.gpu_uuid, set()) & _memory_slices(d)))


def _memory_slices(device: DraDevice) -> set[int]:
    prefix = memory_slice_counter(0)[:-1]
    return {
        int(name.removeprefix(prefix))
        for counters in device.consumes_counters.values()
        for name in counters
        if name.startswith(prefix)
    }
