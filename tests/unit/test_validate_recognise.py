"""What is not a sharing config is refused for what it is; a resource no GPU is ever advertised as is a warning.

NVIDIA's plugin reads any map as a config, ignoring keys it does not know: a Pod manifest, a mig-parted
layout file or a ConfigMap manifest given where a config belongs is silently every default. Tessera names
the document instead (the agent, ``tessera validate`` and ``tessera plan`` alike: it is in parse_config).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from agent.config.model import ConfigError
from agent.config.schema import NotASharingConfig, foreign_document
from agent.config.source import parse_document
from agent.config.validate import resource_name_warnings

ROOT = Path(__file__).resolve().parents[2]

FOREIGN = {
    "pod": (
        {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "cuda"}, "spec": {"containers": []}},
        "a Kubernetes Pod 'cuda' manifest (v1), not a sharing config",
    ),
    "deployment": (
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"}},
        "a Kubernetes Deployment 'web' manifest (apps/v1), not a sharing config",
    ),
    "configmap": (
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "tessera-config"}, "data": {}},
        "a Kubernetes ConfigMap 'tessera-config' manifest, not a sharing config: its data keys are the configs",
    ),
    "mig-parted": (
        {"version": "v1", "mig-configs": {"all-disabled": [{"devices": "all", "mig-enabled": False}]}},
        "a MIG layout file (mig-parted's format: version and mig-configs), not a sharing config",
    ),
    "node-spec": (
        {"name": "n", "gpus": [{"model": "A100-SXM4-80GB", "count": 8}]},
        "a simulated node spec (gpus: [{model: ...}]), not a sharing config; give it to --node",
    ),
    "helm-values": (
        {"config": {"map": {"default": "version: v1\n"}, "default": "default"}, "gfd": {"enabled": True}},
        "the Helm values of NVIDIA's device-plugin chart, not a sharing config; the configs are the texts under "
        "config.map (keys: default)",
    ),
}


@pytest.mark.parametrize("kind", sorted(FOREIGN))
def test_a_foreign_document_is_named_for_what_it_is(kind: str):
    document, expected = FOREIGN[kind]
    assert foreign_document(document) is not None
    assert foreign_document(document).startswith(expected)  # type: ignore[union-attr]
    with pytest.raises(NotASharingConfig) as raised:
        parse_document(yaml.safe_dump(document), "x.yaml")
    assert raised.value.problems == [foreign_document(document)]
    assert isinstance(raised.value, ConfigError)  # the agent keeps its last good config, as for any bad config


@pytest.mark.parametrize(
    "document",
    [
        None,
        {},
        {"version": "v1"},
        {"version": "v1", "sharing": {"timeSlicing": {"resources": [{"name": "gpu", "replicas": 2}]}}},
        {"kind": "ConfigMap"},  # no apiVersion: a config with an unknown key (warned about)
        {"version": "v1", "flags": {}, "gpus": [{"model": "x"}]},  # a config with a misplaced key, not a spec
        {"version": "v1", "config": {"map": {}}, "sharing": {}},
        [{"version": "v1"}],  # not a map: pydantic says so, as before
    ],
)
def test_a_config_or_something_unrecognisable_is_left_to_the_schema(document: object):
    assert foreign_document(document) is None


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_no_shipped_config_is_taken_for_something_else(path: Path):
    assert foreign_document(yaml.safe_load(path.read_text())) is None


def test_the_mig_manager_layouts_file_is_recognised():
    path = ROOT / "daemonset" / "overlays" / "mig-manager" / "mig-layouts.yaml"
    assert "a MIG layout file" in (foreign_document(yaml.safe_load(path.read_text())) or "")


# ----- resource names no GPU would ever get -------------------------------------------------------------------


def warnings_for(text: str) -> list[str]:
    model, _ = parse_document(text, "c.yaml")
    return resource_name_warnings(model)


def sharing(name: str, extra: str = "") -> str:
    return f"version: v1\n{extra}sharing:\n  timeSlicing:\n    resources:\n    - name: {name}\n      replicas: 2\n"


@pytest.mark.parametrize(
    "name",
    [
        "nvidia.com/gpu",
        "gpu",  # NVIDIA's rule: nvidia.com/ is prefixed
        "nvidia.com/mig-1g.10gb",
        "nvidia.com/mig-1g.5gb",  # A100 40GB
        "nvidia.com/mig-1g.10gb.me",  # 1g.10gb+me: '+' is written '.'
        "nvidia.com/mig-3g.71gb",  # H200
    ],
)
def test_names_a_device_can_have_give_no_warning(name: str):
    assert warnings_for(sharing(name)) == []


def test_a_misspelt_gpu_resource_is_a_warning_with_the_name_meant():
    (warning,) = warnings_for(sharing("nvidia.com/gpuu"))
    assert warning.startswith("sharing.timeSlicing.resources[0].name: no GPU is ever advertised as nvidia.com/gpuu")
    assert "so this entry shares nothing" in warning
    assert warning.endswith("did you mean nvidia.com/gpu?")


def test_a_profile_no_gpu_model_has_is_a_warning():
    (warning,) = warnings_for(sharing("nvidia.com/mig-1g.11gb"))
    assert "no GPU is ever advertised as nvidia.com/mig-1g.11gb" in warning
    assert "; did you mean nvidia.com/mig-1g." in warning  # a 1g profile some model has


def test_a_name_the_config_s_own_rules_give_is_valid():
    rules = "resources:\n  gpus:\n  - {pattern: '*A100*', name: nvidia.com/a100}\n"
    assert warnings_for(sharing("nvidia.com/a100", rules)) == []
    (warning,) = warnings_for(sharing("nvidia.com/a10", rules))
    assert "or a name this config's resources rules give (nvidia.com/a100)" in warning
    assert warning.endswith("did you mean nvidia.com/a100?")


@pytest.mark.parametrize(("strategy", "instead"), [("none", "not advertised"), ("single", "are nvidia.com/gpu")])
def test_a_mig_name_with_a_strategy_that_never_advertises_it_is_a_warning(strategy: str, instead: str):
    (warning,) = warnings_for(sharing("nvidia.com/mig-1g.10gb", f"flags: {{migStrategy: {strategy}}}\n"))
    assert f"is advertised only with migStrategy mixed; this config sets migStrategy {strategy}" in warning
    assert instead in warning
    assert warnings_for(sharing("nvidia.com/mig-1g.10gb", "flags: {migStrategy: mixed}\n")) == []


def test_only_the_sharing_group_in_force_is_checked():
    text = (
        "version: v1\nsharing:\n  timeSlicing:\n    resources: [{name: nvidia.com/gpuu, replicas: 2}]\n"
        "  mps:\n    resources: [{name: nvidia.com/gpu, replicas: 2}]\n"
    )
    assert warnings_for(text) == []  # mps wins; timeSlicing is ignored (and warned about as such by the parser)


def test_every_entry_is_checked():
    text = (
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
        "    - {name: nvidia.com/gpu, replicas: 2, devices: [0]}\n"
        "    - {name: nvidia.com/gpux, replicas: 2, devices: [1]}\n"
    )
    (warning,) = warnings_for(text)
    assert warning.startswith("sharing.timeSlicing.resources[1].name:")
