"""The agent as a node runs it, against the least a Python device plugin can do, measured in the same run.

Run: python tests/bench/bench_node.py [--rounds 3] [--idle-seconds 60] [--xids 30]

The agent runs as the DaemonSet runs it (``daemonset/base``): the sharing ConfigMap mounted as a directory (the
kubelet's ``..data`` symlink layout, the four configs of ``daemonset/base/configs``), the node's
``nvidia.com/device-plugin.config`` label followed through the Kubernetes API (the API server stand-in, reached by
the real client over HTTP; the label names ``per-gpu-sharing``), metrics served, the status socket, PodResources —
on a simulated dgx-a100: ``nvidia.com/gpu`` (4) and ``nvidia.com/gpu.shared`` (32) from one process, from a copy
of this tree's ``agent`` with its bytecode compiled, run by a Python set up as the image's (``image_python``).

The floor is the least a Python device plugin does for the same job, in a process of its own started the same way
(this file, whose top level imports nothing but the standard library and grpc):
``grpc.aio`` and the generated v1beta1 stubs (nothing of Tessera's beyond them), serving ListAndWatch with the same
devices for both resources, registering both, and marking a device Unhealthy when told on a pipe. Nothing else:
no NVML, no config, no API server, no metrics.

Figures, each beside the floor's and the ratio (agent / floor); medians over the rounds, a fresh process per round,
the agent and the floor turn about:
- process start → every resource registered with all its devices allocatable (target < 200 ms);
- RSS after the idle window (default 60 s; target < 45 MB);
- XID → the kubelet sees the device Unhealthy, p50 / p99 over ``--xids`` per round, from the moment the simulated
  driver queued the XID (the floor: from the moment the pipe was written; target p50 < 1.5 ms).

Beside them, in the same run: the CPU time each process (with the children it waited for: the agent's config
checker) spent until registered — on a loaded machine the wall time mostly measures the queue for a core — and
the agent's RSS less the simulator's share. A real node does not load ``agent/sim`` (the simulated driver, its
YAML node specs, the control socket, the stand-in driver files): the share is the RSS of ``import agent.cli,
agent.run`` with the simulated dgx-a100 installed, its control socket served and its driver files laid out, as
``tessera run --simulate --sim-control`` does, less the RSS without them, each in a fresh process. (A real node
maps NVIDIA's ``libnvidia-ml.so.1`` instead, whose resident pages cannot be measured here.) Likewise the start less
the simulator's setup: the seconds that setup takes (its modules with PyYAML, the node spec, the control socket,
the stand-in driver files) in a fresh process after the agent's modules, one a round, taken from that round's start
— what the agent's own code takes; a real node's start has nvmlInit in its place, not measurable here.

Last, where a start's time goes: one more start, logging at debug level as JSON, its milestones (modules loaded,
GPUs discovered, the Node read, the checker's answer with its own time and the agent's wait for it, the plan, the
servers, the registration) in ms after the process was spawned; and what the agent's modules cost to load, with
the share of it that is Python building their dataclasses (each ``@dataclass`` compiles its generated methods one
``exec`` at a time on Python 3.11).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING, NamedTuple

import grpc

if TYPE_CHECKING:
    from agent.sim.apiserver import ApiServer
    from agent.sim.kubelet import KubeletEmulator

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "daemonset" / "base" / "configs"
CONFIG_NAME = "per-gpu-sharing"
NODE = "gpu-node-1"
WHOLE, SHARED = "nvidia.com/gpu", "nvidia.com/gpu.shared"
EXPECTED = {WHOLE: 4, SHARED: 32}  # per-gpu-sharing on dgx-a100: GPUs 0-3 whole, 4-7 time-sliced 8 ways


def image_interpreter() -> str:
    """The interpreter the image runs, where this machine has it: Debian's own ``python3.X`` (the image test's
    stand-in base is built from it; a distribution build, like the real base's ``python:3.11-slim``, which is
    configured ``--enable-optimizations --with-lto``), of this Python's version so that the dependencies installed
    here fit it. Otherwise this one (a development build — pyenv's, say: ``--enable-shared`` without
    optimizations — loads modules 20-25% slower: start figures are then higher, the floor's too)."""
    debian = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
    return str(debian) if debian.is_file() and os.access(debian, os.X_OK) else sys.executable


def image_python(directory: Path) -> str:
    """A Python set up as the image's: the image's interpreter (``image_interpreter``) in a virtual environment
    without pip whose site-packages reach this one's (the agent's dependencies) through a path file, so that a
    development install's hooks (an editable install's import finder, loaded by every process at start) are not
    loaded, as the image has none."""
    subprocess.run([image_interpreter(), "-m", "venv", "--without-pip", str(directory)], check=True)
    python = directory / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    ours = sorted({sysconfig.get_path("purelib"), sysconfig.get_path("platlib")})
    Path(purelib, "dependencies.pth").write_text("".join(f"{path}\n" for path in ours))
    return str(python)


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _cpu_seconds(pid: int) -> float:
    """User and system time of ``pid`` and of the children it has waited for."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(value) for value in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


# ----- the floor: the least a Python device plugin does -------------------------------------------------


def _floor_plugin(directory: str) -> None:
    """Serve both resources' devices, register them, and mark ``health <resource> <n>`` devices Unhealthy."""
    sys.path.insert(0, os.getcwd())  # the stubs from the agent's copy, as `python -m agent` finds it there
    from agent.api.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc

    plugin_dir = Path(directory)
    healthy = {resource: [True] * count for resource, count in EXPECTED.items()}
    changed = {resource: asyncio.Event() for resource in EXPECTED}

    class Plugin(api_pb2_grpc.DevicePluginServicer):
        def __init__(self, resource: str) -> None:
            self.resource = resource

        async def GetDevicePluginOptions(self, request, context):
            return api_pb2.DevicePluginOptions()

        async def ListAndWatch(self, request, context):
            while True:
                changed[self.resource].clear()
                yield api_pb2.ListAndWatchResponse(
                    devices=[
                        api_pb2.Device(ID=f"{self.resource}-{n}", health="Healthy" if ok else "Unhealthy")
                        for n, ok in enumerate(healthy[self.resource])
                    ]
                )
                await changed[self.resource].wait()

    async def main() -> None:
        servers = []
        for resource in EXPECTED:
            server = grpc.aio.server()
            api_pb2_grpc.add_DevicePluginServicer_to_server(Plugin(resource), server)
            endpoint = f"floor-{resource.replace('/', '-')}.sock"
            server.add_insecure_port(f"unix://{plugin_dir / endpoint}")
            await server.start()
            servers.append(server)
            async with grpc.aio.insecure_channel(f"unix://{plugin_dir / 'kubelet.sock'}") as channel:
                await api_pb2_grpc.RegistrationStub(channel).Register(
                    api_pb2.RegisterRequest(version="v1beta1", endpoint=endpoint, resource_name=resource)
                )
        loop = asyncio.get_running_loop()
        lines: asyncio.Queue[str] = asyncio.Queue()
        loop.add_reader(sys.stdin.fileno(), lambda: lines.put_nowait(sys.stdin.readline()))
        while line := await lines.get():
            _, resource, n = line.split()
            healthy[resource][int(n)] = not healthy[resource][int(n)]
            changed[resource].set()

    asyncio.run(main())


# ----- one round ----------------------------------------------------------------------------------------


@dataclass
class Figures:
    start: list[float] = field(default_factory=list)
    start_cpu: list[float] = field(default_factory=list)
    rss: list[float] = field(default_factory=list)
    xid_p50: list[float] = field(default_factory=list)
    xid_p99: list[float] = field(default_factory=list)


def _registered(kubelet) -> bool:
    return all(r in kubelet.resources() and kubelet.allocatable(r) == n for r, n in EXPECTED.items())


def _idle(seconds: float, process: subprocess.Popen) -> None:
    """Leave the process alone for the idle window (a deadline, not a poll of it)."""
    try:
        process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return
    raise RuntimeError(f"exited during the idle window (code {process.returncode})")


def _configmap_dir(base: Path) -> Path:
    """The ConfigMap as the kubelet mounts it: ``..data`` → a timestamped directory, each key a symlink."""
    mount = base / "config"
    data = mount / "..2026_11_28_00_00_00.000000001"
    data.mkdir(parents=True)
    for config in CONFIGS.glob("*.yaml"):
        (data / config.name).write_bytes(config.read_bytes())
        (mount / config.name).symlink_to(Path("..data") / config.name)
    (mount / "..data").symlink_to(data.name)
    return mount


def _node(base: Path) -> tuple[KubeletEmulator, ApiServer]:
    """The node the agent starts on: the kubelet emulator, and the API server stand-in with the labelled Node."""
    from agent.sim.apiserver import ApiServer
    from agent.sim.kubelet import KubeletEmulator

    kubelet = KubeletEmulator(base / "dp", base / "pr" / "kubelet.sock")
    kubelet.start()
    apiserver = ApiServer().start()
    apiserver.add_node(NODE, labels={"nvidia.com/device-plugin.config": CONFIG_NAME})
    return kubelet, apiserver


def _start_agent(
    base: Path, args: argparse.Namespace, apiserver: ApiServer, *, stderr: IO[str] | int, debug: bool = False
) -> subprocess.Popen[bytes]:
    """``tessera run`` as the DaemonSet runs it (see the module's docstring), on ``_node``; ``debug``: its log at
    debug level, as JSON lines."""
    command = [
        args.python, "-m", "agent", "run", "--simulate", "dgx-a100", "--sim-control", str(base / "ctl.sock"),
        "--config", str(_configmap_dir(base)), "--node-name", NODE,
        "--kubeconfig", str(apiserver.write_kubeconfig(base / "kubeconfig")),
        "--device-plugin-dir", str(base / "dp"), "--pod-resources-socket", str(base / "pr" / "kubelet.sock"),
        "--metrics-address", "127.0.0.1:0", "--status-socket", str(base / "status.sock"),
        "--health-recovery-seconds", "0.05",
        *(("--log-level", "debug", "--log-format", "json") if debug else ("--log-level", "warning")),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return subprocess.Popen(command, env=env, cwd=args.agent_home, stderr=stderr)


def agent_round(base: Path, args: argparse.Namespace, figures: Figures) -> None:
    from agent.sim.nvml.control import SimControlClient

    kubelet, apiserver = _node(base)
    started = time.monotonic()
    agent = _start_agent(base, args, apiserver, stderr=subprocess.DEVNULL)
    try:
        kubelet.wait_for(lambda: _registered(kubelet), timeout=60, what="registered")
        figures.start.append(time.monotonic() - started)
        figures.start_cpu.append(_cpu_seconds(agent.pid))
        _idle(args.idle_seconds, agent)
        figures.rss.append(_rss_mib(agent.pid))

        control = SimControlClient(base / "ctl.sock")
        times = []
        for n in range(args.xids):
            gpu = 4 + n % 4  # a time-sliced GPU: its 8 replicas go Unhealthy together
            queued = control.call("inject_xid", gpu=gpu, xid=48)
            kubelet.wait_for(lambda: kubelet.allocatable(SHARED) < EXPECTED[SHARED], timeout=5, what="Unhealthy")
            times.append(time.monotonic() - queued)
            kubelet.wait_for(lambda: _registered(kubelet), timeout=5, what="recovered")
        figures.xid_p50.append(statistics.median(times))
        figures.xid_p99.append(_percentile(times, 0.99))
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=10)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        kubelet.stop()
        apiserver.stop()


def floor_round(base: Path, args: argparse.Namespace, figures: Figures) -> None:
    from agent.sim.kubelet import KubeletEmulator

    plugin_dir = base / "dp"
    kubelet = KubeletEmulator(plugin_dir, base / "pr" / "kubelet.sock")
    kubelet.start()
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    started = time.monotonic()
    floor = subprocess.Popen(
        [args.python, __file__, "--floor-plugin", str(plugin_dir)],
        env=env,
        cwd=args.agent_home,
        stdin=subprocess.PIPE,
        text=True,
    )
    assert floor.stdin is not None
    try:
        kubelet.wait_for(lambda: _registered(kubelet), timeout=60, what="registered")
        figures.start.append(time.monotonic() - started)
        figures.start_cpu.append(_cpu_seconds(floor.pid))
        _idle(args.idle_seconds, floor)
        figures.rss.append(_rss_mib(floor.pid))
        times = []
        for n in range(args.xids):
            command = f"health {SHARED} {8 * (n % 4)}\n"
            written = time.monotonic()
            floor.stdin.write(command)
            floor.stdin.flush()
            kubelet.wait_for(lambda: kubelet.allocatable(SHARED) < EXPECTED[SHARED], timeout=5, what="Unhealthy")
            times.append(time.monotonic() - written)
            floor.stdin.write(command)
            floor.stdin.flush()
            kubelet.wait_for(lambda: _registered(kubelet), timeout=5, what="recovered")
        figures.xid_p50.append(statistics.median(times))
        figures.xid_p99.append(_percentile(times, 0.99))
    finally:
        floor.kill()
        floor.wait()
        kubelet.stop()


# ----- where the agent's memory goes --------------------------------------------------------------------

RUN_PATH = "import agent.cli, agent.run"
SIMULATOR = (  # what `tessera run --simulate dgx-a100 --sim-control …` runs of agent/sim (agent.run.run_agent): the
    # simulated driver beneath pynvml, its control socket, and the stand-in driver files its CDI specs name
    "import os, shutil, tempfile\nfrom pathlib import Path\nfrom agent.sim.nvml.install import simulated_node\n"
    "from agent.sim.nvml.control import SimControlServer\nfrom agent.sim.driver_root import sim_driver_root\n"
    "driver = simulated_node('dgx-a100').__enter__()\n"
    "SimControlServer(driver, Path(f'ctl-{os.getpid()}.sock')).start()\n"  # in the package copy, removed with it
    "files = Path(tempfile.mkdtemp(prefix='bench-sim-driver-'))\n"
    "sim_driver_root(files, [gpu.minor_number for gpu in driver.gpus])\nshutil.rmtree(files)"
)
SIM_SHARE = {  # the agent's run path without and with the simulator: the difference is the simulator's share
    "run path": RUN_PATH,
    "run path + simulator": f"{RUN_PATH}\n{SIMULATOR}",
}
PARTS = {  # what a piece costs on top of `import grpc`, each in a fresh process (RSS, MB)
    "grpc (the base of both)": "",
    "the Kubernetes client (`import kubernetes`)": "import kubernetes",
    "the config checker's work (PyYAML, agent.config.schema)": "import yaml, agent.config.schema",
    "prometheus_client": "import prometheus_client",
    "the simulator, dgx-a100 (not on a real node)": SIMULATOR,
}


def memory_parts(python: str, home: Path, parts: dict[str, str] = PARTS, base: str = "import grpc") -> dict[str, float]:
    """RSS of ``base`` plus each part, in a process of its own (the parts overlap: not a sum)."""
    measured = {}
    for name, code in parts.items():
        script = f"{base}\n{code}\nprint(open('/proc/self/status').read().split('VmRSS:')[1].split()[0])"
        out = subprocess.run([python, "-c", script], capture_output=True, text=True, cwd=home, check=True)
        measured[name] = int(out.stdout.split()[-1]) / 1024
    return measured


# ----- where the start's time goes -------------------------------------------------------------------------

MODULE_COST = (  # the run path's imports, how much of them is the building of dataclasses (decorators timed), and
    # then the simulator's setup (what `tessera run --simulate` does before the agent starts)
    "import dataclasses, time\n"
    "plain, built = dataclasses.dataclass, [0, 0.0]\n"
    "def timed(cls=None, /, **options):\n"
    "    def build(c):\n"
    "        started = time.perf_counter()\n"
    "        out = plain(**options)(c)\n"
    "        built[0] += 1\n"
    "        built[1] += time.perf_counter() - started\n"
    "        return out\n"
    "    return build if cls is None else build(cls)\n"
    "dataclasses.dataclass = timed  # before any module of the agent takes the name\n"
    "started = time.perf_counter()\n"
    f"{RUN_PATH}\n"
    "loaded = time.perf_counter()\n"
    f"{SIMULATOR}\n"
    "print(loaded - started, built[0], built[1], time.perf_counter() - loaded)"
)


class ModuleCost(NamedTuple):
    took: float  # seconds: ``import agent.cli, agent.run``
    dataclasses: int  # how many dataclasses those modules built
    building: float  # seconds of it spent building them
    simulator: float  # seconds: then the simulated node set up (SIMULATOR), as ``run --simulate`` does first


def module_cost(python: str, home: Path) -> ModuleCost:
    """``import agent.cli, agent.run`` in a fresh process, what of it is dataclasses, then the simulator's setup."""
    out = subprocess.run([python, "-c", MODULE_COST], capture_output=True, text=True, cwd=home, check=True)
    took, count, building, simulator = out.stdout.split()
    return ModuleCost(float(took), int(count), float(building), float(simulator))


MILESTONES = (  # (what, logger, the message's first words): the first such line of a start at debug level
    ("the agent's modules loaded, the simulated driver installed", "agent.run", "using a SIMULATED GPU driver"),
    ("the GPUs discovered", "agent.agent", "discovered"),
    ("the Node read through the API (its labels pick the config)", "agent.node_metadata", "node read"),
    ("the config checker's answer taken", "agent.config.isolated", "config checked"),
    ("the config applied: the plan", "agent.agent", "config applied"),
    ("the resources served", "agent.plugin.server", "serving"),
    ("kubelet.sock seen: registering", "agent.agent", "kubelet is up"),
    ("the kubelet answered the last Register", "agent.plugin.registrations", "registered"),
)


def start_timeline(base: Path, args: argparse.Namespace) -> list[tuple[str, float, str]]:
    """One more start, logging at debug level (slower than the measured ones): each milestone in ms after the
    process was spawned, with what its log line adds (the checker's own time and how long the agent waited)."""
    import json

    kubelet, apiserver = _node(base)
    log = base / "agent-log.jsonl"
    with log.open("w") as out:
        spawned = time.time()
        agent = _start_agent(base, args, apiserver, stderr=out, debug=True)
        try:
            kubelet.wait_for(lambda: _registered(kubelet), timeout=60, what="registered")
        finally:
            agent.terminate()
            agent.wait(timeout=10)
            kubelet.stop()
            apiserver.stop()
    seen: dict[str, tuple[float, str]] = {}
    for line in log.read_text().splitlines():
        try:
            entry = json.loads(line)
            at = datetime.fromisoformat(entry["time"].replace("Z", "+00:00")).timestamp()
        except (ValueError, KeyError, TypeError):
            continue  # gRPC's own lines
        for what, logger, words in MILESTONES:
            if entry.get("logger") == logger and str(entry.get("msg", "")).startswith(words):
                if what not in seen or what == MILESTONES[-1][0]:  # the first, but the last Register answered
                    extra = ", ".join(f"{k} {entry[k]} ms" for k in ("took_ms", "waited_ms") if k in entry)
                    seen[what] = ((at - spawned) * 1000, extra)
                break
    return [(what, *seen[what]) for what, _, _ in MILESTONES if what in seen]


# ----- report -------------------------------------------------------------------------------------------


def _version_of(python: str) -> str:
    """Which interpreter ran both processes: ``Python 3.11.2 (/usr/bin/python3.11)``."""
    script = "import platform, sys; print(platform.python_version(), sys._base_executable)"
    answer = subprocess.run([python, "-c", script], capture_output=True, text=True, check=True).stdout
    version, executable = answer.split()
    return f"Python {version} ({executable})"


def report(
    agent: Figures,
    floor: Figures,
    parts: dict[str, list[float]],
    sim_share: list[float],
    args: argparse.Namespace,
    timeline: list[tuple[str, float, str]],
    modules: list[ModuleCost],
) -> None:
    def row(label: str, ours: list[float], least: list[float], scale: float, unit: str, target: str) -> None:
        a, f = statistics.median(ours) * scale, statistics.median(least) * scale
        spread = f"{min(ours) * scale:.1f}–{max(ours) * scale:.1f}"
        print(f"| {label} | {a:.2f} {unit} ({spread}) | {f:.2f} {unit} | {a / f:.2f}× | {target} |")

    print(
        f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}, {args.interpreter}, "
        f"grpcio {grpc.__version__}; simulated dgx-a100, config {CONFIG_NAME} from a ConfigMap directory picked by "
        f"the node label through the API; {args.rounds} rounds, medians (agent range in brackets); idle "
        f"{args.idle_seconds:g} s; {args.xids} XIDs per round"
    )
    print()
    print("| measure | Tessera | Python floor | ratio | target |")
    print("|---|---|---|---|---|")
    row("start → registered (gpu ×4, gpu.shared ×32)", agent.start, floor.start, 1000, "ms", "< 200 ms")
    row(
        "start → registered, less the simulator's setup (a real node runs no agent/sim)",
        [start - m.simulator for start, m in zip(agent.start, modules, strict=True)], floor.start, 1000, "ms", "-",
    )  # fmt: skip
    row("… CPU time until registered (with waited-for children)", agent.start_cpu, floor.start_cpu, 1000, "ms", "-")
    row(f"RSS after {args.idle_seconds:g} s idle", agent.rss, floor.rss, 1, "MB", "< 45 MB")
    row(
        f"RSS after {args.idle_seconds:g} s idle, less the simulator's share (a real node loads no agent/sim)",
        [rss - share for rss, share in zip(agent.rss, sim_share, strict=True)], floor.rss, 1, "MB", "< 45 MB",
    )  # fmt: skip
    row("XID → kubelet sees Unhealthy, p50", agent.xid_p50, floor.xid_p50, 1000, "ms", "< 1.5 ms")
    row("XID → kubelet sees Unhealthy, p99", agent.xid_p99, floor.xid_p99, 1000, "ms", "-")
    print()
    base = statistics.median(parts["grpc (the base of both)"])
    print("| RSS of a process that imports grpc, then … | MB | above grpc alone |")
    print("|---|---|---|")
    for name, values in parts.items():
        print(f"| {name} | {statistics.median(values):.1f} | {statistics.median(values) - base:+.1f} |")
    print()
    print(
        f"the simulator's share of the agent's RSS (`{RUN_PATH}` with the simulated dgx-a100 installed, its "
        f"control socket served and its driver files laid out, less without them; fresh processes, this run): "
        f"{statistics.median(sim_share):.1f} MB ({min(sim_share):.1f}–{max(sim_share):.1f})"
    )
    print()
    print("where a start's time goes (one more start, logging at debug level: slower than the measured ones)")
    print()
    print("| ms after the process was spawned | milestone | |")
    print("|---|---|---|")
    for what, at, extra in timeline:
        print(f"| {at:.0f} | {what} | {extra} |")
    print()
    took, building = [1000 * m.took for m in modules], [1000 * m.building for m in modules]
    simulator = [1000 * m.simulator for m in modules]
    print(
        f"the agent's modules (`{RUN_PATH}`, a fresh process a round): {statistics.median(took):.0f} ms "
        f"({min(took):.0f}–{max(took):.0f}), of which building its {modules[0].dataclasses} dataclasses "
        f"{statistics.median(building):.0f} ms ({min(building):.0f}–{max(building):.0f}); then the simulator's "
        f"setup (its modules with PyYAML, the dgx-a100 spec, the driver, the control socket, the stand-in driver "
        f"files): {statistics.median(simulator):.0f} ms ({min(simulator):.0f}–{max(simulator):.0f}). A real node "
        "loads libnvidia-ml.so and calls nvmlInit instead, which this machine cannot measure: the start less the "
        "simulator's setup is what the agent's own code takes, not a real node's start."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--idle-seconds", type=float, default=60.0)
    parser.add_argument("--xids", type=int, default=30)
    parser.add_argument("--floor-plugin", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.floor_plugin:
        _floor_plugin(args.floor_plugin)
        return
    sys.path.insert(0, str(ROOT))  # the floor process imports nothing of this: only the runner needs it
    from tests.bench.bench_lifecycle import package_copy

    logging.disable(logging.ERROR)  # the emulators' notes on streams closed at exit are not the report
    work = Path(tempfile.mkdtemp(prefix="bench-node", dir="/tmp"))
    args.agent_home = package_copy(work / "compiled", compiled=True)
    args.python = image_python(work / "venv")
    args.interpreter = _version_of(args.python)
    agent, floor = Figures(), Figures()
    parts: dict[str, list[float]] = {}
    sim_share: list[float] = []
    modules: list[ModuleCost] = []
    try:
        for n in range(args.rounds):
            rounds = [(agent_round, agent), (floor_round, floor)]
            for body, figures in rounds if n % 2 == 0 else rounds[::-1]:
                base = Path(tempfile.mkdtemp(prefix="r", dir=work))  # unix socket paths must stay short
                try:
                    body(base, args, figures)
                finally:
                    shutil.rmtree(base, ignore_errors=True)
            for name, mib in memory_parts(args.python, args.agent_home).items():
                parts.setdefault(name, []).append(mib)
            share = memory_parts(args.python, args.agent_home, SIM_SHARE, base="")
            sim_share.append(share["run path + simulator"] - share["run path"])
            modules.append(module_cost(args.python, args.agent_home))
            print(f"round {n + 1}/{args.rounds} done", file=sys.stderr, flush=True)
        base = Path(tempfile.mkdtemp(prefix="t", dir=work))
        timeline = start_timeline(base, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(agent, floor, parts, sim_share, args, timeline, modules)


if __name__ == "__main__":
    main()
