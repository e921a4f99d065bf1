"""Thread-pool gRPC servers vs one asyncio loop of ``grpc.aio`` servers, for the per-resource device plugins.

Run: python tests/bench/bench_grpc_models.py [--servers 3] [--seconds 30] [--rounds 3] [--models thread,aio]

The question: serve each resource's ``v1beta1.DevicePlugin`` from its own ``grpc.server(ThreadPoolExecutor)``
(what ``agent/plugin/server.py`` does) or serve all of them from ONE asyncio event loop running one
``grpc.aio`` server per socket? Allocate latency was measured equal (``bench_plugin.py``); this measures what
the agent pays while nothing happens (idle CPU, wake-ups), and the latency, start and stop figures beside it.

Every round starts fresh child processes, one per model, each serving ``--servers`` device plugins on as many
unix sockets (under a short ``/tmp`` directory) with the generated stubs (``api_pb2_grpc.DevicePluginServicer``:
GetDevicePluginOptions, ListAndWatch with 8 devices, Allocate answering one empty container response; and an
empty raw-bytes method ``/bench.Empty/Call`` on the same server, the RPC floor):

- ``thread``: ``grpc.server(ThreadPoolExecutor(8))`` per socket; ListAndWatch blocks on a
  ``threading.Condition`` exactly as ``ResourceServer.stream`` does (woken by an update, the stop or the end of
  the RPC through ``context.add_callback``).
- ``aio``: one asyncio loop in one thread that is NOT the main thread (the agent's main thread has signals and
  the reconcile loop), one ``grpc.aio.server()`` per socket; ListAndWatch is an async generator awaiting an
  ``asyncio.Event``; updates are handed over with ``loop.call_soon_threadsafe``.
- ``aio-main`` (only with ``--models``): the same with the loop in the main thread and the commands in a helper
  thread, to see whether the loop's thread matters.

Each child's main thread (the helper thread for ``aio-main``) stands in for the agent's reconcile thread: it
blocks reading commands from a pipe (stdin) and hands snapshots over as the agent would (``push``), stops the
servers (``stop``), or answers ``echo``. Two floor children run in the same rounds: ``floor`` is
``python -c`` with ``import grpc`` and a blocking read of stdin, nothing else (importing grpc starts no
thread); ``core`` is the same with one idle channel created, which starts gRPC core (its event-engine, timer
and lifeguard threads), as any process serving gRPC has it. Per-server costs are taken above ``core``.

Measured, per round (the medians over the rounds are printed, with min-max ranges for the idle figures):

1. Idle: the parent opens ListAndWatch on every socket as the kubelet does (one channel per socket, the
   kubelet emulator's channel options, the stream kept open after its first message), waits ``--warmup``
   seconds, then measures all children over the SAME ``--seconds`` window (a noisy neighbour hits every model
   alike): the process CPU clock (``clock_gettime`` of the child's CPUCLOCK_SCHED, ns resolution, every thread
   including exited ones) as % of one core; the same from utime + stime of ``/proc/<pid>/stat`` (10 ms ticks,
   a cross-check); voluntary context switches per second summed over ``/proc/<pid>/task/*/status``, which
   counts wake-ups whatever the machine's load (each is a thread that slept and was woken), and per thread
   (labelled with its Python name when it has one, else its ``comm``; digits folded to ``#``).
   RSS (VmRSS) after start, with the streams open.
2. Push latency: the parent writes ``push <server> <listing>`` on the child's stdin and takes the time its
   ListAndWatch reader thread receives the message (both times in the parent, CLOCK_MONOTONIC). The path is
   pipe -> the reconcile stand-in wakes -> handover (Condition.notify_all, or call_soon_threadsafe + Event.set)
   -> the stream sends -> the parent's reader. The pipe is the same for every model; its own cost is printed
   (``echo`` round trip, child's main thread answers on stdout). Pushes go to each server in turn, the models
   interleaved in batches.
3. Allocate (2 devices) and the empty RPC: unary round trips over the stream's channel, raw bytes on the
   client side, models and methods interleaved in batches. And a sync client inside the child, as the agent's
   Register is (new channel, one call, close; from the reconcile stand-in, 20 times, to an empty-method
   thread-pool server in the parent, the kubelet's stand-in): whether sync grpc beside a ``grpc.aio`` loop in
   one process works and costs the same.
4. Stop: the parent writes ``stop``; the child ends every stream (as ``ResourceServer.stop``), stops every
   server (thread pool: one after the other, as the agent's ``_shutdown``; aio: ``asyncio.gather`` of the
   stops) with ``--grace``, removes the sockets and reports the time; the parent records stop -> sockets
   removed, -> every stream ended at its reader (and how it ended), -> process exited (plain interpreter exit,
   no ``os._exit``). Anything a child wrote on stderr is printed at the end.

Every child is stopped, killed if it must be, and the socket directory removed, whatever happens.

Notes from writing it (grpcio 1.85): a ``grpc.aio.server()`` must be created inside its loop (here: in a
coroutine sent with ``run_coroutine_threadsafe``); one created in another thread and started in the loop fails
with "Future attached to a different loop". Each thread-pool server's ``_serve`` thread sleeps in
``epoll_wait`` for at most 200 ms (the interrupt check); with two or more servers their threads share gRPC's
one epoll set and hand the poller role over with a futex wake at each timeout, so each wakes ~7-8 times a
second rather than 5 (``strace -p`` on the ``_serve`` threads shows it).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import platform
import queue
import re
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from agent.api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc

GPUS = 8
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
CPUCLOCK_SCHED = 2  # the kernel's process CPU clock id for a pid: ((~pid) << 3) | CPUCLOCK_SCHED
LIST_AND_WATCH = "/v1beta1.DevicePlugin/ListAndWatch"
ALLOCATE = "/v1beta1.DevicePlugin/Allocate"
EMPTY_SERVICE, EMPTY_METHOD = "bench.Empty", "/bench.Empty/Call"
BATCH = 25  # pushes or calls per turn when models are interleaved
MODELS = ("thread", "aio", "aio-main")
FLOOR_CODE = """
import os, sys, time, grpc
if sys.argv[1] == "core":  # gRPC core started (its event engine and timer threads), nothing served
    channel = grpc.insecure_channel("unix:///nonexistent/bench.sock")
os.write(1, b"ready\\n")
while True:
    line = sys.stdin.buffer.readline()
    if line.startswith(b"echo"):
        os.write(1, b"echo\\n")
    elif not line or line.startswith(b"stop"):
        break
os.write(1, repr(time.monotonic()).encode() + b"\\n")
"""
FLOORS = {"floor": "import grpc, blocked reading stdin", "core": "the same + one idle channel (gRPC core up)"}


# ----- the children: device plugins under each model ---------------------------------------------------


def _listings() -> list[api_pb2.ListAndWatchResponse]:
    """8 GPUs on two NUMA nodes, all healthy (index 0) or GPU n-1 Unhealthy (index n)."""

    def listing(unhealthy: int) -> api_pb2.ListAndWatchResponse:
        return api_pb2.ListAndWatchResponse(
            devices=[
                api_pb2.Device(
                    ID=f"GPU-{n:08x}-5555-4000-8000-{n:012x}",
                    health="Unhealthy" if n == unhealthy else "Healthy",
                    topology=api_pb2.TopologyInfo(nodes=[api_pb2.NUMANode(ID=n // 4)]),
                )
                for n in range(GPUS)
            ]
        )

    return [listing(-1)] + [listing(n) for n in range(GPUS)]


OPTIONS = api_pb2.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)


def _allocate(request: api_pb2.AllocateRequest) -> api_pb2.AllocateResponse:
    return api_pb2.AllocateResponse(
        container_responses=[api_pb2.ContainerAllocateResponse() for _ in request.container_requests]
    )


class ThreadPlugin(api_pb2_grpc.DevicePluginServicer):
    """The thread-pool model: ListAndWatch as ``ResourceServer.stream`` (a Condition, no polling)."""

    def __init__(self, listing: api_pb2.ListAndWatchResponse) -> None:
        self._listing = listing
        self._version = 0
        self._changed = threading.Condition()
        self._stopping = False

    def GetDevicePluginOptions(self, request: api_pb2.Empty, context: grpc.ServicerContext) -> object:
        return OPTIONS

    def ListAndWatch(self, request: api_pb2.Empty, context: grpc.ServicerContext) -> Iterator[object]:
        sent = -1
        if not context.add_callback(self._wake):
            return
        while True:
            with self._changed:
                while self._version == sent and not self._stopping and context.is_active():
                    self._changed.wait()
                if self._stopping or not context.is_active():
                    return
                sent, listing = self._version, self._listing
            yield listing

    def Allocate(self, request: api_pb2.AllocateRequest, context: grpc.ServicerContext) -> object:
        return _allocate(request)

    def PreStartContainer(self, request: object, context: grpc.ServicerContext) -> object:
        return api_pb2.PreStartContainerResponse()

    def update(self, listing: api_pb2.ListAndWatchResponse) -> None:  # the reconcile thread
        with self._changed:
            self._listing = listing
            self._version += 1
            self._changed.notify_all()

    def end_streams(self) -> None:
        with self._changed:
            self._stopping = True
            self._changed.notify_all()

    def _wake(self) -> None:
        with self._changed:
            self._changed.notify_all()


class AioPlugin(api_pb2_grpc.DevicePluginServicer):
    """The aio model: ListAndWatch awaits an ``asyncio.Event``; ``update`` and ``end_streams`` run in the loop."""

    def __init__(self, listing: api_pb2.ListAndWatchResponse) -> None:
        self._listing = listing
        self._version = 0
        self._changed = asyncio.Event()
        self._stopping = False

    async def GetDevicePluginOptions(self, request: api_pb2.Empty, context: grpc.aio.ServicerContext) -> object:
        return OPTIONS

    async def ListAndWatch(self, request: api_pb2.Empty, context: grpc.aio.ServicerContext) -> AsyncIterator[object]:
        sent = -1  # the end of the RPC cancels this task at its await: no callback needed
        while not self._stopping:
            if self._version == sent:
                await self._changed.wait()
                continue
            sent = self._version
            yield self._listing

    async def Allocate(self, request: api_pb2.AllocateRequest, context: grpc.aio.ServicerContext) -> object:
        return _allocate(request)

    async def PreStartContainer(self, request: object, context: grpc.aio.ServicerContext) -> object:
        return api_pb2.PreStartContainerResponse()

    def update(self, listing: api_pb2.ListAndWatchResponse) -> None:  # in the loop, via call_soon_threadsafe
        self._listing = listing
        self._version += 1
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def end_streams(self) -> None:
        self._stopping = True
        self._changed.set()


def _say(text: str) -> None:
    os.write(1, text.encode() + b"\n")


def _sync_calls(path: str, count: int = 20) -> str:
    """What Register does from the agent's threads: a new sync channel, one unary call, close; ``count``
    times, to a server in another process (the parent's kubelet stand-in). The median and the max, seconds."""
    times = []
    for _ in range(count):
        began = time.perf_counter()
        with grpc.insecure_channel(f"unix://{path}") as channel:
            channel.unary_unary(EMPTY_METHOD, _registered_method=True)(b"", timeout=10)
        times.append(time.perf_counter() - began)
    return f"{statistics.median(times)!r} {max(times)!r}"


def _commands(push: Callable[[int, int], None], stop: Callable[[], None]) -> None:
    """The reconcile thread's stand-in: block on stdin, hand snapshots over, stop. EOF stops too."""
    _say("ready")
    while True:
        words = sys.stdin.buffer.readline().split()
        if not words or words[0] == b"stop":
            stop()
            _say(repr(time.monotonic()))
            return
        if words[0] == b"push":
            push(int(words[1]), int(words[2]))
        elif words[0] == b"echo":
            _say("echo")
        elif words[0] == b"register":
            _say(_sync_calls(words[1].decode()))
        elif words[0] == b"threads":
            _say(json.dumps({thread.native_id: thread.name for thread in threading.enumerate()}))


def _empty_handler() -> grpc.GenericRpcHandler:
    """``/bench.Empty/Call`` for a thread-pool server: raw bytes in and out, nothing done."""
    return grpc.method_handlers_generic_handler(
        EMPTY_SERVICE, {"Call": grpc.unary_unary_rpc_method_handler(lambda request, context: b"")}
    )


def _serve_thread(directory: Path, count: int, grace: float) -> None:
    listings = _listings()
    empty = _empty_handler()
    served: list[tuple[ThreadPlugin, grpc.Server, futures.ThreadPoolExecutor, Path]] = []
    for k in range(count):
        path = directory / f"plugin-{k}.sock"
        plugin = ThreadPlugin(listings[0])
        executor = futures.ThreadPoolExecutor(8, thread_name_prefix=f"plugin-{k}")
        server = grpc.server(executor)
        api_pb2_grpc.add_DevicePluginServicer_to_server(plugin, server)
        server.add_generic_rpc_handlers((empty,))
        server.add_insecure_port(f"unix://{path}")
        server.start()
        path.chmod(0o600)
        served.append((plugin, server, executor, path))

    def push(k: int, listing: int) -> None:
        served[k][0].update(listings[listing])

    def stop() -> None:  # as the agent's _shutdown: ResourceServer.stop for each, one after the other
        for plugin, server, executor, path in served:
            plugin.end_streams()
            server.stop(grace).wait()
            executor.shutdown(wait=False)
            path.unlink(missing_ok=True)

    _commands(push, stop)


def _serve_aio(directory: Path, count: int, grace: float, *, loop_in_main: bool) -> None:
    listings = _listings()
    loop = asyncio.new_event_loop()
    served: list[tuple[AioPlugin, grpc.aio.Server, Path]] = []

    async def nothing(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return b""

    empty = grpc.method_handlers_generic_handler(EMPTY_SERVICE, {"Call": grpc.unary_unary_rpc_method_handler(nothing)})

    async def start() -> None:
        for k in range(count):
            path = directory / f"plugin-{k}.sock"
            plugin = AioPlugin(listings[0])
            server = grpc.aio.server()
            api_pb2_grpc.add_DevicePluginServicer_to_server(plugin, server)
            server.add_generic_rpc_handlers((empty,))
            server.add_insecure_port(f"unix://{path}")
            await server.start()
            path.chmod(0o600)
            served.append((plugin, server, path))

    async def stop_all() -> None:
        for plugin, _, _ in served:
            plugin.end_streams()
        await asyncio.gather(*(server.stop(grace) for _, server, _ in served))
        for _, _, path in served:
            path.unlink(missing_ok=True)

    def push(k: int, listing: int) -> None:  # from the reconcile thread
        loop.call_soon_threadsafe(served[k][0].update, listings[listing])

    def stop() -> None:
        asyncio.run_coroutine_threadsafe(stop_all(), loop).result(30)

    if loop_in_main:
        loop.run_until_complete(start())

        def commands() -> None:
            try:
                _commands(push, stop)
            finally:
                loop.call_soon_threadsafe(loop.stop)

        helper = threading.Thread(target=commands, name="commands")
        helper.start()
        loop.run_forever()
        helper.join()
    else:
        runner = threading.Thread(target=loop.run_forever, name="aio-loop", daemon=True)
        runner.start()
        asyncio.run_coroutine_threadsafe(start(), loop).result(30)
        try:
            _commands(push, stop)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            runner.join(10)
    loop.close()


def child_main(model: str, directory: str, count: int, grace: float) -> None:
    if model == "thread":
        _serve_thread(Path(directory), count, grace)
    else:
        _serve_aio(Path(directory), count, grace, loop_in_main=model == "aio-main")


# ----- the parent: processes, streams, samples ----------------------------------------------------------


class Child:
    """A child process driven over its stdin/stdout pipes, line by line, with timeouts."""

    def __init__(self, name: str, argv: list[str], stderr: Path) -> None:
        self.name = name
        self.stderr_path = stderr
        self.began = time.monotonic()
        with stderr.open("wb") as sink:
            self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=sink, bufsize=0)
        self.pid = self.process.pid
        self._buffer = b""

    def send(self, line: str) -> None:
        assert self.process.stdin is not None
        os.write(self.process.stdin.fileno(), line.encode() + b"\n")

    def readline(self, timeout: float = 15.0) -> str:
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.name}: no answer within {timeout} s")
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise RuntimeError(f"{self.name} exited (code {self.process.poll()}): {self.stderr_tail()}")
                self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()

    def stderr_tail(self, lines: int = 12) -> str:
        try:
            return "\n".join(self.stderr_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()


class Stream:
    """One socket as the kubelet holds it: a channel, ListAndWatch open, a reader thread noting arrivals."""

    def __init__(self, path: Path, options: tuple[tuple[str, object], ...]) -> None:
        self.channel = grpc.insecure_channel(f"unix://{path}", options=options)
        self.arrivals: queue.SimpleQueue[float | None] = queue.SimpleQueue()
        self.first: bytes | None = None
        self.ended: float | None = None
        self.status = "open"
        self.allocate = self.channel.unary_unary(ALLOCATE, _registered_method=True)
        self.empty = self.channel.unary_unary(EMPTY_METHOD, _registered_method=True)
        self._call = self.channel.unary_stream(LIST_AND_WATCH, _registered_method=True)(b"")
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for message in self._call:
                if self.first is None:
                    self.first = message
                self.arrivals.put(time.monotonic())
            self.status = "OK"
        except grpc.RpcError as error:
            self.status = error.code().name
        self.ended = time.monotonic()
        self.arrivals.put(None)

    def next_arrival(self, timeout: float = 5.0) -> float:
        arrival = self.arrivals.get(timeout=timeout)
        if arrival is None:
            raise RuntimeError(f"ListAndWatch ended ({self.status})")
        return arrival

    def close(self) -> None:
        self._call.cancel()
        self._reader.join(5)
        self.channel.close()


@dataclass
class Sample:
    at: float
    cpu_ns: int  # the process CPU clock: every thread, exited ones included
    ticks: int  # utime + stime, /proc/<pid>/stat
    tasks: dict[int, tuple[str, int, int, int]]  # tid -> comm, runtime ns (schedstat), voluntary, involuntary


def _sample(pid: int) -> Sample:
    at = time.monotonic()
    cpu_ns = time.clock_gettime_ns(((~pid) << 3) | CPUCLOCK_SCHED)
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    ticks = int(fields[11]) + int(fields[12])
    tasks = {}
    for entry in os.scandir(f"/proc/{pid}/task"):
        try:
            comm = Path(entry.path, "comm").read_text().strip()
            runtime = int(Path(entry.path, "schedstat").read_text().split()[0])
            status = dict(
                line.split(":", 1) for line in Path(entry.path, "status").read_text().splitlines() if ":" in line
            )
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread just exited
        voluntary = int(status["voluntary_ctxt_switches"])
        involuntary = int(status["nonvoluntary_ctxt_switches"])
        tasks[int(entry.name)] = (comm, runtime, voluntary, involuntary)
    return Sample(at, cpu_ns, ticks, tasks)


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def _label(name: str) -> str:
    return re.sub(r"\d+", "#", name)


@dataclass
class Results:
    """Per model, per round: one value per figure (latencies: the round's p50 and p99)."""

    values: dict[str, list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    ends: collections.Counter[str] = field(default_factory=collections.Counter)
    threads: dict[str, list[float]] = field(default_factory=lambda: collections.defaultdict(lambda: [0, 0.0, 0.0]))
    gone: int = 0  # threads that exited inside an idle window (their wake-ups are missing from the count)
    stderr: list[str] = field(default_factory=list)

    def latency(self, key: str, samples: list[float]) -> None:
        self.values[f"{key} p50"].append(statistics.median(samples))
        self.values[f"{key} p99"].append(_percentile(samples, 0.99))


def _idle(before: Sample, after: Sample, names: dict[int, str], pid: int, results: Results, rounds: int) -> None:
    seconds = after.at - before.at
    results.values["cpu"].append((after.cpu_ns - before.cpu_ns) / 1e9 / seconds * 100)
    results.values["ticks"].append((after.ticks - before.ticks) / CLOCK_TICKS / seconds * 100)
    voluntary = involuntary = 0
    for tid, (comm, runtime, vol, invol) in after.tasks.items():
        _, runtime0, vol0, invol0 = before.tasks.get(tid, (comm, 0, 0, 0))
        voluntary += vol - vol0
        involuntary += invol - invol0
        label = "MainThread" if tid == pid else _label(names.get(tid, f"[{comm}]"))
        entry = results.threads[label]
        entry[0] += 1 / rounds
        entry[1] += (vol - vol0) / seconds / rounds
        entry[2] += (runtime - runtime0) / 1e3 / seconds / rounds  # us of CPU per second
    results.gone += len(before.tasks.keys() - after.tasks.keys())
    results.values["wakeups"].append(voluntary / seconds)
    results.values["involuntary"].append(involuntary / seconds)
    results.values["threads"].append(len(after.tasks))


def one_round(n: int, models: list[str], args: argparse.Namespace, results: dict[str, Results], options: tuple) -> None:
    order = models[n % len(models) :] + models[: n % len(models)]  # each round starts with another model
    base = Path(tempfile.mkdtemp(prefix="bgm", dir="/tmp"))  # unix socket paths must stay short
    children: dict[str, Child] = {}
    streams: dict[str, list[Stream]] = {}
    try:
        for name in FLOORS:
            children[name] = Child(name, [sys.executable, "-c", FLOOR_CODE, name], base / f"{name}.err")
        for model in order:
            (base / model).mkdir()
            argv = [sys.executable, __file__, "--child", model, str(base / model), "--servers", str(args.servers)]
            children[model] = Child(model, [*argv, "--grace", str(args.grace)], base / f"{model}.err")
        for name, child in children.items():
            child.readline(30)
            results[name].values["start"].append(time.monotonic() - child.began)
        for model in order:
            streams[model] = [Stream(base / model / f"plugin-{k}.sock", options) for k in range(args.servers)]
        for model in order:
            for stream in streams[model]:
                stream.next_arrival(10)
                assert stream.first is not None
                assert len(api_pb2.ListAndWatchResponse.FromString(stream.first).devices) == GPUS
        names: dict[str, dict[int, str]] = {name: {} for name in FLOORS}
        for model in order:
            children[model].send("threads")
            names[model] = {int(tid): name for tid, name in json.loads(children[model].readline()).items()}
        for name, child in children.items():
            results[name].values["rss"].append(_rss_mib(child.pid))

        time.sleep(args.warmup)
        before = {name: _sample(child.pid) for name, child in children.items()}
        time.sleep(args.seconds)
        after = {name: _sample(child.pid) for name, child in children.items()}
        for name, child in children.items():
            _idle(before[name], after[name], names[name], child.pid, results[name], args.rounds)

        # push latency, models interleaved in batches; each stream alternates all-healthy / one GPU Unhealthy
        pushes: dict[str, list[float]] = {model: [] for model in order}
        shown = {model: [0] * args.servers for model in order}
        for turn in range(max(1, args.pushes // BATCH)):
            for model in order:
                for i in range(BATCH):
                    k = (turn * BATCH + i) % args.servers
                    listing = 0 if shown[model][k] else 1 + (turn * BATCH + i) % GPUS
                    shown[model][k] = listing
                    began = time.monotonic()
                    children[model].send(f"push {k} {listing}")
                    pushes[model].append(streams[model][k].next_arrival() - began)
        for model in order:
            results[model].latency("push", pushes[model])

        # the pipe alone (the push's trigger), every child
        for name, child in children.items():
            echoes = []
            for _ in range(100):
                began = time.monotonic()
                child.send("echo")
                child.readline()
                echoes.append(time.monotonic() - began)
            results[name].latency("echo", echoes)

        # a sync client inside the child (Register's way: channel, call, close) to a server in the parent
        kubelet = grpc.server(futures.ThreadPoolExecutor(4))
        kubelet.add_generic_rpc_handlers((_empty_handler(),))
        kubelet.add_insecure_port(f"unix://{base / 'kubelet.sock'}")
        kubelet.start()
        try:
            for model in order:
                children[model].send(f"register {base / 'kubelet.sock'}")
                median, most = map(float, children[model].readline(60).split())
                results[model].values["register p50"].append(median)
                results[model].values["register p99"].append(most)
        finally:
            kubelet.stop(0).wait()

        # Allocate and the empty RPC, models and methods interleaved, the servers in turn
        request = api_pb2.AllocateRequest(
            container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=["GPU-a", "GPU-b"])]
        ).SerializeToString()
        calls: dict[tuple[str, str], list[float]] = {}
        for model in order:
            for stream in streams[model]:
                for _ in range(20):  # warm-up: workers, caches
                    stream.allocate(request)
                    stream.empty(b"")
        for turn in range(max(1, args.calls // BATCH)):
            for model in order:
                for method, payload in (("allocate", request), ("empty", b"")):
                    times = calls.setdefault((model, method), [])
                    for i in range(BATCH):
                        call = getattr(streams[model][(turn * BATCH + i) % args.servers], method)
                        began = time.perf_counter()
                        call(payload)
                        times.append(time.perf_counter() - began)
        for (model, method), times in calls.items():
            results[model].latency(method, times)

        # stop: sockets removed, streams ended at the readers, process gone
        for name in [*order, *FLOORS]:
            child = children[name]
            began = time.monotonic()
            child.send("stop")
            stopped = float(child.readline(30))
            child.process.wait(30)
            exited = time.monotonic()
            results[name].values["stop sockets"].append(stopped - began)
            results[name].values["stop exit"].append(exited - began)
            if name in FLOORS:
                continue
            for stream in streams[name]:
                stream.close()
            ended = [stream.ended for stream in streams[name]]
            if all(end is not None for end in ended):
                results[name].values["stop streams"].append(max(ended) - began)  # type: ignore[type-var]
            results[name].ends.update(stream.status for stream in streams[name])
            left = list((base / name).glob("*.sock"))
            if left:
                results[name].stderr.append(f"round {n + 1}: {len(left)} socket(s) left after exit")
            if child.process.returncode != 0:
                results[name].stderr.append(f"round {n + 1}: exit code {child.process.returncode}")
    finally:
        for model_streams in streams.values():
            for stream in model_streams:
                stream.close()
        for name, child in children.items():
            child.close()
            text = child.stderr_tail(40).strip()
            if text:
                results[name].stderr.append(f"round {n + 1} stderr:\n{text}")
        shutil.rmtree(base, ignore_errors=True)


# ----- report -------------------------------------------------------------------------------------------


def _cell(values: list[float], scale: float = 1.0, digits: int = 2, spread: bool = False) -> str:
    if not values:
        return "-"
    median = f"{statistics.median(values) * scale:.{digits}f}"
    if spread and len(values) > 1:
        return f"{median} ({min(values) * scale:.{digits}f}-{max(values) * scale:.{digits}f})"
    return median


def report(results: dict[str, Results], models: list[str], args: argparse.Namespace) -> None:
    names = [*FLOORS, *models]
    print(
        f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; Python {platform.python_version()}, "
        f"grpcio {grpc.__version__}; {args.servers} servers per model, {args.rounds} rounds, idle window "
        f"{args.seconds:g} s after {args.warmup:g} s warm-up (all children in the same window), stop grace "
        f"{args.grace:g} s"
    )
    print("medians over the rounds (idle figures: median (min-max)); latencies: medians of the per-round p50/p99")
    for name, what in FLOORS.items():
        print(f"{name}: {what}")
    print()
    print("| measure | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))

    def row(label: str, key: str, scale: float = 1.0, digits: int = 2, spread: bool = False) -> None:
        cells = [_cell(results[name].values.get(key, []), scale, digits, spread) for name in names]
        print(f"| {label} | " + " | ".join(cells) + " |")

    def pair(label: str, key: str) -> None:
        cells = []
        for name in names:
            values = results[name].values
            cells.append(
                f"{_cell(values[f'{key} p50'], 1000)} / {_cell(values[f'{key} p99'], 1000)}"
                if values.get(f"{key} p50")
                else "-"
            )
        print(f"| {label} | " + " | ".join(cells) + " |")

    row("idle CPU, % of a core (process CPU clock)", "cpu", digits=4, spread=True)
    row("idle CPU, % of a core (utime+stime, 10 ms ticks)", "ticks", digits=3, spread=True)
    row("wake-ups/s (voluntary ctxt switches, all threads)", "wakeups", digits=1, spread=True)
    row("involuntary ctxt switches/s", "involuntary", digits=2)
    row("threads", "threads", digits=0)
    row("RSS after start, streams open, MB", "rss", digits=1, spread=True)
    row("start -> serving, ms (every child started at once)", "start", 1000, 0)
    pair("push -> ListAndWatch reader, p50 / p99 ms", "push")
    pair("  pipe round trip alone (echo), p50 / p99 ms", "echo")
    pair("Allocate (2 devices), p50 / p99 ms", "allocate")
    pair("empty RPC (floor), p50 / p99 ms", "empty")
    pair("Register's way from the child (sync channel, call, close), median / max ms", "register")
    row("stop -> every socket removed, ms", "stop sockets", 1000, 1, spread=True)
    row("stop -> every stream ended at its reader, ms", "stop streams", 1000, 1, spread=True)
    row("stop -> process exited (plain interpreter exit), ms", "stop exit", 1000, 1, spread=True)
    ends = [", ".join(f"{k} x{v}" for k, v in sorted(results[name].ends.items())) or "-" for name in names]
    print("| how the streams ended at the reader | " + " | ".join(ends) + " |")

    floor_cpu = statistics.median(results["core"].values["cpu"])
    floor_wakeups = statistics.median(results["core"].values["wakeups"])
    print()
    print("above the 'core' floor, per server (the agent serves one per resource; target < 0.1 % for the agent):")
    for model in models:
        values = results[model].values
        cpu = (statistics.median(values["cpu"]) - floor_cpu) / args.servers
        wakeups = (statistics.median(values["wakeups"]) - floor_wakeups) / args.servers
        print(f"  {model:<9} {cpu:.4f} % of a core, {wakeups:.1f} wake-ups/s per server")
    print()
    print("idle wake-ups by thread (means over the rounds; '#' stands for any number; [comm] = no Python name):")
    for name in names:
        print(f"  {name}:")
        ranked = sorted(results[name].threads.items(), key=lambda item: -item[1][1])
        for label, (count, wakeups, cpu_us) in ranked:
            if wakeups >= 0.05 or cpu_us >= 1:
                print(f"    {label:<28} x{count:<4.1f} {wakeups:7.2f} wake-ups/s  {cpu_us:7.1f} us CPU/s")
        quiet = sum(count for count, wakeups, cpu_us in results[name].threads.values() if wakeups < 0.05 and cpu_us < 1)
        print(f"    ({quiet:.1f} more threads: no wake-ups)")
        if results[name].gone:
            print(f"    ({results[name].gone} threads exited inside idle windows: their wake-ups are not counted)")
    for name in names:
        for text in results[name].stderr:
            print(f"\n{name}: {text}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--servers", type=int, default=3, help="device-plugin servers (sockets) per model")
    parser.add_argument("--seconds", type=float, default=30.0, help="idle window per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds between opening the streams and idling")
    parser.add_argument("--pushes", type=int, default=200, help="pushes per model per round")
    parser.add_argument("--calls", type=int, default=500, help="Allocate (and empty) calls per model per round")
    parser.add_argument("--grace", type=float, default=0.1, help="server stop grace (ResourceServer.STOP_GRACE)")
    parser.add_argument("--models", default="thread,aio", help=f"comma-separated, of {','.join(MODELS)}")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(args.child[0], args.child[1], args.servers, args.grace)
        return

    from agent.sim.kubelet.common import CHANNEL_OPTIONS  # the kubelet emulator's dial options

    models = args.models.split(",")
    if unknown := set(models) - set(MODELS):
        parser.error(f"unknown models: {', '.join(sorted(unknown))}")
    results = {name: Results() for name in [*FLOORS, *models]}
    for n in range(args.rounds):
        one_round(n, models, args, results, CHANNEL_OPTIONS)
        print(f"round {n + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    report(results, models, args)


if __name__ == "__main__":
    main()
