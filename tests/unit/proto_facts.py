"""Compare a compiled kubelet API proto with its fact table in tests/data (kubelet-api.json, dra-api.json).

A fact table describes each proto by package, messages (fields with name, number, type, label, json_name),
enums and services (rpcs with method path, request, response and streaming flags), dumped from the upstream
descriptors. The wire tests assert that the descriptors of our generated stubs say exactly the same.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from google.protobuf.descriptor import FieldDescriptor, FileDescriptor
from google.protobuf.descriptor_pb2 import FileDescriptorProto

ROOT = Path(__file__).parents[2]
FACTS_DIR = ROOT / "tests" / "data"  # copies of the project's facts, with their sources (tests/data/README.md)

_SCALARS = {
    FieldDescriptor.TYPE_STRING: "string",
    FieldDescriptor.TYPE_BOOL: "bool",
    FieldDescriptor.TYPE_INT32: "int32",
    FieldDescriptor.TYPE_INT64: "int64",
    FieldDescriptor.TYPE_UINT64: "uint64",
}


def field_label(field: FieldDescriptor) -> str:
    """The fact tables' label: singular, optional (proto3 explicit presence), repeated or map."""
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        return "map"
    if field.is_repeated:
        return "repeated"
    return "optional" if field.has_presence and field.message_type is None else "singular"


def field_type(field: FieldDescriptor) -> str:
    """The fact tables' type: a scalar, a fully qualified message or enum name, or map<key, value>."""
    if field.message_type is not None:
        entry = field.message_type
        if entry.GetOptions().map_entry:
            key, value = entry.fields_by_name["key"], entry.fields_by_name["value"]
            return f"map<{field_type(key)}, {field_type(value)}>"
        return entry.full_name
    if field.enum_type is not None:
        return field.enum_type.full_name
    return _SCALARS[field.type]


def load_facts(file_name: str) -> dict:
    """A whole fact file, refused when it is no longer the copy recorded in tests/data/SHA256SUMS."""
    path = FACTS_DIR / file_name
    recorded = dict(line.split("  ", 1)[::-1] for line in (FACTS_DIR / "SHA256SUMS").read_text().splitlines())
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == recorded[file_name], f"{path} differs from the copy of the facts (tests/data/README.md)"
    return json.loads(path.read_text())


def assert_messages_match(file: FileDescriptor, facts: dict) -> None:
    """Package, every message with its fields in declaration order, and every enum with its values."""
    assert file.package == facts["package"]
    proto = FileDescriptorProto()
    file.CopyToProto(proto)
    assert proto.syntax == facts["syntax"]
    messages = file.message_types_by_name
    assert sorted(messages) == sorted(m["name"] for m in facts["messages"])
    for message in facts["messages"]:
        ours = messages[message["name"]]
        assert ours.full_name == message["full_name"]
        got = [(f.name, f.number, field_type(f), field_label(f), f.json_name) for f in ours.fields]
        want = [(f["name"], f["number"], f["type"], f["label"], f["json_name"]) for f in message["fields"]]
        assert got == want, message["name"]
    enums = file.enum_types_by_name
    assert sorted(enums) == sorted(e["name"] for e in facts["enums"])
    for enum in facts["enums"]:
        ours = enums[enum["name"]]
        assert ours.full_name == enum["full_name"]
        assert [(v.name, v.number) for v in ours.values] == [(v["name"], v["number"]) for v in enum["values"]]


def method_paths(file: FileDescriptor) -> list[str]:
    """The gRPC method paths (/<package>.<Service>/<Method>) of every rpc the file declares."""
    return [
        f"/{service.full_name}/{method.name}"
        for service in file.services_by_name.values()
        for method in service.methods
    ]


def assert_services_match(file: FileDescriptor, facts: dict) -> None:
    """Every service with its rpcs in order: method path, request, response and streaming flags."""
    services = file.services_by_name
    assert sorted(services) == sorted(s["name"] for s in facts["services"])
    for service in facts["services"]:
        ours = services[service["name"]]
        assert ours.full_name == service["full_name"]
        got = [
            (
                f"/{ours.full_name}/{m.name}",
                m.input_type.full_name,
                m.output_type.full_name,
                m.client_streaming,
                m.server_streaming,
            )
            for m in ours.methods
        ]
        want = [
            (r["method_path"], r["request"], r["response"], r["client_streaming"], r["server_streaming"])
            for r in service["rpcs"]
        ]
        assert got == want, service["name"]


def assert_wire_matches(file: FileDescriptor, facts: dict) -> None:
    """Everything the fact table says about one proto file: messages, enums, services and rpcs."""
    assert_messages_match(file, facts)
    assert_services_match(file, facts)
