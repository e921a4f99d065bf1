"""The CDI spec of a prepared claim, its file name and the CDI IDs the kubelet hands to the runtime."""

from __future__ import annotations

import re

import pytest
import yaml

from agent.core.allocation import DeviceListStrategy, container_allocation
from agent.core.dra.cdi import (
    CDI_KIND,
    CDI_VERSION,
    NODE_WIDE_CDI_KIND,
    CdiError,
    DeviceNode,
    cdi_device_ids,
    claim_device_id,
    claim_spec,
    claim_uid_of_spec_file,
    gpu_nodes,
    mig_nodes,
    spec_file_name,
)
from agent.core.resources import Device

UID = "0b6f3a52-9f1c-4c1e-8d0e-6c1a2b3c4d5e"  # begins with a digit, as UIDs often do
CDI_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]*[A-Za-z0-9]")  # CDI's device name rule (digits first since 0.5.0)


def test_the_spec_file_is_named_as_nvidias_driver_names_it():
    assert spec_file_name(UID) == f"k8s.gpu.nvidia.com-claim_{UID}.yaml"
    assert claim_uid_of_spec_file(spec_file_name(UID)) == UID


@pytest.mark.parametrize(
    "uid",
    [
        "../../etc/cron.d/x",
        f"{UID}/../../x",
        f"../{UID}",
        "0b6f3a52-9f1c-4c1e-8d0e-6c1a2b3c4d5e\n",
        "",
        "not-a-uid",
        "0b6f3a52_9f1c_4c1e_8d0e_6c1a2b3c4d5e",
    ],
)
def test_a_claim_uid_that_is_not_a_kubernetes_uid_never_names_a_file(uid: str):
    with pytest.raises(CdiError, match="is not a Kubernetes UID"):
        spec_file_name(uid)
    with pytest.raises(CdiError):
        claim_spec(uid, {"gpu-0": gpu_nodes(0)})


@pytest.mark.parametrize(
    "name", ["nvidia.yaml", f"k8s.gpu.nvidia.com-claim_{UID}.json", "k8s.gpu.nvidia.com-claim_x.yaml", ".tmp-1"]
)
def test_other_files_in_the_cdi_directory_are_not_taken_for_claim_specs(name: str):
    assert claim_uid_of_spec_file(name) is None


def test_a_claim_spec_has_one_entry_per_device_with_its_nodes_and_turns_legacy_injection_off():
    spec = claim_spec(
        UID,
        {
            "gpu-0": gpu_nodes(0),
            "gpu-2-mig-1g10gb-19-0": mig_nodes(parent_minor=2, caps_major=511, gi_minor=21, ci_minor=22),
        },
    )
    assert spec == {
        "cdiVersion": "0.5.0",
        "kind": "k8s.gpu.nvidia.com/claim",
        "devices": [
            {"name": f"{UID}-gpu-0", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}},
            {
                "name": f"{UID}-gpu-2-mig-1g10gb-19-0",
                "containerEdits": {
                    "deviceNodes": [
                        {"path": "/dev/nvidia2"},
                        {"path": "/dev/nvidia-caps/nvidia-cap21", "type": "c", "major": 511, "minor": 21,
                         "permissions": "rw"},
                        {"path": "/dev/nvidia-caps/nvidia-cap22", "type": "c", "major": 511, "minor": 22,
                         "permissions": "rw"},
                    ]
                },
            },
        ],
        "containerEdits": {"env": ["NVIDIA_VISIBLE_DEVICES=void"]},
    }  # fmt: skip
    assert all(CDI_NAME.fullmatch(d["name"]) for d in spec["devices"])
    assert yaml.safe_load(yaml.safe_dump(spec)) == spec  # the shell writes it as YAML


def test_cdi_version_is_high_enough_for_entry_names_that_begin_with_a_digit():
    # CDI accepts device names beginning with a digit from 0.5.0 on; claim UIDs (hex) often do
    assert tuple(int(p) for p in CDI_VERSION.split(".")) >= (0, 5, 0)


def test_common_edits_are_added_at_spec_level_keeping_visible_devices_void_first():
    spec = claim_spec(
        UID,
        {"gpu-0": gpu_nodes(0)},
        common_edits={
            "env": ["NVIDIA_VISIBLE_DEVICES=void", "NVIDIA_DRIVER_CAPABILITIES=all"],
            "deviceNodes": [{"path": "/dev/nvidiactl"}],
            "mounts": [{"hostPath": "/usr/lib/libcuda.so.1", "containerPath": "/usr/lib/libcuda.so.1"}],
        },
    )
    assert spec["containerEdits"] == {
        "env": ["NVIDIA_VISIBLE_DEVICES=void", "NVIDIA_DRIVER_CAPABILITIES=all"],
        "deviceNodes": [{"path": "/dev/nvidiactl"}],
        "mounts": [{"hostPath": "/usr/lib/libcuda.so.1", "containerPath": "/usr/lib/libcuda.so.1"}],
    }


def test_a_host_path_is_written_only_when_it_differs():
    node = DeviceNode("/dev/nvidia0", host_path="/run/nvidia/driver/dev/nvidia0")
    assert node.to_cdi() == {"path": "/dev/nvidia0", "hostPath": "/run/nvidia/driver/dev/nvidia0"}


@pytest.mark.parametrize(
    ("devices", "message"),
    [
        ({}, "has no devices"),
        ({"gpu-0": ()}, "device gpu-0 of claim .* has no device nodes"),
        ({"../gpu-0": gpu_nodes(0)}, "'../gpu-0' is not a DNS label"),
        ({"GPU_0": gpu_nodes(0)}, "'GPU_0' is not a DNS label"),
    ],
)
def test_a_spec_that_would_be_invalid_is_refused(devices: dict[str, tuple[DeviceNode, ...]], message: str):
    with pytest.raises(CdiError, match=message):
        claim_spec(UID, devices)


def test_the_kubelet_gets_only_the_claim_id_by_default_and_the_node_wide_id_only_when_asked():
    assert cdi_device_ids(UID, "gpu-0", "GPU-aaaa") == (f"{CDI_KIND}={UID}-gpu-0",)  # the claim's own spec alone
    wide = cdi_device_ids(UID, "gpu-0", "GPU-aaaa", node_wide=True)
    assert wide == (f"{CDI_KIND}={UID}-gpu-0", "nvidia.com/gpu=GPU-aaaa")
    assert cdi_device_ids(UID, "gpu-0-mig-1g10gb-19-0", "MIG-cccc", node_wide=True)[1] == "nvidia.com/gpu=MIG-cccc"
    custom = cdi_device_ids(UID, "gpu-0", "GPU-aaaa", node_wide=True, node_cdi_kind="example.com/gpu")
    assert custom[1] == "example.com/gpu=GPU-aaaa"


def test_with_node_wide_cdi_the_id_is_the_one_the_device_plugin_hands_out_with_that_kind():
    gpu = Device(id="GPU-aaaa", gpu_uuid="GPU-aaaa", gpu_index=0, index="0", memory_mib=81920)
    mig = Device(id="MIG-cccc", gpu_uuid="GPU-2222", gpu_index=2, index="2:0", memory_mib=9728, mig_uuid="MIG-cccc")
    for device, name in ((gpu, "gpu-0"), (mig, "gpu-2-mig-1g10gb-19-0")):
        plugin = container_allocation(
            "nvidia.com/gpu", [device], [DeviceListStrategy.CDI_CRI], cdi_kind=NODE_WIDE_CDI_KIND
        )
        assert plugin.cdi_devices == cdi_device_ids(UID, name, device.physical_id, node_wide=True)[1:]


def test_a_claim_device_id_refuses_a_uid_that_could_escape():
    with pytest.raises(CdiError):
        claim_device_id("../x", "gpu-0")
