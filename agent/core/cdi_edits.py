"""The CDI edits every NVIDIA GPU container needs, built as NVIDIA's container toolkit (nvcdi) builds them.

A CDI spec that stands alone gives the container, besides its GPUs' own device nodes, what the driver puts on the
host for every GPU process (facts/dra.md F, the toolkit's ``nvcdi`` in ``nvml`` mode):

- the control nodes ``/dev/nvidiactl``, ``/dev/nvidia-uvm``, ``/dev/nvidia-uvm-tools`` (and ``/dev/nvidia-modeset``
  when the host has it), host paths under the dev root;
- the driver's versioned libraries (every ``*.so.<driver version>`` beside ``libcuda.so.<version>``, as nvcdi
  takes them), bind-mounted read-only at the same path in the container;
- the driver's binaries (``nvidia-smi``, ``nvidia-debugdump``, ``nvidia-persistenced``,
  ``nvidia-cuda-mps-control``, ``nvidia-cuda-mps-server``) at ``/usr/bin/<name>``; the GSP firmware directory
  ``/lib/firmware/nvidia/<version>``; the persistenced socket;
- the hooks nvidia-ctk writes when the host has the hook binary (``nvidia-cdi-hook`` or ``nvidia-ctk hook``):
  ``create-symlinks`` (``libcuda.so`` -> ``libcuda.so.1``, and each library's SONAME link) and ``update-ldcache``
  for the library directories. Without a hook binary the SONAME links (``libcuda.so.1``, ``libnvidia-ml.so.1``) are
  bind-mounted too, at their own names: a bind mount follows the host's link, so the program that opens
  ``libcuda.so.1`` finds the library without a hook running in the container.

Paths in the result are host paths (what the runtime opens) and container paths (where they appear); the shell
(``agent.gpu.driver_root``) discovers the files under the driver root and says which host path each has.

``cdiVersion``: nothing here needs more than the ``0.5.0`` the claim specs already use (hooks, ``hostPath``, mount
options and device ``type``/``major``/``minor`` are all older; 0.6.0 brings annotations, 0.7.0 ``additionalGIDs``).
The ``createRuntime`` stage of the memory-limits hook is one of the OCI hook stages CDI has accepted since 0.3.0.

GPU memory limits, path (a) of the driver's per-container limits (driver r615+, facts ``memory-limits.md``): a
container given a device of a known memory size gets ``NVIDIA_GPU_MEMORY_REQUEST`` and ``NVIDIA_GPU_MEMORY_LIMIT``
(singular, whole MiB: what the toolkit's hook reads), and, where the node's hook binary has it (toolkit v1.20.1+,
``DriverFiles.memory_limits_hook``), one ``apply-cuda-memory-limits`` ``createRuntime`` hook per GPU, exactly as
the toolkit's own CDI discoverer adds it (``--driver-root <root> --gpu-id <GPU UUID>``), so the limit is on the
container's cgroup before the workload runs. The hook returns early when neither variable is set, so a spec entry
may carry it for every GPU (the device plugin's spec does, as the toolkit's does). MIG devices have no
per-container limits: no hook.

Pure: values in, documents out.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from msgspec import Struct

from agent.core.dra.cdi import CDI_VERSION, VISIBLE_DEVICES_VOID, CdiError, DeviceNode

CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")
REQUIRED_CONTROL_NODES = ("/dev/nvidiactl",)
REQUIRED_LIBRARIES = ("libcuda.so", "libnvidia-ml.so")  # without either no CUDA or NVML program can run
BINARIES = (
    "nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control", "nvidia-cuda-mps-server",
)  # fmt: skip
SONAME_LINKS = ("libcuda.so.1", "libnvidia-ml.so.1", "libnvidia-ptxjitcompiler.so.1", "libnvidia-nvvm.so.4")
MOUNT_OPTIONS = ("ro", "nosuid", "nodev", "rbind", "rprivate")  # nvcdi's for libraries, binaries and firmware
IPC_OPTIONS = ("ro", "nosuid", "nodev", "rbind", "rprivate", "noexec")  # nvcdi's for sockets
HOOK_STAGE = "createContainer"
MEMORY_LIMITS_HOOK = "apply-cuda-memory-limits"  # NVIDIA/nvidia-container-toolkit PR #2075, toolkit v1.20.1
MEMORY_LIMITS_TOOLKIT = (1, 20, 1)  # the first toolkit whose hook binary has it
MEMORY_LIMITS_STAGE = "createRuntime"  # as the toolkit's own spec has it: after the cgroup exists, before start
# What the hook reads from the container's spec and applies to its cgroup through NVML (driver r615+): singular,
# whole MiB, the same on each of the container's GPUs. Allocate (agent.core.allocation) gives the same variables.
MEMORY_REQUEST_ENV = "NVIDIA_GPU_MEMORY_REQUEST"
MEMORY_LIMIT_ENV = "NVIDIA_GPU_MEMORY_LIMIT"

# Device-plugin CDI spec: NVIDIA's device plugin writes vendor k8s.device-plugin.nvidia.com, class gpu
DEVICE_PLUGIN_KIND = "k8s.device-plugin.nvidia.com/gpu"
_KIND = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/[a-zA-Z0-9]([-_a-zA-Z0-9]*)?")
_DEVICE_NAME = re.compile(r"[a-zA-Z0-9][-_.:a-zA-Z0-9]*")


class DriverMissing(CdiError):
    """The driver root lacks what every GPU container needs; the message names what and the flag that fixes it."""


class HostFile(Struct, frozen=True):
    """One file or directory the container gets: its path on the host and where it appears in the container."""

    host_path: str
    container_path: str


class Hook(Struct, frozen=True):
    """The hook binary on the host: ``nvidia-cdi-hook <command>`` or ``nvidia-ctk hook <command>``."""

    path: str

    def args(self, command: str, *more: str) -> list[str]:
        name = self.path.rsplit("/", 1)[-1]
        prefix = [name] if name != "nvidia-ctk" else [name, "hook"]
        return [*prefix, command, *more]


class DriverFiles(Struct, frozen=True):
    """What a shell found under a host's driver root (every path a host path, with its container path)."""

    version: str  # the driver version the libraries carry, "550.54.15"
    control_nodes: tuple[HostFile, ...] = ()
    libraries: tuple[HostFile, ...] = ()  # the versioned libraries, libcuda.so.<version> first
    links: tuple[HostFile, ...] = ()  # SONAME links (libcuda.so.1 ...) the host has beside them
    binaries: tuple[HostFile, ...] = ()
    firmware: tuple[HostFile, ...] = ()
    ipc: tuple[HostFile, ...] = ()
    hook: Hook | None = None
    dev_root: str = "/"  # the host directory whose dev/ holds the GPUs' nodes
    driver_root: str = "/"  # the host's driver root (the memory-limits hook's --driver-root)
    memory_limits_hook: bool = False  # the hook binary has apply-cuda-memory-limits (toolkit v1.20.1+)

    def missing(self) -> list[str]:
        """What a GPU container cannot do without and is not here (empty: the driver root is usable)."""
        nodes = {f.container_path for f in self.control_nodes}
        absent = [n for n in REQUIRED_CONTROL_NODES if n not in nodes]
        names = [f.container_path.rsplit("/", 1)[-1] for f in self.libraries]
        absent += [f"{lib}.<version>" for lib in REQUIRED_LIBRARIES if not any(n.startswith(lib + ".") for n in names)]
        return absent

    def host_device(self, path: str) -> str | None:
        """The host path of a device node ``/dev/...`` under the dev root (``None`` when that is ``/``)."""
        return None if self.dev_root in ("", "/") else self.dev_root.rstrip("/") + path


def check_complete(files: DriverFiles, where: str, fix: str) -> DriverFiles:
    """``files`` if they hold what every GPU container needs, else ``DriverMissing`` naming what, where and the fix."""
    absent = files.missing()
    if absent:
        raise DriverMissing(
            f"no NVIDIA driver found for CDI specs: {', '.join(absent)} not found under {where}; {fix}. Without them "
            "a container given the device could not use it, so no CDI device is returned"
        )
    return files


def common_edits(files: DriverFiles) -> dict[str, Any]:
    """The spec-level ``containerEdits`` every GPU container of the spec gets (``env`` starts with ``void``)."""
    nodes = [DeviceNode(f.container_path, host_path=_host_if_other(f)).to_cdi() for f in files.control_nodes]
    mounts = [_mount(f, MOUNT_OPTIONS) for f in (*files.libraries, *files.binaries, *files.firmware)]
    if files.hook is None:
        mounts += [_mount(f, MOUNT_OPTIONS) for f in files.links]
    mounts += [_mount(f, IPC_OPTIONS) for f in files.ipc]
    edits: dict[str, Any] = {"env": [VISIBLE_DEVICES_VOID], "deviceNodes": nodes, "mounts": mounts}
    if files.hook is not None:
        edits["hooks"] = _hooks(files)
    return edits


def _hooks(files: DriverFiles) -> list[dict[str, Any]]:
    assert files.hook is not None
    links = []
    for link in files.links:  # the SONAME link to the versioned library beside it, made in the container too
        directory, name = link.container_path.rsplit("/", 1)
        target = next((lib for lib in files.libraries if _soname_of(lib.container_path) == name), None)
        if target is not None:
            links.append(f"{target.container_path.rsplit('/', 1)[-1]}::{directory}/{name}")
    cuda = next((lib for lib in files.libraries if _soname_of(lib.container_path) == "libcuda.so.1"), None)
    if cuda is not None:  # libcuda.so -> libcuda.so.1, for programs that dlopen the unversioned name
        links.append(f"libcuda.so.1::{cuda.container_path.rsplit('/', 1)[0]}/libcuda.so")
    folders = sorted({lib.container_path.rsplit("/", 1)[0] for lib in files.libraries})
    hook = files.hook
    hooks = []
    if links:
        args = hook.args("create-symlinks", *(a for link in links for a in ("--link", link)))
        hooks.append({"hookName": HOOK_STAGE, "path": hook.path, "args": args})
    ldcache = hook.args("update-ldcache", *(a for folder in folders for a in ("--folder", folder)))
    hooks.append({"hookName": HOOK_STAGE, "path": hook.path, "args": ldcache})
    return hooks


def memory_limits_hook(files: DriverFiles | None, gpu_uuid: str) -> dict[str, Any] | None:
    """The toolkit's ``apply-cuda-memory-limits`` hook for one GPU, or None where it cannot run: no hook binary, one
    older than v1.20.1, or a MIG device (no per-container limits)."""
    if files is None or files.hook is None or not files.memory_limits_hook or not gpu_uuid.startswith("GPU-"):
        return None
    args = files.hook.args(MEMORY_LIMITS_HOOK, "--driver-root", files.driver_root, "--gpu-id", gpu_uuid)
    return {"hookName": MEMORY_LIMITS_STAGE, "path": files.hook.path, "args": args}


def memory_limit_env(request_mib: int, limit_mib: int | None = None) -> list[str]:
    """The two variables the hook (and KAI's NRI plugin) read: request and limit in whole MiB (limit: the request
    unless bursting is allowed)."""
    limit = request_mib if limit_mib is None else limit_mib
    return [f"{MEMORY_REQUEST_ENV}={request_mib}", f"{MEMORY_LIMIT_ENV}={limit}"]


def memory_limit_edits(files: DriverFiles | None, gpu_uuid: str, mib: int) -> dict[str, list[Any]]:
    """A device entry's edits for a container held to ``mib`` of ``gpu_uuid``: the variables, and the hook where
    the node's toolkit has it."""
    edits: dict[str, list[Any]] = {"env": memory_limit_env(mib)}
    hook = memory_limits_hook(files, gpu_uuid)
    if hook is not None:
        edits["hooks"] = [hook]
    return edits


def _soname_of(path: str) -> str:
    """``/x/libcuda.so.550.54.15`` -> ``libcuda.so.1`` (the SONAME the host's link carries), else ``""``."""
    name = path.rsplit("/", 1)[-1]
    for link in SONAME_LINKS:
        if name.startswith(link.rsplit(".", 1)[0] + ".") and name != link:
            return link
    return ""


def _mount(file: HostFile, options: Sequence[str]) -> dict[str, Any]:
    return {"hostPath": file.host_path, "containerPath": file.container_path, "options": list(options)}


def _host_if_other(file: HostFile) -> str | None:
    return None if file.host_path == file.container_path else file.host_path


# ----- the device plugin's spec ----------------------------------------------------------------------------------


def check_kind(kind: str) -> tuple[str, str]:
    """``vendor/class`` of a CDI kind, or ``CdiError`` naming the kind."""
    if not _KIND.fullmatch(kind):
        raise CdiError(f"CDI kind {kind!r} is not <vendor>/<class> (e.g. {DEVICE_PLUGIN_KIND}); fix --cdi-kind")
    vendor, cls = kind.split("/", 1)
    return vendor, cls


def spec_file_name(kind: str) -> str:
    """The device plugin's spec file name for ``kind``: ``<vendor>-<class>.yaml``, one per kind."""
    vendor, cls = check_kind(kind)
    return f"{vendor}-{cls}.yaml"


def device_plugin_spec(
    kind: str,
    devices: Mapping[str, Iterable[DeviceNode]],
    common: Mapping[str, Any],
    files: DriverFiles | None = None,
) -> dict[str, Any]:
    """The device plugin's spec: one entry per physical device (GPU or MIG UUID) with its nodes, and ``common``
    (``common_edits``) at spec level, so that each ``<kind>=<uuid>`` Allocate returns resolves on its own. With
    ``files`` whose hook binary has it, each GPU's entry runs the memory-limits hook (``memory_limits_hook``): it
    applies the ``NVIDIA_GPU_MEMORY_*`` variables Allocate gives a sized replica, and does nothing without them."""
    check_kind(kind)
    entries = []
    for name, nodes in devices.items():
        if not _DEVICE_NAME.fullmatch(name):
            raise CdiError(f"device {name!r} cannot name a CDI device (letters, digits, -_.: only)")
        node_list = [node.to_cdi() for node in nodes]
        if not node_list:
            raise CdiError(f"device {name} has no device nodes; a CDI device needs edits")
        edits: dict[str, Any] = {"deviceNodes": node_list}
        hook = memory_limits_hook(files, name)
        if hook is not None:
            edits["hooks"] = [hook]
        entries.append({"name": name, "containerEdits": edits})
    return {"cdiVersion": CDI_VERSION, "kind": kind, "devices": entries, "containerEdits": dict(common)}


# ----- MIG capability minors ------------------------------------------------------------------------------------


def parse_mig_minors(text: str) -> dict[str, int]:
    """``/proc/driver/nvidia-caps/mig-minors``: ``gpu0/gi1/access 12`` lines -> {"gpu0/gi1/access": 12}.

    The file lists every capability the driver can create (``gpu0..31``, ``gi0..14``, ``ci0..7``), so a MIG device
    made after it was read is in it too; ``config`` and ``monitor`` are the MIG config and monitor capabilities."""
    minors: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdecimal():
            minors[parts[0]] = int(parts[1])
    return minors


def mig_minor_keys(gpu_minor: int, gi_id: int, ci_id: int) -> tuple[str, str]:
    """The keys of a MIG device's GI and CI access capabilities in ``mig-minors``."""
    gi = f"gpu{gpu_minor}/gi{gi_id}"
    return f"{gi}/access", f"{gi}/ci{ci_id}/access"
