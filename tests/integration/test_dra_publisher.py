"""The node's ResourceSlices, kept by ``SlicePublisher`` in the API server stand-in through the real Kubernetes client.

The stand-in validates every write against the Kubernetes 1.34 and 1.37 schemas and the API's own rules, so a slice
the publisher writes is a slice a real API server would take.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator

import pytest
from msgspec.structs import replace

from agent.core.dra.devices import DraDevice, dra_devices
from agent.core.dra.taints import DeviceTaint
from agent.dra.publisher import SlicePublisher, SlicesFailed, SlicesPublished
from agent.gpu.discovery import discover
from agent.sim.apiserver import ApiServer

NODE, DRIVER = "gpu-node-1", "gpu.nvidia.com"
DEADLINE = 15.0


@pytest.fixture
def api() -> Iterator[ApiServer]:
    with ApiServer(git_version="v1.36.3") as server:
        server.add_node(NODE)
        server.add_node("other-node")
        yield server


@pytest.fixture
def devices(sim_node: Callable[[object], object]) -> tuple[DraDevice, ...]:
    sim_node("dgx-a100")
    return dra_devices(discover())


class Publisher:
    def __init__(self, api: ApiServer) -> None:
        self.events: queue.Queue[object] = queue.Queue()
        self.publisher = SlicePublisher(api.api_client(), NODE, DRIVER, post=self.events.put)
        self.publisher.start()

    def next(self, kind: type) -> object:
        while True:
            event = self.events.get(timeout=DEADLINE)
            if isinstance(event, kind):
                return event


@pytest.fixture
def publisher(api: ApiServer) -> Iterator[Publisher]:
    made = Publisher(api)
    yield made
    made.publisher.stop()


def ours(api: ApiServer) -> list[dict]:
    return [s for s in api.objects("resourceslices") if s["spec"]["nodeName"] == NODE]


def test_the_nodes_devices_are_published_owned_by_the_node(api, publisher, devices) -> None:
    publisher.publisher.publish(devices, {})
    published = publisher.next(SlicesPublished)
    (slice_,) = ours(api)
    assert published == SlicesPublished(generation=1, slices=1)
    assert slice_["spec"]["driver"] == DRIVER and slice_["spec"]["pool"] == {
        "name": NODE,
        "generation": 1,
        "resourceSliceCount": 1,
    }
    assert [d["name"] for d in slice_["spec"]["devices"]] == [d.name for d in devices]
    (owner,) = slice_["metadata"]["ownerReferences"]
    assert owner["kind"] == "Node" and owner["name"] == NODE and owner["controller"] is True
    assert owner["uid"] == api.get("nodes", NODE)["metadata"]["uid"]


def test_the_same_devices_again_write_nothing(api, publisher, devices) -> None:
    publisher.publisher.publish(devices, {})
    publisher.next(SlicesPublished)
    writes = api.count("create", "resourceslices") + api.count("update", "resourceslices")
    publisher.publisher.publish(devices, {})
    assert publisher.next(SlicesPublished) == SlicesPublished(generation=1, slices=1)
    assert api.count("create", "resourceslices") + api.count("update", "resourceslices") == writes


def test_a_taint_is_a_new_generation_of_the_same_slice(api, publisher, devices) -> None:
    publisher.publisher.publish(devices, {})
    publisher.next(SlicesPublished)
    (before,) = ours(api)
    taint = DeviceTaint(key=f"{DRIVER}/xid", value="79", time_added="2026-11-24T00:00:00Z")
    publisher.publisher.publish(devices, {devices[0].name: (taint,)})
    assert publisher.next(SlicesPublished).generation == 2
    (after,) = ours(api)
    assert after["metadata"]["name"] == before["metadata"]["name"]  # updated in place
    tainted = after["spec"]["devices"][0]
    assert tainted["taints"][0]["key"] == f"{DRIVER}/xid" and tainted["taints"][0]["value"] == "79"
    publisher.publisher.publish(devices, {})  # recovered: the taint goes
    assert publisher.next(SlicesPublished).generation == 3
    assert "taints" not in ours(api)[0]["spec"]["devices"][0]


def test_slices_wiped_by_the_kubelet_come_back_newer(api, publisher, devices) -> None:
    publisher.publisher.publish(devices, {})
    publisher.next(SlicesPublished)
    client = api.api_client()
    import kubernetes

    kubernetes.client.ResourceV1Api(client).delete_collection_resource_slice(field_selector=f"spec.nodeName={NODE}")
    assert publisher.next(SlicesPublished).generation == 2  # no publish call: the watch saw the wipe
    assert [d["name"] for d in ours(api)[0]["spec"]["devices"]] == [d.name for d in devices]


def test_an_outage_is_reported_once_and_the_slices_follow_when_it_ends(api, publisher, devices) -> None:
    api.down()
    publisher.publisher.publish(devices, {})
    failed = publisher.next(SlicesFailed)
    assert "Error" in failed.error or "refused" in failed.error.lower()
    api.up()
    assert publisher.next(SlicesPublished).generation == 1
    assert len(ours(api)) == 1


def test_more_devices_than_a_slice_holds_split_and_shrink_back(api, publisher, devices) -> None:
    many = tuple(replace(devices[i % len(devices)], name=f"gpu-{i}") for i in range(130))
    publisher.publisher.publish(many, {})
    assert publisher.next(SlicesPublished).slices == 2
    assert sorted(len(s["spec"]["devices"]) for s in ours(api)) == [2, 128]
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in ours(api)} == {2}
    publisher.publisher.publish(many[:10], {})
    assert publisher.next(SlicesPublished).slices == 1
    (left,) = ours(api)
    assert len(left["spec"]["devices"]) == 10 and left["spec"]["pool"]["resourceSliceCount"] == 1


def test_other_nodes_and_drivers_are_never_touched(api, publisher, devices) -> None:
    from tests.apiserver_fixtures import nvidia_gpu, nvidia_slice

    api.create("resourceslices", nvidia_slice("other-node", [nvidia_gpu(0)]))
    api.create("resourceslices", nvidia_slice(NODE, [nvidia_gpu(0)], driver="other.example.com"))
    publisher.publisher.publish(devices, {})
    publisher.next(SlicesPublished)
    publisher.publisher.publish(devices[:1], {})
    publisher.next(SlicesPublished)
    drivers = sorted((s["spec"]["nodeName"], s["spec"]["driver"]) for s in api.objects("resourceslices"))
    assert drivers == [("gpu-node-1", "gpu.nvidia.com"), ("gpu-node-1", "other.example.com"), ("other-node", DRIVER)]


def test_what_the_api_server_adds_on_write_settles_after_one_write(api, publisher, devices) -> None:
    """A taint written without timeAdded gets the server's clock: what it stored after the write is what later
    checks compare with, so the watch's echo of the write does not start a rewrite loop."""
    api.wait_for(lambda: api.open_watches("resourceslices") >= 1)  # the write's echo will reach the publisher
    taints = {devices[0].name: (DeviceTaint(key=f"{DRIVER}/gpu-lost"),)}
    publisher.publisher.publish(devices, taints)
    assert publisher.next(SlicesPublished).generation == 1
    assert ours(api)[0]["spec"]["devices"][0]["taints"][0]["timeAdded"]  # stamped by the server
    # lists: the watch's first, the publish's, the one after its write, and the echo's re-check
    api.wait_for(lambda: api.count("list", "resourceslices") >= 4)
    publisher.publisher.publish(devices, taints)  # handled after the echo (one worker): still nothing to write
    assert publisher.next(SlicesPublished).generation == 1
    assert api.count("create", "resourceslices") == 1 and api.count("update", "resourceslices") == 0
