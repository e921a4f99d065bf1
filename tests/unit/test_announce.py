"""What the agent announces as Node Events: the differences between two published statuses."""

from __future__ import annotations

import pytest
from msgspec.structs import replace

from agent.agent import AgentStatus
from agent.core.announce import Announcement, announcements
from agent.core.health import Fault
from agent.core.xid_catalog import XidAction
from agent.gpu.discovery import discover


@pytest.fixture
def status(sim_node) -> AgentStatus:
    sim_node({"gpus": [{"model": "A100-SXM4-80GB", "count": 2, "mig": {"instances": ["3g.40gb"]}}]})
    return AgentStatus(inventory=discover(), config_name="mps-4", config_digest="0123456789abcdef0123")


def reasons(said: list[Announcement]) -> list[str]:
    return [a.reason for a in said]


def test_nothing_changed_is_nothing_said(status):
    assert announcements(status, replace(status)) == []


def test_a_device_going_unhealthy_and_healthy_again_names_the_gpu_the_xid_and_the_action(status):
    gpu = status.inventory.gpus[1]
    fault = Fault("XID 48 (Double Bit ECC Error)", since=1.0, last_event=1.0, xid=48, action=XidAction.RESET_GPU)
    faulty = replace(status, faults={gpu.uuid: fault})
    (said,) = announcements(status, faulty)
    assert (said.type, said.reason, said.action) == ("Warning", "GPUUnhealthy", "MarkUnhealthy")
    assert said.note.startswith(f"GPU 1 ({gpu.uuid}): XID 48 (Double Bit ECC Error); the catalog says RESET_GPU")
    assert announcements(faulty, replace(faulty, faults=dict(faulty.faults))) == []  # the same fault again: quiet
    (healed,) = announcements(faulty, status)
    assert (healed.type, healed.reason) == ("Normal", "GPUHealthy")
    assert "healthy again after XID 48" in healed.note


def test_a_lost_gpu_and_a_mig_device_are_named_as_an_operator_knows_them(status):
    mig = status.inventory.gpus[0].mig_devices[0]
    gpu = status.inventory.gpus[1]
    faults = {
        mig.uuid: Fault("XID 94", 1.0, 1.0, gpu_uuid=mig.parent_uuid),
        gpu.uuid: Fault("lost", 1.0, 1.0, lost=True),
    }
    said = announcements(status, replace(status, faults=faults))
    assert sorted(reasons(said)) == ["GPULost", "GPUUnhealthy"]
    assert any(a.note.startswith(f"MIG device 3g.40gb on GPU 0 ({mig.uuid})") for a in said)


def test_config_applied_and_rejected(status):
    (applied,) = announcements(AgentStatus(), status)
    assert (applied.reason, applied.note) == ("ConfigApplied", "sharing config mps-4 (0123456789ab)")
    rejected = replace(status, config_error="config.yaml: sharing.timeSlicing.resources[0].replicas: must be >= 2")
    (said,) = announcements(status, rejected)
    assert (said.type, said.reason) == ("Warning", "ConfigRejected")
    assert "replicas: must be >= 2; config mps-4 stays in force" in said.note
    assert announcements(rejected, replace(rejected)) == []  # the same rejection is said once


@pytest.mark.parametrize(
    ("state", "reason", "type_"),
    [("pending", "MIGChangePending", "Normal"), ("success", "MIGChangeApplied", "Normal"),
     ("failed", "MIGChangeFailed", "Warning"), ("reset-required", "MIGResetRequired", "Warning")],
)  # fmt: skip
def test_mig_state_changes(status, state, reason, type_):
    (said,) = announcements(status, replace(status, mig_state=state, mig_error="NVML_ERROR_IN_USE on GPU 0"))
    assert (said.type, said.reason) == (type_, reason)
    assert ("NVML_ERROR_IN_USE" in said.note) == (type_ == "Warning")


def test_mps_daemon_restarted_and_failing(status):
    ready = replace(status, mps={"gpu-0": {"state": "ready", "restarts": 0, "error": None}})
    restarted = replace(status, mps={"gpu-0": {"state": "down", "restarts": 1, "error": "exited with status 1"}})
    assert reasons(announcements(ready, restarted)) == ["MPSDaemonRestarted"]
    failing = replace(status, mps={"gpu-0": {"state": "down", "restarts": 0, "error": "cannot set compute mode"}})
    assert reasons(announcements(status, failing)) == ["MPSDaemonFailing"]
    assert announcements(failing, replace(failing)) == []


def test_cordon_and_its_problems(status):
    gpu = status.inventory.gpus[1]
    cordoned = replace(status, cordoned={gpu.uuid: ("tessera.dev/gpu-cordon",)}, cordon_problems=("x: 'GPU-nope' …",))
    said = announcements(status, cordoned)
    assert reasons(said) == ["GPUCordoned", "CordonEntryIgnored"]
    assert said[0].note.startswith(f"GPU 1 ({gpu.uuid}) cordoned by tessera.dev/gpu-cordon")
    assert reasons(announcements(cordoned, status)) == ["GPUUncordoned"]


def test_every_announcement_is_an_event_the_recorder_takes(status):
    """The agent sends announcements to the recorder unchecked: each reason, action and note must pass the
    recorder's validation (CamelCase reason, action of 1-128 bytes)."""
    from agent.core.events import validate_event

    gpu, mig = status.inventory.gpus[1], status.inventory.gpus[0].mig_devices[0]
    faulty = replace(
        status,
        faults={gpu.uuid: Fault("XID 79", 1.0, 1.0, lost=True), mig.uuid: Fault("XID 94", 1.0, 1.0)},
        config_error="bad",
        mps={"k": {"state": "down", "restarts": 1, "error": "x"}, "j": {"state": "down", "restarts": 0, "error": "y"}},
        cordoned={gpu.uuid: ("tessera.dev/gpu-cordon",)},
        cordon_problems=("p",),
    )
    said = announcements(AgentStatus(), faulty) + announcements(faulty, status)
    said += [a for state in ("pending", "applying", "success", "failed", "reset-required")
             for a in announcements(status, replace(status, mig_state=state, mig_error="e"))]  # fmt: skip
    assert len({a.reason for a in said}) >= 14
    for announcement in said:
        validate_event(announcement.type, announcement.reason, announcement.action, announcement.note)


def test_a_memory_limit_fallback_is_announced_once_not_per_container(status):
    from agent.core.memlimits import ContainerRef, Enforcement
    from agent.memlimits.manager import HeldLimit

    gpu = status.inventory.gpus[1]
    why = "the driver has no nvmlDeviceSetMemoryLimits_v1 (it needs r615 or newer); the MPS server's default holds it"

    def held(pod: str, how: Enforcement = Enforcement.MPS) -> HeldLimit:
        return HeldLimit(ContainerRef("ns", pod, "main"), gpu.uuid, gpu.index, 10 << 30, 10 << 30, how, why)

    one = replace(status, memory_limits=(held("a"),))
    (said,) = announcements(status, one)
    assert (said.type, said.reason, said.action) == ("Warning", "MemoryLimitFallback", "LimitMemory")
    assert f"GPU 1 ({gpu.uuid})" in said.note and "(mps), not the driver: the driver has no" in said.note
    assert announcements(one, replace(status, memory_limits=(held("a"), held("b")))) == []  # a second container
    driver = replace(status, memory_limits=(held("a", Enforcement.DRIVER),))
    assert announcements(status, driver) == []  # the driver holds it: nothing to say
