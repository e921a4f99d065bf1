"""Per-cgroup GPU memory limits through NVML (driver r615+): ``nvmlDeviceSetMemoryLimits_v1`` and its read-back.

Both calls take the container's cgroup (v2) directory as a full path and work in bytes. Setting needs root and a
full GPU (MIG handles are NOT_SUPPORTED); reading needs neither privilege nor a limit (none reads soft 0, hard
``NVML_DEVICE_MEMORY_LIMIT_MAX``). A driver without the calls answers FUNCTION_NOT_FOUND (pynvml looks the symbol
up and does not find it). Callers hold an NVML session.
"""

from __future__ import annotations

import pynvml
from msgspec import Struct

from agent.gpu.nvml import error_name


class MemoryLimitError(RuntimeError):
    """The driver refused: ``code`` is the NVML error name (``NO_PERMISSION``, ``FUNCTION_NOT_FOUND`` ...)."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"NVML_ERROR_{code}: {detail}")
        self.code = code


class ReadLimits(Struct, frozen=True):
    soft: int
    hard: int
    used: int  # what the cgroup's processes use on the GPU now


def set_memory_limits(gpu_uuid: str, cgroup: str, soft: int, hard: int) -> None:
    limits = pynvml.c_nvmlSetMemoryLimits_v1_t()
    limits.nameSpace = cgroup.encode()
    limits.softLimit, limits.hardLimit = soft, hard
    try:
        pynvml.nvmlDeviceSetMemoryLimits_v1(pynvml.nvmlDeviceGetHandleByUUID(gpu_uuid), limits)
    except pynvml.NVMLError as error:
        raise MemoryLimitError(error_name(error), f"setting limits on {cgroup} for GPU {gpu_uuid}") from error


def read_memory_limits(gpu_uuid: str, cgroup: str) -> ReadLimits:
    limits = pynvml.c_nvmlGetMemoryLimits_v1_t()
    limits.nameSpace = cgroup.encode()
    try:
        pynvml.nvmlDeviceGetMemoryLimits_v1(pynvml.nvmlDeviceGetHandleByUUID(gpu_uuid), limits)
    except pynvml.NVMLError as error:
        raise MemoryLimitError(error_name(error), f"reading limits of {cgroup} for GPU {gpu_uuid}") from error
    return ReadLimits(limits.softLimit, limits.hardLimit, limits.currentUsed)
