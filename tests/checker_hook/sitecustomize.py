"""A test's hold on the config checker child (``python -m agent.config.check``), outside the project's code.

A test puts this directory on ``PYTHONPATH`` (the agent's checker children inherit it) and names a file in
``CHECKER_HOOK``. Python imports this module at the start of each process; in a config checker, and only while that
file exists, the first child to take it (an atomic rename to ``<file>.<pid>``: the test learns the pid) does what
it says: ``hang SECONDS`` (a checker that hangs) or ``exit CODE`` (a checker that dies). A checker is a new
interpreter running ``-m agent.config.check``, or the child ``tessera run`` forks for its first check
(``agent.config.forked``: the only ``os.fork`` of the agent, so any child forked from a ``-m agent`` process).
Every other Python process, and every checker once the file is taken, runs untouched.

``CHECKER_FORK_MODULES`` names a file where a ``-m agent`` process writes the modules it has loaded as it forks
(the parent's, just before the fork): what the forked checker starts with.
"""

import os
import sys
import time

_flag = os.environ.get("CHECKER_HOOK")


def _take() -> None:
    taken = f"{_flag}.{os.getpid()}"
    try:
        os.rename(_flag, taken)
    except OSError:
        return  # no hold asked, or another child took it
    with open(taken) as file:
        action, _, value = file.read().strip().partition(" ")
    if action == "hang":
        time.sleep(float(value))
    elif action == "exit":
        print("checker hook: told to fail", file=sys.stderr, flush=True)
        os._exit(int(value))  # site would catch a SystemExit raised here


if _flag and sys.orig_argv[1:3] == ["-m", "agent.config.check"]:
    _take()
elif _flag and sys.orig_argv[1:3] == ["-m", "agent"]:
    os.register_at_fork(after_in_child=_take)


def _write_modules() -> None:
    with open(os.environ["CHECKER_FORK_MODULES"], "w") as file:
        file.write("\n".join(sorted(sys.modules)))


if os.environ.get("CHECKER_FORK_MODULES") and sys.orig_argv[1:3] == ["-m", "agent"]:
    os.register_at_fork(before=_write_modules)
