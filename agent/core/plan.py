"""``plan(config, inventory) -> ResourcePlan``: which resources the node advertises, with which devices."""

from __future__ import annotations

from collections import defaultdict

from agent.core.inventory import Gpu, Inventory, MigDevice
from agent.core.mig_naming import mig_resource_suffix
from agent.core.resources import (
    GPU_RESOURCE,
    Device,
    MigStrategy,
    PlanConfig,
    PlanError,
    Resource,
    ResourcePlan,
)


def plan(config: PlanConfig, inventory: Inventory) -> ResourcePlan:
    """Map the node's GPUs and MIG devices to resources, following NVIDIA's MIG strategies.

    GPUs that NVML could not describe are left out with a warning. Deterministic: devices are ordered
    by GPU index, then MIG device index.
    """
    warnings = [f"{failure}; its devices are not advertised" for failure in inventory.failures]
    warnings += [_pending_warning(gpu) for gpu in inventory.gpus if gpu.mig_change_pending]
    by_resource: dict[str, list[Device]] = defaultdict(list)

    strategy = config.mig_strategy
    if strategy is MigStrategy.SINGLE:
        _check_single(inventory)
    for gpu in sorted(inventory.gpus, key=lambda g: g.index):
        if strategy is MigStrategy.NONE or not gpu.mig_enabled:
            by_resource[GPU_RESOURCE].append(_gpu_device(gpu))
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
            name = GPU_RESOURCE if strategy is MigStrategy.SINGLE else _mig_resource_name(mig)
            by_resource[name].append(_mig_device(gpu, mig))

    resources = tuple(Resource(name, tuple(devices)) for name, devices in sorted(by_resource.items()))
    return ResourcePlan(resources=resources, mig_strategy=strategy, warnings=tuple(warnings))


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


def _pending_warning(gpu: Gpu) -> str:
    now, then = ("enabled", "disabled") if gpu.mig_enabled else ("disabled", "enabled")
    return (
        f"GPU {gpu.index} ({gpu.uuid}) has MIG {now} with a change to {then} pending until the GPU is reset; "
        f"it is advertised as MIG {now}"
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
