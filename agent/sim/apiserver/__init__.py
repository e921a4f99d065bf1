"""Stands in for the Kubernetes API server for the objects a DRA driver uses, over real HTTP for the real client.

Served: ``resource.k8s.io/v1`` ResourceSlices, ResourceClaims (with ``/status``) and DeviceClasses, core ``v1``
Nodes, ``/version`` and discovery. Objects get uid, resourceVersion (one counter for all kinds), creationTimestamp
and generation; writes use optimistic concurrency (409 Conflict), field and label selectors filter list, watch and
DeleteCollection, and watches replay from a resourceVersion or answer 410 Gone after compaction. Every written object
is validated against the real OpenAPI schemas of the oldest and newest supported Kubernetes versions
(``kubernetes_validate``, strict) and against the semantic rules of the version the stand-in reports (422 Invalid).

Modules, one job each: ``kinds`` (the served kinds), ``store`` (objects, resourceVersion, event history),
``strategy`` (what the server does to an object before storing it), ``quantity`` (canonical quantities), ``rules``
(semantic validation), ``validate`` (schema + rules), ``registry`` (the verbs), ``selectors``, ``patch``, ``watch``
(watch streams), ``http`` (routing, bodies, answers), ``faults``, ``observe`` (request log), ``server``
(``ApiServer``). Usage::

    with ApiServer(git_version="v1.34.2") as api:
        api.add_node("node-a")
        client = kubernetes.client.ResourceV1Api(api.api_client())
"""

from agent.sim.apiserver.errors import ApiError
from agent.sim.apiserver.kinds import DEVICE_CLASS, KINDS, NODE, RESOURCE_CLAIM, RESOURCE_SLICE, Kind
from agent.sim.apiserver.observe import Request
from agent.sim.apiserver.server import DEFAULT_GIT_VERSION, ApiServer
from agent.sim.apiserver.validate import DEFAULT_SCHEMA_VERSIONS

__all__ = [
    "DEFAULT_GIT_VERSION",
    "DEFAULT_SCHEMA_VERSIONS",
    "DEVICE_CLASS",
    "KINDS",
    "NODE",
    "RESOURCE_CLAIM",
    "RESOURCE_SLICE",
    "ApiError",
    "ApiServer",
    "Kind",
    "Request",
]
