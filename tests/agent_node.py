"""An in-process agent on a simulated node with the kubelet emulator: the harness of the safety tests.

``running_node(driver, config, **options)`` writes the sharing config, starts the kubelet emulator (device
plugin and PodResources) and ``Agent.run`` in a thread, and stops everything at the end — asserting that the
reconcile loop was still alive, because the agent's loop must never end on its own.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from agent.agent import Agent, AgentOptions
from agent.config.watch import ConfigSourceChanged
from agent.sim.kubelet import KubeletEmulator
from agent.sim.nvml.driver import SimDriver


@dataclass
class Node:
    driver: SimDriver
    kubelet: KubeletEmulator
    agent: Agent
    thread: threading.Thread
    base: Path

    @property
    def config(self) -> Path:
        return self.base / "config.yaml"

    def wait(self, predicate: Callable[[], object], what: str, timeout: float = 10.0) -> None:
        """Poll ``predicate`` every 2 ms until it holds; fail after ``timeout`` seconds naming ``what``."""
        deadline = time.monotonic() + timeout
        pace = threading.Event()
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
            pace.wait(0.002)

    def reload(self, text: str | bytes, *, size: int | None = None) -> None:
        """Replace the config atomically (as the kubelet swaps a ConfigMap) and tell the agent at once (what
        its watcher does, without its poll delay). ``size`` makes it a sparse file of that size instead."""
        staged = self.base / "config.staged"
        staged.write_bytes(text.encode() if isinstance(text, str) else text)
        if size is not None:
            os.truncate(staged, size)
        staged.replace(self.config)
        self.agent.post(ConfigSourceChanged())

    def waiting_for(self, operation: str) -> str:
        """Why the agent's disruptive operations (``mig``, ``mps``) wait, as one string."""
        waiting = self.agent.status.waiting_for
        return " | ".join(reason for key, reasons in waiting.items() if key.startswith(operation) for reason in reasons)

    def healthy_ids(self, resource: str) -> set[str]:
        if resource not in self.kubelet.resources():
            return set()
        return {i for i, health in self.kubelet.devices(resource).items() if health == "Healthy"}


@contextmanager
def running_node(driver: SimDriver, config: str | bytes, **options: object) -> Iterator[Node]:
    base = Path(tempfile.mkdtemp(prefix="n", dir="/tmp"))  # unix socket paths are limited to 107 bytes
    (base / "config.yaml").write_bytes(config.encode() if isinstance(config, str) else config)
    kubelet = KubeletEmulator(base / "dp", base / "pr" / "kubelet.sock")
    kubelet.start()
    settings: dict[str, object] = {
        "device_plugin_dir": base / "dp",
        "pod_resources_socket": base / "pr" / "kubelet.sock",
        "config_path": base / "config.yaml",
        **options,
    }
    agent = Agent(AgentOptions(**settings))  # type: ignore[arg-type]
    thread = threading.Thread(target=agent.run, name="agent-under-test")
    thread.start()
    try:
        assert agent.started.wait(20)
        yield Node(driver, kubelet, agent, thread, base)
        assert thread.is_alive(), "the agent's reconcile loop ended by itself"
    finally:
        agent.stop()
        thread.join(timeout=20)
        kubelet.stop()
        shutil.rmtree(base, ignore_errors=True)
