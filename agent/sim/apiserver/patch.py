"""PATCH bodies: JSON merge patch (RFC 7386), JSON patch (RFC 6902) and strategic merge patch.

The Kubernetes Python client sends a dict body as ``application/strategic-merge-patch+json`` (a list as JSON patch).
Strategic merge is done as a merge patch except for the lists these kinds merge by key: ``metadata.ownerReferences``
(by uid), ``metadata.finalizers`` (as a set), ``status.reservedFor`` (by uid) and a Node's ``status.conditions``
(by type); ``$patch: delete`` removes a keyed item, ``$patch: replace`` replaces the object, and the
``$setElementOrder``/``$retainKeys`` directives are ignored. Every other list in ResourceSlice, ResourceClaim and
DeviceClass is atomic, which merge-patch semantics already give.
"""

from __future__ import annotations

import copy

from agent.sim.apiserver.errors import ApiError

MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"
APPLY = "application/apply-patch+yaml"
PATCH_TYPES = (JSON_PATCH, MERGE, STRATEGIC)

_KEYED_LISTS = {
    ("metadata", "ownerReferences"): "uid",
    ("status", "reservedFor"): "uid",
    ("status", "conditions"): "type",
}
_SET_LISTS = {("metadata", "finalizers")}


def merge_patch(target: object, patch: object) -> object:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def strategic_merge_patch(target: object, patch: object, path: tuple[str, ...] = ()) -> object:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            continue
        here = (*path, key)
        if value is None:
            result.pop(key, None)
        elif here in _KEYED_LISTS and isinstance(value, list):
            result[key] = _merge_keyed(result.get(key) or [], value, _KEYED_LISTS[here])
        elif here in _SET_LISTS and isinstance(value, list):
            result[key] = list(dict.fromkeys([*(result.get(key) or []), *value]))
        else:
            result[key] = strategic_merge_patch(result.get(key), value, here)
    return result


def _merge_keyed(current: list, patch: list, key: str) -> list:
    merged = [copy.deepcopy(item) for item in current]
    for item in patch:
        if not isinstance(item, dict):
            continue
        index = next(
            (i for i, old in enumerate(merged) if isinstance(old, dict) and old.get(key) == item.get(key)), None
        )
        if item.get("$patch") == "delete":
            if index is not None:
                merged.pop(index)
        elif index is None:
            merged.append({k: v for k, v in item.items() if not k.startswith("$")})
        else:
            merged[index] = strategic_merge_patch(merged[index], item)
    return merged


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise ApiError(422, f"invalid JSON pointer {path!r}", "Invalid")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _walk(doc: object, parts: list[str]) -> object:
    for part in parts:
        if isinstance(doc, dict) and part in doc:
            doc = doc[part]
        elif isinstance(doc, list) and part.isdigit() and int(part) < len(doc):
            doc = doc[int(part)]
        else:
            raise ApiError(422, f"jsonpatch: path does not exist: /{'/'.join(parts)}", "Invalid")
    return doc


def json_patch(target: object, operations: object) -> object:
    if not isinstance(operations, list):
        raise ApiError(400, "a JSON patch must be a list of operations", "BadRequest")
    doc = copy.deepcopy(target)
    for op in operations:
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise ApiError(400, f"invalid JSON patch operation {op!r}", "BadRequest")
        parts = _pointer(op["path"])
        kind = op["op"]
        if kind == "test":
            if _walk(doc, parts) != op.get("value"):
                raise ApiError(422, f"testing value {op['path']} failed", "Invalid")
            continue
        if kind in ("move", "copy"):
            value = copy.deepcopy(_walk(doc, _pointer(op.get("from", ""))))
            if kind == "move":
                doc = _remove(doc, _pointer(op["from"]))
            doc = _add(doc, parts, value)
        elif kind == "add":
            doc = _add(doc, parts, copy.deepcopy(op.get("value")))
        elif kind == "remove":
            doc = _remove(doc, parts)
        elif kind == "replace":
            _walk(doc, parts)
            doc = _add(_remove(doc, parts), parts, copy.deepcopy(op.get("value")))
        else:
            raise ApiError(400, f"unknown JSON patch operation {kind!r}", "BadRequest")
    return doc


def _add(doc: object, parts: list[str], value: object) -> object:
    if not parts:
        return value
    parent = _walk(doc, parts[:-1])
    last = parts[-1]
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list) and (last == "-" or (last.isdigit() and int(last) <= len(parent))):
        parent.insert(len(parent) if last == "-" else int(last), value)
    else:
        raise ApiError(422, f"jsonpatch add operation does not apply: /{'/'.join(parts)}", "Invalid")
    return doc


def _remove(doc: object, parts: list[str]) -> object:
    _walk(doc, parts)
    if not parts:
        return None
    parent = _walk(doc, parts[:-1])
    if isinstance(parent, dict):
        del parent[parts[-1]]
    else:
        assert isinstance(parent, list)
        del parent[int(parts[-1])]
    return doc


def apply(content_type: str, target: dict, patch: object) -> object:
    if content_type == MERGE:
        return merge_patch(target, patch)
    if content_type == STRATEGIC:
        return strategic_merge_patch(target, patch)
    return json_patch(target, patch)
