"""Bounded YAML: every file from outside is read within limits, and breaking one is a ConfigError naming the
file, the limit and the fix — never RecursionError, MemoryError or another parser exception.

The bombs here are the ones from the issue: deep nesting (~1 kB, 500 levels), alias expansion ("billion
laughs"), a 100 MB file, binary garbage and a FIFO; plus the other ways PyYAML fails on garbage.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.config import yaml_limits
from agent.config.bounded import MAX_BYTES, read_bounded
from agent.config.model import ConfigError
from agent.config.yaml_limits import MAX_ALIASES, MAX_DEPTH, MAX_NODES, load_yaml
from agent.mig.layout_file import LayoutFileError, parse_layout_file, parse_layout_text, read_layout_file
from agent.sim.nvml.spec import SimSpecError, load_node_spec

ROOT = Path(__file__).resolve().parents[2]


def nested(depth: int, *, flow: bool = True) -> str:
    """``depth`` levels of collections: a map, then lists (flow) or maps (block)."""
    if flow:
        return "a: " + "[" * (depth - 1) + "]" * (depth - 1)
    return "".join(" " * i + "k:\n" for i in range(depth - 1)) + " " * (depth - 1) + "k: 1\n"


def laughs(levels: int = 9) -> str:
    lines = ["a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, levels + 1):
        name, previous = chr(97 + i), chr(96 + i)
        lines.append(f"{name}: &{name} [{', '.join([f'*{previous}'] * 9)}]")
    return "\n".join(lines) + "\n"


def problem(data: bytes | str, **limits: int) -> str:
    with pytest.raises(ConfigError) as raised:
        load_yaml(data, "bomb.yaml", kind="a sharing config", **limits)
    assert raised.value.origin == "bomb.yaml"
    (only,) = raised.value.problems
    assert "\n" not in only
    return only


# ----- the limits leave every real document far behind ------------------------------------------------------


def test_limits_are_module_constants():
    assert (MAX_BYTES, MAX_DEPTH, MAX_NODES, MAX_ALIASES) == (1 << 20, 64, 20_000, 1_000)


SHIPPED = [
    *ROOT.glob("configs/*.yaml"),
    *ROOT.glob("agent/sim/presets/*.yaml"),
    *ROOT.glob("tests/deploy/nodes/*"),
    ROOT / "daemonset" / "overlays" / "mig-manager" / "mig-layouts.yaml",
]


@pytest.mark.parametrize("path", sorted(SHIPPED), ids=lambda p: p.name)
def test_every_shipped_document_loads_well_within_the_limits(path: Path):
    text = path.read_text(encoding="utf-8")
    quarter = {"max_depth": MAX_DEPTH // 4, "max_nodes": MAX_NODES // 100, "max_aliases": 0}
    assert load_yaml(read_bounded(path), str(path), **quarter) == yaml.safe_load(text)


def test_yaml_and_json_and_empty_documents():
    assert load_yaml("version: v1\nsharing: {timeSlicing: {}}\n", "c") == {
        "version": "v1",
        "sharing": {"timeSlicing": {}},
    }
    assert load_yaml('{"version": "v1", "match": ["Tesla T4"]}', "c") == {"version": "v1", "match": ["Tesla T4"]}
    assert load_yaml("", "c") is None
    assert load_yaml("# only a comment\n", "c") is None
    assert load_yaml(b"\xef\xbb\xbfversion: v1\n", "c") == {"version": "v1"}  # a UTF-8 byte-order mark
    assert load_yaml("---\nversion: v1\n...\n", "c") == {"version": "v1"}


# ----- nesting ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flow", [True, False], ids=["flow", "block"])
def test_500_levels_deep_names_the_depth_the_limit_and_the_fix(flow: bool):
    text = nested(500, flow=flow)
    message = problem(text)
    assert "nested 500 levels deep" in message
    assert "a sharing config nests at most 64 levels: flatten it" in message


def test_the_issue_s_1_kb_config_bomb():
    text = "a: " + "[" * 500 + "]" * 500
    assert len(text) < 1100
    assert "nested 501 levels deep (level 65 at line 1, column 67)" in problem(text)


def test_depth_at_the_limit_loads_one_more_does_not():
    assert load_yaml(nested(MAX_DEPTH), "c") is not None
    assert load_yaml(nested(MAX_DEPTH, flow=False), "c") is not None
    assert f"nested {MAX_DEPTH + 1} levels deep" in problem(nested(MAX_DEPTH + 1))


def test_a_megabyte_of_brackets_is_refused_quickly():
    started = time.monotonic()
    message = problem("[" * (MAX_BYTES - 1))
    assert time.monotonic() - started < 5
    assert "nested at least" in message


def test_deep_nesting_never_reaches_python_s_recursion_limit():
    message = problem(nested(10_000), max_depth=10**6)  # above the limit only the recursion guard is left
    assert "nested" in message


# ----- aliases ---------------------------------------------------------------------------------------------------


def test_billion_laughs_is_refused_as_soon_as_it_expands_past_the_limit():
    text = laughs()
    assert len(text) < 1000
    started = time.monotonic()
    message = problem(text)
    assert time.monotonic() - started < 1
    assert "aliases expand to more than 20,000 values" in message
    assert 'an alias bomb ("billion laughs")' in message
    assert "write the values out or use fewer aliases" in message


def test_a_few_aliases_and_merge_keys_are_fine():
    text = "base: &base {replicas: 2}\nresources:\n  - {<<: *base, name: nvidia.com/gpu}\n  - *base\n"
    assert load_yaml(text, "c") == {
        "base": {"replicas": 2},
        "resources": [{"replicas": 2, "name": "nvidia.com/gpu"}, {"replicas": 2}],
    }
    assert load_yaml(laughs(2), "c")["c"][0][0][0] == "lol"  # 10 + 90 + 810 values: fine


def test_an_alias_cycle_is_refused():
    assert "is inside the value it repeats (a cycle)" in problem("a: &a [1, *a]\n")
    assert "is inside the value it repeats" in problem("a: &a {b: *a}\n")


def test_alias_count_limit():
    text = "a: &a 1\nb: [" + ", ".join(["*a"] * (MAX_ALIASES + 1)) + "]\n"
    assert f"more than {MAX_ALIASES:,} aliases" in problem(text)


def test_values_limit():
    assert "more than 20,000 values" in problem("[" + "1, " * MAX_NODES + "1]")
    assert load_yaml("[" + "1, " * (MAX_NODES - 2) + "1]", "c") is not None


# ----- size, encoding, documents ---------------------------------------------------------------------------------


def test_more_than_a_mebibyte_is_refused_before_it_is_parsed():
    assert "larger than the 1 MiB limit" in problem("#" * (MAX_BYTES + 1))
    assert "larger than the 1 MiB limit" in problem("é" * (MAX_BYTES // 2 + 1))  # counted in bytes
    assert load_yaml("#" * MAX_BYTES, "c") is None


def test_binary_garbage_is_refused_naming_the_byte():
    assert "not UTF-8 text (byte 128)" in problem(bytes(range(256)))
    assert "not text: character U+0000 (not allowed in YAML) at line 1, column 4" in problem("a: \x00")
    assert "character U+001B" in problem("a: 1\n\x1b[31m")


def test_more_than_one_document_is_an_error_naming_where_the_second_starts():
    message = problem("version: v1\n---\nversion: v1\n")
    assert "holds more than one YAML document (another starts at line 2, column 1)" in message
    assert "a sharing config is one document" in message
    assert load_yaml("---\n# empty\n---\nversion: v1\n---\n", "c") == {"version": "v1"}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("sharing: [\n", "did not find expected node content"),
        ("a: " + "1" * 5000, "Exceeds the limit (4300 digits)"),  # int() refuses: ValueError
        ("a: 2024-13-45\n", "month must be in 1..12"),  # a timestamp PyYAML cannot build: ValueError
        ("? [a, b]\n: 1\n", "found unhashable key"),
        ("a: !!python/object/apply:os.system [echo]\n", "could not determine a constructor"),
        ("a: *nowhere\n", "found undefined alias"),
        ("a: &x 1\nb: &x 2\n", "duplicate anchor"),
        ("a: !!binary 'a'\n", "failed to decode base64 data"),
        ("a:\n\tb: 1\n", "cannot start any token"),
        ("a: !!timestamp x\n", "AttributeError"),  # PyYAML's own bugs on explicit tags, still bad input
        ("a: !!bool x\n", "KeyError"),
        ("a: !!float x\n", "could not convert string to float"),
    ],
    ids=[
        "syntax",
        "huge-int",
        "bad-date",
        "unhashable",
        "python-tag",
        "undefined-alias",
        "dup-anchor",
        "base64",
        "tab",
        "timestamp-tag",
        "bool-tag",
        "float-tag",
    ],
)
def test_whatever_pyyaml_raises_on_garbage_is_a_config_error(text: str, expected: str):
    message = problem(text)
    assert message.startswith("not valid YAML or JSON: ")
    assert expected in message


@pytest.mark.parametrize(
    "text",
    [
        "a: 0x" + "f" * 4000,  # ~4,800 digits, under a mebibyte: YAML's hex is not held to Python's bound on text
        "? 0" + "7" * 5000 + "\n: 1\n",  # as a key (YAML 1.1 octal: a leading 0)
        "a: [1, -0b" + "1" * 16000 + "]",
    ],
    ids=["hex-value", "octal-key", "negative-binary-in-a-list"],
)
def test_an_integer_too_long_to_print_is_refused_where_it_is_written(text: str):
    """Past 4,300 digits no message could print the number (Python refuses to make it text); no setting takes one."""
    message = problem(text)
    assert "a number of more than 4,300 digits" in message
    assert message.startswith("not valid YAML or JSON: ")
    assert load_yaml("a: 0x" + "f" * 3000, "c.yaml") == {"a": int("f" * 3000, 16)}  # 3,612 digits: a number


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300) | st.text(alphabet="[]{}:,-&*!|>'\"#?%@` \n\tab1", max_size=200))
def test_fuzz_garbage_is_a_value_or_a_config_error(data: bytes | str):
    try:
        load_yaml(data, "fuzz.yaml")
    except ConfigError as error:
        assert error.origin == "fuzz.yaml"
        assert error.problems


# ----- read_bounded: the bytes, or why not -----------------------------------------------------------------------


def test_read_bounded_reads_a_regular_file_and_follows_symlinks(tmp_path: Path):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"version: v1\n")
    (tmp_path / "link").symlink_to(path)
    assert read_bounded(path) == read_bounded(tmp_path / "link", "configmap/default") == b"version: v1\n"


def test_read_bounded_refuses_a_100_mb_file_without_reading_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = tmp_path / "huge.yaml"
    with path.open("wb") as stream:
        stream.truncate(100 << 20)
    monkeypatch.setattr(os, "open", lambda *_a, **_k: pytest.fail("the file was opened"))
    with pytest.raises(ConfigError) as raised:
        read_bounded(path, "configmap/huge")
    assert raised.value.origin == "configmap/huge"
    assert raised.value.problems == [
        "larger than the 1 MiB limit: 100 MiB (104857600 bytes); a ConfigMap holds at most 1 MiB, so this is "
        "not a config or layout: check the path"
    ]


def test_read_bounded_stops_at_the_limit_when_the_size_lies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A file that grows between stat and read (or a /proc file that says 0 bytes): at most limit + 1 read."""
    path = tmp_path / "growing"
    path.write_bytes(b"#" * 10)
    served: list[int] = []

    def endless(fd: int, n: int) -> bytes:
        served.append(n)
        return b"#" * n

    monkeypatch.setattr(os, "read", endless)
    with pytest.raises(ConfigError, match="larger than the 1 KiB limit: more than 1 KiB"):
        read_bounded(path, max_bytes=1024)
    assert sum(served) == 1025


def test_read_bounded_refuses_a_fifo_without_blocking(tmp_path: Path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError) as raised:
        read_bounded(fifo)
    assert raised.value.problems == ["is a FIFO (named pipe), not a regular file; give the path of a file"]


def test_read_bounded_refuses_directories_and_devices_but_dev_null_is_empty(tmp_path: Path):
    with pytest.raises(ConfigError, match="is a directory, not a file"):
        read_bounded(tmp_path)
    with pytest.raises(ConfigError, match="is a device, not a regular file"):
        read_bounded(Path("/dev/zero"))
    assert read_bounded(Path("/dev/null")) == b""


def test_read_bounded_names_a_missing_file(tmp_path: Path):
    with pytest.raises(ConfigError) as raised:
        read_bounded(tmp_path / "nowhere.yaml")
    assert raised.value.problems == ["cannot read: No such file or directory; check the mount and the path"]


# ----- the other readers: MIG layout files and node specs ---------------------------------------------------------


def test_read_layout_file_reads_a_layout(tmp_path: Path):
    path = tmp_path / "layouts.yaml"
    path.write_text(
        "version: v1\nmig-configs:\n  all-1g: [{devices: all, mig-enabled: true, mig-devices: {1g.10gb: 7}}]\n"
    )
    parsed = parse_layout_file(read_layout_file(path), str(path))
    assert list(parsed.mig_configs) == ["all-1g"]


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (nested(500), "nested 500 levels deep"),
        (laughs(), "billion laughs"),
        (bytes(range(256)), "not UTF-8 text"),
        ("version: v1\n---\nversion: v1\n", "a MIG layout file is one document"),
    ],
    ids=["deep", "laughs", "binary", "two-documents"],
)
def test_a_layout_file_bomb_is_a_layout_file_error_naming_the_path(tmp_path: Path, content: str | bytes, expected):
    path = tmp_path / "layouts.yaml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(LayoutFileError) as raised:
        read_layout_file(path)
    assert str(raised.value).startswith(f"{path}: ")
    assert expected in str(raised.value)
    assert len(raised.value.problems) == 1


def test_a_layout_file_that_is_a_fifo_a_directory_or_huge(tmp_path: Path):
    os.mkfifo(tmp_path / "fifo")
    with (tmp_path / "huge").open("wb") as stream:
        stream.truncate(100 << 20)
    for name, expected in (("fifo", "FIFO"), ("huge", "larger than the 1 MiB limit"), ("", "is a directory")):
        with pytest.raises(LayoutFileError, match=expected):
            read_layout_file(tmp_path / name)


def test_layout_text_is_bounded_too():
    with pytest.raises(LayoutFileError, match="billion laughs"):
        parse_layout_text(laughs(), "configmap/mig-layouts")


@pytest.mark.parametrize(
    ("content", "expected"),
    [(nested(500, flow=False), "a node spec nests at most 64"), (laughs(), "billion laughs")],
    ids=["deep", "laughs"],
)
def test_a_node_spec_bomb_is_a_sim_spec_error(tmp_path: Path, content: str, expected: str):
    path = tmp_path / "node.yaml"
    path.write_text(content)
    with pytest.raises(SimSpecError, match=expected) as raised:
        load_node_spec(str(path))
    assert str(raised.value).startswith(f"{path}: ")


def test_a_node_spec_that_is_a_fifo_is_refused(tmp_path: Path):
    os.mkfifo(tmp_path / "node.yaml")
    with pytest.raises(SimSpecError, match="FIFO"):
        load_node_spec(str(tmp_path / "node.yaml"))


def test_a_node_spec_with_too_many_gpus_is_refused(tmp_path: Path):
    path = tmp_path / "node.yaml"
    path.write_text("gpus:\n" + "  - {model: T4, count: 64}\n" * 2)
    with pytest.raises(SimSpecError, match="128 GPUs in all; a simulated node has at most 64"):
        load_node_spec(str(path))


def test_the_module_names_its_limits_in_its_docstring():
    assert yaml_limits.__doc__ is not None
    for text in ("1 MiB", "64", "20,000", "1,000"):
        assert text in yaml_limits.__doc__
