"""Dynamic MIG's MIG-mode switch through real pynvml on the simulated driver (``agent.dra.partitions``): NVML's
``nvmlDeviceSetMigMode`` returns an activation status rather than failing, so a request the driver would only apply
at a reset must be withdrawn, never left pending for someone's later reset."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from agent.dra.partitions import MigModeBusy, NvmlPartitions
from agent.sim.nvml.driver import SimDriver

HOPPER = {"gpus": [{"model": "H100-SXM5-80GB"}]}


def test_mig_mode_turns_on_and_off_on_an_idle_hopper(sim_node: Callable[[object], SimDriver]) -> None:
    driver = sim_node(HOPPER)
    uuid = driver.gpus[0].uuid
    partitions = NvmlPartitions()
    before = partitions.mig_mode(uuid)
    assert (before.enabled, before.architecture, before.mig_devices) == (False, "Hopper", 0)
    partitions.set_mig_mode(uuid, True)
    assert driver.gpus[0].mig_current and partitions.mig_mode(uuid).enabled
    partitions.set_mig_mode(uuid, False)
    assert not driver.gpus[0].mig_current


def test_a_change_the_driver_would_leave_pending_is_withdrawn(sim_node: Callable[[object], SimDriver]) -> None:
    driver = sim_node(HOPPER)
    uuid = driver.gpus[0].uuid
    driver.add_process(0, 777, 256)  # the driver answers IN_USE as the activation status: pending until a reset
    with pytest.raises(MigModeBusy, match="only at the next GPU reset"):
        NvmlPartitions().set_mig_mode(uuid, True)
    assert (driver.gpus[0].mig_current, driver.gpus[0].mig_pending) == (False, False)  # no reset turns it on later
