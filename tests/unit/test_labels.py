"""node_labels(): GPU Feature Discovery's labels (device plugin facts §9) for simulated nodes seen through NVML."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import yaml
from msgspec.structs import replace

from agent.config.effective import FlagOverrides, effective
from agent.config.model import parse_config
from agent.core.inventory import Inventory
from agent.core.plan import plan
from agent.core.resources import MigStrategy, PlanConfig, PlanError, ResourcePlan
from agent.gpu.discovery import discover
from agent.sim.nvml.driver import SimDriver
from agent.sim.nvml.hardware import hardware_table
from agent.sim.nvml.spec import preset_names
from agent.telemetry.labels import (
    MIG_CONFIG_STATE_LABEL,
    gpu_family,
    is_label_key,
    is_label_value,
    label_value,
    node_labels,
    sanitise,
)

SimNode = Callable[[object], SimDriver]
GPU = "nvidia.com/gpu"


@pytest.fixture
def inventory(sim_node: SimNode) -> Callable[[object], Inventory]:
    """``inventory("dgx-a100")`` or ``inventory({"gpus": [...]})``: a simulated node as discovery sees it."""

    def make(spec: object) -> Inventory:
        sim_node(spec)
        return discover()

    return make


def gpus(model: str, count: int = 1, instances: list[str] | None = None) -> dict[str, Any]:
    group: dict[str, Any] = {"model": model, "count": count}
    if instances is not None:
        group["mig"] = {"instances": instances}
    return {"gpus": [group]}


def planned(inventory: Inventory, strategy: str = "none", sharing: str | None = None) -> ResourcePlan:
    """The plan for a config given as YAML text under ``sharing:`` (or no sharing) and a MIG strategy."""
    if sharing is None:
        return plan(PlanConfig(mig_strategy=MigStrategy(strategy)), inventory)
    model, _ = parse_config(yaml.safe_load(f"version: v1\nsharing:\n{sharing}"))
    return plan(effective(model, FlagOverrides(mig_strategy=strategy)).plan, inventory)


def time_slicing(name: str = GPU, replicas: int = 4, extra: str = "", rename_by_default: bool = False) -> str:
    return (
        f"  timeSlicing:\n    renameByDefault: {str(rename_by_default).lower()}\n"
        f"    resources:\n      - {{name: {name}, replicas: {replicas}{extra}}}\n"
    )


def mps(name: str = GPU, replicas: int = 4) -> str:
    return f"  mps:\n    resources:\n      - {{name: {name}, replicas: {replicas}}}\n"


def assert_valid(labels: dict[str, str]) -> None:
    assert list(labels) == sorted(labels)
    bad = {k: v for k, v in labels.items() if not (is_label_key(k) and is_label_value(v))}
    assert not bad, f"invalid Kubernetes labels: {bad}"


# ----- full GPUs ----------------------------------------------------------------------------------------------


def test_dgx_a100_has_gfds_labels(inventory: Callable[[object], Inventory]) -> None:
    node = inventory("dgx-a100")
    assert node_labels(node, planned(node), machine="DGX A100") == {
        "nvidia.com/cuda.driver-version.full": "580.95.05",
        "nvidia.com/cuda.driver-version.major": "580",
        "nvidia.com/cuda.driver-version.minor": "95",
        "nvidia.com/cuda.driver-version.revision": "05",
        "nvidia.com/cuda.driver.major": "580",
        "nvidia.com/cuda.driver.minor": "95",
        "nvidia.com/cuda.driver.rev": "05",
        "nvidia.com/cuda.runtime-version.full": "13.0",
        "nvidia.com/cuda.runtime-version.major": "13",
        "nvidia.com/cuda.runtime-version.minor": "0",
        "nvidia.com/cuda.runtime.major": "13",
        "nvidia.com/cuda.runtime.minor": "0",
        "nvidia.com/gpu.compute.major": "8",
        "nvidia.com/gpu.compute.minor": "0",
        "nvidia.com/gpu.count": "8",
        "nvidia.com/gpu.family": "ampere",
        "nvidia.com/gpu.machine": "DGX-A100",
        "nvidia.com/gpu.memory": "81920",
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB",
        "nvidia.com/gpu.replicas": "1",
        "nvidia.com/gpu.sharing-strategy": "none",
        "nvidia.com/mig.capable": "true",
        "nvidia.com/mps.capable": "false",
    }


def test_t4_is_turing_and_not_mig_capable(inventory: Callable[[object], Inventory]) -> None:
    node = inventory("t4x4")
    labels = node_labels(node, planned(node))
    assert labels["nvidia.com/gpu.product"] == "Tesla-T4"
    assert labels["nvidia.com/gpu.count"] == "4"
    assert labels["nvidia.com/gpu.family"] == "turing"
    assert (labels["nvidia.com/gpu.compute.major"], labels["nvidia.com/gpu.compute.minor"]) == ("7", "5")
    assert labels["nvidia.com/mig.capable"] == "false"
    assert labels["nvidia.com/gpu.memory"] == "15360"
    assert "nvidia.com/mig.strategy" not in labels


@pytest.mark.parametrize(
    ("spec", "product", "family"),
    [
        (gpus("V100-SXM2-16GB", 2), "Tesla-V100-SXM2-16GB", "volta"),
        ("dgx-h100", "NVIDIA-H100-80GB-HBM3", "hopper"),
        (gpus("L4"), "NVIDIA-L4", "ada-lovelace"),
        (gpus("A10G"), "NVIDIA-A10G", "ampere"),
        (gpus("GH200-H100-96GB"), "NVIDIA-GH200-480GB", "hopper"),
    ],
)
def test_families(inventory: Callable[[object], Inventory], spec: object, product: str, family: str) -> None:
    node = inventory(spec)
    labels = node_labels(node, planned(node))
    assert (labels["nvidia.com/gpu.product"], labels["nvidia.com/gpu.family"]) == (product, family)


@pytest.mark.parametrize(
    ("cc", "family"),
    [
        ((1, 3), "tesla"),
        ((2, 1), "fermi"),
        ((3, 7), "kepler"),
        ((5, 2), "maxwell"),
        ((6, 1), "pascal"),
        ((7, 0), "volta"),
        ((7, 2), "volta"),
        ((7, 5), "turing"),
        ((8, 0), "ampere"),
        ((8, 6), "ampere"),
        ((8, 7), "ampere"),
        ((8, 9), "ada-lovelace"),
        ((9, 0), "hopper"),
        ((10, 0), "blackwell"),
        ((12, 0), "blackwell"),
        ((13, 0), "rubin"),
        ((4, 0), "undefined"),
        ((11, 0), "undefined"),
    ],
)
def test_family_table(cc: tuple[int, int], family: str) -> None:
    assert gpu_family(cc) == family


def test_heterogeneous_node_describes_gpu_0s_model(inventory: Callable[[object], Inventory]) -> None:
    node = inventory({"gpus": [{"model": "L4"}, {"model": "T4", "count": 2}]})
    labels = node_labels(node, planned(node))
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-L4"
    assert labels["nvidia.com/gpu.count"] == "1"  # the GPUs of that model, as GFD counts
    assert labels["nvidia.com/gpu.family"] == "ada-lovelace"
    assert labels["nvidia.com/gpu.memory"] == "23034"


# ----- versions, machine, Tessera's label ---------------------------------------------------------------------


def test_versions_machine_and_mig_config_state(inventory: Callable[[object], Inventory]) -> None:
    node = inventory("t4x4")
    labels = node_labels(
        replace(node, driver_version="550.54", cuda_driver_version=12050), planned(node), mig_config_state="success"
    )
    assert labels["nvidia.com/cuda.driver-version.full"] == "550.54"
    assert labels["nvidia.com/cuda.driver-version.revision"] == labels["nvidia.com/cuda.driver.rev"] == ""
    assert labels["nvidia.com/cuda.runtime-version.full"] == "12.5"
    assert labels["nvidia.com/gpu.machine"] == "unknown"
    assert labels[MIG_CONFIG_STATE_LABEL] == "success"

    odd = node_labels(replace(node, driver_version="r580 beta", cuda_driver_version=None), planned(node))
    assert odd["nvidia.com/cuda.driver-version.full"] == "r580-beta"
    assert "nvidia.com/cuda.driver-version.major" not in odd
    assert not any(k.startswith("nvidia.com/cuda.runtime") for k in odd)
    assert MIG_CONFIG_STATE_LABEL not in odd


def test_values_are_sanitised_and_truncated(inventory: Callable[[object], Inventory]) -> None:
    node = inventory("t4x4")
    assert node_labels(node, planned(node), machine="  PowerEdge  R750xa (Dell)\n")["nvidia.com/gpu.machine"] == (
        "PowerEdge-R750xa-Dell"
    )
    assert node_labels(node, planned(node), machine="(((")["nvidia.com/gpu.machine"] == "unknown"
    long_name = "NVIDIA " + "Very Long Product Name " * 5 + "(rev 2)"
    renamed = replace(node, gpus=tuple(replace(g, name=long_name) for g in node.gpus))
    shared = planned(renamed, sharing=time_slicing())
    product = node_labels(renamed, shared, shared_suffix=True)["nvidia.com/gpu.product"]
    assert len(product) <= 63 and product.endswith("-SHARED") and is_label_value(product)
    assert_valid(node_labels(renamed, shared, shared_suffix=True, mig_config_state="pending: reboot!"))


def test_sanitise_is_gfds() -> None:
    assert sanitise("NVIDIA-TITAN-X-(Pascal)") == "NVIDIA-TITAN-X-Pascal"
    assert sanitise("Tesla  V100 SXM2") == "Tesla-V100-SXM2"
    assert label_value("-x_" * 40) == ("-x_" * 40)[1:62]


def test_no_gpus_no_gfd_labels(inventory: Callable[[object], Inventory]) -> None:
    node = inventory({"gpus": []})
    assert node_labels(node, planned(node)) == {}
    assert node_labels(node, planned(node), mig_config_state="success") == {MIG_CONFIG_STATE_LABEL: "success"}


# ----- MIG ----------------------------------------------------------------------------------------------------


def test_mig_mixed_labels_each_profile(inventory: Callable[[object], Inventory]) -> None:
    node = inventory("a100-mig")
    labels = node_labels(node, planned(node, "mixed"))
    assert {k: v for k, v in labels.items() if k.startswith("nvidia.com/mig-")} == {
        "nvidia.com/mig-1g.10gb.count": "7",
        "nvidia.com/mig-1g.10gb.memory": "9728",
        "nvidia.com/mig-1g.10gb.multiprocessors": "14",
        "nvidia.com/mig-1g.10gb.product": "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb",
        "nvidia.com/mig-1g.10gb.replicas": "1",
        "nvidia.com/mig-1g.10gb.sharing-strategy": "none",
        "nvidia.com/mig-1g.10gb.slices.ci": "1",
        "nvidia.com/mig-1g.10gb.slices.gi": "1",
    }
    assert labels["nvidia.com/mig.strategy"] == "mixed"
    # the MIG-enabled parent: GFD's labels without sharing, replicas 0
    assert labels["nvidia.com/gpu.count"] == "1"
    assert labels["nvidia.com/gpu.replicas"] == "0"
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB"


def test_mig_mixed_demo_node(inventory: Callable[[object], Inventory]) -> None:
    node = inventory("demo")  # GPU 0: 3g.40gb + 2g.20gb + 2x 1g.10gb, GPU 1: 7x 1g.10gb, GPUs 2-3 whole
    labels = node_labels(node, planned(node, "mixed"))
    assert labels["nvidia.com/mig-1g.10gb.count"] == "9"
    assert (labels["nvidia.com/mig-3g.40gb.count"], labels["nvidia.com/mig-3g.40gb.slices.gi"]) == ("1", "3")
    assert labels["nvidia.com/mig-2g.20gb.memory"] == "19968"
    assert labels["nvidia.com/gpu.count"] == "4"  # GFD counts every GPU of the model
    assert labels["nvidia.com/gpu.replicas"] == "1"  # GPUs 2-3 are advertised whole


def test_mig_mixed_key_of_a_plus_profile(inventory: Callable[[object], Inventory]) -> None:
    node = inventory(gpus("A100-SXM4-80GB", instances=["1g.10gb+me"]))
    labels = node_labels(node, planned(node, "mixed"))
    assert labels["nvidia.com/mig-1g.10gb.me.count"] == "1"
    assert labels["nvidia.com/mig-1g.10gb.me.product"] == "NVIDIA-A100-SXM4-80GB-MIG-1g.10gbme"  # GFD's sanitise
    assert_valid(labels)


def test_partial_compute_instances_are_not_labelled(inventory: Callable[[object], Inventory]) -> None:
    node = inventory(gpus("A100-SXM4-80GB", instances=["3g.40gb", "1c.3g.40gb"]))
    labels = node_labels(node, planned(node, "mixed"))
    assert labels["nvidia.com/mig-3g.40gb.count"] == "1"
    assert not any(k.startswith("nvidia.com/mig-1c.") for k in labels)


def test_mig_single_overloads_gpu_labels(inventory: Callable[[object], Inventory]) -> None:
    node = inventory("a100-mig")
    labels = node_labels(node, planned(node, "single"))
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb"
    assert labels["nvidia.com/gpu.count"] == "7"
    assert labels["nvidia.com/gpu.memory"] == "9728"
    assert labels["nvidia.com/gpu.replicas"] == "1"
    assert (labels["nvidia.com/gpu.slices.gi"], labels["nvidia.com/gpu.slices.ci"]) == ("1", "1")
    assert labels["nvidia.com/gpu.multiprocessors"] == "14"
    assert labels["nvidia.com/gpu.family"] == "ampere"  # still the parent's
    assert labels["nvidia.com/mig.strategy"] == "single"
    assert not any(k.startswith("nvidia.com/mig-") for k in labels)


def test_mig_single_without_mig_is_none(inventory: Callable[[object], Inventory]) -> None:
    node = inventory("dgx-a100")
    single = node_labels(node, planned(node, "single"))
    assert single.pop("nvidia.com/mig.strategy") == "single"
    assert single == node_labels(node, planned(node))


def test_mig_single_invalid_layout(inventory: Callable[[object], Inventory]) -> None:
    node = inventory("demo")  # two profiles and MIG-disabled GPUs: plan() refuses single
    with pytest.raises(PlanError):
        planned(node, "single")
    labels = node_labels(node, ResourcePlan(resources=(), mig_strategy=MigStrategy.SINGLE))
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB-MIG-INVALID"
    assert (labels["nvidia.com/gpu.count"], labels["nvidia.com/gpu.replicas"]) == ("0", "0")
    assert (labels["nvidia.com/gpu.memory"], labels["nvidia.com/gpu.sharing-strategy"]) == ("0", "")
    assert_valid(labels)


def test_mig_strategy_none_labels_a_mig_gpu_as_whole(inventory: Callable[[object], Inventory]) -> None:
    node = inventory("a100-mig")
    labels = node_labels(node, planned(node))
    assert "nvidia.com/mig.strategy" not in labels
    assert not any(k.startswith("nvidia.com/mig-") for k in labels)
    assert labels["nvidia.com/gpu.replicas"] == "1"  # Tessera advertises it whole under none (GFD says 0)


# ----- sharing ------------------------------------------------------------------------------------------------


def test_time_slicing_labels_without_shared_suffix_by_default(inventory: Callable[[object], Inventory]) -> None:
    node = inventory("t4x4")
    labels = node_labels(node, planned(node, sharing=time_slicing()))
    assert labels["nvidia.com/gpu.replicas"] == "4"
    assert labels["nvidia.com/gpu.sharing-strategy"] == "time-slicing"
    assert labels["nvidia.com/gpu.count"] == "4"  # physical GPUs, not replicas
    assert labels["nvidia.com/gpu.product"] == "Tesla-T4"
    assert labels["nvidia.com/mps.capable"] == "false"


def test_shared_suffix_only_when_not_renamed(inventory: Callable[[object], Inventory]) -> None:
    node = inventory("t4x4")
    same_name = planned(node, sharing=time_slicing())
    assert node_labels(node, same_name, shared_suffix=True)["nvidia.com/gpu.product"] == "Tesla-T4-SHARED"

    by_default = planned(node, sharing=time_slicing(rename_by_default=True))
    assert by_default.resource("nvidia.com/gpu.shared") is not None and by_default.resource(GPU) is None
    labels = node_labels(node, by_default, shared_suffix=True)
    assert labels["nvidia.com/gpu.product"] == "Tesla-T4"
    assert labels["nvidia.com/gpu.replicas"] == "4"  # keys use the original name
    assert not any(k.startswith("nvidia.com/gpu.shared") for k in labels)

    explicit = planned(node, sharing=time_slicing(extra=", rename: nvidia.com/t4-slice"))
    labels = node_labels(node, explicit, shared_suffix=True)
    assert (labels["nvidia.com/gpu.product"], labels["nvidia.com/gpu.replicas"]) == ("Tesla-T4", "4")


def test_sharing_some_gpus(inventory: Callable[[object], Inventory]) -> None:
    node = inventory("t4x4")
    partly = planned(node, sharing=time_slicing(replicas=3, extra=", devices: [1, 2], rename: nvidia.com/t4-slice"))
    labels = node_labels(node, partly, shared_suffix=True)
    assert labels["nvidia.com/gpu.replicas"] == "3"
    assert labels["nvidia.com/gpu.product"] == "Tesla-T4"


def test_mps_labels(inventory: Callable[[object], Inventory]) -> None:
    node = inventory("t4x4")
    labels = node_labels(node, planned(node, sharing=mps()))
    assert labels["nvidia.com/mps.capable"] == "true"
    assert labels["nvidia.com/gpu.sharing-strategy"] == "mps"
    assert labels["nvidia.com/gpu.replicas"] == "4"


def test_mps_on_mig_is_not_mps_capable(inventory: Callable[[object], Inventory]) -> None:
    node = inventory("a100-mig")
    labels = node_labels(node, planned(node, "mixed", sharing=mps("nvidia.com/mig-1g.10gb", 2)))
    assert labels["nvidia.com/mps.capable"] == "false"
    assert labels["nvidia.com/mig-1g.10gb.sharing-strategy"] == "mps"
    assert labels["nvidia.com/mig-1g.10gb.replicas"] == "2"


def test_time_slicing_mig_mixed_and_single(inventory: Callable[[object], Inventory]) -> None:
    node = inventory("a100-mig")
    mixed = planned(node, "mixed", sharing=time_slicing("nvidia.com/mig-1g.10gb", 2))
    labels = node_labels(node, mixed, shared_suffix=True)
    assert labels["nvidia.com/mig-1g.10gb.replicas"] == "2"
    assert labels["nvidia.com/mig-1g.10gb.sharing-strategy"] == "time-slicing"
    assert labels["nvidia.com/mig-1g.10gb.product"] == "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb-SHARED"
    assert labels["nvidia.com/gpu.replicas"] == "0"

    single = node_labels(node, planned(node, "single", sharing=time_slicing(replicas=2)), shared_suffix=True)
    assert single["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb-SHARED"
    assert (single["nvidia.com/gpu.replicas"], single["nvidia.com/gpu.count"]) == ("2", "7")


def test_full_gpus_shared_beside_mig_devices(inventory: Callable[[object], Inventory]) -> None:
    node = inventory("demo")
    labels = node_labels(node, planned(node, "mixed", sharing=time_slicing(replicas=2)))
    assert labels["nvidia.com/gpu.replicas"] == "2"
    assert labels["nvidia.com/mig-1g.10gb.replicas"] == "1"


# ----- every simulated node gives valid Kubernetes labels ----------------------------------------------------


def _every_labelling(node: Inventory) -> list[dict[str, str]]:
    results = []
    for strategy in MigStrategy:
        try:
            advertised = planned(node, str(strategy))
        except PlanError:
            advertised = ResourcePlan(resources=(), mig_strategy=strategy)
        for suffix in (False, True):
            results.append(node_labels(node, advertised, shared_suffix=suffix, machine="Model X (2U)"))
    return results


@pytest.mark.parametrize("preset", preset_names())
def test_every_preset_gives_valid_labels(inventory: Callable[[object], Inventory], preset: str) -> None:
    node = inventory(preset)
    for labels in _every_labelling(node):
        assert_valid(labels)
        assert labels["nvidia.com/gpu.count"] != ""


def _model_specs() -> list[tuple[str, dict[str, Any]]]:
    specs = []
    for key, model in sorted(hardware_table().items()):
        specs.append((key, gpus(key, 2)))
        specs += [(f"{key}/{p.name}", gpus(key, 2, instances=[p.name])) for p in model.gi_profiles]
    return specs


@pytest.mark.parametrize(("case", "spec"), _model_specs(), ids=[case for case, _ in _model_specs()])
def test_every_model_and_mig_profile_gives_valid_labels(
    inventory: Callable[[object], Inventory], case: str, spec: dict[str, Any]
) -> None:
    node = inventory(spec)
    for labels in _every_labelling(node):
        assert_valid(labels)
        assert labels["nvidia.com/gpu.product"]
    if "/" in case:
        mixed = node_labels(node, planned(node, "mixed"))
        assert sum(k.endswith(".count") and k.startswith("nvidia.com/mig-") for k in mixed) == 1


def test_labels_are_deterministic(inventory: Callable[[object], Inventory]) -> None:
    node = inventory("demo")
    advertised = planned(node, "mixed", sharing=time_slicing(replicas=2))
    first = node_labels(node, advertised)
    assert first == node_labels(node, advertised)
    assert list(first) == sorted(first)
