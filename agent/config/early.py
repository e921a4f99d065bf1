"""The first step of ``tessera run``: its config checker forked before anything else loads.

The check runs beside the agent's own start (PyYAML and the checker's modules load, every config is read: ~0.06 s)
and the agent waits for
its answer before its first advertisement, so the sooner it starts, the sooner the kubelet is served. The entry
point (:mod:`agent.entry`) loads this module first: it reads the config path from the command line, unparsed, and
forks the checker (:class:`agent.config.forked.ForkedChecker`) before the command line's own modules load —
argparse, logging, json, pathlib: ~20 ms the checker would otherwise wait for and does not use. So this module
imports only ``os`` and ``time``, and ``stamp`` reads the files with ``os`` alone.

:class:`agent.config.isolated.Check` takes the forked child over (``Check(path, early=...)``, through
:func:`agent.config.isolated.start_early`): from there it is any check, bounded and read the same way.
"""

# ruff: noqa: PTH112, PTH115, PTH116, PTH118, PTH208 - os alone: pathlib would cost ~10 ms before the fork

from __future__ import annotations

import os
import time

TYPE_CHECKING = False  # typing itself is not loaded for this: ~3 ms of a start
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from agent.config.forked import ForkedChecker

CONFIG_FLAGS = (("--config", "TESSERA_CONFIG"), ("--config-file", "CONFIG_FILE"))  # Tessera's first, then NVIDIA's


def config_on_command_line(argv: Sequence[str], environ: Mapping[str, str]) -> str | None:
    """The config a ``tessera run`` command line names, read before its parser is even built, so that the checker
    (the longest step of a start) starts first: ``--config`` (or ``TESSERA_CONFIG``), else NVIDIA's
    ``--config-file`` (or ``CONFIG_FILE``), spelled in full, the last one given winning, as argparse reads them.
    A guess that cannot be wrong in effect: the agent takes the check only for the path its parsed options name
    (:func:`agent.run.take_over` stops it otherwise), so an abbreviated flag only costs the early start."""
    if not argv or argv[0] != "run":
        return None
    given: dict[str, str] = {}
    words = iter(argv[1:])
    for word in words:
        if word == "--":
            break
        flag, equals, value = word.partition("=")
        if any(flag == name for name, _ in CONFIG_FLAGS):
            given[flag] = value if equals else next(words, "")
    for flag, env in CONFIG_FLAGS:
        path = given.get(flag) or environ.get(env)
        if path:
            return path
    return None


def stamp(path: str | os.PathLike[str]) -> object:
    """What changes when the config at ``path`` may have: the identity, size and time of each file it is read
    from (a mounted ConfigMap's ``..data`` link moves on each update). Cheap: a few ``stat`` calls."""

    def of(p: str) -> tuple[int, int, int, int] | None:
        try:
            st = os.stat(p)
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    folder = os.fspath(path)
    if not os.path.isdir(folder):
        return ("file", of(folder))
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return ("dir", None)
    try:
        link: str | None = os.readlink(os.path.join(folder, "..data"))
    except OSError:  # no ..data link (a plain directory), or it is being swapped
        link = None
    return ("dir", link, tuple((name, of(os.path.join(folder, name))) for name in names))


class EarlyCheck:
    """The checker forked at the very start: its child, the config path, the files' stamp taken just before the
    fork (a change while it reads is then seen as one) and when it started (its deadline counts from there)."""

    def __init__(self, path: str, taken: object, started: float, child: ForkedChecker) -> None:
        self.path = path
        self.stamp = taken
        self.started = started
        self.child = child


def fork_early(argv: Sequence[str], environ: Mapping[str, str]) -> EarlyCheck | None:
    """The checker of the config ``argv`` (the process's own command line, without the program) names, forked
    now; None when it names none, when this process may not fork (another thread runs) or the fork fails — the
    agent then starts its checker as it would for a reload."""
    path = config_on_command_line(argv, environ)
    if path is None:
        return None
    from agent.config.forked import ForkedChecker, can_fork

    if not can_fork():
        return None
    taken, started = stamp(path), time.monotonic()
    try:
        return EarlyCheck(path, taken, started, ForkedChecker(path))
    except OSError:
        return None
