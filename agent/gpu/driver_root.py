"""The NVIDIA driver's files under the host's driver root, found as NVIDIA's container toolkit finds them.

``--driver-root`` (NVIDIA's flag and ``NVIDIA_DRIVER_ROOT``, default ``/``) is where the driver is installed on the
host: ``/`` for a driver installed on the node, ``/run/nvidia/driver`` for the GPU operator's driver container. The
agent sees that directory at ``--container-driver-root`` (NVIDIA's ``DRIVER_ROOT_CTR_PATH``; by default the same
path: the host's ``/`` is mounted at ``/`` only outside a container, so the DaemonSet mounts it at
``/driver-root``). ``--dev-root`` (``NVIDIA_DEV_ROOT``, default the driver root) holds the ``dev/`` of the device
nodes. CDI specs name host paths (the runtime opens them), so every file is looked for under the container path and
written with its host path.

What is looked for (``agent.core.cdi_edits`` says why each is there):

- ``libcuda.so.<version>`` (a regular file) in the usual library directories; every ``*.so.<version>`` beside it,
  and ``libnvidia-ml.so.<version>`` wherever it is; the SONAME links beside them;
- the binaries in ``usr/bin``, ``usr/sbin``, ``bin``, ``sbin``; ``lib/firmware/nvidia/<version>``;
  ``run/nvidia-persistenced/socket``;
- the control nodes under ``<dev root>/dev``;
- the hook: ``--nvidia-cdi-hook-path`` as given (a host path, as NVIDIA takes it), else ``nvidia-cdi-hook`` or
  ``nvidia-ctk`` in the driver root's ``usr/bin`` or ``usr/local/bin``; none found: no hooks (the SONAME links are
  then mounted instead). Whether it has ``apply-cuda-memory-limits`` (toolkit v1.20.1+) is asked of the binary
  itself: ``<hook> --version`` (both binaries are urfave/cli programs printing ``... version 1.20.1``), run once
  per binary file (``HookVersions``: kept while its size and modification time stay, so an upgraded toolkit is
  asked again). The version, not a trial run of the sub-command: ``--help`` of an unknown sub-command does not
  fail in every urfave/cli version, and the version is what NVIDIA's release notes name.

A node without ``/dev/nvidiactl``, ``libcuda`` or ``libnvidia-ml`` there has no usable driver for CDI:
``DriverMissing`` names what is missing, where it was looked for and the flags that fix it, and the Prepare (or the
device plugin's spec) fails with it rather than hand out a CDI ID the container could not use.

Discovery lists a few directories (well under a millisecond warm); ``CommonEdits`` keeps a result for ``ttl``
seconds (NVIDIA's driver caches its common edits for 5 minutes) so a burst of Prepares reads them once, and keeps no
failure, so a driver installed after the agent started is found at the next Prepare.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from msgspec import Struct

from agent.core.cdi_edits import (
    BINARIES,
    CONTROL_NODES,
    MEMORY_LIMITS_TOOLKIT,
    SONAME_LINKS,
    DriverFiles,
    Hook,
    HostFile,
    check_complete,
    common_edits,
)

log = logging.getLogger(__name__)

LIBRARY_DIRS = (
    "usr/lib/x86_64-linux-gnu", "usr/lib64", "usr/lib/aarch64-linux-gnu", "lib/x86_64-linux-gnu", "lib64",
    "lib/aarch64-linux-gnu", "usr/lib",
)  # fmt: skip
BINARY_DIRS = ("usr/bin", "usr/sbin", "bin", "sbin")
HOOK_DIRS = ("usr/bin", "usr/local/bin", "usr/local/nvidia/toolkit")
HOOK_NAMES = ("nvidia-cdi-hook", "nvidia-ctk")
PERSISTENCED_SOCKET = "run/nvidia-persistenced/socket"
FIRMWARE_DIR = "lib/firmware/nvidia"
_CUDA = re.compile(r"libcuda\.so\.(\d+\.\d+(?:\.\d+)?)")
_VERSION = re.compile(r"\bversion\s+v?(\d+)\.(\d+)\.(\d+)")
CACHE_SECONDS = 60.0


class DriverRoot(Struct, frozen=True):
    """Where the driver is on the host, and where the agent sees it (``None``: the same path)."""

    root: Path = Path("/")
    container_root: Path | None = None
    dev_root: Path | None = None  # None: the driver root
    hook_path: str | None = None  # None: looked for under the driver root
    proc: Path = Path("/proc")  # the kernel's /proc (MIG capability minors)

    @property
    def seen_root(self) -> Path:
        return self.container_root or self.root

    @property
    def host_dev_root(self) -> Path:
        return self.dev_root or self.root

    @property
    def seen_dev_root(self) -> Path:
        return self.dev_root if self.dev_root is not None and self.dev_root != self.root else self.seen_root

    def where(self) -> str:
        seen = "" if self.container_root in (None, self.root) else f" (seen by the agent at {self.container_root})"
        dev = "" if self.dev_root in (None, self.root) else f" and the dev root {self.dev_root}"
        return f"the driver root {self.root}{seen}{dev}"


FIX = (
    "install the NVIDIA driver on the node, or point --driver-root (NVIDIA_DRIVER_ROOT) at it (the GPU operator's "
    "is /run/nvidia/driver) and mount it at --container-driver-root; --dev-root if /dev lies elsewhere"
)


class HookVersions:
    """The toolkit version each hook binary says it is, asked once per binary file (path, size, mtime)."""

    def __init__(self, run: Callable[[str], str | None] | None = None) -> None:
        self._run = run or _version_output
        self._lock = threading.Lock()
        self._known: dict[tuple[str, int, int], tuple[int, ...] | None] = {}

    def version(self, path: Path) -> tuple[int, ...] | None:
        try:
            info = path.stat()
        except OSError:
            return None
        key = (str(path), info.st_size, info.st_mtime_ns)
        with self._lock:
            if key not in self._known:
                output = self._run(str(path))
                match = _VERSION.search(output or "")
                found = tuple(int(p) for p in match.groups()) if match else None
                self._known = {k: v for k, v in self._known.items() if k[0] != key[0]}
                self._known[key] = found
                log.info("CDI hook binary path=%s toolkit_version=%s memory_limits_hook=%s", path,
                         ".".join(map(str, found)) if found else "unknown",
                         found is not None and found >= MEMORY_LIMITS_TOOLKIT)  # fmt: skip
            return self._known[key]


def _version_output(path: str) -> str | None:
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def discover_driver(
    where: DriverRoot, version: str | None = None, *, hook_versions: HookVersions | None = None
) -> DriverFiles:
    """The driver's files under ``where``; ``DriverMissing`` if it lacks what every GPU container needs."""
    seen, host = where.seen_root, where.root
    found_version, library_dir = _find_cuda(seen, version)
    libraries: list[HostFile] = []
    links: list[HostFile] = []
    if found_version is not None and library_dir is not None:
        suffix = f".so.{found_version}"
        dirs = [library_dir] + [d for d in LIBRARY_DIRS if d != library_dir]
        for directory in dirs:
            names = _listing(seen / directory)
            for name in sorted(names):
                wanted = name.endswith(suffix) if directory == library_dir else name == f"libnvidia-ml{suffix}"
                if wanted and _is_file(seen / directory / name):
                    libraries.append(_file(host, directory, name))
            for link in SONAME_LINKS:
                if link in names and (seen / directory / link).is_symlink() and directory in _dirs_of(libraries):
                    links.append(_file(host, directory, link))
        libraries.sort(key=lambda f: (not f.container_path.endswith(f"/libcuda{suffix}"), f.container_path))
    binaries = []
    for name in BINARIES:
        directory = next((d for d in BINARY_DIRS if _is_file(seen / d / name)), None)
        if directory is not None:
            binaries.append(HostFile(_host(host, directory, name), f"/usr/bin/{name}"))
    firmware = []
    if found_version is not None and (seen / FIRMWARE_DIR / found_version).is_dir():
        firmware.append(HostFile(_host(host, FIRMWARE_DIR, found_version), f"/{FIRMWARE_DIR}/{found_version}"))
    ipc = []
    if (seen / PERSISTENCED_SOCKET).exists():
        ipc.append(HostFile(_host(host, PERSISTENCED_SOCKET), f"/{PERSISTENCED_SOCKET}"))
    dev_seen, dev_host = where.seen_dev_root, where.host_dev_root
    control = [
        HostFile(_host(dev_host, node.lstrip("/")), node) for node in CONTROL_NODES if (dev_seen / node[1:]).exists()
    ]
    hook = _hook(where)
    hook_version = (hook_versions or HookVersions()).version(_seen(where, hook.path)) if hook is not None else None
    files = DriverFiles(
        version=found_version or "",
        control_nodes=tuple(control),
        libraries=tuple(libraries),
        links=tuple(links),
        binaries=tuple(binaries),
        firmware=tuple(firmware),
        ipc=tuple(ipc),
        hook=hook,
        dev_root=str(dev_host),
        driver_root=str(host),
        memory_limits_hook=hook_version is not None and hook_version >= MEMORY_LIMITS_TOOLKIT,
    )
    return check_complete(files, where.where(), FIX)


def _find_cuda(seen: Path, version: str | None) -> tuple[str | None, str | None]:
    """The driver version and the library directory of ``libcuda.so.<version>`` (the highest if ``version`` is
    not given)."""
    best: tuple[tuple[int, ...], str, str] | None = None
    for directory in LIBRARY_DIRS:
        for name in _listing(seen / directory):
            match = _CUDA.fullmatch(name)
            if match is None or not _is_file(seen / directory / name):
                continue
            found = match[1]
            if version is not None and found != version:
                continue
            key = tuple(int(p) for p in found.split("."))
            if best is None or key > best[0]:
                best = (key, found, directory)
    return (best[1], best[2]) if best is not None else (None, None)


def _hook(where: DriverRoot) -> Hook | None:
    if where.hook_path:
        return Hook(where.hook_path)
    for directory in HOOK_DIRS:
        for name in HOOK_NAMES:
            if os.access(where.seen_root / directory / name, os.X_OK):
                return Hook(_host(where.root, directory, name))
    return None


def _seen(where: DriverRoot, host_path: str) -> Path:
    """Where the agent sees a host path under the driver root (the path itself when it lies elsewhere)."""
    path = Path(host_path)
    if where.container_root is not None and path.is_relative_to(where.root):
        return where.container_root / path.relative_to(where.root)
    return path


def _listing(directory: Path) -> set[str]:
    try:
        return {entry.name for entry in os.scandir(directory)}
    except OSError:
        return set()


def _is_file(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()


def _dirs_of(files: list[HostFile]) -> set[str]:
    return {f.container_path.rsplit("/", 1)[0].lstrip("/") for f in files}


def _host(root: Path, *parts: str) -> str:
    return str(Path(root, *parts))


def _file(host: Path, directory: str, name: str) -> HostFile:
    return HostFile(_host(host, directory, name), f"/{directory}/{name}")


class CommonEdits:
    """The spec-level edits of ``discover_driver(where)``, kept ``ttl`` seconds; a failure is not kept."""

    def __init__(
        self, where: DriverRoot, *, ttl: float = CACHE_SECONDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.where = where
        self._ttl, self._clock = ttl, clock
        self._lock = threading.Lock()
        self._cached: tuple[float, dict[str, Any], DriverFiles] | None = None
        self._hook_versions = HookVersions()

    def files(self) -> DriverFiles:
        return self._get()[1]

    def __call__(self) -> dict[str, Any]:
        return self._get()[0]

    def _get(self) -> tuple[dict[str, Any], DriverFiles]:
        with self._lock:
            now = self._clock()
            if self._cached is not None and now - self._cached[0] < self._ttl:
                return self._cached[1], self._cached[2]
            # DriverMissing goes to the caller, and nothing is kept
            files = discover_driver(self.where, hook_versions=self._hook_versions)
            edits = common_edits(files)
            if self._cached is None or self._cached[2] != files:
                log.info(
                    "NVIDIA driver found for CDI specs root=%s version=%s libraries=%d binaries=%d hook=%s",
                    self.where.root, files.version, len(files.libraries), len(files.binaries),
                    files.hook.path if files.hook else "none",
                )  # fmt: skip
            self._cached = (now, edits, files)
            return edits, files
