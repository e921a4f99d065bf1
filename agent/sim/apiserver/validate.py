"""Validation of every written object: the real OpenAPI schema of each configured Kubernetes version (through
``kubernetes_validate``, strict: unknown fields are errors), then the semantic rules of ``rules`` for the version the
stand-in reports. Any error is a 422 Invalid naming the field, the version and the problem, and nothing is stored.

``kubernetes_validate`` is a test dependency: it is imported lazily, and when it is missing the stand-in serves
without schema validation and says so once in the log (the semantic rules still apply).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Iterable

from agent.sim.apiserver import rules
from agent.sim.apiserver.errors import FieldError, invalid, invalid_value
from agent.sim.apiserver.kinds import Kind

log = logging.getLogger("agent.sim.apiserver")

DEFAULT_SCHEMA_VERSIONS = ("1.34", "1.37")  # the oldest and newest supported Kubernetes versions

_warned = False
_warn_lock = threading.Lock()


def _load():
    """The ``kubernetes_validate`` module, or None (logged once per process)."""
    global _warned
    try:
        import kubernetes_validate  # a test dependency, imported only when needed
    except ImportError:
        with _warn_lock:
            if not _warned:
                _warned = True
                log.warning(
                    "apiserver stand-in: kubernetes_validate is not installed; objects are stored WITHOUT OpenAPI "
                    "schema validation (pip install 'kubernetes-validate>=1.37,<2' to enable it)"
                )
        return None
    return kubernetes_validate


def parse_version(text: str) -> tuple[int, int]:
    match = re.match(r"v?(\d+)\.(\d+)", text)
    if not match:
        raise ValueError(f"not a Kubernetes version: {text!r}")
    return int(match.group(1)), int(match.group(2))


def _field_path(parts: Iterable[object]) -> str:
    path = ""
    for part in parts:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or "<root>"


class Validator:
    """Schema versions to check against, and the version whose semantic rules apply."""

    def __init__(self, schema_versions: Iterable[str], served_version: str, *, schema: bool = True) -> None:
        self.schema_versions = tuple(schema_versions)
        self.served = parse_version(served_version)
        self._module = _load() if schema else None
        for version in self.schema_versions:
            parse_version(version)
            if self._module is not None:  # fail at start, not at the first write, on a version it lacks
                self._module.validate(
                    {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "probe"}}, version, strict=True
                )

    @property
    def schema_enabled(self) -> bool:
        return self._module is not None

    def schema_errors(self, obj: dict) -> list[FieldError]:
        if self._module is None:
            return []
        errors = []
        for version in self.schema_versions:
            try:
                self._module.validate(obj, version, strict=True)
            except self._module.ValidationError as e:
                errors.append(
                    invalid_value(
                        _field_path(e.absolute_path),
                        "<value omitted>",
                        f"does not match the OpenAPI schema of Kubernetes {version} (strict): {e.message}",
                    )
                )
            except self._module.SchemaNotFoundError as e:
                errors.append(invalid_value("kind", obj.get("kind"), e.message))
        return errors

    def check(self, kind: Kind, obj: dict, old: dict | None = None, subresource: str | None = None) -> None:
        """Raise the 422 ApiError for ``obj``, or return when it may be stored."""
        errors = self.schema_errors(obj)
        if not errors:  # semantic rules assume the shapes the schema guarantees
            errors = rules.check(kind, obj, old, self.served, subresource)
        if errors:
            name = (obj.get("metadata") or {}).get("name") or (obj.get("metadata") or {}).get("generateName") or ""
            raise invalid(kind, str(name), errors)
