"""MPS per claim: the control daemon a claim's devices are served by, and what the claim's containers get.

A claim whose config (NVIDIA's ``GpuConfig`` / ``MigDeviceConfig`` with ``sharing.strategy: MPS``) asks for MPS
gets its devices served by one MPS control daemon, run and supervised by Tessera's MPS manager like the device
plugin's (limits, readiness, pidfd supervision, adoption across agent restarts, the keeper). The daemon is keyed
by the set of devices it serves (``dra/<hash of the sorted UUIDs>``), so claims on the same devices share it; it
stops once no claim needs it and no client runs (the manager's drain). A share of a GPU shared by memory
(``agent.core.dra.shares``) is served the same way by the GPU's daemon, its limits from the share.

An MPS claim's limits are its own, given to its clients: ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``
(``defaultActiveThreadPercentage``) and ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (``defaultPinnedDeviceMemoryLimit`` and
``defaultPerDevicePinnedMemoryLimit``, as NVIDIA resolves them) in the claim's CDI edits, with the daemon's pipe
directory (``CUDA_MPS_PIPE_DIRECTORY``) and the MPS shared memory mounted as the device plugin mounts them.

A share's limits are held by the daemon itself, since a client can drop its variables (and its variables can only
lower the server's): the record carries them (``ShareLimits``), and the daemon of a shared device runs with server
defaults that hold every share it serves (``daemon_limits``: the largest of each, ``agent.core.dra.shares``). Where
all shares are equal the defaults are each share's limit exactly; else the smaller shares' limits are advisory
below that ceiling (``share_enforcement`` says which, per claim). A change of the shares on the device changes the
defaults, not the daemon: the MPS manager sets them on the running daemon and its servers, for clients that start
from then on (a client keeps the limits it started with).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

from msgspec import Struct
from msgspec.structs import replace

from agent.core.dra.opaque import MpsConfig, pinned_memory_limits
from agent.core.dra.shares import Enforcement, Limits, client_env, enforced_by, enforcement_note, server_limits
from agent.core.mps import CONTAINER_MPS_ROOT, MpsDaemonSpec

KEY_PREFIX = "dra"
RESOURCE = "dra"  # the daemons' resource name in the MPS manager (no device-plugin resource has it)
NO_THREAD_LIMIT = 100  # the daemon's own default: its clients' env sets each claim's


class ShareLimits(Struct, frozen=True):
    """A share's limits (``agent.core.dra.shares.limits``) and its device's memory, as its MPS record keeps them."""

    memory_mib: int | None  # None: no memory limit
    threads: int | None  # None: no thread limit
    device_mib: int = 0  # the device's memory: the server default when no share limits memory (0: unknown)

    @property
    def limits(self) -> Limits:
        return Limits(self.memory_mib, self.threads)


class MpsRecord(Struct, frozen=True):
    """The daemon a prepared claim uses: its key and the devices (GPU or MIG UUIDs) it serves."""

    key: str
    devices: tuple[str, ...]
    env: tuple[str, ...] = ()  # the claim's limits, as its clients' environment
    share: ShareLimits | None = None  # a share of a device: what the daemon's server defaults must hold

    def spec(self) -> MpsDaemonSpec:
        return MpsDaemonSpec(
            key=self.key,
            resource=RESOURCE,
            visible_devices=self.devices,
            active_thread_percentage=NO_THREAD_LIMIT,
            pinned_memory_mib=(),
        )


class ShareEnforcement(Struct, frozen=True):
    """How a share's limits are held (``agent.core.dra.shares.enforced_by``), with the server defaults they meet."""

    limits: Limits
    server: Limits
    memory: Enforcement | None
    threads: Enforcement | None

    @property
    def advisory(self) -> bool:
        return any(e in (Enforcement.ADVISORY, Enforcement.MPS_SERVER_CEILING) for e in (self.memory, self.threads))


def daemon_key(uuids: Sequence[str]) -> str:
    return f"{KEY_PREFIX}/{hashlib.sha256(','.join(sorted(uuids)).encode()).hexdigest()[:12]}"


def mps_record(uuids: Sequence[str], config: MpsConfig) -> MpsRecord:
    """The daemon for the MPS devices of one claim (their UUIDs, in claim order) and the claim's limits
    (``OpaqueConfigError`` when a per-device limit names a device the claim does not have)."""
    env = []
    if config.default_active_thread_percentage is not None:
        env.append(f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={config.default_active_thread_percentage}")
    limits = pinned_memory_limits(config, list(uuids))
    if limits:
        env.append("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=" + ",".join(f"{uuid}={limit}" for uuid, limit in limits.items()))
    return MpsRecord(daemon_key(uuids), tuple(uuids), tuple(env))


def pinned_mib(record: MpsRecord) -> dict[str, int]:
    """Device UUID -> the pinned memory limit (MiB) an MPS claim's record gives its clients (its
    ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``, from the claim's ``GpuConfig``): the memory size of each device, which
    the driver's per-container limits hold (``agent.core.memlimits.claim_sizes``)."""
    sizes: dict[str, int] = {}
    for entry in record.env:
        name, _, value = entry.partition("=")
        if name != "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT":
            continue
        for item in value.split(","):
            uuid, _, limit = item.rpartition("=")
            if uuid and limit.endswith("M") and limit[:-1].isdecimal():
                sizes[uuid] = int(limit[:-1])
    return sizes


def memory_sizes(record: MpsRecord | None) -> dict[str, int]:
    """Device UUID -> the memory (MiB) a claim's containers are held to on it: a share's memory limit, or an MPS
    claim's pinned limits (``pinned_mib``); the CDI spec gives them as ``NVIDIA_GPU_MEMORY_*`` (path (a) of the
    driver's per-container limits)."""
    if record is None:
        return {}
    if record.share is not None:
        return {record.devices[0]: record.share.memory_mib} if record.share.memory_mib else {}
    return pinned_mib(record)


def pinned_over_memory(config: MpsConfig, devices: Sequence[tuple[str, str, int]]) -> str | None:
    """Why the claim's MPS pinned memory limits cannot be held, or None: a limit above its device's memory, which
    neither the driver nor the MPS server could hold (``devices``: name, UUID, memory in bytes, in claim order).
    ``OpaqueConfigError`` for a per-device key that names no device of the claim."""
    uuids = [uuid for _, uuid, _ in devices]
    limits = pinned_memory_limits(config, uuids)
    per_device = pinned_memory_limits(replace(config, default_pinned_device_memory_limit=None), uuids)
    for name, uuid, memory in devices:
        value = limits.get(uuid)
        total = memory >> 20
        if value is None or not total or int(value[:-1]) <= total:
            continue
        field = "defaultPerDevicePinnedMemoryLimit" if uuid in per_device else "defaultPinnedDeviceMemoryLimit"
        return (
            f"sharing.mpsConfig.{field}: {value[:-1]}Mi for device {name} ({uuid}) is more than its {total}Mi of "
            f"memory; give at most {total}Mi"
        )
    return None


def share_record(uuid: str, limits: Limits, device_mib: int) -> MpsRecord:
    """The daemon a share of device ``uuid`` (a GPU or MIG device, of ``device_mib`` memory) is served by (the
    device's one daemon, shared by every claim with a share of it, and by MPS claims on the whole device) and the
    share's ``limits``: held by the daemon's server defaults, and given to its clients' environment too."""
    share = ShareLimits(limits.memory_mib, limits.threads, device_mib)
    return MpsRecord(daemon_key([uuid]), (uuid,), client_env(uuid, limits), share)


def daemon_limits(records: Mapping[str, MpsRecord]) -> dict[str, Limits]:
    """Daemon key -> the server defaults that hold every share the daemon serves (daemons of MPS claims only: none)."""
    shares: dict[str, list[Limits]] = {}
    for record in records.values():
        if record.share is not None:
            shares.setdefault(record.key, []).append(record.share.limits)
    for record in records.values():  # a share recorded before records kept its limits: the server must not hold it
        if record.share is None and record.key in shares:
            shares[record.key].append(Limits(None, None))
    return {key: server_limits(limits) for key, limits in shares.items()}


def share_enforcement(
    record: MpsRecord, records: Mapping[str, MpsRecord], held: object = None, *, driver_memory: bool = False
) -> ShareEnforcement | None:
    """How ``record``'s share is held next to the other recorded claims' (``records``, claim -> record); None for a
    record that is not a share. ``held`` is what the daemon holds now (``MpsDaemonSpec.limits`` of its last good
    setting, from the MPS manager): while it is being set to new limits, the old ones are what hold a new client.
    ``driver_memory``: the driver holds the claim's containers to their memory (issue 27's per-container limits,
    where the driver and the device allow them); then memory is ``driver``-held whatever the server's ceiling."""
    if record.share is None:
        return None
    server = daemon_limits(records).get(record.key, Limits(None, None))
    if held is not None:
        server = _held(held, record.share.device_mib)
    mine = record.share.limits
    return ShareEnforcement(
        limits=mine,
        server=server,
        memory=enforced_by(mine.memory_mib, server.memory_mib, driver=driver_memory),
        threads=enforced_by(mine.threads, server.threads),
    )


def client_edits(record: MpsRecord, host_root: str) -> dict[str, list]:
    """The CDI ``containerEdits`` a claim's MPS devices carry: the daemon's pipe, the MPS shared memory and the
    claim's limits. ``host_root`` is the MPS root on the host (``mpsRoot``)."""
    pipe = f"{CONTAINER_MPS_ROOT}/{record.key}/pipe"
    env = [f"CUDA_MPS_PIPE_DIRECTORY={pipe}", *record.env]
    mounts = [
        {"containerPath": pipe, "hostPath": f"{host_root}/{record.key}/pipe", "options": ["rbind", "rw"]},
        {"containerPath": "/dev/shm", "hostPath": f"{host_root}/shm", "options": ["rbind", "rw"]},  # noqa: S108
    ]
    return {"env": env, "mounts": mounts}


def records_specs(records: Mapping[str, MpsRecord]) -> tuple[MpsDaemonSpec, ...]:
    """The daemons the recorded claims need, each once (claims on the same devices share one); a shared device's
    daemon with the server defaults that hold its shares (no memory limit: the device's whole memory, so a ceiling
    set before is lifted)."""
    specs = {record.key: record.spec() for record in records.values()}
    device_mib = {r.key: r.share.device_mib for r in records.values() if r.share is not None and r.share.device_mib}
    for key, server in daemon_limits(records).items():
        memory = server.memory_mib if server.memory_mib is not None else device_mib.get(key)
        spec = specs[key]
        specs[key] = replace(
            spec,
            active_thread_percentage=server.threads if server.threads is not None else NO_THREAD_LIMIT,
            pinned_memory_mib=tuple((uuid, memory) for uuid in spec.visible_devices) if memory else (),
        )
    return tuple(specs.values())


def _held(held: object, device_mib: int) -> Limits:
    """A daemon's limits (thread percentage, ((uuid, MiB), ...)) as server Limits: 100% and the device's whole
    memory are no limit."""
    threads, pinned = held  # type: ignore[misc]
    memory = min((mib for _, mib in pinned), default=None)
    return Limits(
        memory_mib=None if memory is None or memory >= device_mib > 0 else memory,
        threads=None if threads >= NO_THREAD_LIMIT else threads,
    )


def enforcement_entry(held: ShareEnforcement) -> dict[str, object]:
    """A share's enforcement as ``tessera status`` (JSON) shows it: per limit, the limit, the server default and what
    holds it (``mps-server-exact``, ``mps-server-ceiling``, ``driver``, ``advisory``; absent: no such limit), and
    the sentence the text form and the claim's Events use."""
    entry: dict[str, object] = {}
    parts = []
    for what, limit, server, how, unit in (
        ("memory", held.limits.memory_mib, held.server.memory_mib, held.memory, "Mi"),
        ("compute", held.limits.threads, held.server.threads, held.threads, "%"),
    ):
        if how is not None:
            entry[what] = {"limit": limit, "server": server, "by": str(how)}
        parts.append(enforcement_note(what, limit, server, how, unit))
    entry["advisory"] = held.advisory
    entry["note"] = "; ".join(parts)
    return entry
