"""The collector's own text-format writer says exactly what prometheus_client's generate_latest says."""

from __future__ import annotations

import math

import pytest
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import CollectorRegistry

from agent.telemetry.collector import LastCollection
from agent.telemetry.exposition import Family, Renderer, counter, gauge


def reference(families: list[Family]) -> bytes:
    class Source:
        def collect(self) -> list:
            return [family.to_metric() for family in families]

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Source())
    return generate_latest(registry)


def sample_families(round_: int = 0) -> list[Family]:
    up = gauge("tessera_gpu_up", "1 when NVML answers", ["gpu", "UUID", "modelName", "Hostname"])
    up.add_metric(("0", "GPU-a", "NVIDIA A100-SXM4-80GB", "node-1"), 1)
    up.add_metric(["1", "GPU-b", "NVIDIA A100-SXM4-80GB", "node-1"], 0)
    memory = gauge("tessera_gpu_memory_total_bytes", "GPU memory\nin bytes \\ total", ["gpu", "Hostname"])
    memory.add_metric(("0", "node-1"), 85899345920)
    memory.add_metric(("1", "node-1"), 1234567 + round_)
    odd = gauge("odd_values", "values of every kind", ["value"])
    for value in (0, -0.0, 0.5, 1e-9, 2.5e21, -3, math.inf, -math.inf, math.nan, True, 123456.789):
        odd.add_metric((repr(value),), value)
    idle = counter("tessera_partition_allocated_idle_seconds", "idle seconds", ["resource", "pod", "Hostname"])
    idle.add_metric(("nvidia.com/gpu", 'we"ird\\pod\nname', "node-1"), 12.5 + round_)
    idle.add_metric(("nvidia.com/gpu", "", "node-1"), 0)
    empty = gauge("tessera_drain_waiting", "nothing here", ["operation", "Hostname"])
    plain = gauge("no_labels", "a series without labels", [])
    plain.add_metric((), 7)
    return [up, memory, odd, idle, empty, plain]


def test_the_text_is_generate_latests_byte_for_byte() -> None:
    assert Renderer().render(sample_families()) == reference(sample_families())


def test_a_renderer_reused_across_collections_stays_exact() -> None:
    renderer = Renderer()
    for round_ in range(4):
        families = sample_families(round_)
        if round_ == 2:
            families = families[::-1]  # another order, other series
            families[3].add_metric(("new-series",), 3)  # odd_values
        assert renderer.render(families) == reference(families), round_


def test_family_names_and_labels_are_checked_once_when_built() -> None:
    with pytest.raises(ValueError):
        gauge("bad name", "x", ["a"])
    with pytest.raises(ValueError):
        counter("already_total", "x", ["a"])
    with pytest.raises(ValueError):
        gauge("ok", "x", ["a", "a"])
    with pytest.raises(ValueError):
        gauge("ok", "x", ["bad-label"])
    family = gauge("ok", "x", ["a", "b"])
    with pytest.raises(ValueError):
        family.add_metric(("only one",), 1)


def test_the_last_collection_is_rendered_on_demand_once() -> None:
    last = LastCollection()
    assert last.rendered == b""
    families = sample_families()
    last.publish(families)
    assert last.collected_at is not None
    first = last.rendered
    assert first == reference(families)
    assert last.rendered is first  # a second scrape copies the same bytes
    assert [m.name for m in last.collect()] == [f.name for f in families]
