"""DRA claims attributed like dcgm-exporter labels them (issue 17): the front end's prepared claims, the kubelet's
DRA checkpoint naming each claim's pods, and a collection on a simulated node (pynvml over the simulated driver,
a fake /proc)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from types import MappingProxyType

import pytest

from agent.core.dra.checkpoint import Checkpoint, CreatedMig, PreparedClaim, PreparedDevice
from agent.gpu.discovery import discover
from agent.plugin.podresources import PodAllocations
from agent.status import AgentStatus
from agent.telemetry.collector import TelemetryCollector, TelemetryOptions
from agent.telemetry.dra_claims import (
    ClaimDevice,
    PhysicalClaim,
    claim_devices,
    podresources_claim_pods,
    read_claim_pods,
    resolve,
)

NODE = {
    "name": "dra-telemetry",
    "gpus": [{"model": "A100-SXM4-80GB", "count": 2}, {"model": "A100-SXM4-80GB", "mig": {"instances": ["3g.40gb"]}}],
}
POD_A, POD_B, POD_C = (f"{n}{n}{n}{n}{n}{n}{n}{n}-0000-4000-8000-00000000000{n}" for n in (1, 2, 3))


def kubelet_state(path: Path, claims: dict[str, list[str]], *, as_list: bool = False) -> None:
    """The kubelet's dra_manager_state: a checkpointmanager wrapper around a JSON string (facts/dra.md A5)."""
    entries = [
        {"ClaimUID": uid, "ClaimName": f"claim-{uid}", "Namespace": "ml",
         "PodUIDs": pods if as_list else {pod: {} for pod in pods},
         "DriverState": {"gpu.nvidia.com": {"Devices": [{"PoolName": "node", "DeviceName": "gpu-0"}]}}}
        for uid, pods in claims.items()
    ]  # fmt: skip
    data = {"kind": "DRACheckpoint", "apiVersion": "checkpoint.dra.kubelet.k8s.io/v1", "ClaimInfoStateList": entries}
    path.write_text(json.dumps({"Data": json.dumps(data), "Checksum": 12345}))


def test_the_kubelets_dra_checkpoint_names_each_claims_pods(tmp_path: Path) -> None:
    kubelet_state(tmp_path / "dra_manager_state", {"c1": [POD_A, POD_B], "c2": []})
    assert read_claim_pods(tmp_path / "dra_manager_state") == {"c1": frozenset({POD_A, POD_B}), "c2": frozenset()}
    kubelet_state(tmp_path / "dra_manager_state", {"c1": [POD_A]}, as_list=True)
    assert read_claim_pods(tmp_path / "dra_manager_state") == {"c1": frozenset({POD_A})}


@pytest.mark.parametrize("content", ["", "null", "[]", '{"Data": 5}', '{"Data": "{"}', '{"Data": "[1]"}', "x" * 10])
def test_a_kubelet_checkpoint_of_another_shape_names_no_pods(tmp_path: Path, content: str) -> None:
    (tmp_path / "dra_manager_state").write_text(content)
    assert read_claim_pods(tmp_path / "dra_manager_state") == {}
    assert read_claim_pods(tmp_path / "missing") == {}


def test_claim_devices_come_from_completed_claims_only() -> None:
    checkpoint = Checkpoint(
        "boot",
        MappingProxyType({
            "u1": PreparedClaim("PrepareCompleted", "ml", "train", (
                PreparedDevice("node-a", "gpu-0", ("gpu",), ("cdi",)),
                PreparedDevice("node-a", "gpu-1", ("gpu",), ("cdi",), admin_access=True),
            )),
            "u2": PreparedClaim("PrepareStarted", "ml", "half", (PreparedDevice("node-a", "gpu-1", ("gpu",)),)),
            "u3": PreparedClaim("PrepareCompleted", "ml", "mig", (
                PreparedDevice("node-a", "gpu-2-mig-3g40gb-9-4", ("gpu",), ("cdi",),
                               mig=CreatedMig("GPU-x", 9, 4, 4, 2, 0, "MIG-made")),
            )),
        }),
    )  # fmt: skip
    assert claim_devices(checkpoint) == (
        ClaimDevice("u1", "ml", "train", "node-a", "gpu-0"),
        ClaimDevice("u3", "ml", "mig", "node-a", "gpu-2-mig-3g40gb-9-4", "MIG-made"),
    )


def proc_entry(root: Path, pid: int, pod_uid: str) -> None:
    entry = root / str(pid)
    entry.mkdir()
    (entry / "cgroup").write_text(f"0::/kubepods/besteffort/pod{pod_uid}/abc\n")
    ticks = int((time.clock_gettime(time.CLOCK_BOOTTIME) - 5) * 100)
    (entry / "stat").write_text(f"{pid} (w) S 1 {pid} {pid} 0 -1 0 " + "0 " * 12 + f"{ticks} 0 0\n")


def series(collector: TelemetryCollector, name: str) -> dict[str, tuple[dict[str, str], float]]:
    (family,) = [f for f in collector.last.families if f.name == name]
    return {values[0]: (dict(zip(family.labels, values, strict=True)), value) for values, value in family.samples}


def test_claims_are_attributed_per_device_with_dcgm_exporters_dra_labels(sim_node, tmp_path: Path) -> None:
    driver = sim_node(NODE)
    inventory = discover()
    gpu0, gpu1, mig_gpu = inventory.gpus
    (mig,) = mig_gpu.mig_devices
    proc = tmp_path / "proc"
    proc.mkdir()
    claims = (
        ClaimDevice("u-train", "ml", "train", "dra-node", f"gpu-{gpu0.minor_number}"),  # busy
        ClaimDevice("u-idle", "ml", "idle", "dra-node", f"gpu-{gpu1.minor_number}"),  # its process does nothing
        ClaimDevice("u-mig", "research", "notebook", "dra-node", "gpu-x-mig", mig.uuid),  # no process on it
        ClaimDevice("u-gone", "ml", "gone", "dra-node", "gpu-99"),  # a device this node does not have
    )
    kubelet_state(tmp_path / "dra_manager_state", {"u-train": [POD_A], "u-idle": [POD_B], "u-mig": [POD_C]})
    proc_entry(proc, 501, POD_A)
    proc_entry(proc, 502, POD_B)
    proc_entry(proc, 503, POD_C)  # the notebook's pod runs on GPU 0, which its claim does not hold
    driver.add_process(0, 501, 4096, sm=70)
    driver.add_process(1, 502, 1024)
    driver.add_process(0, 503, 512, sm=10)
    options = TelemetryOptions(hostname="h", proc_root=proc, device_plugin_dir=tmp_path / "dp", kubelet_dir=tmp_path)
    collector = TelemetryCollector(options, lambda: AgentStatus(inventory=inventory), dict, claims=lambda: claims)
    collector.collect_once()
    collector.collect_once()  # the first window was the driver's whole buffer; this one starts at the first

    utilization = series(collector, "tessera_dra_claim_gpu_utilization_percent")
    assert set(utilization) == {"train", "idle"}, "a MIG device has no per-process utilization: no series"
    labels, value = utilization["train"]
    assert value == 70 and labels["namespace"] == "ml" and labels["dra_pool_name"] == "dra-node"
    assert labels["dra_device_name"] == f"gpu-{gpu0.minor_number}" and labels["UUID"] == gpu0.uuid
    assert labels["dra_mig_profile"] == labels["dra_mig_device_uuid"] == ""
    assert utilization["idle"][1] == 0
    idle = series(collector, "tessera_dra_claim_idle")
    assert {name: v for name, (_, v) in idle.items()} == {"train": 0, "idle": 1, "notebook": 1}
    mig_labels = idle["notebook"][0]
    assert mig_labels["dra_mig_profile"] == "3g.40gb" and mig_labels["dra_mig_device_uuid"] == mig.uuid
    assert mig_labels["GPU_I_PROFILE"] == "3g.40gb"
    memory = series(collector, "tessera_dra_claim_memory_used_bytes")
    assert memory["train"][1] == 4096 << 20 and memory["idle"][1] == 1024 << 20
    (unattributed,) = [f for f in collector.last.families if f.name == "tessera_unattributed_gpu_processes"]
    reasons = {dict(zip(unattributed.labels, v, strict=True))["reason"]: n for v, n in unattributed.samples}
    assert reasons == {"not_holding": 1}, "the notebook's process on a GPU its claim does not hold is nobody's"
    seconds = series(collector, "tessera_dra_claim_allocated_idle_seconds")
    assert seconds["idle"][1] > 0 and seconds["train"][1] == 0
    assert any(d.resource == "DRA claim idle" and d.idle_seconds > 0 for d in collector.pods.idle_devices)


def test_without_the_kubelets_word_on_a_claims_pods_no_process_is_the_claims(sim_node, tmp_path: Path) -> None:
    driver = sim_node(NODE)
    inventory = discover()
    gpu0, gpu1, _ = inventory.gpus
    proc = tmp_path / "proc"
    proc.mkdir()
    proc_entry(proc, 601, POD_A)
    driver.add_process(0, 601, 2048, sm=40)
    claims = (ClaimDevice("u1", "ml", "busy", "p", f"gpu-{gpu0.minor_number}"),
              ClaimDevice("u2", "ml", "empty", "p", f"gpu-{gpu1.minor_number}"))  # fmt: skip
    options = TelemetryOptions(hostname="h", proc_root=proc, device_plugin_dir=tmp_path / "dp", kubelet_dir=tmp_path)
    collector = TelemetryCollector(options, lambda: AgentStatus(inventory=inventory), dict, claims=lambda: claims)
    collector.collect_once()
    collector.collect_once()
    idle = series(collector, "tessera_dra_claim_idle")
    assert idle["busy"][1] == 0 and idle["empty"][1] == 1, "a device with a process on it is not called idle"
    utilization = series(collector, "tessera_dra_claim_gpu_utilization_percent")
    assert set(utilization) == {"empty"}, "unknown is not 0"
    assert resolve(claims, inventory)[0].uuid == gpu0.uuid


def test_a_broken_claims_source_leaves_the_other_metrics_alone(sim_node, tmp_path: Path, caplog) -> None:
    sim_node(NODE)
    inventory = discover()

    def broken() -> tuple[ClaimDevice, ...]:
        raise RuntimeError("the front end is restarting")

    options = TelemetryOptions(hostname="h", proc_root=tmp_path, device_plugin_dir=tmp_path / "dp")
    collector = TelemetryCollector(options, lambda: AgentStatus(inventory=inventory), dict, claims=broken)
    collector.collect_once()
    collector.collect_once()
    assert any(f.name == "tessera_gpu_up" and len(f.samples) == 3 for f in collector.last.families)
    assert len([r for r in caplog.records if "without DRA claims" in r.getMessage()]) == 1


def physical(uid: str, name: str, device: str, uuid: str) -> PhysicalClaim:
    return PhysicalClaim(ClaimDevice(uid, "ml", name, "p", device), uuid, uuid, "")


def test_podresources_names_a_claims_pods_through_its_device() -> None:
    train, shared_a, shared_b = (
        physical("u-train", "train", "gpu-0", "GPU-0"),
        physical("u-a", "a", "gpu-1", "GPU-1"),
        physical("u-b", "b", "gpu-1", "GPU-1"),  # two claims share GPU 1 (time-slicing)
    )
    users = {(c.claim.namespace, c.claim.name, "p", c.claim.device): frozenset({("ml", c.claim.name)})
             for c in (train, shared_a, shared_b)}  # fmt: skip
    found = podresources_claim_pods(
        [train, shared_a, shared_b], users, {"GPU-0": frozenset({POD_A}), "GPU-1": frozenset({POD_B, POD_C})}
    )
    assert found == {"u-train": frozenset({POD_A})}, "a device two claims share cannot tell whose a process is"
    assert podresources_claim_pods([train], {}, {"GPU-0": frozenset({POD_A})}) == {}, "not named: not known"
    assert podresources_claim_pods([train], users, {}) == {"u-train": frozenset()}, "named, no process: idle"
    two = podresources_claim_pods([train], users, {"GPU-0": frozenset({POD_A, POD_B})})
    assert two == {}, "more pods on the device than the claim serves: none is the claim's"


def test_a_pod_holding_the_device_through_the_device_plugin_is_not_counted_for_a_claim() -> None:
    from agent.telemetry.pods import _other_pods_on
    from agent.telemetry.procfs import Owner
    from agent.telemetry.usage import DeviceProcesses, ListedProcess

    devices = [DeviceProcesses("GPU-0", [ListedProcess(1, 10), ListedProcess(2, 10)], None)]
    owners = {1: Owner(1, 1.0, POD_A), 2: Owner(2, 1.0, POD_B)}
    assert _other_pods_on(devices, owners, {POD_B: {"GPU-0": ("ml", "plugin-pod")}}) == {"GPU-0": frozenset({POD_A})}


def test_podresources_wins_over_the_kubelet_checkpoint_which_is_read_only_for_claims_it_does_not_name(
    sim_node, tmp_path: Path
) -> None:
    driver = sim_node(NODE)
    inventory = discover()
    gpu0, gpu1, _ = inventory.gpus
    proc = tmp_path / "proc"
    proc.mkdir()
    proc_entry(proc, 701, POD_A)
    proc_entry(proc, 702, POD_B)
    driver.add_process(0, 701, 2048, sm=40)
    driver.add_process(1, 702, 1024, sm=20)
    named = ClaimDevice("u1", "ml", "named", "p", f"gpu-{gpu0.minor_number}")
    unnamed = ClaimDevice("u2", "ml", "unnamed", "p", f"gpu-{gpu1.minor_number}")
    kubelet_state(tmp_path / "dra_manager_state", {"u1": [POD_C], "u2": [POD_B]})  # stale for u1: PodResources wins
    answer = PodAllocations({}, {("ml", "named", "p", named.device): frozenset({("ml", "trainer")})})
    claims: tuple[ClaimDevice, ...] = (named, unnamed)
    options = TelemetryOptions(hostname="h", proc_root=proc, device_plugin_dir=tmp_path / "dp", kubelet_dir=tmp_path)
    collector = TelemetryCollector(options, lambda: AgentStatus(inventory=inventory), lambda: answer,
                                   claims=lambda: claims)  # fmt: skip
    collector.collect_once()
    collector.collect_once()
    memory = series(collector, "tessera_dra_claim_memory_used_bytes")
    assert memory["named"][1] == 2048 << 20 and memory["unnamed"][1] == 1024 << 20
    assert collector._claim_pods._key is not None, "a claim PodResources does not name: the checkpoint is read"

    claims = (named,)
    reader = collector._claim_pods = type(collector._claim_pods)(tmp_path)
    collector.collect_once()
    assert reader._key is None, "every claim named by PodResources: the kubelet's checkpoint is not read"
    assert series(collector, "tessera_dra_claim_memory_used_bytes")["named"][1] == 2048 << 20


def test_a_podresources_answer_with_an_overlong_claim_name_is_refused() -> None:
    from agent.api.podresources.v1 import api_pb2 as pr
    from agent.plugin.podresources import MAX_NAME_CHARS, PodResourcesError, _claim_users

    def answer(claim: str) -> pr.ListPodResourcesResponse:
        resource = pr.ClaimResource(driver_name="gpu.nvidia.com", pool_name="p", device_name="gpu-0")
        dynamic = pr.DynamicResource(claim_name=claim, claim_namespace="ml", claim_resources=[resource])
        container = pr.ContainerResources(name="main", dynamic_resources=[dynamic])
        return pr.ListPodResourcesResponse(
            pod_resources=[pr.PodResources(name="t", namespace="ml", containers=[container])]
        )

    assert _claim_users(answer("train")) == {("ml", "train", "p", "gpu-0"): frozenset({("ml", "t")})}
    with pytest.raises(PodResourcesError, match="longer than"):
        _claim_users(answer("x" * (MAX_NAME_CHARS + 1)))


def test_a_node_without_claims_never_loads_dra_device_naming() -> None:
    """Metrics resolve the prepared claims at every collection; on the usual node there are none, and DRA's device
    naming (and the MIG catalog under it) stays out of the process."""
    script = (
        "import sys\nfrom agent.telemetry.dra_claims import resolve\nassert resolve(iter(()), None) == []\n"
        "print(sorted(m for m in sys.modules if m.startswith(('agent.core.dra', 'agent.core.mig_catalog'))))"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
