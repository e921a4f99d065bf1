"""The sharing config: NVIDIA's ``version: v1`` format, parsed as NVIDIA parses it, plus Tessera's extensions.

Compatibility rules (facts: nvidia-device-plugin.md §1):
- YAML or JSON; an empty document is all defaults; ``version`` missing or empty means ``v1``.
- Keys of ordinary sections match case-insensitively (``timeslicing`` is ``timeSlicing``); keys inside a
  sharing group (``renameByDefault``, ``resources``...), a sharing resource entry or a naming rule are exact,
  because NVIDIA reads those with exact map lookups.
- A YAML number or bool given for a text field becomes text (``version: 1`` is "1", which is then not
  v1); text is never read as a number or bool (``replicas: "4"`` is an error).
- Unknown keys are accepted, as NVIDIA accepts them — but each is reported with the closest known key,
  because a typo (``timeSlice:``) silently turns sharing off on NVIDIA's plugin. ``strict`` rejects them.

Tessera's extensions are additions NVIDIA's plugin ignores: top-level ``match`` (which GPU products this
config is for), ``migLayout``, ``health`` (per-XID overrides of the Xid-catalog defaults), and honouring
``rename``, ``devices`` and ``resources`` where NVIDIA discards them.

This module holds the config as plain frozen structs (msgspec): the agent builds ``ConfigModel()`` (every
default) when no config is given, at no cost. :func:`parse_config` validates a document with
:mod:`agent.config.schema` (how each field is written in YAML), imported only then.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from msgspec import Struct, field

from agent.config.errors import ConfigError as ConfigError  # where every caller finds it
from agent.core.xid_effect import XidEffect, parse_xid_key
from agent.plugin.names import resource_name_problem

RESOURCE_PREFIX = "nvidia.com/"
MAX_REPLICAS = 1024  # per device; more would flood the kubelet's device list (NVIDIA sets no limit)
# Patterns as text, compiled (and cached by re) when first used: a start without a config uses none of them.
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


def parse_config(data: object, origin: str = "config") -> tuple[ConfigModel, list[str]]:
    """A validated config and its warnings (unknown keys with the closest known one, overridden sections).

    Raises ``ConfigError`` whose problems name each field path.
    """
    from agent.config.schema import parse_config as validate

    return validate(data, origin)


def safe_host_path(value: str) -> str:
    """A host directory the agent creates things in: absolute, no ``..``, no control characters."""
    if not value.startswith("/") or any(part == ".." for part in value.split("/")):
        raise ValueError(f"{value!r} must be an absolute path without '..'")
    if any(ord(c) < 32 for c in value) or len(value) > 255:
        raise ValueError(f"{value!r} has control characters or is too long")
    return value.rstrip("/") or "/"


def normalise_resource_name(value: str) -> str:
    """NVIDIA's rule: prefix ``nvidia.com/`` unless already there; then the kubelet's and the 63-char rules."""
    name = value if value.startswith(RESOURCE_PREFIX) else RESOURCE_PREFIX + value
    short = name[len(RESOURCE_PREFIX) :]
    if len(name) > 63:
        raise ValueError(f"fully-qualified resource name must be 63 characters or less: {name!r}")
    if not re.match(_DNS_SUBDOMAIN, short):
        raise ValueError(
            f"incorrect format for resource name {name!r}: after 'nvidia.com/' use lower-case letters, digits, "
            "'-' and '.', starting and ending with a letter or digit"
        )
    problem = resource_name_problem(name)
    if problem:
        raise ValueError(problem)
    return name


MAX_MEMORY_MIB = 1 << 24  # 16Ti: a memory limit beyond any GPU's memory


def quantity_mib(text: str) -> int:
    """A Kubernetes quantity (``10Gi``, ``512Mi``, ``20G``, ``1.5Gi``, bytes) in whole MiB (rounded down), 1Mi to 16Ti.

    Read by ``agent.core.quantity``, which bounds it before any arithmetic (``1e10000000`` is refused at once)."""
    from agent.core.quantity import QuantityError, quantity_value

    span = "use between 1Mi and 16Ti"
    try:
        amount = quantity_value(text, what="memory quantity", hint="write e.g. 10Gi, 512Mi or 20G")
    except QuantityError as error:
        if not error.out_of_range:
            raise ValueError(str(error)) from None
        amount = None
    mib = None if amount is None else amount // (1 << 20)
    if mib is None or not 1 <= mib <= MAX_MEMORY_MIB:
        shown = repr(text) if len(text) <= 40 else f"{text[:40]!r}..."
        raise ValueError(f"{shown} is out of range: {span}")
    return mib


# ----- the config, as agent.config.schema reads it (the keys, types and rules of each field are there) -----

DeviceListStrategyName = Literal["envvar", "volume-mounts", "cdi-annotations", "cdi-cri"]


class PluginFlags(Struct, frozen=True, kw_only=True):
    pass_device_specs: bool | None = None
    device_list_strategy: list[DeviceListStrategyName] | None = None
    device_id_strategy: Literal["uuid", "index"] | None = None
    cdi_annotation_prefix: str | None = None
    nvidia_ctk_path: str | None = None
    container_driver_root: str | None = None
    shared_devices_allocation_policy: Literal["distributed", "packed"] | None = None


class GfdFlags(Struct, frozen=True, kw_only=True):
    oneshot: bool | None = None
    no_timestamp: bool | None = None
    sleep_interval: str | None = None
    output_file: str | None = None
    machine_type_file: str | None = None


class Flags(Struct, frozen=True, kw_only=True):
    mig_strategy: Literal["none", "single", "mixed"] | None = None
    fail_on_init_error: bool | None = None
    mps_root: str | None = None
    nvidia_driver_root: str | None = None
    nvidia_dev_root: str | None = None
    gdrcopy_enabled: bool | None = None
    gds_enabled: bool | None = None
    mofed_enabled: bool | None = None
    use_node_feature_api: bool | None = None
    device_discovery_strategy: Literal["auto", "nvml", "tegra", "vfio"] | None = None
    plugin: PluginFlags | None = None
    gfd: GfdFlags | None = None


class NamingRuleModel(Struct, frozen=True, kw_only=True):
    pattern: str
    name: str


class ResourcesModel(Struct, frozen=True, kw_only=True):
    gpus: list[NamingRuleModel] = field(default_factory=list)
    mig: list[NamingRuleModel] = field(default_factory=list)


class ReplicatedResource(Struct, frozen=True, kw_only=True):
    name: str
    rename: str | None = None
    replicas: int
    devices: Literal["all"] | int | list[int | str] = "all"
    # Tessera's extensions (memoryBurstLimit: time-slicing only; activeThreadPercentage, oversubscribe: MPS only):
    memory_limit: str | None = None  # a quantity: 10Gi, 512Mi, 20G
    memory_burst_limit: str | None = None  # the hard limit a time-sliced replica may burst to (>= memory_limit)
    active_thread_percentage: int | None = None
    oversubscribe: bool | None = None


class ReplicatedResources(Struct, frozen=True, kw_only=True):
    rename_by_default: bool = False
    fail_requests_greater_than_one: bool | None = None
    resources: list[ReplicatedResource]


class SharingModel(Struct, frozen=True, kw_only=True):
    time_slicing: ReplicatedResources | None = None
    mps: ReplicatedResources | None = None


class ImexModel(Struct, frozen=True, kw_only=True):
    channel_ids: list[int] = field(default_factory=list)
    required: bool = False


class MigLayoutSection(Struct, frozen=True, kw_only=True):
    """Tessera: the MIG layout this config wants, in mig-parted's format (``layouts``), and which one."""

    config: str | None = None  # the mig-config to apply (a node label nvidia.com/mig.config wins)
    layouts: dict[str, Any] | None = None  # {version: v1, mig-configs: {...}}, validated by agent.mig.layout_file


class HealthSection(Struct, frozen=True, kw_only=True):
    """Tessera: what an XID does to a device, overriding the Xid-catalog default (docs/health.md).

    ``xids`` maps an XID (``"94"``) or an inclusive range (``"144-150"``) to ``ignore``, ``application``,
    ``unhealthy`` or ``lost``. A ``--xid-overrides`` flag wins over it, XID by XID.
    """

    xids: dict[str, XidEffect] | None = None

    def overrides(self) -> dict[int, XidEffect]:
        """The XID -> effect map, ranges expanded (later keys win where ranges overlap)."""
        result: dict[int, XidEffect] = {}
        for key, effect in (self.xids or {}).items():
            result.update(dict.fromkeys(parse_xid_key(key), effect))
        return result


def shared_gpus(
    gpu_shares: Literal["all"] | list[int | str] | None, consumable_shares: int | str | None
) -> Literal["all"] | list[int | str] | None:
    """The GPUs published for shares: ``gpuShares``, or every one when only ``consumableShares`` is set."""
    if consumable_shares == "disabled":
        return None
    if gpu_shares is None and consumable_shares is not None:
        return "all"
    return gpu_shares


def share_mode(consumable_shares: int | str | None) -> int | str:
    """NVIDIA's ``consumableShares`` mode of the shared GPUs (``memory`` unless set)."""
    return "memory" if consumable_shares is None else consumable_shares


class DraSection(Struct, frozen=True, kw_only=True):
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

    enabled: bool = False
    driver_name: str = "gpu.nvidia.com"
    gpus: Literal["all"] | list[int | str] = "all"
    dynamic_mig: Literal["all"] | list[int | str] | None = None  # partitionable devices: MIG made per claim
    gpu_shares: Literal["all"] | list[int | str] | None = None  # consumable capacity: memory-sized shares
    default_share: int | None = None  # bytes a claim that asks for no memory gets of a shared GPU (None: all)
    consumable_shares: int | str | None = None  # NVIDIA's --consumable-shares: memory, unlimited, N or disabled

    @property
    def shared_gpus(self) -> Literal["all"] | list[int | str] | None:
        return shared_gpus(self.gpu_shares, self.consumable_shares)

    @property
    def share_mode(self) -> int | str:
        return share_mode(self.consumable_shares)


class ConfigModel(Struct, frozen=True, kw_only=True):
    """A whole config; ``ConfigModel()`` is every default (no config given)."""

    version: str | None = None
    flags: Flags = field(default_factory=Flags)
    resources: ResourcesModel | None = None
    sharing: SharingModel | None = None
    imex: ImexModel | None = None
    match: list[str] | None = None  # Tessera: the GPU products this config is for (globs)
    mig_layout: MigLayoutSection | None = None  # Tessera: the MIG layout manager
    health: HealthSection | None = None  # Tessera: per-XID health overrides
    dra: DraSection | None = None  # Tessera: which GPUs the DRA front end serves

    @property
    def replicated(self) -> tuple[str, ReplicatedResources] | None:
        """The sharing group in force: MPS wins when both are set, as on NVIDIA's plugin."""
        if self.sharing is None:
            return None
        if self.sharing.mps is not None:
            return "mps", self.sharing.mps
        if self.sharing.time_slicing is not None:
            return "timeSlicing", self.sharing.time_slicing
        return None
