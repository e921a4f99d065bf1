"""Time-slicing per claim: the GPU's compute time-slice set for a claim whose config asks for it, reset after.

As NVIDIA's DRA driver does it (facts/dra.md C6): the GPU goes to compute mode DEFAULT (so the claim's
containers can share it) and gets the interval's time-slice through ``nvidia-smi compute-policy``; Unprepare puts
the time-slice back to Default. A compute mode is changed only while no process runs on the GPU; a GPU that
does not support time-slices is left as it is when it is reset (NVIDIA tolerates that too).
"""

from __future__ import annotations

import logging

from agent.gpu.compute_mode import DEFAULT, ComputeModeError, compute_mode, set_compute_mode
from agent.gpu.nvml import NvmlUnavailable
from agent.gpu.processes import ProcessesUnknown, device_processes
from agent.gpu.timeslice import DEFAULT as DEFAULT_TIMESLICE
from agent.gpu.timeslice import TimesliceError, TimesliceNotSupported, set_timeslice

log = logging.getLogger(__name__)


class TimesliceFailed(RuntimeError):
    """The time-slice could not be set or reset; the message names the GPU and why."""


class NvidiaSmiTimeslices:
    def __init__(self, nvidia_smi: str = "nvidia-smi") -> None:
        self._nvidia_smi = nvidia_smi

    def apply(self, gpu_uuid: str, level: int) -> None:
        try:
            if compute_mode(gpu_uuid) != DEFAULT:
                busy = device_processes([gpu_uuid])[gpu_uuid]
                if busy:
                    raise TimesliceFailed(
                        f"GPU {gpu_uuid} is not in compute mode DEFAULT and processes {', '.join(map(str, busy))} "
                        "run on it; its mode is not changed under them"
                    )
                set_compute_mode(gpu_uuid, DEFAULT)
            set_timeslice(self._nvidia_smi, gpu_uuid, level)
        except (TimesliceError, ComputeModeError, ProcessesUnknown, NvmlUnavailable) as error:
            raise TimesliceFailed(str(error)) from error
        log.info("time-slice set for a claim gpu=%s level=%d", gpu_uuid, level)

    def reset(self, gpu_uuid: str) -> None:
        try:
            set_timeslice(self._nvidia_smi, gpu_uuid, DEFAULT_TIMESLICE)
        except TimesliceNotSupported:
            log.info("time-slice not supported, left as it is gpu=%s", gpu_uuid)
        except TimesliceError as error:
            raise TimesliceFailed(str(error)) from error
