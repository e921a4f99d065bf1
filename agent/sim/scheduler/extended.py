"""The special ResourceClaim the scheduler builds for a pod's extended resources served by DRA (KEP-5004).

A DeviceClass with ``extendedResourceName: nvidia.com/gpu`` lets a pod that asks for ``nvidia.com/gpu: 2`` be
served from ResourceSlices on a node whose allocatable does not list the resource (no device plugin advertises
it). The scheduler then writes one claim per pod (facts ``dra.md`` D): ``generateName: <pod>-extended-resources-``,
owned by the pod, annotated ``resource.kubernetes.io/extended-resource-claim: "true"``, with one ``exactly``
request per container and resource — ``container-<container index>-request-<index among the container's sorted
resource names>``, ``ExactCount`` of the quantity, the mapped class — and tells the kubelet in the pod's
``status.extendedResourceClaimStatus`` which container's resource is which request.

Each class also answers to ``deviceclass.resource.kubernetes.io/<class name>``. When two classes name the same
resource, the one created later wins, and of two created at once the one whose name sorts first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

IMPLICIT_PREFIX = "deviceclass.resource.kubernetes.io/"
ANNOTATION = "resource.kubernetes.io/extended-resource-claim"


def extended_resource_classes(classes: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """Resource name -> the DeviceClass that serves it (explicit names by the API's tie rules, implicit ones)."""
    chosen: dict[str, tuple[str, str]] = {}  # resource -> (creationTimestamp, class name)
    for name, device_class in classes.items():
        resource = (device_class.get("spec") or {}).get("extendedResourceName")
        if not resource:
            continue
        created = str((device_class.get("metadata") or {}).get("creationTimestamp") or "")
        best = chosen.get(resource)
        if best is None or created > best[0] or (created == best[0] and name < best[1]):
            chosen[resource] = (created, name)
    mapping = {resource: name for resource, (_, name) in chosen.items()}
    mapping.update({IMPLICIT_PREFIX + name: name for name in classes})
    return mapping


def extended_resource_claim(
    pod: Mapping[str, Any], classes: Mapping[str, Mapping[str, Any]]
) -> tuple[dict[str, Any], list[dict[str, str]]] | None:
    """The claim the scheduler writes for ``pod`` and its request mappings; None when no container asks for a
    resource a class serves."""
    served = extended_resource_classes(classes)
    metadata = pod.get("metadata") or {}
    requests: list[dict[str, Any]] = []
    mappings: list[dict[str, str]] = []
    for index, container in enumerate((pod.get("spec") or {}).get("containers") or []):
        resources = container.get("resources") or {}
        asked = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
        names = sorted(name for name, quantity in asked.items() if name in served and int(quantity) > 0)
        for position, resource in enumerate(names):
            request = f"container-{index}-request-{position}"
            requests.append(
                {
                    "name": request,
                    "exactly": {
                        "deviceClassName": served[resource],
                        "allocationMode": "ExactCount",
                        "count": int(asked[resource]),
                    },
                }
            )
            mappings.append({"containerName": container["name"], "resourceName": resource, "requestName": request})
    if not requests:
        return None
    owner = {"apiVersion": "v1", "kind": "Pod", "name": metadata.get("name"), "uid": metadata.get("uid"),
             "controller": True, "blockOwnerDeletion": True}  # fmt: skip
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "generateName": f"{metadata.get('name')}-extended-resources-",
            "namespace": metadata.get("namespace", "default"),
            "annotations": {ANNOTATION: "true"},
            "ownerReferences": [owner],
        },
        "spec": {"devices": {"requests": requests}},
    }
    return claim, mappings
