"""Helpers for tests that talk to the API server stand-in (``agent.sim.apiserver``) through the real Kubernetes client.

``nvidia_gpu`` / ``nvidia_slice`` build objects shaped like NVIDIA's DRA driver's (dra.md C2/C3), ``resource_api``
gives a ``ResourceV1Api`` on the stand-in, and ``raw_request`` sends a body the client's own models would refuse
(e.g. a slice without a pool) through the same client, so the server's answer can be tested.
"""

from __future__ import annotations

import json
from typing import Any

import kubernetes.client

from agent.sim.apiserver import ApiServer

DRIVER = "gpu.nvidia.com"


def nvidia_gpu(
    index: int,
    *,
    memory: str = "80Gi",
    product: str = "NVIDIA A100-SXM4-80GB",
    compute_capability: str = "8.0.0",
    taints: list[dict] | None = None,
) -> dict:
    """A full GPU as NVIDIA's driver publishes it: ``gpu-<minor>`` with type, uuid, productName and a version-typed
    cudaComputeCapability, and its memory as a capacity."""
    device: dict[str, Any] = {
        "name": f"gpu-{index}",
        "attributes": {
            "type": {"string": "gpu"},
            "uuid": {"string": f"GPU-4d1f3c2e-0000-4000-8000-{index:012d}"},
            "productName": {"string": product},
            "brand": {"string": "Nvidia"},
            "architecture": {"string": "Ampere"},
            "cudaComputeCapability": {"version": compute_capability},
            "driverVersion": {"version": "580.65.6"},
            "cudaDriverVersion": {"version": "13.0.0"},
            "resource.kubernetes.io/pciBusID": {"string": f"0000:{index + 7:02x}:00.0"},
        },
        "capacity": {"memory": {"value": memory}},
    }
    if taints:
        device["taints"] = taints
    return device


def nvidia_slice(
    node: str,
    devices: list[dict],
    *,
    driver: str = DRIVER,
    pool: str | None = None,
    generation: int = 1,
    slice_count: int = 1,
    node_uid: str | None = None,
    name: str | None = None,
    labels: dict[str, str] | None = None,
) -> dict:
    """A ResourceSlice of ``node``'s pool (named after the node, as NVIDIA's), owned by the Node when its uid is
    given, named by ``generateName`` unless ``name`` is."""
    metadata: dict[str, Any] = {"name": name} if name else {"generateName": f"{node}-{driver}-"}
    if node_uid:
        metadata["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node_uid, "controller": True}
        ]
    if labels:
        metadata["labels"] = labels
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": metadata,
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": pool or node, "generation": generation, "resourceSliceCount": slice_count},
            "devices": devices,
        },
    }


def gpu_claim(name: str, *, device_class: str = DRIVER, selectors: list[str] | None = None) -> dict:
    exactly: dict[str, Any] = {"deviceClassName": device_class}
    if selectors:
        exactly["selectors"] = [{"cel": {"expression": e}} for e in selectors]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}},
    }


def resource_api(api: ApiServer) -> kubernetes.client.ResourceV1Api:
    return kubernetes.client.ResourceV1Api(api.api_client())


def raw_request(
    api_client: kubernetes.client.ApiClient,
    method: str,
    path: str,
    body: object = None,
    *,
    content_type: str | None = None,
) -> Any:
    """Send ``body`` as it is (a dict is sent as JSON, a str or bytes verbatim) through the client's ApiClient and
    return the decoded answer; an error status raises ``ApiException`` as every client call does."""
    headers = {"Accept": "application/json"}
    if content_type:
        headers["Content-Type"] = content_type
    method, url, header_params, serialized, post_params = api_client.param_serialize(
        method=method, resource_path=path, header_params=headers, body=body
    )
    response = api_client.call_api(method, url, header_params=header_params, body=serialized, post_params=post_params)
    response.read()
    api_client.response_deserialize(response, {"2XX": "object"})
    return json.loads(response.data or b"null")
