"""A device's nodes for its claim's CDI entry: MIG capability minors read from a driver's /proc tree under tmp."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.core.dra.cdi import DeviceNode, mig_nodes
from agent.core.dra.devices import DraDevice
from agent.dra.devnodes import (
    DeviceNodeError,
    capability_files,
    capability_minor,
    caps_major,
    default_device_nodes,
    device_nodes,
)

CAPS_MAJOR = 508
PROC_DEVICES = f"""Character devices:
  1 mem
195 nvidia
195 nvidiactl
{CAPS_MAJOR + 1} nvidia-caps-imex-channels
{CAPS_MAJOR} nvidia-caps
510 nvidia-uvm

Block devices:
  7 loop
259 blkext
"""


def device(name: str, gpu_minor: int, gi_id: int | None = None, ci_id: int | None = None) -> DraDevice:
    kind = "mig" if "-mig-" in name else "gpu"
    return DraDevice(name, kind, f"UUID-{name}", None, gpu_minor, {}, {}, gi_id=gi_id, ci_id=ci_id)


GPU = device("gpu-1", 1)
MIG = device("gpu-2-mig-3g40gb-9-4", 2, gi_id=1, ci_id=0)


def capability(minor: int, mode: int = 292) -> str:
    """A capability file as the driver writes it (newer drivers add DeviceFileModify)."""
    return f"DeviceFileMinor: {minor}\nDeviceFileMode: {mode}\nDeviceFileModify: 1\n"


def fake_proc(root: Path, *, gpu_minor: int = 2, instances: dict[tuple[int, int], tuple[int, int]]) -> Path:
    """``root`` as the driver's /proc: ``instances`` maps (gi, ci) to (GI capability minor, CI capability minor)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "devices").write_text(PROC_DEVICES)
    for (gi, ci), (gi_minor, ci_minor) in instances.items():
        gi_access, ci_access = capability_files(root, gpu_minor, gi, ci)
        ci_access.parent.mkdir(parents=True, exist_ok=True)
        gi_access.write_text(capability(gi_minor))
        ci_access.write_text(capability(ci_minor, mode=256))
    return root


def test_the_capability_files_are_where_the_driver_publishes_them(tmp_path):
    gi, ci = capability_files(tmp_path, 3, 13, 2)
    assert gi == tmp_path / "driver/nvidia/capabilities/gpu3/mig/gi13/access"
    assert ci == tmp_path / "driver/nvidia/capabilities/gpu3/mig/gi13/ci2/access"


def test_a_mig_device_gets_its_gpus_node_and_its_gi_and_ci_capability_nodes(tmp_path):
    proc = fake_proc(tmp_path / "proc", instances={(1, 0): (21, 22), (2, 0): (30, 31)})
    nodes = device_nodes(MIG, proc)
    assert nodes == mig_nodes(2, CAPS_MAJOR, 21, 22)
    assert [n.to_cdi() for n in nodes] == [
        {"path": "/dev/nvidia2"},
        {"path": "/dev/nvidia-caps/nvidia-cap21", "type": "c", "major": CAPS_MAJOR, "minor": 21, "permissions": "rw"},
        {"path": "/dev/nvidia-caps/nvidia-cap22", "type": "c", "major": CAPS_MAJOR, "minor": 22, "permissions": "rw"},
    ]


def test_a_full_gpu_needs_only_its_node_and_nothing_is_read(tmp_path):
    assert device_nodes(GPU, tmp_path / "absent") == (DeviceNode("/dev/nvidia1"),)


def test_with_node_wide_cdi_the_gpus_node_is_enough_and_nothing_is_read(tmp_path):
    nodes = default_device_nodes(True, tmp_path / "absent")
    assert tuple(nodes(MIG)) == (DeviceNode("/dev/nvidia2"),)
    assert tuple(nodes(GPU)) == (DeviceNode("/dev/nvidia1"),)


def test_without_node_wide_cdi_the_default_reads_the_capability_nodes(tmp_path):
    proc = fake_proc(tmp_path / "proc", instances={(1, 0): (21, 22)})
    nodes = default_device_nodes(False, proc)
    assert tuple(nodes(MIG)) == mig_nodes(2, CAPS_MAJOR, 21, 22)
    assert tuple(nodes(GPU)) == (DeviceNode("/dev/nvidia1"),)


def test_the_minors_are_read_afresh_after_mig_is_reconfigured(tmp_path):
    proc = fake_proc(tmp_path / "proc", instances={(1, 0): (21, 22)})
    assert device_nodes(MIG, proc)[1].minor == 21
    fake_proc(proc, instances={(1, 0): (40, 41)})
    assert [n.minor for n in device_nodes(MIG, proc)[1:]] == [40, 41]


def test_a_missing_capability_file_is_an_error_naming_it(tmp_path):
    proc = fake_proc(tmp_path / "proc", instances={(2, 0): (30, 31)})  # GI 1 does not exist
    with pytest.raises(DeviceNodeError, match=r"cannot read .*/gpu2/mig/gi1/access: No such file"):
        device_nodes(MIG, proc)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("DeviceFileMode: 292\n", "has no DeviceFileMinor line"),
        ("", "has no DeviceFileMinor line"),
        ("DeviceFileMinor: -3\nDeviceFileMode: 292\n", "'-3' is not a device minor number"),
        ("DeviceFileMinor: twelve\n", "'twelve' is not a device minor number"),
        ("DeviceFileMinor: 1048576\n", "'1048576' is not a device minor number"),
    ],
)
def test_a_capability_file_not_in_the_drivers_format_is_refused(tmp_path, content: str, message: str):
    access = tmp_path / "access"
    access.write_text(content)
    with pytest.raises(DeviceNodeError, match=message) as error:
        capability_minor(access)
    assert str(access) in str(error.value)


def test_the_minor_line_is_found_among_the_others(tmp_path):
    access = tmp_path / "access"
    access.write_text("DeviceFileMode: 256\nDeviceFileMinor:   7 \nDeviceFileModify: 1\n")
    assert capability_minor(access) == 7


def test_the_caps_major_is_the_nvidia_caps_character_device(tmp_path):
    (tmp_path / "devices").write_text(PROC_DEVICES)
    assert caps_major(tmp_path) == CAPS_MAJOR  # not nvidia-caps-imex-channels


@pytest.mark.parametrize(
    "devices",
    [
        "Character devices:\n195 nvidia\n509 nvidia-caps-imex-channels\n\nBlock devices:\n",
        "Character devices:\n195 nvidia\n\nBlock devices:\n508 nvidia-caps\n",  # only a character device counts
    ],
)
def test_no_nvidia_caps_character_device_is_an_error(tmp_path, devices: str):
    (tmp_path / "devices").write_text(devices)
    with pytest.raises(DeviceNodeError, match="lists no nvidia-caps character device"):
        caps_major(tmp_path)


def test_a_mig_device_without_instance_ids_is_refused(tmp_path):
    proc = fake_proc(tmp_path / "proc", instances={(1, 0): (21, 22)})
    with pytest.raises(DeviceNodeError, match="gpu-2-mig-3g40gb-9-4 has no GPU or compute instance ID"):
        device_nodes(device("gpu-2-mig-3g40gb-9-4", 2), proc)


@pytest.mark.parametrize(
    ("table", "missing"),
    [
        ("config 1\nmonitor 2\ngpu2/gi1/access 21\ngpu2/gi1/ci1/access 23\n", "gpu2/gi1/ci0/access"),
        ("config 1\ngpu2/gi1/ci0/access 22\ngpu2/gi2/access 30\n", "gpu2/gi1/access"),
        ("", "gpu2/gi1/access, gpu2/gi1/ci0/access"),
        ("gpu2/gi1/access 1048576\ngpu2/gi1/ci0/access 22\n", "gpu2/gi1/access"),  # over Linux's 20-bit minors
    ],
)
def test_a_mig_minors_table_without_the_devices_capabilities_is_an_error_naming_it(tmp_path, table: str, missing: str):
    """Where the driver's table is, it is the answer: the per-instance files are not consulted behind its back."""
    proc = fake_proc(tmp_path / "proc", instances={(1, 0): (21, 22)})
    minors = proc / "driver/nvidia-caps/mig-minors"
    minors.parent.mkdir(parents=True)
    minors.write_text(table)
    with pytest.raises(DeviceNodeError) as error:
        device_nodes(MIG, proc)
    assert str(error.value) == f"{minors} lists no minor for {missing}; is it the NVIDIA driver's?"
