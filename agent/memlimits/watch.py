"""Containers starting and ending, from the kubelet's log links (``/var/log/containers``), through inotify.

Every entry created or removed there is a container that started or went: ``ContainersChanged`` is posted, and
the room looks at the node again. The safety re-check (every ``safety_interval`` seconds) posts it too: it is
also when limits changed behind the agent's back (NVML announces no such change) are found and repaired.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from msgspec import Struct

from agent.fswatch import ENTRY_CHANGES, InotifyWatcher, Watch, plan_for


class ContainersChanged(Struct, frozen=True):
    reason: str  # "start", "containers", "re-check"


class LimitsChanged(Struct, frozen=True):
    """The room's picture changed (a container limited, a fallback): the loop publishes the status again, and the
    Node Events it calls for (a fallback is announced once)."""


class ContainerLogWatcher(InotifyWatcher):
    def __init__(self, container_logs: Path, post: Callable[[object], None], *, safety_interval: float) -> None:
        super().__init__(post, safety_interval=safety_interval, thread_name="memory-limits-watch")
        self._dir = container_logs

    def _plan(self) -> tuple[Watch, ...]:
        return plan_for(self._dir, ENTRY_CHANGES)

    def _initial(self) -> None:
        self._post(ContainersChanged("start"))

    def _on_events(self, events: list[tuple[Watch, int, str]]) -> None:
        self._post(ContainersChanged("containers"))

    def _resync(self) -> None:
        self._post(ContainersChanged("re-check"))
