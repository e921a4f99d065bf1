"""``plan(config, inventory) -> ResourcePlan``: which resources the node advertises, with which devices.

Three steps, each pure and deterministic:
1. every GPU and MIG device gets a resource by the MIG strategy (NVIDIA's ``none | single | mixed``) and
   the ``resources`` naming rules (which Tessera honours; NVIDIA's plugin discards them);
2. the sharing rules replicate the devices they select (``devices``: all, a count, or a list — also
   honoured) into ``<uuid>::<n>`` replicas under the target name, leaving the rest dedicated;
3. resources are sorted by name, devices by GPU index, MIG index and replica.
"""

from __future__ import annotations

import re
from collections import defaultdict

from msgspec.structs import replace

from agent.core.glob import glob_matches as glob_matches  # NVIDIA's glob, for configs too
from agent.core.inventory import Gpu, Inventory, MigDevice
from agent.core.mig_naming import mig_resource_suffix
from agent.core.resources import (
    GPU_RESOURCE,
    Device,
    DeviceSelector,
    MigStrategy,
    MpsLimits,
    NamingRule,
    PlanConfig,
    PlanError,
    ReplicaMemory,
    ReplicaRule,
    Resource,
    ResourcePlan,
    SharingConfig,
)

_LEGACY_MIG = re.compile(r"^MIG-(GPU-[0-9a-fA-F-]+)/(\d+)/(\d+)$")


def plan(config: PlanConfig, inventory: Inventory) -> ResourcePlan:
    """The node's resources under ``config``; ``PlanError`` says why a config cannot apply to this node."""
    warnings = [f"{failure}; its devices are not advertised" for failure in inventory.failures]
    warnings += [_pending_warning(gpu) for gpu in inventory.gpus if gpu.mig_change_pending]
    base = _base_resources(config, inventory, warnings)
    resources = _share(config.sharing, base, inventory, warnings) if config.sharing else _dedicated(base)
    return ResourcePlan(
        resources=tuple(sorted(resources, key=lambda r: r.name)),
        mig_strategy=config.mig_strategy,
        warnings=tuple(warnings),
    )


# ----- step 1: one device per GPU or MIG device -------------------------------------------------------


def _base_resources(config: PlanConfig, inventory: Inventory, warnings: list[str]) -> dict[str, list[Device]]:
    strategy = config.mig_strategy
    if strategy is MigStrategy.SINGLE:
        _check_single(inventory)
    by_resource: dict[str, list[Device]] = defaultdict(list)
    for gpu in sorted(inventory.gpus, key=lambda g: g.index):
        if strategy is MigStrategy.NONE or not gpu.mig_enabled:
            name = _named(config.gpu_names, gpu.name, GPU_RESOURCE)
            if gpu.mig_enabled:
                warnings.append(_whole_mig_gpu_warning(gpu, name))
            by_resource[name].append(_gpu_device(gpu))
            continue
        if not gpu.mig_devices:
            warnings.append(f"GPU {gpu.index} ({gpu.uuid}) has MIG enabled but no MIG devices; it offers nothing")
        for mig in sorted(gpu.mig_devices, key=lambda m: m.mig_index):
            if not mig.is_full_instance:
                warnings.append(
                    f"MIG device {mig.uuid} ({mig.profile}) on GPU {gpu.index} is a partial compute instance; "
                    "only full GPU instances are advertised"
                )
                continue
            default = GPU_RESOURCE if strategy is MigStrategy.SINGLE else _mig_resource_name(mig)
            by_resource[_named(config.mig_names, mig.profile, default)].append(_mig_device(gpu, mig))
    return by_resource


def _named(rules: tuple[NamingRule, ...], subject: str, default: str) -> str:
    """The first rule whose glob matches the whole subject names the resource; else the default name."""
    return next((rule.name for rule in rules if glob_matches(rule.pattern, subject)), default)


def _check_single(inventory: Inventory) -> None:
    """NVIDIA's three fatal conditions of the ``single`` strategy, with messages that say what to do."""
    mig_gpus = [g for g in inventory.gpus if g.mig_enabled]
    if not mig_gpus:
        return
    empty = [g.index for g in mig_gpus if not g.mig_devices]
    if empty:
        raise PlanError(
            f"mig-strategy single: GPU(s) {_indices(empty)} have MIG enabled but no MIG devices configured; "
            "create MIG devices on them or disable MIG"
        )
    plain = [g.index for g in inventory.gpus if not g.mig_enabled]
    if plain:
        raise PlanError(
            f"mig-strategy single: all GPUs on the node must have the same MIG mode, but GPU(s) "
            f"{_indices([g.index for g in mig_gpus])} have MIG enabled and GPU(s) {_indices(plain)} do not; "
            "use mig-strategy mixed or change the MIG mode"
        )
    counts: dict[str, list[int]] = defaultdict(list)
    for gpu in mig_gpus:
        for mig in gpu.mig_devices:
            counts[mig.profile].append(gpu.index)
    if len(counts) > 1:
        found = ", ".join(
            f"{profile} ×{len(gpus)} on GPU(s) {_indices(sorted(set(gpus)))}"
            for profile, gpus in sorted(counts.items())
        )
        raise PlanError(
            f"mig-strategy single needs one MIG profile on the whole node, found {len(counts)}: {found}; "
            "use mig-strategy mixed or give every GPU the same MIG layout"
        )


# ----- step 2: sharing --------------------------------------------------------------------------------


def _dedicated(base: dict[str, list[Device]]) -> list[Resource]:
    return [Resource(name, tuple(devices)) for name, devices in base.items() if devices]


def _share(
    sharing: SharingConfig, base: dict[str, list[Device]], inventory: Inventory, warnings: list[str]
) -> list[Resource]:
    claimed: dict[str, str] = {}  # physical ID -> the rule that shares it
    replicated: dict[str, list[Device]] = defaultdict(list)
    replicas_of: dict[str, tuple[int, str]] = {}  # target -> (replicas, rule)
    mps_of: dict[str, MpsLimits] = {}
    memory_of: dict[str, ReplicaMemory] = {}
    sizes_of: dict[str, tuple[object, str]] = {}  # target -> (its memory size, the first rule giving it)
    for rule in sharing.rules:
        devices = base.get(rule.name, [])
        if not devices:
            warnings.append(f"{rule.where}: no device on this node is {rule.name}; nothing is shared by this entry")
            continue
        if rule.memory is not None and rule.target == rule.name:
            warnings.append(
                f"{rule.where}: replicas held to {rule.memory.request_mib} MiB keep the name {rule.name}: a pod asking "
                f"for {rule.name} gets a {rule.memory.request_mib} MiB share, not a whole device; set rename or "
                "renameByDefault to tell them apart"
            )
        for device in _select(rule, devices, inventory):
            if rule.mps is not None:
                _check_mps(rule, device, inventory)
            if rule.memory is not None:
                _check_sized(rule, device)
            if device.physical_id in claimed:
                raise PlanError(
                    f"{rule.where}: GPU {device.index} ({device.physical_id}) is already shared by "
                    f"{claimed[device.physical_id]}; a device can be shared by one entry only"
                )
            claimed[device.physical_id] = rule.where
            replicated[rule.target] += [
                replace(device, id=f"{device.id}::{n}", replica=n) for n in range(rule.replicas)
            ]
        if rule.mps is not None:
            mps_of.setdefault(rule.target, rule.mps)
        if rule.memory is not None:
            memory_of.setdefault(rule.target, rule.memory)
        sized = (rule.mps.memory_limit_mib if rule.mps else None, rule.memory)
        first = sizes_of.setdefault(rule.target, (sized, rule.where))
        if first[0] != sized:
            raise PlanError(
                f"{rule.where}.memoryLimit: {rule.target} gets a different memory size here than in {first[1]}; "
                "one resource has one size: give both entries the same memoryLimit (and memoryBurstLimit), or "
                "rename one of them"
            )
        previous = replicas_of.setdefault(rule.target, (rule.replicas, rule.where))
        if previous[0] != rule.replicas:
            raise PlanError(
                f"{rule.where}: {rule.target} gets {rule.replicas} replicas here but {previous[0]} in {previous[1]}; "
                "one resource has one replica count"
            )
    resources = []
    for name, devices in base.items():
        dedicated = [d for d in devices if d.physical_id not in claimed]
        if dedicated and name in replicated:
            raise PlanError(
                f"{name} would mix shared and dedicated devices ({len(dedicated)} not selected by "
                f"{replicas_of[name][1]}); select all of them, or rename the shared resource"
            )
        if dedicated:
            resources.append(Resource(name, tuple(dedicated)))
    for name, devices in replicated.items():
        ordered = sorted(devices, key=lambda d: (d.gpu_index, d.index, d.replica or 0))
        resources.append(
            Resource(
                name,
                tuple(ordered),
                sharing=sharing.strategy,
                replicas=replicas_of[name][0],
                fail_requests_greater_than_one=sharing.fail_requests_greater_than_one,
                mps=mps_of.get(name),
                memory=memory_of.get(name),
            )
        )
    return resources


def mps_client_cap(compute_capability: tuple[int, int], gi_slices: int | None = None, slices: int = 7) -> int:
    """How many MPS clients a device takes: 48 from Volta (CC 7.0 — NVIDIA's plugin wrongly uses 7.5), 16
    before; on a MIG device the 48 shrink in proportion to its share of the GPU's compute slices."""
    cap = 48 if compute_capability >= (7, 0) else 16
    if gi_slices is not None:
        cap = max(1, cap * gi_slices // slices)
    return cap


def _check_mps(rule: ReplicaRule, device: Device, inventory: Inventory) -> None:
    assert rule.mps is not None
    gpu = next(g for g in inventory.gpus if g.index == device.gpu_index)
    mig = next((m for m in gpu.mig_devices if m.uuid == device.mig_uuid), None)
    total_slices = max((m.gi_slices for m in gpu.mig_devices), default=7) if mig else 7
    cap = mps_client_cap(gpu.compute_capability, mig.gi_slices if mig else None, max(total_slices, 7))
    what = (
        f"MIG device {device.index} ({mig.profile})" if mig else f"GPU {device.index} ({gpu.name}, CC {gpu.cc_string})"
    )
    if rule.replicas > cap:
        raise PlanError(
            f"{rule.where}.replicas: {rule.replicas} MPS clients on {what} is more than its cap of {cap}; "
            f"use at most {cap} replicas"
        )
    per_client = rule.mps.memory_for(device.memory_mib, rule.replicas)
    if per_client > device.memory_mib:
        raise PlanError(
            f"{rule.where}.memoryLimit: {per_client} MiB per client is more than the {device.memory_mib} MiB of "
            f"{what} (oversubscribe cannot give a client more than the whole device); give at most "
            f"{device.memory_mib} MiB"
        )
    if per_client * rule.replicas > device.memory_mib and not rule.mps.oversubscribe:
        raise PlanError(
            f"{rule.where}.memoryLimit: {rule.replicas} clients x {per_client} MiB is more than the "
            f"{device.memory_mib} MiB of {what}; lower memoryLimit or replicas, or set oversubscribe: true"
        )


def _check_sized(rule: ReplicaRule, device: Device) -> None:
    """A time-sliced replica with a size: only the driver can hold it (no MPS server), never on a MIG device, and
    the replicas' guaranteed memory (their requests) must fit in the device, as must the burst ceiling."""
    assert rule.memory is not None
    what = f"MIG device {device.index} ({device.mig_profile})" if device.mig_uuid else f"GPU {device.index}"
    if device.mig_uuid is not None:
        raise PlanError(
            f"{rule.where}.memoryLimit: {rule.name} is a MIG device ({what}): the driver holds no container to a "
            "memory size on MIG devices and time-slicing has no MPS server to do it; remove memoryLimit, or share "
            "the MIG device with sharing.mps"
        )
    memory = rule.memory
    if memory.limit_mib > device.memory_mib:
        field = "memoryBurstLimit" if memory.limit_mib != memory.request_mib else "memoryLimit"
        raise PlanError(
            f"{rule.where}.{field}: {memory.limit_mib} MiB is more than the {device.memory_mib} MiB of {what}; "
            f"give at most {device.memory_mib} MiB"
        )
    if memory.request_mib * rule.replicas > device.memory_mib:
        raise PlanError(
            f"{rule.where}.memoryLimit: {rule.replicas} replicas x {memory.request_mib} MiB guaranteed is more than "
            f"the {device.memory_mib} MiB of {what}; lower memoryLimit or replicas (memoryBurstLimit lets a replica "
            "use more when the others leave it free)"
        )


def _select(rule: ReplicaRule, devices: list[Device], inventory: Inventory) -> list[Device]:
    selector: DeviceSelector = rule.devices
    if selector.takes_all:
        return devices
    if selector.count is not None:
        if selector.count > len(devices):
            raise PlanError(
                f"{rule.where}.devices: {selector.count} devices requested but {rule.name} has "
                f"{len(devices)} on this node"
            )
        return devices[: selector.count]
    chosen: list[Device] = []
    for position, ref in enumerate(selector.refs):
        wanted = _resolve_legacy_mig(ref, inventory)
        match = next((d for d in devices if wanted in (d.index, d.mig_uuid or d.gpu_uuid)), None)
        if match is None:
            raise PlanError(f"{rule.where}.devices[{position}]: {ref!r} is not a {rule.name} device on this node")
        if match not in chosen:
            chosen.append(match)
    return sorted(chosen, key=devices.index)


def _resolve_legacy_mig(ref: str, inventory: Inventory) -> str:
    """The R450 MIG form ``MIG-GPU-<uuid>/<gi>/<ci>`` names a MIG device by its GPU and GI/CI ids."""
    legacy = _LEGACY_MIG.match(ref)
    if legacy is None:
        return ref
    gpu = inventory.gpu_by_uuid(legacy[1])
    gi, ci = int(legacy[2]), int(legacy[3])
    mig = next((m for m in gpu.mig_devices if (m.gi_id, m.ci_id) == (gi, ci)), None) if gpu else None
    return mig.uuid if mig else ref


# ----- devices ----------------------------------------------------------------------------------------


def _pending_warning(gpu: Gpu) -> str:
    now, then = ("enabled", "disabled") if gpu.mig_enabled else ("disabled", "enabled")
    return (
        f"GPU {gpu.index} ({gpu.uuid}) has MIG {now} with a change to {then} pending until the GPU is reset; "
        f"it is advertised as MIG {now}"
    )


def _whole_mig_gpu_warning(gpu: Gpu, resource: str) -> str:
    """A MIG-enabled GPU under mig-strategy none. It is still advertised whole, as NVIDIA's plugin does
    (``internal/rm/device_map.go``: with strategy none every GPU is a GPU resource, MIG mode or not): ``none``
    promises NVIDIA's behaviour, a node moved from NVIDIA's plugin keeps the capacity its pods and quotas count
    on, and a pod that asks for the GPU itself (nvidia-smi, a MIG-aware tool) gets it. But CUDA runs only in a
    MIG device when MIG is on, and a pod given the parent GPU gets none: its CUDA finds no device to use. So
    the plan says so, naming the GPU, the resource and the fix."""
    return (
        f"GPU {gpu.index} ({gpu.uuid}) has MIG enabled: with mig-strategy none it is advertised whole as "
        f"{resource}, but CUDA in a pod given it finds no device it can use (CUDA runs only in MIG devices, and "
        "the pod gets none); use mig-strategy mixed (or single) to advertise its MIG devices, or disable MIG on it"
    )


def _mig_resource_name(mig: MigDevice) -> str:
    return f"nvidia.com/mig-{mig_resource_suffix(mig.profile)}"


def _gpu_device(gpu: Gpu) -> Device:
    return Device(
        id=gpu.uuid,
        gpu_uuid=gpu.uuid,
        gpu_index=gpu.index,
        index=str(gpu.index),
        memory_mib=gpu.memory_mib,
        numa_node=gpu.numa_node,
    )


def _mig_device(gpu: Gpu, mig: MigDevice) -> Device:
    return Device(
        id=mig.uuid,
        gpu_uuid=gpu.uuid,
        gpu_index=gpu.index,
        index=mig.index,
        memory_mib=mig.memory_mib,
        mig_uuid=mig.uuid,
        mig_profile=mig.profile,
        numa_node=gpu.numa_node,
    )


def _indices(indices: list[int]) -> str:
    return ", ".join(str(i) for i in indices)
