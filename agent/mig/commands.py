"""``tessera mig export | assert | apply``: mig-parted's three verbs, on a simulated node or the real driver."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from agent.core.drain import Drain, busy_reasons, mig_drain
from agent.core.inventory import Inventory
from agent.core.mig_layout import CreateInstance, DestroyInstance, LayoutError, Operation, SetMigMode, diff_node
from agent.gpu.discovery import discover
from agent.gpu.mig import MigOperationError, create_instance, destroy_instance, set_mig_mode
from agent.gpu.processes import ProcessesUnknown, device_processes
from agent.mig.layout_file import (
    LayoutFileError,
    export_layout,
    layouts_for_node,
    parse_layout_file,
    read_layout_file,
)

EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_INVALID = 2
EXIT_FAILED = 3
EXIT_BUSY = 4


def export(output_format: str, label: str) -> int:
    document = export_layout(discover().gpus, label)
    print(json.dumps(document, indent=2) if output_format == "json" else yaml.safe_dump(document, sort_keys=False))
    return EXIT_OK


def _operations(config: Path, name: str | None, inventory: Inventory) -> dict[int, tuple[Operation, ...]]:
    layout_file = parse_layout_file(read_layout_file(config), str(config))
    if name is None:
        if len(layout_file.mig_configs) != 1:
            raise LayoutFileError(f"{config}: several mig-configs; choose one with --name")
        name = next(iter(layout_file.mig_configs))
    return diff_node(inventory.gpus, layouts_for_node(layout_file, name, inventory.gpus))


def assert_layout(config: Path, name: str | None) -> int:
    try:
        operations = _operations(config, name, discover())
    except (LayoutFileError, LayoutError) as error:
        print(f"tessera: {error}", file=sys.stderr)
        return EXIT_INVALID
    if operations:
        print("assertion failure: selected configuration not currently applied")
        for gpu_index, ops in sorted(operations.items()):
            print(f"  GPU {gpu_index}: {len(ops)} operations needed")
        return EXIT_MISMATCH
    print("Selected MIG configuration currently applied")
    return EXIT_OK


def apply(config: Path, name: str | None, dry_run: bool) -> int:
    inventory = discover()
    try:
        operations = _operations(config, name, inventory)
    except (LayoutFileError, LayoutError) as error:
        print(f"tessera: {error}", file=sys.stderr)
        return EXIT_INVALID
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
    pending = []
    try:
        for gpu_index, ops in sorted(operations.items()):
            for op in ops:
                if isinstance(op, SetMigMode) and not set_mig_mode(gpu_index, op.enabled):
                    pending.append(gpu_index)
                    break
                if isinstance(op, DestroyInstance):
                    destroy_instance(gpu_index, op.gi_id)
                elif isinstance(op, CreateInstance):
                    create_instance(gpu_index, op.profile_id, op.placement, op.ci_profile_id)
    except MigOperationError as error:
        print(f"tessera: MIG configuration failed: {error}; run again to converge", file=sys.stderr)
        return EXIT_FAILED
    if pending:
        print(f"reset-required: GPU(s) {', '.join(map(str, pending))} need a reset for the MIG mode change")
        return EXIT_MISMATCH
    print("MIG configuration applied successfully")
    return EXIT_OK


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
