"""NVML health events: a thread that waits on an NVML event set and reports XIDs, and a liveness probe.

The thread only translates driver events into ``XidEvent`` values posted to the reconcile loop; what an
event means for device health is decided there (``agent.core.health``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from ctypes import c_void_p, cast
from dataclasses import dataclass

import pynvml

from agent.gpu.nvml import error_name, nvml_session

log = logging.getLogger(__name__)

WATCHED_EVENTS = (
    pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError | pynvml.nvmlEventTypeSingleBitEccError
)


@dataclass(frozen=True, slots=True)
class XidEvent:
    gpu_uuid: str
    xid: int
    gi_id: int
    ci_id: int


@dataclass(frozen=True, slots=True)
class WatchFailed:
    """The driver refused to watch a GPU (or the event wait broke): its devices cannot be trusted."""

    gpu_uuid: str | None  # None: every GPU
    error: str


class NvmlEventWatcher:
    """Waits on one NVML event set for every watched GPU and posts what it sees."""

    def __init__(self, gpu_uuids: Sequence[str], post: Callable[[object], None], *, wait_ms: int = 500) -> None:
        self._gpu_uuids = list(gpu_uuids)
        self._post = post
        self._wait_ms = wait_ms
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nvml-events", daemon=True)

    def start(self, timeout: float = 5.0) -> None:
        """Start watching; returns once every GPU is registered (events from then on are seen)."""
        self._thread.start()
        self._ready.wait(timeout)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self._wait_ms / 1000 + 2)

    def _run(self) -> None:
        try:
            with nvml_session():
                event_set = pynvml.nvmlEventSetCreate()
                try:
                    uuid_by_handle = self._register(event_set)
                    self._ready.set()
                    self._loop(event_set, uuid_by_handle)
                finally:
                    pynvml.nvmlEventSetFree(event_set)
        except Exception as error:  # the thread must report, never die silently
            log.exception("NVML event watcher failed")
            self._post(WatchFailed(None, repr(error)))
        finally:
            self._ready.set()

    def _register(self, event_set: object) -> dict[int, str]:
        uuid_by_handle: dict[int, str] = {}
        for uuid in self._gpu_uuids:
            try:
                handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
                mask = WATCHED_EVENTS & pynvml.nvmlDeviceGetSupportedEventTypes(handle)
                pynvml.nvmlDeviceRegisterEvents(handle, mask, event_set)
            except pynvml.NVMLError as error:
                if error_name(error) == "NOT_SUPPORTED":
                    log.warning("GPU does not support health events gpu=%s", uuid)
                    continue
                log.error("cannot watch GPU health gpu=%s error=NVML_ERROR_%s", uuid, error_name(error))
                self._post(WatchFailed(uuid, error_name(error)))
                continue
            uuid_by_handle[_address(handle)] = uuid
        log.info("watching GPU health gpus=%d", len(uuid_by_handle))
        return uuid_by_handle

    def _loop(self, event_set: object, uuid_by_handle: dict[int, str]) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                data = pynvml.nvmlEventSetWait_v2(event_set, self._wait_ms)
            except pynvml.NVMLError as error:
                if error_name(error) == "TIMEOUT":
                    continue
                failures += 1
                if failures == 1:  # report once per run of failures, not in a loop
                    log.error("NVML event wait failed error=NVML_ERROR_%s", error_name(error))
                    self._post(WatchFailed(None, error_name(error)))
                self._stop.wait(min(5.0, 0.1 * failures))
                continue
            failures = 0
            if not data.eventType & pynvml.nvmlEventTypeXidCriticalError:
                continue
            uuid = uuid_by_handle.get(_address(data.device))
            if uuid is not None:
                self._post(XidEvent(uuid, int(data.eventData), int(data.gpuInstanceId), int(data.computeInstanceId)))


def _address(handle: object) -> int:
    return cast(handle, c_void_p).value or 0


def probe(gpu_uuid: str, mig_uuid: str | None = None) -> str | None:
    """Ask the driver whether a GPU (or MIG device) answers: None if it does, else the NVML error name."""
    try:
        with nvml_session():
            handle = pynvml.nvmlDeviceGetHandleByUUID(mig_uuid or gpu_uuid)
            pynvml.nvmlDeviceGetMemoryInfo(handle)
    except pynvml.NVMLError as error:
        return error_name(error)
    return None
