"""The device plugin's CDI spec follows the devices it advertises: written for the simulated node's GPUs and MIG
devices (read through NVML as the agent reads them), written again when the MIG layout changes, kept when the
driver root cannot be read."""

from __future__ import annotations

from pathlib import Path

import yaml

from agent.core.cdi_edits import DEVICE_PLUGIN_KIND
from agent.core.inventory import Inventory
from agent.core.resources import Device
from agent.core.snapshot import ResourceSnapshot
from agent.gpu.discovery import discover
from agent.gpu.driver_root import DriverRoot
from agent.plugin.cdi_spec import DevicePluginCdi
from agent.sim.driver_root import sim_driver_root

NODE = {
    "gpus": [{"model": "A100-SXM4-80GB", "mig": {"instances": ["3g.40gb", "3g.40gb"]}}, {"model": "A100-SXM4-80GB"}]
}


def advertised(inventory: Inventory) -> dict[str, ResourceSnapshot]:
    """Every GPU without MIG devices and every MIG device, as one resource (what the plugin serves)."""
    devices = []
    for gpu in inventory.gpus:
        devices += [
            Device(m.uuid, gpu.uuid, gpu.index, m.index, m.memory_mib, mig_uuid=m.uuid) for m in gpu.mig_devices
        ]
        if not gpu.mig_devices:
            devices.append(Device(gpu.uuid, gpu.uuid, gpu.index, str(gpu.index), gpu.memory_mib))
    return {"r": ResourceSnapshot("r", tuple(devices), {d.id: True for d in devices})}


def entries(path: Path) -> dict[str, list[str]]:
    spec = yaml.safe_load(path.read_text())
    return {d["name"]: [n["path"] for n in d["containerEdits"]["deviceNodes"]] for d in spec["devices"]}


def test_the_spec_is_written_again_when_the_mig_layout_changes_and_kept_when_the_driver_is_gone(sim_node, tmp_path):
    driver = sim_node(NODE)
    root = sim_driver_root(tmp_path / "driver")
    cdi = DevicePluginCdi(tmp_path / "cdi", root)
    inventory = discover()
    path = cdi.refresh(DEVICE_PLUGIN_KIND, inventory, advertised(inventory))
    assert path == tmp_path / "cdi" / "k8s.device-plugin.nvidia.com-gpu.yaml"
    (first, _), (second, _) = [(ci.uuid, gi) for gi, ci in driver.gpus[0].mig_devices()]
    written = entries(path)
    assert list(written) == [first, second, driver.gpus[1].uuid]
    assert written[first][0] == "/dev/nvidia0" and written[first][1].startswith("/dev/nvidia-caps/nvidia-cap")
    assert written[driver.gpus[1].uuid] == ["/dev/nvidia1"]

    gi, ci = driver.gpus[0].mig_devices()[1]
    driver.destroy_compute_instance(0, gi, ci)
    driver.destroy_gpu_instance(0, gi)
    inventory = discover()
    assert cdi.refresh(DEVICE_PLUGIN_KIND, inventory, advertised(inventory)) == path
    assert list(entries(path)) == [first, driver.gpus[1].uuid]  # the destroyed MIG device is gone from the spec

    broken = DevicePluginCdi(tmp_path / "cdi", DriverRoot(tmp_path / "nowhere"))
    assert broken.refresh(DEVICE_PLUGIN_KIND, inventory, advertised(inventory)) is None
    assert "--driver-root" in broken.error and list(entries(path)) == [first, driver.gpus[1].uuid]  # kept
