"""A stand-in for a CUDA application that is an MPS client, run as ``python -m agent.sim.mps.client``.

It connects to the MPS control emulator (``agent.sim.mps.control``) found through its own environment, exactly as a
CUDA application finds the real daemon: ``CUDA_MPS_PIPE_DIRECTORY`` (default ``/tmp/nvidia-mps``), and the limits it
may carry, ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` and ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` — which, as on a real
driver, can only lower what the server holds it to. A container that drops those variables runs this without them.

    python -m agent.sim.mps.client --device GPU-... --allocate 10240 [--allocate 1024 ...]

prints one JSON line with what the server holds it to (``server``, ``pinned_limit_mib``, ``active_thread_percentage``),
then one JSON line per allocation (``{"allocate_mib": 10240, "ok": true}``, or ``"error"`` with CUDA's
``cudaErrorMemoryAllocation: out of memory``). Exit status: 0 when every allocation succeeded, 2 when one failed (the
application stops there, as one that checks its errors does), 1 when there is no daemon to talk to.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import sys
from collections.abc import Sequence

from agent.sim.mps.control import CLIENT_HELLO, CONTROL_SOCKET, MAX_REPLY_BYTES, NO_DAEMON, _directories


def _reply(conn: socket.socket) -> str:
    header = _exactly(conn, 4)
    (size,) = struct.unpack(">I", header)
    if size > MAX_REPLY_BYTES:
        raise ConnectionError("reply too long")
    return _exactly(conn, size).decode(errors="replace")


def _exactly(conn: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the daemon closed the connection")
        data += chunk
    return bytes(data)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tessera-sim-mps-client", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", required=True, help="the device it runs on: a GPU or MIG UUID, or an ordinal")
    parser.add_argument("--allocate", type=int, action="append", default=[], metavar="MIB", help="pin MiB (repeat)")
    args = parser.parse_args(argv)
    env = os.environ
    pipe_dir, _ = _directories(env)
    hello = {
        "pid": os.getpid(),
        "uid": os.getuid(),
        "device": args.device,
        "pinned": env.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"),
        "threads": env.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
    }
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(str(pipe_dir / CONTROL_SOCKET))
        conn.sendall(CLIENT_HELLO + json.dumps(hello).encode() + b"\n")
        held = _reply(conn)
        if held.startswith("ERR"):
            print(held, file=sys.stderr)
            return 1
        print(held, flush=True)
        for mib in args.allocate:
            conn.sendall(f"ALLOC {mib}\n".encode())
            answer = _reply(conn)
            if answer != "OK":
                print(json.dumps({"allocate_mib": mib, "ok": False, "error": answer}), flush=True)
                return 2
            print(json.dumps({"allocate_mib": mib, "ok": True}), flush=True)
    except OSError:
        print(NO_DAEMON, file=sys.stderr)
        return 1
    finally:
        conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
