"""The device nodes a claim's CDI entry gives each device, with the numbers the host's NVIDIA driver gives them.

A full GPU needs ``/dev/nvidia<minor>``. A MIG device needs its GPU's node and two ``nvidia-caps`` capability
nodes, ``/dev/nvidia-caps/nvidia-cap<n>``: the access capability of its GPU instance and that of its compute
instance (a process needs both; facts/dra.md C7, mig-mps.md). The driver publishes their minors in
``/proc/driver/nvidia/capabilities/gpu<gpu minor>/mig/gi<gi>/access`` and ``.../gi<gi>/ci<ci>/access``, files of
``Key: value`` lines::

    DeviceFileMinor: 22
    DeviceFileMode: 292

(``DeviceFileMode`` is the host node's mode in decimal, 292 = 0444; newer drivers add ``DeviceFileModify``). Only
the minor is needed: the CDI entry asks for cgroup access ``rw`` and gives type, major and minor so the runtime can
create the node in the container (``agent.core.dra.cdi.mig_nodes``). The major is the ``nvidia-caps`` line of the
character devices in ``/proc/devices``. ``/proc/driver`` is kernel-wide, so the agent's container sees the host's.

The driver also lists every capability it can ever create, with its minor, in ``/proc/driver/nvidia-caps/mig-minors``
(``gpu0/gi1/access 12``, up to ``gpu31/gi14/ci7``): where that file is, the minors come from it (it holds the
instances a dynamic-MIG Prepare has just created as well), else from the per-instance ``access`` files.

The files are read on every Prepare of a MIG device, never cached: the minors belong to GPU and compute instances
that MIG reconfiguration destroys and creates again.

With the node-wide CDI spec (``nvidia-ctk cdi generate``, ``node_wide``), its ``nvidia.com/gpu=<MIG UUID>`` entry
already carries the capability nodes, so the claim entry gives only the GPU's node and nothing is read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from agent.core.cdi_edits import mig_minor_keys, parse_mig_minors
from agent.core.dra.cdi import CdiError, DeviceNode, gpu_nodes, mig_nodes
from agent.core.dra.claims import PreparableDevice

PROC = Path("/proc")
CAPABILITIES = Path("driver/nvidia/capabilities")
MIG_MINORS = Path("driver/nvidia-caps/mig-minors")
CAPS_DEVICE = "nvidia-caps"
MINOR_KEY = "DeviceFileMinor"
MAX_MINOR = (1 << 20) - 1  # Linux minor numbers are 20 bits

DeviceNodes = Callable[[PreparableDevice], Sequence[DeviceNode]]


class DeviceNodeError(CdiError):
    """A device's nodes cannot be told (a file missing, unreadable or not in the driver's format); names the file."""


def default_device_nodes(node_wide: bool, proc: Path = PROC, dev_root: str = "/") -> DeviceNodes:
    """What the DRA service gives each device by default: the GPU's node alone with ``node_wide`` (the node-wide
    entry brings a MIG device's capability nodes), else every node the device needs, read under ``proc``; the GPU
    nodes' host paths under ``dev_root``."""
    if node_wide:
        return lambda device: gpu_nodes(device.gpu_minor, dev_root)
    return lambda device: device_nodes(device, proc, dev_root)


def device_nodes(device: PreparableDevice, proc: Path = PROC, dev_root: str = "/") -> tuple[DeviceNode, ...]:
    """All the nodes ``device`` needs: its GPU's, and for a MIG device its two capability nodes."""
    if device.kind != "mig":
        return gpu_nodes(device.gpu_minor, dev_root)
    if device.gi_id is None or device.ci_id is None:
        raise DeviceNodeError(f"MIG device {device.name} has no GPU or compute instance ID to find its nodes by")
    gi_minor, ci_minor = mig_minors(proc, device.gpu_minor, device.gi_id, device.ci_id)
    return mig_nodes(device.gpu_minor, caps_major(proc), gi_minor, ci_minor, dev_root)


def mig_minors(proc: Path, gpu_minor: int, gi_id: int, ci_id: int) -> tuple[int, int]:
    """The GI and CI access capabilities' minors: from ``mig-minors`` where the driver has it, else from the
    instances' ``access`` files."""
    table = proc / MIG_MINORS
    if table.is_file():
        minors = parse_mig_minors(_read(table))
        keys = mig_minor_keys(gpu_minor, gi_id, ci_id)
        missing = [key for key in keys if key not in minors or minors[key] > MAX_MINOR]
        if missing:
            raise DeviceNodeError(f"{table} lists no minor for {', '.join(missing)}; is it the NVIDIA driver's?")
        return minors[keys[0]], minors[keys[1]]
    gi_access, ci_access = capability_files(proc, gpu_minor, gi_id, ci_id)
    return capability_minor(gi_access), capability_minor(ci_access)


def capability_files(proc: Path, gpu_minor: int, gi_id: int, ci_id: int) -> tuple[Path, Path]:
    """The access capability files of a GPU instance and of a compute instance in it."""
    gi = proc / CAPABILITIES / f"gpu{gpu_minor}" / "mig" / f"gi{gi_id}"
    return gi / "access", gi / f"ci{ci_id}" / "access"


def capability_minor(access: Path) -> int:
    """The ``DeviceFileMinor`` of one capability file: the ``n`` of ``/dev/nvidia-caps/nvidia-cap<n>``."""
    for line in _read(access).splitlines():
        key, colon, value = line.partition(":")
        if colon and key.strip() == MINOR_KEY:
            minor = value.strip()
            if minor.isdecimal() and int(minor) <= MAX_MINOR:
                return int(minor)
            raise DeviceNodeError(f"{access}: {MINOR_KEY} {minor!r} is not a device minor number")
    raise DeviceNodeError(f"{access} has no {MINOR_KEY} line; is this the NVIDIA driver's capability file?")


def caps_major(proc: Path = PROC) -> int:
    """The major number of the ``nvidia-caps`` character devices, from ``/proc/devices``."""
    devices = proc / "devices"
    character = False
    for line in _read(devices).splitlines():
        if line.strip().endswith(":"):  # "Character devices:", "Block devices:"
            character = line.strip() == "Character devices:"
            continue
        number, _, name = line.strip().partition(" ")
        if character and name.strip() == CAPS_DEVICE and number.isdecimal():
            return int(number)
    raise DeviceNodeError(
        f"{devices} lists no {CAPS_DEVICE} character device: the NVIDIA driver has not registered MIG capabilities"
    )


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as error:
        raise DeviceNodeError(
            f"cannot read {path}: {error.strerror or error}; the MIG device's capability nodes cannot be given "
            "without it (or enable node-wide CDI, whose entries carry them)"
        ) from None
