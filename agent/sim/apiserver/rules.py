"""The semantic checks the OpenAPI schema cannot express, as the API server's ``pkg/apis/resource/validation`` does
them, for the Kubernetes version the stand-in reports (its ``/version``).

Sources: /work/shared/facts/dra.md B1-B3 (limits by version, name rules, exactly-one rules) and the upstream
validation code (field paths and wording). Versions matter where the limits changed in 1.35: devices per slice
(128; 64 when a device has taints or consumesCounters, and from 1.36 list attributes), taints per device (4 → 16),
the ``None`` taint effect, counter sets, and "only one of ``sharedCounters`` or ``devices``" (1.34 allows both in one
slice). Immutable on update: ResourceSlice ``spec.driver``, ``spec.nodeName`` and ``spec.pool.name`` (dra.md names
the first two; the upstream ``validateResourceSliceSpec`` also pins the pool name); ResourceClaim ``spec``; a set
``status.allocation``. CEL expressions are checked for presence and length only (no CEL compiler here).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from agent.sim.apiserver import quantity as quantities
from agent.sim.apiserver.errors import (
    FieldError,
    duplicate,
    forbidden,
    immutable,
    invalid_value,
    not_supported,
    required,
    too_long,
    too_many,
)
from agent.sim.apiserver.kinds import DEVICE_CLASS, RESOURCE_CLAIM, RESOURCE_SLICE, Kind

Version = tuple[int, int]
Errors = list[FieldError]

_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_LABEL = re.compile(_LABEL)
_DNS_SUBDOMAIN = re.compile(rf"{_LABEL}(\.{_LABEL})*")
_C_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NAME_PART = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_SEMVER = re.compile(
    r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(-(0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*)(\.(0|[1-9]\d*|\d*[a-zA-Z-][0-9a-zA-Z-]*))*)?"
    r"(\+[0-9a-zA-Z-]+(\.[0-9a-zA-Z-]+)*)?"
)

DRIVER_NAME_MAX = 63
POOL_NAME_MAX = 253
ATTRIBUTE_VALUE_MAX = 64  # DeviceAttributeMaxValueLength
C_IDENTIFIER_MAX = 32  # DeviceMaxIDLength
ATTRIBUTES_AND_CAPACITIES_MAX = 32
ATTRIBUTE_VALUES_MAX = 48  # 1.36+: attribute values, list items included
SLICE_MAX_DEVICES = 128
SLICE_MAX_DEVICES_ADVANCED = 64  # 1.35+: with taints, consumesCounters (1.36+: or list attributes)
BINDING_CONDITIONS_MAX = 4
REQUESTS_MAX = 32
SUBREQUESTS_MAX = 8
SELECTORS_MAX = 32
CONSTRAINTS_MAX = 32
CONFIG_MAX = 32
CEL_MAX_LENGTH = 10 * 1024
OPAQUE_PARAMETERS_MAX = 10 * 1024
RESULTS_MAX = 32
RESERVED_FOR_MAX = 256
ANNOTATIONS_MAX_BYTES = 256 * 1024

_DNS_LABEL_MSG = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end "
    "with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
)
_DNS_SUBDOMAIN_MSG = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start "
    "and end with an alphanumeric character (e.g. 'example.com', regex used for validation is "
    r"'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)
_C_IDENTIFIER_MSG = (
    "a valid C identifier must start with alphabetic character or '_', followed by a string of alphanumeric "
    "characters or '_' (e.g. 'my_name',  or 'MY_NAME',  or 'MyName', regex used for validation is "
    "'[A-Za-z_][A-Za-z0-9_]*')"
)
_NAME_PART_MSG = (
    "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an "
    "alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is "
    "'([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')"
)


# --------------------------------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------------------------------


def dns_label(value: object, path: str) -> Errors:
    if not isinstance(value, str) or not value:
        return [required(path)]
    errs: Errors = []
    if len(value) > 63:
        errs.append(invalid_value(path, value, "must be no more than 63 characters"))
    if not _DNS_LABEL.fullmatch(value):
        errs.append(invalid_value(path, value, _DNS_LABEL_MSG))
    return errs


def dns_subdomain(value: object, path: str) -> Errors:
    if not isinstance(value, str) or not value:
        return [required(path)]
    errs: Errors = []
    if len(value) > 253:
        errs.append(invalid_value(path, value, "must be no more than 253 characters"))
    if not _DNS_SUBDOMAIN.fullmatch(value):
        errs.append(invalid_value(path, value, _DNS_SUBDOMAIN_MSG))
    return errs


def driver_name(value: object, path: str) -> Errors:
    """``ValidateCSIDriverName``: at most 63 characters, a DNS subdomain (case-insensitive)."""
    if not isinstance(value, str) or not value:
        return [required(path)]
    errs: Errors = []
    if len(value) > DRIVER_NAME_MAX:
        errs.append(too_long(path, DRIVER_NAME_MAX))
    if not _DNS_SUBDOMAIN.fullmatch(value.lower()):
        errs.append(invalid_value(path, value, _DNS_SUBDOMAIN_MSG))
    return errs


def pool_name(value: object, path: str) -> Errors:
    if not isinstance(value, str) or not value:
        return [required(path)]
    errs: Errors = []
    if len(value) > POOL_NAME_MAX:
        errs.append(too_long(path, POOL_NAME_MAX))
    for part in value.split("/"):
        errs += dns_subdomain(part, path) if part else [invalid_value(path, value, _DNS_SUBDOMAIN_MSG)]
    return errs


def c_identifier(value: str, path: str) -> Errors:
    errs: Errors = []
    if len(value) > C_IDENTIFIER_MAX:
        errs.append(too_long(path, C_IDENTIFIER_MAX))
    if not _C_IDENTIFIER.fullmatch(value):
        errs.append(invalid_value(path, value, _C_IDENTIFIER_MSG))
    return errs


def qualified_name(name: str, path: str) -> Errors:
    """A device attribute or capacity name: a C identifier, or ``<DNS subdomain>/<C identifier>``."""
    parts = name.split("/")
    if len(parts) == 1:
        return c_identifier(parts[0], path)
    errs: Errors = []
    domain, ident = parts[0], parts[-1]
    if len(parts) > 2:
        errs.append(invalid_value(path, name, "must be a C identifier or <domain>/<C identifier>"))
    errs += driver_name(domain, path) if domain else [invalid_value(path, "", "the domain must not be empty")]
    errs += c_identifier(ident, path) if ident else [invalid_value(path, "", "the name must not be empty")]
    return errs


def label_key(key: object, path: str) -> Errors:
    """``IsQualifiedName``: ``[prefix/]name``, name at most 63 characters, prefix a DNS subdomain."""
    if not isinstance(key, str) or not key:
        return [invalid_value(path, key, "name part must be non-empty")]
    parts = key.split("/")
    if len(parts) > 2:
        return [invalid_value(path, key, "a qualified name must consist of a name part and an optional prefix")]
    errs: Errors = []
    name = parts[-1]
    if len(parts) == 2:
        prefix = parts[0]
        if not prefix:
            errs.append(invalid_value(path, key, "prefix part must be non-empty"))
        else:
            errs += [invalid_value(path, key, "prefix part " + e.detail) for e in dns_subdomain(prefix, path)]
    if not name:
        errs.append(invalid_value(path, key, "name part must be non-empty"))
    elif len(name) > 63:
        errs.append(invalid_value(path, key, "name part must be no more than 63 characters"))
    elif not _NAME_PART.fullmatch(name):
        errs.append(invalid_value(path, key, _NAME_PART_MSG))
    return errs


def label_value(value: object, path: str) -> Errors:
    if not isinstance(value, str):
        return [invalid_value(path, value, "must be a string")]
    errs: Errors = []
    if len(value) > 63:
        errs.append(invalid_value(path, value, "must be no more than 63 characters"))
    if not _LABEL_VALUE.fullmatch(value):
        errs.append(
            invalid_value(
                path,
                value,
                "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', "
                "and must start and end with an alphanumeric character",
            )
        )
    return errs


def quantity(value: object, path: str) -> Errors:
    try:
        quantities.parse(value)
    except ValueError as e:
        return [invalid_value(path, value, str(e).split(": ")[0])]
    return []


def _items(value: object) -> list:
    return value if isinstance(value, list) else []


def _map(value: object) -> dict:
    return value if isinstance(value, dict) else {}


def _limited(items: list, limit: int, path: str) -> Errors:
    """validateSlice's size check, which short-circuits the item checks when it fails."""
    return [too_many(path, len(items), limit)] if len(items) > limit else []


def _unique(items: list, key: Callable[[object], object], path: str) -> Errors:
    seen: set = set()
    errs: Errors = []
    for i, item in enumerate(items):
        k = key(item)
        if k in seen:
            errs.append(duplicate(f"{path}[{i}]", k))
        seen.add(k)
    return errs


# --------------------------------------------------------------------------------------------------
# Metadata (corevalidation.ValidateObjectMeta, the parts that matter here)
# --------------------------------------------------------------------------------------------------


def metadata(kind: Kind, obj: dict) -> Errors:
    meta = _map(obj.get("metadata"))
    errs: Errors = []
    if not meta.get("name"):
        errs.append(required("metadata.name", "name or generateName is required"))
    else:
        errs += dns_subdomain(meta["name"], "metadata.name")
    if kind.namespaced:
        errs += dns_label(meta.get("namespace"), "metadata.namespace")
    for key, value in _map(meta.get("labels")).items():
        errs += label_key(key, "metadata.labels")
        errs += label_value(value, f"metadata.labels[{key}]") if isinstance(value, str) else []
    annotations = _map(meta.get("annotations"))
    for key in annotations:
        errs += label_key(key.lower() if isinstance(key, str) else key, "metadata.annotations")
    if sum(len(k) + len(str(v)) for k, v in annotations.items()) > ANNOTATIONS_MAX_BYTES:
        errs.append(too_long("metadata.annotations", ANNOTATIONS_MAX_BYTES))
    controllers = []
    for i, ref in enumerate(_items(meta.get("ownerReferences"))):
        path = f"metadata.ownerReferences[{i}]"
        for field in ("apiVersion", "kind", "name", "uid"):
            if not _map(ref).get(field):
                errs.append(required(f"{path}.{field}", f"{field} must not be empty"))
        if _map(ref).get("controller"):
            controllers.append(str(_map(ref).get("name")))
    if len(controllers) > 1:
        errs.append(
            invalid_value(
                "metadata.ownerReferences",
                meta.get("ownerReferences"),
                'Only one reference can have Controller set to true. Found "true" in references for '
                + " and ".join(controllers),
            )
        )
    for i, finalizer in enumerate(_items(meta.get("finalizers"))):
        errs += label_key(finalizer, f"metadata.finalizers[{i}]")
    return errs


def metadata_update(new: dict, old: dict) -> Errors:
    errs: Errors = []
    for field in ("name", "namespace", "uid"):
        if new["metadata"].get(field) != old["metadata"].get(field):
            errs.append(immutable(f"metadata.{field}", new["metadata"].get(field)))
    return errs


# --------------------------------------------------------------------------------------------------
# ResourceSlice (B1)
# --------------------------------------------------------------------------------------------------

_ATTRIBUTE_SCALARS = ("bool", "int", "string", "version")
_ATTRIBUTE_LISTS = ("bools", "ints", "strings", "versions")  # DRAListTypeAttributes, 1.36+


def _taint_effects(version: Version) -> list[str]:
    return ["NoExecute", "NoSchedule", "None"] if version >= (1, 35) else ["NoExecute", "NoSchedule"]


def _string_value(kind: str, value: object, path: str) -> Errors:
    errs: Errors = []
    if kind.startswith("version") and isinstance(value, str) and not _SEMVER.fullmatch(value):
        errs.append(invalid_value(path, value, "must be a string compatible with semver.org spec 2.0.0"))
    if isinstance(value, str) and len(value) > ATTRIBUTE_VALUE_MAX:
        errs.append(too_long(path, ATTRIBUTE_VALUE_MAX))
    return errs


def device_attribute(attribute: object, path: str, version: Version) -> tuple[Errors, int]:
    """Errors, and how many values the attribute holds (list items count one each)."""
    attribute = _map(attribute)
    forms = _ATTRIBUTE_SCALARS + (_ATTRIBUTE_LISTS if version >= (1, 36) else ())
    present = [f for f in forms if attribute.get(f) is not None]
    errs: Errors = []
    values = 0
    for form in present:
        if form in ("string", "version"):
            errs += _string_value(form, attribute[form], f"{path}.{form}")
        if form in _ATTRIBUTE_LISTS:
            for i, item in enumerate(_items(attribute[form])):
                errs += _string_value(form, item, f"{path}.{form}[{i}]") if form in ("strings", "versions") else []
            values += len(_items(attribute[form]))
        else:
            values += 1
    if not present:
        errs.append(invalid_value(path, "", "exactly one value must be specified"))
    elif len(present) > 1:
        errs.append(invalid_value(path, attribute, "exactly one value must be specified"))
    return errs, values


def _uses_lists(device: dict) -> bool:
    return any(_map(a).get(f) is not None for a in _map(device.get("attributes")).values() for f in _ATTRIBUTE_LISTS)


def resource_slice(obj: dict, old: dict | None, version: Version) -> Errors:
    spec = _map(obj.get("spec"))
    errs: Errors = []
    errs += driver_name(spec.get("driver"), "spec.driver")
    pool = _map(spec.get("pool"))
    errs += pool_name(pool.get("name"), "spec.pool.name")
    count, generation = pool.get("resourceSliceCount"), pool.get("generation")
    if not isinstance(count, int) or count <= 0:
        errs.append(invalid_value("spec.pool.resourceSliceCount", count, "must be greater than zero"))
    if not isinstance(generation, int) or generation < 0:
        errs.append(invalid_value("spec.pool.generation", generation, "must be greater than or equal to zero"))
    if old is not None:
        old_spec = _map(old.get("spec"))
        if pool.get("name") != _map(old_spec.get("pool")).get("name"):
            errs.append(immutable("spec.pool.name", pool.get("name")))
        for field in ("driver", "nodeName"):
            if (spec.get(field) or "") != (old_spec.get(field) or ""):
                errs.append(immutable(f"spec.{field}", spec.get(field)))
    errs += _node_fields(spec, "spec", "`nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection`")
    if version >= (1, 35) and spec.get("sharedCounters") is not None and spec.get("devices") is not None:
        errs.append(invalid_value("spec", "", "only one of `sharedCounters` or `devices` is allowed"))

    devices = _items(spec.get("devices"))
    advanced = any(_items(_map(d).get("taints")) or _items(_map(d).get("consumesCounters")) for d in devices)
    if version >= (1, 36):
        advanced = advanced or any(_uses_lists(_map(d)) for d in devices)
    limit = SLICE_MAX_DEVICES_ADVANCED if advanced and version >= (1, 35) else SLICE_MAX_DEVICES
    size = _limited(devices, limit, "spec.devices")
    if size:
        errs += size
    else:
        for i, device in enumerate(devices):
            errs += _device(_map(device), f"spec.devices[{i}]", bool(spec.get("perDeviceNodeSelection")), version)
        errs += _unique(devices, lambda d: _map(d).get("name"), "spec.devices")
    errs += _shared_counters(spec, devices, version)
    return errs


def _node_fields(spec: dict, path: str, names: str) -> Errors:
    errs: Errors = []
    set_fields = []
    if spec.get("nodeName") is not None:
        if spec["nodeName"]:
            set_fields.append("`nodeName`")
            errs += dns_subdomain(spec["nodeName"], f"{path}.nodeName")
        else:
            errs.append(invalid_value(f"{path}.nodeName", "", "must be either unset or set to a non-empty string"))
    if spec.get("nodeSelector") is not None:
        set_fields.append("`nodeSelector`")
        terms = _items(_map(spec["nodeSelector"]).get("nodeSelectorTerms"))
        if path == "spec" and len(terms) != 1:
            errs.append(
                invalid_value(
                    f"{path}.nodeSelector.nodeSelectorTerms", terms, "must have exactly one node selector term"
                )
            )
    for field in ("allNodes", "perDeviceNodeSelection") if path == "spec" else ("allNodes",):
        if spec.get(field) is True:
            set_fields.append(f"`{field}`")
        elif spec.get(field) is not None:
            errs.append(invalid_value(f"{path}.{field}", spec[field], "must be either unset or set to true"))
    if not set_fields:
        errs.append(required(path, f"exactly one of {names} is required"))
    elif len(set_fields) > 1:
        errs.append(
            invalid_value(
                path,
                "{" + ", ".join(set_fields) + "}",
                f"exactly one of {names} is required, but multiple fields are set",
            )
        )
    return errs


def _device(device: dict, path: str, per_device_nodes: bool, version: Version) -> Errors:
    errs = dns_label(device.get("name"), f"{path}.name")
    attributes, capacity = _map(device.get("attributes")), _map(device.get("capacity"))
    if len(attributes) + len(capacity) > ATTRIBUTES_AND_CAPACITIES_MAX:
        errs.append(
            invalid_value(
                path,
                len(attributes) + len(capacity),
                f"the total number of attributes and capacities must not exceed {ATTRIBUTES_AND_CAPACITIES_MAX}",
            )
        )
    values = 0
    for name, attribute in attributes.items():
        errs += qualified_name(name, f"{path}.attributes[{name}]")
        attribute_errs, n = device_attribute(attribute, f"{path}.attributes[{name}]", version)
        errs += attribute_errs
        values += n
    if version >= (1, 36) and values > ATTRIBUTE_VALUES_MAX:
        errs.append(
            invalid_value(
                f"{path}.attributes",
                values,
                f"the total number of attribute values must not exceed {ATTRIBUTE_VALUES_MAX}",
            )
        )
    multiple = device.get("allowMultipleAllocations") is True
    for name, cap in capacity.items():
        errs += qualified_name(name, f"{path}.capacity[{name}]")
        errs += quantity(_map(cap).get("value"), f"{path}.capacity[{name}].value")
        if _map(cap).get("requestPolicy") is not None and not multiple:
            errs.append(forbidden(f"{path}.capacity[{name}].requestPolicy", "allowMultipleAllocations must be true"))
    taints = _items(device.get("taints"))
    taint_limit = 16 if version >= (1, 35) else 4
    errs += _limited(taints, taint_limit, f"{path}.taints") or [
        e for i, t in enumerate(taints) for e in _taint(_map(t), f"{path}.taints[{i}]", version)
    ]
    errs += _consumes_counters(device, path, version)
    if per_device_nodes:
        errs += _node_fields(device, path, "`nodeName`, `nodeSelector`, or `allNodes`")
    elif any(device.get(f) is not None for f in ("nodeName", "nodeSelector", "allNodes")):
        errs.append(
            invalid_value(
                path,
                None,
                "`nodeName`, `nodeSelector` and `allNodes` can only be set if `perDeviceNodeSelection` is set to "
                "true in the ResourceSlice spec",
            )
        )
    for field in ("bindingConditions", "bindingFailureConditions"):
        errs += _limited(_items(device.get(field)), BINDING_CONDITIONS_MAX, f"{path}.{field}")
    return errs


def _taint(taint: dict, path: str, version: Version) -> Errors:
    errs = label_key(taint.get("key"), f"{path}.key")
    if taint.get("value"):
        errs += label_value(taint["value"], f"{path}.value")
    effects = _taint_effects(version)
    if not taint.get("effect"):
        errs.append(required(f"{path}.effect"))
    elif taint["effect"] not in effects:
        errs.append(not_supported(f"{path}.effect", taint["effect"], effects))
    return errs


def _consumes_counters(device: dict, path: str, version: Version) -> Errors:
    consumptions = _items(device.get("consumesCounters"))
    path = f"{path}.consumesCounters"
    if version >= (1, 35):
        errs = _limited(consumptions, 2, path)
        if errs:
            return errs
        errs += _unique(consumptions, lambda c: _map(c).get("counterSet"), path)
    else:
        errs = []
        total = sum(len(_map(_map(c).get("counters"))) for c in consumptions)
        if total > 32:
            errs.append(too_many(path, total, 32))
    for i, consumption in enumerate(consumptions):
        consumption = _map(consumption)
        errs += dns_label(consumption.get("counterSet"), f"{path}[{i}].counterSet")
        counters = _map(consumption.get("counters"))
        if not counters:
            errs.append(required(f"{path}[{i}].counters"))
        elif len(counters) > 32:
            errs.append(too_many(f"{path}[{i}].counters", len(counters), 32))
        for name, counter in counters.items():
            errs += dns_label(name, f"{path}[{i}].counters[{name}]")
            errs += quantity(_map(counter).get("value"), f"{path}[{i}].counters[{name}].value")
    return errs


def _shared_counters(spec: dict, devices: list, version: Version) -> Errors:
    sets = _items(spec.get("sharedCounters"))
    errs: Errors = []
    if version >= (1, 35):
        size = _limited(sets, 8, "spec.sharedCounters")
        if size:
            return size
    else:
        total = sum(len(_map(_map(s).get("counters"))) for s in sets)
        if total > 32:
            errs.append(too_many("spec.sharedCounters", total, 32))
        consumed = sum(
            len(_map(_map(c).get("counters"))) for d in devices for c in _items(_map(d).get("consumesCounters"))
        )
        if consumed > 1024:
            errs.append(too_many("spec.devices", consumed, 1024))
    for i, counter_set in enumerate(sets):
        counter_set = _map(counter_set)
        errs += dns_label(counter_set.get("name"), f"spec.sharedCounters[{i}].name")
        counters = _map(counter_set.get("counters"))
        if not counters:
            errs.append(required(f"spec.sharedCounters[{i}].counters"))
        elif len(counters) > 32:
            errs.append(too_many(f"spec.sharedCounters[{i}].counters", len(counters), 32))
        for name, counter in counters.items():
            errs += dns_label(name, f"spec.sharedCounters[{i}].counters[{name}]")
            errs += quantity(_map(counter).get("value"), f"spec.sharedCounters[{i}].counters[{name}].value")
    errs += _unique(sets, lambda s: _map(s).get("name"), "spec.sharedCounters")
    return errs


# --------------------------------------------------------------------------------------------------
# ResourceClaim (B2) and DeviceClass (B3)
# --------------------------------------------------------------------------------------------------


def _selectors(selectors: list, path: str) -> Errors:
    errs = _limited(selectors, SELECTORS_MAX, path)
    if errs:
        return errs
    for i, selector in enumerate(selectors):
        cel = _map(selector).get("cel")
        if cel is None:
            errs.append(required(f"{path}[{i}].cel"))
            continue
        expression = _map(cel).get("expression")
        if not expression:
            errs.append(required(f"{path}[{i}].cel.expression"))
        elif len(expression) > CEL_MAX_LENGTH:
            errs.append(too_long(f"{path}[{i}].cel.expression", CEL_MAX_LENGTH))
    return errs


def _opaque(config: dict, path: str) -> Errors:
    opaque = config.get("opaque")
    if opaque is None:
        return [required(f"{path}.opaque")]
    errs = driver_name(_map(opaque).get("driver"), f"{path}.opaque.driver")
    parameters = _map(opaque).get("parameters")
    if parameters is None:
        errs.append(required(f"{path}.opaque.parameters"))
    elif not isinstance(parameters, dict):
        errs.append(invalid_value(f"{path}.opaque.parameters", "<value omitted>", "must be a valid JSON object"))
    elif len(json.dumps(parameters, separators=(",", ":"))) > OPAQUE_PARAMETERS_MAX:
        errs.append(too_long(f"{path}.opaque.parameters", OPAQUE_PARAMETERS_MAX))
    return errs


def _exact_request(request: dict, path: str) -> Errors:
    errs = dns_subdomain(request.get("deviceClassName"), f"{path}.deviceClassName")
    errs += _selectors(_items(request.get("selectors")), f"{path}.selectors")
    mode = request.get("allocationMode")
    if mode == "ExactCount":
        count = request.get("count")
        if not isinstance(count, int) or count <= 0:
            errs.append(invalid_value(f"{path}.count", count, "must be greater than zero"))
    elif mode == "All":
        if request.get("count") not in (None, 0):
            errs.append(
                invalid_value(f"{path}.count", request["count"], "must not be specified when allocationMode is 'All'")
            )
    else:
        errs.append(not_supported(f"{path}.allocationMode", mode, ["All", "ExactCount"]))
    return errs


def _request_names(spec: dict) -> set[str]:
    names = set()
    for request in _items(_map(spec.get("devices")).get("requests")):
        request = _map(request)
        names.add(request.get("name"))
        for sub in _items(request.get("firstAvailable")):
            names.add(f"{request.get('name')}/{_map(sub).get('name')}")
    return names


def claim_spec(spec: dict) -> Errors:
    devices = _map(spec.get("devices"))
    requests = _items(devices.get("requests"))
    errs = _limited(requests, REQUESTS_MAX, "spec.devices.requests")
    main_names = {_map(r).get("name") for r in requests}
    for i, request in enumerate(requests if not errs else []):
        request = _map(request)
        path = f"spec.devices.requests[{i}]"
        errs += dns_label(request.get("name"), f"{path}.name")
        exactly, first = request.get("exactly"), request.get("firstAvailable")
        if (exactly is None) == (first is None):
            errs.append(invalid_value(path, None, "exactly one of `exactly` or `firstAvailable` is required"))
        if exactly is not None:
            errs += _exact_request(_map(exactly), f"{path}.exactly")
        if first is not None:
            subs = _items(first)
            errs += _limited(subs, SUBREQUESTS_MAX, f"{path}.firstAvailable")
            for j, sub in enumerate(subs):
                errs += dns_label(_map(sub).get("name"), f"{path}.firstAvailable[{j}].name")
                errs += _exact_request(_map(sub), f"{path}.firstAvailable[{j}]")
            errs += _unique(subs, lambda s: _map(s).get("name"), f"{path}.firstAvailable")
    errs += _unique(requests, lambda r: _map(r).get("name"), "spec.devices.requests")

    def refs(items: list, path: str) -> Errors:
        out: Errors = []
        for k, name in enumerate(items):
            if name not in main_names and name not in _request_names(spec):
                out.append(invalid_value(f"{path}[{k}]", name, "must be the name of a request in the claim"))
        return out

    constraints = _items(devices.get("constraints"))
    errs += _limited(constraints, CONSTRAINTS_MAX, "spec.devices.constraints")
    for i, constraint in enumerate(constraints):
        constraint = _map(constraint)
        errs += refs(_items(constraint.get("requests")), f"spec.devices.constraints[{i}].requests")
        attribute = constraint.get("matchAttribute") or constraint.get("distinctAttribute")
        if not attribute:
            errs.append(required(f"spec.devices.constraints[{i}].matchAttribute"))
        elif "/" not in attribute:
            errs.append(
                invalid_value(
                    f"spec.devices.constraints[{i}].matchAttribute",
                    attribute,
                    "a fully qualified name must be a domain and a name separated by a slash",
                )
            )
    configs = _items(devices.get("config"))
    errs += _limited(configs, CONFIG_MAX, "spec.devices.config")
    for i, config in enumerate(configs):
        errs += refs(_items(_map(config).get("requests")), f"spec.devices.config[{i}].requests")
        errs += _opaque(_map(config), f"spec.devices.config[{i}]")
    return errs


def claim_status(obj: dict, old: dict | None) -> Errors:
    status = _map(obj.get("status"))
    old_status = _map((old or {}).get("status"))
    names = _request_names(_map(obj.get("spec")))
    errs: Errors = []
    reserved = _items(status.get("reservedFor"))
    errs += _limited(reserved, RESERVED_FOR_MAX, "status.reservedFor")
    for i, ref in enumerate(reserved):
        for field in ("resource", "name", "uid"):
            if not _map(ref).get(field):
                errs.append(required(f"status.reservedFor[{i}].{field}"))
    errs += _unique(reserved, lambda r: _map(r).get("uid"), "status.reservedFor")
    allocation = status.get("allocation")
    if reserved and allocation is None:
        errs.append(forbidden("status.reservedFor", "may not be specified when `allocated` is not set"))
    if allocation is not None and old_status.get("allocation") is not None:
        if allocation != old_status["allocation"]:
            errs.append(immutable("status.allocation", "<value omitted>"))
    elif allocation is not None:
        results = _items(_map(_map(allocation).get("devices")).get("results"))
        errs += _limited(results, RESULTS_MAX, "status.allocation.devices.results")
        for i, result in enumerate(results):
            result = _map(result)
            path = f"status.allocation.devices.results[{i}]"
            if result.get("request") not in names:
                errs.append(
                    invalid_value(
                        f"{path}.request", result.get("request"), "must be the name of a request in the claim"
                    )
                )
            errs += driver_name(result.get("driver"), f"{path}.driver")
            errs += pool_name(result.get("pool"), f"{path}.pool")
            errs += dns_label(result.get("device"), f"{path}.device")
        for i, config in enumerate(_items(_map(_map(allocation).get("devices")).get("config"))):
            config = _map(config)
            if config.get("source") not in ("FromClaim", "FromClass"):
                errs.append(
                    not_supported(
                        f"status.allocation.devices.config[{i}].source",
                        config.get("source"),
                        ["FromClaim", "FromClass"],
                    )
                )
            errs += _opaque(config, f"status.allocation.devices.config[{i}]")
    allocated = {
        (_map(r).get("driver"), _map(r).get("pool"), _map(r).get("device"))
        for r in _items(_map(_map(allocation).get("devices")).get("results"))
    }
    for i, device in enumerate(_items(status.get("devices"))):
        device = _map(device)
        ident = (device.get("driver"), device.get("pool"), device.get("device"))
        if ident not in allocated:
            errs.append(
                invalid_value(
                    f"status.devices[{i}]", "/".join(str(p) for p in ident), "must be an allocated device in the claim"
                )
            )
    return errs


def device_class(obj: dict) -> Errors:
    spec = _map(obj.get("spec"))
    errs = _selectors(_items(spec.get("selectors")), "spec.selectors")
    configs = _items(spec.get("config"))
    errs += _limited(configs, CONFIG_MAX, "spec.config")
    for i, config in enumerate(configs):
        errs += _opaque(_map(config), f"spec.config[{i}]")
    name = spec.get("extendedResourceName")
    if name is not None and ("/" not in str(name) or label_key(name, "") or str(name).startswith("requests.")):
        errs.append(invalid_value("spec.extendedResourceName", name, "must be a valid extended resource name"))
    return errs


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------


def check(kind: Kind, obj: dict, old: dict | None, version: Version, subresource: str | None = None) -> Errors:
    """Every semantic error of ``obj`` (``old``: the stored object it replaces, on update)."""
    errs = metadata(kind, obj)
    if old is not None:
        errs += metadata_update(obj, old)
    if kind is RESOURCE_SLICE:
        errs += resource_slice(obj, old, version)
    elif kind is RESOURCE_CLAIM:
        if old is None:
            errs += claim_spec(_map(obj.get("spec")))
            if obj.get("status"):
                errs += claim_status(obj, None)
        elif subresource == "status":
            errs += claim_status(obj, old)
        elif obj.get("spec") != old.get("spec"):
            errs.append(immutable("spec", "<value omitted>"))
    elif kind is DEVICE_CLASS:
        errs += device_class(obj)
    return errs
