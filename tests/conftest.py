"""Shared fixtures: a simulated node installed beneath pynvml for the duration of one test."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from agent.sim.driver import SimDriver
from agent.sim.install import install, uninstall
from agent.sim.spec import build_driver, load_node_spec, parse_node_spec


@pytest.fixture
def sim_node() -> Iterator[Callable[[object], SimDriver]]:
    """Install a simulated node: ``sim_node("dgx-a100")`` or ``sim_node({"gpus": [...]})``.

    The agent code under test then reaches it through real pynvml, exactly as it would reach a GPU.
    """

    def make(spec: object) -> SimDriver:
        node = load_node_spec(spec) if isinstance(spec, str) else parse_node_spec(spec)
        driver = build_driver(node)
        install(driver)
        return driver

    yield make
    uninstall()
