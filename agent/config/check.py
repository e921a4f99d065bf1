"""The config checker: ``python -m agent.config.check <path>`` validates every config of a file, a directory or a
ConfigMap manifest and prints the result as one JSON document on stdout.

The agent runs it as a short-lived child (:mod:`agent.config.isolated`): a config that would take the parser's
time or memory (a YAML bomb, a deep document) takes the child's, within bounds, and the agent's own process never
holds PyYAML (~2 MB that would stay for good); ``tessera plan`` and ``tessera validate`` keep calling
:func:`agent.config.model.parse_config` in-process.

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


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m agent.config.check <config file, directory or ConfigMap manifest>", file=sys.stderr)
        return 2
    answer = check(Path(args[0]))
    sys.stdout.write(json.dumps(answer, default=str))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
