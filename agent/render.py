"""Human-readable output of the CLI: an inventory like ``nvidia-smi -L``, a plan as a table, GPU lists and
MIG layouts as a person reads them (``GPUs 0-7``, ``3g.40gb + 2g.20gb + 1g.10gb``, counts before their names)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from agent.core.inventory import Inventory
from agent.core.memlimits import ResourceEnforcement
from agent.core.mig_catalog import parse_profile_name
from agent.core.resources import Device, Resource, ResourcePlan


def inventory_text(inventory: Inventory) -> str:
    lines = []
    for gpu in inventory.gpus:
        lines.append(f"GPU {gpu.index}: {gpu.name} (UUID: {gpu.uuid})")
        for mig in gpu.mig_devices:
            lines.append(f"  MIG {mig.profile:<16} Device {mig.mig_index:>2}: (UUID: {mig.uuid})")
    for failure in inventory.failures:
        lines.append(f"GPU {failure.index}: Unable to describe the GPU: {failure}")
    return "\n".join(lines)


def inventory_details(inventory: Inventory) -> str:
    """One line per GPU with what the agent uses: memory, compute capability, MIG mode, NVLink, NUMA."""
    lines = [f"Driver {inventory.driver_version}, NVML {inventory.nvml_version}"]
    for gpu in inventory.gpus:
        mig = "n/a" if not gpu.mig_capable else ("enabled" if gpu.mig_enabled else "disabled")
        if gpu.mig_change_pending:
            mig += f" (pending: {'enabled' if gpu.mig_pending else 'disabled'} after reset)"
        peers = ",".join(str(p) for p in gpu.nvlink_peers) or "-"
        numa = "-" if gpu.numa_node is None else str(gpu.numa_node)
        lines.append(
            f"  GPU {gpu.index}  {gpu.memory_mib} MiB  CC {gpu.cc_string}  {gpu.architecture}  bus {gpu.pci_bus_id}"
            f"  MIG {mig}  NVLink peers {peers}  NUMA {numa}"
        )
    return "\n".join(lines)


def plan_table(plan: ResourcePlan, held: Sequence[ResourceEnforcement] = ()) -> str:
    """The devices, what would hold each sized resource's memory (``held``), then the one-line summary."""
    rows = [("RESOURCE", "DEVICE ID", "GPU", "INDEX", "PROFILE", "MEMORY")]
    for resource in plan.resources:
        for device in resource.devices:
            rows.append(
                (
                    resource.name,
                    device.id,
                    str(device.gpu_index),
                    device.index,
                    device.mig_profile or "-",
                    _memory(resource, device),
                )
            )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    summary = ", ".join(_resource_summary(r) for r in plan.resources) or "nothing"
    lines += memory_limit_lines(held)
    lines.append("")
    lines.append(f"Advertised (mig-strategy {plan.mig_strategy}): {summary}")
    lines += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(lines)


def memory_limit_lines(held: Sequence[ResourceEnforcement]) -> list[str]:
    """``tessera plan``: what would hold each sized resource's containers to their size on this node, and why."""
    if not held:
        return []
    lines = ["", "Memory limits (per container, each replica's size):"]
    for row in held:
        size = f"request {row.request_mib} MiB, limit {row.limit_mib} MiB"
        lines.append(f"  {row.resource}: {size}; {row.enforcement}: {row.reason}")
    return lines


def _memory(resource: Resource, device: Device) -> str:
    """What a pod given the device may use: an MPS replica's slice (``10240 MiB of 81920``), a time-sliced
    replica's whole GPU, shared with the other replicas (``81920 MiB shared``), else the device's memory."""
    if resource.mps is not None:
        return f"{resource.memory_of(device)} MiB of {device.memory_mib}"
    if resource.sharing == "time-slicing" and resource.memory is not None:
        request, limit = resource.memory.request_mib, resource.memory.limit_mib
        return f"{request} MiB of {device.memory_mib}" + (f", bursts to {limit}" if limit != request else "")
    if resource.sharing == "time-slicing":
        return f"{device.memory_mib} MiB shared"
    return f"{device.memory_mib} MiB"


def _resource_summary(resource: Resource) -> str:
    if resource.sharing == "none":
        return f"{resource.name} × {len(resource.devices)}"
    return f"{resource.name} × {len(resource.devices)} ({resource.sharing}, {resource.replicas} per device)"


def gpu_list(indices: Iterable[int]) -> str:
    """``GPU 3``, ``GPUs 0-7``, ``GPUs 0-3, 5``: runs of consecutive indices as ranges."""
    ordered = sorted(set(indices))
    runs: list[list[int]] = []
    for index in ordered:
        if runs and index == runs[-1][-1] + 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    text = ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs)
    return f"GPU {text}" if len(ordered) == 1 else f"GPUs {text}"


def model_name(name: str) -> str:
    """A GPU product as the hardware tables name it: ``A100-SXM4-80GB`` for ``NVIDIA A100-SXM4-80GB``."""
    return name.removeprefix("NVIDIA ")


def instances_text(devices: Iterable[tuple[str, int]] | Mapping[str, int]) -> str:
    """MIG instances largest first (``3g.40gb + 2g.20gb + 1g.10gb``), a count before a name it repeats;
    ``no instances`` for none."""
    pairs = [(name, count) for name, count in (devices.items() if isinstance(devices, Mapping) else devices) if count]

    def size(pair: tuple[str, int]) -> tuple[int, int, str]:
        try:
            parsed = parse_profile_name(pair[0])
        except ValueError:
            return (0, 0, pair[0])
        return (-parsed.gpu_slices, -parsed.memory_gb, pair[0])

    parts = [name if count == 1 else f"{count} × {name}" for name, count in sorted(pairs, key=size)]
    return " + ".join(parts) or "no instances"
