"""Hot reload: the ConfigMap directory changes the way the kubelet changes it (an atomic ``..data`` swap).

The agent runs in-process against a simulated node and the kubelet emulator; the test swaps the config
and watches what the kubelet sees: new resources appear, removed ones disappear, an unchanged resource's
ListAndWatch stream is not interrupted, and a broken config changes nothing.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.agent import Agent, AgentOptions
from agent.config.labels import CONFIG_LABEL, NodeLabelChanged
from agent.sim.kubelet import KubeletEmulator

NODE = {
    "name": "reload",
    "gpus": [
        {"model": "A100-SXM4-80GB", "mig": {"instances": ["1g.10gb", "1g.10gb"]}},
        {"model": "A100-SXM4-80GB", "count": 2},
    ],
}
MIXED = "version: v1\nflags:\n  migStrategy: mixed\n"
SHARED_GPUS = MIXED + (
    "sharing:\n  timeSlicing:\n    renameByDefault: true\n"
    "    resources:\n      - name: nvidia.com/gpu\n        replicas: 4\n"
)
BROKEN = MIXED + "sharing:\n  timeSlicing:\n    resources:\n      - name: nvidia.com/gpu\n        replicas: 1\n"
SHARED_MIG = MIXED + (
    "sharing:\n  timeSlicing:\n    resources:\n      - name: nvidia.com/mig-1g.10gb\n        replicas: 2\n"
    "        rename: nvidia.com/small\n"
)


class ConfigMapDir:
    """A directory laid out like a mounted ConfigMap: <key> -> ..data/<key>, ..data -> ..<timestamp>/."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.generation = 0
        root.mkdir()

    def publish(self, documents: dict[str, str]) -> None:
        self.generation += 1
        version = self.root / f"..2026_11_21_00_00_{self.generation:02d}"
        version.mkdir()
        for key, text in documents.items():
            (version / key).write_text(text)
        staging = self.root / "..data_tmp"
        staging.symlink_to(version.name)
        os.replace(staging, self.root / "..data")  # the atomic swap
        for key in documents:
            link = self.root / key
            if not link.is_symlink():
                link.symlink_to(f"..data/{key}")
        for stale in self.root.iterdir():
            if stale.is_symlink() and stale.name not in documents and not stale.name.startswith(".."):
                stale.unlink()


@pytest.fixture
def world(sim_node) -> Iterator[tuple[KubeletEmulator, ConfigMapDir, Callable[..., Agent]]]:
    sim_node(NODE)
    base = Path(tempfile.mkdtemp(prefix="r", dir="/tmp"))
    kubelet = KubeletEmulator(base / "dp")
    kubelet.start()
    configmap = ConfigMapDir(base / "cm")
    running: list[tuple[Agent, threading.Thread]] = []

    def start(**options: object) -> Agent:
        agent = Agent(AgentOptions(device_plugin_dir=base / "dp", config_path=configmap.root, **options))
        thread = threading.Thread(target=agent.run, name="agent-under-test")
        thread.start()
        running.append((agent, thread))
        assert agent.started.wait(20)
        return agent

    yield kubelet, configmap, start
    for agent, thread in running:
        agent.stop()
        thread.join(timeout=20)
    kubelet.stop()
    shutil.rmtree(base, ignore_errors=True)


def test_a_swapped_configmap_is_applied_without_a_restart(world) -> None:
    kubelet, configmap, start = world
    configmap.publish({"default": MIXED})
    agent = start()
    kubelet.wait_for(lambda: {"nvidia.com/gpu", "nvidia.com/mig-1g.10gb"} <= set(kubelet.resources()), 10, "mixed")
    assert kubelet.capacity("nvidia.com/gpu") == 2
    mig_registrations = kubelet.registrations("nvidia.com/mig-1g.10gb")
    digest = agent.status.config_digest

    configmap.publish({"default": SHARED_GPUS})
    kubelet.wait_for(lambda: kubelet.allocatable("nvidia.com/gpu.shared") == 8, 5, "the shared resource")
    kubelet.wait_for(lambda: kubelet.stopped("nvidia.com/gpu"), 5, "the old resource's stream to end")
    assert all(i.count("::") == 1 for i in kubelet.devices("nvidia.com/gpu.shared"))
    # the MIG resource did not change: same registration, same stream, still healthy
    assert kubelet.registrations("nvidia.com/mig-1g.10gb") == mig_registrations
    assert not kubelet.stopped("nvidia.com/mig-1g.10gb")
    assert kubelet.allocatable("nvidia.com/mig-1g.10gb") == 2
    assert agent.status.config_name == "default" and agent.status.config_error is None
    assert agent.status.config_digest not in (None, digest)  # the new text is the one in force
    assert not (kubelet.device_plugin_dir / "nvidia-gpu.sock").exists()


def test_a_broken_config_changes_nothing_and_a_fix_is_applied(world, caplog: pytest.LogCaptureFixture) -> None:
    kubelet, configmap, start = world
    configmap.publish({"default": SHARED_GPUS})
    agent = start()
    kubelet.wait_for(lambda: kubelet.allocatable("nvidia.com/gpu.shared") == 8, 10, "shared")
    registrations = kubelet.registrations("nvidia.com/gpu.shared")
    digest = agent.status.config_digest

    configmap.publish({"default": BROKEN})
    kubelet.wait_for(lambda: agent.status.config_error is not None, 5, "the broken config to be noticed")
    assert "sharing.timeSlicing.resources[0].replicas" in agent.status.config_error
    assert agent.status.config_digest == digest  # the last good config is still in force
    assert kubelet.allocatable("nvidia.com/gpu.shared") == 8
    assert kubelet.registrations("nvidia.com/gpu.shared") == registrations
    assert sum("config rejected" in r.getMessage() for r in caplog.records) == 1

    configmap.publish({"default": SHARED_MIG})
    kubelet.wait_for(lambda: kubelet.allocatable("nvidia.com/small") == 4, 5, "the fixed config applied")
    assert agent.status.config_error is None
    kubelet.wait_for(lambda: kubelet.stopped("nvidia.com/mig-1g.10gb"), 5, "the renamed MIG resource to go")


def test_the_node_label_chooses_among_named_configs(world) -> None:
    kubelet, configmap, start = world
    configmap.publish({"default": MIXED, "shared": SHARED_GPUS, "small": SHARED_MIG})
    agent = start()
    kubelet.wait_for(lambda: "nvidia.com/mig-1g.10gb" in kubelet.resources(), 10, "the default config")

    agent.post(NodeLabelChanged(CONFIG_LABEL, "small"))
    kubelet.wait_for(lambda: kubelet.allocatable("nvidia.com/small") == 4, 5, "the labelled config")
    assert agent.status.config_name == "small"

    agent.post(NodeLabelChanged(CONFIG_LABEL, "no-such-config"))  # a warning, then the fallbacks
    kubelet.wait_for(lambda: agent.status.config_name == "default", 5, "the fallback to default")
    kubelet.wait_for(lambda: kubelet.allocatable("nvidia.com/mig-1g.10gb") == 2, 5, "the default's MIG resource")
    assert agent.status.config_error is None  # a label naming no config is not an error

    agent.post(NodeLabelChanged(CONFIG_LABEL, "small"))
    kubelet.wait_for(lambda: kubelet.allocatable("nvidia.com/small") == 4, 5, "the labelled config again")
    agent.post(NodeLabelChanged(CONFIG_LABEL, None))  # the label removed: back to the default
    kubelet.wait_for(lambda: agent.status.config_name == "default", 5, "the default once the label is gone")
    kubelet.wait_for(lambda: kubelet.allocatable("nvidia.com/mig-1g.10gb") == 2, 5, "the default's MIG resource")
    kubelet.wait_for(lambda: kubelet.stopped("nvidia.com/small"), 5, "the labelled config's resource to go")
    assert agent.status.config_error is None
