"""Field and label selectors as list, watch and DeleteCollection take them.

Field selectors: ``key=value``, ``key==value`` and ``key!=value`` joined by commas (ANDed), keys limited to the kind's
selectable fields (an unknown one is a 400 ``field label not supported``). Label selectors: equality (``=``, ``==``,
``!=``), existence (``key``, ``!key``) and set-based ``key in (a,b)`` / ``key notin (a,b)``.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from msgspec import Struct

from agent.sim.apiserver.errors import bad_request
from agent.sim.apiserver.kinds import Kind, field_value


def _split_top(text: str) -> list[str]:
    """Split on commas outside parentheses."""
    parts, depth, current = [], 0, []
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]


class FieldSelector(Struct, frozen=True):
    kind: Kind
    terms: tuple[tuple[str, bool, str], ...]  # (label, equal?, value)

    @classmethod
    def parse(cls, kind: Kind, text: str | None) -> FieldSelector:
        terms = []
        for part in _split_top(text or ""):
            match = re.fullmatch(r"([^=!]+)(==|=|!=)(.*)", part)
            if not match:
                raise bad_request(f"invalid field selector: {part!r}: does not match key=value or key!=value")
            label, op, value = match.group(1).strip(), match.group(2), match.group(3).strip()
            if label not in kind.field_labels():
                raise bad_request(f"field label not supported: {label}")
            terms.append((label, op != "!=", value))
        return cls(kind, tuple(terms))

    def matches(self, obj: dict) -> bool:
        return all((field_value(self.kind, obj, label) == value) == equal for label, equal, value in self.terms)

    def __bool__(self) -> bool:
        return bool(self.terms)


_KEY = r"[A-Za-z0-9][-A-Za-z0-9_./]*"


class LabelSelector(Struct, frozen=True):
    tests: tuple[Callable[[dict], bool], ...]

    @classmethod
    def parse(cls, text: str | None) -> LabelSelector:
        tests: list[Callable[[dict], bool]] = []
        for part in _split_top(text or ""):
            tests.append(_label_test(part))
        return cls(tuple(tests))

    def matches(self, obj: dict) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return all(test(labels) for test in self.tests)

    def __bool__(self) -> bool:
        return bool(self.tests)


def _label_test(part: str) -> Callable[[dict], bool]:
    if match := re.fullmatch(rf"({_KEY})\s*(==|=|!=)\s*([-A-Za-z0-9_.]*)", part):
        key, op, value = match.groups()
        if op == "!=":
            return lambda labels: labels.get(key) != value
        return lambda labels: labels.get(key) == value
    if match := re.fullmatch(rf"({_KEY})\s+(in|notin)\s*\(([^)]*)\)", part):
        key, op, raw = match.groups()
        values = {v.strip() for v in raw.split(",") if v.strip()}
        if op == "in":
            return lambda labels: labels.get(key) in values
        return lambda labels: labels.get(key) not in values
    if match := re.fullmatch(rf"(!?)\s*({_KEY})", part):
        negate, key = match.groups()
        if negate:
            return lambda labels: key not in labels
        return lambda labels: key in labels
    raise bad_request(f"unable to parse requirement: {part!r}")
