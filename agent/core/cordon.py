"""Per-GPU cordon: an operator takes GPUs out of service by annotating the Node, without a restart.

The annotation value lists GPUs by UUID (``GPU-…``), by index (``3``) or MIG devices by UUID (``MIG-…``),
separated by commas or spaces — HAMi's ``hami.io/device-cordon`` (comma-separated GPU UUIDs) is read the same
way. A cordoned unit's devices are advertised Unhealthy with the reason ``cordoned``: the kubelet places no
new pod on them and pods already running there are untouched. Removing the entry restores them.

Entries that name nothing on this node (a typo, another node's UUID, an index out of range) are reported and
ignored; they never stop the valid ones from applying, and never stop the agent.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from msgspec import Struct, field

from agent.core.inventory import Inventory

CORDON_REASON = "cordoned"
MAX_ENTRIES = 256  # a node has at most a few dozen GPUs and MIG devices; anything beyond is junk
_SEPARATORS = re.compile(r"[,\s]+")


class Cordon(Struct, frozen=True):
    """What the annotations take out of service, and what in them could not be understood."""

    units: frozenset[str] = frozenset()  # GPU and MIG device UUIDs
    sources: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # unit -> the annotation keys naming it
    problems: tuple[str, ...] = ()


NO_CORDON = Cordon()


def parse_cordon(annotations: Mapping[str, str | None], inventory: Inventory) -> Cordon:
    """The units the cordon annotations (key -> value, None when absent) name on this node."""
    by_index = {str(gpu.index): gpu.uuid for gpu in inventory.gpus}
    known = {gpu.uuid for gpu in inventory.gpus} | {mig.uuid for gpu in inventory.gpus for mig in gpu.mig_devices}
    sources: dict[str, list[str]] = {}
    problems: list[str] = []
    for key, value in sorted(annotations.items()):
        if not value:
            continue
        entries = [entry for entry in _SEPARATORS.split(value) if entry]
        if len(entries) > MAX_ENTRIES:
            problems.append(f"{key}: {len(entries)} entries, at most {MAX_ENTRIES} are read; the rest are ignored")
            entries = entries[:MAX_ENTRIES]
        for entry in entries:
            unit = by_index.get(entry, entry)
            if unit in known:
                sources.setdefault(unit, []).append(key)
            else:
                problems.append(
                    f"{key}: {_printable(entry)!r} is not a GPU or MIG device of this node; {_hint(inventory)}"
                )
    return Cordon(frozenset(sources), {unit: tuple(keys) for unit, keys in sources.items()}, tuple(problems))


def _hint(inventory: Inventory) -> str:
    if not inventory.gpus:
        return "this node has no GPUs"
    last = inventory.gpus[-1].index
    return f"name GPUs by index (0-{last}) or UUID (GPU-…), MIG devices by UUID (MIG-…)"


def _printable(entry: str, limit: int = 80) -> str:
    """An entry as it can safely go into a log line or an Event: bounded, no control characters."""
    clean = "".join(ch if ch.isprintable() else "?" for ch in entry)
    return clean if len(clean) <= limit else clean[: limit - 1] + "…"
