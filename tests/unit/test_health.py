"""Device health (device plugin §6): XID policy, which units an event hits, faults, probes and recovery.

The node: GPUs 0 and 1 in MIG mode with seven 1g.10gb devices each, GPU 2 a plain GPU, and GPU 3 in MIG
mode with one 3g.40gb GPU instance split into two compute instances (1c.3g.40gb). Time is a plain number.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.core.allocation import AllocationError, validate_request
from agent.core.health import (
    NVIDIA_IGNORED_XIDS,
    UNATTRIBUTED,
    HealthPolicy,
    HealthState,
    due_for_probe,
    probe_failed,
    probe_succeeded,
    record_fault,
    units_for_event,
    xid_policy,
)
from agent.core.inventory import Gpu, Inventory, MigDevice, Placement
from agent.core.resources import Device, MigStrategy, Resource, ResourcePlan
from agent.core.snapshot import AllocationOptions, build_snapshots
from tests.unit.builders import a100

QUIET = 60.0


def gpu_uuid(index: int) -> str:
    return f"GPU-{index:08x}-5555-4000-8000-000000000000"


def mig_uuid(gpu_index: int, mig_index: int) -> str:
    return f"MIG-{gpu_index:08x}-6666-5000-8000-{mig_index:012x}"


def mig(gpu_index: int, mig_index: int, *, gi_id: int, ci_id: int = 0, gi_slices: int = 1, ci_slices: int = 1):
    return MigDevice(
        uuid=mig_uuid(gpu_index, mig_index),
        parent_uuid=gpu_uuid(gpu_index),
        gpu_index=gpu_index,
        mig_index=mig_index,
        profile="1g.10gb" if gi_slices == 1 else f"{ci_slices}c.{gi_slices}g.40gb",
        gi_id=gi_id,
        ci_id=ci_id,
        gi_profile_id=19 if gi_slices == 1 else 9,
        ci_profile_id=0,
        gi_slices=gi_slices,
        ci_slices=ci_slices,
        placement=Placement(mig_index if gi_slices == 1 else 0, gi_slices),
        memory_mib=9728 if gi_slices == 1 else 40192,
        multiprocessor_count=14 * ci_slices,
    )


def gpu(index: int, migs: tuple[MigDevice, ...] = ()) -> Gpu:
    enabled = bool(migs)
    return a100(
        index, gpu_uuid(index), mig_enabled=enabled, mig_pending=enabled, mig_devices=migs, numa_node=index // 2
    )


def seven_1g(gpu_index: int) -> tuple[MigDevice, ...]:
    return tuple(mig(gpu_index, m, gi_id=7 + m) for m in range(7))


INVENTORY = Inventory(
    driver_version="580.95.05",
    nvml_version="13.580.95.05",
    cuda_driver_version=13000,
    gpus=(
        gpu(0, seven_1g(0)),
        gpu(1, seven_1g(1)),
        gpu(2),
        gpu(3, (mig(3, 0, gi_id=1, ci_id=0, gi_slices=3), mig(3, 1, gi_id=1, ci_id=1, gi_slices=3))),
    ),
)


def mig_device(m: MigDevice, numa: int | None) -> Device:
    return Device(
        id=m.uuid,
        gpu_uuid=m.parent_uuid,
        gpu_index=m.gpu_index,
        index=m.index,
        memory_mib=m.memory_mib,
        mig_uuid=m.uuid,
        mig_profile=m.profile,
        numa_node=numa,
    )


def gpu_device(g: Gpu) -> Device:
    return Device(
        id=g.uuid,
        gpu_uuid=g.uuid,
        gpu_index=g.index,
        index=str(g.index),
        memory_mib=g.memory_mib,
        numa_node=g.numa_node,
    )


MIG_DEVICES = {g.index: [mig_device(m, g.numa_node) for m in g.mig_devices] for g in INVENTORY.gpus}
GPU2 = gpu_device(INVENTORY.gpus[2])
PLAN = ResourcePlan(
    resources=(
        Resource("nvidia.com/gpu", (GPU2,)),
        Resource("nvidia.com/mig-1c.3g.40gb", tuple(MIG_DEVICES[3])),
        Resource("nvidia.com/mig-1g.10gb", (*MIG_DEVICES[0], *MIG_DEVICES[1])),
    ),
    mig_strategy=MigStrategy.MIXED,
)
ALL_DEVICES = [d for r in PLAN.resources for d in r.devices]


def healthy_ids(state: HealthState) -> set[str]:
    return {device_id for device_id, ok in state.device_health(ALL_DEVICES).items() if ok}


def xid(state: HealthState, gpu_index: int, number: int, now: float, gi: int = UNATTRIBUTED, ci: int = UNATTRIBUTED):
    return record_fault(state, units_for_event(INVENTORY, gpu_uuid(gpu_index), gi, ci), f"XID {number}", now)


# ----- which XIDs count ----------------------------------------------------------------------------


@pytest.mark.parametrize("number", [13, 31, 43, 45, 68, 109])
def test_nvidia_default_ignored_xids_do_not_count(number: int):
    assert not HealthPolicy().is_critical(number)
    assert not xid_policy()[0].is_critical(number)


@pytest.mark.parametrize("number", [48, 63, 64, 74, 79, 92, 94, 95, 119])
def test_other_xids_count_by_default(number: int):
    assert HealthPolicy().is_critical(number)


def test_default_policy_is_nvidias_list_and_nothing_rejected():
    policy, rejected = xid_policy()
    assert policy.ignored_xids == NVIDIA_IGNORED_XIDS == frozenset({13, 31, 43, 45, 68, 109})
    assert rejected == []


def test_xid_13_is_ignored_by_default_but_counts_with_dp_enable_healthchecks_13():
    policy, _ = xid_policy(nvidia_enabled="13")
    assert policy.is_critical(13)
    assert not policy.is_critical(31)  # the other defaults stay ignored


def test_dp_disable_healthchecks_adds_to_the_default_ignores():
    policy, _ = xid_policy(nvidia_disabled="79, 48")
    assert not policy.is_critical(79) and not policy.is_critical(48)
    assert not policy.is_critical(13)
    assert policy.is_critical(94)


@pytest.mark.parametrize("value", ["all", "xids", "ALL", " All ", "48,all"])
def test_dp_disable_healthchecks_all_turns_every_xid_off(value: str):
    policy, rejected = xid_policy(nvidia_disabled=value)
    assert not any(policy.is_critical(n) for n in (13, 48, 79, 94, 119))
    assert rejected == []


def test_disable_all_with_some_enabled_counts_only_those():
    policy, _ = xid_policy(nvidia_disabled="all", nvidia_enabled="79,13")
    assert policy.is_critical(79) and policy.is_critical(13)
    assert not policy.is_critical(48)


def test_dp_enable_healthchecks_overrides_the_disabled_list():
    policy, _ = xid_policy(nvidia_disabled="79,48", nvidia_enabled="79")
    assert policy.is_critical(79)
    assert not policy.is_critical(48)


@pytest.mark.parametrize("disabled", [None, "all", "48,79"])
def test_dp_enable_healthchecks_all_makes_every_xid_count_defaults_included(disabled: str | None):
    policy, _ = xid_policy(nvidia_disabled=disabled, nvidia_enabled="All")
    assert all(policy.is_critical(n) for n in (13, 31, 43, 45, 48, 68, 79, 109))


def test_ignored_xids_flag_replaces_nvidias_default_list():
    policy, _ = xid_policy(ignored="79")
    assert policy.is_critical(13)
    assert not policy.is_critical(79)


def test_ignored_xids_flag_and_dp_disable_healthchecks_combine():
    policy, _ = xid_policy(ignored="79", nvidia_disabled="48")
    assert not policy.is_critical(79) and not policy.is_critical(48)
    assert policy.is_critical(13)


def test_empty_ignored_xids_flag_makes_every_xid_count():
    policy, _ = xid_policy(ignored="")
    assert all(policy.is_critical(n) for n in NVIDIA_IGNORED_XIDS)


def test_bad_entries_are_returned_for_a_warning_and_good_ones_still_apply():
    policy, rejected = xid_policy(ignored="79,x1", nvidia_disabled=" -68 , ABC,48", nvidia_enabled="13,0x1f")
    assert rejected == ["x1", "-68", "abc", "0x1f"]
    assert not policy.is_critical(79) and not policy.is_critical(48)
    assert policy.is_critical(13)


def test_non_ascii_digits_are_rejected_not_a_crash():
    policy, rejected = xid_policy(nvidia_disabled="48,\u00b2,\u0661\u0663")  # superscript two, Arabic-Indic 13
    assert rejected == ["\u00b2", "\u0661\u0663"]
    assert not policy.is_critical(48)


@settings(max_examples=200, deadline=None)
@given(ignored=st.none() | st.text(), disabled=st.none() | st.text(), enabled=st.none() | st.text())
def test_property_any_environment_gives_a_policy_never_an_exception(
    ignored: str | None, disabled: str | None, enabled: str | None
):
    policy, rejected = xid_policy(ignored, disabled, enabled)
    assert all(isinstance(entry, str) and entry for entry in rejected)
    assert isinstance(policy.is_critical(79), bool)


def test_quiet_period_is_passed_through_and_none_means_faults_never_clear():
    assert xid_policy(quiet_seconds=5.0)[0].quiet_seconds == 5.0
    assert xid_policy(quiet_seconds=None)[0].quiet_seconds is None


# ----- which units an event hits -------------------------------------------------------------------


def test_unattributed_event_hits_the_whole_gpu():
    assert units_for_event(INVENTORY, gpu_uuid(0), UNATTRIBUTED, UNATTRIBUTED) == [gpu_uuid(0)]


def test_event_with_matching_gi_and_ci_hits_one_mig_device():
    assert units_for_event(INVENTORY, gpu_uuid(1), 7 + 4, 0) == [mig_uuid(1, 4)]


def test_event_naming_a_gi_but_no_ci_hits_every_compute_instance_in_it():
    assert units_for_event(INVENTORY, gpu_uuid(3), 1, UNATTRIBUTED) == [mig_uuid(3, 0), mig_uuid(3, 1)]


def test_event_naming_one_compute_instance_of_a_shared_gi_hits_only_it():
    assert units_for_event(INVENTORY, gpu_uuid(3), 1, 1) == [mig_uuid(3, 1)]


def test_event_naming_no_known_instance_falls_back_to_the_whole_gpu():
    assert units_for_event(INVENTORY, gpu_uuid(0), 99, 0) == [gpu_uuid(0)]
    assert units_for_event(INVENTORY, gpu_uuid(2), 0, 0) == [gpu_uuid(2)]  # a GPU not in MIG mode


def test_event_for_a_gpu_not_in_the_inventory_names_that_gpu():
    assert units_for_event(INVENTORY, "GPU-unknown", 7, 0) == ["GPU-unknown"]


# ----- what becomes Unhealthy ----------------------------------------------------------------------


def test_everything_is_healthy_without_faults():
    assert healthy_ids(HealthState()) == {d.id for d in ALL_DEVICES}


def test_an_xid_on_gpu_0_makes_all_its_7_mig_devices_unhealthy_but_not_gpu_1s():
    state = xid(HealthState(), 0, 79, now=100.0)
    health = state.device_health(ALL_DEVICES)
    assert [health[d.id] for d in MIG_DEVICES[0]] == [False] * 7
    assert [health[d.id] for d in MIG_DEVICES[1]] == [True] * 7
    assert health[GPU2.id] and all(health[d.id] for d in MIG_DEVICES[3])


def test_an_xid_on_one_mig_device_makes_only_that_device_unhealthy():
    state = xid(HealthState(), 1, 94, now=100.0, gi=7 + 2, ci=0)
    assert healthy_ids(HealthState()) - healthy_ids(state) == {mig_uuid(1, 2)}


def test_an_xid_on_a_time_sliced_gpu_makes_every_replica_unhealthy():
    # NVIDIA's bug #1929 marked only one replica; here every replica of the GPU goes
    replicas = [
        Device(id=f"{gpu_uuid(2)}::{n}", gpu_uuid=gpu_uuid(2), gpu_index=2, index="2", memory_mib=81920)
        for n in range(4)
    ]
    state = xid(HealthState(), 2, 79, now=1.0)
    assert state.device_health(replicas) == dict.fromkeys((r.id for r in replicas), False)


def test_unhealthy_device_is_refused_by_allocate():
    state = xid(HealthState(), 0, 79, now=1.0)
    devices = {d.id: d for d in MIG_DEVICES[0]}
    with pytest.raises(AllocationError, match=mig_uuid(0, 6)):
        validate_request("nvidia.com/mig-1g.10gb", [mig_uuid(0, 6)], devices, state.device_health(devices.values()))


def test_listing_sends_the_new_health_and_only_changes_when_health_changes():
    options = AllocationOptions()
    before = build_snapshots(PLAN, HealthState(), INVENTORY, options)
    again = build_snapshots(PLAN, HealthState(), INVENTORY, options)
    after = build_snapshots(PLAN, xid(HealthState(), 0, 79, now=1.0), INVENTORY, options)
    name = "nvidia.com/mig-1g.10gb"
    assert again[name].listing() == before[name].listing()  # nothing to resend
    assert after[name].listing() != before[name].listing()
    assert after[name].listing()[:8] == (
        *((d.id, False, 0) for d in MIG_DEVICES[0]),
        (mig_uuid(1, 0), True, 0),
    )
    assert after[name].healthy_count == 7
    assert after["nvidia.com/gpu"].listing() == before["nvidia.com/gpu"].listing() == ((GPU2.id, True, 1),)


# ----- faults over time ----------------------------------------------------------------------------


def test_repeated_faults_keep_the_first_time_and_move_the_last_event():
    state = record_fault(HealthState(), [gpu_uuid(2)], "XID 79", now=10.0)
    state = record_fault(state, [gpu_uuid(2)], "XID 94", now=30.0)
    fault = state.faults[gpu_uuid(2)]
    assert (fault.since, fault.last_event, fault.reason) == (10.0, 30.0, "XID 94")


def test_lost_gpu_stays_marked_lost_after_later_faults():
    state = record_fault(HealthState(), [gpu_uuid(2)], "GPU is lost", now=1.0, lost=True)
    state = record_fault(state, [gpu_uuid(2)], "XID 79", now=2.0)
    assert state.faults[gpu_uuid(2)].lost


def test_recording_a_fault_leaves_the_previous_state_untouched():
    before = HealthState()
    after = record_fault(before, [gpu_uuid(2)], "XID 79", now=1.0)
    assert before.faults == {}
    assert gpu_uuid(2) in after.faults


def test_a_fault_is_not_probed_before_a_quiet_period():
    state = xid(HealthState(), 2, 79, now=100.0)
    policy = HealthPolicy(quiet_seconds=QUIET)
    assert due_for_probe(state, policy, now=100.0 + QUIET - 0.001) == []
    assert due_for_probe(state, policy, now=100.0 + QUIET) == [gpu_uuid(2)]


def test_a_new_critical_event_restarts_the_quiet_period():
    state = xid(HealthState(), 2, 79, now=100.0)
    state = xid(state, 2, 79, now=150.0)
    policy = HealthPolicy(quiet_seconds=QUIET)
    assert due_for_probe(state, policy, now=160.0) == []
    assert due_for_probe(state, policy, now=210.0) == [gpu_uuid(2)]


def test_units_due_for_probe_come_in_a_stable_order():
    state = xid(HealthState(), 2, 79, now=5.0)
    state = xid(state, 0, 79, now=1.0)
    state = xid(state, 1, 94, now=3.0, gi=7, ci=0)
    assert due_for_probe(state, HealthPolicy(quiet_seconds=QUIET), now=1000.0) == sorted(
        [gpu_uuid(2), gpu_uuid(0), mig_uuid(1, 0)]
    )


def test_without_a_quiet_period_faults_are_never_probed_like_nvidia():
    state = xid(HealthState(), 2, 79, now=0.0)
    assert due_for_probe(state, HealthPolicy(quiet_seconds=None), now=1e12) == []


def test_a_successful_probe_makes_the_devices_healthy_again():
    state = xid(HealthState(), 0, 79, now=0.0)
    state = xid(state, 2, 79, now=0.0)
    state = probe_succeeded(state, gpu_uuid(0))
    assert all(d.id in healthy_ids(state) for d in MIG_DEVICES[0])
    assert GPU2.id not in healthy_ids(state)  # another unit's fault stays


def test_a_probe_failure_postpones_the_next_probe_by_a_quiet_period():
    policy = HealthPolicy(quiet_seconds=QUIET)
    state = xid(HealthState(), 2, 79, now=0.0)
    assert due_for_probe(state, policy, now=60.0) == [gpu_uuid(2)]
    state = probe_failed(state, gpu_uuid(2), now=60.0)
    assert due_for_probe(state, policy, now=119.0) == []
    assert due_for_probe(state, policy, now=120.0) == [gpu_uuid(2)]
    fault = state.faults[gpu_uuid(2)]
    assert (fault.since, fault.reason) == (0.0, "XID 79")
    assert GPU2.id not in healthy_ids(state)


def test_a_probe_failure_keeps_a_lost_gpu_lost():
    state = record_fault(HealthState(), [gpu_uuid(2)], "GPU is lost", now=0.0, lost=True)
    assert probe_failed(state, gpu_uuid(2), now=60.0).faults[gpu_uuid(2)].lost


def test_probe_results_for_a_unit_without_a_fault_change_nothing():
    state = xid(HealthState(), 2, 79, now=0.0)
    assert probe_failed(state, gpu_uuid(0), now=60.0) == state
    assert probe_succeeded(state, gpu_uuid(0)).faults == state.faults


def test_clearing_a_gpu_fault_leaves_a_separate_mig_fault_in_place():
    state = xid(HealthState(), 1, 79, now=0.0)
    state = xid(state, 1, 94, now=0.0, gi=7 + 5, ci=0)
    state = probe_succeeded(state, gpu_uuid(1))
    assert {d.id for d in MIG_DEVICES[1]} - healthy_ids(state) == {mig_uuid(1, 5)}


def test_a_mig_device_fault_spoils_the_whole_gpu_device_under_strategy_none() -> None:
    """With MIG strategy none a MIG-enabled GPU is one nvidia.com/gpu device: an XID on any of its MIG
    devices must take that device out, as NVIDIA's plugin does."""
    from agent.core.health import HealthState, record_fault
    from agent.core.resources import Device

    whole = Device(id="GPU-a", gpu_uuid="GPU-a", gpu_index=0, index="0", memory_mib=81920)
    other = Device(id="GPU-b", gpu_uuid="GPU-b", gpu_index=1, index="1", memory_mib=81920)
    mig = Device(id="MIG-1", gpu_uuid="GPU-a", gpu_index=0, index="0:0", memory_mib=9728, mig_uuid="MIG-1")
    sibling = Device(id="MIG-2", gpu_uuid="GPU-a", gpu_index=0, index="0:1", memory_mib=9728, mig_uuid="MIG-2")
    state = record_fault(HealthState(), ["MIG-1"], "XID 48", 1.0, gpu_uuid="GPU-a")
    assert state.device_health([whole, other, mig, sibling]) == {
        "GPU-a": False,
        "GPU-b": True,
        "MIG-1": False,
        "MIG-2": True,
    }
