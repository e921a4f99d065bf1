"""MPS per claim: the control daemon a claim's devices are served by, and what the claim's containers get.

A claim whose config (NVIDIA's ``GpuConfig`` / ``MigDeviceConfig`` with ``sharing.strategy: MPS``) asks for MPS
gets its devices served by one MPS control daemon, run and supervised by Tessera's MPS manager like the device
plugin's (limits, readiness, pidfd supervision, adoption across agent restarts, the keeper). The daemon is keyed
by the set of devices it serves (``dra/<hash of the sorted UUIDs>``), so claims on the same devices share it; it
stops once no claim needs it and no client runs (the manager's drain). A share of a GPU shared by memory
(``agent.core.dra.shares``) is served the same way by the GPU's daemon, its limits from the share.

The limits are the claim's own, given to its clients rather than to the daemon: ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``
(``defaultActiveThreadPercentage``) and ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (``defaultPinnedDeviceMemoryLimit`` and
``defaultPerDevicePinnedMemoryLimit``, as NVIDIA resolves them) in the claim's CDI edits, with the daemon's pipe
directory (``CUDA_MPS_PIPE_DIRECTORY``) and the MPS shared memory mounted as the device plugin mounts them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from agent.core.dra.opaque import MpsConfig, pinned_memory_limits
from agent.core.dra.shares import Share, client_env
from agent.core.mps import CONTAINER_MPS_ROOT, MpsDaemonSpec

KEY_PREFIX = "dra"
RESOURCE = "dra"  # the daemons' resource name in the MPS manager (no device-plugin resource has it)
NO_THREAD_LIMIT = 100  # the daemon's own default: its clients' env sets each claim's


@dataclass(frozen=True, slots=True)
class MpsRecord:
    """The daemon a prepared claim uses: its key and the devices (GPU or MIG UUIDs) it serves."""

    key: str
    devices: tuple[str, ...]
    env: tuple[str, ...] = ()  # the claim's limits, as its clients' environment

    def spec(self) -> MpsDaemonSpec:
        return MpsDaemonSpec(
            key=self.key,
            resource=RESOURCE,
            visible_devices=self.devices,
            active_thread_percentage=NO_THREAD_LIMIT,
            pinned_memory_mib=(),
        )


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


def share_record(uuid: str, share: Share) -> MpsRecord:
    """The daemon a share of GPU ``uuid`` is served by (the GPU's one daemon, shared by every claim with a share of
    it, and by MPS claims on the whole GPU) and the share's limits as its clients' environment."""
    return MpsRecord(daemon_key([uuid]), (uuid,), client_env(uuid, share))


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
    """The daemons the recorded claims need, each once (claims on the same devices share one)."""
    return tuple({record.key: record.spec() for record in records.values()}.values())
