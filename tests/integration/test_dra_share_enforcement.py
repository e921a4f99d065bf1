"""GPU shares held by something other than the client, and NVIDIA's ConsumableShares modes, end to end.

The agent (in process, on a simulated dgx-a100) publishes shared devices; the simulated scheduler allocates shares
from the published slices; the DRA kubelet emulator prepares them over gRPC; the MPS emulator is the real
``nvidia-cuda-mps-control`` stand-in, and ``agent.sim.mps.client`` a CUDA application connecting to it the way a
container does: through the claim's pipe directory, with or without the ``CUDA_MPS_*`` variables the claim's CDI
spec gives it. A container can drop those variables; what holds it then is the daemon's server defaults, and
``tessera status`` must say which limits they hold exactly and which are advisory.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.sim.scheduler import Unschedulable, allocate, devices_in_use
from agent.status_report import render_text, status_document

from . import test_dra_e2e, test_dra_shares
from .test_dra_e2e import NODE, World
from .test_dra_shares import cdi_spec, dra_daemons, share_claim, shared

world = test_dra_e2e.world  # the fixture: an agent, both kubelets and the API server on a simulated dgx-a100
shares = test_dra_shares.shares  # the fixture: GPU 0 shared by memory, GPU 1 whole; the MPS root
MIB = 1 << 20


def run_client(
    root: Path, key: str, device: str, *allocations: int, env: dict[str, str] | None = None
) -> tuple[int, list[dict[str, Any]]]:
    """A CUDA application on ``device`` with only the claim's pipe directory (plus ``env``): its exit status and
    its JSON lines (what the server holds it to, then each allocation)."""
    environment = {"PATH": os.environ["PATH"], "CUDA_MPS_PIPE_DIRECTORY": str(root / key / "pipe"), **(env or {})}
    command = [sys.executable, "-m", "agent.sim.mps.client", "--device", device]
    command += [f"--allocate={mib}" for mib in allocations]
    done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode in (0, 2), done.stderr
    return done.returncode, [json.loads(line) for line in done.stdout.splitlines()]


def claim_env(world: World, claim: dict) -> dict[str, str]:
    """The ``CUDA_MPS_*`` limits the claim's CDI spec gives its containers (not the pipe directory)."""
    spec = yaml.safe_load(cdi_spec(world, claim))
    env = [e for d in spec["devices"] for e in d["containerEdits"].get("env", [])]
    pairs = (e.split("=", 1) for e in env)
    return {k: v for k, v in pairs if k.startswith("CUDA_MPS_") and k != "CUDA_MPS_PIPE_DIRECTORY"}


def status_text(world: World) -> str:
    return render_text(status_document(world.agent.status, version="t"))


def said(world: World, *texts: str) -> str:
    """Wait until ``tessera status`` says each of ``texts``; what it says then."""

    def saying() -> str | None:
        text = status_text(world)
        return text if all(t in text for t in texts) else None

    return test_dra_e2e.poll(saying, f"status: {'; '.join(texts)}")


def run_pod(world: World, claim: str) -> None:
    world.dra.run_pod("default", claim, f"pod-{claim}", [("gpu", claim)], {"a": [("gpu", None)]})


def configure(world: World, mps_bin: Path, monkeypatch: pytest.MonkeyPatch, dra: str) -> Path:
    """GPUs 0 and 1 served by DRA, with ``dra`` (YAML flow mapping entries) added; the MPS emulator on PATH."""
    root = world.base / "mps"
    before = world.agent.status.config_digest
    text = f"version: v1\nflags: {{mpsRoot: '{root}'}}\ndra: {{enabled: true, gpus: [0, 1], {dra}}}\n"
    (world.base / "config.yaml").write_text(text)
    test_dra_e2e.poll(lambda: world.agent.status.config_digest != before, "the config applied")
    monkeypatch.setenv("PATH", f"{mps_bin}:{os.environ['PATH']}")
    world.api.wait_for(lambda: shared(world).get("allowMultipleAllocations") is True, test_dra_e2e.DEADLINE)
    return root


# ----- held by the MPS server ------------------------------------------------------------------------------------


def test_equal_shares_hold_a_client_that_dropped_its_variables_to_its_share(world: World, shares: Path) -> None:
    for name in ("a", "b"):
        share_claim(world, name, memory="10Gi")
        run_pod(world, name)
    (key,) = dra_daemons(world)
    uuid = world.driver.gpus[0].uuid
    text = said(world, "gpu-0 limits: memory 10240Mi held by the MPS server")
    assert "advisory" not in text
    status, lines = run_client(shares, key, uuid, 10240, 1)  # no CUDA_MPS_* variables at all
    assert lines[0]["pinned_limit_mib"] == 10240
    assert (status, lines[1]["ok"], lines[2]) == (2, True, {"allocate_mib": 1, "ok": False, "error": lines[2]["error"]})
    assert "out of memory" in lines[2]["error"]


def test_unequal_shares_the_server_holds_the_largest_and_status_says_the_smaller_is_advisory_until_it_is_not(
    world: World, shares: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="agent.events")  # the stand-in API server serves no Events: they are logged
    small = share_claim(world, "small", memory="10Gi")
    share_claim(world, "large", memory="20Gi", computePercent="30")
    run_pod(world, "small")
    run_pod(world, "large")
    (key,) = dra_daemons(world)
    uuid = world.driver.gpus[0].uuid
    said(
        world,
        "memory 10240Mi advisory: the MPS server holds 20480Mi",
        "memory 20480Mi held by the MPS server",  # the large share is held exactly
        "compute 30% advisory: only the client's CUDA_MPS_* variables hold it",  # the small one asked for none
    )
    event = test_dra_e2e.poll(
        lambda: next((r.getMessage() for r in caplog.records if "reason=ShareLimitAdvisory" in r.getMessage()
                      and "ResourceClaim/default/small" in r.getMessage()), None),
        "a Warning Event on the small claim",
    )  # fmt: skip
    assert "type=Warning" in event and "memory 10240Mi advisory: the MPS server holds 20480Mi" in event
    # a client of the small claim without its variables: past its share (advisory, as said), not past the ceiling
    status, lines = run_client(shares, key, uuid, 10241, 10239, 1)
    assert lines[0]["pinned_limit_mib"] == 20480
    assert [line["ok"] for line in lines[1:]] == [True, True, False] and status == 2
    # with the variables its CDI spec gives it, the client lowers its own limit to its share
    _, lines = run_client(shares, key, uuid, 10241, env=claim_env(world, small))
    assert lines[0]["pinned_limit_mib"] == 10240 and lines[1]["ok"] is False
    # the large share goes: the server's defaults become the small share's, exactly, for clients from now on
    world.dra.stop_pod("pod-large")
    text = said(world, "gpu-0 limits: memory 10240Mi held by the MPS server")
    assert "advisory" not in text
    status, lines = run_client(shares, key, uuid, 10241)
    assert lines[0]["pinned_limit_mib"] == 10240 and status == 2


def test_a_share_that_arrives_raises_the_ceiling_before_its_prepare_returns(world: World, shares: Path) -> None:
    """The larger share's container must not start held below its share: Prepare returns once the server holds it."""
    share_claim(world, "small", memory="10Gi")
    run_pod(world, "small")
    (key,) = dra_daemons(world)
    said(world, "gpu-0 limits: memory 10240Mi held by the MPS server")
    share_claim(world, "large", memory="30Gi")
    run_pod(world, "large")  # returns when Prepare does
    _, lines = run_client(shares, key, world.driver.gpus[0].uuid)
    assert lines[0]["pinned_limit_mib"] == 30720


# ----- NVIDIA's ConsumableShares ---------------------------------------------------------------------------------


def test_memory_comes_in_1mi_steps_so_1500mi_consumes_1500mi_and_is_held_to_it(world: World, shares: Path) -> None:
    claim = share_claim(world, "odd", memory="1500Mi")
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert result["consumedCapacity"]["memory"] == "1500Mi"
    run_pod(world, "odd")
    (key,) = dra_daemons(world)
    assert claim_env(world, claim)["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"].endswith("=1500M")
    status, lines = run_client(shares, key, world.driver.gpus[0].uuid, 1500, 1)
    assert lines[0]["pinned_limit_mib"] == 1500 and status == 2


def test_an_integer_consumable_shares_publishes_shares_and_each_claim_is_held_to_its_part(
    world: World, mps_bin: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = configure(world, mps_bin, monkeypatch, "gpuShares: [0], consumableShares: 4")
    assert shared(world)["capacity"]["shares"] == {
        "value": "4",
        "requestPolicy": {"default": "1", "validRange": {"min": "1", "max": "4", "step": "1"}},
    }
    one = share_claim(world, "one", shares="1")  # NVIDIA's request; unschedulable before
    two = share_claim(world, "two")  # asks for nothing: one share, no memory (NVIDIA's defaults)
    for claim in (one, two):
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        assert (result["consumedCapacity"]["shares"], result["consumedCapacity"]["memory"]) == ("1", "0")
        run_pod(world, claim["metadata"]["name"])
    share_claim(world, "three", shares="2")
    with pytest.raises(Unschedulable):
        share_claim(world, "four", shares="1")  # 4 of 4 taken
    run_pod(world, "three")
    (key,) = dra_daemons(world)
    text = said(world, "claim default/one: gpu-0 (share of no memory, 1 shares)")
    assert "memory 20480Mi advisory: the MPS server holds 40960Mi" in text  # 1/4 of 80Gi, next to a 2/4 share
    _, lines = run_client(root, key, world.driver.gpus[0].uuid)
    assert (lines[0]["pinned_limit_mib"], lines[0]["active_thread_percentage"]) == (40960, 50.0)


def test_unlimited_consumable_shares_let_any_number_of_claims_share_and_say_nothing_holds_them(
    world: World, mps_bin: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    configure(world, mps_bin, monkeypatch, "gpuShares: [0], consumableShares: unlimited")
    assert shared(world)["capacity"]["memory"]["requestPolicy"]["default"] == "0"
    for n in range(5):
        claim = share_claim(world, f"u{n}")
        assert claim["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"]["memory"] == "0"
    run_pod(world, "u0")
    text = said(world, "gpu-0 limits: no memory limit; no compute limit")
    assert "claim default/u0: gpu-0 (share of no memory)" in text


def test_consumable_shares_alone_shares_every_gpu_dra_serves_as_nvidias_flag_does(
    world: World, mps_bin: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    configure(world, mps_bin, monkeypatch, "consumableShares: memory")
    devices = {d["name"]: d for s in world.slices() for d in s["spec"].get("devices", [])}
    assert devices["gpu-0"].get("allowMultipleAllocations") and devices["gpu-1"].get("allowMultipleAllocations")


MIG_NODE = {"name": "a100-mig", "gpus": [{"model": "A100-SXM4-80GB", "mig": {"instances": ["3g.40gb", "3g.40gb"]}}]}


@pytest.mark.parametrize("world", [MIG_NODE], indirect=True)
def test_a_mig_device_is_shared_by_claims_held_by_its_own_mps_daemon(
    world: World, mps_bin: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = world.base / "mps"
    before = world.agent.status.config_digest
    (world.base / "config.yaml").write_text(
        f"version: v1\nflags: {{mpsRoot: '{root}'}}\ndra: {{enabled: true, gpus: [0], gpuShares: [0]}}\n"
    )
    test_dra_e2e.poll(lambda: world.agent.status.config_digest != before, "the config applied")
    monkeypatch.setenv("PATH", f"{mps_bin}:{os.environ['PATH']}")

    def mig() -> dict:
        found = [d for s in world.slices() for d in s["spec"].get("devices", []) if "-mig-" in d["name"]]
        return min(found, key=lambda d: d["name"]) if found and found[0].get("allowMultipleAllocations") else {}

    device = test_dra_e2e.poll(mig, "the MIG devices published for shares")
    assert device["capacity"]["multiprocessors"]["requestPolicy"] == {"default": "0", "validValues": ["0"]}
    mig_class = "device.attributes['gpu.nvidia.com'].type == 'mig'"  # NVIDIA's mig.nvidia.com
    world.api.create("deviceclasses", {
        "apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": "mig.nvidia.com"},
        "spec": {"selectors": [{"cel": {"expression": mig_class}}]},
    })  # fmt: skip
    classes = {c["metadata"]["name"]: c for c in world.api.objects("deviceclasses")}
    claims = []
    for name in ("m1", "m2"):
        exactly = {"deviceClassName": "mig.nvidia.com", "capacity": {"requests": {"memory": "5Gi"}}}
        created = world.api.create("resourceclaims", {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
        })  # fmt: skip
        others = [c for c in world.api.objects("resourceclaims") if c["metadata"]["name"] != name]
        held, consumed = devices_in_use(others)
        allocated = allocate(created, world.slices(), classes, held, NODE, consumed=consumed)
        claims.append(world.api.update("resourceclaims", allocated, status=True))
        run_pod(world, name)
    results = [c["status"]["allocation"]["devices"]["results"][0]["device"] for c in claims]
    assert results[0] == results[1] == device["name"]  # both on one MIG device
    (key,) = dra_daemons(world)
    said(world, f"{device['name']} limits: memory 5120Mi held by the MPS server")
    mig_uuid = claim_env(world, claims[0])["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"].split("=")[0]
    assert mig_uuid.startswith("MIG-")
    status, lines = run_client(root, key, mig_uuid, 5121)
    assert lines[0]["pinned_limit_mib"] == 5120 and status == 2


# ----- bad values ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dra", "named"),
    [
        ("consumableShares: four", "'four' is not a consumableShares value"),
        ("consumableShares: unlimited, defaultShare: 10Gi", "with consumableShares: unlimited such a claim takes"),
        ("gpuShares: [0], consumableShares: disabled", "consumableShares is disabled but gpuShares names GPUs"),
        ("gpuShares: [0], defaultShare: 1500.5Mi", "is not a whole number of MiB"),
    ],
)
def test_a_bad_shares_value_is_refused_by_name_and_the_last_good_config_kept(
    world: World, dra: str, named: str
) -> None:
    before = world.agent.status.config_digest
    (world.base / "config.yaml").write_text(f"version: v1\ndra: {{enabled: true, gpus: [0, 1], {dra}}}\n")
    error = test_dra_e2e.poll(lambda: world.agent.status.config_error, "the config refused")
    assert named in error and "dra" in error
    assert world.agent.status.config_digest == before
