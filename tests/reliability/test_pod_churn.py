"""Scenario 2: pods created and deleted through the kubelet emulator on a dgx-a100-like node.

MIG 1g.10gb devices time-sliced x2, four whole GPUs time-sliced x4, two whole GPUs dedicated. After every
step: no dedicated GPU handed out twice (nor shared with anyone), no replica handed out twice, no physical
device over its replica count, and PodResources List (a real gRPC client) agrees with the allocations.
"""

from __future__ import annotations

import random
import time
from collections import Counter

import grpc
import pytest

from agent.api.podresources.v1 import api_pb2 as pr_pb2
from agent.api.podresources.v1 import api_pb2_grpc as pr_grpc
from agent.sim.kubelet import AdmissionError

from .conftest import summary_ms
from .nodes import DGX_CONFIG, DGX_NODE, DGX_RESOURCES

DEDICATED = "nvidia.com/gpu"
REPLICAS = {"nvidia.com/gpu.shared": 4, "nvidia.com/mig-1g.10gb.shared": 2}


def _check(kubelet, lister) -> int:
    """The invariants; returns the number of live allocations checked."""
    held: dict[str, list[str]] = {r: [] for r in DGX_RESOURCES}
    physical: Counter[str] = Counter()
    dedicated_physical: list[str] = []
    expected = set()
    for pod in kubelet.pods():
        for cname, resources in pod.containers.items():
            for resource, allocation in resources.items():
                held[resource] += allocation.device_ids
                visible = allocation.response.envs["NVIDIA_VISIBLE_DEVICES"].split(",")
                assert sorted(visible) == sorted({d.split("::")[0] for d in allocation.device_ids})
                physical.update(visible)
                if resource == DEDICATED:
                    dedicated_physical += visible
                expected.add((pod.name, cname, resource, tuple(sorted(allocation.device_ids))))
    for resource, ids in held.items():
        assert len(ids) == len(set(ids)), f"{resource}: a device handed out twice: {ids}"
    assert all(physical[uuid] == 1 for uuid in dedicated_physical), "a dedicated GPU is shared"
    assert max(physical.values(), default=0) <= max(REPLICAS.values())
    listed = lister.List(pr_pb2.ListPodResourcesRequest(), timeout=5)
    seen = {
        (p.name, c.name, d.resource_name, tuple(sorted(d.device_ids)))
        for p in listed.pod_resources
        for c in p.containers
        for d in c.devices
    }
    assert seen == expected, "PodResources disagrees with the allocations"
    return len(expected)


@pytest.mark.parametrize("steps", [pytest.param(200, id="ci"), pytest.param(1000, id="long", marks=pytest.mark.long)])
def test_pod_churn_never_double_allocates(make_node, figures, steps: int) -> None:
    node = make_node(DGX_NODE, DGX_CONFIG)
    kubelet = node.kubelet
    node.wait_registered(DGX_RESOURCES)
    rng = random.Random(20261122)
    channel = grpc.insecure_channel(f"unix://{node.pod_resources_socket}")
    lister = pr_grpc.PodResourcesListerStub(channel)
    live: list[str] = []
    create_times, allocate_times = [], []
    refused = created = deleted = checked = 0
    try:
        for step in range(steps):
            if live and (rng.random() < 0.45 or len(live) >= 30):
                kubelet.delete_pod(live.pop(rng.randrange(len(live))))
                deleted += 1
            else:
                resource = rng.choice([DEDICATED, *REPLICAS])
                containers = {"main": {resource: 1}}
                if rng.random() < 0.3:  # a second container on another resource
                    containers["side"] = {rng.choice(list(REPLICAS)): 1}
                name = f"p{step}"
                started = time.monotonic()
                try:
                    pod = kubelet.create_pod(name, containers)
                except AdmissionError:
                    refused += 1  # the node is full for that resource: the kubelet says so, nothing lost
                else:
                    create_times.append(time.monotonic() - started)
                    created += 1
                    live.append(name)
                    ids = pod.containers["main"][resource].device_ids
                    started = time.monotonic()
                    kubelet.allocate_raw(resource, ids)
                    allocate_times.append(time.monotonic() - started)
            checked += _check(kubelet, lister)
            time.sleep(0.011)  # pacing: PodResources allows 100 calls/s
    finally:
        channel.close()
    assert node.process.poll() is None
    assert created > steps // 3
    figures.update(
        steps=steps,
        pods_created=created,
        pods_deleted=deleted,
        admissions_refused_node_full=refused,
        allocations_checked=checked,
        create_pod=summary_ms(create_times),
        allocate=summary_ms(allocate_times),
    )
