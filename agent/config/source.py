"""Where the config comes from: a file, a directory (a mounted ConfigMap with several named configs), or a
``kind: ConfigMap`` manifest file (its data keys are the named configs, as they would be once mounted).

Which named config applies to this node, in order:
1. ``--config-name`` / ``TESSERA_CONFIG_NAME``;
2. the node label ``nvidia.com/device-plugin.config`` (NVIDIA's selector);
3. a config whose ``match`` names a GPU product on this node (Tessera: all H100 nodes get ``h100``);
4. the config named ``default``, or the only config there is (NVIDIA's ``named`` and ``single`` fallbacks);
5. no config at all: every default.
A name is resolved by :func:`resolve_name` (``time-slicing-4`` finds the key ``time-slicing-4`` or the file
``time-slicing-4.yaml``), for the agent and the previews alike. For the agent, a name that resolves to
nothing is a warning and the next rule is tried — never a crash loop; the previews (``tessera plan``) ask for
``strict_names``, and such a name is an error naming the configs there are.

Selection never widens: a config with a ``match`` that selects none of this node's GPU products is never
applied by rules 4 and 5 — not as ``default``, not as the only config, not as a single ``--config`` file,
and so not its ``migLayout`` either. Only an explicit choice (rules 1 and 2) applies it, with a warning.
A node no config applies to gets the defaults, and the reason says why.

Every file is read within the limits of :mod:`agent.config.yaml_limits` (size, nesting, aliases).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from pathlib import Path

from msgspec import Struct, field

from agent.config.labels import CONFIG_LABEL
from agent.config.model import ConfigError, ConfigModel, parse_config
from agent.core.glob import glob_matches

# A ConfigMap holds at most 1 MiB; anything bigger is not a config. (yaml_limits.MAX_BYTES: that module,
# and yaml with it, is imported only when a config is read, so an agent without --config never loads yaml.)
MAX_CONFIG_BYTES = 1 << 20
DEFAULT_NAME = "default"
KIND = "a sharing config"
CONFIG_SUFFIXES = (".yaml", ".yml", ".json")  # what a config file's name may end with, beyond its config name
_CONFIGMAP_KEY = re.compile(r"[-._a-zA-Z0-9]{1,253}")  # the API server's rule for a data key
_MANIFEST_KIND = re.compile(r"""^kind:[ \t]*["']?ConfigMap["']?[ \t]*(#.*)?$""", re.MULTILINE)


class ConfigSet(Struct, frozen=True):
    origin: Path
    documents: dict[str, str]  # config name (ConfigMap key or file name) -> text
    is_directory: bool
    manifest: str | None = None  # a ConfigMap manifest file: its metadata.name ("" if none); else None
    # of a manifest's keys written as literal blocks (key: |): where the text starts in the file (lines before
    # it, indentation), so that a YAML error inside a key is reported at its line and column in the file
    positions: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def named(self) -> bool:
        """Several configs chosen by name (a directory, a ConfigMap manifest); else one file, the config."""
        return self.is_directory or self.manifest is not None

    def origin_of(self, name: str) -> str:
        """How messages name one config: its file, or the manifest and the data key."""
        if self.is_directory:
            return str(self.origin / name)
        if self.manifest is not None:
            return f"{self.origin} (data key {name})"
        return str(self.origin)


class ConfigNameError(ConfigError):
    """A name given explicitly (``--config-name``, the node label) resolves to no config (``strict_names``)."""


class LoadedConfig(Struct, frozen=True):
    name: str | None  # None: no config applies, all defaults
    model: ConfigModel
    warnings: tuple[str, ...]
    digest: str  # sha256 of the text in force, so an unchanged reload does nothing
    reason: str  # why this config was chosen, for the log


def read_config_set(path: Path) -> ConfigSet:
    """Every config at ``path``. In a directory, entries whose names start with ``..`` (the kubelet's
    ConfigMap bookkeeping) and sub-directories are not configs. A file that is a ``kind: ConfigMap`` manifest
    holds its data keys, as the directory it would be mounted as."""
    try:
        if path.is_dir():
            entries = sorted(p for p in path.iterdir() if not p.name.startswith("..") and p.is_file())
            return ConfigSet(path, {p.name: _read(p) for p in entries}, is_directory=True)
        text = _read(path)
        if _MANIFEST_KIND.search(text):  # only then is the file read as YAML here
            manifest = _configmap_manifest(text, str(path))
            if manifest is not None:
                name, documents, positions = manifest
                return ConfigSet(path, documents, is_directory=False, manifest=name, positions=positions)
        return ConfigSet(path, {path.name: text}, is_directory=False)
    except OSError as error:
        raise ConfigError(
            str(path), [f"cannot read: {error.strerror or error}; check the mount and the path"]
        ) from error


def _configmap_manifest(text: str, origin: str) -> tuple[str, dict[str, str], dict[str, tuple[int, int]]] | None:
    """(metadata.name, data, positions of literal blocks) of a ConfigMap manifest; None if it is not one.

    A data value must be text, as the API server insists: a map written where ``key: |`` was meant is an
    error naming the key. ``binaryData`` holds no configs.
    """
    from agent.config.yaml_limits import load_yaml

    document = load_yaml(text, origin, kind="a ConfigMap manifest")
    if not isinstance(document, dict) or document.get("kind") != "ConfigMap" or "apiVersion" not in document:
        return None
    metadata = document.get("metadata")
    name = metadata.get("name") if isinstance(metadata, dict) else None
    data = document.get("data") or {}
    if not isinstance(data, dict):
        raise ConfigError(origin, [f"data is a {_yaml_type(data)}, not a map of keys to texts"])
    # as the API server reads it: `1:` is the key "1", and `key:` with no value is the empty text
    data = {_go_text(key) or "": "" if value is None else value for key, value in data.items()}
    problems = [
        f"data key {key}: a {_yaml_type(value)}, not text; a ConfigMap's data values are strings: write "
        f"'{key}: |' and the config indented under it"
        for key, value in data.items()
        if not isinstance(value, str)
    ]
    problems += [
        f"data key {key!r}: not a ConfigMap key (letters, digits, '-', '_' and '.', not starting with '..'); the "
        "API server would refuse the ConfigMap"
        for key in data
        if not (_CONFIGMAP_KEY.fullmatch(key) and not key.startswith("..") and key != ".")
    ]
    if problems:
        raise ConfigError(origin, problems)
    return (name if isinstance(name, str) else ""), dict(data), _block_positions(text)


def _yaml_type(value: object) -> str:
    if isinstance(value, dict):
        return "map"
    if isinstance(value, list):
        return "list"
    if isinstance(value, bool):
        return "boolean"
    return "number" if isinstance(value, int | float) else type(value).__name__


def _block_positions(text: str) -> dict[str, tuple[int, int]]:
    """For each data key written as a literal block (``key: |``): lines before its text, and its indentation.

    The text is composed again, for the marks, without being built: it has passed the limits already (read
    within 1 MiB, loaded by :func:`agent.config.yaml_limits.load_yaml`).
    """
    import yaml

    root = yaml.compose(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    if not isinstance(root, yaml.MappingNode):
        return {}
    data = next((v for k, v in root.value if isinstance(k, yaml.ScalarNode) and k.value == "data"), None)
    if not isinstance(data, yaml.MappingNode):
        return {}
    lines = text.splitlines()
    positions = {}
    for key, value in data.value:
        if not (isinstance(key, yaml.ScalarNode) and isinstance(value, yaml.ScalarNode) and value.style == "|"):
            continue
        first = value.start_mark.line + 1  # the text starts on the line after the '|'
        body = next((line for line in lines[first:] if line.strip()), "")
        positions[key.value] = (first, len(body) - len(body.lstrip(" ")))
    return positions


def _read(path: Path) -> str:
    """The text of one config: a regular file of at most 1 MiB of UTF-8 (a FIFO or a device is refused)."""
    from agent.config.bounded import read_bounded
    from agent.config.yaml_limits import decode_text

    return decode_text(read_bounded(path, str(path), MAX_CONFIG_BYTES), str(path), kind=KIND)


def parse_document(text: str, origin: str, *, strict: bool = False) -> tuple[ConfigModel, list[str]]:
    from agent.config.yaml_limits import load_yaml

    data = load_yaml(text, origin, kind=KIND)
    model, warnings = parse_config(data, origin)
    if strict and warnings:
        raise ConfigError(origin, [w.removeprefix(f"{origin}: ") for w in warnings])
    return model, warnings


def parse_member(config_set: ConfigSet, name: str, *, strict: bool = False) -> tuple[ConfigModel, list[str]]:
    """Parse one config of the set, named in messages by :meth:`ConfigSet.origin_of`; a YAML error inside a
    manifest's key is reported at its line and column in the manifest file."""
    from agent.config.yaml_limits import YamlSyntaxError

    try:
        return parse_document(config_set.documents[name], config_set.origin_of(name), strict=strict)
    except YamlSyntaxError as error:
        if config_set.manifest is None:
            raise
        position = config_set.positions.get(name)
        if position is None:  # a quoted or folded value: its lines are not the file's; say where in the value
            raise ConfigError(error.origin, [f"{p} of the key's text" for p in error.problems]) from None
        raise error.moved(str(config_set.origin), *position, note=f"in data key {name}") from None


def load_config(
    config_set: ConfigSet,
    *,
    requested: str | None = None,
    label: str | None = None,
    gpu_products: Sequence[str] = (),
    strict: bool = False,
    strict_names: bool = False,
) -> LoadedConfig:
    """Choose the config for this node and parse it; ``ConfigError`` if the chosen one is invalid.

    ``strict_names`` (the previews): a requested name or label value that resolves to no config is a
    ``ConfigNameError`` instead of a warning and a fallback.
    """
    name, reason, warnings = select_config(config_set, requested, label, gpu_products, strict_names=strict_names)
    if name is None:
        return LoadedConfig(None, ConfigModel(), tuple(warnings), _digest(""), reason)
    text = config_set.documents[name]
    model, parse_warnings = parse_member(config_set, name, strict=strict)
    return LoadedConfig(name, model, tuple(warnings + parse_warnings), _digest(text), reason)


def resolve_name(names: Collection[str], wanted: str) -> str | None:
    """The config that ``wanted`` names among ``names``, or None: the name itself; else the name with a file
    suffix (``time-slicing-4`` finds ``time-slicing-4.yaml``: a ConfigMap kept as local files names them
    so); else the name without one (``time-slicing-4.yaml`` finds the key ``time-slicing-4``)."""
    if wanted in names:
        return wanted
    for suffix in CONFIG_SUFFIXES:
        if wanted + suffix in names:
            return wanted + suffix
    stem, _, suffix = wanted.rpartition(".")
    if stem and f".{suffix}" in CONFIG_SUFFIXES and stem in names:
        return stem
    return None


Matches = dict[str, tuple[tuple[str, ...] | None, str | None]]  # config name -> (its match patterns, a problem)


def select_config(
    config_set: ConfigSet,
    requested: str | None,
    label: str | None,
    gpu_products: Sequence[str],
    *,
    strict_names: bool = False,
    matches: Matches | None = None,
) -> tuple[str | None, str, list[str]]:
    """(chosen name or None, why, warnings). A config whose ``match`` does not select this node's GPU
    products is chosen only explicitly (``requested`` or ``label``), never by a fallback.

    ``strict_names``: a requested name or label value that resolves to nothing raises ``ConfigNameError``
    (naming the configs there are, and what the agent would fall back to) instead of warning.

    ``matches``: each config's :func:`match_of`, when it was read already (by the config checker's process).
    """
    name, reason, warnings = _select(config_set, requested, label, gpu_products, matches)
    if strict_names:
        _check_names(config_set, requested, label, reason)
    return name, reason, warnings


def _check_names(config_set: ConfigSet, requested: str | None, label: str | None, fallback: str) -> None:
    names = list(config_set.documents)
    have = ", ".join(names) or "nothing"
    if not config_set.named:
        if requested and resolve_name(names, requested) is None:
            raise ConfigNameError(
                str(config_set.origin),
                [
                    f"--config-name {requested!r} names no config: this is a single file, its one config is "
                    f"{have}; give the directory or the ConfigMap manifest that holds {requested!r}"
                ],
            )
        return
    for value, source in ((requested, "--config-name"), (label, f"node label {CONFIG_LABEL}")):
        if value and resolve_name(names, value) is None:
            raise ConfigNameError(
                str(config_set.origin),
                [
                    f"{source} {value!r} names no config here; it has: {have} (the agent would warn and fall "
                    f"back: {fallback})"
                ],
            )


def _select(
    config_set: ConfigSet,
    requested: str | None,
    label: str | None,
    gpu_products: Sequence[str],
    matches: Matches | None = None,
) -> tuple[str | None, str, list[str]]:
    names = config_set.documents
    products = sorted(set(gpu_products))
    warnings: list[str] = []
    if matches is None:
        matches = {name: match_of(text) for name, text in names.items()}
    for name, (_, problem) in matches.items():
        if problem:
            warnings.append(f"config {name}: {problem}")
    if not config_set.named:
        if requested and resolve_name(names, requested) is None:
            warnings.append(f"--config-name {requested!r} ignored: {config_set.origin} is a single file")
        only = next(iter(names))
        patterns = matches[only][0]
        if patterns is None:
            return only, f"the file {config_set.origin}", warnings
        if _selects(patterns, products):
            return only, f"the file {config_set.origin}, whose match selects {_products(products)}", warnings
        return None, _none_applies(config_set, matches, products), warnings
    for value, source in ((requested, "--config-name"), (label, f"node label {CONFIG_LABEL}")):
        if not value:
            continue
        chosen = resolve_name(names, value)
        if chosen is not None:
            patterns = matches[chosen][0]
            if patterns is not None and not _selects(patterns, products):
                warnings.append(
                    f"{source}={value} chooses config {chosen!r}, whose match ({_patterns(patterns)}) does not "
                    f"select this node's GPUs ({_products(products)}); applying it because it was chosen explicitly"
                )
            return chosen, f"{source}={value}", warnings
        warnings.append(
            f"{source} names config {value!r}, which {config_set.origin} does not have "
            f"(it has: {', '.join(names) or 'nothing'}); falling back"
        )
    matched = [name for name, (patterns, _) in matches.items() if patterns is not None and _selects(patterns, products)]
    if matched:
        if len(matched) > 1:
            warnings.append(f"configs {', '.join(matched)} all match this node's GPUs; using {matched[0]}")
        return matched[0], f"match: {', '.join(products)}", warnings
    # The fallbacks never pick a config whose match excludes this node.
    unmatched = {name for name, (patterns, _) in matches.items() if patterns is None}
    if DEFAULT_NAME in unmatched:
        return DEFAULT_NAME, "the config named default", warnings
    if len(names) == 1 and unmatched:
        return next(iter(names)), "the only config", warnings
    if unmatched:
        warnings.append(f"no config in {config_set.origin} applies to this node; using the defaults")
    return None, _none_applies(config_set, matches, products), warnings


def _none_applies(config_set: ConfigSet, matches: Matches, products: list[str]) -> str:
    """Why a node gets the defaults: which configs match other GPUs, which need to be named."""
    if not config_set.documents:
        return f"no config applies: {config_set.origin} holds no config"
    excluded = [f"{name} matches only {_patterns(p)}" for name, (p, _) in matches.items() if p is not None]
    parts = [f"{'; '.join(excluded)}; this node has {_products(products)}"] if excluded else []
    others = [name for name, (p, _) in matches.items() if p is None]
    if others:
        verb = "applies" if len(others) == 1 else "apply"
        parts.append(
            f"{', '.join(others)} {verb} only when named by the node label nvidia.com/device-plugin.config or "
            f"--config-name (no config is named {DEFAULT_NAME})"
        )
    return "no config applies: " + "; ".join(parts)


def _patterns(patterns: tuple[str, ...]) -> str:
    return ", ".join(patterns) if patterns else "nothing (match is an empty list)"


def _products(products: Sequence[str]) -> str:
    return ", ".join(products) if products else "no GPUs"


def _selects(patterns: tuple[str, ...], products: Sequence[str]) -> bool:
    return any(glob_matches(pattern, product) for pattern in patterns for product in products)


def match_of(text: str) -> tuple[tuple[str, ...] | None, str | None]:
    """(the config's match patterns, or None when it has no match; a problem with its match, if any).

    Read as parse_config reads it: the key case-insensitively (the last one wins), a text or a list, a
    number or bool becoming text. A config that cannot be read has no match here: it is reported when
    chosen. A match that is not a glob or a list of globs selects nothing (it never widens), with a warning.
    """
    from agent.config.yaml_limits import load_yaml

    try:
        data = load_yaml(text, "config", kind=KIND)
    except ConfigError:
        return None, None  # reported if it is ever chosen
    if not isinstance(data, dict):
        return None, None
    keys = [k for k in data if isinstance(k, str) and k.lower() == "match"]
    value = data[keys[-1]] if keys else None
    if value is None:  # absent, or an explicit null (Go's decoder leaves the field alone)
        return None, None
    items = [value] if isinstance(value, str) else value
    if isinstance(items, list):
        patterns = [_go_text(item) for item in items]
        if all(p is not None for p in patterns):
            return tuple(p for p in patterns if p is not None), None
    return (), 'match is not a glob or a list of globs, so it selects no node; write e.g. match: ["NVIDIA A100*"]'


def _go_text(item: object) -> str | None:
    if isinstance(item, bool):
        return "true" if item else "false"
    if isinstance(item, str | int | float):
        return str(item)
    return None


def _digest(text: str) -> str:
    import hashlib  # ~4 ms, only once a config is read

    return hashlib.sha256(text.encode()).hexdigest()
