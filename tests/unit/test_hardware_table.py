"""The simulator's hardware table is the facts' table, and covers the models the sharing scenarios use."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from agent.sim.nvml.hardware import find_model, hardware_table

PACKAGED = Path(__file__).parents[2] / "agent" / "data" / "mig-profiles.json"
DIGESTS = Path(__file__).parents[1] / "data" / "SHA256SUMS"  # the facts as copied (tests/data/README.md)


def test_packaged_mig_table_is_the_facts_table() -> None:
    recorded = dict(line.split("  ", 1)[::-1] for line in DIGESTS.read_text().splitlines())
    assert hashlib.sha256(PACKAGED.read_bytes()).hexdigest() == recorded["../../agent/data/mig-profiles.json"]


@pytest.mark.parametrize(
    ("key", "nvml_name", "memory_mib", "cc"),
    [
        ("T4", "Tesla T4", 15360, (7, 5)),
        ("V100-SXM2-16GB", "Tesla V100-SXM2-16GB", 16160, (7, 0)),
        ("L4", "NVIDIA L4", 23034, (8, 9)),
        ("A10G", "NVIDIA A10G", 23028, (8, 6)),
    ],
)
def test_non_mig_models_for_sharing_scenarios(key: str, nvml_name: str, memory_mib: int, cc: tuple[int, int]) -> None:
    model = hardware_table()[key]
    assert (model.nvml_name, model.memory_mib, model.compute_capability) == (nvml_name, memory_mib, cc)
    assert not model.mig_capable


def test_every_mig_model_of_the_facts_is_simulated() -> None:
    facts = json.loads(PACKAGED.read_text())["gpus"]
    for key, raw in facts.items():
        model = hardware_table()[key]
        assert model.mig_capable
        assert [p.name for p in model.gi_profiles] == [p["name"] for p in raw["gpu_instance_profiles"]]
        for profile in model.gi_profiles:
            assert profile.memory_mib > 0, f"{key} {profile.name} has no memory size"
            assert profile.full_ci_profile().slice_count == profile.slice_count


def test_models_are_found_by_key_or_by_the_name_nvml_reports() -> None:
    assert find_model("NVIDIA A100-SXM4-80GB") is hardware_table()["A100-SXM4-80GB"]
    assert find_model("tesla t4") is hardware_table()["T4"]
    assert find_model("A100-PCIE-40GB") is None
