"""The API server stand-in (agent.sim.apiserver), driven only through the real Kubernetes Python client over HTTP."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Iterator

import kubernetes.client
import kubernetes.config
import kubernetes.watch
import pytest
import urllib3
from kubernetes.client.exceptions import ApiException

from agent.sim.apiserver import ApiServer
from tests.apiserver_fixtures import DRIVER, gpu_claim, nvidia_gpu, nvidia_slice, raw_request, resource_api

NODE_UID = "6c1e8f0e-0000-4000-8000-00000000000a"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"


@pytest.fixture
def api() -> Iterator[ApiServer]:
    with ApiServer(git_version="v1.34.2") as server:
        server.add_node("node-a", uid=NODE_UID, labels={"kubernetes.io/hostname": "node-a"})
        server.add_node("node-b")
        yield server


@pytest.fixture
def resources(api: ApiServer) -> kubernetes.client.ResourceV1Api:
    return resource_api(api)


def status_of(e: ApiException) -> dict:
    return json.loads(e.body)


def slices(api: ApiServer) -> list[dict]:
    return api.objects("ResourceSlice")


# --------------------------------------------------------------------------------------------------
# create, read, update, conflicts
# --------------------------------------------------------------------------------------------------


def test_create_with_generate_name_assigns_name_uid_and_metadata(api, resources):
    created = resources.create_resource_slice(
        nvidia_slice("node-a", [nvidia_gpu(0, memory="81920Mi")], node_uid=NODE_UID)
    )
    prefix = f"node-a-{DRIVER}-"
    assert created.metadata.name.startswith(prefix) and len(created.metadata.name) == len(prefix) + 5
    assert created.metadata.uid and created.metadata.generation == 1 and created.metadata.creation_timestamp
    assert int(created.metadata.resource_version) == api.resource_version
    assert created.spec.devices[0].capacity["memory"].value == "80Gi"  # stored in canonical form, like the server
    assert created.metadata.owner_references[0].uid == NODE_UID

    read = resources.read_resource_slice(created.metadata.name)
    assert read.metadata.uid == created.metadata.uid
    assert api.get("ResourceSlice", created.metadata.name)["metadata"]["uid"] == created.metadata.uid

    with pytest.raises(ApiException) as missing:
        resources.read_resource_slice("no-such-slice")
    assert missing.value.status == 404
    assert status_of(missing.value)["message"] == 'resourceslices.resource.k8s.io "no-such-slice" not found'


def test_update_with_stale_resource_version_is_a_conflict(api, resources):
    first = resources.create_resource_slice(nvidia_slice("node-a", [nvidia_gpu(0)], name="node-a-gpus"))
    stale = api.get("ResourceSlice", "node-a-gpus")

    fresh = api.get("ResourceSlice", "node-a-gpus")
    fresh["spec"]["pool"]["generation"] = 2
    fresh["spec"]["devices"].append(nvidia_gpu(1))
    updated = resources.replace_resource_slice("node-a-gpus", fresh)
    assert updated.metadata.generation == 2  # spec changed
    assert int(updated.metadata.resource_version) > int(first.metadata.resource_version)

    stale["spec"]["pool"]["generation"] = 3
    with pytest.raises(ApiException) as err:
        resources.replace_resource_slice("node-a-gpus", stale)
    assert err.value.status == 409
    status = status_of(err.value)
    assert status["reason"] == "Conflict" and status["kind"] == "Status"
    assert "the object has been modified" in status["message"]
    assert api.get("ResourceSlice", "node-a-gpus")["spec"]["pool"]["generation"] == 2  # nothing stored

    again = api.get("ResourceSlice", "node-a-gpus")
    rv = again["metadata"]["resourceVersion"]
    resources.replace_resource_slice("node-a-gpus", again)  # no change: a no-op keeps the resourceVersion
    assert api.get("ResourceSlice", "node-a-gpus")["metadata"]["resourceVersion"] == rv


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("driver", "other.example.com"),
        ("nodeName", "node-b"),
        ("pool", {"name": "x", "generation": 1, "resourceSliceCount": 1}),
    ],
)
def test_immutable_slice_fields_are_invalid_on_update(api, resources, field, value):
    resources.create_resource_slice(nvidia_slice("node-a", [nvidia_gpu(0)], name="node-a-gpus"))
    changed = api.get("ResourceSlice", "node-a-gpus")
    changed["spec"][field] = value
    with pytest.raises(ApiException) as err:
        resources.replace_resource_slice("node-a-gpus", changed)
    assert err.value.status == 422
    message = status_of(err.value)["message"]
    assert "field is immutable" in message and f"spec.{field}" in message
    assert api.get("ResourceSlice", "node-a-gpus")["spec"]["driver"] == DRIVER


def test_patch_changes_labels_without_bumping_generation(api, resources):
    resources.create_resource_slice(nvidia_slice("node-a", [nvidia_gpu(0)], name="node-a-gpus"))
    patched = resources.patch_resource_slice("node-a-gpus", {"metadata": {"labels": {"tier": "gold"}}})
    assert patched.metadata.labels == {"tier": "gold"} and patched.metadata.generation == 1
    assert api.requests(verb="patch", resource="resourceslices")[0].status == 200


# --------------------------------------------------------------------------------------------------
# validation: the OpenAPI schemas of 1.34 and 1.37, and the rules the schema cannot express
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("git_version", ["v1.34.2", "v1.37.0"])
def test_realistic_nvidia_slice_is_valid_for_the_oldest_and_newest_schema(git_version):
    with ApiServer(git_version=git_version) as server:
        assert server.schema_validation  # kubernetes_validate is a test dependency
        assert server.validator.schema_versions == ("1.34", "1.37")
        node = server.add_node("node-a")
        created = resource_api(server).create_resource_slice(
            nvidia_slice("node-a", [nvidia_gpu(i) for i in range(8)], node_uid=node["metadata"]["uid"])
        )
        assert len(created.spec.devices) == 8


def test_version_attribute_that_is_not_semver_is_invalid(api, resources):
    gpu = nvidia_gpu(0, compute_capability="8.0")
    with pytest.raises(ApiException) as err:
        resources.create_resource_slice(nvidia_slice("node-a", [gpu]))
    assert err.value.status == 422
    status = status_of(err.value)
    assert status["reason"] == "Invalid"
    assert "spec.devices[0].attributes[cudaComputeCapability].version" in status["message"]
    assert "semver.org spec 2.0.0" in status["message"]
    assert status["details"]["causes"][0]["field"] == "spec.devices[0].attributes[cudaComputeCapability].version"
    assert slices(api) == []


def _two_value_types() -> dict:
    gpu = nvidia_gpu(0)
    gpu["attributes"]["type"] = {"string": "gpu", "int": 1}
    return nvidia_slice("node-a", [gpu])


def _list_attribute() -> dict:
    gpu = nvidia_gpu(0)
    gpu["attributes"]["migProfiles"] = {"strings": ["1g.10gb", "7g.80gb"]}  # a 1.36+ list attribute
    return nvidia_slice("node-a", [gpu])


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (_two_value_types, "spec.devices[0].attributes[type]: Invalid value"),
        (lambda: nvidia_slice("node-a", [nvidia_gpu(i) for i in range(129)]), "Too many: 129: must have at most 128"),
        (_list_attribute, "does not match the OpenAPI schema of Kubernetes 1.34"),
        (lambda: nvidia_slice("node-a", [nvidia_gpu(0), nvidia_gpu(0)]), 'Duplicate value: "gpu-0"'),
        (
            lambda: nvidia_slice("node-a", [nvidia_gpu(0)], slice_count=0),
            "spec.pool.resourceSliceCount: Invalid value: 0: must be greater than zero",
        ),
        (lambda: nvidia_slice("node-a", [nvidia_gpu(0)], driver="x" * 64 + ".com"), "spec.driver: Too long"),
    ],
    ids=[
        "two-value-types",
        "129-devices",
        "list-attribute-unknown-to-1.34",
        "duplicate-device",
        "zero-slices",
        "long-driver",
    ],
)
def test_invalid_slices_are_rejected_and_not_stored(api, resources, body, expected):
    before = api.resource_version
    with pytest.raises(ApiException) as err:
        resources.create_resource_slice(body())
    assert err.value.status == 422
    assert expected in status_of(err.value)["message"]
    assert slices(api) == [] and api.resource_version == before


def test_slice_without_pool_fails_the_schema(api):
    body = nvidia_slice("node-a", [nvidia_gpu(0)])
    del body["spec"]["pool"]  # the client's own models refuse this, so it goes through raw_request
    with pytest.raises(ApiException) as err:
        raw_request(api.api_client(), "POST", SLICES, body)
    assert err.value.status == 422
    message = status_of(err.value)["message"]
    assert "'pool' is a required property" in message and "Kubernetes 1.34" in message
    assert slices(api) == []


def test_node_placement_must_be_exactly_one_field(api):
    body = nvidia_slice("node-a", [nvidia_gpu(0)])
    body["spec"]["allNodes"] = True
    with pytest.raises(ApiException) as err:
        raw_request(api.api_client(), "POST", SLICES, body)
    assert (
        "exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection`"
        in status_of(err.value)["message"]
    )


@pytest.mark.parametrize(("git_version", "accepted"), [("v1.34.2", True), ("v1.35.0", False)])
def test_tainted_slices_hold_64_devices_from_1_35(git_version, accepted):
    taint = [{"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}]
    devices = [nvidia_gpu(i, taints=taint if i == 0 else None) for i in range(65)]
    with ApiServer(git_version=git_version) as server:
        server.add_node("node-a")
        client = resource_api(server)
        if accepted:
            created = client.create_resource_slice(nvidia_slice("node-a", devices))
            assert created.spec.devices[0].taints[0].time_added is not None  # set by the server
        else:
            with pytest.raises(ApiException) as err:
                client.create_resource_slice(nvidia_slice("node-a", devices))
            assert "Too many: 65: must have at most 64 items" in status_of(err.value)["message"]


# --------------------------------------------------------------------------------------------------
# list, field selectors, DeleteCollection
# --------------------------------------------------------------------------------------------------


def _three_slices(resources) -> None:
    resources.create_resource_slice(nvidia_slice("node-a", [nvidia_gpu(0)], labels={"tier": "gold"}))
    resources.create_resource_slice(nvidia_slice("node-a", [nvidia_gpu(0)], driver="nic.example.com"))
    resources.create_resource_slice(nvidia_slice("node-b", [nvidia_gpu(0)]))


def test_list_with_field_and_label_selectors(api, resources):
    _three_slices(resources)

    def nodes_and_drivers(**selectors) -> list[tuple[str, str]]:
        answer = resources.list_resource_slice(**selectors)
        assert int(answer.metadata.resource_version) == api.resource_version
        return sorted((s.spec.node_name, s.spec.driver) for s in answer.items)

    assert nodes_and_drivers(field_selector="spec.nodeName=node-a") == [
        ("node-a", DRIVER),
        ("node-a", "nic.example.com"),
    ]
    assert nodes_and_drivers(field_selector=f"spec.driver={DRIVER}") == [("node-a", DRIVER), ("node-b", DRIVER)]
    assert nodes_and_drivers(field_selector=f"spec.nodeName=node-a,spec.driver={DRIVER}") == [("node-a", DRIVER)]
    assert nodes_and_drivers(field_selector="spec.nodeName!=node-a") == [("node-b", DRIVER)]
    assert nodes_and_drivers(label_selector="tier=gold") == [("node-a", DRIVER)]
    assert len(nodes_and_drivers()) == 3

    with pytest.raises(ApiException) as err:
        resources.list_resource_slice(field_selector="spec.pool.name=node-a")
    assert err.value.status == 400 and "field label not supported" in status_of(err.value)["message"]


def test_delete_collection_by_node_removes_only_that_nodes_slices(api, resources):
    _three_slices(resources)
    resources.delete_collection_resource_slice(field_selector=f"spec.nodeName=node-a,spec.driver={DRIVER}")
    assert sorted((s["spec"]["nodeName"], s["spec"]["driver"]) for s in slices(api)) == [
        ("node-a", "nic.example.com"),
        ("node-b", DRIVER),
    ]
    resources.delete_collection_resource_slice(field_selector="spec.nodeName=node-a")  # the kubelet at start
    assert [(s["spec"]["nodeName"], s["spec"]["driver"]) for s in slices(api)] == [("node-b", DRIVER)]
    assert api.count("deletecollection", "resourceslices", 200) == 2


def test_delete_one_answers_the_deleted_object(api, resources):
    created = resources.create_resource_slice(nvidia_slice("node-a", [nvidia_gpu(0)]))
    deleted = resources.delete_resource_slice(created.metadata.name)
    assert deleted.metadata.uid == created.metadata.uid
    assert slices(api) == []
    with pytest.raises(ApiException) as err:
        resources.delete_resource_slice(created.metadata.name)
    assert err.value.status == 404


# --------------------------------------------------------------------------------------------------
# watch
# --------------------------------------------------------------------------------------------------


def test_watch_replays_from_a_resource_version_then_streams(api, resources):
    start = str(api.resource_version)
    a = resources.create_resource_slice(nvidia_slice("node-a", [nvidia_gpu(0)], name="a"))
    resources.create_resource_slice(nvidia_slice("node-b", [nvidia_gpu(0)], name="b"))
    watch = kubernetes.watch.Watch()
    seen: list[tuple[str, str]] = []
    for event in watch.stream(
        resources.list_resource_slice, resource_version=start, field_selector="spec.nodeName=node-a", timeout_seconds=10
    ):
        seen.append((event["type"], event["object"].metadata.name))
        if len(seen) == 1:  # the replayed creation of "a" (node-b's "b" is filtered out): now change it live
            body = api.get("ResourceSlice", "a")
            body["spec"]["pool"]["generation"] = 2
            resources.replace_resource_slice("a", body)
        elif len(seen) == 2:
            resources.delete_resource_slice("a")
        elif len(seen) == 3:
            watch.stop()
    assert seen == [("ADDED", "a"), ("MODIFIED", "a"), ("DELETED", "a")]
    assert a.metadata.name == "a"


def test_watch_without_resource_version_lists_then_streams(api, resources):
    resources.create_resource_slice(nvidia_slice("node-a", [nvidia_gpu(0)], name="a"))
    watch = kubernetes.watch.Watch()
    seen = []
    for event in watch.stream(resources.list_resource_slice, timeout_seconds=10):
        seen.append((event["type"], event["object"].metadata.name))
        if len(seen) == 1:
            resources.create_resource_slice(nvidia_slice("node-a", [nvidia_gpu(0)], name="b"))
        else:
            watch.stop()
    assert seen == [("ADDED", "a"), ("ADDED", "b")]


def test_watch_from_a_compacted_resource_version_gets_410(api, resources):
    old = str(api.resource_version)
    resources.create_resource_slice(nvidia_slice("node-a", [nvidia_gpu(0)]))
    api.compact()
    with pytest.raises(ApiException) as err:
        watch = kubernetes.watch.Watch()
        for _ in watch.stream(resources.list_resource_slice, resource_version=old, timeout_seconds=5):
            pass
    assert err.value.status == 410 and "too old resource version" in err.value.reason
    assert api.count("watch", "resourceslices", 410) == 1


def test_watch_ends_at_its_timeout(api, resources):
    started = time.monotonic()
    events = list(kubernetes.watch.Watch().stream(resources.list_resource_slice, timeout_seconds=1))
    assert events == []
    assert 0.9 <= time.monotonic() - started < 5


def test_close_watches_ends_open_streams(api, resources):
    ended = threading.Event()

    def watch() -> None:
        for _ in kubernetes.watch.Watch().stream(resources.list_resource_slice, timeout_seconds=30):
            pass
        ended.set()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    api.wait_for(lambda: api.open_watches("resourceslices") == 1)
    api.close_watches()
    assert ended.wait(10)
    api.wait_for(lambda: api.open_watches() == 0)


# --------------------------------------------------------------------------------------------------
# ResourceClaim, DeviceClass, Node, /version
# --------------------------------------------------------------------------------------------------


def test_resource_claim_create_get_and_status_round_trip(api, resources):
    created = resources.create_namespaced_resource_claim("default", gpu_claim("claim-1"))
    request = created.spec.devices.requests[0].exactly
    assert (request.allocation_mode, request.count) == ("ExactCount", 1)  # defaulted by the server
    assert created.status is None

    body = api.get("ResourceClaim", "claim-1", "default")
    body["status"] = {
        "allocation": {
            "devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": "node-a", "device": "gpu-0"}]},
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-a"]}]}
                ]
            },
        },
        "reservedFor": [{"resource": "pods", "name": "pod-1", "uid": "0d2c1e4a-0000-4000-8000-000000000001"}],
    }
    allocated = resources.replace_namespaced_resource_claim_status("claim-1", "default", body)
    assert allocated.status.allocation.devices.results[0].device == "gpu-0"

    read = resources.read_namespaced_resource_claim("claim-1", "default")
    assert read.status.reserved_for[0].name == "pod-1" and read.metadata.uid == created.metadata.uid

    changed = api.get("ResourceClaim", "claim-1", "default")
    changed["spec"]["devices"]["requests"][0]["exactly"]["count"] = 2
    with pytest.raises(ApiException) as err:
        resources.replace_namespaced_resource_claim("claim-1", "default", changed)
    assert err.value.status == 422 and "spec: Invalid value" in status_of(err.value)["message"]

    moved = api.get("ResourceClaim", "claim-1", "default")
    moved["status"]["allocation"]["devices"]["results"][0]["device"] = "gpu-1"
    with pytest.raises(ApiException) as err:
        resources.replace_namespaced_resource_claim_status("claim-1", "default", moved)
    assert "status.allocation: Invalid value" in status_of(err.value)["message"]


def test_device_class_create_list_delete(api, resources):
    selector = f"device.driver == '{DRIVER}' && device.attributes['{DRIVER}'].type == 'gpu'"
    resources.create_device_class(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "DeviceClass",
            "metadata": {"name": DRIVER},
            "spec": {"selectors": [{"cel": {"expression": selector}}], "extendedResourceName": "nvidia.com/gpu"},
        }
    )
    listed = resources.list_device_class()
    assert [c.metadata.name for c in listed.items] == [DRIVER]
    assert listed.items[0].spec.selectors[0].cel.expression == selector
    resources.delete_device_class(DRIVER)
    assert resources.list_device_class().items == []


def test_node_is_readable_for_owner_references(api):
    node = kubernetes.client.CoreV1Api(api.api_client()).read_node("node-a")
    assert node.metadata.uid == NODE_UID and node.metadata.labels == {"kubernetes.io/hostname": "node-a"}


def test_kubeconfig_points_the_client_at_the_stand_in(api, tmp_path):
    config = api.write_kubeconfig(tmp_path / "kubeconfig")
    client = kubernetes.config.new_client_from_config(config_file=str(config), persist_config=False)
    assert kubernetes.client.VersionApi(client).get_code().git_version == "v1.34.2"
    assert kubernetes.client.ResourceV1Api(client).list_resource_slice().items == []


@pytest.mark.parametrize("git_version", ["v1.34.2", "v1.36.3"])
def test_version_reports_the_configured_git_version(git_version):
    with ApiServer(git_version=git_version) as server:
        info = kubernetes.client.VersionApi(server.api_client()).get_code()
        assert info.git_version == git_version and info.minor == git_version.split(".")[1]


# --------------------------------------------------------------------------------------------------
# faults, limits, observation
# --------------------------------------------------------------------------------------------------


def test_down_refuses_connections_and_up_serves_again(api, resources):
    resources.create_resource_slice(nvidia_slice("node-a", [nvidia_gpu(0)], name="a"))
    api.down()
    with pytest.raises(urllib3.exceptions.MaxRetryError) as err:
        resources.list_resource_slice()
    assert "Connection refused" in str(err.value)
    api.up()
    assert [s.metadata.name for s in resources.list_resource_slice().items] == ["a"]  # state survives


def test_down_with_503_answers_every_request_with_it(api, resources):
    api.down(503)
    with pytest.raises(ApiException) as err:
        resources.list_resource_slice()
    assert err.value.status == 503 and status_of(err.value)["reason"] == "ServiceUnavailable"
    api.up()
    assert resources.list_resource_slice().items == []


def test_fail_next_fails_only_the_scripted_requests(api, resources):
    api.fail_next("create", "ResourceSlice", 500, n=1)
    with pytest.raises(ApiException) as err:
        resources.create_resource_slice(nvidia_slice("node-a", [nvidia_gpu(0)]))
    assert err.value.status == 500
    assert slices(api) == []
    resources.create_resource_slice(nvidia_slice("node-a", [nvidia_gpu(0)]))
    assert api.request_counts()[("create", "resourceslices")] == 2
    assert [r.status for r in api.requests(verb="create")] == [500, 201]


def test_a_dropped_connection_fails_a_create_and_stores_nothing(api, resources):
    api.fail_next("create", "resourceslices", 0)
    with pytest.raises(urllib3.exceptions.ProtocolError):
        resources.create_resource_slice(nvidia_slice("node-a", [nvidia_gpu(0)]))
    assert slices(api) == [] and [r.status for r in api.requests(verb="create")] == [0]


def test_python_side_create_keeps_an_allocated_claims_status(api, resources):
    claim = gpu_claim("claim-2")
    claim["metadata"]["namespace"] = "team-a"
    claim["status"] = {
        "allocation": {
            "devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": "node-a", "device": "gpu-3"}]}
        }
    }
    api.create("ResourceClaim", claim)
    read = resources.read_namespaced_resource_claim("claim-2", "team-a")
    assert read.status.allocation.devices.results[0].device == "gpu-3"
    bad = gpu_claim("claim-3")
    bad["status"] = {"reservedFor": [{"resource": "pods", "name": "p", "uid": "u-1"}]}
    with pytest.raises(Exception, match="may not be specified when `allocated` is not set"):
        api.create("ResourceClaim", bad)


def test_bodies_that_are_not_json_or_too_large_are_refused(api):
    with pytest.raises(ApiException) as err:
        raw_request(api.api_client(), "POST", SLICES, "driver: x", content_type="text/plain")
    assert err.value.status == 415
    with pytest.raises(ApiException) as err:
        raw_request(api.api_client(), "POST", SLICES, "{not json", content_type="application/json")
    assert err.value.status == 400
    with pytest.raises(ApiException) as err:
        raw_request(api.api_client(), "POST", SLICES, "x" * (3 * 1024 * 1024), content_type="application/json")
    assert err.value.status == 413 and "limit is 3145728" in status_of(err.value)["message"]
    assert slices(api) == []


def test_wait_for_wakes_on_a_change_from_another_thread(api, resources):
    thread = threading.Thread(
        target=resources.create_resource_slice, args=(nvidia_slice("node-a", [nvidia_gpu(0)]),), daemon=True
    )
    thread.start()
    created = api.wait_for(lambda: slices(api), timeout=10)
    assert created[0]["spec"]["nodeName"] == "node-a"
    thread.join(5)


def test_without_kubernetes_validate_it_serves_unchecked_schemas_and_says_so_once(monkeypatch, caplog):
    from agent.sim.apiserver import validate

    monkeypatch.setitem(sys.modules, "kubernetes_validate", None)  # makes the import fail
    monkeypatch.setattr(validate, "_warned", False)
    with caplog.at_level(logging.WARNING, logger="agent.sim.apiserver"):
        first, second = ApiServer(git_version="v1.36.3"), ApiServer()
    assert not first.schema_validation and not second.schema_validation
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert "WITHOUT OpenAPI schema validation" in caplog.records[0].getMessage()
    with first as server:
        server.add_node("node-a")
        client = resource_api(server)
        client.create_resource_slice(_list_attribute())  # the 1.34 schema would refuse it; nothing checks it now
        with pytest.raises(ApiException) as err:  # the semantic rules still apply
            client.create_resource_slice(nvidia_slice("node-a", [nvidia_gpu(0, compute_capability="8")]))
        assert err.value.status == 422


def test_binds_loopback_only():
    with pytest.raises(ValueError, match="loopback"):
        ApiServer(host="0.0.0.0")


def test_a_client_that_resets_its_connection_mid_request_leaves_no_traceback(
    api: ApiServer, capfd: pytest.CaptureFixture[str]
) -> None:
    """A killed agent's connection reset is routine for an API server: the stand-in serves on, quietly."""
    import socket
    import struct

    with socket.create_connection((api.host, api.port)) as client:
        client.sendall(b"GET /api/v1/nodes HTTP/1.1\r\nHost: x\r\n")  # the request's end never comes
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
    assert [n["metadata"]["name"] for n in api.objects("nodes")] == ["node-a", "node-b"]
    resource_api(api).list_resource_slice()  # a request after it is answered
    assert "Traceback" not in capfd.readouterr().err


def test_with_a_feature_gate_off_its_fields_are_dropped_from_what_is_written() -> None:
    """As a cluster without DRAConsumableCapacity / DRAPartitionableDevices: the rest of the object is stored."""
    shared = nvidia_gpu(0)
    shared["allowMultipleAllocations"] = True
    shared["capacity"]["memory"]["requestPolicy"] = {"default": "80Gi", "validRange": {"min": "1Gi"}}
    partition = nvidia_gpu(1)
    partition["consumesCounters"] = [{"counterSet": "gpu-1-counter-set", "counters": {"memory": {"value": "80Gi"}}}]
    with ApiServer(disabled_gates=["DRAConsumableCapacity", "DRAPartitionableDevices"]) as api:
        api.add_node("node-a")
        combined = nvidia_slice("node-a", [shared, partition])
        combined["spec"]["sharedCounters"] = [{"name": "gpu-1-counter-set", "counters": {"memory": {"value": "80Gi"}}}]
        stored = api.create("resourceslices", combined)
        gpu0, gpu1 = stored["spec"]["devices"]
        assert "allowMultipleAllocations" not in gpu0 and gpu0["capacity"]["memory"] == {"value": "80Gi"}
        assert "consumesCounters" not in gpu1 and "sharedCounters" not in stored["spec"]
        claim = gpu_claim("asks")
        claim["spec"]["devices"]["requests"][0]["exactly"]["capacity"] = {"requests": {"memory": "10Gi"}}
        stored_claim = api.create("resourceclaims", {**claim, "metadata": {"name": "asks", "namespace": "default"}})
        assert "capacity" not in stored_claim["spec"]["devices"]["requests"][0]["exactly"]
    with pytest.raises(ValueError, match="not DRAFancyThing"):
        ApiServer(disabled_gates=["DRAFancyThing"])


def test_with_the_gates_on_the_fields_are_kept() -> None:
    shared = nvidia_gpu(0)
    shared["allowMultipleAllocations"] = True
    with ApiServer() as api:
        api.add_node("node-a")
        stored = api.create("resourceslices", nvidia_slice("node-a", [shared]))
        assert stored["spec"]["devices"][0]["allowMultipleAllocations"] is True
