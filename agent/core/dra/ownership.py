"""Which front end serves each GPU: the DRA driver or the device plugin, never both.

The config's ``dra`` section names the GPUs DRA serves (``all``, or indices and UUIDs); every other GPU stays
with the device plugin. A GPU that moves from one front end to the other moves only when nothing uses it
(``transition``): until then it stays where it is, so no running workload loses its device and no device is
ever offered twice.
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from typing import Literal

from msgspec import Struct
from msgspec.structs import replace

from agent.core.inventory import Gpu, Inventory
from agent.core.resources import PlanError


class OwnershipError(PlanError):
    """The ``dra.gpus`` list names GPUs this node does not have; the message names them and what exists."""


def dra_gpus(
    gpus: Literal["all"] | Sequence[int | str] | None, inventory: Inventory, *, field: str = "dra.gpus"
) -> frozenset[str]:
    """The UUIDs of the GPUs the config's ``dra.gpus`` gives to DRA on this node (None: DRA is off)."""
    if gpus is None:
        return frozenset()
    if gpus == "all":
        return frozenset(g.uuid for g in inventory.gpus)
    by_index = {g.index: g.uuid for g in inventory.gpus}
    uuids = {g.uuid for g in inventory.gpus}
    chosen, unknown = set(), []
    for entry in gpus:
        uuid = by_index.get(entry) if isinstance(entry, int) else (entry if entry in uuids else None)
        if uuid is None:
            unknown.append(str(entry))
        else:
            chosen.add(uuid)
    if unknown:
        have = ", ".join(f"{g.index} ({g.uuid})" for g in inventory.gpus) or "none"
        raise OwnershipError(f"{field}: {', '.join(unknown)} is not a GPU of this node; it has {have}")
    return frozenset(chosen)


def dynamic_mig_gpus(
    dynamic: Literal["all"] | Sequence[int | str] | None, served: Set[str], inventory: Inventory
) -> frozenset[str]:
    """The UUIDs of the GPUs the config's ``dra.dynamicMig`` puts in dynamic-MIG mode: ``all`` is every
    MIG-capable GPU DRA serves; a GPU named that DRA does not serve, or that cannot do MIG, is an error."""
    from agent.core.mig_catalog import mig_catalog

    def capable(gpu: Gpu) -> bool:
        return gpu.mig_capable and mig_catalog(gpu.pci_device_id) is not None

    if dynamic is None:
        return frozenset()
    gpus = [g for g in inventory.gpus if g.uuid in served]
    if dynamic == "all":
        return frozenset(g.uuid for g in gpus if capable(g))
    named = dra_gpus(dynamic, inventory, field="dra.dynamicMig")
    problems = []
    for gpu in sorted((g for g in inventory.gpus if g.uuid in named), key=lambda g: g.index):
        if gpu.uuid not in served:
            problems.append(f"GPU {gpu.index} is not served by DRA (add it to dra.gpus)")
        elif not capable(gpu):
            problems.append(f"GPU {gpu.index} ({gpu.name}) cannot do MIG")
    if problems:
        raise OwnershipError(f"dra.dynamicMig: {'; '.join(problems)}")
    return named


def shared_gpus(
    shares: Literal["all"] | Sequence[int | str] | None,
    served: Set[str],
    dynamic: Set[str],
    inventory: Inventory,
) -> frozenset[str]:
    """The UUIDs of the GPUs the config's ``dra.gpuShares`` shares by memory (``agent.core.dra.shares``): ``all``
    is every GPU DRA serves that is not in dynamic-MIG mode; a GPU named that DRA does not serve, or that
    ``dra.dynamicMig`` also names, is an error. A GPU in MIG mode is shared through its MIG devices: each of them is
    published for shares."""
    if shares is None:
        return frozenset()
    if shares == "all":
        return frozenset(g.uuid for g in inventory.gpus if g.uuid in served and g.uuid not in dynamic)
    named = dra_gpus(shares, inventory, field="dra.gpuShares")
    problems = []
    for gpu in sorted((g for g in inventory.gpus if g.uuid in named), key=lambda g: g.index):
        if gpu.uuid not in served:
            problems.append(f"GPU {gpu.index} is not served by DRA (add it to dra.gpus)")
        elif gpu.uuid in dynamic:
            problems.append(
                f"GPU {gpu.index} is in dra.dynamicMig: a GPU is split by MIG or shared by memory, not both"
            )
    if problems:
        raise OwnershipError(f"dra.gpuShares: {'; '.join(problems)}")
    return named


def without(inventory: Inventory, uuids: Set[str]) -> Inventory:
    """The inventory the device plugin plans from: the GPUs DRA serves left out."""
    if not uuids:
        return inventory
    return replace(inventory, gpus=tuple(g for g in inventory.gpus if g.uuid not in uuids))


class Transition(Struct, frozen=True):
    """Where each GPU is served now, and the moves that wait because the GPU is in use."""

    dra: frozenset[str]  # served by DRA now
    waiting: dict[str, str]  # GPU UUID -> why its move waits ("to DRA: ...", "to the device plugin: ...")


def transition(
    current: Set[str],
    wanted: Set[str],
    busy_in_plugin: Set[str],
    busy_in_dra: Set[str],
    reasons: dict[str, str] | None = None,
) -> Transition:
    """Move every GPU whose front end changes, unless it is in use where it is now (``busy_*``: GPU UUIDs with
    a kubelet allocation or a process on them, or with a prepared claim); those stay and wait."""
    reasons = reasons or {}
    dra, waiting = set(current & wanted), {}
    for uuid in wanted - current:
        if uuid in busy_in_plugin:
            waiting[uuid] = f"to DRA: {reasons.get(uuid, 'in use by a device-plugin pod')}"
        else:
            dra.add(uuid)
    for uuid in current - wanted:
        if uuid in busy_in_dra:
            dra.add(uuid)
            waiting[uuid] = f"to the device plugin: {reasons.get(uuid, 'a prepared claim holds it')}"
    return Transition(frozenset(dra), waiting)
