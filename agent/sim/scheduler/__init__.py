"""Stands in for the kube-scheduler's DRA plugin: allocates one ResourceClaim on one node from ResourceSlices.

Written from ``k8s.io/dynamic-resource-allocation`` (``structured``, the allocator the plugin runs, and ``cel``,
the selector environment) so that claims and DeviceClasses written for NVIDIA's DRA driver can be tested
against the ResourceSlices Tessera publishes with NVIDIA's exact CEL expressions, evaluated by a real CEL
implementation (cel-python, imported on first use: only the simulator needs it).

``allocate(claim, slices, classes, allocated, node_name)`` returns a copy of the claim with
``status.allocation`` as the API has it: ``devices.results[]`` (``request`` — ``<main>/<sub>`` for a
firstAvailable choice —, ``driver``, ``pool``, ``device``, ``adminAccess`` and ``tolerations`` when the request
has them), ``devices.config[]`` (the classes' configs first, ``source: FromClass``, then the claim's,
``FromClaim``) and a ``nodeSelector`` pinning the node. Or it raises ``Unschedulable`` whose ``reason`` names the
request and why. What it does as the scheduler does:

* Pools: only slices of a pool's highest generation count; devices come only from complete pools (as many
  slices at that generation as ``resourceSliceCount``) that hold no duplicate device names; only slices with
  ``nodeName`` equal to the node (or ``allNodes``) offer devices.
* Requests in order; ``exactly`` with ``ExactCount`` (``count``) or ``All`` (every matching device, at least
  one; an error while a pool is incomplete); ``firstAvailable``: the first subrequest that can be satisfied.
  Devices are tried in slice and device order with backtracking, so the first solution is deterministic.
* A device matches when every class selector and then every request selector is true. A selector that fails
  to evaluate (a missing attribute: "no such key") stops allocation with the scheduler's error text
  (``cel_errors="abort"``, Kubernetes' behaviour), or, with ``cel_errors="skip"``, counts as no match, the
  first such error kept in ``Diagnostics`` and named in the reason if allocation fails.
* Devices allocated to other claims are skipped unless the request has ``adminAccess``; a device with a
  ``NoSchedule`` or ``NoExecute`` taint only if the request tolerates it (``None`` is ignored).
* Constraints ``matchAttribute`` and ``distinctAttribute`` over the named requests (or all); shared counters
  (``sharedCounters``/``consumesCounters``) less what allocated devices consume.
* Consumable capacity (``agent.sim.scheduler.capacity``): a device with ``allowMultipleAllocations`` is shared by
  claims while their shares (``capacity.requests``, else the policy's default, rounded up to the request policy)
  fit its capacities; its results carry a ``shareID`` and ``consumedCapacity``. ``devices_in_use`` gives
  ``allocate`` what other claims hold whole and what their shares take.

``extended.extended_resource_claim`` builds the claim the scheduler writes for a pod whose containers ask for an
extended resource a DeviceClass serves (KEP-5004).

Left out: scoring and other nodes (one node, first solution); slices selected by ``nodeSelector`` or
per-device node selection; binding conditions; the admin-access namespace label; ``reservedFor``,
``allocationTimestamp`` and writing the claim (the caller's job); CEL cost limits; Kubernetes' compile-time
type checking (``cel`` checks names and functions only, see its docstring).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agent.sim.scheduler.allocator import MAX_RESULTS, DeviceID, Diagnostics, allocate, devices_in_use
from agent.sim.scheduler.errors import CELCompileError, CELRuntimeError, Unschedulable

if TYPE_CHECKING:
    from agent.sim.scheduler.cel import Selector


def compile_selector(expression: str) -> Selector:
    """The compiled CEL selector (cached, failures too); ``CELCompileError`` names the expression."""
    from agent.sim.scheduler.cel import compile_selector as compile_cel

    return compile_cel(expression)


__all__ = [
    "MAX_RESULTS",
    "CELCompileError",
    "CELRuntimeError",
    "DeviceID",
    "Diagnostics",
    "Unschedulable",
    "allocate",
    "compile_selector",
    "devices_in_use",
]
