"""Simulated nodes described in YAML, and the presets users and tests start from.

```yaml
name: gpu-node-1                 # optional; seeds the GPU UUIDs (same spec -> same UUIDs)
nvlink: nvswitch                 # none (default) | nvswitch | [[0, 1], [2, 3]] (direct links)
numa_nodes: 2                    # optional, default 1: GPUs are spread evenly over them
gpus:
  - model: A100-SXM4-80GB        # a key of the hardware table (or the name NVML reports)
    count: 2                     # optional, default 1
    mig:                         # optional; absent means MIG disabled
      instances: [3g.40gb, 2g.20gb, 1g.10gb, 1g.10gb]   # created in order, placed as the driver would
    mig_pending: disabled        # optional: a MIG mode change waiting for a GPU reset
    mig_needs_reset: false       # optional: MIG mode changes stay pending until reset_gpu()
    compute_mode: DEFAULT        # DEFAULT | PROHIBITED | EXCLUSIVE_PROCESS
```

A ``mig.instances`` entry such as ``1c.3g.40gb`` adds a compute instance to the GPU instance of the
previous entry when it has room (as mig-parted does), otherwise to a new one.
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from msgspec import Struct, field

from agent.config.bounded import read_bounded
from agent.config.model import ConfigError
from agent.config.yaml_limits import load_yaml
from agent.sim.nvml.driver import NvmlFault, SimDriver, SimGpu, SimGpuInstance, gpu_uuid
from agent.sim.nvml.hardware import GpuModel, find_model, hardware_table

KIND = "a node spec"
MAX_GPUS = 64  # per node, as count: a real node has at most 16
_COMPUTE_MODES = {"DEFAULT": 0, "PROHIBITED": 2, "EXCLUSIVE_PROCESS": 3}
_CI_PREFIX = re.compile(r"^(?:(?P<c>\d+)c\.)?(?P<gi>\d+g\..+)$")


class SimSpecError(ValueError):
    """The node spec is not valid; the message names the field and the fix."""


class MigSpec(Struct, frozen=True):
    instances: tuple[str, ...] = ()


class GpuGroupSpec(Struct, frozen=True):
    model: str
    count: int = 1
    mig: MigSpec | None = None
    mig_pending: Literal["enabled", "disabled"] | None = None
    mig_needs_reset: bool = False
    compute_mode: Literal["DEFAULT", "PROHIBITED", "EXCLUSIVE_PROCESS"] = "DEFAULT"


class NodeSpec(Struct, frozen=True):
    name: str = "sim-node"
    driver_version: str = "580.95.05"
    cuda_driver_version: int = 13000
    nvlink: Literal["none", "nvswitch"] | tuple[tuple[int, ...], ...] = "none"
    numa_nodes: int = 1
    gpus: tuple[GpuGroupSpec, ...] = field(default=())


def preset_names() -> list[str]:
    folder = resources.files("agent.sim").joinpath("presets")
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


def load_node_spec(reference: str) -> NodeSpec:
    """A node spec from a YAML file path or a preset name, read within the limits of agent.config.yaml_limits."""
    path = Path(reference)
    try:
        if path.is_file() or (path.exists() and reference not in preset_names()):
            origin = str(path)
            data = load_yaml(read_bounded(path, origin), origin, kind=KIND)
        elif reference in preset_names():
            origin = f"preset {reference}"
            text = resources.files("agent.sim").joinpath("presets", f"{reference}.yaml").read_text(encoding="utf-8")
            data = load_yaml(text, origin, kind=KIND)
        else:
            raise SimSpecError(
                f"node spec {reference!r} is neither a file nor a preset; presets: {', '.join(preset_names())}"
            )
    except ConfigError as error:
        raise SimSpecError(str(error)) from None
    except OSError as error:  # path.is_file() on a path the caller may not search
        raise SimSpecError(f"{reference}: cannot read: {error.strerror or error}; check the path") from None
    if data is None or (isinstance(data, dict) and "gpus" not in data):
        # an empty file (or one without gpus) would be a node with no GPUs, whose every preview says "nothing"
        # without saying why; a node without GPUs is written as such: gpus: []
        what = "is empty" if data is None else "has no gpus"
        raise SimSpecError(
            f"{origin} {what}: a node spec lists its GPUs, e.g. gpus: [{{model: A100-SXM4-80GB, count: 2}}] "
            "(docs/simulated-node.md; gpus: [] for a node without GPUs)"
        )
    return parse_node_spec(data, origin)


def parse_node_spec(data: object, origin: str = "node spec") -> NodeSpec:
    """A node spec from parsed YAML. Unknown fields, wrong types and values out of range are refused, every
    problem named by its path (``gpus[0].count``) in one error."""
    reader = _Reader()
    spec = reader.node(data)
    if reader.problems or spec is None:
        raise SimSpecError(f"{origin}: {'; '.join(reader.problems) or '(top level): expected a mapping'}")
    return spec


class _Reader:
    """Reads the YAML shapes of the spec strictly, collecting every problem instead of stopping at the first
    (a node spec is written by hand; one error listing all the fixes saves round trips)."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def node(self, data: object) -> NodeSpec | None:
        fields = self._mapping(data, "(top level)", _NODE_FIELDS)
        if fields is None:
            return None
        groups = tuple(self._groups(fields.get("gpus", []), "gpus"))
        total = sum(group.count for group in groups)
        if total > MAX_GPUS:
            self.problems.append(
                f"gpus: {total} GPUs in all; a simulated node has at most {MAX_GPUS}: lower the counts"
            )
        return NodeSpec(
            name=self._string(fields.get("name", "sim-node"), "name", max_length=63),
            driver_version=self._string(fields.get("driver_version", "580.95.05"), "driver_version"),
            cuda_driver_version=self._integer(fields.get("cuda_driver_version", 13000), "cuda_driver_version"),
            nvlink=self._nvlink(fields.get("nvlink", "none")),
            numa_nodes=self._integer(fields.get("numa_nodes", 1), "numa_nodes", low=1, high=8),
            gpus=groups,
        )

    def _groups(self, data: object, where: str) -> list[GpuGroupSpec]:
        if not isinstance(data, list):
            self.problems.append(f"{where}: expected a list of GPU groups")
            return []
        groups = []
        for number, entry in enumerate(data):
            group = self._group(entry, f"{where}[{number}]")
            if group is not None:
                groups.append(group)
        return groups

    def _group(self, data: object, where: str) -> GpuGroupSpec | None:
        fields = self._mapping(data, where, _GROUP_FIELDS)
        if fields is None:
            return None
        if "model" not in fields:
            self.problems.append(f"{where}.model: missing; name a GPU model ({', '.join(sorted(hardware_table()))})")
            return None
        model = find_model(self._string(fields["model"], f"{where}.model"))
        if model is None:
            known = ", ".join(sorted(hardware_table()))
            self.problems.append(f"{where}.model: unknown GPU model {fields['model']!r}; known models: {known}")
            return None
        mig = None
        if fields.get("mig") is not None:
            mig_fields = self._mapping(fields["mig"], f"{where}.mig", _MIG_FIELDS) or {}
            instances = mig_fields.get("instances", [])
            if not isinstance(instances, list) or not all(isinstance(i, str) for i in instances):
                self.problems.append(f"{where}.mig.instances: expected a list of profile names such as 1g.10gb")
                instances = []
            mig = MigSpec(tuple(instances))
        return GpuGroupSpec(
            model=model.key,
            count=self._integer(fields.get("count", 1), f"{where}.count", low=1, high=MAX_GPUS),
            mig=mig,
            mig_pending=self._choice(fields.get("mig_pending"), f"{where}.mig_pending", ("enabled", "disabled", None)),
            mig_needs_reset=self._boolean(fields.get("mig_needs_reset", False), f"{where}.mig_needs_reset"),
            compute_mode=self._choice(
                fields.get("compute_mode", "DEFAULT"), f"{where}.compute_mode", tuple(_COMPUTE_MODES)
            ),
        )

    def _nvlink(self, value: object) -> Literal["none", "nvswitch"] | tuple[tuple[int, ...], ...]:
        if value in ("none", "nvswitch"):
            return value  # type: ignore[return-value]
        if isinstance(value, list) and all(
            isinstance(group, list) and all(_is_integer(i) for i in group) for group in value
        ):
            return tuple(tuple(group) for group in value)
        self.problems.append("nvlink: expected none, nvswitch or a list of linked GPU index groups such as [[0, 1]]")
        return "none"

    def _mapping(self, data: object, where: str, allowed: frozenset[str]) -> dict[str, object] | None:
        if not isinstance(data, dict):
            self.problems.append(f"{where}: expected a mapping, got {type(data).__name__}")
            return None
        unknown = sorted(str(key) for key in data if key not in allowed)
        for key in unknown:
            self.problems.append(f"{_join(where, key)}: unknown field; known: {', '.join(sorted(allowed))}")
        return {key: value for key, value in data.items() if key in allowed}

    def _string(self, value: object, where: str, max_length: int = 253) -> str:
        if not isinstance(value, str) or not 1 <= len(value) <= max_length:
            self.problems.append(f"{where}: expected a string of 1 to {max_length} characters")
            return ""
        return value

    def _integer(self, value: object, where: str, low: int | None = None, high: int | None = None) -> int:
        if not _is_integer(value):
            self.problems.append(f"{where}: expected a whole number, got {value!r}")
            return low or 0
        number = int(value)  # type: ignore[call-overload]
        if (low is not None and number < low) or (high is not None and number > high):
            self.problems.append(f"{where}: {number} is out of range {low}..{high}")
            return low or 0
        return number

    def _boolean(self, value: object, where: str) -> bool:
        if not isinstance(value, bool):
            self.problems.append(f"{where}: expected true or false, got {value!r}")
            return False
        return value

    def _choice(self, value: object, where: str, choices: tuple[object, ...]) -> Any:
        if value not in choices:
            self.problems.append(f"{where}: {value!r} is not one of {', '.join(str(c) for c in choices if c)}")
            return choices[0]
        return value


_NODE_FIELDS = frozenset({"name", "driver_version", "cuda_driver_version", "nvlink", "numa_nodes", "gpus"})
_GROUP_FIELDS = frozenset({"model", "count", "mig", "mig_pending", "mig_needs_reset", "compute_mode"})
_MIG_FIELDS = frozenset({"instances"})


def _is_integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _join(where: str, key: object) -> str:
    return str(key) if where == "(top level)" else f"{where}.{key}"


def build_driver(spec: NodeSpec) -> SimDriver:
    """A simulated driver with the spec's GPUs, MIG layouts created in order as the driver would.

    Errors name the field as ``gpus[<group>].mig.instances[<n>]``.
    """
    gpus: list[SimGpu] = []
    total = sum(group.count for group in spec.gpus)
    for group in spec.gpus:
        model = hardware_table()[group.model]
        for _ in range(group.count):
            gpus.append(_make_gpu(spec, group, model, len(gpus), total))
    _connect_nvlink(spec, gpus)
    driver = SimDriver(gpus, driver_version=spec.driver_version, cuda_driver_version=spec.cuda_driver_version)
    group_of_gpu = [(g, group) for g, group in enumerate(spec.gpus) for _ in range(group.count)]
    for gpu, (group_number, group) in zip(gpus, group_of_gpu, strict=True):
        if group.mig is not None:
            _create_layout(driver, gpu, group.mig.instances, f"gpus[{group_number}].mig.instances")
        if group.mig_pending is not None:
            gpu.mig_pending = group.mig_pending == "enabled"
    return driver


def _make_gpu(spec: NodeSpec, group: GpuGroupSpec, model: GpuModel, index: int, total: int) -> SimGpu:
    if group.mig is not None and not model.mig_capable:
        raise SimSpecError(f"gpus: {model.key} is not MIG capable; remove its mig section")
    if group.mig_pending is not None and not model.mig_capable:
        raise SimSpecError(f"gpus: {model.key} is not MIG capable; remove mig_pending")
    mig = group.mig is not None
    domain, bus = divmod(index, 8)
    return SimGpu(
        index=index,
        model=model,
        uuid=gpu_uuid(spec.name, index),
        pci_bus_id=f"{domain:08X}:{0x18 + 0x20 * bus:02X}:00.0",
        minor_number=index,
        numa_node=index * spec.numa_nodes // max(total, 1),
        pcie_switch=index // 2,
        serial=f"{1650000000000 + index}",
        mig_current=mig,
        mig_pending=mig,
        mig_needs_reset=group.mig_needs_reset,
        compute_mode=_COMPUTE_MODES[group.compute_mode],
    )


def _connect_nvlink(spec: NodeSpec, gpus: list[SimGpu]) -> None:
    linked = [g for g in gpus if g.model.nvlink_links > 0]
    if spec.nvlink == "nvswitch":
        for gpu in linked:
            gpu.nvswitch = True
            gpu.nvlink_peers = frozenset(other.index for other in linked if other is not gpu)
    elif isinstance(spec.nvlink, tuple):
        for number, group in enumerate(spec.nvlink):
            for index in group:
                if not 0 <= index < len(gpus) or gpus[index].model.nvlink_links == 0:
                    raise SimSpecError(f"nvlink[{number}]: GPU {index} does not exist or has no NVLink")
                peers = gpus[index].nvlink_peers | {i for i in group if i != index}
                gpus[index].nvlink_peers = frozenset(peers)


def _create_layout(driver: SimDriver, gpu: SimGpu, instances: tuple[str, ...], where: str) -> None:
    previous: SimGpuInstance | None = None
    for position, entry in enumerate(instances):
        match = _CI_PREFIX.match(entry)
        profile = gpu.model.gi_profile_by_name(match["gi"]) if match else None
        if match is None or profile is None:
            known = ", ".join(p.name for p in gpu.model.gi_profiles)
            raise SimSpecError(f"{where}[{position}]: {entry!r} is not a profile of {gpu.model.key}; known: {known}")
        ci_slices = int(match["c"]) if match["c"] else profile.slice_count
        ci_profile = next((c for c in profile.ci_profiles if c.slice_count == ci_slices), None)
        if ci_profile is None:
            raise SimSpecError(f"{where}[{position}]: {profile.name} has no {ci_slices}-slice compute instance")
        try:
            gi = previous if previous is not None and previous.profile is profile else None
            if gi is None or driver.ci_remaining_capacity(gpu.index, gi, ci_profile.id) == 0:
                gi = driver.create_gpu_instance(gpu.index, profile.id)
            driver.create_compute_instance(gpu.index, gi, ci_profile.id)
        except NvmlFault as fault:
            before = ", ".join(instances[:position]) or "nothing"
            raise SimSpecError(
                f"{where}[{position}]: {entry} does not fit on GPU {gpu.index} ({gpu.model.key}) after {before}: "
                f"NVML_ERROR_{fault.code.name.removeprefix('ERROR_')}"
            ) from fault
        previous = gi
