"""``tessera run``: the agent process — options from flags, environment and config file, signals, exit."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from contextlib import ExitStack
from pathlib import Path
from types import FrameType

from agent.agent import Agent, AgentOptions
from agent.config.flags import ConfigError, load_config_file
from agent.core.allocation import DEFAULT_CDI_KIND, DeviceListStrategy
from agent.core.health import xid_policy
from agent.core.resources import MigStrategy
from agent.core.snapshot import AllocationOptions

log = logging.getLogger(__name__)


class OptionsError(ValueError):
    """A flag, environment variable or config value is not usable; the message says which and why."""


def build_options(args: argparse.Namespace, environ: dict[str, str]) -> AgentOptions:
    """Flags (or their env twins) first, then the config file's ``flags``, then defaults."""
    file_flags = None
    if args.config:
        try:
            file_flags = load_config_file(Path(args.config)).flags
        except ConfigError as error:
            raise OptionsError(str(error)) from error
    mig = args.mig_strategy or (file_flags.mig_strategy if file_flags else None) or "none"
    from_file = file_flags.plugin.device_list_strategy if file_flags else None
    strategies = args.device_list_strategy.split(",") if args.device_list_strategy else from_file or ["envvar"]
    try:
        parsed = tuple(DeviceListStrategy(s.strip()) for s in strategies)
    except ValueError as error:
        known = ", ".join(s.value for s in DeviceListStrategy)
        raise OptionsError(f"device-list-strategy: {error}; use one or more of {known}") from error
    quiet = args.health_recovery_seconds
    policy, rejected = xid_policy(
        args.ignored_xids,
        environ.get("DP_DISABLE_HEALTHCHECKS"),
        environ.get("DP_ENABLE_HEALTHCHECKS"),
        quiet_seconds=None if quiet <= 0 else quiet,
    )
    if rejected:
        log.warning("ignored unknown XID entries entries=%s", ",".join(rejected))
    return AgentOptions(
        device_plugin_dir=Path(args.device_plugin_dir),
        pod_resources_socket=Path(args.pod_resources_socket),
        mig_strategy=MigStrategy(mig),
        allocation=AllocationOptions(strategies=parsed, cdi_kind=args.cdi_kind or DEFAULT_CDI_KIND),
        health=policy,
    )


def run_agent(options: AgentOptions, simulate: str | None, sim_control: str | None) -> int:
    with ExitStack() as stack:
        if simulate:
            from agent.sim.install import simulated_node

            driver = stack.enter_context(simulated_node(simulate))
            log.warning("using a SIMULATED GPU driver spec=%s", simulate)
            if sim_control:
                from agent.sim.control import SimControlServer

                control = SimControlServer(driver, Path(sim_control))
                control.start()
                stack.callback(control.stop)
        agent = Agent(options)
        _stop_on_signals(agent)
        agent.run()
    return 0


def _stop_on_signals(agent: Agent) -> None:
    if threading.current_thread() is not threading.main_thread():
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        log.info("stopping signal=%s", signal.Signals(signum).name)
        agent.stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
