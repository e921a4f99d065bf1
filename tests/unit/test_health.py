"""Device health (device plugin §6): XID policy (the Xid catalog, overrides, NVIDIA's variables), which
units an event hits, faults and their reasons, recovery checks.

The node: GPUs 0 and 1 in MIG mode with seven 1g.10gb devices each, GPU 2 a plain GPU, and GPU 3 in MIG
mode with one 3g.40gb GPU instance split into two compute instances (1c.3g.40gb). Time is a plain number.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.core.allocation import AllocationError, validate_request
from agent.core.health import (
    BACK_UNWATCHED_REASON,
    GPU_LOST_REASON,
    NVIDIA_IGNORED_XIDS,
    UNATTRIBUTED,
    HealthPolicy,
    HealthState,
    XidEffect,
    awaiting_watch,
    due_for_probe,
    health_policy,
    next_probe,
    parse_effect,
    parse_override_mapping,
    parse_xid_key,
    parse_xid_overrides,
    probe_failed,
    probe_succeeded,
    record_fault,
    record_unwatched,
    record_xid,
    units_for_event,
    watch_restored,
    xid_policy,
)
from agent.core.inventory import Gpu, Inventory, MigDevice, Placement
from agent.core.resources import Device, MigStrategy, Resource, ResourcePlan
from agent.core.snapshot import AllocationOptions, build_snapshots
from agent.core.xid_catalog import XidAction
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

APPLICATION_XIDS = (8, 13, 31, 32, 43, 45, 68, 69, 94)  # RESTART_APP / IGNORE / WORKFLOW_XID_45 in the catalog
RESET_CLASS_XIDS = (46, 48, 62, 64, 74, 95, 109, 119, 140, 144, 154, 159, 167, 999, 500)


@pytest.mark.parametrize("number", APPLICATION_XIDS)
def test_application_level_xids_leave_the_device_healthy_by_default(number: int):
    assert not HealthPolicy().is_critical(number)
    assert not xid_policy()[0].is_critical(number)


@pytest.mark.parametrize("number", RESET_CLASS_XIDS)
def test_reset_class_and_unknown_xids_make_the_device_unhealthy_by_default(number: int):
    assert HealthPolicy().effect(number) is XidEffect.UNHEALTHY
    assert HealthPolicy().is_critical(number)


@pytest.mark.parametrize("number", [79, 151])
def test_reboot_class_xids_mark_the_gpu_lost(number: int):
    assert HealthPolicy().effect(number) is XidEffect.LOST
    assert HealthPolicy().is_critical(number)
    assert HealthPolicy().verdict(number).lost


def test_catalog_ignore_and_restart_app_differ_in_what_is_logged():
    policy = HealthPolicy()
    assert policy.effect(63) is XidEffect.IGNORE  # remap event: no action
    assert policy.effect(94) is XidEffect.APPLICATION  # contained error: the application restarts


def test_where_the_default_differs_from_nvidias_plugin():
    ours, nvidias = HealthPolicy(), HealthPolicy.nvidia()
    assert not ours.is_critical(94) and nvidias.is_critical(94)  # RESTART_APP; NVIDIA: unhealthy
    assert ours.is_critical(109) and not nvidias.is_critical(109)  # RESET_GPU; NVIDIA: ignored
    for number in NVIDIA_IGNORED_XIDS:
        assert not nvidias.is_critical(number)
    assert nvidias.effect(79) is XidEffect.LOST
    assert nvidias.quiet_seconds is None


def test_default_policy_uses_the_catalog_and_nothing_is_rejected():
    policy, rejected = xid_policy()
    assert policy.catalog_defaults and policy.ignored_xids == frozenset()
    assert rejected == []
    assert health_policy() == (HealthPolicy(), [])


def test_xid_13_counts_with_dp_enable_healthchecks_13():
    policy, _ = xid_policy(nvidia_enabled="13")
    assert policy.effect(13) is XidEffect.UNHEALTHY
    assert not policy.is_critical(31)  # the other application XIDs stay as they were


def test_dp_enable_healthchecks_keeps_a_reboot_class_xid_lost():
    assert xid_policy(nvidia_enabled="79")[0].effect(79) is XidEffect.LOST


def test_dp_disable_healthchecks_ignores_the_xids_it_names():
    policy, _ = xid_policy(nvidia_disabled="79, 48")
    assert policy.effect(79) is XidEffect.IGNORE and policy.effect(48) is XidEffect.IGNORE
    assert not policy.is_critical(13)
    assert policy.is_critical(109) and policy.is_critical(95)


@pytest.mark.parametrize("value", ["all", "xids", "ALL", " All ", "48,all"])
def test_dp_disable_healthchecks_all_turns_every_xid_off(value: str):
    policy, rejected = xid_policy(nvidia_disabled=value)
    assert all(policy.effect(n) is XidEffect.IGNORE for n in (13, 48, 79, 94, 119, 151, 999))
    assert rejected == []


def test_disable_all_with_some_enabled_counts_only_those():
    """NVIDIA's code comment's reading (its code itself then monitors nothing; docs/health.md)."""
    policy, _ = xid_policy(nvidia_disabled="all", nvidia_enabled="79,13")
    assert policy.effect(79) is XidEffect.LOST and policy.effect(13) is XidEffect.UNHEALTHY
    assert not policy.is_critical(48)


def test_dp_enable_healthchecks_overrides_the_disabled_list():
    policy, _ = xid_policy(nvidia_disabled="79,48", nvidia_enabled="79")
    assert policy.is_critical(79)
    assert not policy.is_critical(48)


@pytest.mark.parametrize("disabled", [None, "all", "48,79"])
def test_dp_enable_healthchecks_all_makes_every_xid_count_defaults_included(disabled: str | None):
    policy, _ = xid_policy(nvidia_disabled=disabled, nvidia_enabled="All")
    assert all(policy.is_critical(n) for n in (13, 31, 43, 45, 48, 63, 68, 79, 92, 94, 109, 121))


def test_ignored_xids_flag_switches_to_nvidias_model_with_that_list():
    policy, _ = xid_policy(ignored="79")
    assert policy.effect(79) is XidEffect.IGNORE
    assert policy.is_critical(13) and policy.is_critical(94) and policy.is_critical(63)  # list replaced
    assert policy.effect(151) is XidEffect.LOST


def test_ignored_xids_with_nvidias_list_is_nvidias_plugin():
    policy, _ = xid_policy(ignored="13,31,43,45,68,109", quiet_seconds=None)
    assert all(policy.effect(n) == HealthPolicy.nvidia().effect(n) for n in range(0, 1001))


def test_ignored_xids_flag_and_dp_disable_healthchecks_combine():
    policy, _ = xid_policy(ignored="79", nvidia_disabled="48")
    assert not policy.is_critical(79) and not policy.is_critical(48)
    assert policy.is_critical(13)


def test_dp_enable_healthchecks_wins_over_ignored_xids():
    assert xid_policy(ignored="13,48", nvidia_enabled="48")[0].is_critical(48)


def test_empty_ignored_xids_flag_makes_every_xid_count():
    policy, _ = xid_policy(ignored="")
    assert all(policy.is_critical(n) for n in (*NVIDIA_IGNORED_XIDS, *APPLICATION_XIDS))


def test_bad_entries_are_returned_for_a_warning_and_good_ones_still_apply():
    policy, rejected = xid_policy(ignored="79,x1", nvidia_disabled=" -68 , ABC,48", nvidia_enabled="13,0x1f")
    assert rejected == ["x1", "-68", "abc", "0x1f"]
    assert not policy.is_critical(79) and not policy.is_critical(48)
    assert policy.is_critical(13)


def test_non_ascii_digits_are_rejected_not_a_crash():
    policy, rejected = xid_policy(nvidia_disabled="48,\u00b2,\u0661\u0663")  # superscript two, Arabic-Indic 13
    assert rejected == ["\u00b2", "\u0661\u0663"]
    assert not policy.is_critical(48)


def test_an_xid_beyond_32_bits_is_rejected():
    assert xid_policy(nvidia_disabled="4294967296")[1] == ["4294967296"]


@settings(max_examples=200, deadline=None)
@given(
    ignored=st.none() | st.text(),
    disabled=st.none() | st.text(),
    enabled=st.none() | st.text(),
    overrides=st.none() | st.text(),
    number=st.integers(0, 2**32),
)
def test_property_any_flags_and_environment_give_a_policy_never_an_exception(
    ignored: str | None, disabled: str | None, enabled: str | None, overrides: str | None, number: int
):
    policy, warnings = health_policy(
        ignored=ignored, overrides=overrides, nvidia_disabled=disabled, nvidia_enabled=enabled
    )
    assert all(isinstance(line, str) and line for line in warnings)
    assert policy.is_critical(number) == policy.effect(number).marks_unhealthy
    assert xid_policy(ignored, disabled, enabled)[0] == replace(policy, overrides={})


def test_quiet_period_is_passed_through_and_none_means_faults_never_clear():
    assert xid_policy(quiet_seconds=5.0)[0].quiet_seconds == 5.0
    assert xid_policy(quiet_seconds=None)[0].quiet_seconds is None


# ----- per-XID overrides: flag and config ----------------------------------------------------------


def test_override_flag_value_is_parsed_case_insensitively_with_ranges():
    overrides, rejected = parse_xid_overrides(" 94=Unhealthy, 13=ignore,109=application , 144-146=LOST,")
    assert overrides == {
        94: XidEffect.UNHEALTHY,
        13: XidEffect.IGNORE,
        109: XidEffect.APPLICATION,
        144: XidEffect.LOST,
        145: XidEffect.LOST,
        146: XidEffect.LOST,
    }
    assert rejected == []


@pytest.mark.parametrize(
    "entry",
    [
        "94",
        "94=",
        "=ignore",
        "94=fatal",
        "x=ignore",
        "0=ignore",
        "150-144=ignore",
        "1-2000=ignore",
        "\u00b2=ignore",
        "4294967296=ignore",
        "94=ignore=x",
        "-5=ignore",
    ],
)
def test_bad_override_entries_are_rejected_and_the_rest_applies(entry: str):
    overrides, rejected = parse_xid_overrides(f"13=unhealthy,{entry}")
    assert rejected == [entry]
    assert overrides == {13: XidEffect.UNHEALTHY}


def test_a_later_override_entry_wins():
    assert parse_xid_overrides("94=ignore,90-95=unhealthy")[0][94] is XidEffect.UNHEALTHY


def test_key_and_effect_errors_say_what_is_allowed():
    with pytest.raises(ValueError, match="ignore, application, unhealthy, lost"):
        parse_effect("fatal")
    with pytest.raises(ValueError, match="144-150"):
        parse_xid_key("ninety")
    assert parse_override_mapping({94: "ignore", "1-3": "lost", "x": "ignore", "5": 7}) == (
        {94: XidEffect.IGNORE, 1: XidEffect.LOST, 2: XidEffect.LOST, 3: XidEffect.LOST},
        [
            "'x' is not an XID; write a number such as 94 or a range such as 144-150",
            "7 is not an XID effect; use one of ignore, application, unhealthy, lost",
        ],
    )


def test_overrides_win_over_every_other_source():
    policy, warnings = health_policy(
        overrides="13=unhealthy,48=ignore", nvidia_disabled="all,13", nvidia_enabled="all,48"
    )
    assert policy.effect(13) is XidEffect.UNHEALTHY
    assert policy.effect(48) is XidEffect.IGNORE
    assert policy.effect(95) is XidEffect.UNHEALTHY  # DP_ENABLE_HEALTHCHECKS=all for the rest
    assert warnings == [
        "XID 13: --xid-overrides (unhealthy) wins over DP_DISABLE_HEALTHCHECKS/--ignored-xids",
        "XID 48: --xid-overrides (ignore) wins over DP_ENABLE_HEALTHCHECKS",
    ]


def test_flag_override_wins_over_the_config_xid_by_xid():
    config = {94: XidEffect.UNHEALTHY, 13: XidEffect.IGNORE}
    policy, warnings = health_policy(overrides="94=application", config_overrides=config)
    assert policy.effect(94) is XidEffect.APPLICATION  # the flag
    assert policy.effect(13) is XidEffect.IGNORE  # the config, where the flag says nothing
    assert policy.effect(48) is XidEffect.UNHEALTHY  # the catalog
    assert warnings == []


def test_config_override_wins_over_nvidias_variables_and_is_reported():
    policy, warnings = health_policy(config_overrides={13: XidEffect.IGNORE}, nvidia_enabled="13")
    assert policy.effect(13) is XidEffect.IGNORE
    assert warnings == ["XID 13: the config's health.xids (ignore) wins over DP_ENABLE_HEALTHCHECKS"]


def test_a_config_reload_replaces_the_config_overrides_and_keeps_the_flags():
    policy, _ = health_policy(overrides="94=unhealthy", config_overrides={13: XidEffect.UNHEALTHY})
    reloaded = policy.with_config_overrides({31: XidEffect.UNHEALTHY})
    assert reloaded.effect(94) is XidEffect.UNHEALTHY
    assert reloaded.effect(13) is XidEffect.APPLICATION and reloaded.effect(31) is XidEffect.UNHEALTHY
    assert policy.effect(13) is XidEffect.UNHEALTHY  # the old policy is untouched


def test_bad_flag_entries_become_warnings_naming_their_source():
    _, warnings = health_policy(ignored="x", overrides="94=fatal", nvidia_disabled="y", nvidia_enabled="z")
    assert warnings == [
        "--ignored-xids: ignored entries that are not XIDs: x",
        "DP_DISABLE_HEALTHCHECKS: ignored entries that are not XIDs: y",
        "DP_ENABLE_HEALTHCHECKS: ignored entries that are not XIDs: z",
        "--xid-overrides: ignored entries 94=fatal; write XID=EFFECT or LOW-HIGH=EFFECT, comma separated; "
        "EFFECT is one of ignore, application, unhealthy, lost",
    ]


def test_policy_overrides_are_immutable_and_the_policy_hashable():
    source = {94: "unhealthy"}
    policy = HealthPolicy(overrides=source)
    source[13] = "unhealthy"
    assert policy.effect(13) is XidEffect.APPLICATION
    with pytest.raises(TypeError):
        policy.overrides[13] = XidEffect.UNHEALTHY  # type: ignore[index]
    assert hash(policy) == hash(HealthPolicy(overrides={94: XidEffect.UNHEALTHY}))
    assert policy == HealthPolicy(overrides={94: XidEffect.UNHEALTHY})


# ----- the reason a fault carries ------------------------------------------------------------------


def test_a_verdict_names_the_xid_its_catalog_entry_and_the_effect():
    verdict = HealthPolicy().verdict(48)
    assert verdict.reason == "XID 48 (Double Bit ECC Error, WORKFLOW_XID_48)"
    assert (verdict.action, verdict.effect, verdict.marks_unhealthy, verdict.lost) == (
        XidAction.WORKFLOW_XID_48,
        XidEffect.UNHEALTHY,
        True,
        False,
    )
    assert HealthPolicy().verdict(999).reason == "XID 999 (XID unknown to NVML, UNKNOWN)"
    assert HealthPolicy().verdict(79).reason == "XID 79 (GPU has fallen off the bus, RESTART_BM)"


def test_recording_an_xid_carries_its_reason_into_the_fault():
    state = record_xid(HealthState(), [gpu_uuid(2)], HealthPolicy().verdict(95), 5.0, ecc_baseline=3)
    fault = state.faults[gpu_uuid(2)]
    assert (fault.reason, fault.xid, fault.action, fault.effect, fault.lost, fault.ecc_baseline) == (
        "XID 95 (Uncontained memory error, RESET_GPU)",
        95,
        XidAction.RESET_GPU,
        XidEffect.UNHEALTHY,
        False,
        3,
    )


def test_recording_an_application_xid_changes_nothing():
    state = HealthState()
    assert record_xid(state, [gpu_uuid(2)], HealthPolicy().verdict(94), 5.0) is state


def test_recording_a_reboot_class_xid_marks_the_gpu_lost():
    state = record_xid(HealthState(), [gpu_uuid(2)], HealthPolicy().verdict(79), 5.0)
    assert state.faults[gpu_uuid(2)].lost
    assert not state.is_healthy(GPU2)


def test_a_mig_xid_names_its_parent_gpu():
    units = units_for_event(INVENTORY, gpu_uuid(1), 7 + 2, 0)
    state = record_xid(HealthState(), units, HealthPolicy().verdict(48), 1.0, gpu_uuid=gpu_uuid(1))
    assert state.faults[mig_uuid(1, 2)].gpu_uuid == gpu_uuid(1)


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


def test_a_failed_recovery_check_remembers_what_blocked_it_and_the_new_ecc_baseline():
    state = record_fault(HealthState(), [gpu_uuid(2)], "XID 48", now=0.0, ecc_baseline=3)
    state = probe_failed(state, gpu_uuid(2), now=60.0, blockers=["uncorrected ECC grew 3 -> 5"], ecc_baseline=5)
    fault = state.faults[gpu_uuid(2)]
    assert (fault.blockers, fault.ecc_baseline, fault.last_event) == (("uncorrected ECC grew 3 -> 5",), 5, 60.0)
    state = probe_failed(state, gpu_uuid(2), now=120.0, blockers=["recovery action GPU_RESET"])
    assert state.faults[gpu_uuid(2)].ecc_baseline == 5  # no new count read: the baseline stays
    assert state.faults[gpu_uuid(2)].blockers == ("recovery action GPU_RESET",)


def test_a_new_fault_keeps_the_first_ecc_baseline_and_clears_old_blockers():
    state = record_fault(HealthState(), [gpu_uuid(2)], "XID 48", now=0.0, ecc_baseline=3)
    state = probe_failed(state, gpu_uuid(2), now=60.0, blockers=["row remap pending"])
    state = record_fault(state, [gpu_uuid(2)], "XID 48", now=70.0, ecc_baseline=9)
    assert state.faults[gpu_uuid(2)].ecc_baseline == 3
    assert state.faults[gpu_uuid(2)].blockers == ()
    assert record_fault(HealthState(), [gpu_uuid(2)], "x", 0.0).faults[gpu_uuid(2)].ecc_baseline is None


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


# ----- faults only the watcher clears -------------------------------------------------------------

BLIND = "health watch failed: NVML_ERROR_UNKNOWN"


def test_a_gpu_the_watcher_cannot_see_is_unhealthy_and_no_quiet_period_clears_it():
    state = record_unwatched(HealthState(), [gpu_uuid(2)], BLIND, now=0.0)
    assert GPU2.id not in healthy_ids(state)
    assert state.faults[gpu_uuid(2)].reason == BLIND
    policy = HealthPolicy(quiet_seconds=QUIET)
    assert due_for_probe(state, policy, now=1e9) == []
    assert next_probe(state, policy) is None  # nothing to wake the loop for
    assert probe_succeeded(state, gpu_uuid(2)).faults == state.faults  # even a stray probe leaves it
    assert GPU2.id in healthy_ids(watch_restored(state, gpu_uuid(2)))


def test_an_xid_on_a_blind_gpu_needs_both_the_evidence_and_the_watcher():
    xid48 = HealthPolicy().verdict(48)
    policy = HealthPolicy(quiet_seconds=QUIET)
    state = record_xid(HealthState(), [gpu_uuid(2)], xid48, now=0.0)
    state = record_unwatched(state, [gpu_uuid(2)], BLIND, now=1.0)
    assert state.faults[gpu_uuid(2)].reason == xid48.reason  # the cause is what the status says first
    assert due_for_probe(state, policy, now=QUIET) == [gpu_uuid(2)]
    evidence_first = probe_succeeded(state, gpu_uuid(2))
    fault = evidence_first.faults[gpu_uuid(2)]
    assert (fault.reason, fault.xid, fault.needs_evidence) == (BLIND, None, False)
    assert GPU2.id not in healthy_ids(evidence_first)
    assert GPU2.id in healthy_ids(watch_restored(evidence_first, gpu_uuid(2)))

    watcher_first = watch_restored(state, gpu_uuid(2))
    assert watcher_first.faults[gpu_uuid(2)].xid == 48  # watched again, but the XID still waits for evidence
    assert GPU2.id not in healthy_ids(watcher_first)
    assert GPU2.id in healthy_ids(probe_succeeded(watcher_first, gpu_uuid(2)))


def test_a_gpu_back_from_the_bus_stays_unhealthy_until_it_is_watched_again():
    state = record_fault(HealthState(), [gpu_uuid(2)], GPU_LOST_REASON, now=0.0, lost=True)
    assert awaiting_watch(state) == [gpu_uuid(2)]
    back = probe_succeeded(state, gpu_uuid(2))  # it answers, and the evidence is good
    fault = back.faults[gpu_uuid(2)]
    assert (fault.reason, fault.lost) == (BACK_UNWATCHED_REASON, False)
    assert GPU2.id not in healthy_ids(back)
    assert due_for_probe(back, HealthPolicy(quiet_seconds=QUIET), now=1e9) == []
    assert GPU2.id in healthy_ids(watch_restored(back, gpu_uuid(2)))


def test_a_lost_gpu_the_watcher_registered_again_first_recovers_on_the_evidence_alone():
    state = record_fault(HealthState(), [gpu_uuid(2)], GPU_LOST_REASON, now=0.0, lost=True)
    state = watch_restored(state, gpu_uuid(2))  # the watcher's own retry got it back before the check
    assert state.faults[gpu_uuid(2)].lost and awaiting_watch(state) == []
    assert GPU2.id in healthy_ids(probe_succeeded(state, gpu_uuid(2)))
    again = record_fault(state, [gpu_uuid(2)], GPU_LOST_REASON, now=5.0, lost=True)  # and falls again
    assert awaiting_watch(again) == [gpu_uuid(2)]


def test_watch_restored_clears_the_waiting_faults_of_that_gpu_and_its_mig_devices_only():
    lost_mig = HealthPolicy(overrides={94: XidEffect.LOST}).verdict(94)
    state = record_xid(HealthState(), [mig_uuid(1, 5)], lost_mig, now=0.0, gpu_uuid=gpu_uuid(1))
    state = probe_succeeded(state, mig_uuid(1, 5))
    state = record_unwatched(state, [gpu_uuid(2)], BLIND, now=0.0)
    assert watch_restored(state, gpu_uuid(0)) is state  # nothing of GPU 0 waits: the same state, nothing to say
    after = watch_restored(state, gpu_uuid(1))
    assert set(after.faults) == {gpu_uuid(2)}
    assert GPU2.id not in healthy_ids(after)


def test_a_fault_with_evidence_pending_still_wakes_the_loop_at_the_end_of_its_quiet_period():
    state = record_unwatched(HealthState(), [gpu_uuid(0)], BLIND, now=0.0)
    state = record_fault(state, [gpu_uuid(2)], "XID 48", now=10.0)
    assert next_probe(state, HealthPolicy(quiet_seconds=QUIET)) == 10.0 + QUIET
    assert next_probe(state, HealthPolicy(quiet_seconds=None)) is None


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


# ----- the sharing config's health section -----------------------------------------------------------


def test_the_config_health_section_carries_overrides_to_the_policy():
    from agent.config.effective import FlagOverrides, effective
    from agent.config.model import parse_config

    model, warnings = parse_config(
        {"version": "v1", "health": {"xids": {94: "Unhealthy", "13": "ignore", "144-145": "application"}}}
    )
    assert warnings == []
    carried = effective(model, FlagOverrides()).health_overrides
    assert dict(carried) == {
        94: XidEffect.UNHEALTHY,
        13: XidEffect.IGNORE,
        144: XidEffect.APPLICATION,
        145: XidEffect.APPLICATION,
    }
    policy, _ = health_policy(overrides="13=unhealthy", config_overrides=carried)
    assert policy.effect(94) is XidEffect.UNHEALTHY and policy.effect(13) is XidEffect.UNHEALTHY
    assert dict(effective(parse_config({})[0], FlagOverrides()).health_overrides) == {}


@pytest.mark.parametrize(
    ("health", "message"),
    [
        (
            {"xids": {"x": "ignore"}},
            "health.xids: key 'x' is not an XID; write a number such as 94 or a range such as 144-150",
        ),
        (
            {"xids": {"94": "fatal"}},
            "health.xids: XID 94: 'fatal' is not an XID effect; use one of ignore, application, unhealthy, lost",
        ),
        ({"xids": ["94"]}, 'health.xids: must be a map of XID to effect, e.g. {"94": unhealthy, "13": ignore}'),
        ({"xids": {"0-5000": "ignore"}}, "health.xids: key '0-5000' is out of range"),
    ],
)
def test_a_bad_config_health_section_is_rejected_naming_the_field_and_the_allowed_values(health, message):
    from agent.config.model import ConfigError, parse_config

    with pytest.raises(ConfigError) as error:
        parse_config({"version": "v1", "health": health})
    assert error.value.problems[0].startswith(message)


def test_a_misspelt_health_key_is_a_warning_like_any_unknown_key():
    from agent.config.model import parse_config

    _, warnings = parse_config({"health": {"xid": {"94": "ignore"}}})
    assert warnings == ["config: unknown key health.xid is ignored; did you mean health.xids?"]
