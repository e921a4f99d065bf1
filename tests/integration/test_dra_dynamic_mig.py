"""Dynamic MIG published as partitionable devices (``dra.dynamicMig``): the full GPU and every MIG profile and
placement, sharing the GPU's counter set, so the scheduler can only pick partitions that fit together.

The slices come from ``tessera plan --dra`` (what the agent publishes) and go to the API server stand-in, which
validates them against the real schemas; the simulated scheduler allocates from them with NVIDIA's MIG
DeviceClass and counts the counters as the real one does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import kubernetes_validate
import pytest
from msgspec.structs import replace

from agent.core.dra.checkpoint import CHECKPOINT_FILE, PREPARE_STARTED, decode, encode
from agent.sim.apiserver import ApiServer
from agent.sim.kubelet.dra_common import PodStartError, PodStopError
from agent.sim.scheduler import Unschedulable, allocate
from tests import cdi_devices

from . import test_dra_e2e
from .test_dra_e2e import DEADLINE, NODE, World
from .test_previews_cli import exits

DRIVER = "gpu.nvidia.com"
world = test_dra_e2e.world  # the fixture: an agent, both kubelets and the API server on a simulated node
MIG_CLASS = "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'mig'"  # NVIDIA's
GPU_CLASS = "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'"
# A100-SXM4-80GB and H100-SXM5-80GB: GPU-instance profile, its NVML profile ID, placements (start) -- mig-profiles.json
PARTITIONS_80GB = {
    "1g10gb": (19, range(7)),
    "1g10gb-me": (20, range(7)),
    "1g20gb": (15, (0, 2, 4, 6)),
    "2g20gb": (14, (0, 2, 4)),
    "3g40gb": (9, (0, 4)),
    "4g40gb": (5, (0,)),
    "7g80gb": (0, (0,)),
}


def preview(tmp_path: Path, version: str, gpus: str = "all", node: str = "dgx-h100") -> list[dict]:
    config = tmp_path / "dynamic.yaml"
    config.write_text(f"version: v1\ndra:\n  enabled: true\n  gpus: {gpus}\n  dynamicMig: all\n")
    result = exits(0, "plan", "--dra", "--node", node, "--config", str(config), "--kubernetes-version", version,
                   "--format", "json")  # fmt: skip
    return json.loads(result.stdout)["items"]


def devices(slices: list[dict]) -> dict[str, dict]:
    return {d["name"]: d for s in slices for d in s["spec"].get("devices", [])}


@pytest.mark.parametrize("version", ["1.34", "1.36"])
def test_every_profile_and_placement_is_a_device_of_its_gpu(tmp_path: Path, version: str) -> None:
    slices = preview(tmp_path, version)
    published = devices(slices)
    expected = {f"gpu-{g}" for g in range(8)} | {
        f"gpu-{g}-mig-{profile}-{profile_id}-{start}"
        for g in range(8)
        for profile, (profile_id, starts) in PARTITIONS_80GB.items()
        for start in starts
    }
    assert set(published) == expected  # 8 x (1 + 25)
    partition = published["gpu-3-mig-3g40gb-9-4"]
    attributes = partition["attributes"]
    assert attributes["type"] == {"string": "mig"} and attributes["profile"] == {"string": "3g.40gb"}
    assert attributes["parentUUID"] == published["gpu-3"]["attributes"]["uuid"]
    assert "uuid" not in attributes  # it does not exist until a claim is prepared
    (consumed,) = partition["consumesCounters"]
    assert consumed["counterSet"] == "gpu-3-counter-set"
    assert {k for k in consumed["counters"] if k.startswith("memory-slice")} == {
        f"memory-slice-{i}" for i in range(4, 8)
    }
    assert consumed["counters"]["multiprocessors"] == {"value": "60"}  # an H100's 3g.40gb
    assert partition["capacity"]["memory"] == {"value": "40448Mi"}
    sets = {c["name"]: c["counters"] for s in slices for c in s["spec"].get("sharedCounters", [])}
    assert set(sets) == {f"gpu-{g}-counter-set" for g in range(8)}
    # the full GPU consumes its whole set: it excludes every partition of its GPU
    (whole,) = published["gpu-3"]["consumesCounters"]
    assert whole == {"counterSet": "gpu-3-counter-set", "counters": sets["gpu-3-counter-set"]}


@pytest.mark.parametrize(("version", "gate_said"), [("1.34", True), ("1.35", True), ("1.36", False)])
def test_the_preview_says_when_the_cluster_needs_the_partitionable_devices_gate(
    tmp_path: Path, version: str, gate_said: bool
) -> None:
    config = tmp_path / "dynamic.yaml"
    config.write_text("version: v1\ndra:\n  enabled: true\n  dynamicMig: all\n")
    result = exits(0, "plan", "--dra", "--node", "dgx-h100", "--config", str(config), "--kubernetes-version", version)
    said = f"Kubernetes {version} needs the DRAPartitionableDevices feature gate (alpha)" in result.stderr
    assert said == gate_said


@pytest.mark.parametrize(("version", "git_version"), [("1.34", "v1.34.2"), ("1.36", "v1.36.3")])
def test_the_api_server_accepts_the_pool_in_its_layout(tmp_path: Path, version: str, git_version: str) -> None:
    slices = preview(tmp_path, version)
    if version == "1.34":  # counters travel with the devices that consume them
        assert all(s["spec"].get("sharedCounters") and s["spec"].get("devices") for s in slices)
    else:  # a slice holds counters or devices, counters first
        assert slices[0]["spec"].get("sharedCounters") and not slices[0]["spec"].get("devices")
        assert all(s["spec"].get("devices") and not s["spec"].get("sharedCounters") for s in slices[1:])
        assert all(len(s["spec"]["devices"]) <= 64 for s in slices[1:])  # the limit with consumesCounters
    for item in slices:
        kubernetes_validate.validate(item, version, strict=True)
    with ApiServer(git_version=git_version) as api:
        api.add_node("dgx-a100", uid="00000000-0000-0000-0000-000000000000")
        for item in slices:
            api.create("resourceslices", item)
        assert len(api.objects("resourceslices")) == len(slices)


class Pool:
    """One H100 in dynamic-MIG mode (MIG mode off: switched at Prepare), as the scheduler sees it, and the claims
    allocated from it so far."""

    def __init__(self, tmp_path: Path) -> None:
        self.slices = preview(tmp_path, "1.36", gpus="[0]")
        self.classes = {
            name: {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": name},
                   "spec": {"selectors": [{"cel": {"expression": expression}}]}}
            for name, expression in (("mig.nvidia.com", MIG_CLASS), (DRIVER, GPU_CLASS))
        }  # fmt: skip
        self.allocated: set[tuple[str, str, str]] = set()
        self.count = 0

    def claim(self, device_class: str, selector: str | None = None) -> str:
        """Allocate one device; its name, or raise Unschedulable."""
        self.count += 1
        exactly: dict = {"deviceClassName": device_class}
        if selector:
            exactly["selectors"] = [{"cel": {"expression": selector}}]
        claim = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": f"c{self.count}", "namespace": "default", "uid": f"uid-{self.count}"},
            "spec": {"devices": {"requests": [{"name": "r", "exactly": exactly}]}},
        }
        done = allocate(claim, self.slices, self.classes, self.allocated, "dgx-h100")
        (result,) = done["status"]["allocation"]["devices"]["results"]
        self.allocated.add((result["driver"], result["pool"], result["device"]))
        return result["device"]


def profile(name: str) -> str:
    return f"device.attributes['gpu.nvidia.com'].profile == '{name}'"


def test_seven_small_partitions_fit_and_an_eighth_does_not(tmp_path: Path) -> None:
    pool = Pool(tmp_path)
    got = [pool.claim("mig.nvidia.com", profile("1g.10gb")) for _ in range(7)]
    assert sorted(got) == sorted(f"gpu-0-mig-1g10gb-19-{start}" for start in range(7))
    with pytest.raises(Unschedulable):  # every compute slice is taken, though memory slice 7 is free
        pool.claim("mig.nvidia.com", profile("1g.10gb"))
    with pytest.raises(Unschedulable):
        pool.claim(DRIVER)  # nor the whole GPU


def test_overlapping_placements_exclude_each_other(tmp_path: Path) -> None:
    pool = Pool(tmp_path)
    first = pool.claim("mig.nvidia.com", profile("3g.40gb"))
    assert first in ("gpu-0-mig-3g40gb-9-0", "gpu-0-mig-3g40gb-9-4")
    if first.endswith("-0"):  # the only 4g.40gb placement starts at 0
        with pytest.raises(Unschedulable):
            pool.claim("mig.nvidia.com", profile("4g.40gb"))
        assert pool.claim("mig.nvidia.com", profile("3g.40gb")) == "gpu-0-mig-3g40gb-9-4"
    else:
        assert pool.claim("mig.nvidia.com", profile("4g.40gb")) == "gpu-0-mig-4g40gb-5-0"
    with pytest.raises(Unschedulable):
        pool.claim("mig.nvidia.com", profile("3g.40gb"))


def test_the_whole_gpu_excludes_every_partition(tmp_path: Path) -> None:
    pool = Pool(tmp_path)
    assert pool.claim(DRIVER) == "gpu-0"
    with pytest.raises(Unschedulable):
        pool.claim("mig.nvidia.com", profile("1g.10gb"))


def test_a_gpu_named_that_dra_does_not_serve_or_cannot_do_mig_is_an_error(tmp_path: Path) -> None:
    config = tmp_path / "dynamic.yaml"
    config.write_text("version: v1\ndra:\n  enabled: true\n  gpus: [0]\n  dynamicMig: [0, 1]\n")
    result = exits(1, "plan", "--dra", "--node", "dgx-a100", "--config", str(config))
    assert "dra.dynamicMig: GPU 1 is not served by DRA (add it to dra.gpus)" in result.stderr
    config.write_text("version: v1\ndra:\n  enabled: true\n  dynamicMig: [0]\n")
    result = exits(1, "plan", "--dra", "--node", "t4x4", "--config", str(config))
    assert "dra.dynamicMig: GPU 0 (Tesla T4) cannot do MIG" in result.stderr
    config.write_text("version: v1\ndra:\n  enabled: true\n  dynamicMig: all\n")  # all: the MIG-capable ones
    assert "mig" not in json.dumps(devices(preview(tmp_path, "1.36", node="t4x4")))


# GPU 0 in MIG mode with no instance yet, GPU 1 with MIG off, both A100 80GB
MIG_READY = {"gpus": [{"model": "A100-SXM4-80GB", "mig": {"instances": []}}, {"model": "A100-SXM4-80GB"}]}
DYNAMIC = "version: v1\ndra:\n  enabled: true\n  gpus: [0, 1]\n  dynamicMig: all\n"


def dynamic_world(world: World) -> None:
    """Turn dynamic MIG on in the world's config and wait for GPU 0's partitions."""
    world.api.wait_for(lambda: world.devices() == ["gpu-1"], DEADLINE)  # GPU 0: MIG on, no instance, no dynamicMig
    (world.base / "config.yaml").write_text(DYNAMIC)
    world.api.wait_for(lambda: len(world.devices()) == 26, DEADLINE)  # GPU 0: 25 partitions (MIG on, an A100: never
    # whole, it cannot be prepared so), GPU 1 whole
    world.api.create("deviceclasses", {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
                                       "metadata": {"name": "mig.nvidia.com"},
                                       "spec": {"selectors": [{"cel": {"expression": MIG_CLASS}}]}})  # fmt: skip
    world.dra.wait_for(lambda: DRIVER in world.dra.drivers(), DEADLINE, "the DRA driver registered")


def mig_claim(world: World, name: str, wanted: str) -> dict:
    request = {"deviceClassName": "mig.nvidia.com", "selectors": [{"cel": {"expression": profile(wanted)}}]}
    claim = world.api.create("resourceclaims", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "mig", "exactly": request}]}},
    })  # fmt: skip
    classes = {c["metadata"]["name"]: c for c in world.api.objects("deviceclasses")}
    held = {
        (r["driver"], r["pool"], r["device"])
        for c in world.api.objects("resourceclaims")
        for r in (((c.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results", [])
    }
    return world.api.update("resourceclaims", allocate(claim, world.slices(), classes, held, NODE), status=True)


def status_text(world: World) -> str:
    from agent.status_report import render_text, status_document

    return render_text(status_document(world.agent.status, version="test"))


def instances(world: World) -> dict[tuple[int, int], str]:
    """GPU 0's MIG devices by placement: (start, size) -> MIG UUID."""
    return {gi.placement: ci.uuid for gi, ci in world.driver.gpus[0].mig_devices()}


@pytest.mark.parametrize("world", [MIG_READY], indirect=True)
def test_a_claim_gets_its_mig_device_created_at_the_placement_and_destroyed_after(world: World) -> None:
    dynamic_world(world)
    published = {d["name"]: d for s in world.slices() for d in s["spec"].get("devices", [])}
    assert "consumesCounters" not in published["gpu-1"]  # MIG off: published whole, as before
    assert [c["name"] for s in world.slices() for c in s["spec"].get("sharedCounters", [])] == ["gpu-0-counter-set"]

    claim = mig_claim(world, "small", "3g.40gb")
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    start = int(result["device"].rsplit("-", 1)[1])
    ids = world.dra.run_pod("default", "small", "pod-1", [("mig", "small")], {"main": [("mig", None)]})
    mig_uuid = instances(world)[(start, 4)]  # exactly the allocated placement
    assert (world.base / "cdi" / f"k8s.gpu.nvidia.com-claim_{claim['metadata']['uid']}.yaml").exists()
    assert cdi_devices.physical(world.base / "cdi", ids["main"], world.driver) == [mig_uuid]  # the claim's spec has it
    statuses = world.api.wait_for(
        lambda: world.api.get("resourceclaims", "small", "default")["status"].get("devices"), test_dra_e2e.DEADLINE
    )  # written once the kubelet has its answer
    (reported,) = statuses
    assert (reported["device"], reported["data"]) == (result["device"], {"uuid": mig_uuid})  # the device it became

    text = test_dra_e2e.poll(lambda: "claim default/small" in status_text(world) and status_text(world), "status")
    assert f"claim default/small: {result['device']} (MIG device {mig_uuid})" in text  # what `tessera status` says

    world.driver.add_process(0, 4242, 1024, mig_uuid=mig_uuid)  # a process outlives its pod
    with pytest.raises(PodStopError, match="processes 4242 still run on it"):
        world.dra.stop_pod("pod-1")
    assert (start, 4) in instances(world)  # never destroyed under a process
    world.driver.remove_process(4242)
    world.dra.stop_pod("pod-1")  # the kubelet retries
    assert instances(world) == {}


@pytest.mark.parametrize("world", [MIG_READY], indirect=True)
@pytest.mark.parametrize(
    ("profile_id", "placement", "said"),
    [
        (19, (0, 1), "overlaps a MIG device that exists"),  # a 1g.10gb inside the claim's placement
        (5, (0, 4), "GPU instance {id} is already there and Tessera did not create it"),  # its very own placement
    ],
    ids=["overlapping", "same-placement"],
)
def test_a_placement_taken_outside_tessera_fails_the_claim_and_is_left_alone(
    world: World, profile_id: int, placement: tuple[int, int], said: str
) -> None:
    """Someone runs ``nvidia-smi mig -cgi`` by hand between the claim's allocation and its Prepare. The Prepare
    fails naming it, and its rollback destroys nothing: not even a device of the claim's own profile found at the
    claim's own placement, which a rollback that took whatever sits there for its own would destroy."""
    dynamic_world(world)
    mig_claim(world, "big", "4g.40gb")  # its only placement: memory slices 0-3
    foreign = world.driver.create_gpu_instance(0, profile_id, placement)
    world.driver.create_compute_instance(0, foreign, 0)
    before = instances(world)
    assert placement in before
    with pytest.raises(PodStartError, match=said.format(id=foreign.id)):
        world.dra.run_pod("default", "big", "pod-2", [("mig", "big")], {"main": [("mig", None)]})
    assert instances(world) == before  # nothing created, the foreign device untouched
    assert list((world.base / "cdi").glob("*.yaml")) == []


@pytest.mark.parametrize("world", [MIG_READY], indirect=True)
def test_a_failure_after_the_mig_device_is_created_takes_it_away_again(world: World) -> None:
    dynamic_world(world)
    mig_claim(world, "small", "1g.10gb")
    cdi = world.base / "cdi"
    shutil.rmtree(cdi, ignore_errors=True)
    cdi.write_text("a regular file where the CDI directory should be: no spec can be written")
    with pytest.raises(PodStartError, match="nothing was left prepared"):
        world.dra.run_pod("default", "small", "pod-1", [("mig", "small")], {"main": [("mig", None)]})
    assert instances(world) == {}  # created, then destroyed with the rest of the attempt
    cdi.unlink()
    world.dra.run_pod("default", "small", "pod-1", [("mig", "small")], {"main": [("mig", None)]})  # the retry works
    assert len(instances(world)) == 1


@pytest.mark.parametrize("world", [MIG_READY], indirect=True)
def test_a_mig_device_made_just_before_an_agent_crash_is_found_by_its_placement_and_destroyed(world: World) -> None:
    dynamic_world(world)
    claim = mig_claim(world, "small", "2g.20gb")
    world.dra.run_pod("default", "small", "pod-1", [("mig", "small")], {"main": [("mig", None)]})
    assert len(instances(world)) == 1
    # What the disk holds when the agent dies after creating the device and before recording it: the placement only
    world.agent.stop()
    world.thread.join(timeout=20)
    (path,) = (world.base / "plugins").rglob(CHECKPOINT_FILE)
    saved = decode(path.read_bytes())
    uid = claim["metadata"]["uid"]
    record = saved.claims[uid]
    devices = tuple(replace(d, cdi_device_ids=(), mig=replace(d.mig, gi_id=None, ci_id=None, uuid=None))
                    for d in record.devices)  # fmt: skip
    crashed = replace(saved, claims={uid: replace(record, state=PREPARE_STARTED, devices=devices)})
    path.write_bytes(encode(crashed))
    registered = len(world.dra.registration_events("registered", DRIVER))
    world.agent, world.thread = test_dra_e2e.start_agent(world.base, world.api)
    test_dra_e2e.poll(lambda: instances(world) == {}, "the leftover destroyed when the agent starts")
    world.dra.wait_for(
        lambda: len(world.dra.registration_events("registered", DRIVER)) > registered, DEADLINE, "registered again"
    )
    world.dra.stop_pod("pod-1")  # the pod is gone: Unprepare of a claim nothing is recorded for any more
    assert decode(path.read_bytes()).claims == {}


LAYOUT_TOO = """version: v1
dra:
  enabled: true
  gpus: [0, 1]
  dynamicMig: [0]
migLayout:
  config: small
  layouts:
    version: v1
    mig-configs:
      small:
        - devices: [0]
          mig-enabled: true
          mig-devices:
            1g.10gb: 7
"""


@pytest.mark.parametrize("world", [MIG_READY], indirect=True)
def test_a_static_layout_never_touches_a_dynamic_mig_gpu(world: World, caplog: pytest.LogCaptureFixture) -> None:
    world.api.wait_for(lambda: world.devices() == ["gpu-1"], DEADLINE)
    (world.base / "config.yaml").write_text(LAYOUT_TOO)
    world.api.wait_for(lambda: len(world.devices()) == 26, DEADLINE)  # GPU 0's partitions, GPU 1 whole
    test_dra_e2e.poll(lambda: world.agent.status.mig_state == "success", "the MIG layout applied")
    assert instances(world) == {}  # the layout's seven 1g.10gb were never made on GPU 0
    assert "the MIG layout leaves GPUs 0 alone: dra.dynamicMig makes their MIG devices per claim" in caplog.text


@pytest.mark.parametrize("model", ["A100-SXM4-80GB", "H100-SXM5-80GB"])
def test_every_published_partition_can_be_created_and_destroyed(sim_node, model: str) -> None:
    """What the slices offer, the driver can make: each profile at each placement, its full compute instance
    included (1g.20gb's is the 1_SLICE_REV1 compute profile, as ``nvidia-smi -C`` picks it)."""
    from agent.core.inventory import Placement
    from agent.core.mig_catalog import mig_catalogs
    from agent.gpu.mig import create_partition, destroy_partition, mig_instance

    driver = sim_node({"gpus": [{"model": model, "mig": {"instances": []}}]})
    uuid = driver.gpus[0].uuid
    (catalog,) = [c for c in mig_catalogs() if c.key == model]
    for profile in catalog.profiles:
        for placement in profile.placements:
            made = create_partition(uuid, profile.id, Placement(placement.start, placement.size))
            ((gi, ci),) = driver.gpus[0].mig_devices()
            assert (gi.profile.name, gi.placement, ci.uuid) == (
                profile.name,
                (placement.start, placement.size),
                made.uuid,
            )
            destroy_partition(uuid, made.gi_id)
            assert mig_instance(uuid, made.gi_id) is None and driver.gpus[0].mig_devices() == []


@pytest.mark.parametrize("world", [MIG_READY], indirect=True)
def test_a_gpu_whose_partition_a_claim_holds_stays_with_dra_until_it_is_unprepared(world: World) -> None:
    dynamic_world(world)
    mig_claim(world, "small", "1g.10gb")
    world.dra.run_pod("default", "small", "pod-1", [("mig", "small")], {"main": [("mig", None)]})
    (world.base / "config.yaml").write_text("version: v1\ndra:\n  enabled: true\n  gpus: [1]\n")  # GPU 0 leaves DRA
    world.api.wait_for(lambda: world.devices() == ["gpu-1"], DEADLINE)  # no new claim gets GPU 0
    assert world.kubelet.allocatable("nvidia.com/gpu") == 0  # nor the device plugin: a claim holds a partition
    assert len(instances(world)) == 1
    world.dra.stop_pod("pod-1")
    assert instances(world) == {}
    world.kubelet.wait_for(lambda: world.kubelet.allocatable("nvidia.com/gpu") == 1, timeout=DEADLINE, what="GPU 0")


@pytest.mark.parametrize("world", [MIG_READY], indirect=True)
def test_mps_on_a_mig_device_made_for_the_claim(world: World, mps_bin, monkeypatch: pytest.MonkeyPatch) -> None:
    """What NVIDIA's driver refuses: MPS with dynamic MIG. The daemon serves the MIG device made for the claim."""
    import os

    root = world.base / "mps"
    dynamic_world(world)
    before = world.agent.status.config_digest
    (world.base / "config.yaml").write_text(DYNAMIC + f"flags: {{mpsRoot: '{root}'}}\n")
    test_dra_e2e.poll(lambda: world.agent.status.config_digest != before, "the config with the MPS root applied")
    monkeypatch.setenv("PATH", f"{mps_bin}:{os.environ['PATH']}")
    mps = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "MigDeviceConfig",
           "sharing": {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 30}}}  # fmt: skip
    request = {"deviceClassName": "mig.nvidia.com", "selectors": [{"cel": {"expression": profile("3g.40gb")}}]}
    claim = world.api.create("resourceclaims", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "mps-mig", "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "mig", "exactly": request}],
                             "config": [{"requests": ["mig"], "opaque": {"driver": DRIVER, "parameters": mps}}]}},
    })  # fmt: skip
    classes = {c["metadata"]["name"]: c for c in world.api.objects("deviceclasses")}
    world.api.update("resourceclaims", allocate(claim, world.slices(), classes, set(), NODE), status=True)
    world.dra.run_pod("default", "mps-mig", "pod-1", [("mig", "mps-mig")], {"main": [("mig", None)]})
    ((gi, ci),) = world.driver.gpus[0].mig_devices()
    assert gi.profile.name == "3g.40gb"
    (key,) = [k for k, d in world.agent.status.mps.items() if k.startswith("dra/") and d["state"] == "ready"]
    spec = (world.base / "cdi" / f"k8s.gpu.nvidia.com-claim_{claim['metadata']['uid']}.yaml").read_text()
    assert f"CUDA_MPS_PIPE_DIRECTORY=/mps/{key}/pipe" in spec and "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30" in spec
    assert ci.compute_mode == 3  # the daemon's MIG device in EXCLUSIVE_PROCESS
    world.dra.stop_pod("pod-1")
    test_dra_e2e.poll(lambda: not any(k.startswith("dra/") for k in world.agent.status.mps), "the daemon stopped")
    test_dra_e2e.poll(lambda: instances(world) == {}, "the MIG device destroyed once its daemon is gone")


def running_2g_claim(world: World) -> str:
    """Dynamic MIG on, a 2g.20gb claim prepared for a running pod (``pod-1``); its device's name, Healthy."""
    dynamic_world(world)
    claim = mig_claim(world, "small", "2g.20gb")
    device = claim["status"]["allocation"]["devices"]["results"][0]["device"]
    world.dra.run_pod("default", "small", "pod-1", [("mig", "small")], {"main": [("mig", None)]})
    world.dra.wait_for(lambda: world.dra.device_health(DRIVER, NODE, device) == "Healthy", DEADLINE, "Healthy")
    return device


@pytest.mark.parametrize("world", [{**MIG_READY, "recovery_seconds": 0.2}], indirect=True)
def test_a_claims_mig_device_gone_after_a_gpu_recovery_is_reported_unhealthy(world: World) -> None:
    device = running_2g_claim(world)
    world.driver.lose_gpu(0)  # Xid 79: off the bus
    world.dra.wait_for(lambda: world.dra.device_health(DRIVER, NODE, device) == "Unhealthy", DEADLINE, "lost")
    world.driver.recover_gpu(0)  # back, as after a node-level recovery, without its MIG devices
    other = "gpu-0-mig-1g10gb-19-6" if device != "gpu-0-mig-1g10gb-19-6" else "gpu-0-mig-1g10gb-19-0"
    world.dra.wait_for(  # the GPU recovered: its other placements are Healthy again...
        lambda: world.dra.device_health(DRIVER, NODE, other) == "Healthy", DEADLINE, "the GPU recovered"
    )
    assert world.dra.device_health(DRIVER, NODE, device) == "Unhealthy"  # ...but the claim's MIG device is not back
    world.dra.stop_pod("pod-1")  # nothing left to destroy: Unprepare succeeds
    assert instances(world) == {}


@pytest.mark.parametrize("world", [{**MIG_READY, "liveness_seconds": 0.1}], indirect=True)
def test_a_claims_mig_device_destroyed_by_a_gpu_reset_by_hand_is_reported_unhealthy(world: World) -> None:
    """``nvidia-smi -r`` sends no event: the slow re-check finds the claim's MIG device gone, and says so."""
    device = running_2g_claim(world)
    world.driver.reset_gpu(0)  # by hand, while no process runs there
    world.dra.wait_for(lambda: world.dra.device_health(DRIVER, NODE, device) == "Unhealthy", DEADLINE, "gone")
    assert world.dra.device_health(DRIVER, NODE, "gpu-1") == "Healthy"  # the other GPU was not touched
    world.dra.stop_pod("pod-1")  # nothing left to destroy: Unprepare succeeds
    assert instances(world) == {}


@pytest.mark.parametrize("world", [MIG_READY], indirect=True)
def test_a_claims_mig_device_reset_away_before_the_agent_read_the_node_again_is_reported_unhealthy(
    world: World,
) -> None:
    """The agent reads the node again after making a claim's MIG device; a reset that comes first (nothing
    announces it) leaves that read without the device, and the claim is told it lost it all the same."""
    dynamic_world(world)
    claim = mig_claim(world, "small", "2g.20gb")
    device = claim["status"]["allocation"]["devices"]["results"][0]["device"]
    world.driver.stall("nvmlSystemGetNVMLVersion", 2.0)  # the next read of the node is slow to start...
    world.dra.run_pod("default", "small", "pod-1", [("mig", "small")], {"main": [("mig", None)]})
    world.driver.reset_gpu(0)  # ... and the GPU is reset before it reads: it never sees the device
    world.dra.wait_for(lambda: world.dra.device_health(DRIVER, NODE, device) == "Unhealthy", DEADLINE, "gone")
    world.dra.stop_pod("pod-1")  # nothing left to destroy: Unprepare succeeds
    assert instances(world) == {}
