"""The NVML event watcher and the recovery evidence, through real pynvml on the simulated node.

The watcher posts to a ``queue.Queue``; tests read it with timeouts and poll with deadlines (no sleeps).
Each guard has a test that fails when the guard is removed: a GPU needing a reset stays unhealthy while
its recovery action reads GPU_RESET, ECC growth blocks recovery, a lost GPU is reported per GPU while the
others keep being watched, an UNKNOWN wait rebuilds the set without marking anything, and an nvmlInit
failure inside the watcher is retried.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator

import pynvml
import pytest

from agent.core.health import UNATTRIBUTED, HealthPolicy, HealthState, due_for_probe, probe_failed, probe_succeeded
from agent.core.health import record_xid as record
from agent.gpu.health import (
    Evidence,
    GpuLost,
    NvmlEventWatcher,
    WatchFailed,
    WatchRestored,
    XidEvent,
    probe,
    read_ecc_uncorrected,
    recovery_evidence,
)
from agent.sim.nvml.codes import Return
from agent.sim.nvml.driver import SimDriver

NODE = {"name": "health", "gpus": [{"model": "A100-SXM4-80GB", "count": 3}]}
MIXED = {"name": "health-mixed", "gpus": [{"model": "A100-SXM4-80GB"}, {"model": "T4"}]}
NO_PAGE_RETIREMENT = "retired pages (NVML_ERROR_NOT_SUPPORTED)"  # Ampere and newer remap rows instead
MIG_NODE = {
    "name": "health-mig",
    "gpus": [{"model": "A100-SXM4-80GB", "mig": {"instances": ["3g.40gb", "1g.10gb"]}}, {"model": "A100-SXM4-80GB"}],
}
WAIT_MS = 50
DEADLINE = 5.0
WATCH_KINDS = (WatchFailed, WatchRestored, GpuLost)


# ----------------------------------------------------------------------------------------------- helpers


class Events:
    """What a watcher posted, read from its queue with deadlines."""

    def __init__(self) -> None:
        self.queue: queue.Queue[object] = queue.Queue()
        self.seen: list[object] = []

    def post(self, event: object) -> None:
        self.queue.put(event)

    def next(self, match: Callable[[object], bool], what: str, timeout: float = DEADLINE) -> object:
        """The next event ``match`` accepts (every event read is kept in ``seen``)."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no {what} within {timeout} s; seen: {self.seen}")
            try:
                event = self.queue.get(timeout=remaining)
            except queue.Empty:
                continue
            self.seen.append(event)
            if match(event):
                return event

    def xid(self, gpu_uuid: str, xid: int, timeout: float = DEADLINE) -> XidEvent:
        event = self.next(
            lambda e: isinstance(e, XidEvent) and e.gpu_uuid == gpu_uuid and e.xid == xid, f"XID {xid} on {gpu_uuid}"
        )
        assert isinstance(event, XidEvent)
        return event

    def of(self, kind: type) -> list[object]:
        return [e for e in self.seen if isinstance(e, kind)]

    def watch_events(self) -> list[object]:
        return [e for e in self.seen if isinstance(e, WATCH_KINDS)]


def poll(predicate: Callable[[], bool], what: str, timeout: float = DEADLINE) -> None:
    deadline = time.monotonic() + timeout
    tick = threading.Event()
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        tick.wait(0.01)


@pytest.fixture
def watch(sim_node: Callable[[object], SimDriver]) -> Iterator[Callable[..., tuple[NvmlEventWatcher, Events]]]:
    """``watch(driver, uuids=None, **options)``: a started watcher on the simulated node, stopped afterwards."""
    started: list[NvmlEventWatcher] = []

    def make(driver: SimDriver, uuids: list[str] | None = None, **options: object) -> tuple[NvmlEventWatcher, Events]:
        events = Events()
        settings = {"wait_ms": WAIT_MS, "backoff_initial": 0.02, "backoff_max": 0.2, **options}
        watcher = NvmlEventWatcher(
            uuids if uuids is not None else [g.uuid for g in driver.gpus], events.post, **settings
        )
        started.append(watcher)
        watcher.start()
        return watcher, events

    yield make
    for watcher in started:
        watcher.stop()


def uuids(driver: SimDriver) -> list[str]:
    return [g.uuid for g in driver.gpus]


def wait_for_rebuild(watcher: NvmlEventWatcher, after: int, *, gpus: set[str]) -> None:
    poll(lambda: watcher.builds > after and watcher.watched() == gpus, f"a rebuilt event set watching {gpus}")


# ------------------------------------------------------------------------------------------ XID events


def test_xid_events_name_the_gpu_and_the_mig_device(sim_node, watch) -> None:
    driver = sim_node(MIG_NODE)
    watcher, events = watch(driver)
    assert watcher.alive() and watcher.watched() == set(uuids(driver))

    driver.inject_xid(1, 48)
    assert events.xid(driver.gpus[1].uuid, 48) == XidEvent(driver.gpus[1].uuid, 48, UNATTRIBUTED, UNATTRIBUTED)

    gi, ci = driver.gpus[0].mig_devices()[1]
    driver.inject_xid(0, 94, mig_uuid=ci.uuid)
    assert events.xid(driver.gpus[0].uuid, 94) == XidEvent(driver.gpus[0].uuid, 94, gi.id, ci.id)
    assert events.watch_events() == []


# ------------------------------------------------------------------------------------------- lost GPUs


def test_a_lost_gpu_is_reported_alone_and_the_others_keep_being_watched(sim_node, watch, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="agent.gpu.health")
    driver = sim_node(NODE)
    watcher, events = watch(driver)
    gpu0, gpu1, gpu2 = uuids(driver)
    before = watcher.builds

    driver.lose_gpu(1)
    events.xid(gpu1, 79)  # the driver's Xid 79 comes first
    assert events.next(lambda e: isinstance(e, GpuLost), "GpuLost") == GpuLost(gpu1)
    wait_for_rebuild(watcher, before, gpus={gpu0, gpu2})

    driver.inject_xid(0, 48)
    driver.inject_xid(2, 95)
    events.xid(gpu0, 48)
    events.xid(gpu2, 95)
    assert events.watch_events() == [GpuLost(gpu1)]  # nothing about the GPUs that answer
    # found by asking each GPU, then rebuilt at once: not a failed watch waiting for its backoff
    assert not [r for r in caplog.records if "event watch failed" in r.getMessage()]


def test_a_lost_gpu_rejoins_the_watch_when_it_answers_again(sim_node, watch) -> None:
    driver = sim_node(NODE)
    watcher, events = watch(driver)
    gpu1 = driver.gpus[1].uuid
    driver.lose_gpu(1)
    events.next(lambda e: isinstance(e, GpuLost), "GpuLost")
    poll(lambda: gpu1 not in watcher.watched(), "the lost GPU dropped from the set")

    driver.recover_gpu(1)
    assert events.next(lambda e: isinstance(e, WatchRestored), "WatchRestored") == WatchRestored(gpu1)
    assert gpu1 in watcher.watched()
    driver.inject_xid(1, 48)
    events.xid(gpu1, 48)
    assert events.of(GpuLost) == [GpuLost(gpu1)]  # reported once, not once per retry


def test_a_gpu_lost_for_a_moment_is_watched_again_on_its_backoff_not_after_a_long_wait(sim_node, watch) -> None:
    """``tessera run`` waits for events up to 5 s at a time; a GPU back from the bus is registered again when its
    retry is due (here within 0.2 s), so an XID it raises then, or a second fall, is seen at once."""
    driver = sim_node(NODE)
    watcher, events = watch(driver, wait_ms=3000)
    gpu1 = driver.gpus[1].uuid
    driver.lose_gpu(1)
    events.next(lambda e: isinstance(e, GpuLost), "GpuLost")
    driver.recover_gpu(1)
    poll(lambda: gpu1 in watcher.watched(), "watched again", timeout=1.5)  # the wait alone would take 3 s
    driver.lose_gpu(1)  # falls again: its XID 79 arrives through the set
    events.xid(gpu1, 79)


def test_a_gpu_the_agent_finds_back_is_confirmed_watched_once_it_is_registered_again(sim_node, watch) -> None:
    """The agent keeps a GPU back from the bus Unhealthy until this word comes: it must come even when the agent,
    not the watcher's own retry (5 s away here), was first to see the GPU answer."""
    driver = sim_node(NODE)
    watcher, events = watch(driver, backoff_initial=5.0, backoff_max=5.0)
    gpu1 = driver.gpus[1].uuid
    driver.lose_gpu(1)
    events.next(lambda e: isinstance(e, GpuLost), "GpuLost")
    poll(lambda: gpu1 not in watcher.watched(), "the lost GPU dropped from the set")
    driver.recover_gpu(1)
    watcher.gpu_back(gpu1)
    assert events.next(lambda e: isinstance(e, WatchRestored), "WatchRestored", timeout=2.0) == WatchRestored(gpu1)
    assert gpu1 in watcher.watched()
    driver.inject_xid(1, 48)
    events.xid(gpu1, 48)


def test_a_gpu_back_that_is_watched_already_is_confirmed_at_once(sim_node, watch) -> None:
    driver = sim_node(NODE)
    watcher, events = watch(driver)
    gpu1 = driver.gpus[1].uuid
    driver.lose_gpu(1)
    events.next(lambda e: isinstance(e, GpuLost), "GpuLost")
    driver.recover_gpu(1)
    events.next(lambda e: isinstance(e, WatchRestored), "WatchRestored after its own retry")
    watcher.gpu_back(gpu1)
    assert events.queue.get_nowait() == WatchRestored(gpu1)  # posted by gpu_back itself: no wait to end first


def test_a_gpu_back_is_not_confirmed_while_it_cannot_be_registered(sim_node, watch) -> None:
    driver = sim_node(NODE)
    watcher, events = watch(driver)
    gpu1 = driver.gpus[1].uuid
    driver.lose_gpu(1)
    events.next(lambda e: isinstance(e, GpuLost), "GpuLost")
    poll(lambda: gpu1 not in watcher.watched(), "the lost GPU dropped from the set")
    driver.inject_error("nvmlDeviceRegisterEvents", Return.ERROR_NO_PERMISSION, times=None, gpu_index=1)
    driver.recover_gpu(1)
    watcher.gpu_back(gpu1)
    failed = events.next(lambda e: isinstance(e, WatchFailed), "WatchFailed for the GPU back")
    assert failed == WatchFailed(gpu1, "NVML_ERROR_NO_PERMISSION (register)")
    assert not events.of(WatchRestored)
    driver.clear_injected_errors()
    assert events.next(lambda e: isinstance(e, WatchRestored), "WatchRestored") == WatchRestored(gpu1)


def test_an_unmonitored_gpu_back_is_confirmed_as_watched_as_it_ever_was(sim_node, watch) -> None:
    driver = sim_node(NODE)
    driver.inject_error("nvmlDeviceRegisterEvents", Return.ERROR_NOT_SUPPORTED, times=None, gpu_index=1)
    watcher, events = watch(driver)
    gpu1 = driver.gpus[1].uuid
    assert gpu1 not in watcher.watched()
    watcher.gpu_back(gpu1)
    assert events.next(lambda e: isinstance(e, WatchRestored), "WatchRestored") == WatchRestored(gpu1)


# ------------------------------------------------------------------------------------- broken event sets


def test_an_unknown_wait_error_rebuilds_the_set_without_marking_anything(sim_node, watch) -> None:
    driver = sim_node(NODE)
    watcher, events = watch(driver)
    before = watcher.builds

    driver.inject_error("nvmlEventSetWait_v2", Return.ERROR_UNKNOWN, times=2)
    wait_for_rebuild(watcher, before, gpus=set(uuids(driver)))
    driver.inject_xid(2, 48)
    events.xid(driver.gpus[2].uuid, 48)
    assert events.watch_events() == []  # NVIDIA's plugin marks every device Unhealthy here
    assert watcher.alive()


def test_an_event_wait_that_keeps_failing_reports_every_gpu_then_restores_them(sim_node, watch) -> None:
    driver = sim_node(NODE)
    _, events = watch(driver)
    everyone = set(uuids(driver))

    driver.inject_error("nvmlEventSetWait_v2", Return.ERROR_UNKNOWN, times=None)
    for _ in everyone:
        events.next(lambda e: isinstance(e, WatchFailed), "WatchFailed for every GPU")
    failed = events.of(WatchFailed)
    assert {e.gpu_uuid for e in failed} == everyone
    assert {e.error for e in failed} == {"NVML_ERROR_UNKNOWN"}

    driver.clear_injected_errors()
    for _ in everyone:
        events.next(lambda e: isinstance(e, WatchRestored), "WatchRestored for every GPU")
    assert {e.gpu_uuid for e in events.of(WatchRestored)} == everyone
    driver.inject_xid(0, 48)
    events.xid(driver.gpus[0].uuid, 48)
    assert len(events.of(WatchFailed)) == len(everyone)  # once each, not once per failed wait


def test_nvml_init_failing_in_the_watcher_is_retried(sim_node, watch) -> None:
    driver = sim_node(NODE)
    driver.fail_init(Return.ERROR_DRIVER_NOT_LOADED, times=2)
    watcher, events = watch(driver)
    poll(lambda: watcher.builds >= 1 and watcher.watched() == set(uuids(driver)), "the watch after two failed inits")
    driver.inject_xid(1, 48)
    events.xid(driver.gpus[1].uuid, 48)
    assert events.watch_events() == []
    assert watcher.alive()


def test_nvml_init_failing_for_good_reports_every_gpu_and_recovers_when_it_works(sim_node, watch) -> None:
    driver = sim_node(NODE)
    driver.fail_init(Return.ERROR_DRIVER_NOT_LOADED, times=None)
    watcher, events = watch(driver)
    for _ in driver.gpus:
        events.next(lambda e: isinstance(e, WatchFailed), "WatchFailed while nvmlInit fails")
    assert all("NVML_ERROR_DRIVER_NOT_LOADED" in e.error for e in events.of(WatchFailed))
    assert watcher.alive() and watcher.builds == 0

    driver.fail_init(None)
    for _ in driver.gpus:
        events.next(lambda e: isinstance(e, WatchRestored), "WatchRestored once nvmlInit works")
    driver.inject_xid(2, 48)
    events.xid(driver.gpus[2].uuid, 48)


# ------------------------------------------------------------------------------------- registering GPUs


def test_a_gpu_that_does_not_support_events_stays_healthy_and_unmonitored(sim_node, watch) -> None:
    driver = sim_node(NODE)
    driver.inject_error("nvmlDeviceRegisterEvents", Return.ERROR_NOT_SUPPORTED, times=None, gpu_index=1)
    watcher, events = watch(driver, failures_before_report=1)
    gpu0, _, gpu2 = uuids(driver)
    assert watcher.watched() == {gpu0, gpu2}
    driver.inject_xid(0, 48)
    events.xid(gpu0, 48)
    assert events.watch_events() == []  # as NVIDIA's plugin: a warning, not Unhealthy


def test_a_gpu_that_cannot_be_registered_is_reported_retried_and_restored(sim_node, watch) -> None:
    driver = sim_node(NODE)
    gpu0, gpu1, _ = uuids(driver)
    driver.inject_error("nvmlDeviceRegisterEvents", Return.ERROR_NO_PERMISSION, times=None, gpu_index=1)
    _, events = watch(driver)
    failed = events.next(lambda e: isinstance(e, WatchFailed), "WatchFailed for GPU 1")
    assert failed == WatchFailed(gpu1, "NVML_ERROR_NO_PERMISSION (register)")
    driver.inject_xid(0, 48)
    events.xid(gpu0, 48)  # the others are watched meanwhile

    driver.clear_injected_errors()
    assert events.next(lambda e: isinstance(e, WatchRestored), "WatchRestored") == WatchRestored(gpu1)
    driver.inject_xid(1, 48)
    events.xid(gpu1, 48)
    assert events.watch_events() == [WatchFailed(gpu1, "NVML_ERROR_NO_PERMISSION (register)"), WatchRestored(gpu1)]


def test_an_unknown_registration_error_rebuilds_the_set_without_that_gpu(sim_node, watch) -> None:
    driver = sim_node(NODE)
    gpu0, gpu1, gpu2 = uuids(driver)
    driver.inject_error("nvmlDeviceRegisterEvents", Return.ERROR_UNKNOWN, times=1, gpu_index=1)
    watcher, events = watch(driver)
    poll(lambda: watcher.watched() == {gpu0, gpu1, gpu2}, "GPU 1 registered again after its retry")
    driver.inject_xid(1, 48)
    events.xid(gpu1, 48)
    assert events.watch_events() == []


def test_set_gpus_adds_a_gpu_that_joined_and_drops_one_that_left(sim_node, watch) -> None:
    driver = sim_node(NODE)
    gpu0, gpu1, gpu2 = uuids(driver)
    watcher, events = watch(driver, [gpu0])
    assert watcher.watched() == {gpu0}

    watcher.set_gpus([gpu0, gpu1])
    poll(lambda: watcher.watched() == {gpu0, gpu1}, "GPU 1 added")
    driver.inject_xid(1, 48)
    events.xid(gpu1, 48)

    watcher.set_gpus([gpu1])
    poll(lambda: watcher.watched() == {gpu1}, "GPU 0 dropped")
    driver.inject_xid(0, 48)  # no longer watched: never posted
    driver.inject_xid(1, 95)
    assert events.next(lambda e: isinstance(e, XidEvent), "the next XID") == XidEvent(
        gpu1, 95, UNATTRIBUTED, UNATTRIBUTED
    )
    assert gpu2 not in {getattr(e, "gpu_uuid", None) for e in events.seen}


# ------------------------------------------------------------------------------------- the thread itself


def test_stop_is_fast_and_a_stopped_watcher_can_be_started_again(sim_node, watch) -> None:
    driver = sim_node(NODE)
    watcher, events = watch(driver, wait_ms=200)
    started = time.monotonic()
    watcher.stop()
    assert time.monotonic() - started < 1.0
    assert not watcher.alive()

    watcher.start()
    assert watcher.alive()
    driver.inject_xid(0, 48)
    events.xid(driver.gpus[0].uuid, 48)


def test_an_unexpected_exception_does_not_end_the_watch(monkeypatch, sim_node, watch) -> None:
    driver = sim_node(NODE)
    real = pynvml.nvmlDeviceGetSupportedEventTypes
    calls = {"n": 0}

    def flaky(handle: object) -> int:
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyError("a bug")
        return real(handle)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetSupportedEventTypes", flaky)
    watcher, events = watch(driver)
    poll(lambda: watcher.watched() == set(uuids(driver)), "the watch after the bug")
    driver.inject_xid(0, 48)
    events.xid(driver.gpus[0].uuid, 48)
    assert watcher.alive()
    assert events.watch_events() == []


def test_a_post_that_raises_does_not_end_the_watch(sim_node, watch) -> None:
    driver = sim_node(NODE)
    events = Events()
    refused = {"n": 0}

    def post(event: object) -> None:
        if refused["n"] == 0:
            refused["n"] += 1
            raise RuntimeError("queue closed")
        events.post(event)

    watcher = NvmlEventWatcher(uuids(driver), post, wait_ms=WAIT_MS)
    watcher.start()
    try:
        driver.inject_xid(0, 48)
        driver.inject_xid(0, 95)
        events.xid(driver.gpus[0].uuid, 95)
        assert watcher.alive()
    finally:
        watcher.stop()


# ------------------------------------------------------------------------------------ recovery evidence


def test_a_healthy_gpu_gives_evidence_of_recovery(nvml_node) -> None:
    driver = nvml_node(NODE)
    evidence = recovery_evidence(driver.gpus[0].uuid, ecc_baseline=0)
    assert evidence == Evidence(True, (), 0, (NO_PAGE_RETIREMENT,))


def test_a_gpu_needing_a_reset_stays_unhealthy_until_it_is_reset(nvml_node) -> None:
    driver = nvml_node(NODE)
    uuid = driver.gpus[1].uuid
    driver.set_health_signals(1, recovery_action=pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET)
    assert probe(uuid) is None  # memory info still answers: the old check called this healthy

    evidence = recovery_evidence(uuid, ecc_baseline=0)
    assert not evidence.ok
    assert evidence.reasons == ("recovery action GPU_RESET",)

    driver.reset_gpu(1)
    assert recovery_evidence(uuid, ecc_baseline=0).ok


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (2, "recovery action NODE_REBOOT"),
        (3, "recovery action DRAIN_P2P"),
        (4, "recovery action DRAIN_AND_RESET"),
        (5, "recovery action RECOVER_IMEX_DOMAIN"),
        (6, "recovery action BUS_RESET"),
        (7, "recovery action SYSTEM_REBOOT"),
        (9, "recovery action 9 (unknown)"),
    ],
)
def test_every_recovery_action_but_none_blocks(nvml_node, value: int, reason: str) -> None:
    driver = nvml_node(NODE)
    driver.set_health_signals(0, recovery_action=value)
    assert recovery_evidence(driver.gpus[0].uuid, ecc_baseline=None).reasons == (reason,)


def test_a_driver_without_the_recovery_action_field_is_not_a_blocker(nvml_node) -> None:
    driver = nvml_node(NODE)
    driver.set_health_signals(0, recovery_action=None)
    evidence = recovery_evidence(driver.gpus[0].uuid, ecc_baseline=0)
    assert evidence.ok
    assert evidence.unavailable == ("recovery action (NVML_ERROR_NOT_SUPPORTED)", NO_PAGE_RETIREMENT)


def test_an_old_driver_lacks_the_field_and_recovery_still_works(nvml_node) -> None:
    driver = nvml_node({**NODE, "driver_version": "560.35.03"})
    evidence = recovery_evidence(driver.gpus[0].uuid, ecc_baseline=0)
    assert evidence.ok
    assert evidence.unavailable == ("recovery action (NVML_ERROR_NOT_SUPPORTED)", NO_PAGE_RETIREMENT)


def test_a_pending_row_remap_blocks_until_the_reset(nvml_node) -> None:
    driver = nvml_node(NODE)
    driver.set_health_signals(2, remap_pending=True)
    assert recovery_evidence(driver.gpus[2].uuid, ecc_baseline=None).reasons == ("row remap pending",)
    driver.reset_gpu(2)
    assert recovery_evidence(driver.gpus[2].uuid, ecc_baseline=None).ok


def test_a_failed_row_remap_blocks_for_good(nvml_node) -> None:
    driver = nvml_node(NODE)
    driver.set_health_signals(2, remap_failure=True)
    driver.reset_gpu(2)
    assert recovery_evidence(driver.gpus[2].uuid, ecc_baseline=None).reasons == ("row remap failure",)


def test_pending_page_retirement_blocks_on_a_gpu_that_retires_pages(nvml_node) -> None:
    driver = nvml_node(MIXED)
    t4 = driver.gpus[1].uuid
    assert recovery_evidence(t4, ecc_baseline=0).unavailable == ("row remapping (NVML_ERROR_NOT_SUPPORTED)",)
    driver.set_health_signals(1, retired_pages_pending=True)
    evidence = recovery_evidence(t4, ecc_baseline=0)
    assert evidence.reasons == ("retired pages pending",)


def test_growing_uncorrected_ecc_blocks_and_becomes_the_next_baseline(nvml_node) -> None:
    driver = nvml_node(NODE)
    uuid = driver.gpus[0].uuid
    driver.set_health_signals(0, ecc_uncorrected=3)
    baseline = read_ecc_uncorrected(uuid)
    assert baseline == 3

    driver.set_health_signals(0, ecc_uncorrected=5)
    grew = recovery_evidence(uuid, ecc_baseline=baseline)
    assert (grew.ok, grew.reasons, grew.ecc_uncorrected) == (False, ("uncorrected ECC grew 3 -> 5",), 5)
    assert recovery_evidence(uuid, ecc_baseline=grew.ecc_uncorrected).ok  # no new error since


def test_a_mig_device_is_judged_by_its_parent_gpus_signals(nvml_node) -> None:
    driver = nvml_node(MIG_NODE)
    gpu = driver.gpus[0]
    _, ci = gpu.mig_devices()[0]
    assert recovery_evidence(gpu.uuid, ci.uuid, ecc_baseline=0).ok
    driver.set_health_signals(0, recovery_action=pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET)
    assert recovery_evidence(gpu.uuid, ci.uuid, ecc_baseline=0).reasons == ("recovery action GPU_RESET",)
    gone = recovery_evidence(gpu.uuid, "MIG-00000000-0000-0000-0000-000000000000", ecc_baseline=0)
    assert gone == Evidence(False, ("MIG device: NVML_ERROR_NOT_FOUND",))


def test_a_lost_gpu_gives_evidence_against_recovery_never_an_exception(nvml_node) -> None:
    driver = nvml_node(NODE)
    driver.lose_gpu(1)
    assert recovery_evidence(driver.gpus[1].uuid, ecc_baseline=0) == Evidence(False, ("NVML_ERROR_GPU_IS_LOST",))
    assert read_ecc_uncorrected(driver.gpus[1].uuid) is None


def test_nvml_unavailable_gives_evidence_against_recovery_never_an_exception(sim_node) -> None:
    driver = sim_node(NODE)
    driver.fail_init(Return.ERROR_DRIVER_NOT_LOADED, times=None)
    evidence = recovery_evidence(driver.gpus[0].uuid, ecc_baseline=0)
    assert not evidence.ok
    assert evidence.reasons[0].startswith("NVML init failed: NVML_ERROR_DRIVER_NOT_LOADED")
    assert read_ecc_uncorrected(driver.gpus[0].uuid) is None


def test_a_signal_that_cannot_be_read_blocks(nvml_node) -> None:
    driver = nvml_node(NODE)
    driver.inject_error("nvmlDeviceGetRemappedRows", Return.ERROR_UNKNOWN, times=1)
    evidence = recovery_evidence(driver.gpus[0].uuid, ecc_baseline=0)
    assert evidence.reasons == ("row remapping unreadable: NVML_ERROR_UNKNOWN",)


def test_a_missing_field_values_function_is_unavailable_not_a_blocker(nvml_node) -> None:
    driver = nvml_node(NODE)
    driver.inject_error("nvmlDeviceGetFieldValues", Return.ERROR_FUNCTION_NOT_FOUND, times=1)
    evidence = recovery_evidence(driver.gpus[0].uuid, ecc_baseline=0)
    assert evidence.ok
    assert evidence.unavailable == ("recovery action (NVML_ERROR_FUNCTION_NOT_FOUND)", NO_PAGE_RETIREMENT)


# ------------------------------------------------------------------- the recovery cycle, as the agent runs it


def test_the_recovery_cycle_keeps_a_reset_class_fault_until_the_evidence_clears_it(nvml_node) -> None:
    """XID 48 with ECC growth and a pending reset: two checks fail for different reasons, the third clears."""
    driver = nvml_node(NODE)
    uuid = driver.gpus[0].uuid
    policy = HealthPolicy(quiet_seconds=60.0)
    driver.set_health_signals(0, recovery_action=pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET, ecc_uncorrected=1)
    state = record(HealthState(), [uuid], policy.verdict(48), 0.0, ecc_baseline=read_ecc_uncorrected(uuid))

    def check(now: float) -> HealthState:
        assert due_for_probe(state, policy, now) == [uuid]
        fault = state.faults[uuid]
        evidence = recovery_evidence(uuid, ecc_baseline=fault.ecc_baseline)
        if evidence.ok:
            return probe_succeeded(state, uuid)
        return probe_failed(state, uuid, now, blockers=evidence.reasons, ecc_baseline=evidence.ecc_uncorrected)

    driver.set_health_signals(0, ecc_uncorrected=2)
    state = check(60.0)
    assert state.faults[uuid].blockers == ("recovery action GPU_RESET", "uncorrected ECC grew 1 -> 2")
    driver.reset_gpu(0)
    state = check(120.0)
    assert uuid not in state.faults
