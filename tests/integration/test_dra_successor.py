"""The next DRA instance takes over what the last one left: with or without ``POD_UID``, at once or after a wait.

One instance works the driver's checkpoint and CDI specs at a time (a lock in the driver's plugin directory). A
successor that starts after its predecessor is gone rolls back a Prepare the predecessor left unfinished and removes
the CDI specs no recorded claim owns; during a rolling update (``POD_UID``: both serve at once) the new instance does
so only once the old one has let go, reading the checkpoint again first — the old one may have prepared a claim
since. The agents run in process on a simulated dgx-a100, against the DRA kubelet emulator and the API server
stand-in (``test_dra_e2e``'s world).
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from msgspec.structs import replace

from agent.api.dra.v1 import api_pb2 as v1
from agent.core.dra.checkpoint import CHECKPOINT_FILE, PREPARE_STARTED, decode, encode

from . import test_dra_e2e
from .test_dra_e2e import DEADLINE, DRIVER, World, poll, start_agent

world = test_dra_e2e.world  # the fixture: an agent, both kubelets and the API server on a simulated dgx-a100
POD_UID = "7c1e0f6a-3b2d-4c5e-9f80-1a2b3c4d5e6f"
STALE_UID = "0b6b3d4e-1234-4cde-8f00-123456789abc"  # a claim no checkpoint knows


def spec_of(world: World, uid: str) -> Path:
    return world.base / "cdi" / f"k8s.gpu.nvidia.com-claim_{uid}.yaml"


def leave_stale_spec(world: World) -> Path:
    """What a crash between writing a spec and recording its claim leaves behind."""
    stale = spec_of(world, STALE_UID)
    stale.parent.mkdir(exist_ok=True)
    stale.write_text("cdiVersion: 0.5.0\nkind: k8s.gpu.nvidia.com/claim\ndevices: []\n")
    return stale


def checkpoint_file(world: World) -> Path:
    (path,) = (world.base / "plugins").rglob(CHECKPOINT_FILE)
    return path


def registrations(world: World) -> int:
    return len(world.dra.registration_events("registered", DRIVER))


def ready(world: World) -> None:
    world.api.wait_for(lambda: world.devices() == ["gpu-0", "gpu-1"], DEADLINE)
    world.dra.wait_for(lambda: DRIVER in world.dra.drivers(), DEADLINE, "the DRA driver registered")


@pytest.mark.parametrize("pod_uid", [None, POD_UID], ids=["without-pod-uid", "with-pod-uid"])
def test_the_next_agent_rolls_back_an_unfinished_prepare_and_sweeps_stale_specs(world: World, pod_uid: str) -> None:
    ready(world)
    uid = world.claim("left", [])["metadata"]["uid"]
    world.dra.run_pod("default", "left", "pod-l", [("gpu", "left")], {"main": [("gpu", None)]})
    # What the disk holds when the agent dies after writing the claim's spec and before recording it complete
    world.agent.stop()
    world.thread.join(timeout=DEADLINE)
    path = checkpoint_file(world)
    saved = decode(path.read_bytes())
    path.write_bytes(encode(replace(saved, claims={uid: replace(saved.claims[uid], state=PREPARE_STARTED)})))
    stale = leave_stale_spec(world)
    assert spec_of(world, uid).exists()

    world.agent, world.thread = start_agent(world.base, world.api, pod_uid=pod_uid)
    poll(lambda: not stale.exists(), "the spec no claim owns removed")
    poll(lambda: not spec_of(world, uid).exists(), "the unfinished claim's spec removed")
    assert decode(path.read_bytes()).claims == {}  # rolled back: the kubelet's next call prepares it afresh


def test_during_a_rolling_update_the_new_instance_sweeps_only_once_the_old_one_let_go(world: World) -> None:
    """Both instances serve at once; the new one must not sweep what the old one is still writing, and must not
    forget what the old one prepared after the new one had read the checkpoint."""
    ready(world)
    old_agent, old_thread = world.agent, world.thread
    stale = leave_stale_spec(world)
    registered = registrations(world)
    # the new pod: its own socket names (POD_UID); its own device-plugin directory, which does not exist (so it does
    # not wait for the old agent's lock on the shared one: only the DRA side is under test)
    new_agent, new_thread = start_agent(world.base, world.api, pod_uid=POD_UID, device_plugin_dir=world.base / "dp-2")
    world.agent, world.thread = new_agent, new_thread  # the fixture stops the new one
    world.dra.wait_for(lambda: registrations(world) > registered, DEADLINE, "the new instance registered")
    assert stale.exists()  # the old instance still works the checkpoint: nothing of it is swept yet

    # The old instance prepares a claim the kubelet sent it before the new one registered (its call in flight)
    claim = world.claim("late", [])
    uid = claim["metadata"]["uid"]
    old_socket = world.base / "plugins" / DRIVER / "dra.sock"
    with grpc.insecure_channel(f"unix://{old_socket}") as channel:
        prepare = channel.unary_unary(
            "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
            request_serializer=v1.NodePrepareResourcesRequest.SerializeToString,
            response_deserializer=v1.NodePrepareResourcesResponse.FromString,
        )
        answer = prepare(v1.NodePrepareResourcesRequest(claims=[v1.Claim(namespace="default", name="late", uid=uid)]))
    assert not answer.claims[uid].error and answer.claims[uid].devices
    assert spec_of(world, uid).exists()

    old_agent.stop()
    old_thread.join(timeout=DEADLINE)
    assert not old_thread.is_alive()
    poll(lambda: not stale.exists(), "the new instance took over and swept")
    assert spec_of(world, uid).exists()  # the late claim's spec is its own: the checkpoint was read again
    assert uid in decode(checkpoint_file(world).read_bytes()).claims


def test_a_new_instance_stopped_before_the_old_one_let_go_stops_at_once_and_touches_nothing(world: World) -> None:
    """A rollout undone (or a node drained) while the new instance still waits for the checkpoint: it stops now,
    without ever working the checkpoint; the old instance goes on serving its claims."""
    ready(world)
    stale = leave_stale_spec(world)
    registered = registrations(world)
    new_agent, new_thread = start_agent(world.base, world.api, pod_uid=POD_UID, device_plugin_dir=world.base / "dp-2")
    try:
        world.dra.wait_for(lambda: registrations(world) > registered, DEADLINE, "the new instance registered")
    finally:
        new_agent.stop()
        new_thread.join(timeout=5)  # its worker waited for the lock: the stop ends that wait
    assert not new_thread.is_alive()
    assert stale.exists()  # the old instance still holds the checkpoint: the new one swept nothing
    world.dra.wait_for(lambda: DRIVER in world.dra.drivers(), DEADLINE, "the old instance still registered")
    world.claim("kept", [])
    world.dra.run_pod("default", "kept", "pod-k", [("gpu", "kept")], {"main": [("gpu", None)]})
