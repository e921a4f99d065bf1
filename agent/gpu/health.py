"""NVML health: a thread that watches NVML events, a liveness probe, and the evidence that a fault cleared.

The watcher only translates what the driver says into events posted to the reconcile loop (``XidEvent``,
``GpuLost``, ``WatchFailed``, ``WatchRestored``); what they mean for device health is decided there
(``agent.core.health``). It handles event-wait errors the way a real driver reports them (facts
gpu-health.md §2.3):

- ``TIMEOUT``: nothing happened (or an interrupt arrived); wait again.
- ``GPU_IS_LOST``: the wait does not say which GPU, so each watched GPU is asked (its handle and a cheap
  call); each that answers ``GPU_IS_LOST`` is posted as ``GpuLost`` and the event set is rebuilt without
  it, so the others keep being watched. A lost GPU is tried again with backoff and rejoins when it answers;
  ``WatchRestored`` says it is registered for events again. The agent, finding a lost GPU answering
  (``gpu_back``), keeps it Unhealthy until that word comes, which it gets even if the GPU already rejoined.
- ``UNKNOWN`` or anything else: the set may be in an undefined state, so it is freed and rebuilt with
  backoff (``backoff_initial`` doubling to ``backoff_max``). Nothing is marked unhealthy unless rebuilding
  keeps failing (``failures_before_report`` attempts in a row): then every GPU it cannot watch gets a
  ``WatchFailed``, and a ``WatchRestored`` once a wait works again.
- Registering one GPU: ``NOT_SUPPORTED`` means "unmonitored" (warned once, the GPU stays healthy, as on
  NVIDIA's plugin); ``GPU_IS_LOST`` is a ``GpuLost``; any other error is retried with backoff and reported
  as ``WatchFailed`` when it keeps failing.
- ``nvmlInit`` failing (``NvmlUnavailable``) is retried with backoff like a broken set. The thread never
  dies silently: an unexpected exception is logged with its traceback and the set rebuilt; ``alive()``
  says whether the thread runs, and ``start()`` starts a new one if it does not.

``recovery_evidence`` answers whether a faulty GPU (or MIG device) may be trusted again. It never raises.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import suppress
from ctypes import c_void_p, cast
from typing import Any

import pynvml
from msgspec import Struct

from agent.gpu.nvml import NvmlUnavailable, error_name, nvml_session

log = logging.getLogger(__name__)

WATCHED_EVENTS = (
    pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError | pynvml.nvmlEventTypeSingleBitEccError
)
FI_GPU_RECOVERY_ACTION = 230  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (driver R565+; in public headers from R570)
RECOVERY_ACTIONS = {
    0: "NONE",
    1: "GPU_RESET",
    2: "NODE_REBOOT",
    3: "DRAIN_P2P",
    4: "DRAIN_AND_RESET",
    5: "RECOVER_IMEX_DOMAIN",
    6: "BUS_RESET",
    7: "SYSTEM_REBOOT",
}
# nvmlValueType_t -> the c_nvmlValue_t member that holds the value
_VALUE_MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}
# A signal read failing with one of these means "this driver or GPU does not give it", not "unhealthy".
_UNAVAILABLE = frozenset({"NOT_SUPPORTED", "FUNCTION_NOT_FOUND", "NO_PERMISSION"})


# ----- events posted to the reconcile loop -----------------------------------------------------------


class XidEvent(Struct, frozen=True):
    gpu_uuid: str
    xid: int
    gi_id: int
    ci_id: int


class WatchFailed(Struct, frozen=True):
    """The driver keeps refusing to watch a GPU: its devices cannot be trusted until ``WatchRestored``."""

    gpu_uuid: str | None  # None: every GPU (no longer posted by the watcher; kept for existing handlers)
    error: str


class GpuLost(Struct, frozen=True):
    """The driver reports this GPU lost (``NVML_ERROR_GPU_IS_LOST``): it fell off the bus or is inaccessible."""

    gpu_uuid: str


class WatchRestored(Struct, frozen=True):
    """A GPU that was reported ``WatchFailed`` or ``GpuLost``, or that the agent said is back (``gpu_back``), is
    registered in an event set whose wait works: its events are seen from now on. Whether its devices are
    healthy is still for the recovery evidence to say."""

    gpu_uuid: str


# ----- the watcher -----------------------------------------------------------------------------------


class _Rebuild(Exception):  # control flow inside the watcher thread; never escapes it
    """Free the event set and build a new one; ``error`` set: after a failure (with backoff)."""

    def __init__(self, error: str | None = None) -> None:
        super().__init__(error or "rebuild")
        self.error = error


class _Retry(Struct):
    failures: int
    due: float


class NvmlEventWatcher:
    """Waits on one NVML event set for every watched GPU and posts what it sees (see the module doc)."""

    def __init__(
        self,
        gpu_uuids: Sequence[str],
        post: Callable[[object], None],
        *,
        wait_ms: int = 500,
        backoff_initial: float = 0.1,
        backoff_max: float = 5.0,
        failures_before_report: int = 3,
    ) -> None:
        self._post_to = post
        self._wait_ms = wait_ms
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._threshold = max(1, failures_before_report)
        self._lock = threading.Lock()
        self._wanted: tuple[str, ...] = tuple(dict.fromkeys(gpu_uuids))
        self._wanted_version = 0
        # GPUs the agent found answering again since they were reported lost -> whether gpu_back already
        # confirmed they are watched
        self._back: dict[str, bool] = {}
        self._watched: frozenset[str] = frozenset()
        self._builds = 0
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        # owned by the watcher thread:
        self._built_version = -1
        self._registered: dict[str, int] = {}  # GPU UUID -> handle address, in the current set
        self._reported: dict[str, str] = {}  # GPU UUID -> "failed" | "lost" | "back": what WatchRestored ends
        self._unmonitored: set[str] = set()  # NOT_SUPPORTED: warned once, not retried
        self._retry: dict[str, _Retry] = {}  # GPUs whose registration failed or that are lost
        self._set_failures = 0  # consecutive failures of the whole set (init, create, wait)

    # ----- control (any thread) --------------------------------------------------------------------

    def start(self, timeout: float = 5.0) -> None:
        """Start watching (again, if the thread is not running); returns once the first event set is built,
        so events from then on are seen, or after ``timeout``."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stop.clear()
            self._ready.clear()
            self._thread = threading.Thread(target=self._run, name="nvml-events", daemon=True)
            self._thread.start()
        self._ready.wait(timeout)

    def stop(self, timeout: float | None = None) -> None:
        """Stop; wait for the thread up to ``timeout`` (default: one event wait and then some). The thread
        may sit in ``nvmlEventSetWait`` until its timeout: a process about to exit need not wait for it."""
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=self._wait_ms / 1000 + 2 if timeout is None else timeout)

    def alive(self) -> bool:
        """Is the watcher thread running? False after ``stop()`` and if it ever died."""
        thread = self._thread
        return thread is not None and thread.is_alive() and not self._stop.is_set()

    def set_gpus(self, gpu_uuids: Iterable[str]) -> None:
        """Watch these GPUs: one that joined or came back is registered at the next turn, one that left is
        dropped (the set is rebuilt without it)."""
        wanted = tuple(dict.fromkeys(gpu_uuids))
        with self._lock:
            if wanted != self._wanted:
                self._wanted = wanted
                self._wanted_version += 1

    def gpu_back(self, uuid: str) -> None:
        """The agent found a lost GPU answering again: register it at the next turn, report it lost again if it
        is (a GPU that flaps must not stay reported once and then be forgotten), and post ``WatchRestored`` once
        it is watched — at once when it already is (it rejoined on its own retry) and the set's wait works."""
        with self._lock:
            confirmed = uuid in self._watched and self._set_failures == 0  # an int the watcher thread writes
            self._back[uuid] = confirmed
        if confirmed:
            self._post(WatchRestored(uuid))

    def watched(self) -> frozenset[str]:
        """The GPUs registered in the current event set."""
        with self._lock:
            return self._watched

    @property
    def builds(self) -> int:
        """How many event sets were built and registered so far (for status and tests)."""
        with self._lock:
            return self._builds

    # ----- the thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                error: str | None
                try:
                    self._session()
                    error = None
                except _Rebuild as rebuild:
                    error = rebuild.error
                except NvmlUnavailable as unavailable:
                    error = str(unavailable)
                except pynvml.NVMLError as nvml_error:  # nvmlEventSetCreate
                    error = f"NVML_ERROR_{error_name(nvml_error)}"
                except Exception as unexpected:  # a bug must not end the watch: log, count, rebuild
                    error = f"unexpected {unexpected!r}"
                    if self._set_failures == 0:
                        log.exception("NVML event watcher failed; rebuilding")
                finally:
                    self._set_watched()
                    self._ready.set()
                if error is not None and not self._stop.is_set():
                    self._set_failed(error)
                    self._stop.wait(self._delay(self._set_failures))
        finally:
            if not self._stop.is_set():
                log.error("NVML event watcher thread ended unexpectedly")

    def _session(self) -> None:
        with nvml_session():
            event_set = pynvml.nvmlEventSetCreate()
            try:
                self._build(event_set)
                with self._lock:
                    self._builds += 1
                self._ready.set()
                self._loop(event_set)
            finally:
                self._registered.clear()
                with suppress(pynvml.NVMLError):
                    pynvml.nvmlEventSetFree(event_set)

    def _build(self, event_set: object) -> None:
        wanted, version = self._wanted_snapshot()
        self._forget_unwanted(wanted)
        self._built_version = version
        now = time.monotonic()
        for uuid in wanted:
            retry = self._retry.get(uuid)
            if uuid not in self._unmonitored and (retry is None or retry.due <= now):
                self._register(event_set, uuid)
        self._set_watched()
        log.info("watching GPU health gpus=%d", len(self._registered))

    def _loop(self, event_set: object) -> None:
        while not self._stop.is_set():
            self._sync(event_set)
            try:
                data = pynvml.nvmlEventSetWait_v2(event_set, self._wait_timeout_ms())
            except pynvml.NVMLError as error:
                name = error_name(error)
                if name == "TIMEOUT":
                    self._wait_worked()
                    continue
                if name == "GPU_IS_LOST":
                    lost = self._find_lost()
                    if lost:
                        for uuid in lost:
                            self._gpu_lost(uuid)
                        raise _Rebuild() from None  # at once, without them
                raise _Rebuild(f"NVML_ERROR_{name}") from None
            self._wait_worked()
            self._deliver(data)

    def _wait_timeout_ms(self) -> int:
        """``wait_ms``, or less when a GPU's registration retry is due sooner: a GPU that was lost for a moment is
        watched again on its backoff (0.1 s, 0.2 s, ...), not at the end of a long wait, whose events would
        otherwise never reach us."""
        due = min((retry.due for retry in self._retry.values()), default=None)
        if due is None:
            return self._wait_ms
        return max(1, min(self._wait_ms, math.ceil((due - time.monotonic()) * 1000)))

    def _sync(self, event_set: object) -> None:
        """Apply ``set_gpus`` and ``gpu_back``, and register GPUs whose retry is due into the current set."""
        wanted, version = self._wanted_snapshot()
        with self._lock:
            back, self._back = self._back, {}
        for uuid, confirmed in back.items():
            self._retry.pop(uuid, None)
            if confirmed:
                self._reported.pop(uuid, None)
            elif uuid in wanted:
                self._reported[uuid] = "back"  # WatchRestored once it is registered and a wait works
        if version != self._built_version:
            self._forget_unwanted(wanted)
            if set(self._registered) - set(wanted):
                raise _Rebuild()  # NVML cannot unregister: a new set without the GPUs that left
            self._built_version = version
        now = time.monotonic()
        added = False
        for uuid in wanted:
            if uuid in self._registered or uuid in self._unmonitored:
                continue
            retry = self._retry.get(uuid)
            if retry is None or retry.due <= now:
                added = self._register(event_set, uuid) or added
        if added:
            self._set_watched()

    def _register(self, event_set: object, uuid: str) -> bool:
        """Register one GPU's events; False if it could not be (reported and retried as needed)."""
        stage = "handle"
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            stage = "supported events"
            mask = WATCHED_EVENTS & pynvml.nvmlDeviceGetSupportedEventTypes(handle)
            if not mask & pynvml.nvmlEventTypeXidCriticalError:
                self._unmonitored_gpu(uuid, "no XID events")
                return False
            stage = "register"
            pynvml.nvmlDeviceRegisterEvents(handle, mask, event_set)
        except pynvml.NVMLError as error:
            name = error_name(error)
            if name == "NOT_SUPPORTED":
                self._unmonitored_gpu(uuid, "NVML_ERROR_NOT_SUPPORTED")
            elif name == "GPU_IS_LOST":
                self._gpu_lost(uuid)
            else:
                self._gpu_failed(uuid, f"NVML_ERROR_{name} ({stage})")
                if stage == "register" and name == "UNKNOWN":
                    raise _Rebuild() from None  # the set is in an undefined state: a new one, without this GPU
            return False
        self._registered[uuid] = _address(handle)
        self._retry.pop(uuid, None)
        return True

    def _find_lost(self) -> list[str]:
        """The wait said a GPU is lost but not which: ask each watched GPU."""
        lost = []
        for uuid in list(self._registered):
            try:
                pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByUUID(uuid))
            except pynvml.NVMLError as error:
                if error_name(error) == "GPU_IS_LOST":
                    lost.append(uuid)
        return lost

    def _deliver(self, data: Any) -> None:
        if not data.eventType & pynvml.nvmlEventTypeXidCriticalError:
            return
        address = _address(data.device)
        uuid = next((u for u, a in self._registered.items() if a == address), None)
        if uuid is not None:
            self._post(
                XidEvent(
                    uuid,
                    int(data.eventData),
                    int(data.gpuInstanceId),
                    int(data.computeInstanceId),
                )
            )

    # ----- bookkeeping (watcher thread) ------------------------------------------------------------

    def _wanted_snapshot(self) -> tuple[tuple[str, ...], int]:
        with self._lock:
            return self._wanted, self._wanted_version

    def _forget_unwanted(self, wanted: Sequence[str]) -> None:
        keep = set(wanted)
        for table in (self._retry, self._reported):
            for uuid in [u for u in table if u not in keep]:
                del table[uuid]
        self._unmonitored &= keep

    def _set_watched(self) -> None:
        with self._lock:
            self._watched = frozenset(self._registered)

    def _wait_worked(self) -> None:
        if self._set_failures:
            log.info("NVML event watch works again after_failures=%d", self._set_failures)
            self._set_failures = 0
        if not self._reported:
            return
        # a GPU without XID events is watched as much as it ever was (unmonitored, as at start)
        for uuid in [u for u in self._reported if u in self._registered or u in self._unmonitored]:
            del self._reported[uuid]
            log.info("watching GPU health again gpu=%s", uuid)
            self._post(WatchRestored(uuid))

    def _set_failed(self, error: str) -> None:
        self._set_failures += 1
        if self._set_failures == 1:
            log.warning("NVML event watch failed error=%s; rebuilding it with backoff", error)
        else:
            log.debug("NVML event watch failed again error=%s failures=%d", error, self._set_failures)
        if self._set_failures >= self._threshold:
            wanted, _ = self._wanted_snapshot()
            for uuid in wanted:
                if uuid not in self._unmonitored:
                    self._report(uuid, "failed", error)

    def _gpu_failed(self, uuid: str, error: str) -> None:
        retry = self._retry.get(uuid)
        failures = (retry.failures if retry else 0) + 1
        self._retry[uuid] = _Retry(failures, time.monotonic() + self._delay(failures))
        if failures == 1:
            log.warning("cannot watch GPU health gpu=%s error=%s; retrying", uuid, error)
        if failures >= self._threshold:
            self._report(uuid, "failed", error)

    def _gpu_lost(self, uuid: str) -> None:
        retry = self._retry.get(uuid)
        failures = (retry.failures if retry else 0) + 1
        self._retry[uuid] = _Retry(failures, time.monotonic() + self._delay(failures))
        self._registered.pop(uuid, None)
        self._report(uuid, "lost", "NVML_ERROR_GPU_IS_LOST")

    def _unmonitored_gpu(self, uuid: str, why: str) -> None:
        if uuid not in self._unmonitored:
            log.warning("GPU does not support health events gpu=%s error=%s; it stays unmonitored", uuid, why)
            self._unmonitored.add(uuid)
        self._retry.pop(uuid, None)

    def _report(self, uuid: str, status: str, error: str) -> None:
        previous = self._reported.get(uuid)
        if previous == status or (previous == "lost" and status == "failed"):
            return
        self._reported[uuid] = status
        if status == "lost":
            log.warning("GPU fell off the bus or is inaccessible gpu=%s error=%s; watching the others", uuid, error)
            self._post(GpuLost(uuid))
        else:
            log.error("GPU health not watched gpu=%s error=%s", uuid, error)
            self._post(WatchFailed(uuid, error))

    def _delay(self, failures: int) -> float:
        return min(self._backoff_max, self._backoff_initial * 2 ** min(max(failures - 1, 0), 30))

    def _post(self, event: object) -> None:
        try:
            self._post_to(event)
        except Exception:  # the loop's queue refusing an event must not end the watch
            log.exception("cannot post health event event=%r", event)


def _address(handle: object) -> int:
    return cast(handle, c_void_p).value or 0


# ----- probe and recovery evidence -------------------------------------------------------------------


def probe(gpu_uuid: str, mig_uuid: str | None = None) -> str | None:
    """Ask the driver whether a GPU (or MIG device) answers: None if it does, else the NVML error name.

    Answering is not being healthy (a GPU that needs a reset still answers): use ``recovery_evidence``
    before trusting a faulty device again.
    """
    try:
        with nvml_session():
            handle = pynvml.nvmlDeviceGetHandleByUUID(mig_uuid or gpu_uuid)
            pynvml.nvmlDeviceGetMemoryInfo(handle)
    except pynvml.NVMLError as error:
        return error_name(error)
    except NvmlUnavailable:
        return "UNINITIALIZED"
    return None


class Evidence(Struct, frozen=True):
    """Whether a faulty unit may be trusted again, and if not, what still blocks it."""

    ok: bool
    reasons: tuple[str, ...] = ()  # e.g. "recovery action GPU_RESET", "uncorrected ECC grew 3 -> 5"
    ecc_uncorrected: int | None = None  # the volatile uncorrected ECC count now: the next check's baseline
    unavailable: tuple[str, ...] = ()  # signals this driver or GPU does not give (not blockers)


def recovery_evidence(gpu_uuid: str, mig_uuid: str | None = None, *, ecc_baseline: int | None) -> Evidence:
    """The evidence that a GPU (or one of its MIG devices) recovered. The signals are read on the GPU:

    - the device answers (memory info, on the MIG device too when one is named);
    - NVML field 230 (GPU recovery action) reads NONE, where the driver gives it (any other value blocks,
      including ones this code does not know);
    - no row remap pending (and none ever failed: the RMA threshold), no retired pages pending;
    - the volatile uncorrected ECC count is not above ``ecc_baseline``.

    A signal the driver does not give (NOT_SUPPORTED and the like, per entry for field values) is listed in
    ``unavailable`` and does not block. Never raises: NVML errors become ``Evidence(ok=False)``.
    """
    try:
        with nvml_session():
            return _evidence(gpu_uuid, mig_uuid, ecc_baseline)
    except NvmlUnavailable as error:
        return Evidence(False, (str(error),))
    except pynvml.NVMLError as error:
        return Evidence(False, (f"NVML_ERROR_{error_name(error)}",))
    except Exception as error:  # never raise into the reconcile loop
        log.exception("recovery check failed gpu=%s mig=%s", gpu_uuid, mig_uuid)
        return Evidence(False, (f"recovery check failed: {error!r}",))


def read_ecc_uncorrected(gpu_uuid: str) -> int | None:
    """The GPU's volatile uncorrected ECC count (the baseline to take when a fault is recorded); None when
    unavailable or on any error."""
    try:
        with nvml_session():
            handle = pynvml.nvmlDeviceGetHandleByUUID(gpu_uuid)
            return int(
                pynvml.nvmlDeviceGetTotalEccErrors(
                    handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
                )
            )
    except (pynvml.NVMLError, NvmlUnavailable):
        return None


def _evidence(gpu_uuid: str, mig_uuid: str | None, ecc_baseline: int | None) -> Evidence:
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(gpu_uuid)
        pynvml.nvmlDeviceGetMemoryInfo(handle)
    except pynvml.NVMLError as error:
        return Evidence(False, (f"NVML_ERROR_{error_name(error)}",))
    if mig_uuid is not None:
        try:
            pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByUUID(mig_uuid))
        except pynvml.NVMLError as error:
            return Evidence(False, (f"MIG device: NVML_ERROR_{error_name(error)}",))
    blockers: list[str] = []
    unavailable: list[str] = []

    def read(signal: str, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except pynvml.NVMLError as error:
            name = error_name(error)
            if name in _UNAVAILABLE:
                unavailable.append(f"{signal} (NVML_ERROR_{name})")
            elif name == "GPU_IS_LOST":
                blockers.append("NVML_ERROR_GPU_IS_LOST")
            else:
                blockers.append(f"{signal} unreadable: NVML_ERROR_{name}")
            return None

    fields = read("recovery action", lambda: pynvml.nvmlDeviceGetFieldValues(handle, [FI_GPU_RECOVERY_ACTION]))
    if fields is not None:
        _recovery_action(fields[0], blockers, unavailable)
    rows = read("row remapping", lambda: pynvml.nvmlDeviceGetRemappedRows(handle))
    if rows is not None:
        _, _, pending, failure = rows
        if pending:
            blockers.append("row remap pending")
        if failure:
            blockers.append("row remap failure")
    retired = read("retired pages", lambda: pynvml.nvmlDeviceGetRetiredPagesPendingStatus(handle))
    if retired:
        blockers.append("retired pages pending")
    ecc = read(
        "uncorrected ECC",
        lambda: pynvml.nvmlDeviceGetTotalEccErrors(
            handle, pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC
        ),
    )
    count = None if ecc is None else int(ecc)
    if count is not None and ecc_baseline is not None and count > ecc_baseline:
        blockers.append(f"uncorrected ECC grew {ecc_baseline} -> {count}")
    return Evidence(not blockers, tuple(dict.fromkeys(blockers)), count, tuple(unavailable))


def _recovery_action(value: Any, blockers: list[str], unavailable: list[str]) -> None:
    """One ``nvmlFieldValue_t`` for field 230: its own return code first, then the value by its type."""
    code = int(value.nvmlReturn)
    if code != pynvml.NVML_SUCCESS:
        unavailable.append(f"recovery action (NVML_ERROR_{error_name(pynvml.NVMLError(code))})")
        return
    member = _VALUE_MEMBERS.get(int(value.valueType))
    if member is None:
        blockers.append(f"recovery action unreadable: value type {int(value.valueType)}")
        return
    action = int(getattr(value.value, member))
    if action != 0:
        blockers.append(f"recovery action {RECOVERY_ACTIONS.get(action, f'{action} (unknown)')}")
