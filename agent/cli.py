"""The ``tessera`` command line.

Every flag has an environment-variable twin (``--node`` / ``TESSERA_NODE``); the flag wins.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from agent import __version__

if TYPE_CHECKING:
    from agent.config.early import EarlyCheck
    from agent.config.isolated import Check
    from agent.config.model import ConfigModel
    from agent.core.inventory import Inventory
    from agent.core.resources import ResourcePlan
    from agent.mig.commands import MigPreview

# The same meaning in every command (docs/configuration.md, "Exit codes"; agent/mig/commands.py uses 1, 3-5).
EXIT_OK = 0
EXIT_INVALID = 1  # invalid input: a config, a layout, a name that names nothing, a config or layout that does not fit
EXIT_PLAN_ERROR = EXIT_INVALID  # the config does not fit the node (PlanError)
EXIT_USAGE = 2  # the command line: argparse, an environment twin's value, a --node that is no preset or spec
EXIT_NVML = 3  # the driver: NVML unavailable, or a MIG operation failed half way
EXIT_BUSY = 4  # mig apply: processes run where the change would destroy something
EXIT_NOT_APPLIED = 5  # mig assert: the node differs from the layout; mig apply: a MIG mode change waits for a reset
EXIT_INTERNAL = 70  # EX_SOFTWARE: a bug, not bad input
EXIT_INTERRUPTED = 130
# the bounds of the number flags (seconds, percent): a week is longer than any interval anyone means
MAX_SECONDS = 7 * 24 * 3600
MIN_METRICS_INTERVAL = 0.1
DEFAULT_STATUS_SOCKET = "/run/tessera-agent/status.sock"  # `tessera run` serves /status there, `tessera status` asks
MIN_KUBERNETES = (1, 34)  # resource.k8s.io/v1 (DRA's GA API, what the DRA front end publishes) is served from 1.34
DEFAULT_KUBERNETES = "1.35"
DRA_ONLY_FLAGS = ("node_name", "node_uid", "kubernetes_version")  # `tessera plan` flags that only --dra reads


def _env_flag(
    parser: argparse.ArgumentParser, flag: str, env: str, *, default: str | None = None, help: str, **kwargs: object
) -> None:
    action = parser.add_argument(flag, default=os.environ.get(env, default), help=f"{help} [env {env}]", **kwargs)
    action.env = env  # type: ignore[attr-defined]  # for _check_env_choices


def _number(env: str, minimum: float, maximum: float, unit: str) -> Callable[[str], float]:
    """An argparse ``type`` for a number flag (and its env twin): finite, from ``minimum`` to ``maximum``. ``inf``,
    ``nan`` and ``1e400`` are refused with the flag's name (argparse prefixes it), never passed on to a timer."""

    def number(text: str) -> float:
        from agent.core.quantity import QuantityError, parse_number

        try:
            return parse_number(text, minimum=minimum, maximum=maximum)
        except QuantityError as error:
            raise argparse.ArgumentTypeError(f"{error} {unit} [env {env}]") from None

    return number


def _kubernetes_version(text: str) -> str:
    """``1.35``, ``v1.35.2`` or ``v1.35.0-gke.1`` as ``1.35``; a version the DRA front end cannot serve is refused,
    naming the range it can: ResourceSlices are ``resource.k8s.io/v1``, which API servers serve from 1.34."""
    import re

    match = re.fullmatch(r"v?(\d{1,3})\.(\d{1,3})(?:\.\d{1,4})?(?:[-+][0-9A-Za-z.+-]{0,64})?", text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a Kubernetes version; give {MIN_KUBERNETES[0]}.{MIN_KUBERNETES[1]} or later, e.g. "
            f"{DEFAULT_KUBERNETES} (or v{DEFAULT_KUBERNETES}.2)"
        )
    version = (int(match[1]), int(match[2]))
    if version[0] != MIN_KUBERNETES[0] or version < MIN_KUBERNETES:
        raise argparse.ArgumentTypeError(
            f"Kubernetes {version[0]}.{version[1]} is not supported: Tessera's DRA driver publishes "
            f"resource.k8s.io/v1 ResourceSlices, served from Kubernetes {MIN_KUBERNETES[0]}.{MIN_KUBERNETES[1]} on; "
            f"give {MIN_KUBERNETES[0]}.{MIN_KUBERNETES[1]} or a later 1.x"
        )
    return f"{version[0]}.{version[1]}"


def _node_uid(text: str) -> str:
    """A Node's ``metadata.uid``: the API server's UIDs are RFC 4122 UUIDs, in their 36-character form."""
    import uuid

    try:
        canonical = str(uuid.UUID(text))
    except ValueError:
        canonical = ""
    if canonical != text.lower():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a Node UID (a UUID such as 4f5b1c2e-8d3a-4b6f-9e1d-2a3b4c5d6e7f): "
            "kubectl get node NAME -o jsonpath='{.metadata.uid}' prints it"
        )
    return text.lower()


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
        choices=["none", "single", "mixed"],
        help="how MIG devices are advertised (default: the config's, else none)",
    )
    _env_flag(
        plan,
        "--config",
        "TESSERA_CONFIG",
        help="a sharing config file, a directory of named configs (a mounted ConfigMap) or a ConfigMap manifest",
    )
    _env_flag(
        plan,
        "--config-name",
        "TESSERA_CONFIG_NAME",
        help="which named config of a directory or manifest (time-slicing-4 finds time-slicing-4.yaml too)",
    )
    plan.add_argument("--node-label", help="the value of the node's nvidia.com/device-plugin.config label")
    plan.add_argument(
        "--mig-label", help="the value of the node's nvidia.com/mig.config label (which layout of migLayout)"
    )
    _env_flag(
        plan, "--format", "TESSERA_FORMAT", default="table", choices=["table", "json", "yaml"], help="output format"
    )
    plan.add_argument(
        "--dra",
        action="store_true",
        help="print the ResourceSlices the DRA driver would publish (the config's dra.gpus, else every GPU)",
    )
    plan.add_argument("--node-name", help="with --dra: the Node (pool and nodeName; default: the node spec's name)")
    plan.add_argument(
        "--node-uid",
        type=_node_uid,
        help="with --dra: the Node's UID for ownerReferences (kubectl get node N -o jsonpath='{.metadata.uid}')",
    )
    plan.add_argument(
        "--kubernetes-version",
        type=_kubernetes_version,
        help=f"with --dra: the API server's version, {MIN_KUBERNETES[0]}.{MIN_KUBERNETES[1]} or later; "
        f"1.34 puts counters and devices in one slice (default {DEFAULT_KUBERNETES})",
    )

    mig = commands.add_parser("mig", help="MIG layouts in mig-parted's format: export, assert, apply")
    mig_commands = mig.add_subparsers(dest="mig_command", required=True)
    mig_export = mig_commands.add_parser("export", help="print the node's current layout as a layout file")
    _node_flag(mig_export)
    mig_export.add_argument("--format", choices=["yaml", "json"], default="yaml")
    mig_export.add_argument("--label", default="current", help="the mig-config name in the output")
    for verb, text in (("assert", "exit 0 iff the node has the layout"), ("apply", "reconfigure the node")):
        sub = mig_commands.add_parser(verb, help=text)
        _node_flag(sub)
        sub.add_argument(
            "--config", required=True, help="a layout file (mig-parted's format), or a sharing config with migLayout"
        )
        sub.add_argument(
            "--name", help="which mig-config (default: the config's migLayout.config, or the only one there is)"
        )
        if verb == "apply":
            sub.add_argument("--dry-run", action="store_true", help="print the operations only")

    validate = commands.add_parser("validate", help="check sharing configs before they reach a node (exit 0: valid)")
    validate.add_argument("path", help="a config file, a directory of named configs, or a ConfigMap manifest")
    validate.add_argument(
        "--strict",
        action="store_true",
        help="every warning is an error: unknown keys, resources no device is advertised as, flags not honoured",
    )
    validate.add_argument("--config-name", help="check only this config of a directory or manifest")

    inventory = commands.add_parser("inventory", help="list the node's GPUs and MIG devices (like nvidia-smi -L)")
    _node_flag(inventory)
    _env_flag(inventory, "--format", "TESSERA_FORMAT", default="table", choices=["table", "json"], help="output format")
    inventory.add_argument("--details", action="store_true", help="also print memory, MIG mode, NVLink and NUMA")

    run = commands.add_parser("run", help="run the agent: serve the node's GPUs to the kubelet")
    _agent_flags(run)
    _env_flag(
        run, "--simulate", "TESSERA_SIMULATE", help="use a simulated node (spec file or preset) instead of the driver"
    )
    _env_flag(run, "--sim-control", "TESSERA_SIM_CONTROL", help="with --simulate: serve a control socket here")

    keeper = commands.add_parser(
        "mps-keeper",
        help="start MPS control daemons for the agent in this container, so they outlive the agent's (the "
        "tessera-mps-keeper DaemonSet)",
    )
    _env_flag(
        keeper,
        "--socket",
        "TESSERA_MPS_KEEPER",
        default="/run/tessera/mps-keeper.sock",
        help="where the agent asks (the agent's --mps-keeper)",
    )
    _env_flag(keeper, "--mps-root", "TESSERA_MPS_ROOT", default="/run/nvidia/mps", help="the agent's MPS root")
    _env_flag(keeper, "--mps-control", "TESSERA_MPS_CONTROL", help="the nvidia-cuda-mps-control binary (default: PATH)")
    _log_flags(keeper)

    status = commands.add_parser("status", help="what the running agent on this node is doing (asks it; no NVML)")
    _env_flag(
        status,
        "--status-socket",
        "TESSERA_STATUS_SOCKET",
        default=DEFAULT_STATUS_SOCKET,
        help="the running agent's status socket: its --status-socket (on the node, or in its container)",
    )
    # /status left the metrics port: an old command line gets an error saying where it went, not "unrecognized"
    status.add_argument("--metrics-address", help=argparse.SUPPRESS)
    _env_flag(status, "--format", "TESSERA_FORMAT", default="text", choices=["text", "json"], help="output format")
    status.add_argument(
        "--idle",
        action="store_true",
        help="each allocated device with its pod and how long the pod's own processes have left it idle, "
        "longest first (with --format json: the whole document, which has them under 'allocated')",
    )

    demo = commands.add_parser("demo", help="a simulated node, an emulated kubelet and the real agent, end to end")
    _env_flag(demo, "--node", "TESSERA_NODE", default="demo", help="the simulated node: a spec file or preset")
    _env_flag(
        demo,
        "--mig-strategy",
        "TESSERA_MIG_STRATEGY",
        default="mixed",
        choices=["none", "single", "mixed"],
        help="how MIG devices are advertised",
    )
    demo.add_argument(
        "--dra",
        action="store_true",
        help="the DRA demo instead: ResourceSlices, claims allocated by CEL selectors, CDI, taints (its own node)",
    )
    return parser


def _agent_flags(parser: argparse.ArgumentParser) -> None:
    from agent.nvidia_flags import BuiltinDefault, ListValue

    _env_flag(
        parser,
        "--config",
        "TESSERA_CONFIG",
        help="the sharing config: a file, or a directory of named configs (a mounted ConfigMap); watched for "
        "changes; NVIDIA's --config-file and CONFIG_FILE count too",
    )
    _env_flag(parser, "--config-name", "TESSERA_CONFIG_NAME", help="which named config of a --config directory to use")
    _env_flag(
        parser,
        "--node-name",
        "TESSERA_NODE_NAME",
        help="this node (for its nvidia.com/device-plugin.config label); NODE_NAME is read too",
    )
    _env_flag(parser, "--kubeconfig", "KUBECONFIG", help="outside a pod: the kubeconfig for reading the node label")
    _env_flag(
        parser,
        "--shared-devices-allocation-policy",
        "TESSERA_SHARED_DEVICES_ALLOCATION_POLICY",
        choices=["distributed", "packed"],
        help="where replicas go (default: the config's, else distributed); NVIDIA's SHARED_DEVICES_ALLOCATION_POLICY "
        "counts too",
    )
    _env_flag(
        parser,
        "--device-plugin-dir",
        "TESSERA_DEVICE_PLUGIN_DIR",
        default=BuiltinDefault("/var/lib/kubelet/device-plugins"),
        help="the kubelet's device-plugin directory; NVIDIA's --kubelet-socket and KUBELET_SOCKET count too",
    )
    _env_flag(
        parser,
        "--pod-resources-socket",
        "TESSERA_POD_RESOURCES_SOCKET",
        default="/var/lib/kubelet/pod-resources/kubelet.sock",
        help="the kubelet's PodResources socket",
    )
    _env_flag(
        parser,
        "--mig-strategy",
        "TESSERA_MIG_STRATEGY",
        choices=["none", "single", "mixed"],
        help="how MIG devices are advertised (default: the config's, else none); NVIDIA's MIG_STRATEGY counts too",
    )
    _env_flag(
        parser,
        "--device-list-strategy",
        "TESSERA_DEVICE_LIST_STRATEGY",
        action=ListValue,
        metavar="LIST",
        help="how devices reach the runtime: envvar, volume-mounts, cdi-cri, cdi-annotations (comma list, or the "
        "flag repeated; default: the config's, else envvar); NVIDIA's DEVICE_LIST_STRATEGY counts too",
    )
    _env_flag(
        parser,
        "--mps-root",
        "TESSERA_MPS_ROOT",
        help="host directory for MPS pipes, logs and shm (default: the config's mpsRoot, else /run/nvidia/mps); "
        "NVIDIA's MPS_ROOT counts too",
    )
    _env_flag(parser, "--mps-control", "TESSERA_MPS_CONTROL", help="the nvidia-cuda-mps-control binary (default: PATH)")
    _env_flag(
        parser,
        "--nvidia-smi",
        "TESSERA_NVIDIA_SMI",
        default="nvidia-smi",
        help="with dra: the host driver's nvidia-smi, which sets a time-slicing claim's GPU time-slice (default: PATH)",
    )
    _env_flag(
        parser,
        "--mps-keeper",
        "TESSERA_MPS_KEEPER",
        help="the socket of a `tessera mps-keeper` on this node: MPS daemons start in its container and outlive "
        "this one's restarts and upgrades (default: none, daemons start in the agent's container)",
    )
    _env_flag(
        parser,
        "--dra-registry-dir",
        "TESSERA_DRA_REGISTRY_DIR",
        default="/var/lib/kubelet/plugins_registry",
        help="with the config's dra section: the kubelet's plugin watcher directory (the registration socket)",
    )
    _env_flag(
        parser,
        "--dra-plugins-dir",
        "TESSERA_DRA_PLUGINS_DIR",
        default="/var/lib/kubelet/plugins",
        help="with dra: the kubelet's plugins directory (<dir>/<driver>/ holds the DRA socket and the checkpoint)",
    )
    _env_flag(
        parser, "--cdi-root", "TESSERA_CDI_ROOT", default="/var/run/cdi", help="with dra: where claims' CDI specs go"
    )
    _env_flag(
        parser,
        "--host-sys",
        "TESSERA_HOST_SYS",
        default="/sys",
        help="with dra: the host's /sys, where each GPU's PCIe root (resource.kubernetes.io/pcieRoot) is read",
    )
    _env_flag(
        parser,
        "--pod-uid",
        "POD_UID",
        help="with dra: this pod's UID (downward API), for socket names that allow a rolling update",
    )
    _env_flag(parser, "--mig-config", "TESSERA_MIG_CONFIG", help="a MIG layout file (mig-parted's format)")
    _env_flag(
        parser,
        "--mig-config-name",
        "TESSERA_MIG_CONFIG_NAME",
        help="which MIG layout (else the node label nvidia.com/mig.config, else the config's)",
    )
    _env_flag(
        parser,
        "--metrics-address",
        "TESSERA_METRICS_ADDRESS",
        default=":9479",
        help="where /metrics, /healthz and /readyz are served (HOST:PORT or :PORT; 'off' for none, and no /status)",
    )
    _env_flag(
        parser,
        "--status-socket",
        "TESSERA_STATUS_SOCKET",
        default=DEFAULT_STATUS_SOCKET,
        help="the unix socket (mode 0600) where /status is served for `tessera status` on this node, never on the "
        "metrics port ('off' for none)",
    )
    _env_flag(
        parser,
        "--metrics-interval",
        "TESSERA_METRICS_INTERVAL",
        default="10",
        type=_number("TESSERA_METRICS_INTERVAL", MIN_METRICS_INTERVAL, MAX_SECONDS, "seconds"),
        help="seconds between metric collections (a scrape serves the last one)",
    )
    _env_flag(
        parser,
        "--idle-threshold",
        "TESSERA_IDLE_THRESHOLD",
        default="5",
        type=_number("TESSERA_IDLE_THRESHOLD", 0, 100, "percent"),
        help="utilization percent under which an allocated device counts as idle",
    )
    _env_flag(
        parser,
        "--host-proc",
        "TESSERA_HOST_PROC",
        default="/proc",
        help="the host's /proc (read-only mount), to attribute GPU processes to pods",
    )
    _env_flag(
        parser,
        "--nfd-features-dir",
        "TESSERA_NFD_FEATURES_DIR",
        help="write node labels as an NFD local feature file in this directory "
        "(e.g. /etc/kubernetes/node-feature-discovery/features.d)",
    )
    parser.add_argument(
        "--shared-product-suffix",
        action="store_true",
        default=os.environ.get("TESSERA_SHARED_PRODUCT_SUFFIX", "") == "true",
        help="GFD's -SHARED suffix on gpu.product for shared GPUs (breaks some selectors) "
        "[env TESSERA_SHARED_PRODUCT_SUFFIX=true]",
    )
    parser.add_argument(
        "--label-node",
        action="store_true",
        default=os.environ.get("TESSERA_LABEL_NODE", "") == "true",
        help="also write the node labels (and nvidia.com/mig.config.state) on the Node itself, where NFD is not "
        "deployed; needs patch on nodes (daemonset/overlays/node-labels) [env TESSERA_LABEL_NODE=true]",
    )
    _env_flag(
        parser,
        "--cdi-kind",
        "TESSERA_CDI_KIND",
        help="CDI kind of the device plugin's spec for cdi-* strategies (k8s.device-plugin.nvidia.com/gpu; with "
        "--node-wide-cdi nvidia.com/gpu)",
    )
    parser.add_argument(
        "--node-wide-cdi",
        action="store_true",
        default=os.environ.get("TESSERA_NODE_WIDE_CDI", "") == "true",
        help="CDI IDs name the node-wide spec nvidia-ctk cdi generate writes (nvidia.com/gpu=<uuid>) instead of "
        "specs Tessera writes whole; only for nodes that keep that spec current [env TESSERA_NODE_WIDE_CDI=true]",
    )
    _env_flag(
        parser,
        "--memory-limits",
        "TESSERA_MEMORY_LIMITS",
        default="on",
        choices=["on", "off"],
        help="hold each container of a sized replica (MPS memoryLimit, time-slicing memoryLimit, a DRA share) to its "
        "size through the driver (r615+; else the MPS server or advisory, said in the status) and give it "
        "NVIDIA_GPU_MEMORY_REQUEST/LIMIT; off: neither",
    )
    _env_flag(
        parser,
        "--cgroup-root",
        "TESSERA_CGROUP_ROOT",
        default="/sys/fs/cgroup",
        help="with memory limits: the host's cgroup v2 hierarchy as the agent sees it (mount the host's "
        "/sys/fs/cgroup there read-only); containers' cgroups are found under it and named to the driver",
    )
    _env_flag(
        parser,
        "--container-logs",
        "TESSERA_CONTAINER_LOGS",
        default="/var/log/containers",
        help="with memory limits: the kubelet's container log links (read-only), watched for containers "
        "starting: each link names its container's ID",
    )
    _env_flag(
        parser,
        "--ignored-xids",
        "TESSERA_IGNORED_XIDS",
        help="XIDs that never make a device unhealthy; giving it switches to NVIDIA's model (every other XID "
        "is critical) instead of NVIDIA's Xid catalog; DP_DISABLE_HEALTHCHECKS / DP_ENABLE_HEALTHCHECKS count too",
    )
    _env_flag(
        parser,
        "--xid-overrides",
        "TESSERA_XID_OVERRIDES",
        help="per-XID effects over the catalog, e.g. 94=unhealthy,13=ignore,144-150=application "
        "(ignore, application, unhealthy, lost); wins over the config's health.xids",
    )
    _env_flag(
        parser,
        "--health-recovery-seconds",
        "TESSERA_HEALTH_RECOVERY_SECONDS",
        default="60",
        type=_number("TESSERA_HEALTH_RECOVERY_SECONDS", 0, MAX_SECONDS, "seconds (0 = never)"),
        help="quiet time after a critical XID before a device is checked for recovery (on evidence); 0 = never",
    )
    _log_flags(parser)
    _nvidia_flags(parser)


def _log_flags(parser: argparse.ArgumentParser) -> None:
    _env_flag(parser, "--log-format", "TESSERA_LOG_FORMAT", default="text", choices=["text", "json"], help="log format")
    _env_flag(
        parser,
        "--log-level",
        "TESSERA_LOG_LEVEL",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log level",
    )


def _nvidia_flags(parser: argparse.ArgumentParser) -> None:
    """NVIDIA's device-plugin flags, after Tessera's: each is honoured or refused (agent/nvidia_flags.py)."""
    from agent.nvidia_flags import add_arguments

    add_arguments(parser)


def _check_env_choices(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """argparse checks ``choices`` only for values given on the command line, not for env-var defaults."""
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for action in subparsers.choices[args.command]._actions:
        value = getattr(args, action.dest, None)
        if action.choices is not None and value is not None and value not in action.choices:
            parser.error(f"{getattr(action, 'env', action.dest)}={value!r} is not one of: {', '.join(action.choices)}")


def _check_plan_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``tessera plan``'s --dra flags without --dra would be ignored: a usage error, not silence."""
    if args.command != "plan" or args.dra:
        return
    given = [f"--{name.replace('_', '-')}" for name in DRA_ONLY_FLAGS if getattr(args, name) is not None]
    if given:
        subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        subparsers.choices["plan"].error(
            f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} read only with --dra (the ResourceSlices "
            "preview); add --dra, or leave "
            f"{'it' if len(given) == 1 else 'them'} out"
        )


def main(argv: Sequence[str] | None = None, *, early: EarlyCheck | None = None) -> int:
    """Run one command. Bad input is one line on stderr and a documented exit status; an exception nobody
    expected is one line too ("internal error", exit 70), with the traceback only when debugging
    (``--log-level debug``, ``TESSERA_LOG_LEVEL=debug`` or ``TESSERA_DEBUG=1``). ``early``: the config checker
    the entry point (:mod:`agent.entry`) forked for this command line."""
    from agent.config.early import config_on_command_line
    from agent.config.isolated import start_early

    words = sys.argv[1:] if argv is None else list(argv)
    # `tessera run`: the config checker (the longest step of a start) first, before the parser is even built
    early_check = start_early(config_on_command_line(words, os.environ), early=early)
    try:
        return _main(words, early_check, exit_when_done=argv is None)
    finally:
        if early_check is not None:  # a usage error, --help, a run that ended: no checker is left running
            early_check.cancel()  # (nothing to do once it has answered)


def _main(words: list[str], early_check: Check | None, *, exit_when_done: bool) -> int:
    parser = _parser()
    args = parser.parse_args(words)
    args.early_check = early_check
    args.exit_when_done = exit_when_done  # the process's own command line: `tessera run` may end the process
    _check_env_choices(parser, args)
    _check_plan_flags(parser, args)
    del parser  # every command's flags and help: not kept for the life of `tessera run`
    try:
        return _command(args)
    except KeyboardInterrupt:
        print("tessera: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        if args.command in ("run", "demo"):
            return _internal_error(args)
        # the reader of our output went away (`tessera plan | head`): nothing more to say, to anyone
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PLAN_ERROR
    except Exception:
        return _internal_error(args)


def _exit_now(code: int) -> NoReturn:
    """End the process at once: the agent has stopped, its sockets are gone and its workers are done, so the
    interpreter's teardown (finalising every module, tens of milliseconds) is skipped. Logs are flushed."""
    logging.shutdown()
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def _debugging(args: argparse.Namespace) -> bool:
    return (
        getattr(args, "log_level", None) == "debug"
        or os.environ.get("TESSERA_LOG_LEVEL", "").lower() == "debug"
        or os.environ.get("TESSERA_DEBUG", "").lower() in ("1", "true", "yes")
    )


def _internal_error(args: argparse.Namespace) -> int:
    """The last resort: one line naming the exception; the traceback only when debugging."""
    error = sys.exc_info()[1]
    if _debugging(args):
        traceback.print_exc(file=sys.stderr)
    detail = " ".join(f"{type(error).__name__}: {error}".split())[:500]
    hint = "" if _debugging(args) else " (TESSERA_DEBUG=1 prints the traceback)"
    print(f"tessera: internal error: {detail}, please report{hint}", file=sys.stderr)
    return EXIT_INTERNAL


def _command(args: argparse.Namespace) -> int:
    if args.command == "run":
        return _run(args)
    if args.command == "demo":
        from agent.demo import run_demo
        from agent.sim.nvml.spec import SimSpecError

        if args.dra:
            from agent.demo_dra import run_dra_demo

            return run_dra_demo(args.node, args.mig_strategy)
        try:
            return run_demo(args.node, args.mig_strategy)
        except SimSpecError as error:
            print(f"tessera: {error}", file=sys.stderr)
            return EXIT_USAGE
    if args.command == "mig":
        return _mig(args)
    if args.command == "validate":
        from agent.config.validate import validate_path

        return validate_path(Path(args.path), strict=args.strict, config_name=args.config_name)
    if args.command == "plan":
        return _plan(args)
    if args.command == "status":
        return _status(args)
    if args.command == "mps-keeper":
        return _mps_keeper(args)
    return _describe(args)


def _mps_keeper(args: argparse.Namespace) -> int:
    """``tessera mps-keeper``: serve the agent's start requests until SIGTERM; the daemons stay."""
    import shutil
    import signal

    from agent.config.model import safe_host_path
    from agent.logs import configure
    from agent.mps.keeper import KeeperError, MpsKeeper

    configure(args.log_format, args.log_level)
    binary = shutil.which(args.mps_control or "nvidia-cuda-mps-control")
    if binary is None:
        print(
            f"tessera: {args.mps_control or 'nvidia-cuda-mps-control'} not found; the keeper needs the driver's "
            "MPS control binary (NVIDIA container runtime with NVIDIA_DRIVER_CAPABILITIES=compute) or --mps-control",
            file=sys.stderr,
        )
        return EXIT_USAGE
    try:
        root, socket_path = Path(safe_host_path(args.mps_root)), Path(safe_host_path(args.socket))
        keeper = MpsKeeper(socket_path, root, binary)
    except (ValueError, OSError) as error:  # KeeperError: another keeper answers there
        problem = error if isinstance(error, KeeperError) else f"cannot serve {args.socket}: {error}"
        print(f"tessera: {problem}", file=sys.stderr)
        return EXIT_USAGE
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: keeper.stop())
    keeper.serve()
    return EXIT_OK


def _status(args: argparse.Namespace) -> int:
    """Ask the running agent (its /status endpoint) and print what it says; exit 1 when nobody answers."""
    import json

    from agent.status_client import StatusUnavailable, fetch_status
    from agent.status_report import render_idle, render_text

    if args.metrics_address is not None:
        print(
            "tessera: /status is no longer served on the metrics port (it answers anyone in the cluster): the agent "
            f"serves it on a unix socket on its node; give --status-socket (default {DEFAULT_STATUS_SOCKET}), and "
            "run this on the node or in the agent's container (kubectl exec -n tessera-system ds/tessera -- "
            "tessera status)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if args.status_socket in ("", "off", "none"):
        print("tessera: --status-socket off names no socket; give the agent's --status-socket", file=sys.stderr)
        return EXIT_USAGE
    try:
        document = fetch_status(args.status_socket)
    except StatusUnavailable as error:
        print(f"tessera: {error}", file=sys.stderr)
        return EXIT_INVALID
    if args.format == "json":
        print(json.dumps(document, indent=2))
    else:
        print(render_idle(document) if args.idle else render_text(document), end="")
    return EXIT_OK


def _mig(args: argparse.Namespace) -> int:
    from agent.backend import gpu_backend
    from agent.gpu.discovery import DiscoveryError
    from agent.gpu.nvml import NvmlUnavailable
    from agent.mig import commands
    from agent.sim.nvml.spec import SimSpecError

    try:
        with gpu_backend(args.node):
            if args.mig_command == "export":
                return commands.export(args.format, args.label)
            if args.mig_command == "assert":
                return commands.assert_layout(args.config, args.name)
            return commands.apply(args.config, args.name, args.dry_run)
    except SimSpecError as error:
        print(f"tessera: {error}", file=sys.stderr)
        return EXIT_USAGE
    except (NvmlUnavailable, DiscoveryError) as error:
        print(f"tessera: {error}{_local_hint(args) if isinstance(error, NvmlUnavailable) else ''}", file=sys.stderr)
        return EXIT_NVML


def _describe(args: argparse.Namespace) -> int:
    from agent.backend import gpu_backend
    from agent.gpu.discovery import DiscoveryError, discover
    from agent.gpu.nvml import NvmlUnavailable
    from agent.sim.nvml.spec import SimSpecError

    try:
        with gpu_backend(args.node):
            inventory = discover()
    except SimSpecError as error:
        print(f"tessera: {error}", file=sys.stderr)
        return EXIT_USAGE
    except (NvmlUnavailable, DiscoveryError) as error:
        print(f"tessera: {error}{_local_hint(args) if isinstance(error, NvmlUnavailable) else ''}", file=sys.stderr)
        return EXIT_NVML
    return _print_inventory(inventory, args)


def _local_hint(args: argparse.Namespace) -> str:
    """What to try without a GPU, in the terms of the command that failed: ``run`` simulates a node with
    ``--simulate``, the commands that read a node (``plan``, ``inventory``, ``mig``) with ``--node``."""
    if args.command == "run":
        return " Without a GPU: `tessera run --simulate dgx-a100`, or `tessera demo`"
    if getattr(args, "node", None) != "local":
        return ""
    return f" Without a GPU: `tessera {_command_words(args)} --node dgx-a100` (a simulated node), or `tessera demo`"


def _command_words(args: argparse.Namespace) -> str:
    return f"mig {args.mig_command}" if args.command == "mig" else str(args.command)


def _run(args: argparse.Namespace) -> int:
    collecting = gc.isenabled()
    gc.disable()  # while the agent is imported and starts: on again once the kubelet is served (agent.run)
    try:
        return _run_agent(args, collector_paused=collecting)
    finally:
        if collecting:
            gc.enable()  # the agent ended (or never started) before the kubelet was served


def _run_agent(args: argparse.Namespace, *, collector_paused: bool) -> int:
    from agent.config.isolated import start_early

    # The config is checked in a child process (no PyYAML here), started first: it runs while the agent loads.
    # `main` started it from the command line, unparsed; if that guessed another path, the agent starts its own.
    config_check = args.early_check or start_early(
        args.config or getattr(args, "config_file", None) or os.environ.get("CONFIG_FILE")
    )
    from agent.core.resources import PlanError
    from agent.gpu.discovery import DiscoveryError
    from agent.gpu.nvml import NvmlUnavailable
    from agent.logs import configure
    from agent.run import OptionsError, build_options, run_agent

    configure(args.log_format, args.log_level)
    try:
        options = build_options(args, dict(os.environ))
        code = run_agent(
            options, args.simulate, args.sim_control, collector_paused=collector_paused, config_check=config_check
        )
        if args.exit_when_done:
            _exit_now(code)
        return code
    except OptionsError as error:  # a bad --simulate spec too
        print(f"tessera: {error}", file=sys.stderr)
        return EXIT_USAGE
    except PlanError as error:
        print(f"tessera: {error}", file=sys.stderr)
        return EXIT_PLAN_ERROR
    except (NvmlUnavailable, DiscoveryError) as error:
        hint = _local_hint(args) if isinstance(error, NvmlUnavailable) and not args.simulate else ""
        print(f"tessera: {error}{hint}", file=sys.stderr)
        return EXIT_NVML
    finally:
        if config_check is not None:
            config_check.cancel()  # the agent collected its answer, or never started: no child left behind


def _print_inventory(inventory: object, args: argparse.Namespace) -> int:
    import msgspec

    from agent.render import inventory_details, inventory_text

    if args.format == "json":
        print(json.dumps(msgspec.to_builtins(inventory), indent=2))
    else:
        print(inventory_text(inventory))  # type: ignore[arg-type]
        if args.details:
            print(inventory_details(inventory))  # type: ignore[arg-type]
    return EXIT_OK


def _plan(args: argparse.Namespace) -> int:
    """``tessera plan``: the config the agent would choose on the node, the MIG layout it would apply (run on
    a simulated node, so the resources shown are those after it), and what the node would then advertise.
    Input that cannot work (a config, a name, a layout) is exit 1, with every problem said once."""
    from agent.backend import gpu_backend
    from agent.config.model import ConfigError
    from agent.core.mig_layout import LayoutError
    from agent.core.resources import PlanError
    from agent.gpu.discovery import DiscoveryError
    from agent.gpu.mig import MigOperationError
    from agent.gpu.nvml import NvmlUnavailable
    from agent.mig.commands import report_invalid
    from agent.mig.layout_file import LayoutFileError
    from agent.sim.nvml.spec import SimSpecError

    try:
        with gpu_backend(args.node) as node:
            result, layout, notes, inventory, model = _preview(args, node)
            if args.dra:
                return _print_dra_preview(args, inventory, model, notes)
    except SimSpecError as error:
        print(f"tessera: {error}", file=sys.stderr)
        return EXIT_USAGE
    except (NvmlUnavailable, DiscoveryError) as error:
        print(f"tessera: {error}{_local_hint(args) if isinstance(error, NvmlUnavailable) else ''}", file=sys.stderr)
        return EXIT_NVML
    except MigOperationError as error:
        print(f"tessera: the simulated node refused the MIG layout: {error}", file=sys.stderr)
        return EXIT_NVML
    except (ConfigError, LayoutFileError, LayoutError, PlanError) as error:
        return report_invalid(error)
    from agent.core.memlimits import plan_enforcement
    from agent.render import plan_table

    for note in notes:
        print(f"tessera: {note}", file=sys.stderr)
    held = plan_enforcement(result, inventory.driver_version)  # which enforcement would hold each sized resource
    if args.format in ("json", "yaml"):
        document = result.to_json()
        if layout is not None:
            document["mig_layout"] = layout.to_json()
        if held:
            document["memory_limits"] = {row.resource: row.to_json() for row in held}
        print(json.dumps(document, indent=2) if args.format == "json" else _yaml(document), end="\n")
    else:
        if layout is not None:
            print("\n".join([*layout.lines(), ""]))
        print(plan_table(result, held))
    return EXIT_OK


def _preview(
    args: argparse.Namespace, node: object | None
) -> tuple[ResourcePlan, MigPreview | None, list[str], Inventory, ConfigModel]:
    """(the plan, the MIG layout's preview or None, notes for stderr, the GPUs after the layout, the config),
    inside the GPU backend."""
    from agent.config.effective import FlagOverrides, effective
    from agent.config.model import ConfigModel
    from agent.config.source import load_config, read_config_set
    from agent.core.plan import plan
    from agent.gpu.discovery import discover
    from agent.mig import commands
    from agent.mig.layout_file import config_layout

    inventory = discover()
    model, notes, layout = ConfigModel(), [], None
    if args.config:
        config_set = read_config_set(Path(args.config))
        loaded = load_config(
            config_set,
            requested=args.config_name,
            label=args.node_label,
            gpu_products=[g.name for g in inventory.gpus],
            strict_names=True,
        )
        model = loaded.model
        notes += [f"warning: {warning}" for warning in loaded.warnings]
        notes.append(f"config {loaded.name or '(defaults)'}: {loaded.reason}")
        origin = config_set.origin_of(loaded.name) if loaded.name is not None else str(config_set.origin)
        selected = config_layout(model.mig_layout, origin, args.mig_label)
        if selected is not None and selected[1] is None:
            notes.append(
                f"migLayout holds several layouts ({', '.join(selected[0].mig_configs)}) and migLayout.config names "
                "none: the agent leaves MIG as it is until the node label nvidia.com/mig.config names one (--mig-label)"
            )
        elif selected is not None:
            layout_file, name = selected
            assert name is not None
            on_node = commands.layout_on_node(layout_file, name, inventory.gpus)
            layout, inventory = commands.preview(on_node, inventory, node)  # type: ignore[arg-type]
            if not layout.after_layout:
                notes.append(
                    "the resources below are the GPUs as they are now: a preview never changes the real "
                    "driver's MIG layout; to see the resources after it, plan on a simulated node with the same "
                    "GPUs (--node SPEC)"
                )
    if args.mig_label and layout is None:  # with layouts, the label picks one (or is an error): here there are none
        notes.append("warning: --mig-label is not used: it picks a layout of the config's migLayout, and there is none")
    planned = inventory
    if model.dra is not None and model.dra.enabled and not args.dra:  # the device plugin's share only
        from agent.core.dra.ownership import dra_gpus, without

        served = dra_gpus(model.dra.gpus, inventory)
        planned = without(inventory, served)
        if served:
            indices = ", ".join(str(g.index) for g in inventory.gpus if g.uuid in served)
            notes.append(f"GPUs {indices} are served through DRA (dra.gpus): `tessera plan --dra` shows them")
    result = plan(effective(model, FlagOverrides(mig_strategy=args.mig_strategy)).plan, planned)
    return result, layout, notes, inventory, model


PLACEHOLDER_NODE_UID = "00000000-0000-0000-0000-000000000000"
PARTITIONABLE_DEVICES_ON = 36  # DRAPartitionableDevices: alpha in 1.33-1.35, beta and on from 1.36 (dra.md B1)


def _print_dra_preview(args: argparse.Namespace, inventory: Inventory, model: ConfigModel, notes: list[str]) -> int:
    """``tessera plan --dra``: the node's ResourceSlices as complete ``resource.k8s.io/v1`` objects, as the agent
    would publish them (a YAML stream, a JSON List, or a table of the devices)."""
    from agent.core.dra.ownership import OwnershipError, dra_gpus, dynamic_mig_gpus, shared_gpus
    from agent.core.dra.pool import dra_pool
    from agent.core.dra.shares import gate_note
    from agent.core.dra.slices import SliceError, layout_for, resource_slices

    section = model.dra
    driver = section.driver_name if section is not None else "gpu.nvidia.com"
    try:
        if section is not None and section.enabled:
            chosen = dra_gpus(section.gpus, inventory)
        else:
            chosen = dra_gpus("all", inventory)
            if args.config:
                notes.append("the config does not enable dra: showing every GPU as DRA would publish it")
        node_name = args.node_name or _spec_node_name(args.node)
        dynamic = dynamic_mig_gpus(section.dynamic_mig, chosen, inventory) if section is not None else frozenset()
        shared = shared_gpus(section.shared_gpus, chosen, dynamic, inventory) if section is not None else frozenset()
        default_share = section.default_share if section is not None else None
        # the agent's own publishing path (agent.dra.manager.publish): what is shown is what it publishes
        real = not args.node or args.node == "local"  # sysfs describes real GPUs only
        roots, numa = _sysfs_topology(inventory, chosen) if real else ({}, {})
        pool = dra_pool(
            inventory,
            served=chosen,
            dynamic_mig=dynamic,
            shared=shared,
            default_share=default_share,
            pcie_roots=roots,
            numa_nodes=numa,
            share_mode=section.share_mode if section is not None else "memory",
        )
        devices = pool.offered
        kubernetes = args.kubernetes_version or DEFAULT_KUBERNETES
        layout = layout_for(f"v{kubernetes}.0")
        slices = resource_slices(
            node_name, args.node_uid or PLACEHOLDER_NODE_UID, driver, devices, 1, layout, counter_sets=pool.counters,
        )  # fmt: skip
    except (OwnershipError, SliceError, ValueError) as error:
        print(f"tessera: {error}", file=sys.stderr)
        return EXIT_INVALID
    kept = [str(g.index) for g in inventory.gpus if g.uuid not in chosen]
    if kept:
        notes.append(f"GPUs {', '.join(kept)} stay with the device plugin (tessera plan without --dra shows them)")
    minor = int(kubernetes.split(".")[1])  # _kubernetes_version: "1.<minor>"
    if dynamic and minor < PARTITIONABLE_DEVICES_ON:
        notes.append(
            f"dynamic MIG publishes partitionable devices: Kubernetes 1.{minor} needs the DRAPartitionableDevices "
            "feature gate (alpha) on the API server, scheduler and kubelet; without it the API server drops the "
            "counters and the scheduler could pick overlapping MIG placements (their Prepare then fails)"
        )
    if any(d.allow_multiple_allocations for d in devices) and (note := gate_note((1, minor))) is not None:
        notes.append(note)
    in_mig_mode = [str(g.index) for g in inventory.gpus if g.uuid in shared and g.mig_enabled]
    if in_mig_mode:
        notes.append(f"GPUs {', '.join(in_mig_mode)} are in MIG mode: each of their MIG devices is shared")
    if shared:
        notes.append(_share_limits_note(inventory, shared))
    if not args.node_uid:
        notes.append(
            "ownerReferences name the Node by a placeholder UID; give --node-uid "
            f"\"$(kubectl get node {node_name} -o jsonpath='{{.metadata.uid}}')\" for the real one"
        )
    for note in notes:
        print(f"tessera: {note}", file=sys.stderr)
    if args.format == "yaml":
        print("---\n".join(_yaml(s) for s in slices), end="")
    elif args.format == "json":
        print(json.dumps({"apiVersion": "v1", "kind": "List", "items": slices}, indent=2))
    else:
        for index, item in enumerate(slices):
            spec = item["spec"]
            print(f"slice {index} of pool {spec['pool']['name']} (driver {spec['driver']}, {layout} layout)")
            for counter_set in spec.get("sharedCounters", []):
                counters = counter_set["counters"]
                slices_of = sum(1 for name in counters if name.startswith("memory-slice-"))
                memory = counters.get("memory", {}).get("value", "-")
                print(f"  counter set {counter_set['name']:<24} memory {memory}, {slices_of} memory slices")
            for device in spec.get("devices", []):
                attributes = device["attributes"]
                kind = attributes["type"]["string"]
                what = attributes.get("profile", attributes.get("productName", {})).get("string", "")
                memory = device.get("capacity", {}).get("memory", {})
                shares = ""
                if device.get("allowMultipleAllocations"):
                    policy = memory["requestPolicy"]
                    given = "all" if policy["default"] == memory["value"] else policy["default"]
                    step = policy["validRange"]["step"]
                    shares = f"  shared: memory in {step} steps ({given} if not asked), computePercent 0-100"
                    count = device["capacity"].get("shares", {}).get("value")
                    shares += f", {count} shares (1 if not asked)" if count else ""
                print(f"  {device['name']:<28} {kind:<4} {what:<26} memory {memory.get('value', '-')}{shares}")
    return EXIT_OK


def _share_limits_note(inventory: Inventory, shared: frozenset[str]) -> str:
    """``tessera plan --dra``: what would hold a share's memory on this node (docs/dra.md, GPU shares)."""
    from agent.core.memlimits import driver_refusal

    ceiling = (
        "the MPS server holds every share exactly where all shares on a device are equal; where they differ it "
        "holds the largest and the smaller ones are advisory (their clients' CUDA_MPS_* variables only)"
    )
    refusal = driver_refusal(inventory.driver_version)
    if refusal is not None:
        return f"shared GPUs' memory: {ceiling}: {refusal}"
    whole = [str(g.index) for g in inventory.gpus if g.uuid in shared and not g.mig_enabled]
    mig = [str(g.index) for g in inventory.gpus if g.uuid in shared and g.mig_enabled]
    said = []
    if whole:
        said.append(
            f"GPUs {', '.join(whole)}: the driver holds each container to its own share (driver "
            f"{inventory.driver_version}, the agent running as root with --memory-limits on)"
        )
    if mig:
        said.append(f"GPUs {', '.join(mig)} (MIG devices, which the driver cannot limit): {ceiling}")
    return "shared GPUs' memory: " + "; ".join(said)


def _sysfs_topology(inventory: Inventory, gpus: frozenset[str]) -> tuple[dict[str, str], dict[str, int | None]]:
    """The PCIe roots and NUMA nodes the agent reads from the host's /sys for these GPUs (``agent.dra.manager``)."""
    from agent.core.dra.devices import pci_bus_id
    from agent.dra.pcie import numa_nodes, pcie_roots

    bus_ids = {b for b in (pci_bus_id(g.pci_bus_id) for g in inventory.gpus if g.uuid in gpus) if b is not None}
    return pcie_roots(bus_ids), numa_nodes(bus_ids)


def _spec_node_name(node: str | None) -> str:
    """The node spec's name (a preset's or a spec file's), else NODE_NAME (in the agent's pod), else the host's."""
    import socket

    if not node or node == "local":
        return os.environ.get("NODE_NAME") or socket.gethostname()
    if node:
        from agent.sim.nvml.spec import load_node_spec

        return load_node_spec(node).name
    return socket.gethostname()


def _yaml(document: object) -> str:
    import yaml

    return yaml.safe_dump(document, sort_keys=False, default_flow_style=False)
