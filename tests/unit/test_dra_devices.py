"""The DRA device model: NVIDIA's device names, attributes and capacities for the GPUs the simulator describes,
and NVIDIA's DeviceClass selectors evaluated against them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pynvml
import pytest
from msgspec.structs import replace

from agent.core.dra.devices import (
    DEFAULT_DRIVER,
    NUMA_NODE,
    PCI_BUS_ID,
    PCIE_ROOT,
    DraDevice,
    Version,
    attribute_kind,
    canonical_profile,
    cel_device,
    cuda_driver_version,
    dra_devices,
    pci_bus_id,
    semver,
)
from agent.core.inventory import Inventory
from agent.core.mig_catalog import mig_catalog
from agent.gpu.discovery import discover
from agent.sim.nvml.codes import Return
from agent.sim.nvml.driver import SimDriver

GIB = 1 << 30
MIB = 1 << 20
MIXED_A100 = ["3g.40gb", "2g.20gb", "1g.10gb+me", "1g.10gb"]


@pytest.fixture
def inventory(sim_node: Callable[[object], SimDriver]) -> Callable[[object], Inventory]:
    """``inventory("dgx-a100")`` or ``inventory({"gpus": [...]})``: a simulated node as discovery sees it."""

    def make(spec: object) -> Inventory:
        sim_node(spec)
        return discover()

    return make


def node(*groups: dict[str, Any]) -> dict[str, Any]:
    return {"gpus": list(groups)}


def a100(instances: list[str] | None = None, count: int = 1) -> dict[str, Any]:
    group: dict[str, Any] = {"model": "A100-SXM4-80GB", "count": count}
    if instances is not None:
        group["mig"] = {"instances": instances}
    return group


def by_name(devices: tuple[DraDevice, ...]) -> dict[str, DraDevice]:
    return {d.name: d for d in devices}


# ----- names -----------------------------------------------------------------------------------------


def test_full_gpus_are_named_by_their_minor_number(inventory):
    devices = dra_devices(inventory("dgx-a100"))
    assert [d.name for d in devices] == [f"gpu-{i}" for i in range(8)]
    assert {d.kind for d in devices} == {"gpu"}
    assert all(d.parent_uuid is None and d.uuid.startswith("GPU-") for d in devices)


def test_seven_1g10gb_devices_get_nvidias_names(inventory):
    devices = dra_devices(inventory("a100-mig"))
    # GI profile id 19 is A100-80GB's 1g.10gb; the last number is the placement start in memory slices
    assert [d.name for d in devices] == [f"gpu-0-mig-1g10gb-19-{start}" for start in range(7)]
    assert {d.kind for d in devices} == {"mig"}


def test_mixed_layout_names_profile_id_and_placement_start(inventory):
    devices = dra_devices(inventory(node(a100(MIXED_A100))))
    assert [d.name for d in devices] == [  # sorted by name within a GPU, as NVIDIA orders its devices
        "gpu-0-mig-1g10gb-19-3",
        "gpu-0-mig-1g10gb-me-20-2",  # "+me" becomes "-me" (ToCanonicalName)
        "gpu-0-mig-2g20gb-14-0",
        "gpu-0-mig-3g40gb-9-4",
    ]


def test_a_mig_enabled_gpu_is_not_offered_whole_and_a_plain_gpu_is(inventory):
    inv = inventory(node(a100(["7g.80gb"]), a100()))
    assert [d.name for d in dra_devices(inv)] == ["gpu-0-mig-7g80gb-0-0", "gpu-1"]


def test_compute_instances_smaller_than_their_gpu_instance_are_left_out(inventory):
    inv = inventory(node(a100(["4g.40gb", "1c.3g.40gb", "1c.3g.40gb"])))
    assert [d.name for d in dra_devices(inv)] == ["gpu-0-mig-4g40gb-5-0"]


def test_mig_enabled_without_instances_offers_nothing(inventory):
    assert dra_devices(inventory(node(a100([])))) == ()


def test_only_the_gpus_asked_for(inventory):
    inv = inventory(node(a100(count=4)))
    chosen = {inv.gpus[1].uuid, inv.gpus[3].uuid}
    assert [d.name for d in dra_devices(inv, gpu_uuids=chosen)] == ["gpu-1", "gpu-3"]


@pytest.mark.parametrize(
    ("profile", "canonical"),
    [
        ("1g.10gb", "1g10gb"),
        ("1g.10gb+me", "1g10gb-me"),
        ("1g.10gb-me", "1g10gb-me"),
        ("1g.10gb+me.all", "1g10gb-meall"),
        ("1c.3g.40gb", "1c3g40gb"),
        ("3g.71gb+gfx", "3g71gb-gfx"),
    ],
)
def test_canonical_profile_follows_nvidias_rule(profile, canonical):
    assert canonical_profile(profile) == canonical


# ----- attributes and capacities ---------------------------------------------------------------------


def test_full_a100_attributes_and_capacity(inventory):
    inv = inventory("dgx-a100")
    gpu = inv.gpus[0]
    device = dra_devices(inv)[0]
    assert dict(device.attributes) == {
        "type": "gpu",
        "uuid": gpu.uuid,
        "productName": "NVIDIA A100-SXM4-80GB",
        "brand": "Nvidia",
        "architecture": "Ampere",
        "cudaComputeCapability": "8.0.0",
        "driverVersion": "580.95.5",  # the simulator's driver is 580.95.05: semver drops the leading zero
        "cudaDriverVersion": "13.0.0",
        PCI_BUS_ID: "0000:18:00.0",
        NUMA_NODE: 0,  # NVML's node (the shell passes sysfs's when it has one)
    }
    assert dict(device.capacity) == {"memory": 80 * GIB}
    kinds = {name: attribute_kind(value) for name, value in device.attributes.items()}
    assert [n for n, k in kinds.items() if k == "version"] == [
        "cudaComputeCapability",
        "driverVersion",
        "cudaDriverVersion",
    ]
    assert set(kinds.values()) == {"string", "version", "int"}


def test_mig_device_attributes_carry_the_parents_and_its_own(inventory):
    inv = inventory("a100-mig")
    gpu = inv.gpus[0]
    mig = next(m for m in gpu.mig_devices if m.placement.start == 0)
    device = by_name(dra_devices(inv))["gpu-0-mig-1g10gb-19-0"]
    assert device.uuid == mig.uuid and device.parent_uuid == gpu.uuid and device.gpu_uuid == gpu.uuid
    assert dict(device.attributes) == {
        "type": "mig",
        "uuid": mig.uuid,
        "parentUUID": gpu.uuid,
        "profile": "1g.10gb",
        "productName": "NVIDIA A100-SXM4-80GB",
        "brand": "Nvidia",
        "architecture": "Ampere",
        "cudaComputeCapability": "8.0.0",
        "driverVersion": "580.95.5",
        "cudaDriverVersion": "13.0.0",
        PCI_BUS_ID: "0000:18:00.0",
        NUMA_NODE: 0,
    }


def test_mig_devices_carry_their_instance_ids_for_the_capability_nodes_and_gpus_none(inventory):
    inv = inventory(node(a100(), a100(MIXED_A100)))
    devices = by_name(dra_devices(inv))
    full = devices["gpu-0"]
    assert (full.gi_id, full.ci_id) == (None, None)
    for mig in inv.gpus[1].mig_devices:
        [device] = [d for d in devices.values() if d.uuid == mig.uuid]
        assert (device.gpu_minor, device.gi_id, device.ci_id) == (inv.gpus[1].minor_number, mig.gi_id, mig.ci_id)
    assert len({(d.gi_id, d.ci_id) for d in devices.values() if d.kind == "mig"}) == len(MIXED_A100)


def test_mig_capacities_come_from_the_gpu_instance_profile(inventory):
    devices = by_name(dra_devices(inventory(node(a100(MIXED_A100)))))
    assert dict(devices["gpu-0-mig-1g10gb-19-3"].capacity) == {
        "multiprocessors": 14,
        "copyEngines": 1,
        "decoders": 0,
        "encoders": 0,
        "jpegEngines": 0,
        "ofaEngines": 0,
        "memory": 9728 * MIB,
        "memorySlice3": 1,
    }
    media = devices["gpu-0-mig-1g10gb-me-20-2"].capacity
    assert (media["decoders"], media["jpegEngines"], media["ofaEngines"]) == (1, 1, 1)  # the media extensions
    big = devices["gpu-0-mig-3g40gb-9-4"].capacity
    assert (big["multiprocessors"], big["copyEngines"], big["decoders"], big["memory"]) == (42, 3, 2, 40192 * MIB)
    assert [n for n in big if n.startswith("memorySlice")] == [f"memorySlice{i}" for i in (4, 5, 6, 7)]


def test_mig_engine_counts_are_what_nvmls_profile_info_says_not_the_packaged_table(sim_node):
    """A driver whose profile info differs from the packaged table (a newer driver, another board): NVML wins."""
    driver = sim_node(node(a100(["1g.10gb"])))
    model = driver.gpus[0].model
    richer = tuple(replace(p, copy_engine_count=2, jpeg_count=3) if p.id == 19 else p for p in model.gi_profiles)
    driver.gpus[0].model = replace(model, gi_profiles=richer)
    inv = discover()
    counts = inv.gpus[0].gi_profile(19)
    assert counts is not None and (counts.copy_engines, counts.jpeg_engines, counts.multiprocessors) == (2, 3, 14)
    (device,) = dra_devices(inv)
    assert (device.capacity["copyEngines"], device.capacity["jpegEngines"]) == (2, 3)


def test_dynamic_mig_partitions_take_nvmls_engine_counts_when_mig_mode_is_on(sim_node):
    driver = sim_node(node(a100([])))
    model = driver.gpus[0].model
    driver.gpus[0].model = replace(
        model, gi_profiles=tuple(replace(p, copy_engine_count=2) if p.id == 19 else p for p in model.gi_profiles)
    )
    inv = discover()
    devices = by_name(dra_devices(inv, dynamic_mig={inv.gpus[0].uuid}))
    partition = devices["gpu-0-mig-1g10gb-19-0"]
    assert partition.capacity["copyEngines"] == 2
    assert partition.consumes_counters["gpu-0-counter-set"]["copy-engines"] == 2


def test_a_model_the_packaged_mig_table_does_not_know_still_gets_its_engine_counts(inventory):
    """Blackwell (B200, PCI device 0x2901) is not in the packaged table: the counts come from NVML's profile info."""
    inv = inventory(node(a100(MIXED_A100)))
    blackwell = replace(inv, gpus=(replace(inv.gpus[0], pci_device_id=0x290110DE),))
    assert mig_catalog(0x290110DE) is None
    devices = by_name(dra_devices(blackwell))
    big = devices["gpu-0-mig-3g40gb-9-4"].capacity
    assert (big["multiprocessors"], big["copyEngines"], big["decoders"], big["memory"]) == (42, 3, 2, 40192 * MIB)
    media = devices["gpu-0-mig-1g10gb-me-20-2"].capacity
    assert (media["decoders"], media["jpegEngines"], media["ofaEngines"]) == (1, 1, 1)


def test_architecture_and_brand_are_go_nvlibs_strings(inventory):
    inv = inventory(node({"model": "L4"}, {"model": "V100-SXM2-16GB"}, {"model": "T4"}, {"model": "H100-SXM5-80GB"}))
    values = [
        (d.attributes["productName"], d.attributes["architecture"], d.attributes["brand"]) for d in dra_devices(inv)
    ]
    assert values == [
        ("NVIDIA L4", "Ada Lovelace", "Nvidia"),  # NVML's ARCH_ADA; nvlib says "Ada Lovelace"
        ("Tesla V100-SXM2-16GB", "Volta", "Tesla"),
        ("Tesla T4", "Turing", "Nvidia"),  # recent drivers report the T4's brand as NVIDIA
        ("NVIDIA H100 80GB HBM3", "Hopper", "Nvidia"),
    ]
    assert [d.attributes["cudaComputeCapability"] for d in dra_devices(inv)] == ["8.9.0", "7.0.0", "7.5.0", "9.0.0"]


def test_pcie_root_only_when_the_shell_knows_it(inventory):
    inv = inventory(node(a100(count=2)))
    devices = dra_devices(inv, pcie_roots={"0000:18:00.0": "pci0000:00"})
    assert devices[0].attributes[PCIE_ROOT] == "pci0000:00"
    assert PCIE_ROOT not in devices[1].attributes


def test_the_numa_node_is_sysfs_s_where_the_shell_read_one_else_nvml_s_and_minus_one_is_none(inventory):
    inv = inventory({"numa_nodes": 2, "gpus": [a100(count=8)]})
    assert [g.numa_node for g in inv.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    bus = [d.attributes[PCI_BUS_ID] for d in dra_devices(inv)]
    devices = dra_devices(inv, numa_nodes={bus[0]: 1, bus[1]: None})  # sysfs: 1, and -1 (no affinity)
    assert [d.attributes.get(NUMA_NODE) for d in devices] == [1, None, 0, 0, 1, 1, 1, 1]
    assert attribute_kind(devices[0].attributes[NUMA_NODE]) == "int"
    mig = dra_devices(inventory("a100-mig"), numa_nodes={"0000:18:00.0": 3})
    assert {d.attributes[NUMA_NODE] for d in mig} == {3}  # MIG devices carry their GPU's


def test_addressing_mode_is_nvmls_where_it_reports_one(inventory):
    inv = inventory(node({"model": "GH200-H100-96GB"}, a100()))
    assert [g.addressing_mode for g in inv.gpus] == ["ATS", None]
    devices = dra_devices(inv)
    assert devices[0].attributes["addressingMode"] == "ATS"
    assert "addressingMode" not in devices[1].attributes


def test_what_the_driver_does_not_say_is_left_out(inventory):
    inv = inventory("dgx-a100")
    odd = replace(inv, driver_version="31.0.15.3667", cuda_driver_version=None)
    odd = replace(odd, gpus=(replace(odd.gpus[0], brand="", pci_bus_id="garbage"),))
    (device,) = dra_devices(odd)
    for missing in ("driverVersion", "cudaDriverVersion", "brand", PCI_BUS_ID):
        assert missing not in device.attributes


def test_device_values_cannot_be_changed(inventory):
    device = dra_devices(inventory("dgx-a100"))[0]
    with pytest.raises(TypeError):
        device.attributes["type"] = "mig"  # type: ignore[index]


@pytest.mark.parametrize(
    ("text", "normalised"),
    [
        ("580.95.05", "580.95.5"),
        ("535.104.05", "535.104.5"),
        ("550.54.14", "550.54.14"),
        ("470.82", "470.82.0"),
        ("v1.2.3", "1.2.3"),
        ("1.2.3-rc.1+build.5", "1.2.3-rc.1+build.5"),
        ("31.0.15.3667", None),
        ("", None),
        ("1.2.3-rc.01", None),
    ],
)
def test_versions_are_normalised_as_masterminds_semver_does(text, normalised):
    assert semver(text) == normalised
    if normalised is not None:
        assert isinstance(semver(text), Version)


@pytest.mark.parametrize(("value", "version"), [(13000, "13.0.0"), (12040, "12.4.0"), (11080, "11.8.0")])
def test_cuda_driver_version_from_nvmls_int(value, version):
    assert cuda_driver_version(value) == version


@pytest.mark.parametrize(
    ("nvml", "attribute"),
    [
        ("00000000:18:00.0", "0000:18:00.0"),
        ("00000000:AB:1F.7", "0000:ab:1f.7"),
        ("00000001:18:00.0", "0001:18:00.0"),
        ("00010000:18:00.0", None),  # a domain the attribute's four hex digits cannot hold
        ("x", None),
    ],
)
def test_pci_bus_id_in_go_nvlibs_spelling(nvml, attribute):
    assert pci_bus_id(nvml) == attribute


def test_attribute_kinds_tell_bool_from_int_and_version_from_string():
    assert [attribute_kind(v) for v in (True, 3, "x", Version("1.0.0"))] == ["bool", "int", "string", "version"]
    with pytest.raises(TypeError):
        attribute_kind(1.5)  # type: ignore[arg-type]


# ----- NVIDIA's DeviceClasses --------------------------------------------------------------------------


def nvidia_class_matches(device: DraDevice, device_type: str, driver: str = DEFAULT_DRIVER) -> bool:
    """``device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == '<type>'``, evaluated
    over the CEL view (a real CEL engine comes with the allocator)."""
    view = cel_device(device, driver)
    attributes: dict[str, dict[str, Any]] = view["attributes"]  # type: ignore[assignment]
    return view["driver"] == "gpu.nvidia.com" and attributes.get("gpu.nvidia.com", {}).get("type") == device_type


def test_nvidias_gpu_and_mig_classes_select_the_right_devices(inventory):
    devices = dra_devices(inventory(node(a100(MIXED_A100), a100(count=2))))
    gpus = [d.name for d in devices if nvidia_class_matches(d, "gpu")]
    migs = [d.name for d in devices if nvidia_class_matches(d, "mig")]
    assert gpus == ["gpu-1", "gpu-2"]
    assert len(migs) == 4 and all("-mig-" in name for name in migs)
    assert not [d for d in devices if nvidia_class_matches(d, "vfio")]


def test_cel_view_puts_unqualified_names_in_the_drivers_domain(inventory):
    device = dra_devices(inventory("a100-mig"))[0]
    view = cel_device(device)
    assert view["attributes"]["gpu.nvidia.com"]["profile"] == "1g.10gb"  # type: ignore[index]
    assert view["attributes"]["resource.kubernetes.io"]["pciBusID"] == "0000:18:00.0"  # type: ignore[index]
    assert view["capacity"]["gpu.nvidia.com"]["memory"] == 9728 * MIB  # type: ignore[index]
    # a selector like "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('9Gi')) >= 0"
    assert view["capacity"]["gpu.nvidia.com"]["memory"] >= 9 * GIB  # type: ignore[index]
    renamed = cel_device(device, "gpu.tessera.example")
    assert "gpu.nvidia.com" not in renamed["attributes"]  # type: ignore[operator]
    assert not nvidia_class_matches(device, "mig", driver="gpu.tessera.example")


# ----- the brand, from NVML --------------------------------------------------------------------------


def test_the_simulated_library_answers_nvml_device_get_brand(nvml_node):
    nvml_node(node({"model": "V100-SXM2-16GB"}, a100(["1g.10gb"])))
    v100 = pynvml.nvmlDeviceGetHandleByIndex(0)
    a100_handle = pynvml.nvmlDeviceGetHandleByIndex(1)
    assert pynvml.nvmlDeviceGetBrand(v100) == pynvml.NVML_BRAND_TESLA
    assert pynvml.nvmlDeviceGetBrand(a100_handle) == pynvml.NVML_BRAND_NVIDIA
    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(a100_handle, 0)
    assert pynvml.nvmlDeviceGetBrand(mig) == pynvml.NVML_BRAND_NVIDIA  # a MIG device answers with its GPU's


def test_a_brand_nvml_does_not_support_leaves_it_empty(sim_node):
    driver = sim_node(node(a100(count=2)))
    driver.inject_error("nvmlDeviceGetBrand", Return.ERROR_NOT_SUPPORTED, gpu_index=0)
    inv = discover()
    assert [g.brand for g in inv.gpus] == ["", "Nvidia"]
    assert inv.failures == ()
    assert "brand" not in dra_devices(inv)[0].attributes
