"""Scenario 7: fuzzing. Generated config trees never crash or hang the parser; valid ones plan or fail with
PlanError / ConfigError naming the field. Random Allocate / GetPreferredAllocation requests never crash a
running agent: refusals are INVALID_ARGUMENT with a message, and a normal Allocate works afterwards."""

from __future__ import annotations

import functools

import grpc
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.config.effective import FlagOverrides, effective
from agent.config.model import ConfigError, parse_config
from agent.config.source import parse_document
from agent.core.inventory import Inventory
from agent.core.plan import plan
from agent.core.resources import PlanError
from agent.gpu.discovery import discover
from agent.sim.nvml.install import simulated_node
from agent.sim.nvml.spec import parse_node_spec

from .nodes import FOUR_GPUS

KEYS = [
    "version", "flags", "migStrategy", "sharing", "timeSlicing", "mps", "resources", "name", "rename",
    "replicas", "devices", "renameByDefault", "failRequestsGreaterThanOne", "memoryLimit",
    "activeThreadPercentage", "oversubscribe", "plugin", "deviceListStrategy", "mpsRoot", "gpus", "mig",
    "pattern", "imex", "channelIDs", "migLayout", "config", "nonsense",
]  # fmt: skip
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**12), 10**12),
    st.sampled_from(["v1", "all", "mixed", "single", "none", "nvidia.com/gpu", "gpu", "10Gi", "0", "-1", "../x"]),
    st.text(max_size=20),
    st.floats(allow_nan=True),
)
TREES = st.recursive(
    SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.sampled_from(KEYS), children, max_size=5)
    ),
    max_leaves=25,
)


def _schema_like() -> st.SearchStrategy[dict]:
    entry = st.fixed_dictionaries(
        {"name": st.sampled_from(["nvidia.com/gpu", "gpu", "nvidia.com/mig-1g.10gb", "x" * 70, "bad name"])},
        optional={
            "replicas": st.one_of(st.integers(-3, 300), st.just(10**9), st.text(max_size=3)),
            "devices": st.one_of(st.just("all"), st.integers(-1, 9), st.lists(st.integers(-1, 9), max_size=3)),
            "rename": st.sampled_from(["shared", "nvidia.com/gpu.shared", ""]),
            "memoryLimit": st.sampled_from(["10Gi", "1", "10**30", "1" + "0" * 30, "-5Mi"]),
            "activeThreadPercentage": st.integers(-5, 120),
        },
    )
    group = st.fixed_dictionaries(
        {"resources": st.lists(entry, max_size=3)}, optional={"renameByDefault": st.booleans()}
    )
    return st.fixed_dictionaries(
        {"version": st.sampled_from(["v1", "v2", 1])},
        optional={
            "flags": st.fixed_dictionaries({}, optional={"migStrategy": st.sampled_from(["none", "mixed", "x"])}),
            "sharing": st.fixed_dictionaries({}, optional={"timeSlicing": group, "mps": group}),
            "extra": TREES,
        },
    )


@functools.cache
def _inventory() -> Inventory:
    node = parse_node_spec(
        {"gpus": [{"model": "A100-SXM4-80GB", "mig": {"instances": ["3g.40gb", "1g.10gb"]}}, {"model": "T4"}]}
    )
    with simulated_node(node):
        return discover()


def _exercise(document: object) -> str:
    text = yaml.safe_dump(document, allow_unicode=True)
    try:
        model, _ = parse_document(text, "fuzz")
    except ConfigError as error:
        assert error.problems and all(p.strip() for p in error.problems)
        return "rejected"
    model2, _ = parse_config(yaml.safe_load(text), "fuzz")
    assert model2 == model
    try:
        plan(effective(model, FlagOverrides()).plan, _inventory())
    except (PlanError, ConfigError) as error:
        assert str(error).strip()
        return "plan-error"
    return "planned"


@pytest.mark.parametrize(
    "examples", [pytest.param(300, id="ci"), pytest.param(5000, id="long", marks=pytest.mark.long)]
)
def test_generated_configs_never_crash_or_hang(figures, examples: int) -> None:
    outcomes: dict[str, int] = {}

    @settings(max_examples=examples, deadline=2000, suppress_health_check=list(HealthCheck), database=None)
    @given(st.one_of(TREES, _schema_like(), _schema_like()))
    def run(document: object) -> None:
        outcome = _exercise(document)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1

    run()
    figures.update(examples=examples, outcomes=outcomes)
    assert outcomes.get("planned", 0) > 0 and outcomes.get("rejected", 0) > 0


@pytest.mark.parametrize(
    "examples", [pytest.param(300, id="ci"), pytest.param(3000, id="long", marks=pytest.mark.long)]
)
def test_random_allocate_requests_never_crash_the_agent(make_node, figures, examples: int) -> None:
    node = make_node(FOUR_GPUS)
    kubelet = node.kubelet
    node.wait_registered({"nvidia.com/gpu": 4})
    real = sorted(kubelet.devices("nvidia.com/gpu"))
    ids = st.lists(st.one_of(st.sampled_from(real), st.text(max_size=40), st.just("GPU-")), max_size=8)
    tally = {"accepted": 0, "refused": 0}

    def check(call) -> None:
        try:
            call()
            tally["accepted"] += 1
        except grpc.RpcError as error:
            assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
            assert error.details()
            tally["refused"] += 1

    @settings(max_examples=examples, deadline=5000, suppress_health_check=list(HealthCheck), database=None)
    @given(ids, ids, st.integers(-3, 12), st.booleans())
    def run(available: list[str], must: list[str], size: int, preferred: bool) -> None:
        if preferred:
            check(lambda: kubelet.preferred_raw("nvidia.com/gpu", available, must, size))
        else:
            check(lambda: kubelet.allocate_raw("nvidia.com/gpu", available))
        assert node.process.poll() is None

    run()
    response = kubelet.allocate_raw("nvidia.com/gpu", real[:1])
    assert response.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == real[0]
    kubelet.create_pod("after-fuzz", {"main": {"nvidia.com/gpu": 2}})
    figures.update(requests=examples, **tally)
