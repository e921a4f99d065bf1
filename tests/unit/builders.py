"""Hand-built inventory values for pure tests: one A100-SXM4-80GB, with whatever a test needs changed."""

from __future__ import annotations

from agent.core.inventory import Gpu


def a100(index: int, uuid: str, **changes: object) -> Gpu:
    """GPU ``index`` of a node of A100-SXM4-80GB, MIG capable and disabled unless ``changes`` say otherwise."""
    fields: dict[str, object] = {
        "index": index,
        "uuid": uuid,
        "name": "NVIDIA A100-SXM4-80GB",
        "memory_mib": 81920,
        "compute_capability": (8, 0),
        "pci_bus_id": f"00000000:{0x18 + index:02X}:00.0",
        "pci_device_id": 0x20B210DE,
        "minor_number": index,
        "architecture": "Ampere",
        "mig_capable": True,
    }
    fields.update(changes)
    return Gpu(**fields)  # type: ignore[arg-type]
