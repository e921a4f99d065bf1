"""The sharing config's validation: pydantic models, built only when a config document is parsed.

:mod:`agent.config.model` holds the config as plain frozen structs, so that the agent imports no
pydantic (~200 ms of imports and schema building) when no ``--config`` is given; :func:`parse_config`
validates a document with the models here (their messages are the contract: tests/unit/test_config_*.py)
and hands back those structs. Class and field names are the structs' own: the conversion goes by field
name (pydantic's messages that name a class are said in YAML's terms instead: ``_problem``).
"""

from __future__ import annotations

import difflib
import re
from typing import Annotated, Any, Literal

from msgspec import Struct
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from agent.config import model as values
from agent.config.model import (
    MAX_REPLICAS,
    ConfigError,
    normalise_resource_name,
    quantity_mib,
    safe_host_path,
)
from agent.core.xid_effect import XidEffect, parse_effect, parse_xid_key

_UUID = r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
_GPU_UUID = re.compile(rf"^GPU-{_UUID}$")
_DEVICE_REF = re.compile(rf"^(\d+|\d+:\d+|GPU-{_UUID}|MIG-{_UUID}|MIG-GPU-{_UUID}/\d+/\d+)$")


def _go_string(value: object) -> object:
    """sigs.k8s.io/yaml turns a YAML scalar into text for a text field; we do the same."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    return value


GoString = Annotated[str, BeforeValidator(_go_string)]


class _Section(BaseModel):
    """An ordinary section: keys match their field names case-insensitively, unknown keys are kept aside."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _case_insensitive_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        known = {(f.alias or n).lower(): (f.alias or n) for n, f in cls.model_fields.items()}
        return _without_nulls(
            cls, {known.get(str(k).lower(), k) if isinstance(k, str) else k: v for k, v in data.items()}
        )


class _Exact(BaseModel):
    """A section NVIDIA reads with exact map lookups: keys are case-sensitive."""

    model_config = ConfigDict(extra="allow", populate_by_name=True, frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        return _without_nulls(cls, data) if isinstance(data, dict) else data


def _without_nulls(cls: type[BaseModel], data: dict[Any, Any]) -> dict[Any, Any]:
    """Go's decoder leaves a field alone for an explicit null, so ``flags:`` with every line commented out
    means the defaults, not an error. A required field keeps its null and is reported."""
    optional = {f.alias or n for n, f in cls.model_fields.items() if not f.is_required()}
    return {k: v for k, v in data.items() if not (v is None and k in optional)}


# ----- flags ----------------------------------------------------------------------------------------

DeviceListStrategyName = Literal["envvar", "volume-mounts", "cdi-annotations", "cdi-cri"]


class PluginFlags(_Section):
    pass_device_specs: StrictBool | None = Field(None, alias="passDeviceSpecs")
    device_list_strategy: list[DeviceListStrategyName] | None = Field(None, alias="deviceListStrategy")
    device_id_strategy: Literal["uuid", "index"] | None = Field(None, alias="deviceIDStrategy")
    cdi_annotation_prefix: GoString | None = Field(None, alias="cdiAnnotationPrefix")
    nvidia_ctk_path: GoString | None = Field(None, alias="nvidiaCTKPath")
    container_driver_root: GoString | None = Field(None, alias="containerDriverRoot")
    shared_devices_allocation_policy: Literal["distributed", "packed"] | None = Field(
        None, alias="sharedDevicesAllocationPolicy"
    )

    @field_validator("device_list_strategy", mode="before")
    @classmethod
    def _string_or_list(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value


class GfdFlags(_Section):
    oneshot: StrictBool | None = None
    no_timestamp: StrictBool | None = Field(None, alias="noTimestamp")
    sleep_interval: GoString | None = Field(None, alias="sleepInterval")
    output_file: GoString | None = Field(None, alias="outputFile")
    machine_type_file: GoString | None = Field(None, alias="machineTypeFile")


class Flags(_Section):
    mig_strategy: Literal["none", "single", "mixed"] | None = Field(None, alias="migStrategy")
    fail_on_init_error: StrictBool | None = Field(None, alias="failOnInitError")
    mps_root: GoString | None = Field(None, alias="mpsRoot")
    nvidia_driver_root: GoString | None = Field(None, alias="nvidiaDriverRoot")
    nvidia_dev_root: GoString | None = Field(None, alias="nvidiaDevRoot")
    gdrcopy_enabled: StrictBool | None = Field(None, alias="gdrcopyEnabled")
    gds_enabled: StrictBool | None = Field(None, alias="gdsEnabled")
    mofed_enabled: StrictBool | None = Field(None, alias="mofedEnabled")
    use_node_feature_api: StrictBool | None = Field(None, alias="useNodeFeatureAPI")
    device_discovery_strategy: Literal["auto", "nvml", "tegra", "vfio"] | None = Field(
        None, alias="deviceDiscoveryStrategy"
    )

    @field_validator("mps_root", "nvidia_driver_root", "nvidia_dev_root")
    @classmethod
    def _host_path(cls, value: str | None) -> str | None:
        return None if value is None else safe_host_path(value)

    plugin: PluginFlags | None = None
    gfd: GfdFlags | None = None


# ----- resources ------------------------------------------------------------------------------------


class NamingRuleModel(_Exact):
    pattern: GoString = Field(min_length=1)
    name: GoString = Field(min_length=1)

    @field_validator("name")
    @classmethod
    def _normalise(cls, value: str) -> str:
        return normalise_resource_name(value)


class ResourcesModel(_Section):
    gpus: list[NamingRuleModel] = Field(default_factory=list)
    mig: list[NamingRuleModel] = Field(default_factory=list)


# ----- sharing --------------------------------------------------------------------------------------


class ReplicatedResource(_Exact):
    name: GoString = Field(min_length=1)
    rename: GoString | None = None
    replicas: StrictInt
    devices: Literal["all"] | StrictInt | list[StrictInt | GoString] = "all"
    # Tessera's extensions. memoryLimit: each replica's GPU memory (MPS: the client's pinned-memory limit;
    # time-slicing: what the driver holds its container to); memoryBurstLimit (time-slicing only): the hard limit
    # a replica may burst to above its memoryLimit (its request); the rest sharing.mps only.
    memory_limit: GoString | None = Field(None, alias="memoryLimit")  # a quantity: 10Gi, 512Mi, 20G
    memory_burst_limit: GoString | None = Field(None, alias="memoryBurstLimit")  # a quantity >= memoryLimit
    active_thread_percentage: StrictInt | None = Field(None, alias="activeThreadPercentage", ge=1, le=100)
    oversubscribe: StrictBool | None = None

    @field_validator("memory_limit", "memory_burst_limit")
    @classmethod
    def _quantity(cls, value: str | None) -> str | None:
        if value is not None and quantity_mib(value) <= 0:
            raise ValueError(f"{value!r} is no memory at all; give a size such as 10Gi")
        return value

    @model_validator(mode="after")
    def _burst_above_size(self) -> ReplicatedResource:
        if self.memory_burst_limit is None:
            return self
        if self.memory_limit is None:
            raise ValueError(
                "memoryBurstLimit needs memoryLimit: a replica bursts from its memoryLimit (its guaranteed request) "
                "up to memoryBurstLimit; set memoryLimit too"
            )
        size, ceiling = quantity_mib(self.memory_limit), quantity_mib(self.memory_burst_limit)
        if ceiling < size:
            raise ValueError(
                f"memoryBurstLimit {self.memory_burst_limit} ({ceiling} MiB) is below memoryLimit {self.memory_limit} "
                f"({size} MiB): the request would be above the limit; raise memoryBurstLimit or remove it"
            )
        return self

    @field_validator("name")
    @classmethod
    def _normalise_name(cls, value: str) -> str:
        return normalise_resource_name(value)

    @field_validator("rename")
    @classmethod
    def _normalise_rename(cls, value: str | None) -> str | None:
        return normalise_resource_name(value) if value else None

    @field_validator("replicas")
    @classmethod
    def _at_least_two(cls, value: int) -> int:
        if value < 2:
            raise ValueError(f"number of replicas must be >= 2 (got {value}); use 2 or more, or remove the entry")
        if value > MAX_REPLICAS:
            raise ValueError(
                f"{value} replicas is more than {MAX_REPLICAS}; every replica is a device the kubelet tracks, "
                "so use at most that many"
            )
        return value

    @field_validator("devices", mode="before")
    @classmethod
    def _devices(cls, value: object) -> object:
        if isinstance(value, str) and value != "all":
            raise ValueError(f"devices set as {value!r} but the only valid string input is 'all'")
        if isinstance(value, bool):
            raise ValueError("devices must be 'all', a count or a list")
        if isinstance(value, int) and value <= 0:
            raise ValueError(f"a count of devices must be > 0 (got {value})")
        if isinstance(value, list):
            for item in value:
                text = str(item) if isinstance(item, int) and not isinstance(item, bool) else item
                if not isinstance(text, str) or not _DEVICE_REF.match(text) or text.startswith("-"):
                    raise ValueError(
                        f"unsupported device {item!r} in devices list: use a GPU index (0), a MIG index (0:1), "
                        "a GPU-<uuid>, a MIG-<uuid> or a MIG-GPU-<uuid>/<gi>/<ci>"
                    )
        return value


class ReplicatedResources(_Exact):
    rename_by_default: StrictBool = Field(False, alias="renameByDefault")
    fail_requests_greater_than_one: StrictBool | None = Field(None, alias="failRequestsGreaterThanOne")
    resources: list[ReplicatedResource]

    @field_validator("resources")
    @classmethod
    def _not_empty(cls, value: list[ReplicatedResource]) -> list[ReplicatedResource]:
        if not value:
            raise ValueError("no resources specified; list at least one resource to share")
        return value


class SharingModel(_Section):
    time_slicing: ReplicatedResources | None = Field(None, alias="timeSlicing")
    mps: ReplicatedResources | None = None

    @field_validator("time_slicing")
    @classmethod
    def _mps_keys_only_for_mps(cls, value: ReplicatedResources | None) -> ReplicatedResources | None:
        for position, entry in enumerate(value.resources if value else ()):
            used = [k for k in ("activeThreadPercentage", "oversubscribe") if _given(entry, k)]
            if used:
                raise ValueError(
                    f"resources[{position}]: {', '.join(used)} only apply to sharing.mps; "
                    "time-slicing cannot limit a client's threads (memoryLimit holds its memory)"
                )
        return value

    @field_validator("mps")
    @classmethod
    def _no_burst_under_mps(cls, value: ReplicatedResources | None) -> ReplicatedResources | None:
        for position, entry in enumerate(value.resources if value else ()):
            if entry.memory_burst_limit is not None:
                raise ValueError(
                    f"resources[{position}]: memoryBurstLimit only applies to sharing.timeSlicing: the MPS server "
                    "holds every client to its memoryLimit, so a replica cannot burst above it; remove "
                    "memoryBurstLimit (or raise memoryLimit)"
                )
        return value


def _given(entry: ReplicatedResource, alias: str) -> bool:
    name = next(n for n, f in type(entry).model_fields.items() if (f.alias or n) == alias)
    return getattr(entry, name) is not None


class ImexModel(_Section):
    channel_ids: list[StrictInt] = Field(default_factory=list, alias="channelIDs")
    required: StrictBool = False

    @field_validator("channel_ids")
    @classmethod
    def _zero_only(cls, value: list[int]) -> list[int]:
        if value not in ([], [0]):
            raise ValueError(f"invalid IMEX config: channelIDs must be [] or [0]; found {value}")
        return value


class MigLayoutSection(_Section):
    """Tessera: the MIG layout this config wants, in mig-parted's format (``layouts``), and which one."""

    config: GoString | None = None  # the mig-config to apply (a node label nvidia.com/mig.config wins)
    layouts: dict[str, Any] | None = None  # {version: v1, mig-configs: {...}}, validated by agent.mig.layout_file


class HealthSection(_Section):
    """Tessera: what an XID does to a device, overriding the Xid-catalog default (docs/health.md).

    ``xids`` maps an XID (``"94"``) or an inclusive range (``"144-150"``) to ``ignore``, ``application``,
    ``unhealthy`` or ``lost``. A ``--xid-overrides`` flag wins over it, XID by XID.
    """

    xids: dict[str, XidEffect] | None = None

    @field_validator("xids", mode="before")
    @classmethod
    def _xids(cls, value: object) -> object:
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ValueError('must be a map of XID to effect, e.g. {"94": unhealthy, "13": ignore}')
        problems, out = [], {}
        for key, effect in value.items():
            try:
                parse_xid_key(key)
            except ValueError as error:
                problems.append(f"key {error}")
                continue
            try:
                out[str(key).strip()] = parse_effect(effect)
            except ValueError as error:
                problems.append(f"XID {str(key).strip()}: {error}")
        if problems:
            raise ValueError("; ".join(problems))
        return out


class DraSection(_Section):
    """Tessera: the DRA front end. ``gpus`` (``all``, or GPU indices and UUIDs) are served to DRA claims as the
    ResourceSlices of driver ``driverName``; every other GPU stays with the device plugin. Off by default.
    ``dynamicMig`` (``all``: every MIG-capable GPU DRA serves, or indices and UUIDs) lists those GPUs as
    partitionable devices: MIG devices are created for a claim and destroyed after it. ``gpuShares`` (``all``:
    every GPU DRA serves outside dynamic MIG, or indices and UUIDs) publishes those GPUs (and their MIG devices) for
    shares: several claims each take part of the device, enforced through MPS. ``consumableShares`` is NVIDIA's
    ``--consumable-shares``: ``memory`` (the default: memory in 1Mi steps, a claim that asks for none gets all of
    it), ``unlimited`` (memory in 1Mi steps, none by default: any number of claims), a number N (plus a ``shares``
    capacity of N, one per claim by default) or ``disabled``; set without ``gpuShares`` it shares every GPU DRA
    serves outside dynamic MIG, as NVIDIA's does. ``defaultShare`` (``memory`` mode, whole MiB) is what a claim that
    asks for no memory gets of such a GPU (default: all of it), so requests by count — an unchanged pod's
    ``nvidia.com/gpu.shared: 1`` through a DeviceClass — share GPUs too."""

    enabled: StrictBool = False
    driver_name: GoString = Field("gpu.nvidia.com", alias="driverName")
    gpus: Literal["all"] | list[StrictInt | GoString] = "all"
    dynamic_mig: Literal["all"] | list[StrictInt | GoString] | None = Field(None, alias="dynamicMig")
    gpu_shares: Literal["all"] | list[StrictInt | GoString] | None = Field(None, alias="gpuShares")
    default_share: StrictInt | None = Field(None, alias="defaultShare")  # bytes, from a quantity such as "10Gi"
    consumable_shares: StrictInt | GoString | None = Field(None, alias="consumableShares")  # NVIDIA's spelling

    @field_validator("consumable_shares", mode="before")
    @classmethod
    def _consumable_shares(cls, value: object) -> object:
        from agent.core.dra.shares import check_mode

        return None if value is None else check_mode(value)

    @property
    def shared_gpus(self) -> Literal["all"] | list[int | str] | None:
        return values.shared_gpus(self.gpu_shares, self.consumable_shares)

    @property
    def share_mode(self) -> int | str:
        return values.share_mode(self.consumable_shares)

    @field_validator("default_share", mode="before")
    @classmethod
    def _default_share(cls, value: object) -> object:
        if value is None:
            return None
        from agent.core.dra.shares import MEMORY_STEP
        from agent.core.quantity import parse_quantity

        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ValueError("write a memory size such as 10Gi")
        # bounded before any arithmetic: "1e10000000" is refused at once, naming the bound (QuantityError)
        amount = parse_quantity(value, what="memory size", hint="write a whole number of MiB such as 1500Mi or 10Gi")
        if amount <= 0 or amount.denominator != 1 or amount % MEMORY_STEP:
            shown = repr(value) if isinstance(value, int) or len(value) <= 40 else f"{value[:40]!r}..."
            raise ValueError(f"{shown} is not a whole number of MiB (1500Mi, 10Gi, …): shares come in 1Mi steps")
        return int(amount)

    @model_validator(mode="after")
    def _shares_named(self) -> DraSection:
        if self.consumable_shares == "disabled" and self.gpu_shares is not None:
            raise ValueError(
                "consumableShares is disabled but gpuShares names GPUs to share: remove one of dra.consumableShares "
                "and dra.gpuShares"
            )
        if self.default_share is not None and self.shared_gpus is None:
            raise ValueError("defaultShare is set but gpuShares names no GPU to share: add dra.gpuShares")
        if self.default_share is not None and self.share_mode != "memory":
            raise ValueError(
                f"defaultShare is what a claim that asks for no memory gets with consumableShares: memory; with "
                f"consumableShares: {self.share_mode} such a claim takes no memory (as on NVIDIA's driver): remove "
                "dra.defaultShare"
            )
        return self

    @field_validator("driver_name")
    @classmethod
    def _driver(cls, value: str) -> str:
        from agent.dra.names import check_driver_name

        return check_driver_name(value)

    @field_validator("gpus", "dynamic_mig", "gpu_shares")
    @classmethod
    def _gpus(cls, value: object) -> object:
        if value == "all" or value is None:
            return value
        assert isinstance(value, list)
        problems = [
            f"{entry!r} is neither a GPU index nor a GPU UUID"
            for entry in value
            if not (isinstance(entry, int) and entry >= 0) and not (isinstance(entry, str) and _GPU_UUID.match(entry))
        ]
        if len(set(map(str, value))) != len(value):
            problems.append("a GPU is named twice")
        if not value:
            problems.append('an empty list serves no GPU: use enabled: false, or "all"')
        if problems:
            raise ValueError("; ".join(problems))
        return value


# ----- the document ---------------------------------------------------------------------------------


class ConfigModel(_Section):
    version: GoString | None = None
    flags: Flags = Field(default_factory=Flags)
    resources: ResourcesModel | None = None
    sharing: SharingModel | None = None
    imex: ImexModel | None = None
    match: list[GoString] | None = None  # Tessera: the GPU products this config is for (globs)
    mig_layout: MigLayoutSection | None = Field(None, alias="migLayout")  # Tessera: the MIG layout manager
    health: HealthSection | None = None  # Tessera: per-XID health overrides
    dra: DraSection | None = None  # Tessera: which GPUs the DRA front end serves

    @field_validator("version")
    @classmethod
    def _v1(cls, value: str | None) -> str:
        if value in (None, "", "v1"):
            return "v1"
        raise ValueError(f"unknown version: {value}; this is a version v1 config (NVIDIA's format): set version: v1")

    @field_validator("match", mode="before")
    @classmethod
    def _one_or_many(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value


def parse_config(data: object, origin: str = "config") -> tuple[values.ConfigModel, list[str]]:
    """What :func:`agent.config.model.parse_config` does: validate, warn, and convert to the structs.

    A document that is positively something else (:func:`foreign_document`) is refused for what it is: NVIDIA's
    plugin would read a Pod manifest as a config of unknown keys, i.e. every default, without a word.
    """
    foreign = foreign_document(data)
    if foreign is not None:
        raise NotASharingConfig(origin, [foreign])
    try:
        model = ConfigModel.model_validate({} if data is None else data)
    except ValidationError as error:
        raise ConfigError(origin, [_problem(e) for e in error.errors()]) from error
    warnings = [f"{origin}: {w}" for w in unknown_key_warnings(model)]
    warnings += [f"{origin}: {w}" for w in _nvidia_flag_warnings(model.flags)]
    if model.sharing and model.sharing.mps is not None and model.sharing.time_slicing is not None:
        warnings.append(f"{origin}: sharing has both timeSlicing and mps; mps is used and timeSlicing is ignored")
    return as_value(model), warnings


def value_class(schema: type[BaseModel]) -> type:
    """The struct of :mod:`agent.config.model` that holds what ``schema`` validates (same name, same fields)."""
    cls = getattr(values, schema.__name__)
    assert isinstance(cls, type) and issubclass(cls, Struct), cls
    return cls


def as_value(item: Any) -> Any:
    """A validated model as its struct, field by field; lists of models item by item; anything else as is."""
    if isinstance(item, BaseModel):
        cls = value_class(type(item))
        return cls(**{name: as_value(getattr(item, name)) for name in cls.__struct_fields__})
    if isinstance(item, list):
        return [as_value(v) for v in item]
    return item


def _nvidia_flag_warnings(flags: Flags | None) -> list[str]:
    """NVIDIA's ``flags`` that Tessera does not honour at the given value (agent.nvidia_flags says why)."""
    if flags is None or not flags.model_fields_set:  # no flag given: nothing to warn of (nor to load the table for)
        return []
    from agent.nvidia_flags import CONFIG_FLAGS, config_flag_warnings

    values: dict[str, object] = {}
    for key in CONFIG_FLAGS:
        section: object = flags
        for part in key.split(".")[1:]:
            section = _field_by_alias(section, part)
        values[key] = section
    return config_flag_warnings(values)


def _field_by_alias(section: object, alias: str) -> object:
    if not isinstance(section, BaseModel):
        return None
    for name, field in type(section).model_fields.items():
        if (field.alias or name) == alias:
            return getattr(section, name)
    return None


def unknown_key_warnings(model: BaseModel, path: str = "") -> list[str]:
    warnings = []
    known = [f.alias or n for n, f in type(model).model_fields.items()]
    for key in model.model_extra or {}:
        where = f"{path}{key}"
        close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
        hint = f"; did you mean {path}{close[0]}?" if close else f"; known keys here: {', '.join(known)}"
        warnings.append(f"unknown key {where} is ignored{hint}")
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        key = field.alias or name
        if isinstance(value, BaseModel):
            warnings += unknown_key_warnings(value, f"{path}{key}.")
        elif isinstance(value, list):
            for position, item in enumerate(value):
                if isinstance(item, BaseModel):
                    warnings += unknown_key_warnings(item, f"{path}{key}[{position}].")
    return warnings


def _problem(error: Any) -> str:
    path = ""
    for part in error["loc"]:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part not in ("function-after[_normalise_name(), constrained-str]",) and not str(part).startswith(
            ("function-", "literal[", "int", "str", "list[", "constrained-")
        ):
            path += f".{part}" if path else str(part)
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "missing":
        message = "required field is missing; add it"
    elif error["type"] in ("model_type", "dict_type", "model_attributes_type", "dataclass_type"):
        # pydantic's own words name its classes ("a valid dictionary or instance of ConfigModel"): say it in YAML's
        message = f"expected a mapping of keys to values, got {_yaml_kind(error.get('input'))}"
    elif error["type"] == "list_type":
        message = f"expected a list, got {_yaml_kind(error.get('input'))}"
    elif error["type"] in ("int_type", "bool_type") and isinstance(error.get("input"), str):
        message += f" (got the text {error['input']!r}: write it without quotes)"
    elif error["type"] == "literal_error":
        message = f"{message} (got {error.get('input')!r})"
    return f"{path or '(top level)'}: {message}"


def _yaml_kind(value: object) -> str:
    """What a YAML value is, as its writer sees it: ``a list``, ``the text 'abc'``, ``the number 5``."""
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, int | float):
        return f"the number {value}"
    if isinstance(value, str):
        shown = value if len(value) <= 40 else value[:40] + "…"
        return f"the text {shown!r}"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return "nothing (an empty value)" if value is None else f"a {type(value).__name__}"


class NotASharingConfig(ConfigError):
    """The document is recognisably something else (:func:`foreign_document` says what)."""


def foreign_document(data: object) -> str | None:
    """What a document is, when it is recognisably not a sharing config; None when it may be one.

    Recognised, by keys no sharing config has: a Kubernetes object (``apiVersion`` and ``kind``; a ConfigMap
    is named as such, since its data keys are configs), a mig-parted layout file (``mig-configs``), a
    simulated node spec (``gpus``, a list of ``{model: ...}``) and the Helm values of NVIDIA's chart
    (``config.map``). Anything else is read as a config, unknown keys warned about one by one.
    """
    if not isinstance(data, dict):
        return None
    api, kind = data.get("apiVersion"), data.get("kind")
    if isinstance(api, str) and isinstance(kind, str):
        name = (data.get("metadata") or {}).get("name") if isinstance(data.get("metadata"), dict) else None
        called = f" {name!r}" if isinstance(name, str) else ""
        if kind == "ConfigMap":
            return (
                f"a Kubernetes ConfigMap{called} manifest, not a sharing config: its data keys are the configs; "
                "give the manifest file itself to tessera validate or tessera plan --config, which read its keys"
            )
        return (
            f"a Kubernetes {kind}{called} manifest ({api}), not a sharing config; a sharing config is the text of "
            "one ConfigMap data key: version: v1 with flags, sharing, resources..."
        )
    if "mig-configs" in data:
        return (
            "a MIG layout file (mig-parted's format: version and mig-configs), not a sharing config; check or "
            "apply it with tessera mig apply --dry-run --config FILE, or put it in a sharing config under "
            "migLayout.layouts"
        )
    known = {(f.alias or n).lower() for n, f in ConfigModel.model_fields.items()} - {"version"}
    if any(str(key).lower() in known for key in data):
        return None
    gpus = data.get("gpus")
    if isinstance(gpus, list) and gpus and all(isinstance(g, dict) and "model" in g for g in gpus):
        return "a simulated node spec (gpus: [{model: ...}]), not a sharing config; give it to --node"
    chart = data.get("config")
    if isinstance(chart, dict) and isinstance(chart.get("map"), dict):
        keys = ", ".join(str(k) for k in chart["map"]) or "none"
        return (
            f"the Helm values of NVIDIA's device-plugin chart, not a sharing config; the configs are the texts "
            f"under config.map (keys: {keys}): save each as a file, or in a ConfigMap"
        )
    return None
