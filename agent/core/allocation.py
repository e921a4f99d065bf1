"""``allocate``: what the container runtime needs for a set of devices, or why the request is refused.

Pure: it validates a kubelet ``Allocate`` container request against the advertised devices and their
health, and builds the response (environment, mounts, CDI device names) for the chosen strategies.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from agent.core.resources import Device

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


def container_allocation(
    resource: str,
    devices: Iterable[Device],
    strategies: Iterable[DeviceListStrategy],
    *,
    cdi_kind: str = DEFAULT_CDI_KIND,
) -> ContainerAllocation:
    """The runtime's view of ``devices``: physical IDs (GPU or MIG UUIDs) de-duplicated in request order."""
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
    return ContainerAllocation(
        envs=envs,
        mounts=tuple(mounts),
        cdi_devices=cdi_names if DeviceListStrategy.CDI_CRI in chosen else (),
        annotations=annotations,
    )


def _annotation_safe(resource: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in resource)


def _ids(ids: Iterable[str], limit: int = 8) -> str:
    listed = list(ids)
    shown = ", ".join(listed[:limit])
    return shown + (f" and {len(listed) - limit} more" if len(listed) > limit else "")
