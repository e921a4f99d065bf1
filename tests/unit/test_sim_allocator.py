"""The simulated scheduler's DRA allocator (agent/sim/scheduler): NVIDIA's DeviceClasses and the selectors
claims written for NVIDIA's driver use, evaluated by a real CEL implementation against slices shaped like the
ones NVIDIA's driver (and Tessera) publish."""

from __future__ import annotations

import copy
import itertools
import re
import subprocess
import sys
from typing import Any

import pytest

from agent.sim.scheduler import (
    CELCompileError,
    CELRuntimeError,
    Diagnostics,
    Unschedulable,
    allocate,
    compile_selector,
)
from agent.sim.scheduler.cel import device_variable
from agent.sim.scheduler.values import Quantity, Semver

DRIVER = "gpu.nvidia.com"
NODE = "node-a"
# NVIDIA's DeviceClass selectors, exactly as the chart renders them (facts dra.md C1).
NVIDIA_GPU = "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'"
NVIDIA_MIG = "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'mig'"
AT_LEAST_40GI = "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0"
PIN_NODE = {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [NODE]}]}]}


# ----- builders: NVIDIA's device names, attributes and capacities (facts dra.md C2, C3) -----------------


def attributes(**values: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in values.items():
        if name in ("cudaComputeCapability", "driverVersion", "cudaDriverVersion"):
            out[name] = {"version": value}
        elif isinstance(value, bool):
            out[name] = {"bool": value}
        elif isinstance(value, int):
            out[name] = {"int": value}
        else:
            out[name] = {"string": value}
    return out


def gpu(minor: int, product: str, cc: str, memory: str, **extra: Any) -> dict[str, Any]:
    device = {
        "name": f"gpu-{minor}",
        "attributes": attributes(
            type="gpu",
            uuid=f"GPU-{minor:08x}-aaaa",
            productName=product,
            cudaComputeCapability=cc,
            driverVersion="580.65.6",
            cudaDriverVersion="13.0.0",
        ),
        "capacity": {"memory": {"value": memory}},
    }
    device["attributes"]["resource.kubernetes.io/pciBusID"] = {"string": f"0000:{minor + 7:02x}:00.0"}
    device.update(extra)
    return device


def mig(minor: int, profile: str, gi_profile: int, start: int, memory: str, **extra: Any) -> dict[str, Any]:
    device = {
        "name": f"gpu-{minor}-mig-{profile.replace('.', '')}-{gi_profile}-{start}",
        "attributes": attributes(
            type="mig",
            uuid=f"MIG-{minor:04x}-{start:04x}",
            parentUUID=f"GPU-{minor:08x}-aaaa",
            profile=profile,
            productName="NVIDIA A100-SXM4-80GB",
            cudaComputeCapability="8.0.0",
            driverVersion="580.65.6",
        ),
        "capacity": {"memory": {"value": memory}, "multiprocessors": {"value": "14"}},
    }
    device.update(extra)
    return device


def node_devices() -> list[dict[str, Any]]:
    """gpu-0 and gpu-4 are A100s in static MIG mode; gpu-1 an A100, gpu-2 an H100, gpu-3 a T4."""
    return [
        mig(0, "1g.10gb", 19, 0, "10Gi"),
        mig(0, "1g.10gb", 19, 1, "10Gi"),
        gpu(1, "NVIDIA A100-SXM4-80GB", "8.0.0", "80Gi"),
        gpu(2, "NVIDIA H100 80GB HBM3", "9.0.0", "80Gi"),
        gpu(3, "Tesla T4", "7.5.0", "15Gi"),
        mig(4, "1g.10gb", 19, 0, "10Gi"),
        mig(4, "3g.40gb", 9, 4, "40Gi"),
    ]


def resource_slice(
    devices: list[dict[str, Any]], *, generation: int = 1, count: int = 1, node: str = NODE, index: int = 0, **spec: Any
) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-{DRIVER}-{generation}-{index}"},
        "spec": {
            "driver": DRIVER,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": count},
            "nodeName": node,
            "devices": devices,
            **spec,
        },
    }


def device_class(name: str, *expressions: str, config: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"selectors": [{"cel": {"expression": e}} for e in expressions]}
    if config:
        spec["config"] = config
    return {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": name}, "spec": spec}


CLASSES = {
    "gpu.nvidia.com": device_class("gpu.nvidia.com", NVIDIA_GPU),
    "mig.nvidia.com": device_class("mig.nvidia.com", NVIDIA_MIG),
    "any.gpu.nvidia.com": device_class("any.gpu.nvidia.com", "device.driver == 'gpu.nvidia.com'"),
}


def request(name: str, device_class: str = "gpu.nvidia.com", *selectors: str, **fields: Any) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": device_class, **fields}
    if selectors:
        exactly["selectors"] = [{"cel": {"expression": s}} for s in selectors]
    return {"name": name, "exactly": exactly}


def claim(*requests: dict[str, Any], **devices: Any) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "train", "namespace": "ml", "uid": "3f1c0d6e-1111-2222-3333-444455556666"},
        "spec": {"devices": {"requests": list(requests), **devices}},
    }


def run(
    the_claim: dict[str, Any],
    slices: list[dict[str, Any]] | None = None,
    allocated: set[tuple[str, str, str]] | None = None,
    classes: dict[str, Any] | None = None,
    **options: Any,
) -> dict[str, Any]:
    result = allocate(
        the_claim,
        slices if slices is not None else [resource_slice(node_devices())],
        classes if classes is not None else CLASSES,
        allocated or set(),
        NODE,
        **options,
    )
    return result["status"]["allocation"]


def chosen(allocation: dict[str, Any]) -> list[str]:
    return [r["device"] for r in allocation["devices"]["results"]]


# ----- NVIDIA's classes select Tessera's devices ---------------------------------------------------------


def test_nvidias_gpu_class_selects_the_full_gpus_and_only_them():
    allocation = run(claim(request("gpus", allocationMode="All")))
    assert chosen(allocation) == ["gpu-1", "gpu-2", "gpu-3"]
    assert {r["request"] for r in allocation["devices"]["results"]} == {"gpus"}


def test_nvidias_mig_class_selects_the_mig_devices_and_only_them():
    allocation = run(claim(request("migs", "mig.nvidia.com", allocationMode="All")))
    assert chosen(allocation) == [
        "gpu-0-mig-1g10gb-19-0",
        "gpu-0-mig-1g10gb-19-1",
        "gpu-4-mig-1g10gb-19-0",
        "gpu-4-mig-3g40gb-9-4",
    ]


@pytest.mark.parametrize(
    ("expression", "gpu_matches", "mig_matches"), [(NVIDIA_GPU, True, False), (NVIDIA_MIG, False, True)]
)
def test_the_class_expressions_themselves(expression: str, gpu_matches: bool, mig_matches: bool):
    selector = compile_selector(expression)
    assert selector.matches(device_variable(gpu(1, "NVIDIA A100-SXM4-80GB", "8.0.0", "80Gi"), DRIVER)) is gpu_matches
    assert selector.matches(device_variable(mig(0, "1g.10gb", 19, 0, "10Gi"), DRIVER)) is mig_matches
    other_driver = device_variable(gpu(1, "NVIDIA A100-SXM4-80GB", "8.0.0", "80Gi"), "gpu.example.com")
    assert selector.matches(other_driver) is False


def test_a_gpu_with_at_least_40_gib_gets_exactly_the_allocation_the_api_has():
    result = allocate(
        claim(request("gpu", "gpu.nvidia.com", AT_LEAST_40GI)), [resource_slice(node_devices())], CLASSES, set(), NODE
    )
    assert result["status"] == {
        "allocation": {
            "devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-1"}]},
            "nodeSelector": PIN_NODE,
        }
    }
    assert result["spec"] == claim(request("gpu", "gpu.nvidia.com", AT_LEAST_40GI))["spec"]


def test_two_gpus_with_at_least_40_gib():
    assert chosen(run(claim(request("gpu", "gpu.nvidia.com", AT_LEAST_40GI, count=2)))) == ["gpu-1", "gpu-2"]


@pytest.mark.parametrize(
    "expression",
    [
        "device.attributes['gpu.nvidia.com'].productName.contains('H100')",
        "device.attributes['gpu.nvidia.com'].productName.matches('^NVIDIA H100')",
        "device.attributes['gpu.nvidia.com'].productName.lowerAscii().contains('h100')",
    ],
)
def test_an_h100(expression: str):
    assert chosen(run(claim(request("gpu", "gpu.nvidia.com", expression)))) == ["gpu-2"]


def test_a_mig_1g_10gb():
    selector = "device.attributes['gpu.nvidia.com'].profile == '1g.10gb'"
    assert chosen(run(claim(request("mig", "mig.nvidia.com", selector)))) == ["gpu-0-mig-1g10gb-19-0"]


def test_compute_capability_through_semver():
    at_least_8 = "device.attributes['gpu.nvidia.com'].cudaComputeCapability.compareTo(semver('8.0.0')) >= 0"
    above_8 = "device.attributes['gpu.nvidia.com'].cudaComputeCapability.isGreaterThan(semver('8.0.0'))"
    major_9 = "device.attributes['gpu.nvidia.com'].cudaComputeCapability.major() == 9"
    assert chosen(run(claim(request("gpu", "gpu.nvidia.com", at_least_8, count=2)))) == ["gpu-1", "gpu-2"]
    assert chosen(run(claim(request("gpu", "gpu.nvidia.com", above_8)))) == ["gpu-2"]
    assert chosen(run(claim(request("gpu", "gpu.nvidia.com", major_9)))) == ["gpu-2"]
    with pytest.raises(Unschedulable, match=r'request "gpu" needs 3 devices: .* 2 match the request\'s selectors'):
        run(claim(request("gpu", "gpu.nvidia.com", at_least_8, count=3)))


def test_first_available_falls_back_to_the_next_subrequest():
    h200 = {
        "name": "h200",
        "deviceClassName": "gpu.nvidia.com",
        "selectors": [{"cel": {"expression": "device.attributes['gpu.nvidia.com'].productName.contains('H200')"}}],
    }
    h100 = {
        "name": "h100",
        "deviceClassName": "gpu.nvidia.com",
        "selectors": [{"cel": {"expression": "device.attributes['gpu.nvidia.com'].productName.contains('H100')"}}],
    }
    allocation = run(claim({"name": "gpu", "firstAvailable": [h200, h100]}))
    assert allocation["devices"]["results"] == [
        {"request": "gpu/h100", "driver": DRIVER, "pool": NODE, "device": "gpu-2"}
    ]
    with pytest.raises(Unschedulable, match=r'request "gpu": no subrequest can be allocated: request "gpu/h200"'):
        run(claim({"name": "gpu", "firstAvailable": [h200]}))


def test_match_attribute_on_the_parent_uuid_backtracks_to_a_gpu_with_both_profiles():
    small = request("small", "mig.nvidia.com", "device.attributes['gpu.nvidia.com'].profile == '1g.10gb'")
    large = request("large", "mig.nvidia.com", "device.attributes['gpu.nvidia.com'].profile == '3g.40gb'")
    same_gpu = [{"requests": ["small", "large"], "matchAttribute": "gpu.nvidia.com/parentUUID"}]
    assert chosen(run(claim(small, large, constraints=same_gpu))) == ["gpu-4-mig-1g10gb-19-0", "gpu-4-mig-3g40gb-9-4"]
    # Without the constraint the first 1g.10gb is taken, on gpu-0.
    assert chosen(run(claim(small, large))) == ["gpu-0-mig-1g10gb-19-0", "gpu-4-mig-3g40gb-9-4"]


def test_match_and_distinct_attribute_over_one_request():
    same_product = [{"matchAttribute": "gpu.nvidia.com/productName"}]
    with pytest.raises(
        Unschedulable, match=r"enough matching devices, but not within matchAttribute gpu\.nvidia\.com/productName"
    ):
        run(claim(request("gpu", count=2), constraints=same_product))
    distinct = [{"distinctAttribute": "gpu.nvidia.com/cudaComputeCapability"}]
    assert chosen(run(claim(request("gpu", count=3), constraints=distinct))) == ["gpu-1", "gpu-2", "gpu-3"]
    # Two MIG devices on different GPUs: the second 1g.10gb of gpu-0 is passed over.
    different_gpus = [{"distinctAttribute": "gpu.nvidia.com/parentUUID"}]
    assert chosen(run(claim(request("mig", "mig.nvidia.com", count=2), constraints=different_gpus))) == [
        "gpu-0-mig-1g10gb-19-0",
        "gpu-4-mig-1g10gb-19-0",
    ]


def test_a_tainted_device_is_skipped_unless_the_request_tolerates_it():
    devices = node_devices()
    devices[2]["taints"] = [{"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}]
    slices = [resource_slice(devices)]
    assert chosen(run(claim(request("gpu", "gpu.nvidia.com", AT_LEAST_40GI)), slices)) == ["gpu-2"]
    tolerate = [{"key": "gpu.nvidia.com/xid", "operator": "Exists", "effect": "NoSchedule"}]
    allocation = run(claim(request("gpu", "gpu.nvidia.com", AT_LEAST_40GI, tolerations=tolerate)), slices)
    assert allocation["devices"]["results"] == [
        {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-1", "tolerations": tolerate}
    ]
    wrong_value = [{"key": "gpu.nvidia.com/xid", "operator": "Equal", "value": "48"}]
    assert chosen(run(claim(request("gpu", "gpu.nvidia.com", AT_LEAST_40GI, tolerations=wrong_value)), slices)) == [
        "gpu-2"
    ]
    right_value = [{"key": "gpu.nvidia.com/xid", "value": "79"}]  # operator defaults to Equal
    assert chosen(run(claim(request("gpu", "gpu.nvidia.com", AT_LEAST_40GI, tolerations=right_value)), slices)) == [
        "gpu-1"
    ]
    everything = [{"operator": "Exists"}]
    assert chosen(run(claim(request("gpu", "gpu.nvidia.com", AT_LEAST_40GI, tolerations=everything)), slices)) == [
        "gpu-1"
    ]


def test_taint_effects_none_and_no_execute():
    devices = node_devices()
    devices[2]["taints"] = [{"key": "gpu.nvidia.com/unmonitored", "effect": "None"}]
    assert chosen(run(claim(request("gpu", "gpu.nvidia.com", AT_LEAST_40GI)), [resource_slice(devices)])) == ["gpu-1"]
    devices[2]["taints"] = [{"key": "gpu.nvidia.com/gpu-lost", "effect": "NoExecute"}]
    assert chosen(run(claim(request("gpu", "gpu.nvidia.com", AT_LEAST_40GI)), [resource_slice(devices)])) == ["gpu-2"]
    no_schedule_only = [{"key": "gpu.nvidia.com/gpu-lost", "operator": "Exists", "effect": "NoSchedule"}]
    the_claim = claim(request("gpu", "gpu.nvidia.com", AT_LEAST_40GI, tolerations=no_schedule_only))
    assert chosen(run(the_claim, [resource_slice(devices)])) == ["gpu-2"]


def test_all_fails_while_one_matching_device_has_an_untolerated_taint():
    devices = node_devices()
    devices[3]["taints"] = [{"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}]
    with pytest.raises(
        Unschedulable, match=r"asks for all 3 matching devices: 0 allocated to other claims, 1 with a taint"
    ):
        run(claim(request("gpus", allocationMode="All")), [resource_slice(devices)])


def test_an_already_allocated_device_is_skipped_unless_admin_access():
    taken = {(DRIVER, NODE, "gpu-1")}
    assert chosen(run(claim(request("gpu", "gpu.nvidia.com", AT_LEAST_40GI)), allocated=taken)) == ["gpu-2"]
    admin = run(claim(request("gpu", "gpu.nvidia.com", AT_LEAST_40GI, adminAccess=True)), allocated=taken)
    assert admin["devices"]["results"] == [
        {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-1", "adminAccess": True}
    ]
    with pytest.raises(
        Unschedulable, match=r"3 match class gpu.nvidia.com, 2 match the request's selectors, 1 are not"
    ):
        run(claim(request("gpu", "gpu.nvidia.com", AT_LEAST_40GI, count=2)), allocated=taken)


def test_two_requests_never_share_a_device():
    allocation = run(
        claim(request("a", "gpu.nvidia.com", AT_LEAST_40GI), request("b", "gpu.nvidia.com", AT_LEAST_40GI))
    )
    assert chosen(allocation) == ["gpu-1", "gpu-2"]
    assert [r["request"] for r in allocation["devices"]["results"]] == ["a", "b"]


def test_an_old_pool_generation_is_ignored():
    old = resource_slice([gpu(9, "NVIDIA B200", "10.0.0", "180Gi")], generation=1)
    current = resource_slice(node_devices(), generation=2)
    b200 = "device.attributes['gpu.nvidia.com'].productName.contains('B200')"
    with pytest.raises(Unschedulable, match=r'request "gpu" needs 1 device: 7 devices on node node-a'):
        run(claim(request("gpu", "gpu.nvidia.com", b200)), [old, current])
    assert chosen(run(claim(request("gpu", allocationMode="All")), [old, current])) == ["gpu-1", "gpu-2", "gpu-3"]


def test_an_incomplete_pool_is_ignored():
    devices = node_devices()
    first = resource_slice(devices[:4], count=2)  # the second slice of generation 1 has not arrived
    with pytest.raises(Unschedulable, match=r"ignored: pool gpu.nvidia.com/node-a is incomplete: 1 of 2 slices"):
        run(claim(request("gpu", "gpu.nvidia.com", AT_LEAST_40GI)), [first])
    with pytest.raises(
        Unschedulable, match=r"asks for all devices, but resource pool gpu.nvidia.com/node-a is currently"
    ):
        run(claim(request("gpus", allocationMode="All")), [first])
    second = resource_slice(devices[4:], count=2, index=1)
    assert chosen(run(claim(request("gpu", "gpu.nvidia.com", AT_LEAST_40GI)), [first, second])) == ["gpu-1"]


def test_only_this_nodes_slices_offer_devices():
    other = resource_slice([gpu(0, "NVIDIA H200", "9.0.0", "141Gi")], node="node-b")
    h200 = "device.attributes['gpu.nvidia.com'].productName.contains('H200')"
    with pytest.raises(Unschedulable, match="cannot allocate all claims"):
        run(claim(request("gpu", "gpu.nvidia.com", h200)), [other, resource_slice(node_devices())])
    with pytest.raises(Unschedulable, match="no ResourceSlices for node node-a"):
        run(claim(request("gpu")), [other])


def test_unsatisfiable_names_the_request():
    with pytest.raises(Unschedulable) as caught:
        run(claim(request("small", "mig.nvidia.com"), request("huge", "gpu.nvidia.com", AT_LEAST_40GI, count=5)))
    assert caught.value.reason.startswith("cannot allocate all claims: ")
    assert (
        'request "huge" needs 5 devices: 7 devices on node node-a, 3 match class gpu.nvidia.com' in caught.value.reason
    )


# ----- CEL errors -------------------------------------------------------------------------------------


PROFILE_3G = "device.attributes['gpu.nvidia.com'].profile == '3g.40gb'"


def test_a_missing_attribute_stops_allocation_as_the_scheduler_does():
    """Kubernetes: "Any reference to an unknown field will cause an evaluation error and allocation to abort."
    The search reaches gpu-1 (no ``profile``) before the 3g.40gb device."""
    with pytest.raises(Unschedulable) as caught:
        run(claim(request("mig", "any.gpu.nvidia.com", PROFILE_3G)))
    assert caught.value.reason == (
        "claim ml/train, request mig: selector #0 on device gpu.nvidia.com/node-a/gpu-1: CEL runtime error: "
        "no such key: profile"
    )
    assert caught.value.cel_error == caught.value.reason


def test_with_skip_a_missing_attribute_only_means_no_match_and_the_first_error_is_kept():
    diagnostics = Diagnostics()
    allocation = run(
        claim(request("mig", "any.gpu.nvidia.com", PROFILE_3G)), cel_errors="skip", diagnostics=diagnostics
    )
    assert chosen(allocation) == ["gpu-4-mig-3g40gb-9-4"]
    assert diagnostics.first_cel_error == (
        "claim ml/train, request mig: selector #0 on device gpu.nvidia.com/node-a/gpu-1: CEL runtime error: "
        "no such key: profile"
    )
    assert len(diagnostics.cel_errors) == 3  # gpu-1, gpu-2, gpu-3
    with pytest.raises(Unschedulable, match=r"first CEL error: claim ml/train, request mig: selector #0 on device "):
        run(claim(request("mig", "any.gpu.nvidia.com", PROFILE_3G, count=2)), cel_errors="skip")


@pytest.mark.parametrize(
    "guarded",
    [
        "device.attributes['gpu.nvidia.com'].type == 'mig' && " + PROFILE_3G,
        "has(device.attributes['gpu.nvidia.com'].profile) && " + PROFILE_3G,
        "'profile' in device.attributes['gpu.nvidia.com'] && " + PROFILE_3G,
    ],
)
def test_a_guarded_selector_never_errs(guarded: str):
    diagnostics = Diagnostics()
    assert chosen(run(claim(request("mig", "any.gpu.nvidia.com", guarded)), diagnostics=diagnostics)) == [
        "gpu-4-mig-3g40gb-9-4"
    ]
    assert diagnostics.cel_errors == []


def test_class_selectors_run_first_so_nvidias_mig_class_shields_a_profile_selector():
    assert chosen(run(claim(request("mig", "mig.nvidia.com", PROFILE_3G)))) == ["gpu-4-mig-3g40gb-9-4"]


def test_an_unknown_domain_reads_as_an_empty_map():
    selector = compile_selector("device.attributes['example.com'].model == 'x'")
    with pytest.raises(CELRuntimeError, match="no such key: model"):
        selector.matches(device_variable(gpu(1, "A", "8.0.0", "1Gi"), DRIVER))
    assert (
        compile_selector("'example.com' in device.attributes").matches(
            device_variable(gpu(1, "A", "8.0.0", "1Gi"), DRIVER)
        )
        is False
    )


def test_a_cel_syntax_error_names_the_expression():
    with pytest.raises(CELCompileError) as caught:
        compile_selector("device.driver == ")
    assert "CEL compile error in selector 'device.driver == ': syntax error" in str(caught.value)
    with pytest.raises(Unschedulable, match=r"claim ml/train, request gpu: selector #1: CEL compile error in selector"):
        run(claim(request("gpu", "gpu.nvidia.com", AT_LEAST_40GI, "device.attributes[")))
    broken = {"bad": device_class("bad", "device.driver = 'gpu.nvidia.com'")}
    with pytest.raises(Unschedulable, match=r"class bad: selector #0: CEL compile error"):
        run(claim(request("gpu", "bad")), classes=broken)


@pytest.mark.parametrize(
    ("expression", "problem"),
    [
        ("devices.driver == 'gpu.nvidia.com'", "undeclared reference to 'devices'"),
        ("device.driver.startWith('gpu')", "undeclared reference to 'startWith'"),
        ("quantty('1Gi') == quantity('1Gi')", "undeclared reference to 'quantty'"),
        ("sets.union([1], [2]) == [1, 2]", "undeclared reference to 'sets.union'"),
        ("device.attributes['gpu.nvidia.com'].?profile.orValue('') == ''", "syntax error"),
    ],
)
def test_names_are_checked_when_compiling(expression: str, problem: str):
    with pytest.raises(CELCompileError, match=problem):
        compile_selector(expression)


def test_compiled_selectors_and_failures_are_cached():
    from agent.sim.scheduler.cel import _compile

    assert compile_selector(NVIDIA_GPU) is compile_selector(NVIDIA_GPU)
    before = _compile.cache_info().hits
    for _ in range(2):
        with pytest.raises(CELCompileError):
            compile_selector("device.driver ==== 1")
    assert _compile.cache_info().hits >= before + 1


def test_a_non_boolean_result_and_a_bad_version_attribute_are_runtime_errors():
    device = device_variable(gpu(1, "A100", "8.0.0", "80Gi"), DRIVER)
    with pytest.raises(CELRuntimeError, match="CEL result of type string could not be converted to bool"):
        compile_selector("device.attributes['gpu.nvidia.com'].productName").matches(device)
    bad = gpu(1, "A100", "8.0", "80Gi")  # not semver 2.0.0
    with pytest.raises(CELRuntimeError, match="attribute cudaComputeCapability: parse semantic version"):
        compile_selector("device.driver == 'gpu.nvidia.com'").matches(device_variable(bad, DRIVER))


# ----- the CEL environment -----------------------------------------------------------------------------

A100 = gpu(1, "NVIDIA A100-SXM4-80GB", "8.0.0", "80Gi", allowMultipleAllocations=False)


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        # quantity library
        ("device.capacity['gpu.nvidia.com'].memory.isGreaterThan(quantity('40Gi'))", True),
        ("device.capacity['gpu.nvidia.com'].memory.isLessThan(quantity('40Gi'))", False),
        ("device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('80Gi')) == 0", True),
        ("device.capacity['gpu.nvidia.com'].memory == quantity('81920Mi')", True),
        ("device.capacity['gpu.nvidia.com'].memory.asInteger() == 85899345920", True),
        ("device.capacity['gpu.nvidia.com'].memory.isInteger()", True),
        ("device.capacity['gpu.nvidia.com'].memory.asApproximateFloat() > 8.5e10", True),
        ("device.capacity['gpu.nvidia.com'].memory.sub(quantity('40Gi')).compareTo(quantity('40Gi')) == 0", True),
        ("device.capacity['gpu.nvidia.com'].memory.add(1).isGreaterThan(quantity('80Gi'))", True),
        (
            "quantity('200M').compareTo(quantity('0.2G')) == 0 && quantity('50M').compareTo(quantity('50Mi')) == -1",
            True,
        ),
        ("quantity('1').sign() == 1 && quantity('0').sign() == 0", True),
        ("isQuantity('1.3Gi') && !isQuantity('200K') && !isQuantity('Mi')", True),
        # semver library
        ("device.attributes['gpu.nvidia.com'].driverVersion.isGreaterThan(semver('550.0.0'))", True),
        ("device.attributes['gpu.nvidia.com'].driverVersion.minor() == 65", True),
        ("device.attributes['gpu.nvidia.com'].driverVersion.patch() == 6", True),
        ("device.attributes['gpu.nvidia.com'].cudaComputeCapability == semver('8.0.0')", True),
        ("device.attributes['gpu.nvidia.com'].cudaComputeCapability.isLessThan(semver('v9', true))", True),
        ("semver('1.0.0-rc.1').isLessThan(semver('1.0.0')) && semver('1.0.0+a') == semver('1.0.0+b')", True),
        ("isSemver('1.2.3') && !isSemver('1.2') && isSemver('v1.2', true)", True),
        # strings, regex, lists, sets, bind
        ("device.attributes['gpu.nvidia.com'].productName.split('-')[1] == 'SXM4'", True),
        ("device.attributes['gpu.nvidia.com'].productName.find('[0-9]+GB') == '80GB'", True),
        ("device.attributes['gpu.nvidia.com'].productName.upperAscii().startsWith('NVIDIA A100')", True),
        ("device.attributes['gpu.nvidia.com'].uuid.substring(0, 4) == 'GPU-'", True),
        ("device.attributes['gpu.nvidia.com'].productName.indexOf('A100') == 7", True),
        ("device.attributes['resource.kubernetes.io'].pciBusID.endsWith(':00.0')", True),
        ("['a', 'b'].join('-') == 'a-b' && ' x '.trim() == 'x' && 'aaa'.replace('a', 'b', 2) == 'bba'", True),
        ("[3, 1, 2].sum() == 6 && [3, 1, 2].max() == 3 && [1, 2].isSorted() && [1, 2].indexOf(2) == 1", True),
        ("sets.contains(['gpu', 'mig'], [device.attributes['gpu.nvidia.com'].type])", True),
        ("sets.intersects(['vfio'], ['gpu']) || sets.equivalent([1, 2], [2, 1])", True),
        (
            "cel.bind(nv, device.attributes['gpu.nvidia.com'], nv.type == 'gpu' && nv.productName.contains('A100'))",
            True,
        ),
        ("device.attributes['gpu.nvidia.com'].exists(name, name == 'parentUUID')", False),
        ("device.capacity['gpu.nvidia.com'].all(name, name == 'memory')", True),
        ("device.allowMultipleAllocations == false", True),
        # Kubernetes' equality: different kinds are unequal, numbers compare across types
        ("device.attributes['gpu.nvidia.com'].type == 1", False),
        ("device.attributes['gpu.nvidia.com'].type != 1", True),
        ("1 == 1.0 && 2 > 1.5 && !(1 in ['1'])", True),
    ],
)
def test_kubernetes_cel_functions(expression: str, expected: bool):
    assert compile_selector(expression).matches(device_variable(A100, DRIVER)) is expected


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        ("quantity('200K').sign() == 1", "quantities must match the regular expression"),
        ("semver('8.0') == semver('8.0.0')", "is not a semantic version"),
        ("device.capacity['gpu.nvidia.com'].memory.compareTo(semver('1.0.0')) == 0", "no such overload"),
        ("device.attributes['gpu.nvidia.com'].profile.split('.')[0] == '1g'", "no such key: profile"),
        ("device.driver > 1", re.escape("no matching overload for '_>_' applied to '(string, int)'")),
        ("quantity('1Gi') < quantity('2Gi')", "no matching overload for '_<_'"),  # Kubernetes: a compile error
        ("device.attributes['gpu.nvidia.com'].productName.matches('[')", "missing ]"),
    ],
)
def test_kubernetes_cel_errors(expression: str, error: str):
    with pytest.raises(CELRuntimeError, match=error):
        compile_selector(expression).matches(device_variable(A100, DRIVER))


def test_quantity_and_semver_values():
    assert Quantity.parse("80Gi").amount == 80 * 2**30
    assert Quantity.parse("1.5G").amount == 1_500_000_000
    assert not Quantity.parse("500m").is_integer()
    for bad in ("200K", "Mi", "1,3G", "Three"):
        with pytest.raises(ValueError):
            Quantity.parse(bad)
    ordered = ["1.0.0-alpha", "1.0.0-alpha.1", "1.0.0-alpha.beta", "1.0.0-beta", "1.0.0-beta.2", "1.0.0-beta.11"]
    ordered += ["1.0.0-rc.1", "1.0.0", "8.0.0", "9.0.0", "580.65.6"]
    versions = [Semver(v) for v in ordered]
    assert all(a.compare(b) == -1 for a, b in itertools.pairwise(versions))
    for bad in ("01.0.0", "1.0", "v1.0.0", "1.0.0-01"):
        with pytest.raises(ValueError):
            Semver(bad)
    assert str(Semver.parse("v1.02", normalize=True)) == "1.2.0"


# ----- configs, counters, shapes ----------------------------------------------------------------------


def test_configs_class_first_then_claim_as_the_api_orders_them():
    gpu_config = {
        "opaque": {"driver": DRIVER, "parameters": {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"}}
    }
    mig_config = {
        "opaque": {
            "driver": DRIVER,
            "parameters": {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "MigDeviceConfig"},
        }
    }
    classes = {
        **CLASSES,
        "gpu.nvidia.com": device_class("gpu.nvidia.com", NVIDIA_GPU, config=[gpu_config]),
        "mig.nvidia.com": device_class("mig.nvidia.com", NVIDIA_MIG, config=[mig_config]),
    }
    sharing = {
        "opaque": {"driver": DRIVER, "parameters": {"kind": "GpuConfig", "sharing": {"strategy": "TimeSlicing"}}}
    }
    other = {"opaque": {"driver": "example.com", "parameters": {}}}
    big = {
        "name": "big",
        "firstAvailable": [
            {
                "name": "h200",
                "deviceClassName": "gpu.nvidia.com",
                "selectors": [
                    {"cel": {"expression": "device.attributes['gpu.nvidia.com'].productName.contains('H200')"}}
                ],
            },
            {"name": "any", "deviceClassName": "gpu.nvidia.com"},
        ],
    }
    the_claim = claim(
        request("a", "gpu.nvidia.com"),
        request("m", "mig.nvidia.com"),
        big,
        config=[
            {"requests": ["a"], **sharing},
            {"requests": ["big/h200"], **sharing},  # not the chosen subrequest: dropped
            {"requests": ["big/any"], **sharing},
            other,  # no requests: applies to all, whatever the driver
        ],
    )
    allocation = run(the_claim, classes=classes)
    assert allocation["devices"]["results"] == [
        {"request": "a", "driver": DRIVER, "pool": NODE, "device": "gpu-1"},
        {"request": "m", "driver": DRIVER, "pool": NODE, "device": "gpu-0-mig-1g10gb-19-0"},
        {"request": "big/any", "driver": DRIVER, "pool": NODE, "device": "gpu-2"},
    ]
    assert allocation["devices"]["config"] == [
        {"source": "FromClass", "requests": ["a", "big/any"], **gpu_config},
        {"source": "FromClass", "requests": ["m"], **mig_config},
        {"source": "FromClaim", "requests": ["a"], **sharing},
        {"source": "FromClaim", "requests": ["big/any"], **sharing},
        {"source": "FromClaim", **other},
    ]


def test_shared_counters_keep_overlapping_devices_apart():
    """DynamicMIG's shape (facts dra.md C4), 1.35 split layout: a counters-only slice, then the devices."""
    counters = resource_slice(
        [],
        count=2,
        sharedCounters=[
            {
                "name": "gpu-0-counter-set",
                "counters": {"memory-slice-0": {"value": "1"}, "memory-slice-1": {"value": "1"}},
            }
        ],
    )
    del counters["spec"]["devices"]

    def consumes(*slices: int) -> list[dict[str, Any]]:
        return [{"counterSet": "gpu-0-counter-set", "counters": {f"memory-slice-{i}": {"value": "1"} for i in slices}}]

    devices = [
        gpu(0, "NVIDIA A100-SXM4-80GB", "8.0.0", "80Gi", consumesCounters=consumes(0, 1)),
        mig(0, "1g.10gb", 19, 0, "10Gi", consumesCounters=consumes(0)),
        mig(0, "1g.10gb", 19, 1, "10Gi", consumesCounters=consumes(1)),
    ]
    slices = [counters, resource_slice(devices, count=2, index=1)]
    # The whole GPU and a MIG device on it cannot both be had.
    with pytest.raises(Unschedulable, match="the pool's shared counters"):
        run(claim(request("whole"), request("part", "mig.nvidia.com")), slices)
    assert chosen(run(claim(request("part", "mig.nvidia.com", count=2)), slices)) == [
        "gpu-0-mig-1g10gb-19-0",
        "gpu-0-mig-1g10gb-19-1",
    ]
    # A MIG device allocated to another claim uses its memory slice: the GPU is gone, the other slice is not.
    taken = {(DRIVER, NODE, "gpu-0-mig-1g10gb-19-0")}
    with pytest.raises(Unschedulable):
        run(claim(request("whole")), slices, allocated=taken)
    assert chosen(run(claim(request("part", "mig.nvidia.com")), slices, allocated=taken)) == ["gpu-0-mig-1g10gb-19-1"]


def test_an_allocated_claim_comes_back_unchanged_and_the_input_is_not_modified():
    the_claim = claim(request("gpu"))
    original = copy.deepcopy(the_claim)
    result = allocate(the_claim, [resource_slice(node_devices())], CLASSES, set(), NODE)
    assert the_claim == original
    assert allocate(result, [], {}, set(), NODE) == result


def test_bad_requests():
    with pytest.raises(
        Unschedulable,
        match=re.escape('device class nvidia.com/gpu: deviceclass.resource.k8s.io "nvidia.com/gpu" not found'),
    ):
        run(claim(request("gpu", "nvidia.com/gpu")))
    with pytest.raises(Unschedulable, match="number of requested devices 33 exceeds the claim limit of 32"):
        run(claim(request("gpu", count=33)))
    with pytest.raises(Unschedulable, match="unsupported count mode Some"):
        run(claim(request("gpu", allocationMode="Some")))


def test_a_v1beta1_request_without_exactly():
    assert chosen(run(claim({"name": "gpu", "deviceClassName": "gpu.nvidia.com", "count": 2}))) == ["gpu-1", "gpu-2"]


def test_a_dgx_a100_with_56_mig_devices():
    """Eight A100s with seven 1g.10gb each: seven on one GPU, then one on each of eight GPUs."""
    devices = [mig(minor, "1g.10gb", 19, start, "10Gi") for minor in range(8) for start in range(7)]
    slices = [resource_slice(devices)]
    same_gpu = [{"matchAttribute": "gpu.nvidia.com/parentUUID"}]
    allocation = run(claim(request("mig", "mig.nvidia.com", count=7), constraints=same_gpu), slices)
    assert chosen(allocation) == [f"gpu-0-mig-1g10gb-19-{start}" for start in range(7)]
    taken = {(DRIVER, NODE, f"gpu-0-mig-1g10gb-19-{start}") for start in range(3)}
    allocation = run(claim(request("mig", "mig.nvidia.com", count=7), constraints=same_gpu), slices, allocated=taken)
    assert chosen(allocation) == [f"gpu-1-mig-1g10gb-19-{start}" for start in range(7)]
    spread = [{"distinctAttribute": "gpu.nvidia.com/parentUUID"}]
    allocation = run(claim(request("mig", "mig.nvidia.com", count=8), constraints=spread), slices)
    assert chosen(allocation) == [f"gpu-{minor}-mig-1g10gb-19-0" for minor in range(8)]


def test_importing_the_package_does_not_load_the_cel_library():
    code = "import sys, agent.sim.scheduler\nprint('celpy' in sys.modules, 'lark' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "False"]
