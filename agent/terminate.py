"""SIGTERM unwinds a foreground command (the demos) like Ctrl-C does, so that it cleans up after itself.

Python's default for SIGTERM ends the process at once: no ``finally`` runs, and a demo's agent, kubelet emulator
and work directory (``/tmp/tessera-demo-*``, ``/tmp/tessera-dra-*``) stay behind. Inside
:func:`terminated_on_sigterm`, SIGTERM raises :class:`Terminated` in the main thread instead; every ``finally`` on
the way stops what it started. ``tessera run`` handles SIGTERM its own way (``agent.run``): it stops the agent.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

EXIT_TERMINATED = 128 + signal.SIGTERM  # the shell's convention for a process ended by SIGTERM: 143


class Terminated(BaseException):
    """SIGTERM arrived. A BaseException, like KeyboardInterrupt, so that no ``except Exception`` on the way
    swallows it."""


@contextlib.contextmanager
def terminated_on_sigterm() -> Iterator[None]:
    """While inside, SIGTERM raises :class:`Terminated` in the main thread; a second SIGTERM during the clean-up
    is ignored (the clean-up finishes). Off the main thread (a command run by a test in a thread) signal handlers
    cannot be set, and nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
