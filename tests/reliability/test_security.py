"""Scenario 8: security checks — file modes, no shell in the source, hostile config values and MPS commands."""

from __future__ import annotations

import re
import stat
from pathlib import Path

import pytest
import yaml

from agent.config.effective import FlagOverrides, effective
from agent.config.model import ConfigError, parse_config
from agent.core.plan import plan
from agent.core.resources import PlanError
from agent.gpu.discovery import discover
from agent.mps.control import pinned_limit_command, thread_percentage_command
from agent.sim.nvml.install import simulated_node
from agent.sim.nvml.spec import parse_node_spec

from .nodes import MPS_CONFIG, MPS_NODE, MPS_RESOURCES

SOURCE = Path(__file__).resolve().parents[2] / "agent"
UUID = "GPU-bc96c7c8-d7b3-583e-a64d-1eae8e57ba4e"


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_sockets_and_mps_directories_have_tight_modes(make_node, figures) -> None:
    node = make_node(MPS_NODE, MPS_CONFIG)
    node.wait_registered(MPS_RESOURCES)
    resource_dir = node.mps_root / "nvidia.com/gpu"
    modes = {
        "plugin socket": _mode(node.plugin_dir / "nvidia-gpu.sock"),
        "sim control socket": _mode(node.control_socket),
        "MPS pipe dir": _mode(resource_dir / "pipe"),
        "MPS log dir": _mode(resource_dir / "log"),
    }
    figures.update({k: oct(v) for k, v in modes.items()})
    assert modes == {"plugin socket": 0o600, "sim control socket": 0o600, "MPS pipe dir": 0o755, "MPS log dir": 0o700}


def test_no_shell_in_the_source_tree(figures) -> None:
    pattern = re.compile(r"shell\s*=\s*True|os\.system\s*\(|os\.popen\s*\(")
    hits = [
        f"{path.relative_to(SOURCE.parent)}:{n}"
        for path in sorted(SOURCE.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    figures.update(files_scanned=len(list(SOURCE.rglob("*.py"))), hits=hits)
    assert not hits


def _entry(**fields: object) -> dict:
    return {"version": "v1", "sharing": {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", **fields}]}}}


def _mps(**fields: object) -> dict:
    return {"version": "v1", "sharing": {"mps": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2, **fields}]}}}


HOSTILE = {
    "replicas 10**9": (_entry(replicas=10**9), "replicas"),
    "memoryLimit 10**30": (_mps(memoryLimit=10**30), "memoryLimit"),
    "memoryLimit 10**30 Mi": (_mps(memoryLimit=f"{10**30}Mi"), "memoryLimit"),
    "name with newline": (_entry(name="nvidia.com/gpu\nquit", replicas=2), "name"),
    "rename with newline": (_entry(rename="shared\nquit", replicas=2), "rename"),
    "name with ..": (_entry(name="nvidia.com/../gpu", replicas=2), "name"),
    "mpsRoot with ..": ({"version": "v1", "flags": {"mpsRoot": "/run/../etc"}}, "mpsRoot"),
    "mpsRoot relative": ({"version": "v1", "flags": {"mpsRoot": "run/mps"}}, "mpsRoot"),
    "mpsRoot newline": ({"version": "v1", "flags": {"mpsRoot": "/run/mps\n/etc"}}, "mpsRoot"),
    "nvidiaDriverRoot with ..": ({"version": "v1", "flags": {"nvidiaDriverRoot": "/../../etc"}}, "nvidiaDriverRoot"),
    "activeThreadPercentage 10**9": (_mps(activeThreadPercentage=10**9), "activeThreadPercentage"),
    # an index is a well-formed number at parse; one past the node's GPUs is refused when planned (PlanError)
    "device index huge": (_entry(replicas=2, devices=[10**12]), f"devices[0]: '{10**12}' is not a nvidia.com/gpu"),
}


@pytest.fixture(scope="module")
def mps_node_inventory():
    """The inventory of the scenarios' two-GPU node, read through pynvml as the agent reads it."""
    with simulated_node(parse_node_spec(yaml.safe_load(MPS_NODE))):
        return discover()


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_config_values_are_rejected_naming_the_field(case: str, mps_node_inventory, figures) -> None:
    """Refused at parse (ConfigError) or, for what only the node can judge, when planned (PlanError): either way
    the message names the field; a value that parses and plans is a failure."""
    document, field = HOSTILE[case]
    try:
        model, _ = parse_config(document, "hostile")
        plan(effective(model, FlagOverrides()).plan, mps_node_inventory)
    except (ConfigError, PlanError) as error:
        figures.update(rejected=f"{type(error).__name__}: {error}")
        assert field in str(error), str(error)
        return
    pytest.fail(f"{case}: accepted and planned")


@pytest.mark.parametrize(
    "uuid, mib",
    [
        (f"{UUID}\nquit", 10),
        (f"{UUID} 1M\nquit", 10),
        (f"{UUID};quit", 10),
        ("../../etc/passwd", 10),
        ("", 10),
        (UUID, 0),
        (UUID, -1),
        (UUID, 10**30),
        (UUID, "10\nquit"),
        (UUID, True),
    ],
)
def test_pinned_limit_command_refuses_injection(uuid: str, mib: object) -> None:
    with pytest.raises(ValueError, match="refusing"):
        pinned_limit_command(uuid, mib)  # type: ignore[arg-type]


@pytest.mark.parametrize("percent", ["25\nquit", "25; quit", 0, 101, -1, 10**9, 25.5, True])
def test_thread_percentage_command_refuses_injection(percent: object) -> None:
    with pytest.raises(ValueError, match="refusing"):
        thread_percentage_command(percent)  # type: ignore[arg-type]


def test_commands_for_good_values() -> None:
    assert pinned_limit_command(UUID, 10240) == f"set_default_device_pinned_mem_limit {UUID} 10240M"
    assert thread_percentage_command(25) == "set_default_active_thread_percentage 25"
