"""Latency histograms comparable with the kubelet's (issue 17): recorded cheaply, written as prometheus_client would."""

from __future__ import annotations

import threading

from prometheus_client.core import HistogramMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import CollectorRegistry
from prometheus_client.utils import floatToGoString

from agent.telemetry.exposition import Buckets, Renderer
from agent.telemetry.latency import DEFAULT_BUCKETS, OperationLatency

HOST = "node-1"


def reference(latency: OperationLatency) -> bytes:
    """The same histograms as prometheus_client's HistogramMetricFamily, through its generate_latest."""
    metrics = []
    for family in latency.families(HOST):
        metric = HistogramMetricFamily(family.name, family.documentation, labels=list(family.labels))
        for values, buckets in family.samples:
            assert isinstance(buckets, Buckets)
            bounds = [floatToGoString(b) for b in buckets.bounds] + ["+Inf"]
            metric.add_metric(list(values), list(zip(bounds, buckets.cumulative, strict=True)), buckets.total)
        metrics.append(metric)

    class Source:
        def collect(self) -> list:
            return metrics

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Source())
    return generate_latest(registry)


def test_the_buckets_are_the_kubelets_and_the_text_is_prometheus_clients() -> None:
    latency = OperationLatency()
    for seconds in (0.001, 0.005, 0.0051, 0.2, 3.0, 11.0):
        latency.observe_allocate("nvidia.com/gpu", seconds)
    latency.observe_allocate('nvidia.com/mig-1g.10gb "odd"\\name', 0.02)
    latency.observe_preferred_allocation("nvidia.com/gpu", 0.0004)
    latency.observe_prepare(0.3, error=False)
    latency.observe_prepare(1.2, error=True)
    latency.observe_unprepare(0.05, error=False)
    assert DEFAULT_BUCKETS == (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)  # client_golang DefBuckets
    text = Renderer().render(latency.families(HOST))
    assert text == reference(latency)

    by_name = {f.name: f for f in text_string_to_metric_families(text.decode())}
    alloc = by_name["tessera_device_plugin_alloc_duration_seconds"]
    assert alloc.type == "histogram"
    gpu = {s.labels.get("le"): s.value for s in alloc.samples if s.labels.get("resource_name") == "nvidia.com/gpu"}
    assert gpu["0.005"] == 2, "le is inclusive: 0.005 is in the 0.005 bucket"
    assert gpu["0.01"] == 3 and gpu["5.0"] == 5 and gpu["+Inf"] == 6
    dra = by_name["tessera_dra_operations_duration_seconds"]
    failed = [s for s in dra.samples if s.name.endswith("_count") and s.labels["is_error"] == "true"]
    assert [(s.labels["operation_name"], s.value) for s in failed] == [("PrepareResources", 1)]


def test_unobserved_histograms_are_served_empty() -> None:
    text = Renderer().render(OperationLatency().families(HOST)).decode()
    names = {f.name for f in text_string_to_metric_families(text)}
    assert names == {
        "tessera_device_plugin_alloc_duration_seconds",
        "tessera_device_plugin_preferred_allocation_duration_seconds",
        "tessera_dra_operations_duration_seconds",
    }


def test_observations_from_many_threads_are_all_counted() -> None:
    latency = OperationLatency()

    def work() -> None:
        for _ in range(2000):
            latency.observe_allocate("nvidia.com/gpu", 0.002)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    (family, *_) = latency.families(HOST)
    ((_, buckets),) = family.samples
    assert buckets.cumulative[-1] == 16000 and buckets.cumulative[0] == 16000
    assert abs(buckets.total - 32.0) < 1e-6
