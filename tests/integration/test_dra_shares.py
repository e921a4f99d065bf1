"""Memory-sized GPU shares through DRA (consumable capacity): several claims on one GPU, each with its amount of
memory (and compute), enforced through the GPU's MPS daemon.

The agent (in process, on a simulated dgx-a100: A100-SXM4-80GB) publishes the GPUs ``dra.gpuShares`` names with
``allowMultipleAllocations``; the simulated scheduler allocates shares from the published slices (``capacity.requests``
rounded up to the request policy, ``shareID`` and ``consumedCapacity`` in the results); the DRA kubelet emulator
prepares them over gRPC; the MPS emulator is the real ``nvidia-cuda-mps-control`` stand-in.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from agent.sim.kubelet.dra_common import PodStartError
from agent.sim.scheduler import Unschedulable, allocate, devices_in_use

from . import test_dra_e2e
from .test_dra_e2e import DEADLINE, DRIVER, NODE, World

world = test_dra_e2e.world  # the fixture: an agent, both kubelets and the API server on a simulated dgx-a100
GIB = 1 << 30


@pytest.fixture
def shares(world: World, mps_bin: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """GPU 0 shared by memory (GPU 1 whole, through DRA too), with the MPS emulator on PATH; the MPS root."""
    root = world.base / "mps"
    before = world.agent.status.config_digest
    (world.base / "config.yaml").write_text(
        f"version: v1\nflags: {{mpsRoot: '{root}'}}\ndra:\n  enabled: true\n  gpus: [0, 1]\n  gpuShares: [0]\n"
    )
    test_dra_e2e.poll(lambda: world.agent.status.config_digest != before, "the config with gpuShares applied")
    monkeypatch.setenv("PATH", f"{mps_bin}:{os.environ['PATH']}")
    world.api.wait_for(lambda: shared(world).get("allowMultipleAllocations") is True, DEADLINE)
    world.dra.wait_for(lambda: DRIVER in world.dra.drivers(), DEADLINE, "the DRA driver registered")
    return root


def shared(world: World) -> dict[str, Any]:
    """GPU 0's device as the API server stored it."""
    return next((d for s in world.slices() for d in s["spec"].get("devices", []) if d["name"] == "gpu-0"), {})


def share_claim(
    world: World,
    name: str,
    config: dict | None = None,
    *,
    stale_memory: str | None = None,
    shared_only: bool = True,
    **capacity: str,
) -> dict:
    """A claim for a share of a GPU (``capacity`` as ``capacity.requests``; a shared GPU unless not
    ``shared_only``), allocated next to the claims already allocated, and stored; ``stale_memory`` replaces the
    memory the allocation consumes, as a stale scheduler or a hand-written status could."""
    exactly: dict[str, Any] = {"deviceClassName": DRIVER}
    if shared_only:  # a selector for shared GPUs (GPU 1 is DRA's too, whole)
        exactly["selectors"] = [{"cel": {"expression": "device.allowMultipleAllocations"}}]
    if capacity:
        exactly["capacity"] = {"requests": capacity}
    spec: dict[str, Any] = {"requests": [{"name": "gpu", "exactly": exactly}]}
    if config is not None:
        spec["config"] = [{"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": config}}]
    claim = world.api.create("resourceclaims", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"}, "spec": {"devices": spec},
    })  # fmt: skip
    classes = {c["metadata"]["name"]: c for c in world.api.objects("deviceclasses")}
    others = [c for c in world.api.objects("resourceclaims") if c["metadata"]["uid"] != claim["metadata"]["uid"]]
    held, consumed = devices_in_use(others)
    allocated = allocate(claim, world.slices(), classes, held, NODE, consumed=consumed)
    if stale_memory is not None:
        allocated["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"]["memory"] = stale_memory
    return world.api.update("resourceclaims", allocated, status=True)


def cdi_spec(world: World, claim: dict) -> str:
    return (world.base / "cdi" / f"k8s.gpu.nvidia.com-claim_{claim['metadata']['uid']}.yaml").read_text()


def dra_daemons(world: World) -> dict[str, dict]:
    return {k: d for k, d in world.agent.status.mps.items() if k.startswith("dra/")}


def test_the_shared_gpu_is_published_with_its_memory_and_compute_and_their_request_policies(
    world: World, shares: Path
) -> None:
    device = shared(world)
    assert device["capacity"]["memory"] == {
        "value": "80Gi",
        "requestPolicy": {"default": "80Gi", "validRange": {"min": "1Mi", "max": "80Gi", "step": "1Mi"}},
    }
    assert device["capacity"]["computePercent"] == {
        "value": "100",
        "requestPolicy": {"default": "0", "validRange": {"min": "0", "max": "100", "step": "1"}},
    }
    other = next(d for s in world.slices() for d in s["spec"].get("devices", []) if d["name"] == "gpu-1")
    assert "allowMultipleAllocations" not in other and other["capacity"] == {"memory": {"value": "80Gi"}}


def test_two_claims_share_one_gpu_each_with_its_memory_and_compute_limits(world: World, shares: Path) -> None:
    small = share_claim(world, "small", memory="10Gi")
    large = share_claim(world, "large", memory="20Gi", computePercent="30")
    results = [c["status"]["allocation"]["devices"]["results"][0] for c in (small, large)]
    assert [r["device"] for r in results] == ["gpu-0", "gpu-0"]
    uuid = world.driver.gpus[0].uuid

    world.dra.run_pod("default", "small", "pod-s", [("gpu", "small")], {"a": [("gpu", None)]})
    world.dra.run_pod("default", "large", "pod-l", [("gpu", "large")], {"a": [("gpu", None)]})
    (key,) = dra_daemons(world)  # one daemon for the GPU, serving both shares
    assert dra_daemons(world)[key]["state"] == "ready"
    small_spec, large_spec = cdi_spec(world, small), cdi_spec(world, large)
    for spec in (small_spec, large_spec):
        assert f"CUDA_MPS_PIPE_DIRECTORY=/mps/{key}/pipe" in spec
        assert f"hostPath: {shares}/{key}/pipe" in spec
    assert f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={uuid}=10240M" in small_spec
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in small_spec  # it asked for no compute: no limit
    assert f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={uuid}=20480M" in large_spec
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30" in large_spec
    from agent.status_report import render_text, status_document

    test_dra_e2e.poll(
        lambda: (
            "gpu-0 (share of 20Gi, 30% of its compute)" in render_text(status_document(world.agent.status, version="t"))
        ),
        "the shares in tessera status",
    )
    assert "claim default/small: gpu-0 (share of 10Gi)" in render_text(status_document(world.agent.status, version="t"))
    prepared = world.dra.prepared_claims()
    echoed = {prepared[c["metadata"]["uid"]].devices[0].share_id for c in (small, large)}
    assert echoed == {r["shareID"] for r in results}  # Device.share_id echoes the allocation's shareID

    world.dra.stop_pod("pod-s")
    # the other share still needs it: kept, its server defaults now the large share's alone
    test_dra_e2e.poll(lambda: dra_daemons(world).get(key, {}).get("state") == "ready", "the daemon kept")
    world.dra.stop_pod("pod-l")
    test_dra_e2e.poll(lambda: not dra_daemons(world), "the GPU's daemon stopped after its last share")


def test_a_claim_that_asks_for_no_memory_gets_the_whole_gpu_without_mps_and_nobody_shares_it(
    world: World, shares: Path
) -> None:
    whole = share_claim(world, "whole")
    (result,) = whole["status"]["allocation"]["devices"]["results"]
    assert result["consumedCapacity"]["memory"] == "80Gi"
    world.dra.run_pod("default", "whole", "pod-w", [("gpu", "whole")], {"a": [("gpu", None)]})
    assert "CUDA_MPS" not in cdi_spec(world, whole)
    assert not dra_daemons(world)
    with pytest.raises(Unschedulable):
        share_claim(world, "late", memory="1Gi")


def test_a_share_the_gpu_cannot_hold_next_to_the_prepared_ones_is_refused_and_leaves_nothing(
    world: World, shares: Path
) -> None:
    share_claim(world, "first", memory="60Gi")
    world.dra.run_pod("default", "first", "pod-1", [("gpu", "first")], {"a": [("gpu", None)]})
    # a stale scheduler (or a hand-written status) gives another 30Gi of the same GPU: 90Gi of 80Gi
    late = share_claim(world, "late", memory="10Gi", stale_memory="30Gi")
    with pytest.raises(PodStartError, match=r"cannot be shared as allocated: its 30Gi of gpu-0 and the 60Gi other"):
        world.dra.run_pod("default", "late", "pod-2", [("gpu", "late")], {"a": [("gpu", None)]})
    assert not (world.base / "cdi" / f"k8s.gpu.nvidia.com-claim_{late['metadata']['uid']}.yaml").exists()


def test_a_share_with_a_sharing_config_of_its_own_is_refused_naming_the_fix(world: World, shares: Path) -> None:
    config = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig", "sharing": {"strategy": "MPS"}}
    share_claim(world, "both", config, memory="10Gi")
    with pytest.raises(PodStartError, match=r"enforced through MPS .* drop the sharing from that config"):
        world.dra.run_pod("default", "both", "pod-1", [("gpu", "both")], {"a": [("gpu", None)]})
    assert not dra_daemons(world)


def test_shares_survive_an_agent_restart_and_still_count_against_the_gpu(world: World, shares: Path) -> None:
    share_claim(world, "kept", memory="70Gi")
    world.dra.run_pod("default", "kept", "pod-1", [("gpu", "kept")], {"a": [("gpu", None)]})
    (key,) = dra_daemons(world)
    registered = len(world.dra.registration_events("registered", DRIVER))
    world.restart_agent()
    world.dra.wait_for(
        lambda: len(world.dra.registration_events("registered", DRIVER)) > registered, DEADLINE, "registered again"
    )
    test_dra_e2e.poll(lambda: dra_daemons(world).get(key, {}).get("state") == "ready", "the daemon adopted")
    share_claim(world, "late", memory="10Gi", stale_memory="20Gi")
    with pytest.raises(PodStartError, match="exceed the device's 80Gi"):
        world.dra.run_pod("default", "late", "pod-2", [("gpu", "late")], {"a": [("gpu", None)]})


WITHOUT_CONSUMABLE_CAPACITY = {
    "name": "dgx-a100",
    "gpus": [{"model": "A100-SXM4-80GB", "count": 8}],
    "gates_off": ["DRAConsumableCapacity"],
}


@pytest.mark.parametrize("world", [WITHOUT_CONSUMABLE_CAPACITY], indirect=True)
def test_without_the_consumable_capacity_gate_a_share_claim_gets_the_whole_gpu_and_the_status_says_why(
    world: World, mps_bin: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = world.agent.status.config_digest
    (world.base / "config.yaml").write_text("version: v1\ndra:\n  enabled: true\n  gpus: [0, 1]\n  gpuShares: [0]\n")
    test_dra_e2e.poll(lambda: world.agent.status.config_digest != before, "the config with gpuShares applied")
    note = test_dra_e2e.poll(
        lambda: (world.agent.status.dra or {}).get("unavailable"), "the status saying what the cluster lacks"
    )
    assert "feature gate DRAConsumableCapacity is off" in note[0] and "allocated whole" in note[0]
    assert "allowMultipleAllocations" not in shared(world)  # as the API server stored it
    claim = share_claim(world, "asks-10gi", shared_only=False, memory="10Gi")  # its capacity.requests dropped too
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert "consumedCapacity" not in result and "capacity" not in claim["spec"]["devices"]["requests"][0]["exactly"]
    world.dra.run_pod("default", "asks-10gi", "pod-1", [("gpu", "asks-10gi")], {"a": [("gpu", None)]})
    assert "CUDA_MPS" not in cdi_spec(world, claim)  # a whole GPU: nothing to enforce
    assert not dra_daemons(world)


def test_the_gpus_daemon_stops_after_its_last_share_though_the_driver_lists_its_mps_server(
    world: World, shares: Path, mps_bin: Path
) -> None:
    """A real driver lists the MPS server among the GPU's compute processes: it is the daemon's own, not a
    workload, so the drain does not wait for it; a client still running would be waited for."""
    import subprocess

    share_claim(world, "only", memory="10Gi")
    world.dra.run_pod("default", "only", "pod-1", [("gpu", "only")], {"a": [("gpu", None)]})
    (key,) = dra_daemons(world)
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(shares / key / "pipe")}
    ask = [str(mps_bin / "nvidia-cuda-mps-control")]
    subprocess.run(ask, input="start_server -uid 0\n", env=env, check=True, capture_output=True, text=True)
    listed = subprocess.run(ask, input="get_server_list\n", env=env, check=True, capture_output=True, text=True)
    server = int(listed.stdout.split()[0])
    world.driver.add_process(0, server, 300, kind="mps_server")  # as nvidia-smi shows it: type C
    world.driver.add_process(0, 4242, 1024, kind="mps_client")  # a client that has not exited yet
    world.dra.stop_pod("pod-1")
    waiting = test_dra_e2e.poll(
        lambda: (
            [d["error"] for d in dra_daemons(world).values() if "4242" in str(d["error"])] or not dra_daemons(world)
        ),
        "the retiring daemon waiting for its client",
    )
    assert waiting is not True, "the daemon stopped under a running client"
    assert str(server) not in str(waiting)  # its own server is not what it waits for
    world.driver.remove_process(4242)
    test_dra_e2e.poll(lambda: not dra_daemons(world), "the daemon stopped; only its own server was left")


def test_unchanged_pods_asking_for_nvidia_com_gpu_shared_share_one_gpu_through_dra(
    world: World, mps_bin: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KEP-5004 with a shared resource name: deploy/dra/examples/deviceclass-gpu-shared.yaml serves
    ``nvidia.com/gpu.shared``; with ``defaultShare`` each unit is that much of a shared GPU, as a replica is."""
    import yaml

    from agent.sim.scheduler.extended import extended_resource_claim

    root = world.base / "mps"
    before = world.agent.status.config_digest
    (world.base / "config.yaml").write_text(
        f"version: v1\nflags: {{mpsRoot: '{root}'}}\n"
        "dra: {enabled: true, gpus: [0, 1], gpuShares: [0], defaultShare: 10Gi}\n"
    )
    test_dra_e2e.poll(lambda: world.agent.status.config_digest != before, "the config with defaultShare applied")
    monkeypatch.setenv("PATH", f"{mps_bin}:{os.environ['PATH']}")
    world.api.wait_for(lambda: shared(world).get("allowMultipleAllocations") is True, DEADLINE)
    assert shared(world)["capacity"]["memory"]["requestPolicy"]["default"] == "10Gi"
    example = Path(__file__).parents[2] / "deploy" / "dra" / "examples" / "deviceclass-gpu-shared.yaml"
    world.api.create("deviceclasses", yaml.safe_load(example.read_text()))
    classes = {c["metadata"]["name"]: c for c in world.api.objects("deviceclasses")}
    uuid = world.driver.gpus[0].uuid
    for n in (1, 2):
        container = {"name": "main", "resources": {"limits": {"nvidia.com/gpu.shared": "1"}}}
        uid = f"5f0c6d3e-0000-4000-8000-00000000000{n}"
        pod = {
            "metadata": {"name": f"replica-{n}", "namespace": "default", "uid": uid},
            "spec": {"containers": [container]},
        }
        built = extended_resource_claim(pod, classes)
        assert built is not None
        claim, _ = built
        created = world.api.create("resourceclaims", claim)
        held, consumed = devices_in_use(c for c in world.api.objects("resourceclaims") if c is not created)
        allocated = allocate(created, world.slices(), classes, held, NODE, consumed=consumed)
        stored = world.api.update("resourceclaims", allocated, status=True)
        (result,) = stored["status"]["allocation"]["devices"]["results"]
        assert (result["device"], result["consumedCapacity"]["memory"]) == ("gpu-0", "10Gi")
        name = created["metadata"]["name"]
        world.dra.run_pod(
            "default", pod["metadata"]["name"], pod["metadata"]["uid"], [("extended", name)],
            {"main": [("extended", "container-0-request-0")]},
        )  # fmt: skip
        assert f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={uuid}=10240M" in cdi_spec(world, stored)
    assert len(dra_daemons(world)) == 1  # both replicas on GPU 0's one daemon
