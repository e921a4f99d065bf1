"""MPS in the config and the plan: per-client limits, client caps, memory checks, daemons and client settings."""

from __future__ import annotations

import pytest
import yaml

from agent.config.effective import FlagOverrides, effective
from agent.config.model import ConfigError, parse_config, quantity_mib
from agent.core.allocation import AllocationError, MpsClient, container_allocation
from agent.core.inventory import Gpu, Inventory, MigDevice, Placement
from agent.core.mps import mps_daemons
from agent.core.plan import mps_client_cap, plan
from agent.core.resources import PlanError, Sharing


def gpu(index: int, name: str = "NVIDIA A100-SXM4-80GB", cc: tuple[int, int] = (8, 0), memory: int = 81920,
        migs: tuple[MigDevice, ...] = ()) -> Gpu:  # fmt: skip
    return Gpu(
        index=index, uuid=f"GPU-{index:08d}-0000-0000-0000-000000000000", name=name, memory_mib=memory,
        compute_capability=cc, pci_bus_id=f"00000000:{index:02x}:00.0", pci_device_id=0x20B210DE,
        minor_number=index, architecture="Ampere", mig_capable=True, mig_enabled=bool(migs), mig_pending=bool(migs),
        mig_devices=migs,
    )  # fmt: skip


def mig(gpu_index: int, n: int) -> MigDevice:
    return MigDevice(
        uuid=f"MIG-{gpu_index:04d}{n:04d}-0000-5000-0000-000000000000", parent_uuid=f"GPU-{gpu_index:08d}",
        gpu_index=gpu_index, mig_index=n, profile="1g.10gb", gi_id=7 + n, ci_id=0, gi_profile_id=19,
        ci_profile_id=0, gi_slices=1, ci_slices=1, placement=Placement(n, 1), memory_mib=9728,
        multiprocessor_count=14,
    )  # fmt: skip


def node(*gpus: Gpu) -> Inventory:
    return Inventory("580.95.05", "13.580.95.05", 13000, gpus=gpus)


def mps_plan(entry: str, inventory: Inventory, flags: str = ""):
    model, _ = parse_config(yaml.safe_load(f"version: v1\n{flags}sharing:\n  mps:\n    resources:\n      - {entry}\n"))
    return plan(effective(model, FlagOverrides()).plan, inventory)


def test_nvidia_even_split_is_the_default() -> None:
    result = mps_plan("{name: nvidia.com/gpu, replicas: 4}", node(gpu(0)))
    resource = result.resource("nvidia.com/gpu")
    assert resource.sharing is Sharing.MPS and resource.fail_requests_greater_than_one
    assert resource.mps.active_thread_percentage == 25
    assert resource.to_json()["mps"]["pinned_memory_mib"] == {gpu(0).uuid: 81920 // 4}


def test_memory_sized_slices_and_thread_share() -> None:
    entry = (
        "{name: nvidia.com/gpu, rename: nvidia.com/gpu-10gb, replicas: 8, memoryLimit: 10Gi, "
        "activeThreadPercentage: 12}"
    )
    resource = mps_plan(entry, node(gpu(0), gpu(1))).resource("nvidia.com/gpu-10gb")
    assert len(resource.devices) == 16
    (daemon,) = mps_daemons(mps_plan(entry, node(gpu(0), gpu(1))))
    assert daemon.visible_devices == (gpu(0).uuid, gpu(1).uuid)
    assert daemon.active_thread_percentage == 12
    assert daemon.pinned_memory_mib == ((gpu(0).uuid, 10240), (gpu(1).uuid, 10240))


def test_memory_over_the_gpu_is_an_error_unless_oversubscribed() -> None:
    with pytest.raises(PlanError, match=r"memoryLimit: 9 clients x 10240 MiB is more than the 81920 MiB of GPU 0"):
        mps_plan("{name: nvidia.com/gpu, replicas: 9, memoryLimit: 10Gi}", node(gpu(0)))
    ok = mps_plan("{name: nvidia.com/gpu, replicas: 9, memoryLimit: 10Gi, oversubscribe: true}", node(gpu(0)))
    assert len(ok.resource("nvidia.com/gpu").devices) == 9


@pytest.mark.parametrize(
    ("name", "cc", "cap"),
    [("Tesla V100-SXM2-16GB", (7, 0), 48), ("Tesla T4", (7, 5), 48), ("Tesla P100", (6, 0), 16)],
)
def test_client_caps_count_volta_as_volta(name: str, cc: tuple[int, int], cap: int) -> None:
    """NVIDIA's plugin tests CC >= 7.5 and so caps a V100 at 16 clients; Volta is CC 7.0."""
    assert mps_client_cap(cc) == cap
    inventory = node(gpu(0, name=name, cc=cc, memory=16160))
    assert mps_plan(f"{{name: nvidia.com/gpu, replicas: {cap}}}", inventory)
    with pytest.raises(PlanError, match=rf"{cap + 1} MPS clients on GPU 0 \({name}.*cap of {cap}"):
        mps_plan(f"{{name: nvidia.com/gpu, replicas: {cap + 1}}}", inventory)


def test_mps_on_mig_devices_gets_a_daemon_per_mig_device() -> None:
    inventory = node(gpu(0, migs=(mig(0, 0), mig(0, 1))))
    result = mps_plan("{name: nvidia.com/mig-1g.10gb, replicas: 2}", inventory, "flags: {migStrategy: mixed}\n")
    daemons = mps_daemons(result)
    assert [d.key for d in daemons] == ["nvidia.com/mig-1g.10gb/mig-0-0", "nvidia.com/mig-1g.10gb/mig-0-1"]
    assert [d.visible_devices for d in daemons] == [(mig(0, 0).uuid,), (mig(0, 1).uuid,)]
    with pytest.raises(PlanError, match="cap of 6"):  # 48 clients shrink with the instance: 1 of 7 slices
        mps_plan("{name: nvidia.com/mig-1g.10gb, replicas: 7}", inventory, "flags: {migStrategy: mixed}\n")


def test_client_settings_for_a_replica() -> None:
    resource = mps_plan("{name: nvidia.com/gpu, replicas: 4, memoryLimit: 20Gi}", node(gpu(0))).resource(
        "nvidia.com/gpu"
    )
    client = MpsClient("/run/nvidia/mps", resource.mps, resource.replicas)
    allocation = container_allocation(resource.name, [resource.devices[1]], ["envvar"], mps=client)
    assert allocation.envs == {
        "NVIDIA_VISIBLE_DEVICES": gpu(0).uuid,
        "CUDA_MPS_PIPE_DIRECTORY": "/mps/nvidia.com/gpu/pipe",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"{gpu(0).uuid}=20480M",
    }
    assert {(m.container_path, m.host_path) for m in allocation.mounts} == {
        ("/mps/nvidia.com/gpu/pipe", "/run/nvidia/mps/nvidia.com/gpu/pipe"),
        ("/dev/shm", "/run/nvidia/mps/shm"),
    }


def test_a_container_cannot_span_two_mig_daemons() -> None:
    inventory = node(gpu(0, migs=(mig(0, 0), mig(0, 1))))
    config = "{name: nvidia.com/mig-1g.10gb, replicas: 2}"
    resource = mps_plan(config, inventory, "flags: {migStrategy: mixed}\n").resource("nvidia.com/mig-1g.10gb")
    client = MpsClient("/run/nvidia/mps", resource.mps, resource.replicas)
    with pytest.raises(AllocationError, match="2 MPS daemons"):
        container_allocation(resource.name, [resource.devices[0], resource.devices[2]], ["envvar"], mps=client)


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ("{name: gpu, replicas: 2, memoryLimit: ten}", "not a memory quantity"),
        ("{name: gpu, replicas: 2, activeThreadPercentage: 0}", "activeThreadPercentage"),
        ("{name: gpu, replicas: 2, activeThreadPercentage: 101}", "activeThreadPercentage"),
        ("{name: gpu, replicas: 2, activeThreadPercentage: '50'}", "without quotes"),
    ],
)
def test_bad_mps_values_are_rejected_before_reaching_a_daemon(entry: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        parse_config(yaml.safe_load(f"sharing:\n  mps:\n    resources:\n      - {entry}\n"))


def test_mps_keys_under_time_slicing_are_an_error() -> None:
    with pytest.raises(ConfigError, match=r"activeThreadPercentage only apply to sharing\.mps"):
        parse_config(
            yaml.safe_load(
                "sharing: {timeSlicing: {resources: [{name: gpu, replicas: 2, activeThreadPercentage: 50}]}}"
            )
        )


@pytest.mark.parametrize(("text", "mib"), [("10Gi", 10240), ("512Mi", 512), ("20G", 19073), ("1073741824", 1024)])
def test_quantities(text: str, mib: int) -> None:
    assert quantity_mib(text) == mib
