"""A GPU's compute time-slice, through ``nvidia-smi compute-policy`` (NVML has no call for it).

The levels are nvidia-smi's and NVIDIA's DRA driver's: 0 Default, 1 Short, 2 Medium, 3 Long. The binary is the
host driver's ``nvidia-smi`` (``--nvidia-smi``, else the one on ``PATH``); it is run without a shell, with only a
GPU UUID and a level, both checked before they reach the command line.
"""

from __future__ import annotations

import re
import subprocess

LEVELS = (0, 1, 2, 3)  # Default, Short, Medium, Long (agent.core.dra.opaque.INTERVALS)
DEFAULT = 0
TIMEOUT_SECONDS = 10.0
NOT_SUPPORTED_EXIT = 3  # nvidia-smi's status for a setting the GPU does not support
_GPU_UUID = re.compile(r"^GPU-[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")


class TimesliceError(RuntimeError):
    """The time-slice could not be set; the message names the GPU, the command's answer and the fix."""


class TimesliceNotSupported(TimesliceError):
    """The GPU does not support setting a time-slice."""


def set_timeslice(nvidia_smi: str, gpu_uuid: str, level: int) -> None:
    """Set the time-slice of the GPU ``gpu_uuid`` to ``level`` (0-3)."""
    if not _GPU_UUID.match(gpu_uuid):
        raise TimesliceError(f"refusing to set a time-slice on {gpu_uuid!r}: not a GPU UUID")
    if type(level) is not int or level not in LEVELS:
        raise TimesliceError(f"refusing time-slice {level!r} for {gpu_uuid}: 0-3 only")
    command = [nvidia_smi, "compute-policy", "-i", gpu_uuid, "--set-timeslice", str(level)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_SECONDS, check=False)
    except FileNotFoundError:
        raise TimesliceError(
            f"cannot set the time-slice of {gpu_uuid}: {nvidia_smi} not found; mount the host driver's nvidia-smi "
            "into the agent's container or give its path with --nvidia-smi"
        ) from None
    except (OSError, subprocess.TimeoutExpired) as error:
        raise TimesliceError(f"cannot set the time-slice of {gpu_uuid}: {nvidia_smi}: {error}") from None
    if done.returncode == 0:
        return
    said = " ".join((done.stderr or done.stdout or "").split())[:300] or f"exit status {done.returncode}"
    kind = TimesliceNotSupported if done.returncode == NOT_SUPPORTED_EXIT else TimesliceError
    raise kind(f"cannot set the time-slice of {gpu_uuid} to {level}: nvidia-smi said: {said}")
