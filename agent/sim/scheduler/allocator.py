"""The structured-parameters allocator: one ResourceClaim against one node's ResourceSlices.

Follows ``k8s.io/dynamic-resource-allocation/structured`` (the allocator the kube-scheduler's DRA plugin runs):
the same pool rules, search order, selector order, constraint, taint and counter checks, result and config
layout, and its error texts where it has one. See the package docstring for what is left out.
"""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import Iterable, Mapping
from fractions import Fraction
from typing import Any, Literal

from msgspec import Struct, field

from agent.sim.scheduler.capacity import amount, consumption, quantity_text
from agent.sim.scheduler.errors import CELCompileError, CELRuntimeError, Unschedulable

MAX_RESULTS = 32  # AllocationResultsMaxSize: devices in one claim's allocation
MAX_STEPS = 1_000_000  # candidate devices tried before the search gives up (the scheduler has a deadline)
EXACT_COUNT, ALL = "ExactCount", "All"
BLOCKING_EFFECTS = ("NoSchedule", "NoExecute")  # None and unknown effects are ignored

DeviceID = tuple[str, str, str]  # (driver, pool, device)
CelErrors = Literal["abort", "skip"]


class Diagnostics(Struct):
    """What one ``allocate`` call saw, for tests and the demo: pass one in to read it afterwards."""

    cel_errors: list[str] = field(default_factory=list)  # every selector that failed to evaluate, in order
    ignored_pools: list[str] = field(default_factory=list)  # incomplete or invalid pools, with the reason
    steps: int = 0  # candidate placements tried
    seconds: float = 0.0

    @property
    def first_cel_error(self) -> str | None:
        return self.cel_errors[0] if self.cel_errors else None


class _Abort(Exception):
    """Allocation stops with an error (the scheduler reports it as is)."""


class _Pool(Struct, eq=False):
    driver: str
    name: str
    generation: int
    slices: list[Mapping[str, Any]]  # all slices of the highest generation, for every node
    expected: int
    invalid: str | None = None
    counters: dict[str, dict[str, Fraction]] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.driver}/{self.name}"

    @property
    def incomplete(self) -> bool:
        return len(self.slices) != self.expected


class _Device(Struct, eq=False):
    id: DeviceID
    spec: Mapping[str, Any]
    slice: Mapping[str, Any]
    pool: _Pool
    index: int
    cel: Any = None  # the CEL ``device`` variable, built on first use

    @property
    def label(self) -> str:
        return "/".join(self.id)

    @property
    def multiple(self) -> bool:
        """``allowMultipleAllocations``: shared by allocations, each consuming part of its capacity."""
        return self.spec.get("allowMultipleAllocations") is True


class _Request(Struct, eq=False):
    name: str
    parent: str | None
    class_name: str
    klass: Mapping[str, Any]
    mode: str
    count: int
    admin: bool
    tolerations: list[Mapping[str, Any]]
    selectors: list[Any]  # compiled request selectors
    class_selectors: list[Any]
    capacity: Mapping[str, Any] = field(default_factory=dict)  # capacity.requests: name -> quantity
    all_devices: list[_Device] | None = None

    @property
    def full_name(self) -> str:
        return f"{self.parent}/{self.name}" if self.parent else self.name

    @property
    def main(self) -> str:
        return self.parent or self.name

    def applies(self, names: set[str]) -> bool:
        return not names or self.main in names or self.full_name in names


def allocate(
    claim: Mapping[str, Any],
    slices: Iterable[Mapping[str, Any]],
    classes: Mapping[str, Mapping[str, Any]],
    allocated: set[DeviceID] | frozenset[DeviceID],
    node_name: str,
    *,
    consumed: Mapping[DeviceID, Mapping[str, Fraction]] | None = None,
    cel_errors: CelErrors = "abort",
    diagnostics: Diagnostics | None = None,
) -> dict[str, Any]:
    """A copy of ``claim`` with ``status.allocation`` as the scheduler writes it, or ``Unschedulable``.

    ``slices`` are ResourceSlice objects (any nodes, any generations), ``classes`` DeviceClass objects by name,
    ``allocated`` the devices other claims hold whole and ``consumed`` what other claims' shares take of
    multi-allocatable devices (``devices_in_use`` computes both from the claims). A claim that already has an
    allocation comes back unchanged.
    ``cel_errors``: ``"abort"`` (Kubernetes) stops at the first selector that fails to evaluate for a device
    the search looks at and reports it; ``"skip"`` treats that device as not matching and goes on, keeping the
    errors in ``diagnostics.cel_errors`` and naming the first in the reason if the claim cannot be allocated.
    """
    started = time.perf_counter()
    diag = diagnostics if diagnostics is not None else Diagnostics()
    result = copy.deepcopy(dict(claim))
    if (result.get("status") or {}).get("allocation"):
        return result
    try:
        allocation = _Allocation(
            result, list(slices), classes, allocated, consumed or {}, node_name, cel_errors, diag
        ).run()
    except _Abort as error:
        raise Unschedulable(str(error), cel_error=diag.first_cel_error) from None
    finally:
        diag.seconds = time.perf_counter() - started
    result.setdefault("status", {})["allocation"] = allocation
    return result


def devices_in_use(
    claims: Iterable[Mapping[str, Any]],
) -> tuple[set[DeviceID], dict[DeviceID, dict[str, Fraction]]]:
    """The devices allocated claims hold whole, and what their shares take of multi-allocatable devices (the
    results with ``consumedCapacity``), for ``allocate``'s ``allocated`` and ``consumed``. Admin-access results
    hold nothing."""
    held: set[DeviceID] = set()
    consumed: dict[DeviceID, dict[str, Fraction]] = {}
    for claim in claims:
        allocation = (claim.get("status") or {}).get("allocation") or {}
        for result in (allocation.get("devices") or {}).get("results") or []:
            device = (result.get("driver", ""), result.get("pool", ""), result.get("device", ""))
            if result.get("consumedCapacity") is not None:
                totals = consumed.setdefault(device, {})
                for name, value in result["consumedCapacity"].items():
                    totals[name] = totals.get(name, Fraction(0)) + amount(value)
            elif not result.get("adminAccess"):
                held.add(device)
    return held, consumed


class _Allocation:
    def __init__(
        self,
        claim: dict[str, Any],
        slices: list[Mapping[str, Any]],
        classes: Mapping[str, Mapping[str, Any]],
        allocated: set[DeviceID] | frozenset[DeviceID],
        consumed: Mapping[DeviceID, Mapping[str, Fraction]],
        node_name: str,
        cel_errors: CelErrors,
        diag: Diagnostics,
    ) -> None:
        if cel_errors not in ("abort", "skip"):
            raise ValueError(f"cel_errors must be 'abort' or 'skip', not {cel_errors!r}")
        self.claim = claim
        self.classes = classes
        self.allocated = allocated
        self.node = node_name
        self.cel_errors = cel_errors
        self.diag = diag
        meta = claim.get("metadata") or {}
        self.ref = f"{meta['namespace']}/{meta.get('name', '')}" if meta.get("namespace") else meta.get("name", "")
        self.matches: dict[tuple[int, int], bool] = {}
        self.reported: set[str] = set()
        self.pools, self.candidates = self._gather(slices)
        self.requests = self._requests()
        self.constraints = self._constraints()
        self.allocating: set[DeviceID] = set()
        self.consumed: dict[tuple[str, str, str], Fraction] = {}
        # (device, capacity) -> taken by other claims' shares and by this claim's so far
        self.capacity_taken: dict[tuple[DeviceID, str], Fraction] = {
            (device, name): value for device, by_name in consumed.items() for name, value in by_name.items()
        }
        self.consumptions: dict[tuple[int, int], dict[str, Fraction] | str] = {}
        self.results: list[tuple[_Request, _Device]] = []
        self.shares: list[dict[str, Fraction]] = []  # per result: what it consumes (empty: a whole device)
        self.chosen: list[_Request | None] = [None] * len(self.requests)

    # ----- pools and devices --------------------------------------------------------------------

    def _gather(self, slices: list[Mapping[str, Any]]) -> tuple[list[_Pool], list[_Device]]:
        """Pools with a slice for this node; only their highest generation counts, and devices are taken only
        from complete, valid pools (GatherPools)."""
        grouped: dict[tuple[str, str], list[Mapping[str, Any]]] = {}
        for s in slices:
            spec = s.get("spec") or {}
            grouped.setdefault((spec.get("driver", ""), (spec.get("pool") or {}).get("name", "")), []).append(s)
        pools: list[_Pool] = []
        candidates: list[_Device] = []
        for (driver, name), members in grouped.items():
            generation = max(int(m["spec"]["pool"].get("generation", 0)) for m in members)
            current = [m for m in members if int(m["spec"]["pool"].get("generation", 0)) == generation]
            local = [m for m in current if self._for_node(m["spec"])]
            if not local:
                continue
            expected = int(current[0]["spec"]["pool"].get("resourceSliceCount", 1))
            pool = _Pool(driver, name, generation, current, expected)
            pools.append(pool)
            names: set[str] = set()
            devices = [(s, d) for s in local for d in (s["spec"].get("devices") or [])]
            for _, device in devices:
                if device["name"] in names:
                    pool.invalid = f"duplicate device name {device['name']}"
                names.add(device["name"])
            if pool.incomplete:
                self.diag.ignored_pools.append(
                    f"pool {pool.id} is incomplete: {len(current)} of {expected} slices of generation {generation}"
                )
                continue
            if pool.invalid:
                self.diag.ignored_pools.append(f"pool {pool.id} is invalid: {pool.invalid}")
                continue
            pool.counters = self._counters(pool)
            for s, device in devices:
                body = {**device, **device["basic"]} if "basic" in device else device
                candidates.append(_Device((driver, name, body["name"]), body, s, pool, len(candidates)))
        return pools, candidates

    def _for_node(self, spec: Mapping[str, Any]) -> bool:
        return spec.get("nodeName") == self.node or bool(spec.get("allNodes"))

    def _counters(self, pool: _Pool) -> dict[str, dict[str, Fraction]]:
        """The pool's shared counters less what devices allocated to other claims consume."""
        available = {
            counter_set["name"]: {c: amount(v) for c, v in (counter_set.get("counters") or {}).items()}
            for s in pool.slices
            for counter_set in (s["spec"].get("sharedCounters") or [])
        }
        for s in pool.slices:
            for device in s["spec"].get("devices") or []:
                if (pool.driver, pool.name, device["name"]) in self.allocated:
                    for use in device.get("consumesCounters") or []:
                        counters = available.get(use["counterSet"], {})
                        for c, v in (use.get("counters") or {}).items():
                            if c in counters:
                                counters[c] -= amount(v)
        return available

    # ----- requests ---------------------------------------------------------------------------------

    def _requests(self) -> list[list[_Request]]:
        """One list per claim request: its alternatives (one, or the firstAvailable subrequests in order)."""
        requests = ((self.claim.get("spec") or {}).get("devices") or {}).get("requests") or []
        out: list[list[_Request]] = []
        for request in requests:
            name = request.get("name", "")
            if request.get("firstAvailable"):
                out.append([self._request(sub, sub.get("name", ""), name) for sub in request["firstAvailable"]])
                continue
            exactly = request.get("exactly")
            if exactly is None and "deviceClassName" in request:  # v1beta1: the fields are on the request
                exactly = {k: v for k, v in request.items() if k != "name"}
            if not exactly or not exactly.get("deviceClassName"):
                raise _Abort(f"claim {self.ref}, request {name}: missing device class name (unsupported request type?)")
            out.append([self._request(exactly, name, None)])
        minimum = sum(min(self._minimum(r) for r in alternatives) for alternatives in out)
        if minimum > MAX_RESULTS:
            raise _Abort(
                f"claim {self.ref}: number of requested devices {minimum} exceeds the claim limit of {MAX_RESULTS}"
            )
        return out

    def _request(self, spec: Mapping[str, Any], name: str, parent: str | None) -> _Request:
        full = f"{parent}/{name}" if parent else name
        class_name = spec.get("deviceClassName", "")
        if not class_name:
            raise _Abort(f"claim {self.ref}, request {full}: missing device class name (unsupported request type?)")
        klass = self.classes.get(class_name)
        if klass is None:
            raise _Abort(
                f"claim {self.ref}, request {full}: could not retrieve device class {class_name}: "
                f'deviceclass.resource.k8s.io "{class_name}" not found'
            )
        mode = spec.get("allocationMode") or EXACT_COUNT
        if mode not in (EXACT_COUNT, ALL):
            raise _Abort(f"claim {self.ref}, request {full}: unsupported count mode {mode}")
        count = int(spec.get("count", 1)) if mode == EXACT_COUNT else 0
        if mode == EXACT_COUNT and count < 1:
            raise _Abort(f"claim {self.ref}, request {full}: count must be greater than zero, not {count}")
        request = _Request(
            name=name,
            parent=parent,
            class_name=class_name,
            klass=klass,
            mode=mode,
            count=count,
            admin=bool(spec.get("adminAccess")) and parent is None,
            tolerations=list(spec.get("tolerations") or []),
            selectors=self._compile(spec.get("selectors"), f"claim {self.ref}, request {full}"),
            class_selectors=self._compile((klass.get("spec") or {}).get("selectors"), f"class {class_name}"),
            capacity=dict((spec.get("capacity") or {}).get("requests") or {}),
        )
        if mode == ALL:
            request.all_devices = self._all_devices(request)
        return request

    def _compile(self, selectors: Any, owner: str) -> list[Any]:
        from agent.sim.scheduler.cel import compile_selector

        compiled = []
        for i, selector in enumerate(selectors or []):
            expression = (selector.get("cel") or {}).get("expression") if isinstance(selector, Mapping) else None
            if expression is None:
                raise _Abort(f"{owner}, selector #{i}: CEL expression empty (unsupported selector type?)")
            try:
                compiled.append(compile_selector(expression))
            except CELCompileError as error:
                raise _Abort(f"{owner}: selector #{i}: {error}") from None
        return compiled

    def _all_devices(self, request: _Request) -> list[_Device]:
        """allocationMode All: every matching device of the node, decided before the search (and an error
        while a pool is being updated, as the scheduler has it)."""
        for pool in self.pools:
            if pool.incomplete:
                raise _Abort(
                    f"claim {self.ref}, request {request.full_name}: asks for all devices, but resource pool "
                    f"{pool.id} is currently being updated"
                )
            if pool.invalid:
                raise _Abort(
                    f"claim {self.ref}, request {request.full_name}: asks for all devices, but resource pool "
                    f"{pool.id} is currently invalid"
                )
        return [d for d in self.candidates if self._selectable(request, d)]

    @staticmethod
    def _minimum(request: _Request) -> int:
        return len(request.all_devices or []) if request.mode == ALL else request.count

    def _constraints(self) -> list[_Constraint]:
        constraints: list[_Constraint] = []
        for i, c in enumerate(((self.claim.get("spec") or {}).get("devices") or {}).get("constraints") or []):
            names = set(c.get("requests") or [])
            if c.get("matchAttribute"):
                constraints.append(_MatchAttribute(names, c["matchAttribute"]))
            elif c.get("distinctAttribute"):
                constraints.append(_DistinctAttribute(names, c["distinctAttribute"]))
            else:
                raise _Abort(f"claim {self.ref}, constraint #{i}: empty constraint (unsupported constraint type?)")
        return constraints

    # ----- selectors ---------------------------------------------------------------------------------

    def _selectable(self, request: _Request, device: _Device, *, abort: bool = True) -> bool:
        """Class selectors, then the request's (isSelectable); the answer is kept per request and device."""
        key = (id(request), device.index)
        if key not in self.matches:
            owner = f"claim {self.ref}, request {request.full_name}"
            self.matches[key] = self._selectors_match(
                device, request.class_selectors, f"class {request.class_name}", abort
            ) and self._selectors_match(device, request.selectors, owner, abort)
        return self.matches[key]

    def _selectors_match(self, device: _Device, selectors: list[Any], owner: str, abort: bool) -> bool:
        from agent.sim.scheduler.cel import device_variable

        for i, selector in enumerate(selectors):
            if device.cel is None:
                device.cel = device_variable(device.spec, device.id[0])
            try:
                if not selector.matches(device.cel):
                    return False
            except CELRuntimeError as error:
                message = f"{owner}: selector #{i} on device {device.label}: CEL runtime error: {error.detail}"
                if message not in self.reported:
                    self.reported.add(message)
                    self.diag.cel_errors.append(message)
                if abort and self.cel_errors == "abort":
                    raise _Abort(message) from None
                return False
        return True

    # ----- search ----------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        if not self._search(0):
            raise _Abort(self._explain())
        return self._allocation()

    def _search(self, index: int) -> bool:
        if index == len(self.requests):
            return True
        for alternative in self.requests[index]:
            if alternative.mode == ALL and not alternative.all_devices:
                continue  # All needs at least one device
            if self._fill(index, alternative, 0, 0):
                self.chosen[index] = alternative
                return True
        return False

    def _fill(self, index: int, request: _Request, k: int, start: int) -> bool:
        """Device ``k`` of ``request``; candidates from ``start`` on, so a request's devices are tried as sets,
        not as every ordering of the same set."""
        need = len(request.all_devices or []) if request.mode == ALL else request.count
        if k >= need:
            return self._search(index + 1)
        if len(self.results) + need - k > MAX_RESULTS:
            return False
        self.diag.steps += 1
        if self.diag.steps > MAX_STEPS:
            raise _Abort(f"claim {self.ref}: no allocation found within {MAX_STEPS} steps; the search gave up")
        if request.mode == ALL:
            assert request.all_devices is not None
            device = request.all_devices[k]
            if not self._available(request, device) or not self._add(request, device, must=True):
                return False
            if self._fill(index, request, k + 1, 0):
                return True
            self._remove(request, device)
            return False
        for device in self.candidates[start:]:
            if len(self.candidates) - device.index < need - k:
                break
            if not self._available(request, device) or not self._selectable(request, device):
                continue
            if not self._add(request, device, must=False):
                continue
            if self._fill(index, request, k + 1, device.index + 1):
                return True
            self._remove(request, device)
        return False

    def _available(self, request: _Request, device: _Device) -> bool:
        if device.multiple:  # shared by allocations: its capacity decides (_take_capacity)
            return True
        if request.admin:  # admin access may share a device with other claims, never within this one
            return device.id not in self.allocating
        return device.id not in self.allocated and device.id not in self.allocating

    def _consumption(self, request: _Request, device: _Device) -> dict[str, Fraction] | str:
        """What ``request`` would consume of ``device`` (empty for a whole device), or why it cannot use it."""
        key = (id(request), device.index)
        if key not in self.consumptions:
            capacities = device.spec.get("capacity") or {}
            self.consumptions[key] = consumption(capacities, request.capacity, device.id[0], multiple=device.multiple)
        return self.consumptions[key]

    def _fits(self, request: _Request, device: _Device) -> bool:
        """The request's share of the device fits in what is left of its capacity."""
        share = self._consumption(request, device)
        if isinstance(share, str):
            return False
        capacities = device.spec.get("capacity") or {}
        return all(
            self.capacity_taken.get((device.id, name), Fraction(0)) + value <= amount(capacities[name])
            for name, value in share.items()
        )

    def _add(self, request: _Request, device: _Device, *, must: bool) -> bool:
        if not self._fits(request, device):
            return False
        if not self._take_counters(device):
            return False
        if _taint_blocks(device, request):
            self._return_counters(device)
            return False
        for i, constraint in enumerate(self.constraints):
            if not constraint.add(request, device):
                for earlier in self.constraints[:i]:
                    earlier.remove(request, device)
                self._return_counters(device)
                if must:
                    raise _Abort(
                        f"claim {self.ref}, request {request.full_name}: cannot add device {device.label} "
                        "because a claim constraint would not be satisfied"
                    )
                return False
        share = self._consumption(request, device)
        assert not isinstance(share, str)  # _fits said so
        for name, value in share.items():
            self.capacity_taken[(device.id, name)] = self.capacity_taken.get((device.id, name), Fraction(0)) + value
        if not device.multiple:
            self.allocating.add(device.id)
        self.results.append((request, device))
        self.shares.append(share)
        return True

    def _remove(self, request: _Request, device: _Device) -> None:
        self.results.pop()
        for name, value in self.shares.pop().items():
            self.capacity_taken[(device.id, name)] -= value
        self.allocating.discard(device.id)
        for constraint in self.constraints:
            constraint.remove(request, device)
        self._return_counters(device)

    def _take_counters(self, device: _Device) -> bool:
        uses = device.spec.get("consumesCounters") or []
        taken: list[tuple[tuple[str, str, str], Fraction]] = []
        ok = True
        for use in uses:
            available = device.pool.counters.get(use.get("counterSet", ""))
            for counter, value in (use.get("counters") or {}).items():
                key = (device.pool.id, use.get("counterSet", ""), counter)
                used = amount(value)
                self.consumed[key] = self.consumed.get(key, Fraction(0)) + used
                taken.append((key, used))
                if available is None or counter not in available or self.consumed[key] > available[counter]:
                    ok = False
        if not ok:
            for key, used in taken:
                self.consumed[key] -= used
        return ok

    def _return_counters(self, device: _Device) -> None:
        for use in device.spec.get("consumesCounters") or []:
            for counter, value in (use.get("counters") or {}).items():
                self.consumed[(device.pool.id, use.get("counterSet", ""), counter)] -= amount(value)

    # ----- the result ------------------------------------------------------------------------------

    def _allocation(self) -> dict[str, Any]:
        results = []
        for (request, device), share in zip(self.results, self.shares, strict=True):
            entry: dict[str, Any] = {
                "request": request.full_name,
                "driver": device.id[0],
                "pool": device.id[1],
                "device": device.id[2],
            }
            if request.admin:
                entry["adminAccess"] = True
            if request.tolerations:
                entry["tolerations"] = copy.deepcopy(request.tolerations)
            if device.multiple:
                entry["shareID"] = str(uuid.uuid4())
                entry["consumedCapacity"] = {name: quantity_text(value) for name, value in sorted(share.items())}
            results.append(entry)
        devices: dict[str, Any] = {"results": results}
        config = self._config()
        if config:
            devices["config"] = config
        allocation: dict[str, Any] = {"devices": devices}
        for _, device in self.results:
            node = device.slice["spec"].get("nodeName")
            if node:
                term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                allocation["nodeSelector"] = {"nodeSelectorTerms": [term]}
                break
        return allocation

    def _config(self) -> list[dict[str, Any]]:
        """Class configs first (each class once, listing the requests that use it), then the claim's configs
        that apply to an allocated request or the chosen subrequest, in their order."""
        config: list[dict[str, Any]] = []
        by_class: dict[str, tuple[int, int]] = {}
        chosen = [c for c in self.chosen if c is not None]
        for request in chosen:
            if request.class_name in by_class:
                first, last = by_class[request.class_name]
                for entry in config[first:last]:
                    entry["requests"].append(request.full_name)
                continue
            first = len(config)
            for item in (request.klass.get("spec") or {}).get("config") or []:
                body = {k: copy.deepcopy(v) for k, v in item.items() if k != "requests"}
                config.append({"source": "FromClass", "requests": [request.full_name], **body})
            by_class[request.class_name] = (first, len(config))
        for item in ((self.claim.get("spec") or {}).get("devices") or {}).get("config") or []:
            names = item.get("requests") or []
            body = {k: copy.deepcopy(v) for k, v in item.items() if k != "requests"}
            if not names:
                config.append({"source": "FromClaim", **body})
            elif any(r.main in names or (r.parent is not None and r.full_name in names) for r in chosen):
                config.append({"source": "FromClaim", "requests": list(names), **body})
        return config

    # ----- why not --------------------------------------------------------------------------------

    def _explain(self) -> str:
        """The scheduler says "cannot allocate all claims"; this adds which request and why."""
        ignored = f" (ignored: {'; '.join(self.diag.ignored_pools)})" if self.diag.ignored_pools else ""
        first_error = f"; first CEL error: {self.diag.first_cel_error}" if self.diag.cel_errors else ""
        if not self.pools:
            return f"cannot allocate all claims: no ResourceSlices for node {self.node}{first_error}"
        for alternatives in self.requests:
            reasons = [self._shortfall(r) for r in alternatives]
            if all(reasons):
                if alternatives[0].parent is None:
                    why = reasons[0]
                else:
                    name = alternatives[0].main
                    why = f'request "{name}": no subrequest can be allocated: ' + "; ".join(str(r) for r in reasons)
                return f"cannot allocate all claims: {why}{ignored}{first_error}"
        limits = [f"{c.kind} {c.attribute}" for c in self.constraints]
        if any(d.spec.get("consumesCounters") for d in self.candidates):
            limits.append("the pool's shared counters")
        names = ", ".join(f'"{a[0].main}"' for a in self.requests)
        what = f"request {names} has" if len(self.requests) == 1 else f"requests {names} each have"
        return (
            f"cannot allocate all claims: {what} enough matching devices, but not within "
            f"{' and '.join(limits) or 'the devices free together'}{ignored}{first_error}"
        )

    def _shortfall(self, request: _Request) -> str | None:
        """Why ``request`` cannot be satisfied even on its own, or None if it can."""
        need = request.count
        total = len(self.candidates)
        in_class = [d for d in self.candidates if self._class_ok(request, d)]
        matching = [d for d in in_class if self._selectable(request, d, abort=False)]
        free = [d for d in matching if request.admin or d.multiple or d.id not in self.allocated]
        usable = [d for d in free if not _taint_blocks(d, request)]
        fitting = [d for d in usable if self._fits(request, d)]
        label = f'request "{request.full_name}"'
        if request.mode == ALL:
            if not matching:
                return f"{label} asks for all devices of class {request.class_name} but none match ({total} on node)"
            if len(fitting) == len(matching):
                return None
            return (
                f"{label} asks for all {len(matching)} matching devices: {len(matching) - len(free)} allocated to "
                f"other claims, {len(free) - len(usable)} with a taint the request does not tolerate"
            )
        if len(fitting) >= need:
            return None
        shared = any(d.multiple for d in usable)
        steps = [
            (f"match class {request.class_name}", in_class),
            ("match the request's selectors", matching) if request.selectors else None,
            ("are not allocated to other claims", free),
            ("have no untolerated NoSchedule/NoExecute taint", usable),
            ("have the requested capacity free", fitting) if request.capacity or shared else None,
        ]
        said = [f"{total} devices on node {self.node}"]
        for step in steps:
            if step is None:
                continue
            said.append(f"{len(step[1])} {step[0]}")
            if len(step[1]) < need:
                break
        return f"{label} needs {need} device{'s' if need != 1 else ''}: {', '.join(said)}"

    def _class_ok(self, request: _Request, device: _Device) -> bool:
        return self._selectors_match(device, request.class_selectors, f"class {request.class_name}", False)


# ----- taints, constraints, quantities -------------------------------------------------------------


def _taint_blocks(device: _Device, request: _Request) -> bool:
    for taint in device.spec.get("taints") or []:
        if taint.get("effect") in BLOCKING_EFFECTS and not any(_tolerates(t, taint) for t in request.tolerations):
            return True
    return False


def _tolerates(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    """resourceclaim.ToleratesTaint (the core/v1 rules): empty effect and empty key match all; operator
    Exists matches any value, Equal (the default) the same value."""
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    if toleration.get("key") and toleration["key"] != taint.get("key"):
        return False
    operator = toleration.get("operator") or "Equal"
    if operator == "Exists":
        return True
    if operator == "Equal":
        return (toleration.get("value") or "") == (taint.get("value") or "")
    return False


def _attribute(device: _Device, name: str) -> tuple[Any, ...] | None:
    """A constraint's fully qualified attribute on a device (lookupAttribute), as a comparable value."""
    attributes = device.spec.get("attributes") or {}
    value = attributes.get(name)
    if value is None:
        domain, _, ident = name.partition("/")
        if domain == device.id[0]:
            value = attributes.get(ident)
    if not isinstance(value, Mapping) or len(value) != 1:
        return None
    ((kind, raw),) = value.items()
    return (kind, tuple(raw) if isinstance(raw, list) else raw)


class _Constraint:
    kind = ""

    def __init__(self, names: set[str], attribute: str) -> None:
        self.names = names
        self.attribute = attribute

    def add(self, request: _Request, device: _Device) -> bool:
        raise NotImplementedError

    def remove(self, request: _Request, device: _Device) -> None:
        raise NotImplementedError


class _MatchAttribute(_Constraint):
    """All chosen devices of the named requests share the attribute's value; a device without it fails."""

    kind = "matchAttribute"

    def __init__(self, names: set[str], attribute: str) -> None:
        super().__init__(names, attribute)
        self.value: tuple[Any, ...] | None = None
        self.count = 0

    def add(self, request: _Request, device: _Device) -> bool:
        if not request.applies(self.names):
            return True
        value = _attribute(device, self.attribute)
        if value is None or (self.count and value != self.value):
            return False
        self.value = value
        self.count += 1
        return True

    def remove(self, request: _Request, device: _Device) -> None:
        if request.applies(self.names):
            self.count -= 1


class _DistinctAttribute(_Constraint):
    """All chosen devices of the named requests have different values of the attribute."""

    kind = "distinctAttribute"

    def __init__(self, names: set[str], attribute: str) -> None:
        super().__init__(names, attribute)
        self.values: list[tuple[Any, ...]] = []

    def add(self, request: _Request, device: _Device) -> bool:
        if not request.applies(self.names):
            return True
        value = _attribute(device, self.attribute)
        if value is None or value in self.values:
            return False
        self.values.append(value)
        return True

    def remove(self, request: _Request, device: _Device) -> None:
        if request.applies(self.names):
            value = _attribute(device, self.attribute)
            if value in self.values:
                self.values.remove(value)
