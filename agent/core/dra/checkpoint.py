"""The prepared-claims checkpoint: what Tessera's DRA driver has prepared, encoded, checked and updated as values.

Prepare and Unprepare must survive agent restarts and work after a claim is deleted (facts/dra.md A2, C8), so the
driver keeps its own record of prepared claims. This is **Tessera's own file** (the shell keeps it as
``tessera-checkpoint.json`` in the driver's plugin directory); it never reads or writes the kubelet's
``dra_manager_state``, nor NVIDIA's ``checkpoint.json``, which a node moved from NVIDIA's driver may still have.

The file is the kubelet checkpointmanager's shape, ``{"data": "<JSON text>", "checksum": "sha256:<hex>"}``: the
checksum is SHA-256 over the exact bytes of ``data`` (UTF-8), so a torn write or a flipped byte anywhere is caught
(the kubelet uses a 32-bit hash; SHA-256 costs nothing at this size and has no accidental collisions). ``data``
holds::

    {"kind": "TesseraDRACheckpoint", "version": 1, "nodeBootID": "<boot id>",
     "preparedClaims": {"<claim uid>": {"checkpointState": "PrepareStarted" | "PrepareCompleted",
                                        "namespace": "...", "name": "...",
                                        "mps": {"key": "dra/…", "devices": ["GPU-…"]},
                                        "preparedDevices": [{"pool": "...", "device": "gpu-0",
                                                             "requests": ["gpu"], "cdiDeviceIDs": ["..."],
                                                             "adminAccess": false, "shareID": "...",
                                                             "share": {"memory": 10737418240, "computePercent": 30},
                                                             "mig": {"parentUUID": "GPU-…", "profileID": 19,
                                                                     "placementStart": 0, "placementSize": 1,
                                                                     "giID": 7, "ciID": 0, "uuid": "MIG-…"}}]}}}

``mig`` is there for a device Prepare created (dynamic MIG): its placement from ``PrepareStarted`` on, its IDs once
``PrepareCompleted``. ``timeSlice`` (``{"gpuUUID", "level"}``; NVIDIA records ``timeSliceApplied``) is the
time-slice Prepare sets on a GPU whose config time-slices it, recorded before it is set, so a rollback or
Unprepare puts the GPU back to Default. ``share`` is what the claim takes of a GPU shared by memory (its
``consumedCapacity``): the shares of prepared claims must fit the GPU together. ``mps`` names the MPS daemon a
claim's devices are served by (MPS sharing, or a share of a GPU), recorded before the daemon is asked for: the
agent's MPS manager keeps every recorded claim's daemon running.

``decode`` refuses a wrong checksum, an unknown kind or version, or a malformed document with ``CheckpointError``;
the caller then starts from ``empty(boot_id)`` and logs why. Unknown fields inside a good document are ignored, so
a downgraded agent still reads a newer file (as NVIDIA decodes its checkpoint non-strictly). ``for_boot`` drops
every claim when the node's boot ID changed: after a reboot nothing prepared is left (MIG devices, MPS daemons, the
CDI specs on tmpfs), so Prepare must run in full again (NVIDIA does the same since v0.4.0). When the current boot
ID is unknown it keeps them: no reboot can be told apart.

States (NVIDIA's): ``PrepareStarted`` is written before anything is done for a claim and ``PrepareCompleted`` once
its CDI spec is written; a claim found ``PrepareStarted`` is rolled back and redone, one found ``PrepareCompleted``
is answered from here. Only ``PrepareCompleted``, non-admin devices count as held against other claims: held whole
(``held_devices``) or as a share (``shares_held``).

Pure: the functions take and return immutable ``Checkpoint`` values; the shell reads and writes the bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, Literal

from msgspec import Struct, field
from msgspec.structs import replace

from agent.core.dra.claims import ClaimRef, PlannedDevice, PreparePlan
from agent.core.dra.mps import MpsRecord, ShareLimits
from agent.core.dra.shares import Share

CHECKPOINT_FILE = "tessera-checkpoint.json"
KIND = "TesseraDRACheckpoint"
VERSION = 1
PREPARE_STARTED = "PrepareStarted"
PREPARE_COMPLETED = "PrepareCompleted"
MAX_CHECKPOINT_BYTES = 64 * 1024 * 1024  # far above any real node (claims x 32 devices); a guard, not a limit

State = Literal["PrepareStarted", "PrepareCompleted"]


class CheckpointError(ValueError):
    """The checkpoint cannot be trusted; the message says why. The caller starts empty and logs it."""


class CreatedMig(Struct, frozen=True):
    """A MIG device Prepare creates for a dynamic-MIG partition. Where it goes is recorded before it is created
    (``PrepareStarted``), what it became once it exists (``PrepareCompleted``): an agent that dies in between finds
    the placement in the record and removes what it may have created there."""

    gpu_uuid: str
    profile_id: int  # the GPU-instance profile ID (NVML's, as in the device name)
    start: int  # placement, in memory slices
    size: int
    gi_id: int | None = None  # None until created and recorded
    ci_id: int | None = None
    uuid: str | None = None  # the MIG device's UUID


class Timeslice(Struct, frozen=True):
    """The compute time-slice Prepare sets on a GPU whose config time-slices it (recorded before it is set)."""

    gpu_uuid: str
    level: int  # 0 Default, 1 Short, 2 Medium, 3 Long


class PreparedDevice(Struct, frozen=True):
    """One device of a prepared claim, as the kubelet is told about it."""

    pool: str
    device: str
    requests: tuple[str, ...]  # request names given to the kubelet (base names: "gpu" for "gpu/a100")
    cdi_device_ids: tuple[str, ...] = ()  # empty while the claim is PrepareStarted
    admin_access: bool = False
    share_id: str | None = None
    mig: CreatedMig | None = None  # the MIG device Prepare created (dynamic MIG), to be destroyed by Unprepare
    timeslice: Timeslice | None = None  # the time-slice Prepare sets on the GPU, reset by Unprepare
    share: Share | None = None  # what the claim takes of a GPU shared by memory


class PreparedClaim(Struct, frozen=True):
    state: State
    namespace: str
    name: str
    devices: tuple[PreparedDevice, ...] = ()
    mps: MpsRecord | None = None  # the MPS daemon its devices are served by (MPS sharing)


class Checkpoint(Struct, frozen=True):
    boot_id: str
    claims: Mapping[str, PreparedClaim] = field(default_factory=lambda: MappingProxyType({}))  # by claim UID


def empty(boot_id: str) -> Checkpoint:
    return Checkpoint(boot_id=boot_id)


# ----- encoding ---------------------------------------------------------------------------------------------------


def encode(checkpoint: Checkpoint) -> bytes:
    """The file's bytes: deterministic (sorted keys), so the same checkpoint always gives the same file."""
    data = json.dumps(_to_json(checkpoint), sort_keys=True, separators=(",", ":"))
    envelope = {"data": data, "checksum": _checksum(data)}
    return (json.dumps(envelope, sort_keys=True) + "\n").encode()


def decode(content: bytes) -> Checkpoint:
    """The checkpoint in ``content``; ``CheckpointError`` if it is corrupt, tampered with or of unknown version."""
    if len(content) > MAX_CHECKPOINT_BYTES:
        raise CheckpointError(f"checkpoint is {len(content)} bytes, more than the {MAX_CHECKPOINT_BYTES} expected")
    try:
        envelope = json.loads(content)
    except (ValueError, RecursionError) as error:
        raise CheckpointError(f"checkpoint is not valid JSON: {error}") from None
    if not isinstance(envelope, dict) or not isinstance(envelope.get("data"), str):
        raise CheckpointError('checkpoint has no "data" string; it was not written by Tessera')
    data, checksum = envelope["data"], envelope.get("checksum")
    if not isinstance(checksum, str) or not hmac.compare_digest(checksum, _checksum(data)):
        raise CheckpointError(f"checkpoint checksum mismatch (stored {checksum!r}): the file is corrupt")
    try:
        document = json.loads(data)
    except (ValueError, RecursionError) as error:
        raise CheckpointError(f"checkpoint data is not valid JSON: {error}") from None
    if not isinstance(document, dict) or document.get("kind") != KIND:
        kind = document.get("kind") if isinstance(document, dict) else None
        raise CheckpointError(f"checkpoint kind is {kind!r}, not {KIND!r}")
    if document.get("version") != VERSION:
        raise CheckpointError(
            f"checkpoint version {document.get('version')!r} is unknown; this agent reads version {VERSION} "
            "(was it written by a newer Tessera?)"
        )
    try:
        return _from_json(document)
    except (TypeError, ValueError, KeyError, AttributeError) as error:
        raise CheckpointError(f"checkpoint data is malformed: {error}") from None


def for_boot(checkpoint: Checkpoint, boot_id: str) -> Checkpoint:
    """The checkpoint valid for this boot: all of it, or nothing after a reboot (a different boot ID).

    ``boot_id`` empty means this boot's ID is unknown (it could not be read): no reboot can be told apart, so the
    checkpoint is kept as it is; dropping it would forget devices that are still prepared.
    """
    if not boot_id or checkpoint.boot_id == boot_id:
        return checkpoint
    if not checkpoint.boot_id:
        return replace(checkpoint, boot_id=boot_id)  # no boot ID recorded: adopt this one, as NVIDIA does
    return empty(boot_id)


# ----- updates ----------------------------------------------------------------------------------------------------


def prepare_started(checkpoint: Checkpoint, plan: PreparePlan) -> Checkpoint:
    """Record that Prepare begins for the plan's claim (replacing an earlier attempt), before anything is done;
    the MIG devices it will create are recorded by placement."""
    devices = tuple(_device(d, (), planned_mig(d)) for d in plan.devices)
    return _with(checkpoint, plan.claim, PreparedClaim(PREPARE_STARTED, plan.claim.namespace, plan.claim.name, devices))


def planned_mig(planned: PlannedDevice) -> CreatedMig | None:
    """The MIG device Prepare creates for ``planned`` (a dynamic-MIG partition), not created yet; else None."""
    info = planned.info
    if info.placement is None or info.gi_profile_id is None or info.parent_uuid is None:
        return None
    start, size = info.placement
    return CreatedMig(info.parent_uuid, info.gi_profile_id, start, size)


def prepare_completed(
    checkpoint: Checkpoint,
    plan: PreparePlan,
    cdi_device_ids: Mapping[str, Sequence[str]],
    created: Mapping[str, CreatedMig] | None = None,
) -> Checkpoint:
    """Record that the plan's claim is prepared; ``cdi_device_ids`` maps each device name to its CDI IDs and
    ``created`` to the MIG device made for it (dynamic MIG)."""
    missing = [d.device for d in plan.devices if not cdi_device_ids.get(d.device)]
    if missing:
        raise ValueError(f"claim {plan.claim}: no CDI device IDs for {', '.join(missing)}")
    created = created or {}
    devices = tuple(_device(d, tuple(cdi_device_ids[d.device]), created.get(d.device)) for d in plan.devices)
    started = checkpoint.claims.get(plan.claim.uid)
    mps = started.mps if started is not None else None
    claim = PreparedClaim(PREPARE_COMPLETED, plan.claim.namespace, plan.claim.name, devices, mps)
    return _with(checkpoint, plan.claim, claim)


def with_mps(checkpoint: Checkpoint, claim_uid: str, record: MpsRecord) -> Checkpoint:
    """Record, while Prepare runs, the MPS daemon the claim needs: the loop starts it from the checkpoint."""
    claim = checkpoint.claims[claim_uid]
    return replace(checkpoint, claims=MappingProxyType({**checkpoint.claims, claim_uid: replace(claim, mps=record)}))


def without_mps(checkpoint: Checkpoint, claim_uid: str) -> Checkpoint:
    """The claim no longer needs its MPS daemon (Unprepare under way)."""
    claim = checkpoint.claims[claim_uid]
    return replace(checkpoint, claims=MappingProxyType({**checkpoint.claims, claim_uid: replace(claim, mps=None)}))


def mps_records(checkpoint: Checkpoint) -> dict[str, MpsRecord]:
    """Claim UID -> the MPS daemon it needs, for every recorded claim with one (completed or being prepared)."""
    return {uid: claim.mps for uid, claim in checkpoint.claims.items() if claim.mps is not None}


def unprepared(checkpoint: Checkpoint, claim_uid: str) -> Checkpoint:
    """Forget the claim (nothing happens for an unknown one: Unprepare of an unknown claim succeeds)."""
    if claim_uid not in checkpoint.claims:
        return checkpoint
    claims = {uid: c for uid, c in checkpoint.claims.items() if uid != claim_uid}
    return replace(checkpoint, claims=MappingProxyType(claims))


# ----- queries ----------------------------------------------------------------------------------------------------


def completed(checkpoint: Checkpoint, claim_uid: str) -> PreparedClaim | None:
    """The claim if its Prepare completed: Prepare answers it from here, redoing nothing."""
    claim = checkpoint.claims.get(claim_uid)
    return claim if claim is not None and claim.state == PREPARE_COMPLETED else None


def held_devices(checkpoint: Checkpoint) -> dict[str, ClaimRef]:
    """Device name → the claim holding it whole: claims whose Prepare completed, devices without admin access
    and not a share (``shares_held``)."""
    held: dict[str, ClaimRef] = {}
    for uid, claim in sorted(checkpoint.claims.items()):
        if claim.state != PREPARE_COMPLETED:
            continue
        for device in claim.devices:
            if not device.admin_access and device.share is None:
                held.setdefault(device.device, ClaimRef(claim.namespace, claim.name, uid))
    return held


def shares_held(checkpoint: Checkpoint, *, other_than: str) -> dict[str, dict[str, Share]]:
    """Device name → the shares completed claims other than ``other_than`` hold of it, by ``namespace/name``."""
    shares: dict[str, dict[str, Share]] = {}
    for uid, claim in sorted(checkpoint.claims.items()):
        if uid == other_than or claim.state != PREPARE_COMPLETED:
            continue
        for device in claim.devices:
            if device.share is not None:
                shares.setdefault(device.device, {})[f"{claim.namespace}/{claim.name}"] = device.share
    return shares


def holder(checkpoint: Checkpoint, device: str, *, other_than: str) -> ClaimRef | None:
    """The completed claim other than ``other_than`` that holds ``device`` without admin access, if any."""
    for uid, claim in sorted(checkpoint.claims.items()):
        if uid == other_than or claim.state != PREPARE_COMPLETED:
            continue
        if any(d.device == device and not d.admin_access for d in claim.devices):
            return ClaimRef(claim.namespace, claim.name, uid)
    return None


# ----- helpers ----------------------------------------------------------------------------------------------------


def _checksum(data: str) -> str:
    return "sha256:" + hashlib.sha256(data.encode()).hexdigest()


def _with(checkpoint: Checkpoint, ref: ClaimRef, claim: PreparedClaim) -> Checkpoint:
    return replace(checkpoint, claims=MappingProxyType({**checkpoint.claims, ref.uid: claim}))


def _device(planned: PlannedDevice, cdi_ids: tuple[str, ...], mig: CreatedMig | None) -> PreparedDevice:
    return PreparedDevice(
        pool=planned.pool,
        device=planned.device,
        requests=(planned.request_name,),
        cdi_device_ids=cdi_ids,
        admin_access=planned.admin_access,
        share_id=planned.share_id,
        mig=mig,
        timeslice=None if planned.timeslice is None else Timeslice(planned.info.uuid, planned.timeslice),
        share=planned.share,
    )


def _mig_to_json(mig: CreatedMig) -> dict[str, Any]:
    ids = {"giID": mig.gi_id, "ciID": mig.ci_id, "uuid": mig.uuid}
    return {
        "parentUUID": mig.gpu_uuid,
        "profileID": mig.profile_id,
        "placementStart": mig.start,
        "placementSize": mig.size,
        **{key: value for key, value in ids.items() if value is not None},
    }


def _mig_from_json(raw: Any, where: str) -> CreatedMig:
    if not isinstance(raw, dict):
        raise TypeError(f"{where} is not an object")

    def number(key: str, required: bool = True) -> int | None:
        value = raw.get(key)
        if value is None and not required:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise TypeError(f"{where}.{key} is not a whole number")
        return value

    uuid = raw.get("uuid")
    return CreatedMig(
        gpu_uuid=_str(raw.get("parentUUID"), f"{where}.parentUUID"),
        profile_id=number("profileID") or 0,
        start=number("placementStart") or 0,
        size=number("placementSize") or 0,
        gi_id=number("giID", False),
        ci_id=number("ciID", False),
        uuid=None if uuid is None else _str(uuid, f"{where}.uuid"),
    )


def _to_json(checkpoint: Checkpoint) -> dict[str, Any]:
    return {
        "kind": KIND,
        "version": VERSION,
        "nodeBootID": checkpoint.boot_id,
        "preparedClaims": {
            uid: {
                "checkpointState": claim.state,
                "namespace": claim.namespace,
                "name": claim.name,
                **({"mps": _mps_to_json(claim.mps)} if claim.mps else {}),
                "preparedDevices": [
                    {
                        "pool": d.pool,
                        "device": d.device,
                        "requests": list(d.requests),
                        "cdiDeviceIDs": list(d.cdi_device_ids),
                        "adminAccess": d.admin_access,
                        **({"shareID": d.share_id} if d.share_id else {}),
                        **({"mig": _mig_to_json(d.mig)} if d.mig is not None else {}),
                        **({"timeSlice": _timeslice_to_json(d.timeslice)} if d.timeslice is not None else {}),
                        **({"share": _share_to_json(d.share)} if d.share is not None else {}),
                    }
                    for d in claim.devices
                ],
            }
            for uid, claim in checkpoint.claims.items()
        },
    }


def _from_json(document: Mapping[str, Any]) -> Checkpoint:
    boot_id = _str(document.get("nodeBootID", ""), "nodeBootID")
    raw_claims = document.get("preparedClaims") or {}
    if not isinstance(raw_claims, dict):
        raise TypeError("preparedClaims is not an object")
    claims: dict[str, PreparedClaim] = {}
    for uid, raw in raw_claims.items():
        where = f"preparedClaims[{uid}]"
        if not isinstance(raw, dict):
            raise TypeError(f"{where} is not an object")
        state = raw.get("checkpointState")
        if state not in (PREPARE_STARTED, PREPARE_COMPLETED):
            raise ValueError(f"{where}.checkpointState is {state!r}")
        raw_devices = raw.get("preparedDevices") or []
        if not isinstance(raw_devices, list):
            raise TypeError(f"{where}.preparedDevices is not a list")
        devices = tuple(_device_from_json(d, f"{where}.preparedDevices[{i}]") for i, d in enumerate(raw_devices))
        raw_mps = raw.get("mps")
        mps = None
        if raw_mps is not None:
            if not isinstance(raw_mps, dict):
                raise TypeError(f"{where}.mps is not an object")
            mps = MpsRecord(
                _str(raw_mps.get("key"), f"{where}.mps.key"),
                _strs(raw_mps.get("devices"), f"{where}.mps.devices"),
                _strs(raw_mps.get("env", []), f"{where}.mps.env"),
                share=_limits(raw_mps.get("share"), f"{where}.mps.share"),
            )
        claims[uid] = PreparedClaim(
            state=state,
            namespace=_str(raw.get("namespace"), f"{where}.namespace"),
            name=_str(raw.get("name"), f"{where}.name"),
            devices=devices,
            mps=mps,
        )
    return Checkpoint(boot_id=boot_id, claims=MappingProxyType(claims))


def _device_from_json(raw: Any, where: str) -> PreparedDevice:
    if not isinstance(raw, dict):
        raise TypeError(f"{where} is not an object")
    admin = raw.get("adminAccess", False)
    if not isinstance(admin, bool):
        raise TypeError(f"{where}.adminAccess is not a boolean")
    share_id = raw.get("shareID")
    return PreparedDevice(
        pool=_str(raw.get("pool"), f"{where}.pool"),
        device=_str(raw.get("device"), f"{where}.device"),
        requests=_strs(raw.get("requests", []), f"{where}.requests"),
        cdi_device_ids=_strs(raw.get("cdiDeviceIDs", []), f"{where}.cdiDeviceIDs"),
        admin_access=admin,
        share_id=None if share_id is None else _str(share_id, f"{where}.shareID"),
        mig=None if raw.get("mig") is None else _mig_from_json(raw["mig"], f"{where}.mig"),
        timeslice=None if raw.get("timeSlice") is None else _timeslice(raw["timeSlice"], f"{where}.timeSlice"),
        share=None if raw.get("share") is None else _share(raw["share"], f"{where}.share"),
    )


def _mps_to_json(record: MpsRecord) -> dict[str, Any]:
    raw: dict[str, Any] = {"key": record.key, "devices": list(record.devices), "env": list(record.env)}
    if record.share is not None:  # a share's limits: the daemon's server defaults are built from them
        limits = record.share
        raw["share"] = {"memoryMiB": limits.memory_mib, "threads": limits.threads, "deviceMiB": limits.device_mib}
    return raw


def _limits(raw: Any, where: str) -> ShareLimits | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise TypeError(f"{where} is not an object")
    memory, threads, device = raw.get("memoryMiB"), raw.get("threads"), raw.get("deviceMiB", 0)
    if memory is not None and (type(memory) is not int or memory <= 0):
        raise TypeError(f"{where}.memoryMiB is not a positive number of MiB or null")
    if threads is not None and (type(threads) is not int or not 0 < threads <= 100):
        raise TypeError(f"{where}.threads is not a percentage 1-100 or null")
    if type(device) is not int or device < 0:
        raise TypeError(f"{where}.deviceMiB is not a number of MiB")
    return ShareLimits(memory, threads, device)


def _timeslice_to_json(timeslice: Timeslice) -> dict[str, Any]:
    return {"gpuUUID": timeslice.gpu_uuid, "level": timeslice.level}


def _timeslice(raw: Any, where: str) -> Timeslice:
    if not isinstance(raw, dict):
        raise TypeError(f"{where} is not an object")
    level = raw.get("level")
    if type(level) is not int or not 0 <= level <= 3:
        raise TypeError(f"{where}.level is not a time-slice level 0-3")
    return Timeslice(_str(raw.get("gpuUUID"), f"{where}.gpuUUID"), level)


def _share_to_json(share: Share) -> dict[str, Any]:
    raw = {"memory": share.memory, "computePercent": share.compute_percent}
    return raw | ({"shares": share.shares} if share.shares else {})


def _share(raw: Any, where: str) -> Share:
    if not isinstance(raw, dict):
        raise TypeError(f"{where} is not an object")
    memory, compute, shares = raw.get("memory"), raw.get("computePercent", 0), raw.get("shares", 0)
    if type(memory) is not int or memory < 0:
        raise TypeError(f"{where}.memory is not a number of bytes")
    if type(compute) is not int or not 0 <= compute <= 100:
        raise TypeError(f"{where}.computePercent is not a percentage 0-100")
    if type(shares) is not int or shares < 0:
        raise TypeError(f"{where}.shares is not a number of shares")
    return Share(memory, compute, shares)


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{where} is not a string")
    return value


def _strs(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TypeError(f"{where} is not a list of strings")
    return tuple(value)
