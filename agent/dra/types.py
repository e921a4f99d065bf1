"""What the reconcile loop and the DRA shell hand each other: settings and events, nothing that imports more.

Kept apart so that an agent without DRA loads none of the DRA front end (the loop imports only these).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from msgspec import Struct, field

from agent.gpu.driver_root import DriverRoot


class DraSettings(Struct, frozen=True):
    driver: str
    node_name: str
    registry_dir: Path  # the kubelet's plugin watcher directory
    plugins_dir: Path  # the kubelet's plugins directory: <plugins>/<driver>/ holds the DRA socket and checkpoint
    cdi_root: Path
    pod_uid: str | None = None  # with it, socket names allow a rolling update of the DaemonSet
    cdi_kind: str = "nvidia.com/gpu"  # with node_wide_cdi: the node-wide CDI spec's kind (nvidia-ctk cdi generate)
    node_wide_cdi: bool = False  # claims' IDs also name the node-wide spec's entries (--node-wide-cdi)
    driver_root: DriverRoot = field(default_factory=DriverRoot)  # the driver's files: claims' self-contained specs
    sys_root: Path = Path("/sys")  # where the GPUs' PCIe roots are read (resource.kubernetes.io/pcieRoot)
    nvidia_smi: str = "nvidia-smi"  # sets a time-slicing claim's GPU time-slice
    mps_root: str = "/run/nvidia/mps"  # the MPS root on the host (mpsRoot): MPS claims' pipes and shared memory
    latency: Any = None  # an agent.telemetry.latency.OperationLatency the service records Prepare/Unprepare into
    memory_limits: bool = True  # sized GPUs' CDI entries get NVIDIA_GPU_MEMORY_* and the hook (--memory-limits)


class DraRegistration(Struct, frozen=True):
    """The kubelet's verdict on the driver's registration."""

    registered: bool
    error: str


class DraHandoverChecked(Struct, frozen=True):
    """What still uses each GPU on its way to DRA, by GPU UUID (nothing: it may move)."""

    results: tuple[tuple[str, tuple[str, ...]], ...]


class DraClaimsChanged(Struct, frozen=True):
    """A Prepare or Unprepare call ended: the prepared claims (what the status shows) may be different."""


class SlicesPublished(Struct, frozen=True):
    """The API server holds exactly what was asked for (``generation`` of the pool)."""

    generation: int
    slices: int


class SlicesFailed(Struct, frozen=True):
    """Posted once per outage: the API server refused or did not answer; the publisher keeps trying."""

    error: str


class DraUnclaimedSwept(Struct, frozen=True):
    """GPU instances on dynamic-MIG GPUs that no claim made: how many were destroyed, and why the others were not."""

    destroyed: int
    waiting: tuple[str, ...]  # "<instance>: <who holds it>", one a line
