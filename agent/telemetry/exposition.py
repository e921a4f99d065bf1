"""Metric families and the Prometheus text format (0.0.4), written without prometheus_client's per-sample work.

The text is what ``prometheus_client.generate_latest`` writes for the same families, byte for byte (a unit test
holds the two together). What costs there — every label name of every sample validated and escaped, every sample
formatted anew — is done here once per family, and a series' label block is kept from one rendering to the next:
a node's series rarely change between collections, so rendering it again is mostly dictionary lookups.

prometheus_client itself is not imported (it is a test dependency only): in the agent it would add ~12-15 ms and
~2 MB to the start of metrics, for a default registry and collectors the agent never uses. The one thing taken
from it is its number format, ``go_float``.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Sequence

from msgspec import Struct, field

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_KINDS = ("gauge", "counter", "histogram")

Values = tuple[str, ...]


class Family(Struct):
    """One metric family: its label names, then a (label values, value) pair per series, in order."""

    name: str
    kind: str  # "gauge", "counter" (its samples are <name>_total) or "histogram" (values are Buckets)
    documentation: str
    labels: tuple[str, ...]
    samples: list[tuple[Values, float | Buckets]] = field(default_factory=list)

    def __post_init__(self) -> None:
        _check(self.name, self.kind, self.labels)

    def add_metric(self, values: Sequence[str], value: float | Buckets) -> None:
        """A series; ``values`` in the order of ``labels``."""
        if len(values) != len(self.labels):
            raise ValueError(f"metric {self.name}: {len(values)} label values for {len(self.labels)} labels")
        self.samples.append((values if type(values) is tuple else tuple(values), value))


@functools.cache
def _check(name: str, kind: str, labels: tuple[str, ...]) -> None:
    """Refuse a family Prometheus could not read. Cached: a collection builds the same few dozen families every
    time, and a failed check is not cached (it raises again)."""
    if kind not in _KINDS:
        raise ValueError(f"metric {name}: kind {kind!r} is not one of {', '.join(_KINDS)}")
    if _METRIC_NAME.fullmatch(name) is None or (kind == "counter" and name.endswith("_total")):
        raise ValueError(f"metric name {name!r} is not a Prometheus name (a counter's without _total)")
    bad = [label for label in labels if _LABEL_NAME.fullmatch(label) is None or label.startswith("__")]
    if bad or len(set(labels)) != len(labels):
        raise ValueError(f"metric {name}: label names {list(labels)} are not distinct plain names")


def gauge(name: str, documentation: str, labels: Sequence[str]) -> Family:
    return Family(name, "gauge", documentation, tuple(labels))


def counter(name: str, documentation: str, labels: Sequence[str]) -> Family:
    return Family(name, "counter", documentation, tuple(labels))


def histogram(name: str, documentation: str, labels: Sequence[str]) -> Family:
    """A histogram family: ``add_metric(values, Buckets(...))`` per series."""
    if "le" in labels:
        raise ValueError(f"metric {name}: a histogram's own label le cannot be one of its labels")
    return Family(name, "histogram", documentation, tuple(labels))


class Buckets(Struct, frozen=True):
    """One histogram series: cumulative counts per upper bound (the last is +Inf: the count) and the sum."""

    bounds: tuple[float, ...]  # upper bounds, ascending, without +Inf
    cumulative: tuple[int, ...]  # len(bounds) + 1 counts
    total: float


class _Layout(Struct, frozen=True):
    """How a family's series are written: the sample name and the label names in the order they are written."""

    header: str
    sample_name: str
    order: tuple[tuple[int, str], ...]  # (position in the values, 'name="') sorted by label name


class Renderer:
    """Writes families in the text format, keeping what it wrote for the previous families to reuse.

    Not thread-safe: one caller at a time (``LastCollection`` holds a lock around it).
    """

    def __init__(self) -> None:
        self._layouts: dict[tuple[str, str, str, tuple[str, ...]], _Layout] = {}
        self._blocks: dict[tuple[str, tuple[str, ...]], dict[Values, str]] = {}
        self._numbers: dict[int, str] = {}  # integers only: a float key would mix 0.0 with -0.0, and NaN

    def render(self, families: Iterable[Family]) -> bytes:
        out: list[str] = []
        blocks: dict[tuple[str, tuple[str, ...]], dict[Values, str]] = {}
        numbers: dict[int, str] = {}
        old_numbers = self._numbers
        for family in families:
            layout = self._layout(family)
            out.append(layout.header)
            if family.kind == "histogram":
                out += _histogram_lines(family)
                continue
            key = (layout.sample_name, family.labels)
            old = self._blocks.get(key, {})
            new = blocks.setdefault(key, {})
            for values, value in family.samples:
                block = new.get(values)
                if block is None:
                    block = old.get(values)
                    if block is None:
                        block = _block(layout, values)
                    new[values] = block
                if type(value) is int:  # counts, bytes, 0/1 states: the same few numbers again and again
                    number = numbers.get(value)
                    if number is None:
                        number = old_numbers.get(value) or go_float(value)
                        numbers[value] = number
                else:
                    number = go_float(value)
                out.append(f"{block}{number}\n")
        self._blocks, self._numbers = blocks, numbers  # only what this rendering used is kept
        return "".join(out).encode()

    def _layout(self, family: Family) -> _Layout:
        key = (family.name, family.kind, family.documentation, family.labels)
        layout = self._layouts.get(key)
        if layout is None:
            name = family.name + "_total" if family.kind == "counter" else family.name
            help_text = family.documentation.replace("\\", r"\\").replace("\n", r"\n")
            order = tuple(sorted(((i, label) for i, label in enumerate(family.labels)), key=lambda item: item[1]))
            layout = _Layout(
                f"# HELP {name} {help_text}\n# TYPE {name} {family.kind}\n",
                name,
                tuple((i, f'{label}="') for i, label in order),
            )
            self._layouts[key] = layout
        return layout


def _block(layout: _Layout, values: Values) -> str:
    """``name{a="1",b="2"} `` (labels sorted by name, values escaped), or ``name `` without labels."""
    if not layout.order:
        return layout.sample_name + " "
    labels = ",".join(f'{prefix}{_escape(values[i])}"' for i, prefix in layout.order)
    return f"{layout.sample_name}{{{labels}}} "


def _histogram_lines(family: Family) -> list[str]:
    """prometheus_client's lines for a histogram: ``_bucket`` per bound with ``le`` among the labels (sorted by
    name), then ``_count`` and ``_sum``; every number a float."""
    lines: list[str] = []
    with_le = sorted([*family.labels, "le"])
    plain = sorted(family.labels)
    position = {label: i for i, label in enumerate(family.labels)}
    for values, buckets in family.samples:
        assert isinstance(buckets, Buckets)
        escaped = {label: _escape(values[position[label]]) for label in family.labels}
        for bound, count in zip([*map(go_float, buckets.bounds), "+Inf"], buckets.cumulative, strict=True):
            escaped["le"] = bound
            labels = ",".join(f'{label}="{escaped[label]}"' for label in with_le)
            lines.append(f"{family.name}_bucket{{{labels}}} {go_float(count)}\n")
        labels = ",".join(f'{label}="{escaped[label]}"' for label in plain)
        block = f"{{{labels}}}" if labels else ""
        lines.append(f"{family.name}_count{block} {go_float(buckets.cumulative[-1])}\n")
        lines.append(f"{family.name}_sum{block} {go_float(buckets.total)}\n")
    return lines


def _escape(value: str) -> str:
    if "\\" in value or "\n" in value or '"' in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return value


def go_float(value: float) -> str:
    """A sample value as prometheus_client's ``floatToGoString`` writes it: ``+Inf``, ``-Inf``, ``NaN``;
    otherwise Python's shortest round-trip ``repr`` of the float (``1.0``, ``0.5``, ``1e-09``, ``-0.0``,
    ``-12345678.0``), except that a positive number with 7 or more integer digits gets an exponent, as Go's
    formatting does (``85899345920`` -> ``8.589934592e+10``, ``1000000`` -> ``1e+06``). Integers and bools
    are written as floats (``1`` -> ``1.0``)."""
    number = float(value)
    if number == math.inf:
        return "+Inf"
    if number == -math.inf:
        return "-Inf"
    if math.isnan(number):
        return "NaN"
    text = repr(number)
    dot = text.find(".")
    if number > 0 and dot > 6:  # 1234567.0 and up (from 1e+16 repr has the exponent)
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1 :]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return text
