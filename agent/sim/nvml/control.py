"""Acting on a simulated node from outside the process that holds it.

``tessera run --simulate SPEC --sim-control PATH`` serves this on a unix socket (mode 0600), so an
end-to-end test or the demo can inject an XID, lose a GPU or start a process in the agent's simulated
driver. One JSON request per line, one JSON reply per line: ``{"op": "inject_xid", "gpu": 0, "xid": 48}``
→ ``{"ok": true}`` or ``{"ok": false, "error": "..."}``. Only the operations below exist, and each takes
only its named arguments, of their JSON types (an NVML code is its ``Return`` name, e.g. ``"ERROR_UNKNOWN"``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from msgspec.structs import asdict

from agent.sim.nvml.codes import Return
from agent.sim.nvml.driver import SimDriver

log = logging.getLogger(__name__)
MAX_REQUEST_BYTES = 4096

_ArgumentTypes = dict[str, type | tuple[type, ...]]
_Operations = dict[str, tuple[Callable[..., Any], _ArgumentTypes]]
_NULL = type(None)
_LOAD: _ArgumentTypes = {"sm": int, "memory": int, "encoder": int, "decoder": int}  # percent busy per engine
_HEALTH_SIGNALS: _ArgumentTypes = {
    "gpu": int,
    "recovery_action": (int, _NULL),
    "remap_pending": bool,
    "remap_failure": bool,
    "remapped_correctable": int,
    "remapped_uncorrectable": int,
    "retired_pages_pending": bool,
    "ecc_uncorrected": int,
}


def _operations(driver: SimDriver) -> _Operations:
    """Each operation: the driver method and its arguments with their types (anything else is refused)."""
    return _node_operations(driver) | _fault_operations(driver)


def _node_operations(driver: SimDriver) -> _Operations:
    """What happens to the node: Xids, lost GPUs, resets, processes, health evidence."""
    return {
        "inject_xid": (
            lambda gpu, xid, mig_uuid=None: driver.inject_xid(gpu, xid, mig_uuid=mig_uuid),
            {"gpu": int, "xid": int, "mig_uuid": str},
        ),
        "lose_gpu": (lambda gpu: driver.lose_gpu(gpu), {"gpu": int}),
        "recover_gpu": (lambda gpu: driver.recover_gpu(gpu), {"gpu": int}),
        "reset_gpu": (lambda gpu: driver.reset_gpu(gpu), {"gpu": int}),
        "add_process": (
            lambda gpu, pid, used_mib, **options: driver.add_process(gpu, pid, used_mib, **options),
            {"gpu": int, "pid": int, "used_mib": int, "mig_uuid": str, "kind": str, **_LOAD, "cgroup": str},
        ),
        "allocate": (driver.allocate, {"pid": int, "mib": int}),
        "set_caller_root": (driver.set_caller_root, {"root": bool}),
        "memory_limits": (lambda: _memory_limits(driver), {}),
        "remove_process": (driver.remove_process, {"pid": int}),
        "set_process_utilization": (
            lambda pid, sm, memory=0, encoder=0, decoder=0: driver.set_process_utilization(
                pid, sm, memory, encoder, decoder
            ),
            {"pid": int, **_LOAD},
        ),
        "exit_after_listing": (driver.exit_after_listing, {"pid": int}),
        "set_utilization": (
            lambda gpu, percent, memory_percent=0: driver.set_utilization(gpu, percent, memory_percent),
            {"gpu": int, "percent": int, "memory_percent": int},
        ),
        "compute_mode": (lambda uuid: _compute_mode(driver, uuid), {"uuid": str}),
        "set_health_signals": (lambda gpu, **signals: driver.set_health_signals(gpu, **signals), _HEALTH_SIGNALS),
        "hide_gi_profile": (driver.hide_gi_profile, {"profile_index": int}),
        "destructive_calls": (lambda: _destructive_calls(driver), {}),
        "mig_devices": (lambda: _mig_devices(driver), {}),
        "set_timeslice": (
            lambda uuid, level: driver.set_timeslice(driver.find_uuid(uuid)[0], level),
            {"uuid": str, "level": int},
        ),
        "timeslice": (lambda uuid: driver.gpus[driver.find_uuid(uuid)[0]].timeslice, {"uuid": str}),
    }


def _fault_operations(driver: SimDriver) -> _Operations:
    """Failures of the NVML library itself: injected errors, random faults, a failing nvmlInit."""
    return {
        "inject_error": (
            lambda symbol, code, times=1, gpu=None: driver.inject_error(
                symbol, _code(code), times=times, gpu_index=gpu
            ),
            {"symbol": str, "code": str, "times": (int, _NULL), "gpu": int},
        ),
        "clear_injected_errors": (driver.clear_injected_errors, {}),
        "stall": (
            lambda symbol, seconds: driver.stall(symbol, float(seconds)),
            {"symbol": str, "seconds": (float, int)},
        ),
        "fail_init": (
            lambda code, times=None: driver.fail_init(None if code is None else _code(code), times=times),
            {"code": (str, _NULL), "times": (int, _NULL)},
        ),
        "set_fault_rate": (
            lambda rate, seed=0, code="ERROR_UNKNOWN", symbols=None: driver.set_fault_rate(
                float(rate), seed=seed, code=_code(code), symbols=_symbols(symbols)
            ),
            {"rate": (float, int), "seed": int, "code": str, "symbols": (list, _NULL)},
        ),
    }


def _code(name: str) -> Return:
    """An NVML code by its ``Return`` name (``"ERROR_GPU_IS_LOST"``; the ``NVML_`` prefix may be given)."""
    key = name.removeprefix("NVML_")
    if key not in Return.__members__:
        raise ValueError(f"unknown NVML code {name!r}; known: {', '.join(Return.__members__)}")
    return Return[key]


def _symbols(symbols: list[Any] | None) -> list[str] | None:
    if symbols is not None and not all(isinstance(symbol, str) for symbol in symbols):
        raise ValueError("symbols is a list of C symbol names")
    return symbols


def _destructive_calls(driver: SimDriver) -> list[dict[str, Any]]:
    """Read-only: the destructive-call log, oldest first, with each result as its ``Return`` name."""
    return [{**asdict(call), "result": call.result.name} for call in driver.destructive_calls]


def _mig_devices(driver: SimDriver) -> list[dict[str, Any]]:
    """Read-only: every MIG device of the node, with its GPU, instance IDs, profile and placement."""
    with driver.lock:
        return [
            {"gpu": gpu.index, "gi": gi.id, "ci": ci.id, "uuid": ci.uuid, "profile": gi.profile.name,
             "start": gi.placement[0], "size": gi.placement[1]}
            for gpu in driver.gpus
            for gi, ci in gpu.mig_devices()
        ]  # fmt: skip


def _memory_limits(driver: SimDriver) -> list[dict[str, Any]]:
    """Read-only: every per-cgroup memory limit set, with its GPU's UUID, in bytes."""
    return [
        {"gpu": index, "uuid": driver.gpus[index].uuid, "cgroup": cgroup, "soft": limit.soft, "hard": limit.hard}
        for (index, cgroup), limit in sorted(driver.memory_limit_table().items())
    ]


def _compute_mode(driver: SimDriver, uuid: str) -> int:
    """Read-only: the compute mode of a GPU or MIG device, as NVML would report it."""
    index, _, ci = driver.find_uuid(uuid)
    return ci.compute_mode if ci is not None else driver.gpus[index].compute_mode


class SimControlServer:
    """The control socket: a thread blocked in ``accept`` (no polling: an idle simulated node costs nothing),
    a thread per connection; ``stop`` shuts the listening socket down, which wakes the ``accept`` at once."""

    def __init__(self, driver: SimDriver, path: Path) -> None:
        self.path = path
        self._operations = _operations(driver)
        path.unlink(missing_ok=True)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._listener.bind(str(path))
            path.chmod(0o600)
            self._listener.listen()
        except BaseException:
            self._listener.close()
            raise
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="sim-control", daemon=True)

    def start(self) -> None:
        self._thread.start()
        log.info("simulated node control socket=%s", self.path)

    def stop(self) -> None:
        self._stopping.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        if self._thread.ident is not None:
            self._thread.join()
        self.path.unlink(missing_ok=True)

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError as error:
                if self._stopping.is_set():
                    return
                log.warning("simulated node control socket cannot accept error=%r; retrying", str(error))
                self._stopping.wait(0.1)  # out of descriptors and the like: a moment, then again
                continue
            threading.Thread(target=self._serve, args=(connection,), name="sim-control-client", daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        with connection, connection.makefile("rb") as requests, contextlib.suppress(OSError):
            while line := requests.readline(MAX_REQUEST_BYTES + 1):  # never buffers more than a request
                whole = len(line) <= MAX_REQUEST_BYTES or line.endswith(b"\n")
                too_long = {"ok": False, "error": f"a request is at most {MAX_REQUEST_BYTES} bytes"}
                connection.sendall(
                    json.dumps(_dispatch(self._operations, line) if whole else too_long).encode() + b"\n"
                )
                if not whole:
                    return  # the rest of an oversized line is not read: the connection ends


def _dispatch(operations: _Operations, line: bytes) -> dict[str, Any]:
    try:
        request = json.loads(line)
        if not isinstance(request, dict):
            raise ValueError("a request is a JSON object")
        op = request.pop("op", None)
        if op not in operations:
            raise ValueError(f"unknown op {op!r}; known: {', '.join(sorted(operations))}")
        function, types = operations[op]
        for name, value in request.items():
            if name not in types or not _is_a(value, types[name]):
                raise ValueError(f"{op}: bad argument {name}={value!r}")
        result = function(**request)
    except Exception as error:  # any failure is the caller's answer, never the server's death
        return {"ok": False, "error": str(error) or type(error).__name__}
    return {"ok": True, "result": result}


def _is_a(value: Any, allowed: type | tuple[type, ...]) -> bool:
    """Exact JSON types: ``true`` is not an int here, though it is one in Python."""
    return type(value) in (allowed if isinstance(allowed, tuple) else (allowed,))


class SimControlClient:
    def __init__(self, path: Path | str, timeout: float = 5.0) -> None:
        self._path = str(path)
        self._timeout = timeout

    def call(self, op: str, **arguments: Any) -> Any:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.settimeout(self._timeout)
            connection.connect(self._path)
            connection.sendall(json.dumps({"op": op, **arguments}).encode() + b"\n")
            reply = json.loads(connection.makefile("rb").readline())
        if not reply.get("ok"):
            raise RuntimeError(f"simulated node refused {op}: {reply.get('error')}")
        return reply.get("result")
