"""Which simulated GPU or MIG device a container is given by CDI device IDs: the specs read as a runtime reads them.

A claim's ID (``k8s.gpu.nvidia.com/claim=<uid>-<device>``) resolves to its entry in the spec files under the CDI
root; the entry's ``/dev/nvidia<minor>`` names the GPU and, for a MIG device, its two ``nvidia-cap<n>`` nodes name
the GPU and compute instance (the driver's ``mig-minors`` numbering, which the simulated driver root writes). An ID
of the node-wide spec (``nvidia.com/gpu=<uuid>``, ``--node-wide-cdi``) names the UUID itself.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from agent.sim.driver_root import MAX_CIS, MAX_GIS
from agent.sim.nvml.driver import SimDriver

NODE_WIDE = "nvidia.com/gpu="
_GPU = re.compile(r"/dev/nvidia(\d+)")
_CAP = re.compile(r"/dev/nvidia-caps/nvidia-cap(\d+)")


def entries(cdi_root: Path) -> dict[str, dict[str, Any]]:
    """``kind=name`` -> the entry's ``containerEdits``, for every spec file under ``cdi_root``."""
    found: dict[str, dict[str, Any]] = {}
    for path in sorted(cdi_root.glob("*.yaml")) if cdi_root.is_dir() else ():
        try:
            spec = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError):  # removed (an Unprepare) between the listing and the read
            continue
        for device in spec.get("devices", []):
            found[f"{spec['kind']}={device['name']}"] = device.get("containerEdits", {})
    return found


def physical(cdi_root: Path, ids: Iterable[str], driver: SimDriver) -> list[str | None]:
    """The UUID each ID gives the container (None: its spec or its device is not there)."""
    known = entries(cdi_root)
    with driver.lock:
        return [uuid_of(known.get(i), driver) if not i.startswith(NODE_WIDE) else i[len(NODE_WIDE) :] for i in ids]


def uuid_of(edits: dict[str, Any] | None, driver: SimDriver) -> str | None:
    if edits is None:
        return None
    paths = [node["path"] for node in edits.get("deviceNodes", [])]
    minors = [int(m[1]) for p in paths if (m := _GPU.fullmatch(p))]
    caps = sorted(int(m[1]) for p in paths if (m := _CAP.fullmatch(p)))
    gpu = next((g for g in driver.gpus if minors and g.minor_number == minors[0]), None)
    if gpu is None:
        return None
    if not caps:
        return gpu.uuid
    first = 3 + gpu.minor_number * MAX_GIS * (1 + MAX_CIS)  # mig-minors: config 1, monitor 2, then per GPU
    gi_id, ci_id = divmod(caps[0] - first, 1 + MAX_CIS)[0], caps[1] - caps[0] - 1
    gi = gpu.gis.get(gi_id)
    ci = gi.cis.get(ci_id) if gi is not None else None
    return ci.uuid if ci is not None else None
