"""Recovery only on evidence, inside a running agent: the kubelet sees a device Healthy again only when the
driver says the GPU recovered, and an application-level XID never takes a device away."""

from __future__ import annotations

from agent.core.health import HealthPolicy
from tests.agent_node import Node, running_node

GPU = "nvidia.com/gpu"
TWO_GPUS = {"name": "recovery", "gpus": [{"model": "A100-SXM4-80GB", "count": 2}]}
QUICK = HealthPolicy(quiet_seconds=0.2)


def _healthy(node: Node) -> set[str]:
    return node.healthy_ids(GPU)


def test_a_gpu_that_needs_a_reset_stays_unhealthy_until_the_driver_says_otherwise(sim_node) -> None:
    driver = sim_node(TWO_GPUS)
    sick = driver.gpus[1].uuid
    with running_node(driver, "version: v1\n", health=QUICK) as node:
        node.wait(lambda: len(_healthy(node)) == 2, "2 GPUs")
        driver.set_health_signals(1, recovery_action=1)  # NVML_GPU_RECOVERY_ACTION_GPU_RESET
        driver.inject_xid(1, 48)
        node.wait(lambda: sick not in _healthy(node), "the XID 48 GPU Unhealthy")
        node.wait(lambda: "recovery action GPU_RESET" in _blockers(node, sick), "checked, and blocked")
        assert sick not in _healthy(node), "a GPU that needs a reset came back"
        driver.set_health_signals(1, recovery_action=0)  # reset done: NONE
        node.wait(lambda: sick in _healthy(node), "Healthy once the driver says NONE")


def test_growing_uncorrected_ecc_blocks_recovery_until_it_stops_growing(sim_node) -> None:
    driver = sim_node(TWO_GPUS)
    sick = driver.gpus[0].uuid
    with running_node(driver, "version: v1\n", health=QUICK) as node:
        node.wait(lambda: len(_healthy(node)) == 2, "2 GPUs")
        driver.inject_xid(0, 48)
        node.wait(lambda: sick not in _healthy(node), "Unhealthy")
        node.wait(lambda: node.agent.status.faults[sick].ecc_baseline is not None, "the baseline read")
        driver.set_health_signals(0, ecc_uncorrected=5)  # errors keep coming after the XID
        node.wait(lambda: "uncorrected ECC grew" in _blockers(node, sick), "growth blocks recovery")
        node.wait(lambda: sick in _healthy(node), "Healthy once the count holds still for a quiet period")


def test_an_application_xid_never_takes_the_device_away(sim_node) -> None:
    driver = sim_node(TWO_GPUS)
    with running_node(driver, "version: v1\n", health=QUICK) as node:
        node.wait(lambda: len(_healthy(node)) == 2, "2 GPUs")
        counted = lambda: sum(n for (_, _, xid), n in node.agent.status.xid_counts.items() if xid == "94")  # noqa: E731
        driver.inject_xid(0, 94)  # contained ECC error: RESTART_APP in NVIDIA's catalog (NVIDIA's plugin: Unhealthy)
        node.wait(lambda: counted() == 1, "the XID counted")
        assert len(_healthy(node)) == 2


def _blockers(node: Node, unit: str) -> str:
    fault = node.agent.status.faults.get(unit)
    return "; ".join(fault.blockers) if fault else ""
