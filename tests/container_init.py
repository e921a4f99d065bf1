"""A container, as far as its processes go: when its main process ends, everything started inside ends too.

    python tests/container_init.py --pid-file FILE -- COMMAND [ARG...]

When a container's main process exits, the runtime kills every process left in the container's cgroup
(runc kills them all; with a PID namespace of its own, the kernel does when its init dies). So a daemon that
double-forks out of the agent's process tree still dies with the agent's container — which is why MPS
daemons need a container of their own to outlive the agent. Tests cannot create cgroups here, so this init
stands in: it makes itself a child subreaper (``PR_SET_CHILD_SUBREAPER``), so that every orphan started
inside — a double-forked daemon included — is re-parented to it rather than to the host's init, runs
COMMAND as its main process (its PID in FILE), passes SIGTERM and SIGINT on to it like a runtime stopping
the container, and when the main process has ended SIGKILLs and reaps everything left, then exits with the
main process's status. SIGKILL the main process to emulate a crash or an OOM kill of the container.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36


def _children() -> list[int]:
    """Live processes whose parent is this init (orphans re-parented here included)."""
    me = os.getpid()
    found = []
    for task in Path(f"/proc/{me}/task").iterdir():
        try:
            found += [int(pid) for pid in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def _kill_everything_left() -> None:
    """SIGKILL every process left, reap one, repeat: orphans of the killed come to this init in turn."""
    while True:
        for pid in _children():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:  # nobody left
            return


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[0] != "--pid-file" or argv[2] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    pid_file, command = Path(argv[1]), argv[3:]
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    main_pid = os.fork()
    if main_pid == 0:
        os.execvp(command[0], command)
    pid_file.write_text(f"{main_pid}\n")
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda received, _: os.kill(main_pid, received))
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == main_pid:
            break
    _kill_everything_left()
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
