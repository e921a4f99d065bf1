"""The ``flags`` section of NVIDIA's config ``version: v1``, which sets agent-wide options.

Precedence is NVIDIA's: an explicit flag or environment variable, then the file, then the default.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class ConfigError(ValueError):
    """The config file cannot be used; the message names the field and the fix."""


class _Lenient(BaseModel):
    # NVIDIA ignores unknown keys; so do we here (the full config model warns about them).
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class PluginFlags(_Lenient):
    device_list_strategy: list[str] | None = Field(default=None, alias="deviceListStrategy")

    @field_validator("device_list_strategy", mode="before")
    @classmethod
    def _string_or_list(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value


class Flags(_Lenient):
    mig_strategy: Literal["none", "single", "mixed"] | None = Field(default=None, alias="migStrategy")
    plugin: PluginFlags = PluginFlags()


class ConfigFile(_Lenient):
    version: Literal["v1"] = "v1"
    flags: Flags = Flags()


def load_config_file(path: Path) -> ConfigFile:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except OSError as error:
        raise ConfigError(f"{path}: cannot read: {error.strerror}") from error
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from error
    try:
        return ConfigFile.model_validate(data)
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in error.errors())
        raise ConfigError(f"{path}: {problems}") from error
