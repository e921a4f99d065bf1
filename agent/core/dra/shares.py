"""GPU shares (NVIDIA's ``ConsumableShares``): one GPU or MIG device shared by several claims, each taking part of it.

A device the config shares (``dra.gpuShares``, ``dra.consumableShares``) is published with
``allowMultipleAllocations: true`` (consumable capacity, KEP-5075; facts ``dra.md`` B4), so the scheduler hands it to
several claims as long as their shares fit, with no scheduler extender. The capacities and their request policies
follow NVIDIA's ``applyConsumableShares`` (kubernetes-sigs/dra-driver-nvidia-gpu ``cmd/gpu-kubelet-plugin/
consumable_shares.go``, main 2026), one mode per node (``consumableShares``):

- ``memory`` — the device's ``memory`` in bytes, in **1Mi steps** from 1Mi to all of it (a request is rounded up
  to the next MiB: ``1500Mi`` consumes ``1500Mi``). A claim that does not ask gets *all* of it, so a claim written
  for a whole GPU still gets a whole GPU and nobody shares it — unless ``dra.defaultShare`` says otherwise (a
  Tessera extension: requests by count, such as ``nvidia.com/gpu.shared: 1`` through a DeviceClass, share GPUs).
- ``unlimited`` — ``memory`` from 0 in 1Mi steps, default 0: any number of claims share the device, each taking the
  memory it asks for (none by default).
- ``<N>`` (an integer) — ``memory`` as in ``unlimited`` plus a ``shares`` capacity of N, default 1, 1 to N: at most
  N claims (or fewer taking several shares each) share the device.

Tessera adds ``computePercent`` (the share of the device's SMs, 100 in all, default 0) in every mode. On a MIG
device its other capacities (``multiprocessors``, engines, memory slices) cannot be split: their policy allows only
0, so a claim asking for some of them does not match a shared MIG device, and sharing is not blocked by them.

What a share's clients are held to (``Share.memory_limit`` / ``Share.thread_limit``): the memory it took (or, with
none but ``shares``, its ``k/N`` of the device's memory, as a replica gets ``1/N`` in NVIDIA's device plugin); the
compute it took (or ``k/N`` of 100). A share that took neither memory nor shares has no memory limit. A share nobody
else can fit next to (all the memory in ``memory`` mode, all N shares) is a whole device: prepared as one (no MPS;
its own sharing config applies).

**Enforcement.** A share's limits are held by the MPS control daemon of its device (``agent.core.dra.mps``), not by
its client: the daemon's server defaults (``set_default_device_pinned_mem_limit``,
``set_default_active_thread_percentage``) hold every client, and a client's own ``CUDA_MPS_*`` variables can only
lower them (facts ``mig-mps.md`` (d)). So the defaults are the largest limit of the shares the daemon serves
(``server_limits``): exact for every share when all shares of the device are equal; a ceiling — still an upper
bound — for the smaller ones, whose own limit then rests on their clients' variables, i.e. is advisory, unless
the driver's per-container memory limits (driver r615+) hold each container to its own share. ``enforced_by`` says
which holds a limit; ``driver`` comes from the memory-limits room's report (``agent.core.memlimits.DriverReport``,
handed to the DRA front end by the reconcile loop).

On clusters without the DRAConsumableCapacity gate (alpha, off, in 1.34 and 1.35; beta, on, from 1.36) the API
server drops ``allowMultipleAllocations`` and the request policies: every such device is then allocated whole, to
one claim. Nothing breaks; nothing is shared.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from msgspec import Struct
from msgspec.structs import replace

from agent.core.dra.devices import GPU, MIG, DraDevice, RequestPolicy

MEMORY = "memory"
COMPUTE = "computePercent"
SHARES = "shares"
MEMORY_STEP = 1 << 20  # 1Mi: NVIDIA's step, the smallest amount of memory a request can take more or less
WHOLE_COMPUTE = 100
GATE = "DRAConsumableCapacity"
GATE_ON_BY_DEFAULT = (1, 36)  # beta, on by default; alpha (off) in 1.34 and 1.35

MODE_MEMORY = "memory"
MODE_UNLIMITED = "unlimited"
MODE_DISABLED = "disabled"
Mode = str | int  # "memory", "unlimited", or N (the shares of each device)
MAX_SHARES = 1024  # a sane bound on N; an MPS server serves at most 48 clients per device anyway (facts mig-mps.md)
UNSPLIT = RequestPolicy(default=0, minimum=0, maximum=0, step=1, valid_values=(0,))  # a MIG device's engines


class Share(Struct, frozen=True):
    """What one claim's allocation result takes of a shared device (its ``consumedCapacity``)."""

    memory: int  # bytes; 0: none asked for (unlimited and integer modes)
    compute_percent: int = 0  # 0: no compute asked for
    shares: int = 0  # of the device's ``shares`` capacity (integer mode); 0 in the other modes

    @property
    def memory_mib(self) -> int:
        return self.memory >> 20


class Limits(Struct, frozen=True):
    """What a share's clients are held to: memory in MiB and the active thread percentage; None: no limit."""

    memory_mib: int | None
    threads: int | None


class Enforcement(StrEnum):
    """What holds a share's limit (``enforced_by``)."""

    MPS_SERVER_EXACT = "mps-server-exact"  # the MPS server's default is the limit: no client can go past it
    MPS_SERVER_CEILING = "mps-server-ceiling"  # the server holds a larger share's limit; below it, advisory
    DRIVER = "driver"  # the driver's per-container limit (issue 27)
    ADVISORY = "advisory"  # only the client's own CUDA_MPS_* variables, which it can drop


ADVISORY_KINDS = frozenset({Enforcement.MPS_SERVER_CEILING, Enforcement.ADVISORY})


def check_mode(value: object) -> Mode:
    """NVIDIA's ``consumableShares`` value (``--consumable-shares``): ``memory``, ``unlimited``, ``disabled`` or a
    positive number of shares (an int, or its decimal string as NVIDIA's Helm value is); ValueError naming it."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= MAX_SHARES:
        return value
    if isinstance(value, str):
        text = value.strip()
        if text in (MODE_MEMORY, MODE_UNLIMITED, MODE_DISABLED):
            return text
        if text.isascii() and text.isdigit() and len(text) <= 6 and 0 < int(text) <= MAX_SHARES:
            return int(text)
    shown = repr(value) if not isinstance(value, str) or len(value) <= 40 else f"{value[:40]!r}..."
    raise ValueError(
        f"{shown} is not a consumableShares value: write memory, unlimited, disabled or a number of shares per "
        f"device from 1 to {MAX_SHARES} (NVIDIA's --consumable-shares)"
    )


def shareable(device: DraDevice, default_share: int | None = None, mode: Mode = MODE_MEMORY) -> DraDevice:
    """``device`` (a whole GPU or an existing MIG device) as a shared one in ``mode``: multi-allocatable, with the
    memory, compute (and in integer mode shares) capacities and their request policies. ``default_share`` (bytes,
    whole MiB; ``memory`` mode only) is what a claim that asks for no memory gets (all of it when None, or when the
    device has no more)."""
    if device.kind not in (GPU, MIG) or device.dynamic or device.consumes_counters:
        raise ValueError(f"device {device.name}: only a whole GPU or an existing MIG device can be shared")
    memory = device.capacity[MEMORY] // MEMORY_STEP * MEMORY_STEP  # NVIDIA: max rounded down to the step
    if mode == MODE_MEMORY:
        default = memory if default_share is None else min(default_share, memory)
        memory_policy = RequestPolicy(default=default, minimum=MEMORY_STEP, maximum=memory, step=MEMORY_STEP)
    else:
        memory_policy = RequestPolicy(default=0, minimum=0, maximum=memory, step=MEMORY_STEP)
    capacity: dict[str, int] = {**device.capacity, MEMORY: memory, COMPUTE: WHOLE_COMPUTE}
    policies = {name: UNSPLIT for name in device.capacity}  # a MIG device's engines and slices cannot be split
    policies |= {MEMORY: memory_policy, COMPUTE: RequestPolicy(default=0, minimum=0, maximum=WHOLE_COMPUTE, step=1)}
    if isinstance(mode, int):
        capacity[SHARES] = mode
        policies[SHARES] = RequestPolicy(default=1, minimum=1, maximum=mode, step=1)
    return replace(
        device,
        capacity=MappingProxyType(capacity),
        allow_multiple_allocations=True,
        request_policies=MappingProxyType(policies),
    )


def share_of(device: Any, consumed: Mapping[str, int]) -> Share | str:
    """The share an allocation result's ``consumedCapacity`` (base units) gives of ``device``, or why it cannot
    be one: more than the device has, or less than its policy's minimum (an allocation the scheduler would not
    make)."""
    total = device.capacity.get(MEMORY, 0)
    policy = _policies(device).get(MEMORY)
    least = policy.minimum if policy is not None else 1
    memory = consumed.get(MEMORY, total if policy is None else policy.default)
    compute = consumed.get(COMPUTE, 0)
    if not least <= memory <= total:
        return f"its share of {MEMORY} ({memory} bytes) is not between {least} and the device's {total}"
    if not 0 <= compute <= WHOLE_COMPUTE:
        return f"its share of {COMPUTE} ({compute}) is not between 0 and {WHOLE_COMPUTE}"
    count = device.capacity.get(SHARES)
    shares = 0
    if count is not None:
        shares = consumed.get(SHARES, 1)
        if not 1 <= shares <= count:
            return f"its {SHARES} ({shares}) are not between 1 and the device's {count}"
    return Share(memory=memory, compute_percent=compute, shares=shares)


def limits(device: Any, share: Share) -> Limits:
    """What ``share``'s clients are held to: the memory and compute it took; with none, its shares' part of the
    device (``k/N``, as a replica of NVIDIA's device plugin gets ``1/N``); else no limit."""
    count = device.capacity.get(SHARES) or 0
    memory: int | None = share.memory_mib if share.memory else None
    threads: int | None = share.compute_percent or None
    if count and share.shares:
        if memory is None:
            memory = device.capacity.get(MEMORY, 0) * share.shares // count >> 20
        if threads is None:
            threads = max(1, WHOLE_COMPUTE * share.shares // count)
    return Limits(memory_mib=memory, threads=threads)


def whole(device: Any, share: Share) -> bool:
    """A share nobody else can fit next to (all the memory in ``memory`` mode, all N shares): it is prepared as a
    whole device. In ``unlimited`` mode no share is whole."""
    used = {MEMORY: share.memory, COMPUTE: share.compute_percent, SHARES: share.shares}
    policies = _policies(device)
    if not policies:  # published before shares had policies of their own: all the memory is the whole device
        return share.memory >= device.capacity.get(MEMORY, 0)
    return any(
        policy.minimum > 0 and used.get(name, 0) + policy.minimum > device.capacity.get(name, 0)
        for name, policy in policies.items()
        if name in used
    )


def over_committed(device: Any, share: Share, others: Mapping[str, Share]) -> str | None:
    """Why ``share`` does not fit next to the shares other claims hold of ``device`` (claim -> share), or None."""
    memory = share.memory + sum(s.memory for s in others.values())
    compute = share.compute_percent + sum(s.compute_percent for s in others.values())
    shares = share.shares + sum(s.shares for s in others.values())
    total = device.capacity.get(MEMORY, 0)
    holders = ", ".join(sorted(others))
    if memory > total:
        return (
            f"its {_size(share.memory)} of {device.name} and the {_size(memory - share.memory)} other claims hold "
            f"({holders}) exceed the device's {_size(total)}"
        )
    if compute > WHOLE_COMPUTE:
        return (
            f"its {share.compute_percent}% of {device.name}'s compute and the {compute - share.compute_percent}% "
            f"other claims hold ({holders}) exceed 100%"
        )
    count = device.capacity.get(SHARES)
    if count is not None and shares > count:
        return (
            f"its {share.shares} of {device.name}'s {SHARES} and the {shares - share.shares} other claims hold "
            f"({holders}) exceed the device's {count}"
        )
    return None


def client_env(uuid: str, limit: Limits) -> tuple[str, ...]:
    """The MPS limits a share's clients are also given (a client can only lower the server's): memory when the share
    has a memory limit, compute when it has a thread limit."""
    env = []
    if limit.memory_mib is not None:
        env.append(f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={uuid}={limit.memory_mib}M")
    if limit.threads is not None:
        env.append(f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={limit.threads}")
    return tuple(env)


# ----- enforcement ---------------------------------------------------------------------------------------------


def server_limits(shares: Iterable[Limits]) -> Limits:
    """The MPS server defaults that hold every one of ``shares`` (the limits of the shares one daemon serves): the
    largest of each limit, None (no server limit) as soon as one share has none — a client's variables can only
    lower the server's, so the server's must let the largest share through."""
    memory: list[int | None] = []
    threads: list[int | None] = []
    for limit in shares:
        memory.append(limit.memory_mib)
        threads.append(limit.threads)
    return Limits(memory_mib=_largest(memory), threads=_largest(threads))


def enforced_by(limit: int | None, server: int | None, *, driver: bool = False) -> Enforcement | None:
    """How a share's ``limit`` is held, given the MPS ``server`` default its clients start under (None: none), and
    whether the driver holds the container to it (``driver``: issue 27's per-container memory limits). None when
    there is no limit to hold."""
    if limit is None:
        return None
    if driver:
        return Enforcement.DRIVER
    if server is None:
        return Enforcement.ADVISORY
    return Enforcement.MPS_SERVER_EXACT if server <= limit else Enforcement.MPS_SERVER_CEILING


def enforcement_note(what: str, limit: int | None, server: int | None, how: Enforcement | None, unit: str) -> str:
    """One limit's enforcement in words, for ``tessera status`` and the claim's Events."""
    if how is None:
        return f"no {what} limit"
    shown = f"{what} {limit}{unit}"
    if how is Enforcement.MPS_SERVER_EXACT:
        return f"{shown} held by the MPS server"
    if how is Enforcement.DRIVER:
        return f"{shown} held by the driver"
    if how is Enforcement.MPS_SERVER_CEILING:
        return (
            f"{shown} advisory: the MPS server holds {server}{unit} (a larger share on the device); below that only "
            "the client's CUDA_MPS_* variables hold it"
        )
    return f"{shown} advisory: only the client's CUDA_MPS_* variables hold it"


def gate_note(version: tuple[int, int] | None) -> str | None:
    """What a cluster of ``version`` (major, minor) needs for shares, or None when it has it by default."""
    if version is not None and version >= GATE_ON_BY_DEFAULT:
        return None
    where = f"Kubernetes {version[0]}.{version[1]}" if version is not None else "Kubernetes before 1.36"
    return (
        f"GPU shares need the {GATE} feature gate, off by default on {where} (on by default from 1.36): "
        "without it the API server drops allowMultipleAllocations and each shared GPU goes to one claim whole"
    )


def _largest(values: list[int | None]) -> int | None:
    if not values or any(v is None for v in values):
        return None
    return max(v for v in values if v is not None)


def _policies(device: Any) -> Mapping[str, RequestPolicy]:
    return getattr(device, "request_policies", None) or {}


def _size(amount: int) -> str:
    for power, suffix in ((40, "Ti"), (30, "Gi"), (20, "Mi")):
        if amount and amount % (1 << power) == 0:
            return f"{amount >> power}{suffix}"
    return f"{amount} bytes"
