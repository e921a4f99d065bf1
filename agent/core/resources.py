"""What the node advertises: resources, their devices, and the plan that holds them."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

GPU_RESOURCE = "nvidia.com/gpu"
RESOURCE_PREFIX = "nvidia.com/"


class MigStrategy(StrEnum):
    """How MIG devices are advertised; the same three strategies NVIDIA's device plugin has."""

    NONE = "none"  # every GPU is one nvidia.com/gpu, MIG devices are ignored
    SINGLE = "single"  # every MIG device is an nvidia.com/gpu; all must be of one profile
    MIXED = "mixed"  # every MIG device is nvidia.com/mig-<profile>


@dataclass(frozen=True, slots=True)
class PlanConfig:
    """The part of the sharing config that planning needs."""

    mig_strategy: MigStrategy = MigStrategy.NONE


@dataclass(frozen=True, slots=True)
class Device:
    """One advertised device: a full GPU or a MIG device, identified by its UUID."""

    id: str
    gpu_uuid: str
    gpu_index: int
    index: str  # NVIDIA's index: "0" for a GPU, "0:3" for a MIG device
    memory_mib: int
    mig_uuid: str | None = None
    mig_profile: str | None = None
    numa_node: int | None = None

    @property
    def physical_id(self) -> str:
        """What the container runtime is given: the MIG UUID for a MIG device, else the GPU UUID."""
        return self.mig_uuid or self.gpu_uuid

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "gpu": self.gpu_uuid,
            "gpu_index": self.gpu_index,
            "index": self.index,
            "mig": self.mig_uuid,
            "profile": self.mig_profile,
            "memory_mib": self.memory_mib,
            "numa_node": self.numa_node,
        }


@dataclass(frozen=True, slots=True)
class Resource:
    name: str
    devices: tuple[Device, ...]

    def to_json(self) -> dict[str, Any]:
        return {"count": len(self.devices), "devices": [d.to_json() for d in self.devices]}


@dataclass(frozen=True, slots=True)
class ResourcePlan:
    """Every resource the node advertises, sorted by name, plus what the user should know."""

    resources: tuple[Resource, ...]
    mig_strategy: MigStrategy
    warnings: tuple[str, ...] = field(default=())

    def resource(self, name: str) -> Resource | None:
        return next((r for r in self.resources if r.name == name), None)

    def to_json(self) -> dict[str, Any]:
        """The stable JSON contract of ``tessera plan --format json``."""
        return {
            "mig_strategy": str(self.mig_strategy),
            "resources": {r.name: r.to_json() for r in self.resources},
            "warnings": list(self.warnings),
        }


class PlanError(ValueError):
    """The config cannot be applied to this node; the message says why and how to fix it."""
