"""Which named config a node uses, read from a directory laid out the way the kubelet mounts a ConfigMap.

The kubelet writes the data into a timestamped directory ``..2026_11_21_10_00_00.123456789``, points the
``..data`` symlink at it and exposes each key as a symlink ``<key> -> ..data/<key>``; an update writes a new
timestamped directory and swaps ``..data``. Only the keys are configs (facts §1.7). Selection order (Tessera):
``--config-name``, the node label, ``match`` on a GPU product, ``default``, the only config, else defaults;
a name that does not exist is a warning and the next rule applies. Selection never widens: a config whose
``match`` excludes the node is applied only when chosen explicitly (name or label), never as ``default``, the
only config or a single file. Every file is read within the input limits (agent.config.yaml_limits).
"""

from __future__ import annotations

import os
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
    name, warnings = choose(cm, label="h100", products=(H100,))
    assert (name, warnings) == ("h100", [])


def test_an_explicit_choice_wins_over_its_own_match_with_a_warning(cm: Path):
    """The label (or --config-name) names a config whose match excludes this node: applied, and said so."""
    name, warnings = choose(cm, label="h100", products=(A100,))
    assert name == "h100"
    assert len(warnings) == 1
    assert "nvidia.com/device-plugin.config=h100" in warnings[0]
    assert "does not select this node's GPUs" in warnings[0]
    assert A100 in warnings[0]
    name, warnings = choose(cm, requested="a100", products=(H100,))
    assert name == "a100"
    assert "--config-name=a100" in warnings[0]


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
    name, warnings = choose(cm, requested="nope", label="h100", products=(H100,))
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
    # Tests may run as root, for whom mode 000 is readable: fail the open the way the kernel would.
    real_open = os.open

    def denied(path: object, *args: object, **kwargs: object) -> int:
        if Path(str(path)).name == "default":
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", denied)
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


# ----- selection never widens: a match that excludes the node keeps the config off it ---------------------

T4 = "Tesla T4"
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
H100_LAYOUT = """\
version: v1
match: ["NVIDIA H100*"]
flags: {migStrategy: mixed}
migLayout:
  config: all-1g
  layouts: {version: v1, mig-configs: {all-1g: [{devices: all, mig-enabled: true, mig-devices: {1g.10gb: 7}}]}}
"""


def test_a_single_file_whose_match_excludes_the_node_is_not_applied(tmp_path: Path):
    path = tmp_path / "h100-only.yaml"
    path.write_text(H100_LAYOUT)
    loaded = load_config(read_config_set(path), gpu_products=(A100,) * 8)
    assert loaded.name is None
    assert loaded.model.mig_layout is None  # nor its layout
    assert loaded.model.flags.mig_strategy is None
    assert loaded.reason == f"no config applies: h100-only.yaml matches only NVIDIA H100*; this node has {A100}"
    assert loaded.warnings == ()
    applied = load_config(read_config_set(path), gpu_products=(H100,))
    assert applied.name == "h100-only.yaml"
    assert applied.model.mig_layout is not None


def test_by_model_from_the_catalogue_leaves_an_a100_node_alone():
    loaded = load_config(read_config_set(CONFIGS / "by-model.yaml"), gpu_products=(A100,) * 8)
    assert loaded.name is None
    assert loaded.model.sharing is None
    assert loaded.reason == (
        f"no config applies: by-model.yaml matches only Tesla T4, NVIDIA L4, NVIDIA A10G; this node has {A100}"
    )
    on_t4 = load_config(read_config_set(CONFIGS / "by-model.yaml"), gpu_products=(T4,) * 4)
    assert on_t4.name == "by-model.yaml"
    assert on_t4.model.replicated is not None


def test_the_only_config_of_a_directory_is_not_applied_where_its_match_excludes_the_node(tmp_path: Path):
    root = configmap(tmp_path / "cm", {"h100": H100_LAYOUT})
    name, reason, warnings = select_config(read_config_set(root), None, None, (A100,))
    assert name is None
    assert "h100 matches only NVIDIA H100*" in reason
    assert warnings == []
    assert select_config(read_config_set(root), None, None, (H100,))[0] == "h100"


def test_a_default_whose_match_excludes_the_node_is_not_applied(tmp_path: Path):
    root = configmap(tmp_path / "cm", {"default": H100_LAYOUT, "ts4": TS4})
    name, reason, warnings = select_config(read_config_set(root), None, None, (A100,))
    assert name is None
    assert "default matches only NVIDIA H100*" in reason
    assert "ts4 applies only when named" in reason
    assert len(warnings) == 1
    assert "using the defaults" in warnings[0]
    assert select_config(read_config_set(root), None, None, (H100,))[0] == "default"  # matched, not fallen back to
    root2 = configmap(tmp_path / "cm2", {"default": H100_LAYOUT})
    assert select_config(read_config_set(root2), None, None, (A100,))[0] is None


def test_a_default_without_match_still_applies_beside_configs_that_match_other_gpus(cm: Path):
    name, reason, _ = select_config(read_config_set(cm), None, None, (T4,))
    assert (name, reason) == ("default", "the config named default")


def test_an_empty_match_selects_no_node(tmp_path: Path):
    root = configmap(tmp_path / "cm", {"nowhere": f"match: []\n{TS4}"})
    name, reason, _ = select_config(read_config_set(root), None, None, (A100, H100, T4))
    assert name is None
    assert "nowhere matches only nothing" in reason
    assert select_config(read_config_set(root), "nowhere", None, (A100,))[0] == "nowhere"  # explicit wins


def test_a_match_that_is_not_globs_selects_no_node_with_a_warning(tmp_path: Path):
    root = configmap(tmp_path / "cm", {"odd": f"match: {{a: b}}\n{TS4}"})
    name, _, warnings = select_config(read_config_set(root), None, None, (A100,))
    assert name is None
    assert any("odd: match is not a glob" in w for w in warnings)


def test_a_match_written_as_numbers_is_read_as_text_like_the_model_reads_it(tmp_path: Path):
    root = configmap(tmp_path / "cm", {"num": f"match: [1080]\n{TS4}"})
    assert select_config(read_config_set(root), None, None, ("1080",))[0] == "num"
    assert load_config(read_config_set(root), gpu_products=("1080",)).model.match == ["1080"]


def test_no_gpus_means_no_match_selects(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_text(f"match: '*'\n{TS4}")
    name, reason, _ = select_config(read_config_set(path), None, None, ())
    assert name is None
    assert reason.endswith("this node has no GPUs")


# ----- bounded input: bombs and garbage are ConfigErrors naming the file and the limit ----------------------

DEEP = "a: " + "[" * 500 + "]" * 500
LAUGHS = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(9)
)


def test_a_config_nested_500_deep_is_a_config_error_not_a_recursion_error(tmp_path: Path):
    root = configmap(tmp_path / "cm", {"default": DEEP})
    with pytest.raises(ConfigError) as raised:
        load_config(read_config_set(root))
    assert raised.value.origin == str(root / "default")
    assert len(DEEP) < 1100
    (problem,) = raised.value.problems
    assert "nested 501 levels deep" in problem
    assert "at most 64" in problem
    assert "flatten" in problem


def test_an_alias_bomb_is_a_config_error_naming_the_limit(tmp_path: Path):
    path = tmp_path / "laughs.yaml"
    path.write_text(LAUGHS)
    with pytest.raises(ConfigError) as raised:
        load_config(read_config_set(path))
    assert raised.value.origin == str(path)
    assert "aliases expand to more than 20,000 values" in raised.value.problems[0]
    assert "billion laughs" in raised.value.problems[0]


def test_a_bomb_beside_a_good_config_does_not_stop_selection(tmp_path: Path):
    root = configmap(tmp_path / "cm", {"deep": DEEP, "laughs": LAUGHS, "a100": f"match: 'NVIDIA A100*'\n{TS4}"})
    assert choose(root, products=(A100,)) == ("a100", [])
    assert load_config(read_config_set(root), gpu_products=(A100,)).model.replicated is not None
    with pytest.raises(ConfigError, match="nested 501 levels deep"):
        load_config(read_config_set(root), requested="deep")


def test_a_100_mb_file_is_refused_from_its_size_without_reading_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = tmp_path / "huge.yaml"
    with path.open("wb") as stream:
        stream.truncate(100 << 20)  # sparse: 100 MB that costs nothing
    monkeypatch.setattr(os, "read", lambda *_: pytest.fail("the file was read"))
    with pytest.raises(ConfigError) as raised:
        read_config_set(path)
    assert raised.value.origin == str(path)
    assert "larger than the 1 MiB limit: 100 MiB" in raised.value.problems[0]


def test_binary_garbage_is_a_config_error(tmp_path: Path):
    path = tmp_path / "config.yaml"
    path.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ConfigError) as raised:
        load_config(read_config_set(path))
    assert raised.value.origin == str(path)
    assert "not UTF-8" in raised.value.problems[0]
    path.write_bytes(b"version: v1\n\x00\x01\x02ELF")  # valid UTF-8, but control characters
    with pytest.raises(ConfigError) as raised:
        load_config(read_config_set(path))
    assert "not text: character U+0000" in raised.value.problems[0]
    assert "line 2, column 1" in raised.value.problems[0]


def test_a_fifo_is_refused_without_blocking(tmp_path: Path):
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError) as raised:
        read_config_set(fifo)  # opening a FIFO for reading would wait for a writer forever
    assert raised.value.origin == str(fifo)
    assert "is a FIFO (named pipe), not a regular file" in raised.value.problems[0]
    root = configmap(tmp_path / "cm", {"default": TS4})
    os.mkfifo(root / "pipe")
    assert sorted(read_config_set(root).documents) == ["default"]  # in a directory: not a config


def test_two_documents_in_one_config_are_an_error(tmp_path: Path):
    path = tmp_path / "two.yaml"
    path.write_text(f"{TS4}---\n{MPS2}")
    with pytest.raises(ConfigError) as raised:
        load_config(read_config_set(path))
    assert "holds more than one YAML document (another starts at line 6, column 1)" in raised.value.problems[0]
    path.write_text(f"---\n{TS4}---\n# nothing more\n")
    assert load_config(read_config_set(path)).model.replicated is not None
