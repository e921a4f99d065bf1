"""The simulated driver's per-process utilization, read through the real pynvml (issue 17).

NVML's rules (``nvmlDeviceGetProcessUtilization``): samples per process that did some work since
``lastSeenTimeStamp``, NOT_FOUND when none did, INSUFFICIENT_SIZE for a buffer too small (pynvml sizes it with a
first call), NOT_SUPPORTED with MIG enabled; and the MPS client list (``nvmlDeviceGetMPSComputeRunningProcesses``).
The reader (``agent.gpu.process_utilization``) on top: windows, retries, and what it remembers.
"""

from __future__ import annotations

import time

import pynvml
import pytest

from agent.gpu.process_utilization import ProcessUtilization
from agent.sim.nvml.codes import Return
from agent.sim.nvml.driver import SimDriver

NODE = {
    "name": "putil",
    "gpus": [{"model": "A100-SXM4-80GB", "count": 2}, {"model": "A100-SXM4-80GB", "mig": {"instances": ["3g.40gb"]}}],
}


@pytest.fixture
def driver(sim_node) -> SimDriver:
    driver = sim_node(NODE)
    pynvml.nvmlInit()
    yield driver
    pynvml.nvmlShutdown()


def handle(index: int) -> object:
    return pynvml.nvmlDeviceGetHandleByIndex(index)


def samples(index: int, last_seen: int = 0) -> dict[int, tuple[int, int, int, int]]:
    return {
        s.pid: (s.smUtil, s.memUtil, s.encUtil, s.decUtil)
        for s in pynvml.nvmlDeviceGetProcessUtilization(handle(index), last_seen)
    }


def test_no_busy_process_is_not_found(driver: SimDriver) -> None:
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetProcessUtilization(handle(0), 0)
    driver.add_process(0, 10, 100)  # a process that does nothing is not listed either
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetProcessUtilization(handle(0), 0)


def test_busy_processes_get_one_sample_each_with_their_engines(driver: SimDriver) -> None:
    driver.add_process(0, 10, 100, sm=40, memory=12, encoder=3, decoder=7)
    driver.add_process(0, 11, 100, kind="mps_client", sm=25)
    driver.add_process(0, 12, 100)
    driver.add_process(1, 13, 100, sm=90)
    assert samples(0) == {10: (40, 12, 3, 7), 11: (25, 0, 0, 0)}
    assert samples(1) == {13: (90, 0, 0, 0)}


def test_only_samples_after_last_seen_come_back(driver: SimDriver) -> None:
    driver.add_process(0, 10, 100, sm=50)
    first = pynvml.nvmlDeviceGetProcessUtilization(handle(0), 0)
    last_seen = max(s.timeStamp for s in first)
    driver.set_process_utilization(10, 0)  # idle from now on
    time.sleep(0.01)  # let the idle stretch outweigh the instant between the read and the change
    again = pynvml.nvmlDeviceGetProcessUtilization(handle(0), max(s.timeStamp for s in first))
    assert all(s.timeStamp > last_seen for s in again)
    stamp = max(s.timeStamp for s in again)
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetProcessUtilization(handle(0), stamp)


def test_the_samples_of_an_exited_process_stay_stamped_before_its_pid_is_reused(driver: SimDriver) -> None:
    driver.add_process(0, 10, 100, sm=70)
    time.sleep(0.01)
    driver.remove_process(10)
    ended_us = time.time() * 1e6
    time.sleep(0.01)
    driver.add_process(0, 10, 100, sm=20)  # the PID is reused
    got = sorted((s.timeStamp, s.smUtil) for s in pynvml.nvmlDeviceGetProcessUtilization(handle(0), 0) if s.pid == 10)
    assert len(got) == 2 and got[0][0] <= ended_us < got[1][0]
    assert (got[0][1], got[1][1]) == (70, 20)


def test_with_mig_enabled_per_process_utilization_is_not_supported(driver: SimDriver) -> None:
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetProcessUtilization(handle(2), 0)
    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle(2), 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetProcessUtilization(mig, 0)


def test_a_buffer_too_small_is_insufficient_size_with_the_count_needed(driver: SimDriver) -> None:
    import ctypes

    driver.add_process(0, 10, 100, sm=10)
    driver.add_process(0, 11, 100, sm=10)
    fn = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetProcessUtilization")
    count = ctypes.c_uint(1)
    buffer = (pynvml.c_nvmlProcessUtilizationSample_t * 1)()
    assert fn(handle(0), buffer, ctypes.byref(count), ctypes.c_ulonglong(0)) == Return.ERROR_INSUFFICIENT_SIZE
    assert count.value == 2


def test_the_gpu_utilization_follows_its_processes_unless_pinned(driver: SimDriver) -> None:
    driver.add_process(0, 10, 100, sm=30, memory=5)
    driver.add_process(0, 11, 100, sm=50)
    assert pynvml.nvmlDeviceGetUtilizationRates(handle(0)).gpu == 80
    driver.set_utilization(0, 12)
    assert pynvml.nvmlDeviceGetUtilizationRates(handle(0)).gpu == 12


def test_a_process_can_exit_right_after_it_is_listed(driver: SimDriver) -> None:
    driver.add_process(0, 10, 100, kind="mps_client", sm=10)
    driver.exit_after_listing(10)
    assert [p.pid for p in pynvml.nvmlDeviceGetMPSComputeRunningProcesses(handle(0))] == [10]
    assert pynvml.nvmlDeviceGetMPSComputeRunningProcesses(handle(0)) == []
    assert 10 in samples(0), "its samples are still in the driver's buffer"


# ----- the reader ------------------------------------------------------------------------------------------------


def test_the_reader_moves_its_window_and_reads_nothing_twice(driver: SimDriver) -> None:
    reader = ProcessUtilization()
    uuid = driver.gpus[0].uuid
    assert reader.read([uuid])[uuid].samples == () and reader.read([uuid])[uuid].error is None
    driver.add_process(0, 10, 100, sm=60)
    (sample,) = reader.read([uuid])[uuid].samples
    assert sample.pid == 10 and sample.load[0] == 60
    driver.set_process_utilization(10, 0)
    time.sleep(0.01)
    reader.read([uuid])  # the moment it was busy until the change
    assert reader.read([uuid])[uuid].samples == ()


def test_the_reader_retries_once_when_processes_appear_between_pynvmls_two_calls(driver: SimDriver) -> None:
    reader = ProcessUtilization()
    uuid = driver.gpus[0].uuid
    driver.add_process(0, 10, 100, sm=60)
    driver.inject_error("nvmlDeviceGetProcessUtilization", Return.ERROR_INSUFFICIENT_SIZE, times=2)
    assert [s.pid for s in reader.read([uuid])[uuid].samples] == [10]


def test_the_reader_says_why_and_asks_a_not_supported_gpu_no_more(driver: SimDriver) -> None:
    reader = ProcessUtilization()
    uuid = driver.gpus[0].uuid
    driver.add_process(0, 10, 100, sm=60)
    driver.inject_error("nvmlDeviceGetProcessUtilization", Return.ERROR_UNKNOWN, times=1)
    assert reader.read([uuid])[uuid].error == "UNKNOWN"
    assert reader.read([uuid])[uuid].samples, "a failure is not remembered"
    driver.inject_error("nvmlDeviceGetProcessUtilization", Return.ERROR_NOT_SUPPORTED, times=1)
    assert reader.read([uuid])[uuid].error == "NOT_SUPPORTED"
    assert reader.read([uuid])[uuid].error == "NOT_SUPPORTED", "not asked again"
    reader.forget([])
    assert reader.read([uuid])[uuid].samples, "asked afresh once forgotten (the GPU left MIG mode)"


def test_the_control_socket_sets_loads_and_makes_processes_exit_after_listing(driver: SimDriver, tmp_path) -> None:
    """An end-to-end test outside the agent's process drives the same through ``--sim-control``."""
    from agent.sim.nvml.control import SimControlClient, SimControlServer

    server = SimControlServer(driver, tmp_path / "ctl.sock")
    server.start()
    try:
        client = SimControlClient(tmp_path / "ctl.sock")
        client.call("add_process", gpu=0, pid=20, used_mib=64, sm=15, decoder=4)
        assert samples(0) == {20: (15, 0, 0, 4)}
        client.call("set_process_utilization", pid=20, sm=0)
        client.call("exit_after_listing", pid=20)
        assert [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle(0))] == [20]
        assert pynvml.nvmlDeviceGetComputeRunningProcesses(handle(0)) == []
        with pytest.raises(Exception, match="0-100"):
            client.call("add_process", gpu=0, pid=21, used_mib=64, sm=101)  # refused, not half-made
    finally:
        server.stop()


def test_a_gpu_idle_in_between_starts_its_next_window_when_it_was_last_seen_idle(driver: SimDriver) -> None:
    """Work done long ago (a process that has exited since) is not read into the window of a process that just
    started on a GPU that sat idle in between."""
    reader = ProcessUtilization()
    uuid = pynvml.nvmlDeviceGetUUID(handle(0))
    driver.add_process(0, 20, 100, sm=80)
    assert {s.pid for s in reader.read([uuid])[uuid].samples} == {20}
    driver.add_process(0, 21, 100, sm=60)  # more work, then both exit: their samples stay in the driver's buffer
    driver.remove_process(20)
    driver.remove_process(21)
    reader.idle([uuid])  # a collection found no process on the GPU
    driver.add_process(0, 22, 100, sm=30)
    assert {s.pid for s in reader.read([uuid])[uuid].samples} == {22}
