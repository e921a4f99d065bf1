"""The config checker: ``python -m agent.config.check <path>`` validates every config of a file, a directory or a
ConfigMap manifest and prints the result as one JSON document on stdout.

The agent runs it as a short-lived child (:mod:`agent.config.isolated`) so that its own process never imports
pydantic (whose model machinery stays in a process's memory for good: ~13 MB and ~100 ms at start) nor PyYAML;
``tessera plan`` and ``tessera validate`` keep calling :func:`agent.config.model.parse_config` in-process.

The answer is either ``{"error": {"origin", "problems"}}`` (the set cannot be read) or the set::

    {"origin", "is_directory", "manifest", "members": {name: {"digest", "match", "match_problem",
     "model" | "error", "warnings"}}}

``model`` is :class:`agent.config.model.ConfigModel` as :func:`agent.config.plain_json.to_plain` writes it. Each
config is checked whole, whichever one the node ends up choosing (the agent chooses, by its label and GPUs):
the checker needs neither, so it runs while the agent does its other start work.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType

from agent.config.model import ConfigError
from agent.config.plain_json import to_plain


def check(path: Path) -> dict[str, object]:
    """The checked set, as the JSON-ready dict described in the module's docstring."""
    from agent.config.source import _digest, match_of, parse_member, read_config_set

    try:
        config_set = read_config_set(path)
    except ConfigError as error:
        return {"error": {"origin": error.origin, "problems": list(error.problems)}}
    members: dict[str, object] = {}
    for name, text in config_set.documents.items():
        patterns, problem = match_of(text)
        member: dict[str, object] = {
            "digest": _digest(text),
            "match": None if patterns is None else list(patterns),
            "match_problem": problem,
            "warnings": [],
        }
        try:
            model, warnings = parse_member(config_set, name)
        except ConfigError as error:
            member["error"] = {"origin": error.origin, "problems": list(error.problems)}
        except Exception as error:  # whatever a config does to the parser rejects that config, and only it
            origin = config_set.origin_of(name)
            member["error"] = {"origin": origin, "problems": [f"cannot be checked: {type(error).__name__}: {error}"]}
        else:
            member["model"] = to_plain(model)
            member["warnings"] = list(warnings)
        members[name] = member
    return {
        "origin": str(config_set.origin),
        "is_directory": config_set.is_directory,
        "manifest": config_set.manifest,
        "members": members,
    }


def without_plugin_discovery() -> None:
    """Spare this process pydantic's search for plugins (the checker uses none).

    pydantic imports its plugin loader when it builds its first model, and the loader imports
    ``importlib.metadata`` (with it ``email``, ``zipfile``, ``csv``, ``hashlib``: ~14 ms of the checker's ~130)
    to read every installed distribution's entry points — even when ``PYDANTIC_DISABLE_PLUGINS=__all__``, which
    the checker sets, makes it return no plugin. Here the loader is one that returns no plugin without looking:
    the same answer. Its one name, ``get_plugins``, is all pydantic takes from it (``pydantic.plugin.
    _schema_validator``); a pydantic that took more would fail every check loudly (tests/integration/
    test_config_check.py), never check differently.
    """
    name = "pydantic.plugin._loader"
    if name in sys.modules:  # pydantic has built a model already: nothing left to spare
        return
    loader = ModuleType(name, "pydantic's plugin loader as the config checker has it: no plugins, none looked for")
    loader.get_plugins = tuple  # type: ignore[attr-defined]  # () — what the real one returns with plugins disabled
    sys.modules[name] = loader


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    without_plugin_discovery()
    if len(args) != 1:
        print("usage: python -m agent.config.check <config file, directory or ConfigMap manifest>", file=sys.stderr)
        return 2
    answer = check(Path(args[0]))
    sys.stdout.write(json.dumps(answer, default=str))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
