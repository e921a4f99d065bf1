"""``tessera validate PATH [--config-name NAME] [--strict]``: check every config before it reaches a node.

PATH is what a user has: a config file, a directory (a mounted ConfigMap: ``..data`` bookkeeping is not a
config) or a ``kind: ConfigMap`` manifest, whose data keys are checked one by one and named by their key.
A document that is something else (a Pod, a mig-parted layout file...) is INVALID, saying what it is. A
sharing entry naming a resource no GPU is ever advertised as (``nvidia.com/gpuu``) is a warning; with
``--strict`` every warning (that one, an unknown key, an NVIDIA flag Tessera does not honour) is an error.

Every file is read within the limits of :mod:`agent.config.yaml_limits`; a file that breaks one is
INVALID with a line naming the limit and the fix, never a traceback; a YAML syntax error is given as
``file:line:column`` with the offending line under it.
"""

from __future__ import annotations

import difflib
import sys
from functools import cache
from pathlib import Path

from agent.config.model import ConfigError, ConfigModel
from agent.config.source import ConfigSet, parse_member, read_config_set, resolve_name

EXIT_VALID = 0
EXIT_INVALID = 1
GPU_RESOURCE = "nvidia.com/gpu"
MIG_PREFIX = "nvidia.com/mig-"


def validate_path(path: Path, *, strict: bool = False, config_name: str | None = None) -> int:
    """Print each config's verdict, its problems and warnings; exit 0 only if every config is valid."""
    try:
        config_set = read_config_set(path)
    except ConfigError as error:
        _print_error(f"tessera: {error}", error, sys.stderr)
        return EXIT_INVALID
    names = list(config_set.documents)
    if config_set.manifest is not None:
        called = f" {config_set.manifest}" if config_set.manifest else ""
        print(f"{path}: ConfigMap{called}, data keys: {', '.join(names) or 'none'}")
    if config_name is not None:
        chosen = resolve_name(names, config_name)
        if chosen is None:
            have = ", ".join(names) or "nothing"
            print(f"tessera: {path}: --config-name {config_name!r} names no config; it has: {have}", file=sys.stderr)
            return EXIT_INVALID
        names = [chosen]
    if not names:
        what = (
            "the ConfigMap has no data keys: nothing to check"
            if config_set.manifest is not None
            else "no configs found (entries starting with '..' and directories are not configs)"
        )
        print(f"{path}: {what}")
        return EXIT_INVALID
    failed = foreign = 0
    for name in names:
        verdict, ok, recognised = _validate_one(config_set, name, strict)
        print("\n".join(verdict))
        failed += not ok
        foreign += recognised
    if config_set.manifest is not None and foreign == len(names):
        print(f"{path}: none of the ConfigMap's data keys is a sharing config")
    total = len(names)
    print(f"{total - failed} of {total} config{'s' if total != 1 else ''} valid" + (" (strict)" if strict else ""))
    return EXIT_INVALID if failed else EXIT_VALID


def _validate_one(config_set: ConfigSet, name: str, strict: bool) -> tuple[list[str], bool, bool]:
    """(the lines to print, valid?, recognised as something else than a sharing config?)."""
    from agent.config.schema import NotASharingConfig

    origin = config_set.origin_of(name)
    try:
        model, warnings = parse_member(config_set, name, strict=strict)
        layout = _check_mig_layout(model, origin)
    except ConfigError as error:
        lines = [f"{name}: INVALID"]
        if getattr(error, "excerpt", ()):  # a YAML syntax error: where, and the line
            lines.append(f"  error: {error}")
            lines += [f"  {line}" for line in error.excerpt]  # type: ignore[attr-defined]
        else:
            lines += [f"  error: {problem}" for problem in error.problems]
        return lines, False, isinstance(error, NotASharingConfig)
    sharing = model.replicated
    summary = f"sharing {sharing[0]}" if sharing else "no sharing"
    strategy = model.flags.mig_strategy or "default"
    only = f", only on nodes with {', '.join(model.match) or 'nothing'}" if model.match is not None else ""
    mig = f", MIG layout {layout}" if layout else ""
    warnings = [w.removeprefix(origin + ": ") for w in [*warnings, *resource_name_warnings(model)]]
    if strict and warnings:  # --strict: what would only be a warning on a node fails the check
        return [f"{name}: INVALID (--strict: warnings are errors)", *(f"  error: {w}" for w in warnings)], False, False
    lines = [f"{name}: valid ({summary}, migStrategy {strategy}{mig}{_dra_summary(model)}{only})"]
    lines += [f"  warning: {warning}" for warning in warnings]
    return lines, True, False


def _dra_summary(model: ConfigModel) -> str:
    """``, DRA on all GPUs (dynamic MIG: all; GPU shares: 0, 1)`` for a config that enables the DRA front end."""
    section = model.dra
    if section is None or not section.enabled:
        return ""

    def gpus(value: object) -> str:
        return value if isinstance(value, str) else ", ".join(map(str, value))  # type: ignore[call-overload]

    extras = [f"{what}: {gpus(value)}" for what, value in (("dynamic MIG", section.dynamic_mig),
              ("GPU shares", section.shared_gpus)) if value is not None]  # fmt: skip
    if section.shared_gpus is not None and section.share_mode != "memory":
        extras[-1] += f", consumableShares {section.share_mode}"
    return f", DRA on {gpus(section.gpus)} GPUs" + (f" ({'; '.join(extras)})" if extras else "")


def _print_error(headline: str, error: ConfigError, stream: object) -> None:
    print(headline, file=stream)  # type: ignore[arg-type]
    for line in getattr(error, "excerpt", ()):
        print(line, file=stream)  # type: ignore[arg-type]


# ----- resource names -----------------------------------------------------------------------------------


def resource_name_warnings(model: ConfigModel) -> list[str]:
    """Sharing entries whose ``name`` no device would ever be advertised as, so that they share nothing.

    A device is advertised as ``nvidia.com/gpu`` (a GPU; a MIG device with migStrategy single), as
    ``nvidia.com/mig-<profile>`` for a MIG profile some GPU model has (migStrategy mixed; ``+`` becomes
    ``.``), or as a name the config's own ``resources.gpus`` / ``resources.mig`` rules give. A MIG name with
    a migStrategy set to none or single is a warning too (a ``--mig-strategy`` flag could still change it).
    """
    replicated = model.replicated
    if replicated is None:
        return []
    key, group = replicated
    renamed = {rule.name for rule in (*model.resources.gpus, *model.resources.mig)} if model.resources else set()
    strategy = model.flags.mig_strategy
    warnings = []
    for position, entry in enumerate(group.resources):
        name, where = entry.name, f"sharing.{key}.resources[{position}].name"
        if name == GPU_RESOURCE or name in renamed:
            continue
        if name.startswith(MIG_PREFIX) and name.removeprefix(MIG_PREFIX) in _mig_suffixes():
            if strategy in ("none", "single"):
                instead = "MIG devices are nvidia.com/gpu" if strategy == "single" else "MIG devices are not advertised"
                warnings.append(
                    f"{where}: {name} is advertised only with migStrategy mixed; this config sets migStrategy "
                    f"{strategy} ({instead}), so this entry shares nothing"
                )
            continue
        known = [GPU_RESOURCE, *sorted(renamed), *(MIG_PREFIX + s for s in sorted(_mig_suffixes()))]
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
        own = f", or a name this config's resources rules give ({', '.join(sorted(renamed))})" if renamed else ""
        warnings.append(
            f"{where}: no GPU is ever advertised as {name}, so this entry shares nothing; devices are "
            f"nvidia.com/gpu or nvidia.com/mig-<profile> (e.g. nvidia.com/mig-1g.10gb){own}"
            + (f"; did you mean {close[0]}?" if close else "")
        )
    return warnings


@cache
def _mig_suffixes() -> frozenset[str]:
    """What follows ``nvidia.com/mig-`` for every MIG profile of every known GPU model."""
    from agent.core.mig_catalog import mig_catalogs
    from agent.core.mig_naming import mig_resource_suffix

    return frozenset(mig_resource_suffix(p.name) for catalog in mig_catalogs() for p in catalog.profiles)


# ----- migLayout ----------------------------------------------------------------------------------------


def _check_mig_layout(model: ConfigModel, origin: str) -> str | None:
    """migLayout: the mig-parted document parses, names a layout it has, uses profiles some GPU has, and each
    layout fits some GPU model; the name of the layout that applies (None without one).

    Whether a layout fits a particular node is checked there (and by ``tessera mig apply --dry-run`` and
    ``tessera plan --node``).
    """
    if model.mig_layout is None:
        return None
    from agent.core.mig_catalog import canonical_profile_name, mig_catalogs
    from agent.mig.layout_file import LayoutFileError, config_layout, unfit_problems

    section = model.mig_layout
    if section.layouts is None:
        if section.config is not None:
            raise ConfigError(origin, ["migLayout.config: names a layout but migLayout.layouts is missing"])
        return None
    try:
        selected = config_layout(section, origin)
    except LayoutFileError as error:
        raise ConfigError(origin, [f"migLayout.layouts.{problem}" for problem in error.problems]) from error
    assert selected is not None
    layout_file, chosen = selected
    problems = []
    if section.config is not None and section.config not in layout_file.mig_configs:
        problems.append(
            f"migLayout.config: {section.config!r} is not in migLayout.layouts ({', '.join(layout_file.mig_configs)})"
        )
    known = {canonical_profile_name(p.name) for catalog in mig_catalogs() for p in catalog.profiles}
    unknown = False
    for name, specs in layout_file.mig_configs.items():
        for position, spec in enumerate(specs):
            for profile in spec.mig_devices or {}:
                if canonical_profile_name(profile) not in known:
                    unknown = True
                    problems.append(
                        f"migLayout.layouts.mig-configs.{name}[{position}].mig-devices: no GPU model has a MIG "
                        f"profile {profile!r}"
                    )
    if not unknown:
        problems += [f"migLayout.layouts.{problem}" for problem in unfit_problems(layout_file)]
    if problems:
        raise ConfigError(origin, problems)
    return chosen
