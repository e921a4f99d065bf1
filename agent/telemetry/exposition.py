"""Metric families and the Prometheus text format (0.0.4), written without prometheus_client's per-sample work.

The text is what ``prometheus_client.generate_latest`` writes for the same families, byte for byte (a unit test
holds the two together). What costs there — every label name of every sample validated and escaped, every sample
formatted anew — is done here once per family, and a series' label block is kept from one rendering to the next:
a node's series rarely change between collections, so rendering it again is mostly dictionary lookups.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.utils import floatToGoString

_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_KINDS = ("gauge", "counter")

Values = tuple[str, ...]


@dataclass(slots=True)
class Family:
    """One metric family: its label names, then a (label values, value) pair per series, in order."""

    name: str
    kind: str  # "gauge" or "counter" (its samples are <name>_total)
    documentation: str
    labels: tuple[str, ...]
    samples: list[tuple[Values, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"metric {self.name}: kind {self.kind!r} is not one of {', '.join(_KINDS)}")
        if _METRIC_NAME.fullmatch(self.name) is None or (self.kind == "counter" and self.name.endswith("_total")):
            raise ValueError(f"metric name {self.name!r} is not a Prometheus name (a counter's without _total)")
        bad = [label for label in self.labels if _LABEL_NAME.fullmatch(label) is None or label.startswith("__")]
        if bad or len(set(self.labels)) != len(self.labels):
            raise ValueError(f"metric {self.name}: label names {list(self.labels)} are not distinct plain names")

    def add_metric(self, values: Sequence[str], value: float) -> None:
        """A series; ``values`` in the order of ``labels``."""
        if len(values) != len(self.labels):
            raise ValueError(f"metric {self.name}: {len(values)} label values for {len(self.labels)} labels")
        self.samples.append((values if type(values) is tuple else tuple(values), value))

    def to_metric(self) -> Metric:
        """The same family as prometheus_client's (for a ``Collector``)."""
        cls = CounterMetricFamily if self.kind == "counter" else GaugeMetricFamily
        metric = cls(self.name, self.documentation, labels=list(self.labels))
        for values, value in self.samples:
            metric.add_metric(list(values), value)
        return metric


def gauge(name: str, documentation: str, labels: Sequence[str]) -> Family:
    return Family(name, "gauge", documentation, tuple(labels))


def counter(name: str, documentation: str, labels: Sequence[str]) -> Family:
    return Family(name, "counter", documentation, tuple(labels))


@dataclass(frozen=True, slots=True)
class _Layout:
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
                        number = old_numbers.get(value) or floatToGoString(value)
                        numbers[value] = number
                else:
                    number = floatToGoString(value)
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


def _escape(value: str) -> str:
    if "\\" in value or "\n" in value or '"' in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return value
