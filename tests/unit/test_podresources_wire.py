"""The PodResources List answer read without the protobuf runtime (agent.plugin.podresources_wire) reads what the
generated classes read: every field the agent uses, whatever else the kubelet writes beside it."""

from __future__ import annotations

import pytest

from agent.api.podresources.v1 import api_pb2
from agent.plugin.podresources_wire import WireError, list_response


def _generated() -> api_pb2.ListPodResourcesResponse:
    topology = api_pb2.TopologyInfo(nodes=[api_pb2.NUMANode(ID=1)])
    claim = api_pb2.DynamicResource(
        claim_name="gpu-claim",
        claim_namespace="ml",
        claim_resources=[
            api_pb2.ClaimResource(
                cdi_devices=[api_pb2.CDIDevice(name="k8s.gpu.nvidia.com/claim=abc")],
                driver_name="gpu.nvidia.com",
                pool_name="node-1",
                device_name="gpu-0",
                share_id="5e7d",
            )
        ],
    )
    return api_pb2.ListPodResourcesResponse(
        pod_resources=[
            api_pb2.PodResources(
                name="trainer-0",
                namespace="ml",
                cpu_ids=[1, 2],
                memory=[api_pb2.ContainerMemory(memory_type="memory", size=1 << 30, topology=topology)],
                containers=[
                    api_pb2.ContainerResources(
                        name="main",
                        devices=[
                            api_pb2.ContainerDevices(
                                resource_name="nvidia.com/gpu.shared",
                                device_ids=["GPU-5d3c::0", "GPU-5d3c::1"],
                                topology=topology,
                            ),
                            api_pb2.ContainerDevices(resource_name="example.com/nic", device_ids=["nic-0"]),
                        ],
                        cpu_ids=[3],
                        dynamic_resources=[claim],
                    ),
                    api_pb2.ContainerResources(name="sidecar"),
                ],
            ),
            api_pb2.PodResources(name="idle", namespace="default"),
        ]
    )


def _plain(response) -> list:
    return [
        (
            pod.name,
            pod.namespace,
            [
                (
                    container.name,
                    [(d.resource_name, list(d.device_ids)) for d in container.devices],
                    [
                        (r.claim_name, r.claim_namespace, [(c.pool_name, c.device_name) for c in r.claim_resources])
                        for r in container.dynamic_resources
                    ],
                )
                for container in pod.containers
            ],
        )
        for pod in response.pod_resources
    ]


def test_reads_what_the_generated_classes_read() -> None:
    generated = _generated()
    assert _plain(list_response(generated.SerializeToString())) == _plain(generated)


def test_an_empty_answer_is_no_pods() -> None:
    assert list_response(b"").pod_resources == ()


@pytest.mark.parametrize(
    "data",
    [
        b"\x0a\x05ab",  # a pod whose length runs past the end
        b"\x08\x01",  # pod_resources written as a number
        b"\x0a\x02\x0a\xff",  # a pod name that is not UTF-8... and cut short
        b"\x0a\x03\x0a\x01\xff",  # a pod name that is not UTF-8
    ],
)
def test_bytes_that_are_no_answer_are_a_wire_error(data: bytes) -> None:
    with pytest.raises(WireError):
        list_response(data)
