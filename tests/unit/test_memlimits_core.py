"""What each container should be held to, and how: the pure part of driver-enforced memory limits, and how a
container's cgroup is found from the kubelet's log link."""

from __future__ import annotations

import logging
from pathlib import Path

from agent.core.memlimits import (
    ContainerRef,
    Enforcement,
    SizedDevice,
    enforcement,
    holds,
    wanted_limits,
)
from agent.memlimits import containers
from agent.memlimits.containers import ContainerCgroups, candidates, parse_link

GIB = 1 << 30
UID = "0b6e1f1c-2a4d-4c52-9d3e-6a8f0e7b1c2d"
CID = "ab" * 32


def sized(device_id: str, gpu: str = "GPU-a", size: int = 10 * GIB, *, mig: bool = False, server: bool = True):
    return SizedDevice(device_id, gpu, 0, mig, size, server)


def test_a_container_is_held_to_the_sum_of_its_devices_on_each_gpu() -> None:
    sizes = {d.device_id: d for d in (sized("a::0"), sized("a::1"), sized("b::0", "GPU-b", 20 * GIB))}
    trainer, other = ContainerRef("ns", "trainer", "main"), ContainerRef("ns", "other", "main")
    holders = [("a::0", trainer), ("a::1", trainer), ("b::0", trainer), ("unsized", other)]
    wanted = wanted_limits(sizes, holders)
    assert [(w.container, w.gpu_uuid, w.request, w.limit) for w in wanted] == [
        (trainer, "GPU-a", 20 * GIB, 20 * GIB),
        (trainer, "GPU-b", 20 * GIB, 20 * GIB),
    ]
    assert wanted == wanted_limits(sizes, reversed(holders))  # the same holders, the same answer


def test_the_fallback_chain_is_said_out_loud() -> None:
    container = ContainerRef("ns", "p", "c")
    full = wanted_limits({"a::0": sized("a::0")}, [("a::0", container)])[0]
    on_mig = wanted_limits({"m::0": sized("m::0", mig=True)}, [("m::0", container)])[0]
    share = SizedDevice("ns/claim/gpu-0", "GPU-a", 0, False, 10 * GIB, False, claim="ns/claim")
    client_only = wanted_limits({"k": share}, [("k", container)])[0]
    time_sliced = wanted_limits({"a::0": sized("a::0", server=False)}, [("a::0", container)])[0]
    assert enforcement(full, driver_refusal=None).enforcement is Enforcement.DRIVER
    assert enforcement(full, driver_refusal="not root").enforcement is Enforcement.MPS
    verdict = enforcement(on_mig, driver_refusal=None)
    assert verdict.enforcement is Enforcement.MPS and "MIG" in verdict.reason
    verdict = enforcement(client_only, driver_refusal="old driver")
    assert verdict.enforcement is Enforcement.ADVISORY and "old driver" in verdict.reason and "drop" in verdict.reason
    verdict = enforcement(time_sliced, driver_refusal="old driver")
    assert verdict.enforcement is Enforcement.ADVISORY and "time-sliced" in verdict.reason
    assert holds(full, 10 * GIB, 10 * GIB) and not holds(full, 0, 0xFFFFFFFFFFFFFFFF)


def test_a_burst_ceiling_is_the_hard_limit_and_the_size_the_request() -> None:
    container = ContainerRef("ns", "p", "c")
    bursting = SizedDevice("a::0", "GPU-a", 0, False, 10 * GIB, False, burst=30 * GIB)
    (wanted,) = wanted_limits({"a::0": bursting, "a::1": sized("a::1")}, [("a::0", container), ("a::1", container)])
    assert (wanted.request, wanted.limit) == (20 * GIB, 40 * GIB)


def test_a_log_link_names_the_container_and_its_pod() -> None:
    name = f"trainer-0_team-a_main-{CID}.log"
    target = f"/var/log/pods/team-a_trainer-0_{UID}/main/0.log"
    assert parse_link(name, target) == (ContainerRef("team-a", "trainer-0", "main"), UID, CID)
    assert parse_link(name, f"/var/log/pods/other_trainer-0_{UID}/main/0.log") is None  # another pod's directory
    assert parse_link("kube-proxy.log", target) is None


def test_the_cgroup_is_found_under_either_cgroup_driver(tmp_path: Path) -> None:
    logs = tmp_path / "containers"
    logs.mkdir()
    (logs / f"trainer-0_team-a_main-{CID}.log").symlink_to(f"/var/log/pods/team-a_trainer-0_{UID}/main/0.log")
    index = ContainerCgroups(logs, tmp_path / "cg")
    assert index.scan() == {}  # no cgroup (yet): not a running container
    cgroupfs = tmp_path / "cg" / "kubepods" / "burstable" / f"pod{UID}" / CID
    cgroupfs.mkdir(parents=True)
    found = index.scan()[ContainerRef("team-a", "trainer-0", "main")]
    assert [c.cgroup for c in found] == [str(cgroupfs)]
    assert str(cgroupfs) in {str(p) for p in candidates(tmp_path / "cg", UID, CID)}


def test_a_container_logs_directory_over_the_bound_is_read_up_to_it_and_said_once(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    """The scan's work is bounded however many entries the directory holds; what it leaves unread is logged."""
    monkeypatch.setattr(containers, "MAX_LINKS", 3)
    logs = tmp_path / "containers"
    logs.mkdir()
    for n in range(5):
        cid = f"{n:064x}"
        (logs / f"trainer-{n}_team-a_main-{cid}.log").symlink_to(f"/var/log/pods/team-a_trainer-{n}_{UID}/main/0.log")
        (tmp_path / "cg" / "kubepods" / f"pod{UID}" / cid).mkdir(parents=True)
    index = ContainerCgroups(logs, tmp_path / "cg")
    with caplog.at_level(logging.WARNING, logger="agent.memlimits.containers"):
        assert len(index.scan()) == 3  # five running containers, three read
        assert len(index.scan()) == 3
    [warning] = [r.getMessage() for r in caplog.records]  # said once, not on every scan
    assert f"container logs directory {logs} holds more than 3 entries; only the first 3 are read" in warning
    assert "gets no memory limit" in warning
    for extra in sorted(logs.iterdir())[:2]:
        extra.unlink()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="agent.memlimits.containers"):
        assert len(index.scan()) == 3  # within the bound again: all read, nothing said
    assert caplog.records == []
