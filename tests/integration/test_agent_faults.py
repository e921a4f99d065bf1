"""Fault handling of the real ``Agent``, run in-process in a thread against a simulated driver.

Each test installs a simulated node beneath pynvml (``sim_node``), runs ``Agent(options).run()`` in a thread,
and watches what an operator would notice: the log lines, and what the kubelet (the emulator, or a tiny fake
``Registration`` server for the failure cases) sees. The subprocess end-to-end test covers the happy paths.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import yaml

from agent.agent import Agent, AgentOptions
from agent.api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from agent.cli import _parser
from agent.config.effective import Effective, effective
from agent.config.model import ConfigModel
from agent.config.source import load_config, read_config_set
from agent.core.allocation import VOLUME_MOUNT_ROOT, DeviceListStrategy
from agent.core.health import HealthPolicy
from agent.core.plan import plan
from agent.core.resources import MigStrategy
from agent.core.snapshot import AllocationOptions
from agent.gpu.discovery import discover
from agent.gpu.driver_root import DriverRoot
from agent.run import OptionsError, build_options
from agent.sim.driver_root import sim_driver_root
from agent.sim.kubelet import KubeletEmulator
from agent.sim.nvml.driver import SimDriver

GPU = "nvidia.com/gpu"
TWO_GPUS = {"name": "faults", "gpus": [{"model": "A100-SXM4-80GB", "count": 2}]}

# ----------------------------------------------------------------------------------------------------- helpers


def _poll(predicate: Callable[[], bool], timeout: float = 5.0, what: str | Callable[[], str] = "condition") -> None:
    """Wait until ``predicate()`` is true, checking every 20 ms; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    tick = threading.Event()
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what() if callable(what) else what}")
        tick.wait(0.02)


def _never(predicate: Callable[[], bool], seconds: float, what: str) -> None:
    """Check over ``seconds`` that ``predicate()`` never becomes true (a bounded window, polled every 20 ms)."""
    deadline = time.monotonic() + seconds
    tick = threading.Event()
    while time.monotonic() < deadline:
        assert not predicate(), what
        tick.wait(0.02)
    assert not predicate(), what


def _lines(caplog: pytest.LogCaptureFixture, text: str, level: int = logging.DEBUG) -> list[str]:
    """Messages of the agent's own loggers that contain ``text``."""
    return [
        r.getMessage()
        for r in list(caplog.records)
        if r.name.startswith("agent.") and not r.name.startswith("agent.sim") and r.levelno >= level
        if text in r.getMessage()
    ]


def _cli_args(*argv: str) -> argparse.Namespace:
    """``tessera run`` flags as the CLI parses them (env twins are read when the parser is built)."""
    return _parser().parse_args(["run", *argv])


def _short_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="f", dir="/tmp"))  # unix socket paths are limited to 107 bytes


@dataclass
class Harness:
    """A short socket directory, the agents and kubelets started in it; everything stopped at the end."""

    base: Path
    agents: list[tuple[Agent, threading.Thread, list[BaseException]]] = field(default_factory=list)
    kubelets: list[KubeletEmulator] = field(default_factory=list)
    cleanups: list[Callable[[], None]] = field(default_factory=list)

    @property
    def plugin_dir(self) -> Path:
        return self.base / "dp"

    def options(self, **overrides: object) -> AgentOptions:
        values: dict[str, object] = {
            "device_plugin_dir": self.plugin_dir,
            "pod_resources_socket": self.base / "pr.sock",
        }
        values.update(overrides)
        return AgentOptions(**values)  # type: ignore[arg-type]

    def kubelet(self, *, start: bool = True, **options: object) -> KubeletEmulator:
        kubelet = KubeletEmulator(self.plugin_dir, dial_timeout=2.0, **options)  # type: ignore[arg-type]
        self.kubelets.append(kubelet)
        if start:
            kubelet.start()
        return kubelet

    def agent(self, options: AgentOptions | None = None, **overrides: object) -> Agent:
        agent = Agent(options or self.options(**overrides))
        errors: list[BaseException] = []

        def run() -> None:
            try:
                agent.run()
            except BaseException as error:
                errors.append(error)
                raise

        thread = threading.Thread(target=run, name="agent-under-test", daemon=True)
        self.agents.append((agent, thread, errors))
        thread.start()
        assert agent.started.wait(10), f"the agent did not start: {errors}"
        return agent

    def stop_agents(self) -> None:
        for agent, thread, errors in self.agents:
            agent.stop()
            thread.join(15)
            assert not thread.is_alive(), "the agent thread did not stop within 15 s"
            assert not errors, f"the agent thread failed: {errors!r}"
        self.agents.clear()

    def close(self) -> None:
        try:
            self.stop_agents()
        finally:
            for kubelet in self.kubelets:
                kubelet.stop()
            for cleanup in reversed(self.cleanups):
                cleanup()
            shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture
def harness(caplog: pytest.LogCaptureFixture, sim_node) -> Iterator[Harness]:
    # sim_node first: the simulated driver must outlive the agent, which is stopped here
    caplog.set_level(logging.INFO)
    h = Harness(_short_dir())
    try:
        yield h
    finally:
        h.close()


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No TESSERA_* / DP_* variables from the developer's shell leak into the flags under test."""
    for name in list(os.environ):
        if name.startswith(("TESSERA_", "DP_")):
            monkeypatch.delenv(name)


def _registered(kubelet: KubeletEmulator, resource: str, count: int) -> Callable[[], bool]:
    return lambda: resource in kubelet.resources() and kubelet.allocatable(resource) == count


def _health(kubelet: KubeletEmulator, driver: SimDriver, index: int, resource: str = GPU) -> str | None:
    return kubelet.devices(resource).get(driver.gpus[index].uuid)


# ------------------------------------------------------------------------------------ 1. kubelet absent at start


def test_waits_quietly_for_an_absent_kubelet_then_registers(harness: Harness, sim_node, caplog) -> None:
    sim_node(TWO_GPUS)
    harness.plugin_dir.mkdir()
    agent = harness.agent()
    _poll(lambda: _lines(caplog, "waiting for the kubelet"), what="the agent to say it waits for the kubelet")
    _never(lambda: len(_lines(caplog, "waiting for the kubelet")) > 1, 1.0, "'waiting for the kubelet' repeated")
    assert not agent.status.kubelet_present and not agent.status.registered
    assert not _lines(caplog, "registration failed")  # nothing was tried while no kubelet was there

    kubelet = harness.kubelet()  # deletes the agent's sockets first, as the kubelet's Start does
    kubelet.wait_for(_registered(kubelet, GPU, 2), timeout=5, what="nvidia.com/gpu registered")
    _poll(lambda: agent.status.registered == {GPU}, what="the agent to record the registration")
    assert kubelet.options(GPU).get_preferred_allocation_available
    assert len(_lines(caplog, "waiting for the kubelet")) == 1


# ------------------------------------------------------------------------ 2. kubelet refuses the registration


REFUSAL = 'requested API version "v1alpha" is not supported by kubelet. Supported version is ["v1beta1"]'


class FlakyRegistration(api_pb2_grpc.RegistrationServicer):
    """A kubelet that refuses the first ``failures`` registrations, then dials the plugin back and accepts."""

    def __init__(self, plugin_dir: Path, failures: int) -> None:
        self.plugin_dir = plugin_dir
        self.failures = failures
        self.calls: list[tuple[float, api_pb2.RegisterRequest]] = []
        self.dialled_options: list[api_pb2.DevicePluginOptions] = []
        self._lock = threading.Lock()

    def Register(self, request: api_pb2.RegisterRequest, context: grpc.ServicerContext) -> api_pb2.Empty:
        with self._lock:
            self.calls.append((time.monotonic(), request))
            refuse = len(self.calls) <= self.failures
        if refuse:
            context.abort(grpc.StatusCode.UNKNOWN, REFUSAL)
        with grpc.insecure_channel(f"unix://{self.plugin_dir / request.endpoint}") as channel:
            options = api_pb2_grpc.DevicePluginStub(channel).GetDevicePluginOptions(api_pb2.Empty(), timeout=5)
        with self._lock:
            self.dialled_options.append(options)
        return api_pb2.Empty()


def _serve_registration(harness: Harness, servicer: api_pb2_grpc.RegistrationServicer) -> None:
    executor = futures.ThreadPoolExecutor(2, thread_name_prefix="fake-kubelet")
    server = grpc.server(executor)
    api_pb2_grpc.add_RegistrationServicer_to_server(servicer, server)
    assert server.add_insecure_port(f"unix://{harness.plugin_dir / 'kubelet.sock'}")
    server.start()

    def stop() -> None:
        server.stop(None).wait(5)
        executor.shutdown(wait=True)

    harness.cleanups.append(stop)


def test_refused_registration_is_retried_with_growing_backoff(harness: Harness, sim_node, caplog) -> None:
    sim_node(TWO_GPUS)
    harness.plugin_dir.mkdir()
    fake = FlakyRegistration(harness.plugin_dir, failures=2)
    _serve_registration(harness, fake)
    agent = harness.agent()
    _poll(lambda: agent.status.registered == {GPU}, timeout=10, what="the third attempt to succeed")

    assert len(fake.calls) == 3
    (t1, _), (t2, _), (t3, _) = fake.calls
    assert t2 - t1 >= 0.4, "the first retry came without a backoff"
    assert t3 - t2 >= (t2 - t1) + 0.3, f"backoff did not grow: {t2 - t1:.2f} s then {t3 - t2:.2f} s"
    failures = _lines(caplog, "registration failed", logging.WARNING)
    assert len(failures) == 1, failures  # the same refusal again is not repeated
    assert REFUSAL in failures[0]  # the kubelet's own words
    assert f"resource={GPU}" in failures[0] and "retry_in=" in failures[0]
    assert _lines(caplog, f"registered resource={GPU} attempt=3")

    for _, request in fake.calls:
        assert request.version == "v1beta1"
        assert request.endpoint == "nvidia-gpu.sock" and "/" not in request.endpoint
        assert request.resource_name == GPU
        assert request.options.get_preferred_allocation_available
        assert not request.options.pre_start_required
    assert fake.dialled_options[0] == fake.calls[-1][1].options  # the same options in both places


# --------------------------------------------------------------------------- 3. device-plugin directory missing


def test_missing_plugin_directory_is_reported_once_then_served(harness: Harness, sim_node, caplog) -> None:
    sim_node(TWO_GPUS)
    agent = harness.agent()
    _poll(lambda: _lines(caplog, "device-plugin directory does not exist"), what="the missing-directory error")
    _never(lambda: len(_lines(caplog, "device-plugin directory does not exist")) > 1, 0.5, "the error was repeated")
    (error,) = _lines(caplog, "device-plugin directory does not exist", logging.ERROR)
    assert str(harness.plugin_dir) in error
    assert "--device-plugin-dir" in error and "hostPath" in error  # the fix
    assert not _lines(caplog, "cannot serve", logging.ERROR)

    harness.plugin_dir.mkdir()
    kubelet = harness.kubelet(cleanup_on_start=False)  # no socket deletion racing the agent's first serve
    kubelet.wait_for(_registered(kubelet, GPU, 2), timeout=5, what="served and registered once the directory exists")
    assert (harness.plugin_dir / "nvidia-gpu.sock").is_socket()
    assert _lines(caplog, "device-plugin directory is there")
    assert len(_lines(caplog, "device-plugin directory does not exist")) == 1
    assert not _lines(caplog, "plugin socket removed")  # it was never served, so nothing was removed
    _poll(lambda: agent.status.registered == {GPU}, what="the agent to record the registration")


def test_a_socket_path_that_cannot_be_served_is_reported_once(harness: Harness, sim_node, caplog) -> None:
    """Something else sits where the plugin socket goes: one error, no crash, served once it is gone."""
    sim_node(TWO_GPUS)
    blocker = harness.plugin_dir / "nvidia-gpu.sock"
    blocker.mkdir(parents=True)
    agent = harness.agent()
    _poll(lambda: _lines(caplog, "cannot serve"), what="the agent to say it cannot serve")
    _never(lambda: len(_lines(caplog, "cannot serve")) > 1, 0.5, "'cannot serve' repeated every tick")
    (error,) = _lines(caplog, "cannot serve", logging.ERROR)
    assert f"resource={GPU}" in error and str(blocker) in error
    assert not _lines(caplog, "plugin socket removed")  # it never existed

    blocker.rmdir()
    kubelet = harness.kubelet()
    kubelet.wait_for(_registered(kubelet, GPU, 2), timeout=5, what="served and registered once the path is free")
    _poll(lambda: agent.status.registered == {GPU}, what="the agent to record the registration")


def test_a_socket_path_too_long_does_not_crash_the_agent(harness: Harness, sim_node, caplog) -> None:
    sim_node(TWO_GPUS)
    long_dir = harness.base / ("d" * 100)
    long_dir.mkdir()
    agent = harness.agent(device_plugin_dir=long_dir)
    _poll(lambda: _lines(caplog, "cannot serve"), what="the agent to say it cannot serve")
    _never(lambda: len(_lines(caplog, "cannot serve")) > 1, 0.5, "'cannot serve' repeated every tick")
    assert str(long_dir / "nvidia-gpu.sock") in _lines(caplog, "cannot serve")[0]
    assert not agent.status.registered
    assert all(thread.is_alive() for _, thread, _ in harness.agents)


# ------------------------------------------------------------------------------------ 4. device-list strategies


@pytest.mark.parametrize(
    ("strategies", "expect"),
    [
        pytest.param((DeviceListStrategy.CDI_CRI,), "cdi", id="cdi-cri"),
        pytest.param((DeviceListStrategy.ENVVAR, DeviceListStrategy.VOLUME_MOUNTS), "mounts", id="envvar+mounts"),
        pytest.param((DeviceListStrategy.ENVVAR, DeviceListStrategy.CDI_CRI), "envvar+cdi", id="envvar+cdi-cri"),
        pytest.param((DeviceListStrategy.CDI_ANNOTATIONS,), "annotations", id="cdi-annotations"),
    ],
)
def test_device_list_strategy_shapes_the_allocate_response(
    harness: Harness, sim_node, strategies: tuple[DeviceListStrategy, ...], expect: str
) -> None:
    driver = sim_node(TWO_GPUS)
    kubelet = harness.kubelet()
    cdi_root = harness.base / "cdi"  # the device plugin's own spec goes there, the simulated driver's files in it
    driver_root = sim_driver_root(harness.base / "driver")
    harness.agent(allocation=AllocationOptions(strategies=strategies), cdi_root=cdi_root, driver_root=driver_root)
    kubelet.wait_for(_registered(kubelet, GPU, 2), timeout=5, what="registered")
    uuids = [driver.gpus[1].uuid, driver.gpus[0].uuid]
    (response,) = kubelet.allocate_raw(GPU, uuids).container_responses

    cdi = [d.name for d in response.cdi_devices]
    mounts = {(m.container_path, m.host_path) for m in response.mounts}
    names = [f"k8s.device-plugin.nvidia.com/gpu={u}" for u in uuids]  # the entries of the spec the agent wrote
    if expect != "mounts":
        spec = yaml.safe_load((cdi_root / "k8s.device-plugin.nvidia.com-gpu.yaml").read_text())
        assert {f"{spec['kind']}={d['name']}" for d in spec["devices"]} == set(names)
    visible = response.envs.get("NVIDIA_VISIBLE_DEVICES")
    annotations = dict(response.annotations)
    if expect == "cdi":  # NVIDIA: when every strategy is CDI, no NVIDIA_VISIBLE_DEVICES at all
        assert (cdi, visible, mounts, annotations) == (names, None, set(), {})
    elif expect == "mounts":  # volume-mounts overwrites the envvar value; one /dev/null mount per device
        assert (cdi, visible, annotations) == ([], VOLUME_MOUNT_ROOT, {})
        assert mounts == {(f"{VOLUME_MOUNT_ROOT}/{u}", "/dev/null") for u in uuids}
    elif expect == "envvar+cdi":
        assert (cdi, visible, mounts, annotations) == (names, ",".join(uuids), set(), {})
    else:  # the CDI names in one cdi.k8s.io/ annotation, nothing else
        assert (cdi, visible, mounts) == ([], None, set())
        ((key, value),) = annotations.items()
        assert key.startswith("cdi.k8s.io/") and value == ",".join(names)


def test_without_a_driver_a_cdi_allocate_is_refused_naming_the_fix_and_envvar_still_works(
    harness: Harness, sim_node
) -> None:
    driver = sim_node(TWO_GPUS)
    kubelet = harness.kubelet()
    nowhere = harness.base / "no-driver"
    cdi = AllocationOptions(strategies=(DeviceListStrategy.CDI_CRI,))
    harness.agent(allocation=cdi, cdi_root=harness.base / "cdi", driver_root=DriverRoot(nowhere))
    kubelet.wait_for(_registered(kubelet, GPU, 2), timeout=5, what="registered")
    with pytest.raises(grpc.RpcError) as refused:
        kubelet.allocate_raw(GPU, [driver.gpus[0].uuid])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"not found under the driver root {nowhere}" in refused.value.details()
    assert "--driver-root" in refused.value.details()
    assert not (harness.base / "cdi" / "k8s.device-plugin.nvidia.com-gpu.yaml").exists()


def test_with_node_wide_cdi_the_names_are_nvidia_ctks_and_no_spec_is_written(harness: Harness, sim_node) -> None:
    driver = sim_node(TWO_GPUS)
    kubelet = harness.kubelet()
    cdi = AllocationOptions(strategies=(DeviceListStrategy.CDI_CRI,))
    harness.agent(allocation=cdi, cdi_root=harness.base / "cdi", node_wide_cdi=True)  # no driver root needed
    kubelet.wait_for(_registered(kubelet, GPU, 2), timeout=5, what="registered")
    (response,) = kubelet.allocate_raw(GPU, [driver.gpus[0].uuid]).container_responses
    assert [d.name for d in response.cdi_devices] == [f"nvidia.com/gpu={driver.gpus[0].uuid}"]
    assert not (harness.base / "cdi").exists()


# ------------------------------------------------------------------------------------- 5. preferred allocation


@pytest.mark.parametrize(
    "islands",
    [
        pytest.param([[0, 1, 2, 3], [4, 5, 6, 7]], id="islands-per-socket"),
        pytest.param([[0, 1, 4, 5], [2, 3, 6, 7]], id="islands-across-sockets"),  # NVLink must beat NUMA
    ],
)
def test_preferred_allocation_keeps_a_pod_on_one_nvlink_island(
    harness: Harness, sim_node, islands: list[list[int]]
) -> None:
    driver = sim_node(
        {"name": "dgx-islands", "nvlink": islands, "numa_nodes": 2, "gpus": [{"model": "A100-SXM4-80GB", "count": 8}]}
    )
    index_of = {driver.gpus[i].uuid: i for i in range(8)}
    kubelet = harness.kubelet()
    harness.agent()
    kubelet.wait_for(_registered(kubelet, GPU, 8), timeout=5, what="registered")

    first = kubelet.create_pod("train-a", {"main": {GPU: 4}})
    picked = sorted(index_of[i] for i in first.containers["main"][GPU].device_ids)
    assert picked in islands, f"a 4-GPU pod straddles NVLink islands: {picked}"
    second = kubelet.create_pod("train-b", {"main": {GPU: 4}})
    assert sorted(index_of[i] for i in second.containers["main"][GPU].device_ids) in islands
    kubelet.delete_pod("train-a")
    kubelet.delete_pod("train-b")

    everything = list(kubelet.devices(GPU))
    member = driver.gpus[islands[1][2]].uuid  # a GPU of the second island
    answers = [
        list(kubelet.preferred_raw(GPU, everything, [member], 4).container_responses[0].deviceIDs) for _ in range(2)
    ]
    assert answers[0] == answers[1], "GetPreferredAllocation is not deterministic"
    assert member in answers[0]
    assert sorted(index_of[i] for i in answers[0]) == islands[1]


# ------------------------------------------------------------------------------------------ 6. XID policy


def test_xid_policy_from_flags_and_environment(clean_env: None) -> None:
    default = build_options(_cli_args(), {}).health
    assert not default.is_critical(13) and default.is_critical(48)

    enabled = build_options(_cli_args(), {"DP_ENABLE_HEALTHCHECKS": "13"}).health
    assert enabled.is_critical(13) and enabled.is_critical(48) and not enabled.is_critical(31)

    disabled = build_options(_cli_args(), {"DP_DISABLE_HEALTHCHECKS": "all"}).health
    assert not disabled.is_critical(48) and not disabled.is_critical(79)

    some_back = build_options(_cli_args(), {"DP_DISABLE_HEALTHCHECKS": "all", "DP_ENABLE_HEALTHCHECKS": "48"}).health
    assert some_back.is_critical(48) and not some_back.is_critical(79)

    replaced = build_options(_cli_args("--ignored-xids", "48"), {}).health
    assert not replaced.is_critical(48)
    assert replaced.is_critical(13) and replaced.is_critical(31)  # the defaults are replaced, not extended

    assert build_options(_cli_args("--health-recovery-seconds", "0"), {}).health.quiet_seconds is None


@pytest.mark.parametrize(
    ("argv", "environ", "xid", "critical"),
    [
        pytest.param((), {"DP_ENABLE_HEALTHCHECKS": "13"}, 13, True, id="DP_ENABLE_HEALTHCHECKS=13"),
        pytest.param((), {"DP_DISABLE_HEALTHCHECKS": "all"}, 48, False, id="DP_DISABLE_HEALTHCHECKS=all"),
        pytest.param(("--ignored-xids", "48"), {}, 48, False, id="ignored-xids=48"),
    ],
)
def test_xid_policy_decides_what_the_kubelet_sees(
    harness: Harness, sim_node, caplog, clean_env: None, argv, environ, xid: int, critical: bool
) -> None:
    driver = sim_node(TWO_GPUS)
    built = build_options(_cli_args("--device-plugin-dir", str(harness.plugin_dir), *argv), environ)
    kubelet = harness.kubelet()
    harness.agent(built)
    kubelet.wait_for(_registered(kubelet, GPU, 2), timeout=5, what="registered")

    driver.inject_xid(1, xid)
    if critical:
        kubelet.wait_for(lambda: _health(kubelet, driver, 1) == "Unhealthy", timeout=5, what=f"XID {xid} critical")
        # the kubelet hears of it first; the log line follows (the loop sends the device list before it logs)
        _poll(lambda: _lines(caplog, f"critical XID gpu={driver.gpus[1].uuid} xid={xid}", logging.WARNING),
              what="the critical XID logged")  # fmt: skip
    else:
        _poll(lambda: _lines(caplog, f"ignored XID gpu={driver.gpus[1].uuid} xid={xid}"), what="the XID to be ignored")
        assert not _lines(caplog, "critical XID")
        assert kubelet.allocatable(GPU) == 2
    assert _health(kubelet, driver, 0) == "Healthy"


# ----------------------------------------------------------------------------- 7. no recovery; MIG under none


def test_without_recovery_a_mig_xid_keeps_the_whole_gpu_unhealthy(harness: Harness, sim_node, caplog) -> None:
    driver = sim_node(
        {
            "name": "mig-none",
            "gpus": [
                {"model": "A100-SXM4-80GB", "mig": {"instances": ["3g.40gb", "1g.10gb", "1g.10gb"]}},
                {"model": "A100-SXM4-80GB"},
            ],
        }
    )
    assert build_options(_cli_args("--health-recovery-seconds", "0"), {}).health.quiet_seconds is None
    kubelet = harness.kubelet()
    harness.agent(mig_strategy=MigStrategy.NONE, health=HealthPolicy(quiet_seconds=None))
    kubelet.wait_for(_registered(kubelet, GPU, 2), timeout=5, what="both GPUs registered as whole GPUs")
    assert kubelet.resources() == [GPU]

    _, ci = driver.gpus[0].mig_devices()[1]
    driver.inject_xid(0, 48, mig_uuid=ci.uuid)
    kubelet.wait_for(lambda: _health(kubelet, driver, 0) == "Unhealthy", timeout=5, what="the MIG GPU Unhealthy")
    assert _health(kubelet, driver, 1) == "Healthy"
    with pytest.raises(TimeoutError):
        kubelet.wait_for(lambda: _health(kubelet, driver, 0) == "Healthy", timeout=1.0, what="a recovery")
    assert kubelet.allocatable(GPU) == 1
    assert not _lines(caplog, "recovered") and not _lines(caplog, "still unhealthy")  # never even probed


# --------------------------------------------------------------------------- 8. a GPU that never comes back


def test_a_lost_gpu_stays_unhealthy_without_flooding_the_log(harness: Harness, sim_node, caplog) -> None:
    driver = sim_node(TWO_GPUS)
    kubelet = harness.kubelet()
    quiet = 0.2
    harness.agent(health=HealthPolicy(quiet_seconds=quiet))
    kubelet.wait_for(_registered(kubelet, GPU, 2), timeout=5, what="registered")

    driver.lose_gpu(1)
    kubelet.wait_for(lambda: _health(kubelet, driver, 1) == "Unhealthy", timeout=5, what="the lost GPU Unhealthy")
    start = len(_lines(caplog, "still unhealthy"))
    window = 1.5
    with pytest.raises(TimeoutError):
        kubelet.wait_for(lambda: _health(kubelet, driver, 1) == "Healthy", timeout=window, what="a lost GPU healthy")
    still = _lines(caplog, "still unhealthy")[start:]
    assert still, "the failing probe was never reported"
    assert len(still) <= window / quiet + 1, f"{len(still)} 'still unhealthy' lines in {window} s"
    assert all(f"unit={driver.gpus[1].uuid}" in line and "GPU_IS_LOST" in line for line in still)
    assert len(_lines(caplog, "critical XID", logging.WARNING)) == 1
    assert not _lines(caplog, "GPU lost")  # the liveness check does not report a GPU already known to be down
    assert _health(kubelet, driver, 0) == "Healthy"


# ---------------------------------------------------------------------------------- 9. nothing left behind


# The process's gRPC loop (agent/grpc_loop.py) and grpc.aio's poller start with the first server of the
# process and stay, idle, for the next one: shared by whatever runs in the process, like gRPC core's threads.
PROCESS_THREADS = ("grpc-loop", "(_poll_wrapper)")


def _threads() -> set[str]:
    return {f"{t.name}#{t.ident}" for t in threading.enumerate() if not any(p in t.name for p in PROCESS_THREADS)}


def _thread_count() -> int:
    return len(_threads())


def test_stop_leaves_no_threads_or_sockets(harness: Harness, sim_node) -> None:
    sim_node(
        {
            "name": "leaks",
            "gpus": [
                {"model": "A100-SXM4-80GB", "mig": {"instances": ["3g.40gb", "1g.10gb"]}},
                {"model": "A100-SXM4-80GB"},
            ],
        }
    )
    baseline, before = _thread_count(), _threads()
    kubelet = harness.kubelet()
    agent = harness.agent(mig_strategy=MigStrategy.MIXED)
    resources = {GPU, "nvidia.com/mig-1g.10gb", "nvidia.com/mig-3g.40gb"}
    kubelet.wait_for(lambda: set(kubelet.resources()) == resources, timeout=5, what="three resources")
    _poll(lambda: agent.status.registered == resources, what="all registered")
    kubelet.create_pod("p", {"main": {GPU: 1}})
    assert len(list(harness.plugin_dir.glob("nvidia-*.sock"))) == 3

    harness.stop_agents()
    assert not list(harness.plugin_dir.glob("nvidia-*.sock"))
    kubelet.stop()
    _poll(
        lambda: _thread_count() <= baseline,
        timeout=5,
        what=lambda: f"threads back to {baseline} (left: {sorted(_threads() - before)})",
    )


# ------------------------------------------------------------------------------------- 10. tessera run: bad input


def _tessera_run(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TESSERA_", "DP_"))}
    command = [sys.executable, "-m", "agent", "run", "--device-plugin-dir", str(cwd / "dp"), *argv]
    return subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=20, cwd=Path(__file__).parents[2], check=False
    )


@pytest.fixture
def scratch() -> Iterator[Path]:
    path = _short_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_cli_rejects_a_bad_device_list_strategy(scratch: Path) -> None:
    result = _tessera_run("--device-list-strategy", "bogus", "--simulate", "t4x4", cwd=scratch)
    assert result.returncode == 2, result.stderr
    assert "bogus" in result.stderr
    for allowed in ("envvar", "volume-mounts", "cdi-cri", "cdi-annotations"):
        assert allowed in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_rejects_an_unknown_preset(scratch: Path) -> None:
    result = _tessera_run("--simulate", "no-such-preset", cwd=scratch)
    assert result.returncode == 2, result.stderr
    assert "no-such-preset" in result.stderr
    for preset in ("dgx-a100", "dgx-h100", "a100-mig", "t4x4"):
        assert preset in result.stderr
    assert "Traceback" not in result.stderr


def test_a_config_of_another_version_is_reported_and_the_agent_keeps_running(scratch: Path) -> None:
    """No crash loop: the agent logs the field and the fix, advertises nothing, and stops cleanly."""
    config = scratch / "config.yaml"
    config.write_text("version: v2\nflags:\n  migStrategy: mixed\n")
    checked = subprocess.run(
        [sys.executable, "-m", "agent", "validate", str(config)], capture_output=True, text=True, check=False
    )
    assert checked.returncode == 1
    assert "version: unknown version: v2" in checked.stdout
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TESSERA_", "DP_"))}
    (scratch / "dp").mkdir()
    command = [
        sys.executable, "-m", "agent", "run", "--device-plugin-dir", str(scratch / "dp"),
        "--config", str(config), "--simulate", "t4x4",
    ]  # fmt: skip
    log_path = scratch / "agent.log"
    with log_path.open("w") as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 20
        while "config rejected" not in log_path.read_text() and time.monotonic() < deadline:
            assert process.poll() is None, log_path.read_text()
            time.sleep(0.05)
        log = log_path.read_text()
        assert "unknown version: v2" in log and "advertising nothing until fixed" in log
        assert not list((scratch / "dp").glob("nvidia-*.sock"))
    finally:
        process.terminate()
        assert process.wait(timeout=10) == 0


def test_config_file_flags_are_honoured_and_flags_win(
    scratch: Path, sim_node, clean_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = scratch / "config.yaml"
    config.write_text("version: v1\nflags:\n  migStrategy: mixed\n  plugin:\n    deviceListStrategy: cdi-cri\n")
    sim_node(
        {
            "name": "cfg",
            "gpus": [
                {"model": "A100-SXM4-80GB", "mig": {"instances": ["1g.10gb", "1g.10gb"]}},
                {"model": "A100-SXM4-80GB"},
            ],
        }
    )
    inventory = discover()

    def chosen(*argv: str) -> Effective:
        options = build_options(_cli_args(*argv), {})
        model = load_config(read_config_set(options.config_path)).model if options.config_path else ConfigModel()
        return effective(model, options.overrides)

    def resources(settings: Effective) -> list[str]:
        return [r.name for r in plan(settings.plan, inventory).resources]

    from_file = chosen("--config", str(config))
    assert from_file.plan.mig_strategy is MigStrategy.MIXED
    assert from_file.allocation.strategies == (DeviceListStrategy.CDI_CRI,)
    assert resources(from_file) == [GPU, "nvidia.com/mig-1g.10gb"]

    flag_wins = chosen("--config", str(config), "--mig-strategy", "none")
    assert flag_wins.plan.mig_strategy is MigStrategy.NONE
    assert resources(flag_wins) == [GPU]
    both = chosen("--config", str(config), "--device-list-strategy", "envvar,volume-mounts")
    assert both.allocation.strategies == (DeviceListStrategy.ENVVAR, DeviceListStrategy.VOLUME_MOUNTS)
    assert chosen("--device-list-strategy", "cdi-cri").allocation == AllocationOptions(
        strategies=(DeviceListStrategy.CDI_CRI,)
    )

    monkeypatch.setenv("TESSERA_MIG_STRATEGY", "single")  # the env twin counts as a flag too
    assert chosen("--config", str(config)).plan.mig_strategy is MigStrategy.SINGLE

    with pytest.raises(OptionsError, match="device-list-strategy"):
        build_options(_cli_args("--device-list-strategy", ","), {})
