"""Memory-sized GPU shares: one GPU shared by several claims, each asking for an amount of its memory.

A GPU the config lists in ``dra.gpuShares`` is published with ``allowMultipleAllocations: true`` (consumable
capacity, KEP-5075; facts ``dra.md`` B4), so the scheduler hands it to several claims as long as their shares fit,
with no scheduler extender. Its two consumable capacities:

- ``memory`` — the GPU's memory in bytes. Request policy: 1Gi steps from 1Gi to all of it; a request is rounded up
  to the next GiB. The default (a claim that does not ask) is *all* of it, so a claim written for a whole GPU still
  gets a whole GPU and nobody shares it — unless the config's ``dra.defaultShare`` says otherwise: then a claim that
  does not ask gets that much, as a replica of a shared GPU is for NVIDIA's device plugin (and requests by count,
  such as the claim the scheduler writes for a pod asking for ``nvidia.com/gpu.shared: 1``, share GPUs).
- ``computePercent`` — the share of the GPU's SMs, 100 in all. Default 0: a claim that does not ask reserves no
  compute and gets no compute limit (its clients use what the others leave, as MPS clients do without a limit).

Prepare gets the share in the claim's allocation result (``shareID``, ``consumedCapacity``) and enforces it through
MPS: the GPU's claims share one MPS control daemon (``agent.core.dra.mps``), and each claim's clients get
``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=<uuid>=<MiB>M`` equal to its memory share and, when it asked for compute,
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` equal to its compute share. A share of all the memory is a whole GPU: it is
prepared as one (no MPS; its own sharing config applies).

On clusters without the DRAConsumableCapacity gate (alpha, off, in 1.34 and 1.35; beta, on, from 1.36) the API
server drops ``allowMultipleAllocations`` and the request policies: every such GPU is then allocated whole, to one
claim, exactly like a GPU outside ``gpuShares``. Nothing breaks; nothing is shared.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

from agent.core.dra.devices import GPU, DraDevice, RequestPolicy

MEMORY = "memory"
COMPUTE = "computePercent"
MEMORY_STEP = 1 << 30  # 1Gi: the smallest share and the unit shares are rounded up to
WHOLE_COMPUTE = 100
GATE = "DRAConsumableCapacity"
GATE_ON_BY_DEFAULT = (1, 36)  # beta, on by default; alpha (off) in 1.34 and 1.35


@dataclass(frozen=True, slots=True)
class Share:
    """What one claim's allocation result takes of a shared GPU."""

    memory: int  # bytes
    compute_percent: int = 0  # 0: no compute limit asked for

    @property
    def memory_mib(self) -> int:
        return self.memory >> 20


def shareable(device: DraDevice, default_share: int | None = None) -> DraDevice:
    """``device`` (a whole GPU) as a shared one: multi-allocatable, with the memory and compute capacities and
    their request policies; ``default_share`` (bytes, whole GiB) is what a claim that asks for no memory gets (all
    of it when None, or when the GPU has no more)."""
    if device.kind != GPU or device.dynamic or device.consumes_counters:
        raise ValueError(f"device {device.name}: only a whole GPU can be shared by memory")
    memory = device.capacity[MEMORY]
    default = memory if default_share is None else min(default_share, memory)
    policies = {
        MEMORY: RequestPolicy(default=default, minimum=MEMORY_STEP, maximum=memory, step=MEMORY_STEP),
        COMPUTE: RequestPolicy(default=0, minimum=0, maximum=WHOLE_COMPUTE, step=1),
    }
    return replace(
        device,
        capacity=MappingProxyType({**device.capacity, COMPUTE: WHOLE_COMPUTE}),
        allow_multiple_allocations=True,
        request_policies=MappingProxyType(policies),
    )


def share_of(device: DraDevice, consumed: Mapping[str, int]) -> Share | str:
    """The share an allocation result's ``consumedCapacity`` (base units) gives of ``device``, or why it cannot
    be one: more than the GPU has, or not on the policy's steps (an allocation the scheduler would not make)."""
    memory = consumed.get(MEMORY, device.capacity.get(MEMORY, 0))
    compute = consumed.get(COMPUTE, 0)
    total = device.capacity.get(MEMORY, 0)
    if not 0 < memory <= total:
        return f"its share of {MEMORY} ({memory} bytes) is not between 1 byte and the GPU's {total}"
    if not 0 <= compute <= WHOLE_COMPUTE:
        return f"its share of {COMPUTE} ({compute}) is not between 0 and {WHOLE_COMPUTE}"
    return Share(memory=memory, compute_percent=compute)


def whole(device: DraDevice, share: Share) -> bool:
    """A share of all the GPU's memory: nobody else can be on the GPU, so it is prepared as a whole GPU."""
    return share.memory >= device.capacity.get(MEMORY, 0)


def over_committed(device: DraDevice, share: Share, others: Mapping[str, Share]) -> str | None:
    """Why ``share`` does not fit next to the shares other claims hold of ``device`` (claim -> share), or None."""
    memory = share.memory + sum(s.memory for s in others.values())
    compute = share.compute_percent + sum(s.compute_percent for s in others.values())
    total = device.capacity.get(MEMORY, 0)
    if memory > total:
        return (
            f"its {_gib(share.memory)} of {device.name} and the {_gib(memory - share.memory)} other claims hold "
            f"({', '.join(sorted(others))}) exceed the GPU's {_gib(total)}"
        )
    if compute > WHOLE_COMPUTE:
        return (
            f"its {share.compute_percent}% of {device.name}'s compute and the {compute - share.compute_percent}% "
            f"other claims hold ({', '.join(sorted(others))}) exceed 100%"
        )
    return None


def client_env(uuid: str, share: Share) -> tuple[str, ...]:
    """The MPS limits a share's clients run with (memory always, compute when the claim asked for some)."""
    env = [f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={uuid}={share.memory_mib}M"]
    if share.compute_percent:
        env.append(f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={share.compute_percent}")
    return tuple(env)


def gate_note(version: tuple[int, int] | None) -> str | None:
    """What a cluster of ``version`` (major, minor) needs for shares, or None when it has it by default."""
    if version is not None and version >= GATE_ON_BY_DEFAULT:
        return None
    where = f"Kubernetes {version[0]}.{version[1]}" if version is not None else "Kubernetes before 1.36"
    return (
        f"GPU shares need the {GATE} feature gate, off by default on {where} (on by default from 1.36): "
        "without it the API server drops allowMultipleAllocations and each shared GPU goes to one claim whole"
    )


def _gib(amount: int) -> str:
    return f"{amount / (1 << 30):g}Gi"
