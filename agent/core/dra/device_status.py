"""A claim's ``status.devices`` (``AllocatedDeviceStatus``, GA in Kubernetes 1.37): what the driver says of each
device it prepared, and taking it back at Unprepare.

After Prepare the driver adds one entry per prepared device: ``driver``, ``pool``, ``device`` (and ``shareID`` for a
share of a GPU: entries are keyed by all four, the API's list-map keys), a ``Ready`` condition (``True``, reason
``Prepared``) and ``data`` with the device's UUID, which for a dynamic-MIG device is the UUID of the MIG device
Prepare created (the published device has none). Users see it in ``kubectl get resourceclaim -o yaml``; tools
(dcgm-exporter's DRA mapping, say) find the GPU or MIG device a claim got without asking the node. Unprepare removes
the driver's entries of that claim again, since the devices no longer hold anything of it.

The list is shared with other drivers of the same claim (a NIC's driver writes ``networkData`` there), so only this
driver's entries for this pool are replaced; the rest is kept as it is. Pure: the shell (``agent.dra.claims_api``)
reads the claim, calls ``with_prepared`` or ``without_ours`` and writes the result with an optimistic-concurrency
check.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from msgspec import Struct

READY = "Ready"
PREPARED = "Prepared"
MAX_DEVICE_STATUSES = 32  # resource.k8s.io AllocationResultsMaxSize: one entry per allocated device at most


class TooManyDeviceStatuses(ValueError):
    """The claim's ``status.devices`` with this report would hold more entries than the API server accepts."""


class DeviceStatus(Struct, frozen=True):
    """What the driver reports for one prepared device."""

    pool: str
    device: str
    uuid: str  # the GPU's or MIG device's UUID ("" when not known)
    share_id: str | None = None


def entry(driver: str, status: DeviceStatus, node: str, now: str, generation: int | None) -> dict[str, Any]:
    """The ``AllocatedDeviceStatus`` for one prepared device (``now``: RFC 3339, as metav1.Time)."""
    condition: dict[str, Any] = {
        "type": READY,
        "status": "True",
        "reason": PREPARED,
        "message": f"prepared on node {node}",
        "lastTransitionTime": now,
    }
    if generation is not None:
        condition["observedGeneration"] = generation
    result: dict[str, Any] = {"driver": driver, "pool": status.pool, "device": status.device}
    if status.share_id:
        result["shareID"] = status.share_id
    result["conditions"] = [condition]
    if status.uuid:
        result["data"] = {"uuid": status.uuid}
    return result


def _key(item: Mapping[str, Any]) -> tuple[Any, Any, Any, Any]:
    return item.get("driver"), item.get("pool"), item.get("device"), item.get("shareID") or None


def with_prepared(
    claim: Mapping[str, Any], driver: str, statuses: Sequence[DeviceStatus], node: str, now: str
) -> list[dict[str, Any]] | None:
    """The claim's new ``status.devices`` with an entry for each of ``statuses`` — the claim's devices this driver
    prepared, all of them — replacing this driver's earlier ones for the same devices (an entry of a share the
    claim no longer holds, another ``shareID`` of the same device, included: left by an earlier allocation whose
    unprepare never reported), keeping everything else; None when nothing changes (entries already there keep
    their ``lastTransitionTime``).

    ``TooManyDeviceStatuses`` when the result would hold more than ``MAX_DEVICE_STATUSES`` entries (the API server
    would refuse it): nothing is dropped to make room, neither this report's entries (the claim would lack the
    devices just prepared, unsaid) nor another writer's (the list is shared; they are not ours to delete)."""
    existing = _existing(claim)
    generation = _generation(claim)
    wanted = {(driver, s.pool, s.device, s.share_id or None): entry(driver, s, node, now, generation) for s in statuses}
    reported = {(s.pool, s.device) for s in statuses}
    kept = [
        item
        for item in existing
        if _key(item) not in wanted and not (item.get("driver") == driver and _key(item)[1:3] in reported)
    ]
    present = {_key(item): item for item in existing if _key(item) in wanted}
    for key, new in wanted.items():
        old = present.get(key)
        if old is not None and _same(old, new):
            wanted[key] = old  # unchanged: the condition's transition time stays what it was
    merged = kept + list(wanted.values())
    if merged == existing:
        return None
    if len(merged) > MAX_DEVICE_STATUSES:
        raise TooManyDeviceStatuses(
            f"status.devices would hold {len(merged)} entries with this driver's {len(wanted)}, more than the "
            f"{MAX_DEVICE_STATUSES} the API server accepts; not written (no entry is dropped to make room)"
        )
    return merged


def without_ours(
    claim: Mapping[str, Any], driver: str, pool: str, devices: Sequence[str]
) -> list[dict[str, Any]] | None:
    """The claim's ``status.devices`` without this driver's entries for ``devices`` of ``pool``; None when it holds
    none of them."""
    existing = _existing(claim)
    names = set(devices)
    kept = [
        i for i in existing if not (i.get("driver") == driver and i.get("pool") == pool and i.get("device") in names)
    ]
    return None if len(kept) == len(existing) else kept


def _same(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """The same report but for the condition's transition time."""

    def stripped(item: Mapping[str, Any]) -> dict[str, Any]:
        conditions = [
            {k: v for k, v in c.items() if k != "lastTransitionTime"}
            for c in item.get("conditions") or []
            if isinstance(c, Mapping)
        ]
        return {**item, "conditions": conditions}

    return stripped(old) == stripped(new)


def _existing(claim: Mapping[str, Any]) -> list[dict[str, Any]]:
    status = claim.get("status")
    devices = status.get("devices") if isinstance(status, Mapping) else None
    return [dict(item) for item in devices if isinstance(item, Mapping)] if isinstance(devices, list) else []


def _generation(claim: Mapping[str, Any]) -> int | None:
    metadata = claim.get("metadata")
    generation = metadata.get("generation") if isinstance(metadata, Mapping) else None
    return generation if isinstance(generation, int) and not isinstance(generation, bool) else None
