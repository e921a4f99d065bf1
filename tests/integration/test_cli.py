"""The ``tessera`` command line as a user runs it: a real subprocess, simulated nodes, exit codes.

These are the issue's acceptance checks. Each run costs ~0.3 s, so runs that several tests read are cached.
"""

from __future__ import annotations

import ctypes.util
import json
import os
import re
import subprocess
import sys
from functools import cache

import pytest

PRESETS = ["a100-mig", "dgx-a100", "dgx-h100", "t4x4"]
GPU_UUID = re.compile(r"^GPU-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}$")
MIG_UUID = re.compile(r"^MIG-[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}$")

MIXED_PROFILES_SPEC = """\
name: mixed-node
gpus:
  - model: A100-SXM4-80GB
    mig:
      instances: [3g.40gb, 1g.10gb]
  - model: A100-SXM4-80GB
    mig:
      instances: [1g.10gb]
"""


def tessera(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """Run ``python -m agent ARGS`` with only the given TESSERA_* variables set."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")} | env
    return subprocess.run(
        [sys.executable, "-m", "agent", *args], capture_output=True, text=True, env=environ, timeout=60, check=False
    )


@cache
def tessera_cached(*args: str) -> subprocess.CompletedProcess[str]:
    return tessera(*args)


def ok_json(*args: str) -> dict:
    result = tessera_cached(*args)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def assert_clean_failure(result: subprocess.CompletedProcess[str], code: int) -> str:
    assert result.returncode == code, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
    assert "tessera" in result.stderr
    return result.stderr


# --- plan -------------------------------------------------------------------------------------------------


def test_plan_dgx_a100_advertises_eight_full_gpus():
    document = ok_json("plan", "--node", "dgx-a100", "--format", "json")
    assert document["mig_strategy"] == "none"
    assert document["warnings"] == []
    assert list(document["resources"]) == ["nvidia.com/gpu"]
    gpus = document["resources"]["nvidia.com/gpu"]
    assert gpus["count"] == 8
    devices = gpus["devices"]
    assert len(devices) == 8
    assert [d["index"] for d in devices] == [str(i) for i in range(8)]
    for device in devices:
        assert GPU_UUID.match(device["id"]), device
        assert device["gpu"] == device["id"]
        assert device["mig"] is None
        assert device["memory_mib"] == 81920
    assert len({d["id"] for d in devices}) == 8
    assert [d["numa_node"] for d in devices] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_plan_json_is_stable_across_runs():
    first = tessera_cached("plan", "--node", "dgx-a100", "--format", "json")
    second = tessera("plan", "--node", "dgx-a100", "--format", "json")
    assert second.returncode == 0
    assert second.stdout == first.stdout


def test_plan_mixed_on_a100_mig():
    document = ok_json("plan", "--node", "a100-mig", "--mig-strategy", "mixed", "--format", "json")
    assert document["mig_strategy"] == "mixed"
    assert list(document["resources"]) == ["nvidia.com/mig-1g.10gb"]
    resource = document["resources"]["nvidia.com/mig-1g.10gb"]
    assert resource["count"] == 7
    devices = resource["devices"]
    assert [d["index"] for d in devices] == [f"0:{i}" for i in range(7)]
    assert len({d["gpu"] for d in devices}) == 1
    for device in devices:
        assert MIG_UUID.match(device["id"])
        assert device["mig"] == device["id"]
        assert device["profile"] == "1g.10gb"
        assert GPU_UUID.match(device["gpu"])


def test_plan_single_on_a100_mig_advertises_mig_devices_as_gpus():
    document = ok_json("plan", "--node", "a100-mig", "--mig-strategy", "single", "--format", "json")
    assert document["mig_strategy"] == "single"
    assert list(document["resources"]) == ["nvidia.com/gpu"]
    resource = document["resources"]["nvidia.com/gpu"]
    assert resource["count"] == 7
    mixed = ok_json("plan", "--node", "a100-mig", "--mig-strategy", "mixed", "--format", "json")
    # the same MIG devices, with the same UUIDs, in a separate run
    assert [d["id"] for d in resource["devices"]] == [
        d["id"] for d in mixed["resources"]["nvidia.com/mig-1g.10gb"]["devices"]
    ]


@pytest.fixture
def mixed_profiles_spec(tmp_path):
    path = tmp_path / "node.yaml"
    path.write_text(MIXED_PROFILES_SPEC, encoding="utf-8")
    return str(path)


def test_plan_single_with_mixed_profiles_fails_naming_both(mixed_profiles_spec):
    stderr = assert_clean_failure(tessera("plan", "--node", mixed_profiles_spec, "--mig-strategy", "single"), 1)
    assert "3g.40gb" in stderr
    assert "1g.10gb" in stderr
    assert "mixed" in stderr


def test_plan_table_lists_resources_and_a_summary(mixed_profiles_spec):
    result = tessera("plan", "--node", mixed_profiles_spec, "--mig-strategy", "mixed")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["RESOURCE", "DEVICE", "ID", "GPU", "INDEX", "PROFILE", "MEMORY"]
    rows = [line.split() for line in lines[1:] if line.startswith("nvidia.com/")]
    assert [(r[0], r[2], r[3], r[4]) for r in rows] == [
        ("nvidia.com/mig-1g.10gb", "0", "0:1", "1g.10gb"),
        ("nvidia.com/mig-1g.10gb", "1", "1:0", "1g.10gb"),
        ("nvidia.com/mig-3g.40gb", "0", "0:0", "3g.40gb"),
    ]
    assert all(MIG_UUID.match(r[1]) for r in rows)
    assert "Advertised (mig-strategy mixed): nvidia.com/mig-1g.10gb × 2, nvidia.com/mig-3g.40gb × 1" in lines


def test_env_twin_of_node():
    result = tessera("plan", TESSERA_NODE="t4x4")
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith("nvidia.com/")]
    assert [(r[0], r[2]) for r in rows] == [("nvidia.com/gpu", str(i)) for i in range(4)]
    assert "Advertised (mig-strategy none): nvidia.com/gpu × 4" in result.stdout.splitlines()
    assert "15360 MiB" in result.stdout


def test_invalid_env_value_is_a_usage_error():
    stderr = assert_clean_failure(tessera("plan", "--node", "t4x4", TESSERA_MIG_STRATEGY="bogus"), 2)
    assert "TESSERA_MIG_STRATEGY" in stderr
    assert "bogus" in stderr


# --- bad node specs -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("group", "field", "detail"),
    [
        ("model: A100-SXM4-99GB", "model", "A100-SXM4-80GB"),  # lists the known models
        ("model: A100-SXM4-80GB\n    mig:\n      instances: [1g.10gb, 5g.50gb]", "instances[1]", "5g.50gb"),
        (
            "model: A100-SXM4-80GB\n    mig:\n      instances: [" + ", ".join(["1g.10gb"] * 8) + "]",
            "instances[7]",
            "INSUFFICIENT_RESOURCES",
        ),
    ],
    ids=["unknown-model", "unknown-profile", "too-many-instances"],
)
def test_bad_spec_is_a_usage_error_naming_the_field(tmp_path, group, field, detail):
    path = tmp_path / "bad.yaml"
    path.write_text(f"gpus:\n  - {group}\n", encoding="utf-8")
    stderr = assert_clean_failure(tessera("plan", "--node", str(path)), 2)
    assert field in stderr
    assert detail in stderr


def test_unknown_preset_lists_the_presets():
    stderr = assert_clean_failure(tessera("inventory", "--node", "dgx-z100"), 2)
    assert "dgx-z100" in stderr
    for preset in PRESETS:
        assert preset in stderr


@pytest.mark.skipif(ctypes.util.find_library("nvidia-ml") is not None, reason="this machine has an NVIDIA driver")
def test_local_without_a_driver_fails_cleanly_with_a_hint():
    stderr = assert_clean_failure(tessera("plan", "--node", "local"), 3)
    assert "NVML" in stderr
    assert "--node" in stderr


# --- inventory ----------------------------------------------------------------------------------------------


def test_inventory_prints_like_nvidia_smi_list():
    result = tessera_cached("inventory", "--node", "a100-mig")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 8
    gpu = re.fullmatch(r"GPU 0: NVIDIA A100-SXM4-80GB \(UUID: (GPU-[0-9a-f-]+)\)", lines[0])
    assert gpu, lines[0]
    assert GPU_UUID.match(gpu[1])
    mig_uuids = []
    for number, line in enumerate(lines[1:]):
        mig = re.fullmatch(rf"  MIG 1g\.10gb +Device {number:>2}: \(UUID: (MIG-[0-9a-f-]+)\)", line)
        assert mig, line
        mig_uuids.append(mig[1])
    # the same UUIDs the plan advertises in another run
    mixed = ok_json("plan", "--node", "a100-mig", "--mig-strategy", "mixed", "--format", "json")
    devices = mixed["resources"]["nvidia.com/mig-1g.10gb"]["devices"]
    assert [d["id"] for d in devices] == mig_uuids
    assert {d["gpu"] for d in devices} == {gpu[1]}


def test_inventory_as_json_holds_every_gpu_and_mig_device_the_text_lists():
    inventory = ok_json("inventory", "--node", "a100-mig", "--format", "json")
    text = tessera_cached("inventory", "--node", "a100-mig").stdout
    assert [g["index"] for g in inventory["gpus"]] == [0]
    gpu = inventory["gpus"][0]
    assert gpu["name"] == "NVIDIA A100-SXM4-80GB" and gpu["mig_enabled"] is True
    assert f"(UUID: {gpu['uuid']})" in text
    migs = gpu["mig_devices"]
    assert len(migs) == 7 and all(f"(UUID: {m['uuid']})" in text for m in migs)
    assert {m["profile"] for m in migs} == {"1g.10gb"} and migs[0]["placement"] == {"start": 0, "size": 1}
    assert inventory["driver_version"] and inventory["failures"] == []


# --- bad input never prints a traceback -------------------------------------------------------------------------

DEEP = "a: " + "[" * 500 + "]" * 500  # the issue's ~1 kB config bomb
LAUGHS = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(9)
)


def write_bomb(tmp_path, kind: str):
    """A file (or FIFO) that breaks one input limit, and the words the error must say."""
    path = tmp_path / f"{kind}.yaml"
    if kind == "deep":
        path.write_text(DEEP, encoding="utf-8")
        return path, "nested 501 levels deep"
    if kind == "laughs":
        path.write_text(LAUGHS, encoding="utf-8")
        return path, "billion laughs"
    if kind == "huge":
        with path.open("wb") as stream:
            stream.truncate(100 << 20)  # 100 MB, sparse
        return path, "larger than the 1 MiB limit"
    if kind == "binary":
        path.write_bytes(bytes(range(256)) * 16)
        return path, "not UTF-8"
    if kind == "fifo":
        os.mkfifo(path)
        return path, "is a FIFO (named pipe), not a regular file"
    raise AssertionError(kind)


BOMBS = ["deep", "laughs", "huge", "binary", "fifo"]


def assert_no_traceback(result: subprocess.CompletedProcess[str], code: int) -> None:
    assert result.returncode == code, (result.stdout, result.stderr)
    assert "Traceback" not in result.stdout + result.stderr
    assert "internal error" not in result.stderr


@pytest.mark.parametrize("kind", BOMBS)
def test_validate_names_the_file_and_the_limit_and_exits_1(tmp_path, kind):
    path, expected = write_bomb(tmp_path, kind)
    result = tessera("validate", str(path))
    assert_no_traceback(result, 1)
    output = result.stdout + result.stderr
    assert expected in output
    error_lines = [line for line in output.splitlines() if expected in line]
    assert len(error_lines) == 1
    if kind in ("huge", "fifo", "binary"):  # refused before parsing: one line on stderr naming the file
        assert result.stderr == f"tessera: {path}: {error_lines[0].split(f'{path}: ', 1)[1]}\n"
    else:  # parsed and refused: the verdict names the file, the next line the problem
        assert f"{path.name}: INVALID" in result.stdout
        assert "0 of 1 config valid" in result.stdout


def test_validate_a_directory_with_bombs_reports_each_and_the_good_ones(tmp_path):
    for kind in ("deep", "laughs"):
        write_bomb(tmp_path, kind)
    os.mkfifo(tmp_path / "pipe")  # not a config: skipped
    (tmp_path / "good.yaml").write_text("version: v1\n", encoding="utf-8")
    result = tessera("validate", str(tmp_path))
    assert_no_traceback(result, 1)
    assert "deep.yaml: INVALID" in result.stdout
    assert "laughs.yaml: INVALID" in result.stdout
    assert "good.yaml: valid" in result.stdout
    assert "1 of 3 configs valid" in result.stdout


@pytest.mark.parametrize("kind", ["deep", "laughs", "fifo"])
def test_plan_with_a_config_bomb_is_one_line_and_exit_1(tmp_path, kind):
    path, expected = write_bomb(tmp_path, kind)
    stderr = assert_clean_failure(tessera("plan", "--node", "t4x4", "--config", str(path)), 1)  # invalid input
    assert "internal error" not in stderr
    assert f"{path}: " in stderr
    assert expected in stderr


@pytest.mark.parametrize(
    ("command", "kind"),
    [(("plan",), "deep"), (("inventory",), "huge"), (("mig", "export"), "binary"), (("plan",), "fifo")],
    ids=["plan-deep", "inventory-huge", "mig-export-binary", "plan-fifo"],
)
def test_a_node_spec_bomb_is_a_bad_node_spec_exit_2(tmp_path, command, kind):
    path, expected = write_bomb(tmp_path, kind)
    stderr = assert_clean_failure(tessera(*command, "--node", str(path)), 2)
    assert "internal error" not in stderr
    assert str(path) in stderr
    assert expected in stderr


@pytest.mark.parametrize(("verb", "kind"), [*(("apply", kind) for kind in [*BOMBS, "directory"]), ("assert", "laughs")])
def test_mig_with_a_layout_file_bomb_is_one_line_and_exit_1(tmp_path, verb, kind):
    if kind == "directory":
        path, expected = tmp_path, f"{tmp_path} is a directory; name a MIG layout file or a sharing config"
    else:
        path, expected = write_bomb(tmp_path, kind)
    stderr = assert_clean_failure(tessera("mig", verb, "--node", "a100-mig", "--config", str(path)), 1)  # invalid
    assert "internal error" not in stderr
    assert str(path) in stderr
    assert expected in stderr


def test_an_unexpected_exception_is_one_line_exit_70(monkeypatch, capsys):
    from agent import cli

    def broken(args):
        raise KeyError("bug\nsecond line")

    monkeypatch.setattr(cli, "_command", broken)
    monkeypatch.delenv("TESSERA_DEBUG", raising=False)
    monkeypatch.delenv("TESSERA_LOG_LEVEL", raising=False)
    assert cli.main(["validate", "x"]) == 70
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("tessera: internal error: KeyError: 'bug\\nsecond line', please report")
    assert "Traceback" not in err
    monkeypatch.setenv("TESSERA_DEBUG", "1")
    assert cli.main(["validate", "x"]) == 70
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert err.splitlines()[-1].startswith("tessera: internal error: KeyError")


# --- config selection never widens ------------------------------------------------------------------------------


def test_by_model_does_not_touch_an_a100_node():
    """configs/by-model.yaml matches T4, L4 and A10G only: an A100 node keeps its 8 whole GPUs, and says why."""
    result = tessera_cached("plan", "--node", "dgx-a100", "--config", "configs/by-model.yaml", "--format", "json")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert {name: r["count"] for name, r in document["resources"].items()} == {"nvidia.com/gpu": 8}
    assert (
        "tessera: config (defaults): no config applies: by-model.yaml matches only Tesla T4, NVIDIA L4, NVIDIA A10G; "
        "this node has NVIDIA A100-SXM4-80GB"
    ) in result.stderr
    on_t4 = ok_json("plan", "--node", "t4x4", "--config", "configs/by-model.yaml", "--format", "json")
    assert on_t4["resources"]["nvidia.com/gpu"]["count"] == 16
