"""From a ResourceClaim to what Prepare must do for it (a ``PreparePlan``), or why it cannot (a ``ClaimError``).

``plan_prepare`` reads the claim as the Kubernetes API returns it (``resource.k8s.io/v1`` JSON, camelCase keys) and
decides, without touching anything:

- which allocation results are this driver's in this node's pool (``status.allocation.devices.results[]``;
  results of other drivers are skipped, as are this driver's results in other pools when some are in ours);
- which opaque config applies to each result, in NVIDIA's precedence (facts/dra.md C5): the configs of this
  driver from ``status.allocation.devices.config[]``, class configs (``FromClass``) before claim configs
  (``FromClaim``), each in order, lowest to highest precedence; for each result the highest-precedence config
  whose ``requests`` names the result's request wins, and must be of the device's type (else NVIDIA's error
  ``cannot apply GpuConfig to device "gpu-0-mig-1g10gb-19-0" of type "mig" (request: mig)``); failing that, the
  highest-precedence config with empty ``requests`` *of the device's type* wins; failing that, the default
  (``config`` is ``None``: no sharing);
- that each device exists on this node, is healthy and is not prepared for another claim (NVIDIA's
  ``requested device gpu-0 is already allocated to different claim <uid>``). Admin-access results may use a
  device another claim holds, and an unhealthy one: that is what admin access (monitoring, diagnostics) is for;
- the sharing each device's config asks for: TimeSlicing (``PlannedDevice.timeslice``, whole GPUs; a MIG device's
  TimeSlicing does nothing, as on NVIDIA's driver) or MPS (``PlannedDevice.mps``, GPUs and MIG devices, dynamic
  ones too); a claim's MPS devices share one daemon, so they must share one MPS config;
- for a GPU shared by memory (``agent.core.dra.shares``; the result carries ``shareID`` and ``consumedCapacity``):
  the claim's share (``PlannedDevice.share``), which must fit next to the shares other prepared claims hold; a GPU
  allocated whole conflicts with any share of it, and a share with a claim that holds the GPU whole. A share of
  part of a GPU is enforced through MPS, so it takes no sharing config of its own, and one claim holds a share of
  one GPU at most (an MPS client reaches one control daemon).

Decisions where NVIDIA and the API differ or the facts are unsure:

- A config naming a main request ``gpu`` also applies to results of its subrequests (``gpu/a100``), as the
  ``resource.k8s.io`` API documents for ``DeviceClaimConfiguration.requests``; NVIDIA v0.4.1 compares literally
  and would skip it (facts C5 (?)). A config naming ``gpu/a100`` applies to that subrequest only.
- A config without ``opaque`` is skipped (the API allows ignoring configs a driver does not know); NVIDIA fails
  the claim with "only opaque parameters are supported by this driver".
- The kubelet gets base request names (``gpu`` for ``gpu/a100``), as Kubernetes' kubelet-plugin helper sends them,
  since containers reference requests by their main name.

Errors name the claim (``namespace/name``, uid) and every reason found, joined by ``; ``; ``retriable`` marks the
ones a later attempt may not hit (claim not allocated yet, deleted or re-created, API server trouble).

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple, Protocol

from msgspec import Struct

from agent.core.dra.opaque import (
    GPU_CONFIG,
    MPS,
    TIME_SLICING,
    DeviceConfig,
    MpsConfig,
    OpaqueConfigError,
    decode,
    parse_quantity,
    unsupported,
)
from agent.core.dra.shares import Share, over_committed, share_of, whole

MAX_RESULTS = 32  # resource.k8s.io AllocationResultsMaxSize
FROM_CLASS = "FromClass"
FROM_CLAIM = "FromClaim"


class PreparableDevice(Protocol):
    """What Prepare needs of a device in this node's pool (``agent.core.dra.devices.DraDevice`` has it)."""

    @property
    def name(self) -> str: ...
    @property
    def kind(self) -> Literal["gpu", "mig"]: ...
    @property
    def uuid(self) -> str: ...
    @property
    def parent_uuid(self) -> str | None: ...
    @property
    def gpu_minor(self) -> int: ...
    @property
    def gi_id(self) -> int | None: ...  # a MIG device's GPU instance ID; None for a full GPU
    @property
    def ci_id(self) -> int | None: ...  # a MIG device's compute instance ID; None for a full GPU
    @property
    def consumes_counters(self) -> Mapping[str, Mapping[str, int]]: ...  # a dynamic-MIG GPU's devices only
    @property
    def gi_profile_id(self) -> int | None: ...  # a dynamic-MIG partition: the GPU-instance profile to create
    @property
    def placement(self) -> tuple[int, int] | None: ...  # ... and where: (start, size) in memory slices
    @property
    def capacity(self) -> Mapping[str, int]: ...  # base units (bytes, counts)
    @property
    def allow_multiple_allocations(self) -> bool: ...  # a GPU shared by memory (shares)


class ClaimRef(NamedTuple):
    """A claim as the kubelet names it in NodePrepareResources / NodeUnprepareResources."""

    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} (uid {self.uid})"


class PlannedDevice(Struct, frozen=True):
    """One allocation result to prepare, with the config that applies to it."""

    request: str  # the result's request as allocated: "gpu", or "gpu/a100" for a firstAvailable subrequest
    pool: str
    device: str  # the device name in the ResourceSlice, e.g. "gpu-0" or "gpu-0-mig-1g10gb-19-0"
    info: PreparableDevice
    admin_access: bool = False
    share_id: str | None = None
    config: DeviceConfig | None = None  # None: no config applies, NVIDIA's default (no sharing)
    config_source: str = "default"  # e.g. "config[1] (FromClaim, requests [gpu])"
    share: Share | None = None  # what the claim takes of a GPU shared by memory (its consumedCapacity)
    # admin access to a GPU another claim holds: the time-slice is that claim's, never set nor reset for this one
    leaves_timeslice: bool = False

    @property
    def request_name(self) -> str:
        """The request name the kubelet matches against containers' ``resources.claims[].request``."""
        return base_request(self.request)

    @property
    def timeslice(self) -> int | None:
        """The time-slice level (0-3) Prepare sets on a whole GPU its config time-slices; None otherwise (a MIG
        device's TimeSlicing does nothing, as on NVIDIA's driver)."""
        sharing = self.config.sharing if self.config is not None else None
        if sharing is None or sharing.strategy != TIME_SLICING or self.info.kind != "gpu" or self.leaves_timeslice:
            return None
        return sharing.interval_value

    @property
    def mps(self) -> MpsConfig | None:
        """The MPS settings when the device's config shares it through MPS (GPU or MIG device)."""
        sharing = self.config.sharing if self.config is not None else None
        return sharing.mps if sharing is not None and sharing.strategy == MPS else None

    @property
    def mps_share(self) -> Share | None:
        """The share when it is part of a shared GPU, enforced through MPS; None for a whole device (a share of
        all the GPU's memory is one)."""
        return self.share if self.share is not None and not whole(self.info, self.share) else None


class PreparePlan(Struct, frozen=True):
    """Everything Prepare does for one claim, decided before anything is done."""

    claim: ClaimRef
    devices: tuple[PlannedDevice, ...]


class ClaimError(Struct, frozen=True):
    """Why one claim cannot be prepared; goes in that claim's ``error`` in the response, the batch goes on."""

    claim: ClaimRef
    reason: str
    retriable: bool = False

    @property
    def message(self) -> str:
        return f"ResourceClaim {self.claim}: {self.reason}"


def base_request(request: str) -> str:
    """``gpu`` for ``gpu/a100`` (Kubernetes' ``resourceclaim.BaseRequestRef``)."""
    return request.split("/", 1)[0]


def plan_prepare(
    ref: ClaimRef,
    claim: Mapping[str, Any] | None,
    *,
    driver: str,
    pool: str,
    devices: Mapping[str, PreparableDevice],
    unhealthy: Mapping[str, str] | None = None,
    held_by: Mapping[str, ClaimRef] | None = None,
    shares_held: Mapping[str, Mapping[str, Share]] | None = None,
) -> PreparePlan | ClaimError:
    """Plan Prepare for the claim the kubelet names (``ref``) from the claim the API server returned.

    ``claim`` is ``None`` when the API server says it does not exist. ``devices`` are this node's devices in
    ``pool`` by name; ``unhealthy`` maps a device name to why it is unhealthy (e.g. ``"XID 79"``); ``held_by``
    maps a device name to the claim that holds it (prepare completed, not admin access), from the checkpoint;
    ``shares_held`` maps a shared GPU's device name to the shares other claims hold of it (by claim).
    """
    unhealthy = unhealthy or {}
    held_by = held_by or {}
    shares_held = shares_held or {}

    def fail(reason: str, *, retriable: bool = False) -> ClaimError:
        return ClaimError(ref, reason, retriable)

    if claim is None:
        return fail(
            "not found in the API server: it was deleted before it could be prepared; the kubelet retries "
            "while the pod still needs it",
            retriable=True,
        )
    metadata = _mapping(claim.get("metadata"))
    uid = metadata.get("uid")
    if uid != ref.uid:
        return fail(
            f"the API server has a claim of that name with uid {uid}: the claim the kubelet asked for was deleted "
            "and re-created; the kubelet retries with the new one",
            retriable=True,
        )
    allocation = _mapping(_mapping(claim.get("status")).get("allocation"))
    if not allocation:
        return fail("not allocated yet (no status.allocation); the kubelet retries once it is", retriable=True)
    allocated = _mapping(allocation.get("devices"))
    results = [_mapping(r) for r in _list(allocated.get("results"))]
    if len(results) > MAX_RESULTS:
        return fail(f"has {len(results)} allocation results, more than the API's limit of {MAX_RESULTS}")

    ours = [r for r in results if r.get("driver") == driver]
    in_pool = [r for r in ours if r.get("pool") == pool]
    if not ours:
        return fail(f"has no devices from driver {driver}")
    if not in_pool:
        pools = ", ".join(sorted({str(r.get("pool")) for r in ours}))
        return fail(
            f"is allocated devices of driver {driver} in pool {pools}, not in this node's pool {pool}: "
            "the pod was bound to a node its claim was not allocated on"
        )

    configs = _driver_configs(_list(allocated.get("config")), driver)
    if isinstance(configs, str):
        return fail(configs)

    planned: list[PlannedDevice] = []
    problems: list[str] = []
    sharing: dict[str, list[str]] = {}  # config description -> devices it would share
    for result in in_pool:
        name = str(result.get("device"))
        request = str(result.get("request"))
        admin = result.get("adminAccess") is True
        info = devices.get(name)
        if info is None:
            problems.append(
                f'requested device "{name}" does not exist on this node (pool {pool}); it may have been removed '
                "or re-partitioned since the claim was allocated"
            )
            continue
        if not admin and name in unhealthy:
            reason = unhealthy[name]
            problems.append(f'requested device "{name}" ({info.uuid}) is Unhealthy' + (f": {reason}" if reason else ""))
        holder = held_by.get(name)
        if not admin and holder is not None and holder.uid != ref.uid:
            problems.append(
                f"requested device {name} is already allocated to different claim {holder.uid} "
                f"({holder.namespace}/{holder.name})"
            )
        share = _share(result, info, shares_held.get(name, {})) if not admin else None
        if isinstance(share, str):
            problems.append(share)
            continue
        chosen = _choose_config(configs, request, info)
        if isinstance(chosen, str):
            problems.append(chosen)
            continue
        config, source = chosen
        if config is not None and (refusal := unsupported(config)) is not None:
            problems.append(f"{source}: {refusal}")
            continue
        if share is not None and not whole(info, share) and config is not None and config.sharing is not None:
            problems.append(
                f"requested device {name} is a share of a GPU, enforced through MPS with the limits of its "
                f"consumedCapacity; {source} asks for {config.sharing.strategy} sharing too: drop the sharing "
                "from that config, or request the whole GPU"
            )
            continue
        if config is not None and config.sharing is not None and config.sharing.strategy == MPS:
            sharing.setdefault(_mps_identity(config.sharing.mps), []).append(name)
        planned.append(
            PlannedDevice(
                request=request,
                pool=pool,
                device=name,
                info=info,
                admin_access=admin,
                share_id=result.get("shareID") or None,
                config=config,
                config_source=source,
                share=share,
            )
        )
    partial = [p.device for p in planned if p.mps_share is not None]
    if len(partial) > 1 or (partial and sharing):
        problems.append(
            f"it holds shares of {', '.join(partial)}{' and MPS devices' if sharing else ''}: a claim's containers "
            "reach one MPS control daemon, so a claim can hold a share of one GPU only; use one claim per share"
        )
    if len(sharing) > 1:  # one daemon serves the claim's MPS devices: their clients share one pipe
        problems.append(
            f"its MPS devices ({', '.join(n for names in sharing.values() for n in names)}) have different MPS "
            "settings; one claim's MPS devices share one daemon, so give them one config"
        )
    if problems:
        return fail("; ".join(problems))
    return PreparePlan(ref, tuple(planned))


# ----- shares -----------------------------------------------------------------------------------------------------


def _share(result: Mapping[str, Any], device: PreparableDevice, others: Mapping[str, Share]) -> Share | str | None:
    """The claim's share of a GPU shared by memory, or why it cannot have it; None for a device not shared."""
    name = device.name
    consumed = result.get("consumedCapacity")
    if not device.allow_multiple_allocations:
        return None
    if consumed is None:  # allocated whole: the cluster does not share (no DRAConsumableCapacity), or a bug
        if others:
            return (
                f"requested device {name} is allocated whole, but claims hold shares of it: {', '.join(sorted(others))}"
            )
        return None
    if not isinstance(consumed, Mapping):
        return f"requested device {name}: consumedCapacity is not a map of capacities"
    amounts: dict[str, int] = {}
    for capacity, value in consumed.items():
        try:
            amount = parse_quantity(str(value))
        except ValueError as error:
            return f"requested device {name}: consumedCapacity {capacity}: {error}"
        if amount.denominator != 1:
            return f"requested device {name}: consumedCapacity {capacity} {value} is not a whole number"
        amounts[str(capacity)] = int(amount)
    share = share_of(device, amounts)
    if isinstance(share, str):
        return f"requested device {name}: {share}"
    problem = over_committed(device, share, others)
    if problem is not None:
        return f"requested device {name} cannot be shared as allocated: {problem}"
    return share


# ----- configs ----------------------------------------------------------------------------------------------------


def _mps_identity(mps: MpsConfig | None) -> str:
    """Configs that give the same limits (a claim's MPS devices must agree)."""
    return repr(mps)


class _Config(NamedTuple):
    requests: tuple[str, ...]
    config: DeviceConfig
    source: str  # "config[2] (FromClaim, GpuConfig, requests [gpu])"


def _driver_configs(raw_configs: Sequence[Any], driver: str) -> list[_Config] | str:
    """This driver's configs, decoded, lowest precedence first; or the reason they cannot be used."""
    by_source: dict[str, list[_Config]] = {FROM_CLASS: [], FROM_CLAIM: []}
    errors: list[str] = []
    for index, raw in enumerate(raw_configs):
        entry = _mapping(raw)
        opaque = entry.get("opaque")
        if not isinstance(opaque, Mapping):
            continue  # not an opaque config: a future API extension, not ours to judge
        if opaque.get("driver") != driver:
            continue  # another driver's config: drivers skip them (facts B2)
        source = entry.get("source")
        requests = tuple(str(r) for r in _list(entry.get("requests")))
        where = f"config[{index}] ({source}, requests [{', '.join(requests) or 'all'}])"
        if source not in by_source:
            errors.append(f"{where}: invalid config source: {source} (expected {FROM_CLASS} or {FROM_CLAIM})")
            continue
        try:
            decoded = decode(opaque.get("parameters") or {})
        except OpaqueConfigError as error:
            errors.append(f"{where}: error decoding config parameters: {error}")
            continue
        label = f"config[{index}] ({source}, {decoded.kind}, requests [{', '.join(requests) or 'all'}])"
        by_source[source].append(_Config(requests, decoded, label))
    if errors:
        return "; ".join(errors)
    return by_source[FROM_CLASS] + by_source[FROM_CLAIM]


def _choose_config(
    configs: Sequence[_Config], request: str, device: PreparableDevice
) -> tuple[DeviceConfig | None, str] | str:
    """NVIDIA's choice for one result: ``(config, description)``, or the type-mismatch error."""
    for candidate in reversed(configs):
        if request in candidate.requests or base_request(request) in candidate.requests:
            if candidate.config.device_kind != device.kind:
                return (
                    f"{candidate.source}: cannot apply {candidate.config.kind} to device "
                    f'"{device.name}" of type "{device.kind}" (request: {request})'
                )
            return candidate.config, candidate.source
    for candidate in reversed(configs):
        if not candidate.requests and candidate.config.device_kind == device.kind:
            return candidate.config, candidate.source
    return None, f"default {GPU_CONFIG if device.kind == 'gpu' else 'MigDeviceConfig'}"


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: Any) -> Sequence[Any]:
    return value if isinstance(value, list | tuple) else ()
