"""`tessera demo --dra` runs end to end and shows what it promises: the slices DRA publishes next to the device
plugin's GPU, three claims allocated by NVIDIA's classes and CEL selectors, a pod prepared with CDI, an XID taint
that comes and goes (with the shortened recovery window said), and the slices back after a kubelet restart."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

TIMEOUT = 120


def _demo(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    return subprocess.run(
        [sys.executable, "-m", "agent", "demo", "--dra", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env,
        check=False,
    )


@pytest.fixture(scope="module")
def run() -> subprocess.CompletedProcess[str]:
    return _demo()


def _step(out: str, n: int) -> str:
    """The text of step ``n`` (from its ``[n/8]`` line to the next step or the end)."""
    start = out.index(f"[{n}/8]")
    following = out.find(f"[{n + 1}/8]", start)
    return out[start : following if following != -1 else len(out)]


def test_the_dra_demo_runs_cleanly(run: subprocess.CompletedProcess[str]) -> None:
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stdout + run.stderr
    assert run.stderr == ""  # nothing but the story: no log lines, no gRPC core chatter
    assert "plugin and DRA sockets left behind: none" in run.stdout
    assert "Summary:" in run.stdout


def test_each_gpu_belongs_to_one_front_end_and_the_slices_name_nvidias_devices(
    run: subprocess.CompletedProcess[str],
) -> None:
    out = run.stdout
    assert re.search(r"GPU 2 +NVIDIA A100-SXM4-80GB +whole GPU +-> device plugin", out)
    assert re.search(r"GPU 3 +NVIDIA A100-SXM4-80GB +MIG, made per claim +-> DRA", out)
    step = _step(out, 1)
    assert re.search(r"nvidia.com/gpu +allocatable 1: GPU-", step)  # the device plugin keeps one GPU
    assert re.search(r"gpu-0 +type gpu +NVIDIA H100 80GB HBM3 +memory 81559Mi", step)
    assert re.search(r"gpu-1 +type gpu +NVIDIA A100-SXM4-80GB +memory 80Gi", step)
    assert "gpu-3-mig-1g10gb-19-{0,1,2,3,4,5,6}: 7 × MIG 1g.10gb, memory 9728Mi" in step  # placements, made later
    assert "gpu-3-mig-7g80gb-0-{0}: 1 × MIG 7g.80gb" in step and "counter set gpu-3-counter-set" in step
    assert "gpu-2" not in step  # never offered by both front ends
    for selector in (
        "gpu.nvidia.com   device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'",
        "mig.nvidia.com   device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'mig'",
    ):
        assert selector in step


def test_three_claims_are_allocated_by_cel_selectors(run: subprocess.CompletedProcess[str]) -> None:
    step = _step(run.stdout, 2)
    assert "device.attributes['gpu.nvidia.com'].productName.contains('H100')" in step
    assert "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0" in step
    assert "device.attributes['gpu.nvidia.com'].profile == '1g.10gb'" in step
    assert "-> gpu-0 (NVIDIA H100 80GB HBM3)" in step
    assert "-> gpu-1 (NVIDIA A100-SXM4-80GB)" in step  # at least 40 GiB; the H100 is held already
    assert re.search(r"-> gpu-3-mig-1g10gb-\d+-\d+ \(NVIDIA A100-SXM4-80GB, MIG 1g.10gb\)", step)
    summary = run.stdout[run.stdout.index("Summary:") :]
    assert re.search(r"h100 -> gpu-0, big-memory -> gpu-1, mig-small -> gpu-3-mig-1g10gb-\d+-\d+", summary)


def test_the_pod_gets_cdi_ids_and_a_spec_is_shown(run: subprocess.CompletedProcess[str]) -> None:
    step = _step(run.stdout, 3)
    uid = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
    assert re.search(rf"k8s.gpu.nvidia.com/claim={uid}-gpu-0\n", step)
    assert re.search(rf"k8s.gpu.nvidia.com/claim={uid}-gpu-3-mig-1g10gb-", step)
    assert re.search(rf"k8s.gpu.nvidia.com-claim_{uid}\.yaml", step)  # the spec file's path
    assert "| kind: k8s.gpu.nvidia.com/claim" in step and "- path: /dev/nvidia0" in step  # its content
    made = re.search(r"claim mig-small's MIG device was created for it: (MIG-[0-9a-f-]+) on GPU 3", step)
    assert made is not None  # the container gets the new device: its claim's spec holds its nodes
    assert re.search(r"its claim's CDI spec gives the container /dev/nvidia3, /dev/nvidia-caps/nvidia-cap\d+, ", step)


def test_an_xid_taints_the_device_and_the_taint_goes_after_the_shortened_window(
    run: subprocess.CompletedProcess[str],
) -> None:
    out = run.stdout
    assert "health recovery after 2 s without errors (shortened for the demo; 60 s on a real node)" in out
    step = _step(out, 4)
    assert "the taint gpu.nvidia.com/xid=48:NoSchedule" in step
    assert "reads gpu-1 Unhealthy" in step
    assert "no new errors for 2 s (shortened for the demo; 60 s on a real node)" in step
    assert "taint gpu.nvidia.com/xid removed from gpu-1, Healthy again" in step


def test_the_slices_come_back_after_a_kubelet_restart(run: subprocess.CompletedProcess[str]) -> None:
    step = _step(run.stdout, 5)
    assert "Restarting the kubelet" in step
    assert "the kubelet deleted slice(s)" in step
    back = re.search(r"slices back after (\d+\.\d+) s\n.*: 27 devices", step)  # GPU 3, an A100 in MIG mode: not whole
    assert back is not None and float(back.group(1)) < 10
    assert "running pods keep their devices, nothing is prepared again: trainer" in step


def test_stopping_the_pod_unprepares_the_claims(run: subprocess.CompletedProcess[str]) -> None:
    step = _step(run.stdout, 6)
    assert "claims h100, big-memory, mig-small unprepared" in step
    assert "none left" in step
    assert "the MIG device made for claim mig-small was destroyed (no process ran on it)" in step


def test_two_claims_share_a_gpu_by_memory_with_their_mps_limits_and_a_third_does_not_fit(
    run: subprocess.CompletedProcess[str],
) -> None:
    step = _step(run.stdout, 7)
    assert re.search(
        r"claim share-a .*\n +-> gpu-1, shareID [0-9a-f]{8}…, consumedCapacity computePercent 0, memory 10Gi", step
    )
    assert re.search(
        r"claim share-b .*\n +-> gpu-1, shareID [0-9a-f]{8}…, consumedCapacity computePercent 25, memory 20Gi", step
    )
    assert "claim share-c  60Gi next to them: not allocated, its pod stays Pending" in step
    assert "0 have the requested capacity free" in step
    assert re.search(r"MPS control daemon dra/[0-9a-f]{12} serves both \(ready\)", step)
    assert re.search(r"share-a: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=GPU-[0-9a-f-]+=10240M\n", step)
    assert re.search(
        r"share-b: CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=GPU-[0-9a-f-]+=20480M, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25", step
    )
    assert re.search(r"drains and stops, GPU 1 in DEFAULT", step)


def test_an_unchanged_nvidia_com_gpu_pod_runs_through_dra_once_the_node_is_all_dra(
    run: subprocess.CompletedProcess[str],
) -> None:
    step = _step(run.stdout, 8)
    assert "gpu-2 is in the node's ResourceSlices; the device plugin advertises no nvidia.com/gpu any more" in step
    assert re.search(
        r"the scheduler writes claim plain-extended-resources-\w+\n +\(request container-0-request-0\)", step
    )
    assert re.search(r"container cuda gets k8s.gpu.nvidia.com/claim=[0-9a-f-]+-gpu-\d\n", step)


def test_flags_of_the_device_plugin_demo_are_refused_not_ignored() -> None:
    result = _demo("--node", "dgx-a100")
    assert result.returncode == 2
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    assert "demo --dra runs its own node" in result.stderr and "--node dgx-a100" in result.stderr
