"""The shipped alert rules against a real Prometheus scraping a real agent.

``promtool`` checks the rules file and lints a real scrape; then a Prometheus server (Debian's ``prometheus``
package, installed by ``.ci/install-prometheus.sh``) scrapes an in-process agent every second on loopback
and evaluates the shipped rules, and the test produces each condition on the simulated node (an XID, a
killed MPS daemon, an idle pod, a full GPU, a broken config) and watches the alert fire through Prometheus'
HTTP API. The tests that need the binaries skip when they are missing; the check that the plain rules file
and the PrometheusRule hold the same groups always runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from agent.memlimits.settings import MemoryLimitSettings
from agent.sim.kubelet import Pod
from tests.integration.test_telemetry import (
    GPU,
    HOST,
    MIG_LAYOUT,
    NODE,
    SMALL,
    TIME_SLICED,
    TelemetryNode,
    documented,
    gpu_of,
    held_device,
    wait_until,
)

ALERTS = Path(__file__).resolve().parents[2] / "deploy" / "alerts"
RULES = ALERTS / "tessera-rules.yaml"
OPERATOR_RULES = ALERTS / "prometheusrule.yaml"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (Debian package 'prometheus'; see .ci/install-prometheus.sh)"
)
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None or PROMTOOL is None,
    reason="prometheus/promtool not installed (Debian package 'prometheus'; see .ci/install-prometheus.sh)",
)
MPS = (
    "version: v1\nflags: {migStrategy: mixed, mpsRoot: '@BASE@/mps'}\n"
    "sharing:\n  mps:\n    resources:\n      - name: nvidia.com/gpu\n        replicas: 4\n" + MIG_LAYOUT
)
SEVERITIES = {"critical", "warning", "info"}
MIB = 1 << 20


def shipped_groups() -> list[dict]:
    return yaml.safe_load(RULES.read_text())["groups"]


def alerts_of(groups: list[dict]) -> dict[str, dict]:
    return {rule["alert"]: rule for group in groups for rule in group["rules"]}


# ----- the rule files themselves -------------------------------------------------------------------------------


def test_the_rules_file_and_the_prometheusrule_hold_the_same_groups() -> None:
    plain = shipped_groups()
    operator = yaml.safe_load(OPERATOR_RULES.read_text())
    assert operator["apiVersion"] == "monitoring.coreos.com/v1" and operator["kind"] == "PrometheusRule"
    assert operator["metadata"]["name"] == "tessera"
    assert operator["spec"]["groups"] == plain, "edit deploy/alerts/tessera-rules.yaml and prometheusrule.yaml together"


def test_every_alert_has_a_severity_annotations_and_documented_metrics() -> None:
    metrics = documented()
    alerts = alerts_of(shipped_groups())
    assert {
        "TesseraDeviceUnhealthy",
        "TesseraMPSDaemonDown",
        "TesseraMPSDaemonRestarting",
        "TesseraMIGLayoutPending",
        "TesseraMIGLayoutFailed",
        "TesseraMIGResetRequired",
        "TesseraConfigInvalid",
        "TesseraAllocatedDeviceIdle",
        "TesseraGPUMemoryPressure",
    } <= set(alerts)
    docs = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    for name, rule in alerts.items():
        assert rule["labels"]["severity"] in SEVERITIES, name
        assert {"summary", "description"} <= set(rule["annotations"]), name
        assert "$labels.Hostname" in rule["annotations"]["summary"], name
        used = set(re.findall(r"\btessera_\w+", rule["expr"]))
        assert used and used <= set(metrics), (name, used - set(metrics))
        assert f"`{name}`" in docs, f"{name} is not in docs/metrics.md"
    for name in ("TesseraDeviceUnhealthy", "TesseraAllocatedDeviceIdle"):
        description = alerts[name]["annotations"]["description"]
        assert all(f"$labels.{label}" in description for label in ("pod", "namespace", "device_id")), name


@needs_promtool
def test_promtool_accepts_the_rules() -> None:
    result = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts_of(shipped_groups()))} rules found" in result.stdout


# ----- a real scrape ----------------------------------------------------------------------------------------------


@pytest.fixture
def node(sim_node) -> Iterator[TelemetryNode]:
    node = TelemetryNode.create(sim_node(NODE), TIME_SLICED)
    node.kubelet.start()
    try:
        node.start_agent()
        node.wait_registered()
        yield node
    finally:
        node.stop()


@needs_promtool
def test_promtool_lints_a_real_scrape(node: TelemetryNode) -> None:
    pod = node.kubelet.create_pod("lint", {"main": {GPU: 1}})
    node.run_process(pod, gpu_of(node, held_device(pod, "main", GPU)), 4100, 512)
    node.driver.inject_xid(1, 48)
    text = (
        node.wait_samples(
            lambda s: s.get("tessera_pod_gpu_memory_used_bytes") and s.get("tessera_gpu_xid_errors_total"), 5, "series"
        )
        and node.text()
    )

    def lint(exposition: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [PROMTOOL, "check", "metrics"], input=exposition, capture_output=True, text=True, timeout=30
        )

    # The one finding is deliberate: dcgm-exporter's label `modelName` is camelCase, and Tessera keeps
    # dcgm-exporter's names so its dashboards and alerts carry over. Everything else is clean:
    result = lint(text)
    findings = (result.stdout + result.stderr).splitlines()
    with_model = {line.split("{", 1)[0] for line in text.splitlines() if "modelName=" in line}
    assert findings and all(
        line.endswith("label names should be written in 'snake_case' not 'camelCase'") and line.split()[0] in with_model
        for line in findings
    ), findings
    renamed = lint(text.replace("modelName=", "model_name="))
    assert renamed.returncode == 0 and not (renamed.stdout + renamed.stderr).strip(), renamed.stdout + renamed.stderr


# ----- a real Prometheus --------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def shortened(groups: list[dict]) -> list[dict]:
    """The shipped rules with every ``for:`` at 1 s and every range or offset at 10 s, for a test that has
    seconds, not hours. The expressions are otherwise the shipped ones, byte for byte."""
    duration = re.compile(r"(\[|offset )\d+[smhdwy]\]?")
    out = []
    for group in groups:
        rules = []
        for rule in group["rules"]:
            copy = dict(rule)
            copy["expr"] = duration.sub(lambda m: "[10s]" if m[1] == "[" else "offset 10s", rule["expr"])
            assert duration.sub("D", copy["expr"]) == duration.sub("D", rule["expr"])  # only durations changed
            if "for" in copy:
                copy["for"] = "1s"
            rules.append(copy)
        out.append({**group, "rules": rules})
    return out


class Prometheus:
    """A Prometheus server on loopback with its own config, rules and TSDB in ``directory``."""

    def __init__(self, directory: Path, target_port: int) -> None:
        directory.mkdir()
        self.directory = directory
        self.port = free_port()
        # a copy of the shipped rules with `for:` and windows in seconds; the expressions are the shipped ones
        (directory / "rules.yaml").write_text(yaml.safe_dump({"groups": shortened(shipped_groups())}, sort_keys=False))
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(directory / "rules.yaml")],
            "scrape_configs": [{"job_name": "tessera", "static_configs": [{"targets": [f"127.0.0.1:{target_port}"]}]}],
        }
        (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
        check = subprocess.run(
            [PROMTOOL, "check", "config", str(directory / "prometheus.yml")], capture_output=True, text=True, timeout=30
        )
        assert check.returncode == 0, check.stdout + check.stderr
        self.log = directory / "prometheus.log"
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={directory / 'prometheus.yml'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    f"--storage.tsdb.path={directory / 'data'}",
                    "--storage.tsdb.retention.time=1h",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)

    def api(self, path: str, **params: str) -> object:
        url = f"http://127.0.0.1:{self.port}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=5) as response:
            reply = json.load(response)
        assert reply["status"] == "success", reply
        return reply["data"]

    def ready(self) -> bool:
        assert self.process.poll() is None, f"prometheus exited: {self.log.read_text()[-2000:]}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def query(self, promql: str) -> list[dict]:
        return self.api("/api/v1/query", query=promql)["result"]

    def alerts(self) -> list[dict]:
        return self.api("/api/v1/alerts")["alerts"]


class FiringLog:
    """Every alert seen firing so far: alertname -> list of (labels, annotations)."""

    def __init__(self, prometheus: Prometheus) -> None:
        self.prometheus = prometheus
        self.seen: dict[str, list[tuple[dict[str, str], dict[str, str]]]] = {}

    def poll(self) -> None:
        for alert in self.prometheus.alerts():
            if alert["state"] == "firing":
                entry = (alert["labels"], alert["annotations"])
                if entry not in self.seen.setdefault(alert["labels"]["alertname"], []):
                    self.seen[alert["labels"]["alertname"]].append(entry)

    def wait(self, name: str, timeout: float, **labels: str) -> tuple[dict[str, str], dict[str, str]]:
        def matching() -> list[tuple[dict[str, str], dict[str, str]]]:
            self.poll()
            return [e for e in self.seen.get(name, []) if all(e[0].get(k) == v for k, v in labels.items())]

        found = wait_until(matching, timeout, f"alert {name} {labels} firing")
        return found[0]


@pytest.fixture
def world(sim_node, mps_bin: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[TelemetryNode, Prometheus, Path]]:
    monkeypatch.setenv("PATH", f"{mps_bin}{os.pathsep}{os.environ.get('PATH', '')}")  # the agent finds it with which
    # driver r615 and cgroups for started containers: the agent holds MPS replicas' containers to their memory
    node = TelemetryNode.create(sim_node({**NODE, "driver_version": "615.71.09"}), MPS, cgroups=True)
    prometheus: Prometheus | None = None
    try:
        node.kubelet.start()
        node.start_agent(memory_limits=MemoryLimitSettings(node.base / "cgroup", node.base / "log" / "containers"))
        node.wait_registered(timeout=30)
        for attempt in range(3):
            prometheus = Prometheus(node.base / f"prometheus-{attempt}", node.port)
            try:
                wait_until(prometheus.ready, 30, "prometheus ready")
                break
            except AssertionError:  # it exited: retry only if another process took its free port meanwhile
                if attempt == 2 or "address already in use" not in prometheus.log.read_text():
                    raise
        yield node, prometheus, mps_bin
    finally:
        if prometheus is not None:
            prometheus.stop()
        node.stop()
        for pid_file in (node.base / "mps").glob("**/nvidia-cuda-mps-control.pid"):
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)  # stopping the agent leaves its daemons


def daemon_pid(node: TelemetryNode) -> int:
    return int((node.base / "mps" / GPU / "pipe" / "nvidia-cuda-mps-control.pid").read_text())


@needs_prometheus
def test_prometheus_scrapes_pod_series_and_the_shipped_rules_fire(world) -> None:
    node, prometheus, mps_bin = world
    kubelet, driver = node.kubelet, node.driver
    driver.set_utilization(2, 80)
    idle: Pod = kubelet.create_pod("idle-notebook", {"jupyter": {GPU: 1}}, namespace="research")
    busy: Pod = kubelet.create_pod("trainer", {"main": {GPU: 1}}, namespace="ml")
    assert [gpu_of(node, held_device(p, c, GPU)) for p, c in ((idle, "jupyter"), (busy, "main"))] == [1, 2]
    node.run_process(busy, 2, 7100, 76000, sm=80)  # 76000 of 81920 MiB: over 90 %; its own process works
    kubelet.create_pod("small", {"main": {SMALL: 1}}, namespace="research")

    # pod-attributed series arrive, with Prometheus' job and instance added to Tessera's labels
    (held,) = wait_until(
        lambda: prometheus.query('tessera_device_allocated{pod="idle-notebook"} == 1'), 15, "the pod's series"
    )
    assert held["metric"]["namespace"] == "research" and held["metric"]["container"] == "jupyter"
    assert held["metric"]["device_id"] == held_device(idle, "jupyter", GPU) and held["metric"]["resource"] == GPU
    assert held["metric"]["Hostname"] == HOST and held["metric"]["job"] == "tessera"
    (memory,) = wait_until(
        lambda: prometheus.query('tessera_pod_gpu_memory_used_bytes{pod="trainer"}'), 10, "per-pod memory"
    )
    assert float(memory["value"][1]) == 76000 * MIB and memory["metric"]["gpu"] == "2"
    (small,) = prometheus.query('tessera_device_allocated{pod="small"}')
    assert small["metric"]["GPU_I_PROFILE"] == "1g.10gb"

    firing = FiringLog(prometheus)
    # an idle pod (GPU 1 at 0 %), not the busy one (GPU 2 at 80 %)
    labels, annotations = firing.wait("TesseraAllocatedDeviceIdle", 20, pod="idle-notebook")
    assert labels["namespace"] == "research" and labels["severity"] == "info"
    assert "research/idle-notebook" in annotations["summary"] and HOST in annotations["summary"]
    assert held_device(idle, "jupyter", GPU) in annotations["description"]
    labels, annotations = firing.wait("TesseraGPUMemoryPressure", 15, gpu="2")
    assert re.search(r"GPU 2 on \S+ is 9\d(\.\d+)?% full", annotations["summary"]) and labels["severity"] == "warning"

    # an XID on the idle pod's GPU: counted, and the devices turn Unhealthy
    driver.inject_xid(1, 48)
    firing.wait("TesseraGPUXidErrors", 15, gpu="1", xid="48")
    labels, annotations = firing.wait("TesseraDeviceUnhealthy", 15, pod="idle-notebook")
    assert labels["device_id"] == held_device(idle, "jupyter", GPU) and labels["gpu"] == "1"
    assert "research/idle-notebook" in annotations["description"]

    # the MPS daemon is killed, and cannot come back: the control binary now fails
    launcher = mps_bin / "nvidia-cuda-mps-control"
    launcher.write_text("#!/bin/sh\necho 'nvidia-cuda-mps-control: broken by the test' >&2\nexit 1\n")
    os.kill(daemon_pid(node), signal.SIGKILL)
    labels, annotations = firing.wait("TesseraMPSDaemonRestarting", 15, resource=GPU)
    assert labels["Hostname"] == HOST and labels["daemon"] in annotations["summary"]
    firing.wait("TesseraMPSDaemonDown", 15, resource=GPU)
    firing.wait("TesseraDeviceUnhealthy", 15, gpu="2")  # the dead daemon's devices

    # a broken config: the last good one stays in force, the alert says so
    (node.base / "config.yaml").write_text("version: v1\nsharing: {mps: {resources: [{name: nvidia.com/gpu}]}}\n")
    firing.wait("TesseraConfigInvalid", 15)

    # none of this made the busy pod idle, and rules about conditions not produced stayed quiet
    firing.poll()
    assert all(labels["pod"] != "trainer" for labels, _ in firing.seen["TesseraAllocatedDeviceIdle"])
    assert not {"TesseraGPUDown", "TesseraMIGLayoutFailed", "TesseraMIGResetRequired"} & set(firing.seen)
    assert prometheus.query('tessera_mig_config_state{state="success"} == 1')


def test_the_shortened_rules_only_change_durations() -> None:
    original, short = alerts_of(shipped_groups()), alerts_of(shortened(shipped_groups()))
    assert original.keys() == short.keys()
    for name, rule in short.items():
        assert rule.get("for") in (None, "1s")
        assert re.sub(r"\d+[smhdwy]", "D", rule["expr"]) == re.sub(r"\d+[smhdwy]", "D", original[name]["expr"])
    assert "[10s]" in short["TesseraAllocatedDeviceIdle"]["expr"]
    assert "offset 10s" in short["TesseraGPUXidErrors"]["expr"]
