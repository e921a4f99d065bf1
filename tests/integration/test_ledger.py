"""One owner per device: every destructive step asks one ledger (issue 24, defects 1-4).

Each test reproduces what a reviewer found on ``ea58d2a`` — a MIG layout change destroying a prepared claim's MIG
device, both front ends handing out one GPU, an admin-access claim resetting a workload's time-slice, dynamic MIG
publishing placements it can never prepare and never cleaning a lost claim's MIG device — against the real agent on
the simulated node, or (for the race) the real DRA service with the agent's real ledger.
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path

import pytest

from agent.core.dra.checkpoint import CHECKPOINT_FILE
from agent.gpu.discovery import discover
from agent.ledger import DeviceLedger
from agent.sim.scheduler import allocate

from . import test_dra_e2e
from .test_dra_dynamic_mig import MIG_READY, dynamic_world, instances, mig_claim
from .test_dra_e2e import DEADLINE, DRIVER, NODE, World
from .test_dra_service import Node, base, claim, devices, entry_error, node, ref  # noqa: F401 (fixtures)
from .test_dra_sharing import LEVELS, gpu_config, smi  # noqa: F401 (smi: the fixture)

world = test_dra_e2e.world  # the fixture: an agent, both kubelets and the API server on a simulated node

STATIC_MIG = {
    "gpus": [
        {"model": "A100-SXM4-80GB", "mig": {"instances": ["3g.40gb", "3g.40gb"]}},
        {"model": "A100-SXM4-80GB"},
    ]
}
MIG_CLASS = "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'mig'"
LAYOUT = """version: v1
dra:
  enabled: true
  gpus: [0, 1]
migLayout:
  config: change
  layouts:
    version: v1
    mig-configs:
      change:
        - devices: [0]
          mig-enabled: true
          mig-devices:
            1g.10gb: 7
        - devices: [1]
          mig-enabled: true
          mig-devices:
            7g.80gb: 1
"""


def allocated(
    world: World, name: str, device_class: str, cel: str, *, admin: bool = False, parameters: dict | None = None
) -> dict:
    """A claim for one device of ``device_class`` matching ``cel`` (opaque ``parameters`` for it), allocated."""
    request: dict = {"deviceClassName": device_class, "selectors": [{"cel": {"expression": cel}}]}
    if admin:
        request["adminAccess"] = True
    wanted: dict = {"requests": [{"name": "gpu", "exactly": request}]}
    if parameters is not None:
        wanted["config"] = [{"requests": ["gpu"], "opaque": {"driver": DRIVER, "parameters": parameters}}]
    created = world.api.create("resourceclaims", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "default"}, "spec": {"devices": wanted},
    })  # fmt: skip
    classes = {c["metadata"]["name"]: c for c in world.api.objects("deviceclasses")}
    held = {
        (r["driver"], r["pool"], r["device"])
        for c in world.api.objects("resourceclaims")
        for r in (((c.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results", [])
        if not r.get("adminAccess")
    }
    return world.api.update("resourceclaims", allocate(created, world.slices(), classes, held, NODE), status=True)


# ----- 1. a MIG layout change never touches what a claim holds ----------------------------------------------------


@pytest.mark.parametrize("world", [STATIC_MIG], indirect=True)
def test_a_layout_change_leaves_a_claims_mig_device_and_a_claims_whole_gpu_alone(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    world.api.wait_for(lambda: sorted(world.devices()) == ["gpu-0-mig-3g40gb-9-0", "gpu-0-mig-3g40gb-9-4", "gpu-1"],
                       DEADLINE)  # fmt: skip
    world.api.create("deviceclasses", {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
                                       "metadata": {"name": "mig.nvidia.com"},
                                       "spec": {"selectors": [{"cel": {"expression": MIG_CLASS}}]}})  # fmt: skip
    world.dra.wait_for(lambda: DRIVER in world.dra.drivers(), DEADLINE, "the DRA driver registered")
    allocated(world, "mig", "mig.nvidia.com", "true")
    allocated(world, "whole", DRIVER, "true")
    # prepared for pods that run no process yet (an image being pulled): only the claims say the devices are held
    world.dra.run_pod("default", "p-mig", "pod-1", [("gpu", "mig")], {"main": [("gpu", None)]})
    world.dra.run_pod("default", "p-whole", "pod-2", [("gpu", "whole")], {"main": [("gpu", None)]})
    before = [(gi.placement, ci.uuid) for gi, ci in world.driver.gpus[0].mig_devices()]

    (world.base / "config.yaml").write_text(LAYOUT)
    test_dra_e2e.poll(lambda: "the MIG layout leaves GPUs 0, 1 alone: DRA serves them" in caplog.text, "said")
    test_dra_e2e.poll(lambda: world.agent.status.config_name is not None and world.agent.status.mig_state, "applied")
    assert [(gi.placement, ci.uuid) for gi, ci in world.driver.gpus[0].mig_devices()] == before
    assert not world.driver.gpus[1].mig_current and not world.driver.gpus[1].mig_pending
    assert world.driver.destructive_calls == []


def test_the_mig_manager_waits_for_a_prepared_claim_that_runs_no_process(sim_node, tmp_path: Path) -> None:
    """The ledger's own word (below the layout filter): a claim's MIG device is held though no process runs."""
    from agent.core.dra.checkpoint import PREPARE_COMPLETED, Checkpoint, PreparedClaim, PreparedDevice
    from agent.core.dra.devices import mig_device_name
    from agent.mig.layout_file import layouts_for_node, parse_layout_file
    from agent.mig.manager import MigBusyChecked, MigManager
    from agent.sim.kubelet import KubeletEmulator

    driver = sim_node(STATIC_MIG)
    kubelet = KubeletEmulator(tmp_path / "dp", tmp_path / "pr.sock")  # PodResources: nothing allocated
    kubelet.start()
    ledger = DeviceLedger(tmp_path / "pr.sock")
    inventory = ledger.inventory = discover()
    gpu = inventory.gpus[0]
    name = mig_device_name(gpu, gpu.mig_devices[0])
    held = PreparedClaim(PREPARE_COMPLETED, "default", "notebook", (PreparedDevice(NODE, name, ("gpu",)),))
    ledger.attach_claims(lambda: Checkpoint("boot", {"3d3c9b1e-0000-4000-8000-000000000001": held}), NODE)
    events: queue.Queue[object] = queue.Queue()
    manager = MigManager(events.put, ledger)
    try:
        layouts = parse_layout_file(
            {"version": "v1", "mig-configs": {"c": [{"devices": [0], "mig-enabled": True,
                                                     "mig-devices": {"1g.10gb": 7}}]}},
            "t",
        )  # fmt: skip
        manager.desire(layouts_for_node(layouts, "c", inventory.gpus), inventory, 0.0)
        manager.tick(0.0)
        checked = events.get(timeout=10)
        assert isinstance(checked, MigBusyChecked)
        assert f"{gpu.mig_devices[0].uuid} held by claim default/notebook (DRA claim)" in checked.busy
        assert not driver.destructive_calls
    finally:
        manager.shutdown()
        kubelet.stop()


# ----- 2. one GPU, one front end, even in a race ------------------------------------------------------------------


def served_by_dra(dra: Node) -> DeviceLedger:
    """The DRA service restarted with a ledger of its own, which says DRA serves every GPU of the dra."""
    ledger = DeviceLedger(dra.base / "pr.sock")
    ledger.inventory = discover()
    assert ledger.adopt_for_dra(d.gpu_uuid for d in dra.devices.values())
    dra.restart(ledger=ledger)
    ledger.attach_claims(dra.service.checkpoint, NODE)  # type: ignore[union-attr]
    return ledger


def test_a_gpu_handed_back_while_a_prepare_reads_its_claim_is_not_prepared(node: Node) -> None:  # noqa: F811
    ledger = served_by_dra(node)
    gpu = node.devices["gpu-0"].uuid
    released: list[frozenset[str]] = []
    # the config takes GPU 0 from DRA while the Prepare waits for the API server: the loop hands it back
    node.claims.gate = lambda name: released.append(ledger.release_from_dra({gpu}))
    node.claims.add(claim(1, "gpu-0"))
    response = node.kubelet.prepare(ref(1))  # type: ignore[union-attr]
    assert released == [frozenset({gpu})]
    assert f"GPU(s) {gpu}, which DRA no longer serves" in entry_error(response, 1)
    assert node.recorded() == {} and not node.spec_file(1).exists()


def test_a_gpu_a_claim_is_being_prepared_on_or_holds_stays_with_dra(node: Node) -> None:  # noqa: F811
    ledger = served_by_dra(node)
    gpu = node.devices["gpu-0"].uuid
    held, done = threading.Event(), threading.Event()

    def step() -> None:  # a step holds the lock (a MIG change, a Prepare recording PrepareStarted)...
        with ledger.section():
            held.set()
            done.wait(10)

    worker = threading.Thread(target=step)
    worker.start()
    try:
        assert held.wait(10)
        assert ledger.release_from_dra({gpu}) == frozenset()  # ... so nothing moves meanwhile, and nobody waits
    finally:
        done.set()
        worker.join(10)
    node.claims.add(claim(1, "gpu-0"))
    assert not entry_error(node.kubelet.prepare(ref(1)), 1)  # type: ignore[union-attr]
    assert ledger.release_from_dra({gpu}) == frozenset()  # held by the claim
    assert gpu in ledger.dra_gpus()
    node.kubelet.unprepare(ref(1))  # type: ignore[union-attr]
    assert ledger.release_from_dra({gpu}) == frozenset({gpu})


# ----- 3. admin access never touches the workload's time-slice ----------------------------------------------------


def test_an_admin_access_claim_leaves_the_time_slice_of_a_gpu_another_claim_holds(world: World, smi: None) -> None:  # noqa: F811
    world.api.wait_for(lambda: world.devices() == ["gpu-0", "gpu-1"], DEADLINE)
    world.dra.wait_for(lambda: DRIVER in world.dra.drivers(), DEADLINE, "the DRA driver registered")
    uuid = world.driver.gpus[0].uuid
    on_gpu0 = f"device.attributes['gpu.nvidia.com'].uuid == '{uuid}'"

    def time_sliced(interval: str) -> dict:
        return gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": interval}})

    allocated(world, "work", DRIVER, on_gpu0, parameters=time_sliced("Long"))
    allocated(world, "monitor", DRIVER, on_gpu0, admin=True, parameters=time_sliced("Short"))
    gpu = world.driver.gpus[0]
    world.dra.run_pod("default", "work-pod", "pod-1", [("gpu", "work")], {"main": [("gpu", None)]})
    assert gpu.timeslice == LEVELS["Long"]
    world.dra.run_pod("default", "monitor-pod", "pod-2", [("gpu", "monitor")], {"main": [("gpu", None)]})
    assert gpu.timeslice == LEVELS["Long"]  # the admin claim did not change it...
    world.dra.stop_pod("pod-2")
    assert gpu.timeslice == LEVELS["Long"]  # ... nor reset it
    world.dra.stop_pod("pod-1")
    assert gpu.timeslice == LEVELS["Default"]


# ----- 4. dynamic MIG: MIG devices no claim made --------------------------------------------------------------------


@pytest.mark.parametrize("world", [{**MIG_READY, "liveness_seconds": 0.2}], indirect=True)
def test_a_mig_device_no_claim_made_is_not_offered_and_is_destroyed_once_free(world: World) -> None:
    dynamic_world(world)
    foreign = world.driver.create_gpu_instance(0, 19, (0, 1))  # nvidia-smi mig -cgi by hand, on a dynamic-MIG GPU
    world.driver.create_compute_instance(0, foreign, 0)
    ((_, ci),) = world.driver.gpus[0].mig_devices()
    world.driver.add_process(0, 5150, 512, mig_uuid=ci.uuid)
    # the slow re-check notices it: every placement it covers leaves the slices (a claim could never be prepared)
    world.api.wait_for(lambda: "gpu-0-mig-1g10gb-19-0" not in world.devices(), DEADLINE)
    offered = world.devices()
    assert "gpu-0" not in offered and "gpu-0-mig-7g80gb-0-0" not in offered and "gpu-0-mig-4g40gb-5-0" not in offered
    assert "gpu-0-mig-1g10gb-19-1" in offered and "gpu-0-mig-3g40gb-9-4" in offered
    test_dra_e2e.poll(
        lambda: "pid 5150" in " ".join(world.agent.status.waiting_for.get("dra:unclaimed-mig", ())), "said"
    )
    assert len(instances(world)) == 1  # a process runs there: never destroyed under it
    world.driver.remove_process(5150)
    test_dra_e2e.poll(lambda: instances(world) == {}, "destroyed once nothing runs on it")
    world.api.wait_for(lambda: len(world.devices()) == 26, DEADLINE)  # every placement offered again


@pytest.mark.parametrize("world", [{**MIG_READY, "liveness_seconds": 0.2}], indirect=True)
def test_a_claims_mig_device_left_by_a_lost_checkpoint_is_destroyed_and_its_placement_offered_again(
    world: World,
) -> None:
    dynamic_world(world)
    mig_claim(world, "small", "2g.20gb")
    world.dra.run_pod("default", "small", "pod-1", [("mig", "small")], {"main": [("mig", None)]})
    assert len(instances(world)) == 1
    world.agent.stop()
    world.thread.join(timeout=20)
    (path,) = (world.base / "plugins").rglob(CHECKPOINT_FILE)
    path.write_bytes(b"{not a checkpoint")  # a torn write: the agent starts with no record of the claim
    world.agent, world.thread = test_dra_e2e.start_agent(world.base, world.api, liveness_seconds=0.2)
    test_dra_e2e.poll(lambda: instances(world) == {}, "the MIG device nobody recorded destroyed")
    world.api.wait_for(lambda: len(world.devices()) == 26, DEADLINE)  # GPU 0's 25 partitions (an A100: never whole)


def test_a_gpu_allocated_a_moment_before_it_moves_to_dra_waits_though_podresources_does_not_list_it_yet(
    world: World,
) -> None:
    """The kubelet records an allocation only once Allocate has answered: a hand-over check in that gap would find
    PodResources empty. The ledger holds what Allocate answered for until PodResources lists it."""
    import grpc

    from agent.api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc

    world.api.wait_for(lambda: world.devices() == ["gpu-0", "gpu-1"], DEADLINE)
    test_dra_e2e.poll(lambda: world.kubelet.allocatable("nvidia.com/gpu") == 6, "the device plugin serves 6 GPUs")
    uuid = world.driver.gpus[2].uuid
    with grpc.insecure_channel(f"unix://{world.base / 'dp' / 'nvidia-gpu.sock'}") as channel:
        request = api_pb2.AllocateRequest(container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=[uuid])])
        api_pb2_grpc.DevicePluginStub(channel).Allocate(request, timeout=10)  # answered; the pod is being admitted
    (world.base / "config.yaml").write_text("version: v1\ndra:\n  enabled: true\n  gpus: [0, 1, 2]\n")
    waiting = test_dra_e2e.poll(lambda: world.agent.status.waiting_for.get(f"dra:{uuid}"), "GPU 2 waits")
    assert "a pod the kubelet is admitting" in " ".join(waiting)  # type: ignore[arg-type]
    assert world.devices() == ["gpu-0", "gpu-1"]  # not DRA's: a claim could not get it
