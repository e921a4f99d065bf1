"""Each GPU's PCIe root, read from a sysfs laid out as the kernel lays it out (``agent.dra.pcie``)."""

from __future__ import annotations

from pathlib import Path

from agent.dra.pcie import numa_nodes, pcie_roots


def link(sysfs: Path, bus_id: str, target: Path) -> None:
    devices = sysfs / "bus" / "pci" / "devices"
    devices.mkdir(parents=True, exist_ok=True)
    target.mkdir(parents=True, exist_ok=True)
    (devices / bus_id).symlink_to(target)


def test_the_root_is_the_first_component_under_devices(tmp_path: Path) -> None:
    link(tmp_path, "0000:18:00.0", tmp_path / "devices" / "pci0000:17" / "0000:17:00.0" / "0000:18:00.0")
    link(tmp_path, "0000:c1:00.0", tmp_path / "devices" / "pci0000:c0" / "0000:c1:00.0")
    assert pcie_roots(["0000:18:00.0", "0000:c1:00.0"], tmp_path) == {
        "0000:18:00.0": "pci0000:17",
        "0000:c1:00.0": "pci0000:c0",
    }


def test_a_vmd_domain_with_more_digits_is_read(tmp_path: Path) -> None:
    link(tmp_path, "10000:01:00.0", tmp_path / "devices" / "pci10000:00" / "10000:00:02.0" / "10000:01:00.0")
    assert pcie_roots(["10000:01:00.0"], tmp_path) == {"10000:01:00.0": "pci10000:00"}


def test_gpus_sysfs_does_not_name_get_no_root(tmp_path: Path) -> None:
    link(tmp_path, "0000:18:00.0", tmp_path / "elsewhere" / "0000:18:00.0")  # not under /sys/devices
    link(tmp_path, "0000:19:00.0", tmp_path / "devices" / "virtual" / "0000:19:00.0")  # not a PCI root
    link(tmp_path, "0000:1a:00.0", tmp_path / "devices" / "pci0000:00" / "0000:1b:00.0")  # another device's link
    assert pcie_roots(["0000:18:00.0", "0000:19:00.0", "0000:1a:00.0", "0000:1c:00.0"], tmp_path) == {}
    assert pcie_roots(["0000:18:00.0"], tmp_path / "no-sysfs") == {}


def test_a_value_that_is_not_a_bus_id_never_becomes_a_path(tmp_path: Path) -> None:
    outside = tmp_path / "devices" / "pci0000:00" / "secret"
    outside.mkdir(parents=True)
    (tmp_path / "bus" / "pci" / "devices").mkdir(parents=True)
    assert pcie_roots(["../../../devices/pci0000:00/secret", "", "0000:18:00.0/.."], tmp_path) == {}


def test_the_numa_node_is_read_from_sysfs_and_minus_one_means_none(tmp_path: Path) -> None:
    for bus_id, text in {
        "0000:18:00.0": "1\n",
        "0000:19:00.0": "-1\n",
        "0000:1a:00.0": "node0",
        "0000:1b:00.0": "",
    }.items():
        device = tmp_path / "devices" / "pci0000:00" / bus_id
        link(tmp_path, bus_id, device)
        (device / "numa_node").write_text(text)
    link(tmp_path, "0000:1c:00.0", tmp_path / "devices" / "pci0000:00" / "0000:1c:00.0")  # no numa_node file
    found = numa_nodes(["0000:18:00.0", "0000:19:00.0", "0000:1a:00.0", "0000:1b:00.0", "0000:1c:00.0"], tmp_path)
    assert found == {"0000:18:00.0": 1, "0000:19:00.0": None}  # unreadable or absent: left to NVML
    assert numa_nodes(["../../etc", "0000:18:00.0/.."], tmp_path) == {}
