"""The MIG profile naming rule (as go-nvlib computes it), so names are derived, never looked up.

A profile is named ``[<C>c.]<G>g.<GB>gb[+attr|-attr]``: C compute slices (omitted when C == G), G GPU
instance slices, GB the instance memory rounded the way NVIDIA rounds it, and an attribute taken from the
GPU instance profile *index* (the NVML_GPU_INSTANCE_PROFILE_* constant), e.g. ``+me`` for the REV1 profiles.
"""

from __future__ import annotations

import math

_MIB = 1 << 20
_GIB = 1 << 30

# NVML_GPU_INSTANCE_PROFILE_* index -> name attribute.
_ATTRIBUTE_BY_PROFILE_INDEX: dict[int, str] = {
    7: "+me",  # 1_SLICE_REV1
    8: "+me",  # 2_SLICE_REV1
    10: "+gfx",  # 1_SLICE_GFX
    11: "+gfx",  # 2_SLICE_GFX
    12: "+gfx",  # 4_SLICE_GFX
    13: "-me",  # 1_SLICE_NO_ME
    14: "-me",  # 2_SLICE_NO_ME
    15: "+me.all",  # 1_SLICE_ALL_ME
    16: "+me.all",  # 2_SLICE_ALL_ME
    17: "+gfx",  # 3_SLICE_GFX
}


def mig_memory_gb(memory_mib: int, parent_total_bytes: int) -> int:
    """The ``<GB>`` of a profile name.

    The instance's share of the GPU is rounded up to eighths, scaled by the GPU's size in whole GiB
    (rounded up), and rounded half away from zero. Python's ``round()`` rounds half to even and would
    name H200's 4-slice profiles ``70gb`` instead of ``71gb``.
    """
    if parent_total_bytes <= 0:
        raise ValueError("parent_total_bytes must be positive")
    fraction = math.ceil(memory_mib * _MIB * 8 / parent_total_bytes) / 8
    total_gb = math.ceil(parent_total_bytes / _GIB)
    return math.floor(fraction * total_gb + 0.5)


def mig_profile_name(
    *,
    gi_slices: int,
    ci_slices: int,
    memory_mib: int,
    parent_total_bytes: int,
    gi_profile_index: int,
) -> str:
    """Name a GPU instance (``ci_slices == gi_slices``) or a compute instance inside one."""
    gb = mig_memory_gb(memory_mib, parent_total_bytes)
    base = f"{gi_slices}g.{gb}gb"
    if ci_slices != gi_slices:
        base = f"{ci_slices}c.{base}"
    return base + _ATTRIBUTE_BY_PROFILE_INDEX.get(gi_profile_index, "")


def mig_resource_suffix(profile: str) -> str:
    """The part after ``nvidia.com/mig-`` for a profile: ``+`` becomes ``.`` (NVIDIA's rule)."""
    return profile.replace("+", ".")
