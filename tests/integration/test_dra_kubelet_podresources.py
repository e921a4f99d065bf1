"""The node's one PodResources socket (``KubeletEmulator``) listing the claims of the DRA kubelet emulator's pods, as
a kubelet of each release does, and the agent's PodResources client reading it (``agent.plugin.podresources``).

After a kubelet restart a claim prepared again holds its devices twice up to 1.36 (kubernetes#140471): PodResources
then lists each of its devices, with its CDI IDs, twice for every pod of the claim. The agent must count each
claim device's users once all the same.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from agent.api.podresources.v1 import api_pb2 as pr
from agent.api.podresources.v1 import api_pb2_grpc as pr_grpc
from agent.plugin.podresources import list_pod_resources
from agent.sim.apiserver import ApiServer
from agent.sim.kubelet import DraKubeletEmulator, KubeletEmulator
from tests.integration.test_dra_kubelet import DRIVER, NODE, POD_UID, Plugin, allocated_claim, registered

SECOND_UID = "0b6b3d4e-1234-4cde-8f00-123456789abd"


class Node:
    def __init__(self, base: Path, api: ApiServer) -> None:
        self.base = base
        self.api = api
        self.kubelet = KubeletEmulator(base / "dp", base / "pr" / "kubelet.sock")
        self.dra: DraKubeletEmulator | None = None
        self.plugin: Plugin | None = None

    @property
    def socket(self) -> Path:
        return self.base / "pr" / "kubelet.sock"

    def start(self, **options: Any) -> DraKubeletEmulator:
        self.kubelet.start()
        self.dra = DraKubeletEmulator(self.base / "plugins_registry", NODE, self.api.api_client(), **options)
        self.dra.start()
        self.kubelet.serve_dra(self.dra)
        self.plugin = Plugin(self.base, self.api, ("v1.DRAPlugin", "v1beta1.DRAPlugin")).start()
        registered(self.dra, self.plugin)
        return self.dra

    def listed(self) -> dict[tuple[str, str], list[tuple[str, str, tuple[str, ...]]]]:
        """(pod, container) -> [(claim, device, CDI IDs)] for every claim device PodResources lists."""
        with grpc.insecure_channel(f"unix://{self.socket}") as channel:
            response = pr_grpc.PodResourcesListerStub(channel).List(pr.ListPodResourcesRequest(), timeout=5)
        return {
            (pod.name, container.name): [
                (claim.claim_name, device.device_name, tuple(c.name for c in device.cdi_devices))
                for claim in container.dynamic_resources
                for device in claim.claim_resources
            ]
            for pod in response.pod_resources
            for container in pod.containers
        }

    def stop(self) -> None:
        if self.plugin is not None:
            self.plugin.stop()
        if self.dra is not None:
            self.dra.stop()
        self.kubelet.stop()


@pytest.fixture
def make_node() -> Iterator[Callable[..., Node]]:
    base = Path(tempfile.mkdtemp(prefix="drpr", dir="/tmp"))  # unix socket paths must stay short
    api = ApiServer()
    api.start()
    api.add_node(NODE)
    nodes: list[Node] = []

    def make(**options: Any) -> Node:
        node = Node(base, api)
        nodes.append(node)
        node.start(**options)
        return node

    try:
        yield make
    finally:
        for node in nodes:
            node.stop()
        api.stop()
        shutil.rmtree(base, ignore_errors=True)


def test_after_a_kubelet_restart_podresources_lists_a_reprepared_claims_devices_twice(make_node) -> None:
    node = make_node()  # a 1.36 kubelet: before the fix of kubernetes#140471
    dra = node.dra
    claim = allocated_claim(node.api, "shared", [("gpu", "gpu-0")])
    cdi = (f"k8s.{DRIVER}/claim={claim['metadata']['uid']}-gpu-0",)
    dra.run_pod("default", "p1", POD_UID, [("gpu", "shared")], {"main": [("gpu", None)]})
    assert node.listed()[("p1", "main")] == [("shared", "gpu-0", cdi)]

    dra.restart()
    registered(dra, node.plugin, times=2)
    dra.run_pod("default", "p2", SECOND_UID, [("gpu", "shared")], {"main": [("gpu", None)]})

    listed = node.listed()
    assert listed[("p1", "main")] == [("shared", "gpu-0", cdi)] * 2  # the running pod's entry doubles too
    assert listed[("p2", "main")] == [("shared", "gpu-0", cdi)] * 2

    # the agent's reading: each claim device's users once, each pod once
    answer = list_pod_resources(node.socket)
    assert answer.claims == {("default", "shared", NODE, "gpu-0"): frozenset({("default", "p1"), ("default", "p2")})}


def test_a_1_33_kubelet_lists_no_dynamic_resources(make_node) -> None:
    """``KubeletPodResourcesDynamicResources`` is alpha and off before 1.34: the pods are not listed for a claim."""
    node = make_node(kubelet_version="1.33")
    allocated_claim(node.api, "c1", [("gpu", "gpu-0")])
    node.dra.run_pod("default", "p1", POD_UID, [("gpu", "c1")], {"main": [("gpu", None)]})

    assert node.listed() == {}
    assert list_pod_resources(node.socket).claims == {}
