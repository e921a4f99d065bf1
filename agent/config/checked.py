"""What the config checker's answer means: every config of a path, validated in the child, rebuilt here as the
plain models, and the choice of this node's config among them (:meth:`CheckedSet.choose`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from msgspec import Struct

from agent.config.model import ConfigError, ConfigModel
from agent.config.plain_json import from_plain
from agent.config.source import ConfigSet, LoadedConfig, Matches, _digest, select_config


class Member(Struct, frozen=True):
    digest: str
    match: tuple[str, ...] | None
    match_problem: str | None
    model: ConfigModel | None  # None: invalid, see error
    error: ConfigError | None
    warnings: tuple[str, ...]


class CheckedSet(Struct, frozen=True):
    """Every config of one path, validated by the checker; :meth:`choose` picks this node's."""

    config_set: ConfigSet  # its names and where they come from (the texts stay with the checker: empty here)
    members: dict[str, Member]
    stamp: object  # :func:`stamp` of the path before it was read

    def choose(self, requested: str | None, label: str | None, gpu_products: Sequence[str]) -> LoadedConfig:
        """What :func:`agent.config.source.load_config` gives for the same set; ``ConfigError`` if the chosen
        config is invalid."""
        matches: Matches = {name: (m.match, m.match_problem) for name, m in self.members.items()}
        name, reason, warnings = select_config(self.config_set, requested, label, gpu_products, matches=matches)
        if name is None:
            return LoadedConfig(None, ConfigModel(), tuple(warnings), _digest(""), reason)
        member = self.members[name]
        if member.error is not None:
            raise member.error
        assert member.model is not None
        return LoadedConfig(name, member.model, tuple(warnings) + member.warnings, member.digest, reason)


def decode(answer: object, stamp: object) -> CheckedSet | ConfigError:
    """The checker's answer (its JSON, parsed) as a checked set, or the error that the set cannot be read."""
    if not isinstance(answer, dict):
        raise ValueError("not an object")
    if "error" in answer:
        return _config_error(answer["error"])
    origin = Path(from_plain(str, answer["origin"], "origin"))
    members = {}
    for name, member in from_plain(dict[str, dict], answer["members"], "members").items():
        error = _config_error(member["error"]) if member.get("error") is not None else None
        members[name] = Member(
            digest=from_plain(str, member["digest"], "digest"),
            match=from_plain(tuple[str, ...] | None, member["match"], "match"),
            match_problem=from_plain(str | None, member["match_problem"], "match_problem"),
            model=None if error is not None else from_plain(ConfigModel, member["model"], f"{name}"),
            error=error,
            warnings=tuple(from_plain(list[str], member["warnings"], "warnings")),
        )
    config_set = ConfigSet(
        origin,
        dict.fromkeys(members, ""),
        is_directory=from_plain(bool, answer["is_directory"], "is_directory"),
        manifest=from_plain(str | None, answer["manifest"], "manifest"),
    )
    return CheckedSet(config_set, members, stamp)


def _config_error(value: object) -> ConfigError:
    origin = from_plain(str, value["origin"], "error.origin")  # type: ignore[index]
    return ConfigError(origin, from_plain(list[str], value["problems"], "error.problems"))  # type: ignore[index]
