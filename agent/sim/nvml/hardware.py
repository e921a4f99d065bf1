"""The simulator's hardware table: GPU models and their MIG profiles, from the facts in ``data/``."""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from typing import Any

import yaml
from msgspec import Struct

try:  # libyaml, in the wheels PyYAML publishes: the table parses in a fraction of the time
    from yaml import CSafeLoader as _SafeLoader
except ImportError:  # pragma: no cover - PyYAML built without libyaml
    from yaml import SafeLoader as _SafeLoader  # type: ignore[assignment]

# NVML_DEVICE_ARCH_* by the first word of the architecture in the table.
_ARCHITECTURE_IDS = {"Volta": 5, "Turing": 6, "Ampere": 7, "Ada": 8, "Hopper": 9, "Blackwell": 10}
# nvmlBrandType_t by the name models.yaml uses (NVML_BRAND_<name>).
_BRAND_IDS = {"QUADRO": 1, "TESLA": 2, "GEFORCE": 5, "NVIDIA_RTX": 13, "NVIDIA": 14}


class CiProfile(Struct, frozen=True):
    index: int  # NVML_COMPUTE_INSTANCE_PROFILE_* constant
    id: int
    slice_count: int
    instance_count: int
    multiprocessor_count: int
    placements: tuple[tuple[int, int], ...]  # (start, size) in compute slices of the GPU instance


class GiProfile(Struct, frozen=True):
    index: int  # NVML_GPU_INSTANCE_PROFILE_* constant
    id: int  # what nvidia-smi shows as ID and what Create/Get calls take
    name: str  # the table's name, e.g. "1g.10gb+me" (the driver's struct says "MIG 1g.10gb+me")
    slice_count: int
    memory_slices: int
    memory_mib: int
    instance_count: int
    multiprocessor_count: int
    copy_engine_count: int
    decoder_count: int
    encoder_count: int
    jpeg_count: int
    ofa_count: int
    p2p_supported: bool
    placements: tuple[tuple[int, int], ...]  # (start, size) in memory slices
    ci_profiles: tuple[CiProfile, ...]

    @property
    def has_media_extensions(self) -> bool:
        """The ``+me`` (REV1) profiles: they take the GPU's one set of media engines."""
        return self.index in (7, 8)

    def full_ci_profile(self) -> CiProfile:
        return next(ci for ci in self.ci_profiles if ci.slice_count == self.slice_count)


class GpuModel(Struct, frozen=True):
    key: str  # the table key used in node specs, e.g. "A100-SXM4-80GB"
    nvml_name: str
    memory_mib: int
    compute_capability: tuple[int, int]
    architecture: str
    architecture_id: int
    pci_device_id: int  # 0xDDDDVVVV
    sm_count: int
    nvlink_links: int
    brand: int = _BRAND_IDS["NVIDIA"]  # what nvmlDeviceGetBrand answers (nvmlBrandType_t)
    # what nvmlDeviceGetAddressingMode answers (NVML_DEVICE_ADDRESSING_MODE_*); None: NOT_SUPPORTED
    addressing_mode: int | None = None
    memory_slices: int = 0
    compute_slices: int = 0
    gi_profiles: tuple[GiProfile, ...] = ()

    @property
    def mig_capable(self) -> bool:
        return bool(self.gi_profiles)

    @property
    def max_gpu_instances(self) -> int:
        return self.compute_slices

    def gi_profile_by_index(self, index: int) -> GiProfile | None:
        return next((p for p in self.gi_profiles if p.index == index), None)

    def gi_profile_by_id(self, profile_id: int) -> GiProfile | None:
        return next((p for p in self.gi_profiles if p.id == profile_id), None)

    def gi_profile_by_name(self, name: str) -> GiProfile | None:
        return next((p for p in self.gi_profiles if p.name == name), None)


def _cc(text: str) -> tuple[int, int]:
    major, minor = text.split(".")
    return int(major), int(minor)


def _architecture_id(architecture: str) -> int:
    return _ARCHITECTURE_IDS.get(architecture.split()[0], 0xFFFFFFFF)


def _brand(raw: dict[str, Any]) -> int:
    name = raw.get("brand", "NVIDIA")
    if name not in _BRAND_IDS:
        raise ValueError(f"models.yaml: unknown brand {name!r}; use one of {', '.join(_BRAND_IDS)}")
    return _BRAND_IDS[name]


_ADDRESSING_MODES = {"NONE": 0, "HMM": 1, "ATS": 2}  # NVML_DEVICE_ADDRESSING_MODE_*


def _addressing_mode(raw: dict[str, Any]) -> int | None:
    name = raw.get("addressing_mode")
    if name is None:
        return None
    if name not in _ADDRESSING_MODES:
        raise ValueError(f"models.yaml: unknown addressing_mode {name!r}; use one of {', '.join(_ADDRESSING_MODES)}")
    return _ADDRESSING_MODES[name]


def _ci_placements(ci: dict[str, Any], gi_slices: int) -> tuple[tuple[int, int], ...]:
    """The table leaves some CI placements unverified; then use aligned starts, as the driver does."""
    if isinstance(ci["placements"], list):
        return tuple((p["start"], p["size"]) for p in ci["placements"])
    size = ci["slice_count"]
    starts = range(0, gi_slices - size + 1, size)
    return tuple((start, size) for start in starts)[: ci["instance_count"]]


def _gi_profile(raw: dict[str, Any]) -> GiProfile:
    memory = raw["memory_size_mib"]
    if not isinstance(memory, int):  # H200's 3g/4g sizes are unverified; the facts give an estimate
        memory = raw["memory_size_mib_estimate"]
    cis = tuple(
        CiProfile(
            index=ci["ci_profile_index"],
            id=ci["ci_profile_id"],
            slice_count=ci["slice_count"],
            instance_count=ci["instance_count"],
            multiprocessor_count=ci["multiprocessor_count"],
            placements=_ci_placements(ci, raw["slice_count"]),
        )
        for ci in raw["compute_instance_profiles"]
    )
    return GiProfile(
        index=raw["profile_index"],
        id=raw["profile_id"],
        name=raw["name"],
        slice_count=raw["slice_count"],
        memory_slices=raw["memory_slices"],
        memory_mib=memory,
        instance_count=raw["instance_count"],
        multiprocessor_count=raw["multiprocessor_count"],
        copy_engine_count=raw["copy_engine_count"],
        decoder_count=raw["decoder_count"],
        encoder_count=raw["encoder_count"],
        jpeg_count=raw["jpeg_count"],
        ofa_count=raw["ofa_count"],
        p2p_supported=bool(raw["is_p2p_supported"]),
        placements=tuple((p["start"], p["size"]) for p in raw["placements"]),
        ci_profiles=cis,
    )


def _read_data(name: str) -> str:
    """The MIG table is the agent's too (agent/data), the rest is the simulator's own (agent/sim/nvml/data)."""
    package = "agent.data" if name == "mig-profiles.json" else "agent.sim.nvml"
    folder = resources.files(package) if package == "agent.data" else resources.files(package).joinpath("data")
    return folder.joinpath(name).read_text(encoding="utf-8")


@cache
def hardware_table() -> dict[str, GpuModel]:
    """Every simulated GPU model by its key."""
    facts = json.loads(_read_data("mig-profiles.json"))
    extra = yaml.load(_read_data("models.yaml"), Loader=_SafeLoader)  # a safe loader, C or Python
    table: dict[str, GpuModel] = {}
    for key, raw in facts["gpus"].items():
        more = extra["mig_models"][key]
        profiles = tuple(_gi_profile(p) for p in raw["gpu_instance_profiles"])
        table[key] = GpuModel(
            key=key,
            nvml_name=raw["nvml_name"],
            memory_mib=raw["memory_total_mib"],
            compute_capability=_cc(raw["cuda_compute_capability"]),
            architecture=raw["architecture"],
            architecture_id=_architecture_id(raw["architecture"]),
            pci_device_id=int(raw["nvml_pci_device_id"], 16),
            sm_count=raw.get("sm_count") or more["sm_count"],
            nvlink_links=more["nvlink_links"],
            brand=_brand(more),
            addressing_mode=_addressing_mode(more),
            memory_slices=raw["memory_slices"],
            compute_slices=raw["compute_slices"],
            gi_profiles=profiles,
        )
    for key, raw in extra["other_models"].items():
        table[key] = GpuModel(
            key=key,
            nvml_name=raw["nvml_name"],
            memory_mib=raw["memory_total_mib"],
            compute_capability=_cc(raw["cuda_compute_capability"]),
            architecture=raw["architecture"],
            architecture_id=_architecture_id(raw["architecture"]),
            pci_device_id=int(raw["nvml_pci_device_id"], 16),
            sm_count=raw["sm_count"],
            nvlink_links=raw["nvlink_links"],
            brand=_brand(raw),
            addressing_mode=_addressing_mode(raw),
        )
    return table


def find_model(name: str) -> GpuModel | None:
    """A model by table key (``A100-SXM4-80GB``) or by the name NVML reports (``NVIDIA A100-SXM4-80GB``)."""
    table = hardware_table()
    if name in table:
        return table[name]
    folded = name.casefold()
    return next(
        (m for m in table.values() if folded in (m.key.casefold(), m.nvml_name.casefold())),
        None,
    )
