"""One resolver for config names, and the ConfigMap manifest reader (issue 14, "previews that tell the truth").

A name (``--config-name``, the node label) finds the config of that name, else the file with a ``.yaml``,
``.yml`` or ``.json`` suffix (a ConfigMap kept as local files), else the name without one. The running agent
warns and falls back when a name finds nothing; the previews (``strict_names``) refuse, naming what exists.
A ``kind: ConfigMap`` manifest file holds its data keys, as it would once mounted.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.config.model import ConfigError
from agent.config.source import (
    ConfigNameError,
    load_config,
    parse_member,
    read_config_set,
    resolve_name,
    select_config,
)
from agent.config.yaml_limits import YamlSyntaxError

A100 = "NVIDIA A100-SXM4-80GB"
TS4 = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 4}\n"
MPS2 = "version: v1\nsharing:\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2}\n"

MANIFEST = """\
apiVersion: v1
kind: ConfigMap
metadata:
  name: tessera-config
  namespace: kube-system
data:
  time-slicing-4: |
    version: v1
    sharing:
      timeSlicing:
        resources:
        - {name: nvidia.com/gpu, replicas: 4}
  broken: |
    version: v1
    sharing: [
  default: |
    version: v1
"""


def local_copy(tmp_path: Path) -> Path:
    """A ConfigMap's keys saved as files, as a user keeps them in git: the names keep their suffix."""
    root = tmp_path / "configs"
    root.mkdir()
    (root / "time-slicing-4.yaml").write_text(TS4)
    (root / "mps-2.yml").write_text(MPS2)
    (root / "..data").mkdir()  # kubelet bookkeeping: never a config
    return root


# ----- the resolver ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("wanted", "found"),
    [
        ("time-slicing-4", "time-slicing-4.yaml"),
        ("time-slicing-4.yaml", "time-slicing-4.yaml"),
        ("mps-2", "mps-2.yml"),
        ("plain", "plain"),
        ("plain.yaml", "plain"),  # a file name given for a ConfigMap key
        ("plain.json", "plain"),
        ("plain.txt", None),
        ("time-slicing", None),  # no prefix matching: a name is a whole name
        ("", None),
    ],
)
def test_resolve_name(wanted: str, found: str | None):
    assert resolve_name(["time-slicing-4.yaml", "mps-2.yml", "plain"], wanted) == found


def test_an_exact_name_wins_over_a_suffixed_one():
    assert resolve_name(["a", "a.yaml"], "a") == "a"
    assert resolve_name(["a", "a.yaml"], "a.yaml") == "a.yaml"


def test_the_agent_resolves_a_label_without_the_suffix_of_a_local_file(tmp_path: Path):
    """The running agent and the previews share the resolver: label time-slicing-4 finds time-slicing-4.yaml."""
    name, reason, warnings = select_config(read_config_set(local_copy(tmp_path)), None, "time-slicing-4", [A100])
    assert name == "time-slicing-4.yaml"
    assert reason == "node label nvidia.com/device-plugin.config=time-slicing-4"
    assert warnings == []


def test_the_agent_warns_and_falls_back_on_a_name_that_finds_nothing(tmp_path: Path):
    name, _, warnings = select_config(read_config_set(local_copy(tmp_path)), "nope", None, [A100])
    assert name is None
    assert any("--config-name names config 'nope'" in w and "falling back" in w for w in warnings)


@pytest.mark.parametrize(("requested", "label", "source"), [("nope", None, "--config-name"), (None, "nope", "label")])
def test_a_preview_refuses_a_name_that_finds_nothing_naming_what_exists(
    tmp_path: Path, requested: str | None, label: str | None, source: str
):
    with pytest.raises(ConfigNameError) as raised:
        select_config(read_config_set(local_copy(tmp_path)), requested, label, [A100], strict_names=True)
    message = str(raised.value)
    assert source in message
    assert "'nope' names no config here; it has: mps-2.yml, time-slicing-4.yaml" in message
    assert "the agent would warn and fall back: no config applies" in message
    assert isinstance(raised.value, ConfigError)  # every caller that handles config errors handles it


def test_load_config_passes_strict_names_through(tmp_path: Path):
    config_set = read_config_set(local_copy(tmp_path))
    with pytest.raises(ConfigNameError):
        load_config(config_set, label="nope", gpu_products=[A100], strict_names=True)
    assert load_config(config_set, label="mps-2", gpu_products=[A100], strict_names=True).name == "mps-2.yml"


def test_a_single_file_named_by_its_own_name_is_no_warning(tmp_path: Path):
    path = tmp_path / "time-slicing-4.yaml"
    path.write_text(TS4)
    config_set = read_config_set(path)
    for requested in ("time-slicing-4", "time-slicing-4.yaml"):
        name, _, warnings = select_config(config_set, requested, None, [A100], strict_names=True)
        assert (name, warnings) == ("time-slicing-4.yaml", [])
    name, _, warnings = select_config(config_set, "other", None, [A100])
    assert name == "time-slicing-4.yaml"
    assert warnings == [f"--config-name 'other' ignored: {path} is a single file"]
    with pytest.raises(ConfigNameError, match=r"this is a single file, its one config is time-slicing-4\.yaml"):
        select_config(config_set, "other", None, [A100], strict_names=True)


# ----- a ConfigMap manifest ---------------------------------------------------------------------------------


def test_a_configmap_manifest_holds_its_data_keys(tmp_path: Path):
    path = tmp_path / "cm.yaml"
    path.write_text(MANIFEST)
    config_set = read_config_set(path)
    assert config_set.manifest == "tessera-config"
    assert not config_set.is_directory
    assert config_set.named
    assert list(config_set.documents) == ["time-slicing-4", "broken", "default"]
    assert config_set.documents["default"] == "version: v1\n"
    assert config_set.origin_of("default") == f"{path} (data key default)"


def test_a_manifest_key_is_chosen_like_a_mounted_one(tmp_path: Path):
    path = tmp_path / "cm.yaml"
    path.write_text(MANIFEST)
    config_set = read_config_set(path)
    assert load_config(config_set, gpu_products=[A100]).name == "default"  # NVIDIA's `named` fallback
    chosen = load_config(config_set, requested="time-slicing-4.yaml", gpu_products=[A100], strict_names=True)
    assert chosen.name == "time-slicing-4"
    assert chosen.model.replicated is not None
    with pytest.raises(ConfigNameError, match="it has: time-slicing-4, broken, default"):
        load_config(config_set, requested="mps", gpu_products=[A100], strict_names=True)


def test_a_yaml_error_in_a_manifest_key_is_at_its_line_and_column_in_the_manifest(tmp_path: Path):
    path = tmp_path / "cm.yaml"
    path.write_text(MANIFEST)
    with pytest.raises(YamlSyntaxError) as raised:
        parse_member(read_config_set(path), "broken")
    error = raised.value
    lines = MANIFEST.splitlines()
    assert lines[error.line - 2].strip() == "sharing: ["  # the value ends there: the problem is just after it
    assert str(error).startswith(f"{path}:{error.line}:{error.column}: not valid YAML or JSON: ")
    assert str(error).endswith("(in data key broken)")
    assert error.excerpt[0] == f"  {error.line - 1} | {lines[error.line - 2]}"  # the manifest's own line
    assert error.excerpt[1].endswith("^")


def test_a_yaml_error_in_a_quoted_manifest_value_says_where_in_the_value(tmp_path: Path):
    path = tmp_path / "cm.yaml"
    path.write_text('apiVersion: v1\nkind: ConfigMap\ndata:\n  a: "version: v1\\nsharing: ["\n')
    with pytest.raises(ConfigError) as raised:
        parse_member(read_config_set(path), "a")
    assert str(raised.value).startswith(f"{path} (data key a): not valid YAML or JSON: ")
    assert str(raised.value).endswith("of the key's text")


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ("data:\n  a:\n    version: v1\n", "data key a: a map, not text; a ConfigMap's data values are strings"),
        ("data:\n  a: 4\n", "data key a: a number, not text"),
        ("data: [a, b]\n", "data is a list, not a map of keys to texts"),
    ],
)
def test_a_manifest_whose_data_is_not_text_is_refused_naming_the_key(tmp_path: Path, data: str, expected: str):
    path = tmp_path / "cm.yaml"
    path.write_text(f"apiVersion: v1\nkind: ConfigMap\nmetadata: {{name: x}}\n{data}")
    with pytest.raises(ConfigError, match=expected):
        read_config_set(path)


@pytest.mark.parametrize(
    "text",
    [
        "kind: ConfigMap\ndata:\n  a: |\n    version: v1\n",  # no apiVersion: a config with unknown keys
        "version: v1\n# kind: ConfigMap\n",
        "version: v1\nflags: {migStrategy: none}\n",
    ],
)
def test_a_file_that_is_no_manifest_is_one_config(tmp_path: Path, text: str):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    config_set = read_config_set(path)
    assert config_set.manifest is None
    assert config_set.documents == {"c.yaml": text}


def test_an_empty_manifest_holds_no_config(tmp_path: Path):
    path = tmp_path / "cm.yaml"
    path.write_text("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: empty}\n")
    config_set = read_config_set(path)
    assert (config_set.manifest, config_set.documents) == ("empty", {})


@pytest.mark.parametrize("key", ["..data", "a/b", "''", "."])
def test_a_manifest_key_the_api_server_would_refuse_is_refused(tmp_path: Path, key: str):
    path = tmp_path / "cm.yaml"
    path.write_text(f"apiVersion: v1\nkind: ConfigMap\ndata:\n  ok: ''\n  {key}: |\n    version: v1\n")
    with pytest.raises(ConfigError, match="not a ConfigMap key") as raised:
        read_config_set(path)
    assert len(raised.value.problems) == 1


def test_a_number_as_a_manifest_key_is_its_text(tmp_path: Path):
    path = tmp_path / "cm.yaml"
    path.write_text("apiVersion: v1\nkind: ConfigMap\ndata:\n  1: |\n    version: v1\n")
    assert read_config_set(path).documents == {"1": "version: v1\n"}


def test_a_manifest_key_without_a_value_is_the_empty_config(tmp_path: Path):
    path = tmp_path / "cm.yaml"
    path.write_text("apiVersion: v1\nkind: ConfigMap\ndata:\n  default:\n")
    config_set = read_config_set(path)
    assert config_set.documents == {"default": ""}
    assert load_config(config_set).name == "default"
