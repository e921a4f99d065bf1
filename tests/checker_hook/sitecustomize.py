"""A test's hold on the config checker child (``python -m agent.config.check``), outside the project's code.

A test puts this directory on ``PYTHONPATH`` (the agent's checker children inherit it) and names a file in
``CHECKER_HOOK``. Python imports this module at the start of each child; in a config checker, and only while that
file exists, the first child to take it (an atomic rename to ``<file>.<pid>``: the test learns the pid) does what
it says: ``hang SECONDS`` (a checker that hangs) or ``exit CODE`` (a checker that dies). Every other Python
process, and every checker once the file is taken, runs untouched.
"""

import os
import sys
import time

_flag = os.environ.get("CHECKER_HOOK")
if _flag and sys.orig_argv[1:3] == ["-m", "agent.config.check"]:
    _taken = f"{_flag}.{os.getpid()}"
    try:
        os.rename(_flag, _taken)
    except OSError:
        pass  # no hold asked, or another child took it
    else:
        with open(_taken) as _file:
            _action, _, _value = _file.read().strip().partition(" ")
        if _action == "hang":
            time.sleep(float(_value))
        elif _action == "exit":
            print("checker hook: told to fail", file=sys.stderr, flush=True)
            os._exit(int(_value))  # site would catch a SystemExit raised here
