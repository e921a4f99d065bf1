"""Sharing through DRA, as NVIDIA's ``GpuConfig`` asks for it in a claim: time-slicing per claim.

The agent (in process, on a simulated dgx-a100) prepares a claim whose opaque config time-slices its GPU: the
GPU's time-slice is set through ``nvidia-smi compute-policy`` (the emulator, ``agent.sim.smi``, reaching the
simulated node through its control socket) and reset to Default when the claim is unprepared.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.sim.kubelet.dra_common import PodStartError
from agent.sim.nvml.control import SimControlServer
from agent.sim.scheduler import allocate
from tests import cdi_devices

from . import test_dra_e2e
from .test_dra_e2e import DEADLINE, DRIVER, NODE, World

world = test_dra_e2e.world  # the fixture: an agent, both kubelets and the API server on a simulated dgx-a100
LEVELS = {"Default": 0, "Short": 1, "Medium": 2, "Long": 3}


def gpu_config(sharing: dict) -> dict:
    return {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig", "sharing": sharing}


@pytest.fixture
def smi(world: World, smi_bin: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """``nvidia-smi`` on PATH, reaching the world's simulated node."""
    control = SimControlServer(world.driver, tmp_path / "ctl.sock")
    control.start()
    monkeypatch.setenv("TESSERA_SIM_CONTROL", str(tmp_path / "ctl.sock"))
    monkeypatch.setenv("PATH", f"{smi_bin}:{os.environ['PATH']}")
    yield
    control.stop()


def shared_claim(world: World, name: str, parameters: dict) -> dict:
    """A claim for one whole GPU with ``parameters`` as its opaque config, allocated and stored."""
    world.api.wait_for(lambda: world.devices() == ["gpu-0", "gpu-1"], DEADLINE)
    world.dra.wait_for(lambda: DRIVER in world.dra.drivers(), DEADLINE, "the DRA driver registered")
    claim = world.api.create("resourceclaims", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}],
            "config": [{"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": parameters}}],
        }},
    })  # fmt: skip
    classes = {c["metadata"]["name"]: c for c in world.api.objects("deviceclasses")}
    return world.api.update("resourceclaims", allocate(claim, world.slices(), classes, set(), NODE), status=True)


def gpu_of(world: World, claim: dict) -> int:
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    return int(result["device"].removeprefix("gpu-"))


@pytest.mark.parametrize("interval", ["Short", "Medium", "Long"])
def test_a_time_slicing_claim_sets_its_gpus_time_slice_and_unprepare_resets_it(
    world: World, smi: None, interval: str
) -> None:
    claim = shared_claim(
        world, "ts", gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": interval}})
    )
    gpu = world.driver.gpus[gpu_of(world, claim)]
    world.dra.run_pod("default", "ts", "pod-1", [("gpu", "ts")], {"a": [("gpu", None)], "b": [("gpu", None)]})
    assert gpu.timeslice == LEVELS[interval]
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    test_dra_e2e.poll(
        lambda: any(c["devices"] == [{"device": result["device"], "timeslice": interval}]
                    for c in (world.agent.status.dra or {}).get("claims", [])),
        "the claim and its time-slice in the status",
    )  # fmt: skip
    world.dra.stop_pod("pod-1")
    assert gpu.timeslice == LEVELS["Default"]


def test_time_slicing_without_an_interval_is_nvidias_default(world: World, smi: None) -> None:
    claim = shared_claim(world, "ts", gpu_config({"strategy": "TimeSlicing"}))
    gpu = world.driver.gpus[gpu_of(world, claim)]
    gpu.timeslice = 2  # left by someone else
    world.dra.run_pod("default", "ts", "pod-1", [("gpu", "ts")], {"a": [("gpu", None)]})
    assert gpu.timeslice == LEVELS["Default"]


def test_a_gpu_in_another_compute_mode_goes_to_default_only_when_nothing_runs_on_it(world: World, smi: None) -> None:
    claim = shared_claim(
        world, "ts", gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}})
    )
    index = gpu_of(world, claim)
    gpu = world.driver.gpus[index]
    gpu.compute_mode = 3  # EXCLUSIVE_PROCESS
    world.driver.add_process(index, 4242, 512)
    with pytest.raises(PodStartError, match="processes 4242 run on it; its mode is not changed under them"):
        world.dra.run_pod("default", "ts", "pod-1", [("gpu", "ts")], {"a": [("gpu", None)]})
    assert (gpu.compute_mode, gpu.timeslice) == (3, 0)
    world.driver.remove_process(4242)
    world.dra.run_pod("default", "ts", "pod-1", [("gpu", "ts")], {"a": [("gpu", None)]})  # the kubelet retries
    assert (gpu.compute_mode, gpu.timeslice) == (0, 3)


def test_without_nvidia_smi_the_claim_fails_naming_the_fix_and_nothing_is_prepared(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    claim = shared_claim(
        world, "ts", gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}})
    )
    with pytest.raises(
        PodStartError, match=r"nvidia-smi not found; mount the host driver.s nvidia-smi.*nothing was left"
    ):
        world.dra.run_pod("default", "ts", "pod-1", [("gpu", "ts")], {"a": [("gpu", None)]})
    assert world.driver.gpus[gpu_of(world, claim)].timeslice == 0
    assert list((world.base / "cdi").glob("*.yaml")) == []


def test_an_mps_claim_without_the_mps_binary_fails_naming_the_fix_and_leaves_nothing(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    shared_claim(world, "mps", gpu_config({"strategy": "MPS"}))
    with pytest.raises(PodStartError, match=r"its MPS daemon .* is not ready: nvidia-cuda-mps-control not found"):
        world.dra.run_pod("default", "mps", "pod-1", [("gpu", "mps")], {"a": [("gpu", None)]})
    assert list((world.base / "cdi").glob("*.yaml")) == []
    test_dra_e2e.poll(lambda: not any(k.startswith("dra/") for k in world.agent.status.mps), "no daemon left wanted")


# ----- nvidia.com/gpu pods served through DRA (KEP-5004) ---------------------------------------------------------


def test_an_unchanged_nvidia_com_gpu_pod_is_served_through_dra_with_the_class_config(world: World, smi: None) -> None:
    from agent.sim.scheduler.extended import ANNOTATION, extended_resource_claim

    (world.base / "config.yaml").write_text("version: v1\ndra:\n  enabled: true\n  gpus: all\n")  # the whole node
    world.api.wait_for(lambda: len(world.devices()) == 8, DEADLINE)
    world.kubelet.wait_for(
        lambda: world.kubelet.allocatable("nvidia.com/gpu") == 0, timeout=DEADLINE, what="no plugin GPU"
    )
    device_class = world.api.get("deviceclasses", DRIVER)
    device_class["spec"]["extendedResourceName"] = "nvidia.com/gpu"  # as deploy/dra/deviceclass-gpu.yaml has it
    long = gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}})
    device_class["spec"]["config"] = [{"opaque": {"driver": DRIVER, "parameters": long}}]
    world.api.update("deviceclasses", device_class)

    pod = {"metadata": {"name": "trainer", "namespace": "default", "uid": "5f0c6d3e-0000-4000-8000-000000000001"},
           "spec": {"containers": [{"name": "main", "resources": {"limits": {"nvidia.com/gpu": "2"}}},
                                   {"name": "sidecar", "resources": {}}]}}  # fmt: skip
    classes = {c["metadata"]["name"]: c for c in world.api.objects("deviceclasses")}
    built = extended_resource_claim(pod, classes)
    assert built is not None
    claim, mappings = built
    assert mappings == [
        {"containerName": "main", "resourceName": "nvidia.com/gpu", "requestName": "container-0-request-0"}
    ]
    created = world.api.create("resourceclaims", claim)
    assert created["metadata"]["annotations"][ANNOTATION] == "true"
    allocated = world.api.update("resourceclaims", allocate(created, world.slices(), classes, set(), NODE), status=True)
    gpus = [int(r["device"].removeprefix("gpu-")) for r in allocated["status"]["allocation"]["devices"]["results"]]
    assert len(gpus) == 2

    ids = world.dra.run_pod(
        "default", "trainer", pod["metadata"]["uid"], [("extended", created["metadata"]["name"])],
        {"main": [("extended", "container-0-request-0")], "sidecar": []},
    )  # fmt: skip
    uuids = {world.driver.gpus[i].uuid for i in gpus}
    assert set(cdi_devices.physical(world.base / "cdi", ids["main"], world.driver)) == uuids
    assert ids["sidecar"] == []
    assert [world.driver.gpus[i].timeslice for i in gpus] == [3, 3]  # the class's config, the only one it has
    world.dra.stop_pod(pod["metadata"]["uid"])
    assert [world.driver.gpus[i].timeslice for i in gpus] == [0, 0]


# ----- MPS per claim -----------------------------------------------------------------------------------------------


def test_an_mps_claim_gets_a_supervised_daemon_with_its_limits_which_stops_after(
    world: World, mps_bin: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = world.base / "mps"
    before = world.agent.status.config_digest
    (world.base / "config.yaml").write_text(
        f"version: v1\nflags: {{mpsRoot: '{root}'}}\ndra:\n  enabled: true\n  gpus: [0, 1]\n"
    )
    test_dra_e2e.poll(lambda: world.agent.status.config_digest != before, "the config with the MPS root applied")
    monkeypatch.setenv("PATH", f"{mps_bin}:{os.environ['PATH']}")
    mps = {
        "strategy": "MPS",
        "mpsConfig": {"defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "10Gi"},
    }
    claim = shared_claim(world, "mps", gpu_config(mps))
    index = gpu_of(world, claim)
    uuid = world.driver.gpus[index].uuid
    world.dra.run_pod("default", "mps", "pod-1", [("gpu", "mps")], {"a": [("gpu", None)], "b": [("gpu", None)]})

    (key,) = [k for k, d in world.agent.status.mps.items() if k.startswith("dra/") and d["state"] == "ready"]
    spec = (world.base / "cdi" / f"k8s.gpu.nvidia.com-claim_{claim['metadata']['uid']}.yaml").read_text()
    for line in (
        f"CUDA_MPS_PIPE_DIRECTORY=/mps/{key}/pipe",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50",
        f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={uuid}=10240M",
        f"hostPath: {root}/{key}/pipe",
    ):
        assert line in spec, line
    assert (root / key / "pipe").is_dir()  # the daemon's pipe, where the claim's containers reach it
    assert world.driver.gpus[index].compute_mode == 3  # EXCLUSIVE_PROCESS: the daemon is the GPU's only client

    # an agent restart (a rollout) keeps the claim's daemon: the new agent adopts it from the checkpoint
    pid = (root / key / "pipe" / "nvidia-cuda-mps-control.pid").read_text().strip()
    registered = len(world.dra.registration_events("registered", DRIVER))
    world.restart_agent()
    test_dra_e2e.poll(lambda: world.agent.status.mps.get(key, {}).get("state") == "ready", "the daemon adopted")
    world.dra.wait_for(
        lambda: len(world.dra.registration_events("registered", DRIVER)) > registered, DEADLINE, "registered again"
    )
    assert (root / key / "pipe" / "nvidia-cuda-mps-control.pid").read_text().strip() == pid  # the same daemon

    world.dra.stop_pod("pod-1")
    test_dra_e2e.poll(
        lambda: not any(k.startswith("dra/") for k in world.agent.status.mps), "the claim's daemon stopped"
    )
    test_dra_e2e.poll(lambda: world.driver.gpus[index].compute_mode == 0, "the GPU back in compute mode DEFAULT")
