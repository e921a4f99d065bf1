"""Node labels written on the Node itself, for clusters without Node Feature Discovery.

NFD turns the feature file into labels (agent.telemetry.nfd); where NFD is not deployed, the agent can
patch its own Node with the same labels — GFD's ``nvidia.com/gpu.*`` and ``nvidia.com/mig.config.state``,
which NVIDIA's mig-manager users watch. It touches only the labels it set: their keys are kept in the
annotation ``tessera.dev/managed-labels``, so a label that no longer applies is removed and nobody else's
label is ever changed. Needs ``patch`` on ``nodes`` (the ``daemonset/overlays/node-labels`` overlay).

A failure is logged once per streak with the fix and retried after the next collection; labels are never
worth more than the node's GPUs.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

MANAGED_ANNOTATION = "tessera.dev/managed-labels"
_RBAC_RULE = 'apiGroups [""], resources [nodes], verbs [patch] (the node-labels overlay grants it)'
_LABEL_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def label_patch(labels: Mapping[str, str], managed_before: set[str]) -> dict[str, Any]:
    """The merge patch that sets ``labels`` and removes the managed labels no longer among them."""
    wanted = {key: value for key, value in labels.items() if _valid(key, value)}
    removed = {key: None for key in sorted(managed_before - wanted.keys())}
    return {
        "metadata": {
            "labels": {**removed, **wanted},
            "annotations": {MANAGED_ANNOTATION: ",".join(sorted(wanted)) or None},
        }
    }


def _valid(key: str, value: str) -> bool:
    """Kubernetes' rules for label keys and values (63-character names and values, DNS-1123 prefixes)."""
    prefix, _, name = key.rpartition("/")
    return (
        bool(_LABEL_KEY.match(key))
        and len(prefix) <= 253
        and len(name) <= 63
        and len(value) <= 63
        and bool(_LABEL_VALUE.match(value))
    )


class NodeLabelPublisher:
    """Keeps this node's labels equal to the agent's, through the Kubernetes API.

    ``api`` is an :class:`agent.kube_api.CoreApi` (its ``read_node`` and ``patch_node``)."""

    def __init__(self, api: Any, node_name: str) -> None:
        self._api = api
        self._node = node_name
        self._published: dict[str, str] | None = None  # what the Node has, as far as we know
        self._managed: set[str] | None = None  # the keys we set, from the Node's annotation
        self._failing: str | None = None

    def publish(self, labels: Mapping[str, str]) -> bool:
        """Patch the Node when ``labels`` differ from what it has; True when it has them now."""
        if self._published is not None and dict(labels) == self._published:
            return True
        try:
            if self._managed is None:
                self._managed = self._read_managed()
            patch = label_patch(labels, self._managed)
            self._api.patch_node(self._node, patch, _request_timeout=(5.0, 15.0))
        except Exception as error:  # ApiException, urllib3 errors, OSError: the same to the operator
            self._failed(error)
            return False
        self._managed = {key for key, value in patch["metadata"]["labels"].items() if value is not None}
        self._published = dict(labels)
        if self._failing is not None:
            log.info("node labels on the Node again node=%s", self._node)
            self._failing = None
        log.info("node labels patched node=%s labels=%d", self._node, len(self._managed))
        return True

    def _read_managed(self) -> set[str]:
        node = self._api.read_node(self._node, _request_timeout=(5.0, 15.0))
        metadata = node.get("metadata") if isinstance(node, Mapping) else None
        annotations = (metadata.get("annotations") or {}) if isinstance(metadata, Mapping) else {}
        return {key for key in str(annotations.get(MANAGED_ANNOTATION, "")).split(",") if key}

    def _failed(self, error: BaseException) -> None:
        status = getattr(error, "status", None)
        if status in (401, 403):
            said = f"HTTP {status}: the agent may not patch node {self._node}; grant {_RBAC_RULE}"
        else:
            said = (
                f"{type(error).__name__}: {getattr(error, 'reason', None) or error}; retrying after the next collection"
            )
        if said != self._failing:
            log.warning("cannot label the Node node=%s error=%s", self._node, said)
        self._failing = said
        self._managed = None  # read again before the next patch: the Node may have changed meanwhile
