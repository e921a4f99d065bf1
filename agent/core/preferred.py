"""``preferred``: which devices the kubelet should pick for a container (``GetPreferredAllocation``).

For full GPUs the best set is the best-connected one: every pair of GPUs in the set scores by its link
(NVLink beats the same NUMA node beats crossing sockets) and the set with the highest total wins, ties to
the lowest GPU indices. Replicas follow the allocation policy by their parent GPU (``distributed``: the
least loaded GPU first; ``packed``: the fullest first — NVIDIA's policies, applied to MIG replicas too), and
a multi-replica request stays on one device whenever one can hold it. MIG devices keep the plan's order.
Deterministic: the same inputs always give the same answer, ties broken by plan order.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from itertools import combinations
from math import comb

from msgspec import Struct

from agent.core.resources import AllocationPolicy, Device

NVLINK_SCORE = 100
SAME_NUMA_SCORE = 20
CROSS_NUMA_SCORE = 10
EXHAUSTIVE_LIMIT = 20_000  # combinations to try before falling back to a greedy choice


class PreferenceError(ValueError):
    """The request is malformed; maps to INVALID_ARGUMENT."""


class DeviceLayout(Struct, frozen=True):
    """What ``preferred`` needs to know about all of a resource's devices, worked out once per snapshot
    instead of on every GetPreferredAllocation call."""

    position: Mapping[str, int]  # device ID -> its place in plan order
    per_gpu: Mapping[str, int]  # GPU UUID -> devices (replicas) of the resource on it
    per_device: Mapping[str, int]  # physical ID -> its replicas
    has_replicas: bool  # any device is a replica: requests may need _replicas
    all_whole: bool  # every device is a whole GPU (no replica, no MIG device): connectivity decides
    nvlink_peers: Mapping[int, frozenset[int]] | None  # what ``pair_scores`` was scored with
    pair_scores: Mapping[tuple[str, str], int]  # (ID, ID) -> link score, both orders, for whole GPUs

    @classmethod
    def of(
        cls, devices: Mapping[str, Device], nvlink_peers: Mapping[int, frozenset[int]] | None = None
    ) -> DeviceLayout:
        whole = [d for d in devices.values() if d.replica is None and d.mig_uuid is None]
        return cls(
            position={device_id: n for n, device_id in enumerate(devices)},
            per_gpu=Counter(d.gpu_uuid for d in devices.values()),
            per_device=Counter(d.physical_id for d in devices.values()),
            has_replicas=any(d.replica is not None for d in devices.values()),
            all_whole=len(whole) == len(devices),
            nvlink_peers=nvlink_peers,
            pair_scores=_pair_scores(whole, nvlink_peers) if nvlink_peers is not None else {},
        )


def preferred(
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    devices: Mapping[str, Device],
    nvlink_peers: Mapping[int, frozenset[int]],
    policy: AllocationPolicy = AllocationPolicy.DISTRIBUTED,
    layout: DeviceLayout | None = None,
) -> list[str]:
    """``size`` IDs from ``available`` that include ``must_include``, best connected first.

    ``layout`` is ``DeviceLayout.of(devices, nvlink_peers)``, computed once by the caller that serves many
    requests.

    Unknown IDs in ``available`` are ignored (the kubelet may hold a stale view); unknown IDs in
    ``must_include``, a size below ``len(must_include)`` or above what is available are errors.
    """
    required = list(dict.fromkeys(must_include))
    unknown = [i for i in required if i not in devices]
    if unknown:
        raise PreferenceError(f"unknown device IDs in must_include: {', '.join(unknown)}")
    if size < max(1, len(required)):
        raise PreferenceError(f"allocation size {size} is smaller than the {len(required)} required devices")
    chosen = set(required)
    candidates = [i for i in dict.fromkeys(available) if i in devices and i not in chosen]
    needed = size - len(required)
    if needed > len(candidates):
        raise PreferenceError(
            f"not enough available devices: {size} requested, {len(required) + len(candidates)} available"
        )
    if layout is None:
        layout = DeviceLayout.of(devices, nvlink_peers)
    if needed == 0:
        return required
    candidates.sort(key=layout.position.__getitem__)
    if layout.has_replicas and any(devices[i].replica is not None for i in (*required, *candidates)):
        return required + _replicas(required, candidates, needed, devices, policy, layout)
    if not layout.all_whole and not all(devices[i].mig_uuid is None for i in (*required, *candidates)):
        return required + candidates[:needed]
    if needed == len(candidates) or len(required) + needed < 2:
        return required + candidates[:needed]  # no choice, or no pair to score: plan order
    if layout.nvlink_peers is nvlink_peers and layout.all_whole:
        scores = layout.pair_scores
    else:
        scores = _pair_scores([devices[i] for i in (*required, *candidates)], nvlink_peers)
    return required + _best_connected(required, candidates, needed, scores)


def _pair_score(a: Device, b: Device, nvlink_peers: Mapping[int, frozenset[int]]) -> int:
    if a.gpu_index == b.gpu_index:
        return NVLINK_SCORE * 2
    if b.gpu_index in nvlink_peers.get(a.gpu_index, frozenset()):
        return NVLINK_SCORE
    if a.numa_node is not None and a.numa_node == b.numa_node:
        return SAME_NUMA_SCORE
    return CROSS_NUMA_SCORE


def _pair_scores(devices: Sequence[Device], nvlink_peers: Mapping[int, frozenset[int]]) -> dict[tuple[str, str], int]:
    scores = {}
    for a, b in combinations(devices, 2):
        scores[a.id, b.id] = scores[b.id, a.id] = _pair_score(a, b, nvlink_peers)
    return scores


def _best_connected(
    required: list[str], candidates: list[str], needed: int, scores: Mapping[tuple[str, str], int]
) -> list[str]:
    """The candidates that, added to ``required``, give the highest total pair score."""
    # a candidate's links to the required devices are the same in every set it is part of
    cross = {c: sum(scores[r, c] for r in required) for c in candidates}
    pair = scores.__getitem__
    if comb(len(candidates), needed) <= EXHAUSTIVE_LIMIT:

        def score(picked: tuple[str, ...]) -> int:
            return sum(map(cross.__getitem__, picked)) + sum(map(pair, combinations(picked, 2)))

        # combinations() yields in plan order and max() keeps the first best: ties go to the lowest indices.
        return list(max(combinations(candidates, needed), key=score))
    picked: list[str] = []  # greedy: add the device that raises the score most, ties to plan order
    for _ in range(needed):
        remaining = [c for c in candidates if c not in picked]
        best = max(remaining, key=lambda c: cross[c] + sum(scores[x, c] for x in picked))
        picked.append(best)
    return picked


def _replicas(
    required: list[str],
    candidates: list[str],
    needed: int,
    devices: Mapping[str, Device],
    policy: AllocationPolicy,
    layout: DeviceLayout,
) -> list[str]:
    """Replicas: keep the request on as few devices as possible, choosing devices by the policy."""
    free: dict[str, list[str]] = {}  # physical device -> its free replicas, in plan order
    for candidate in candidates:
        free.setdefault(devices[candidate].physical_id, []).append(candidate)
    total, unit_total = layout.per_gpu, layout.per_device
    available = Counter(devices[c].gpu_uuid for c in candidates)
    first_seen = {unit: n for n, unit in enumerate(free)}
    sign = 1 if policy is AllocationPolicy.DISTRIBUTED else -1

    def rank(unit: str) -> tuple[int, int, int]:
        gpu = devices[free[unit][0]].gpu_uuid
        load = total[gpu] - available[gpu]  # replicas in use elsewhere, unhealthy or required
        # then the device's own load: MIG devices of one GPU are separate devices (NVIDIA ranks by device)
        return sign * load, sign * (unit_total[unit] - len(free[unit])), first_seen[unit]

    picks: list[str] = []
    together = [u for u in dict.fromkeys(devices[r].physical_id for r in required) if u in free]
    for unit in together:  # join the devices the container already has first
        picks += free.pop(unit)[: needed - len(picks)]
    while len(picks) < needed:
        remaining = needed - len(picks)
        holding = [u for u in free if len(free[u]) >= remaining]
        unit = min(holding, key=rank) if holding else min(free, key=lambda u: (-len(free[u]), rank(u)))
        picks += free.pop(unit)[:remaining]
    return picks
