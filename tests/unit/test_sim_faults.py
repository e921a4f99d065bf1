"""The simulated driver failing as real NVIDIA drivers do, seen through real pynvml.

Each test sets up a failure on the simulated node (a driver that will not load, random call failures, a GPU
off the bus, memory-health evidence, a reset) and checks what a pynvml user sees: the values and the
``NVMLError_*`` classes. The driver object is used only for what happens *to* the node, and to read the
log of destructive calls the way a drain-safety test would.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

from agent.sim.nvml import driver as sim_driver
from agent.sim.nvml.codes import Return
from agent.sim.nvml.control import SimControlClient, SimControlServer
from agent.sim.nvml.driver import DestructiveCall, NvmlFault, SimDriver
from tests.unit.test_sim_driver import blocked_in_wait, gpus, handle, mig_gpus, mig_handles, wait_until

MIB = 1 << 20
XID = pynvml.nvmlEventTypeXidCriticalError
WAIT_MS = 50  # an EventSetWait that is expected to time out
RECOVERY = pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
GI_1G_10GB = 19  # profile id of 1g.10gb on A100 (profile index NVML_GPU_INSTANCE_PROFILE_1_SLICE = 0)


@pytest.fixture
def bare_node(sim_node: Callable[[object], SimDriver]) -> Iterator[Callable[[object], SimDriver]]:
    """``bare_node(spec)``: a simulated node without ``nvmlInit``; whatever the test initialised is shut down."""
    drivers: list[SimDriver] = []

    def start(spec: object) -> SimDriver:
        drivers.append(sim_node(spec))
        return drivers[-1]

    yield start
    for driver in drivers:
        for _ in range(driver.init_count):
            pynvml.nvmlShutdown()


def pids(processes: list[Any]) -> list[int]:
    return sorted(p.pid for p in processes)


def field(device: Any, field_id: int | tuple[int, int]) -> Any:
    [entry] = pynvml.nvmlDeviceGetFieldValues(device, [field_id])
    return entry


def last_call(driver: SimDriver) -> DestructiveCall:
    return driver.destructive_calls[-1]


# ----- 1. nvmlInit fails -----------------------------------------------------------------------------


def test_init_fails_with_driver_not_loaded_until_told_otherwise(bare_node: Callable[[object], SimDriver]) -> None:
    driver = bare_node(gpus("T4"))
    driver.fail_init(Return.ERROR_DRIVER_NOT_LOADED)
    for _ in range(3):
        with pytest.raises(pynvml.NVMLError_DriverNotLoaded) as raised:
            pynvml.nvmlInit()
    assert str(raised.value) == "Driver Not Loaded"
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()  # a failed init does not count

    driver.fail_init(None)
    pynvml.nvmlInit()
    assert pynvml.nvmlDeviceGetCount() == 1


@pytest.mark.parametrize(
    ("code", "error"),
    [
        (Return.ERROR_NO_PERMISSION, pynvml.NVMLError_NoPermission),
        (Return.ERROR_LIBRARY_NOT_FOUND, pynvml.NVMLError_LibraryNotFound),
        (Return.ERROR_LIB_RM_VERSION_MISMATCH, pynvml.NVMLError_LibRmVersionMismatch),
    ],
)
def test_init_fails_a_number_of_times_then_recovers_by_itself(
    bare_node: Callable[[object], SimDriver], code: Return, error: type[pynvml.NVMLError]
) -> None:
    driver = bare_node(gpus("A100-SXM4-80GB"))
    driver.fail_init(code, times=2)
    for _ in range(2):
        with pytest.raises(error):
            pynvml.nvmlInit()
    pynvml.nvmlInit()
    assert pynvml.nvmlDeviceGetCount() == 1


# ----- 2. random faults and injected errors ------------------------------------------------------------


def _failures(calls: int, call: Callable[[], object]) -> list[int]:
    """The positions of the calls that raised NVMLError_Unknown."""
    failed = []
    for position in range(calls):
        try:
            call()
        except pynvml.NVMLError_Unknown:
            failed.append(position)
    return failed


def test_fault_rate_fails_about_that_share_of_calls_reproducibly(nvml_node: Callable[[object], SimDriver]) -> None:
    driver = nvml_node(gpus("A100-SXM4-80GB"))
    device = handle(0)

    driver.set_fault_rate(0.01, seed=7)
    first = _failures(10_000, lambda: pynvml.nvmlDeviceGetMemoryInfo(device))
    assert 50 <= len(first) <= 150  # 1 % of 10 000, ± 5 standard deviations
    assert driver.random_faults == len(first)

    driver.set_fault_rate(0.01, seed=7)
    assert _failures(10_000, lambda: pynvml.nvmlDeviceGetMemoryInfo(device)) == first
    driver.set_fault_rate(0.01, seed=8)
    assert _failures(10_000, lambda: pynvml.nvmlDeviceGetMemoryInfo(device)) != first

    driver.set_fault_rate(0)
    assert _failures(1_000, lambda: pynvml.nvmlDeviceGetMemoryInfo(device)) == []


def test_fault_rate_spares_init_and_shutdown_unless_init_is_listed(nvml_node: Callable[[object], SimDriver]) -> None:
    driver = nvml_node(gpus("T4"))
    device = handle(0)
    driver.set_fault_rate(1.0, code=Return.ERROR_GPU_IS_LOST)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetName(device)
    pynvml.nvmlInit()
    pynvml.nvmlShutdown()
    assert str(pynvml.NVMLError(pynvml.NVML_ERROR_NO_DATA)) == "No data"  # nvmlErrorString still answers

    driver.set_fault_rate(1.0, symbols=["nvmlInit", "nvmlDeviceGetName"])
    with pytest.raises(pynvml.NVMLError_Unknown):
        pynvml.nvmlInit()
    with pytest.raises(pynvml.NVMLError_Unknown):
        pynvml.nvmlDeviceGetName(device)
    assert pynvml.nvmlDeviceGetMemoryInfo(device).total == 15360 * MIB  # not listed


def test_injected_error_without_a_count_lasts_until_cleared(nvml_node: Callable[[object], SimDriver]) -> None:
    driver = nvml_node(gpus("A100-SXM4-80GB"))
    device = handle(0)
    driver.inject_error("nvmlDeviceGetMemoryInfo", Return.ERROR_NO_PERMISSION, times=None)
    for _ in range(5):
        with pytest.raises(pynvml.NVMLError_NoPermission):
            pynvml.nvmlDeviceGetMemoryInfo(device)
    driver.clear_injected_errors()
    assert pynvml.nvmlDeviceGetMemoryInfo(device).total == 81920 * MIB


def test_injected_unknown_on_event_wait_then_the_set_works_again(nvml_node: Callable[[object], SimDriver]) -> None:
    driver = nvml_node(gpus("A100-SXM4-80GB"))
    event_set = pynvml.nvmlEventSetCreate()
    pynvml.nvmlDeviceRegisterEvents(handle(0), XID, event_set)
    driver.inject_error("nvmlEventSetWait_v2", Return.ERROR_UNKNOWN)
    driver.inject_xid(0, 48)
    with pytest.raises(pynvml.NVMLError_Unknown):
        pynvml.nvmlEventSetWait(event_set, 1000)
    assert pynvml.nvmlEventSetWait(event_set, 1000).eventData == 48  # the event was not consumed
    pynvml.nvmlEventSetFree(event_set)


# ----- 3. event waits when a GPU is lost ---------------------------------------------------------------


def _xid_set(*indices: int) -> Any:
    event_set = pynvml.nvmlEventSetCreate()
    for index in indices:
        pynvml.nvmlDeviceRegisterEvents(handle(index), XID, event_set)
    return event_set


def test_wait_delivers_xid_79_then_fails_with_gpu_is_lost_until_recovery(
    nvml_node: Callable[[object], SimDriver],
) -> None:
    driver = nvml_node(gpus("A100-SXM4-80GB", 2))
    on_lost, on_other = _xid_set(1), _xid_set(0)

    driver.lose_gpu(1)
    event = pynvml.nvmlEventSetWait(on_lost, 1000)
    assert (event.eventType, event.eventData) == (XID, 79)
    started = time.monotonic()
    for _ in range(3):
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            pynvml.nvmlEventSetWait(on_lost, 10_000)
    assert time.monotonic() - started < 5  # at once, not after the timeout
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait(on_other, WAIT_MS)  # a set without the lost GPU is unaffected

    driver.recover_gpu(1)
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait(on_lost, WAIT_MS)
    driver.inject_xid(1, 48)
    assert pynvml.nvmlEventSetWait(on_lost, 1000).eventData == 48  # the registration stayed
    for event_set in (on_lost, on_other):
        pynvml.nvmlEventSetFree(event_set)


def test_blocked_wait_wakes_with_gpu_is_lost(nvml_node: Callable[[object], SimDriver]) -> None:
    driver = nvml_node(gpus("A100-SXM4-80GB"))
    event_set = pynvml.nvmlEventSetCreate()
    pynvml.nvmlDeviceRegisterEvents(handle(0), pynvml.nvmlEventTypePState, event_set)  # no Xid events
    outcome: dict[str, Any] = {}

    def waiter() -> None:
        try:
            pynvml.nvmlEventSetWait(event_set, 10_000)
        except pynvml.NVMLError as error:
            outcome["error"] = error

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    wait_until(lambda: blocked_in_wait(thread))
    driver.lose_gpu(0)
    thread.join(timeout=5)
    assert isinstance(outcome.get("error"), pynvml.NVMLError_GpuIsLost), outcome
    pynvml.nvmlEventSetFree(event_set)


def test_registering_events_on_a_lost_gpu_fails(nvml_node: Callable[[object], SimDriver]) -> None:
    driver = nvml_node(gpus("A100-SXM4-80GB"))
    device = handle(0)
    event_set = pynvml.nvmlEventSetCreate()
    driver.lose_gpu(0)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceRegisterEvents(device, XID, event_set)
    pynvml.nvmlEventSetFree(event_set)


# ----- 4. GPU reset ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["compute", "mps_server", "mps_client"])
def test_reset_is_refused_while_any_process_runs(nvml_node: Callable[[object], SimDriver], kind: str) -> None:
    driver = nvml_node(gpus("T4"))
    driver.add_process(0, 4242, 100, kind=kind)
    with pytest.raises(NvmlFault) as refused:
        driver.reset_gpu(0)
    assert refused.value.code == Return.ERROR_IN_USE
    driver.remove_process(4242)
    driver.reset_gpu(0)


def test_reset_destroys_mig_devices_and_they_come_back_with_new_uuids(
    nvml_node: Callable[[object], SimDriver],
) -> None:
    driver = nvml_node(mig_gpus("A100-SXM4-80GB", ["1g.10gb", "1g.10gb"]))
    device = handle(0)
    before = {pynvml.nvmlDeviceGetUUID(mig) for mig in mig_handles()}
    assert len(before) == 2

    driver.reset_gpu(0)
    assert mig_handles() == []
    assert pynvml.nvmlDeviceGetMigMode(device) == [1, 1]
    for _ in range(2):
        gi = pynvml.nvmlDeviceCreateGpuInstance(device, GI_1G_10GB)
        pynvml.nvmlGpuInstanceCreateComputeInstance(gi, 0)
    after = {pynvml.nvmlDeviceGetUUID(mig) for mig in mig_handles()}
    assert len(after) == 2
    assert after.isdisjoint(before)


def test_reset_restores_the_default_compute_mode(nvml_node: Callable[[object], SimDriver]) -> None:
    driver = nvml_node(gpus("T4", compute_mode="EXCLUSIVE_PROCESS"))
    driver.reset_gpu(0)
    assert pynvml.nvmlDeviceGetComputeMode(handle(0)) == pynvml.NVML_COMPUTEMODE_DEFAULT


def test_reset_clears_the_recovery_action_and_carries_out_pending_repairs(
    nvml_node: Callable[[object], SimDriver],
) -> None:
    driver = nvml_node({"gpus": [{"model": "A100-SXM4-80GB"}, {"model": "T4"}]})
    driver.set_health_signals(0, recovery_action=pynvml.NVML_GPU_RECOVERY_ACTION_GPU_RESET, remap_pending=True)
    driver.set_health_signals(0, remap_failure=True)
    driver.set_health_signals(1, retired_pages_pending=True)
    driver.reset_gpu(0)
    driver.reset_gpu(1)
    assert field(handle(0), RECOVERY).value.uiVal == pynvml.NVML_GPU_RECOVERY_ACTION_NONE
    assert pynvml.nvmlDeviceGetRemappedRows(handle(0)) == (0, 0, 0, 1)  # a failed remap stays on record
    assert pynvml.nvmlDeviceGetRetiredPagesPendingStatus(handle(1)) == pynvml.NVML_FEATURE_DISABLED


# ----- 5. MPS processes --------------------------------------------------------------------------------


def test_mps_clients_are_listed_only_by_the_mps_call(nvml_node: Callable[[object], SimDriver]) -> None:
    driver = nvml_node(gpus("A100-SXM4-80GB"))
    device = handle(0)
    driver.add_process(0, 100, 1000)
    driver.add_process(0, 200, 300, kind="mps_server")
    driver.add_process(0, 301, 2000, kind="mps_client")
    driver.add_process(0, 302, 4000, kind="mps_client")

    assert pids(pynvml.nvmlDeviceGetComputeRunningProcesses(device)) == [100, 200]
    assert pids(pynvml.nvmlDeviceGetMPSComputeRunningProcesses(device)) == [301, 302]
    assert pynvml.nvmlDeviceGetGraphicsRunningProcesses(device) == []
    assert pynvml.nvmlDeviceGetMemoryInfo(device).used == 7300 * MIB


def test_mps_client_on_a_mig_device(nvml_node: Callable[[object], SimDriver]) -> None:
    driver = nvml_node(mig_gpus("A100-SXM4-80GB", ["3g.40gb", "3g.40gb"]))
    first, second = mig_handles()
    uuid = pynvml.nvmlDeviceGetUUID(first)
    driver.add_process(0, 500, 100, mig_uuid=uuid, kind="mps_server")
    driver.add_process(0, 501, 900, mig_uuid=uuid, kind="mps_client")
    assert pids(pynvml.nvmlDeviceGetComputeRunningProcesses(first)) == [500]
    [client] = pynvml.nvmlDeviceGetMPSComputeRunningProcesses(first)
    assert (client.pid, client.usedGpuMemory) == (501, 900 * MIB)
    assert client.gpuInstanceId == pynvml.nvmlDeviceGetGpuInstanceId(first)
    assert pynvml.nvmlDeviceGetMPSComputeRunningProcesses(second) == []
    assert pynvml.nvmlDeviceGetMemoryInfo(first).used == 1000 * MIB


def test_unknown_process_kind_is_refused(nvml_node: Callable[[object], SimDriver]) -> None:
    driver = nvml_node(gpus("T4"))
    with pytest.raises(ValueError, match="graphics"):
        driver.add_process(0, 1, 1, kind="graphics")


# ----- 6. the destructive-call log ---------------------------------------------------------------------


def test_destroy_under_running_processes_is_refused_and_logged(nvml_node: Callable[[object], SimDriver]) -> None:
    driver = nvml_node(mig_gpus("A100-SXM4-80GB", ["3g.40gb"]))
    [mig] = mig_handles()
    mig_uuid, gi_id = pynvml.nvmlDeviceGetUUID(mig), pynvml.nvmlDeviceGetGpuInstanceId(mig)
    gpu_uuid = pynvml.nvmlDeviceGetUUID(handle(0))
    gi = pynvml.nvmlDeviceGetGpuInstanceById(handle(0), gi_id)
    ci = pynvml.nvmlGpuInstanceGetComputeInstanceById(gi, pynvml.nvmlDeviceGetComputeInstanceId(mig))
    driver.add_process(0, 700, 100, mig_uuid=mig_uuid)
    driver.add_process(0, 701, 100, mig_uuid=mig_uuid, kind="mps_client")
    assert driver.destructive_calls == []

    with pytest.raises(pynvml.NVMLError_InUse):
        pynvml.nvmlComputeInstanceDestroy(ci)
    call = last_call(driver)
    assert (call.symbol, call.gpu_index, call.target) == ("nvmlComputeInstanceDestroy", 0, mig_uuid)
    assert (call.processes, call.result, call.gpu_instance_id) == (2, Return.ERROR_IN_USE, gi_id)
    assert call.at <= time.monotonic()

    driver.remove_process(700)
    driver.remove_process(701)
    pynvml.nvmlComputeInstanceDestroy(ci)
    pynvml.nvmlGpuInstanceDestroy(gi)
    destroys = driver.destructive_calls[-2:]
    assert [(c.symbol, c.target, c.processes, c.result) for c in destroys] == [
        ("nvmlComputeInstanceDestroy", mig_uuid, 0, Return.SUCCESS),
        ("nvmlGpuInstanceDestroy", gpu_uuid, 0, Return.SUCCESS),
    ]


def test_mode_changes_are_logged_only_when_they_change_something(nvml_node: Callable[[object], SimDriver]) -> None:
    driver = nvml_node(gpus("A100-SXM4-80GB"))
    device = handle(0)
    uuid = pynvml.nvmlDeviceGetUUID(device)
    pynvml.nvmlDeviceSetMigMode(device, pynvml.NVML_DEVICE_MIG_DISABLE)
    pynvml.nvmlDeviceSetComputeMode(device, pynvml.NVML_COMPUTEMODE_DEFAULT)
    assert driver.destructive_calls == []

    driver.add_process(0, 800, 100)
    pynvml.nvmlDeviceSetComputeMode(device, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
    pynvml.nvmlDeviceSetMigMode(device, pynvml.NVML_DEVICE_MIG_ENABLE)  # stays pending: IN_USE
    pynvml.nvmlDeviceSetMigMode(device, pynvml.NVML_DEVICE_MIG_ENABLE)  # changes nothing more
    driver.remove_process(800)
    driver.reset_gpu(0)
    assert [(c.symbol, c.target, c.processes, c.result) for c in driver.destructive_calls] == [
        ("nvmlDeviceSetComputeMode", uuid, 1, Return.SUCCESS),
        ("nvmlDeviceSetMigMode", uuid, 1, Return.ERROR_IN_USE),
        ("reset_gpu", uuid, 0, Return.SUCCESS),
    ]
    driver.clear_destructive_calls()
    assert driver.destructive_calls == []


def test_the_log_keeps_only_the_newest_calls(
    nvml_node: Callable[[object], SimDriver], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sim_driver, "DESTRUCTIVE_LOG_LIMIT", 3)
    driver = nvml_node(gpus("T4"))
    modes = [pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS, pynvml.NVML_COMPUTEMODE_PROHIBITED] * 3
    for mode in modes:
        pynvml.nvmlDeviceSetComputeMode(handle(0), mode)
    calls = driver.destructive_calls
    assert len(calls) == 3
    assert [c.at for c in calls] == sorted(c.at for c in calls)


# ----- 7. memory health evidence -----------------------------------------------------------------------


def test_recovery_action_reads_back_through_field_values(nvml_node: Callable[[object], SimDriver]) -> None:
    driver = nvml_node(gpus("A100-SXM4-80GB"))
    device = handle(0)
    entry = field(device, RECOVERY)
    assert (entry.nvmlReturn, entry.valueType) == (pynvml.NVML_SUCCESS, pynvml.NVML_VALUE_TYPE_UNSIGNED_INT)
    assert entry.value.uiVal == pynvml.NVML_GPU_RECOVERY_ACTION_NONE
    assert entry.timestamp > 0

    driver.set_health_signals(0, recovery_action=pynvml.NVML_GPU_RECOVERY_ACTION_DRAIN_AND_RESET)
    recovery, unknown = pynvml.nvmlDeviceGetFieldValues(device, [(RECOVERY, 0), 9999])
    assert (recovery.nvmlReturn, recovery.value.uiVal) == (pynvml.NVML_SUCCESS, 4)
    assert unknown.nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED

    driver.set_health_signals(0, recovery_action=None)
    assert field(device, RECOVERY).nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED


def test_recovery_action_is_unknown_to_drivers_before_r565(nvml_node: Callable[[object], SimDriver]) -> None:
    nvml_node({"driver_version": "560.35.03", **gpus("A100-SXM4-80GB")})
    assert field(handle(0), RECOVERY).nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED


def test_remapped_rows_on_ampere_not_on_turing_nor_with_mig_instances(
    nvml_node: Callable[[object], SimDriver],
) -> None:
    driver = nvml_node(
        {
            "gpus": [
                {"model": "A100-SXM4-80GB"},
                {"model": "T4"},
                {"model": "A100-SXM4-80GB", "mig": {"instances": ["3g.40gb"]}},
                {"model": "A100-SXM4-80GB", "mig": {"instances": []}},
            ]
        }
    )
    driver.set_health_signals(0, remap_pending=True, remapped_uncorrectable=2)
    assert pynvml.nvmlDeviceGetRemappedRows(handle(0)) == (0, 2, 1, 0)
    pending, failure = pynvml.nvmlDeviceGetFieldValues(
        handle(0), [pynvml.NVML_FI_DEV_REMAPPED_PENDING, pynvml.NVML_FI_DEV_REMAPPED_FAILURE]
    )
    assert (pending.nvmlReturn, pending.value.uiVal, failure.value.uiVal) == (pynvml.NVML_SUCCESS, 1, 0)

    for index in (1, 2):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetRemappedRows(handle(index))
        assert field(handle(index), pynvml.NVML_FI_DEV_REMAPPED_PENDING).nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED
    assert pynvml.nvmlDeviceGetRemappedRows(handle(3)) == (0, 0, 0, 0)  # MIG on, but no instances yet
    with pytest.raises(ValueError, match="row remapping"):
        driver.set_health_signals(1, remap_pending=True)


def test_retired_pages_pending_before_ampere_only(nvml_node: Callable[[object], SimDriver]) -> None:
    driver = nvml_node({"gpus": [{"model": "T4"}, {"model": "A100-SXM4-80GB"}]})
    assert pynvml.nvmlDeviceGetRetiredPagesPendingStatus(handle(0)) == pynvml.NVML_FEATURE_DISABLED
    driver.set_health_signals(0, retired_pages_pending=True)
    assert pynvml.nvmlDeviceGetRetiredPagesPendingStatus(handle(0)) == pynvml.NVML_FEATURE_ENABLED
    assert field(handle(0), pynvml.NVML_FI_DEV_RETIRED_PENDING).value.uiVal == 1
    cause = pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
    assert pynvml.nvmlDeviceGetRetiredPages(handle(0), cause) == []

    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetRetiredPagesPendingStatus(handle(1))
    with pytest.raises(ValueError, match="remaps rows"):
        driver.set_health_signals(1, retired_pages_pending=True)


def test_uncorrected_ecc_errors_volatile_and_aggregate(nvml_node: Callable[[object], SimDriver]) -> None:
    driver = nvml_node(gpus("H100-SXM5-80GB"))
    device = handle(0)
    uncorrected = pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED

    def counts() -> tuple[int, int]:
        return (
            pynvml.nvmlDeviceGetTotalEccErrors(device, uncorrected, pynvml.NVML_VOLATILE_ECC),
            pynvml.nvmlDeviceGetTotalEccErrors(device, uncorrected, pynvml.NVML_AGGREGATE_ECC),
        )

    assert counts() == (0, 0)
    driver.set_health_signals(0, ecc_uncorrected=3)
    assert counts() == (3, 3)
    driver.set_health_signals(0, ecc_uncorrected=0)  # as after a driver reload
    assert counts() == (0, 3)
    driver.set_health_signals(0, ecc_uncorrected=2)
    assert counts() == (2, 5)
    volatile, aggregate = pynvml.nvmlDeviceGetFieldValues(
        device, [pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL, pynvml.NVML_FI_DEV_ECC_DBE_AGG_TOTAL]
    )
    assert volatile.valueType == pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
    assert (volatile.value.ullVal, aggregate.value.ullVal) == (2, 5)
    corrected = pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
    assert pynvml.nvmlDeviceGetTotalEccErrors(device, corrected, pynvml.NVML_VOLATILE_ECC) == 0


def test_health_reads_on_a_lost_gpu_fail_with_gpu_is_lost(nvml_node: Callable[[object], SimDriver]) -> None:
    driver = nvml_node({"gpus": [{"model": "A100-SXM4-80GB"}, {"model": "T4"}]})
    ampere, turing = handle(0), handle(1)
    driver.lose_gpu(0)
    driver.lose_gpu(1)
    driver.set_health_signals(0, recovery_action=pynvml.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT)  # allowed while lost
    reads: list[Callable[[], object]] = [
        lambda: pynvml.nvmlDeviceGetFieldValues(ampere, [RECOVERY]),
        lambda: pynvml.nvmlDeviceGetRemappedRows(ampere),
        lambda: pynvml.nvmlDeviceGetRetiredPagesPendingStatus(turing),
        lambda: pynvml.nvmlDeviceGetTotalEccErrors(ampere, 1, 0),
    ]
    for read in reads:
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            read()
    driver.recover_gpu(0)
    assert field(ampere, RECOVERY).value.uiVal == pynvml.NVML_GPU_RECOVERY_ACTION_NODE_REBOOT


# ----- 8. a GPU instance profile the bindings do not know ---------------------------------------------


def test_hidden_gi_profile_is_invalid_but_its_instances_live_on(nvml_node: Callable[[object], SimDriver]) -> None:
    driver = nvml_node(mig_gpus("A100-SXM4-80GB", ["1g.10gb", "3g.40gb"]))
    device = handle(0)
    driver.hide_gi_profile(pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
    for version in (1, 2):
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlDeviceGetGpuInstanceProfileInfo(device, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE, version)
    assert pynvml.nvmlDeviceGetGpuInstanceProfileInfo(device, pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE).id == 9

    profile_ids = set()
    for mig in mig_handles():
        gi = pynvml.nvmlDeviceGetGpuInstanceById(device, pynvml.nvmlDeviceGetGpuInstanceId(mig))
        profile_ids.add(pynvml.nvmlGpuInstanceGetInfo(gi).profileId)
    assert profile_ids == {GI_1G_10GB, 9}


# ----- 9. the control socket ---------------------------------------------------------------------------


@pytest.fixture
def control(tmp_path: Path) -> Iterator[Callable[[SimDriver], SimControlClient]]:
    servers: list[SimControlServer] = []

    def serve(driver: SimDriver) -> SimControlClient:
        server = SimControlServer(driver, tmp_path / "ctl.sock")
        server.start()
        servers.append(server)
        return SimControlClient(tmp_path / "ctl.sock")

    yield serve
    for server in servers:
        server.stop()


def test_control_socket_drives_the_new_failures(
    nvml_node: Callable[[object], SimDriver], control: Callable[[SimDriver], SimControlClient]
) -> None:
    driver = nvml_node(mig_gpus("A100-SXM4-80GB", ["3g.40gb"]))
    client = control(driver)
    device = handle(0)

    client.call("fail_init", code="ERROR_DRIVER_NOT_LOADED", times=1)
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        pynvml.nvmlInit()
    client.call("fail_init", code=None)

    client.call("set_fault_rate", rate=1, seed=3, code="ERROR_UNKNOWN", symbols=["nvmlDeviceGetName"])
    with pytest.raises(pynvml.NVMLError_Unknown):
        pynvml.nvmlDeviceGetName(device)
    client.call("set_fault_rate", rate=0.0)
    client.call("inject_error", symbol="nvmlDeviceGetName", code="ERROR_UNKNOWN", times=None)
    client.call("clear_injected_errors")
    assert pynvml.nvmlDeviceGetName(device) == "NVIDIA A100-SXM4-80GB"

    [mig] = mig_handles()
    client.call("add_process", gpu=0, pid=900, used_mib=64, mig_uuid=pynvml.nvmlDeviceGetUUID(mig), kind="mps_client")
    assert pids(pynvml.nvmlDeviceGetMPSComputeRunningProcesses(mig)) == [900]
    client.call("set_health_signals", gpu=0, recovery_action=2, ecc_uncorrected=1)
    assert field(device, RECOVERY).value.uiVal == 2
    client.call("set_health_signals", gpu=0, recovery_action=None)
    assert field(device, RECOVERY).nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED

    with pytest.raises(RuntimeError, match="IN_USE"):
        client.call("reset_gpu", gpu=0)
    [logged] = client.call("destructive_calls")
    assert logged["symbol"] == "reset_gpu"
    assert (logged["gpu_index"], logged["processes"], logged["result"]) == (0, 1, "ERROR_IN_USE")


@pytest.mark.parametrize(
    "request_",
    [
        {"op": "set_fault_rate", "rate": "0.5"},
        {"op": "set_fault_rate", "rate": True},
        {"op": "set_fault_rate", "rate": 0.5, "symbols": [1]},
        {"op": "set_fault_rate", "rate": 2.0},
        {"op": "fail_init", "code": "ERROR_NOPE"},
        {"op": "fail_init", "code": "SUCCESS"},
        {"op": "add_process", "gpu": 0, "pid": 1, "used_mib": 1, "kind": "graphics"},
        {"op": "set_health_signals", "gpu": 0, "remap_pending": 1},
        {"op": "destructive_calls", "gpu": 0},
    ],
)
def test_control_socket_refuses_bad_arguments(
    nvml_node: Callable[[object], SimDriver],
    control: Callable[[SimDriver], SimControlClient],
    request_: dict[str, Any],
) -> None:
    driver = nvml_node(gpus("A100-SXM4-80GB"))
    client = control(driver)
    op = request_.pop("op")
    with pytest.raises(RuntimeError, match="refused"):
        client.call(op, **request_)
    assert pynvml.nvmlDeviceGetCount() == 1  # the node is unharmed
    assert driver.random_faults == 0


def test_control_socket_refuses_an_endless_request_without_buffering_it(
    nvml_node: Callable[[object], SimDriver], control: Callable[[SimDriver], SimControlClient], tmp_path: Path
) -> None:
    import json
    import socket

    from agent.sim.nvml.control import MAX_REQUEST_BYTES

    driver = nvml_node(gpus("Tesla T4"))
    client = control(driver)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.settimeout(5)
        connection.connect(str(tmp_path / "ctl.sock"))
        connection.sendall(b"x" * (MAX_REQUEST_BYTES * 4))  # no newline: a naive reader would wait for more
        reply = json.loads(connection.makefile("rb").readline())
    assert reply == {"ok": False, "error": f"a request is at most {MAX_REQUEST_BYTES} bytes"}
    client.call("inject_xid", gpu=0, xid=48)  # the server still serves


def test_the_control_socket_sleeps_until_asked_and_stops_at_once(
    nvml_node: Callable[[object], SimDriver], tmp_path: Path
) -> None:
    """An idle simulated node wakes no thread of its control socket (it waits in ``accept``; nothing polls,
    which the idle agent's CPU figure counts), and ``stop`` ends that wait at once."""
    server = SimControlServer(nvml_node(gpus("Tesla T4")), tmp_path / "ctl.sock")
    server.start()
    try:
        SimControlClient(tmp_path / "ctl.sock").call("inject_xid", gpu=0, xid=48)
        status = Path(f"/proc/self/task/{server._thread.native_id}/status")
        switches = status.read_text().split("voluntary_ctxt_switches:")[1].split()[0]
        threading.Event().wait(0.3)  # a window to count wake-ups in (a poll every 50 ms would show 6)
        assert status.read_text().split("voluntary_ctxt_switches:")[1].split()[0] == switches
    finally:
        server.stop()
    assert not server._thread.is_alive() and not (tmp_path / "ctl.sock").exists()


def test_the_control_socket_keeps_serving_after_an_accept_fails(
    nvml_node: Callable[[object], SimDriver], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Out of file descriptors, ``accept`` fails (EMFILE): the socket says so and tries again, and serves the
    waiting client once descriptors are free; only ``stop`` ends it."""
    import json
    import os
    import resource
    import socket

    server = SimControlServer(nvml_node(gpus("Tesla T4")), tmp_path / "ctl.sock")
    server.start()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        client.settimeout(5)
        lowest_free = os.dup(0)
        os.close(lowest_free)
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))  # no new descriptor from here on
        try:
            client.connect(str(tmp_path / "ctl.sock"))  # queued; the server has no descriptor to accept it with
            wait_until(lambda: "cannot accept" in caplog.text)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        client.sendall(b'{"op": "inject_xid", "gpu": 0, "xid": 48}\n')
        assert json.loads(client.makefile("rb").readline())["ok"] is True
    finally:
        client.close()
        server.stop()
    assert not server._thread.is_alive()


def test_inject_xid_answers_when_the_driver_queued_it(
    nvml_node: Callable[[object], SimDriver], control: Callable[[SimDriver], SimControlClient]
) -> None:
    """The answer is the ``time.monotonic()`` at which the XID entered the driver (a clock all processes share),
    which benchmarks time from."""
    client = control(nvml_node(gpus("Tesla T4")))
    before = time.monotonic()
    queued = client.call("inject_xid", gpu=0, xid=48)
    assert before <= queued <= time.monotonic()


def test_control_socket_lists_the_mig_devices(
    nvml_node: Callable[[object], SimDriver], control: Callable[[SimDriver], SimControlClient]
) -> None:
    driver = nvml_node({"gpus": [{"model": "A100-SXM4-80GB", "mig": {"instances": ["3g.40gb", "1g.10gb"]}}]})
    listed = control(driver).call("mig_devices")
    expected = [
        {"gpu": 0, "gi": gi.id, "ci": ci.id, "uuid": ci.uuid, "profile": gi.profile.name,
         "start": gi.placement[0], "size": gi.placement[1]}
        for gi, ci in driver.gpus[0].mig_devices()
    ]  # fmt: skip
    assert listed == expected and sorted(m["profile"] for m in listed) == ["1g.10gb", "3g.40gb"]


def test_a_stalled_call_blocks_in_the_driver_then_runs(nvml_node: Callable[[object], SimDriver]) -> None:
    """``stall``: the next call of a symbol blocks (a MIG mode change takes seconds on real hardware), then runs."""
    driver = nvml_node(gpus("A100-SXM4-80GB"))
    device = handle(0)
    driver.stall("nvmlDeviceGetMemoryInfo", 1.5)
    done = threading.Event()
    totals: list[int] = []

    def call() -> None:
        totals.append(pynvml.nvmlDeviceGetMemoryInfo(device).total)
        done.set()

    caller = threading.Thread(target=call)
    caller.start()
    assert not done.wait(0.3)  # held in the driver
    assert pynvml.nvmlDeviceGetMemoryInfo(device).total == 81920 * MIB  # only the next call stalls
    assert done.wait(10) and totals == [81920 * MIB]  # ... and then it runs
    caller.join(10)
    with pytest.raises(ValueError, match="at most 3600 seconds"):
        driver.stall("nvmlDeviceGetMemoryInfo", 10**9)
