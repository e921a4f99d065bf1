"""The DRA service called as the kubelet calls it: real gRPC on the real unix socket, devices from the simulated
node, claims shaped as resource.k8s.io/v1 returns them, CDI specs and the checkpoint on a real disk."""

from __future__ import annotations

import json
import logging
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from agent.api.dra.v1 import api_pb2 as v1
from agent.api.dra.v1beta1 import api_pb2 as v1beta1
from agent.api.drahealth.v1alpha1 import api_pb2 as health
from agent.core.dra.cdi import claim_spec, gpu_nodes
from agent.core.dra.checkpoint import PREPARE_COMPLETED, PREPARE_STARTED, prepare_started
from agent.core.dra.claims import ClaimRef, plan_prepare
from agent.core.dra.devices import DraDevice, dra_devices
from agent.core.dra.opaque import API_VERSION
from agent.dra.cdi_store import CdiStore
from agent.dra.checkpoint_store import CheckpointSaveError, CheckpointStore, checkpoint_path
from agent.dra.claims_api import ClaimsUnavailable, ClaimUnreadable, KubernetesClaimReader, KubernetesClaimStatus
from agent.dra.devnodes import capability_files, default_device_nodes
from agent.dra.names import dra_socket
from agent.dra.service import DraService
from agent.gpu.discovery import discover
from agent.gpu.driver_root import CommonEdits, DriverRoot
from agent.sim.apiserver import ApiServer
from agent.sim.driver_root import make_driver_root

DRIVER = "gpu.nvidia.com"
NODE = "node-a"
BOOT = "a85d0bcb-e4bf-483a-a4f0-b31707c072e4"
NODE_SPEC = {
    "gpus": [
        {"model": "A100-SXM4-80GB", "count": 2},
        {"model": "A100-SXM4-80GB", "mig": {"instances": ["3g.40gb", "3g.40gb"]}},
    ]
}
MIG = "gpu-2-mig-3g40gb-9-0"
V1 = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/"
V1BETA1 = "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/"
WATCH = "/v1alpha1.DRAResourceHealth/NodeWatchResources"


def uid(n: int) -> str:
    return f"0b6f3a52-9f1c-4c1e-8d0e-{n:012d}"


# ----- the API server's claims ------------------------------------------------------------------------------------


def claim(
    n: int,
    *devices: str,
    request: str = "gpu",
    configs: list[dict[str, Any]] | None = None,
    namespace: str = "ml",
    **result_fields: Any,
) -> dict[str, Any]:
    """ResourceClaim ``claim-<n>`` (uid ``uid(n)``) as resource.k8s.io/v1 returns it, allocated on this node."""
    results = [
        {"request": request, "driver": DRIVER, "pool": NODE, "device": device, **result_fields} for device in devices
    ]
    allocated: dict[str, Any] = {"results": results}
    if configs:
        allocated["config"] = configs
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": f"claim-{n}", "namespace": namespace, "uid": uid(n), "resourceVersion": "42"},
        "spec": {"devices": {"requests": [{"name": request, "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
        "status": {
            "allocation": {
                "devices": allocated,
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [NODE]}]}
                    ]
                },
            },
            "reservedFor": [{"resource": "pods", "name": f"pod-{n}", "uid": "5e5e5e5e-0000-4000-8000-000000000001"}],
        },
    }


def opaque(kind: str = "GpuConfig", **fields: Any) -> dict[str, Any]:
    """A claim's opaque config for this driver, as it appears in status.allocation.devices.config[]."""
    return {
        "source": "FromClaim",
        "opaque": {"driver": DRIVER, "parameters": {"apiVersion": API_VERSION, "kind": kind, **fields}},
    }


class Claims:
    """The API server's ResourceClaims as the DRA service reads them (the stand-in for ``KubernetesClaimReader``)."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.down = False
        self.reads: list[str] = []
        self.gate: Callable[[str], None] = lambda name: None  # a test can hold a read here

    def add(self, *claims: dict[str, Any]) -> None:
        for c in claims:
            self.objects[c["metadata"]["namespace"], c["metadata"]["name"]] = c

    def delete(self, namespace: str, name: str) -> None:
        del self.objects[namespace, name]

    def __call__(self, namespace: str, name: str, uid: str) -> dict[str, Any] | None:
        self.reads.append(name)
        self.gate(name)
        if self.down:
            raise ClaimsUnavailable("connection refused (API server down)")
        return self.objects.get((namespace, name))


def ref(n: int, namespace: str = "ml") -> ClaimRef:
    return ClaimRef(namespace, f"claim-{n}", uid(n))


# ----- the kubelet's side -----------------------------------------------------------------------------------------


class Kubelet:
    """Calls the DRA socket as the kubelet does: v1 (1.34+) or v1beta1 paths, the health stream."""

    def __init__(self, socket_path: Path) -> None:
        self.channel = grpc.insecure_channel(f"unix://{socket_path}")

    def prepare(self, *claims: ClaimRef, api: Any = v1, timeout: float = 45) -> Any:
        path = V1 if api is v1 else V1BETA1
        call = self.channel.unary_unary(
            path + "NodePrepareResources",
            request_serializer=api.NodePrepareResourcesRequest.SerializeToString,
            response_deserializer=api.NodePrepareResourcesResponse.FromString,
        )
        request = api.NodePrepareResourcesRequest(
            claims=[api.Claim(namespace=c.namespace, name=c.name, uid=c.uid) for c in claims]
        )
        return call(request, timeout=timeout)

    def prepare_async(self, *claims: ClaimRef, timeout: float = 45) -> grpc.Future:
        call = self.channel.unary_unary(
            V1 + "NodePrepareResources",
            request_serializer=v1.NodePrepareResourcesRequest.SerializeToString,
            response_deserializer=v1.NodePrepareResourcesResponse.FromString,
        )
        request = v1.NodePrepareResourcesRequest(
            claims=[v1.Claim(namespace=c.namespace, name=c.name, uid=c.uid) for c in claims]
        )
        return call.future(request, timeout=timeout)

    def unprepare(self, *claims: ClaimRef, api: Any = v1) -> Any:
        path = V1 if api is v1 else V1BETA1
        call = self.channel.unary_unary(
            path + "NodeUnprepareResources",
            request_serializer=api.NodeUnprepareResourcesRequest.SerializeToString,
            response_deserializer=api.NodeUnprepareResourcesResponse.FromString,
        )
        request = api.NodeUnprepareResourcesRequest(
            claims=[api.Claim(namespace=c.namespace, name=c.name, uid=c.uid) for c in claims]
        )
        return call(request, timeout=45)

    def watch(self, timeout: float = 10) -> Iterator[health.NodeWatchResourcesResponse]:
        call = self.channel.unary_stream(
            WATCH,
            request_serializer=health.NodeWatchResourcesRequest.SerializeToString,
            response_deserializer=health.NodeWatchResourcesResponse.FromString,
        )
        return call(health.NodeWatchResourcesRequest(), timeout=timeout)

    def close(self) -> None:
        self.channel.close()


# ----- the node ---------------------------------------------------------------------------------------------------


class Node:
    """One node's DRA driver: its stores on disk, its devices from the simulator, the service and a kubelet."""

    def __init__(self, base: Path, devices: tuple[DraDevice, ...], claims: Claims) -> None:
        self.base = base
        self.devices = {d.name: d for d in devices}
        self.claims = claims
        self.boot_id = base / "boot_id"
        self.boot_id.write_text(BOOT + "\n")
        self.cdi_root = base / "cdi"
        minors = sorted({d.gpu_minor for d in devices})
        self.driver_root = DriverRoot(make_driver_root(base / "driver", minors), proc=base / "driver" / "proc")
        self.socket = dra_socket(base / "plugins", DRIVER)
        self.checkpoint = checkpoint_path(self.socket.parent)
        self.service: DraService | None = None
        self.kubelet: Kubelet | None = None

    def start(
        self,
        *,
        cdi: CdiStore | None = None,
        checkpoints: CheckpointStore | None = None,
        devices_known: bool = True,
        **options: Any,
    ) -> DraService:
        driver = self.driver_root  # as the agent's DRA front end gives them (agent.dra.frontend)
        defaults: dict[str, Any] = {"cdi_common_edits": CommonEdits(driver)}
        if not options.get("node_wide_cdi"):
            defaults["device_nodes"] = default_device_nodes(False, driver.proc, str(driver.host_dev_root))
        self.service = DraService(
            self.socket,
            driver=DRIVER,
            pool=NODE,
            read_claim=self.claims,
            cdi=cdi or CdiStore(self.cdi_root),
            checkpoints=checkpoints or CheckpointStore(self.checkpoint, boot_id_path=self.boot_id),
            **{**defaults, **options},
        )
        if devices_known:
            self.service.update(self.devices, {})
        self.service.start()
        self.kubelet = Kubelet(self.socket)
        return self.service

    def stop(self) -> None:
        if self.kubelet is not None:
            self.kubelet.close()
            self.kubelet = None
        if self.service is not None:
            self.service.stop()
            self.service = None

    def restart(self, **options: Any) -> DraService:
        self.stop()
        return self.start(**options)

    def spec_file(self, n: int) -> Path:
        return self.cdi_root / f"k8s.gpu.nvidia.com-claim_{uid(n)}.yaml"

    def recorded(self) -> dict[str, str]:
        """The checkpoint on disk as a fresh agent would read it: claim UID -> state."""
        checkpoint = CheckpointStore(self.checkpoint, boot_id_path=self.boot_id).load()
        return {u: c.state for u, c in checkpoint.claims.items()}


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dra", dir="/tmp"))  # unix socket paths must stay short
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def devices(sim_node) -> tuple[DraDevice, ...]:
    sim_node(NODE_SPEC)
    return dra_devices(discover())


@pytest.fixture
def node(base: Path, devices: tuple[DraDevice, ...]) -> Iterator[Node]:
    node = Node(base, devices, Claims())
    node.start()
    yield node
    node.stop()


def entry_error(response: Any, n: int) -> str:
    return response.claims[uid(n)].error


def device_names(response: Any, n: int) -> list[str]:
    return [d.device_name for d in response.claims[uid(n)].devices]


# ----- Prepare ----------------------------------------------------------------------------------------------------


def test_preparing_a_gpu_writes_a_cdi_spec_that_stands_alone_and_returns_only_its_id(node: Node):
    node.claims.add(claim(1, "gpu-0"))
    response = node.kubelet.prepare(ref(1))
    assert list(response.claims) == [uid(1)]
    answer = response.claims[uid(1)]
    assert answer.error == ""
    [device] = answer.devices
    assert list(device.request_names) == ["gpu"]
    assert (device.pool_name, device.device_name) == (NODE, "gpu-0")
    assert list(device.cdi_device_ids) == [f"k8s.gpu.nvidia.com/claim={uid(1)}-gpu-0"]  # no spec of anyone else's
    assert not device.HasField("share_id")
    spec_file = node.spec_file(1)
    assert stat.S_IMODE(spec_file.stat().st_mode) == 0o644
    spec = yaml.safe_load(spec_file.read_text())
    driver = node.driver_root.root
    lib = "/usr/lib/x86_64-linux-gnu"
    gpu0 = node.devices["gpu-0"].gpu_minor
    assert spec["cdiVersion"] == "0.5.0" and spec["kind"] == "k8s.gpu.nvidia.com/claim"
    assert spec["devices"] == [
        {
            "name": f"{uid(1)}-gpu-0",
            "containerEdits": {
                "deviceNodes": [{"path": f"/dev/nvidia{gpu0}", "hostPath": f"{driver}/dev/nvidia{gpu0}"}]
            },
        }
    ]
    edits = spec["containerEdits"]
    assert edits["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]
    assert [n["path"] for n in edits["deviceNodes"]] == [
        "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset",
    ]  # fmt: skip
    mounts = {m["containerPath"]: m for m in edits["mounts"]}
    assert mounts[f"{lib}/libcuda.so.550.54.15"]["hostPath"] == f"{driver}{lib}/libcuda.so.550.54.15"
    assert "ro" in mounts[f"{lib}/libcuda.so.550.54.15"]["options"]
    assert {f"{lib}/libnvidia-ml.so.550.54.15", f"{lib}/libcuda.so.1", "/usr/bin/nvidia-smi"} <= set(mounts)
    assert "/lib/firmware/nvidia/550.54.15" in mounts
    assert node.service.prepared() == {uid(1): ("gpu-0",)}
    assert node.recorded() == {uid(1): PREPARE_COMPLETED}
    socket_mode = node.socket.stat().st_mode
    assert stat.S_ISSOCK(socket_mode) and stat.S_IMODE(socket_mode) == 0o600


def test_a_mig_device_gets_its_gpus_node_and_its_capability_nodes_from_the_drivers_mig_minors(node: Node):
    node.claims.add(claim(1, MIG, request="mig"))
    [device] = node.kubelet.prepare(ref(1)).claims[uid(1)].devices
    assert list(device.cdi_device_ids) == [f"k8s.gpu.nvidia.com/claim={uid(1)}-{MIG}"]
    spec = yaml.safe_load(node.spec_file(1).read_text())
    mig = node.devices[MIG]
    gi_minor = 3 + mig.gpu_minor * 135 + mig.gi_id * 9  # the driver's mig-minors table (the simulator writes it)
    assert spec["devices"][0]["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/nvidia2", "hostPath": f"{node.driver_root.root}/dev/nvidia2"},
        {"path": f"/dev/nvidia-caps/nvidia-cap{gi_minor}", "type": "c", "major": 508, "minor": gi_minor,
         "permissions": "rw"},
        {"path": f"/dev/nvidia-caps/nvidia-cap{gi_minor + 1 + mig.ci_id}", "type": "c", "major": 508,
         "minor": gi_minor + 1 + mig.ci_id, "permissions": "rw"},
    ]  # fmt: skip


def test_a_mig_minors_table_without_the_devices_minors_refuses_its_claim_naming_it_and_prepares_nothing(
    node: Node,
):
    mig = node.devices[MIG]
    table = node.driver_root.proc / "driver/nvidia-caps/mig-minors"
    ci_key = f"gpu{mig.gpu_minor}/gi{mig.gi_id}/ci{mig.ci_id}/access"
    table.write_text("".join(line for line in table.read_text().splitlines(True) if not line.startswith(ci_key)))
    node.claims.add(claim(1, MIG, request="mig"), claim(2, "gpu-0"))
    response = node.kubelet.prepare(ref(1), ref(2))
    error = entry_error(response, 1)
    assert f"{table} lists no minor for {ci_key}; is it the NVIDIA driver's?" in error, error
    assert device_names(response, 1) == [] and not node.spec_file(1).exists()
    assert uid(1) not in node.recorded() and uid(1) not in node.service.prepared()
    assert entry_error(response, 2) == "" and device_names(response, 2) == ["gpu-0"]  # the rest of the batch


def test_with_node_wide_cdi_the_ids_name_nvidia_ctks_spec_as_before(node: Node):
    node.restart(node_wide_cdi=True, cdi_common_edits=None)
    node.claims.add(claim(1, "gpu-0"), claim(2, MIG, request="mig"))
    response = node.kubelet.prepare(ref(1), ref(2))
    [gpu] = response.claims[uid(1)].devices
    assert list(gpu.cdi_device_ids) == [
        f"k8s.gpu.nvidia.com/claim={uid(1)}-gpu-0",  # first: the kubelet shows it as the device's resourceID
        f"nvidia.com/gpu={node.devices['gpu-0'].uuid}",  # the node-wide spec brings the driver libraries
    ]
    [mig] = response.claims[uid(2)].devices
    assert list(mig.cdi_device_ids)[1] == f"nvidia.com/gpu={node.devices[MIG].uuid}"  # nvidia-ctk's MIG entry
    spec = yaml.safe_load(node.spec_file(2).read_text())
    assert spec["devices"][0]["containerEdits"]["deviceNodes"] == [{"path": "/dev/nvidia2"}]
    assert spec["containerEdits"] == {"env": ["NVIDIA_VISIBLE_DEVICES=void"]}


def test_without_a_driver_prepare_fails_naming_what_is_missing_and_the_flag_and_prepares_nothing(node: Node):
    empty = node.base / "no-driver"
    empty.mkdir()
    node.restart(cdi_common_edits=CommonEdits(DriverRoot(empty)))
    node.claims.add(claim(1, "gpu-0"), claim(2, MIG, request="mig"))
    response = node.kubelet.prepare(ref(1), ref(2))
    for n in (1, 2):
        error = entry_error(response, n)
        assert "/dev/nvidiactl, libcuda.so.<version>, libnvidia-ml.so.<version> not found" in error, error
        assert f"driver root {empty}" in error and "--driver-root" in error
        assert device_names(response, n) == [] and not node.spec_file(n).exists()
    assert node.recorded() == {}
    node.restart()  # the driver is found (--driver-root fixed): the kubelet's retry prepares the claim
    assert entry_error(node.kubelet.prepare(ref(1)), 1) == ""


def driver_proc(root: Path, device: DraDevice, gi_minor: int, ci_minor: int) -> Path:
    """``root`` as the NVIDIA driver's /proc with the capability files of ``device`` (a MIG device)."""
    gi_access, ci_access = capability_files(root, device.gpu_minor, device.gi_id, device.ci_id)
    ci_access.parent.mkdir(parents=True)
    gi_access.write_text(f"DeviceFileMinor: {gi_minor}\nDeviceFileMode: 292\n")
    ci_access.write_text(f"DeviceFileMinor: {ci_minor}\nDeviceFileMode: 292\n")
    (root / "devices").write_text("Character devices:\n195 nvidia\n508 nvidia-caps\n\nBlock devices:\n  7 loop\n")
    return root


def test_without_node_wide_cdi_a_mig_device_gets_its_capability_nodes_from_the_driver(node: Node):
    proc = driver_proc(node.base / "proc", node.devices[MIG], gi_minor=21, ci_minor=22)
    node.restart(node_wide_cdi=False, device_nodes=default_device_nodes(False, proc))
    other_mig = next(name for name, d in node.devices.items() if d.kind == "mig" and name != MIG)
    node.claims.add(claim(1, MIG, request="mig"), claim(2, other_mig, request="mig"), claim(3, "gpu-0"))
    response = node.kubelet.prepare(ref(1), ref(2), ref(3))
    [device] = response.claims[uid(1)].devices
    assert list(device.cdi_device_ids) == [f"k8s.gpu.nvidia.com/claim={uid(1)}-{MIG}"]  # the claim spec alone
    spec = yaml.safe_load(node.spec_file(1).read_text())
    assert spec["devices"][0]["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/nvidia2"},
        {"path": "/dev/nvidia-caps/nvidia-cap21", "type": "c", "major": 508, "minor": 21, "permissions": "rw"},
        {"path": "/dev/nvidia-caps/nvidia-cap22", "type": "c", "major": 508, "minor": 22, "permissions": "rw"},
    ]
    gi = node.devices[other_mig].gi_id  # the driver published no capability files for it
    assert f"cannot read {proc}/driver/nvidia/capabilities/gpu2/mig/gi{gi}/access" in entry_error(response, 2)
    assert not node.spec_file(2).exists() and uid(2) not in node.recorded()
    assert entry_error(response, 3) == "" and device_names(response, 3) == ["gpu-0"]


@pytest.mark.skipif(Path("/proc/driver/nvidia").exists(), reason="a real NVIDIA driver is loaded here")
def test_by_default_without_node_wide_cdi_the_capability_nodes_are_read_from_the_hosts_proc(node: Node):
    node.restart(node_wide_cdi=False, device_nodes=None)  # the service's own default: the host's /proc
    node.claims.add(claim(1, MIG, request="mig"))
    error = entry_error(node.kubelet.prepare(ref(1)), 1)
    assert "cannot read /proc/driver/nvidia/capabilities/gpu2/mig/gi" in error


def test_a_second_prepare_gives_the_same_answer_and_leaves_the_spec_alone(node: Node):
    node.claims.add(claim(1, "gpu-0", "gpu-1"))
    first = node.kubelet.prepare(ref(1))
    before = node.spec_file(1).stat()
    again = node.kubelet.prepare(ref(1))
    after = node.spec_file(1).stat()
    assert again == first
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert node.claims.reads == ["claim-1"]  # answered from the checkpoint, the API server not asked again


def test_a_spec_gone_after_a_reboot_of_the_cdi_directory_is_written_again(node: Node):
    node.claims.add(claim(1, "gpu-0"))
    first = node.kubelet.prepare(ref(1))
    written = node.spec_file(1).read_text()
    node.spec_file(1).unlink()  # /var/run/cdi is tmpfs
    assert node.kubelet.prepare(ref(1)) == first
    assert node.spec_file(1).read_text() == written


def test_the_share_id_of_a_consumable_capacity_result_goes_back_on_v1(node: Node):
    share = "9a9a9a9a-0000-4000-8000-000000000abc"
    node.claims.add(claim(1, "gpu-0", shareID=share))
    [device] = node.kubelet.prepare(ref(1)).claims[uid(1)].devices
    assert device.HasField("share_id") and device.share_id == share


def hold_gpu1(node: Node) -> None:
    node.claims.add(claim(9, "gpu-1", namespace="other"))
    assert entry_error(node.kubelet.prepare(ref(9, "other")), 9) == ""


def unhealthy_gpu1(node: Node) -> None:
    node.service.update(node.devices, {"gpu-1": "XID 79 (GPU has fallen off the bus)"})


BAD_CLAIMS: dict[str, tuple[Callable[[Node], None], dict[str, Any], list[str]]] = {
    "device prepared for another claim": (
        hold_gpu1,
        claim(2, "gpu-1"),
        [f"already allocated to different claim {uid(9)}", "other/claim-9"],
    ),
    "unhealthy device": (unhealthy_gpu1, claim(2, "gpu-1"), ["gpu-1", "Unhealthy", "XID 79"]),
    "unknown device": (lambda node: None, claim(2, "gpu-9"), ['"gpu-9" does not exist on this node']),
    "MPS asked for": (
        lambda node: None,
        claim(2, "gpu-1", configs=[opaque(sharing={"strategy": "MPS"})]),
        ["its MPS daemon (dra/", "is not ready", "nothing was left prepared"],
    ),
    "unknown config kind": (
        lambda node: None,
        claim(2, "gpu-1", configs=[opaque("FooConfig")]),
        ["error decoding config parameters", "FooConfig"],
    ),
}


@pytest.mark.parametrize("case", list(BAD_CLAIMS))
def test_one_bad_claim_in_a_batch_gets_an_error_and_the_good_one_is_prepared(node: Node, case: str):
    setup, bad, reasons = BAD_CLAIMS[case]
    setup(node)
    node.claims.add(claim(1, "gpu-0"), bad)
    response = node.kubelet.prepare(ref(1), ref(2))
    assert set(response.claims) == {uid(1), uid(2)}
    assert entry_error(response, 1) == "" and device_names(response, 1) == ["gpu-0"]
    error = entry_error(response, 2)
    assert error.startswith(f"ResourceClaim ml/claim-2 (uid {uid(2)}): ")
    for reason in reasons:
        assert reason in error
    assert not response.claims[uid(2)].devices
    assert not node.spec_file(2).exists()  # nothing half-prepared for the bad one
    assert uid(2) not in node.service.prepared() and uid(2) not in node.recorded()
    assert node.spec_file(1).exists() and node.recorded()[uid(1)] == PREPARE_COMPLETED


def test_a_claim_deleted_before_prepare_is_a_retriable_error(node: Node):
    node.claims.add(claim(1, "gpu-0"))
    response = node.kubelet.prepare(ref(1), ref(2))
    assert entry_error(response, 1) == ""
    assert "not found in the API server" in entry_error(response, 2)
    assert "ml/claim-2" in entry_error(response, 2)


def test_an_api_server_outage_fails_each_claim_retriably_and_the_retry_succeeds(node: Node):
    node.claims.add(claim(1, "gpu-0"), claim(2, "gpu-1"))
    node.claims.down = True
    response = node.kubelet.prepare(ref(1), ref(2))
    for n in (1, 2):
        assert "cannot read the claim: connection refused (API server down)" in entry_error(response, n)
        assert "retries" in entry_error(response, n)
    assert node.service.prepared() == {} and list(node.cdi_root.glob("*.yaml")) == []
    node.claims.down = False
    response = node.kubelet.prepare(ref(1), ref(2))
    assert [entry_error(response, n) for n in (1, 2)] == ["", ""]


def test_a_claim_the_api_server_sends_unreadable_is_the_claims_error_not_an_outage(
    node: Node, caplog: pytest.LogCaptureFixture
):
    node.claims.add(claim(1, "gpu-0"), claim(2, "gpu-1"))

    def unreadable(name: str) -> None:
        if name == "claim-1":
            raise ClaimUnreadable("ResourceClaim ml/claim-1 cannot be read as JSON (Exceeds the limit …)")

    node.claims.gate = unreadable
    with caplog.at_level(logging.WARNING, logger="agent.dra.prepare"):
        response = node.kubelet.prepare(ref(1), ref(2))
    assert "ResourceClaim ml/claim-1 cannot be read as JSON" in entry_error(response, 1)
    assert "internal error" not in entry_error(response, 1) and "retries" not in entry_error(response, 1)
    assert "retriable=False" in caplog.text
    assert entry_error(response, 2) == ""  # the other claim of the batch is prepared


def test_an_unwritable_cdi_directory_is_a_per_claim_error_naming_it(node: Node):
    (node.base / "file").write_text("a regular file, so nothing can be created under it (even by root)")
    node.restart(cdi=CdiStore(node.base / "file" / "cdi"))
    node.claims.add(claim(1, "gpu-0"))
    error = entry_error(node.kubelet.prepare(ref(1)), 1)
    assert "ml/claim-1" in error and str(node.base / "file" / "cdi") in error
    assert node.service.prepared() == {} and node.recorded() == {}


class FailingSecondSave(CheckpointStore):
    """A disk that fails the write recording PrepareCompleted (after the CDI spec is written)."""

    saves = 0

    def save(self, checkpoint):
        self.saves += 1
        if self.saves == 2:
            raise CheckpointSaveError(f"cannot write the DRA checkpoint {self.path}: No space left on device")
        super().save(checkpoint)


def test_a_failure_after_the_spec_is_written_rolls_the_claim_back(node: Node):
    node.restart(checkpoints=FailingSecondSave(node.checkpoint, boot_id_path=node.boot_id))
    node.claims.add(claim(1, "gpu-0"))
    error = entry_error(node.kubelet.prepare(ref(1)), 1)
    assert "No space left on device" in error and "nothing was left prepared" in error
    assert not node.spec_file(1).exists()
    assert node.service.prepared() == {} and node.recorded() == {}
    assert entry_error(node.kubelet.prepare(ref(1)), 1) == ""  # the kubelet's retry


def test_a_claim_left_prepare_started_by_a_crash_is_rolled_back_and_prepared_again(node: Node):
    node.stop()
    node.claims.add(claim(1, "gpu-0"))
    plan = plan_prepare(ref(1), node.claims.objects["ml", "claim-1"], driver=DRIVER, pool=NODE, devices=node.devices)
    store = CheckpointStore(node.checkpoint, boot_id_path=node.boot_id)
    store.save(prepare_started(store.load(), plan))
    node.cdi_root.mkdir()
    node.spec_file(1).write_text("half")  # the crash came after the spec was begun
    service = node.start()
    assert service.prepared() == {uid(1): ("gpu-0",)}  # a GPU mid-prepare stays with DRA
    assert node.recorded() == {uid(1): PREPARE_STARTED}
    assert entry_error(node.kubelet.prepare(ref(1)), 1) == ""
    assert node.recorded() == {uid(1): PREPARE_COMPLETED}
    assert yaml.safe_load(node.spec_file(1).read_text())["devices"][0]["name"] == f"{uid(1)}-gpu-0"


def test_two_calls_racing_for_one_device_prepare_it_once(node: Node):
    node.claims.add(claim(1, "gpu-0"), claim(2, "gpu-0"))
    calls = [node.kubelet.prepare_async(ref(n)) for n in (1, 2)]
    errors = [entry_error(call.result(), n) for call, n in zip(calls, (1, 2), strict=True)]
    assert sorted(bool(e) for e in errors) == [False, True]
    assert "already allocated to different claim" in next(e for e in errors if e)
    assert len(node.service.prepared()) == 1


def test_claims_still_queued_when_the_kubelet_gives_up_are_not_started(node: Node):
    release = threading.Event()
    node.claims.gate = lambda name: release.wait(10) if name == "claim-1" else None
    node.claims.add(claim(1, "gpu-0"), claim(2, "gpu-1"))
    with pytest.raises(grpc.RpcError) as gave_up:
        node.kubelet.prepare(ref(1), ref(2), timeout=0.5)
    assert gave_up.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    release.set()
    follow = node.kubelet.prepare(ref(3))  # queued behind the abandoned batch: answered once that is done
    assert "not found" in entry_error(follow, 3)
    assert node.claims.reads == ["claim-1", "claim-3"]  # claim-2 was never started
    assert set(node.service.prepared()) == {uid(1)}  # the claim under way was finished (the retry finds it)


def test_before_the_devices_are_known_prepare_asks_for_a_retry_and_health_waits(node: Node):
    service = node.restart(devices_known=False)
    node.claims.add(claim(1, "gpu-0"))
    assert "devices are not known yet" in entry_error(node.kubelet.prepare(ref(1)), 1)
    stream = node.kubelet.watch()
    service.update(node.devices, {})  # the first list the stream sends is the real one, not an empty one
    assert list(statuses(next(stream))) == list(node.devices)
    stream.cancel()
    assert entry_error(node.kubelet.prepare(ref(1)), 1) == ""


def test_each_prepare_and_unprepare_is_logged_with_the_claim_and_its_devices(node: Node, caplog):
    node.claims.add(claim(1, "gpu-0", "gpu-1"))
    with caplog.at_level(logging.INFO, logger="agent.dra.prepare"):
        node.kubelet.prepare(ref(1))
        node.kubelet.unprepare(ref(1))
    lines = [r.getMessage() for r in caplog.records]
    assert any(
        line.startswith("claim prepared claim=ml/claim-1 uid=" + uid(1)) and "devices=gpu-0,gpu-1" in line
        for line in lines
    )
    assert any(line.startswith(f"claim unprepared claim=ml/claim-1 uid={uid(1)} devices=gpu-0,gpu-1") for line in lines)


def test_a_status_report_past_the_api_servers_bound_is_logged_naming_the_claim_and_the_prepare_stands(
    node: Node, caplog
):
    """status.devices already holds 31 entries (30 of a NIC driver, and that driver's entry for a share of one NIC:
    not ours to delete): two more would pass the API server's 32. The report is refused whole, logged with the
    claim; the claim is prepared all the same."""
    api = ApiServer(git_version="v1.37.0")
    api.start()
    try:
        nic_driver = "nic.example.com"
        requests = [
            {"name": "gpu", "exactly": {"deviceClassName": DRIVER, "count": 2}},
            {"name": "nic", "exactly": {"deviceClassName": nic_driver, "count": 30}},
        ]
        created = api.create(
            "resourceclaims",
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaim",
                "metadata": {"name": "wide", "namespace": "ml"},
                "spec": {"devices": {"requests": requests}},
            },
        )
        nics = [{"driver": nic_driver, "pool": NODE, "device": f"eth{i}"} for i in range(30)]
        gpus = [{"driver": DRIVER, "pool": NODE, "device": f"gpu-{i}"} for i in range(2)]
        results = [{"request": "gpu", **g} for g in gpus] + [{"request": "nic", **n} for n in nics]
        created["status"] = {
            "allocation": {"devices": {"results": results}},
            "reservedFor": [{"resource": "pods", "name": "pod-w", "uid": "5e5e5e5e-0000-4000-8000-000000000002"}],
            "devices": [*nics, {**nics[0], "shareID": uid(0)}],
        }
        wide = api.update("resourceclaims", created, status=True)
        node.claims.add(wide)
        node.restart(claim_status=KubernetesClaimStatus(api.api_client(), DRIVER, NODE))
        wide_ref = ClaimRef("ml", "wide", wide["metadata"]["uid"])
        with caplog.at_level(logging.WARNING, logger="agent.dra.prepare"):
            response = node.kubelet.prepare(wide_ref)
            answer = response.claims[wide_ref.uid]
            assert answer.error == "" and [d.device_name for d in answer.devices] == ["gpu-0", "gpu-1"]
            deadline = time.monotonic() + 10  # the report is written after the kubelet has its answer
            while not caplog.records and time.monotonic() < deadline:
                threading.Event().wait(0.01)
        messages = [record.getMessage() for record in caplog.records]
        assert len(messages) == 1, f"one warning expected, the agent said: {messages}"
        [message] = messages
        assert "claim status.devices not written claim=ml/wide" in message, message
        assert "status.devices would hold 33 entries" in message and "more than the 32" in message
        assert api.get("resourceclaims", "wide", "ml")["status"]["devices"] == wide["status"]["devices"]
        assert wide_ref.uid in node.service.prepared()  # a report only: the Prepare stands
    finally:
        api.stop()


def test_an_empty_request_gets_an_empty_answer(node: Node):
    assert node.kubelet.prepare() == v1.NodePrepareResourcesResponse()
    assert node.kubelet.unprepare() == v1.NodeUnprepareResourcesResponse()
    assert node.kubelet.prepare(api=v1beta1) == v1beta1.NodePrepareResourcesResponse()
    assert node.claims.reads == []


# ----- Unprepare --------------------------------------------------------------------------------------------------


def test_unprepare_removes_the_spec_and_the_record_and_frees_the_device(node: Node):
    node.claims.add(claim(1, "gpu-0"), claim(2, "gpu-0"))
    node.kubelet.prepare(ref(1))
    response = node.kubelet.unprepare(ref(1))
    assert list(response.claims) == [uid(1)] and response.claims[uid(1)].error == ""
    assert not node.spec_file(1).exists()
    assert node.service.prepared() == {} and node.recorded() == {}
    assert entry_error(node.kubelet.prepare(ref(2)), 2) == ""


def test_unprepare_of_an_unknown_claim_succeeds(node: Node):
    response = node.kubelet.unprepare(ref(7), ClaimRef("ml", "odd", "not-a-uid"))
    assert set(response.claims) == {uid(7), "not-a-uid"}
    assert all(entry.error == "" for entry in response.claims.values())


def test_unprepare_works_after_the_claim_was_deleted_from_the_api_server(node: Node):
    node.claims.add(claim(1, "gpu-0"))
    node.kubelet.prepare(ref(1))
    node.claims.delete("ml", "claim-1")
    node.claims.down = True  # nor does it need the API server at all
    assert node.kubelet.unprepare(ref(1)).claims[uid(1)].error == ""
    assert not node.spec_file(1).exists() and node.service.prepared() == {}


# ----- restarts, reboots, a corrupt checkpoint --------------------------------------------------------------------


def test_after_an_agent_restart_prepared_claims_are_kept_and_their_devices_refused_to_others(node: Node):
    node.claims.add(claim(1, "gpu-0"), claim(2, "gpu-0"))
    first = node.kubelet.prepare(ref(1))
    service = node.restart()
    assert service.prepared() == {uid(1): ("gpu-0",)}
    assert node.kubelet.prepare(ref(1)) == first
    error = entry_error(node.kubelet.prepare(ref(2)), 2)
    assert f"already allocated to different claim {uid(1)}" in error
    assert node.claims.reads == ["claim-1", "claim-2"]


def test_a_reboot_drops_what_was_prepared_before_it(node: Node):
    node.claims.add(claim(1, "gpu-0"), claim(2, "gpu-0"))
    node.kubelet.prepare(ref(1))
    node.stop()
    node.boot_id.write_text("f00dcafe-0000-4000-8000-000000000001\n")
    service = node.start()
    assert service.prepared() == {}
    assert entry_error(node.kubelet.prepare(ref(2)), 2) == ""


def test_a_corrupt_checkpoint_is_set_aside_and_the_agent_serves_from_empty(node: Node, caplog):
    node.claims.add(claim(1, "gpu-0"))
    node.kubelet.prepare(ref(1))
    node.stop()
    node.checkpoint.write_bytes(node.checkpoint.read_bytes()[:-20])  # torn
    with caplog.at_level(logging.ERROR):
        service = node.start()
    assert service.prepared() == {}
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any(str(node.checkpoint) in m and "not valid JSON" in m for m in errors)
    assert len(list(node.checkpoint.parent.glob("tessera-checkpoint.json.corrupt-*"))) == 1
    assert entry_error(node.kubelet.prepare(ref(1)), 1) == ""  # and it serves
    assert service.sweep_stale_specs() == []  # claim-1's spec is its own again


def test_stale_specs_of_forgotten_claims_are_swept_on_request(node: Node):
    node.claims.add(claim(1, "gpu-0"))
    node.kubelet.prepare(ref(1))
    node.spec_file(2).write_text(yaml.safe_dump(claim_spec(uid(2), {"gpu-1": gpu_nodes(1)})))
    assert node.service.sweep_stale_specs() == [uid(2)]
    assert node.spec_file(1).exists() and not node.spec_file(2).exists()


# ----- v1beta1 ----------------------------------------------------------------------------------------------------


def test_a_v1beta1_kubelet_gets_the_same_behaviour(node: Node):
    node.claims.add(claim(1, "gpu-0", shareID="9a9a9a9a-0000-4000-8000-000000000abc"), claim(2, "gpu-0"))
    response = node.kubelet.prepare(ref(1), ref(2), api=v1beta1)
    assert isinstance(response, v1beta1.NodePrepareResourcesResponse)
    [device] = response.claims[uid(1)].devices
    assert (device.device_name, list(device.request_names)) == ("gpu-0", ["gpu"])
    assert device.cdi_device_ids[0] == f"k8s.gpu.nvidia.com/claim={uid(1)}-gpu-0"
    assert "already allocated to different claim" in entry_error(response, 2)
    assert node.kubelet.prepare(ref(1), api=v1beta1).claims[uid(1)] == response.claims[uid(1)]
    # the v1 answer for the same claim carries the share ID the v1beta1 protocol has no field for
    assert node.kubelet.prepare(ref(1)).claims[uid(1)].devices[0].share_id == "9a9a9a9a-0000-4000-8000-000000000abc"
    assert node.kubelet.unprepare(ref(1), api=v1beta1).claims[uid(1)].error == ""
    assert node.service.prepared() == {}


# ----- health -----------------------------------------------------------------------------------------------------


def statuses(message: health.NodeWatchResourcesResponse) -> dict[str, tuple[int, str]]:
    return {d.device.device_name: (d.health, d.message) for d in message.devices}


def test_the_health_stream_sends_the_whole_list_and_again_on_every_change(node: Node):
    stream = node.kubelet.watch()
    first = next(stream)
    assert list(statuses(first)) == list(node.devices)  # every device of the pool, in order
    assert {d.device.pool_name for d in first.devices} == {NODE}
    assert all(d.health == health.HEALTHY for d in first.devices)
    assert all(d.health_check_timeout_seconds == 60 for d in first.devices)
    assert all(abs(d.last_updated_time - time.time()) < 60 for d in first.devices)

    node.service.update(node.devices, {"gpu-1": "XID 79 (GPU has fallen off the bus)"}, unknown={MIG})
    second = statuses(next(stream))
    assert list(second) == list(node.devices)  # the complete list again, not only what changed
    assert second["gpu-1"] == (health.UNHEALTHY, "XID 79 (GPU has fallen off the bus)")
    assert second[MIG] == (health.UNKNOWN, "")
    assert second["gpu-0"] == (health.HEALTHY, "")

    node.service.update(node.devices, {})
    third = statuses(next(stream))
    assert all(status == (health.HEALTHY, "") for status in third.values())
    stream.cancel()


def test_the_health_stream_repeats_the_list_before_the_kubelet_would_time_it_out(node: Node):
    node.restart(health_timeout_seconds=3)
    stream = node.kubelet.watch()
    first = next(stream)
    started = time.monotonic()
    second = next(stream)  # nothing changed: the list comes again within a third of the timeout
    assert time.monotonic() - started < 3
    assert statuses(second) == statuses(first)
    assert second.devices[0].health_check_timeout_seconds == 3
    stream.cancel()


def test_stopping_ends_the_health_stream_and_removes_the_socket(node: Node):
    stream = node.kubelet.watch()
    next(stream)
    node.service.stop()
    assert list(stream) == []  # a clean end of stream
    assert not node.socket.exists()


# ----- the Kubernetes client reader -------------------------------------------------------------------------------


class _ApiServer(BaseHTTPRequestHandler):
    answers: dict[str, tuple[int, dict[str, Any] | bytes]] = {}

    def do_GET(self) -> None:
        status, body = self.answers.get(self.path, (404, {"kind": "Status", "code": 404, "reason": "NotFound"}))
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


def test_the_kubernetes_reader_tells_not_found_from_an_outage():
    import kubernetes

    server = ThreadingHTTPServer(("127.0.0.1", 0), _ApiServer)
    with ThreadPoolExecutor(1) as pool:
        pool.submit(server.serve_forever)
        configuration = kubernetes.client.Configuration()
        configuration.host = f"http://127.0.0.1:{server.server_address[1]}"
        reader = KubernetesClaimReader(kubernetes.client.ApiClient(configuration))
        _ApiServer.answers = {
            "/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims/claim-1": (200, claim(1, "gpu-0")),
            "/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims/claim-3": (503, {"kind": "Status", "code": 503}),
            # a number no JSON decoder here reads (Python's limit: 4,300 digits): the claim's fault, not an outage
            "/apis/resource.k8s.io/v1/namespaces/ml/resourceclaims/claim-4": (200, b'{"spec": {"x": 1' + b"0" * 5000
                                                                                + b"}}"),
        }  # fmt: skip
        try:
            assert reader("ml", "claim-1", uid(1)) == claim(1, "gpu-0")
            assert reader("ml", "claim-2", uid(2)) is None
            with pytest.raises(ClaimsUnavailable, match=r"HTTP 503 .*ml/claim-3"):
                reader("ml", "claim-3", uid(3))
            with pytest.raises(ClaimUnreadable, match="ResourceClaim ml/claim-4 cannot be read as JSON"):
                reader("ml", "claim-4", uid(4))
        finally:
            server.shutdown()
            server.server_close()
        with pytest.raises(ClaimsUnavailable, match="could not be reached for ResourceClaim ml/claim-1"):
            reader("ml", "claim-1", uid(1))


def test_prepare_and_unprepare_calls_are_timed_as_the_kubelets_dra_operations(node: Node):
    from agent.telemetry.latency import OperationLatency

    latency = OperationLatency()
    node.restart(latency=latency)
    node.claims.add(claim(1, "gpu-0"))
    node.kubelet.prepare(ref(1))
    node.kubelet.prepare(ref(2))  # not in the API server: that claim fails
    node.kubelet.unprepare(ref(1))
    node.kubelet.prepare()  # the liveness probe (no claims) is not an operation
    assert _counts(latency) == {
        ("PrepareResources", "false"): 1,
        ("PrepareResources", "true"): 1,
        ("UnprepareResources", "false"): 1,
    }


def _counts(latency: Any) -> dict[tuple[str, ...], int]:
    """Calls per (operation_name, is_error) of the DRA histogram, as the metrics show them."""
    (family,) = [f for f in latency.families("node-a") if f.name == "tessera_dra_operations_duration_seconds"]
    names = family.labels
    return {tuple(v for n, v in zip(names, values, strict=True) if n in ("operation_name", "is_error")):
            buckets.cumulative[-1] for values, buckets in family.samples}  # fmt: skip
