"""Properties of config -> plan over generated nodes, and robustness of the parser against junk.

Nodes: 1-8 GPUs (A100-80GB or T4), each A100 optionally in MIG mode with a layout the driver accepts,
discovered through real pynvml from the simulator. Configs: time-slicing or MPS, replicas 2..16, each shared
resource with devices all / a count / a list (indices, UUIDs, MIG indices, legacy MIG UUIDs), optionally
split over two entries, renamed or not. Whatever is generated, the plan must be deterministic, device IDs
unique, every replica must map back to one physical device, and every device is either dedicated or shared.
"""

from __future__ import annotations

import functools
import re
from collections import Counter, defaultdict
from dataclasses import dataclass

import pytest
import yaml
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from agent.config.effective import FlagOverrides, effective
from agent.config.model import ConfigError, parse_config
from agent.config.source import parse_document
from agent.core.inventory import Inventory
from agent.core.plan import plan
from agent.core.resources import Device, MigStrategy, PlanConfig, PlanError, ResourcePlan
from agent.gpu.discovery import discover
from agent.sim.nvml.install import simulated_node
from agent.sim.nvml.spec import parse_node_spec

PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# MIG layouts the A100-80GB accepts (created in this order; the driver places them).
MIG_LAYOUTS: tuple[tuple[str, ...], ...] = (
    ("7g.80gb",),
    ("3g.40gb", "3g.40gb"),
    ("3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"),
    ("1g.10gb",) * 7,
    ("2g.20gb", "2g.20gb", "2g.20gb", "1g.10gb"),
    ("4g.40gb", "3g.40gb"),
    ("1g.20gb",) * 4,
    ("1g.10gb+me",),
    ("1g.10gb", "1g.10gb", "3g.40gb"),
    ("1c.3g.40gb", "2c.3g.40gb"),  # compute instances smaller than their GPU instance: never advertised
    (),  # MIG enabled, nothing created
)

# One GPU: "T4", "A100" or a MIG layout on an A100.
gpu_kinds = st.one_of(st.sampled_from(["T4", "A100"]), st.sampled_from(MIG_LAYOUTS))
node_keys = st.lists(gpu_kinds, min_size=1, max_size=8).map(tuple)


@functools.cache
def inventory_of(key: tuple[str | tuple[str, ...], ...]) -> Inventory:
    gpus = []
    for kind in key:
        if kind == "T4":
            gpus.append({"model": "T4"})
        elif kind == "A100":
            gpus.append({"model": "A100-SXM4-80GB"})
        else:
            gpus.append({"model": "A100-SXM4-80GB", "mig": {"instances": list(kind)}})
    with simulated_node(parse_node_spec({"gpus": gpus})):
        return discover()


@dataclass(frozen=True)
class Rule:
    """One generated sharing entry and what it should select."""

    name: str
    target: str
    replicas: int
    selected: tuple[str, ...]  # physical IDs, in plan order
    partial: bool  # selects some but not all of the resource's devices


def ref_for(device: Device, inventory: Inventory, style: int) -> object:
    """A way a user may name ``device`` in ``devices:`` (GPU: index int/text, UUID; MIG: index, UUIDs)."""
    if device.mig_uuid is None:
        return [device.gpu_index, str(device.gpu_index), device.gpu_uuid][style % 3]
    gpu = inventory.gpu_by_uuid(device.gpu_uuid)
    assert gpu is not None
    mig = next(m for m in gpu.mig_devices if m.uuid == device.mig_uuid)
    return [device.index, device.mig_uuid, f"MIG-{gpu.uuid}/{mig.gi_id}/{mig.ci_id}"][style % 3]


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[Inventory, str, ResourcePlan, list[Rule], str]:
    """(node, config text, the plan without sharing, the rules generated, the sharing key)."""
    inventory = inventory_of(draw(node_keys))
    strategy = draw(st.sampled_from(["none", "mixed"]))
    base = plan(PlanConfig(mig_strategy=MigStrategy(strategy)), inventory)
    assume(base.resources)  # e.g. one MIG GPU with nothing created: nothing to share
    has_mig = any(d.mig_uuid for r in base.resources for d in r.devices)
    key = draw(st.sampled_from(["timeSlicing"] if has_mig else ["timeSlicing", "mps"]))
    rename_by_default = draw(st.booleans())
    shared = draw(st.lists(st.sampled_from(base.resources), min_size=1, unique_by=lambda r: r.name))
    entries: list[dict[str, object]] = []
    rules: list[Rule] = []
    for resource in sorted(shared, key=lambda r: r.name):
        devices = list(resource.devices)
        short = resource.name.removeprefix("nvidia.com/")
        split = len(devices) >= 2 and draw(st.booleans())
        if split:  # two entries over disjoint devices, each under its own name
            cut = draw(st.integers(1, len(devices) - 1))
            order = draw(st.permutations(devices))
            groups = [sorted(order[:cut], key=devices.index), sorted(order[cut:], key=devices.index)]
            for n, group in enumerate(groups):
                replicas = draw(st.integers(2, 16))
                refs = [ref_for(d, inventory, draw(st.integers(0, 2))) for d in group]
                target = f"nvidia.com/{short}-part{n}"
                entries.append({"name": resource.name, "rename": target, "replicas": replicas, "devices": refs})
                rules.append(Rule(resource.name, target, replicas, tuple(d.physical_id for d in group), True))
            continue
        replicas = draw(st.integers(2, 16))
        entry: dict[str, object] = {"name": short if draw(st.booleans()) else resource.name, "replicas": replicas}
        form = draw(st.sampled_from(["default", "all", "count", "list"]))
        if form == "all":
            entry["devices"] = "all"
            chosen = devices
        elif form == "count":
            count = draw(st.integers(1, len(devices)))
            entry["devices"] = count
            chosen = devices[:count]
        elif form == "list":
            chosen = sorted(draw(st.lists(st.sampled_from(devices), min_size=1, unique=True)), key=devices.index)
            entry["devices"] = [ref_for(d, inventory, draw(st.integers(0, 2))) for d in chosen]
        else:
            chosen = devices
        target = f"{resource.name}.shared" if rename_by_default else resource.name
        if draw(st.booleans()):
            target = f"nvidia.com/{short}-mine"
            entry["rename"] = target
        entries.append(entry)
        rules.append(
            Rule(resource.name, target, replicas, tuple(d.physical_id for d in chosen), len(chosen) < len(devices))
        )
    flags: dict[str, object] = {"migStrategy": strategy}
    group: dict[str, object] = {"resources": entries}
    if rename_by_default:
        group["renameByDefault"] = True
    document = {"version": "v1", "flags": flags, "sharing": {key: group}}
    return inventory, yaml.safe_dump(document, sort_keys=False), base, rules, key


def configured(text: str, inventory: Inventory) -> ResourcePlan:
    model, warnings = parse_document(text, "generated.yaml", strict=True)
    assert warnings == []
    return plan(effective(model, FlagOverrides()).plan, inventory)


@PROPERTY
@given(scenarios())
def test_generated_configs_give_consistent_plans(scenario: tuple[Inventory, str, ResourcePlan, list[Rule], str]):
    inventory, text, base, rules, key = scenario
    mixes = [r for r in rules if r.partial and r.target == r.name]
    devices = "MIG" if any(p.startswith("MIG-") for r in rules for p in r.selected) else "GPU"
    event(f"{key}, {len(rules)} rule(s), {devices}, {'mix' if mixes else 'ok'}")
    if mixes:  # a subset shared under the resource's own name would mix shared and dedicated devices
        with pytest.raises(PlanError, match="would mix shared and dedicated devices"):
            configured(text, inventory)
        return

    result = configured(text, inventory)

    # deterministic: the same inputs give the identical plan
    assert configured(text, inventory) == result
    assert [r.name for r in result.resources] == sorted(r.name for r in result.resources)

    # device IDs are unique across the whole node
    ids = [d.id for r in result.resources for d in r.devices]
    assert len(ids) == len(set(ids))

    base_physical = {d.physical_id for r in base.resources for d in r.devices}
    shared_physical: set[str] = set()
    by_target: dict[str, list[Rule]] = defaultdict(list)
    for rule in rules:
        by_target[rule.target].append(rule)
    for target, target_rules in by_target.items():
        resource = result.resource(target)
        assert resource is not None, target
        assert str(resource.sharing) == ("mps" if key == "mps" else "time-slicing")
        assert {resource.replicas} == {r.replicas for r in target_rules}
        selected = [p for r in target_rules for p in r.selected]
        # replicas advertised == selected physical devices x replicas
        assert len(resource.devices) == len(selected) * resource.replicas
        # every replica ID is <physical>::<n> and maps back to exactly one selected physical device
        copies: Counter[str] = Counter()
        for device in resource.devices:
            physical, _, n = device.id.partition("::")
            assert physical == device.physical_id
            assert re.fullmatch(r"\d+", n) and int(n) == device.replica
            assert 0 <= device.replica < resource.replicas
            assert physical in selected
            copies[physical] += 1
        assert copies == dict.fromkeys(selected, resource.replicas)
        shared_physical |= set(selected)

    dedicated = [d for r in result.resources if r.name not in by_target for d in r.devices]
    assert all(d.replica is None and "::" not in d.id for d in dedicated)
    dedicated_physical = {d.physical_id for d in dedicated}
    # every device is either dedicated or shared, never both, none lost
    assert dedicated_physical.isdisjoint(shared_physical)
    assert dedicated_physical | shared_physical == base_physical
    assert len(dedicated) == len(dedicated_physical)


@PROPERTY
@given(node_keys, st.sampled_from(["none", "mixed"]))
def test_without_sharing_every_gpu_or_full_mig_instance_is_one_device(key: tuple, strategy: str):
    inventory = inventory_of(key)
    result = configured(f"flags: {{migStrategy: {strategy}}}\n", inventory)
    expected = 0
    for gpu in inventory.gpus:
        if strategy == "none" or not gpu.mig_enabled:
            expected += 1
        else:
            expected += sum(m.is_full_instance for m in gpu.mig_devices)
    devices = [d for r in result.resources for d in r.devices]
    assert len(devices) == expected
    assert len({d.id for d in devices}) == expected


SECTION_KEYS = ("version", "flags", "sharing", "timeSlicing", "mps", "migStrategy")


def recase(text: str, data: st.DataObject) -> str:
    """Change the case of the keys NVIDIA reads case-insensitively (struct keys), leave the others."""

    def swap(match: re.Match[str]) -> str:
        word = match.group(2)
        flips = data.draw(st.lists(st.booleans(), min_size=len(word), max_size=len(word)))
        return match.group(1) + "".join(c.swapcase() if f else c for c, f in zip(word, flips, strict=True)) + ":"

    return re.sub(rf"^(\s*)({'|'.join(SECTION_KEYS)}):", swap, text, flags=re.MULTILINE)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.data())
def test_section_key_case_never_changes_the_plan(scenario: tuple, data: st.DataObject):
    inventory, text, _, rules, _ = scenario
    if any(r.partial and r.target == r.name for r in rules):
        return
    assert configured(recase(text, data), inventory) == configured(text, inventory)


# ----- junk never crashes the parser ------------------------------------------------------------------------

KNOWN_KEYS = [
    "version", "flags", "sharing", "resources", "imex", "match", "timeSlicing", "mps", "renameByDefault",
    "failRequestsGreaterThanOne", "name", "rename", "replicas", "devices", "gpus", "mig", "pattern",
    "migStrategy", "failOnInitError", "plugin", "gfd", "deviceListStrategy", "deviceIDStrategy",
    "sharedDevicesAllocationPolicy", "channelIDs", "required", "TimeSlicing", "VERSION",
]  # fmt: skip
keys = st.one_of(st.sampled_from(KNOWN_KEYS), st.text(max_size=12))
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=16),
    st.sampled_from(["all", "v1", "gpu", "nvidia.com/gpu", "0", "0:1", "mixed", "envvar", "$bad$", "*"]),
)
junk = st.recursive(
    scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(keys, kids, max_size=5), max_leaves=30
)

A_VALID_DOCUMENT = {
    "version": "v1",
    "flags": {"migStrategy": "mixed", "plugin": {"deviceListStrategy": ["envvar"]}},
    "resources": {"gpus": [{"pattern": "*", "name": "gpu"}]},
    "sharing": {
        "timeSlicing": {"renameByDefault": True, "resources": [{"name": "gpu", "replicas": 2, "devices": [0]}]}
    },
    "imex": {"channelIDs": [0]},
}


def paths(node: object, prefix: tuple = ()) -> list[tuple]:
    found = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            found += paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            found += paths(v, (*prefix, i))
    return found


def replaced(document: object, path: tuple, value: object) -> object:
    if not path:
        return value
    copy = dict(document) if isinstance(document, dict) else list(document)  # type: ignore[call-overload]
    copy[path[0]] = replaced(copy[path[0]], path[1:], value)
    return copy


@st.composite
def damaged_documents(draw: st.DrawFn) -> object:
    """A valid document with one part replaced by junk: reaches the deep validators more often."""
    path = draw(st.sampled_from(paths(A_VALID_DOCUMENT)))
    return replaced(A_VALID_DOCUMENT, path, draw(junk))


def a_small_node() -> Inventory:
    return inventory_of(("A100", ("1g.10gb", "1g.10gb", "3g.40gb")))


def check_never_crashes(document: object) -> None:
    try:
        model, warnings = parse_config(document, "junk.yaml")
    except ConfigError as error:
        assert error.problems
        assert all(isinstance(p, str) and p.strip() for p in error.problems)
        event("ConfigError")
        return
    event("parsed" + (" with sharing" if model.replicated else ""))
    assert all(isinstance(w, str) and w.startswith("junk.yaml: ") for w in warnings)
    try:  # what parses must also plan, or be refused with a reason
        plan(effective(model, FlagOverrides()).plan, a_small_node())
    except PlanError as error:
        assert str(error)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(junk, st.dictionaries(keys, junk, max_size=6)))
def test_junk_documents_parse_or_raise_config_error(document: object):
    check_never_crashes(document)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(damaged_documents())
def test_damaged_valid_documents_parse_or_raise_config_error(document: object):
    check_never_crashes(document)


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=200))
def test_junk_text_parses_or_raises_config_error(text: str):
    try:
        parse_document(text, "junk.yaml")
    except ConfigError as error:
        assert error.problems
