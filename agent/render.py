"""Human-readable output of the CLI: an inventory like ``nvidia-smi -L``, a plan as a table."""

from __future__ import annotations

from agent.core.inventory import Inventory
from agent.core.resources import Resource, ResourcePlan


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


def plan_table(plan: ResourcePlan) -> str:
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
                    f"{device.memory_mib} MiB",
                )
            )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    summary = ", ".join(_resource_summary(r) for r in plan.resources) or "nothing"
    lines.append("")
    lines.append(f"Advertised (mig-strategy {plan.mig_strategy}): {summary}")
    lines += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(lines)


def _resource_summary(resource: Resource) -> str:
    if resource.sharing == "none":
        return f"{resource.name} × {len(resource.devices)}"
    return f"{resource.name} × {len(resource.devices)} ({resource.sharing}, {resource.replicas} per device)"
