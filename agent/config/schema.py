"""The sharing config's validation: one walk of the document that checks every key and builds the structs.

:mod:`agent.config.model` holds the config as plain frozen structs; this module says how each of their fields is
written in YAML (its key, its type in YAML's terms, its rules) and :func:`parse_config` walks a document with it:
every problem is found in one walk, each named by its field path (``sharing.mps.resources[0].replicas: ...``); the
messages are the contract (tests/unit/test_config_*.py). A walk of a config costs well under a millisecond and the
module loads in a few, so a start waits for no schema machinery: it replaced pydantic models that took ~70 ms to
import and build in the config checker, the longest step of a start.

How a key is read follows NVIDIA's plugin (``agent.config.model`` lists the rules): keys of ordinary sections match
case-insensitively, those NVIDIA reads with exact map lookups (a sharing group, its resources, a naming rule) match
exactly; an explicit null is the default (a required field keeps it and is reported); a YAML number or boolean
given for a text field becomes text; text is never a number or a boolean. Unknown keys are kept aside and each is
warned about with the closest known key.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from agent.config import model as values
from agent.config.model import (
    MAX_REPLICAS,
    ConfigError,
    normalise_resource_name,
    quantity_mib,
    safe_host_path,
)
from agent.core.xid_effect import parse_effect, parse_xid_key

_UUID = r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
# matched whole (re.fullmatch: no trailing newline as with ``$``), digits ASCII only (``\d`` takes Arabic-Indic ones)
_GPU_UUID = rf"GPU-{_UUID}"
_DEVICE_REF = rf"[0-9]+|[0-9]+:[0-9]+|GPU-{_UUID}|MIG-{_UUID}|MIG-GPU-{_UUID}/[0-9]+/[0-9]+"


class _Walk:
    """What one walk has found: the problems (each ``path: message``) and the unknown keys' warnings."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.warnings: list[str] = []

    def problem(self, path: str, message: str) -> None:
        self.problems.append(f"{path or '(top level)'}: {message}")


class _Bad:
    """The result of a value that has a problem (reported already): its section is not built."""


BAD: Any = _Bad()
Rule = Callable[[Any, str, _Walk], Any]  # (value, its path, the walk) -> the value as held, or BAD


def child(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def leaf(check: Callable[[Any], Any]) -> Rule:
    """A rule from a function of the value alone that returns it as held or raises ValueError saying why not."""

    def rule(value: Any, path: str, walk: _Walk) -> Any:
        try:
            return check(value)
        except ValueError as error:
            walk.problem(path, str(error))
            return BAD

    return rule


def then(first: Rule, *checks: Callable[[Any], Any]) -> Rule:
    """``first``, then each check on what it returned (each returns the value as held or raises ValueError)."""

    rest = [leaf(check) for check in checks]

    def rule(value: Any, path: str, walk: _Walk) -> Any:
        value = first(value, path, walk)
        for check in rest:
            if value is BAD:
                break
            value = check(value, path, walk)
        return value

    return rule


# ----- YAML's scalars -------------------------------------------------------------------------------


def yaml_kind(value: object) -> str:
    """What a YAML value is, as its writer sees it: ``a list``, ``the text 'abc'``, ``the number 5``."""
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, int | float):
        return f"the number {value}"
    if isinstance(value, str):
        cut = value if len(value) <= 40 else value[:40] + "…"
        return f"the text {cut!r}"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return "nothing (an empty value)" if value is None else f"a {type(value).__name__}"


def shown(value: object, width: int = 60) -> str:
    """``value`` as the writer would recognise it, cut to ``width``: a message quotes it, never a whole document."""
    text = repr(value)
    return text if len(text) <= width else text[: width - 1] + "…"


def _got(value: object) -> str:
    hint = ": write it without quotes" if isinstance(value, str) else ""
    return f"got {yaml_kind(value)}{hint}"


def boolean(value: object) -> bool:
    if isinstance(value, bool):
        return value
    raise ValueError(f"expected a boolean (true or false), {_got(value)}")


def integer(value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise ValueError(f"expected a whole number, {_got(value)}")


def text(value: object) -> str:
    """sigs.k8s.io/yaml turns a YAML scalar into text for a text field; so do we (``true``, ``1``, ``1.5``)."""
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):  # YAML's !!binary: Go's decoder makes it the text it encodes
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError("expected text, got binary data that is not UTF-8 text") from None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    raise ValueError(f"expected text, got {yaml_kind(value)}")


def non_empty(value: str) -> str:
    if not value:
        raise ValueError("must not be empty")
    return value


def one_of(*choices: str) -> Callable[[object], str]:
    allowed = ", ".join(map(repr, choices[:-1])) + f" or {choices[-1]!r}" if len(choices) > 1 else repr(choices[0])

    def check(value: object) -> str:
        if isinstance(value, str) and value in choices:
            return value
        raise ValueError(f"must be {allowed} (got {shown(value)})")

    return check


def between(low: int, high: int) -> Callable[[int], int]:
    def check(value: int) -> int:
        if not low <= value <= high:
            raise ValueError(f"must be from {low} to {high} (got {value})")
        return value

    return check


def one_or_many(rule: Rule) -> Rule:
    """A list of ``rule``; a single text stands for a list of one (NVIDIA's ``deviceListStrategy: envvar``)."""
    many = list_of(rule)
    return lambda value, path, walk: many([value] if isinstance(value, str) else value, path, walk)


def list_of(rule: Rule) -> Rule:
    def check(value: Any, path: str, walk: _Walk) -> Any:
        if not isinstance(value, list):
            walk.problem(path, f"expected a list, got {yaml_kind(value)}")
            return BAD
        items = [rule(item, f"{path}[{position}]", walk) for position, item in enumerate(value)]
        return BAD if any(item is BAD for item in items) else items

    return check


def mapping(value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"expected a mapping of keys to values, got {yaml_kind(value)}")
    odd = [key for key in value if not isinstance(key, str)]
    if odd:
        raise ValueError(f"keys must be text: quote {', '.join(shown(str(k)) for k in odd)}")
    return dict(value)  # the config's own: the document it came from is not shared


# ----- sections -------------------------------------------------------------------------------------


class Key(NamedTuple):
    """One field of a section: the struct's field, its key in YAML and how its value is read."""

    field: str
    alias: str
    rule: Rule
    required: bool = False


class Section:
    """A mapping read into ``struct``: known keys by ``keys`` (case-insensitively unless ``exact``), unknown ones
    warned about; ``after`` checks the built struct as a whole (ValueError: a problem of the section's path)."""

    def __init__(
        self,
        struct: type,
        keys: Sequence[Key],
        *,
        exact: bool = False,
        after: Callable[[Any], None] | None = None,
    ) -> None:
        self.struct, self.keys, self.exact, self.after = struct, tuple(keys), exact, after
        self.aliases = [k.alias for k in self.keys]
        self._by_lower = {alias.lower(): alias for alias in self.aliases}
        self._by_alias = {k.alias: k for k in self.keys}

    def key(self, alias: str) -> Key | None:
        return self._by_alias.get(alias)

    def known(self, key: object) -> str | None:
        """The alias ``key`` stands for, or None for an unknown key."""
        if not isinstance(key, str):
            return None
        if self.exact:
            return key if key in self._by_alias else None
        return self._by_lower.get(key.lower())

    def __call__(self, value: Any, path: str, walk: _Walk) -> Any:
        if not isinstance(value, dict):
            walk.problem(path, f"expected a mapping of keys to values, got {yaml_kind(value)}")
            return BAD
        given: dict[str, Any] = {}
        for key, item in value.items():
            alias = self.known(key)
            if alias is None:
                self._unknown(key, path, walk)
            else:
                given[alias] = item  # the last of keys that differ only in case wins, as in Go's decoder
        held: dict[str, Any] = {}
        for key in self.keys:
            if key.alias not in given:
                if key.required:
                    walk.problem(child(path, key.alias), "required field is missing; add it")
                    held[key.field] = BAD
                continue
            item = given[key.alias]
            if item is None and not key.required:
                continue  # an explicit null is the default, as Go's decoder leaves the field alone
            held[key.field] = key.rule(item, child(path, key.alias), walk)
        if any(item is BAD for item in held.values()):
            return BAD
        built = self.struct(**held)
        if self.after is not None:
            try:
                self.after(built)
            except ValueError as error:
                walk.problem(path, str(error))
                return BAD
        return built

    def _unknown(self, key: object, path: str, walk: _Walk) -> None:
        where = f"{path}." if path else ""
        close = difflib.get_close_matches(str(key), self.aliases, n=1, cutoff=0.6)
        hint = f"; did you mean {where}{close[0]}?" if close else f"; known keys here: {', '.join(self.aliases)}"
        walk.warnings.append(f"unknown key {where}{key} is ignored{hint}")


# ----- flags ----------------------------------------------------------------------------------------

TEXT = leaf(text)
BOOL = leaf(boolean)
INT = leaf(integer)
HOST_PATH = then(TEXT, safe_host_path)

PLUGIN_FLAGS = Section(
    values.PluginFlags,
    [
        Key("pass_device_specs", "passDeviceSpecs", BOOL),
        Key(
            "device_list_strategy",
            "deviceListStrategy",
            one_or_many(leaf(one_of("envvar", "volume-mounts", "cdi-annotations", "cdi-cri"))),
        ),
        Key("device_id_strategy", "deviceIDStrategy", leaf(one_of("uuid", "index"))),
        Key("cdi_annotation_prefix", "cdiAnnotationPrefix", TEXT),
        Key("nvidia_ctk_path", "nvidiaCTKPath", TEXT),
        Key("container_driver_root", "containerDriverRoot", TEXT),
        Key("shared_devices_allocation_policy", "sharedDevicesAllocationPolicy", leaf(one_of("distributed", "packed"))),
    ],
)

GFD_FLAGS = Section(
    values.GfdFlags,
    [
        Key("oneshot", "oneshot", BOOL),
        Key("no_timestamp", "noTimestamp", BOOL),
        Key("sleep_interval", "sleepInterval", TEXT),
        Key("output_file", "outputFile", TEXT),
        Key("machine_type_file", "machineTypeFile", TEXT),
    ],
)

FLAGS = Section(
    values.Flags,
    [
        Key("mig_strategy", "migStrategy", leaf(one_of("none", "single", "mixed"))),
        Key("fail_on_init_error", "failOnInitError", BOOL),
        Key("mps_root", "mpsRoot", HOST_PATH),
        Key("nvidia_driver_root", "nvidiaDriverRoot", HOST_PATH),
        Key("nvidia_dev_root", "nvidiaDevRoot", HOST_PATH),
        Key("gdrcopy_enabled", "gdrcopyEnabled", BOOL),
        Key("gds_enabled", "gdsEnabled", BOOL),
        Key("mofed_enabled", "mofedEnabled", BOOL),
        Key("use_node_feature_api", "useNodeFeatureAPI", BOOL),
        Key("device_discovery_strategy", "deviceDiscoveryStrategy", leaf(one_of("auto", "nvml", "tegra", "vfio"))),
        Key("plugin", "plugin", PLUGIN_FLAGS),
        Key("gfd", "gfd", GFD_FLAGS),
    ],
)


# ----- resources ------------------------------------------------------------------------------------

RESOURCE_NAME = then(TEXT, non_empty, normalise_resource_name)

NAMING_RULE = Section(
    values.NamingRuleModel,
    [
        Key("pattern", "pattern", then(TEXT, non_empty), required=True),
        Key("name", "name", RESOURCE_NAME, required=True),
    ],
    exact=True,
)

RESOURCES = Section(
    values.ResourcesModel, [Key("gpus", "gpus", list_of(NAMING_RULE)), Key("mig", "mig", list_of(NAMING_RULE))]
)


# ----- sharing --------------------------------------------------------------------------------------


def replica_count(value: int) -> int:
    if value < 2:
        raise ValueError(f"number of replicas must be >= 2 (got {value}); use 2 or more, or remove the entry")
    if value > MAX_REPLICAS:
        raise ValueError(
            f"{value} replicas is more than {MAX_REPLICAS}; every replica is a device the kubelet tracks, "
            "so use at most that many"
        )
    return value


def devices(value: object) -> object:
    """``all``, a count, or a list of GPU and MIG devices by index or UUID."""
    if isinstance(value, str) and value != "all":
        raise ValueError(f"devices set as {shown(value)} but the only valid string input is 'all'")
    if isinstance(value, bool) or not isinstance(value, str | int | list):
        raise ValueError(f"devices must be 'all', a count or a list, got {yaml_kind(value)}")
    if isinstance(value, int) and value <= 0:
        raise ValueError(f"a count of devices must be > 0 (got {value})")
    for item in value if isinstance(value, list) else ():
        reference = str(item) if isinstance(item, int) and not isinstance(item, bool) else item
        if not isinstance(reference, str) or not re.fullmatch(_DEVICE_REF, reference):
            raise ValueError(
                f"unsupported device {shown(item)} in devices list: use a GPU index (0), a MIG index (0:1), "
                "a GPU-<uuid>, a MIG-<uuid> or a MIG-GPU-<uuid>/<gi>/<ci>"
            )
    return list(value) if isinstance(value, list) else value  # the config's own, as mapping()


def memory_size(value: str) -> str:
    """A memory quantity from 1Mi to 16Ti (``quantity_mib`` says why not)."""
    quantity_mib(value)
    return value


def burst_above_size(entry: values.ReplicatedResource) -> None:
    if entry.memory_burst_limit is None:
        return
    if entry.memory_limit is None:
        raise ValueError(
            "memoryBurstLimit needs memoryLimit: a replica bursts from its memoryLimit (its guaranteed request) "
            "up to memoryBurstLimit; set memoryLimit too"
        )
    size, ceiling = quantity_mib(entry.memory_limit), quantity_mib(entry.memory_burst_limit)
    if ceiling < size:
        raise ValueError(
            f"memoryBurstLimit {entry.memory_burst_limit} ({ceiling} MiB) is below memoryLimit {entry.memory_limit} "
            f"({size} MiB): the request would be above the limit; raise memoryBurstLimit or remove it"
        )


def _rename(value: object, path: str, walk: _Walk) -> Any:
    """``rename``: a resource name; empty is no rename at all."""
    renamed = TEXT(value, path, walk)
    if renamed == "":
        return None
    return renamed if renamed is BAD else _NORMALISED(renamed, path, walk)


_NORMALISED = leaf(normalise_resource_name)


REPLICATED_RESOURCE = Section(
    values.ReplicatedResource,
    [
        Key("name", "name", RESOURCE_NAME, required=True),
        Key("rename", "rename", _rename),
        Key("replicas", "replicas", then(INT, replica_count), required=True),
        Key("devices", "devices", leaf(devices)),
        # Tessera's extensions. memoryLimit: each replica's GPU memory (MPS: the client's pinned-memory limit;
        # time-slicing: what the driver holds its container to); memoryBurstLimit (time-slicing only): the hard
        # limit a replica may burst to above its memoryLimit (its request); the rest sharing.mps only.
        Key("memory_limit", "memoryLimit", then(TEXT, memory_size)),
        Key("memory_burst_limit", "memoryBurstLimit", then(TEXT, memory_size)),
        Key("active_thread_percentage", "activeThreadPercentage", then(INT, between(1, 100))),
        Key("oversubscribe", "oversubscribe", BOOL),
    ],
    exact=True,
    after=burst_above_size,
)


def at_least_one(resources: list[Any]) -> list[Any]:
    if not resources:
        raise ValueError("no resources specified; list at least one resource to share")
    return resources


REPLICATED_RESOURCES = Section(
    values.ReplicatedResources,
    [
        Key("rename_by_default", "renameByDefault", BOOL),
        Key("fail_requests_greater_than_one", "failRequestsGreaterThanOne", BOOL),
        Key("resources", "resources", then(list_of(REPLICATED_RESOURCE), at_least_one), required=True),
    ],
    exact=True,
)


_MPS_ONLY = (("activeThreadPercentage", "active_thread_percentage"), ("oversubscribe", "oversubscribe"))


def mps_keys_only_for_mps(group: values.ReplicatedResources) -> values.ReplicatedResources:
    for position, entry in enumerate(group.resources):
        used = [alias for alias, name in _MPS_ONLY if getattr(entry, name) is not None]
        if used:
            raise ValueError(
                f"resources[{position}]: {', '.join(used)} only apply to sharing.mps; "
                "time-slicing cannot limit a client's threads (memoryLimit holds its memory)"
            )
    return group


def no_burst_under_mps(group: values.ReplicatedResources) -> values.ReplicatedResources:
    for position, entry in enumerate(group.resources):
        if entry.memory_burst_limit is not None:
            raise ValueError(
                f"resources[{position}]: memoryBurstLimit only applies to sharing.timeSlicing: the MPS server "
                "holds every client to its memoryLimit, so a replica cannot burst above it; remove "
                "memoryBurstLimit (or raise memoryLimit)"
            )
    return group


SHARING = Section(
    values.SharingModel,
    [
        Key("time_slicing", "timeSlicing", then(REPLICATED_RESOURCES, mps_keys_only_for_mps)),
        Key("mps", "mps", then(REPLICATED_RESOURCES, no_burst_under_mps)),
    ],
)


def channel_ids(ids: list[int]) -> list[int]:
    if ids not in ([], [0]):
        raise ValueError(f"invalid IMEX config: channelIDs must be [] or [0]; found {ids}")
    return ids


IMEX = Section(
    values.ImexModel,
    [Key("channel_ids", "channelIDs", then(list_of(INT), channel_ids)), Key("required", "required", BOOL)],
)

# Tessera: the MIG layout this config wants, in mig-parted's format (``layouts``: validated by
# agent.mig.layout_file where it is used), and which of its mig-configs (a node label nvidia.com/mig.config wins).
MIG_LAYOUT = Section(values.MigLayoutSection, [Key("config", "config", TEXT), Key("layouts", "layouts", leaf(mapping))])


def xid_overrides(value: object) -> dict[str, Any]:
    """``health.xids``: an XID (``"94"``) or an inclusive range (``"144-150"``) to an effect (docs/health.md)."""
    if not isinstance(value, dict):
        raise ValueError('must be a map of XID to effect, e.g. {"94": unhealthy, "13": ignore}')
    problems, effects = [], {}
    for key, effect in value.items():
        try:
            parse_xid_key(key)
        except ValueError as error:
            problems.append(f"key {error}")
            continue
        try:
            effects[str(key).strip()] = parse_effect(effect)
        except ValueError as error:
            problems.append(f"XID {str(key).strip()}: {error}")
    if problems:
        raise ValueError("; ".join(problems))
    return effects


HEALTH = Section(values.HealthSection, [Key("xids", "xids", leaf(xid_overrides))])


# ----- DRA ------------------------------------------------------------------------------------------


def gpu_selection(value: object) -> str | list[int | str]:
    """``all``, or a list of GPU indices and UUIDs, each named once."""
    if value == "all":
        return "all"
    if not isinstance(value, list):
        raise ValueError(f"expected 'all' or a list of GPU indices and UUIDs, got {yaml_kind(value)}")
    entries = [v if isinstance(v, int) and not isinstance(v, bool) else _text_or_self(v) for v in value]
    problems = [
        f"{shown(entry)} is neither a GPU index nor a GPU UUID"
        for entry in entries
        if not (isinstance(entry, int) and entry >= 0)
        and not (isinstance(entry, str) and re.fullmatch(_GPU_UUID, entry))
    ]
    if len(set(map(str, entries))) != len(entries):
        problems.append("a GPU is named twice")
    if not entries:
        problems.append('an empty list serves no GPU: use enabled: false, or "all"')
    if problems:
        raise ValueError("; ".join(problems))
    return entries


def _text_or_self(value: object) -> object:
    try:
        return text(value)
    except ValueError:
        return value


def default_share(value: object) -> int:
    """``dra.defaultShare``: a memory size in whole MiB (``10Gi``), as bytes."""
    from agent.core.dra.shares import MEMORY_STEP
    from agent.core.quantity import parse_quantity

    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError("write a memory size such as 10Gi")
    # bounded before any arithmetic: "1e10000000" is refused at once, naming the bound (QuantityError)
    amount = parse_quantity(value, what="memory size", hint="write a whole number of MiB such as 1500Mi or 10Gi")
    if amount <= 0 or amount.denominator != 1 or amount % MEMORY_STEP:
        raise ValueError(f"{shown(value)} is not a whole number of MiB (1500Mi, 10Gi, …): shares come in 1Mi steps")
    return int(amount)


def consumable_shares(value: object) -> int | str:
    from agent.core.dra.shares import check_mode

    return check_mode(value)


def driver_name(value: str) -> str:
    from agent.dra.names import check_driver_name

    return check_driver_name(value)


def shares_named(section: values.DraSection) -> None:
    if section.consumable_shares == "disabled" and section.gpu_shares is not None:
        raise ValueError(
            "consumableShares is disabled but gpuShares names GPUs to share: remove one of dra.consumableShares "
            "and dra.gpuShares"
        )
    if section.default_share is not None and section.shared_gpus is None:
        raise ValueError("defaultShare is set but gpuShares names no GPU to share: add dra.gpuShares")
    if section.default_share is not None and section.share_mode != "memory":
        raise ValueError(
            f"defaultShare is what a claim that asks for no memory gets with consumableShares: memory; with "
            f"consumableShares: {section.share_mode} such a claim takes no memory (as on NVIDIA's driver): remove "
            "dra.defaultShare"
        )


# agent.config.model.DraSection says what each key does (and docs/dra.md)
DRA = Section(
    values.DraSection,
    [
        Key("enabled", "enabled", BOOL),
        Key("driver_name", "driverName", then(TEXT, driver_name)),
        Key("gpus", "gpus", leaf(gpu_selection)),
        Key("dynamic_mig", "dynamicMig", leaf(gpu_selection)),
        Key("gpu_shares", "gpuShares", leaf(gpu_selection)),
        Key("default_share", "defaultShare", leaf(default_share)),
        Key("consumable_shares", "consumableShares", leaf(consumable_shares)),
    ],
    after=shares_named,
)


# ----- the document ---------------------------------------------------------------------------------


def version(value: str) -> str:
    if value in ("", "v1"):
        return "v1"
    raise ValueError(f"unknown version: {value}; this is a version v1 config (NVIDIA's format): set version: v1")


CONFIG = Section(
    values.ConfigModel,
    [
        Key("version", "version", then(TEXT, version)),
        Key("flags", "flags", FLAGS),
        Key("resources", "resources", RESOURCES),
        Key("sharing", "sharing", SHARING),
        Key("imex", "imex", IMEX),
        Key("match", "match", one_or_many(TEXT)),  # Tessera: the GPU products this config is for (globs)
        Key("mig_layout", "migLayout", MIG_LAYOUT),  # Tessera: the MIG layout manager
        Key("health", "health", HEALTH),  # Tessera: per-XID health overrides
        Key("dra", "dra", DRA),  # Tessera: which GPUs the DRA front end serves
    ],
)

SECTIONS: dict[type, Section] = {
    s.struct: s
    for s in (
        PLUGIN_FLAGS,
        GFD_FLAGS,
        FLAGS,
        NAMING_RULE,
        RESOURCES,
        REPLICATED_RESOURCE,
        REPLICATED_RESOURCES,
        SHARING,
        IMEX,
        MIG_LAYOUT,
        HEALTH,
        DRA,
        CONFIG,
    )
}


def parse_config(data: object, origin: str = "config") -> tuple[values.ConfigModel, list[str]]:
    """What :func:`agent.config.model.parse_config` does: validate, warn, and build the structs.

    A document that is positively something else (:func:`foreign_document`) is refused for what it is: NVIDIA's
    plugin would read a Pod manifest as a config of unknown keys, i.e. every default, without a word.
    """
    foreign = foreign_document(data)
    if foreign is not None:
        raise NotASharingConfig(origin, [foreign])
    walk = _Walk()
    model = CONFIG({} if data is None else data, "", walk)
    if walk.problems or model is BAD:
        raise ConfigError(origin, walk.problems)
    warnings = [f"{origin}: {w}" for w in walk.warnings + _nvidia_flag_warnings(model.flags)]
    if model.sharing and model.sharing.mps is not None and model.sharing.time_slicing is not None:
        warnings.append(f"{origin}: sharing has both timeSlicing and mps; mps is used and timeSlicing is ignored")
    return model, warnings


def _nvidia_flag_warnings(flags: values.Flags) -> list[str]:
    """NVIDIA's ``flags`` that Tessera does not honour at the given value (agent.nvidia_flags says why)."""
    if flags == values.Flags():  # no flag given: nothing to warn of (nor to load the table for)
        return []
    from agent.nvidia_flags import CONFIG_FLAGS, config_flag_warnings

    given: dict[str, object] = {}
    for path in CONFIG_FLAGS:
        section: object = flags
        for alias in path.split(".")[1:]:
            key = SECTIONS[type(section)].key(alias) if type(section) in SECTIONS else None
            section = None if key is None else getattr(section, key.field)
        given[path] = section
    return config_flag_warnings(given)


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
    if any(CONFIG.known(key) not in (None, "version") for key in data):
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
