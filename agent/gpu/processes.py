"""Who runs on a device, as NVML sees it: the check before anything that could disturb a workload.

A real driver lists an MPS server among the compute processes and its clients only through the MPS
list, so both lists are read. A device NVML no longer knows (``NOT_FOUND``: destroyed, reset away) has
no processes. Anything else NVML cannot answer (``NO_PERMISSION``, a lost GPU, NVML not initialising)
raises ``ProcessesUnknown``: a caller about to destroy something treats unknown as busy.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import pynvml

from agent.gpu.nvml import NvmlUnavailable, error_name, nvml_session


class ProcessesUnknown(RuntimeError):
    """NVML could not say which processes run on a device."""


def device_processes(uuids: Iterable[str], *, exclude_pids: Collection[int] = ()) -> dict[str, tuple[int, ...]]:
    """Per GPU or MIG UUID, the PIDs of its compute processes and MPS clients (minus ``exclude_pids``)."""
    found: dict[str, tuple[int, ...]] = {}
    try:
        with nvml_session():
            for uuid in uuids:
                pids = _pids(uuid)
                found[uuid] = tuple(sorted(p for p in pids if p not in exclude_pids))
    except NvmlUnavailable as error:
        raise ProcessesUnknown(str(error)) from error
    return found


def _pids(uuid: str) -> set[int]:
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
    except pynvml.NVMLError as error:
        if error_name(error) == "NOT_FOUND":
            return set()
        raise ProcessesUnknown(f"{uuid}: NVML_ERROR_{error_name(error)}") from error
    pids: set[int] = set()
    for what, call in (
        ("compute processes", pynvml.nvmlDeviceGetComputeRunningProcesses),
        ("MPS clients", pynvml.nvmlDeviceGetMPSComputeRunningProcesses),
    ):
        try:
            pids.update(int(p.pid) for p in call(handle))
        except pynvml.NVMLError as error:
            if error_name(error) == "NOT_FOUND":
                return set()
            raise ProcessesUnknown(f"{uuid}: cannot list {what}: NVML_ERROR_{error_name(error)}") from error
    return pids
