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
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from agent.config.model import ConfigError
from agent.config.yaml_limits import load_yaml, read_bounded
from agent.sim.driver import NvmlFault, SimDriver, SimGpu, SimGpuInstance, gpu_uuid
from agent.sim.hardware import GpuModel, find_model, hardware_table

KIND = "a node spec"
MAX_GPUS = 64  # per node, as count: a real node has at most 16
_COMPUTE_MODES = {"DEFAULT": 0, "PROHIBITED": 2, "EXCLUSIVE_PROCESS": 3}
_CI_PREFIX = re.compile(r"^(?:(?P<c>\d+)c\.)?(?P<gi>\d+g\..+)$")


class SimSpecError(ValueError):
    """The node spec is not valid; the message names the field and the fix."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MigSpec(_Strict):
    instances: list[str] = Field(default_factory=list)


class GpuGroupSpec(_Strict):
    model: str
    count: int = Field(default=1, ge=1, le=64)
    mig: MigSpec | None = None
    mig_pending: Literal["enabled", "disabled"] | None = None
    mig_needs_reset: bool = False
    compute_mode: Literal["DEFAULT", "PROHIBITED", "EXCLUSIVE_PROCESS"] = "DEFAULT"

    @field_validator("model")
    @classmethod
    def _known_model(cls, value: str) -> str:
        model = find_model(value)
        if model is None:
            raise ValueError(f"unknown GPU model {value!r}; known models: {', '.join(sorted(hardware_table()))}")
        return model.key


class NodeSpec(_Strict):
    name: str = Field(default="sim-node", min_length=1, max_length=63)
    driver_version: str = "580.95.05"
    cuda_driver_version: int = 13000
    nvlink: Literal["none", "nvswitch"] | list[list[int]] = "none"
    numa_nodes: int = Field(default=1, ge=1, le=8)
    gpus: list[GpuGroupSpec] = Field(default_factory=list)

    @field_validator("gpus")
    @classmethod
    def _at_most_max_gpus(cls, value: list[GpuGroupSpec]) -> list[GpuGroupSpec]:
        total = sum(group.count for group in value)
        if total > MAX_GPUS:
            raise ValueError(f"{total} GPUs in all; a simulated node has at most {MAX_GPUS}: lower the counts")
        return value


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
    return parse_node_spec({} if data is None else data, origin)


def parse_node_spec(data: object, origin: str = "node spec") -> NodeSpec:
    try:
        return NodeSpec.model_validate(data)
    except ValidationError as error:
        problems = "; ".join(f"{_field_path(e['loc'])}: {e['msg']}" for e in error.errors())
        raise SimSpecError(f"{origin}: {problems}") from error


def _field_path(location: tuple[int | str, ...]) -> str:
    """pydantic's ('gpus', 0, 'model') as gpus[0].model, the form build errors use too."""
    path = ""
    for part in location:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or "(top level)"


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
    elif isinstance(spec.nvlink, list):
        for number, group in enumerate(spec.nvlink):
            for index in group:
                if not 0 <= index < len(gpus) or gpus[index].model.nvlink_links == 0:
                    raise SimSpecError(f"nvlink[{number}]: GPU {index} does not exist or has no NVLink")
                peers = gpus[index].nvlink_peers | {i for i in group if i != index}
                gpus[index].nvlink_peers = frozenset(peers)


def _create_layout(driver: SimDriver, gpu: SimGpu, instances: list[str], where: str) -> None:
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
