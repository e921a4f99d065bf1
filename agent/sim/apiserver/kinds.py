"""The object kinds the stand-in serves, with the REST facts the handlers and the store need about each.

Field selectors: every kind takes ``metadata.name`` (and ``metadata.namespace`` when namespaced); ResourceSlice adds
``spec.nodeName`` and ``spec.driver`` (``ResourceSliceSelectorNodeName``/``...Driver``, dra.md B1), Node adds
``spec.unschedulable``. Any other field label is a 400, as on the real server.
"""

from __future__ import annotations

from msgspec import Struct

RESOURCE_GROUP = "resource.k8s.io"


class Kind(Struct, frozen=True):
    kind: str  # "ResourceSlice"
    plural: str  # "resourceslices"
    group: str  # "" for the core group
    version: str
    namespaced: bool
    status: bool  # has a status subresource (the main resource then ignores status)
    has_spec: bool  # generation is bumped on spec changes
    fields: tuple[str, ...] = ()  # selectable field labels beyond metadata.name / metadata.namespace
    returns_deleted: bool = True  # DELETE answers the deleted object (``ReturnDeletedObject``), else a Status

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def list_kind(self) -> str:
        return self.kind + "List"

    @property
    def qualified_resource(self) -> str:
        """``resourceslices.resource.k8s.io``: how NotFound / Conflict messages name the resource."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def qualified_kind(self) -> str:
        """``ResourceSlice.resource.k8s.io``: how Invalid messages name the kind."""
        return f"{self.kind}.{self.group}" if self.group else self.kind

    def field_labels(self) -> tuple[str, ...]:
        base = ("metadata.name", "metadata.namespace") if self.namespaced else ("metadata.name",)
        return base + self.fields

    def path(self, namespace: str | None = None, name: str | None = None) -> str:
        prefix = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespaced and namespace:
            prefix += f"/namespaces/{namespace}"
        prefix += f"/{self.plural}"
        return f"{prefix}/{name}" if name else prefix


RESOURCE_SLICE = Kind(
    "ResourceSlice", "resourceslices", RESOURCE_GROUP, "v1", False, False, True, ("spec.nodeName", "spec.driver")
)
RESOURCE_CLAIM = Kind("ResourceClaim", "resourceclaims", RESOURCE_GROUP, "v1", True, True, True)
DEVICE_CLASS = Kind("DeviceClass", "deviceclasses", RESOURCE_GROUP, "v1", False, False, True)
NODE = Kind("Node", "nodes", "", "v1", False, True, True, ("spec.unschedulable",), returns_deleted=False)

KINDS: tuple[Kind, ...] = (RESOURCE_SLICE, RESOURCE_CLAIM, DEVICE_CLASS, NODE)


def lookup(name: str | Kind) -> Kind:
    """A kind by its Kind name, plural or lower-case name (``"ResourceSlice"``, ``"resourceslices"``)."""
    if isinstance(name, Kind):
        return name
    wanted = name.lower()
    for kind in KINDS:
        if wanted in (kind.kind.lower(), kind.plural):
            return kind
    raise KeyError(f"the API server stand-in serves no kind {name!r}; it serves {[k.kind for k in KINDS]}")


def by_path(group: str, version: str, plural: str) -> Kind | None:
    for kind in KINDS:
        if (kind.group, kind.version, kind.plural) == (group, version, plural):
            return kind
    return None


def field_value(kind: Kind, obj: dict, label: str) -> str:
    """The value of a selectable field as the server's field set renders it (absent = empty string)."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    if label == "metadata.name":
        return str(meta.get("name") or "")
    if label == "metadata.namespace":
        return str(meta.get("namespace") or "")
    if kind is RESOURCE_SLICE and label == "spec.nodeName":
        return str(spec.get("nodeName") or "")
    if kind is RESOURCE_SLICE and label == "spec.driver":
        return str(spec.get("driver") or "")
    if kind is NODE and label == "spec.unschedulable":
        return "true" if spec.get("unschedulable") else "false"
    raise KeyError(label)
