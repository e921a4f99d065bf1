"""A simulated node's NVIDIA driver on disk: stand-in libraries, binaries, firmware, device nodes and /proc files.

What ``agent.gpu.driver_root`` looks for on a real node, laid out the same way under one directory:

- ``usr/lib/x86_64-linux-gnu/lib*.so.<version>`` (small files holding their own name) with the SONAME links the
  driver's installer makes (``libcuda.so.1`` -> ``libcuda.so.<version>``, ``libcuda.so`` -> ``libcuda.so.1``);
- ``usr/bin/nvidia-smi`` and the other binaries (shell scripts that print their name), the GSP firmware directory;
- ``dev/nvidiactl``, ``dev/nvidia-uvm``, ``dev/nvidia-uvm-tools``, ``dev/nvidia-modeset`` and ``dev/nvidia<minor>``
  per GPU: character devices where the process may create them (root), each a harmless ``/dev/null`` (1, 3) so a
  container given one can open it and nothing else; elsewhere empty files, enough to build specs but not to start a
  container;
- ``proc/devices`` (the ``nvidia-caps`` major) and ``proc/driver/nvidia-caps/mig-minors``, the driver's full table of
  MIG capability minors (``gpu<m>/gi<g>/access``, ``.../ci<c>/access``), so any MIG device the simulator makes later
  has its capability minors already listed, as on a real node.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from agent.gpu.driver_root import DriverRoot

VERSION = "550.54.15"
LIBRARY_DIR = "usr/lib/x86_64-linux-gnu"
LIBRARIES = (
    "libcuda.so", "libnvidia-ml.so", "libnvidia-ptxjitcompiler.so", "libnvidia-nvvm.so", "libcudadebugger.so",
    "libnvidia-cfg.so", "libnvidia-opencl.so",
)  # fmt: skip
LINKS = {
    "libcuda.so.1": "libcuda.so", "libnvidia-ml.so.1": "libnvidia-ml.so",
    "libnvidia-ptxjitcompiler.so.1": "libnvidia-ptxjitcompiler.so", "libnvidia-nvvm.so.4": "libnvidia-nvvm.so",
}  # fmt: skip
BINARIES = (
    "nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control", "nvidia-cuda-mps-server",
)  # fmt: skip
CONTROL_NODES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
STAND_IN_DEVICE = (1, 3)  # /dev/null: a container that opens its "GPU" reads nothing and writes into nothing
CAPS_MAJOR = 508
MAX_GPUS, MAX_GIS, MAX_CIS = 32, 15, 8


def mig_minors_table() -> str:
    """The driver's ``mig-minors``: ``config 1``, ``monitor 2``, then per GPU minor, GI and CI its access minor."""
    lines = ["config 1", "monitor 2"]
    minor = 3
    for gpu in range(MAX_GPUS):
        for gi in range(MAX_GIS):
            lines.append(f"gpu{gpu}/gi{gi}/access {minor}")
            minor += 1
            for ci in range(MAX_CIS):
                lines.append(f"gpu{gpu}/gi{gi}/ci{ci}/access {minor}")
                minor += 1
    return "\n".join(lines) + "\n"


def make_driver_root(root: Path, gpu_minors: Iterable[int], *, version: str = VERSION, hook: bool = False) -> Path:
    """Lay out a driver at ``root`` for GPUs of these minors; ``hook`` adds a stand-in ``usr/bin/nvidia-cdi-hook``
    (which does nothing: a runtime that runs it finds it succeeds). Returns ``root``."""
    libs = root / LIBRARY_DIR
    libs.mkdir(parents=True, exist_ok=True)
    for name in LIBRARIES:
        (libs / f"{name}.{version}").write_text(f"{name}.{version} (stand-in)\n")
    for link, library in LINKS.items():
        _symlink(libs / link, f"{library}.{version}")
    _symlink(libs / "libcuda.so", "libcuda.so.1")
    bins = root / "usr/bin"
    bins.mkdir(parents=True, exist_ok=True)
    for name in (*BINARIES, *(("nvidia-cdi-hook",) if hook else ())):
        _script(bins / name, f"#!/bin/sh\necho {name} stand-in\n" if name != "nvidia-cdi-hook" else "#!/bin/sh\n")
    firmware = root / "lib/firmware/nvidia" / version
    firmware.mkdir(parents=True, exist_ok=True)
    (firmware / "gsp_ga10x.bin").write_text("firmware (stand-in)\n")
    dev = root / "dev"
    dev.mkdir(exist_ok=True)
    for name in (*CONTROL_NODES, *(f"nvidia{minor}" for minor in gpu_minors)):
        _device(dev / name)
    proc = root / "proc"
    (proc / "driver/nvidia-caps").mkdir(parents=True, exist_ok=True)
    (proc / "driver/nvidia-caps/mig-minors").write_text(mig_minors_table())
    (proc / "devices").write_text(
        f"Character devices:\n  1 mem\n195 nvidia\n195 nvidiactl\n{CAPS_MAJOR} nvidia-caps\n510 nvidia-uvm\n\n"
        "Block devices:\n  7 loop\n"
    )
    return root


def device_nodes_are_real(root: Path) -> bool:
    """True when the layout's device nodes are character devices (a container runtime can give them)."""
    return stat.S_ISCHR((root / "dev/nvidiactl").stat().st_mode)


def _device(path: Path) -> None:
    if path.exists() or path.is_symlink():
        return
    major, minor = STAND_IN_DEVICE
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
    except PermissionError:
        path.touch()  # not root: enough to build specs with


def _symlink(path: Path, target: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    path.symlink_to(target)


def _script(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


def sim_driver_root(root: Path, gpu_minors: Iterable[int] = range(MAX_GPUS), **options: Any) -> DriverRoot:
    """A simulated driver at ``root`` and the ``DriverRoot`` an agent on the simulated node is given for it (its
    ``proc`` the layout's own, for the MIG capability minors)."""
    make_driver_root(root, gpu_minors, **options)
    return DriverRoot(root, proc=root / "proc")
