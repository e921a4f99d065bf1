"""What each MIG-capable GPU model can be partitioned into: its GPU instance profiles and their placements.

The numbers come from the packaged facts (``agent/data/mig-profiles.json``, read once), the same table the
simulator reads, so the layout manager and the simulated driver cannot disagree about a model. A catalog is
found by the PCI device id NVML reports (``0xDDDDVVVV``), which is also what mig-parted's ``device-filter``
names.

Points the facts leave open, and what is done about them:
- H200's 3g/4g ``memory_size_mib`` is "unverified"; the facts' ``memory_size_mib_estimate`` is used. Only
  ``memory_mib`` depends on it, never a placement or a name (the names are the table's).
- Some compute instance profiles have "unverified" placements. Only the full compute instance (C == G) is
  used here, and only its profile id, which every profile in the table has.

Also here: the profile-string grammar of mig-parted / go-nvlib (``[<C>c.]<G>g.<GB>gb[+attr,...|-attr,...]``).
"""

from __future__ import annotations

import json
import re
from functools import cache
from typing import Any

from msgspec import Struct

from agent.core.inventory import Placement

_MEDIA_EXTENSION_INDICES = (7, 8)  # NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1, _2_SLICE_REV1: the "+me" profiles


class GiProfileInfo(Struct, frozen=True):
    """One GPU instance profile of one GPU model."""

    name: str  # the table's name: "1g.10gb", "1g.10gb+me"
    id: int  # NVML profile ID (what CreateGpuInstance takes)
    index: int  # NVML_GPU_INSTANCE_PROFILE_* index
    slices: int  # compute slices (the G of the name)
    memory_slices: int
    memory_mib: int
    instance_count: int
    placements: tuple[Placement, ...]  # in memory slices
    media_extensions: bool  # +me (REV1 indices 7, 8): one per GPU
    full_ci_profile_id: int  # the compute instance profile spanning the whole GPU instance
    # What NVML's GPU instance profile info says the instance holds. The DRA capacities of a MIG device are read
    # from NVML itself (``Gpu.gi_profiles``, as NVIDIA's driver does); these are the simulator's data and the
    # fallback for an inventory without profile info (dynamic MIG on a GPU whose MIG mode is still off)
    multiprocessors: int = 0
    copy_engines: int = 0
    decoders: int = 0
    encoders: int = 0
    jpeg_engines: int = 0
    ofa_engines: int = 0


class MigCatalog(Struct, frozen=True):
    """The MIG geometry of one GPU model."""

    product: str  # the NVML name, e.g. "NVIDIA A100-SXM4-80GB"
    key: str  # the table key, e.g. "A100-SXM4-80GB"
    pci_device_id: int  # 0xDDDDVVVV
    memory_slices: int
    compute_slices: int
    max_gpu_instances: int
    profiles: tuple[GiProfileInfo, ...]

    def profile(self, name: str) -> GiProfileInfo | None:
        """The profile called ``name`` (attributes in any order: ``1g.10gb+me``), or None."""
        canonical = canonical_profile_name(name) or name
        return next((p for p in self.profiles if p.name == canonical), None)

    def profile_by_id(self, profile_id: int) -> GiProfileInfo | None:
        return next((p for p in self.profiles if p.id == profile_id), None)

    @property
    def profile_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.profiles)


def mig_catalog(pci_device_id: int) -> MigCatalog | None:
    """The catalog of the model with this PCI device id (``0xDDDDVVVV``), or None (unknown or not MIG-capable)."""
    return _catalogs_by_device_id().get(pci_device_id & 0xFFFFFFFF)


def mig_catalogs() -> tuple[MigCatalog, ...]:
    """Every MIG-capable model in the packaged table, in table order."""
    return _load()


@cache
def _catalogs_by_device_id() -> dict[int, MigCatalog]:
    return {c.pci_device_id: c for c in _load()}


@cache
def _load() -> tuple[MigCatalog, ...]:
    from importlib import resources  # ~6 ms: only when a MIG catalog is first needed

    text = resources.files("agent.data").joinpath("mig-profiles.json").read_text(encoding="utf-8")
    facts = json.loads(text)
    return tuple(_catalog(key, raw) for key, raw in facts["gpus"].items() if raw.get("mig_capable", True))


def _catalog(key: str, raw: dict[str, Any]) -> MigCatalog:
    return MigCatalog(
        product=raw["nvml_name"],
        key=key,
        pci_device_id=int(raw["nvml_pci_device_id"], 16),
        memory_slices=raw["memory_slices"],
        compute_slices=raw["compute_slices"],
        max_gpu_instances=raw.get("max_gpu_instances") or raw["compute_slices"],
        profiles=tuple(_profile(p) for p in raw["gpu_instance_profiles"]),
    )


def _profile(raw: dict[str, Any]) -> GiProfileInfo:
    memory = raw["memory_size_mib"]
    if not isinstance(memory, int):  # "unverified" (H200 3g/4g): the facts give an estimate
        memory = raw["memory_size_mib_estimate"]
    full_ci = next(ci for ci in raw["compute_instance_profiles"] if ci["slice_count"] == raw["slice_count"])
    return GiProfileInfo(
        name=raw["name"],
        id=raw["profile_id"],
        index=raw["profile_index"],
        slices=raw["slice_count"],
        memory_slices=raw["memory_slices"],
        memory_mib=memory,
        instance_count=raw["instance_count"],
        placements=tuple(Placement(p["start"], p["size"]) for p in raw["placements"]),
        media_extensions=raw["profile_index"] in _MEDIA_EXTENSION_INDICES,
        full_ci_profile_id=full_ci["ci_profile_id"],
        multiprocessors=raw["multiprocessor_count"],
        copy_engines=raw["copy_engine_count"],
        decoders=raw["decoder_count"],
        encoders=raw["encoder_count"],
        jpeg_engines=raw["jpeg_count"],
        ofa_engines=raw["ofa_count"],
    )


# ----- the profile-string grammar ------------------------------------------------------------------

# go-nvlib: fields "<C>c.<G>g.<GB>gb" or "<G>g.<GB>gb"; then "+a[,b]" or "-a[,b]" (never both). An attribute
# is letters and digits with inner dots (``me.all``), does not start with a digit, and is not repeated.
_PROFILE = re.compile(r"^(?:(?P<c>\d+)c\.)?(?P<g>\d+)g\.(?P<gb>\d+)gb(?:(?P<sign>[+-])(?P<attrs>.*))?$")
_ATTRIBUTE = re.compile(r"^[A-Za-z][A-Za-z0-9]*(?:\.[A-Za-z0-9]+)*$")


class ProfileName(Struct, frozen=True):
    """A parsed profile string."""

    compute_slices: int  # C (== G when the string omits it)
    gpu_slices: int  # G
    memory_gb: int  # GB
    attributes: tuple[str, ...] = ()  # after "+", sorted
    negative_attributes: tuple[str, ...] = ()  # after "-", sorted

    @property
    def is_compute_instance(self) -> bool:
        """A compute instance inside a larger GPU instance (``1c.3g.40gb``)."""
        return self.compute_slices != self.gpu_slices

    def __str__(self) -> str:
        base = f"{self.gpu_slices}g.{self.memory_gb}gb"
        if self.is_compute_instance:
            base = f"{self.compute_slices}c.{base}"
        if self.attributes:
            base += "+" + ",".join(self.attributes)
        if self.negative_attributes:
            base += "-" + ",".join(self.negative_attributes)
        return base


def parse_profile_name(text: str) -> ProfileName:
    """Parse a profile string as mig-parted does; ValueError says what is wrong."""
    if not isinstance(text, str) or not text:
        raise ValueError("a MIG profile is a non-empty string such as '1g.10gb'")
    if "+" in text and "-" in text:
        raise ValueError(f"profile {text!r} has both '+' and '-' attributes")
    match = _PROFILE.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a MIG profile: expected [<C>c.]<G>g.<GB>gb[+attr|-attr], e.g. '1g.10gb'")
    attributes: tuple[str, ...] = ()
    if match["sign"] is not None:
        parts = match["attrs"].split(",")
        bad = [a for a in parts if not _ATTRIBUTE.match(a)]
        if bad:
            raise ValueError(f"profile {text!r} has a malformed attribute {bad[0]!r}")
        if len(set(parts)) != len(parts):
            raise ValueError(f"profile {text!r} repeats an attribute")
        attributes = tuple(sorted(parts))
    g = int(match["g"])
    c = int(match["c"]) if match["c"] is not None else g
    if c <= 0 or g <= 0:
        raise ValueError(f"profile {text!r} has a zero slice count")
    return ProfileName(
        compute_slices=c,
        gpu_slices=g,
        memory_gb=int(match["gb"]),
        attributes=attributes if match["sign"] == "+" else (),
        negative_attributes=attributes if match["sign"] == "-" else (),
    )


def canonical_profile_name(text: str) -> str | None:
    """The profile string in its canonical spelling (sorted attributes, no leading zeros); None if malformed."""
    try:
        return str(parse_profile_name(text))
    except ValueError:
        return None
