"""The kubelet API protos are wire-identical to the kubelet's, and the committed stubs are up to date."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf.descriptor import FieldDescriptor

from agent.api.deviceplugin.v1beta1 import api_pb2 as deviceplugin
from agent.api.podresources.v1 import api_pb2 as podresources

ROOT = Path(__file__).parents[2]
FACTS = ROOT.parent / "shared" / "facts" / "kubelet-api.json"

_SCALARS = {
    FieldDescriptor.TYPE_STRING: "string",
    FieldDescriptor.TYPE_BOOL: "bool",
    FieldDescriptor.TYPE_INT32: "int32",
    FieldDescriptor.TYPE_INT64: "int64",
    FieldDescriptor.TYPE_UINT64: "uint64",
}


def _label(field: FieldDescriptor) -> str:
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        return "map"
    if field.is_repeated:
        return "repeated"
    return "optional" if field.has_presence and field.message_type is None else "singular"


def _type(field: FieldDescriptor) -> str:
    if field.message_type is not None:
        entry = field.message_type
        if entry.GetOptions().map_entry:
            key, value = entry.fields_by_name["key"], entry.fields_by_name["value"]
            return f"map<{_type(key)}, {_type(value)}>"
        return entry.full_name
    return _SCALARS[field.type]


def _facts(name: str) -> dict:
    if not FACTS.exists():
        pytest.skip("shared/facts is not beside this checkout")
    return json.loads(FACTS.read_text())["protos"][name]


@pytest.mark.parametrize(
    ("module", "facts_name"), [(deviceplugin, "deviceplugin_v1beta1"), (podresources, "podresources_v1")]
)
def test_messages_and_fields_match_the_kubelet(module, facts_name: str) -> None:
    facts = _facts(facts_name)
    file = module.DESCRIPTOR
    assert file.package == facts["package"]
    ours = {name: message for name, message in file.message_types_by_name.items()}
    assert sorted(ours) == sorted(m["name"] for m in facts["messages"])
    for message in facts["messages"]:
        fields = ours[message["name"]].fields
        got = [(f.name, f.number, _type(f), _label(f)) for f in fields]
        want = [(f["name"], f["number"], f["type"], f["label"]) for f in message["fields"]]
        assert got == want, message["name"]


@pytest.mark.parametrize(
    ("module", "facts_name"), [(deviceplugin, "deviceplugin_v1beta1"), (podresources, "podresources_v1")]
)
def test_services_and_rpcs_match_the_kubelet(module, facts_name: str) -> None:
    facts = _facts(facts_name)
    services = module.DESCRIPTOR.services_by_name
    assert sorted(services) == sorted(s["name"] for s in facts["services"])
    for service in facts["services"]:
        methods = services[service["name"]].methods
        got = [
            (
                f"/{services[service['name']].full_name}/{m.name}",
                m.input_type.full_name,
                m.output_type.full_name,
                m.client_streaming,
                m.server_streaming,
            )
            for m in methods
        ]
        want = [
            (r["method_path"], r["request"], r["response"], r["client_streaming"], r["server_streaming"])
            for r in service["rpcs"]
        ]
        assert got == want


def test_regenerating_the_stubs_changes_nothing(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "proto" / "generate.py"), "--out", str(tmp_path)], check=True, capture_output=True
    )
    generated = sorted(tmp_path.joinpath("agent", "api").rglob("api_pb2*"))
    assert len(generated) == 6
    for path in generated:
        committed = ROOT / path.relative_to(tmp_path)
        assert committed.read_bytes() == path.read_bytes(), f"{committed} is stale: run python proto/generate.py"
