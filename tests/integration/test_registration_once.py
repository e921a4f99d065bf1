"""One Register per resource per kubelet start (issue 24, defect 8).

Against the kubelet's device manager a plugin that registers a resource twice leaves the kubelet holding two
streams for one name; when the older one ends alone (kubelets up to 1.36) it disconnects the newer and the
resource goes unavailable. A kubelet restart gives the agent two reasons to register (its plugin sockets are
deleted, ``kubelet.sock`` comes back as a new file); it must register each resource exactly once with the new
kubelet, and pods must get devices afterwards.

In-process agent on a simulated node (one MIG GPU, two whole GPUs: three resources), the kubelet emulator
counting every Register it accepts. Each order is repeated 20 times: a second Register the agent sends in a round
shows in the count, checked exactly once the round's pods got their devices (a Register sent at once after the
first lands by then) and, should it come later, by the next round's exact count. On the code before this room,
"after-a-kill" and "sockets-deleted-late" fail; the emulator's plain restart did not show the double.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.sim.kubelet import KubeletEmulator
from tests.agent_node import Node, running_node

NODE = {
    "name": "register-once",
    "gpus": [
        {"model": "A100-SXM4-80GB", "mig": {"instances": ["3g.40gb", "1g.10gb", "1g.10gb"]}},
        {"model": "A100-SXM4-80GB", "count": 2},
    ],
}
CONFIG = "version: v1\nflags:\n  migStrategy: mixed\n"
RESOURCES = {"nvidia.com/gpu": 2, "nvidia.com/mig-1g.10gb": 2, "nvidia.com/mig-3g.40gb": 1}
RESTARTS = 20


def _plugin_sockets(kubelet: KubeletEmulator) -> list[Path]:
    return sorted(p for p in kubelet.device_plugin_dir.glob("nvidia-*.sock") if p.is_socket())


def _dead_kubelet_socket(kubelet: KubeletEmulator) -> None:
    """What a killed kubelet leaves behind: ``kubelet.sock`` on disk with nobody listening (a Register is
    refused at once). Bound beside the directory and renamed into place, so it appears in one step."""
    staged = kubelet.device_plugin_dir.parent / "staged-kubelet.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(str(staged))
    os.replace(staged, kubelet.kubelet_socket)


def restart(node: Node) -> None:
    """The emulator's restart: streams end, kubelet.sock goes, every socket in the directory is deleted, a new
    kubelet.sock is served."""
    node.kubelet.restart()


def restart_after_a_kill(node: Node) -> None:
    """A killed kubelet started again: its streams end and its kubelet.sock stays behind (the agent sees a
    kubelet that refuses); the new one deletes every socket, dead kubelet.sock included, and serves a new one."""
    kubelet = node.kubelet
    kubelet.stop()
    node.wait(lambda: not node.agent.status.kubelet_present, "the kubelet seen gone")
    _dead_kubelet_socket(kubelet)
    node.wait(lambda: node.agent.status.kubelet_present, "the dead kubelet's socket seen")
    kubelet.restart()


def restart_then_sockets_deleted_late(node: Node) -> None:
    """The kubelet.sock event first, the plugin sockets' deletion seen after it: the agent registers with the
    new kubelet, then finds its sockets gone and serves them again, which needs no second Register."""
    kubelet = node.kubelet
    inodes = {p.name: p.stat().st_ino for p in _plugin_sockets(kubelet)}
    kubelet.restart()
    _registered_and_allocatable(node)
    for path in _plugin_sockets(kubelet):
        path.unlink()
    node.wait(
        lambda: (
            [p.name for p in _plugin_sockets(kubelet)] == sorted(inodes)
            and all(p.stat().st_ino == inodes[p.name] for p in _plugin_sockets(kubelet))
        ),
        "the same plugin sockets served again",
    )


def _registered_and_allocatable(node: Node) -> None:
    kubelet = node.kubelet
    node.wait(
        lambda: all(
            RESOURCES.keys() <= set(kubelet.resources()) and kubelet.allocatable(r) == n for r, n in RESOURCES.items()
        ),
        "every resource registered and allocatable",
    )


def _pods_get_devices(node: Node, round_: int) -> None:
    kubelet = node.kubelet
    for n, resource in enumerate(RESOURCES):
        name = f"r{round_}-{n}"
        pod = kubelet.create_pod(name, {"main": {resource: 1}})
        assert len(pod.containers["main"][resource].device_ids) == 1
        kubelet.delete_pod(name)


@pytest.mark.parametrize(
    "order",
    [restart, restart_after_a_kill, restart_then_sockets_deleted_late],
    ids=["restart", "after-a-kill", "sockets-deleted-late"],
)
def test_every_kubelet_restart_gets_exactly_one_register_per_resource(sim_node, order: Callable[[Node], None]) -> None:
    with running_node(sim_node(NODE), CONFIG) as node:
        kubelet = node.kubelet
        _registered_and_allocatable(node)
        expected = {r: kubelet.registrations(r) for r in RESOURCES}
        assert expected == dict.fromkeys(RESOURCES, 1)
        for round_ in range(RESTARTS):
            order(node)
            expected = {r: n + 1 for r, n in expected.items()}
            node.wait(
                lambda: all(kubelet.registrations(r) >= n for r, n in expected.items()),  # noqa: B023
                f"every resource registered again after restart {round_ + 1}",
            )
            _registered_and_allocatable(node)
            _pods_get_devices(node, round_)
            counts = {r: kubelet.registrations(r) for r in RESOURCES}
            assert counts == expected, f"restart {round_ + 1}: Register calls per resource {counts}, not {expected}"
        assert node.agent.responsive()
        _pods_get_devices(node, RESTARTS)
        assert {r: kubelet.registrations(r) for r in RESOURCES} == expected
        assert node.agent.status.registered == frozenset(RESOURCES)
