"""The one status value the agent publishes: replaced after every change, never mutated.

Everything that reports on a running agent reads this value and nothing else of it — the health endpoints, the
metrics, ``/status`` and ``tessera status``, the Node Events — so they always agree with each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from msgspec import Struct, field

if TYPE_CHECKING:
    from agent.core.health import Fault
    from agent.core.inventory import Inventory
    from agent.core.resources import ResourcePlan
    from agent.core.snapshot import ResourceSnapshot


class AgentStatus(Struct):
    """What the outside world may read (health endpoints, metrics, ``/status``, Events, the demo)."""

    resources: dict[str, ResourceSnapshot] = field(default_factory=dict)
    registered: frozenset[str] = frozenset()
    kubelet_present: bool = False
    config_name: str | None = None
    config_digest: str | None = None
    config_error: str | None = None  # why the newest config was rejected (the last good one is in force)
    mps: dict[str, dict[str, object]] = field(default_factory=dict)  # MPS daemon key -> state, restarts, error
    mig_state: str | None = None  # nvidia.com/mig.config.state: pending, applying, success, failed, reset-required
    mig_error: str | None = None
    inventory: Inventory | None = None
    plan: ResourcePlan | None = None
    config_errors_total: int = 0
    xid_counts: dict[tuple[str, str, str], int] = field(default_factory=dict)  # (gpu, UUID, xid) -> events
    internal_errors: dict[str, int] = field(default_factory=dict)  # where -> unexpected exceptions survived
    waiting_for: dict[str, tuple[str, ...]] = field(default_factory=dict)  # operation -> what it waits for
    stale_gpus: frozenset[str] = frozenset()  # GPUs withdrawn until the inventory is read again
    discovery_error: str | None = None  # why the last inventory read failed (the previous one is in force)
    faults: Mapping[str, Fault] = field(default_factory=dict)  # GPU or MIG UUID -> why it is Unhealthy
    cordoned: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # GPU or MIG UUID -> annotation keys
    cordon_problems: tuple[str, ...] = ()  # cordon entries that name nothing on this node
    dra: Mapping[str, object] | None = None  # the DRA front end: driver, GPUs served, waiting, leaving, error
    # the memory-limits room's picture: per container and GPU, its request and limit and what enforces them
    # (``agent.memlimits.manager.HeldLimit``); empty without the room or without sized replicas in use
    memory_limits: tuple[HeldLimitView, ...] = ()


class HeldLimitView(Protocol):
    """One container's memory limits on one GPU, as the status shows them."""

    @property
    def gpu_uuid(self) -> str: ...
    @property
    def enforcement(self) -> str: ...
    @property
    def reason(self) -> str: ...

    def to_json(self) -> dict[str, object]: ...


class StatusSource(Protocol):
    """What readers of a running agent get: the published status and whether its loop still turns."""

    status: AgentStatus
    heartbeat: float  # the reconcile loop's last turn (monotonic clock)

    def responsive(self, timeout: float = 2.0) -> bool: ...
