"""What an XID does to a device (``XidEffect``) and the parsers of the overrides that a flag or a config's
``health.xids`` writes. Apart from :mod:`agent.core.health` (the health state machine, which re-exports these)
so that the config checker validates a config's overrides without loading the state machine and its catalog."""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum

MAX_XID = 0xFFFFFFFF  # eventData is an unsigned 32-bit number
MAX_RANGE = 1024  # "144-150=unhealthy": a range may name at most this many XIDs


class XidEffect(StrEnum):
    """What an XID does to the device it names."""

    IGNORE = "ignore"  # counted in metrics only
    APPLICATION = "application"  # logged and counted; the device stays Healthy (the application is at fault)
    UNHEALTHY = "unhealthy"  # the device is Unhealthy until the evidence says it recovered
    LOST = "lost"  # as UNHEALTHY, and the GPU is treated as gone until it answers again (re-read inventory)

    @property
    def marks_unhealthy(self) -> bool:
        return self in (XidEffect.UNHEALTHY, XidEffect.LOST)


EFFECT_NAMES = tuple(e.value for e in XidEffect)


def is_xid_number(text: str) -> bool:
    # isdigit() alone accepts '\u00b2', which int() rejects; 20 digits bound int() (Python refuses 4,300 and more)
    return text.isascii() and text.isdigit() and len(text) <= 20


def parse_xid_key(key: object) -> range:
    """An override's key: one XID (``94``) or an inclusive range (``144-150``). Raises ValueError saying why."""
    text = str(key).strip() if isinstance(key, int | str) and not isinstance(key, bool) else None
    if text is None:
        raise ValueError(f"{key!r} is not an XID; write a number such as 94 or a range such as 144-150")
    first, sep, last = text.partition("-")
    if not is_xid_number(first) or (sep and not is_xid_number(last)):
        raise ValueError(f"{text!r} is not an XID; write a number such as 94 or a range such as 144-150")
    low, high = int(first), int(last) if sep else int(first)
    if not 1 <= low <= high <= MAX_XID:
        raise ValueError(f"{text!r} is out of range: XIDs are 1 to {MAX_XID}, written low-high")
    if high - low + 1 > MAX_RANGE:
        raise ValueError(f"{text!r} names more than {MAX_RANGE} XIDs; list narrower ranges")
    return range(low, high + 1)


def parse_effect(value: object) -> XidEffect:
    """An override's value, case-insensitive. Raises ValueError naming the allowed values."""
    text = value.strip().lower() if isinstance(value, str) else None
    if text not in EFFECT_NAMES:
        raise ValueError(f"{value!r} is not an XID effect; use one of {', '.join(EFFECT_NAMES)}")
    return XidEffect(text)


def parse_override_mapping(mapping: Mapping[object, object]) -> tuple[dict[int, XidEffect], list[str]]:
    """``{"94": "unhealthy", "144-150": "ignore"}`` (a config's ``health.xids``): the overrides and one
    problem line per entry that was not understood."""
    overrides: dict[int, XidEffect] = {}
    problems: list[str] = []
    for key, value in mapping.items():
        try:
            xids, effect = parse_xid_key(key), parse_effect(value)
        except ValueError as error:
            problems.append(str(error))
            continue
        overrides.update(dict.fromkeys(xids, effect))
    return overrides, problems


def parse_xid_overrides(text: str) -> tuple[dict[int, XidEffect], list[str]]:
    """A flag value such as ``94=unhealthy,13=ignore,144-150=application``: the overrides and the entries
    that were rejected (a later entry for the same XID wins)."""
    overrides: dict[int, XidEffect] = {}
    rejected: list[str] = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        key, sep, value = entry.partition("=")
        try:
            if not sep:
                raise ValueError(entry)
            xids, effect = parse_xid_key(key), parse_effect(value)
        except ValueError:
            rejected.append(entry)
            continue
        overrides.update(dict.fromkeys(xids, effect))
    return overrides, rejected


OVERRIDE_SYNTAX = f"XID=EFFECT or LOW-HIGH=EFFECT, comma separated; EFFECT is one of {', '.join(EFFECT_NAMES)}"
