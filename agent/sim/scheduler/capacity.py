"""Consumable capacity (KEP-5075, gate DRAConsumableCapacity): what one request takes of one device.

A device with ``allowMultipleAllocations: true`` can be allocated to several claims (and several requests of one
claim); each allocation consumes an amount of every capacity the device has, and the amounts of all allocations
together never exceed the capacity's ``value``. How much one request consumes of capacity ``c`` (facts ``dra.md``
B4, the API's field comments):

- the request's ``capacity.requests[c]`` if it names ``c``; else the policy's ``default``; else (no policy) the
  whole ``value``;
- rounded up to the policy: the smallest of ``validValues`` at least that large, or, with ``validRange``, at least
  ``min`` and then up to ``min + n * step``; an amount above every valid value or above ``max`` makes the device
  ineligible for the request;
- a request that names a capacity the device does not have cannot use the device.

A device without ``allowMultipleAllocations`` is allocated whole, once; a request's ``capacity.requests`` then
only has to fit in the device's capacities.
"""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction
from math import ceil
from typing import Any

from agent.sim.scheduler.values import Quantity


def amount(value: Any) -> Fraction:
    """A quantity (``"10Gi"``, ``{"value": "10Gi"}``, a number) as an exact amount."""
    raw = value.get("value") if isinstance(value, Mapping) else value
    return Quantity.parse(str(raw)).amount


def qualified(name: str, driver: str) -> str:
    """A capacity name with its domain: unqualified names belong to the driver's."""
    return name if "/" in name else f"{driver}/{name}"


def consumption(
    capacities: Mapping[str, Any], requests: Mapping[str, Any], driver: str, *, multiple: bool
) -> dict[str, Fraction] | str:
    """What a request with ``capacity.requests`` = ``requests`` consumes of a device's ``capacities`` (its
    ``capacity`` map, names as the slice has them), by the device's capacity names; or why it cannot use the device.

    For a device without ``multiple`` allocations the result is empty (nothing is shared, nothing to count)."""
    by_name = {qualified(name, driver): name for name in capacities}
    wanted: dict[str, Fraction] = {}
    for name, value in requests.items():
        device_name = by_name.get(qualified(name, driver))
        if device_name is None:
            return f"has no capacity {name}"
        wanted[device_name] = amount(value)
    if not multiple:
        for name, asked in wanted.items():
            if asked > amount(capacities[name]):
                has = quantity_text(amount(capacities[name]))
                return f"has {has} of {name}, less than the {quantity_text(asked)} asked"
        return {}
    consumed: dict[str, Fraction] = {}
    for name, capacity in capacities.items():
        total = amount(capacity)
        policy = capacity.get("requestPolicy") if isinstance(capacity, Mapping) else None
        if name in wanted:
            asked = wanted[name]
        elif isinstance(policy, Mapping) and policy.get("default") is not None:
            asked = amount(policy["default"])
        else:
            asked = total
        rounded = _round(asked, policy) if isinstance(policy, Mapping) else asked
        if rounded is None:
            return f"cannot give {name} {quantity_text(asked)}: its request policy allows no such amount"
        consumed[name] = rounded
    return consumed


def _round(asked: Fraction, policy: Mapping[str, Any]) -> Fraction | None:
    """``asked`` rounded up to the policy; None when no valid amount is that large."""
    valid_values = policy.get("validValues")
    if valid_values:
        larger = [v for v in (amount(v) for v in valid_values) if v >= asked]
        return min(larger) if larger else None
    valid_range = policy.get("validRange")
    if isinstance(valid_range, Mapping):
        low = amount(valid_range.get("min", 0))
        rounded = max(asked, low)
        step = valid_range.get("step")
        if step is not None and amount(step) > 0:
            size = amount(step)
            rounded = low + ceil((rounded - low) / size) * size
        high = valid_range.get("max")
        if high is not None and rounded > amount(high):
            return None
        return rounded
    return asked


def quantity_text(value: Fraction) -> str:
    """An amount as the API server prints a quantity it stores (``10Gi``, ``30``)."""
    if value.denominator != 1:
        return f"{float(value)}"
    whole = int(value)
    for power, suffix in ((50, "Pi"), (40, "Ti"), (30, "Gi"), (20, "Mi"), (10, "Ki")):
        if whole and whole % (1 << power) == 0:
            return f"{whole >> power}{suffix}"
    return str(whole)
