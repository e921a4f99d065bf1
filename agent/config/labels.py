"""Node labels and annotations Tessera follows, and the events that say one changed (no Kubernetes client
needed here)."""

from __future__ import annotations

import re

from msgspec import Struct

CONFIG_LABEL = "nvidia.com/device-plugin.config"
MIG_CONFIG_LABEL = "nvidia.com/mig.config"
# Per-GPU cordon (agent.core.cordon): Tessera's own key, and HAMi's, read the same way
CORDON_ANNOTATION = "tessera.dev/gpu-cordon"
HAMI_CORDON_ANNOTATION = "hami.io/device-cordon"
CORDON_ANNOTATIONS = (CORDON_ANNOTATION, HAMI_CORDON_ANNOTATION)

_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


class NodeLabelChanged(Struct, frozen=True):
    key: str
    value: str | None  # None when the label is absent or the node cannot be read


class NodeAnnotationChanged(Struct, frozen=True):
    key: str
    value: str | None  # None when the annotation is absent or the node cannot be read


def validate_node_name(node_name: object) -> str:
    """A node name is a DNS-1123 subdomain of at most 253 characters; anything else never reaches the API."""
    if not isinstance(node_name, str) or not 0 < len(node_name) <= 253 or not _DNS1123_SUBDOMAIN.fullmatch(node_name):
        raise ValueError(
            f"invalid node name {node_name!r}: a node name is a DNS-1123 subdomain (lower-case letters, digits, "
            "'-' and '.', at most 253 characters); set NODE_NAME from the downward API (fieldRef spec.nodeName)"
        )
    return node_name
