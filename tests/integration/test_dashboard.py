"""The shipped Grafana dashboard against a real Prometheus scraping a real agent on a simulated node.

Every panel's every query (with the dashboard's variables set to "All") must return data once the node has
what the dashboard shows: pods busy and idle next to each other on MPS-shared GPUs, a pod on a MIG device, a host
process nobody owns, an XID. With ``TESSERA_DASHBOARD_DATA=<file>`` the test also writes each query's range
over the run to that file, which ``docs/render_dashboard.py`` draws as the PNG in docs/telemetry.md.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from tests.integration.test_prometheus import Prometheus, needs_prometheus, world  # noqa: F401 - world: a fixture
from tests.integration.test_telemetry import GPU, SMALL, TelemetryNode, held_device, shared_pair, wait_until

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "tessera-dashboard.json"
VARIABLES = {"$node": ".*", "$namespace": ".*", "${datasource}": "prometheus"}


def panels() -> list[dict]:
    return [p for p in json.loads(DASHBOARD.read_text())["panels"] if p["type"] != "row"]


def concrete(expr: str) -> str:
    """The query as Grafana sends it with every variable at "All"."""
    for variable, value in VARIABLES.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"an unknown variable in {expr!r}"
    return expr


def test_the_dashboard_is_grafana_json_with_queries_on_documented_metrics() -> None:
    from tests.integration.test_telemetry import documented

    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "tessera-gpus" and dashboard["schemaVersion"] >= 36
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "node", "namespace"}
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    metrics = set(documented())
    for panel in panels():
        assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            used = {m.removesuffix("_bucket") for m in re.findall(r"\btessera_\w+", target["expr"])}
            assert used and used <= metrics, (panel["title"], used - metrics)
        assert panel["gridPos"]["x"] >= 0 and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
    titles = " ".join(p["title"] for p in panels()).lower()
    for subject in ("gpu", "mig", "pod", "idle gpu-hours by namespace", "xid", "mps", "used vs limit"):
        assert subject in titles, subject


@needs_prometheus
def test_every_panel_returns_data_from_a_scraped_agent(world) -> None:  # noqa: F811 - the imported fixture
    node, prometheus, _ = world
    node: TelemetryNode
    prometheus: Prometheus
    kubelet, driver = node.kubelet, node.driver
    started = time.time()
    pods = [kubelet.create_pod(f"infer-{n}", {"main": {GPU: 1}}, namespace="serving") for n in range(3)]
    shared, busy, quiet, other, lonely = shared_pair(node, pods)
    for pod in pods:  # started: the driver holds each to its replica's memory ("used vs limit")
        kubelet.start_container(pod.name, "main", pod.namespace)
    cgroup = str(kubelet.started_container(busy.name, "main", busy.namespace).cgroup)
    node.run_process(busy, shared, 8100, 20000, kind="mps_client", sm=65, memory=30, cgroup=cgroup)
    node.run_process(quiet, shared, 8101, 6000, kind="mps_client")  # holds memory, computes nothing
    node.run_process(lonely, other, 8102, 9000, kind="mps_client", sm=35)
    node.proc_entry(8200, "0::/system.slice/monitoring-agent.service\n")
    driver.add_process(other, 8200, 400, sm=5)  # a host process: nobody's
    notebook = kubelet.create_pod("notebook", {"jupyter": {SMALL: 1}}, namespace="research")
    node.run_process(notebook, 0, 8300, 3000, mig_uuid=held_device(notebook, "jupyter", SMALL))
    kubelet.create_pod("reserved", {"main": {SMALL: 1}}, namespace="research")  # held, never used
    driver.inject_xid(other, 48)  # a double-bit ECC error: the GPU's devices turn Unhealthy

    queries = [(panel, target, concrete(target["expr"])) for panel in panels() for target in panel["targets"]]
    missing: list[str] = []

    def all_answer() -> bool:
        missing[:] = [f"{panel['title']}: {expr}" for panel, _, expr in queries if not prometheus.query(expr)]
        return not missing

    try:
        wait_until(all_answer, 60, "every panel's query to return data")
    except TimeoutError:
        pytest.fail("panels without data:\n" + "\n".join(missing))

    driver.inject_xid(other, 48)  # a second one, once Prometheus has the counter: an increase it can see
    wait_until(
        lambda: prometheus.query(concrete('increase(tessera_gpu_xid_errors_total{Hostname=~"$node"}[1h]) > 0')),
        20,
        "the XID panel to count the second XID",
    )
    unhealthy = next(t["expr"] for p in panels() if p["title"] == "Unhealthy devices" for t in p["targets"])
    assert any(float(r["value"][1]) > 0 for r in prometheus.query(concrete(unhealthy)))
    idle = prometheus.query(concrete('tessera_pod_device_idle{Hostname=~"$node"} == 1'))
    assert {r["metric"]["pod"] for r in idle} >= {quiet.name, "reserved"}
    assert busy.name not in {r["metric"]["pod"] for r in idle}

    out = os.environ.get("TESSERA_DASHBOARD_DATA")
    if out:
        wait_until(lambda: time.time() - started > 30, 40, "half a minute of data for the picture")
        Path(out).write_text(json.dumps({"panels": ranges(prometheus, started)}, indent=1))


def ranges(prometheus: Prometheus, started: float) -> list[dict]:
    """Each panel's queries over the run, one point a second, with Grafana's legends."""
    data = []
    for panel in panels():
        series = []
        for target in panel["targets"]:
            query = {"query": concrete(target["expr"]), "start": str(started), "end": str(time.time()), "step": "1"}
            for entry in prometheus.api("/api/v1/query_range", **query)["result"]:
                labels = entry["metric"]
                legend = re.sub(
                    r"\{\{\s*(\w+)\s*\}\}", lambda m, labels=labels: labels.get(m[1], ""), target["legendFormat"]
                )
                points = [[float(t), float(v)] for t, v in entry["values"]]
                series.append({"legend": legend or json.dumps(labels), "labels": labels, "points": points})
        unit = panel["fieldConfig"]["defaults"]["unit"]
        data.append({"title": panel["title"], "type": panel["type"], "unit": unit, "series": series})
    return data
