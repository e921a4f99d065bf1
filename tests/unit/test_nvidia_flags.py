"""NVIDIA's device-plugin flags and variables under ``tessera run``: each one honoured or refused, never ignored.

The options are built as ``tessera run`` builds them (``agent.run.build_options`` on the parsed command line
and an environment); no agent is started.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.cli import _parser
from agent.config.effective import effective
from agent.config.source import load_config, read_config_set
from agent.core.allocation import DeviceListStrategy
from agent.core.resources import MigStrategy
from agent.nvidia_flags import SETTINGS, parse_go_bool
from agent.run import OptionsError, RunOptions, build_options


@pytest.fixture(autouse=True)
def _no_tessera_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parser reads TESSERA_* when it is built: none from the developer's shell."""
    for name in list(os.environ):
        if name.startswith("TESSERA_"):
            monkeypatch.delenv(name)


def options(*argv: str, **environ: str) -> RunOptions:
    return build_options(_parser().parse_args(["run", *argv]), environ)


def refusal(*argv: str, **environ: str) -> str:
    with pytest.raises(OptionsError) as caught:
        options(*argv, **environ)
    message = str(caught.value)
    assert "\n" not in message
    return message


Get = Callable[[RunOptions], object]
mig: Get = lambda o: o.overrides.mig_strategy  # noqa: E731
strategies: Get = lambda o: o.overrides.device_list_strategy  # noqa: E731
policy: Get = lambda o: o.overrides.allocation_policy  # noqa: E731
mps_root: Get = lambda o: o.overrides.mps_root  # noqa: E731
config: Get = lambda o: o.config_path  # noqa: E731
plugin_dir: Get = lambda o: o.device_plugin_dir  # noqa: E731
fail: Get = lambda o: o.fail_on_init_error  # noqa: E731

K0S = "/var/lib/k0s/kubelet/device-plugins"
RUN_DRIVER = "/run/nvidia/driver"
HOOK = "/usr/local/nvidia/toolkit/nvidia-cdi-hook"
DRIVER_ROOT = Path("/driver-root")


def driver(name: str) -> Get:
    return lambda o: getattr(o.driver_root, name)


# (the NVIDIA name given, argv, environment, what changes, to what)
HONOURED: list[tuple[str, list[str], dict[str, str], Get, object]] = [
    ("--mig-strategy", ["--mig-strategy", "mixed"], {}, mig, "mixed"),
    ("MIG_STRATEGY", [], {"MIG_STRATEGY": "single"}, mig, "single"),
    ("--device-list-strategy", ["--device-list-strategy", "envvar,cdi-cri"], {}, strategies, ("envvar", "cdi-cri")),
    (
        "--device-list-strategy",  # urfave/cli's StringSlice: the flag may repeat
        ["--device-list-strategy", "volume-mounts", "--device-list-strategy", "cdi-annotations"],
        {},
        strategies,
        ("volume-mounts", "cdi-annotations"),
    ),
    ("DEVICE_LIST_STRATEGY", [], {"DEVICE_LIST_STRATEGY": "envvar, cdi-cri"}, strategies, ("envvar", "cdi-cri")),
    ("--shared-devices-allocation-policy", ["--shared-devices-allocation-policy", "packed"], {}, policy, "packed"),
    ("SHARED_DEVICES_ALLOCATION_POLICY", [], {"SHARED_DEVICES_ALLOCATION_POLICY": "packed"}, policy, "packed"),
    ("--mps-root", ["--mps-root", "/run/mps"], {}, mps_root, "/run/mps"),
    ("MPS_ROOT", [], {"MPS_ROOT": "/run/mps"}, mps_root, "/run/mps"),
    ("--config-file", ["--config-file", "/config/config.yaml"], {}, config, Path("/config/config.yaml")),
    ("CONFIG_FILE", [], {"CONFIG_FILE": "/config/config.yaml"}, config, Path("/config/config.yaml")),
    ("--kubelet-socket", ["--kubelet-socket", f"{K0S}/kubelet.sock"], {}, plugin_dir, Path(K0S)),
    ("KUBELET_SOCKET", [], {"KUBELET_SOCKET": f"{K0S}/kubelet.sock"}, plugin_dir, Path(K0S)),
    ("--fail-on-init-error", ["--fail-on-init-error"], {}, fail, True),
    ("--fail-on-init-error", ["--fail-on-init-error=T"], {}, fail, True),
    ("--fail-on-init-error", ["--fail-on-init-error", "0"], {}, fail, False),
    ("FAIL_ON_INIT_ERROR", [], {"FAIL_ON_INIT_ERROR": "TRUE"}, fail, True),
    ("FAIL_ON_INIT_ERROR", [], {"FAIL_ON_INIT_ERROR": "f"}, fail, False),
    # where the driver is, for the CDI specs Tessera writes (agent.gpu.driver_root)
    ("--driver-root", ["--driver-root", "/run/nvidia/driver"], {}, driver("root"), Path("/run/nvidia/driver")),
    ("--nvidia-driver-root", ["--nvidia-driver-root=/run/nvidia/driver"], {}, driver("root"), Path(RUN_DRIVER)),
    ("NVIDIA_DRIVER_ROOT", [], {"NVIDIA_DRIVER_ROOT": RUN_DRIVER}, driver("root"), Path(RUN_DRIVER)),
    ("--dev-root", ["--dev-root", "/"], {}, driver("dev_root"), Path("/")),
    ("--nvidia-dev-root", ["--nvidia-dev-root", RUN_DRIVER], {}, driver("dev_root"), Path(RUN_DRIVER)),
    ("NVIDIA_DEV_ROOT", [], {"NVIDIA_DEV_ROOT": RUN_DRIVER}, driver("dev_root"), Path(RUN_DRIVER)),
    ("--nvidia-cdi-hook-path", ["--nvidia-cdi-hook-path", HOOK], {}, driver("hook_path"), HOOK),
    ("--nvidia-ctk-path", ["--nvidia-ctk-path", "/usr/bin/nvidia-ctk"], {}, driver("hook_path"), "/usr/bin/nvidia-ctk"),
    ("NVIDIA_CDI_HOOK_PATH", [], {"NVIDIA_CDI_HOOK_PATH": HOOK}, driver("hook_path"), HOOK),
    ("NVIDIA_CTK_PATH", [], {"NVIDIA_CTK_PATH": HOOK}, driver("hook_path"), HOOK),
    ("--driver-root-ctr-path", ["--driver-root-ctr-path", "/driver-root"], {}, driver("container_root"), DRIVER_ROOT),
    ("--container-driver-root", ["--container-driver-root", "/driver-root"], {}, driver("container_root"), DRIVER_ROOT),
    ("DRIVER_ROOT_CTR_PATH", [], {"DRIVER_ROOT_CTR_PATH": "/driver-root"}, driver("container_root"), DRIVER_ROOT),
    ("CONTAINER_DRIVER_ROOT", [], {"CONTAINER_DRIVER_ROOT": "/driver-root"}, driver("container_root"), DRIVER_ROOT),
]

# Accepted at the value that asks for what Tessera always does: the options are exactly the defaults.
AT_DEFAULT: list[tuple[str, list[str], dict[str, str]]] = [
    ("--driver-root", ["--driver-root", "/"], {}),
    ("--nvidia-driver-root", ["--nvidia-driver-root=/"], {}),
    ("NVIDIA_DRIVER_ROOT", [], {"NVIDIA_DRIVER_ROOT": "/"}),
    ("--pass-device-specs", ["--pass-device-specs=false"], {}),
    ("PASS_DEVICE_SPECS", [], {"PASS_DEVICE_SPECS": "0"}),
    ("--device-id-strategy", ["--device-id-strategy", "uuid"], {}),
    ("DEVICE_ID_STRATEGY", [], {"DEVICE_ID_STRATEGY": "uuid"}),
    ("--gdrcopy-enabled", ["--gdrcopy-enabled=f"], {}),
    ("GDRCOPY_ENABLED", [], {"GDRCOPY_ENABLED": "false"}),
    ("--gds-enabled", ["--gds-enabled", "False"], {}),
    ("GDS_ENABLED", [], {"GDS_ENABLED": "F"}),
    ("--mofed-enabled", ["--mofed-enabled=FALSE"], {}),
    ("MOFED_ENABLED", [], {"MOFED_ENABLED": "0"}),
    ("--device-discovery-strategy", ["--device-discovery-strategy", "nvml"], {}),
    ("DEVICE_DISCOVERY_STRATEGY", [], {"DEVICE_DISCOVERY_STRATEGY": "auto"}),
    ("--cdi-annotation-prefix", ["--cdi-annotation-prefix", "cdi.k8s.io/"], {}),
    ("CDI_ANNOTATION_PREFIX", [], {"CDI_ANNOTATION_PREFIX": "cdi.k8s.io/"}),
    ("--cdi-feature-flags", ["--cdi-feature-flags="], {}),
    ("CDI_FEATURE_FLAGS", [], {"CDI_FEATURE_FLAGS": ""}),
    ("--cdi-disable-hooks", ["--cdi-disable-hooks="], {}),
    ("CDI_DISABLE_HOOKS", [], {"CDI_DISABLE_HOOKS": ""}),
    ("--imex-channel-ids", ["--imex-channel-ids="], {}),
    ("IMEX_CHANNEL_IDS", [], {"IMEX_CHANNEL_IDS": ""}),
    ("--imex-required", ["--imex-required=false"], {}),
    ("IMEX_REQUIRED", [], {"IMEX_REQUIRED": "0"}),
    # the container runtime's variables in NVIDIA's manifests: not plugin settings, not looked at
    ("runtime", [], {"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": "compute,utility"}),
    ("runtime", [], {"NVIDIA_MIG_MONITOR_DEVICES": "all", "NVIDIA_MIG_CONFIG_DEVICES": "all"}),
]

# (the NVIDIA name given, argv, environment, a word of what to do instead)
REFUSED: list[tuple[str, list[str], dict[str, str], str]] = [
    ("--pass-device-specs", ["--pass-device-specs"], {}, "cdi-cri"),
    ("PASS_DEVICE_SPECS", [], {"PASS_DEVICE_SPECS": "true"}, "cdi-cri"),
    ("--device-id-strategy", ["--device-id-strategy", "index"], {}, "uuid"),
    ("DEVICE_ID_STRATEGY", [], {"DEVICE_ID_STRATEGY": "index"}, "uuid"),
    ("--gdrcopy-enabled", ["--gdrcopy-enabled"], {}, "NVIDIA_GDRCOPY=enabled"),
    ("GDRCOPY_ENABLED", [], {"GDRCOPY_ENABLED": "1"}, "NVIDIA_GDRCOPY=enabled"),
    ("--gds-enabled", ["--gds-enabled=t"], {}, "NVIDIA_GDS=enabled"),
    ("GDS_ENABLED", [], {"GDS_ENABLED": "True"}, "NVIDIA_GDS=enabled"),
    ("--mofed-enabled", ["--mofed-enabled", "TRUE"], {}, "NVIDIA_MOFED=enabled"),
    ("MOFED_ENABLED", [], {"MOFED_ENABLED": "T"}, "NVIDIA_MOFED=enabled"),
    ("--device-discovery-strategy", ["--device-discovery-strategy", "tegra"], {}, "nvml"),
    ("DEVICE_DISCOVERY_STRATEGY", [], {"DEVICE_DISCOVERY_STRATEGY": "tegra"}, "nvml"),
    ("--cdi-annotation-prefix", ["--cdi-annotation-prefix", "nvidia.cdi.k8s.io/"], {}, "cdi-cri"),
    ("CDI_ANNOTATION_PREFIX", [], {"CDI_ANNOTATION_PREFIX": "nvidia.cdi.k8s.io/"}, "cdi-cri"),
    ("--cdi-feature-flags", ["--cdi-feature-flags", "disable-multiple-csv-devices"], {}, "remove it"),
    ("CDI_FEATURE_FLAGS", [], {"CDI_FEATURE_FLAGS": "disable-multiple-csv-devices"}, "remove it"),
    ("--cdi-disable-hooks", ["--cdi-disable-hooks", "all"], {}, "--node-wide-cdi"),
    ("CDI_DISABLE_HOOKS", [], {"CDI_DISABLE_HOOKS": "all"}, "--node-wide-cdi"),
    ("--imex-channel-ids", ["--imex-channel-ids", "0"], {}, "DRA driver"),
    ("IMEX_CHANNEL_IDS", [], {"IMEX_CHANNEL_IDS": "0"}, "DRA driver"),
    ("--imex-required", ["--imex-required"], {}, "DRA driver"),
    ("IMEX_REQUIRED", [], {"IMEX_REQUIRED": "true"}, "DRA driver"),
    ("--kubelet-socket", ["--kubelet-socket", "/run/kubelet/kubelet.socket"], {}, "--device-plugin-dir"),
    ("--kubelet-socket", ["--kubelet-socket="], {}, "kubelet.sock"),  # NVIDIA: empty = never register
    ("KUBELET_SOCKET", [], {"KUBELET_SOCKET": ""}, "kubelet.sock"),
    ("KUBELET_SOCKET", [], {"KUBELET_SOCKET": "kubelet.sock"}, "--device-plugin-dir"),  # relative
]

# Values NVIDIA's plugin itself rejects (Go's ParseBool, case-sensitive enumerations, IMEX's [] or [0]).
INVALID: list[tuple[str, list[str], dict[str, str], str]] = [
    ("--fail-on-init-error", ["--fail-on-init-error=maybe"], {}, "not a boolean"),
    ("FAIL_ON_INIT_ERROR", [], {"FAIL_ON_INIT_ERROR": "yes"}, "not a boolean"),  # YAML's, not Go's
    ("PASS_DEVICE_SPECS", [], {"PASS_DEVICE_SPECS": "on"}, "not a boolean"),
    ("--imex-required", ["--imex-required=tRue"], {}, "not a boolean"),
    ("MIG_STRATEGY", [], {"MIG_STRATEGY": "Mixed"}, "unknown MIG strategy: Mixed"),
    ("DEVICE_LIST_STRATEGY", [], {"DEVICE_LIST_STRATEGY": "envvar,cdi"}, "cdi is not valid"),
    ("SHARED_DEVICES_ALLOCATION_POLICY", [], {"SHARED_DEVICES_ALLOCATION_POLICY": "Packed"}, "Packed"),
    ("DEVICE_ID_STRATEGY", [], {"DEVICE_ID_STRATEGY": "UUID"}, "invalid --device-id-strategy option: UUID"),
    ("--device-discovery-strategy", ["--device-discovery-strategy", "vfio"], {}, "option vfio"),  # GFD's only
    ("DEVICE_DISCOVERY_STRATEGY", [], {"DEVICE_DISCOVERY_STRATEGY": "NVML"}, "option NVML"),
    ("--imex-channel-ids", ["--imex-channel-ids", "1"], {}, "channelIDs must be [] or [0]; found [1]"),
    ("IMEX_CHANNEL_IDS", [], {"IMEX_CHANNEL_IDS": "0,0"}, "found [0 0]"),
    ("IMEX_CHANNEL_IDS", [], {"IMEX_CHANNEL_IDS": "zero"}, "not an integer"),
]


def _ids(cases: list) -> list[str]:
    return [case[0] for case in cases]


@pytest.mark.parametrize(("name", "argv", "environ", "get", "expected"), HONOURED, ids=_ids(HONOURED))
def test_an_honoured_nvidia_setting_changes_the_options(name, argv, environ, get, expected):
    assert get(options()) != expected or name.startswith(("FAIL", "--fail"))  # the default is not the answer
    assert get(options(*argv, **environ)) == expected


@pytest.mark.parametrize(("name", "argv", "environ"), AT_DEFAULT, ids=_ids(AT_DEFAULT))
def test_nvidias_default_value_is_accepted_and_changes_nothing(name, argv, environ):
    assert options(*argv, **environ) == options()


@pytest.mark.parametrize(("name", "argv", "environ", "instead"), REFUSED, ids=_ids(REFUSED))
def test_a_value_tessera_cannot_honour_is_refused_naming_it(name, argv, environ, instead):
    message = refusal(*argv, **environ)
    assert message.startswith(f"{name}: ")
    why, _, what = message.partition("; ")
    assert why and instead in what, message


@pytest.mark.parametrize(("name", "argv", "environ", "said"), INVALID, ids=_ids(INVALID))
def test_a_value_nvidia_would_reject_is_rejected_naming_it(name, argv, environ, said):
    message = refusal(*argv, **environ)
    assert message.startswith(f"{name}: ") and said in message, message


def test_every_nvidia_flag_and_variable_is_covered_here_and_in_the_help():
    names = {n for setting in SETTINGS for n in (*setting.flags, *setting.envs)}
    tested = set(_ids(HONOURED)) | set(_ids(AT_DEFAULT)) | set(_ids(REFUSED)) | set(_ids(INVALID))
    assert names - tested == set()
    subcommands = next(a for a in _parser()._actions if a.dest == "command")
    help_text = subcommands.choices["run"].format_help()
    assert [n for n in sorted(names) if n not in help_text] == []
    assert "DP_DISABLE_HEALTHCHECKS" in help_text  # NVIDIA's health variables, honoured since before


@pytest.mark.parametrize("text", ["1", "t", "T", "TRUE", "true", "True"])
def test_go_true(text):
    assert parse_go_bool(text) is True


@pytest.mark.parametrize("text", ["0", "f", "F", "FALSE", "false", "False"])
def test_go_false(text):
    assert parse_go_bool(text) is False


@pytest.mark.parametrize("text", ["", "yes", "no", "on", "off", "tRUE", "2", " true"])
def test_not_go_booleans(text):
    with pytest.raises(ValueError):
        parse_go_bool(text)


# ----- precedence: a flag, then the variable(s), then the config file, then the default -----------------


def test_a_flag_wins_over_tessera_variable_which_wins_over_nvidias(monkeypatch, caplog):
    assert options(MIG_STRATEGY="mixed").overrides.mig_strategy == "mixed"
    monkeypatch.setenv("TESSERA_MIG_STRATEGY", "single")
    with caplog.at_level(logging.WARNING, logger="agent.run"):
        assert options(MIG_STRATEGY="mixed").overrides.mig_strategy == "single"
    assert "MIG_STRATEGY='mixed' is ignored" in caplog.text
    assert options("--mig-strategy", "none", MIG_STRATEGY="mixed").overrides.mig_strategy == "none"


def test_the_same_value_under_both_names_is_no_conflict(monkeypatch, caplog):
    monkeypatch.setenv("TESSERA_MPS_ROOT", "/run/nvidia/mps")  # Tessera's DaemonSet plus NVIDIA's chart
    monkeypatch.setenv("TESSERA_DEVICE_PLUGIN_DIR", "/var/lib/kubelet/device-plugins")
    with caplog.at_level(logging.WARNING, logger="agent.run"):
        options(MPS_ROOT="/run/nvidia/mps", KUBELET_SOCKET="/var/lib/kubelet/device-plugins/kubelet.sock")
    assert "ignored" not in caplog.text


def test_the_kubelet_socket_and_the_plugin_directory_are_one_setting(monkeypatch):
    socket = f"{K0S}/kubelet.sock"
    assert options("--device-plugin-dir", "/a", "--kubelet-socket", socket).device_plugin_dir == Path(K0S)
    assert options("--kubelet-socket", socket, "--device-plugin-dir", "/a").device_plugin_dir == Path("/a")
    kubelet = "/var/lib/kubelet/device-plugins"  # given explicitly, even at its default value, it wins
    assert options("--device-plugin-dir", kubelet, KUBELET_SOCKET=socket).device_plugin_dir == Path(kubelet)
    monkeypatch.setenv("TESSERA_DEVICE_PLUGIN_DIR", "/b")
    assert options(KUBELET_SOCKET=socket).device_plugin_dir == Path("/b")
    assert options("--kubelet-socket", socket).device_plugin_dir == Path(K0S)  # a flag beats any variable


def test_config_is_nvidias_config_file(monkeypatch):
    assert options("--config", "/a.yaml", CONFIG_FILE="/config/config.yaml").config_path == Path("/a.yaml")
    monkeypatch.setenv("TESSERA_CONFIG", "/b")
    assert options(CONFIG_FILE="/config/config.yaml").config_path == Path("/b")
    assert options("--config-file", "/c.yaml").config_path == Path("/c.yaml")


def test_nvidias_variables_are_read_in_nvidias_order():
    first, other = "/usr/bin/nvidia-ctk", "/opt/nvidia-cdi-hook"
    assert options(NVIDIA_CDI_HOOK_PATH=first, NVIDIA_CTK_PATH=other).driver_root.hook_path == first
    assert options(NVIDIA_CDI_HOOK_PATH="", NVIDIA_CTK_PATH=other).driver_root.hook_path == other
    given = options(DRIVER_ROOT_CTR_PATH="/driver-root", CONTAINER_DRIVER_ROOT="/host").driver_root
    assert given.container_root == Path("/driver-root")


def test_a_flag_wins_over_nvidias_own_variable():
    assert options("--pass-device-specs=false", PASS_DEVICE_SPECS="true") == options()
    assert options("--fail-on-init-error=false", FAIL_ON_INIT_ERROR="true").fail_on_init_error is False
    assert options("--device-id-strategy", "uuid", DEVICE_ID_STRATEGY="index") == options()


def test_an_empty_nvidia_variable_counts_as_unset():
    assert options(MIG_STRATEGY="", MPS_ROOT="", CONFIG_FILE="", FAIL_ON_INIT_ERROR="") == options()


def test_nvidias_variables_win_over_the_config_files_flags(tmp_path: Path):
    path = tmp_path / "config.yaml"
    path.write_text("version: v1\nflags:\n  migStrategy: mixed\n  plugin:\n    deviceListStrategy: cdi-cri\n")
    model = load_config(read_config_set(path)).model

    from_file = effective(model, options("--config", str(path)).overrides)
    assert from_file.plan.mig_strategy is MigStrategy.MIXED
    assert from_file.allocation.strategies == (DeviceListStrategy.CDI_CRI,)

    built = options(CONFIG_FILE=str(path), MIG_STRATEGY="none", DEVICE_LIST_STRATEGY="envvar")
    assert built.config_path == path
    from_env = effective(model, built.overrides)
    assert from_env.plan.mig_strategy is MigStrategy.NONE
    assert from_env.allocation.strategies == (DeviceListStrategy.ENVVAR,)


def test_fail_on_init_error_from_the_config_file_unless_the_flag_or_variable_says(tmp_path: Path):
    path = tmp_path / "config.yaml"
    path.write_text("version: v1\nflags:\n  failOnInitError: true\n")
    assert options("--config", str(path)).fail_on_init_error is True
    assert options("--config", str(path), "--fail-on-init-error=false").fail_on_init_error is False
    assert options("--config", str(path), FAIL_ON_INIT_ERROR="false").fail_on_init_error is False
    path.write_text("version: v1\nflags:\n  failOnInitError: false\n")
    assert options("--config", str(path), FAIL_ON_INIT_ERROR="true").fail_on_init_error is True
    assert options("--config", str(path)).fail_on_init_error is False
    path.write_text("version: v1\nflags: [not, a, mapping\n")  # broken: the agent names it; not fatal here
    assert options("--config", str(path)).fail_on_init_error is False
    assert options("--config", str(tmp_path)).fail_on_init_error is False  # a directory: chosen later


# ----- NVIDIA's own manifests ---------------------------------------------------------------------------


def test_the_environment_of_nvidias_helm_daemonset_starts_tessera():
    """The chart's device-plugin container (facts §10.2) with every chart override it turns into a variable."""
    chart = {
        "MPS_ROOT": "/run/nvidia/mps",
        "NVIDIA_VISIBLE_DEVICES": "all",
        "NVIDIA_DRIVER_CAPABILITIES": "compute,utility",
        "CONFIG_FILE": "/config/config.yaml",
        "NVIDIA_MIG_MONITOR_DEVICES": "all",
        "MIG_STRATEGY": "mixed",
        "FAIL_ON_INIT_ERROR": "false",
        "DEVICE_LIST_STRATEGY": "envvar",
        "DEVICE_ID_STRATEGY": "uuid",
        "NVIDIA_DRIVER_ROOT": "/",
        "GDRCOPY_ENABLED": "false",
        "GDS_ENABLED": "false",
        "MOFED_ENABLED": "false",
        "DEVICE_DISCOVERY_STRATEGY": "auto",
    }
    built = options(**chart)
    assert built.config_path == Path("/config/config.yaml")
    assert built.overrides.mig_strategy == "mixed"
    assert built.overrides.device_list_strategy == ("envvar",)
    assert built.overrides.mps_root == "/run/nvidia/mps"
    assert built.fail_on_init_error is False


def test_nvidias_cpu_manager_manifest_is_refused_with_the_way_out():
    """nvidia-device-plugin-compat-with-cpumanager.yml sets PASS_DEVICE_SPECS=true."""
    message = refusal(PASS_DEVICE_SPECS="true", NVIDIA_VISIBLE_DEVICES="all")
    assert message.startswith("PASS_DEVICE_SPECS: ") and "--device-list-strategy cdi-cri" in message


# ----- the documents ------------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]


def test_the_migration_guide_lists_every_nvidia_flag_and_variable():
    install = (ROOT / "docs" / "install.md").read_text(encoding="utf-8")
    section = install.split("### NVIDIA's flags and environment variables", 1)[1].split("\n## ", 1)[0]
    names = {n for setting in SETTINGS for n in (*setting.flags, *setting.envs)}
    assert [n for n in sorted(names) if f"`{n}`" not in section] == []


def test_the_readme_lists_nvidias_names_that_tessera_run_honours():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme.split("### `tessera run`", 1)[1].split("\n\n", 2)[1]
    assert table.startswith("| flag |") and "`--log-level`" in table
    honoured = {n for s in SETTINGS if s.honoured is None for n in (*s.flags, *s.envs)}
    assert [n for n in sorted(honoured) if f"`{n}`" not in table] == []


def test_a_configs_flags_that_tessera_does_not_honour_are_warnings_that_keep_the_config():
    """The same settings in a config's `flags` keep the config (it is shared and reloaded while nodes serve)
    and say, each once, why the setting is ignored."""
    from agent.config.source import parse_document

    text = (
        "version: v1\nflags:\n  migStrategy: mixed\n  gdsEnabled: true\n  nvidiaDevRoot: /\n"
        "  plugin:\n    passDeviceSpecs: false\n    deviceIDStrategy: index\n    containerDriverRoot: /driver-root\n"
    )
    model, warnings = parse_document(text, "cm/default")
    assert model.flags.mig_strategy == "mixed"
    flagged = sorted(w.split(": ")[1] for w in warnings)
    assert flagged == ["flags.gdsEnabled", "flags.plugin.deviceIDStrategy"]
    assert all(w.startswith("cm/default: ") and w.endswith("the setting is ignored") for w in warnings)


def test_a_configs_driver_root_is_a_warning_naming_the_flag_that_sets_it():
    """Where the driver is comes from the agent's command line (each node's own); a shared config's value is
    said and ignored, NVIDIA's defaults pass in silence."""
    from agent.config.source import parse_document

    text = (
        "version: v1\nflags:\n  nvidiaDriverRoot: /run/nvidia/driver\n  nvidiaDevRoot: /\n"
        "  plugin:\n    nvidiaCTKPath: /usr/bin/nvidia-ctk\n    containerDriverRoot: /driver-root\n"
    )
    _, warnings = parse_document(text, "cm/default")
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("cm/default: flags.nvidiaDriverRoot: ") and "--nvidia-driver-root" in warnings[0]
