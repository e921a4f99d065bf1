"""``tessera mig export | assert | apply``: mig-parted's three verbs, on a simulated node or the real driver.

``--config`` takes a MIG layout file (mig-parted's format) or a sharing config whose ``migLayout`` holds
the layouts (or a ConfigMap manifest of configs: the config the agent would choose on this node). Every
problem is reported before anything changes, grouped once for the GPUs it applies to.

Exit codes (docs/configuration.md, "Exit codes"; the same meaning in every command):
0 done or nothing to do, 1 invalid input (a file, a name, a layout that does not fit), 3 an NVML error half
way (run again to converge), 4 processes in the way, 5 the node is not (yet) in the layout (``assert``:
it differs; ``apply``: a MIG mode change waits for a GPU reset). 2 is the command line (argparse, --node).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

import yaml
from msgspec import Struct

from agent.config.model import ConfigError
from agent.core.drain import Drain, busy_reasons, mig_drain
from agent.core.inventory import Gpu, Inventory
from agent.core.mig_catalog import mig_catalog
from agent.core.mig_layout import (
    CreateInstance,
    DesiredLayout,
    DestroyInstance,
    LayoutError,
    Operation,
    SetMigMode,
    current_layout,
    diff_gpu,
)
from agent.gpu.discovery import discover
from agent.gpu.mig import MigOperationError, create_instance, destroy_instance, set_mig_mode
from agent.gpu.processes import ProcessesUnknown, device_processes
from agent.mig.layout_file import (
    LayoutFileError,
    MigLayoutFile,
    config_layout,
    export_layout,
    layouts_for_node,
    misfit,
    parse_layout_file,
    read_layout_file,
    unfit_problems,
)
from agent.render import gpu_list, instances_text, model_name

EXIT_OK = 0
EXIT_INVALID = 1
EXIT_FAILED = 3  # = agent.cli.EXIT_NVML: the driver said no
EXIT_BUSY = 4
EXIT_NOT_APPLIED = 5

_LAYOUT_SUFFIXES = (".yaml", ".yml", ".json")


class SelectedLayout(Struct, frozen=True):
    """The layout a command applies: per GPU index, and what it is called where it came from."""

    name: str
    source: str  # "configs/layouts.yaml", "configs/h100-balanced.yaml migLayout.layouts"
    layouts: dict[int, DesiredLayout]


def export(output_format: str, label: str) -> int:
    document = export_layout(discover().gpus, label)
    print(json.dumps(document, indent=2) if output_format == "json" else yaml.safe_dump(document, sort_keys=False))
    return EXIT_OK


# ----- what to apply ----------------------------------------------------------------------------------


def select_layout(config: str, name: str | None, gpus: Sequence[Gpu]) -> SelectedLayout:
    """The layout ``--config`` (and ``--name``) select on this node; LayoutFileError or ConfigError says why not.

    A directory is refused with the file to name instead; a sharing config (or a ConfigMap manifest) is read
    as the agent reads it: the config that applies to these GPUs, its ``migLayout``, ``--name`` winning over
    ``migLayout.config`` as the node label ``nvidia.com/mig.config`` does.
    """
    path = Path(config)
    if path.is_dir():
        raise LayoutFileError(_directory_sentence(config, path))
    data = read_layout_file(path)
    if isinstance(data, dict) and "mig-configs" in data:
        layout_file = parse_layout_file(data, str(path))
        chosen = name
        if chosen is None:
            if len(layout_file.mig_configs) != 1:
                message = f"several mig-configs ({', '.join(layout_file.mig_configs)}); choose one with --name"
                raise LayoutFileError(f"{path}: {message}", [message])
            chosen = next(iter(layout_file.mig_configs))
    else:
        layout_file, chosen = _from_sharing_config(path, name, gpus)
    return layout_on_node(layout_file, chosen, gpus)


def layout_on_node(layout_file: MigLayoutFile, name: str, gpus: Sequence[Gpu]) -> SelectedLayout:
    """mig-config ``name`` of the file, walked over these GPUs; LayoutFileError if it is not there.

    Where it gives no MIG-capable GPU of this node a layout, so that :func:`node_operations` judges nothing,
    it is judged against every GPU model: a layout that fits none is an error on any node (a T4 node too).
    """
    layouts = layouts_for_node(layout_file, name, gpus)
    if not any(gpu.mig_capable and gpu.index in layouts for gpu in gpus):
        problems = unfit_problems(layout_file, name)
        if problems:
            raise LayoutFileError(f"{layout_file.origin}: " + "; ".join(problems), problems)
    return SelectedLayout(name, layout_file.origin, layouts)


def _from_sharing_config(path: Path, name: str | None, gpus: Sequence[Gpu]) -> tuple[MigLayoutFile, str]:
    from agent.config.source import load_config, read_config_set

    config_set = read_config_set(path)
    loaded = load_config(config_set, gpu_products=[g.name for g in gpus])
    if loaded.name is None:
        message = f"the agent would apply no config of it on this node ({loaded.reason}), so no MIG layout either"
        raise LayoutFileError(f"{path}: {message}", [message])
    config_set_origin = config_set.origin_of(loaded.name)
    selected = config_layout(loaded.model.mig_layout, config_set_origin, name)
    if selected is None:
        message = (
            "a sharing config without migLayout.layouts: it asks for no MIG layout; give a MIG layout file "
            "(mig-parted's format: version and mig-configs) or a sharing config with migLayout"
        )
        raise LayoutFileError(f"{config_set_origin}: {message}", [message])
    layout_file, chosen = selected
    if chosen is None:
        message = (
            f"migLayout.layouts has several mig-configs ({', '.join(layout_file.mig_configs)}) and "
            "migLayout.config names none; choose one with --name"
        )
        raise LayoutFileError(f"{config_set_origin}: {message}", [message])
    return layout_file, chosen


def _directory_sentence(shown: str, path: Path) -> str:
    """``configs/ is a directory; name a file in it, e.g. configs/h100-balanced.yaml`` (one with a layout)."""
    try:
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in _LAYOUT_SUFFIXES)
    except OSError:
        files = []
    with_layout = [p for p in files if _mentions_layout(p)]
    example = (with_layout or files or [None])[0]
    if example is None:
        return f"{shown} is a directory; name a MIG layout file or a sharing config file with migLayout"
    joined = f"{shown}{example.name}" if shown.endswith("/") else f"{shown}/{example.name}"
    return f"{shown} is a directory; name a file in it, e.g. {joined}"


def _mentions_layout(path: Path) -> bool:
    try:
        with path.open("rb") as stream:
            head = stream.read(1 << 16)
    except OSError:
        return False
    return b"mig-configs" in head or b"migLayout" in head


# ----- the operations, with every problem grouped ------------------------------------------------------


def node_operations(gpus: Sequence[Gpu], layouts: Mapping[int, DesiredLayout]) -> dict[int, tuple[Operation, ...]]:
    """The operations per GPU index (``diff_gpu`` for each GPU with a layout), or one LayoutError whose
    problems say each reason once, for the GPUs it applies to: ``GPUs 0-7 (A100-SXM4-80GB): 7g.80gb +
    1g.10gb does not fit: ...``. GPUs without a layout, and non-MIG-capable GPUs asked for MIG off, are left
    alone (as :func:`agent.core.mig_layout.diff_node` leaves them)."""
    result: dict[int, tuple[Operation, ...]] = {}
    failed: dict[tuple[str, str], list[int]] = {}
    for gpu in sorted(gpus, key=lambda g: g.index):
        desired = layouts.get(gpu.index)
        if desired is None or (not gpu.mig_capable and not desired.enabled):
            continue
        catalog = mig_catalog(gpu.pci_device_id) if gpu.mig_capable else None
        model = _model(gpu)
        if not gpu.mig_capable:
            problem = "not MIG-capable: MIG cannot be enabled"
        elif catalog is None:
            problem = f"no MIG profiles are known for this model (PCI device id 0x{gpu.pci_device_id:08X})"
        else:
            try:
                ops = diff_gpu(gpu, desired, catalog)
            except LayoutError as error:
                reason = misfit(catalog, desired) or "; ".join(error.problems)
                problem = f"{instances_text(desired.devices)} does not fit: {reason}"
            else:
                if ops:
                    result[gpu.index] = ops
                continue
        failed.setdefault((model, problem), []).append(gpu.index)
    if failed:
        problems = [f"{gpu_list(indices)} ({model}): {problem}" for (model, problem), indices in failed.items()]
        raise LayoutError("; ".join(problems), problems)
    return result


def left_alone(gpus: Sequence[Gpu], layouts: Mapping[int, DesiredLayout]) -> list[str]:
    """The GPUs a layout does not touch, grouped: not MIG-capable, or selected by none of its specs."""
    groups: dict[tuple[str, str], list[int]] = {}
    for gpu in gpus:
        desired = layouts.get(gpu.index)
        if desired is not None and (gpu.mig_capable or desired.enabled):
            continue
        why = "not MIG-capable" if not gpu.mig_capable else "selected by none of the layout's specs"
        groups.setdefault((model_name(gpu.name), why), []).append(gpu.index)
    return [f"{gpu_list(indices)} ({model}): {why}, left as is" for (model, why), indices in groups.items()]


def report_invalid(error: Exception) -> int:
    """A problem with the input: the message, each problem on its own line when there are several, and the
    offending line of a YAML syntax error under it."""
    problems = getattr(error, "problems", None) or [str(error)]
    if isinstance(error, LayoutError) and len(problems) > 1:
        print("tessera: the MIG layout cannot be applied to this node:", file=sys.stderr)
        for problem in problems:
            print(f"  {problem}", file=sys.stderr)
    else:
        print(f"tessera: {error}", file=sys.stderr)
    cause = error.__cause__ if isinstance(error, LayoutFileError) else error
    for line in getattr(cause, "excerpt", ()):
        print(line, file=sys.stderr)
    return EXIT_INVALID


# ----- the verbs -----------------------------------------------------------------------------------------


def assert_layout(config: str, name: str | None) -> int:
    inventory = discover()
    try:
        selected = select_layout(config, name, inventory.gpus)
        operations = node_operations(inventory.gpus, selected.layouts)
    except (LayoutFileError, LayoutError, ConfigError) as error:
        return report_invalid(error)
    if not selected.layouts:  # as mig-parted: nothing to check is nothing amiss; but say so
        print(f"Nothing to check: the layout {selected.name} selects no GPU of this node")
        for line in left_alone(inventory.gpus, selected.layouts):
            print(f"  {line}")
        return EXIT_OK
    if operations:
        print("assertion failure: selected configuration not currently applied")
        needed: dict[int, list[int]] = {}
        for gpu_index, ops in sorted(operations.items()):
            needed.setdefault(len(ops), []).append(gpu_index)
        for count, indices in needed.items():
            print(f"  {gpu_list(indices)}: {count} operations needed" + (" each" if len(indices) > 1 else ""))
        return EXIT_NOT_APPLIED
    print("Selected MIG configuration currently applied")
    return EXIT_OK


def apply(config: str, name: str | None, dry_run: bool) -> int:
    inventory = discover()
    try:
        selected = select_layout(config, name, inventory.gpus)
        operations = node_operations(inventory.gpus, selected.layouts)
    except (LayoutFileError, LayoutError, ConfigError) as error:
        return report_invalid(error)
    print(f"MIG layout {selected.name} from {selected.source}")
    skipped = left_alone(inventory.gpus, selected.layouts)
    if not selected.layouts:
        print("Nothing to do: the layout selects no GPU of this node")
        for line in skipped:
            print(f"  {line}")
        return EXIT_OK
    for line in skipped:
        print(line)
    if not operations:
        print("Selected MIG configuration currently applied; nothing to do")
        return EXIT_OK
    for gpu_index, ops in sorted(operations.items()):
        for op in ops:
            print(f"GPU {gpu_index}: {describe(op)}")
    if dry_run:
        print("dry run: nothing was changed")
        return EXIT_OK
    busy = _running_processes(operations, inventory)
    if busy:
        print(
            f"tessera: refusing to change MIG: {'; '.join(busy)}. Stop those processes (drain the node's GPU "
            "pods) and run again; the running agent does this by itself.",
            file=sys.stderr,
        )
        return EXIT_BUSY
    try:
        pending = execute(operations)
    except MigOperationError as error:
        print(f"tessera: MIG configuration failed: {error}; run again to converge", file=sys.stderr)
        return EXIT_FAILED
    if pending:
        print(f"reset-required: {gpu_list(pending)} need a reset for the MIG mode change")
        return EXIT_NOT_APPLIED
    print("MIG configuration applied successfully")
    return EXIT_OK


def execute(operations: Mapping[int, Sequence[Operation]]) -> list[int]:
    """Run the operations through NVML, GPU by GPU, in order; the GPUs whose MIG mode change waits for a
    reset (the rest of their operations are not run). MigOperationError names the GPU and the NVML error."""
    pending = []
    for gpu_index, ops in sorted(operations.items()):
        for op in ops:
            if isinstance(op, SetMigMode) and not set_mig_mode(gpu_index, op.enabled):
                pending.append(gpu_index)
                break
            if isinstance(op, DestroyInstance):
                destroy_instance(gpu_index, op.gi_id)
            elif isinstance(op, CreateInstance):
                create_instance(gpu_index, op.profile_id, op.placement, op.ci_profile_id)
    return pending


def _running_processes(operations: dict[int, tuple[Operation, ...]], inventory: Inventory) -> list[str]:
    """What runs where the change would destroy something (NVML's view; unknown counts as running)."""
    drain = mig_drain(operations, inventory)
    try:
        processes = device_processes(sorted(drain.scopes))
    except ProcessesUnknown as error:
        return [f"cannot tell whether processes run on the GPUs: {error}"]
    return busy_reasons(Drain(scopes=drain.scopes), {}, processes)


def describe(op: Operation) -> str:
    if isinstance(op, SetMigMode):
        return f"set MIG mode {'enabled' if op.enabled else 'disabled'}"
    if isinstance(op, DestroyInstance):
        return f"destroy {op.profile} (GPU instance {op.gi_id} at {op.placement})"
    return f"create {op.profile} at {op.placement}"


# ----- a preview: what the layout does, and the node after it --------------------------------------------


class _Resettable(Protocol):
    def reset_gpu(self, index: int) -> None: ...


class GpuChange(Struct, frozen=True):
    """One GPU under the layout: as it is, as it will be, and the operations between."""

    index: int
    model: str
    before: DesiredLayout
    after: DesiredLayout
    operations: tuple[str, ...]
    reset_required: bool = False  # the MIG mode change waits for a GPU reset

    def to_json(self) -> dict[str, object]:
        return {
            "model": self.model,
            "before": _layout_json(self.before),
            "after": _layout_json(self.after),
            "operations": list(self.operations),
            "reset_required": self.reset_required,
        }


class MigPreview(Struct, frozen=True):
    """What a layout does to a node, for ``tessera plan``."""

    name: str
    source: str
    changes: tuple[GpuChange, ...]
    left_alone: tuple[str, ...]
    after_layout: bool  # the resources planned are those after the layout (a simulated node, or nothing to do)

    def lines(self) -> list[str]:
        """``GPUs 0-7 (H100-SXM5-80GB): MIG disabled -> MIG enabled: 3g.40gb + ... (5 operations each)``."""
        groups: dict[tuple[str, str, str, int, bool], list[int]] = {}
        for change in self.changes:
            key = (
                change.model,
                _summary(change.before),
                _summary(change.after),
                len(change.operations),
                change.reset_required,
            )
            groups.setdefault(key, []).append(change.index)
        lines = [f"MIG layout {self.name} ({self.source}):"]
        for (model, before, after, count, reset), indices in groups.items():
            if not count:
                lines.append(f"  {gpu_list(indices)} ({model}): {after}, as it is now")
                continue
            each = " each" if len(indices) > 1 else ""
            wait = "; the MIG mode change waits for a GPU reset (reset-required), shown as after it" if reset else ""
            lines.append(f"  {gpu_list(indices)} ({model}): {before} -> {after} ({count} operations{each}{wait})")
        lines += [f"  {line}" for line in self.left_alone]
        return lines

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "source": self.source,
            "resources_after_layout": self.after_layout,
            "gpus": {str(c.index): c.to_json() for c in self.changes},
            "left_as_is": list(self.left_alone),
        }


def preview(selected: SelectedLayout, inventory: Inventory, node: _Resettable | None) -> tuple[MigPreview, Inventory]:
    """The layout's effect, and the node after it: on a simulated ``node`` the operations are run (a MIG mode
    change that waits for a reset gets the reset, as an administrator would give it) and the node read again;
    on the real driver (``node`` None) nothing is changed and the inventory is the one given."""
    operations = node_operations(inventory.gpus, selected.layouts)
    pending: list[int] = []
    after = inventory
    if operations and node is not None:
        pending = execute(operations)
        if pending:
            for index in pending:
                node.reset_gpu(index)
            rest = node_operations(discover().gpus, {i: selected.layouts[i] for i in pending})
            execute(rest)
        after = discover()
    changes = tuple(
        GpuChange(
            gpu.index,
            _model(gpu),
            current_layout(gpu),
            selected.layouts[gpu.index],
            tuple(describe(op) for op in operations.get(gpu.index, ())),
            gpu.index in pending,
        )
        for gpu in sorted(inventory.gpus, key=lambda g: g.index)
        if gpu.index in selected.layouts and gpu.mig_capable
    )
    result = MigPreview(
        selected.name,
        selected.source,
        changes,
        tuple(left_alone(inventory.gpus, selected.layouts)),
        after_layout=node is not None or not operations,
    )
    return result, after


def _model(gpu: Gpu) -> str:
    catalog = mig_catalog(gpu.pci_device_id) if gpu.mig_capable else None
    return catalog.key if catalog is not None else model_name(gpu.name)


def _summary(layout: DesiredLayout) -> str:
    """``MIG disabled``, ``MIG enabled: 3g.40gb + 2g.20gb``."""
    return f"MIG enabled: {instances_text(layout.devices)}" if layout.enabled else "MIG disabled"


def _layout_json(layout: DesiredLayout) -> dict[str, object]:
    return {"mig_enabled": layout.enabled, "devices": dict(layout.devices)}
