"""YAML syntax errors a person can act on: ``file:line:column``, the problem, the offending line with a caret.

PyYAML's own text names the stream ``in "<unicode string>", line 3, column 1`` and spreads over several
lines; Tessera's never does. The one-line ``problems`` (what ``tessera validate`` lists and the agent logs)
keep their form; ``str()`` leads with the place, as compilers do, and ``excerpt`` shows the line.
"""

from __future__ import annotations

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.config import yaml_limits
from agent.config.model import ConfigError
from agent.config.yaml_limits import YamlSyntaxError, load_yaml


def syntax_error(text: str) -> YamlSyntaxError:
    with pytest.raises(YamlSyntaxError) as raised:
        load_yaml(text, "configs/x.yaml")
    return raised.value


def test_the_place_leads_the_message_and_the_line_is_shown_with_a_caret():
    error = syntax_error("version: v1\nsharing:\n  timeSlicing: b: c\n")
    assert (error.line, error.column) == (3, 17)
    assert str(error) == "configs/x.yaml:3:17: not valid YAML or JSON: mapping values are not allowed in this context"
    assert error.origin == "configs/x.yaml"
    assert error.problems == [
        "not valid YAML or JSON: mapping values are not allowed in this context at line 3, column 17"
    ]
    assert error.excerpt == ("  3 |   timeSlicing: b: c", "    |                 ^")


def test_at_the_end_of_the_text_the_line_where_the_construct_began_is_shown():
    error = syntax_error("version: v1\nflags: {migStrategy: 'mixed}\n")
    assert str(error).startswith("configs/x.yaml:3:1: not valid YAML or JSON: found unexpected end of stream")
    assert "(while scanning a quoted scalar at line 2, column 22)" in str(error)
    assert error.excerpt == ("  2 | flags: {migStrategy: 'mixed}", "    |                      ^")


def test_with_no_context_on_a_line_the_last_line_with_something_on_it_is_shown():
    error = syntax_error("version: v1\nsharing: [\n\n")
    number, text, _ = error.shown  # type: ignore[misc]
    assert (number, text) == (2, "sharing: [")
    assert error.excerpt[1] == "    |           ^"  # just past the end of that line


def test_a_tab_keeps_the_caret_under_the_character():
    error = syntax_error("a:\n\tb: 1\n")
    assert error.excerpt == ("  2 | \tb: 1", "    | ^")
    error = syntax_error("k:\tv: x\n")
    assert error.excerpt == ("  1 | k:\tv: x", "    |   \t ^")  # the tab repeated: it lines up in a terminal


def test_a_long_line_is_shown_as_a_window_around_the_column():
    line = "a: [" + "1, " * 200 + "b: c: d]"
    error = syntax_error(line + "\n")
    shown, caret = error.excerpt
    text = shown.split(" | ", 1)[1]
    assert text.startswith("…")  # cut at the start; the window reaches the end of the line
    assert text.endswith("b: c: d]")
    assert len(text) == 101  # 100 characters and the mark
    under = caret.index("^") - len("    | ")
    assert text[under] == line[error.column - 1]  # the caret is under the character the error names


def test_a_value_that_cannot_be_built_is_placed_at_the_value():
    error = syntax_error("version: v1\nflags:\n  mpsRoot: 2024-13-45\n")
    assert str(error).startswith("configs/x.yaml:3:12: not valid YAML or JSON: a value cannot be read: ValueError")
    assert error.excerpt[0] == "  3 |   mpsRoot: 2024-13-45"


def test_moved_into_a_manifest_shifts_the_place_and_the_line():
    inner = syntax_error("version: v1\nsharing: [\n")
    moved = inner.moved("cm.yaml", 10, 4, note="in data key ts")
    assert (moved.line, moved.column) == (inner.line + 10, inner.column + 4)
    assert str(moved).startswith(f"cm.yaml:{inner.line + 10}:{inner.column + 4}: not valid YAML or JSON: ")
    assert str(moved).endswith("(in data key ts)")
    assert moved.excerpt[0] == "  12 |     sharing: ["
    assert moved.excerpt[1] == "     |               ^"


@pytest.mark.parametrize(
    "error",
    [
        yaml.YAMLError('unacceptable character\n  in "<unicode string>", position 3'),
        yaml.MarkedYAMLError(context="while reading a value"),  # no mark at all
    ],
    ids=["unmarked", "no-mark"],
)
def test_pyyaml_s_stream_name_never_reaches_a_message(monkeypatch: pytest.MonkeyPatch, error: Exception):
    def fail(self: object) -> None:
        raise error

    monkeypatch.setattr(yaml_limits._BoundedLoader, "load_one", fail)
    with pytest.raises(ConfigError) as raised:
        load_yaml("a: 1\n", "x.yaml")
    assert "<unicode string>" not in str(raised.value)
    assert str(raised.value).startswith("x.yaml: not valid YAML or JSON: ")
    assert "\n" not in str(raised.value)


def test_a_context_without_a_problem_is_the_problem(monkeypatch: pytest.MonkeyPatch):
    mark = yaml.Mark("<unicode string>", 0, 0, 2, None, None)

    def fail(self: object) -> None:
        raise yaml.MarkedYAMLError(context="while parsing a block mapping", context_mark=mark)

    monkeypatch.setattr(yaml_limits._BoundedLoader, "load_one", fail)
    with pytest.raises(YamlSyntaxError) as raised:
        load_yaml("a: 1\n", "x.yaml")
    assert str(raised.value) == "x.yaml:1:3: not valid YAML or JSON: while parsing a block mapping"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(alphabet="[]{}:,-&*!|>'\"#?%@` \n\tab1", max_size=120))
def test_no_error_names_pyyaml_s_stream_and_every_syntax_error_has_a_place(text: str):
    try:
        load_yaml(text, "fuzz.yaml")
    except YamlSyntaxError as error:
        assert str(error).startswith(f"fuzz.yaml:{error.line}:{error.column}: ")
        assert 1 <= error.line <= text.count("\n") + 2
        assert all("\n" not in line for line in error.excerpt)
        assert "<unicode string>" not in str(error) + "".join(error.problems)
    except ConfigError as error:
        assert "<unicode string>" not in str(error)
