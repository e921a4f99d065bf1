"""The kubelet's DRA protos (plugin registration v1, DRA v1 and v1beta1, DRA health v1alpha1 and v1) are wire-identical
to the kubelet's, and name the services the kubelet asks for. The stubs' freshness is checked by
test_proto_wire.py, which regenerates every proto."""

from __future__ import annotations

import json

import pytest

from agent.api.deviceplugin.v1beta1 import api_pb2 as deviceplugin
from agent.api.dra.v1 import api_pb2 as dra_v1
from agent.api.dra.v1beta1 import api_pb2 as dra_v1beta1
from agent.api.drahealth.v1 import api_pb2 as health_v1
from agent.api.drahealth.v1alpha1 import api_pb2 as health_v1alpha1
from agent.api.pluginregistration.v1 import api_pb2 as registration
from agent.api.podresources.v1 import api_pb2 as podresources
from tests.unit.proto_facts import assert_wire_matches, load_facts, method_paths

FACTS = "dra-api.json"
PROTOS = [
    (registration, "pluginregistration_v1"),
    (dra_v1, "dra_v1"),
    (dra_v1beta1, "dra_v1beta1"),
    (health_v1alpha1, "dra_health_v1alpha1"),
]
# The constants' keys for our stubs' services; "health v1" (v1.DRAResourceHealth) is kubelet master's (1.37).
SERVICES = {
    "registration": registration.DESCRIPTOR.services_by_name["Registration"],
    "dra v1": dra_v1.DESCRIPTOR.services_by_name["DRAPlugin"],
    "dra v1beta1": dra_v1beta1.DESCRIPTOR.services_by_name["DRAPlugin"],
    "health v1alpha1": health_v1alpha1.DESCRIPTOR.services_by_name["DRAResourceHealth"],
    "health v1": health_v1.DESCRIPTOR.services_by_name["DRAResourceHealth"],
}
MASTER_ONLY = "(master only)"


def _supported_version(service) -> str:
    """How a DRA plugin names a service in PluginInfo.supported_versions: <last package segment>.<Service>."""
    return f"{service.file.package.rsplit('.', 1)[-1]}.{service.name}"


@pytest.mark.parametrize(("module", "facts_name"), PROTOS)
def test_messages_enums_services_and_rpcs_match_the_kubelet(module, facts_name: str) -> None:
    assert_wire_matches(module.DESCRIPTOR, load_facts(FACTS)["protos"][facts_name])


def test_method_paths_are_the_ones_the_kubelet_calls() -> None:
    paths = load_facts(FACTS)["constants"]["method paths"]
    wanted = [path.removesuffix(f" {MASTER_ONLY}") for path in paths]  # master's v1 health service is served too
    modules = [module for module, _ in PROTOS] + [health_v1]
    assert sorted(p for module in modules for p in method_paths(module.DESCRIPTOR)) == sorted(wanted)


def test_the_v1_health_proto_is_v1alpha1s_messages_in_package_v1() -> None:
    """k/k #139477: the same proto as v1alpha1 under a v1 package (facts/dra.md E)."""
    table = load_facts(FACTS)["protos"]["dra_health_v1alpha1"]
    assert_wire_matches(health_v1.DESCRIPTOR, json.loads(json.dumps(table).replace("v1alpha1", "v1")))
    strings = load_facts(FACTS)["constants"]["supported_versions service strings"]
    assert _supported_version(SERVICES["health v1"]) == strings[f"health v1 {MASTER_ONLY}"]


def test_grpc_service_names() -> None:
    names = load_facts(FACTS)["constants"]["grpc full service names (NOT the same as the supported_versions strings)"]
    assert {key: names[key] for key in SERVICES} == {key: service.full_name for key, service in SERVICES.items()}


@pytest.mark.parametrize(
    ("key", "facts_name"),
    [("dra v1", "dra_v1"), ("dra v1beta1", "dra_v1beta1"), ("health v1alpha1", "dra_health_v1alpha1")],
)
def test_supported_versions_strings_name_our_services(key: str, facts_name: str) -> None:
    facts = load_facts(FACTS)
    strings = facts["constants"]["supported_versions service strings"]
    assert _supported_version(SERVICES[key]) == strings[key] == facts["protos"][facts_name]["supported_versions_string"]


def test_every_service_a_kubelet_or_the_go_helper_names_is_served_by_a_stub() -> None:
    constants = load_facts(FACTS)["constants"]
    kubelet = constants["kubelet side (pkg/kubelet/cm/dra, pluginmanager)"]
    helper = constants["kubeletplugin helper (k8s.io/dynamic-resource-allocation v0.36.2 / master)"]
    ours = {_supported_version(service) for key, service in SERVICES.items() if key != "registration"}
    wanted = [
        *kubelet["servicesSupportedByKubelet (1.34+)"],
        *kubelet["servicesSupportedByKubelet (<=1.33, older index copy)"],
        *(entry.split(" ")[0] for entry in helper["advertised supported_versions order"]),
    ]
    assert set(wanted) <= ours


def test_plugin_type_is_dra_plugin() -> None:
    facts = load_facts(FACTS)
    plugin_type = facts["constants"]["pluginregistration"]["DRAPlugin (PluginInfo.type)"]
    assert plugin_type == facts["protos"]["pluginregistration_v1"]["constants_go"]["DRAPlugin"] == "DRAPlugin"
    info = registration.PluginInfo(type=plugin_type, name="gpu.example.com", supported_versions=["v1.DRAPlugin"])
    assert registration.PluginInfo.FromString(info.SerializeToString()) == info


def test_all_kubelet_protos_share_one_descriptor_pool() -> None:
    """Bare packages (v1, v1beta1, v1alpha1, pluginregistration) and the api.proto file names do not clash."""
    files = [module.DESCRIPTOR for module in (deviceplugin, podresources, *(m for m, _ in PROTOS))]
    assert len({file.name for file in files}) == len(files)
    assert len({file.pool for file in files}) == 1
    assert (
        health_v1alpha1.DESCRIPTOR.pool.FindEnumTypeByName("v1alpha1.HealthStatus").values_by_name["UNHEALTHY"].number
        == 2
    )


def test_share_id_has_presence_in_v1_only() -> None:
    device = dra_v1.Device(pool_name="p", device_name="gpu-0")
    assert not device.HasField("share_id")
    device.share_id = ""
    assert device.HasField("share_id")
    assert "share_id" not in dra_v1beta1.Device.DESCRIPTOR.fields_by_name


def test_v1_and_v1beta1_messages_are_wire_compatible() -> None:
    """The same bytes mean the same claims and devices in both versions (share_id aside)."""
    request = dra_v1.NodePrepareResourcesRequest(claims=[dra_v1.Claim(namespace="ns", uid="u-1", name="c")])
    assert dra_v1beta1.NodePrepareResourcesRequest.FromString(request.SerializeToString()).claims[0].uid == "u-1"
    response = dra_v1beta1.NodePrepareResourcesResponse()
    response.claims["u-1"].devices.add(
        request_names=["r"], pool_name="p", device_name="gpu-0", cdi_device_ids=["example.com/gpu=u-1-gpu-0"]
    )
    parsed = dra_v1.NodePrepareResourcesResponse.FromString(response.SerializeToString())
    assert parsed.claims["u-1"].devices[0].cdi_device_ids == ["example.com/gpu=u-1-gpu-0"]
    assert not parsed.claims["u-1"].devices[0].HasField("share_id")


def test_an_empty_unprepare_entry_is_sent() -> None:
    """A successful unprepare answers every claim with an empty message; SetInParent puts the key on the wire."""
    response = dra_v1.NodeUnprepareResourcesResponse()
    response.claims["u-1"].SetInParent()
    assert list(dra_v1.NodeUnprepareResourcesResponse.FromString(response.SerializeToString()).claims) == ["u-1"]
