"""This node's pool as complete ``resource.k8s.io/v1`` ResourceSlice objects, split at the API's limits.

One pool per node, named after the node (NVIDIA's choice), every slice owned by the Node (``controller: true``)
so that only this node's slices are ever touched and they go away with the Node. ``generateName`` is the Go
helper's (``k8s.io/dynamic-resource-allocation/resourceslice``): ``<index as hex, at least 5 digits>-<driver>-
<node>-``, so the API server's names sort in slice order. The caller owns the pool generation (bump it on every
change); every slice carries it and ``resourceSliceCount``. There is always at least one slice: an empty pool
tells the scheduler the driver runs and has no devices, which is not the same as no pool.

Two layouts (facts ``dra.md`` B1; NVIDIA picks by the API server's version, ``layout_for``):

- ``combined`` — Kubernetes 1.34: a counter set lives in the slice of the devices that consume it. Limits:
  128 devices per slice, at most 32 counters in all the sets of a slice, 32 counters consumed per device and
  1024 in all the devices of a slice, 4 taints per device, taint effects NoSchedule and NoExecute only.
- ``split`` — 1.35 and later: a slice holds devices or counter sets, never both; counter sets go first, in
  slices of their own (at most 8 sets of at most 32 counters each). 128 devices per slice, but 64 when any
  device of the slice has taints or consumes counters; a device consumes from at most 2 sets, at most 32
  counters from each; 16 taints per device; effects None, NoSchedule, NoExecute.

Both: at most 32 attributes and capacities per device; names are C identifiers of at most 32 characters, with
an optional ``<DNS subdomain>/`` prefix of at most 63; string and version values at most 64 characters; a
version is semver 2.0.0; device names are DNS labels, unique in the pool. A device that breaks a rule raises
``SliceError`` naming the device and the rule, before anything is built.

Static MIG has no counters yet: ``counter_sets`` and ``DraDevice.consumes_counters`` are where dynamic MIG's
per-GPU counter sets (``gpu-<minor>-counter-set``) will go.

Deterministic: devices are ordered by GPU minor, then name; counter sets by name (numbers compared as numbers).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

from agent.core.dra.devices import DraDevice, RequestPolicy, attribute_kind
from agent.core.dra.taints import EFFECTS, NONE, DeviceTaint

Layout = Literal["combined", "split"]
COMBINED: Layout = "combined"
SPLIT: Layout = "split"
API_VERSION = "resource.k8s.io/v1"

MAX_DEVICES = 128  # ResourceSliceMaxDevices
MAX_DEVICES_WITH_ADVANCED_FEATURES = 64  # 1.35+: a device with taints or consumesCounters in the slice
MAX_ATTRIBUTES_AND_CAPACITIES = 32
MAX_VALUE_LENGTH = 64  # DeviceAttributeMaxValueLength
MAX_TAINTS = {COMBINED: 4, SPLIT: 16}
MAX_COUNTERS_PER_SET = 32
MAX_COUNTER_SETS_PER_SLICE = 8  # 1.35+
MAX_SHARED_COUNTERS_PER_SLICE = 32  # 1.34: counters in all sets of a slice
MAX_CONSUMED_COUNTERS_PER_DEVICE = 32
MAX_CONSUMED_COUNTERS_PER_SLICE = 1024  # 1.34
MAX_CONSUMED_SETS_PER_DEVICE = 2  # 1.35+
_INT64 = (-(1 << 63), (1 << 63) - 1)

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_SEMVER = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-((?:0|[1-9]\d*|\d*[A-Za-z-][0-9A-Za-z-]*)(?:\.(?:0|[1-9]\d*|\d*[A-Za-z-][0-9A-Za-z-]*))*))?"
    r"(?:\+([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?$"
)


class SliceError(ValueError):
    """The pool cannot be published as asked: the message names the device (or counter set) and the rule."""


_Fail = Callable[[str], SliceError]  # makes the error for one device: fail("the rule it breaks")


def layout_for(server_version: str) -> Layout:
    """NVIDIA's choice by the API server's ``gitVersion`` (``v1.34.2``, ``v1.35.0-gke.1``): split from 1.35 on."""
    match = re.match(r"^v?(\d+)\.(\d+)", server_version.strip())
    if match is None:
        raise ValueError(f"{server_version!r} is not a Kubernetes version such as 'v1.35.0'")
    return SPLIT if (int(match[1]), int(match[2])) >= (1, 35) else COMBINED


def resource_slices(
    node_name: str,
    node_uid: str,
    driver: str,
    devices: Iterable[DraDevice],
    generation: int,
    layout: Layout = SPLIT,
    *,
    taints: Mapping[str, Sequence[DeviceTaint]] | None = None,
    counter_sets: Mapping[str, Mapping[str, int]] | None = None,
) -> list[dict[str, Any]]:
    """The ResourceSlices of ``node_name``'s pool for ``driver``, in publishing order.

    ``taints`` are by device name (``device_taints``); ``counter_sets`` maps a set name to its counters and
    their values, for devices that consume counters.
    """
    _check_pool(node_name, node_uid, driver, generation, layout)
    ordered = sorted(devices, key=lambda d: (d.gpu_minor, d.name))
    sets = {name: dict(counters) for name, counters in sorted((counter_sets or {}).items(), key=_natural_item)}
    for name, counters in sets.items():
        _check_counter_set(name, counters)
    entries = _entries(ordered, taints or {}, sets, driver, layout)
    specs = _combined(ordered, entries, sets) if layout == COMBINED else _split(ordered, entries, sets)
    width = max(5, len(f"{len(specs) - 1:x}"))
    owner = {"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node_uid, "controller": True}
    pool = {"name": node_name, "generation": generation, "resourceSliceCount": len(specs)}
    return [
        {
            "apiVersion": API_VERSION,
            "kind": "ResourceSlice",
            "metadata": {"generateName": f"{index:0{width}x}-{driver}-{node_name}-", "ownerReferences": [dict(owner)]},
            "spec": {"driver": driver, "pool": dict(pool), "nodeName": node_name, **body},
        }
        for index, body in enumerate(specs)
    ]


# What a cluster loses when the API server drops the fields of a feature gate that is off (it stores the rest)
DROPPED_GATES = {
    "DRAConsumableCapacity": (
        "the API server dropped allowMultipleAllocations (feature gate DRAConsumableCapacity is off): the GPUs in "
        "dra.gpuShares are allocated whole, one claim each; turn the gate on (beta and on from Kubernetes 1.36)"
    ),
    "DRAPartitionableDevices": (
        "the API server dropped the shared counters (feature gate DRAPartitionableDevices is off): the scheduler "
        "may allocate overlapping MIG partitions of dynamic-MIG GPUs, whose Prepare then fails; turn the gate on "
        "(beta and on from 1.36) or drop dra.dynamicMig"
    ),
}


def dropped_gates(wanted: Sequence[Mapping[str, Any]], stored: Sequence[Mapping[str, Any]]) -> tuple[str, ...]:
    """The feature gates the API server evidently has off: the fields of theirs Tessera wrote (``wanted``) and the
    server did not keep (``stored``, this pool's slices as listed after the write). Keys of ``DROPPED_GATES``."""

    def devices(slices: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        return [d for s in slices for d in s.get("spec", {}).get("devices") or []]

    def counters(slices: Sequence[Mapping[str, Any]]) -> bool:
        return any(s.get("spec", {}).get("sharedCounters") for s in slices) or any(
            d.get("consumesCounters") for d in devices(slices)
        )

    dropped = []
    if any(d.get("allowMultipleAllocations") for d in devices(wanted)) and not any(
        d.get("allowMultipleAllocations") for d in devices(stored)
    ):
        dropped.append("DRAConsumableCapacity")
    if counters(wanted) and not counters(stored):
        dropped.append("DRAPartitionableDevices")
    return tuple(dropped)


def quantity(value: int) -> str:
    """An integer in resource.Quantity's canonical BinarySI form, as ``NewQuantity(v, BinarySI)`` prints it:
    ``85899345920`` -> ``80Gi``, ``1536`` -> ``1536``, ``14`` -> ``14`` (below 1024: decimal SI, ``1000`` -> ``1k``)."""
    if -1024 < value < 1024:
        return f"{value // 1000}k" if value and value % 1000 == 0 else str(value)
    for power, suffix in ((60, "Ei"), (50, "Pi"), (40, "Ti"), (30, "Gi"), (20, "Mi"), (10, "Ki")):
        if value % (1 << power) == 0:
            return f"{value >> power}{suffix}"
    return str(value)


# ----- layouts --------------------------------------------------------------------------------------


def _combined(
    devices: list[DraDevice], entries: Mapping[str, dict[str, Any]], sets: Mapping[str, Mapping[str, int]]
) -> list[dict[str, Any]]:
    """1.34: the devices that consume a counter set share its slice; the other devices fill further slices."""
    groups = _counter_groups(devices, sets)
    specs: list[dict[str, Any]] = []
    grouped: set[str] = set()
    for set_names, members in groups:
        counters = sum(len(sets[s]) for s in set_names)
        if counters > MAX_SHARED_COUNTERS_PER_SLICE:
            raise SliceError(
                f"counter sets {', '.join(set_names)} hold {counters} counters and must share one slice on "
                f"Kubernetes 1.34, which allows {MAX_SHARED_COUNTERS_PER_SLICE}"
            )
        if len(members) > MAX_DEVICES:
            raise SliceError(
                f"{len(members)} devices consume counter set {set_names[0]} and must share its slice on "
                f"Kubernetes 1.34, which holds at most {MAX_DEVICES} devices"
            )
        consumed = sum(_consumed_counters(d) for d in members)
        if consumed > MAX_CONSUMED_COUNTERS_PER_SLICE:
            raise SliceError(
                f"the devices consuming counter set {set_names[0]} consume {consumed} counters in all; a 1.34 "
                f"slice allows {MAX_CONSUMED_COUNTERS_PER_SLICE}"
            )
        grouped.update(d.name for d in members)
        body: dict[str, Any] = {"sharedCounters": [_counter_set(s, sets[s]) for s in set_names]}
        body["devices"] = [entries[d.name] for d in members]
        specs.append(body)
    rest = [d for d in devices if d.name not in grouped]
    chunks = _pack(rest, lambda chunk: MAX_DEVICES)
    specs.extend({"devices": [entries[d.name] for d in chunk]} for chunk in chunks)
    return specs or [{"devices": []}]


def _split(
    devices: list[DraDevice], entries: Mapping[str, dict[str, Any]], sets: Mapping[str, Mapping[str, int]]
) -> list[dict[str, Any]]:
    """1.35+: slices of counter sets first, then slices of devices."""
    names = list(sets)
    specs: list[dict[str, Any]] = [
        {"sharedCounters": [_counter_set(s, sets[s]) for s in names[i : i + MAX_COUNTER_SETS_PER_SLICE]]}
        for i in range(0, len(names), MAX_COUNTER_SETS_PER_SLICE)
    ]

    def limit(chunk: list[DraDevice]) -> int:
        advanced = any(entries[d.name].get("taints") or d.consumes_counters for d in chunk)
        return MAX_DEVICES_WITH_ADVANCED_FEATURES if advanced else MAX_DEVICES

    specs.extend({"devices": [entries[d.name] for d in chunk]} for chunk in _pack(devices, limit))
    return specs or [{"devices": []}]


def _pack(devices: list[DraDevice], limit: Callable[[list[DraDevice]], int]) -> list[list[DraDevice]]:
    """Devices in order into slices, each as full as ``limit(slice)`` allows (the limit depends on the contents)."""
    chunks: list[list[DraDevice]] = []
    current: list[DraDevice] = []
    for device in devices:
        if current and len(current) + 1 > limit([*current, device]):
            chunks.append(current)
            current = []
        current.append(device)
    if current:
        chunks.append(current)
    return chunks


def _counter_groups(
    devices: list[DraDevice], sets: Mapping[str, Mapping[str, int]]
) -> list[tuple[list[str], list[DraDevice]]]:
    """Counter sets joined by the devices that consume from several, with those devices; sets no device uses
    form groups of their own. In the order of the sets."""
    root = {name: name for name in sets}

    def find(name: str) -> str:
        while root[name] != name:
            root[name] = root[root[name]]
            name = root[name]
        return name

    for device in devices:
        used = list(device.consumes_counters)
        for other in used[1:]:
            root[find(other)] = find(used[0])
    groups: dict[str, tuple[list[str], list[DraDevice]]] = {}
    for name in sets:
        groups.setdefault(find(name), ([], []))[0].append(name)
    for device in devices:
        if device.consumes_counters:
            groups[find(next(iter(device.consumes_counters)))][1].append(device)
    return list(groups.values())


# ----- one device -----------------------------------------------------------------------------------


def _entries(
    devices: list[DraDevice],
    taints: Mapping[str, Sequence[DeviceTaint]],
    sets: Mapping[str, Mapping[str, int]],
    driver: str,
    layout: Layout,
) -> dict[str, dict[str, Any]]:
    entries: dict[str, dict[str, Any]] = {}
    for device in devices:
        if device.name in entries:
            raise SliceError(f"device {device.name}: the name is used twice; names are unique in a pool")
        entries[device.name] = _device_entry(device, taints.get(device.name, ()), sets, driver, layout)
    unknown = sorted(set(taints) - set(entries))
    if unknown:
        raise SliceError(f"taints given for {', '.join(unknown)}, which is not a device of this pool")
    return entries


def _device_entry(
    device: DraDevice,
    taints: Sequence[DeviceTaint],
    sets: Mapping[str, Mapping[str, int]],
    driver: str,
    layout: Layout,
) -> dict[str, Any]:
    def fail(rule: str) -> SliceError:
        return SliceError(f"device {device.name}: {rule}")

    if len(device.name) > 63 or not _DNS_LABEL.match(device.name):
        raise fail("the name must be a DNS label (lower-case letters, digits and '-', at most 63 characters)")
    count = len(device.attributes) + len(device.capacity)
    if count > MAX_ATTRIBUTES_AND_CAPACITIES:
        raise fail(f"{count} attributes and capacities; at most {MAX_ATTRIBUTES_AND_CAPACITIES} are allowed")
    entry: dict[str, Any] = {"name": device.name}
    attributes: dict[str, Any] = {}
    for name in sorted(device.attributes):
        _check_name(name, driver, device.attributes, fail, "attribute")
        attributes[name] = _attribute(name, device.attributes[name], fail)
    if attributes:
        entry["attributes"] = attributes
    capacity: dict[str, Any] = {}
    for name in sorted(device.capacity):
        _check_name(name, driver, device.capacity, fail, "capacity")
        capacity[name] = {"value": quantity(_int(name, device.capacity[name], fail))}
        policy = device.request_policies.get(name)
        if policy is not None:
            capacity[name]["requestPolicy"] = _request_policy(policy)
    if device.request_policies and not device.allow_multiple_allocations:
        raise fail("a capacity has a request policy, which needs allowMultipleAllocations")
    unknown = sorted(set(device.request_policies) - set(device.capacity))
    if unknown:
        raise fail(f"request policy for {', '.join(unknown)}, which is not a capacity of the device")
    if capacity:
        entry["capacity"] = capacity
    if device.allow_multiple_allocations:
        entry["allowMultipleAllocations"] = True
    if device.consumes_counters:
        entry["consumesCounters"] = _consumption(device, sets, layout, fail)
    if taints:
        entry["taints"] = _taints(taints, layout, fail)
    return entry


def _request_policy(policy: RequestPolicy) -> dict[str, Any]:
    if policy.valid_values is not None:
        return {"default": quantity(policy.default), "validValues": [quantity(v) for v in policy.valid_values]}
    valid_range = {"min": quantity(policy.minimum), "max": quantity(policy.maximum), "step": quantity(policy.step)}
    return {"default": quantity(policy.default), "validRange": valid_range}


def _check_name(name: str, driver: str, names: Mapping[str, object], fail: _Fail, what: str) -> None:
    domain, _, identifier = name.rpartition("/")
    if len(identifier) > 32 or not _C_IDENTIFIER.match(identifier):
        raise fail(f"{what} {name!r}: the name must be a C identifier of at most 32 characters")
    if domain and (len(domain) > 63 or not _DNS_SUBDOMAIN.match(domain)):
        raise fail(f"{what} {name!r}: the domain must be a DNS subdomain of at most 63 characters")
    if domain == driver and identifier in names:
        raise fail(f"{what} {name!r} is also given as {identifier!r}: unqualified names are in {driver}")


def _attribute(name: str, value: Any, fail: _Fail) -> dict[str, Any]:
    try:
        kind = attribute_kind(value)
    except TypeError as error:
        raise fail(f"attribute {name!r}: {error}") from None
    if kind == "int":
        return {"int": _int(name, value, fail)}
    if kind in ("string", "version") and len(value) > MAX_VALUE_LENGTH:
        raise fail(f"attribute {name!r} is {len(value)} characters long; at most {MAX_VALUE_LENGTH} are allowed")
    if kind == "version" and not _SEMVER.match(value):
        raise fail(f"attribute {name!r}: {value!r} is not a semantic version (semver 2.0.0, e.g. '8.0.0')")
    return {kind: str(value) if kind != "bool" else value}


def _int(name: str, value: Any, fail: _Fail) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not _INT64[0] <= value <= _INT64[1]:
        raise fail(f"{name!r}: {value!r} is not a 64-bit integer")
    return value


def _consumption(
    device: DraDevice, sets: Mapping[str, Mapping[str, int]], layout: Layout, fail: _Fail
) -> list[dict[str, Any]]:
    if layout == SPLIT and len(device.consumes_counters) > MAX_CONSUMED_SETS_PER_DEVICE:
        raise fail(f"consumes from {len(device.consumes_counters)} counter sets; at most 2 are allowed")
    total = 0
    consumption = []
    for set_name, counters in device.consumes_counters.items():
        if set_name not in sets:
            raise fail(f"consumes counter set {set_name!r}, which the pool does not have")
        unknown = sorted(set(counters) - set(sets[set_name]))
        if unknown:
            raise fail(f"consumes {', '.join(unknown)} from {set_name!r}, which has no such counter")
        if len(counters) > MAX_CONSUMED_COUNTERS_PER_DEVICE:
            raise fail(f"consumes {len(counters)} counters of {set_name!r}; at most 32 are allowed")
        total += len(counters)
        values = {c: {"value": quantity(_int(c, counters[c], fail))} for c in sorted(counters, key=_natural)}
        consumption.append({"counterSet": set_name, "counters": values})
    if layout == COMBINED and total > MAX_CONSUMED_COUNTERS_PER_DEVICE:
        raise fail(f"consumes {total} counters; at most {MAX_CONSUMED_COUNTERS_PER_DEVICE} are allowed on 1.34")
    return consumption


def _taints(taints: Sequence[DeviceTaint], layout: Layout, fail: _Fail) -> list[dict[str, Any]]:
    if len(taints) > MAX_TAINTS[layout]:
        raise fail(f"{len(taints)} taints; at most {MAX_TAINTS[layout]} are allowed")
    result = []
    for taint in taints:
        prefix, _, name = taint.key.rpartition("/")
        if not _LABEL_NAME.match(name) or len(name) > 63 or (prefix and not _DNS_SUBDOMAIN.match(prefix)):
            raise fail(f"taint key {taint.key!r} is not a label name")
        if taint.value is not None and (len(taint.value) > 63 or not _LABEL_VALUE.match(taint.value)):
            raise fail(f"taint {taint.key}: value {taint.value!r} is not a label value")
        if taint.effect not in EFFECTS or (layout == COMBINED and taint.effect == NONE):
            allowed = EFFECTS[1:] if layout == COMBINED else EFFECTS
            raise fail(f"taint {taint.key}: effect {taint.effect!r}; the API allows {', '.join(allowed)}")
        entry: dict[str, Any] = {"key": taint.key}
        if taint.value is not None:
            entry["value"] = taint.value
        entry["effect"] = taint.effect
        if taint.time_added is not None:
            entry["timeAdded"] = taint.time_added
        result.append(entry)
    return result


# ----- counters and pool ----------------------------------------------------------------------------


def _check_counter_set(name: str, counters: Mapping[str, int]) -> None:
    if len(name) > 63 or not _DNS_LABEL.match(name):
        raise SliceError(f"counter set {name!r}: the name must be a DNS label")
    if not counters or len(counters) > MAX_COUNTERS_PER_SET:
        raise SliceError(f"counter set {name}: {len(counters)} counters; 1 to {MAX_COUNTERS_PER_SET} are allowed")
    for counter, value in counters.items():
        if len(counter) > 63 or not _DNS_LABEL.match(counter):
            raise SliceError(f"counter set {name}: counter {counter!r} is not a DNS label")
        if isinstance(value, bool) or not isinstance(value, int):
            raise SliceError(f"counter set {name}: counter {counter} is {value!r}, not an integer")


def _counter_set(name: str, counters: Mapping[str, int]) -> dict[str, Any]:
    return {"name": name, "counters": {c: {"value": quantity(counters[c])} for c in sorted(counters, key=_natural)}}


def _consumed_counters(device: DraDevice) -> int:
    return sum(len(c) for c in device.consumes_counters.values())


def _check_pool(node_name: str, node_uid: str, driver: str, generation: int, layout: str) -> None:
    if len(driver) > 63 or not _DNS_SUBDOMAIN.match(driver):
        raise SliceError(f"driver name {driver!r} must be a DNS subdomain of at most 63 characters")
    if len(node_name) > 253 or not _DNS_SUBDOMAIN.match(node_name):
        raise SliceError(f"node name {node_name!r} cannot name a pool: it must be a DNS subdomain")
    if not node_uid:
        raise SliceError("the Node's UID is needed for the slices' owner reference")
    if isinstance(generation, bool) or not isinstance(generation, int) or not 0 <= generation <= _INT64[1]:
        raise SliceError(f"pool generation {generation!r} must be a non-negative 64-bit integer")
    if layout not in (COMBINED, SPLIT):
        raise SliceError(f"layout {layout!r}: use 'combined' (Kubernetes 1.34) or 'split' (1.35 and later)")


def _natural(text: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key that compares digit runs as numbers: gpu-2 before gpu-10."""
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", text) if p)


def _natural_item(item: tuple[str, object]) -> tuple[tuple[int, int | str], ...]:
    return _natural(item[0])
