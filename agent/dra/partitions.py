"""The MIG devices of dynamic-MIG claims: created by Prepare at the allocated placement, destroyed by Unprepare.

Only what the checkpoint records is ever destroyed, and only while no process runs on it: a MIG device someone
else made is never touched, even at a placement a claim was allocated (that claim gets an error naming it). The
NVML work is ``agent.gpu.mig``'s; the process check is ``agent.gpu.processes``'s (unknown counts as busy).
"""

from __future__ import annotations

import logging

from msgspec.structs import replace

from agent.core.dra.checkpoint import CreatedMig
from agent.core.inventory import Placement
from agent.gpu.mig import (
    MigModeState,
    MigOperationError,
    create_partition,
    destroy_partition,
    gpu_instance_at,
    mig_instance,
    mig_mode_state,
    switch_mig_mode,
)
from agent.gpu.processes import ProcessesUnknown, device_processes

log = logging.getLogger(__name__)


class PartitionError(RuntimeError):
    """A MIG device could not be created or destroyed; the message says which, where and why."""


class MigModeBusy(PartitionError):
    """A GPU's MIG mode cannot change now (something holds the GPU); a later attempt may succeed."""


def describe(mig: CreatedMig) -> str:
    last = mig.start + mig.size - 1
    return f"GPU-instance profile {mig.profile_id} at memory slices {mig.start}-{last} of {mig.gpu_uuid}"


class NvmlPartitions:
    def create(self, mig: CreatedMig) -> CreatedMig:
        """Create the MIG device ``mig`` stands for; the record with its IDs and UUID."""
        where = describe(mig)
        try:
            existing = gpu_instance_at(mig.gpu_uuid, mig.profile_id, mig.start)
            if existing is not None:
                raise PartitionError(
                    f"{where}: GPU instance {existing} is already there and Tessera did not create it for this "
                    "claim; it is left alone (the GPU is in dynamic-MIG mode: create no MIG devices on it by hand)"
                )
            made = create_partition(mig.gpu_uuid, mig.profile_id, Placement(mig.start, mig.size))
        except MigOperationError as error:
            if error.error == "INSUFFICIENT_RESOURCES":
                raise PartitionError(
                    f"{where}: the placement overlaps a MIG device that exists (made outside Tessera, or not yet "
                    "destroyed after its claim); nothing was created"
                ) from error
            raise PartitionError(f"{where}: {error}") from error
        log.info(
            "MIG device created for a claim gpu=%s gi=%d ci=%d uuid=%s", mig.gpu_uuid, made.gi_id, made.ci_id, made.uuid
        )
        return replace(mig, gi_id=made.gi_id, ci_id=made.ci_id, uuid=made.uuid)

    def destroy(self, mig: CreatedMig) -> None:
        """Destroy what ``mig`` records, if it still exists and no process runs on it; ``PartitionError`` if not.

        A record without IDs (an agent that died between creating and recording) is found by its placement."""
        where = describe(mig)
        try:
            gi_id = mig.gi_id if mig.gi_id is not None else gpu_instance_at(mig.gpu_uuid, mig.profile_id, mig.start)
            if gi_id is None:
                return  # never created, or gone with a GPU reset
            instance = mig_instance(mig.gpu_uuid, gi_id)
            if instance is None:
                return
            if mig.uuid is not None and instance.uuid != mig.uuid:
                log.warning("MIG device at a recorded placement is not the one recorded; left alone %s", where)
                return  # destroyed and re-made by someone else: not ours any more
            busy = device_processes([instance.uuid])[instance.uuid]
            if busy:
                raise PartitionError(
                    f"{where} ({instance.uuid}): processes {', '.join(map(str, busy))} still run on it; "
                    "it is destroyed once they end"
                )
            destroy_partition(mig.gpu_uuid, gi_id)
        except ProcessesUnknown as error:
            raise PartitionError(
                f"{where}: cannot tell whether processes run on it ({error}); left in place"
            ) from error
        except MigOperationError as error:
            raise PartitionError(f"{where}: {error}") from error
        log.info("MIG device of a claim destroyed gpu=%s gi=%d", mig.gpu_uuid, gi_id)

    def mig_mode(self, gpu_uuid: str) -> MigModeState:
        try:
            return mig_mode_state(gpu_uuid)
        except MigOperationError as error:
            raise PartitionError(str(error)) from error

    def set_mig_mode(self, gpu_uuid: str, enabled: bool) -> None:
        """Turn the GPU's MIG mode on or off now; ``PartitionError`` when it refuses or would wait for a reset."""
        mode = "on" if enabled else "off"
        try:
            in_force = switch_mig_mode(gpu_uuid, enabled)
        except MigOperationError as error:
            if error.error == "IN_USE":
                raise MigModeBusy(f"GPU {gpu_uuid}: MIG mode cannot be turned {mode}: {error}") from error
            raise PartitionError(f"GPU {gpu_uuid}: MIG mode cannot be turned {mode}: {error}") from error
        if not in_force:
            raise MigModeBusy(
                f"GPU {gpu_uuid}: MIG mode would be turned {mode} only at the next GPU reset (a process or another "
                "client holds the GPU); the request was withdrawn"
            )
        log.info("MIG mode turned %s for dynamic MIG gpu=%s", mode, gpu_uuid)
