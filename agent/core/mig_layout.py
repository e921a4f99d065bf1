"""The MIG layout manager's pure part: is a layout possible, where does each instance go, what must change.

A *layout* is what mig-parted calls a MIG config for one GPU: MIG on or off, and how many GPU instances of each
profile (``{1g.10gb: 2, 2g.20gb: 1, 3g.40gb: 1}``). Tessera creates full GPU instances only: one compute
instance spanning each GPU instance, which is one MIG device. Compute-instance profiles (``1c.3g.40gb``) are
refused for now.

Unlike mig-parted, which lets the driver choose placements and retries every ordering, Tessera computes the
placements itself (``fit``) and creates each instance with ``CreateGpuInstanceWithPlacement``. That makes a
reconfiguration plannable: instances of the target that already exist at the same placement are *kept*, so
a change destroys only what it must (``diff_gpu``). Placement rules, from the facts (mig-mps.md, "Rules a
faithful MIG simulator should enforce"): instances may not overlap on memory slices; each profile has an
instance count; at most one ``+me`` instance per GPU; at most ``max_gpu_instances`` instances.

Nothing here does I/O; the executor (the shell) runs the returned operations: for ``DestroyInstance`` it
destroys every compute instance of the GPU instance first, then the GPU instance.

A limitation of working from the inventory: a GPU instance without any compute instance is not a MIG device,
so the inventory does not show it. If one occupies memory slices, a create can fail with
INSUFFICIENT_RESOURCES; the executor should list GPU instances through NVML when that happens.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence

from msgspec import Struct
from msgspec.structs import force_setattr

from agent.core.inventory import Gpu, MigDevice, Placement
from agent.core.mig_catalog import GiProfileInfo, MigCatalog, canonical_profile_name, mig_catalog, parse_profile_name


class LayoutError(ValueError):
    """A layout cannot be applied to a GPU; the message names the GPU model and the reason."""

    def __init__(self, message: str, problems: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.problems = list(problems) or [message]


class DesiredLayout(Struct, frozen=True):
    """One GPU's MIG layout: MIG on or off and the GPU instances by profile.

    ``devices`` is normalised on construction (a mapping is accepted too): canonical profile spelling,
    duplicates summed, zero counts dropped, sorted by name. A negative count is a ValueError.
    """

    enabled: bool
    devices: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        raw: Iterable[tuple[str, int]] = (
            self.devices.items() if isinstance(self.devices, Mapping) else self.devices  # type: ignore[union-attr]
        )
        counts: Counter[str] = Counter()
        for name, count in raw:
            if not isinstance(count, int) or isinstance(count, bool) or count < 0:
                raise ValueError(f"MIG device count for {name!r} must be a non-negative integer, not {count!r}")
            if count:
                counts[canonical_profile_name(name) or name] += count
        force_setattr(self, "devices", tuple(sorted(counts.items())))

    @property
    def counts(self) -> dict[str, int]:
        return dict(self.devices)

    @property
    def instance_count(self) -> int:
        return sum(count for _, count in self.devices)

    def __str__(self) -> str:
        return f"MIG enabled {render_devices(self.devices)}" if self.enabled else "MIG disabled"


class PlacedInstance(Struct, frozen=True):
    """A GPU instance of ``profile`` at a memory-slice placement, with its full compute instance."""

    profile: str
    profile_id: int
    placement: Placement
    ci_profile_id: int


class SetMigMode(Struct, frozen=True):
    gpu_index: int
    enabled: bool


class DestroyInstance(Struct, frozen=True):
    """Destroy a GPU instance and, first, all its compute instances (their MIG devices are ``mig_uuids``)."""

    gpu_index: int
    gi_id: int
    profile: str
    placement: Placement
    mig_uuids: tuple[str, ...]


class CreateInstance(Struct, frozen=True):
    """Create a GPU instance at ``placement``, then its full compute instance (``ci_profile_id``)."""

    gpu_index: int
    profile: str
    profile_id: int
    placement: Placement
    ci_profile_id: int


Operation = SetMigMode | DestroyInstance | CreateInstance


def render_devices(devices: Iterable[tuple[str, int]] | Mapping[str, int]) -> str:
    """``{1g.10gb: 2, 3g.40gb: 1}``, as mig-parted's ``mig-devices`` reads."""
    pairs = devices.items() if isinstance(devices, Mapping) else devices
    return "{" + ", ".join(f"{name}: {count}" for name, count in sorted(pairs) if count) + "}"


# ----- validation ----------------------------------------------------------------------------------


def validate_layout(catalog: MigCatalog, layout: DesiredLayout) -> list[str]:
    """Every reason ``layout`` cannot be applied to a GPU of ``catalog``'s model (empty when it can)."""
    model = catalog.product
    if not layout.enabled:
        if layout.devices:
            return [f"{render_devices(layout.devices)} are listed but MIG is disabled on {model}"]
        return []
    problems: list[str] = []
    wanted: list[tuple[GiProfileInfo, int]] = []
    for name, count in layout.devices:
        problem, profile = _profile_problem(catalog, name)
        if problem:
            problems.append(problem)
        elif profile is not None:
            wanted.append((profile, count))
    problems += _count_problems(catalog, wanted)
    if len(wanted) == len(layout.devices) and _search(catalog, wanted, frozenset()) is None:
        problems.append(f"no placement can hold {render_devices(layout.devices)} on {model}")
    return problems


def _profile_problem(catalog: MigCatalog, name: str) -> tuple[str | None, GiProfileInfo | None]:
    model = catalog.product
    try:
        parsed = parse_profile_name(name)
    except ValueError as error:
        return f"{error} (on {model})", None
    if parsed.is_compute_instance:
        return (
            f"{name} is a compute-instance profile: Tessera's MIG manager supports full GPU instances only "
            f"(for now), e.g. {parsed.gpu_slices}g.{parsed.memory_gb}gb on {model}",
            None,
        )
    profile = catalog.profile(name)
    if profile is None:
        return f"{name} is not a MIG profile of {model} (its profiles: {', '.join(catalog.profile_names)})", None
    return None, profile


def _count_problems(catalog: MigCatalog, wanted: Sequence[tuple[GiProfileInfo, int]]) -> list[str]:
    model = catalog.product
    problems = [
        f"{count}x {profile.name} requested but {model} allows at most {profile.instance_count}"
        for profile, count in wanted
        if count > profile.instance_count
    ]
    media = sum(count for profile, count in wanted if profile.media_extensions)
    if media > 1:
        problems.append(f"{media} +me instances requested but {model} has one set of media extensions: at most 1")
    total = sum(count for _, count in wanted)
    if total > catalog.max_gpu_instances:
        problems.append(f"{total} GPU instances requested but {model} allows at most {catalog.max_gpu_instances}")
    return problems


# ----- placement -----------------------------------------------------------------------------------


def fit(
    catalog: MigCatalog, devices: Mapping[str, int], keep: Sequence[PlacedInstance] = ()
) -> tuple[PlacedInstance, ...]:
    """A memory-slice placement for every wanted instance, or LayoutError naming the model and the reason.

    Among all fits it picks, in this order: the most instances of ``keep`` (same profile at the same
    placement, so a reconfiguration destroys as little as possible); the most room left for further
    instances (the free placements of every profile, as the driver's own choice favours); the lowest
    starts, largest instances first. The search is exhaustive (8 memory slices make that cheap), so it finds
    a fit whenever one exists, and the same input always gives the same output.
    """
    layout = DesiredLayout(True, tuple(devices.items()))
    wanted: list[tuple[GiProfileInfo, int]] = []
    problems: list[str] = []
    for name, count in layout.devices:
        problem, profile = _profile_problem(catalog, name)
        if problem:
            problems.append(problem)
        elif profile is not None:
            wanted.append((profile, count))
    problems += _count_problems(catalog, wanted)
    if problems:
        raise LayoutError(
            f"cannot lay out {render_devices(layout.devices)} on {catalog.product}: " + "; ".join(problems), problems
        )
    kept = frozenset((k.profile, k.placement) for k in keep)
    placed = _search(catalog, wanted, kept)
    if placed is None:
        message = f"no placement can hold {render_devices(layout.devices)} on {catalog.product}"
        raise LayoutError(message)
    return placed


def _search(
    catalog: MigCatalog, wanted: Sequence[tuple[GiProfileInfo, int]], keep: frozenset[tuple[str, Placement]]
) -> tuple[PlacedInstance, ...] | None:
    """The best fit (see ``fit``) on placement geometry alone, or None when there is none."""
    groups = sorted(
        ((p, n) for p, n in wanted if n > 0), key=lambda pn: (-pn[0].memory_slices, -pn[0].slices, pn[0].name)
    )
    if sum(p.slices * n for p, n in groups) > catalog.compute_slices:
        return None
    best: tuple[tuple[int, int, tuple[int, ...]], tuple[PlacedInstance, ...]] | None = None
    for chosen in _assignments(groups, 0, frozenset()):
        kept = sum(1 for profile, placement in chosen if (profile.name, placement) in keep)
        room = _room_left(catalog, chosen)
        key = (-kept, -room, tuple(placement.start for _, placement in chosen))
        if best is None or key < best[0]:
            placed = tuple(
                PlacedInstance(profile.name, profile.id, placement, profile.full_ci_profile_id)
                for profile, placement in chosen
            )
            best = (key, placed)
    return best[1] if best else None


def _assignments(
    groups: Sequence[tuple[GiProfileInfo, int]], group: int, used: frozenset[int]
) -> Iterator[list[tuple[GiProfileInfo, Placement]]]:
    """Every way to place the groups from ``group`` on, without overlapping memory slices.

    The instances of one profile take placements in ascending order, so each set is produced once.
    """
    if group == len(groups):
        yield []
        return
    profile, count = groups[group]
    for combo in _combinations(profile.placements, count, used):
        taken = used.union(*(_slices(p) for p in combo))
        for rest in _assignments(groups, group + 1, taken):
            yield [(profile, p) for p in combo] + rest


def _combinations(
    placements: Sequence[Placement], count: int, used: frozenset[int], start: int = 0
) -> Iterator[list[Placement]]:
    if count == 0:
        yield []
        return
    for i in range(start, len(placements)):
        placement = placements[i]
        slices = _slices(placement)
        if used.isdisjoint(slices):
            for rest in _combinations(placements, count - 1, used | slices, i + 1):
                yield [placement, *rest]


def _slices(placement: Placement) -> frozenset[int]:
    return frozenset(range(placement.start, placement.start + placement.size))


def _room_left(catalog: MigCatalog, chosen: Sequence[tuple[GiProfileInfo, Placement]]) -> int:
    """How many more instances could still be created, summed over profiles (each on its own)."""
    used = frozenset().union(*(_slices(p) for _, p in chosen))
    existing = Counter(profile.name for profile, _ in chosen)
    media_used = any(profile.media_extensions for profile, _ in chosen)
    slots = catalog.max_gpu_instances - len(chosen)
    room = 0
    for profile in catalog.profiles:
        if profile.media_extensions and media_used:
            continue
        free = sum(1 for p in profile.placements if used.isdisjoint(_slices(p)))
        room += max(0, min(free, profile.instance_count - existing[profile.name], slots))
    return room


# ----- what is there, and what must change ---------------------------------------------------------


def current_layout(gpu: Gpu) -> DesiredLayout:
    """The layout the inventory shows: MIG mode and the MIG devices counted by profile.

    A full compute instance carries its GPU instance's name (one per GPU instance); partial compute
    instances are counted under their own names (``1c.3g.40gb``), which no valid layout contains.
    """
    if not gpu.mig_enabled:
        return DesiredLayout(False)
    return DesiredLayout(True, tuple(Counter(device.profile for device in gpu.mig_devices).items()))


def diff_gpu(gpu: Gpu, desired: DesiredLayout, catalog: MigCatalog) -> tuple[Operation, ...]:
    """The operations that turn ``gpu`` into ``desired``; ``()`` when it already matches.

    It matches when the MIG mode (current and pending) is the desired one and the GPU holds the same
    multiset of full GPU instances, whatever their placements. Otherwise: ``SetMigMode`` first when
    enabling, last when disabling; ``DestroyInstance`` for every GPU instance that is not kept (a GPU instance
    with partial compute instances is never kept); ``CreateInstance`` for every new instance at its fitted
    placement. Kept instances are existing ones at the same profile and placement as the fitted target.
    Raises LayoutError when the layout is invalid for the model.
    """
    if not gpu.mig_capable:
        if desired.enabled:
            raise LayoutError(f"cannot set MIG mode on non MIG-capable GPU {gpu.index} ({gpu.name})")
        return ()
    if catalog.pci_device_id != gpu.pci_device_id & 0xFFFFFFFF:
        raise LayoutError(f"GPU {gpu.index} is a {gpu.name}, not a {catalog.product}: wrong MIG catalog")
    problems = validate_layout(catalog, desired)
    if problems:
        raise LayoutError(f"GPU {gpu.index} ({catalog.product}): " + "; ".join(problems), problems)
    mode_ok = gpu.mig_enabled == desired.enabled and not gpu.mig_change_pending
    if mode_ok and current_layout(gpu) == desired:
        return ()
    instances = _gpu_instances(gpu)
    if not desired.enabled:
        ops: list[Operation] = [_destroy(gpu.index, devices) for devices in instances.values()]
        if not mode_ok:
            ops.append(SetMigMode(gpu.index, False))
        return tuple(ops)
    ops = [] if mode_ok else [SetMigMode(gpu.index, True)]
    keepable = {gi_id: placed for gi_id, devices in instances.items() if (placed := _keepable(devices, catalog))}
    target = fit(catalog, desired.counts, tuple(keepable.values()))
    wanted = {(t.profile, t.placement) for t in target}
    kept = {gi_id for gi_id, placed in keepable.items() if (placed.profile, placed.placement) in wanted}
    ops += [_destroy(gpu.index, devices) for gi_id, devices in instances.items() if gi_id not in kept]
    kept_at = {(keepable[gi_id].profile, keepable[gi_id].placement) for gi_id in kept}
    ops += [
        CreateInstance(gpu.index, t.profile, t.profile_id, t.placement, t.ci_profile_id)
        for t in target
        if (t.profile, t.placement) not in kept_at
    ]
    return tuple(ops)


def _gpu_instances(gpu: Gpu) -> dict[int, list[MigDevice]]:
    """The GPU's MIG devices grouped by GPU instance id, in id order."""
    instances: dict[int, list[MigDevice]] = {}
    for device in sorted(gpu.mig_devices, key=lambda d: (d.gi_id, d.ci_id)):
        instances.setdefault(device.gi_id, []).append(device)
    return instances


def _keepable(devices: list[MigDevice], catalog: MigCatalog) -> PlacedInstance | None:
    """A GPU instance that a target could keep: exactly one compute instance, spanning it, of a known profile."""
    if len(devices) != 1 or not devices[0].is_full_instance:
        return None
    device = devices[0]
    profile = catalog.profile(device.profile)
    if profile is None or profile.id != device.gi_profile_id:
        return None
    return PlacedInstance(profile.name, profile.id, device.placement, device.ci_profile_id)


def _destroy(gpu_index: int, devices: list[MigDevice]) -> DestroyInstance:
    first = devices[0]
    return DestroyInstance(gpu_index, first.gi_id, first.profile, first.placement, tuple(d.uuid for d in devices))


def diff_node(gpus: Sequence[Gpu], layouts: Mapping[int, DesiredLayout]) -> dict[int, tuple[Operation, ...]]:
    """The operations per GPU index, for the GPUs that differ from their layout.

    GPUs without a layout are left alone; non-MIG-capable GPUs whose layout is "disabled" are skipped. Every
    GPU is checked before anything is returned: one LayoutError lists the problems of all GPUs.
    """
    result: dict[int, tuple[Operation, ...]] = {}
    problems: list[str] = []
    for gpu in sorted(gpus, key=lambda g: g.index):
        desired = layouts.get(gpu.index)
        if desired is None or (not gpu.mig_capable and not desired.enabled):
            continue
        if not gpu.mig_capable:
            problems.append(f"cannot set MIG mode on non MIG-capable GPU {gpu.index} ({gpu.name})")
            continue
        catalog = mig_catalog(gpu.pci_device_id)
        if catalog is None:
            problems.append(
                f"GPU {gpu.index} ({gpu.name}, PCI device id 0x{gpu.pci_device_id:08X}): "
                "no MIG profiles are known for this model"
            )
            continue
        try:
            ops = diff_gpu(gpu, desired, catalog)
        except LayoutError as error:
            problems.append(str(error))
            continue
        if ops:
            result[gpu.index] = ops
    if problems:
        raise LayoutError("; ".join(problems), problems)
    return result
