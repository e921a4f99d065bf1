"""From a parsed config and the explicit flags to what the core needs: a ``PlanConfig`` and allocation options.

Precedence is NVIDIA's: an explicit flag (or its environment twin), then the config file, then the default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import msgspec

from agent.config.model import ConfigModel, ReplicatedResources, quantity_mib
from agent.core.allocation import DEFAULT_CDI_KIND, DeviceListStrategy
from agent.core.resources import (
    AllocationPolicy,
    DeviceSelector,
    MigStrategy,
    MpsLimits,
    NamingRule,
    PlanConfig,
    ReplicaMemory,
    ReplicaRule,
    Sharing,
    SharingConfig,
)
from agent.core.snapshot import AllocationOptions
from agent.core.xid_effect import XidEffect

DEFAULT_MPS_ROOT = "/run/nvidia/mps"


class FlagOverrides(msgspec.Struct, frozen=True):
    """Values given explicitly on the command line or in the environment; None means 'not given'."""

    mig_strategy: str | None = None
    device_list_strategy: tuple[str, ...] | None = None
    allocation_policy: str | None = None
    cdi_kind: str | None = None
    mps_root: str | None = None


@dataclass(frozen=True, slots=True)
class Effective:
    plan: PlanConfig
    allocation: AllocationOptions
    # the config's ``health.xids``, ranges expanded: for ``HealthPolicy.with_config_overrides`` (a flag wins)
    health_overrides: Mapping[int, XidEffect] = field(default_factory=lambda: MappingProxyType({}), hash=False)


def effective(model: ConfigModel, overrides: FlagOverrides) -> Effective:
    flags = model.flags
    plugin = flags.plugin
    mig = overrides.mig_strategy or flags.mig_strategy or "none"
    strategies = overrides.device_list_strategy or (plugin.device_list_strategy if plugin else None) or ("envvar",)
    policy = (
        overrides.allocation_policy or (plugin.shared_devices_allocation_policy if plugin else None) or "distributed"
    )
    naming = model.resources
    return Effective(
        plan=PlanConfig(
            mig_strategy=MigStrategy(mig),
            gpu_names=tuple(NamingRule(r.pattern, r.name) for r in naming.gpus) if naming else (),
            mig_names=tuple(NamingRule(r.pattern, r.name) for r in naming.mig) if naming else (),
            sharing=_sharing(model),
        ),
        allocation=AllocationOptions(
            strategies=tuple(DeviceListStrategy(s) for s in strategies),
            cdi_kind=overrides.cdi_kind or DEFAULT_CDI_KIND,
            policy=AllocationPolicy(policy),
            mps_root=overrides.mps_root or flags.mps_root or DEFAULT_MPS_ROOT,
        ),
        health_overrides=MappingProxyType(model.health.overrides() if model.health else {}),
    )


def _sharing(model: ConfigModel) -> SharingConfig | None:
    replicated = model.replicated
    if replicated is None:
        return None
    key, group = replicated
    mps = key == "mps"
    return SharingConfig(
        strategy=Sharing.MPS if mps else Sharing.TIME_SLICING,
        rules=_rules(key, group),
        fail_requests_greater_than_one=(
            group.fail_requests_greater_than_one if group.fail_requests_greater_than_one is not None else mps
        ),
    )


def _rules(key: str, group: ReplicatedResources) -> tuple[ReplicaRule, ...]:
    rules = []
    for position, entry in enumerate(group.resources):
        target = entry.rename or (f"{entry.name}.shared" if group.rename_by_default else entry.name)
        if entry.devices == "all":
            selector = DeviceSelector()
        elif isinstance(entry.devices, int):
            selector = DeviceSelector(count=entry.devices)
        else:
            selector = DeviceSelector(refs=tuple(str(d) for d in entry.devices))
        mps = None
        if key == "mps":
            mps = MpsLimits(
                active_thread_percentage=entry.active_thread_percentage or max(1, 100 // entry.replicas),
                memory_limit_mib=quantity_mib(entry.memory_limit) if entry.memory_limit else None,
                oversubscribe=bool(entry.oversubscribe),
            )
        memory = None
        if key != "mps" and entry.memory_limit:
            size = quantity_mib(entry.memory_limit)
            memory = ReplicaMemory(size, quantity_mib(entry.memory_burst_limit) if entry.memory_burst_limit else size)
        rules.append(
            ReplicaRule(
                name=entry.name,
                replicas=entry.replicas,
                target=target,
                devices=selector,
                where=f"sharing.{key}.resources[{position}]",
                mps=mps,
                memory=memory,
            )
        )
    return tuple(rules)
