"""Per-process truth (issue 17): /proc read with PID-reuse checks, and processes joined to pods.

Fake /proc trees stand in for the host's; the join is pure and takes the NVML answers as values.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from agent.gpu.process_utilization import Sample
from agent.telemetry.procfs import HZ, Owner, ProcessOwners, Unattributed, boot_clock, pod_uid_in
from agent.telemetry.usage import DeviceProcesses, ListedProcess, attribute

UID = "3f2a9c1e-5b6d-4e7f-8a9b-0c1d2e3f4a5b"
OTHER = "77777777-1111-2222-3333-444444444444"
GPU = "GPU-0000"
MIG = "MIG-1111"

CGROUPS = {
    "v2 systemd": f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID.replace('-', '_')}.slice/"
    "cri-containerd-0123abcd.scope\n",
    "v2 cgroupfs": f"0::/kubepods/besteffort/pod{UID}/0123abcd4567\n",
    "v2 guaranteed systemd": f"0::/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/crio-0123.scope\n",
    "v1 cgroupfs": "".join(
        f"{n}:{controller}:/kubepods/burstable/pod{UID}/0123abcd\n"
        for n, controller in enumerate(["memory", "cpu,cpuacct", "devices", "pids"], start=2)
    )
    + "1:name=systemd:/kubepods/burstable/pod"
    + UID
    + "/0123abcd\n0::/\n",
    "v1 systemd": f"11:devices:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID.replace('-', '_')}"
    ".slice/docker-0123.scope\n4:memory:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod"
    f"{UID.replace('-', '_')}.slice/docker-0123.scope\n",
}


def stat(pid: int, started: float, comm: str = "python3") -> str:
    ticks = int(started * HZ)
    return f"{pid} ({comm}) S 1 {pid} {pid} 0 -1 4194560 " + "0 " * 12 + f"{ticks} 1000 10\n"


def process(root: Path, pid: int, cgroup: str, started: float | None = None, comm: str = "python3") -> None:
    entry = root / str(pid)
    entry.mkdir(exist_ok=True)
    (entry / "cgroup").write_text(cgroup)
    (entry / "stat").write_text(stat(pid, boot_clock() - 5 if started is None else started, comm))


@pytest.mark.parametrize("layout", sorted(CGROUPS))
def test_the_pod_uid_is_found_in_every_cgroup_layout(layout: str) -> None:
    assert pod_uid_in(CGROUPS[layout]) == UID


@pytest.mark.parametrize(
    "cgroup",
    [
        "0::/system.slice/containerd.service\n",  # a host process
        "0::/user.slice/user-1000.slice/session-3.scope\n",
        f"0::/system.slice/docker-{UID.replace('-', '')}.scope\n",  # docker run, outside Kubernetes
        f"0::/machine.slice/libpod-pod{UID}.scope\n",  # a podman pod: not the kubelet's
        "",
    ],
)
def test_a_cgroup_outside_the_kubelets_pods_names_no_pod(cgroup: str) -> None:
    assert pod_uid_in(cgroup) is None


def test_two_pods_in_one_cgroup_file_name_none() -> None:
    assert pod_uid_in(CGROUPS["v2 cgroupfs"] + f"1:memory:/kubepods/besteffort/pod{OTHER}/x\n") is None


def test_owners_from_a_fake_proc_tree(tmp_path: Path) -> None:
    process(tmp_path, 100, CGROUPS["v1 systemd"], comm="my (weird) worker")  # comm with spaces and parentheses
    process(tmp_path, 101, "0::/system.slice/sshd.service\n")
    (tmp_path / "102").mkdir()
    (tmp_path / "102" / "stat").write_text("garbage")
    owners = ProcessOwners(tmp_path).owners([100, 101, 102, 103], listed_at=boot_clock())
    assert owners[100].pod_uid == UID and owners[100].reason is None
    assert owners[101] == Owner(101, owners[101].start, None, Unattributed.NO_POD)
    assert owners[102].reason is Unattributed.UNREADABLE
    assert owners[103].reason is Unattributed.EXITED


def test_a_process_started_after_nvml_listed_its_pid_is_not_the_one_listed(tmp_path: Path) -> None:
    listed_at = boot_clock()
    process(tmp_path, 200, CGROUPS["v2 cgroupfs"], started=listed_at + 1.0)  # the PID went to a newer process
    (owner,) = ProcessOwners(tmp_path).owners([200], listed_at=listed_at).values()
    assert owner.pod_uid is None and owner.reason is Unattributed.PID_REUSED


def test_a_pid_that_changes_hands_is_read_again_and_the_cgroup_is_cached_otherwise(tmp_path: Path) -> None:
    owners = ProcessOwners(tmp_path)
    process(tmp_path, 300, CGROUPS["v2 cgroupfs"])
    assert owners.owners([300])[300].pod_uid == UID
    (tmp_path / "300" / "cgroup").write_text(f"0::/kubepods/besteffort/pod{OTHER}/x\n")  # same process: not re-read
    assert owners.owners([300])[300].pod_uid == UID
    process(tmp_path, 300, f"0::/kubepods/besteffort/pod{OTHER}/x\n", started=boot_clock() - 1)  # a new process
    assert owners.owners([300])[300].pod_uid == OTHER


def test_an_unreadable_cgroup_is_said_so(tmp_path: Path) -> None:
    process(tmp_path, 400, CGROUPS["v2 cgroupfs"])
    (tmp_path / "400" / "cgroup").unlink()
    (tmp_path / "400" / "cgroup").mkdir()  # reading a directory fails like a permission error would
    assert ProcessOwners(tmp_path).owners([400])[400].reason is Unattributed.UNREADABLE


@pytest.mark.parametrize("pid", [0, -1])
def test_a_pid_that_is_no_pid_never_becomes_a_path(tmp_path: Path, pid: int) -> None:
    assert ProcessOwners(tmp_path).owners([pid])[pid].reason is Unattributed.UNREADABLE


# ----- the join ------------------------------------------------------------------------------------------------


def owner(pid: int, uid: str | None, start: float = 100.0) -> Owner:
    return Owner(pid, start, uid, None if uid else Unattributed.NO_POD)


HELD = {UID: {GPU: ("ml", "trainer")}, OTHER: {GPU: ("ml", "notebook")}}  # pod UID -> physical -> holder
BOOT = 1_000_000.0  # wall clock at boot: a process started 100 s after boot started at 1_000_100


def us(wall: float) -> int:
    return int(wall * 1e6)


def test_each_pod_gets_its_own_processes_memory_and_utilization() -> None:
    device = DeviceProcesses(
        GPU,
        [ListedProcess(1, 1 << 30), ListedProcess(2, 2 << 30), ListedProcess(3, 3 << 30), ListedProcess(4, 1 << 20)],
        [Sample(1, us(BOOT + 150), (40, 10, 0, 0)), Sample(2, us(BOOT + 150), (30, 0, 5, 0))],
    )
    owners = {1: owner(1, UID), 2: owner(2, UID), 3: owner(3, OTHER), 4: owner(4, None)}
    result = attribute([device], owners, HELD, BOOT)
    trainer, notebook = result.by_holder[(("ml", "trainer"), GPU)], result.by_holder[(("ml", "notebook"), GPU)]
    assert (trainer.processes, trainer.memory_bytes, trainer.load) == (2, 3 << 30, [70, 10, 5, 0])
    assert (notebook.processes, notebook.memory_bytes, notebook.load) == (1, 3 << 30, [0, 0, 0, 0])
    host = result.unattributed[(GPU, Unattributed.NO_POD)]
    assert (host.processes, host.memory_bytes) == (1, 1 << 20)


def test_a_sample_older_than_the_process_now_holding_its_pid_is_an_earlier_process() -> None:
    """The notebook's process exited; its PID now belongs to the trainer's new process, started at 200 s."""
    device = DeviceProcesses(
        GPU,
        [ListedProcess(7, 1 << 30)],
        [Sample(7, us(BOOT + 150), (90, 0, 0, 0)), Sample(7, us(BOOT + 210), (20, 0, 0, 0))],
    )
    result = attribute([device], {7: owner(7, UID, start=200.0)}, HELD, BOOT)
    assert result.by_holder[(("ml", "trainer"), GPU)].load == [20, 0, 0, 0]
    only_old = DeviceProcesses(GPU, [ListedProcess(7, 1 << 30)], [Sample(7, us(BOOT + 150), (90, 0, 0, 0))])
    result = attribute([only_old], {7: owner(7, UID, start=200.0)}, HELD, BOOT)
    assert result.by_holder[(("ml", "trainer"), GPU)].load == [0, 0, 0, 0], (
        "the earlier process's work is not the pod's"
    )


def test_a_pod_that_holds_no_device_here_or_that_nobody_names_gets_nothing() -> None:
    device = DeviceProcesses(MIG, [ListedProcess(1, 5), ListedProcess(2, 7)], None)
    owners = {1: owner(1, UID), 2: owner(2, "99999999-9999-9999-9999-999999999999")}
    result = attribute([device], owners, HELD, BOOT)
    assert not result.by_holder
    assert result.unattributed[(MIG, Unattributed.NOT_HOLDING)].memory_bytes == 5
    assert result.unattributed[(MIG, Unattributed.UNKNOWN_POD)].memory_bytes == 7
    assert result.unattributed[(MIG, Unattributed.NOT_HOLDING)].load is None, "a MIG device: unknown, not zero"


def test_a_process_that_exited_in_the_window_still_counts_its_work_but_not_as_a_process() -> None:
    device = DeviceProcesses(GPU, [ListedProcess(1, 1 << 30)], [Sample(5, us(BOOT + 150), (35, 0, 0, 0))])
    owners = {1: owner(1, UID), 5: Owner(5, None, None, Unattributed.EXITED)}
    result = attribute([device], owners, HELD, BOOT)
    gone = result.unattributed[(GPU, Unattributed.EXITED)]
    assert (gone.processes, gone.load) == (0, [35, 0, 0, 0])
    assert result.by_holder[(("ml", "trainer"), GPU)].load == [0, 0, 0, 0]


def test_utilization_is_capped_at_a_hundred_percent() -> None:
    device = DeviceProcesses(
        GPU, [ListedProcess(1, 0), ListedProcess(2, 0)],
        [Sample(1, us(BOOT + 150), (70, 0, 0, 0)), Sample(2, us(BOOT + 150), (60, 0, 0, 0))],
    )  # fmt: skip
    result = attribute([device], {1: owner(1, UID), 2: owner(2, UID)}, HELD, BOOT)
    assert result.by_holder[(("ml", "trainer"), GPU)].load == [100, 0, 0, 0]


def test_the_boot_clock_and_the_wall_clock_agree_with_proc() -> None:
    """The join puts /proc's start times (since boot) and NVML's timestamps (wall clock) on one clock."""
    with open(f"/proc/{os.getpid()}/stat", "rb") as file:
        text = file.read()
    started = int(text[text.rindex(b")") + 1 :].split()[19]) / HZ
    assert 0 <= boot_clock() - started < time.process_time() + 3600 * 24 * 365
