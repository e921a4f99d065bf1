"""The driver's common CDI edits: found under a driver root laid out as on a node, built as NVIDIA's toolkit builds
them, and a clear refusal where the driver is missing."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from agent.core.cdi_edits import (
    DEVICE_PLUGIN_KIND,
    DriverMissing,
    common_edits,
    device_plugin_spec,
    mig_minor_keys,
    parse_mig_minors,
    spec_file_name,
)
from agent.core.dra.cdi import CdiError, gpu_nodes
from agent.gpu.driver_root import CommonEdits, DriverRoot, discover_driver
from agent.sim.driver_root import VERSION, make_driver_root, mig_minors_table

LIB = "/usr/lib/x86_64-linux-gnu"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return make_driver_root(tmp_path / "driver", [0, 1])


def mounts(edits: dict) -> dict[str, dict]:
    return {m["containerPath"]: m for m in edits["mounts"]}


def test_the_driver_root_gives_its_libraries_binaries_firmware_and_control_nodes(root: Path):
    edits = common_edits(discover_driver(DriverRoot(root)))
    assert edits["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]
    assert edits["deviceNodes"] == [
        {"path": f"/dev/{name}", "hostPath": f"{root}/dev/{name}"}
        for name in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
    ]
    found = mounts(edits)
    assert next(iter(found)) == f"{LIB}/libcuda.so.{VERSION}"  # libcuda first, as nvcdi lists it
    libraries = {p.rsplit("/", 1)[1] for p in found if p.startswith(LIB) and p.endswith(VERSION)}
    assert {f"libnvidia-ml.so.{VERSION}", f"libnvidia-ptxjitcompiler.so.{VERSION}"} <= libraries
    assert found[f"{LIB}/libcuda.so.{VERSION}"] == {
        "hostPath": f"{root}{LIB}/libcuda.so.{VERSION}",
        "containerPath": f"{LIB}/libcuda.so.{VERSION}",
        "options": ["ro", "nosuid", "nodev", "rbind", "rprivate"],
    }
    assert found["/usr/bin/nvidia-smi"]["hostPath"] == f"{root}/usr/bin/nvidia-smi"
    assert {"/usr/bin/nvidia-cuda-mps-control", "/usr/bin/nvidia-cuda-mps-server"} <= set(found)
    assert found[f"/lib/firmware/nvidia/{VERSION}"]["hostPath"] == f"{root}/lib/firmware/nvidia/{VERSION}"
    # no hook binary: the SONAME links are mounted (a bind mount follows the host's link to the library)
    assert {f"{LIB}/libcuda.so.1", f"{LIB}/libnvidia-ml.so.1"} <= set(found)
    assert "hooks" not in edits


def test_a_driver_seen_elsewhere_is_named_by_its_host_paths(root: Path):
    """The agent sees the GPU operator's /run/nvidia/driver at /driver-root: the spec names the host's paths."""
    host = Path("/run/nvidia/driver")
    edits = common_edits(discover_driver(DriverRoot(host, container_root=root)))
    assert mounts(edits)[f"{LIB}/libcuda.so.{VERSION}"]["hostPath"] == f"{host}{LIB}/libcuda.so.{VERSION}"
    assert edits["deviceNodes"][0] == {"path": "/dev/nvidiactl", "hostPath": f"{host}/dev/nvidiactl"}


def test_the_device_nodes_come_from_the_dev_root_when_it_is_another(root: Path, tmp_path: Path):
    dev_root = tmp_path / "host"
    (dev_root / "dev").mkdir(parents=True)
    (dev_root / "dev" / "nvidiactl").touch()
    edits = common_edits(discover_driver(DriverRoot(root, dev_root=dev_root)))
    assert edits["deviceNodes"] == [{"path": "/dev/nvidiactl", "hostPath": f"{dev_root}/dev/nvidiactl"}]


def test_with_the_hook_binary_the_spec_runs_create_symlinks_and_update_ldcache(tmp_path: Path):
    root = make_driver_root(tmp_path / "driver", [0], hook=True)
    edits = common_edits(discover_driver(DriverRoot(root)))
    hook = f"{root}/usr/bin/nvidia-cdi-hook"
    create, ldcache = edits["hooks"]
    assert create["hookName"] == ldcache["hookName"] == "createContainer"
    assert create["path"] == ldcache["path"] == hook
    assert create["args"][:2] == ["nvidia-cdi-hook", "create-symlinks"]
    links = create["args"][3::2]
    assert f"libcuda.so.{VERSION}::{LIB}/libcuda.so.1" in links and f"libcuda.so.1::{LIB}/libcuda.so" in links
    assert ldcache["args"] == ["nvidia-cdi-hook", "update-ldcache", "--folder", LIB]
    assert f"{LIB}/libcuda.so.1" not in mounts(edits)  # the hook makes the links in the container
    given = common_edits(discover_driver(DriverRoot(root, hook_path="/usr/bin/nvidia-ctk")))  # NVIDIA's flag
    assert [h["args"][:3] for h in given["hooks"]] == [["nvidia-ctk", "hook", "create-symlinks"],
                                                       ["nvidia-ctk", "hook", "update-ldcache"]]  # fmt: skip


@pytest.mark.parametrize(
    ("remove", "missing"),
    [
        ("dev/nvidiactl", "/dev/nvidiactl"),
        (f"usr/lib/x86_64-linux-gnu/libcuda.so.{VERSION}", "libcuda.so.<version>"),
        (f"usr/lib/x86_64-linux-gnu/libnvidia-ml.so.{VERSION}", "libnvidia-ml.so.<version>"),
    ],
)
def test_a_driver_root_without_what_every_container_needs_is_refused_naming_it(root: Path, remove: str, missing: str):
    (root / remove).unlink()
    with pytest.raises(DriverMissing) as refused:
        discover_driver(DriverRoot(root))
    message = str(refused.value)
    named, _, where = message.partition(" not found under ")
    assert missing in named.split(": ", 1)[1].split(", ") and where.startswith(f"the driver root {root};")
    assert "--driver-root" in message and isinstance(refused.value, CdiError)


def test_common_edits_are_kept_a_while_and_a_missing_driver_is_found_once_installed(tmp_path: Path):
    now = [0.0]
    source = CommonEdits(DriverRoot(tmp_path / "driver"), ttl=60, clock=lambda: now[0])
    with pytest.raises(DriverMissing):
        source()
    make_driver_root(tmp_path / "driver", [0])  # the driver installed after the agent started
    first = source()
    assert first["mounts"] and source() is first  # kept: a burst of Prepares reads the driver root once
    shutil.rmtree(tmp_path / "driver" / "lib")  # the firmware gone (a driver upgrade under way)
    assert source() is first
    now[0] = 61.0
    assert f"/lib/firmware/nvidia/{VERSION}" not in mounts(source())  # read again after the ttl


def test_mig_minors_are_the_drivers_table():
    minors = parse_mig_minors(mig_minors_table())
    assert minors["config"] == 1 and minors["monitor"] == 2
    assert minors["gpu0/gi0/access"] == 3 and minors["gpu0/gi0/ci0/access"] == 4 and minors["gpu0/gi1/access"] == 12
    gi, ci = mig_minor_keys(2, 5, 1)
    assert (gi, ci) == ("gpu2/gi5/access", "gpu2/gi5/ci1/access")
    assert minors[gi] == 3 + 2 * 135 + 5 * 9 and minors[ci] == minors[gi] + 2
    assert max(minors.values()) == 2 + 32 * 15 * 9  # gpu31/gi14/ci7, the last


def test_the_device_plugin_spec_holds_each_device_and_the_common_edits(root: Path):
    common = common_edits(discover_driver(DriverRoot(root)))
    spec = device_plugin_spec(DEVICE_PLUGIN_KIND, {"GPU-aaaa": gpu_nodes(0, str(root))}, common)
    assert spec["cdiVersion"] == "0.5.0" and spec["kind"] == "k8s.device-plugin.nvidia.com/gpu"
    assert spec["devices"] == [
        {
            "name": "GPU-aaaa",
            "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0", "hostPath": f"{root}/dev/nvidia0"}]},
        }
    ]
    assert spec["containerEdits"] == common
    assert spec_file_name(DEVICE_PLUGIN_KIND) == "k8s.device-plugin.nvidia.com-gpu.yaml"
    for kind in ("nvidia.com", "a/b/c", "../x/gpu", "Nvidia.com/gpu"):
        with pytest.raises(CdiError, match="--cdi-kind"):
            spec_file_name(kind)
