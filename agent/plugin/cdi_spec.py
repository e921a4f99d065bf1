"""The device plugin's CDI spec: what the ``cdi-cri`` and ``cdi-annotations`` strategies' names resolve to.

Allocate answers ``<kind>=<uuid>`` per device (``agent.core.allocation``; kind ``k8s.device-plugin.nvidia.com/gpu``
by default, NVIDIA's device plugin's). Those names must resolve to a spec on the node, so Tessera writes it itself,
as NVIDIA's plugin does: one file ``<vendor>-<class>.yaml`` under ``--cdi-root`` with one entry per device the
plugin advertises (GPU UUIDs and MIG UUIDs: a MIG device's entry holds its GPU's node and its two capability nodes)
and the driver's common edits (``agent.core.cdi_edits``). It is written before the devices are advertised, and
again whenever they change (a MIG layout applied, a GPU gone), atomically, so a container created in between
sees the old spec or the new one, never half of one.

With ``--node-wide-cdi`` the names are those of ``nvidia-ctk cdi generate``'s spec instead and nothing is written.

A node whose driver cannot be found (``DriverMissing``) or whose MIG minors cannot be read keeps its last good spec;
the error is logged once, naming the fix.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from agent.atomic import write_atomically
from agent.core.cdi_edits import device_plugin_spec, spec_file_name
from agent.core.dra.cdi import CdiError, DeviceNode, gpu_nodes, mig_nodes
from agent.core.inventory import Inventory
from agent.core.snapshot import ResourceSnapshot
from agent.dra.cdi_store import DIR_MODE, FILE_MODE, dump
from agent.dra.devnodes import caps_major, mig_minors
from agent.gpu.driver_root import CommonEdits, DriverRoot

log = logging.getLogger(__name__)


class DevicePluginCdi:
    """Keeps ``<cdi root>/<vendor>-<class>.yaml`` in step with the devices the plugin advertises."""

    def __init__(self, root: Path, driver_root: DriverRoot) -> None:
        self.root = root
        self._common = CommonEdits(driver_root)
        self._driver_root = driver_root
        self._written: tuple[Path, bytes] | None = None
        self._key: tuple[object, ...] | None = None  # what the spec written last was made of
        self._error = ""

    @property
    def error(self) -> str:
        """Why the spec could not be written last time ("" when it was)."""
        return self._error

    def refresh(self, kind: str, inventory: Inventory, snapshots: Mapping[str, ResourceSnapshot]) -> Path | None:
        """Write the spec for the physical devices of ``snapshots`` if it changed; its path, or None on error."""
        physical = dict.fromkeys(d.physical_id for s in snapshots.values() for d in s.devices)
        try:
            common = self._common()
            path = self.root / spec_file_name(kind)
            key = (kind, tuple(physical), inventory.gpus, id(common))  # the same edits object while it is cached
            if key == self._key and path.is_file():
                return path
            spec = device_plugin_spec(kind, self._nodes(inventory, physical), common)
            content = dump(spec)
            if self._written != (path, content) or not path.is_file():
                self.root.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
                write_atomically(path, content, FILE_MODE)
                log.info("device plugin CDI spec written path=%s kind=%s devices=%d", path, kind, len(physical))
                self._written = (path, content)
            self._key = key
        except (CdiError, OSError) as error:
            message = str(error)
            if message != self._error:
                log.error("cannot write the device plugin's CDI spec kind=%s error=%r", kind, message)
            self._error = message
            return None
        self._error = ""
        return path

    def _nodes(self, inventory: Inventory, physical: Iterable[str]) -> dict[str, tuple[DeviceNode, ...]]:
        dev_root = str(self._driver_root.host_dev_root)
        wanted = set(physical)
        nodes: dict[str, tuple[DeviceNode, ...]] = {}
        major: int | None = None
        for gpu in inventory.gpus:
            if gpu.uuid in wanted:
                nodes[gpu.uuid] = gpu_nodes(gpu.minor_number, dev_root)
            for mig in gpu.mig_devices:
                if mig.uuid in wanted:
                    proc = self._driver_root.proc
                    major = caps_major(proc) if major is None else major
                    gi_minor, ci_minor = mig_minors(proc, gpu.minor_number, mig.gi_id, mig.ci_id)
                    nodes[mig.uuid] = mig_nodes(gpu.minor_number, major, gi_minor, ci_minor, dev_root)
        return {uuid: nodes[uuid] for uuid in physical if uuid in nodes}


def spec_of(path: Path) -> dict[str, Any]:
    """A written spec, read back (for status and tests)."""
    return yaml.safe_load(path.read_text())
