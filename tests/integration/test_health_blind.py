"""Health while the agent cannot see, inside a running agent with the real NVML event watcher: the simulated
driver's event wait failing on demand, a GPU back from the bus before the watcher has it registered again, a GPU
that falls off the bus without an event reaching the watcher. A device never looks Healthy while nobody could
see it fail, and looks Healthy again once it is watched."""

from __future__ import annotations

import time

from agent.core.health import BACK_UNWATCHED_REASON, GPU_LOST_REASON, HealthPolicy
from agent.sim.nvml.codes import Return
from tests.agent_node import Node, running_node

GPU = "nvidia.com/gpu"
TWO_GPUS = {"name": "blind", "gpus": [{"model": "A100-SXM4-80GB", "count": 2}]}
QUIET = 0.2
QUICK = HealthPolicy(quiet_seconds=QUIET)
WAIT_MS = 100  # one event wait: how soon the watcher takes up a change
REFUSED = "NVML_ERROR_NO_PERMISSION"


def _advertised_healthy(node: Node, uuid: str) -> bool:
    """What the agent advertises for a whole GPU (its snapshot), not what the kubelet has heard yet."""
    snapshot = node.agent.status.resources.get(GPU)
    return snapshot is not None and snapshot.health.get(uuid, False)


def _reason(node: Node, uuid: str) -> str | None:
    fault = node.agent.status.faults.get(uuid)
    return fault.reason if fault else None


def _loop_turned_twice(node: Node) -> None:
    """A ping is answered before the turn's tick: two of them mean a whole turn ran (its recovery checks too)."""
    assert node.agent.responsive() and node.agent.responsive()


def _xid_seen(node: Node, uuid: str, xid: int) -> bool:
    return any(n for (_, gpu, number), n in node.agent.status.xid_counts.items() if (gpu, number) == (uuid, str(xid)))


def test_a_failing_event_wait_keeps_every_gpu_unhealthy_past_the_quiet_period_until_it_works(sim_node) -> None:
    driver = sim_node(TWO_GPUS)
    uuids = [g.uuid for g in driver.gpus]
    with running_node(driver, "version: v1\n", health=QUICK, health_event_wait_ms=WAIT_MS) as node:
        node.wait(lambda: node.healthy_ids(GPU) == set(uuids), "2 GPUs Healthy")

        driver.inject_error("nvmlEventSetWait_v2", Return.ERROR_UNKNOWN, times=None)  # the wait fails throughout
        node.wait(lambda: not node.healthy_ids(GPU), "every GPU Unhealthy at the kubelet")
        assert {u: _reason(node, u) for u in uuids} == dict.fromkeys(uuids, "health watch failed: NVML_ERROR_UNKNOWN")

        since = max(node.agent.status.faults[u].last_event for u in uuids)
        node.wait(lambda: time.monotonic() > since + 3 * QUIET, "three quiet periods")
        _loop_turned_twice(node)
        assert not any(_advertised_healthy(node, u) for u in uuids), "a quiet period cleared a blind GPU"
        assert not node.healthy_ids(GPU)

        driver.clear_injected_errors()  # the wait works again: the watcher says so, and only that clears it
        node.wait(lambda: node.healthy_ids(GPU) == set(uuids), "Healthy once the watch works again")
        driver.inject_xid(1, 48)
        node.wait(lambda: uuids[1] not in node.healthy_ids(GPU), "the XID after the watch came back is seen")
        assert _reason(node, uuids[1]) == "XID 48 (Double Bit ECC Error, WORKFLOW_XID_48)"
        assert uuids[0] in node.healthy_ids(GPU)


def test_a_health_watcher_that_died_while_blind_is_replaced_by_one_that_says_when_it_sees(sim_node) -> None:
    """The new watcher knows nothing of what the dead one reported: the agent tells it which GPUs wait for its word,
    else they would stay Unhealthy for good."""
    driver = sim_node(TWO_GPUS)
    uuids = [g.uuid for g in driver.gpus]
    options = {"health": QUICK, "health_event_wait_ms": WAIT_MS, "liveness_probe_seconds": 0.2}
    with running_node(driver, "version: v1\n", **options) as node:
        node.wait(lambda: node.healthy_ids(GPU) == set(uuids), "2 GPUs Healthy")
        driver.inject_error("nvmlEventSetWait_v2", Return.ERROR_UNKNOWN, times=None)
        node.wait(lambda: not node.healthy_ids(GPU), "every GPU Unhealthy: the watch failed")
        node.agent._event_watcher.stop()  # its thread ends, as if it had died
        driver.clear_injected_errors()
        node.wait(lambda: node.agent.status.internal_errors.get("thread"), "the dead thread noticed")
        node.wait(lambda: node.healthy_ids(GPU) == set(uuids), "Healthy once the new watcher sees them")
        driver.inject_xid(0, 48)
        node.wait(lambda: uuids[0] not in node.healthy_ids(GPU), "an XID seen by the new watcher")


def test_a_gpu_back_from_the_bus_stays_unhealthy_until_the_watcher_registers_it_again(sim_node) -> None:
    driver = sim_node(TWO_GPUS)
    gpu0, gpu1 = (g.uuid for g in driver.gpus)
    with running_node(driver, "version: v1\n", health=QUICK, health_event_wait_ms=WAIT_MS) as node:
        node.wait(lambda: node.healthy_ids(GPU) == {gpu0, gpu1}, "2 GPUs Healthy")
        driver.lose_gpu(1)
        node.wait(lambda: _reason(node, gpu1) == GPU_LOST_REASON, "GPU 1 lost")

        # It answers again, but the driver refuses to register it for events for now.
        driver.inject_error("nvmlDeviceRegisterEvents", Return.ERROR_NO_PERMISSION, times=None, gpu_index=1)
        driver.recover_gpu(1)
        fault = lambda: node.agent.status.faults.get(gpu1)  # noqa: E731
        node.wait(lambda: not (fault() and fault().lost), "the evidence that GPU 1 answers again")
        assert not _advertised_healthy(node, gpu1), "a GPU back from the bus is Healthy before it is watched"
        assert _reason(node, gpu1) in (BACK_UNWATCHED_REASON, f"health watch failed: {REFUSED} (register)")
        _loop_turned_twice(node)
        assert not _advertised_healthy(node, gpu1) and gpu1 not in node.healthy_ids(GPU)
        assert gpu0 in node.healthy_ids(GPU)

        driver.clear_injected_errors()  # registered again: Healthy, and its XIDs are seen
        node.wait(lambda: gpu1 in node.healthy_ids(GPU), "GPU 1 Healthy once watched again")
        driver.inject_xid(1, 48)
        node.wait(lambda: gpu1 not in node.healthy_ids(GPU), "an XID on the GPU back from the bus is seen")
        assert _reason(node, gpu1) == "XID 48 (Double Bit ECC Error, WORKFLOW_XID_48)"


def test_the_liveness_recheck_finds_a_gpu_lost_without_any_event(sim_node) -> None:
    """GPU 1 gives no XID events (registering them is NOT_SUPPORTED: it is unmonitored, Healthy, as on NVIDIA's
    plugin), so when it falls off the bus no Xid 79 and no failing wait reach the watcher: only the liveness
    re-check can find it."""
    driver = sim_node(TWO_GPUS)
    gpu0, gpu1 = (g.uuid for g in driver.gpus)
    driver.inject_error("nvmlDeviceRegisterEvents", Return.ERROR_NOT_SUPPORTED, times=None, gpu_index=1)
    options = {"health": QUICK, "health_event_wait_ms": WAIT_MS, "liveness_probe_seconds": 0.2}
    with running_node(driver, "version: v1\n", **options) as node:
        node.wait(lambda: node.healthy_ids(GPU) == {gpu0, gpu1}, "2 GPUs Healthy")
        driver.lose_gpu(1)
        node.wait(lambda: gpu1 not in node.healthy_ids(GPU), "the silently lost GPU Unhealthy")
        assert _reason(node, gpu1) == GPU_LOST_REASON
        assert not _xid_seen(node, gpu1, 79), "the watcher saw an event: not a test of the re-check"
        assert gpu0 in node.healthy_ids(GPU)

        driver.recover_gpu(1)  # back, and as watched as it ever was (unmonitored): Healthy again
        node.wait(lambda: node.healthy_ids(GPU) == {gpu0, gpu1}, "GPU 1 Healthy again")


def test_the_liveness_recheck_finds_a_gpu_lost_while_the_watch_is_blind(sim_node) -> None:
    """While no event set can be made every GPU is Unhealthy (health watch failed), and the watcher touches no GPU;
    one falling off the bus then is still found, and marked lost: once back it is read again (a reset loses MIG
    instances) before it is offered."""
    driver = sim_node(TWO_GPUS)
    gpu0, gpu1 = (g.uuid for g in driver.gpus)
    options = {"health": QUICK, "health_event_wait_ms": WAIT_MS, "liveness_probe_seconds": 0.2}
    with running_node(driver, "version: v1\n", **options) as node:
        node.wait(lambda: node.healthy_ids(GPU) == {gpu0, gpu1}, "2 GPUs Healthy")
        driver.inject_error("nvmlEventSetCreate", Return.ERROR_UNKNOWN, times=None)
        driver.inject_error("nvmlEventSetWait_v2", Return.ERROR_UNKNOWN, times=1)  # the set in use goes
        node.wait(lambda: _reason(node, gpu1) == "health watch failed: NVML_ERROR_UNKNOWN", "the watch failed")
        driver.lose_gpu(1)
        node.wait(lambda: _reason(node, gpu1) == GPU_LOST_REASON, "GPU 1 found lost by the re-check")
        assert node.agent.status.faults[gpu1].lost
        assert _reason(node, gpu0) == "health watch failed: NVML_ERROR_UNKNOWN"
