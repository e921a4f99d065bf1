"""``tessera validate FILE|DIR [--strict]``: check every config before it reaches a node."""

from __future__ import annotations

import sys
from pathlib import Path

from agent.config.model import ConfigError
from agent.config.source import parse_document, read_config_set

EXIT_VALID = 0
EXIT_INVALID = 1


def validate_path(path: Path, *, strict: bool = False) -> int:
    """Print each config's verdict, its problems and warnings; exit 0 only if every config is valid."""
    try:
        config_set = read_config_set(path)
    except ConfigError as error:
        print(f"tessera: {error}", file=sys.stderr)
        return EXIT_INVALID
    if not config_set.documents:
        print(f"{path}: no configs found (entries starting with '..' and directories are not configs)")
        return EXIT_INVALID
    failed = 0
    for name, text in config_set.documents.items():
        origin = str(path / name) if config_set.is_directory else str(path)
        try:
            model, warnings = parse_document(text, origin, strict=strict)
        except ConfigError as error:
            failed += 1
            print(f"{name}: INVALID")
            for problem in error.problems:
                print(f"  error: {problem}")
            continue
        sharing = model.replicated
        summary = f"sharing {sharing[0]}" if sharing else "no sharing"
        strategy = model.flags.mig_strategy or "default"
        print(f"{name}: valid ({summary}, migStrategy {strategy})")
        for warning in warnings:
            print(f"  warning: {warning.removeprefix(origin + ': ')}")
    total = len(config_set.documents)
    print(f"{total - failed} of {total} config{'s' if total != 1 else ''} valid" + (" (strict)" if strict else ""))
    return EXIT_INVALID if failed else EXIT_VALID
