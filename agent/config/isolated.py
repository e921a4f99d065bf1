"""The agent's side of the config checker: run :mod:`agent.config.check` in a child process, read its answer
within bounds, and choose this node's config from it — without importing pydantic or PyYAML here.

The child is started with the same interpreter and no shell, as early as the agent knows its config path, and
runs while the agent discovers its GPUs and reads its Node. It is bounded: ``timeout`` seconds and
``MAX_OUTPUT`` bytes of answer. A child that dies, hangs, says too much or answers something that is not the
checked set is a :class:`ConfigError` naming the config path and what went wrong; the agent then keeps its last
good config, as for any invalid config.

A checked set is reused while the files it was read from stay the same (:func:`stamp`): a node label that
picks another config of the same directory needs no new child.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from agent.config.model import ConfigError, ConfigModel
from agent.config.plain_json import PlainJsonError, from_plain
from agent.config.source import ConfigSet, LoadedConfig, Matches, _digest, select_config

log = logging.getLogger(__name__)

TIMEOUT_SECONDS = 30.0  # pydantic builds its models in ~0.1 s; a loaded node may take many times that
MAX_OUTPUT = 32 << 20  # configs are at most 1 MiB each; their models as JSON are a fraction more
MAX_STDERR = 4096  # of what the child said on stderr, the tail kept for the message
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # where this `agent` package is imported from


@dataclass(frozen=True, slots=True)
class Member:
    digest: str
    match: tuple[str, ...] | None
    match_problem: str | None
    model: ConfigModel | None  # None: invalid, see error
    error: ConfigError | None
    warnings: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class CheckedSet:
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


def stamp(path: Path) -> object:
    """What changes when the config at ``path`` may have: the identity, size and time of each file it is read
    from (a mounted ConfigMap's ``..data`` link moves on each update). Cheap: a few ``stat`` calls."""

    def of(p: Path) -> tuple[int, int, int, int] | None:
        try:
            st = p.stat()
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    if not path.is_dir():
        return ("file", of(path))
    try:
        names = sorted(entry.name for entry in path.iterdir())
    except OSError:
        return ("dir", None)
    try:
        link: str | None = str((path / "..data").readlink())
    except OSError:  # no ..data link (a plain directory), or it is being swapped
        link = None
    return ("dir", link, tuple((name, of(path / name)) for name in names))


class CheckerFailed(ConfigError):
    """The checker itself failed (could not start, died, hung, answered garbage): nothing is known about the config,
    so the agent tries again with backoff rather than wait for the files to change."""


class Check:
    """One run of the checker on ``path``, started at once; :meth:`result` waits for it (bounded)."""

    def __init__(
        self,
        path: Path,
        *,
        timeout: float = TIMEOUT_SECONDS,
        max_output: int = MAX_OUTPUT,
        command: Sequence[str] | None = None,
    ) -> None:
        """``command``: the checker's command line without the path (default: this interpreter running
        :mod:`agent.config.check`); tests give others, to see what a broken checker does to the agent."""
        self.path = path
        self.stamp = stamp(path)
        self._started = time.monotonic()
        self._deadline = self._started + timeout
        self._timeout = timeout
        self._max_output = max_output
        self._result: CheckedSet | ConfigError | None = None
        self._cancelled = False
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        try:
            self._process: subprocess.Popen[bytes] | None = subprocess.Popen(  # our interpreter, no shell
                [*(command or (sys.executable, "-m", "agent.config.check")), str(path)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
            )
        except OSError as error:
            self._process = None
            self._result = self._error(f"the config checker could not start: {error.strerror or error}")

    def result(self) -> CheckedSet:
        """The checked set; ``ConfigError`` naming the path when the set or the checker failed."""
        if self._result is None:
            waiting = time.monotonic()
            try:
                self._result = self._collect()
            except Exception as error:  # a read nobody foresaw: this check's failure, not its caller's
                self.cancel()
                self._result = self._error(f"the config checker could not be read: {type(error).__name__}: {error}")
            log.debug(
                "config checked path=%s took_ms=%.0f waited_ms=%.0f", self.path,
                (time.monotonic() - self._started) * 1000, (time.monotonic() - waiting) * 1000,
            )  # fmt: skip
        if isinstance(self._result, ConfigError):
            raise self._result
        return self._result

    def cancel(self) -> None:
        """Kill the child if it still runs (a newer change supersedes it, or the agent stops); its result is
        then a ``ConfigError`` saying so."""
        self._cancelled = True
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    # ----- reading the child ----------------------------------------------------------------------

    def _error(self, what: str) -> CheckerFailed:
        return CheckerFailed(str(self.path), [f"{what}; the last good config stays in force"])

    def _collect(self) -> CheckedSet | ConfigError:
        process = self._process
        assert process is not None and process.stdout is not None and process.stderr is not None
        out, err = bytearray(), bytearray()
        with selectors.DefaultSelector() as selector:
            selector.register(process.stdout, selectors.EVENT_READ, out)
            selector.register(process.stderr, selectors.EVENT_READ, err)
            while selector.get_map():
                left = self._deadline - time.monotonic()
                if left <= 0:
                    self.cancel()
                    return self._error(f"the config checker gave no answer within {self._timeout:g} s")
                for key, _ in selector.select(timeout=left):
                    chunk = os.read(key.fd, 1 << 16)
                    if not chunk:
                        selector.unregister(key.fileobj)
                        continue
                    key.data.extend(chunk)
                    if len(err) > MAX_STDERR:
                        del err[: len(err) - MAX_STDERR]
                if len(out) > self._max_output:
                    self.cancel()
                    return self._error(f"the config checker's answer is larger than {self._max_output >> 20} MiB")
        try:
            code = process.wait(timeout=max(0.0, self._deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.cancel()
            return self._error(f"the config checker did not exit within {self._timeout:g} s")
        finally:
            process.stdout.close()
            process.stderr.close()
        if code != 0 and self._cancelled:
            return self._error("the config check was stopped before it answered")
        if code != 0:
            said = err.decode(errors="replace").strip().splitlines()
            return self._error(f"the config checker failed (exit code {code}){': ' + said[-1] if said else ''}")
        try:
            return self._decode(json.loads(out))
        except (ValueError, RecursionError, PlainJsonError, KeyError, TypeError, AttributeError) as error:
            return self._error(f"the config checker's answer is not a checked config set: {str(error)[:200]}")

    def _decode(self, answer: object) -> CheckedSet | ConfigError:
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
        return CheckedSet(config_set, members, self.stamp)


def start_early(path: str | None) -> Check | None:
    """The checker on the config ``tessera run`` was given, started before the agent is even imported (it runs
    while the agent loads); None without a config. The agent uses it only if its options name the same path."""
    return Check(Path(path)) if path else None


def _config_error(value: object) -> ConfigError:
    origin = from_plain(str, value["origin"], "error.origin")  # type: ignore[index]
    return ConfigError(origin, from_plain(list[str], value["problems"], "error.problems"))  # type: ignore[index]
