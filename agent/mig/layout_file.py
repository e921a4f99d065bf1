"""mig-parted's config file (``version: v1``): parsed as mig-parted parses it, walked as mig-parted walks it.

```yaml
version: v1
mig-configs:
  all-balanced:
    - device-filter: ["0x20B210DE", "0x233010DE"]   # optional: 0xDDDDVVVV[:0xSSSSVVVV], a string or a list
      devices: all                                 # required: all, or a list of GPU indices
      mig-enabled: true                            # required
      mig-devices: {1g.10gb: 2, 2g.20gb: 1, 3g.40gb: 1}   # required when enabled ({} = MIG on, no instances)
```

The rules (facts: mig-mps.md §(a)): ``version`` must be ``v1``; ``mig-configs`` is a non-empty map of
non-empty lists; any other key, at the top or in a spec, is an "unexpected field". ``mig-devices`` must be
absent or empty when MIG is disabled; each key must parse as a profile string (``[<C>c.]<G>g.<GB>gb`` with
``+attr`` or ``-attr``); counts are >= 0, and a non-empty map needs one count > 0. Every problem is reported
with its path, e.g. ``mig-configs.all-balanced[0].mig-devices``.

Where Tessera is stricter than mig-parted, on purpose:
- A malformed ``device-filter`` is an error. mig-parted silently matches nothing with it, so a typo would
  leave the GPUs unconfigured without a word.
- A negative index in ``devices`` is an error (mig-parted accepts it and it matches nothing).
- The file must name at least one config (mig-parted accepts a file without ``mig-configs``).

Where Tessera can only approximate: the inventory has no PCI *subsystem* ids, so a filter with a subsystem
(``0x20B010DE:0x134F10DE``) matches on device and vendor only: it may select more GPUs than mig-parted would
(those of the same product from another board vendor).

Whether a profile exists on a GPU model, and whether a layout fits, is ``agent.core.mig_layout``'s business.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from msgspec import Struct
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from agent.config.bounded import read_bounded
from agent.config.model import ConfigError, MigLayoutSection
from agent.config.yaml_limits import load_yaml
from agent.core.inventory import Gpu
from agent.core.mig_catalog import MigCatalog, mig_catalogs, parse_profile_name
from agent.core.mig_layout import DesiredLayout, current_layout, validate_layout

VERSION = "v1"
KIND = "a MIG layout file"


class LayoutFileError(ValueError):
    """The file or the selected config cannot be used; ``problems`` are ``path: what is wrong`` lines."""

    def __init__(self, message: str, problems: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.problems = list(problems) or [message]


class DeviceFilter(Struct, frozen=True):
    """One ``device-filter`` value: ``0xDDDDVVVV`` (device << 16 | vendor) and an optional subsystem id."""

    device_id: int  # 0xDDDDVVVV, as NVML's pciDeviceId
    subsystem_id: int | None = None  # 0xSSSSVVVV

    def __str__(self) -> str:
        text = f"0x{self.device_id:08X}"
        return text if self.subsystem_id is None else f"{text}:0x{self.subsystem_id:08X}"

    def matches(self, gpu: Gpu) -> bool:
        """Device and vendor must match; the subsystem cannot be checked (the inventory lacks it)."""
        return self.device_id == gpu.pci_device_id & 0xFFFFFFFF


def parse_device_filter(text: str) -> DeviceFilter:
    """``0xDDDDVVVV[:0xSSSSVVVV]``, each part an unsigned 32-bit integer in Go's base-0 syntax (0x.., decimal)."""
    parts = text.split(":")
    if len(parts) > 2:
        raise ValueError(f"{text!r} is not 0xDDDDVVVV or 0xDDDDVVVV:0xSSSSVVVV")
    values = []
    for part in parts:
        try:
            value = int(part, 0)
        except ValueError:
            raise ValueError(f"{text!r} is not 0xDDDDVVVV[:0xSSSSVVVV] (e.g. '0x20B010DE')") from None
        if not 0 <= value <= 0xFFFFFFFF:
            raise ValueError(f"{text!r} does not fit in 32 bits")
        values.append(value)
    return DeviceFilter(values[0], values[1] if len(values) == 2 else None)


class MigConfigSpec(BaseModel):
    """One entry of a config: which GPUs, MIG on or off, and which instances."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    device_filter: tuple[str, ...] = Field(default=(), alias="device-filter")  # empty: every GPU
    devices: Literal["all"] | tuple[int, ...]
    mig_enabled: bool = Field(alias="mig-enabled")
    mig_devices: dict[str, int] | None = Field(default=None, alias="mig-devices", validate_default=True)

    @field_validator("device_filter", mode="plain")
    @classmethod
    def _device_filter(cls, value: Any) -> tuple[str, ...]:
        if value is None or value == "":
            return ()
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, list | tuple) or not all(isinstance(v, str) for v in values):
            raise ValueError(
                "must be a string or a list of strings such as '0x20B010DE' (quote hex ids in YAML, "
                "or they become numbers)"
            )
        for v in values:
            parse_device_filter(v)
        return tuple(values)

    @field_validator("devices", mode="plain")
    @classmethod
    def _devices(cls, value: Any) -> Literal["all"] | tuple[int, ...]:
        if isinstance(value, str):
            if value != "all":
                raise ValueError(f"invalid string input {value!r}: use 'all' or a list of GPU indices")
            return "all"
        if not isinstance(value, list | tuple):
            raise ValueError("must be 'all' or a list of GPU indices")
        for item in value:
            if not isinstance(item, int) or isinstance(item, bool) or item < 0:
                raise ValueError(f"{item!r} is not a GPU index (a non-negative integer)")
        return tuple(value)

    @field_validator("mig_enabled", mode="plain")
    @classmethod
    def _mig_enabled(cls, value: Any) -> bool:
        if not isinstance(value, bool):
            raise ValueError(f"must be true or false, not {value!r}")
        return value

    @field_validator("mig_devices", mode="plain")
    @classmethod
    def _mig_devices(cls, value: Any, info: ValidationInfo) -> dict[str, int] | None:
        enabled = info.data.get("mig_enabled")
        if value is None:
            if enabled is True:
                raise ValueError("required when mig-enabled is true ({} means MIG on with no instances)")
            return None
        if not isinstance(value, Mapping):
            raise ValueError("must be a map from MIG profile to count, e.g. {1g.10gb: 7}")
        devices: dict[str, int] = {}
        for profile, count in value.items():
            if not isinstance(profile, str):
                raise ValueError(f"{profile!r} is not a MIG profile string")
            try:
                parse_profile_name(profile)
            except ValueError as error:
                raise ValueError(f"invalid format for {profile!r}: {error}") from None
            if not isinstance(count, int) or isinstance(count, bool) or count < 0:
                raise ValueError(f"invalid count for {profile!r}: {count!r} (a non-negative integer)")
            devices[profile] = count
        if devices and not any(devices.values()):
            raise ValueError("all counts are 0: give one count > 0, or use {} for MIG on with no instances")
        if enabled is False and devices:
            raise ValueError("MIG devices are listed but mig-enabled is false: remove them")
        return devices

    @property
    def filters(self) -> tuple[DeviceFilter, ...]:
        return tuple(parse_device_filter(f) for f in self.device_filter)

    def matches(self, gpu: Gpu) -> bool:
        """mig-parted's test: the device filter (empty matches all) and the device list ('all' or the index)."""
        filters = self.filters
        if filters and not any(f.matches(gpu) for f in filters):
            return False
        return self.devices == "all" or gpu.index in self.devices

    def layout(self) -> DesiredLayout:
        return DesiredLayout(self.mig_enabled, tuple((self.mig_devices or {}).items()))


def _non_empty(value: Any) -> Any:
    if isinstance(value, list | tuple) and not value:
        raise ValueError("at least one entry is required")
    return value


class MigLayoutFile(BaseModel):
    """A whole file: configs by label, each a list of specs applied in order."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: str
    mig_configs: dict[str, Annotated[tuple[MigConfigSpec, ...], BeforeValidator(_non_empty)]] = Field(
        alias="mig-configs"
    )
    _origin: str = PrivateAttr(default="")

    @property
    def origin(self) -> str:
        """Where the file came from (a path, ``configmap/...``), for messages."""
        return self._origin

    @field_validator("version", mode="plain")
    @classmethod
    def _version(cls, value: Any) -> str:
        if value != VERSION:
            raise ValueError(f"unknown version: {value!r} (use 'version: {VERSION}')")
        return VERSION

    @field_validator("mig_configs", mode="before")
    @classmethod
    def _configs(cls, value: Any) -> Any:
        if isinstance(value, Mapping) and not value:
            raise ValueError("at least one entry is required")
        return value


def parse_layout_file(data: object, origin: str) -> MigLayoutFile:
    """Validate a loaded YAML/JSON document; LayoutFileError lists every problem with its path."""
    if not isinstance(data, Mapping):
        problem = f"expected a map with 'version: {VERSION}' and 'mig-configs', not {type(data).__name__}"
        raise LayoutFileError(f"{origin}: {problem}", [problem])
    try:
        parsed = MigLayoutFile.model_validate(data)
    except ValidationError as error:
        problems = [_problem(e) for e in error.errors()]
        raise LayoutFileError(f"{origin}: " + "; ".join(problems), problems) from None
    parsed._origin = origin
    return parsed


def read_layout_file(path: Path) -> object:
    """The YAML/JSON document of the layout file at ``path``, read within the limits of
    :mod:`agent.config.yaml_limits` (1 MiB, nesting, aliases, one document, a regular file).

    Raises only LayoutFileError, whose message starts with the path (and whose ``cause`` is the ConfigError,
    a YAML syntax error with its excerpt among them); pass the result to :func:`parse_layout_file`
    (``parse_layout_file(read_layout_file(path), str(path))``).
    """
    origin = str(path)
    try:
        return load_yaml(read_bounded(path, origin), origin, kind=KIND)
    except ConfigError as error:
        raise LayoutFileError(str(error), error.problems) from error


def config_layout(
    section: MigLayoutSection | None, origin: str, name: str | None = None
) -> tuple[MigLayoutFile, str | None] | None:
    """The layouts a sharing config's ``migLayout`` holds, and the mig-config that applies, as the agent
    chooses it: ``name`` (the node label ``nvidia.com/mig.config``), else ``migLayout.config``, else the only
    one; None for the name when it cannot tell (the agent then leaves MIG as it is). None when the config
    holds no layouts."""
    if section is None or section.layouts is None:
        return None
    layout_file = parse_layout_file(section.layouts, f"{origin} migLayout.layouts")
    chosen = name or section.config
    if chosen is None and len(layout_file.mig_configs) == 1:
        chosen = next(iter(layout_file.mig_configs))
    return layout_file, chosen


def misfit(catalog: MigCatalog, layout: DesiredLayout) -> str | None:
    """Why ``layout`` cannot be applied to a GPU of ``catalog``'s model, in short, or None when it can.

    The model is the reader's context (the messages are grouped by it), so it is not repeated; "no placement
    can hold" is said in slices where the slices are the reason.
    """
    problems = [
        p.removesuffix(f" on {catalog.product}").replace(f" {catalog.product} ", " the GPU ")
        for p in validate_layout(catalog, layout)
    ]
    if not problems:
        return None
    placement = [p for p in problems if p.startswith("no placement can hold")]
    if placement and len(placement) < len(problems):  # the counts say why already
        problems = [p for p in problems if p not in placement]
    elif placement:
        profiles = [(catalog.profile(name), count) for name, count in layout.devices]
        if all(profile is not None for profile, _ in profiles):
            compute = sum(profile.slices * count for profile, count in profiles if profile is not None)
            memory = sum(profile.memory_slices * count for profile, count in profiles if profile is not None)
            if compute > catalog.compute_slices:
                return f"together they take {compute} compute slices and the GPU has {catalog.compute_slices}"
            if memory > catalog.memory_slices:
                return f"together they take {memory} memory slices and the GPU has {catalog.memory_slices}"
        return "no placement holds them together (each profile may start only at certain memory slices)"
    return "; ".join(problems)


def unfit_problems(layout_file: MigLayoutFile, label: str | None = None) -> list[str]:
    """The specs (of ``label``, or of every mig-config) that no GPU model can take, whatever the node.

    A spec is judged on the models its ``device-filter`` admits (every model without one): none of them has
    all its profiles, or on every model that has them the instances do not fit. A spec whose filter names
    only models Tessera has no MIG table for is not judged.
    """
    problems = []
    for name in [label] if label is not None else list(layout_file.mig_configs):
        for position, spec in enumerate(layout_file.mig_configs.get(name, ())):
            layout = spec.layout()
            if not layout.enabled or not layout.devices:
                continue
            filters = spec.filters
            admitted = [
                c for c in mig_catalogs() if not filters or any(f.device_id == c.pci_device_id for f in filters)
            ]
            if not admitted:
                continue
            having = [c for c in admitted if all(c.profile(profile) is not None for profile, _ in layout.devices)]
            where = f"mig-configs.{name}[{position}]"
            models = "the GPU models of its device-filter" if filters else "GPU model"
            if not having:
                problems.append(
                    f"{where}: no {models} has all of {', '.join(p for p, _ in layout.devices)} as MIG profiles"
                    if not filters
                    else f"{where}: none of {models} ({', '.join(c.key for c in admitted)}) has all of "
                    f"{', '.join(p for p, _ in layout.devices)}"
                )
                continue
            reasons: dict[str, list[str]] = {}
            for catalog in having:
                reason = misfit(catalog, layout)
                if reason is None:
                    break
                reasons.setdefault(reason, []).append(catalog.key)
            else:
                from agent.render import instances_text

                grouped = "; ".join(f"on {', '.join(keys)}: {reason}" for reason, keys in reasons.items())
                fits = "fits none of the GPU models of its device-filter" if filters else "fits no GPU model"
                problems.append(f"{where}: {instances_text(layout.devices)} {fits}: {grouped}")
    return problems


def parse_layout_text(text: str, origin: str) -> MigLayoutFile:
    """Parse YAML (or JSON) text, as mig-parted reads its file, within the limits of agent.config.yaml_limits."""
    try:
        data = load_yaml(text, origin, kind=KIND)
    except ConfigError as error:
        raise LayoutFileError(str(error), error.problems) from None
    return parse_layout_file(data, origin)


_MESSAGES = {
    "missing": "missing required field",
    "extra_forbidden": "unexpected field",
    "dict_type": "must be a map",
    "tuple_type": "must be a list of specs",
    "model_type": "must be a map with devices, mig-enabled and mig-devices",
    "string_type": "must be a string",
}
_ALIASES = {  # loc names a field by its Python name when a default is validated
    "mig_configs": "mig-configs",
    "device_filter": "device-filter",
    "mig_enabled": "mig-enabled",
    "mig_devices": "mig-devices",
}


def _problem(error: Mapping[str, Any]) -> str:
    kind = error["type"]
    path = _path(error["loc"], raw_keys=kind == "extra_forbidden")
    message = str(error["ctx"]["error"]) if kind == "value_error" else _MESSAGES.get(kind, error["msg"])
    return f"{path}: {message}" if path else message


def _path(loc: Sequence[Any], *, raw_keys: bool = False) -> str:
    """``("mig-configs", "all-balanced", 0, "mig-devices")`` -> ``mig-configs.all-balanced[0].mig-devices``."""
    text = ""
    for position, part in enumerate(loc):
        known = isinstance(part, str) and position in (0, 3) and not raw_keys
        name = _ALIASES.get(part, part) if known else part
        if isinstance(name, int) and position != 1:
            text += f"[{name}]"
        elif name == "[key]":
            text += " (key)"
        else:
            text += f".{name}" if text else str(name)
    return text


# ----- mig-parted's walk -------------------------------------------------------------------------------


def layouts_for_node(file: MigLayoutFile, label: str, gpus: Sequence[Gpu]) -> dict[int, DesiredLayout]:
    """The layout per GPU index that config ``label`` selects on this node, walked as mig-parted walks it.

    The specs in file order; for each, the GPUs in index order that match its device filter and its device
    list. A GPU visited by several specs gets the last one. GPUs that no spec matches are absent (left
    alone); listed indices that the node lacks are ignored, as mig-parted ignores them. A non-MIG-capable GPU
    is skipped under ``devices: all`` or ``mig-enabled: false``; listing it by index with ``mig-enabled:
    true`` is an error.
    """
    specs = file.mig_configs.get(label)
    if specs is None:
        message = f"selected mig-config not present: {label} (have: {', '.join(sorted(file.mig_configs))})"
        raise LayoutFileError(f"{file.origin}: {message}" if file.origin else message, [message])
    layouts: dict[int, DesiredLayout] = {}
    problems: list[str] = []
    for number, spec in enumerate(specs):
        for gpu in sorted(gpus, key=lambda g: g.index):
            if not spec.matches(gpu):
                continue
            if not gpu.mig_capable:
                if spec.devices != "all" and spec.mig_enabled:
                    problems.append(
                        f"mig-configs.{label}[{number}]: cannot set MIG mode on non MIG-capable GPU {gpu.index} "
                        f"({gpu.name})"
                    )
                continue
            layouts[gpu.index] = spec.layout()
    if problems:
        prefix = f"{file.origin}: " if file.origin else ""
        raise LayoutFileError(prefix + "; ".join(problems), problems)
    return layouts


def export_layout(gpus: Sequence[Gpu], label: str = "current") -> dict[str, Any]:
    """The node's current layout as a mig-parted config file, in the shape ``nvidia-mig-parted export`` gives.

    One spec per GPU ``{device-filter: [id], devices: [i], mig-enabled, mig-devices}``; specs with equal
    mig-enabled and mig-devices are merged. The filter is dropped when the node has one device id or when
    one spec remains, and a single filter becomes a string; a device list that covers every GPU of its
    filters becomes ``all``. A non-MIG-capable GPU exports as ``mig-enabled: false``.
    """
    per_gpu = []
    for gpu in sorted(gpus, key=lambda g: g.index):
        layout = current_layout(gpu) if gpu.mig_capable else DesiredLayout(False)
        per_gpu.append((f"0x{gpu.pci_device_id & 0xFFFFFFFF:08X}", gpu.index, layout))
    devices_by_filter: dict[str, set[int]] = {}
    for device_filter, index, _ in per_gpu:
        devices_by_filter.setdefault(device_filter, set()).add(index)
    merged: list[tuple[set[str], set[int], DesiredLayout]] = []
    for device_filter, index, layout in per_gpu:
        same = next((m for m in merged if m[2] == layout), None)
        if same is None:
            merged.append(({device_filter}, {index}, layout))
        else:
            same[0].add(device_filter)
            same[1].add(index)
    specs = []
    for filters, indices, layout in merged:
        spec: dict[str, Any] = {}
        if len(devices_by_filter) > 1 and len(merged) > 1:
            spec["device-filter"] = next(iter(filters)) if len(filters) == 1 else sorted(filters)
        covered = set().union(*(devices_by_filter[f] for f in filters))
        spec["devices"] = "all" if indices == covered else sorted(indices)
        spec["mig-enabled"] = layout.enabled
        spec["mig-devices"] = dict(layout.devices)
        specs.append(spec)
    return {"version": VERSION, "mig-configs": {label: specs}}
