"""Acting on a simulated node from outside the process that holds it.

``tessera run --simulate SPEC --sim-control PATH`` serves this on a unix socket (mode 0600), so an
end-to-end test or the demo can inject an XID, lose a GPU or start a process in the agent's simulated
driver. One JSON request per line, one JSON reply per line: ``{"op": "inject_xid", "gpu": 0, "xid": 48}``
→ ``{"ok": true}`` or ``{"ok": false, "error": "..."}``. Only the operations below exist.
"""

from __future__ import annotations

import json
import logging
import socket
import socketserver
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.sim.driver import SimDriver
from agent.sim.nvml_codes import Return

log = logging.getLogger(__name__)
MAX_REQUEST_BYTES = 4096


def _operations(driver: SimDriver) -> dict[str, tuple[Callable[..., Any], dict[str, type]]]:
    """Each operation: the driver method and its arguments with their types (anything else is refused)."""
    return {
        "inject_xid": (
            lambda gpu, xid, mig_uuid=None: driver.inject_xid(gpu, xid, mig_uuid=mig_uuid),
            {"gpu": int, "xid": int, "mig_uuid": str},
        ),
        "lose_gpu": (lambda gpu: driver.lose_gpu(gpu), {"gpu": int}),
        "recover_gpu": (lambda gpu: driver.recover_gpu(gpu), {"gpu": int}),
        "reset_gpu": (lambda gpu: driver.reset_gpu(gpu), {"gpu": int}),
        "add_process": (
            lambda gpu, pid, used_mib, mig_uuid=None: driver.add_process(gpu, pid, used_mib, mig_uuid=mig_uuid),
            {"gpu": int, "pid": int, "used_mib": int, "mig_uuid": str},
        ),
        "remove_process": (driver.remove_process, {"pid": int}),
        "set_utilization": (
            lambda gpu, percent, memory_percent=0: driver.set_utilization(gpu, percent, memory_percent),
            {"gpu": int, "percent": int, "memory_percent": int},
        ),
        "compute_mode": (lambda uuid: _compute_mode(driver, uuid), {"uuid": str}),
        "inject_error": (
            lambda symbol, code, times=1, gpu=None: driver.inject_error(
                symbol, Return[code], times=times, gpu_index=gpu
            ),
            {"symbol": str, "code": str, "times": int, "gpu": int},
        ),
    }


def _compute_mode(driver: SimDriver, uuid: str) -> int:
    """Read-only: the compute mode of a GPU or MIG device, as NVML would report it."""
    index, _, ci = driver.find_uuid(uuid)
    return ci.compute_mode if ci is not None else driver.gpus[index].compute_mode


class SimControlServer:
    def __init__(self, driver: SimDriver, path: Path) -> None:
        self.path = path
        operations = _operations(driver)

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                for line in self.rfile:
                    reply = _dispatch(operations, line[:MAX_REQUEST_BYTES])
                    self.wfile.write(json.dumps(reply).encode() + b"\n")

        path.unlink(missing_ok=True)
        self._server = socketserver.ThreadingUnixStreamServer(str(path), Handler)
        self._server.daemon_threads = True
        path.chmod(0o600)
        self._thread = threading.Thread(target=self._server.serve_forever, name="sim-control", daemon=True)

    def start(self) -> None:
        self._thread.start()
        log.info("simulated node control socket=%s", self.path)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self.path.unlink(missing_ok=True)


def _dispatch(operations: dict[str, tuple[Callable[..., Any], dict[str, type]]], line: bytes) -> dict[str, Any]:
    try:
        request = json.loads(line)
        if not isinstance(request, dict):
            raise ValueError("a request is a JSON object")
        op = request.pop("op", None)
        if op not in operations:
            raise ValueError(f"unknown op {op!r}; known: {', '.join(sorted(operations))}")
        function, types = operations[op]
        for name, value in request.items():
            if name not in types or type(value) is not types[name]:
                raise ValueError(f"{op}: bad argument {name}={value!r}")
        result = function(**request)
    except Exception as error:  # any failure is the caller's answer, never the server's death
        return {"ok": False, "error": str(error) or type(error).__name__}
    return {"ok": True, "result": result}


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
