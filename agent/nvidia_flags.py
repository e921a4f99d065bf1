"""NVIDIA's device-plugin flags and environment variables (v0.20) under ``tessera run``.

A manifest written for NVIDIA's ``nvidia-device-plugin`` must not be silently misread. So each of its
settings is either *honoured* (same flag, same variable, same value syntax) or *refused* with one line that
says why and what to use instead, before anything starts (``tessera run`` exits 2):

- honoured under Tessera's own flag: ``--mig-strategy``, ``--device-list-strategy``,
  ``--shared-devices-allocation-policy``, ``--mps-root``, ``--config-file`` (``--config``) and
  ``--kubelet-socket`` (``--device-plugin-dir``), each with NVIDIA's variable as well;
- honoured as NVIDIA's own: ``--fail-on-init-error``, and where the driver is for CDI specs: ``--driver-root``,
  ``--dev-root``, ``--nvidia-cdi-hook-path`` and ``--container-driver-root`` (``agent.gpu.driver_root``);
- honoured only at the value that asks for what Tessera always does (NVIDIA's default, e.g.
  ``--device-id-strategy uuid``); any other value is refused (e.g. ``index``).

Precedence is NVIDIA's: a flag, then its variable(s) (the first one set, in NVIDIA's order), then the config
file's ``flags``, then the default. Where Tessera has a name of its own, any flag spelling wins, then
``TESSERA_*``, then NVIDIA's variable (a warning names the one that lost). An empty NVIDIA variable counts
as unset, except ``KUBELET_SOCKET`` (for NVIDIA, empty means "never register"). Values are read as NVIDIA
reads them: booleans as Go's ``strconv.ParseBool``, enumerations case-sensitively.
Variables of the container runtime that NVIDIA's manifests set (``NVIDIA_VISIBLE_DEVICES``,
``NVIDIA_DRIVER_CAPABILITIES``, ``NVIDIA_MIG_MONITOR_DEVICES``) are not plugin settings: never looked at.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from enum import StrEnum
from pathlib import PurePosixPath
from typing import Any

from msgspec import Struct, field

GO_TRUE = frozenset({"1", "t", "T", "TRUE", "true", "True"})
GO_FALSE = frozenset({"0", "f", "F", "FALSE", "false", "False"})
KUBELET_SOCKET_NAME = "kubelet.sock"
_NO_CDI_SPEC = "Tessera's CDI specs hold what NVIDIA's toolkit gives by default (every hook it finds, no feature flags)"


class NvidiaFlagError(ValueError):
    """A setting of NVIDIA's that Tessera refuses or cannot read; the text is ``NAME: why; what to do``."""


class Kind(StrEnum):
    BOOL = "bool"  # Go's strconv.ParseBool; a bare flag means true
    TEXT = "text"
    TEXTS = "texts"  # urfave/cli's StringSlice: comma-separated, the flag may repeat
    INTS = "ints"  # urfave/cli's IntSlice


class NvidiaSetting(Struct, frozen=True):
    """One setting of ``nvidia-device-plugin``: its flag spellings and variables in NVIDIA's order."""

    flags: tuple[str, ...]
    envs: tuple[str, ...]
    kind: Kind = Kind.TEXT
    default: str = ""  # NVIDIA's, as text ("" = none)
    choices: tuple[str, ...] = ()  # NVIDIA's own check, case-sensitive ("" = any value)
    invalid: str = ""  # NVIDIA's complaint about a value outside ``choices``, with {value}
    honoured: tuple[str, ...] | None = None  # the values Tessera honours (None: every valid one)
    refusal: tuple[str, str] = ("", "")  # why any other value is refused ({value}), and what to do instead
    tessera: str = ""  # the dest of Tessera's flag that carries it ("": a setting of NVIDIA's own)
    help: str = ""

    @property
    def dest(self) -> str:
        return self.tessera or "nvidia_" + self.flags[0].removeprefix("--").replace("-", "_")


SETTINGS: tuple[NvidiaSetting, ...] = (
    NvidiaSetting(
        ("--mig-strategy",), ("MIG_STRATEGY",), default="none", choices=("none", "single", "mixed"),
        invalid="unknown MIG strategy: {value}", tessera="mig_strategy",
    ),
    NvidiaSetting(
        ("--device-list-strategy",), ("DEVICE_LIST_STRATEGY",), Kind.TEXTS, default="envvar",
        tessera="device_list_strategy",
    ),
    NvidiaSetting(
        ("--shared-devices-allocation-policy",), ("SHARED_DEVICES_ALLOCATION_POLICY",), default="distributed",
        choices=("distributed", "packed"), invalid="invalid --shared-devices-allocation-policy option: {value}",
        tessera="shared_devices_allocation_policy",
    ),
    NvidiaSetting(("--mps-root",), ("MPS_ROOT",), tessera="mps_root"),
    NvidiaSetting(
        ("--config-file",), ("CONFIG_FILE",), tessera="config",
        help="NVIDIA's name for --config",
    ),
    NvidiaSetting(
        ("--kubelet-socket",), ("KUBELET_SOCKET",), default="/var/lib/kubelet/device-plugins/kubelet.sock",
        tessera="device_plugin_dir",
        help="NVIDIA's: DIR/kubelet.sock means --device-plugin-dir DIR",
    ),
    NvidiaSetting(
        ("--fail-on-init-error",), ("FAIL_ON_INIT_ERROR",), Kind.BOOL, default="true",
        help="exit (status 3) at start when NVML cannot initialise; Tessera's default is false: keep running, "
        "advertise nothing and retry",
    ),
    NvidiaSetting(
        ("--driver-root", "--nvidia-driver-root"), ("NVIDIA_DRIVER_ROOT",), default="/",
        help="the driver's root on the host (/run/nvidia/driver for the GPU operator's): CDI specs mount its "
        "libraries and binaries from there",
    ),
    NvidiaSetting(
        ("--dev-root", "--nvidia-dev-root"), ("NVIDIA_DEV_ROOT",), default="/",
        help="the host root of the /dev device nodes CDI specs name (default: the driver root)",
    ),
    NvidiaSetting(
        ("--pass-device-specs",), ("PASS_DEVICE_SPECS",), Kind.BOOL, default="false", honoured=("false",),
        refusal=(
            "Tessera's Allocate passes no DeviceSpecs (NVIDIA's compatWithCPUManager workaround)",
            "use --device-list-strategy cdi-cri: the devices are then in the container's own spec and survive "
            "CPU-manager updates",
        ),
        help="only false (for CPU-manager nodes use --device-list-strategy cdi-cri)",
    ),
    NvidiaSetting(
        ("--device-id-strategy",), ("DEVICE_ID_STRATEGY",), default="uuid", choices=("uuid", "index"),
        invalid="invalid --device-id-strategy option: {value}", honoured=("uuid",),
        refusal=(
            "Tessera names devices by UUID only (indices change when GPUs come and go)",
            "remove it, or set uuid",
        ),
        help="only uuid",
    ),
    *(
        NvidiaSetting(
            (f"--{name}-enabled",), (f"{name.upper()}_ENABLED",), Kind.BOOL, default="false", honoured=("false",),
            refusal=(
                f"Tessera does not add NVIDIA_{name.upper()}=enabled to containers",
                f"set NVIDIA_{name.upper()}=enabled in the pod's container env (the NVIDIA runtime reads it there)",
            ),
            help=f"only false (set NVIDIA_{name.upper()}=enabled in the pod instead)",
        )
        for name in ("gdrcopy", "gds", "mofed")
    ),
    NvidiaSetting(
        ("--device-discovery-strategy",), ("DEVICE_DISCOVERY_STRATEGY",), default="auto",
        choices=("auto", "nvml", "tegra"), invalid="invalid --device-discovery-strategy option {value}",
        honoured=("auto", "nvml"),
        refusal=(
            "Tessera finds GPUs through NVML only; Tegra (Jetson) GPUs are not supported",
            "use auto or nvml, or NVIDIA's plugin on Tegra nodes",
        ),
        help="auto or nvml (Tessera always uses NVML)",
    ),
    NvidiaSetting(
        ("--cdi-annotation-prefix",), ("CDI_ANNOTATION_PREFIX",), default="cdi.k8s.io/", honoured=("cdi.k8s.io/",),
        refusal=(
            "Tessera's CDI annotation keys are cdi.k8s.io/tessera_<resource>; the prefix is fixed",
            "remove it, or use --device-list-strategy cdi-cri (no annotation at all)",
        ),
        help="only cdi.k8s.io/",
    ),
    NvidiaSetting(
        ("--nvidia-cdi-hook-path", "--nvidia-ctk-path"), ("NVIDIA_CDI_HOOK_PATH", "NVIDIA_CTK_PATH"),
        help="the host's nvidia-cdi-hook (or nvidia-ctk) that CDI specs' hooks run (default: found under the "
        "driver root, else no hooks)",
    ),
    NvidiaSetting(
        ("--driver-root-ctr-path", "--container-driver-root"), ("DRIVER_ROOT_CTR_PATH", "CONTAINER_DRIVER_ROOT"),
        help="where the agent sees the driver root (the DaemonSet's mount of it; default: the driver root's path)",
    ),
    NvidiaSetting(
        ("--cdi-feature-flags",), ("CDI_FEATURE_FLAGS",), Kind.TEXTS, honoured=(),
        refusal=(_NO_CDI_SPEC, "remove it"),
        help="refused (Tessera's CDI specs take no feature flags)",
    ),
    NvidiaSetting(
        ("--cdi-disable-hooks",), ("CDI_DISABLE_HOOKS",), Kind.TEXTS, honoured=(),
        refusal=(
            _NO_CDI_SPEC,
            "remove it, or give --nvidia-cdi-hook-path a hook of your choice, or use --node-wide-cdi and choose the "
            "hooks with nvidia-ctk cdi generate",
        ),
        help="refused (Tessera's CDI specs run every hook the driver root offers)",
    ),
    NvidiaSetting(
        ("--imex-channel-ids",), ("IMEX_CHANNEL_IDS",), Kind.INTS, honoured=(),
        invalid="invalid IMEX channel IDs: invalid IMEX config: channelIDs must be [] or [0]; found {value}",
        refusal=(
            "Tessera does not give IMEX channels to containers",
            "remove it (for IMEX, use NVIDIA's DRA driver and its ComputeDomains)",
        ),
        help="refused (Tessera gives no IMEX channels)",
    ),
    NvidiaSetting(
        ("--imex-required",), ("IMEX_REQUIRED",), Kind.BOOL, default="false", honoured=("false",),
        refusal=(
            "Tessera does not give IMEX channels to containers",
            "remove it (for IMEX, use NVIDIA's DRA driver and its ComputeDomains)",
        ),
        help="only false",
    ),
)  # fmt: skip


# ----- the command line ---------------------------------------------------------------------------------


class _Given(str):
    """A value from the command line, with the spelling the user typed (for messages)."""

    option: str

    def __new__(cls, value: str, option: str) -> _Given:
        given = super().__new__(cls, value)
        given.option = option
        return given


class BuiltinDefault(str):
    """A flag's built-in default: neither the command line nor Tessera's variable gave it."""


class KubeletSocket(_Given):
    """``--kubelet-socket``, kept in ``--device-plugin-dir``'s place (the last one given wins)."""


class Value(argparse.Action):
    """Store a flag's text with the spelling given."""

    wrap: type[_Given] = _Given

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[object] | None,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, self.wrap(str(values), option_string or self.dest))


class ListValue(Value):
    """urfave/cli's slices: comma-separated, and a repeated flag adds to the list (its variable is replaced)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[object] | None,
        option_string: str | None = None,
    ) -> None:
        current = getattr(namespace, self.dest, None)
        text = f"{current},{values}" if isinstance(current, _Given) else str(values)
        setattr(namespace, self.dest, _Given(text, option_string or self.dest))


class _KubeletSocketValue(Value):
    wrap = KubeletSocket


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """NVIDIA's flags on ``tessera run``, added after Tessera's own: a flag Tessera already has under NVIDIA's
    name (``--mig-strategy`` ...) is that one, and its help names NVIDIA's variable."""
    group = parser.add_argument_group(
        "NVIDIA device plugin flags",
        "NVIDIA's flags and variables are read too; a value Tessera cannot honour stops it at once with one line "
        "that says why (exit 2). See docs/install.md.",
    )
    for setting in SETTINGS:
        if setting.flags[0] not in parser._option_string_actions:
            group.add_argument(*setting.flags, **_argument(setting))


def _argument(setting: NvidiaSetting) -> dict[str, Any]:
    common = {
        "dest": setting.dest,
        "default": argparse.SUPPRESS if setting.tessera else None,  # Tessera's own flag holds the default
        "help": f"{setting.help} [env {', '.join(setting.envs)}]",
    }
    if setting.dest == "device_plugin_dir":
        return common | {"action": _KubeletSocketValue, "metavar": "PATH"}
    if setting.kind is Kind.BOOL:  # --flag alone is true, as in Go; --flag=false, --flag false
        return common | {"action": Value, "nargs": "?", "const": "true", "metavar": "BOOL"}
    if setting.kind in (Kind.TEXTS, Kind.INTS):
        return common | {"action": ListValue, "metavar": "LIST"}
    path = setting.default.startswith("/") or setting.flags[0].endswith(("-file", "-root", "-path"))
    return common | {"action": Value, "metavar": "PATH" if path else "VALUE"}


# ----- reading them -------------------------------------------------------------------------------------


class Chosen(Struct, frozen=True):
    value: str | None
    source: str  # the flag or variable it came from, for messages


class NvidiaFlags(Struct, frozen=True):
    """What ``tessera run`` takes from NVIDIA's settings, every one checked."""

    chosen: Mapping[str, Chosen]  # by Tessera's dest: the flag (or Tessera's variable), else NVIDIA's variable
    fail_on_init_error: bool | None = None  # None: neither the flag nor FAIL_ON_INIT_ERROR was given
    warnings: tuple[str, ...] = ()
    driver: Mapping[str, str] = field(default_factory=dict)  # DRIVER_SETTINGS given: dest -> value

    def driver_root(self) -> dict[str, str | None]:
        """The driver root's settings (``agent.gpu.driver_root.DriverRoot``'s fields), None where not given."""
        return {name: self.driver.get(dest) for dest, name in DRIVER_SETTINGS.items()}

    def value(self, dest: str) -> str | None:
        return self.chosen[dest].value


# NVIDIA's settings that say where the driver is (for CDI specs): dest -> the DriverRoot field it sets
DRIVER_SETTINGS = {
    "nvidia_driver_root": "root",
    "nvidia_dev_root": "dev_root",
    "nvidia_nvidia_cdi_hook_path": "hook_path",
    "nvidia_driver_root_ctr_path": "container_root",
}


def parse_go_bool(text: str) -> bool:
    """As Go's ``strconv.ParseBool``."""
    if text in GO_TRUE:
        return True
    if text in GO_FALSE:
        return False
    raise ValueError(text)


def read(args: argparse.Namespace, environ: Mapping[str, str]) -> NvidiaFlags:
    """Every NVIDIA setting from the parsed ``tessera run`` flags and the environment; raises
    ``NvidiaFlagError`` for the first one that is invalid or refused."""
    chosen: dict[str, Chosen] = {}
    warnings: list[str] = []
    fail_on_init_error: bool | None = None
    driver: dict[str, str] = {}
    for setting in SETTINGS:
        if setting.tessera:
            chosen[setting.dest] = _tessera_or_nvidia(setting, args, environ, warnings)
            continue
        given = getattr(args, setting.dest, None)
        source = _first_env(setting, environ)
        if isinstance(given, _Given):
            source = (given.option, str(given))
        if source is None:
            continue
        value = _checked(setting, *source)
        if setting.dest == "nvidia_fail_on_init_error":
            fail_on_init_error = value == "true"
        if setting.dest in DRIVER_SETTINGS and value:
            driver[setting.dest] = value
    return NvidiaFlags(chosen, fail_on_init_error, tuple(warnings), driver)


def _first_env(setting: NvidiaSetting, environ: Mapping[str, str]) -> tuple[str, str] | None:
    """NVIDIA's variable that is set (non-empty), the first in NVIDIA's order."""
    for name in setting.envs:
        if environ.get(name) or (name == "KUBELET_SOCKET" and name in environ):
            return name, environ[name]
    return None


def _tessera_or_nvidia(
    setting: NvidiaSetting, args: argparse.Namespace, environ: Mapping[str, str], warnings: list[str]
) -> Chosen:
    """A flag (any spelling) or Tessera's variable, else NVIDIA's variable, else Tessera's default."""
    given = getattr(args, setting.dest, None)
    env = _first_env(setting, environ)
    if isinstance(given, KubeletSocket):
        return Chosen(_socket_dir(given.option, str(given)), given.option)
    if given is not None and not isinstance(given, BuiltinDefault):
        if env is not None and _comparable(setting, env[1]) != _comparable(setting, str(given)):
            warnings.append(f"{env[0]}={env[1]!r} is ignored: the flag or Tessera's variable gives {str(given)!r}")
        return Chosen(str(given), getattr(given, "option", setting.flags[0]))
    if env is None:
        return Chosen(None if given is None else str(given), setting.flags[0])
    name, text = env
    if setting.dest == "device_plugin_dir":
        return Chosen(_socket_dir(name, text), name)
    if setting.choices and text not in setting.choices:
        raise NvidiaFlagError(f"{name}: {setting.invalid.format(value=text)}; use {_alternatives(setting.choices)}")
    return Chosen(text, name)


def _comparable(setting: NvidiaSetting, text: str) -> str:
    if setting.dest == "device_plugin_dir":  # KUBELET_SOCKET against TESSERA_DEVICE_PLUGIN_DIR
        socket = PurePosixPath(text)
        return str(socket.parent) if socket.name == KUBELET_SOCKET_NAME else text
    if setting.kind is Kind.TEXTS:
        return ",".join(part.strip() for part in text.split(",") if part.strip())
    return text


def _socket_dir(name: str, path: str) -> str:
    socket = PurePosixPath(path)
    if not path:
        raise NvidiaFlagError(
            f"{name}: Tessera always registers with the kubelet (NVIDIA's empty socket means never); "
            f"give the kubelet's socket, e.g. /var/lib/kubelet/device-plugins/{KUBELET_SOCKET_NAME}"
        )
    if socket.name != KUBELET_SOCKET_NAME or not socket.is_absolute():
        raise NvidiaFlagError(
            f"{name}: Tessera expects the kubelet's socket as <dir>/{KUBELET_SOCKET_NAME}, not {path!r} (its own "
            "sockets go beside it); use --device-plugin-dir DIR"
        )
    return str(socket.parent)


def _checked(setting: NvidiaSetting, name: str, text: str) -> str:
    """The value in NVIDIA's reading (booleans as true/false), or NvidiaFlagError naming ``name``."""
    value = text
    if setting.kind is Kind.BOOL:
        try:
            value = "true" if parse_go_bool(text) else "false"
        except ValueError:
            raise NvidiaFlagError(
                f"{name}: {text!r} is not a boolean; use true or false (Go's 1, t, T, TRUE, True, 0, f, F, FALSE, "
                "False work too)"
            ) from None
    elif setting.kind is Kind.TEXTS:
        value = ",".join(part.strip() for part in text.split(",") if part.strip())
    elif setting.kind is Kind.INTS:
        value = _ints(setting, name, text)
    elif setting.choices and text not in setting.choices:
        usable = setting.honoured if setting.honoured is not None else setting.choices
        raise NvidiaFlagError(f"{name}: {setting.invalid.format(value=text)}; use {_alternatives(usable)}")
    if setting.honoured is not None and value and value not in setting.honoured:
        why, what = setting.refusal
        raise NvidiaFlagError(f"{name}: {why.format(value=value)}; {what}")
    return value


_MAX_INT_TEXT = 70  # the longest int64 in Go's base-0 syntax: 0b and 63 binary digits, a sign


def _ints(setting: NvidiaSetting, name: str, text: str) -> str:
    """urfave/cli's IntSlice, then NVIDIA's IMEX rule: ``[]`` or ``[0]``. The result is "" or "0"."""
    ids: list[int] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        shown = repr(part) if len(part) <= _MAX_INT_TEXT else f"{part[:_MAX_INT_TEXT]!r}..."
        out_of_range = f"{name}: {shown} is out of range (Go reads a 64-bit integer); give channel IDs such as 0"
        if len(part) > _MAX_INT_TEXT:  # before int(): thousands of digits are refused by Python, or slow
            raise NvidiaFlagError(out_of_range)
        try:
            value = int(part, 10) if part.lstrip("+-").isdigit() else int(part, 0)
        except ValueError:
            raise NvidiaFlagError(f"{name}: {shown} is not an integer; give channel IDs such as 0") from None
        if not -(1 << 63) <= value < 1 << 63:
            raise NvidiaFlagError(out_of_range)
        ids.append(value)
    if ids not in ([], [0]):
        found = "[" + " ".join(str(i) for i in ids) + "]"  # as Go prints a slice
        raise NvidiaFlagError(f"{name}: {setting.invalid.format(value=found)}; remove it")
    return ",".join(str(i) for i in ids)


def _alternatives(values: Sequence[str]) -> str:
    return values[0] if len(values) == 1 else ", ".join(values[:-1]) + " or " + values[-1]


# The config file's `flags` that name one of the settings above (NVIDIA's config keys -> its flag).
CONFIG_FLAGS: dict[str, str] = {
    "flags.nvidiaDriverRoot": "--nvidia-driver-root",
    "flags.nvidiaDevRoot": "--nvidia-dev-root",
    "flags.gdrcopyEnabled": "--gdrcopy-enabled",
    "flags.gdsEnabled": "--gds-enabled",
    "flags.mofedEnabled": "--mofed-enabled",
    "flags.deviceDiscoveryStrategy": "--device-discovery-strategy",
    "flags.plugin.passDeviceSpecs": "--pass-device-specs",
    "flags.plugin.deviceIDStrategy": "--device-id-strategy",
    "flags.plugin.cdiAnnotationPrefix": "--cdi-annotation-prefix",
    "flags.plugin.nvidiaCTKPath": "--nvidia-ctk-path",
    "flags.plugin.containerDriverRoot": "--container-driver-root",
}


# The config's flags that say where the driver is: read by Tessera from its command line only (NVIDIA's defaults)
CONFIG_DRIVER_FLAGS = {
    "flags.nvidiaDriverRoot": "/",
    "flags.nvidiaDevRoot": "/",
    "flags.plugin.nvidiaCTKPath": "/usr/bin/nvidia-ctk",
    "flags.plugin.containerDriverRoot": "/driver-root",
}


def config_flag_warnings(values: Mapping[str, object]) -> list[str]:
    """What a config's ``flags`` ask for that Tessera does not do, one warning each (``values``: config key
    path -> the value the config gives, None when absent). A config is shared by many nodes and reloaded
    while they serve, so these are warnings that keep the config, where the same setting on the command line
    is refused before anything starts."""
    by_flag = {flag: setting for setting in SETTINGS for flag in setting.flags}
    warnings = []
    for key, nvidia_default in CONFIG_DRIVER_FLAGS.items():
        value = values.get(key)
        if value not in (None, "", nvidia_default):
            warnings.append(
                f"{key}: Tessera takes where the driver is from its command line only; give {CONFIG_FLAGS[key]} "
                "(or its variable) to the agent instead; the setting is ignored"
            )
    for key, flag in CONFIG_FLAGS.items():
        value = values.get(key)
        setting = by_flag.get(flag)
        if value is None or setting is None or setting.honoured is None:
            continue
        text = ("true" if value else "false") if isinstance(value, bool) else str(value)
        if text and text not in setting.honoured:
            why, what = setting.refusal
            warnings.append(f"{key}: {why.format(value=text)}; {what}; the setting is ignored")
    return warnings
