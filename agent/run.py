"""``tessera run``: the agent process — options from flags, environment and config file, signals, exit."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from types import FrameType
from typing import Any

from msgspec.structs import replace

from agent.agent import Agent, AgentExit, AgentOptions
from agent.config.effective import FlagOverrides
from agent.config.isolated import Check
from agent.config.labels import validate_node_name
from agent.config.model import safe_host_path
from agent.config.watch import ConfigSourceChanged
from agent.core.allocation import DeviceListStrategy
from agent.core.dra.cdi import NODE_WIDE_CDI_KIND
from agent.core.health import health_policy
from agent.gpu.driver_root import DriverRoot
from agent.memlimits.settings import MemoryLimitSettings
from agent.nvidia_flags import NvidiaFlagError, read
from agent.telemetry.server import parse_address
from agent.telemetry.service import TelemetrySettings

log = logging.getLogger(__name__)


class OptionsError(ValueError):
    """A flag, environment variable or config value is not usable; the message says which and why."""


# NVIDIA's device plugin waits 5 s per nvmlEventSetWait too: an idle agent wakes for it once every 5 s
PROCESS_EVENT_WAIT_MS = 5000
MAX_CONFIG_PEEK = 1 << 20  # a sharing config is kilobytes; the agent refuses larger ones with a reason
MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the terminating NUL


class RunOptions(AgentOptions, frozen=True):
    """The agent's options plus what only the ``tessera run`` process does with them."""

    fail_on_init_error: bool = False  # NVIDIA's --fail-on-init-error: exit at start when NVML cannot initialise


def build_options(args: argparse.Namespace, environ: dict[str, str]) -> RunOptions:
    """The agent's options from flags (or their env twins), and NVIDIA's flags and variables (each honoured or
    refused: ``agent.nvidia_flags``). The config file is read by the agent itself, so that it can be reloaded;
    explicit flags win over its ``flags`` section, as on NVIDIA's plugin."""
    try:
        nvidia = read(args, environ)
    except NvidiaFlagError as error:
        raise OptionsError(str(error)) from None
    for warning in nvidia.warnings:
        log.warning("flags: %s", warning)
    strategies = _strategies(nvidia.value("device_list_strategy"), nvidia.chosen["device_list_strategy"].source)
    quiet = args.health_recovery_seconds
    policy, warnings = health_policy(
        ignored=args.ignored_xids,
        overrides=args.xid_overrides,
        nvidia_disabled=environ.get("DP_DISABLE_HEALTHCHECKS"),
        nvidia_enabled=environ.get("DP_ENABLE_HEALTHCHECKS"),
        quiet_seconds=None if quiet <= 0 else quiet,
    )
    for warning in warnings:
        log.warning("health: %s", warning)
    node_name = args.node_name or environ.get("NODE_NAME") or None
    if node_name is not None:
        try:
            validate_node_name(node_name)
        except ValueError as error:
            raise OptionsError(f"--node-name: {error}") from error
    mps_root = nvidia.chosen["mps_root"]
    config = nvidia.value("config")
    return RunOptions(
        device_plugin_dir=Path(nvidia.value("device_plugin_dir") or args.device_plugin_dir),
        pod_resources_socket=Path(args.pod_resources_socket),
        overrides=FlagOverrides(
            mig_strategy=nvidia.value("mig_strategy"),
            device_list_strategy=strategies,
            allocation_policy=nvidia.value("shared_devices_allocation_policy"),
            cdi_kind=args.cdi_kind or (NODE_WIDE_CDI_KIND if args.node_wide_cdi else None),
            mps_root=_mps_root(mps_root.value, mps_root.source),
        ),
        mps_control=args.mps_control,
        nvidia_smi=args.nvidia_smi,
        mps_keeper=_socket_path("--mps-keeper", args.mps_keeper),
        dra_registry_dir=_host_dir("--dra-registry-dir", args.dra_registry_dir),
        dra_plugins_dir=_host_dir("--dra-plugins-dir", args.dra_plugins_dir),
        cdi_root=_host_dir("--cdi-root", args.cdi_root),
        driver_root=_driver_root(nvidia.driver_root(), args.host_proc),
        node_wide_cdi=args.node_wide_cdi,
        sys_root=_host_dir("--host-sys", args.host_sys),
        pod_uid=_pod_uid(args.pod_uid),
        mig_config=Path(args.mig_config) if args.mig_config else None,
        mig_config_name=args.mig_config_name,
        telemetry=_telemetry(args, node_name),
        memory_limits=_memory_limits(args),
        config_path=Path(config) if config else None,
        config_name=args.config_name,
        node_name=node_name,
        kubeconfig=args.kubeconfig,
        health=policy,
        thread_join_seconds=0.0,  # the process exits right after stopping: daemon threads end with it
        health_event_wait_ms=PROCESS_EVENT_WAIT_MS,
        fail_on_init_error=_fail_on_init_error(nvidia.fail_on_init_error, Path(config) if config else None),
    )


def _fail_on_init_error(given: bool | None, config: Path | None) -> bool:
    """NVIDIA's precedence: the flag or FAIL_ON_INIT_ERROR, else the config file's ``flags.failOnInitError``,
    else Tessera's default (false). Only a config *file* is read here, before NVML starts; in a directory of
    named configs the one in force is chosen later (by node label), so there the flag or variable decides."""
    if given is not None:
        return given
    if config is None or not config.is_file():
        return False
    from agent.config.bounded import read_bounded
    from agent.config.model import ConfigError
    from agent.config.yaml_limits import load_yaml

    try:  # within the limits every config is read in (nesting, size, aliases): no RecursionError, no bomb
        document = load_yaml(read_bounded(config, max_bytes=MAX_CONFIG_PEEK), str(config))
    except ConfigError:
        return False  # the agent reads the config again, names what is wrong with it and keeps running
    flags = document.get("flags") if isinstance(document, dict) else None
    value = flags.get("failOnInitError") if isinstance(flags, dict) else None
    return value is True


def _strategies(value: str | None, source: str) -> tuple[str, ...] | None:
    if not value:
        return None
    strategies = tuple(s.strip() for s in value.split(",") if s.strip())
    unknown = [s for s in strategies if s not in {k.value for k in DeviceListStrategy}]
    if unknown or not strategies:
        known = ", ".join(k.value for k in DeviceListStrategy)
        raise OptionsError(f"{source}: {', '.join(unknown) or 'empty'} is not valid; use one or more of {known}")
    return strategies


def _telemetry(args: argparse.Namespace, node_name: str | None) -> TelemetrySettings | None:
    if args.metrics_address in ("", "off", "none"):
        return None
    try:
        parse_address(args.metrics_address)
    except ValueError as error:
        raise OptionsError(f"--metrics-address: {error}") from error
    if args.metrics_interval <= 0 or not 0 <= args.idle_threshold <= 100:
        raise OptionsError("--metrics-interval must be > 0 and --idle-threshold between 0 and 100")
    features = Path(safe_host_path(args.nfd_features_dir)) if args.nfd_features_dir else None
    off = args.status_socket in ("", "off", "none")
    status_socket = None if off else _socket_path("--status-socket", args.status_socket)
    return TelemetrySettings(
        hostname=node_name or socket.gethostname(),
        metrics_address=args.metrics_address,
        interval=args.metrics_interval,
        idle_threshold_percent=args.idle_threshold,
        proc_root=Path(safe_host_path(args.host_proc)),
        nfd_features_dir=features,
        shared_product_suffix=args.shared_product_suffix,
        label_node=args.label_node,
        status_socket=status_socket,
    )


def _memory_limits(args: argparse.Namespace) -> MemoryLimitSettings | None:
    """``--memory-limits on`` (the default): the agent holds sized replicas' containers to their size (``off``:
    no room, no variables). On by default because only a config that gives sizes has anything to hold, and
    where the driver cannot (older than r615, MIG) the room says which fallback holds instead of failing."""
    if args.memory_limits == "off":
        return None
    return MemoryLimitSettings(
        cgroup_root=_host_dir("--cgroup-root", args.cgroup_root),
        container_logs=_host_dir("--container-logs", args.container_logs),
    )


def _mps_root(value: str | None, source: str) -> str | None:
    if not value:
        return None
    try:
        return safe_host_path(value)
    except ValueError as error:
        raise OptionsError(f"{source}: {error}") from error


def _driver_root(given: dict[str, str | None], proc: str) -> DriverRoot:
    """Where the driver is (NVIDIA's --driver-root, --dev-root, --container-driver-root, --nvidia-cdi-hook-path)."""
    paths: dict[str, Any] = {}
    for name, flag in (("root", "--driver-root"), ("container_root", "--container-driver-root"),
                       ("dev_root", "--dev-root")):  # fmt: skip
        value = given.get(name)
        if value:
            paths[name] = _host_dir(flag, value)
    hook = given.get("hook_path")
    if hook and not hook.startswith("/"):
        raise OptionsError(f"--nvidia-cdi-hook-path: {hook!r} is not an absolute path on the host")
    return DriverRoot(**paths, hook_path=hook or None, proc=Path(proc))


def _host_dir(flag: str, value: str) -> Path:
    try:
        return Path(safe_host_path(value))
    except ValueError as error:
        raise OptionsError(f"{flag}: {error}") from error


def _pod_uid(value: str | None) -> str | None:
    if not value:
        return None
    from agent.dra.names import check_pod_uid

    try:
        return check_pod_uid(value)
    except ValueError as error:
        raise OptionsError(f"--pod-uid (POD_UID): {error}") from error


def _socket_path(flag: str, value: str | None) -> Path | None:
    if not value:
        return None
    try:
        path = safe_host_path(value)
    except ValueError as error:
        raise OptionsError(f"{flag}: {error}") from error
    if len(path.encode()) > MAX_SOCKET_PATH:
        raise OptionsError(f"{flag}: {path!r} is longer than a unix socket path may be ({MAX_SOCKET_PATH} bytes)")
    return Path(path)


def run_agent(
    options: AgentOptions,
    simulate: str | None,
    sim_control: str | None,
    *,
    collector_paused: bool = False,
    config_check: Check | None = None,
) -> int:
    """Run the agent until it is stopped. ``collector_paused``: the caller turned the garbage collector off for
    the start (``tessera run`` does, before it imports the agent); it is turned back on once the kubelet is
    served (``_resume_collector_once_served``). ``config_check``: the config checker, started by the caller before
    it imported the agent (used when it checks the config the options name; else stopped)."""
    _limit_malloc_arenas()
    options = take_over(options, config_check)
    with ExitStack() as stack:
        if simulate:
            from agent.sim.nvml.install import simulated_node
            from agent.sim.nvml.spec import SimSpecError

            try:
                driver = stack.enter_context(simulated_node(simulate))
            except SimSpecError as error:
                raise OptionsError(str(error)) from None
            log.warning("using a SIMULATED GPU driver spec=%s", simulate)
            if options.driver_root.root == DriverRoot().root and options.driver_root.container_root is None:
                # no --driver-root: the simulated node's driver files, on disk
                options = _simulated_driver_root(stack, options, [gpu.minor_number for gpu in driver.gpus])
            if sim_control:
                from agent.sim.nvml.control import SimControlServer

                control = SimControlServer(driver, Path(sim_control))
                control.start()
                stack.callback(control.stop)
                # the emulators the agent runs (nvidia-smi: agent.sim.smi) reach the simulated node through it
                os.environ["TESSERA_SIM_CONTROL"] = str(Path(sim_control).resolve())
        if isinstance(options, RunOptions) and options.fail_on_init_error:
            _nvml_starts()
        agent = Agent(options)
        if collector_paused:
            _resume_collector_once_served(agent.served)
        stack.callback(_stop_on_signals(agent))
        try:
            agent.run()
        except AgentExit as error:
            if agent.stopping.is_set():  # SIGTERM during the start (waiting for the plugin-directory lock): done
                log.info("stopped before the start was over reason=%r", str(error))
                return 0
            log.error("cannot run error=%r", str(error))
            print(f"tessera: {error}", file=sys.stderr)
            return 1
    return 0


def take_over(options: AgentOptions, config_check: Check | None) -> AgentOptions:
    """The options with the checker started early, if it checks the config they name; else it is stopped (the
    agent starts its own)."""
    if config_check is None:
        return options
    if config_check.path == options.config_path:
        return replace(options, config_check=config_check)
    config_check.cancel()
    return options


MALLOC_ARENAS = 1
M_ARENA_MAX = -8  # glibc's mallopt parameter


def _limit_malloc_arenas() -> None:
    """One glibc malloc arena, as ``MALLOC_ARENA_MAX=1`` would (an explicit one wins).

    glibc gives each thread that allocates an arena of its own, up to eight per core; the agent's dozen threads
    (gRPC's, the watchers', the senders') each keep the memory they once freed in theirs: ~1.6 MB more RSS on an
    idle agent, measured (two arenas: ~0.9 MB more). Python's own small objects are allocated under the GIL
    anyway, and the agent's threads allocate little: one lock costs nothing here. Set before any of them starts;
    without glibc it does nothing.
    """
    if "MALLOC_ARENA_MAX" in os.environ:
        return
    try:
        import ctypes

        ctypes.CDLL(None).mallopt(M_ARENA_MAX, MALLOC_ARENAS)
    except (OSError, AttributeError):  # not glibc (musl has no arenas to limit)
        return


def _simulated_driver_root(stack: ExitStack, options: AgentOptions, minors: list[int]) -> AgentOptions:
    """``options`` with a simulated driver root (stand-in files in a directory removed at the end), so the CDI
    specs of a simulated node name files that exist."""
    import shutil
    import tempfile

    from agent.sim.driver_root import sim_driver_root

    try:
        root = Path(tempfile.mkdtemp(prefix="tessera-sim-driver-"))
        stack.callback(shutil.rmtree, root, True)
        driver_root = sim_driver_root(root, minors)
    except OSError as error:  # a read-only /tmp: CDI specs then fail naming the missing driver, nothing else does
        log.warning("cannot lay out a simulated driver root for CDI specs error=%r", str(error))
        return options
    log.warning("using a SIMULATED driver root for CDI specs path=%s", root)
    return replace(options, driver_root=driver_root)


def _resume_collector_once_served(served: threading.Event) -> None:
    """Resume the garbage collector, paused for the start, once the kubelet is served.

    Nearly everything the start makes (modules, classes, the plan, the servers) lives as long as the process:
    collecting while it is made only walks it again and again (~80 passes, 5-10 ms before the first
    registration). Once the kubelet is served, one full pass frees what the start left in cycles — the command
    line's parser with every command's flags and help (``agent.cli`` lets go of it), the config checker's answer:
    ~0.4 MB of an idle agent's memory — and what is left is frozen out of the collector's way for good
    (``gc.freeze``: later passes walk only what is newer) before collection resumes. The pass holds the GIL for
    ~10 ms once, after the kubelet has its devices. (Measured and left out: glibc's ``malloc_trim`` and emptying
    ``re``'s cache after it, no less RSS.)
    """

    def resume() -> None:
        served.wait()
        gc.collect()
        gc.freeze()
        gc.enable()

    threading.Thread(target=resume, name="gc-resume", daemon=True).start()


def _nvml_starts() -> None:
    """NVIDIA's ``--fail-on-init-error``: NVML must initialise now, else ``NvmlUnavailable`` ends the run
    (exit 3). Without it the agent keeps running, advertises nothing and retries with backoff."""
    from agent.gpu.nvml import nvml_session

    with nvml_session():
        pass


SIGNALS = {signal.SIGTERM: "stop", signal.SIGINT: "stop", signal.SIGHUP: "reload"}


def _stop_on_signals(agent: Agent) -> Callable[[], None]:
    """SIGTERM and SIGINT stop the agent; SIGHUP has it read its config again (NVIDIA's config-manager sidecar
    sends it after it switched the config: read it again, do not die). Returns what puts the previous handling
    back (for an agent run inside another program).

    Python runs a signal's handler on the main thread only, between two bytecodes, but the kernel may deliver
    the signal to any thread (a gRPC thread, say): the main thread, asleep in the reconcile loop's wait, would
    then run the handler only when that wait ends, up to ``SAFETY_SECONDS`` later (seen about once in a
    hundred SIGTERMs right after a start). So the interpreter's own handler, whichever thread it runs on,
    writes the signal's number to a pipe (``signal.set_wakeup_fd``), and a thread reading it tells the agent.
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    previous_fd = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    previous = {signum: signal.signal(signum, _on_signal) for signum in SIGNALS}
    threading.Thread(target=_dispatch_signals, args=(read_end, agent), name="signals", daemon=True).start()

    def restore() -> None:
        signal.set_wakeup_fd(previous_fd)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        os.close(write_end)  # the dispatcher reads the end of the pipe and stops

    return restore


def _on_signal(signum: int, frame: FrameType | None) -> None:
    """The signals are handled by ``_dispatch_signals``: this handler only makes the interpreter catch them."""


def _dispatch_signals(read_end: int, agent: Agent) -> None:
    with open(read_end, "rb", buffering=0) as pipe:
        while numbers := pipe.read(64):
            for signum in numbers:
                if SIGNALS.get(signum) == "stop":
                    log.info("stopping signal=%s", signal.Signals(signum).name)
                    agent.stop()
                elif SIGNALS.get(signum) == "reload":
                    log.info("reading the config again signal=SIGHUP")
                    agent.post(ConfigSourceChanged())
