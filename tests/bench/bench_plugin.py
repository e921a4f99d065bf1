"""Benchmarks for the device-plugin path, on a simulated dgx-a100 with the kubelet emulator.

Run: python tests/bench/bench_plugin.py [--rounds 5] [--calls 2000]

Every round measures every figure once, interleaved (a noisy neighbour spreads over all of them), and the
figures printed are the medians over the rounds of each round's p50 and p99. Each figure is printed next to
the floor measured in the same round: an empty unary RPC (no request, no response, a handler that does
nothing) to a Python gRPC server in another process, over a unix socket, from the same client.

1. Allocate against the floor. A plugin process serves the dgx-a100 ``nvidia.com/gpu`` snapshot with
   ``ResourceServer`` (``grpc.aio`` on the agent's gRPC loop, as the agent does); one empty-RPC server of
   each kind (grpcio's thread pool, ``grpc.aio``) is the floor. Latency p50/p99 and the server process's CPU
   per call (utime + stime from /proc). The idle cost of the two server models is
   ``bench_grpc_models.py``'s.
2. The part of re-registration the plugin owns, in a plugin process against the kubelet emulator: from the
   moment the agent decides to act (the kubelet restarted and deleted the plugin socket) to the emulator
   holding every device allocatable again, two ways, turn about: ``restore_socket()`` (link the socket's
   standby name back) + ``register``, and stopping the server + starting a new one + ``register`` (what the
   agent did before). Noticing the restart (the agent's watcher) is not in it; the whole-agent figure has it.
3. ``ResourceServer.update(snapshot)`` -> the message at a ListAndWatch reader, and -> the kubelet emulator
   holding the new device list (one device Unhealthy, then Healthy again); ``stop()`` with a stream open.
4. The whole agent (``tessera run --simulate dgx-a100``, a fresh process per round): process start -> all
   devices registered and healthy; Allocate / GetPreferredAllocation / PreStartContainer round trips, dialled
   as the kubelet does, with the agent's CPU per call; XID -> the kubelet sees Unhealthy (from the moment the
   simulated driver queued the XID, which the simulation-control call returns, and from the start of that
   call, whose round trip to the simulator is not the agent's); kubelet restart ->
   re-registered, from the new kubelet.sock (the emulator's ``restart()`` itself first spends ~200 ms closing
   its own channels); SIGTERM -> exit; RSS after start and its growth over the calls. Metrics are off (this is
   the plugin path; ``bench_lifecycle.py`` measures start, idle and stop with the default features).

Cross-process times use CLOCK_MONOTONIC (``time.monotonic``), which every process on the host shares.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from agent.api.deviceplugin.v1beta1 import api_pb2
from agent.core.resources import Device
from agent.core.snapshot import ResourceSnapshot
from agent.plugin.registration import register
from agent.plugin.server import ResourceServer
from agent.sim.kubelet import KubeletEmulator
from agent.sim.kubelet.common import CHANNEL_OPTIONS
from agent.sim.nvml.control import SimControlClient

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.bench.bench_lifecycle import package_copy

RESOURCE = "nvidia.com/gpu"
GPUS = 8
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
EMPTY_METHOD = "/bench.Empty/Call"
ALLOCATE_METHOD = "/v1beta1.DevicePlugin/Allocate"
BATCH = 250  # calls per turn when two servers are measured against each other


# ----- helpers ------------------------------------------------------------------------------------------


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def _cpu_seconds(pid: int) -> float:
    """utime + stime of every thread of ``pid``, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def _wait_for_path(path: Path, process: subprocess.Popen[str], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{path} did not appear (exit code {process.returncode})")
        time.sleep(0.005)


def bench_snapshot(healthy: frozenset[int] = frozenset(range(GPUS))) -> ResourceSnapshot:
    """dgx-a100's ``nvidia.com/gpu``: 8 GPUs, two NUMA nodes, all NVLink peers (NVSwitch)."""
    devices = tuple(
        Device(
            id=f"GPU-{n:08x}-5555-4000-8000-{n:012x}",
            gpu_uuid=f"GPU-{n:08x}-5555-4000-8000-{n:012x}",
            gpu_index=n,
            index=str(n),
            memory_mib=81920,
            numa_node=n // 4,
        )
        for n in range(GPUS)
    )
    peers = {n: frozenset(range(GPUS)) - {n} for n in range(GPUS)}
    return ResourceSnapshot(RESOURCE, devices, {d.id: d.gpu_index in healthy for d in devices}, nvlink_peers=peers)


@dataclass
class Figure:
    """One measure: per round, its p50 and p99 (or a single value) and the floor p50 of that round."""

    name: str
    target: str = "-"
    p50: list[float] = field(default_factory=list)
    p99: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)  # server CPU per call, seconds
    single: bool = False

    def add(self, samples: list[float], cpu: float | None = None) -> None:
        if not samples:
            return
        self.p50.append(statistics.median(samples))
        self.p99.append(_percentile(samples, 0.99))
        if cpu is not None:
            self.cpu.append(cpu)

    def add_one(self, value: float) -> None:
        self.single = True
        self.p50.append(value)


# ----- the processes under test -------------------------------------------------------------------------


def _serve_empty(model: str, path: str) -> None:
    """A gRPC server whose one method does nothing: the floor any plugin RPC pays."""
    if model == "thread":
        handler = grpc.unary_unary_rpc_method_handler(lambda request, context: b"")
        server = grpc.server(futures.ThreadPoolExecutor(8))
        server.add_registered_method_handlers("bench.Empty", {"Call": handler})
        server.add_insecure_port(f"unix://{path}")
        server.start()
        server.wait_for_termination()
        return

    async def nothing(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return b""

    async def main() -> None:
        server = grpc.aio.server()
        server.add_registered_method_handlers("bench.Empty", {"Call": grpc.unary_unary_rpc_method_handler(nothing)})
        server.add_insecure_port(f"unix://{path}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def _serve_plugin(directory: str) -> None:
    """The dgx-a100 snapshot served by ``ResourceServer``, as the agent serves it."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    ResourceServer(bench_snapshot(), Path(directory)).start()
    threading.Event().wait()


def _plugin_agent(kubelet_socket: str) -> None:
    """What the agent does when it re-registers or publishes, driven by commands on stdin.

    ``relink``: bring the socket the kubelet deleted back (``restore_socket``) and register; ``restart``:
    stop that server, serve a new one and register (the agent's ``_restart_server`` + registration);
    ``health N``: hand over a snapshot where GPU N is Unhealthy
    (N = -1: all healthy); ``stop``: stop with the kubelet's stream open. Each answer is the CLOCK_MONOTONIC
    times the step's parts ended, the first being when it began.
    """
    logging.getLogger().addHandler(logging.NullHandler())
    directory = Path(kubelet_socket).parent
    server = ResourceServer(bench_snapshot(), directory)
    server.start()
    register(Path(kubelet_socket), server.socket_path.name, RESOURCE)
    print("ready", flush=True)
    snapshots = {n: bench_snapshot(frozenset(range(GPUS)) - {n}) for n in range(-1, GPUS)}
    for line in sys.stdin:
        command, _, argument = line.strip().partition(" ")
        times = [time.monotonic()]
        if command == "relink":
            if not server.restore_socket():
                raise RuntimeError("restore_socket failed")
            times.append(time.monotonic())
            register(Path(kubelet_socket), server.socket_path.name, RESOURCE)
            times.append(time.monotonic())
        elif command == "restart":
            snapshot = server.snapshot
            server.stop(grace=0)
            times.append(time.monotonic())
            server = ResourceServer(snapshot, directory)
            server.start()
            times.append(time.monotonic())
            register(Path(kubelet_socket), server.socket_path.name, RESOURCE)
            times.append(time.monotonic())
        elif command == "health":
            server.update(snapshots[int(argument)])
        elif command == "stop":
            server.stop()
            times.append(time.monotonic())
        print(" ".join(map(repr, times)), flush=True)
        if command == "stop":
            return


@contextmanager
def _process(*arguments: str, stdin: bool = False, ready: Path | None = None) -> Iterator[subprocess.Popen[str]]:
    process = subprocess.Popen(
        [sys.executable, __file__, *arguments],
        stdin=subprocess.PIPE if stdin else None,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        if ready is not None:
            _wait_for_path(ready, process)
        yield process
    finally:
        if process.poll() is None:
            process.terminate()
        process.wait(timeout=10)


# ----- measuring ----------------------------------------------------------------------------------------


class Target:
    """A server process and one client connection to it, measured in batches of calls."""

    def __init__(self, process: subprocess.Popen[str], path: Path, method: str, request: bytes) -> None:
        self.pid = process.pid
        self.channel = grpc.insecure_channel(f"unix://{path}", options=CHANNEL_OPTIONS)
        self.call = self.channel.unary_unary(method, _registered_method=True)
        self.request = request
        self.times: list[float] = []
        self.cpu = 0.0
        self.calls = 0
        for _ in range(200):  # warm-up: connection, worker threads, caches
            self.call(self.request)

    def batch(self, count: int) -> None:
        call, request, times = self.call, self.request, self.times
        cpu = _cpu_seconds(self.pid)
        for _ in range(count):
            began = time.perf_counter()
            call(request)
            times.append(time.perf_counter() - began)
        self.cpu += _cpu_seconds(self.pid) - cpu
        self.calls += count

    def close(self) -> None:
        self.channel.close()


def _interleaved(targets: list[Target], calls: int) -> None:
    for _ in range(max(1, calls // BATCH)):
        for target in targets:
            target.batch(BATCH)


def _allocate_request(ids: list[str]) -> bytes:
    return api_pb2.AllocateRequest(
        container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids)]
    ).SerializeToString()


def server_models(base: Path, calls: int, figures: dict[str, Figure]) -> None:
    """The empty RPC on both server models and Allocate on ``ResourceServer``, in one interleaved run."""
    ids = [d.id for d in bench_snapshot().devices]
    request = _allocate_request(ids[1:3])
    with (
        _process("--serve-empty", "thread", str(base / "empty-t.sock"), ready=base / "empty-t.sock") as empty_t,
        _process("--serve-empty", "aio", str(base / "empty-a.sock"), ready=base / "empty-a.sock") as empty_a,
        _process("--serve-plugin", str(base / "a"), ready=base / "a" / "nvidia-gpu.sock") as plugin,
    ):
        targets = {
            "floor thread": Target(empty_t, base / "empty-t.sock", EMPTY_METHOD, b""),
            "floor aio": Target(empty_a, base / "empty-a.sock", EMPTY_METHOD, b""),
            "allocate": Target(plugin, base / "a" / "nvidia-gpu.sock", ALLOCATE_METHOD, request),
        }
        _interleaved(list(targets.values()), calls)
        for name, target in targets.items():
            figures[name].add(target.times, target.cpu / target.calls)
            target.close()


def _listen(path: Path, arrivals: list[float]) -> Callable[[], None]:
    """Read a ListAndWatch stream of ``path`` as the kubelet does, noting when each message arrives."""
    channel = grpc.insecure_channel(f"unix://{path}", options=CHANNEL_OPTIONS)
    stream = channel.unary_stream("/v1beta1.DevicePlugin/ListAndWatch", _registered_method=True)(b"")

    def read() -> None:
        try:
            for _ in stream:
                arrivals.append(time.monotonic())
        except grpc.RpcError:
            pass

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    def close() -> None:
        stream.cancel()
        reader.join(5)
        channel.close()

    return close


def owned_registration(base: Path, restarts: int, updates: int, figures: dict[str, Figure]) -> None:
    """The plugin's own share of re-registration, and update -> kubelet, in a plugin process."""
    directory = base / "own"
    kubelet = KubeletEmulator(directory)
    kubelet.start()
    try:
        with _process("--plugin-agent", str(kubelet.kubelet_socket), stdin=True) as plugin:
            assert plugin.stdin is not None and plugin.stdout is not None
            assert plugin.stdout.readline().strip() == "ready"
            kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == GPUS, timeout=10, what="registered")

            def ask(command: str) -> list[float]:
                assert plugin.stdin is not None and plugin.stdout is not None
                plugin.stdin.write(command + "\n")
                plugin.stdin.flush()
                return [float(t) for t in plugin.stdout.readline().split()]

            parts: dict[str, list[float]] = {
                key: [] for key in ("reregister", "relink", "register", "law", "restart", "stop0", "serve")
            }
            for n in range(restarts):  # the two ways, turn about
                count = kubelet.registrations(RESOURCE)
                kubelet.restart()
                answer = ask("relink" if n % 2 == 0 else "restart")
                kubelet.wait_for(
                    lambda c=count: kubelet.registrations(RESOURCE) > c and kubelet.allocatable(RESOURCE) == GPUS,
                    timeout=10,
                    what="re-registered",
                )
                seen = time.monotonic()
                if n % 2 == 0:
                    began, relinked, registered = answer
                    parts["reregister"].append(seen - began)
                    parts["relink"].append(relinked - began)
                    parts["register"].append(registered - relinked)
                    parts["law"].append(seen - registered)
                else:
                    began, stopped, served, registered = answer
                    parts["restart"].append(seen - began)
                    parts["stop0"].append(stopped - began)
                    parts["serve"].append(served - stopped)
            for key, values in parts.items():
                figures[f"own {key}"].add(values)

            arrivals: list[float] = []
            close = _listen(directory / "nvidia-gpu.sock", arrivals)
            try:
                deadline = time.monotonic() + 5
                while not arrivals and time.monotonic() < deadline:
                    time.sleep(0.001)
                to_reader, to_kubelet = [], []
                for n in range(updates):
                    for command, healthy in ((f"health {n % GPUS}", GPUS - 1), ("health -1", GPUS)):
                        heard = len(arrivals)
                        (began,) = ask(command)
                        kubelet.wait_for(lambda h=healthy: kubelet.allocatable(RESOURCE) == h, timeout=5, what=command)
                        to_kubelet.append(time.monotonic() - began)
                        while len(arrivals) == heard and time.monotonic() < began + 5:
                            time.sleep(0.0005)
                        to_reader.append(arrivals[heard] - began)
            finally:
                close()
            figures["own update reader"].add(to_reader)
            figures["own update"].add(to_kubelet)

            began, stopped = ask("stop")
            figures["own stop"].add_one(stopped - began)
    finally:
        kubelet.stop()


def whole_agent(base: Path, args: argparse.Namespace, figures: dict[str, Figure]) -> None:
    plugin_dir = base / "dp"
    kubelet = KubeletEmulator(plugin_dir, base / "pr" / "kubelet.sock")
    kubelet.start()
    command = [
        sys.executable, "-m", "agent", "run", "--simulate", "dgx-a100", "--sim-control", str(base / "ctl.sock"),
        "--device-plugin-dir", str(plugin_dir), "--health-recovery-seconds", "0.05",
        "--log-level", args.agent_log_level, "--metrics-address", "off",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    started = time.monotonic()
    agent = subprocess.Popen(command, env=env, cwd=args.agent_home, stderr=subprocess.DEVNULL)
    try:
        kubelet.wait_for(
            lambda: kubelet.allocatable(RESOURCE) == GPUS if RESOURCE in kubelet.resources() else False,
            timeout=30,
            what="registered",
        )
        figures["start"].add_one(time.monotonic() - started)
        figures["rss"].add_one(_rss_kib(agent.pid) / 1024)
        control = SimControlClient(base / "ctl.sock")
        ids = sorted(kubelet.devices(RESOURCE))

        with _process("--serve-empty", "aio", str(base / "floor.sock"), ready=base / "floor.sock") as empty:
            floor = Target(empty, base / "floor.sock", EMPTY_METHOD, b"")
            socket = plugin_dir / "nvidia-gpu.sock"  # dialled as the kubelet does, with its channel options
            pairs = [[ids[n % GPUS], ids[(n + 1) % GPUS]] for n in range(GPUS)]
            preferred = api_pb2.PreferredAllocationRequest(
                container_requests=[
                    api_pb2.ContainerPreferredAllocationRequest(available_deviceIDs=ids, allocation_size=2)
                ]
            ).SerializeToString()
            targets = {
                "agent floor": floor,
                "agent allocate": Target(agent, socket, ALLOCATE_METHOD, _allocate_request(pairs[0])),
                "agent preferred": Target(agent, socket, "/v1beta1.DevicePlugin/GetPreferredAllocation", preferred),
                "agent prestart": Target(agent, socket, "/v1beta1.DevicePlugin/PreStartContainer", b""),
            }
            rss_before = _rss_kib(agent.pid)
            for turn in range(max(1, args.calls // BATCH)):  # every figure and the floor, turn about
                targets["agent allocate"].request = _allocate_request(pairs[turn % GPUS])
                for target in targets.values():
                    target.batch(BATCH)
            figures["rss growth"].add_one((_rss_kib(agent.pid) - rss_before) / 1024)
            for key, target in targets.items():
                figures[key].add(target.times, target.cpu / target.calls)
                target.close()

        xid, with_call = [], []
        for n in range(args.xids):
            began = time.monotonic()
            queued = control.call("inject_xid", gpu=n % GPUS, xid=48)  # when the driver had it: one clock
            kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) < GPUS, timeout=5, what="Unhealthy")
            seen = time.monotonic()
            xid.append(seen - queued)
            with_call.append(seen - began)
            kubelet.wait_for(lambda: kubelet.allocatable(RESOURCE) == GPUS, timeout=5, what="recovered")
        figures["agent xid"].add(xid)
        figures["agent xid call"].add(with_call)

        from_socket, from_call = [], []
        for _ in range(args.restarts):
            count = kubelet.registrations(RESOURCE)
            began = time.monotonic()
            kubelet.restart()  # the emulator's own teardown (closing its channels) takes ~200 ms of this
            served = time.monotonic()
            kubelet.wait_for(
                lambda c=count: kubelet.registrations(RESOURCE) > c and kubelet.allocatable(RESOURCE) == GPUS,
                timeout=10,
                what="re-registered",
            )
            from_socket.append(time.monotonic() - served)
            from_call.append(time.monotonic() - began)
        figures["agent restart"].add(from_socket)
        figures["agent restart call"].add(from_call)

        began = time.monotonic()
        agent.terminate()
        agent.wait(timeout=10)
        figures["sigterm"].add_one(time.monotonic() - began)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        kubelet.stop()


# ----- report -------------------------------------------------------------------------------------------


def _figures() -> dict[str, Figure]:
    names = {
        "floor thread": ("empty RPC, thread-pool server (the floor)", "-"),
        "floor aio": ("empty RPC, grpc.aio server", "-"),
        "allocate": ("Allocate (2 GPUs), ResourceServer (grpc.aio)", "p50 <= 1.2x floor"),
        "own reregister": ("socket deleted: restore_socket + register -> kubelet has all", "p99 < 16 ms (all of it)"),
        "own relink": ("  restore_socket() (link the standby name back)", "-"),
        "own register": ("  Register (the kubelet dials back inside it)", "-"),
        "own law": ("  Register returned -> kubelet has all devices", "-"),
        "own restart": ("socket deleted: stop, new server, register -> kubelet has all", "-"),
        "own stop0": ("  stop the old server (grace 0)", "-"),
        "own serve": ("  start a new server on the socket", "-"),
        "own update reader": ("update(snapshot) -> message at a ListAndWatch reader", "-"),
        "own update": ("update(snapshot) -> kubelet emulator has the new list", "-"),
        "own stop": ("ResourceServer.stop() with the kubelet's stream open", "-"),
        "start": ("process start -> registered, 8 GPUs healthy", "- (metrics off; the target: bench_lifecycle)"),
        "agent floor": ("empty RPC, grpc.aio server (the floor)", "-"),
        "agent allocate": ("Allocate (2 GPUs) via the kubelet's connection", "p50 <= 1.2x floor"),
        "agent preferred": ("GetPreferredAllocation (2 of 8)", "-"),
        "agent prestart": ("PreStartContainer (a no-op on the agent)", "-"),
        "agent xid": ("XID in the driver -> kubelet sees Unhealthy", "p99 < 2.5 ms"),
        "agent xid call": ("  from the start of the sim control call injecting it", "-"),
        "agent restart": ("kubelet restart (new kubelet.sock) -> re-registered", "p99 < 16 ms"),
        "agent restart call": ("  from the start of the emulator's restart()", "-"),
        "sigterm": ("SIGTERM -> exit", "< 100 ms"),
        "rss": ("RSS after start", "- (metrics off; the target: bench_lifecycle)"),
        "rss growth": ("RSS growth over the Allocate calls", "< 2 MB"),
    }
    return {key: Figure(name, target) for key, (name, target) in names.items()}


def _ms(value: float) -> str:
    return f"{value * 1000:8.2f} ms"


def _print_row(figure: Figure, floor: Figure | None, unit: str = "ms") -> None:
    if not figure.p50:
        return
    p50 = statistics.median(figure.p50)
    if figure.single:
        shown = f"{p50:8.1f} MB" if unit == "MB" else _ms(p50)
        print(f"  {figure.name:<52} {shown}{'':34}  target {figure.target}")
        return
    p99 = statistics.median(figure.p99)
    ratio = f"{p50 / statistics.median(floor.p50):5.2f}x" if floor is not None and floor.p50 else "     -"
    cpu = f"{statistics.median(figure.cpu) * 1e6:5.0f} us" if figure.cpu else "       -"
    print(f"  {figure.name:<52} p50 {_ms(p50)}  p99 {_ms(p99)}  {ratio}  cpu/call {cpu}  target {figure.target}")


def report(figures: dict[str, Figure], rounds: int) -> None:
    print(
        f"machine: {os.cpu_count()} cores, Python {platform.python_version()}, grpcio {grpc.__version__}; "
        f"{rounds} rounds, medians of the per-round p50 / p99; 'x' = p50 / the floor's p50 in the same rounds"
    )
    print("1. Allocate against the floor, interleaved (cpu/call: the server process; x: against the aio floor)")
    for key in ("floor thread", "floor aio", "allocate"):
        _print_row(figures[key], figures["floor aio"])
    print("2. the plugin's share of re-registration and updates (a plugin process, the kubelet emulator)")
    for key in ("own reregister", "own relink", "own register", "own law", "own restart", "own stop0", "own serve"):
        _print_row(figures[key], figures["floor thread"])
    for key in ("own update reader", "own update", "own stop"):
        _print_row(figures[key], figures["floor thread"])
    print("3. the whole agent (tessera run --simulate dgx-a100, a fresh process per round)")
    for key in ("start", "agent floor", "agent allocate", "agent preferred", "agent prestart"):
        _print_row(figures[key], figures["agent floor"])
    for key in ("agent xid", "agent xid call"):
        _print_row(figures[key], figures["agent floor"])
    for key in ("agent restart", "agent restart call", "sigterm"):
        _print_row(figures[key], figures["agent floor"])
    _print_row(figures["rss"], None, unit="MB")
    _print_row(figures["rss growth"], None, unit="MB")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000, help="calls per round for each unary figure")
    parser.add_argument("--restarts", type=int, default=15, help="kubelet restarts per round")
    parser.add_argument("--xids", type=int, default=30, help="XIDs per round")
    parser.add_argument("--agent-log-level", default="warning")
    parser.add_argument("--parts", default="models,own,agent", help="which parts to run (comma-separated)")
    parser.add_argument("--serve-empty", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--serve-plugin", help=argparse.SUPPRESS)
    parser.add_argument("--plugin-agent", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_empty:
        _serve_empty(*args.serve_empty)
        return
    if args.serve_plugin:
        _serve_plugin(args.serve_plugin)
        return
    if args.plugin_agent:
        _plugin_agent(args.plugin_agent)
        return

    logging.getLogger().addHandler(logging.NullHandler())  # the kubelet emulator's logs are not the report
    figures = _figures()
    parts: dict[str, Callable[[Path], None]] = {
        "models": lambda base: server_models(base, args.calls, figures),
        "own": lambda base: owned_registration(base, args.restarts * 2, args.xids, figures),
        "agent": lambda base: whole_agent(base, args, figures),
    }
    steps = [parts[name] for name in args.parts.split(",")]
    # `python -m agent` runs a copy of this tree's agent with its bytecode compiled, as the image has it
    args.agent_home = package_copy(Path(tempfile.mkdtemp(prefix="bench-plugin-agent-")), compiled=True)
    try:
        for n in range(args.rounds):
            base = Path(tempfile.mkdtemp(prefix="bp", dir="/tmp"))  # unix socket paths must stay short
            try:
                for step in steps[n % len(steps) :] + steps[: n % len(steps)]:  # each round starts elsewhere
                    step(base)
            finally:
                shutil.rmtree(base, ignore_errors=True)
            print(f"round {n + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(args.agent_home, ignore_errors=True)
    report(figures, args.rounds)


if __name__ == "__main__":
    main()
