"""``allocate``: what the container runtime needs for a set of devices, or why the request is refused.

Pure: it validates a kubelet ``Allocate`` container request against the advertised devices and their
health, and builds the response (environment, mounts, CDI device names) for the chosen strategies.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from enum import StrEnum
from types import MappingProxyType

from msgspec import Struct, field

from agent.core.cdi_edits import DEVICE_PLUGIN_KIND, MEMORY_LIMIT_ENV, MEMORY_REQUEST_ENV
from agent.core.mps import CONTAINER_MPS_ROOT, daemon_key
from agent.core.resources import Device, MpsLimits, ReplicaMemory, replica_memory

VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
VOLUME_MOUNT_ROOT = "/var/run/nvidia-container-devices"
DEFAULT_CDI_KIND = DEVICE_PLUGIN_KIND  # --cdi-kind: the spec Tessera writes, named as NVIDIA's plugin names it
CDI_ANNOTATION_PREFIX = "cdi.k8s.io/"


class DeviceListStrategy(StrEnum):
    """How devices reach the container runtime (NVIDIA's ``deviceListStrategy`` values)."""

    ENVVAR = "envvar"  # NVIDIA_VISIBLE_DEVICES=<uuids>, read by the NVIDIA container runtime
    VOLUME_MOUNTS = "volume-mounts"  # /dev/null mounted at /var/run/nvidia-container-devices/<uuid>
    CDI_CRI = "cdi-cri"  # CDI device names in the CRI request
    CDI_ANNOTATIONS = "cdi-annotations"  # CDI device names in a container annotation


class Mount(Struct, frozen=True):
    container_path: str
    host_path: str
    read_only: bool = False


class ContainerAllocation(Struct, frozen=True):
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


class MpsClient(Struct, frozen=True):
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
    A server answering many requests builds an ``Allocator`` once instead.
    """
    devices = list(devices)
    allocator = Allocator.of(resource, devices, {}, strategies, cdi_kind=cdi_kind, mps=mps)
    return allocator.container([d.id for d in devices])


class Allocator(Struct, frozen=True):
    """``allocate`` for one snapshot of a resource: everything an Allocate request needs that depends only on
    the snapshot (healthy IDs, physical IDs, CDI names, mounts, MPS daemons and limits) is derived once, here,
    so a request costs a few dictionary lookups and one join."""

    resource: str
    devices: Mapping[str, Device]
    health: Mapping[str, bool]
    fail_requests_greater_than_one: bool
    healthy: frozenset[str]
    physical: Mapping[str, str]  # device ID -> GPU or MIG UUID
    envvar: bool
    volume_mounts: Mapping[str, Mount]  # physical ID -> its /dev/null mount; empty unless that strategy is on
    cdi_names: Mapping[str, str]  # physical ID -> "<kind>=<uuid>"
    cdi_cri: bool
    annotation_key: str | None  # set when CDI names also go in an annotation
    daemons: Mapping[str, str]  # device ID -> its MPS daemon key; empty without MPS
    mps_envs: Mapping[str, Mapping[str, str]]  # daemon key -> its pipe directory and thread percentage
    mps_mounts: Mapping[str, tuple[Mount, ...]]  # daemon key -> pipe and shared-memory mounts
    mps_memory: Mapping[str, str]  # physical ID -> "<uuid>=<MiB>M", its pinned-memory limit
    # device ID -> (its GPU, request MiB, limit MiB): the memory-limit variables; empty when they are not given
    memory_sizes: Mapping[str, tuple[str, int, int]] = field(default_factory=dict)
    cdi_unavailable: str = ""  # why the CDI names would not resolve (the spec could not be written): refused

    @classmethod
    def of(
        cls,
        resource: str,
        devices: Iterable[Device],
        health: Mapping[str, bool],
        strategies: Iterable[DeviceListStrategy],
        *,
        cdi_kind: str = DEFAULT_CDI_KIND,
        mps: MpsClient | None = None,
        fail_requests_greater_than_one: bool = False,
        memory: ReplicaMemory | None = None,
        replicas: int = 1,
        memory_envs: bool = False,
        cdi_unavailable: str = "",
    ) -> Allocator:
        """``memory``: a time-sliced resource's replica size; ``memory_envs``: give a container of a sized replica
        (MPS or time-sliced) ``NVIDIA_GPU_MEMORY_REQUEST`` / ``NVIDIA_GPU_MEMORY_LIMIT`` (the node enforces memory
        limits: ``tessera run --memory-limits on``)."""
        by_id = {d.id: d for d in devices}
        chosen = set(strategies)
        physical = {i: d.physical_id for i, d in by_id.items()}
        units = dict.fromkeys(physical.values())  # every physical ID once, in plan order
        daemons: dict[str, str] = {}
        mps_envs: dict[str, Mapping[str, str]] = {}
        mps_mounts: dict[str, tuple[Mount, ...]] = {}
        mps_memory: dict[str, str] = {}
        if mps is not None:
            daemons = {i: daemon_key(resource, d) for i, d in by_id.items()}
            for key in dict.fromkeys(daemons.values()):
                pipe = f"{CONTAINER_MPS_ROOT}/{key}/pipe"
                mps_envs[key] = {
                    "CUDA_MPS_PIPE_DIRECTORY": pipe,
                    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(mps.limits.active_thread_percentage),
                }
                mps_mounts[key] = (
                    Mount(pipe, f"{mps.host_root}/{key}/pipe"),
                    Mount("/dev/shm", f"{mps.host_root}/shm"),  # noqa: S108 - the container's shm, by design
                )
            for d in by_id.values():
                if d.physical_id not in mps_memory:
                    limit = mps.limits.memory_for(d.memory_mib, mps.replicas)
                    mps_memory[d.physical_id] = f"{d.physical_id}={limit}M"
        annotate = DeviceListStrategy.CDI_ANNOTATIONS in chosen
        return cls(
            resource=resource,
            devices=MappingProxyType(by_id),
            health=health,
            fail_requests_greater_than_one=fail_requests_greater_than_one,
            healthy=frozenset(i for i in by_id if health.get(i, False)),
            physical=physical,
            envvar=DeviceListStrategy.ENVVAR in chosen,
            volume_mounts={
                u: Mount(f"{VOLUME_MOUNT_ROOT}/{u}", "/dev/null", read_only=True)
                for u in (units if DeviceListStrategy.VOLUME_MOUNTS in chosen else ())
            },
            cdi_names={u: f"{cdi_kind}={u}" for u in units},
            cdi_cri=DeviceListStrategy.CDI_CRI in chosen,
            annotation_key=f"{CDI_ANNOTATION_PREFIX}tessera_{_annotation_safe(resource)}" if annotate else None,
            daemons=daemons,
            mps_envs=mps_envs,
            mps_mounts=mps_mounts,
            mps_memory=mps_memory,
            memory_sizes=_memory_sizes(by_id, mps, memory, replicas) if memory_envs else {},
            cdi_unavailable=cdi_unavailable if DeviceListStrategy.CDI_CRI in chosen or annotate else "",
        )

    def allocate(self, requested: Sequence[str]) -> ContainerAllocation:
        """Validate one container's request and answer it; ``AllocationError`` names every bad ID."""
        if self.cdi_unavailable:  # CDI names no spec holds would fail the container's creation: refuse up front
            raise AllocationError(f"{self.resource}: its CDI devices cannot be given: {self.cdi_unavailable}")
        valid = 0 < len(requested) == len(set(requested)) and self.healthy.issuperset(requested)
        if not valid or (self.fail_requests_greater_than_one and len(requested) > 1):
            # the rare path: validate_request says precisely what is wrong (or that nothing is)
            validate_request(
                self.resource,
                requested,
                self.devices,
                self.health,
                fail_requests_greater_than_one=self.fail_requests_greater_than_one,
            )
        return self.container(requested)

    def container(self, ids: Sequence[str]) -> ContainerAllocation:
        """The runtime's view of devices already validated: physical IDs de-duplicated in request order."""
        physical = [self.physical[i] for i in ids]
        if len(physical) > 1:
            physical = list(dict.fromkeys(physical))
        envs: dict[str, str] = {}
        mounts: tuple[Mount, ...] = ()
        annotations: dict[str, str] = {}
        if self.envvar:
            envs[VISIBLE_DEVICES_ENV] = ",".join(physical)
        if self.volume_mounts:
            envs[VISIBLE_DEVICES_ENV] = VOLUME_MOUNT_ROOT
            mounts = tuple(self.volume_mounts[u] for u in physical)
        cdi_names = tuple(self.cdi_names[u] for u in physical) if self.cdi_cri or self.annotation_key else ()
        if self.annotation_key is not None:
            annotations[self.annotation_key] = ",".join(cdi_names)
        if self.daemons:
            keys = sorted({self.daemons[i] for i in ids})
            if len(keys) > 1:
                raise AllocationError(
                    f'invalid allocation request for "{self.resource}": these replicas belong to {len(keys)} MPS '
                    f"daemons ({', '.join(keys)}) and a container can use one; request one MIG device's replicas"
                )
            envs.update(self.mps_envs[keys[0]])
            envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(self.mps_memory[u] for u in physical)
            mounts += self.mps_mounts[keys[0]]
        if self.memory_sizes:
            envs.update(memory_limit_envs([self.memory_sizes[i] for i in ids if i in self.memory_sizes]))
        return ContainerAllocation(
            envs=envs,
            mounts=mounts,
            cdi_devices=cdi_names if self.cdi_cri else (),
            annotations=annotations,
        )


def _memory_sizes(
    devices: Mapping[str, Device], mps: MpsClient | None, memory: ReplicaMemory | None, replicas: int
) -> dict[str, tuple[str, int, int]]:
    limits = mps.limits if mps is not None else None
    replicas = mps.replicas if mps is not None else replicas
    sizes = {}
    for device_id, device in devices.items():
        sized = replica_memory(device, replicas, limits, memory)
        if sized is not None:
            sizes[device_id] = (device.gpu_uuid, *sized)
    return sizes


def memory_limit_envs(sizes: Sequence[tuple[str, int, int]]) -> dict[str, str]:
    """The toolkit hook's variables for a container given devices of these (GPU, request MiB, limit MiB): on each
    GPU the sum of its devices there. The variables are singular (one value for every GPU of the container), so
    when the sums differ between GPUs none is given and the agent's own path sets each GPU's limits after the
    start (``agent.memlimits``); a container given no sized device gets none either."""
    per_gpu: dict[str, tuple[int, int]] = {}
    for gpu, request, limit in sizes:
        had = per_gpu.get(gpu, (0, 0))
        per_gpu[gpu] = (had[0] + request, had[1] + limit)
    if len(set(per_gpu.values())) != 1:
        return {}
    request, limit = next(iter(per_gpu.values()))
    return {MEMORY_REQUEST_ENV: str(request), MEMORY_LIMIT_ENV: str(limit)}


def _annotation_safe(resource: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in resource)


def _ids(ids: Iterable[str], limit: int = 8) -> str:
    listed = list(ids)
    shown = ", ".join(listed[:limit])
    return shown + (f" and {len(listed) - limit} more" if len(listed) > limit else "")
