"""How agent.config.schema's walk reports a document: every problem in one pass, each by its path, values quoted
short. (What each field accepts is tests/unit/test_config_table.py, row by row.)"""

from __future__ import annotations

import pytest

from agent.config.model import ConfigError, parse_config


def problems(document: object) -> list[str]:
    with pytest.raises(ConfigError) as raised:
        parse_config(document, "cfg.yaml")
    return raised.value.problems


def test_one_walk_names_every_problem_of_the_document_by_its_path():
    found = problems(
        {
            "flags": {"migStrategy": "several", "failOnInitError": "no"},
            "sharing": {"timeSlicing": {"resources": [{"name": "gpu", "replicas": 1}, {"replicas": 2}]}},
            "imex": {"channelIDs": [3]},
        }
    )
    assert [p.split(": ", 1)[0] for p in found] == [
        "flags.migStrategy",
        "flags.failOnInitError",
        "sharing.timeSlicing.resources[0].replicas",
        "sharing.timeSlicing.resources[1].name",
        "imex.channelIDs",
    ]
    assert "required field is missing" in found[3]


def test_a_section_with_a_problem_is_not_checked_as_a_whole_too():
    """memoryBurstLimit below memoryLimit is a check of the entry as a whole: it is not made (nor reported) while
    one of the entry's own values is wrong, which would be a second message for one mistake."""
    entry = {"name": "gpu", "replicas": "4", "memoryLimit": "8Gi", "memoryBurstLimit": "4Gi"}
    found = problems({"sharing": {"timeSlicing": {"resources": [entry]}}})
    assert found == [
        "sharing.timeSlicing.resources[0].replicas: expected a whole number, got the text '4': write it without quotes"
    ]
    entry["replicas"] = 4
    assert "is below memoryLimit" in problems({"sharing": {"timeSlicing": {"resources": [entry]}}})[0]


@pytest.mark.parametrize(
    "document",
    [
        {"flags": {"migStrategy": ["x" * 100] * 1000}},
        {"sharing": {"mps": {"resources": [{"name": "gpu", "replicas": 2, "devices": [{"k": "v" * 10_000}]}]}}},
        {"dra": {"gpus": ["GPU-" + "0" * 10_000]}},
    ],
)
def test_a_message_quotes_a_value_short_never_the_whole_of_it(document: dict[str, object]):
    (problem,) = problems(document)
    assert len(problem) < 300, problem
    assert "…" in problem


UUID = "GPU-12345678-1234-1234-1234-123456789abc"


@pytest.mark.parametrize(
    ("document", "path"),
    [
        ({"sharing": {"mps": {"resources": [{"name": "gpu", "replicas": 2, "devices": ["0\n"]}]}}}, "devices"),
        ({"sharing": {"mps": {"resources": [{"name": "gpu", "replicas": 2, "devices": ["0:1\n"]}]}}}, "devices"),
        ({"sharing": {"mps": {"resources": [{"name": "gpu", "replicas": 2, "devices": ["\u0661"]}]}}}, "devices"),
        ({"dra": {"gpus": [UUID + "\n"]}}, "dra.gpus"),
    ],
    ids=["index-newline", "mig-index-newline", "arabic-indic-digit", "uuid-newline"],
)
def test_a_device_reference_is_matched_whole_with_ascii_digits(document: dict[str, object], path: str):
    """NVIDIA's Go patterns match the whole text with ASCII digits; "0\\n" or an Arabic-Indic digit is no GPU."""
    (problem,) = problems(document)
    assert path in problem.split(": ", 1)[0]


def test_yaml_binary_text_is_read_as_the_text_it_encodes():
    """sigs.k8s.io/yaml decodes ``!!binary`` to the text it holds, for a text field; so does Tessera."""
    from agent.config.source import parse_document

    model, _ = parse_document("version: !!binary djE=\nmatch: [!!binary QTEwMCo=]\n", "cfg.yaml")
    assert (model.version, model.match) == ("v1", ["A100*"])
    with pytest.raises(ConfigError, match="version: expected text, got binary data that is not UTF-8 text"):
        parse_document("version: !!binary /w==\n", "cfg.yaml")


def test_the_config_holds_its_own_values_not_the_documents():
    """A config is frozen: changing the document it was read from afterwards changes nothing in it."""
    entry = {"name": "gpu", "replicas": 2, "devices": [0, 1]}
    layouts = {"version": "v1", "mig-configs": {}}
    document = {"sharing": {"timeSlicing": {"resources": [entry]}}, "migLayout": {"layouts": layouts}}
    model, _ = parse_config(document, "cfg.yaml")
    entry["devices"].append(2)
    layouts["mig-configs"] = {"all-1g": []}
    assert model.sharing.time_slicing.resources[0].devices == [0, 1]
    assert model.mig_layout.layouts == {"version": "v1", "mig-configs": {}}


def entry(**more: object) -> dict[str, object]:
    return {"name": "gpu", "replicas": 2, **more}


def ts(*entries: dict[str, object]) -> dict[str, object]:
    return {"sharing": {"timeSlicing": {"resources": list(entries)}}}


def mps(*entries: dict[str, object]) -> dict[str, object]:
    return {"sharing": {"mps": {"resources": list(entries)}}}


R0 = "sharing.timeSlicing.resources[0]"
M0 = "sharing.mps.resources[0]"


@pytest.mark.parametrize(
    ("document", "path", "phrase"),
    [
        ({"resources": {"gpus": [{"pattern": "", "name": "x"}]}}, "resources.gpus[0].pattern", "must not be empty"),
        (ts(entry(name="")), f"{R0}.name", "must not be empty"),
        (ts({"replicas": 2}), f"{R0}.name", "required field is missing"),
        (ts(entry(replicas=2000)), f"{R0}.replicas", "2000 replicas is more than 1024"),
        (ts(entry(rename="Bad_Name")), f"{R0}.rename", "incorrect format for resource name"),
        (ts(entry(memoryLimit="0")), f"{R0}.memoryLimit", "'0' is out of range: use between 1Mi and 16Ti"),
        (ts(entry(memoryBurstLimit="2Gi")), R0, "memoryBurstLimit needs memoryLimit"),
        (ts(entry(memoryLimit="4Gi", memoryBurstLimit="2Gi")), R0, "is below memoryLimit"),
        (ts(entry(oversubscribe=True)), "sharing.timeSlicing", "oversubscribe only apply to sharing.mps"),
        (mps(entry(memoryLimit="1Gi", memoryBurstLimit="2Gi")), "sharing.mps", "only applies to sharing.timeSlicing"),
        (mps(entry(activeThreadPercentage=101)), f"{M0}.activeThreadPercentage", "must be from 1 to 100 (got 101)"),
        ({"sharing": {"mps": {"resources": None}}}, "sharing.mps.resources", "expected a list, got nothing"),
        ({"flags": {"migStrategy": "several"}}, "flags.migStrategy", "must be 'none', 'single' or 'mixed'"),
        ({"flags": {"mpsRoot": "run/mps"}}, "flags.mpsRoot", "must be an absolute path"),
        ({"flags": ["a"]}, "flags", "expected a mapping of keys to values, got a list"),
        ({"imex": {"channelIDs": [2]}}, "imex.channelIDs", "channelIDs must be [] or [0]"),
        ({"version": "v2"}, "version", "unknown version: v2"),
        ({"match": 5}, "match", "expected a list, got the number 5"),
        ({"migLayout": {"layouts": {1: "x"}}}, "migLayout.layouts", "keys must be text: quote '1'"),
        ({"migLayout": {"layouts": ["x"]}}, "migLayout.layouts", "expected a mapping of keys to values"),
        ({"health": {"xids": [94]}}, "health.xids", "must be a map of XID to effect"),
        ({"health": {"xids": {"94": "explode"}}}, "health.xids", "XID 94:"),
        ({"health": {"xids": {"x": "ignore"}}}, "health.xids", "key "),
        ({"dra": {"gpus": [0, 0]}}, "dra.gpus", "a GPU is named twice"),
        ({"dra": {"gpus": []}}, "dra.gpus", "an empty list serves no GPU"),
        ({"dra": {"dynamicMig": ["GPU-x"]}}, "dra.dynamicMig", "'GPU-x' is neither a GPU index nor a GPU UUID"),
        ({"dra": {"gpuShares": "some"}}, "dra.gpuShares", "expected 'all' or a list of GPU indices and UUIDs"),
        ({"dra": {"driverName": "Not A Name"}}, "dra.driverName", "must be a DNS subdomain"),
        ({"dra": {"consumableShares": "lots"}}, "dra.consumableShares", "is not a consumableShares value"),
        ({"dra": {"defaultShare": True, "gpuShares": "all"}}, "dra.defaultShare", "write a memory size such as 10Gi"),
        ({"dra": {"defaultShare": "1.5Mi", "gpuShares": "all"}}, "dra.defaultShare", "is not a whole number of MiB"),
        ({"dra": {"defaultShare": "1Gi"}}, "dra", "defaultShare is set but gpuShares names no GPU to share"),
        ({"dra": {"defaultShare": "1Gi", "consumableShares": 4}}, "dra", "with consumableShares: 4"),
        ({"dra": {"consumableShares": "disabled", "gpuShares": [0]}}, "dra", "consumableShares is disabled but"),
    ],
    ids=lambda value: None if not isinstance(value, str) else value[:40],
)
def test_each_rule_of_the_walk_refuses_naming_the_field(document: dict[str, object], path: str, phrase: str):
    (problem,) = problems(document)
    where, message = problem.split(": ", 1)
    assert where == path
    assert phrase in message


def test_a_single_device_list_strategy_is_a_list_of_one_and_a_null_is_the_default():
    model, _ = parse_config({"flags": {"plugin": {"deviceListStrategy": "cdi-cri"}, "migStrategy": None}}, "c")
    assert model.flags.plugin is not None and model.flags.plugin.device_list_strategy == ["cdi-cri"]
    assert model.flags.mig_strategy is None
