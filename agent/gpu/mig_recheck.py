"""MIG changes no event announces: ``nvidia-smi -r`` destroys every MIG device, ``nvidia-smi mig -cgi/-dgi`` makes or
destroys them by hand, and neither sends an event. The slow liveness re-check compares each MIG-capable GPU's MIG
mode and devices with what the inventory says, and names the GPUs to read again.

A difference that stays after a read (a device the inventory leaves out, say of a profile the installed
nvidia-ml-py cannot describe) is not read again and again: only a new difference is.
"""

from __future__ import annotations

from collections.abc import Iterable

from agent.core.inventory import Gpu
from agent.gpu.discovery import MigNow, mig_now


class MigRecheck:
    def __init__(self) -> None:
        # per MIG-capable GPU, the inventory's MIG and the driver's, as the last re-check compared them
        self._compared: dict[str, tuple[MigNow, MigNow]] = {}

    def differing(self, gpus: Iterable[Gpu]) -> frozenset[str]:
        """The UUIDs of the GPUs whose MIG mode or devices differ from the inventory's (newly); a GPU that does not
        answer (lost) keeps its last reading."""
        capable = [g for g in gpus if g.mig_capable]
        read = mig_now([g.uuid for g in capable]) if capable else {}
        differ = []
        for gpu in capable:
            if gpu.uuid not in read:
                continue
            compared = (MigNow(gpu.mig_enabled, frozenset(m.uuid for m in gpu.mig_devices)), read[gpu.uuid])
            if compared[0] != compared[1] and compared != self._compared.get(gpu.uuid):
                differ.append(gpu.uuid)
            self._compared[gpu.uuid] = compared
        return frozenset(differ)
