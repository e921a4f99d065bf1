"""Per-process GPU utilization through NVML (``nvmlDeviceGetProcessUtilization``), since the previous read.

NVML returns one sample per process that did some work since ``lastSeenTimeStamp`` (a CPU timestamp in µs), with
the SM, memory, encoder and decoder utilization and the CPU time it was recorded, and NOT_FOUND when no process did
any. So a process missing from the answer was idle over the window, and NOT_FOUND means every process was.
Each GPU's window starts at the newest timestamp its previous read returned, as NVML asks. Samples of a process
that has since exited are still in the answer: a PID can then be named by two samples, and only the sample
stamped after the start of the process now holding that PID is that process's (the caller checks; see ``procfs``).

NVML does not report it on a MIG-enabled GPU ("On MIG-enabled GPUs, querying process utilization is not currently
supported") nor on some boards: the GPU's read then carries the NVML error instead (``NOT_SUPPORTED``), and it is
not asked again until the GPU leaves MIG mode. pynvml sizes the buffer with a first call; when more processes
became busy between its two calls NVML answers INSUFFICIENT_SIZE, and the read is tried once more.

A GPU no process runs on is not asked (nobody to attribute work to), but its window moves on (``idle``): the next
read, once a process appears, starts from there rather than returning what the buffer held from long before.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import pynvml
from msgspec import Struct

from agent.gpu.nvml import error_name, is_error

Load = tuple[float, float, float, float]  # SM, memory, encoder, decoder utilization in percent


class Sample(Struct, frozen=True):
    pid: int
    timestamp_us: int  # CPU time (µs since the epoch) the sample was recorded
    load: Load


class UtilizationRead(Struct, frozen=True):
    """One GPU's samples since its previous read, or the NVML error why there are none to trust."""

    samples: tuple[Sample, ...] = ()
    error: str | None = None  # NVML's error name, e.g. NOT_SUPPORTED; None when read


class ProcessUtilization:
    """Reads each GPU's per-process utilization since its previous read. Called inside an NVML session."""

    def __init__(self) -> None:
        self._last_seen: dict[str, int] = {}  # GPU UUID -> the end of its previous window (µs)
        self._unsupported: set[str] = set()  # GPUs that said NOT_SUPPORTED while not in MIG mode

    def read(self, gpu_uuids: Iterable[str]) -> dict[str, UtilizationRead]:
        """GPU UUID -> its samples. Only GPUs not in MIG mode should be given (NVML has no answer for the others)."""
        reads: dict[str, UtilizationRead] = {}
        for uuid in gpu_uuids:
            if uuid in self._unsupported:
                reads[uuid] = UtilizationRead(error="NOT_SUPPORTED")
                continue
            reads[uuid] = self._read(uuid)
        return reads

    def idle(self, gpu_uuids: Iterable[str]) -> None:
        """These GPUs run no process now: their next window starts now (no NVML call)."""
        now_us = int(time.time() * 1_000_000)
        for uuid in gpu_uuids:
            self._last_seen[uuid] = max(self._last_seen.get(uuid, 0), now_us)

    def unsupported(self, gpu_uuids: Iterable[str]) -> dict[str, UtilizationRead]:
        """The GPUs among ``gpu_uuids`` known not to report it, as reads saying so (no NVML call)."""
        return {uuid: UtilizationRead(error="NOT_SUPPORTED") for uuid in gpu_uuids if uuid in self._unsupported}

    def forget(self, keep: Iterable[str]) -> None:
        """Drop the state of GPUs not in ``keep`` (gone, or in MIG mode now: asked afresh when they leave it)."""
        kept = set(keep)
        self._last_seen = {uuid: seen for uuid, seen in self._last_seen.items() if uuid in kept}
        self._unsupported &= kept

    def _read(self, uuid: str) -> UtilizationRead:
        last_seen = self._last_seen.get(uuid, 0)
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            try:
                raw = pynvml.nvmlDeviceGetProcessUtilization(handle, last_seen)
            except pynvml.NVMLError as error:
                if not is_error(error, "INSUFFICIENT_SIZE"):
                    raise
                raw = pynvml.nvmlDeviceGetProcessUtilization(handle, last_seen)  # grew between the two calls
        except pynvml.NVMLError as error:
            name = error_name(error)
            if name == "NOT_FOUND":  # nobody did any work since last_seen, which stays (NVML's timestamps only)
                return UtilizationRead()
            if name == "NOT_SUPPORTED":
                self._unsupported.add(uuid)
            return UtilizationRead(error=name)
        samples = tuple(
            Sample(s.pid, s.timeStamp, (float(s.smUtil), float(s.memUtil), float(s.encUtil), float(s.decUtil)))
            for s in raw
        )
        self._last_seen[uuid] = max([last_seen, *(s.timestamp_us for s in samples)])
        return UtilizationRead(samples)
