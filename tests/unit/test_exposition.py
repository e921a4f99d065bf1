"""The collector's own text-format writer says exactly what prometheus_client's generate_latest says.

prometheus_client is a test dependency only: the agent writes the text format itself and never imports it
(checked here in a fresh interpreter, as tests/unit/test_imports.py checks the commands).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import CollectorRegistry
from prometheus_client.utils import floatToGoString

from agent.telemetry.collector import LastCollection
from agent.telemetry.exposition import Family, Renderer, counter, gauge, go_float


def to_metric(family: Family) -> Metric:
    """The same family as prometheus_client's."""
    cls = CounterMetricFamily if family.kind == "counter" else GaugeMetricFamily
    metric = cls(family.name, family.documentation, labels=list(family.labels))
    for values, value in family.samples:
        metric.add_metric(list(values), value)
    return metric


def reference(families: list[Family]) -> bytes:
    class Source:
        def collect(self) -> list[Metric]:
            return [to_metric(family) for family in families]

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
    assert last.families is families


# ----- the number format: prometheus_client's floatToGoString, without prometheus_client -------------------

EDGES = [
    0, -0.0, 1, -1, True, False, 0.5, 1e-9, 5e-324, -5e-324, 2.5e21, 1e22, 1e16, 1e15, 123456.789,
    999999, 1000000, 1234567, 9999999.5, 85899345920, -85899345920, 2**53 + 1, 2**63, 10**30, 1.7976931348623157e308,
    -1.7976931348623157e308, math.inf, -math.inf, math.nan, -math.nan, 0.1 + 0.2, 100.0, 12.5,
]  # fmt: skip


@pytest.mark.parametrize("value", EDGES, ids=repr)
def test_numbers_are_written_as_prometheus_client_writes_them(value: float) -> None:
    assert go_float(value) == floatToGoString(value)


@given(st.floats(allow_nan=True, allow_infinity=True) | st.integers(min_value=-(2**70), max_value=2**70))
def test_any_number_is_written_as_prometheus_client_writes_it(value: float) -> None:
    assert go_float(value) == floatToGoString(value)


def test_special_values_and_exponents_are_prometheus_text():
    assert [go_float(v) for v in (math.inf, -math.inf, math.nan, 1, 85899345920, 1e-9)] == [
        "+Inf", "-Inf", "NaN", "1.0", "8.589934592e+10", "1e-09"
    ]  # fmt: skip


def test_counters_are_written_with_total_and_no_created_sample():
    errors = counter("tessera_config_reload_errors", "configs rejected since start", ["Hostname"])
    errors.add_metric(("node-1",), 2)
    text = Renderer().render([errors]).decode()
    assert text == (
        "# HELP tessera_config_reload_errors_total configs rejected since start\n"
        "# TYPE tessera_config_reload_errors_total counter\n"
        'tessera_config_reload_errors_total{Hostname="node-1"} 2.0\n'
    )
    assert text.encode() == reference([errors])


# ----- prometheus_client stays out of the agent ---------------------------------------------------------------

# The telemetry modules, then one collection of an empty node rendered and served over HTTP, as a scrape does.
TELEMETRY_PATH = """
import agent.telemetry.service, agent.telemetry.collector, agent.telemetry.exposition, agent.telemetry.server
import urllib.request
from pathlib import Path
from agent.telemetry.collector import TelemetryCollector, TelemetryOptions
from agent.telemetry.server import TelemetryServer
options = TelemetryOptions(hostname="node-1", device_plugin_dir=Path("/nonexistent"))
collector = TelemetryCollector(options, status=lambda: None, holders=dict)
collector.collect_once()
server = TelemetryServer("127.0.0.1:0", collector.last, lambda: (True, "ok"), lambda: (True, "ok"))
server.start()
body = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10).read()
server.stop()
assert b"# TYPE tessera_config_reload_errors_total counter" in body, body
"""


def test_the_telemetry_path_never_loads_prometheus_client():
    script = f"{TELEMETRY_PATH}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    loaded = set(json.loads(result.stdout.splitlines()[-1]))
    seen = {"agent.telemetry.collector", "agent.telemetry.server", "agent.telemetry.serving"}
    assert seen <= loaded  # it saw the path
    assert not [m for m in loaded if m == "prometheus_client" or m.startswith("prometheus_client.")]
