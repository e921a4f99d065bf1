"""Memory sizes from the sharing config: time-sliced replicas given a size (Tessera's memoryLimit and
memoryBurstLimit), what is refused by name, and what Allocate gives a container of a sized replica."""

from __future__ import annotations

import pytest
import yaml

from agent.config.effective import FlagOverrides, effective
from agent.config.model import ConfigError, parse_config
from agent.core.allocation import MEMORY_LIMIT_ENV, MEMORY_REQUEST_ENV, Allocator, DeviceListStrategy, MpsClient
from agent.core.memlimits import MIB, ContainerRef, sized_devices, unsized_holders
from agent.core.plan import plan
from agent.core.resources import PlanError
from tests.unit.test_mps_plan import gpu, mig, node

GIB_MIB = 1024


def planned(sharing: str, inventory=None):
    model, _ = parse_config(yaml.safe_load(f"version: v1\nsharing:\n{sharing}"))
    return plan(effective(model, FlagOverrides()).plan, inventory or node(gpu(0), gpu(1)))


TS_10GI = (
    "  timeSlicing:\n    resources:\n"
    "      - {name: nvidia.com/gpu, rename: nvidia.com/gpu-10gb, replicas: 4, memoryLimit: 10Gi}\n"
)
TS_BURST = (
    "  timeSlicing:\n    resources:\n      - {name: nvidia.com/gpu, rename: nvidia.com/gpu-10gb, replicas: 4, "
    "memoryLimit: 10Gi, memoryBurstLimit: 30Gi}\n"
)


def test_time_sliced_replicas_given_a_size_hold_their_containers_to_it() -> None:
    result = planned(TS_10GI)
    resource = result.resource("nvidia.com/gpu-10gb")
    assert resource.to_json()["memory"] == {"request_mib": 10240, "limit_mib": 10240}
    assert {d["memory_mib"] for d in resource.to_json()["devices"]} == {10240}  # what `tessera plan` shows
    sizes = sized_devices(result)
    assert len(sizes) == 8 and {(s.size, s.limit, s.server_default) for s in sizes.values()} == {
        (10 * GIB_MIB * MIB, 10 * GIB_MIB * MIB, False)
    }


def test_a_burst_ceiling_raises_the_hard_limit_only() -> None:
    (size,) = {(s.size, s.limit) for s in sized_devices(planned(TS_BURST)).values()}
    assert size == (10 * GIB_MIB * MIB, 30 * GIB_MIB * MIB)


def test_time_slicing_without_a_size_stays_unsized() -> None:
    result = planned("  timeSlicing:\n    resources:\n      - {name: nvidia.com/gpu, replicas: 4}\n")
    assert sized_devices(result) == {}
    assert "memory" not in result.resource("nvidia.com/gpu").to_json()


MPS_4 = "  mps:\n    resources:\n      - {name: nvidia.com/gpu, replicas: 4}\n"
UNSIZED_TS = "  timeSlicing:\n    resources:\n      - {name: nvidia.com/gpu, replicas: 4}\n"


@pytest.mark.parametrize(("sharing", "sized"), [(TS_10GI, True), (TS_BURST, True), (MPS_4, True), (UNSIZED_TS, False)])
def test_whether_a_plan_sizes_memory_is_said_without_the_memory_limits_module(sharing: str, sized: bool) -> None:
    """The agent asks the plan whether anything is sized before it loads the memory-limits modules (most nodes size
    nothing and never load them): the plan's answer is the one ``sized_devices`` would give."""
    result = planned(sharing)
    assert result.sizes_memory() is sized is bool(sized_devices(result))


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ("memoryLimit: 20Gi, memoryBurstLimit: 10Gi", r"memoryBurstLimit 10Gi \(10240 MiB\) is below memoryLimit 20Gi"),
        ("memoryBurstLimit: 10Gi", "memoryBurstLimit needs memoryLimit"),
        ("memoryLimit: 10Gi, activeThreadPercentage: 50", "activeThreadPercentage only apply to sharing.mps"),
    ],
)
def test_nonsense_sizes_are_refused_by_name_at_parse_time(entry: str, problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        parse_config(yaml.safe_load(f"sharing: {{timeSlicing: {{resources: [{{name: gpu, replicas: 2, {entry}}}]}}}}"))


def test_a_burst_under_mps_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match=r"memoryBurstLimit only applies to sharing\.timeSlicing"):
        parse_config(
            yaml.safe_load(
                "sharing: {mps: {resources: [{name: gpu, replicas: 2, memoryLimit: 10Gi, memoryBurstLimit: 20Gi}]}}"
            )
        )


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        (
            "{name: nvidia.com/gpu, replicas: 4, memoryLimit: 30Gi}",
            r"resources\[0\]\.memoryLimit: 4 replicas x 30720 MiB guaranteed is more than the 81920 MiB of GPU 0",
        ),
        (
            "{name: nvidia.com/gpu, replicas: 2, memoryLimit: 10Gi, memoryBurstLimit: 100Gi}",
            r"resources\[0\]\.memoryBurstLimit: 102400 MiB is more than the 81920 MiB of GPU 0",
        ),
        (
            "{name: nvidia.com/gpu, replicas: 2, memoryLimit: 100Gi}",
            r"resources\[0\]\.memoryLimit: 102400 MiB is more than the 81920 MiB of GPU 0",
        ),
    ],
)
def test_a_size_that_does_not_fit_the_gpu_is_refused_at_plan_time(entry: str, problem: str) -> None:
    with pytest.raises(PlanError, match=problem):
        planned(f"  timeSlicing:\n    resources:\n      - {entry}\n")


def test_a_size_on_a_time_sliced_mig_device_is_refused() -> None:
    sharing = "  timeSlicing:\n    resources:\n      - {name: nvidia.com/mig-1g.10gb, replicas: 2, memoryLimit: 4Gi}\n"
    model, _ = parse_config(yaml.safe_load(f"version: v1\nflags: {{migStrategy: mixed}}\nsharing:\n{sharing}"))
    with pytest.raises(PlanError, match="no container to a memory size on MIG devices"):
        plan(effective(model, FlagOverrides()).plan, node(gpu(0, migs=(mig(0, 0), mig(0, 1)))))


def test_one_resource_has_one_size() -> None:
    sharing = (
        "  timeSlicing:\n    resources:\n"
        "      - {name: nvidia.com/gpu, rename: shared, replicas: 2, memoryLimit: 10Gi, devices: [0]}\n"
        "      - {name: nvidia.com/gpu, rename: shared, replicas: 2, memoryLimit: 20Gi, devices: [1]}\n"
    )
    with pytest.raises(PlanError, match=r"resources\[1\]\.memoryLimit: nvidia.com/shared gets a different memory size"):
        planned(sharing)


def test_an_mps_client_limit_above_the_device_is_refused_even_oversubscribed() -> None:
    sharing = (
        "  mps:\n    resources:\n      - {name: nvidia.com/gpu, replicas: 2, memoryLimit: 90Gi, oversubscribe: true}\n"
    )
    with pytest.raises(PlanError, match=r"memoryLimit: 92160 MiB per client is more than the 81920 MiB"):
        planned(sharing)


# ----- Allocate: the toolkit hook's variables ---------------------------------------------------------------


def allocator(result, name: str, *, memory_envs: bool = True) -> Allocator:
    resource = result.resource(name)
    mps = MpsClient("/run/nvidia/mps", resource.mps, resource.replicas) if resource.mps else None
    return Allocator.of(
        name,
        resource.devices,
        dict.fromkeys((d.id for d in resource.devices), True),
        (DeviceListStrategy.ENVVAR,),
        mps=mps,
        memory=resource.memory,
        replicas=resource.replicas,
        memory_envs=memory_envs,
    )


def test_allocate_gives_a_sized_replica_the_singular_mib_variables() -> None:
    served = allocator(planned(TS_BURST), "nvidia.com/gpu-10gb")
    ids = [d for d in served.devices]
    envs = served.allocate([ids[0]]).envs
    assert (envs[MEMORY_REQUEST_ENV], envs[MEMORY_LIMIT_ENV]) == ("10240", "30720")
    two_on_one_gpu = served.allocate(ids[:2]).envs  # two replicas of GPU 0: the sum
    assert (two_on_one_gpu[MEMORY_REQUEST_ENV], two_on_one_gpu[MEMORY_LIMIT_ENV]) == ("20480", "61440")
    one_per_gpu = served.allocate([ids[0], ids[4]]).envs  # one replica on each GPU: the same on each
    assert one_per_gpu[MEMORY_REQUEST_ENV] == "10240"
    uneven = served.allocate([ids[0], ids[1], ids[4]]).envs  # 20Gi on GPU 0, 10Gi on GPU 1: cannot be said singly
    assert MEMORY_REQUEST_ENV not in uneven and MEMORY_LIMIT_ENV not in uneven


def test_allocate_gives_an_mps_replica_its_pinned_size() -> None:
    sharing = (
        "  mps:\n    resources:\n"
        "      - {name: nvidia.com/gpu, rename: nvidia.com/gpu-20gb, replicas: 2, memoryLimit: 20Gi}\n"
    )
    served = allocator(planned(sharing), "nvidia.com/gpu-20gb")
    envs = served.allocate([next(iter(served.devices))]).envs
    assert (envs[MEMORY_REQUEST_ENV], envs[MEMORY_LIMIT_ENV]) == ("20480", "20480")
    assert envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"].endswith("=20480M")


def test_no_variables_without_enforcement_or_without_a_size() -> None:
    off = allocator(planned(TS_10GI), "nvidia.com/gpu-10gb", memory_envs=False)
    assert MEMORY_LIMIT_ENV not in off.allocate([next(iter(off.devices))]).envs
    unsized = allocator(
        planned("  timeSlicing:\n    resources:\n      - {name: nvidia.com/gpu, replicas: 2}\n"), "nvidia.com/gpu"
    )
    assert MEMORY_LIMIT_ENV not in unsized.allocate([next(iter(unsized.devices))]).envs


def test_a_sized_replica_that_keeps_the_devices_name_is_warned_about() -> None:
    result = planned("  timeSlicing:\n    resources:\n      - {name: nvidia.com/gpu, replicas: 4, memoryLimit: 10Gi}\n")
    assert any("keep the name nvidia.com/gpu" in w and "set rename or renameByDefault" in w for w in result.warnings)
    assert not any("keep the name" in w for w in planned(TS_10GI).warnings)  # renamed: nothing to say


def test_the_holders_of_unsized_replicas_are_where_a_left_over_limit_is_looked_for() -> None:
    """A container of a replica without a size, on a whole GPU, is where an earlier agent's limit may be left over;
    one of a sized replica is held to its size instead, and a device of no resource of the plan is not ours."""
    result = planned(
        "  timeSlicing:\n    resources:\n"
        "      - {name: nvidia.com/gpu, rename: nvidia.com/gpu-10gb, replicas: 2, memoryLimit: 10Gi, devices: [0]}\n"
        "      - {name: nvidia.com/gpu, rename: nvidia.com/gpu-any, replicas: 2, devices: [1]}\n"
    )
    sized, unsized = (result.resource(name).devices[0] for name in ("nvidia.com/gpu-10gb", "nvidia.com/gpu-any"))
    a, b, c = (ContainerRef("team", pod, "main") for pod in ("a", "b", "c"))
    holders = [(sized.id, a), (unsized.id, b), ("another-vendor-device", c)]
    assert unsized_holders(result, holders, sized_devices(result)) == [(unsized.gpu_uuid, b)]
