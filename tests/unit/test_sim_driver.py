"""The simulated driver seen through real pynvml: MIG mode, events, lost GPUs, processes, faults, init.

Each test installs a simulated node beneath pynvml and acts as a user of real hardware would: it calls
pynvml and checks the values and ``NVMLError_*`` classes that come back. The driver object is used only
for what happens *to* a node (a process starts, an Xid fires, a GPU falls off the bus, a reset).
"""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import suppress
from typing import Any

import pynvml
import pytest

from agent.sim.nvml.codes import Return
from agent.sim.nvml.driver import SimDriver

MIB = 1 << 20
INVALID_ID = 0xFFFFFFFF
XID = pynvml.nvmlEventTypeXidCriticalError
WAIT_MS = 50  # an EventSetWait that is expected to time out
GPU_UUID = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
MIG_UUID = re.compile(r"^MIG-[0-9a-f]{8}-[0-9a-f]{4}-5[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}$")


@pytest.fixture
def node(sim_node: Callable[[object], SimDriver]) -> Iterator[Callable[..., SimDriver]]:
    """``node(spec)``: install a simulated node and ``nvmlInit`` it (unless ``init=False``); shut down after."""
    started = 0

    def start(spec: object, *, init: bool = True) -> SimDriver:
        nonlocal started
        driver = sim_node(spec)
        if init:
            pynvml.nvmlInit()
            started += 1
        return driver

    yield start
    for _ in range(started):
        with suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def gpus(model: str, count: int = 1, **extra: Any) -> dict[str, Any]:
    return {"gpus": [{"model": model, "count": count, **extra}]}


def mig_gpus(model: str, instances: list[str], count: int = 1) -> dict[str, Any]:
    return gpus(model, count, mig={"instances": instances})


def handle(index: int) -> Any:
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def mig_handles(index: int = 0) -> list[Any]:
    device = handle(index)
    found = []
    for position in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(device)):
        try:
            found.append(pynvml.nvmlDeviceGetMigDeviceHandleByIndex(device, position))
        except pynvml.NVMLError_NotFound:
            break
    return found


def xid_event_set(*indices: int) -> Any:
    event_set = pynvml.nvmlEventSetCreate()
    for index in indices:
        pynvml.nvmlDeviceRegisterEvents(handle(index), XID, event_set)
    return event_set


def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll ``predicate`` until it holds, failing the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached before the deadline")
        time.sleep(0.001)


def blocked_in_wait(thread: threading.Thread) -> bool:
    """True while ``thread`` sits in a threading wait (it has registered as a waiter of a condition)."""
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code.co_name == "wait" and frame.f_code.co_filename.endswith("threading.py"):
            return True
        frame = frame.f_back
    return False


# ----- identity ------------------------------------------------------------------------------------


def _uuids() -> list[str]:
    return [pynvml.nvmlDeviceGetUUID(handle(i)) for i in range(pynvml.nvmlDeviceGetCount())]


def test_gpu_uuids_are_deterministic_across_two_builds_of_the_same_spec(node: Callable[..., SimDriver]) -> None:
    spec = {"name": "node-a", **gpus("A100-SXM4-80GB", 4)}
    node(spec)
    first = _uuids()
    pynvml.nvmlShutdown()
    node(spec)
    second = _uuids()
    assert first == second
    assert len(set(first)) == 4
    assert all(GPU_UUID.match(uuid) for uuid in first)


def test_gpu_uuids_differ_between_nodes(node: Callable[..., SimDriver]) -> None:
    node({"name": "node-a", **gpus("T4", 2)})
    first = _uuids()
    pynvml.nvmlShutdown()
    node({"name": "node-b", **gpus("T4", 2)})
    assert set(first).isdisjoint(_uuids())


def test_handle_by_uuid_and_by_bus_id_find_the_same_gpu(node: Callable[..., SimDriver]) -> None:
    node("dgx-a100")
    device = handle(3)
    uuid = pynvml.nvmlDeviceGetUUID(device)
    bus_id = pynvml.nvmlDeviceGetPciInfo(device).busId
    assert pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByUUID(uuid)) == 3
    assert pynvml.nvmlDeviceGetIndex(pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)) == 3
    assert pynvml.nvmlDeviceGetName(device) == "NVIDIA A100-SXM4-80GB"


def test_mig_uuids_have_the_mig_form(node: Callable[..., SimDriver]) -> None:
    node(mig_gpus("A100-SXM4-80GB", ["1g.10gb"] * 3))
    uuids = [pynvml.nvmlDeviceGetUUID(h) for h in mig_handles()]
    assert len(uuids) == 3
    assert all(MIG_UUID.match(uuid) for uuid in uuids), uuids


# ----- 6. MIG mode ---------------------------------------------------------------------------------


def test_mig_mode_on_a_t4_is_not_supported(node: Callable[..., SimDriver]) -> None:
    node(gpus("T4"))
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetMigMode(handle(0))
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceSetMigMode(handle(0), pynvml.NVML_DEVICE_MIG_ENABLE)
    assert pynvml.nvmlDeviceGetMaxMigDeviceCount(handle(0)) == 0


def test_set_mig_mode_on_an_idle_gpu_applies_at_once(node: Callable[..., SimDriver]) -> None:
    node(gpus("A100-SXM4-80GB"))
    device = handle(0)
    assert pynvml.nvmlDeviceGetMigMode(device) == [0, 0]
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceCreateGpuInstance(device, 9)

    assert pynvml.nvmlDeviceSetMigMode(device, pynvml.NVML_DEVICE_MIG_ENABLE) == pynvml.NVML_SUCCESS
    assert pynvml.nvmlDeviceGetMigMode(device) == [1, 1]
    assert pynvml.nvmlDeviceGetMaxMigDeviceCount(device) == 7
    gi = pynvml.nvmlDeviceCreateGpuInstance(device, 9)
    assert pynvml.nvmlGpuInstanceGetInfo(gi).profileId == 9


def test_set_mig_mode_with_a_process_running_stays_pending_until_reset(node: Callable[..., SimDriver]) -> None:
    driver = node(gpus("A100-SXM4-80GB"))
    device = handle(0)
    driver.add_process(0, 4242, 1000)

    status = pynvml.nvmlDeviceSetMigMode(device, pynvml.NVML_DEVICE_MIG_ENABLE)
    assert status == pynvml.NVML_ERROR_IN_USE == 19
    current, pending = pynvml.nvmlDeviceGetMigMode(device)
    assert (current, pending) == (0, 1)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceCreateGpuInstance(device, 9)

    driver.remove_process(4242)
    driver.reset_gpu(0)
    assert pynvml.nvmlDeviceGetMigMode(device) == [1, 1]
    pynvml.nvmlDeviceCreateGpuInstance(device, 9)


def test_set_mig_mode_that_needs_a_reset_reports_reset_required(node: Callable[..., SimDriver]) -> None:
    driver = node(gpus("A100-SXM4-80GB", mig_needs_reset=True))
    device = handle(0)
    status = pynvml.nvmlDeviceSetMigMode(device, pynvml.NVML_DEVICE_MIG_ENABLE)
    assert status == pynvml.NVML_ERROR_RESET_REQUIRED == 16
    assert pynvml.nvmlDeviceGetMigMode(device) == [0, 1]
    driver.reset_gpu(0)
    assert pynvml.nvmlDeviceGetMigMode(device) == [1, 1]


def test_disabling_mig_destroys_the_instances_and_their_handles(node: Callable[..., SimDriver]) -> None:
    node(mig_gpus("A100-SXM4-80GB", ["3g.40gb", "3g.40gb"]))
    device = handle(0)
    gi = pynvml.nvmlDeviceGetGpuInstanceById(device, 2)
    assert len(mig_handles()) == 2

    assert pynvml.nvmlDeviceSetMigMode(device, pynvml.NVML_DEVICE_MIG_DISABLE) == pynvml.NVML_SUCCESS
    assert pynvml.nvmlDeviceGetMigMode(device) == [0, 0]
    assert pynvml.nvmlDeviceGetMaxMigDeviceCount(device) == 0
    assert pynvml.nvmlDeviceGetComputeMode(device) == pynvml.NVML_COMPUTEMODE_DEFAULT

    assert pynvml.nvmlDeviceSetMigMode(device, pynvml.NVML_DEVICE_MIG_ENABLE) == pynvml.NVML_SUCCESS
    assert mig_handles() == []
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlGpuInstanceGetInfo(gi)
    assert pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(device, 9) == 2


def test_gpu_reset_loses_the_instances_but_keeps_mig_mode(node: Callable[..., SimDriver]) -> None:
    driver = node(mig_gpus("A100-SXM4-80GB", ["3g.40gb", "1g.10gb"]))
    device = handle(0)
    assert len(mig_handles()) == 2
    driver.reset_gpu(0)
    assert pynvml.nvmlDeviceGetMigMode(device) == [1, 1]
    assert mig_handles() == []
    assert pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(device, 0) == 1  # the 7g fits again


def test_utilization_is_not_supported_on_a_mig_enabled_gpu(node: Callable[..., SimDriver]) -> None:
    driver = node({"gpus": [{"model": "A100-SXM4-80GB"}, {"model": "A100-SXM4-80GB", "mig": {"instances": []}}]})
    driver.set_utilization(0, 55, 20)
    rates = pynvml.nvmlDeviceGetUtilizationRates(handle(0))
    assert (rates.gpu, rates.memory) == (55, 20)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetUtilizationRates(handle(1))


def test_compute_mode_needs_a_mig_handle_when_mig_is_enabled(node: Callable[..., SimDriver]) -> None:
    node(mig_gpus("A100-SXM4-80GB", ["3g.40gb", "2g.20gb"]))
    device = handle(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetComputeMode(device)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceSetComputeMode(device, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)

    first, second = mig_handles()
    pynvml.nvmlDeviceSetComputeMode(first, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
    assert pynvml.nvmlDeviceGetComputeMode(first) == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    assert pynvml.nvmlDeviceGetComputeMode(second) == pynvml.NVML_COMPUTEMODE_DEFAULT


def test_compute_mode_on_a_gpu_without_mig(node: Callable[..., SimDriver]) -> None:
    node(gpus("T4", compute_mode="PROHIBITED"))
    device = handle(0)
    assert pynvml.nvmlDeviceGetComputeMode(device) == pynvml.NVML_COMPUTEMODE_PROHIBITED
    pynvml.nvmlDeviceSetComputeMode(device, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)
    assert pynvml.nvmlDeviceGetComputeMode(device) == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS


# ----- 7. events -----------------------------------------------------------------------------------


def test_event_wait_times_out_when_nothing_happens(node: Callable[..., SimDriver]) -> None:
    node(gpus("A100-SXM4-80GB"))
    assert pynvml.nvmlDeviceGetSupportedEventTypes(handle(0)) & XID
    event_set = xid_event_set(0)
    started = time.monotonic()
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait_v2(event_set, WAIT_MS)
    assert time.monotonic() - started >= WAIT_MS / 1000 * 0.9
    pynvml.nvmlEventSetFree(event_set)


def test_injected_xid_is_delivered_with_its_number_and_no_instance(node: Callable[..., SimDriver]) -> None:
    driver = node(gpus("A100-SXM4-80GB"))
    event_set = xid_event_set(0)
    driver.inject_xid(0, 48)
    event = pynvml.nvmlEventSetWait_v2(event_set, 1000)
    assert event.eventType == XID
    assert event.eventData == 48
    assert event.gpuInstanceId == INVALID_ID
    assert event.computeInstanceId == INVALID_ID
    assert pynvml.nvmlDeviceGetUUID(event.device) == pynvml.nvmlDeviceGetUUID(handle(0))
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait_v2(event_set, WAIT_MS)  # delivered once
    pynvml.nvmlEventSetFree(event_set)


def test_xid_on_a_mig_device_carries_its_instance_ids(node: Callable[..., SimDriver]) -> None:
    driver = node(mig_gpus("A100-SXM4-80GB", ["3g.40gb", "2g.20gb"]))
    event_set = xid_event_set(0)
    _, mig = mig_handles()
    driver.inject_xid(0, 94, mig_uuid=pynvml.nvmlDeviceGetUUID(mig))
    event = pynvml.nvmlEventSetWait_v2(event_set, 1000)
    assert event.eventData == 94
    assert event.gpuInstanceId == pynvml.nvmlDeviceGetGpuInstanceId(mig)
    assert event.computeInstanceId == pynvml.nvmlDeviceGetComputeInstanceId(mig)
    assert event.gpuInstanceId != INVALID_ID
    pynvml.nvmlEventSetFree(event_set)


def test_event_set_only_gets_events_of_the_gpus_it_registered(node: Callable[..., SimDriver]) -> None:
    driver = node(gpus("A100-SXM4-80GB", 2))
    event_set = xid_event_set(0)
    driver.inject_xid(1, 48)
    with pytest.raises(pynvml.NVMLError_Timeout):
        pynvml.nvmlEventSetWait_v2(event_set, WAIT_MS)
    driver.inject_xid(0, 63)
    event = pynvml.nvmlEventSetWait_v2(event_set, 1000)
    assert event.eventData == 63
    assert pynvml.nvmlDeviceGetIndex(event.device) == 0
    pynvml.nvmlEventSetFree(event_set)


def test_unsupported_event_type_is_refused_and_the_set_stays_usable(node: Callable[..., SimDriver]) -> None:
    driver = node(gpus("A100-SXM4-80GB"))
    event_set = pynvml.nvmlEventSetCreate()
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceRegisterEvents(handle(0), pynvml.nvmlEventTypePowerSourceChange, event_set)
    pynvml.nvmlDeviceRegisterEvents(handle(0), XID, event_set)
    driver.inject_xid(0, 31)
    assert pynvml.nvmlEventSetWait_v2(event_set, 1000).eventData == 31
    pynvml.nvmlEventSetFree(event_set)


def test_events_are_registered_on_the_parent_gpu_not_a_mig_device(node: Callable[..., SimDriver]) -> None:
    driver = node(mig_gpus("A100-SXM4-80GB", ["3g.40gb"]))
    [mig] = mig_handles()
    event_set = pynvml.nvmlEventSetCreate()
    with pytest.raises(pynvml.NVMLError):
        pynvml.nvmlDeviceRegisterEvents(mig, XID, event_set)
    pynvml.nvmlDeviceRegisterEvents(handle(0), XID, event_set)
    driver.inject_xid(0, 43, mig_uuid=pynvml.nvmlDeviceGetUUID(mig))
    assert pynvml.nvmlEventSetWait_v2(event_set, 1000).gpuInstanceId == pynvml.nvmlDeviceGetGpuInstanceId(mig)
    pynvml.nvmlEventSetFree(event_set)


def test_blocked_waiter_in_another_thread_wakes_on_an_injected_xid(node: Callable[..., SimDriver]) -> None:
    driver = node(gpus("A100-SXM4-80GB"))
    event_set = xid_event_set(0)
    outcome: dict[str, Any] = {}

    def waiter() -> None:
        started = time.monotonic()
        try:
            outcome["xid"] = pynvml.nvmlEventSetWait_v2(event_set, 10_000).eventData
        except pynvml.NVMLError as error:
            outcome["error"] = error
        outcome["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    wait_until(lambda: blocked_in_wait(thread))
    driver.inject_xid(0, 48)
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert outcome.get("xid") == 48, outcome
    assert outcome["seconds"] < 5  # woken by the event, not by the 10 s timeout
    pynvml.nvmlEventSetFree(event_set)


# ----- 8. a GPU falls off the bus ------------------------------------------------------------------


def test_lost_gpu_fails_with_gpu_is_lost_and_recovers(node: Callable[..., SimDriver]) -> None:
    driver = node(gpus("A100-SXM4-80GB", 2))
    old = handle(1)
    uuid = pynvml.nvmlDeviceGetUUID(old)
    event_set = xid_event_set(1)

    driver.lose_gpu(1)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetHandleByIndex(1)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetUUID(old)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetMemoryInfo(old)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetHandleByUUID(uuid)
    assert pynvml.nvmlDeviceGetMemoryInfo(handle(0)).total == 81920 * MIB  # the other GPU keeps working

    event = pynvml.nvmlEventSetWait_v2(event_set, 1000)
    assert (event.eventType, event.eventData) == (XID, 79)

    driver.recover_gpu(1)
    assert pynvml.nvmlDeviceGetUUID(handle(1)) == uuid
    assert pynvml.nvmlDeviceGetUUID(old) == uuid
    pynvml.nvmlEventSetFree(event_set)


def test_lost_mig_gpu_fails_its_mig_handles(node: Callable[..., SimDriver]) -> None:
    driver = node(mig_gpus("H100-SXM5-80GB", ["3g.40gb"]))
    [mig] = mig_handles()
    driver.lose_gpu(0)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetMemoryInfo(mig)


# ----- 9. processes --------------------------------------------------------------------------------


def test_running_processes_and_used_memory(node: Callable[..., SimDriver]) -> None:
    driver = node(gpus("A100-SXM4-80GB", 2))
    driver.add_process(0, 1002, 3072)
    driver.add_process(0, 1001, 1024)
    procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle(0))
    assert sorted((p.pid, p.usedGpuMemory) for p in procs) == [(1001, 1024 * MIB), (1002, 3072 * MIB)]
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle(0))
    assert memory.used == 4096 * MIB
    assert memory.total == 81920 * MIB
    assert memory.free == memory.total - memory.used
    assert pynvml.nvmlDeviceGetComputeRunningProcesses(handle(1)) == []
    assert pynvml.nvmlDeviceGetMemoryInfo(handle(1)).used == 0

    driver.remove_process(1002)
    assert [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle(0))] == [1001]
    assert pynvml.nvmlDeviceGetMemoryInfo(handle(0)).used == 1024 * MIB


def test_mig_handle_sees_only_its_processes_and_its_instance_memory(node: Callable[..., SimDriver]) -> None:
    driver = node(mig_gpus("A100-SXM4-80GB", ["3g.40gb", "2g.20gb"]))
    big, small = mig_handles()
    driver.add_process(0, 2001, 2048, mig_uuid=pynvml.nvmlDeviceGetUUID(big))
    driver.add_process(0, 2002, 512, mig_uuid=pynvml.nvmlDeviceGetUUID(small))

    [proc] = pynvml.nvmlDeviceGetComputeRunningProcesses(big)
    assert (proc.pid, proc.usedGpuMemory) == (2001, 2048 * MIB)
    assert proc.gpuInstanceId == pynvml.nvmlDeviceGetGpuInstanceId(big)
    assert proc.computeInstanceId == pynvml.nvmlDeviceGetComputeInstanceId(big)
    assert [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(small)] == [2002]

    big_memory = pynvml.nvmlDeviceGetMemoryInfo(big)
    assert (big_memory.total, big_memory.used) == (40192 * MIB, 2048 * MIB)
    small_memory = pynvml.nvmlDeviceGetMemoryInfo(small)
    assert (small_memory.total, small_memory.used) == (19968 * MIB, 512 * MIB)

    parent = handle(0)
    assert sorted(p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(parent)) == [2001, 2002]
    parent_memory = pynvml.nvmlDeviceGetMemoryInfo(parent)
    assert (parent_memory.total, parent_memory.used) == (81920 * MIB, 2560 * MIB)


def test_compute_instances_sharing_a_gpu_instance_list_only_their_own_processes(
    node: Callable[..., SimDriver],
) -> None:
    driver = node(mig_gpus("A100-SXM4-80GB", ["1c.3g.40gb", "1c.3g.40gb"]))
    first, second = mig_handles()
    assert pynvml.nvmlDeviceGetGpuInstanceId(first) == pynvml.nvmlDeviceGetGpuInstanceId(second)
    driver.add_process(0, 3001, 100, mig_uuid=pynvml.nvmlDeviceGetUUID(first))
    driver.add_process(0, 3002, 200, mig_uuid=pynvml.nvmlDeviceGetUUID(second))
    assert [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(first)] == [3001]
    assert [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(second)] == [3002]
    for mig in (first, second):
        assert pynvml.nvmlDeviceGetMemoryInfo(mig).total == 40192 * MIB  # the GPU instance's memory


# ----- 10. injected faults -------------------------------------------------------------------------


def test_injected_error_fails_the_next_call_only(node: Callable[..., SimDriver]) -> None:
    driver = node(mig_gpus("A100-SXM4-80GB", []))
    device = handle(0)
    driver.inject_error("nvmlDeviceCreateGpuInstance", Return.ERROR_UNKNOWN)
    with pytest.raises(pynvml.NVMLError_Unknown):
        pynvml.nvmlDeviceCreateGpuInstance(device, 9)
    assert pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(device, 9) == 2  # the failed call created nothing
    gi = pynvml.nvmlDeviceCreateGpuInstance(device, 9)
    assert pynvml.nvmlGpuInstanceGetInfo(gi).profileId == 9


def test_injected_error_can_target_one_gpu_and_repeat(node: Callable[..., SimDriver]) -> None:
    driver = node(gpus("A100-SXM4-80GB", 2))
    driver.inject_error("nvmlDeviceGetMemoryInfo", Return.ERROR_GPU_IS_LOST, times=2, gpu_index=1)
    assert pynvml.nvmlDeviceGetMemoryInfo(handle(0)).total == 81920 * MIB
    for _ in range(2):
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            pynvml.nvmlDeviceGetMemoryInfo(handle(1))
    assert pynvml.nvmlDeviceGetMemoryInfo(handle(1)).total == 81920 * MIB


# ----- 11. library lifecycle -----------------------------------------------------------------------


def test_calls_before_init_are_uninitialized(node: Callable[..., SimDriver]) -> None:
    node(gpus("T4"), init=False)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetHandleByIndex(0)
    pynvml.nvmlInit()
    assert pynvml.nvmlDeviceGetCount() == 1
    pynvml.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()


def test_init_is_reference_counted(node: Callable[..., SimDriver]) -> None:
    node(gpus("T4"))
    pynvml.nvmlInit()
    pynvml.nvmlShutdown()
    assert pynvml.nvmlDeviceGetCount() == 1  # still one nvmlInit outstanding


def test_function_the_simulator_lacks_is_function_not_found(node: Callable[..., SimDriver]) -> None:
    node(gpus("A100-SXM4-80GB"))
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        pynvml.nvmlDeviceGetPowerUsage(handle(0))


def test_error_strings_come_from_the_library(node: Callable[..., SimDriver]) -> None:
    node(gpus("A100-SXM4-80GB"))
    assert str(pynvml.NVMLError(pynvml.NVML_ERROR_IN_USE)) == "In use by another client"
    assert str(pynvml.NVMLError(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)) == "Insufficient Resources"
