"""Which named config a node uses, read from a directory laid out the way the kubelet mounts a ConfigMap.

The kubelet writes the data into a timestamped directory ``..2026_11_21_10_00_00.123456789``, points the
``..data`` symlink at it and exposes each key as a symlink ``<key> -> ..data/<key>``; an update writes a new
timestamped directory and swaps ``..data``. Only the keys are configs (facts §1.7). Selection order (Tessera):
``--config-name``, the node label, ``match`` on a GPU product, ``default``, the only config, else defaults;
a name that does not exist is a warning and the next rule applies.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.config.model import ConfigError
from agent.config.source import MAX_CONFIG_BYTES, load_config, read_config_set, select_config

A100 = "NVIDIA A100-SXM4-80GB"
H100 = "NVIDIA H100 80GB HBM3"
TS4 = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 4}\n"
MPS2 = "version: v1\nsharing:\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2}\n"
PLAIN = "version: v1\n"


def configmap(root: Path, data: dict[str, str], stamp: str = "..2026_11_21_10_00_00.123456789") -> Path:
    """A ConfigMap volume as the kubelet lays it out; calling it again with a new stamp is an update."""
    root.mkdir(exist_ok=True)
    (root / stamp).mkdir()
    for key, text in data.items():
        (root / stamp / key).write_text(text, encoding="utf-8")
    staging = root / "..data_tmp"
    staging.symlink_to(stamp)
    staging.replace(root / "..data")  # the atomic swap the kubelet does
    for key in data:
        link = root / key
        if not link.is_symlink():
            link.symlink_to(f"..data/{key}")
    for stale in [p for p in root.iterdir() if p.is_symlink() and p.name != "..data" and not p.exists()]:
        stale.unlink()
    return root


def choose(
    path: Path,
    *,
    requested: str | None = None,
    label: str | None = None,
    products: tuple[str, ...] = (),
) -> tuple[str | None, list[str]]:
    name, _, warnings = select_config(read_config_set(path), requested, label, products)
    return name, warnings


@pytest.fixture
def cm(tmp_path: Path) -> Path:
    return configmap(
        tmp_path / "configs",
        {
            "default": PLAIN,
            "a100": f'match: "NVIDIA A100*"\n{TS4}',
            "h100": f'match: ["NVIDIA H100*", "NVIDIA H200*"]\n{MPS2}',
            "ts8": TS4.replace("replicas: 4", "replicas: 8"),
        },
    )


# ----- what counts as a config ----------------------------------------------------------------------------


def test_only_the_configmap_keys_are_configs(cm: Path):
    (cm / "nested").mkdir()
    (cm / "nested" / "not-a-config").write_text(PLAIN)
    config_set = read_config_set(cm)
    assert config_set.is_directory
    assert sorted(config_set.documents) == ["a100", "default", "h100", "ts8"]
    assert config_set.documents["ts8"].count("replicas: 8") == 1


def test_timestamped_entries_are_ignored_even_when_they_are_files(cm: Path):
    (cm / "..2026_11_21_09_00_00.000000001").write_text("version: v9\n")
    assert "..2026_11_21_09_00_00.000000001" not in read_config_set(cm).documents
    assert choose(cm, requested="..data")[0] == "default"


def test_a_configmap_update_is_read_through_the_new_data_link(cm: Path):
    configmap(cm, {"default": TS4, "fresh": MPS2}, stamp="..2026_11_22_08_00_00.987654321")
    config_set = read_config_set(cm)
    assert sorted(config_set.documents) == ["default", "fresh"]
    assert config_set.documents["default"] == TS4


# ----- selection order --------------------------------------------------------------------------------------


def test_config_name_beats_label_match_and_default(cm: Path):
    assert choose(cm, requested="ts8", label="h100", products=(A100,)) == ("ts8", [])


def test_label_beats_match_and_default(cm: Path):
    assert choose(cm, label="h100", products=(A100,)) == ("h100", [])


def test_match_on_gpu_product_beats_default(cm: Path):
    assert choose(cm, products=(A100,)) == ("a100", [])


def test_match_list_form_and_any_product_on_the_node(cm: Path):
    assert choose(cm, products=("Tesla T4", "NVIDIA H200")) == ("h100", [])


def test_match_glob_is_anchored(cm: Path):
    assert choose(cm, products=("Custom NVIDIA A100 board",)) == ("default", [])


def test_default_when_nothing_else_applies(cm: Path):
    assert choose(cm, products=("Tesla T4",)) == ("default", [])


def test_the_only_config_when_there_is_no_default(tmp_path: Path):
    root = configmap(tmp_path / "one", {"mine": TS4})
    assert choose(root) == ("mine", [])


def test_no_applicable_config_means_defaults_with_a_warning(tmp_path: Path):
    root = configmap(tmp_path / "two", {"a": TS4, "b": MPS2})
    name, warnings = choose(root, products=(A100,))
    assert name is None
    assert len(warnings) == 1
    assert "no config" in warnings[0]
    assert "using the defaults" in warnings[0]
    loaded = load_config(read_config_set(root), gpu_products=(A100,))
    assert loaded.name is None
    assert loaded.model.sharing is None
    assert loaded.warnings == tuple(warnings)


def test_empty_configmap_means_defaults(tmp_path: Path):
    root = configmap(tmp_path / "empty", {})
    loaded = load_config(read_config_set(root))
    assert loaded.name is None
    assert loaded.model.replicated is None


# ----- missing names fall back, with a warning ---------------------------------------------------------------


def test_missing_config_name_warns_and_falls_back_to_the_label(cm: Path):
    name, warnings = choose(cm, requested="nope", label="h100")
    assert name == "h100"
    assert len(warnings) == 1
    assert "--config-name" in warnings[0]
    assert "'nope'" in warnings[0]
    assert "a100, default, h100, ts8" in warnings[0]  # what it could have been
    assert "falling back" in warnings[0]


def test_missing_label_warns_and_falls_back_to_match(cm: Path):
    name, warnings = choose(cm, label="gone", products=(A100,))
    assert name == "a100"
    assert len(warnings) == 1
    assert "nvidia.com/device-plugin.config" in warnings[0]
    assert "'gone'" in warnings[0]


def test_missing_config_name_and_label_fall_back_to_default(cm: Path):
    name, warnings = choose(cm, requested="x", label="y")
    assert name == "default"
    assert len(warnings) == 2


def test_empty_label_value_is_no_label(cm: Path):
    assert choose(cm, label="") == ("default", [])


# ----- match ------------------------------------------------------------------------------------------------


def test_several_matches_take_the_first_and_warn(tmp_path: Path):
    root = configmap(
        tmp_path / "cm",
        {"b-a100": f"match: 'NVIDIA A100*'\n{TS4}", "a-all": f"match: '*'\n{MPS2}", "default": PLAIN},
    )
    name, warnings = choose(root, products=(A100,))
    assert name == "a-all"
    assert len(warnings) == 1
    assert "a-all, b-a100" in warnings[0]
    assert "using a-all" in warnings[0]


def test_match_key_is_case_insensitive_like_every_top_level_key(tmp_path: Path):
    root = configmap(tmp_path / "cm", {"a100": f"Match: 'NVIDIA A100*'\n{TS4}", "default": PLAIN})
    assert choose(root, products=(A100,)) == ("a100", [])
    loaded = load_config(read_config_set(root), gpu_products=(A100,))
    assert loaded.model.match == ["NVIDIA A100*"]
    assert loaded.warnings == ()


def test_a_broken_config_does_not_stop_another_from_matching(tmp_path: Path):
    root = configmap(tmp_path / "cm", {"broken": "sharing: [\n", "a100": f"match: 'NVIDIA A100*'\n{TS4}"})
    assert choose(root, products=(A100,)) == ("a100", [])


def test_match_without_products_matches_nothing(cm: Path):
    assert choose(cm) == ("default", [])


# ----- a single file ----------------------------------------------------------------------------------------


def test_single_file_ignores_config_name_with_a_warning(tmp_path: Path):
    path = tmp_path / "config.yaml"
    path.write_text(TS4)
    config_set = read_config_set(path)
    assert not config_set.is_directory
    name, warnings = choose(path, requested="a100", label="h100")
    assert name == "config.yaml"
    assert len(warnings) == 1
    assert "'a100'" in warnings[0]
    assert "single file" in warnings[0]
    loaded = load_config(config_set, requested="a100")
    assert loaded.model.replicated is not None
    assert loaded.warnings == tuple(warnings)


def test_config_file_through_a_symlink_like_nvidias_config_manager(tmp_path: Path):
    cm = configmap(tmp_path / "available-configs", {"ts": TS4})
    (tmp_path / "config.yaml").symlink_to(cm / "ts")
    loaded = load_config(read_config_set(tmp_path / "config.yaml"))
    assert loaded.model.replicated is not None


def test_dev_null_is_the_empty_config():
    loaded = load_config(read_config_set(Path("/dev/null")))
    assert loaded.model.sharing is None
    assert loaded.warnings == ()


# ----- load_config: parse the chosen one ---------------------------------------------------------------------


def test_load_parses_the_chosen_config_and_says_why(cm: Path):
    loaded = load_config(read_config_set(cm), label="h100")
    assert loaded.name == "h100"
    assert "h100" in loaded.reason
    assert loaded.model.replicated is not None
    assert loaded.model.replicated[0] == "mps"


def test_invalid_chosen_config_names_the_file_and_the_field(tmp_path: Path):
    root = configmap(tmp_path / "cm", {"default": "version: v1\nflags: {migStrategy: sometimes}\n", "ok": PLAIN})
    with pytest.raises(ConfigError) as raised:
        load_config(read_config_set(root))
    assert raised.value.origin == str(root / "default")
    assert raised.value.problems[0].startswith("flags.migStrategy: ")
    assert load_config(read_config_set(root), requested="ok").name == "ok"


def test_strict_load_refuses_unknown_keys_lenient_load_warns(tmp_path: Path):
    root = configmap(tmp_path / "cm", {"default": "version: v1\nsharing:\n  timeslice: {}\n"})
    lenient = load_config(read_config_set(root))
    assert any("did you mean sharing.timeSlicing?" in w for w in lenient.warnings)
    with pytest.raises(ConfigError) as raised:
        load_config(read_config_set(root), strict=True)
    assert raised.value.problems == ["unknown key sharing.timeslice is ignored; did you mean sharing.timeSlicing?"]


def test_digest_changes_with_the_text_only(tmp_path: Path):
    root = configmap(tmp_path / "cm", {"default": TS4})
    first = load_config(read_config_set(root)).digest
    assert load_config(read_config_set(root)).digest == first
    configmap(root, {"default": TS4 + "# edited\n"}, stamp="..2026_11_22_00_00_00.1")
    assert load_config(read_config_set(root)).digest != first


# ----- files that are not configs ------------------------------------------------------------------------------


def test_missing_path_is_a_config_error(tmp_path: Path):
    with pytest.raises(ConfigError) as raised:
        read_config_set(tmp_path / "nowhere.yaml")
    assert "cannot read" in raised.value.problems[0]


def test_unreadable_file_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    root = configmap(tmp_path / "cm", {"default": TS4})
    # Tests may run as root, for whom mode 000 is readable: fail the read the way the kernel would.
    real_read = Path.read_text

    def denied(self: Path, *args: object, **kwargs: object) -> str:
        if self.name == "default":
            raise PermissionError(13, "Permission denied", str(self))
        return real_read(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "read_text", denied)
    with pytest.raises(ConfigError) as raised:
        read_config_set(root)
    assert raised.value.problems == ["cannot read: Permission denied; check the mount and the path"]


def test_oversized_file_is_a_config_error(tmp_path: Path):
    root = configmap(tmp_path / "cm", {"default": PLAIN, "huge": "#" * (MAX_CONFIG_BYTES + 1)})
    with pytest.raises(ConfigError) as raised:
        read_config_set(root)
    assert raised.value.origin.endswith("huge")
    assert "larger than" in raised.value.problems[0]


def test_a_file_of_exactly_the_limit_is_read(tmp_path: Path):
    path = tmp_path / "config.yaml"
    path.write_text(PLAIN + "#" * (MAX_CONFIG_BYTES - len(PLAIN)))
    assert load_config(read_config_set(path)).model.version == "v1"


def test_binary_file_is_a_config_error_not_a_crash(tmp_path: Path):
    path = tmp_path / "config.yaml"
    path.write_bytes(b"\xff\xfe\x00version: v1\n")
    with pytest.raises(ConfigError) as raised:
        read_config_set(path)
    assert "not UTF-8" in raised.value.problems[0]
