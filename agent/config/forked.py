"""The config checker forked from ``tessera run`` at its very start, instead of a new interpreter.

The check runs beside the agent's own start (PyYAML and the checker's modules load in the child: ~0.06 s), and the
agent waits for
it before its first advertisement. Forked before the agent has started a single thread — by
:mod:`agent.config.early`, before the command line's modules load — the child already holds the interpreter (a
new one would take ~10 ms to start) and does only what ``python -m agent.config.check`` does: check, answer on its
stdout, end. A process with threads must not fork (a lock another thread held stays held in the child), so only
the early check forks, and only in a process that has no other thread; every later check (a reload) starts a new
interpreter (:class:`agent.config.isolated.Check`).

:class:`ForkedChecker` is the part of :class:`subprocess.Popen` that :class:`~agent.config.isolated.Check` uses.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

TYPE_CHECKING = False  # forked first thing (agent.config.early): typing, subprocess and contextlib load later
if TYPE_CHECKING:
    from typing import IO, NoReturn

MAX_WAIT_STEP = 0.05  # without a pidfd, wait() polls the child at most this far apart, as subprocess does


def can_fork() -> bool:
    """Is forking safe here: a POSIX process with no thread but this one."""
    return hasattr(os, "fork") and threading.active_count() == 1


class ForkedChecker:
    """A checker child forked from this process (see the module's docstring)."""

    def __init__(self, path: str) -> None:
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        try:
            pid = os.fork()
        except OSError:
            for fd in (out_read, out_write, err_read, err_write):
                os.close(fd)
            raise
        if pid == 0:
            _check_in_child(path, (out_read, err_read), out_write, err_write)
        os.close(out_write)
        os.close(err_write)
        self.pid = pid
        self.args = [sys.executable, "(forked)", "-m", "agent.config.check", path]
        self.returncode: int | None = None
        self.stdout: IO[bytes] = os.fdopen(out_read, "rb", buffering=0)
        self.stderr: IO[bytes] = os.fdopen(err_read, "rb", buffering=0)

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: it has ended, how is not known
                self.returncode = -1
                return self.returncode
            if pid == self.pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:  # not reaped: the pid is still this child's (a zombie at worst)
            os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        """The exit code; :class:`subprocess.TimeoutExpired` after ``timeout`` seconds (it is asked once the
        child has closed its output, so at its very end). Woken by the child's exit (a pidfd), not by a timer."""
        if self.poll() is None and not self._exited_within(timeout):
            import subprocess

            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        if self.returncode is None:  # it has exited: reap it
            try:
                _, status = os.waitpid(self.pid, 0)
                self.returncode = os.waitstatus_to_exitcode(status)
            except ChildProcessError:  # reaped elsewhere meanwhile
                self.returncode = -1
        assert self.returncode is not None
        return self.returncode

    def _exited_within(self, timeout: float | None) -> bool:
        """Has the child exited within ``timeout`` seconds (None: however long it takes)? Its pidfd (Linux 5.3)
        turns readable at its exit; a kernel without pidfds is asked at most every ``MAX_WAIT_STEP``."""
        if timeout is None:
            return True  # waitpid blocks until it has
        try:
            pidfd = os.pidfd_open(self.pid)
        except (AttributeError, OSError):  # no pidfd here (an older kernel, not Linux)
            return self._polled_exit_within(timeout)
        try:
            import select

            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            return bool(poller.poll(max(0, round(timeout * 1000))))
        finally:
            os.close(pidfd)

    def _polled_exit_within(self, timeout: float) -> bool:
        deadline, step = time.monotonic() + timeout, 0.0005
        while self.poll() is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(step, left))
            step = min(step * 2, MAX_WAIT_STEP)
        return True


def _check_in_child(path: str, parent_ends: tuple[int, int], out: int, err: int) -> NoReturn:
    """The child's whole life: ``python -m agent.config.check <path>`` on the inherited interpreter."""
    code = 1
    try:
        for fd in parent_ends:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        for fd in (null, out, err):
            os.close(fd)
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # the agent's own ^C handling is not the child's
        from agent.config.check import main

        code = main([path])
    except BaseException:
        try:  # its last words, on the stderr the agent reads
            import traceback

            traceback.print_exc()
        except BaseException:  # noqa: S110 - nothing is left to tell it to
            pass
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
