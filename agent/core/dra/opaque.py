"""NVIDIA's opaque device configs (``resource.nvidia.com/v1beta1``), decoded the way NVIDIA's DRA driver does.

A ResourceClaim or DeviceClass can carry ``opaque: {driver: gpu.nvidia.com, parameters: {...}}``. NVIDIA's driver
decodes ``parameters`` with a strict Kubernetes decoder (facts/dra.md C5), and so does this module:

- ``apiVersion`` must be ``resource.nvidia.com/v1beta1``; ``kind`` one of ``GpuConfig`` or ``MigDeviceConfig``,
  or one of NVIDIA's other kinds (``VfioDeviceConfig``, ``ComputeDomainChannelConfig``,
  ``ComputeDomainDaemonConfig``, ``ComputeDomain``), which decode as NVIDIA's driver decodes them but apply to no
  device Tessera publishes: as on NVIDIA's driver (facts/dra.md C5), a class-wide one (no ``requests``) is skipped
  for GPUs and MIG devices, and one naming a request of a GPU or MIG device fails that claim
  (``cannot apply VfioDeviceConfig to device "gpu-0" of type "gpu"``). ``VfioDeviceConfig`` is decoded strictly
  (``iommu.backendPolicy``, ``iommu.enableAPIDevice``); the compute-domain kinds, whose fields Tessera does not
  model, are not (decision). Any other kind or apiVersion is refused by name.
- Unknown fields are errors (``strict decoding error: unknown field "sharing.stratgy"``), names are
  case-sensitive, a duplicated field is an error, ``null`` means "not set" (as in Go), and values must have the
  JSON type the Go struct has (an int is not a float, a bool is not an int).
- The raw parameters are at most 10 KiB (``OpaqueParametersMaxLength``; the API server enforces it too).
- ``sharing`` is decoded, normalised and validated as NVIDIA does with its sharing gates on: ``strategy``
  ``TimeSlicing`` or ``MPS``; ``timeSlicingConfig.interval`` ``Default``/``Short``/``Medium``/``Long`` → 0..3
  (the number given to ``nvidia-smi compute-policy --set-timeslice``); TimeSlicing without ``timeSlicingConfig``
  means interval ``Default``; MPS without ``mpsConfig`` means ``{}``; ``timeSlicingConfig`` with MPS or
  ``mpsConfig`` with TimeSlicing (GpuConfig) is an error; ``MigDeviceConfig`` has no ``timeSlicingConfig``;
  ``defaultActiveThreadPercentage`` is 0..100; pinned memory limits are Kubernetes quantities of at least 1 MiB,
  normalised to NVIDIA's ``<MiB>M``; the per-device map is keyed by the device's index in the claim or its UUID
  (resolved against the claim's devices by ``pinned_memory_limits``).

Where NVIDIA is silent or would crash, this module decides (each noted where it happens): a
``timeSlicingConfig`` without ``interval`` means ``Default`` (NVIDIA dereferences a nil pointer there), limits
below 1 MiB are refused at decode time (NVIDIA refuses them when it starts the MPS daemon), and ``mpsConfig.
multiUser`` (added on NVIDIA's main after v0.4.1) decodes, but ``true`` is refused by name (``unsupported``, for a
config that applies to a device): an MPS control daemon
starts one server per user ID and a client of another user waits until that server drains (facts/mig-mps.md d),
so containers of different users cannot share a claim's daemon and Tessera does not pretend they can; ``false``
(the default, one user) is what Tessera does.

Applying a decoded sharing setting is not this module's business: ``agent.core.dra.claims`` plans it for each
device (time-slicing on whole GPUs, MPS on GPUs and MIG devices) and ``agent.dra.prepare`` applies it.

Numbers are bounded before any arithmetic (``agent.core.quantity``): ``"1e10000000"`` as a limit is refused at
once, naming the field and the bound, where exact arithmetic would hold the GIL for seconds.

Pure: no I/O. Errors are ``OpaqueConfigError`` with a message that names the field and the fix; nothing a claim
holds raises anything else (a ``ValueError`` or ``ArithmeticError`` no check foresaw becomes one too), so a bad
config is always the claim's own, final error, never an internal one the kubelet would retry forever.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from math import ceil
from typing import Any, Literal

from msgspec import Struct, field

from agent.core.quantity import QuantityError, parse_quantity

API_GROUP = "resource.nvidia.com"
API_VERSION = f"{API_GROUP}/v1beta1"
GPU_CONFIG = "GpuConfig"
MIG_DEVICE_CONFIG = "MigDeviceConfig"
VFIO_DEVICE_CONFIG = "VfioDeviceConfig"
SUPPORTED_KINDS = (GPU_CONFIG, MIG_DEVICE_CONFIG)
# NVIDIA's other registered kinds: decoded as NVIDIA does, applied to no device Tessera publishes
COMPUTE_DOMAIN_KINDS = ("ComputeDomainChannelConfig", "ComputeDomainDaemonConfig", "ComputeDomain")
NVIDIA_ONLY_KINDS = (VFIO_DEVICE_CONFIG, *COMPUTE_DOMAIN_KINDS)
ConfigKind = Literal[
    "GpuConfig",
    "MigDeviceConfig",
    "VfioDeviceConfig",
    "ComputeDomainChannelConfig",
    "ComputeDomainDaemonConfig",
    "ComputeDomain",
]
MAX_PARAMETERS_BYTES = 10 * 1024  # resource.k8s.io OpaqueParametersMaxLength

TIME_SLICING = "TimeSlicing"
MPS = "MPS"
INTERVALS = {"Default": 0, "Short": 1, "Medium": 2, "Long": 3}  # NVIDIA's TimeSliceInterval.Int()
MIB = 1024 * 1024

Strategy = Literal["TimeSlicing", "MPS"]


class OpaqueConfigError(ValueError):
    """The parameters cannot be used; the message says which field and why."""


class MpsConfig(Struct, frozen=True):
    """``sharing.mpsConfig``; limits already in NVIDIA's ``<MiB>M`` form."""

    default_active_thread_percentage: int | None = None
    default_pinned_device_memory_limit: str | None = None
    # key as written: a device index within the claim ("0") or a UUID; resolved by pinned_memory_limits()
    default_per_device_pinned_memory_limit: Mapping[str, str] = field(default_factory=dict)
    multi_user: bool | None = None


class Sharing(Struct, frozen=True):
    """``sharing``, normalised: TimeSlicing on a GPU always has an interval, MPS always has an ``MpsConfig``."""

    strategy: Strategy
    interval: str | None = None  # "Default" | "Short" | "Medium" | "Long"; None for MIG devices or MPS
    mps: MpsConfig | None = None

    @property
    def interval_value(self) -> int | None:
        """The number ``nvidia-smi compute-policy --set-timeslice`` takes (0..3)."""
        return None if self.interval is None else INTERVALS[self.interval]


class DeviceConfig(Struct, frozen=True):
    """One decoded config: a ``GpuConfig`` or ``MigDeviceConfig``, or one of NVIDIA's kinds for devices Tessera
    does not publish (vfio, compute domains), which never applies to a device here."""

    kind: ConfigKind
    sharing: Sharing | None = None

    @property
    def device_kind(self) -> Literal["gpu", "mig", "vfio", "compute-domain"]:
        """The kind of device this config may be applied to."""
        if self.kind == GPU_CONFIG:
            return "gpu"
        if self.kind == MIG_DEVICE_CONFIG:
            return "mig"
        return "vfio" if self.kind == VFIO_DEVICE_CONFIG else "compute-domain"


# the fields each object may have, by JSON path ("" is the top level); anything else is an unknown field
_MPS_FIELDS = (
    "defaultActiveThreadPercentage",
    "defaultPinnedDeviceMemoryLimit",
    "defaultPerDevicePinnedMemoryLimit",
    "multiUser",
)
_GPU_SHARING_FIELDS = ("strategy", "timeSlicingConfig", "mpsConfig")
_MIG_SHARING_FIELDS = ("strategy", "mpsConfig")
_TOP_FIELDS = ("apiVersion", "kind", "sharing")


def decode(parameters: bytes | str | Mapping[str, Any]) -> DeviceConfig:
    """Decode ``opaque.parameters``: raw JSON as sent, or the value already parsed from the claim's JSON."""
    with _config_errors("parameters cannot be decoded"):
        return _decode(parameters)


def _decode(parameters: bytes | str | Mapping[str, Any]) -> DeviceConfig:
    document = _load(parameters)
    if not isinstance(document, Mapping):
        raise OpaqueConfigError(f"parameters must be a JSON object, got {_json_type(document)}")
    api_version = _optional_str(document, "apiVersion", "apiVersion")
    kind = _optional_str(document, "kind", "kind")
    if not kind:
        raise OpaqueConfigError(
            f"kind is missing: set kind to {GPU_CONFIG} or {MIG_DEVICE_CONFIG} (apiVersion {API_VERSION})"
        )
    if not api_version:
        raise OpaqueConfigError(f"apiVersion is missing: set apiVersion to {API_VERSION} (kind {kind})")
    if api_version != API_VERSION:
        group = api_version.split("/", 1)[0]
        hint = "NVIDIA's config API version is" if group == API_GROUP else "Tessera reads NVIDIA's config API,"
        raise OpaqueConfigError(f'unknown apiVersion "{api_version}" (kind {kind}): {hint} {API_VERSION}')
    if kind == VFIO_DEVICE_CONFIG:
        _check_vfio(document)
        return DeviceConfig(kind=kind)
    if kind in COMPUTE_DOMAIN_KINDS:
        return DeviceConfig(kind=kind)  # decision: fields not modelled; it applies to no device here anyway
    if kind not in SUPPORTED_KINDS:
        raise OpaqueConfigError(
            f'unknown kind "{kind}" for apiVersion {API_VERSION}: use {GPU_CONFIG} or {MIG_DEVICE_CONFIG}'
        )

    sharing_fields = _GPU_SHARING_FIELDS if kind == GPU_CONFIG else _MIG_SHARING_FIELDS
    _check_fields(document, sharing_fields)
    raw_sharing = document.get("sharing")
    if raw_sharing is None:
        return DeviceConfig(kind=kind)
    return DeviceConfig(kind=kind, sharing=_sharing(raw_sharing, kind))


def unsupported(config: DeviceConfig) -> str | None:
    """Why Tessera cannot apply a config NVIDIA's driver accepts, or None. Asked only of a config that applies to
    a device (NVIDIA validates those alone): a config that applies to none fails no claim."""
    mps = config.sharing.mps if config.sharing is not None else None
    if mps is not None and mps.multi_user:
        return (
            "sharing.mpsConfig.multiUser: true is not supported by Tessera: an MPS control daemon runs one server per "
            "user ID and a client of another user waits until that server drains, so the claim's containers must run "
            "as one user; run them as one user and remove multiUser (or set it to false)"
        )
    return None


def pinned_memory_limits(mps: MpsConfig, uuids: Sequence[str]) -> dict[str, str]:
    """Per-device pinned memory limits for the claim's devices (in claim order), as NVIDIA computes them.

    The default applies to every device, then per-device entries override it; a key is a UUID of one of the
    devices or an index into ``uuids``. Returns ``{uuid: "<MiB>M"}``.
    """
    with _config_errors("sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit cannot be resolved"):
        return _pinned_memory_limits(mps, uuids)


def _pinned_memory_limits(mps: MpsConfig, uuids: Sequence[str]) -> dict[str, str]:
    limits = dict.fromkeys(uuids, mps.default_pinned_device_memory_limit) if uuids else {}
    limits = {u: v for u, v in limits.items() if v is not None}
    for key, value in mps.default_per_device_pinned_memory_limit.items():
        if key in uuids:
            limits[key] = value
            continue
        if not re.fullmatch(r"[+-]?[0-9]+", key):  # Go's strconv.Atoi: ASCII digits
            raise OpaqueConfigError(
                f"sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit: invalid device: {_shown(key)} is neither an "
                f"index nor the UUID of one of the claim's devices ({', '.join(uuids) or 'none'})"
            )
        # bounded before int(): a claim's key may be thousands of digits long
        index = int(key) if len(key.lstrip("+-").lstrip("0")) <= _MAX_INDEX_DIGITS else None
        if index is None or not 0 <= index < len(uuids):
            shown = _shown(key) if index is None else index
            raise OpaqueConfigError(
                f"sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit: invalid device index {shown}: "
                f"the config applies to {len(uuids)} device(s), indices 0 to {len(uuids) - 1}"
            )
        limits[uuids[index]] = value
    return limits


# ----- decoding helpers -------------------------------------------------------------------------------------------

_MAX_INDEX_DIGITS = 9  # a device index within a claim (at most 32 devices); more digits are out of range anyway
_SHOWN = 40  # characters of an offending value shown in a message


@contextmanager
def _config_errors(what: str) -> Iterator[None]:
    """Whatever a claim's values make fail is that claim's config error, never an internal (retried) one."""
    try:
        yield
    except OpaqueConfigError:
        raise
    except (ValueError, ArithmeticError, RecursionError) as error:
        detail = " ".join(f"{type(error).__name__}: {error}".split())[:200]
        raise OpaqueConfigError(f"{what}: {detail}") from None


def _shown(text: str) -> str:
    return repr(text) if len(text) <= _SHOWN else f"{text[:_SHOWN]!r}... ({len(text)} characters)"


def _load(parameters: bytes | str | Mapping[str, Any]) -> Any:
    if not isinstance(parameters, bytes | bytearray | str):  # already parsed from the claim's JSON
        try:
            size = len(json.dumps(parameters, separators=(",", ":"), ensure_ascii=False).encode())
        except (TypeError, ValueError) as error:
            raise OpaqueConfigError(f"parameters are not JSON: {error}") from None
        _check_size(size)
        return parameters
    raw = parameters.encode() if isinstance(parameters, str) else bytes(parameters)
    _check_size(len(raw))
    try:
        return json.loads(raw, object_pairs_hook=_no_duplicates)
    except _DuplicateField as duplicate:
        raise OpaqueConfigError(f'strict decoding error: duplicate field "{duplicate.args[0]}"') from None
    except (ValueError, RecursionError) as error:
        raise OpaqueConfigError(f"parameters are not valid JSON: {error}") from None


def _check_size(size: int) -> None:
    if size > MAX_PARAMETERS_BYTES:
        raise OpaqueConfigError(
            f"parameters are {size} bytes, over the API's limit of {MAX_PARAMETERS_BYTES} bytes (10 KiB)"
        )


class _DuplicateField(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateField(key)
        seen[key] = value
    return seen


def _check_fields(document: Mapping[str, Any], sharing_fields: tuple[str, ...]) -> None:
    """Every unknown field in the document, reported together as Kubernetes' strict decoder does."""
    unknown: list[str] = [_unknown(key, "", _TOP_FIELDS) for key in document if key not in _TOP_FIELDS]
    sharing = document.get("sharing")
    if isinstance(sharing, Mapping):
        unknown += [_unknown(k, "sharing.", sharing_fields) for k in sharing if k not in sharing_fields]
        time_slicing = sharing.get("timeSlicingConfig") if "timeSlicingConfig" in sharing_fields else None
        if isinstance(time_slicing, Mapping):
            path = "sharing.timeSlicingConfig."
            unknown += [_unknown(k, path, ("interval",)) for k in time_slicing if k != "interval"]
        mps = sharing.get("mpsConfig")
        if isinstance(mps, Mapping):
            unknown += [_unknown(k, "sharing.mpsConfig.", _MPS_FIELDS) for k in mps if k not in _MPS_FIELDS]
    if unknown:
        raise OpaqueConfigError("strict decoding error: " + ", ".join(unknown))


_VFIO_FIELDS = ("apiVersion", "kind", "iommu")
_IOMMU_FIELDS = ("backendPolicy", "enableAPIDevice")


def _check_vfio(document: Mapping[str, Any]) -> None:
    """NVIDIA's strict decoding of a ``VfioDeviceConfig``: known fields with their JSON types."""
    unknown = [_unknown(key, "", _VFIO_FIELDS) for key in document if key not in _VFIO_FIELDS]
    iommu = document.get("iommu")
    if isinstance(iommu, Mapping):
        unknown += [_unknown(k, "iommu.", _IOMMU_FIELDS) for k in iommu if k not in _IOMMU_FIELDS]
    if unknown:
        raise OpaqueConfigError("strict decoding error: " + ", ".join(unknown))
    if iommu is None:
        return
    if not isinstance(iommu, Mapping):
        raise OpaqueConfigError(f"iommu: expected an object, got {_json_type(iommu)}")
    _optional_str(iommu, "backendPolicy", "iommu.backendPolicy")
    enable = iommu.get("enableAPIDevice")
    if enable is not None and not isinstance(enable, bool):
        raise OpaqueConfigError(f"iommu.enableAPIDevice: expected true or false, got {_json_type(enable)}")


def _unknown(key: str, path: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1) or [k for k in known if k.lower() == key.lower()]
    hint = f' (did you mean "{close[0]}"?)' if close else ""
    return f'unknown field "{path}{key}"{hint}'


def _sharing(raw: Any, kind: str) -> Sharing:
    if not isinstance(raw, Mapping):
        raise OpaqueConfigError(f"sharing: expected an object, got {_json_type(raw)}")
    strategy = _optional_str(raw, "strategy", "sharing.strategy") or ""
    if strategy not in (TIME_SLICING, MPS):
        raise OpaqueConfigError(
            f"unknown GPU sharing strategy: {strategy or '(empty)'}, "
            f"supported GPU sharing strategies: {TIME_SLICING}, {MPS}"
        )
    raw_time_slicing = raw.get("timeSlicingConfig") if kind == GPU_CONFIG else None
    raw_mps = raw.get("mpsConfig")
    if strategy == TIME_SLICING:
        if kind == MIG_DEVICE_CONFIG:
            # NVIDIA accepts TimeSlicing for a MIG device and does nothing with it (no interval, mpsConfig unread)
            return Sharing(strategy=TIME_SLICING)
        if raw_mps is not None:
            raise OpaqueConfigError(f"cannot use MpsConfig with the '{TIME_SLICING}' strategy")
        return Sharing(strategy=TIME_SLICING, interval=_interval(raw_time_slicing))
    if raw_time_slicing is not None:
        raise OpaqueConfigError(f"cannot use TimeSlicingConfig with the '{MPS}' strategy")
    return Sharing(strategy=MPS, mps=_mps(raw_mps))


def _interval(raw: Any) -> str:
    if raw is None:
        return "Default"  # NVIDIA's Normalize(): TimeSlicing without timeSlicingConfig
    if not isinstance(raw, Mapping):
        raise OpaqueConfigError(f"sharing.timeSlicingConfig: expected an object, got {_json_type(raw)}")
    interval = _optional_str(raw, "interval", "sharing.timeSlicingConfig.interval")
    if interval is None:
        return "Default"  # decision: NVIDIA would dereference a nil interval here
    if interval not in INTERVALS:
        raise OpaqueConfigError(
            f"unknown time-slice interval: {interval}, supported time-slice intervals: {', '.join(INTERVALS)}"
        )
    return interval


def _mps(raw: Any) -> MpsConfig:
    if raw is None:
        return MpsConfig()  # NVIDIA's Normalize(): MPS without mpsConfig is {}
    path = "sharing.mpsConfig"
    if not isinstance(raw, Mapping):
        raise OpaqueConfigError(f"{path}: expected an object, got {_json_type(raw)}")
    percentage = raw.get("defaultActiveThreadPercentage")
    if percentage is not None:
        if not isinstance(percentage, int) or isinstance(percentage, bool):
            raise OpaqueConfigError(
                f"{path}.defaultActiveThreadPercentage: expected an integer, got {_json_type(percentage)}"
            )
        if percentage < 0:
            raise OpaqueConfigError("active thread percentage must not be negative")
        if percentage > 100:
            raise OpaqueConfigError("active thread percentage must not be greater than 100")
    default_limit = raw.get("defaultPinnedDeviceMemoryLimit")
    per_device = raw.get("defaultPerDevicePinnedMemoryLimit")
    if per_device is not None and not isinstance(per_device, Mapping):
        raise OpaqueConfigError(
            f"{path}.defaultPerDevicePinnedMemoryLimit: expected an object of device index or UUID to quantity, "
            f"got {_json_type(per_device)}"
        )
    multi_user = raw.get("multiUser")
    if multi_user is not None and not isinstance(multi_user, bool):
        raise OpaqueConfigError(f"{path}.multiUser: expected true or false, got {_json_type(multi_user)}")
    return MpsConfig(
        default_active_thread_percentage=percentage,
        default_pinned_device_memory_limit=(
            None if default_limit is None else _megabytes(default_limit, f"{path}.defaultPinnedDeviceMemoryLimit")
        ),
        default_per_device_pinned_memory_limit={
            str(key): _megabytes(value, f"{path}.defaultPerDevicePinnedMemoryLimit[{key}]")
            for key, value in (per_device or {}).items()
        },
        multi_user=multi_user,
    )


def _megabytes(raw: Any, path: str) -> str:
    """NVIDIA's ``limit.Megabyte()``: the quantity's bytes (rounded up) in whole MiB, as ``<MiB>M``, at least 1."""
    if isinstance(raw, bool) or not isinstance(raw, str | int | float):
        raise OpaqueConfigError(f"{path}: expected a quantity such as 1Gi, got {_json_type(raw)}")
    try:
        value = parse_quantity(raw)  # bounded: the most is the int64 maximum, refused before any arithmetic
    except QuantityError as error:
        raise OpaqueConfigError(f"{path}: {error}") from None
    mib = ceil(value) // MIB if value > 0 else 0  # Go: Value() rounds up, then integer division by 1024 twice
    if mib < 1:
        # decision: refused here, at decode; NVIDIA refuses it when it starts the MPS daemon
        shown = f"{raw[:_SHOWN]}..." if isinstance(raw, str) and len(raw) > _SHOWN else raw  # parsed: int64 at most
        raise OpaqueConfigError(f"{path}: invalid limit: {shown} is below the minimum of 1Mi")
    return f"{mib}M"


def _optional_str(document: Mapping[str, Any], key: str, path: str) -> str | None:
    value = document.get(key)
    if value is not None and not isinstance(value, str):
        raise OpaqueConfigError(f"{path}: expected a string, got {_json_type(value)}")
    return value


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean {json.dumps(value)}"
    if isinstance(value, int) and value.bit_length() > 128:  # repr() of a 5,000-digit int raises ValueError
        return f"a number of about {int(value.bit_length() * 0.30103)} digits"
    if isinstance(value, int | float):
        return f"number {value!r}"
    if isinstance(value, str):
        shown = json.dumps(value[:_SHOWN])
        return f"string {shown}" if len(value) <= _SHOWN else f"string {shown}... ({len(value)} characters)"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, list | tuple):
        return "an array"
    return type(value).__name__
