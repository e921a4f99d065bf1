"""The kubelet API protos are wire-identical to the kubelet's, and the committed stubs are up to date."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from agent.api.deviceplugin.v1beta1 import api_pb2 as deviceplugin
from agent.api.podresources.v1 import api_pb2 as podresources
from tests.unit.proto_facts import ROOT, assert_wire_matches, load_facts

FACTS = "kubelet-api.json"
PROTOS = [(deviceplugin, "deviceplugin_v1beta1"), (podresources, "podresources_v1")]


@pytest.mark.parametrize(("module", "facts_name"), PROTOS)
def test_messages_enums_services_and_rpcs_match_the_kubelet(module, facts_name: str) -> None:
    assert_wire_matches(module.DESCRIPTOR, load_facts(FACTS)["protos"][facts_name])


def _stubs(root: Path) -> list[Path]:
    api = root / "agent" / "api"
    return sorted(path.relative_to(root) for path in api.rglob("api_pb2*") if "__pycache__" not in path.parts)


def test_regenerating_the_stubs_changes_nothing(tmp_path: Path) -> None:
    """Covers every proto in proto/generate.py: no stale, missing or orphaned stub, and each is importable."""
    subprocess.run(
        [sys.executable, str(ROOT / "proto" / "generate.py"), "--out", str(tmp_path)], check=True, capture_output=True
    )
    generated = _stubs(tmp_path)
    assert len(generated) == 3 * len(list(ROOT.joinpath("proto").rglob("*.proto")))
    assert _stubs(ROOT) == generated
    for path in generated:
        committed = ROOT / path
        assert committed.read_bytes() == tmp_path.joinpath(path).read_bytes(), (
            f"{committed} is stale: run python proto/generate.py"
        )
        for package in committed.relative_to(ROOT / "agent").parents[:-1]:
            assert (ROOT / "agent" / package / "__init__.py").is_file(), f"agent/{package} lacks an __init__.py"
