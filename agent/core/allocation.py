"""``allocate``: what the container runtime needs for a set of devices, or why the request is refused.

Pure: it validates a kubelet ``Allocate`` container request against the advertised devices and their
health, and builds the response (environment, mounts, CDI device names) for the chosen strategies.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from agent.core.mps import CONTAINER_MPS_ROOT, daemon_key
from agent.core.resources import Device, MpsLimits

VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
VOLUME_MOUNT_ROOT = "/var/run/nvidia-container-devices"
DEFAULT_CDI_KIND = "nvidia.com/gpu"
CDI_ANNOTATION_PREFIX = "cdi.k8s.io/"


class DeviceListStrategy(StrEnum):
    """How devices reach the container runtime (NVIDIA's ``deviceListStrategy`` values)."""

    ENVVAR = "envvar"  # NVIDIA_VISIBLE_DEVICES=<uuids>, read by the NVIDIA container runtime
    VOLUME_MOUNTS = "volume-mounts"  # /dev/null mounted at /var/run/nvidia-container-devices/<uuid>
    CDI_CRI = "cdi-cri"  # CDI device names in the CRI request
    CDI_ANNOTATIONS = "cdi-annotations"  # CDI device names in a container annotation


@dataclass(frozen=True, slots=True)
class Mount:
    container_path: str
    host_path: str
    read_only: bool = False


@dataclass(frozen=True, slots=True)
class ContainerAllocation:
    """One container's share of an ``AllocateResponse``."""

    envs: Mapping[str, str] = field(default_factory=dict)
    mounts: tuple[Mount, ...] = ()
    cdi_devices: tuple[str, ...] = ()
    annotations: Mapping[str, str] = field(default_factory=dict)


class AllocationError(ValueError):
    """The request cannot be served; the message names the IDs and why. Maps to INVALID_ARGUMENT."""


def validate_request(
    resource: str,
    requested: Sequence[str],
    devices: Mapping[str, Device],
    healthy: Mapping[str, bool],
    *,
    fail_requests_greater_than_one: bool = False,
) -> list[Device]:
    """The requested devices in request order, or ``AllocationError`` naming every bad ID.

    With ``fail_requests_greater_than_one`` a request for more than one replica is refused with NVIDIA's
    text, because two replicas of one GPU would silently give the container one GPU.
    """
    if not requested:
        raise AllocationError(f"empty allocation request for {resource}: no device IDs")
    if fail_requests_greater_than_one and len(requested) > 1 and any("::" in i for i in requested):
        raise AllocationError(
            f'invalid allocation request for "{resource}": maximum request size for shared resources is 1; '
            f"found {len(requested)}"
        )
    seen: set[str] = set()
    duplicates = [i for i in requested if i in seen or seen.add(i)]  # type: ignore[func-returns-value]
    if duplicates:
        raise AllocationError(f"duplicate device IDs in the request for {resource}: {_ids(duplicates)}")
    unknown = [i for i in requested if i not in devices]
    if unknown:
        raise AllocationError(f"unknown device IDs for {resource}: {_ids(unknown)}")
    unhealthy = [i for i in requested if not healthy.get(i, False)]
    if unhealthy:
        raise AllocationError(f"devices of {resource} are Unhealthy and cannot be allocated: {_ids(unhealthy)}")
    return [devices[i] for i in requested]


@dataclass(frozen=True, slots=True)
class MpsClient:
    """What an MPS client container needs: the daemon's directory on the host, and its limits."""

    host_root: str
    limits: MpsLimits
    replicas: int


def container_allocation(
    resource: str,
    devices: Iterable[Device],
    strategies: Iterable[DeviceListStrategy],
    *,
    cdi_kind: str = DEFAULT_CDI_KIND,
    mps: MpsClient | None = None,
) -> ContainerAllocation:
    """The runtime's view of ``devices``: physical IDs (GPU or MIG UUIDs) de-duplicated in request order.

    An MPS client also gets the daemon's pipe directory, the shared-memory mount and its own limits as
    environment (a client can only lower them, so they are a second line of defence behind the daemon's).
    """
    devices = list(devices)
    physical = list(dict.fromkeys(d.physical_id for d in devices))
    chosen = set(strategies)
    envs: dict[str, str] = {}
    mounts: list[Mount] = []
    annotations: dict[str, str] = {}
    cdi_names = tuple(f"{cdi_kind}={i}" for i in physical)
    if DeviceListStrategy.ENVVAR in chosen:
        envs[VISIBLE_DEVICES_ENV] = ",".join(physical)
    if DeviceListStrategy.VOLUME_MOUNTS in chosen:
        envs[VISIBLE_DEVICES_ENV] = VOLUME_MOUNT_ROOT
        mounts += [Mount(f"{VOLUME_MOUNT_ROOT}/{i}", "/dev/null", read_only=True) for i in physical]
    if DeviceListStrategy.CDI_ANNOTATIONS in chosen:
        annotations[f"{CDI_ANNOTATION_PREFIX}tessera_{_annotation_safe(resource)}"] = ",".join(cdi_names)
    if mps is not None:
        _mps_client(resource, devices, mps, envs, mounts)
    return ContainerAllocation(
        envs=envs,
        mounts=tuple(mounts),
        cdi_devices=cdi_names if DeviceListStrategy.CDI_CRI in chosen else (),
        annotations=annotations,
    )


def _mps_client(
    resource: str, devices: list[Device], mps: MpsClient, envs: dict[str, str], mounts: list[Mount]
) -> None:
    keys = sorted({daemon_key(resource, d) for d in devices})
    if len(keys) > 1:
        raise AllocationError(
            f'invalid allocation request for "{resource}": these replicas belong to {len(keys)} MPS daemons '
            f"({', '.join(keys)}) and a container can use one; request one MIG device's replicas"
        )
    pipe = f"{CONTAINER_MPS_ROOT}/{keys[0]}/pipe"
    envs["CUDA_MPS_PIPE_DIRECTORY"] = pipe
    envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(mps.limits.active_thread_percentage)
    limits = dict.fromkeys(d.physical_id for d in devices)
    envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(
        f"{uuid}={mps.limits.memory_for(next(d.memory_mib for d in devices if d.physical_id == uuid), mps.replicas)}M"
        for uuid in limits
    )
    mounts.append(Mount(pipe, f"{mps.host_root}/{keys[0]}/pipe"))
    mounts.append(Mount("/dev/shm", f"{mps.host_root}/shm"))  # noqa: S108 - the container's shm, by design


def _annotation_safe(resource: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in resource)


def _ids(ids: Iterable[str], limit: int = 8) -> str:
    listed = list(ids)
    shown = ", ".join(listed[:limit])
    return shown + (f" and {len(listed) - limit} more" if len(listed) > limit else "")
