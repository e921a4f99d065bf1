"""NVML sessions and error names, shared by every module that talks to the driver."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pynvml

NVMLError = pynvml.NVMLError

_NAME_BY_CODE: dict[int, str] = {
    value: name.removeprefix("NVML_ERROR_")
    for name, value in vars(pynvml).items()
    if name.startswith("NVML_ERROR_") and isinstance(value, int)
}


def error_name(error: pynvml.NVMLError) -> str:
    """The NVML error's constant name without its prefix, e.g. ``GPU_IS_LOST``."""
    return _NAME_BY_CODE.get(error.value, f"UNKNOWN_{error.value}")


def is_error(error: pynvml.NVMLError, *names: str) -> bool:
    return error_name(error) in names


class NvmlUnavailable(RuntimeError):
    """NVML could not be initialised: no driver, no library, or no permission."""


@contextmanager
def nvml_session() -> Iterator[None]:
    """``nvmlInit`` ... ``nvmlShutdown``; NVML is reference counted, so sessions may nest."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        hint = {
            "LIBRARY_NOT_FOUND": "libnvidia-ml.so.1 was not found: is the NVIDIA driver installed and mounted "
            "into the container (the NVIDIA container runtime, runtimeClassName: nvidia)?",
            "DRIVER_NOT_LOADED": "the NVIDIA kernel driver is not loaded (nvidia-smi on the host says why)",
            "NO_PERMISSION": "no permission to open the NVIDIA device nodes (/dev/nvidia*): check the container "
            "runtime gives the agent all GPUs (NVIDIA_VISIBLE_DEVICES=all)",
        }.get(error_name(error), "")
        raise NvmlUnavailable(f"NVML init failed: NVML_ERROR_{error_name(error)}. {hint}".strip()) from error
    try:
        yield
    finally:
        pynvml.nvmlShutdown()
