"""What each command loads: only what its configured features need (issue 13, "Fast start").

Each check imports a command's modules in a fresh interpreter and looks at ``sys.modules``: which
modules are loaded, not how long they took, so it holds on a loaded machine. A module named here is one
that costs tens to hundreds of milliseconds at start (pydantic and the config schema it builds, the
Kubernetes client, prometheus_client, grpc) or belongs to another command.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from msgspec import NODEFAULT
from msgspec.structs import fields

from agent.config import model
from agent.config.model import ConfigModel, parse_config


def loaded_after(code: str) -> set[str]:
    """The modules loaded in a fresh interpreter after running ``code``."""
    script = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    return set(json.loads(result.stdout.splitlines()[-1]))


def packages(modules: set[str], *names: str) -> set[str]:
    """Which of ``names`` (packages or modules) are loaded, themselves or any module inside them."""
    return {name for name in names if any(m == name or m.startswith(name + ".") for m in modules)}


# `tessera run`: the entry point, the option parsing and the agent with everything it imports at module level
RUN_PATH = "import agent.cli, agent.run"


def test_run_loads_no_kubernetes_client_no_metrics_and_no_other_command():
    loaded = loaded_after(RUN_PATH)
    assert "agent.agent" in loaded  # the check sees the whole run path
    assert not packages(
        loaded,
        "kubernetes",  # only with a node name, for the node label (agent.config.node_label)
        "urllib3",
        "agent.config.node_label",
        "prometheus_client",  # never: telemetry has its own exposition writer
        "agent.telemetry.collector",
        "http.server",
        "agent.config.schema",  # only when a config document is parsed
        "agent.sim",  # only with --simulate
        "agent.demo",
        "agent.render",
        "agent.mig.commands",
        "agent.config.validate",
        "agent.mig",  # the MIG manager and layout planning: only once a MIG layout is configured
        "agent.core.mig_layout",
        "agent.core.mig_catalog",
        "agent.gpu.mig",
        "agent.mps",  # the MPS manager: only with the first MPS daemon (a resource or a DRA claim)
        "agent.core.drain",  # what MIG and MPS changes drain
        "agent.core.announce",  # Node Events: only with a Kubernetes API to send them to
        "google.protobuf",  # the device-plugin messages are written by agent.plugin.wire
        "agent.api",
    )


def test_run_without_a_config_loads_no_pydantic_and_no_yaml():
    assert not packages(loaded_after(RUN_PATH), "pydantic", "pydantic_core", "yaml")


def test_the_config_modules_load_no_yaml_until_a_config_is_read_and_no_pydantic_ever():
    code = (
        "import agent.config.model, agent.config.effective, agent.config.source, agent.config.labels\n"
        "from agent.config.effective import FlagOverrides, effective\n"
        "from agent.config.model import ConfigModel\n"
        "effective(ConfigModel(), FlagOverrides())"
    )
    assert not packages(loaded_after(code), "pydantic", "pydantic_core", "yaml", "agent.config.schema")
    parsed = loaded_after(code + "\nfrom agent.config.source import parse_document\nparse_document('{}', 'x')")
    # the config checker's whole work (on a start's path): YAML and the walk of agent.config.schema, no pydantic
    assert packages(parsed, "pydantic", "pydantic_core", "yaml", "agent.config.schema") == {
        "yaml",
        "agent.config.schema",
    }


@pytest.mark.parametrize(
    ("document", "table"), [("version: v1\n", False), ("version: v1\nflags: {gdsEnabled: true}\n", True)]
)
def test_the_checker_loads_the_nvidia_flag_table_only_for_a_config_that_gives_flags(document: str, table: bool):
    """Most configs give no ``flags``; their check (on the start's path) does not load the table of NVIDIA's flags
    and the command line's parser it is written with, which only a given flag needs (to warn of it)."""
    loaded = loaded_after(f"from agent.config.source import parse_document\nparse_document({document!r}, 'x')")
    assert ("agent.nvidia_flags" in loaded) is table


def test_a_simulated_run_loads_no_pydantic_and_no_drain_machinery():
    """``tessera run --simulate``: the node spec is read without pydantic, and the PodResources stubs that
    drains use load with the first drain, not at start."""
    loaded = loaded_after(
        RUN_PATH + "\nfrom agent.sim.nvml.install import simulated_node\nsimulated_node('dgx-a100').__enter__()"
    )
    assert "agent.sim.nvml.driver" in loaded
    assert not packages(loaded, "pydantic", "pydantic_core", "agent.plugin.podresources")


def test_the_podresources_client_loads_protobuf_with_its_first_call_not_with_its_types():
    """Metrics import DeviceHolder at start; the stubs and protobuf load only once the kubelet is asked."""
    loaded = loaded_after("from agent.plugin.podresources import DeviceHolder, allocated_devices")
    assert not packages(loaded, "google.protobuf", "agent.api")


def test_the_telemetry_settings_load_no_metrics_library():
    code = "from agent.telemetry.service import TelemetrySettings\nfrom agent.telemetry.server import parse_address"
    assert not packages(loaded_after(code), "prometheus_client", "http.server", "grpc", "agent.telemetry.collector")


def test_metrics_load_no_yaml_parser():
    """Starting metrics (after the kubelet is served, on the reconcile loop) reads the kubelet's checkpoints as
    bytes: PyYAML (~12 ms) is not loaded for that."""
    code = (
        "from agent.telemetry.collector import TelemetryCollector\nfrom agent.telemetry.server import TelemetryServer"
    )
    loaded = loaded_after(code)
    assert "agent.telemetry.attribution" in loaded and "agent.telemetry.dra_claims" in loaded
    assert not packages(loaded, "yaml", "agent.config.yaml_limits")


OTHER_COMMANDS = {
    "validate": "agent.config.validate",
    "plan": "agent.backend, agent.gpu.discovery, agent.config.effective, agent.config.source, agent.render",
    "inventory": "agent.backend, agent.gpu.discovery, agent.render",
    "mig": "agent.backend, agent.mig.commands",
}


@pytest.mark.parametrize("command", sorted(OTHER_COMMANDS))
def test_other_commands_load_nothing_of_run(command: str):
    loaded = loaded_after(f"import agent.cli, {OTHER_COMMANDS[command]}")
    assert not packages(
        loaded, "agent.run", "agent.agent", "agent.plugin.server", "grpc", "prometheus_client", "kubernetes"
    )
    if command == "validate":
        assert not packages(loaded, "pynvml", "agent.gpu")


def test_the_cli_alone_loads_no_command():
    loaded = loaded_after("import agent.cli")
    assert not packages(loaded, "agent.run", "agent.agent", "agent.config", "grpc", "pydantic", "yaml", "pynvml")


# ----- the config is held in plain structs; agent.config.schema says how each field is written -------------


def test_every_config_struct_is_read_field_by_field_by_its_section():
    from agent.config import schema

    assert {s.__name__ for s in schema.SECTIONS} >= {"ConfigModel", "Flags", "ReplicatedResource", "HealthSection"}
    structs = {v for v in vars(model).values() if isinstance(v, type) and v.__module__ == model.__name__}
    assert structs == set(schema.SECTIONS)  # every struct of the config is read by a section of its own
    for struct, section in schema.SECTIONS.items():
        held = {f.name: f for f in fields(struct)}
        assert [k.field for k in section.keys] == list(held), struct.__name__
        for key in section.keys:
            no_default = held[key.field].default is NODEFAULT and held[key.field].default_factory is NODEFAULT
            assert key.required is no_default, (struct.__name__, key.field)
        assert len({k.alias.lower() for k in section.keys}) == len(section.keys), struct.__name__


def test_an_empty_document_is_the_default_config():
    parsed, warnings = parse_config({})
    assert parsed == ConfigModel()
    assert warnings == []


def test_a_parsed_config_is_held_in_the_dataclasses():
    parsed, _ = parse_config(
        {
            "flags": {"migStrategy": "mixed", "plugin": {"deviceListStrategy": "cdi-cri"}},
            "sharing": {"mps": {"resources": [{"name": "gpu", "replicas": 4, "memoryLimit": "10Gi"}]}},
            "health": {"xids": {"94": "ignore"}},
        }
    )
    assert type(parsed) is ConfigModel
    assert parsed.flags == model.Flags(mig_strategy="mixed", plugin=model.PluginFlags(device_list_strategy=["cdi-cri"]))
    assert parsed.replicated == (
        "mps",
        model.ReplicatedResources(
            resources=[model.ReplicatedResource(name="nvidia.com/gpu", replicas=4, memory_limit="10Gi")]
        ),
    )
    assert parsed.health is not None and set(parsed.health.overrides()) == {94}


def test_the_source_limit_is_the_yaml_limit():
    from agent.config.bounded import MAX_BYTES
    from agent.config.source import MAX_CONFIG_BYTES

    assert MAX_CONFIG_BYTES == MAX_BYTES


def test_nothing_that_reports_on_the_agent_imports_the_agent():
    """Status, health endpoints, metrics and Events read the one published status (agent.status), never the
    Agent object: no module outside the shell (cli, run, the demos) imports agent.agent, not even for type hints."""
    import ast
    from pathlib import Path

    import agent

    root = Path(agent.__file__).parent
    shell = {"agent/agent.py", "agent/cli.py", "agent/run.py", "agent/demo.py", "agent/demo_dra.py"}
    importers = []
    for path in sorted(root.rglob("*.py")):
        name = f"agent/{path.relative_to(root)}"
        if name in shell or "/sim/" in name:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            from_agent = isinstance(node, ast.ImportFrom) and node.module == "agent.agent"
            if from_agent or (isinstance(node, ast.Import) and any(a.name == "agent.agent" for a in node.names)):
                importers.append(name)
    assert importers == []
