"""Where the config comes from: a file, or a directory (a mounted ConfigMap with several named configs).

Which named config applies to this node, in order:
1. ``--config-name`` / ``TESSERA_CONFIG_NAME``;
2. the node label ``nvidia.com/device-plugin.config`` (NVIDIA's selector);
3. a config whose ``match`` names a GPU product on this node (Tessera: all H100 nodes get ``h100``);
4. the config named ``default``, or the only config there is (NVIDIA's ``named`` and ``single`` fallbacks);
5. no config at all: every default.
A name that does not exist is a warning and the next rule is tried — never a crash loop.

Selection never widens: a config with a ``match`` that selects none of this node's GPU products is never
applied by rules 4 and 5 — not as ``default``, not as the only config, not as a single ``--config`` file,
and so not its ``migLayout`` either. Only an explicit choice (rules 1 and 2) applies it, with a warning.
A node no config applies to gets the defaults, and the reason says why.

Every file is read within the limits of :mod:`agent.config.yaml_limits` (size, nesting, aliases).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.config.model import ConfigError, ConfigModel, parse_config
from agent.core.plan import glob_matches

# A ConfigMap holds at most 1 MiB; anything bigger is not a config. (yaml_limits.MAX_BYTES: that module,
# and yaml with it, is imported only when a config is read, so an agent without --config never loads yaml.)
MAX_CONFIG_BYTES = 1 << 20
DEFAULT_NAME = "default"
KIND = "a sharing config"


@dataclass(frozen=True, slots=True)
class ConfigSet:
    origin: Path
    documents: dict[str, str]  # config name (ConfigMap key or file name) -> text
    is_directory: bool


@dataclass(frozen=True, slots=True)
class LoadedConfig:
    name: str | None  # None: no config applies, all defaults
    model: ConfigModel
    warnings: tuple[str, ...]
    digest: str  # sha256 of the text in force, so an unchanged reload does nothing
    reason: str  # why this config was chosen, for the log


def read_config_set(path: Path) -> ConfigSet:
    """Every config at ``path``. In a directory, entries whose names start with ``..`` (the kubelet's
    ConfigMap bookkeeping) and sub-directories are not configs."""
    try:
        if path.is_dir():
            entries = sorted(p for p in path.iterdir() if not p.name.startswith("..") and p.is_file())
            return ConfigSet(path, {p.name: _read(p) for p in entries}, is_directory=True)
        return ConfigSet(path, {path.name: _read(path)}, is_directory=False)
    except OSError as error:
        raise ConfigError(
            str(path), [f"cannot read: {error.strerror or error}; check the mount and the path"]
        ) from error


def _read(path: Path) -> str:
    """The text of one config: a regular file of at most 1 MiB of UTF-8 (a FIFO or a device is refused)."""
    from agent.config.yaml_limits import decode_text, read_bounded

    return decode_text(read_bounded(path, str(path), MAX_CONFIG_BYTES), str(path), kind=KIND)


def parse_document(text: str, origin: str, *, strict: bool = False) -> tuple[ConfigModel, list[str]]:
    from agent.config.yaml_limits import load_yaml

    data = load_yaml(text, origin, kind=KIND)
    model, warnings = parse_config(data, origin)
    if strict and warnings:
        raise ConfigError(origin, [w.removeprefix(f"{origin}: ") for w in warnings])
    return model, warnings


def load_config(
    config_set: ConfigSet,
    *,
    requested: str | None = None,
    label: str | None = None,
    gpu_products: Sequence[str] = (),
    strict: bool = False,
) -> LoadedConfig:
    """Choose the config for this node and parse it; ``ConfigError`` if the chosen one is invalid."""
    name, reason, warnings = select_config(config_set, requested, label, gpu_products)
    if name is None:
        return LoadedConfig(None, ConfigModel(), tuple(warnings), _digest(""), reason)
    text = config_set.documents[name]
    origin = str(config_set.origin / name) if config_set.is_directory else str(config_set.origin)
    model, parse_warnings = parse_document(text, origin, strict=strict)
    return LoadedConfig(name, model, tuple(warnings + parse_warnings), _digest(text), reason)


def select_config(
    config_set: ConfigSet, requested: str | None, label: str | None, gpu_products: Sequence[str]
) -> tuple[str | None, str, list[str]]:
    """(chosen name or None, why, warnings). A config whose ``match`` does not select this node's GPU
    products is chosen only explicitly (``requested`` or ``label``), never by a fallback."""
    names = config_set.documents
    products = sorted(set(gpu_products))
    warnings: list[str] = []
    matches = {name: _match_of(text) for name, text in names.items()}
    for name, (_, problem) in matches.items():
        if problem:
            warnings.append(f"config {name}: {problem}")
    if not config_set.is_directory:
        if requested:
            warnings.append(f"--config-name {requested!r} ignored: {config_set.origin} is a single file")
        only = next(iter(names))
        patterns = matches[only][0]
        if patterns is None:
            return only, f"the file {config_set.origin}", warnings
        if _selects(patterns, products):
            return only, f"the file {config_set.origin}, whose match selects {_products(products)}", warnings
        return None, _none_applies(config_set, matches, products), warnings
    for value, source in ((requested, "--config-name"), (label, "node label nvidia.com/device-plugin.config")):
        if not value:
            continue
        if value in names:
            patterns = matches[value][0]
            if patterns is not None and not _selects(patterns, products):
                warnings.append(
                    f"{source}={value} chooses config {value!r}, whose match ({_patterns(patterns)}) does not "
                    f"select this node's GPUs ({_products(products)}); applying it because it was chosen explicitly"
                )
            return value, f"{source}={value}", warnings
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


def _none_applies(
    config_set: ConfigSet, matches: dict[str, tuple[tuple[str, ...] | None, str | None]], products: list[str]
) -> str:
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


def _match_of(text: str) -> tuple[tuple[str, ...] | None, str | None]:
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
