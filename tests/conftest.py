"""Shared fixtures: a simulated node installed beneath pynvml for the duration of one test."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import suppress
from pathlib import Path

import pytest

from agent.sim.nvml.driver import SimDriver
from agent.sim.nvml.install import install, uninstall
from agent.sim.nvml.spec import build_driver, load_node_spec, parse_node_spec


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


@pytest.fixture
def mps_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding ``nvidia-cuda-mps-control``: the MPS control emulator under the real binary's name."""
    directory = tmp_path_factory.mktemp("mps-bin")
    launcher = directory / "nvidia-cuda-mps-control"
    launcher.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m agent.sim.mps.control "$@"\n')
    launcher.chmod(0o755)
    return directory


@pytest.fixture
def nvml_node(sim_node: Callable[[object], SimDriver]) -> Iterator[Callable[[object], SimDriver]]:
    """``nvml_node(spec)``: a simulated node with ``pynvml.nvmlInit`` done; shut down again afterwards."""
    import pynvml

    started = 0

    def start(spec: object) -> SimDriver:
        nonlocal started
        driver = sim_node(spec)
        pynvml.nvmlInit()
        started += 1
        return driver

    yield start
    for _ in range(started):
        with suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()
