"""A small kustomize, enough to render ``daemonset/`` without kubectl, and strict about everything else.

It follows a ``kustomization.yaml`` as kustomize does for the features the manifests use:
``resources`` (files and directories, recursively), ``configMapGenerator`` (``files`` as ``key=path`` or
``path``, ``literals``, ``behavior: create|merge|replace``; ``generatorOptions.disableNameSuffixHash``
must be true), ``patches`` (strategic merge, from ``path`` or inline ``patch``, optional ``target``),
``namespace`` and ``images``. Any other key is an error, so a kustomization that uses something this
renderer does not do fails loudly instead of rendering something kustomize would not.

Like kustomize's default load restrictor (``LoadRestrictionsRootOnly``), every *file* a kustomization
reads (a resource file, a generator's file, a patch) must resolve, symlinks included, inside the
kustomization's directory; a resource *directory* (another kustomization) may be anywhere.

Strategic merge follows Kubernetes' patch strategies for the lists the manifests patch: containers,
initContainers, env, volumes and imagePullSecrets merge by ``name``, volumeMounts by
``mountPath``; other lists are replaced; ``null`` deletes a key; ``$patch: delete`` removes a list item.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
KNOWN_KEYS = {
    "apiVersion",
    "kind",
    "resources",
    "configMapGenerator",
    "generatorOptions",
    "patches",
    "namespace",
    "images",
}
CLUSTER_SCOPED = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "RuntimeClass",
    "PriorityClass",
    "CustomResourceDefinition",
    "StorageClass",
    "PersistentVolume",
    "Node",
}
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "imagePullSecrets": "name",
    "volumeMounts": "mountPath",
}

Obj = dict[str, Any]


class KustomizeError(ValueError):
    pass


def build(directory: Path) -> list[Obj]:
    """The objects ``kustomize build directory`` would print (same content; order of first appearance)."""
    root = directory.resolve()
    kustomization = _load_kustomization(root)
    unknown = set(kustomization) - KNOWN_KEYS
    if unknown:
        raise KustomizeError(f"{root}: this renderer does not support {sorted(unknown)}")
    if kustomization.get("kind", "Kustomization") != "Kustomization":
        raise KustomizeError(f"{root}: kind {kustomization['kind']!r} is not supported")

    objects: list[Obj] = []
    for entry in kustomization.get("resources", []):
        target = root / entry
        if target.is_dir():
            objects.extend(build(target))
        else:
            objects.extend(_documents(_restricted(root, entry)))

    options = kustomization.get("generatorOptions", {})
    for generator in kustomization.get("configMapGenerator", []):
        _generate_config_map(root, generator, options, kustomization.get("namespace"), objects)

    for patch in kustomization.get("patches", []):
        _apply_patch(root, patch, objects)

    namespace = kustomization.get("namespace")
    if namespace:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj.setdefault("metadata", {})["namespace"] = namespace

    for image in kustomization.get("images", []):
        _set_image(image, objects)

    _check_unique(root, objects)
    return objects


def _load_kustomization(root: Path) -> Obj:
    for name in KUSTOMIZATION_FILES:
        path = root / name
        if path.is_file():
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
            if not isinstance(data, dict):
                raise KustomizeError(f"{path}: not a mapping")
            return data
    raise KustomizeError(f"{root}: no kustomization file")


def _restricted(root: Path, relative: str) -> Path:
    """kustomize's LoadRestrictionsRootOnly: the file, symlinks resolved, must be inside ``root``."""
    path = (root / relative).resolve()
    if not path.is_relative_to(root):
        raise KustomizeError(f"security; file '{relative}' is not in or below '{root}'")
    if not path.is_file():
        raise KustomizeError(f"{root}: '{relative}' is not a file")
    return path


def _documents(path: Path) -> list[Obj]:
    docs = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]
    for doc in docs:
        if not isinstance(doc, dict) or not {"apiVersion", "kind", "metadata"} <= set(doc):
            raise KustomizeError(f"{path}: every document must have apiVersion, kind and metadata")
    return docs


def _generate_config_map(root: Path, generator: Obj, options: Obj, namespace: str | None, objects: list[Obj]) -> None:
    unknown = set(generator) - {"name", "namespace", "files", "literals", "behavior"}
    if unknown:
        raise KustomizeError(f"{root}: configMapGenerator keys {sorted(unknown)} are not supported")
    if not options.get("disableNameSuffixHash"):
        raise KustomizeError(f"{root}: set generatorOptions.disableNameSuffixHash: true (no hash suffixes here)")
    data: dict[str, str] = {}
    for entry in generator.get("files", []):
        key, _, relative = entry.partition("=") if "=" in entry else (Path(entry).name, "", entry)
        if key in data:
            raise KustomizeError(f"{root}: configMapGenerator {generator['name']}: duplicate key {key!r}")
        data[key] = _restricted(root, relative).read_text(encoding="utf-8")
    for entry in generator.get("literals", []):
        key, _, value = entry.partition("=")
        data[key] = value
    name = generator["name"]
    behavior = generator.get("behavior", "create")
    # As kustomize: the generated object's id is (name, the generator's or the kustomization's namespace),
    # and merge/replace need a resource with exactly that id - a base's namespace does not carry over.
    ns = generator.get("namespace") or namespace
    existing = [
        o
        for o in objects
        if o["kind"] == "ConfigMap" and o["metadata"]["name"] == name and o["metadata"].get("namespace") == ns
    ]
    if behavior == "create":
        if existing:
            raise KustomizeError(f"{root}: ConfigMap {name} exists already; use behavior: merge or replace")
        metadata: Obj = {"name": name, **({"namespace": ns} if ns else {})}
        objects.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data})
    elif behavior in ("merge", "replace"):
        if len(existing) != 1:
            raise KustomizeError(
                f"{root}: behavior {behavior}: no ConfigMap {name} in namespace {ns!r} from resources "
                "(set the same namespace as the base)"
            )
        target = existing[0]
        target["data"] = {**target.get("data", {}), **data} if behavior == "merge" else data
    else:
        raise KustomizeError(f"{root}: unknown behavior {behavior!r}")


def _apply_patch(root: Path, patch: Obj, objects: list[Obj]) -> None:
    unknown = set(patch) - {"path", "patch", "target"}
    if unknown or ("path" in patch) == ("patch" in patch):
        raise KustomizeError(f"{root}: a patch needs exactly one of path / patch (and optionally target)")
    text = _restricted(root, patch["path"]).read_text(encoding="utf-8") if "path" in patch else patch["patch"]
    body = yaml.safe_load(text)
    if isinstance(body, list):
        raise KustomizeError(f"{root}: JSON 6902 patches are not supported")
    target = patch.get("target") or {
        "kind": body["kind"],
        "name": body["metadata"]["name"],
        **({"namespace": body["metadata"]["namespace"]} if body["metadata"].get("namespace") else {}),
    }
    matches = [o for o in objects if _matches(o, target)]
    if not matches:
        raise KustomizeError(f"{root}: patch target {target} matches no resource")
    for obj in matches:
        merged = strategic_merge(obj, {k: v for k, v in body.items() if k not in ("apiVersion", "kind", "metadata")})
        obj.clear()
        obj.update(merged)


def _matches(obj: Obj, target: Obj) -> bool:
    unknown = set(target) - {"kind", "name", "namespace", "group", "version"}
    if unknown:
        raise KustomizeError(f"patch target keys {sorted(unknown)} are not supported")
    group, _, version = obj["apiVersion"].rpartition("/")
    return (
        target.get("kind", obj["kind"]) == obj["kind"]
        and target.get("name", obj["metadata"]["name"]) == obj["metadata"]["name"]
        and target.get("namespace", obj["metadata"].get("namespace")) == obj["metadata"].get("namespace")
        and target.get("group", group) == group
        and target.get("version", version) == version
    )


def strategic_merge(base: Any, patch: Any, key: str | None = None) -> Any:
    """Kubernetes strategic merge of ``patch`` into a copy of ``base`` (the subset described above)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        result = copy.deepcopy(base)
        for k, v in patch.items():
            if v is None:
                result.pop(k, None)
            elif k in result:
                result[k] = strategic_merge(result[k], v, k)
            else:
                result[k] = _without_directives(v)
        return result
    if isinstance(base, list) and isinstance(patch, list) and key in MERGE_KEYS:
        merge_key = MERGE_KEYS[key]
        result = copy.deepcopy(base)
        for item in patch:
            index = next((i for i, b in enumerate(result) if b.get(merge_key) == item.get(merge_key)), None)
            if item.get("$patch") == "delete":
                if index is not None:
                    del result[index]
            elif index is None:
                result.append(_without_directives(item))
            else:
                result[index] = strategic_merge(result[index], item, None)
        return result
    return _without_directives(patch)


def _without_directives(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_directives(v) for k, v in value.items() if not k.startswith("$")}
    if isinstance(value, list):
        return [_without_directives(v) for v in value]
    return copy.deepcopy(value)


def _set_image(image: Obj, objects: list[Obj]) -> None:
    unknown = set(image) - {"name", "newName", "newTag", "digest"}
    if unknown:
        raise KustomizeError(f"images keys {sorted(unknown)} are not supported")
    for obj in objects:
        spec = obj.get("spec", {}) if obj["kind"] == "Pod" else obj.get("spec", {}).get("template", {}).get("spec")
        if not spec:
            continue
        for container in spec.get("containers", []) + spec.get("initContainers", []):
            name, tag = _split_image(container["image"])
            if name != image["name"]:
                continue
            name = image.get("newName", name)
            if image.get("digest"):
                container["image"] = f"{name}@{image['digest']}"
            else:
                new_tag = image.get("newTag", tag)
                container["image"] = f"{name}:{new_tag}" if new_tag else name


def _split_image(reference: str) -> tuple[str, str | None]:
    name = reference.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    if ":" in last:
        return name[: name.rindex(":")], name[name.rindex(":") + 1 :]
    return name, None


def _check_unique(root: Path, objects: list[Obj]) -> None:
    seen: set[tuple[str, str, str | None]] = set()
    for obj in objects:
        ident = (obj["kind"], obj["metadata"]["name"], obj["metadata"].get("namespace"))
        if ident in seen:
            raise KustomizeError(f"{root}: {ident} appears twice")
        seen.add(ident)
