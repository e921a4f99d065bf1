"""The ``tessera`` command line.

Every flag has an environment-variable twin (``--node`` / ``TESSERA_NODE``); the flag wins.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from agent import __version__

EXIT_OK = 0
EXIT_PLAN_ERROR = 1
EXIT_USAGE = 2
EXIT_NVML = 3


def _env_flag(
    parser: argparse.ArgumentParser, flag: str, env: str, *, default: str | None = None, help: str, **kwargs: object
) -> None:
    action = parser.add_argument(flag, default=os.environ.get(env, default), help=f"{help} [env {env}]", **kwargs)
    action.env = env  # type: ignore[attr-defined]  # for _check_env_choices


def _node_flag(parser: argparse.ArgumentParser) -> None:
    _env_flag(
        parser,
        "--node",
        "TESSERA_NODE",
        default="local",
        help="a node spec YAML file, a preset (dgx-a100, dgx-h100, a100-mig, t4x4) or 'local' for the real driver",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tessera", description="Tessera: a GPU sharing agent for Kubernetes nodes.")
    parser.add_argument("--version", action="version", version=f"tessera {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    plan = commands.add_parser("plan", help="print the resources this node would advertise")
    _node_flag(plan)
    _env_flag(
        plan,
        "--mig-strategy",
        "TESSERA_MIG_STRATEGY",
        default="none",
        choices=["none", "single", "mixed"],
        help="how MIG devices are advertised",
    )
    _env_flag(plan, "--format", "TESSERA_FORMAT", default="table", choices=["table", "json"], help="output format")

    inventory = commands.add_parser("inventory", help="list the node's GPUs and MIG devices (like nvidia-smi -L)")
    _node_flag(inventory)
    _env_flag(inventory, "--format", "TESSERA_FORMAT", default="table", choices=["table", "json"], help="output format")
    inventory.add_argument("--details", action="store_true", help="also print memory, MIG mode, NVLink and NUMA")
    return parser


def _check_env_choices(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """argparse checks ``choices`` only for values given on the command line, not for env-var defaults."""
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for action in subparsers.choices[args.command]._actions:
        value = getattr(args, action.dest, None)
        if action.choices is not None and value is not None and value not in action.choices:
            parser.error(f"{getattr(action, 'env', action.dest)}={value!r} is not one of: {', '.join(action.choices)}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _check_env_choices(parser, args)
    from agent.backend import gpu_backend
    from agent.gpu.discovery import DiscoveryError, discover
    from agent.gpu.nvml import NvmlUnavailable
    from agent.sim.spec import SimSpecError

    try:
        with gpu_backend(args.node):
            inventory = discover()
    except SimSpecError as error:
        print(f"tessera: {error}", file=sys.stderr)
        return EXIT_USAGE
    except (NvmlUnavailable, DiscoveryError) as error:
        hint = "" if args.node != "local" else " (to try Tessera without a GPU, use --node dgx-a100)"
        print(f"tessera: {error}{hint}", file=sys.stderr)
        return EXIT_NVML

    if args.command == "inventory":
        return _print_inventory(inventory, args)
    return _print_plan(inventory, args)


def _print_inventory(inventory: object, args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from agent.render import inventory_details, inventory_text

    if args.format == "json":
        print(json.dumps(asdict(inventory), indent=2))  # type: ignore[call-overload]
    else:
        print(inventory_text(inventory))  # type: ignore[arg-type]
        if args.details:
            print(inventory_details(inventory))  # type: ignore[arg-type]
    return EXIT_OK


def _print_plan(inventory: object, args: argparse.Namespace) -> int:
    from agent.core.plan import plan
    from agent.core.resources import MigStrategy, PlanConfig, PlanError
    from agent.render import plan_table

    try:
        result = plan(PlanConfig(mig_strategy=MigStrategy(args.mig_strategy)), inventory)  # type: ignore[arg-type]
    except PlanError as error:
        print(f"tessera: {error}", file=sys.stderr)
        return EXIT_PLAN_ERROR
    print(json.dumps(result.to_json(), indent=2) if args.format == "json" else plan_table(result))
    return EXIT_OK
