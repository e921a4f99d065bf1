"""``tessera validate FILE|DIR [--strict]``: check every config before it reaches a node.

Every file is read within the limits of :mod:`agent.config.yaml_limits`; a file that breaks one is
INVALID with a line naming the limit and the fix, never a traceback.
"""

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
            if model.mig_layout is not None:
                _check_mig_layout(model.mig_layout.layouts, model.mig_layout.config, origin)
        except ConfigError as error:
            failed += 1
            print(f"{name}: INVALID")
            for problem in error.problems:
                print(f"  error: {problem}")
            continue
        sharing = model.replicated
        summary = f"sharing {sharing[0]}" if sharing else "no sharing"
        strategy = model.flags.mig_strategy or "default"
        only = f", only on nodes with {', '.join(model.match) or 'nothing'}" if model.match is not None else ""
        print(f"{name}: valid ({summary}, migStrategy {strategy}{only})")
        for warning in warnings:
            print(f"  warning: {warning.removeprefix(origin + ': ')}")
    total = len(config_set.documents)
    print(f"{total - failed} of {total} config{'s' if total != 1 else ''} valid" + (" (strict)" if strict else ""))
    return EXIT_INVALID if failed else EXIT_VALID


def _check_mig_layout(layouts: object, selected: str | None, origin: str) -> None:
    """migLayout: the mig-parted document parses, names a layout it has, and uses profiles some GPU has.

    Whether a layout fits a particular GPU is checked on the node (and by ``tessera mig apply --dry-run``).
    """
    from agent.core.mig_catalog import canonical_profile_name, mig_catalogs
    from agent.mig.layout_file import LayoutFileError, parse_layout_file

    if layouts is None:
        if selected is not None:
            raise ConfigError(origin, ["migLayout.config: names a layout but migLayout.layouts is missing"])
        return
    try:
        layout_file = parse_layout_file(layouts, "migLayout.layouts")
    except LayoutFileError as error:
        raise ConfigError(origin, [str(error)]) from error
    problems = []
    if selected is not None and selected not in layout_file.mig_configs:
        problems.append(
            f"migLayout.config: {selected!r} is not in migLayout.layouts ({', '.join(layout_file.mig_configs)})"
        )
    known = {canonical_profile_name(p.name) for catalog in mig_catalogs() for p in catalog.profiles}
    for name, specs in layout_file.mig_configs.items():
        for position, spec in enumerate(specs):
            for profile in spec.mig_devices or {}:
                if canonical_profile_name(profile) not in known:
                    problems.append(
                        f"migLayout.layouts.mig-configs.{name}[{position}].mig-devices: no GPU model has a MIG "
                        f"profile {profile!r}"
                    )
    if problems:
        raise ConfigError(origin, problems)
