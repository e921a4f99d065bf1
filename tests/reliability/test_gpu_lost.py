"""Scenario 5: a GPU falls off the bus mid-run and comes back; only its devices change health, and a GPU that
comes back without its MIG instances never has them advertised again."""

from __future__ import annotations

import time

import pytest

from .conftest import sim_uuids, summary_ms
from .nodes import SMALL_NODE, SMALL_RESOURCES

GPU = "nvidia.com/gpu"


def _health(node) -> dict[str, dict[str, str]]:
    return {r: node.kubelet.devices(r) for r in SMALL_RESOURCES}


def _advertised(node) -> set[str]:
    return {d for r in node.kubelet.resources() if not node.kubelet.stopped(r) for d in node.kubelet.devices(r)}


def _ids(by_resource: dict[str, set[str]]) -> set[str]:
    return set().union(*by_resource.values())


@pytest.mark.parametrize("cycles", [pytest.param(3, id="ci"), pytest.param(20, id="long", marks=pytest.mark.long)])
def test_lost_gpu_goes_unhealthy_and_comes_back_others_unaffected(make_node, figures, cycles: int) -> None:
    node = make_node(SMALL_NODE, None, "--mig-strategy", "mixed", "--health-recovery-seconds", "0.5")
    kubelet = node.kubelet
    node.wait_registered(SMALL_RESOURCES)
    before = _health(node)
    uuids = sim_uuids(SMALL_NODE)
    lost_times, found_times, pods = [], [], 0
    # A whole GPU, every cycle; then, last, the MIG GPU — which a real node brings back without its MIG
    # instances (a reset destroys them): its old MIG devices must never be advertised again.
    for cycle, gpu in [*((c, 3) for c in range(cycles)), (cycles, 0)]:
        own = {r: {d for d in ids if d.split("::")[0] in uuids[gpu]} for r, ids in before.items()}
        others = {r: set(ids) - own[r] for r, ids in before.items()}
        started = time.monotonic()
        node.control.call("lose_gpu", gpu=gpu)
        kubelet.wait_for(
            lambda: all(kubelet.devices(r)[d] == "Unhealthy" for r, ds in own.items() for d in ds),  # noqa: B023
            timeout=10,
            what=f"GPU {gpu} devices Unhealthy",
        )
        lost_times.append(time.monotonic() - started)
        assert all(kubelet.devices(r)[d] == "Healthy" for r, ds in others.items() for d in ds)
        name = f"during-loss-{cycle}-{gpu}"  # the rest keep serving
        kubelet.create_pod(name, {"main": {GPU: 1}})
        kubelet.delete_pod(name)
        pods += 1
        started = time.monotonic()
        node.control.call("recover_gpu", gpu=gpu)
        if gpu == 3:
            kubelet.wait_for(lambda: _health(node) == before, timeout=15, what=f"GPU {gpu} Healthy again")
        else:
            vanished = _ids(own)
            kubelet.wait_for(lambda: not _advertised(node) & vanished, timeout=15, what="old MIG devices gone")  # noqa: B023
            assert all(kubelet.devices(r)[d] == "Healthy" for r, ds in others.items() for d in ds)
        found_times.append(time.monotonic() - started)
    assert node.process.poll() is None
    figures.update(
        cycles=cycles,
        losses=len(lost_times),
        lost_to_unhealthy=summary_ms(lost_times),
        recovered_to_healthy=summary_ms(found_times),
        pods_served_during_loss=pods,
    )
