"""Where the config comes from: a file, or a directory (a mounted ConfigMap with several named configs).

Which named config applies to this node, in order:
1. ``--config-name`` / ``TESSERA_CONFIG_NAME``;
2. the node label ``nvidia.com/device-plugin.config`` (NVIDIA's selector);
3. a config whose ``match`` names a GPU product on this node (Tessera: all H100 nodes get ``h100``);
4. the config named ``default``, or the only config there is (NVIDIA's ``named`` and ``single`` fallbacks);
5. no config at all: every default.
A name that does not exist is a warning and the next rule is tried — never a crash loop.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from agent.config.model import ConfigError, ConfigModel, parse_config
from agent.core.plan import glob_matches

MAX_CONFIG_BYTES = 1 << 20  # a ConfigMap holds at most 1 MiB; anything bigger is not a config
DEFAULT_NAME = "default"


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
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigError(str(path), [f"larger than {MAX_CONFIG_BYTES} bytes; this is not a config"])
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ConfigError(str(path), [f"not UTF-8 text (byte {error.start}); this is not a config"]) from error


def parse_document(text: str, origin: str, *, strict: bool = False) -> tuple[ConfigModel, list[str]]:
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(origin, [f"not valid YAML or JSON: {error}".replace("\n", " ")]) from error
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
    """(chosen name or None, why, warnings)."""
    names = config_set.documents
    warnings: list[str] = []
    if not config_set.is_directory:
        if requested:
            warnings.append(f"--config-name {requested!r} ignored: {config_set.origin} is a single file")
        return next(iter(names)), f"the file {config_set.origin}", warnings
    for value, source in ((requested, "--config-name"), (label, "node label nvidia.com/device-plugin.config")):
        if not value:
            continue
        if value in names:
            return value, f"{source}={value}", warnings
        warnings.append(
            f"{source} names config {value!r}, which {config_set.origin} does not have "
            f"(it has: {', '.join(names) or 'nothing'}); falling back"
        )
    matched = _matching(config_set, gpu_products, warnings)
    if matched:
        if len(matched) > 1:
            warnings.append(f"configs {', '.join(matched)} all match this node's GPUs; using {matched[0]}")
        return matched[0], f"match: {', '.join(sorted(set(gpu_products)))}", warnings
    if DEFAULT_NAME in names:
        return DEFAULT_NAME, "the config named default", warnings
    if len(names) == 1:
        only = next(iter(names))
        return only, "the only config", warnings
    warnings.append(f"no config in {config_set.origin} applies to this node; using the defaults")
    return None, "no config applies", warnings


def _matching(config_set: ConfigSet, gpu_products: Sequence[str], warnings: list[str]) -> list[str]:
    matched = []
    for name, text in config_set.documents.items():
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError:
            continue  # reported if it is ever chosen
        # the key matches case-insensitively, as parse_config reads it
        keys = [k for k in data if isinstance(k, str) and k.lower() == "match"] if isinstance(data, dict) else []
        patterns = data[keys[-1]] if keys else None
        if isinstance(patterns, str):
            patterns = [patterns]
        if not isinstance(patterns, list):
            continue
        if any(isinstance(p, str) and glob_matches(p, product) for p in patterns for product in gpu_products):
            matched.append(name)
    return matched


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
