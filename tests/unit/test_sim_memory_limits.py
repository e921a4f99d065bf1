"""The simulated driver's per-cgroup memory limits (r615+), seen through real pynvml.

``nvmlDeviceSetMemoryLimits_v1`` / ``nvmlDeviceGetMemoryLimits_v1`` are called exactly as pynvml 13.615 calls them
(its structures, by reference). Where NVIDIA documents the behaviour (the NVML API pages, the MPS v3 memory
partitioning page) the simulator follows it: root only, not on MIG handles, absent before r615, the cgroup must
exist (a cgroup without the controller's files is "not found"), soft 0 / hard MAX is "no limit", removing the
cgroup clears its limits.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pynvml
import pytest

from agent.sim.nvml.control import SimControlClient, SimControlServer
from agent.sim.nvml.driver import OutOfMemory, SimDriver

MIB = 1 << 20
GIB = 1 << 30
NEW_DRIVER = {"driver_version": "615.71.09", "gpus": [{"model": "A100-SXM4-80GB"}]}


def set_limits(handle: object, cgroup: Path, soft: int, hard: int) -> None:
    request = pynvml.c_nvmlSetMemoryLimits_v1_t()
    request.nameSpace = str(cgroup).encode()
    request.softLimit, request.hardLimit = soft, hard
    pynvml.nvmlDeviceSetMemoryLimits_v1(handle, request)


def get_limits(handle: object, cgroup: Path) -> tuple[int, int, int]:
    answer = pynvml.c_nvmlGetMemoryLimits_v1_t()
    answer.nameSpace = str(cgroup).encode()
    pynvml.nvmlDeviceGetMemoryLimits_v1(handle, answer)
    return answer.softLimit, answer.hardLimit, answer.currentUsed


@pytest.fixture
def cgroup(tmp_path: Path) -> Path:
    path = tmp_path / "kubepods.slice" / "pod-a.slice" / "cri-containerd-1.scope"
    path.mkdir(parents=True)
    return path


def test_a_limit_set_reads_back_and_clears(nvml_node: Callable[[object], SimDriver], cgroup: Path) -> None:
    nvml_node(NEW_DRIVER)
    gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert get_limits(gpu, cgroup) == (0, pynvml.NVML_DEVICE_MEMORY_LIMIT_MAX, 0)
    set_limits(gpu, cgroup, 10 * GIB, 10 * GIB)
    assert get_limits(gpu, cgroup) == (10 * GIB, 10 * GIB, 0)
    set_limits(gpu, cgroup, 0, pynvml.NVML_DEVICE_MEMORY_LIMIT_MAX)
    assert get_limits(gpu, cgroup) == (0, pynvml.NVML_DEVICE_MEMORY_LIMIT_MAX, 0)


def test_older_drivers_have_no_such_function(nvml_node: Callable[[object], SimDriver], cgroup: Path) -> None:
    nvml_node({"driver_version": "580.95.05", "gpus": [{"model": "A100-SXM4-80GB"}]})
    gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        set_limits(gpu, cgroup, GIB, GIB)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        get_limits(gpu, cgroup)


def test_refusals(nvml_node: Callable[[object], SimDriver], cgroup: Path, tmp_path: Path) -> None:
    driver = nvml_node(
        {"driver_version": "615.71.09", "gpus": [{"model": "A100-SXM4-80GB"}, {"model": "A100-SXM4-80GB",
                                                                                "mig": {"instances": ["3g.40gb"]}}]}
    )  # fmt: skip
    gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):  # above the GPU's 80 GiB
        set_limits(gpu, cgroup, GIB, 81 * GIB)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):  # soft above hard
        set_limits(gpu, cgroup, 2 * GIB, GIB)
    with pytest.raises(pynvml.NVMLError_NotFound):
        set_limits(gpu, tmp_path / "no-such-cgroup", GIB, GIB)
    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(pynvml.nvmlDeviceGetHandleByIndex(1), 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        set_limits(mig, cgroup, GIB, GIB)
    with pytest.raises(pynvml.NVMLError_NotSupported):  # nor on a GPU in MIG mode
        set_limits(pynvml.nvmlDeviceGetHandleByIndex(1), cgroup, GIB, GIB)
    driver.set_caller_root(False)
    with pytest.raises(pynvml.NVMLError_NoPermission):
        set_limits(gpu, cgroup, GIB, GIB)
    assert get_limits(gpu, cgroup)[1] == pynvml.NVML_DEVICE_MEMORY_LIMIT_MAX  # reading needs no privilege
    assert driver.memory_limit_table() == {}


def test_processes_are_held_to_the_hard_limit(nvml_node: Callable[[object], SimDriver], cgroup: Path) -> None:
    driver = nvml_node(NEW_DRIVER)
    gpu = pynvml.nvmlDeviceGetHandleByIndex(0)
    set_limits(gpu, cgroup, 10 * GIB, 10 * GIB)
    driver.add_process(0, 100, 6 * 1024, cgroup=str(cgroup))
    driver.add_process(0, 101, 3 * 1024, cgroup=str(cgroup))
    assert get_limits(gpu, cgroup)[2] == 9 * GIB  # currentUsed follows the cgroup's processes
    with pytest.raises(OutOfMemory, match="hard limit"):
        driver.allocate(101, 2 * 1024)
    driver.allocate(101, 1024)
    assert get_limits(gpu, cgroup)[2] == 10 * GIB
    with pytest.raises(OutOfMemory):  # a new process of the same container starts no better
        driver.add_process(0, 102, 1, cgroup=str(cgroup))
    driver.remove_process(100)
    assert get_limits(gpu, cgroup)[2] == 4 * GIB


def test_removing_the_cgroup_clears_its_limits(nvml_node: Callable[[object], SimDriver], cgroup: Path) -> None:
    driver = nvml_node(NEW_DRIVER)
    set_limits(pynvml.nvmlDeviceGetHandleByIndex(0), cgroup, GIB, GIB)
    assert len(driver.memory_limit_table()) == 1
    cgroup.rmdir()
    assert driver.memory_limit_table() == {}
    with pytest.raises(pynvml.NVMLError_NotFound):
        get_limits(pynvml.nvmlDeviceGetHandleByIndex(0), cgroup)


def test_injected_failures(nvml_node: Callable[[object], SimDriver], cgroup: Path) -> None:
    driver = nvml_node(NEW_DRIVER)
    driver.inject_error("nvmlDeviceSetMemoryLimits_v1", pynvml.NVML_ERROR_UNKNOWN)
    with pytest.raises(pynvml.NVMLError_Unknown):
        set_limits(pynvml.nvmlDeviceGetHandleByIndex(0), cgroup, GIB, GIB)
    set_limits(pynvml.nvmlDeviceGetHandleByIndex(0), cgroup, GIB, GIB)
    assert driver.memory_limit_sets == 1


def test_the_control_socket_runs_processes_in_cgroups_and_lists_limits(
    nvml_node: Callable[[object], SimDriver], cgroup: Path, tmp_path: Path
) -> None:
    """What an end-to-end test or the demo does to an agent's simulated node from outside its process."""
    driver = nvml_node(NEW_DRIVER)
    server = SimControlServer(driver, tmp_path / "ctl.sock")
    server.start()
    try:
        client = SimControlClient(tmp_path / "ctl.sock")
        set_limits(pynvml.nvmlDeviceGetHandleByIndex(0), cgroup, GIB, 2 * GIB)
        assert client.call("memory_limits") == [
            {"gpu": 0, "uuid": driver.gpus[0].uuid, "cgroup": str(cgroup), "soft": GIB, "hard": 2 * GIB}
        ]
        client.call("add_process", gpu=0, pid=300, used_mib=1024, cgroup=str(cgroup))
        with pytest.raises(RuntimeError, match="OUT_OF_MEMORY"):
            client.call("allocate", pid=300, mib=2048)
        client.call("set_caller_root", root=False)
        with pytest.raises(pynvml.NVMLError_NoPermission):
            set_limits(pynvml.nvmlDeviceGetHandleByIndex(0), cgroup, GIB, GIB)
    finally:
        server.stop()
