"""Choosing the GPU driver: the real one (``local``) or a simulated node beneath pynvml."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

LOCAL = "local"


@contextmanager
def gpu_backend(node: str) -> Iterator[object | None]:
    """Inside the block pynvml talks to the real driver (``local``) or to a simulated node.

    Yields the simulated driver (so a demo or a test can act on the node), or None for the real one.
    """
    if node == LOCAL:
        yield None
        return
    from agent.sim.nvml.install import simulated_node  # only simulated runs import the simulator

    with simulated_node(node) as driver:
        yield driver
