"""MPS daemons outlive the agent's container when a keeper starts them (``tessera mps-keeper``).

Agent and keeper run as the main processes of emulated containers (``tests/container_init.py``): when a
container's main process dies, everything started inside it dies too, as with a real container. MPS clients
are a pod holding a replica and an MPS server started for the client's UID on the daemon.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

from .conftest import Container, Node, mps_daemons, poll
from .nodes import MPS_CONFIG, MPS_NODE, MPS_RESOURCES

RESOURCE = "nvidia.com/gpu"
CLIENT_UID = "1000"


def _node_with_keeper(make_node) -> Node:
    """An MPS node whose agent (not started yet) asks a keeper at <base>/keeper.sock."""
    node = make_node(MPS_NODE, MPS_CONFIG, start=False)
    node.args = (*node.args, "--mps-keeper", str(node.base / "keeper.sock"))
    return node


def _keeper(node: Node) -> Container:
    socket_path = node.base / "keeper.sock"
    command = [sys.executable, "-m", "agent", "mps-keeper", "--socket", str(socket_path)]
    command += ["--mps-root", str(node.mps_root)]
    keeper = Container.start(command, node.base / f"keeper{len(node.containers)}.log", node.env)
    node.containers.append(keeper)
    poll(socket_path.exists, 30, "the keeper serves its socket")
    return keeper


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _client(node: Node, command: str) -> list[str]:
    """``command`` sent to the daemon the way an MPS client reaches it: through its pipe directory."""
    from agent.mps.control import MpsControl

    binary = shutil.which("nvidia-cuda-mps-control", path=node.env["PATH"])
    assert binary is not None
    pipe = node.mps_root / RESOURCE / "pipe"
    return MpsControl(binary, pipe, pipe.parent / "log", ()).commands([command])


def _servers(node: Node) -> list[str]:
    return _client(node, "get_server_list")


def _with_client(node: Node) -> tuple[int, list[str], list[str]]:
    """The node's MPS daemon, with a pod holding a replica and a server running for the pod's UID."""
    node.wait_registered(MPS_RESOURCES)
    (daemon,) = mps_daemons(node.mps_root / RESOURCE / "pipe")
    pod = node.kubelet.create_pod("mps-client", {"main": {RESOURCE: 1}})
    held = pod.containers["main"][RESOURCE].device_ids
    _client(node, f"start_server -uid {CLIENT_UID}")
    servers = _servers(node)
    assert len(servers) == 1
    return daemon, held, servers


def test_the_agent_container_restarts_and_mps_clients_keep_their_server(make_node, figures) -> None:
    node = _node_with_keeper(make_node)
    keeper = _keeper(node)
    node.start_agent(container=True)
    daemon, held, servers = _with_client(node)
    assert _parent(daemon) == keeper.init.pid  # it lives in the keeper's container, not the agent's

    node.container.kill()  # the agent's container ends: a crash, an upgrade, an OOM kill
    assert node.container.init.returncode is not None
    assert mps_daemons(node.mps_root / RESOURCE / "pipe") == [daemon]
    assert _servers(node) == servers  # the client's server still runs

    started = time.monotonic()
    node.start_agent(container=True)
    poll(lambda: "adopted=True" in node.log(), 30, "the new agent adopts the daemon")
    node.wait_registered(MPS_RESOURCES)
    elapsed = time.monotonic() - started
    assert mps_daemons(node.mps_root / RESOURCE / "pipe") == [daemon]
    assert _servers(node) == servers
    assert all(node.kubelet.devices(RESOURCE)[d] == "Healthy" for d in held)
    figures.update(daemon_pid_kept=daemon, new_container_to_registered_ms=round(elapsed * 1000, 1))


def test_without_a_keeper_the_agent_container_takes_its_daemons_with_it(make_node, figures) -> None:
    """What the keeper is for: the same restart with daemons started in the agent's own container."""
    node = make_node(MPS_NODE, MPS_CONFIG, start=False)
    node.start_agent(container=True)
    daemon, _, _ = _with_client(node)
    assert _parent(daemon) == node.container.init.pid

    node.container.kill()
    assert mps_daemons(node.mps_root / RESOURCE / "pipe") == []  # the clients lost their server

    node.start_agent(container=True)
    node.wait_registered(MPS_RESOURCES)
    (new_daemon,) = mps_daemons(node.mps_root / RESOURCE / "pipe")
    assert new_daemon != daemon
    assert "adopted=False" in node.log()
    figures.update(lost_daemon=daemon, new_daemon=new_daemon)


def test_a_keeper_that_is_not_there_yet_is_waited_for(make_node, figures) -> None:
    node = _node_with_keeper(make_node)
    node.start_agent(container=True)
    poll(lambda: "the MPS keeper does not answer" in node.log(), 30, "the agent names the missing keeper")
    assert "tessera-mps-keeper" in node.log()
    assert RESOURCE not in node.kubelet.resources()  # no replica is offered before its daemon has its limits
    assert mps_daemons(node.mps_root / RESOURCE / "pipe") == []

    started = time.monotonic()
    keeper = _keeper(node)
    node.wait_registered(MPS_RESOURCES)
    (daemon,) = mps_daemons(node.mps_root / RESOURCE / "pipe")
    assert _parent(daemon) == keeper.init.pid
    figures.update(keeper_started_to_registered_ms=round((time.monotonic() - started) * 1000, 1))


def test_when_the_keeper_container_ends_the_daemon_is_restarted_through_the_next_keeper(make_node, figures) -> None:
    node = _node_with_keeper(make_node)
    keeper = _keeper(node)
    node.start_agent(container=True)
    daemon, held, _ = _with_client(node)

    keeper.kill()  # the keeper's pod is deleted (OnDelete: an operator's choice): its daemons end with it
    poll(lambda: any(node.kubelet.devices(RESOURCE)[d] == "Unhealthy" for d in held), 30, "replicas Unhealthy")
    assert mps_daemons(node.mps_root / RESOURCE / "pipe") == []

    started = time.monotonic()
    new_keeper = _keeper(node)
    poll(lambda: all(node.kubelet.devices(RESOURCE)[d] == "Healthy" for d in held), 60, "replicas Healthy again")
    (new_daemon,) = mps_daemons(node.mps_root / RESOURCE / "pipe")
    assert new_daemon != daemon and _parent(new_daemon) == new_keeper.init.pid
    figures.update(keeper_back_to_healthy_ms=round((time.monotonic() - started) * 1000, 1))
