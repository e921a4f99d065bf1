"""``tessera``: the program's entry point (``python -m agent`` too).

``tessera run`` forks its config checker first (:func:`agent.config.early.fork_early`), before the command line's
modules load, then the command line runs as usual (:func:`agent.cli.main`). This module imports nothing else.
"""

from __future__ import annotations

import os
import sys


def main() -> int:
    from agent.config.early import fork_early

    early = fork_early(sys.argv[1:], os.environ)
    from agent.cli import main as command_line

    return command_line(early=early)
