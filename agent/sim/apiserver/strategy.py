"""What the API server does to an object before it validates and stores it (``rest.BeforeCreate`` /
``BeforeUpdate`` and each kind's ``PrepareForCreate`` / ``PrepareForUpdate`` and defaulting).

* Create: ``generateName`` → name plus 5 random characters (prefix cut to 58); uid, creationTimestamp,
  generation 1; a cluster-scoped object loses ``metadata.namespace``; a resourceVersion in the body is an error (as
  in etcd3's ``Create``); ResourceClaim status is cleared.
* Update: uid (when absent), creationTimestamp, deletion fields and generation come from the stored object;
  generation is bumped when ``spec`` changed. On a kind with a status subresource, the main resource keeps the
  stored status and ``/status`` keeps the stored spec and metadata (``ResetObjectMetaForStatus``).
* Quantities are stored in canonical form (``quantity.canonical``: ``"81920Mi"`` → ``"80Gi"``).
* Defaults: ResourceClaim requests get ``allocationMode: ExactCount`` and ``count: 1``, tolerations
  ``operator: Equal``; device taints without ``timeAdded`` get the current time.
* Fields of a feature gate that is off are dropped (``dropDisabledFields``), unless the stored object already
  uses them: with DRAConsumableCapacity off, ResourceSlice devices lose ``allowMultipleAllocations`` and their
  capacities' ``requestPolicy``, and claim requests their ``capacity``; with DRAPartitionableDevices off, slices
  lose ``sharedCounters`` and devices ``consumesCounters`` (the gates of facts ``dra.md`` B1, B4).
"""

from __future__ import annotations

import copy
import secrets
import uuid
from datetime import UTC, datetime

from agent.sim.apiserver import quantity
from agent.sim.apiserver.errors import ApiError, bad_request
from agent.sim.apiserver.kinds import NODE, RESOURCE_CLAIM, RESOURCE_SLICE, Kind

_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # k8s.io/apimachinery/pkg/util/rand: no vowels, no confusable digits
_MAX_GENERATED_PREFIX = 58  # 63 - 5 random characters
_SERVER_META = ("uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "generation")


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def generate_name(prefix: str) -> str:
    return prefix[:_MAX_GENERATED_PREFIX] + "".join(secrets.choice(_NAME_CHARS) for _ in range(5))


def check_body(kind: Kind, body: object, namespace: str | None, name: str | None = None) -> dict:
    """The request body is an object of this kind, in this namespace (and, for PUT, of this name)."""
    if not isinstance(body, dict):
        raise bad_request(f"the body of the request must be a JSON object of kind {kind.kind}")
    api_version = body.get("apiVersion")
    if api_version not in (None, "", kind.api_version):
        raise bad_request(
            f"the API version in the data ({api_version}) does not match the expected API version ({kind.api_version})"
        )
    if body.get("kind") not in (None, "", kind.kind):
        raise bad_request(f"the kind in the data ({body.get('kind')}) does not match the expected kind ({kind.kind})")
    meta = body.get("metadata")
    if meta is not None and not isinstance(meta, dict):
        raise bad_request("metadata must be an object")
    meta = meta or {}
    if kind.namespaced and namespace and meta.get("namespace") not in (None, "", namespace):
        raise bad_request("the namespace of the provided object does not match the namespace sent on the request")
    if name is not None and meta.get("name") not in (None, "", name):
        raise bad_request(f"the name of the object ({meta.get('name')}) does not match the name on the URL ({name})")
    return body


CONSUMABLE_CAPACITY = "DRAConsumableCapacity"
PARTITIONABLE_DEVICES = "DRAPartitionableDevices"
GATES = (CONSUMABLE_CAPACITY, PARTITIONABLE_DEVICES)  # the gates whose fields the stand-in can drop


def prepare_create(
    kind: Kind, namespace: str | None, body: dict, *, keep_status: bool = False, disabled: frozenset[str] = frozenset()
) -> dict:
    obj = copy.deepcopy(body)
    obj["apiVersion"], obj["kind"] = kind.api_version, kind.kind
    meta = obj.setdefault("metadata", {})
    if meta.get("resourceVersion"):
        raise ApiError(500, "resourceVersion should not be set on objects to be created")
    if kind.namespaced:
        meta["namespace"] = namespace or meta.get("namespace") or "default"
    else:
        meta.pop("namespace", None)
    if not meta.get("name") and meta.get("generateName"):
        meta["name"] = generate_name(meta["generateName"])
    for field in ("deletionTimestamp", "deletionGracePeriodSeconds", "selfLink", "managedFields"):
        meta.pop(field, None)
    meta["uid"] = str(uuid.uuid4())
    meta["creationTimestamp"] = now()
    meta["generation"] = 1
    if kind.status and not keep_status:
        obj.pop("status", None)
    drop_disabled_fields(kind, obj, None, disabled)
    _defaults(kind, obj, None)
    return obj


def prepare_update(
    kind: Kind, body: dict, old: dict, subresource: str | None, *, disabled: frozenset[str] = frozenset()
) -> dict:
    obj = copy.deepcopy(body)
    obj["apiVersion"], obj["kind"] = kind.api_version, kind.kind
    meta = obj.setdefault("metadata", {})
    old_meta = old["metadata"]
    meta.setdefault("name", old_meta["name"])
    if kind.namespaced:
        meta.setdefault("namespace", old_meta.get("namespace"))
    if subresource == "status":
        obj["metadata"] = {**copy.deepcopy(old_meta), "resourceVersion": meta.get("resourceVersion")}
        meta = obj["metadata"]
        if "spec" in old:
            obj["spec"] = copy.deepcopy(old["spec"])
        else:
            obj.pop("spec", None)
    else:
        if kind.status:
            if "status" in old:
                obj["status"] = copy.deepcopy(old["status"])
            else:
                obj.pop("status", None)
        meta.setdefault("uid", old_meta.get("uid"))
        for field in _SERVER_META[1:]:
            if field in old_meta:
                meta[field] = old_meta[field]
            else:
                meta.pop(field, None)
        meta.pop("managedFields", None)
    drop_disabled_fields(kind, obj, old, disabled)
    _defaults(kind, obj, old)
    if kind.has_spec and obj.get("spec") != old.get("spec"):
        meta["generation"] = int(old_meta.get("generation") or 0) + 1
    return obj


def drop_disabled_fields(kind: Kind, obj: dict, old: dict | None, disabled: frozenset[str]) -> None:
    """The fields of the ``disabled`` gates, dropped unless ``old`` (the stored object) already uses them."""
    if not disabled:
        return
    spec, old_spec = obj.get("spec") or {}, (old or {}).get("spec") or {}
    if kind is RESOURCE_SLICE:
        devices = spec.get("devices") or []
        if CONSUMABLE_CAPACITY in disabled and not _uses_consumable_capacity(old_spec):
            for device in devices:
                device.pop("allowMultipleAllocations", None)
                for capacity in (device.get("capacity") or {}).values():
                    if isinstance(capacity, dict):
                        capacity.pop("requestPolicy", None)
        if PARTITIONABLE_DEVICES in disabled and not _uses_counters(old_spec):
            spec.pop("sharedCounters", None)
            for device in devices:
                device.pop("consumesCounters", None)
    elif kind is RESOURCE_CLAIM and CONSUMABLE_CAPACITY in disabled and "status" not in (old or {}):
        for request in (spec.get("devices") or {}).get("requests") or []:
            for alternative in [request.get("exactly") or {}, *(request.get("firstAvailable") or [])]:
                alternative.pop("capacity", None)


def _uses_counters(spec: dict) -> bool:
    return bool(spec.get("sharedCounters")) or any(d.get("consumesCounters") for d in spec.get("devices") or [])


def _uses_consumable_capacity(spec: dict) -> bool:
    return any(
        d.get("allowMultipleAllocations")
        or any(isinstance(c, dict) and c.get("requestPolicy") for c in (d.get("capacity") or {}).values())
        for d in spec.get("devices") or []
    )


def _defaults(kind: Kind, obj: dict, old: dict | None) -> None:
    _canonical_quantities(kind, obj)
    if kind is RESOURCE_CLAIM:
        for request in ((obj.get("spec") or {}).get("devices") or {}).get("requests") or []:
            if isinstance(request, dict):
                if isinstance(request.get("exactly"), dict):
                    _default_request(request["exactly"])
                for sub in request.get("firstAvailable") or []:
                    if isinstance(sub, dict):
                        _default_request(sub)
    elif kind is RESOURCE_SLICE:
        stamp = now()
        old_taints = {}
        for device in ((old or {}).get("spec") or {}).get("devices") or []:
            for taint in device.get("taints") or []:
                old_taints[(device.get("name"), taint.get("key"), taint.get("effect"))] = taint.get("timeAdded")
        for device in (obj.get("spec") or {}).get("devices") or []:
            if not isinstance(device, dict):
                continue
            for taint in device.get("taints") or []:
                if isinstance(taint, dict) and not taint.get("timeAdded"):
                    key = (device.get("name"), taint.get("key"), taint.get("effect"))
                    taint["timeAdded"] = old_taints.get(key) or stamp


def _canonical_quantities(kind: Kind, obj: dict) -> None:
    """Quantities as the server stores them (``quantity.canonical``)."""
    spec = obj.get("spec") if isinstance(obj.get("spec"), dict) else {}
    if kind is RESOURCE_SLICE:
        for device in spec.get("devices") or []:
            if not isinstance(device, dict):
                continue
            quantity.canonicalize_map(device.get("capacity"))
            for consumption in device.get("consumesCounters") or []:
                if isinstance(consumption, dict):
                    quantity.canonicalize_map(consumption.get("counters"))
        for counter_set in spec.get("sharedCounters") or []:
            if isinstance(counter_set, dict):
                quantity.canonicalize_map(counter_set.get("counters"))
    elif kind is NODE and isinstance(obj.get("status"), dict):
        quantity.canonicalize_plain(obj["status"].get("capacity"))
        quantity.canonicalize_plain(obj["status"].get("allocatable"))
    elif kind is RESOURCE_CLAIM:
        for request in (spec.get("devices") or {}).get("requests") or []:
            if isinstance(request, dict):
                for sub in [request.get("exactly"), *(request.get("firstAvailable") or [])]:
                    if isinstance(sub, dict) and isinstance(sub.get("capacity"), dict):
                        quantity.canonicalize_plain(sub["capacity"].get("requests"))


def _default_request(request: dict) -> None:
    request.setdefault("allocationMode", "ExactCount")
    if request["allocationMode"] == "ExactCount":
        request.setdefault("count", 1)
    for toleration in request.get("tolerations") or []:
        if isinstance(toleration, dict):
            toleration.setdefault("operator", "Equal")


def same_object(a: dict, b: dict) -> bool:
    """Equal apart from resourceVersion: such an update is a no-op (no new resourceVersion, no event)."""
    strip = ("resourceVersion",)
    return {**a, "metadata": {k: v for k, v in a["metadata"].items() if k not in strip}} == {
        **b,
        "metadata": {k: v for k, v in b["metadata"].items() if k not in strip},
    }
