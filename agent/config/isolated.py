"""The agent's side of the config checker: run :mod:`agent.config.check` in a child process, read its answer
within bounds — without importing PyYAML or the config's schema here. What the answer means (the checked set and
the choice of this node's config) is :mod:`agent.config.checked`, loaded once the child has answered: this module
imports nothing of the agent's config, so ``tessera run`` starts the child before it loads anything else.

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
from pathlib import Path
from typing import TYPE_CHECKING

from agent.config.early import stamp
from agent.config.errors import ConfigError

if TYPE_CHECKING:
    from agent.config.checked import CheckedSet
    from agent.config.early import EarlyCheck
    from agent.config.forked import ForkedChecker

log = logging.getLogger(__name__)

TIMEOUT_SECONDS = 30.0  # a check takes ~0.06 s; a loaded node may take many times that
MAX_OUTPUT = 32 << 20  # configs are at most 1 MiB each; their models as JSON are a fraction more
MAX_STDERR = 4096  # of what the child said on stderr, the tail kept for the message
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # where this `agent` package is imported from


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
        early: EarlyCheck | None = None,
    ) -> None:
        """``command``: the checker's command line without the path (default: this interpreter running
        :mod:`agent.config.check`); tests give others, to see what a broken checker does to the agent.
        ``early``: the checker :func:`agent.config.early.fork_early` forked on ``path``, taken over as it runs."""
        self.path = path
        self.stamp = stamp(path) if early is None else early.stamp
        self._started = time.monotonic() if early is None else early.started
        self._deadline = self._started + timeout
        self._timeout = timeout
        self._max_output = max_output
        self._result: CheckedSet | ConfigError | None = None
        self._cancelled = False
        if early is not None:
            self._process: subprocess.Popen[bytes] | ForkedChecker | None = early.child
            return
        try:
            self._process = _start_child(path, command)
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
        from agent.config.checked import decode  # what the answer means: loaded once the child has answered
        from agent.config.plain_json import PlainJsonError

        try:
            return decode(json.loads(out), self.stamp)
        except (ValueError, RecursionError, PlainJsonError, KeyError, TypeError, AttributeError) as error:
            return self._error(f"the config checker's answer is not a checked config set: {str(error)[:200]}")


def _start_child(path: Path, command: Sequence[str] | None) -> subprocess.Popen[bytes]:
    """The checker's child: this interpreter (or ``command``) running :mod:`agent.config.check`, with no shell. (The
    first check of `tessera run` is forked instead, by the entry point: :mod:`agent.config.early`.)"""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    return subprocess.Popen(
        [*(command or (sys.executable, "-m", "agent.config.check")), str(path)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )


def start_early(path: str | None, *, early: EarlyCheck | None = None) -> Check | None:
    """The checker on the config ``tessera run`` was given, started before the agent is even imported (it runs
    while the agent loads); None without a config. The agent uses it only if its options name the same path.
    ``early``: the one the entry point forked already (:mod:`agent.config.early`), taken over; else a new
    interpreter checks ``path`` (the entry point could not fork, or the command line is not the process's own)."""
    if early is not None:
        return Check(Path(early.path), early=early)
    return Check(Path(path)) if path else None
