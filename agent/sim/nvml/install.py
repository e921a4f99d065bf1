"""Put the simulated library beneath pynvml, where ``libnvidia-ml.so.1`` would be.

pynvml loads the real library only while its module global ``nvmlLib`` is None, and looks every function
up on that object by name (caching the result). Installing the simulator sets ``nvmlLib`` and clears the
cache, so from then on every pynvml call lands in ``SimulatedNvmlLibrary``; nothing above pynvml changes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pynvml

from agent.sim.nvml.driver import SimDriver
from agent.sim.nvml.libnvml import SimulatedNvmlLibrary
from agent.sim.nvml.spec import NodeSpec, SimSpecError, build_driver, load_node_spec


def install(driver: SimDriver) -> SimulatedNvmlLibrary:
    library = SimulatedNvmlLibrary(driver)
    with pynvml.libLoadLock:
        pynvml.nvmlLib = library
        pynvml._nvmlGetFunctionPointer_cache.clear()
    return library


def uninstall() -> None:
    with pynvml.libLoadLock:
        pynvml.nvmlLib = None
        pynvml._nvmlGetFunctionPointer_cache.clear()
        pynvml._nvmlLib_refcount = 0


@contextmanager
def simulated_node(spec: NodeSpec | str) -> Iterator[SimDriver]:
    """Run the body against a simulated node (a spec, a YAML path or a preset name)."""
    node = load_node_spec(spec) if isinstance(spec, str) else spec
    try:
        driver = build_driver(node)
    except SimSpecError as error:
        raise SimSpecError(f"{spec if isinstance(spec, str) else 'node spec'}: {error}") from error
    install(driver)
    try:
        yield driver
    finally:
        uninstall()
