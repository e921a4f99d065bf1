"""What sysfs says of each GPU's PCI device: its PCIe root and its NUMA node, for the standard
``resource.kubernetes.io/pcieRoot`` and ``resource.kubernetes.io/numaNode`` attributes.

The NUMA node is ``/sys/bus/pci/devices/<bus ID>/numa_node``: a number, or ``-1`` when the platform gives the
device no affinity (a single-node machine, a VM), which means no attribute.

NVML gives a GPU's PCI bus ID but not the root complex above it; the kernel does: ``/sys/bus/pci/devices/<bus
ID>`` links to the device's place in the PCI hierarchy, ``/sys/devices/pci<domain>:<bus>/…/<bus ID>``, and the
first component, ``pci0000:00``, names the root. Kubernetes' own helper (``deviceattribute``) reads it the same
way; a scheduler uses it to put a GPU and a NIC of one claim under one root. A GPU whose link cannot be read (a
sysfs without it, a VM that hides the hierarchy) simply gets no attribute.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)

_BUS_ID = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_ROOT = re.compile(r"^pci[0-9a-f]{4,8}:[0-9a-f]{2}$")


def pcie_roots(bus_ids: Iterable[str], sysfs: Path = Path("/sys")) -> dict[str, str]:
    """``{bus ID: PCIe root}`` for the bus IDs (``0000:18:00.0``) whose root sysfs names."""
    roots: dict[str, str] = {}
    for bus_id in bus_ids:
        key = bus_id.lower()
        if not _BUS_ID.match(key):  # never a path component that is not a bus ID
            continue
        root = _root_of(sysfs, key)
        if root is not None:
            roots[bus_id] = root
    return roots


def _root_of(sysfs: Path, bus_id: str) -> str | None:
    link = sysfs / "bus" / "pci" / "devices" / bus_id
    try:
        target = Path(os.path.realpath(link, strict=True))
    except OSError as error:
        log.debug("no PCIe root for the GPU bus_id=%s error=%s", bus_id, error)
        return None
    parts = target.parts
    devices = sysfs.resolve() / "devices"
    if target.name != bus_id or parts[: len(devices.parts)] != devices.parts or len(parts) <= len(devices.parts):
        log.debug("no PCIe root for the GPU bus_id=%s link=%s", bus_id, target)
        return None
    root = parts[len(devices.parts)]
    return root if _ROOT.match(root) else None


_MAX_NUMA_NODE = 1 << 16  # far above any machine's node count; a larger number is not a NUMA node


def numa_nodes(bus_ids: Iterable[str], sysfs: Path = Path("/sys")) -> dict[str, int | None]:
    """``{bus ID: NUMA node}`` for the bus IDs whose ``numa_node`` sysfs has: None where it says ``-1`` (no
    affinity); bus IDs it has no readable value for are left out (the caller may ask NVML)."""
    nodes: dict[str, int | None] = {}
    for bus_id in bus_ids:
        key = bus_id.lower()
        if not _BUS_ID.match(key):  # never a path component that is not a bus ID
            continue
        path = sysfs / "bus" / "pci" / "devices" / key / "numa_node"
        try:
            text = path.read_text(encoding="ascii", errors="replace")[:32].strip()
        except OSError as error:
            log.debug("no NUMA node for the GPU bus_id=%s error=%s", bus_id, error)
            continue
        if not re.fullmatch(r"-?[0-9]{1,6}", text) or int(text) > _MAX_NUMA_NODE:
            log.debug("no NUMA node for the GPU bus_id=%s numa_node=%r", bus_id, text)
            continue
        nodes[bus_id] = int(text) if int(text) >= 0 else None
    return nodes
