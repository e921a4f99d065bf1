"""Allocate (device plugin §4): request validation and what the container runtime is handed.

Also the snapshots the servers answer from (build_snapshots), since Allocate reads its devices, health and
strategies from one.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.core.allocation import (
    AllocationError,
    Allocator,
    ContainerAllocation,
    DeviceListStrategy,
    Mount,
    MpsClient,
    container_allocation,
    validate_request,
)
from agent.core.health import HealthState, record_fault
from agent.core.inventory import Gpu, Inventory
from agent.core.resources import Device, MigStrategy, MpsLimits, Resource, ResourcePlan
from agent.core.snapshot import AllocationOptions, ResourceSnapshot, build_snapshots
from tests.unit.builders import a100

ENVVAR = DeviceListStrategy.ENVVAR
VOLUME_MOUNTS = DeviceListStrategy.VOLUME_MOUNTS
CDI_CRI = DeviceListStrategy.CDI_CRI
CDI_ANNOTATIONS = DeviceListStrategy.CDI_ANNOTATIONS

GPU = "nvidia.com/gpu"
MIG_1G = "nvidia.com/mig-1g.10gb"


def gpu_uuid(index: int) -> str:
    return f"GPU-{index:08x}-3333-4000-8000-000000000000"


def mig_uuid(gpu_index: int, mig_index: int) -> str:
    return f"MIG-{gpu_index:08x}-4444-5000-8000-{mig_index:012x}"


def gpu_device(index: int) -> Device:
    return Device(
        id=gpu_uuid(index), gpu_uuid=gpu_uuid(index), gpu_index=index, index=str(index), memory_mib=81920, numa_node=0
    )


def replica(index: int, n: int) -> Device:
    """A time-sliced replica: NVIDIA's ``<uuid>::<n>`` ID for the same physical GPU."""
    return Device(
        id=f"{gpu_uuid(index)}::{n}", gpu_uuid=gpu_uuid(index), gpu_index=index, index=str(index), memory_mib=81920
    )


def mig_device(gpu_index: int, mig_index: int) -> Device:
    return Device(
        id=mig_uuid(gpu_index, mig_index),
        gpu_uuid=gpu_uuid(gpu_index),
        gpu_index=gpu_index,
        index=f"{gpu_index}:{mig_index}",
        memory_mib=9728,
        mig_uuid=mig_uuid(gpu_index, mig_index),
        mig_profile="1g.10gb",
        numa_node=0,
    )


GPUS = [gpu_device(i) for i in range(4)]
BY_ID = {d.id: d for d in GPUS}
ALL_HEALTHY = dict.fromkeys(BY_ID, True)


def allocate(devices: list[Device], *strategies: DeviceListStrategy, **kwargs: str) -> ContainerAllocation:
    return container_allocation(GPU, devices, strategies or (ENVVAR,), **kwargs)


# ----- validate_request ----------------------------------------------------------------------------


def test_valid_request_returns_the_devices_in_request_order():
    requested = [gpu_uuid(2), gpu_uuid(0), gpu_uuid(3)]
    assert validate_request(GPU, requested, BY_ID, ALL_HEALTHY) == [GPUS[2], GPUS[0], GPUS[3]]


def test_empty_request_is_refused_and_names_the_resource():
    with pytest.raises(AllocationError, match=r"empty allocation request for nvidia\.com/gpu"):
        validate_request(GPU, [], BY_ID, ALL_HEALTHY)


def test_duplicate_id_is_refused_and_named():
    with pytest.raises(AllocationError, match=f"duplicate device IDs .*{gpu_uuid(1)}") as error:
        validate_request(GPU, [gpu_uuid(1), gpu_uuid(0), gpu_uuid(1)], BY_ID, ALL_HEALTHY)
    assert gpu_uuid(0) not in str(error.value)


def test_unknown_ids_are_refused_and_every_one_is_named_but_no_known_one():
    with pytest.raises(AllocationError, match="unknown device IDs") as error:
        validate_request(GPU, [gpu_uuid(0), "GPU-bogus", mig_uuid(0, 0)], BY_ID, ALL_HEALTHY)
    message = str(error.value)
    assert "GPU-bogus" in message and mig_uuid(0, 0) in message
    assert gpu_uuid(0) not in message


def test_device_of_another_resource_is_unknown_here():
    migs = {d.id: d for d in (mig_device(0, 0), mig_device(0, 1))}
    with pytest.raises(AllocationError, match=rf"unknown device IDs for nvidia\.com/mig-1g\.10gb: {gpu_uuid(0)}"):
        validate_request(MIG_1G, [gpu_uuid(0)], migs, dict.fromkeys(migs, True))


def test_unhealthy_device_is_refused_and_only_it_is_named():
    health = {**ALL_HEALTHY, gpu_uuid(3): False}
    with pytest.raises(AllocationError, match="Unhealthy") as error:
        validate_request(GPU, [gpu_uuid(0), gpu_uuid(3)], BY_ID, health)
    assert gpu_uuid(3) in str(error.value)
    assert gpu_uuid(0) not in str(error.value)


def test_device_without_a_health_entry_counts_as_unhealthy():
    with pytest.raises(AllocationError, match="Unhealthy"):
        validate_request(GPU, [gpu_uuid(0)], BY_ID, {})


def test_long_lists_of_bad_ids_are_shortened_with_a_count():
    bad = [f"GPU-bad-{n:02d}" for n in range(11)]
    with pytest.raises(AllocationError) as error:
        validate_request(GPU, bad, BY_ID, ALL_HEALTHY)
    message = str(error.value)
    assert "GPU-bad-00" in message and "GPU-bad-07" in message
    assert "GPU-bad-08" not in message
    assert message.endswith("and 3 more")


def test_allocation_error_is_a_value_error():
    assert issubclass(AllocationError, ValueError)


# ----- container_allocation: envvar ----------------------------------------------------------------


def test_envvar_passes_gpu_uuids_in_request_order_and_nothing_else():
    allocation = allocate([GPUS[3], GPUS[1]])
    assert allocation.envs == {"NVIDIA_VISIBLE_DEVICES": f"{gpu_uuid(3)},{gpu_uuid(1)}"}
    assert allocation.mounts == ()
    assert allocation.cdi_devices == ()
    assert allocation.annotations == {}


def test_mig_device_is_passed_as_its_mig_uuid_not_its_parent_gpu():
    allocation = container_allocation(MIG_1G, [mig_device(1, 4)], [ENVVAR])
    assert allocation.envs["NVIDIA_VISIBLE_DEVICES"] == mig_uuid(1, 4)


def test_two_replicas_of_one_gpu_become_one_gpu_in_the_container():
    allocation = allocate([replica(0, 0), replica(0, 3)])
    assert allocation.envs["NVIDIA_VISIBLE_DEVICES"] == gpu_uuid(0)


def test_replicas_on_two_gpus_give_both_gpus_in_first_seen_order():
    allocation = allocate([replica(2, 1), replica(0, 0), replica(2, 0)])
    assert allocation.envs["NVIDIA_VISIBLE_DEVICES"] == f"{gpu_uuid(2)},{gpu_uuid(0)}"


# ----- container_allocation: volume-mounts ---------------------------------------------------------


def test_volume_mounts_mount_dev_null_read_only_per_gpu():
    allocation = allocate([GPUS[1], GPUS[0]], VOLUME_MOUNTS)
    assert allocation.envs == {"NVIDIA_VISIBLE_DEVICES": "/var/run/nvidia-container-devices"}
    assert allocation.mounts == (
        Mount(f"/var/run/nvidia-container-devices/{gpu_uuid(1)}", "/dev/null", read_only=True),
        Mount(f"/var/run/nvidia-container-devices/{gpu_uuid(0)}", "/dev/null", read_only=True),
    )


def test_volume_mounts_override_envvar_when_both_are_chosen():
    allocation = allocate([GPUS[0]], ENVVAR, VOLUME_MOUNTS)
    assert allocation.envs["NVIDIA_VISIBLE_DEVICES"] == "/var/run/nvidia-container-devices"
    assert len(allocation.mounts) == 1


def test_volume_mounts_of_replicas_mount_each_gpu_once():
    allocation = allocate([replica(1, 0), replica(1, 1)], VOLUME_MOUNTS)
    assert [m.container_path for m in allocation.mounts] == [f"/var/run/nvidia-container-devices/{gpu_uuid(1)}"]


# ----- container_allocation: CDI -------------------------------------------------------------------


def test_cdi_cri_names_each_device_and_sets_no_visible_devices_env():
    allocation = allocate([GPUS[2], GPUS[0]], CDI_CRI)
    assert allocation.cdi_devices == (
        f"k8s.device-plugin.nvidia.com/gpu={gpu_uuid(2)}",
        f"k8s.device-plugin.nvidia.com/gpu={gpu_uuid(0)}",
    )
    assert "NVIDIA_VISIBLE_DEVICES" not in allocation.envs
    assert allocation.annotations == {}
    assert allocation.mounts == ()


def test_cdi_names_use_the_configured_kind():
    allocation = allocate([GPUS[0]], CDI_CRI, cdi_kind="nvidia.com/gpu")  # --node-wide-cdi: nvidia-ctk's spec
    assert allocation.cdi_devices == (f"nvidia.com/gpu={gpu_uuid(0)}",)


def test_cdi_names_mig_devices_by_mig_uuid():
    allocation = container_allocation(MIG_1G, [mig_device(0, 2)], [CDI_CRI])
    assert allocation.cdi_devices == (f"k8s.device-plugin.nvidia.com/gpu={mig_uuid(0, 2)}",)


def test_cdi_annotations_put_every_name_in_one_annotation():
    allocation = allocate([GPUS[1], GPUS[3]], CDI_ANNOTATIONS)
    ((key, value),) = allocation.annotations.items()
    assert key.startswith("cdi.k8s.io/")
    assert value == f"k8s.device-plugin.nvidia.com/gpu={gpu_uuid(1)},k8s.device-plugin.nvidia.com/gpu={gpu_uuid(3)}"
    assert allocation.cdi_devices == ()
    assert "NVIDIA_VISIBLE_DEVICES" not in allocation.envs


@pytest.mark.parametrize("resource", [GPU, MIG_1G, "nvidia.com/mig-1g.24gb.me.all", "nvidia.com/gpu.shared"])
def test_cdi_annotation_key_is_a_valid_kubernetes_annotation_key(resource: str):
    ((key, _),) = container_allocation(resource, [GPUS[0]], [CDI_ANNOTATIONS]).annotations.items()
    prefix, name = key.split("/")
    assert prefix == "cdi.k8s.io"
    assert len(name) <= 63
    assert re.fullmatch(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?", name)


def test_cdi_annotation_key_is_the_same_for_the_same_resource_and_differs_between_resources():
    def key(resource: str, device: Device) -> str:
        return next(iter(container_allocation(resource, [device], [CDI_ANNOTATIONS]).annotations))

    assert key(GPU, GPUS[0]) == key(GPU, GPUS[1])
    assert key(GPU, GPUS[0]) != key(MIG_1G, mig_device(0, 0))


def test_all_strategies_together():
    allocation = allocate([GPUS[0]], ENVVAR, VOLUME_MOUNTS, CDI_CRI, CDI_ANNOTATIONS)
    assert allocation.envs == {"NVIDIA_VISIBLE_DEVICES": "/var/run/nvidia-container-devices"}
    assert len(allocation.mounts) == 1
    assert allocation.cdi_devices == (f"k8s.device-plugin.nvidia.com/gpu={gpu_uuid(0)}",)
    assert list(allocation.annotations.values()) == [f"k8s.device-plugin.nvidia.com/gpu={gpu_uuid(0)}"]


def test_strategy_order_and_repeats_do_not_change_the_answer():
    assert allocate(GPUS[:2], CDI_CRI, ENVVAR) == allocate(GPUS[:2], ENVVAR, CDI_CRI, ENVVAR)


def test_same_devices_same_answer():
    assert allocate(GPUS[:3], ENVVAR, CDI_ANNOTATIONS) == allocate(GPUS[:3], ENVVAR, CDI_ANNOTATIONS)


# ----- snapshots: what a resource server answers Allocate from -------------------------------------


def inventory_gpu(index: int) -> Gpu:
    return a100(index, gpu_uuid(index), nvlink_peers=tuple(p for p in range(4) if p != index), numa_node=0)


INVENTORY = Inventory("580.95.05", "13.580.95.05", 13000, gpus=tuple(inventory_gpu(i) for i in range(4)))
PLAN = ResourcePlan(
    resources=(Resource(GPU, tuple(GPUS)), Resource(MIG_1G, ())),
    mig_strategy=MigStrategy.MIXED,
)


def test_snapshot_serves_only_resources_that_have_devices():
    snapshots = build_snapshots(PLAN, HealthState(), INVENTORY, AllocationOptions())
    assert list(snapshots) == [GPU]


def test_snapshot_carries_devices_health_peers_and_options_for_allocate():
    options = AllocationOptions(strategies=(CDI_CRI,), cdi_kind="example.com/gpu")
    health = record_fault(HealthState(), [gpu_uuid(1)], "XID 79", now=10.0)
    snapshot = build_snapshots(PLAN, health, INVENTORY, options)[GPU]
    assert snapshot.by_id[gpu_uuid(2)] == GPUS[2]
    assert snapshot.options == options
    assert snapshot.nvlink_peers[0] == frozenset({1, 2, 3})
    assert snapshot.healthy_count == 3
    with pytest.raises(AllocationError, match=gpu_uuid(1)):
        validate_request(GPU, [gpu_uuid(1)], snapshot.by_id, snapshot.health)
    devices = validate_request(GPU, [gpu_uuid(2)], snapshot.by_id, snapshot.health)
    allocation = container_allocation(GPU, devices, snapshot.options.strategies, cdi_kind=snapshot.options.cdi_kind)
    assert allocation.cdi_devices == (f"example.com/gpu={gpu_uuid(2)}",)


def test_a_snapshot_takes_over_the_layout_of_the_one_it_replaces_only_when_its_devices_are_the_same():
    first = build_snapshots(PLAN, HealthState(), INVENTORY, AllocationOptions())
    health = record_fault(HealthState(), [gpu_uuid(1)], "XID 79", now=10.0)
    after_xid = build_snapshots(PLAN, health, INVENTORY, AllocationOptions(), previous=first)[GPU]
    assert after_xid.layout is first[GPU].layout  # only health changed: nothing counted again
    assert after_xid == build_snapshots(PLAN, health, INVENTORY, AllocationOptions())[GPU]
    assert after_xid.health[gpu_uuid(1)] is False
    fewer = ResourcePlan((Resource(GPU, tuple(GPUS[:2])),), MigStrategy.MIXED)
    shrunk = build_snapshots(fewer, health, INVENTORY, AllocationOptions(), previous=first)[GPU]
    assert shrunk.layout is not first[GPU].layout
    assert shrunk.layout == build_snapshots(fewer, health, INVENTORY, AllocationOptions())[GPU].layout
    assert set(shrunk.layout.position) == {gpu_uuid(0), gpu_uuid(1)}


def test_default_options_are_envvar_with_the_device_plugins_own_cdi_kind():
    expected = AllocationOptions(strategies=(ENVVAR,), cdi_kind="k8s.device-plugin.nvidia.com/gpu")
    assert AllocationOptions() == expected


def test_snapshot_cannot_be_changed_by_its_readers():
    health = {d.id: True for d in GPUS}
    snapshot = ResourceSnapshot(GPU, tuple(GPUS), health)
    health[gpu_uuid(0)] = False  # the caller's dict changing later does not reach the snapshot
    assert snapshot.health[gpu_uuid(0)] is True
    with pytest.raises(TypeError):
        snapshot.health[gpu_uuid(0)] = False  # type: ignore[index]
    with pytest.raises(TypeError):
        snapshot.by_id["GPU-new"] = GPUS[0]  # type: ignore[index]


# ----- Allocator: one snapshot's answers, derived once -----------------------------------------------

ALL_STRATEGIES = (ENVVAR, VOLUME_MOUNTS, CDI_CRI, CDI_ANNOTATIONS)
NODE = (*GPUS, *(replica(i, n) for i in range(2) for n in range(3)), *(mig_device(2, m) for m in range(3)))


def expected_answer(
    requested: list[str], health: dict[str, bool], strategies: set[DeviceListStrategy], one_replica: bool
) -> tuple[str, tuple[str, ...]] | tuple[object, ...]:
    """What the kubelet is told, worked out here from the rules (not through ``validate_request``): a refusal
    as (its phrase, the IDs it must name), else what the container gets (env, mount paths, CDI names)."""
    by_id = {d.id: d for d in NODE}
    if not requested:
        return "empty allocation request for nvidia.com/gpu", ()
    if one_replica and len(requested) > 1 and any("::" in i for i in requested):
        return "maximum request size for shared resources is 1", ()
    duplicates = tuple(i for n, i in enumerate(requested) if i in requested[:n])
    if duplicates:
        return "duplicate device IDs", duplicates
    unknown = tuple(i for i in requested if i not in by_id)
    if unknown:
        return "unknown device IDs", unknown
    unhealthy = tuple(i for i in requested if not health[i])
    if unhealthy:
        return "are Unhealthy and cannot be allocated", unhealthy
    physical = list(dict.fromkeys(by_id[i].mig_uuid or by_id[i].gpu_uuid for i in requested))
    names = tuple(f"example.com/gpu={u}" for u in physical)
    mounts = VOLUME_MOUNTS in strategies
    visible = "/var/run/nvidia-container-devices" if mounts else ",".join(physical) if ENVVAR in strategies else None
    return (
        visible,
        tuple(f"/var/run/nvidia-container-devices/{u}" for u in physical) if mounts else (),
        names if CDI_CRI in strategies else (),
        (",".join(names),) if CDI_ANNOTATIONS in strategies else (),
    )


@settings(max_examples=300, deadline=None)
@given(
    requested=st.lists(st.sampled_from([d.id for d in NODE] + ["GPU-bogus", f"{gpu_uuid(9)}::0"]), max_size=5),
    unhealthy=st.sets(st.sampled_from([d.id for d in NODE]), max_size=3),
    strategies=st.sets(st.sampled_from(ALL_STRATEGIES), min_size=1),
    fail_requests_greater_than_one=st.booleans(),
)
def test_property_allocator_answers_as_the_rules_say(
    requested: list[str], unhealthy: set[str], strategies: set[DeviceListStrategy], fail_requests_greater_than_one: bool
) -> None:
    """The allocator (its quick check, then ``validate_request`` on the rare path) refuses exactly the requests
    the rules refuse, naming every bad ID, and gives any other request exactly its devices."""
    health = {d.id: d.id not in unhealthy for d in NODE}
    flag = {"fail_requests_greater_than_one": fail_requests_greater_than_one}
    allocator = Allocator.of(GPU, NODE, health, sorted(strategies), cdi_kind="example.com/gpu", **flag)
    expected = expected_answer(requested, health, strategies, fail_requests_greater_than_one)
    try:
        got = allocator.allocate(requested)
    except AllocationError as error:
        phrase, named = expected
        assert isinstance(phrase, str) and phrase in str(error), (str(error), expected)
        assert all(i in str(error) for i in named), (str(error), named)
        return
    seen = (
        got.envs.get("NVIDIA_VISIBLE_DEVICES"),
        tuple(m.container_path for m in got.mounts),
        got.cdi_devices,
        tuple(got.annotations.values()),
    )
    assert seen == expected


def test_allocator_for_mps_clients_matches_the_single_request_answer() -> None:
    limits = MpsLimits(active_thread_percentage=25)
    client = MpsClient("/run/nvidia/mps", limits, replicas=4)
    devices = [replica(0, n) for n in range(4)] + [replica(1, n) for n in range(4)]
    health = dict.fromkeys((d.id for d in devices), True)
    allocator = Allocator.of(GPU, devices, health, [ENVVAR], mps=client)
    for requested in ([devices[1]], [devices[0], devices[5]], [devices[6], devices[7]]):
        ids = [d.id for d in requested]
        assert allocator.allocate(ids) == container_allocation(GPU, requested, [ENVVAR], mps=client)


def test_allocator_keeps_the_snapshot_it_was_built_for() -> None:
    healthy = Allocator.of(GPU, GPUS, ALL_HEALTHY, [ENVVAR])
    sick = Allocator.of(GPU, GPUS, {**ALL_HEALTHY, gpu_uuid(1): False}, [ENVVAR])
    assert healthy.allocate([gpu_uuid(1)]).envs == {"NVIDIA_VISIBLE_DEVICES": gpu_uuid(1)}
    with pytest.raises(AllocationError, match="Unhealthy"):
        sick.allocate([gpu_uuid(1)])


def test_snapshot_listing_is_what_list_and_watch_sends_and_a_missing_health_entry_is_unhealthy() -> None:
    snapshot = ResourceSnapshot(GPU, tuple(GPUS), {gpu_uuid(0): True, gpu_uuid(1): False, gpu_uuid(2): True})
    assert snapshot.listing() == (
        (gpu_uuid(0), True, 0),
        (gpu_uuid(1), False, 0),
        (gpu_uuid(2), True, 0),
        (gpu_uuid(3), False, 0),
    )
    assert snapshot.listing() is snapshot.listing()  # computed once, with the snapshot
