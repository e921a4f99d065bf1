"""This node's object in the Kubernetes API, as the agent follows it: the config labels, the per-GPU cordon
annotations, and the Events an operator reads with ``kubectl describe node``.

All of it needs a node name and an API to ask; without them (a node outside a cluster, a test) it is off, and the
other config selectors still work. The labels and annotations are read once before anything is advertised, so a
cordoned GPU is never offered, not even for a moment; once the kubelet is served a watch stream, from that read's
resourceVersion, posts each change to the loop. Events go
out from a thread of their own, rate-limited and aggregated: the loop never waits for the API server.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

from agent.config.labels import CONFIG_LABEL, CORDON_ANNOTATIONS, MIG_CONFIG_LABEL
from agent.core.cordon import NO_CORDON, Cordon, parse_cordon
from agent.core.inventory import Inventory

if TYPE_CHECKING:
    from agent.config.node_label import NodeApi
    from agent.status import AgentStatus

log = logging.getLogger(__name__)


class Stoppable(Protocol):
    def stop(self, timeout: float | None = ...) -> None: ...


class Follower(Stoppable, Protocol):
    def start(self) -> None: ...


class Recorder(Stoppable, Protocol):
    def emit(
        self, type_: str, reason: str, action: str, note: str, *, regarding: Mapping[str, str] | None = None
    ) -> None: ...

    def release(self) -> None: ...


class NodeMetadata:
    def __init__(
        self, node_name: str | None, kubeconfig: str | None, *, follow_labels: bool, hold_events_seconds: float = 0.0
    ) -> None:
        """``follow_labels``: the configs come from a directory, so the node's labels pick one (and the MIG layout).
        ``hold_events_seconds``: Events are written once :meth:`release_events` is called (or that long after the
        start): the start's Events (ConfigApplied) then do not compete with the start itself for the CPU."""
        self._node_name = node_name
        self._kubeconfig = kubeconfig
        self._follow_labels = follow_labels
        self.api: NodeApi | None = None  # when there is a node name and an API
        self.config_label: str | None = None  # nvidia.com/device-plugin.config
        self.mig_label: str | None = None  # nvidia.com/mig.config
        self.cordon: Cordon = NO_CORDON
        self._cordon_values: dict[str, str | None] = {}  # cordon annotation key -> value (None: absent)
        self._watcher: Follower | None = None
        self._recorder: Recorder | None = None
        self._hold_events_seconds = hold_events_seconds

    def start(self, post: Callable[[object], None], inventory: Inventory | None) -> None:
        """Read the labels and annotations once, then follow them (changes are posted as events)."""
        if not self._node_name:
            return
        from agent.config.node_label import NodeLabelError, NodeLabelWatcher, load_kube_api, read_node_metadata

        try:
            api = load_kube_api(self._kubeconfig)
        except Exception as error:  # no API is a degraded mode, not a failure: the other selectors still work
            log.warning("cannot reach the Kubernetes API; node labels and GPU cordons are off error=%r", str(error))
            return
        if api is None:
            return
        self.api = api
        self._start_recorder(api)
        try:
            known = read_node_metadata(api, self._node_name)
        except NodeLabelError as error:
            log.warning("cannot read the node's labels; trying again in the background error=%r", str(error))
            known = None
        else:
            log.debug("node read node=%s resource_version=%s", self._node_name, known.resource_version)
            if self._follow_labels:
                self.config_label = known.labels.get(CONFIG_LABEL)
                self.mig_label = known.labels.get(MIG_CONFIG_LABEL)
            self._cordon_values = {key: known.annotations.get(key) for key in CORDON_ANNOTATIONS}
            self.recut_cordon(inventory)
        self._watcher = NodeLabelWatcher(
            api,
            self._node_name,
            [CONFIG_LABEL, MIG_CONFIG_LABEL] if self._follow_labels else [],
            post,
            annotation_keys=CORDON_ANNOTATIONS,
            known=known,  # None (nothing read): the watcher's own GET comes first
        )

    def follow(self) -> None:
        """Follow the labels and annotations from here on: the watch opens. Called once,
        when the start is over (the kubelet is served, or at most ``TELEMETRY_WAIT_SECONDS`` after the start): the
        watch starts from the start's GET, so a change made in between is its first event, and opening it does not
        compete with the first registration. A start whose GET failed gets the node from the watcher's own."""
        if self._watcher is not None:
            self._watcher.start()

    def _start_recorder(self, api: NodeApi) -> None:
        from agent.events import EventRecorder

        assert self._node_name is not None
        try:
            recorder = EventRecorder(api, self._node_name, hold_seconds=self._hold_events_seconds)
            recorder.start()
        except Exception as error:  # Events are a courtesy: without them the log says the same
            log.warning("no Kubernetes Events; the log has what they would say error=%r", str(error))
            return
        self._recorder = recorder

    def release_events(self) -> None:
        """The start is over: its held Events are written."""
        if self._recorder is not None:
            self._recorder.release()

    def on_annotation(self, key: str, value: str | None, inventory: Inventory | None) -> bool:
        """A cordon annotation changed; True when what is cordoned changed (publish again)."""
        self._cordon_values[key] = value
        return self.recut_cordon(inventory)

    def recut_cordon(self, inventory: Inventory | None) -> bool:
        """What the cordon annotations name on ``inventory`` (indices and MIG UUIDs may name other devices after a
        read); True when that changed."""
        cordon = parse_cordon(self._cordon_values, inventory) if inventory else NO_CORDON
        if cordon == self.cordon:
            return False
        for unit in sorted(cordon.units - self.cordon.units):
            log.warning("GPU cordoned unit=%s by=%s; its devices are Unhealthy (reason cordoned) until the entry "
                        "is removed, running pods are untouched", unit, ",".join(cordon.sources[unit]))  # fmt: skip
        for unit in sorted(self.cordon.units - cordon.units):
            log.info("GPU cordon lifted unit=%s", unit)
        for problem in cordon.problems:
            if problem not in self.cordon.problems:
                log.warning("cordon entry ignored problem=%s", problem)
        self.cordon = cordon
        return True

    def announce(self, before: AgentStatus, after: AgentStatus) -> None:
        """Events on the Node for what changed between two statuses that an operator must see."""
        if self._recorder is None or before is after:
            return
        from agent.core.announce import announcements

        for said in announcements(before, after):  # reasons and actions are valid by construction (a test)
            self._recorder.emit(said.type, said.reason, said.action, said.note, regarding=said.regarding)

    def threads(self) -> tuple[Stoppable, ...]:
        """What runs on threads of its own, for the agent to stop."""
        return tuple(t for t in (self._watcher, self._recorder) if t is not None)
