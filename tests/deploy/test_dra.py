"""The DRA deployment: NVIDIA's DeviceClasses and the example claims in deploy/dra/, the dra overlay's named config,
and what docs/dra.md shows.

- Every object in deploy/dra/ (the classes and the examples) is valid Kubernetes, strictly, against 1.34 — the first
  release that serves ``resource.k8s.io/v1`` (DRA's GA) — and the newest supported one (1.37). Not against 1.31, the
  oldest the agent's manifests are validated for: it has no ``resource.k8s.io/v1`` at all (1.31 serves v1alpha3,
  1.32 and 1.33 v1beta1/v1beta2), so the DeviceClasses cannot be applied there and the DRA front end, which
  publishes and reads v1 objects, needs 1.34 (test_oldest_supported_kubernetes_has_no_resource_k8s_io_v1 says so).
- The DeviceClasses are NVIDIA's (names and exact CEL selectors, facts dra.md C1) and select, with the simulated
  scheduler (agent.sim.scheduler: Kubernetes' structured allocator with a real CEL engine), exactly the whole GPUs /
  the MIG devices of the ResourceSlices that ``tessera plan --dra`` prints for simulated nodes, in both the 1.34 and
  the 1.35+ layouts: "NVIDIA's DeviceClass selects Tessera's devices".
- The example claims allocate what they say they do: a GPU with at least 40 GiB on H100 and A100 nodes and nothing
  on a T4 node; a MIG 1g.10gb on the MIG nodes.
- The DRA variants (overlays/dra, dra-mps, dra-mig-manager) grant what dynamic MIG, compute-mode changes
  (time-slicing and MPS per claim) and MPS need: CAP_SYS_ADMIN, the MIG config and monitor capability devices, the
  host PID namespace; dra-mps runs the MPS daemons in the keeper, dra-mig-manager has the layouts
  (test_manifests.py checks each is its variant plus exactly components/dra).
- components/dra's ``dra`` config is valid, and on the rendered ConfigMap gives every GPU to DRA on a node labelled
  ``dra`` and on no other node.
- docs/dra.md: its claim templates allocate, its config is valid, its recipe for DRA in a variant of one's own
  renders to that variant plus DRA's grants and paths, and every file it names exists.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from agent.sim.scheduler import Unschedulable, allocate
from agent.sim.scheduler.values import Quantity
from tests.deploy.conftest import (
    COMPONENTS,
    CONFIGS,
    NEWEST_KUBERNETES,
    OLDEST_KUBERNETES,
    ROOT,
    SUPPORTED_KUBERNETES,
    VARIANTS,
    container,
    daemonset,
    daemonsets,
    keeper_daemonset,
)
from tests.deploy.test_manifests import (
    DRA_COMPONENT,
    DRA_CONFIGS,
    DRA_GRANTS,
    DRA_HOST_PATHS,
    DRA_VARIANTS,
    EXTRA_GRANTS,
    GRANTS,
    HOST_PATHS,
    MIG_DEVICES_ENV,
    MIG_ENV,
    canonical,
    config_map,
    dra_volumes,
    env,
    host_paths,
    keeper_container,
    pod_spec,
    rbac_grants,
    with_dra,
)

DEPLOY = ROOT / "deploy" / "dra"
EXAMPLES = DEPLOY / "examples"
DOC = ROOT / "docs" / "dra.md"
H100_BALANCED = str(Path(__file__).parent / "nodes" / "dgx-h100-balanced.yaml")  # 8 H100s in MIG mode

# DRA is GA from 1.34: the first release whose schemas have resource.k8s.io/v1; and the newest supported.
DRA_KUBERNETES = ("1.34", NEWEST_KUBERNETES)
DRIVER = "gpu.nvidia.com"
# NVIDIA's DeviceClasses, exactly as its chart renders them (facts dra.md C1).
NVIDIA_CLASSES = {
    "gpu.nvidia.com": "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'",
    "mig.nvidia.com": "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'mig'",
}
# Simulated nodes: whole GPUs (H100 80GB, A100 40GB, T4 16GB), an A100 80GB in MIG mode (7 x 1g.10gb), 8 H100s in
# MIG mode (2 x 1g.10gb, 1 x 2g.20gb, 1 x 3g.40gb each).
NODES = ("dgx-h100", "dgx-a100", "t4x4", "a100-mig", H100_BALANCED)
LAYOUTS = {"1.34": "combined", "1.35": "split"}  # the API server's version -> the slices' layout


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]


def deploy_objects() -> list[tuple[Path, dict[str, Any]]]:
    return [(path, obj) for path in sorted(DEPLOY.rglob("*.yaml")) for obj in documents(path)]


def by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {obj["metadata"]["name"]: obj for _, obj in deploy_objects() if obj["kind"] == kind}


def device_classes() -> dict[str, dict[str, Any]]:
    """The DeviceClasses `kubectl apply -f deploy/dra/` installs: NVIDIA's two (the examples' class is apart)."""
    top = (o for path in sorted(DEPLOY.glob("*.yaml")) for o in documents(path))
    return {o["metadata"]["name"]: o for o in top if o["kind"] == "DeviceClass"}


@functools.cache
def _plan_dra(node: str, kubernetes_version: str, config: Path | None = None) -> str:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "agent",
            "plan",
            "--dra",
            "--node",
            node,
            "--format",
            "yaml",
            "--kubernetes-version",
            kubernetes_version,
            *(["--config", str(config)] if config else []),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def slices(node: str, kubernetes_version: str = "1.35", config: Path | None = None) -> list[dict[str, Any]]:
    """The ResourceSlices the agent would publish for every GPU of a simulated node (`tessera plan --dra`)."""
    found = [d for d in yaml.safe_load_all(_plan_dra(node, kubernetes_version, config)) if d is not None]
    assert found and all(s["kind"] == "ResourceSlice" for s in found), node
    return found


def node_name(node_slices: list[dict[str, Any]]) -> str:
    (name,) = {s["spec"]["nodeName"] for s in node_slices}
    return name


def devices(node_slices: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for s in node_slices for d in s["spec"].get("devices", [])}


def claim_from(spec: dict[str, Any], name: str = "claim") -> dict[str, Any]:
    """A ResourceClaim as the controller makes it from a template's spec."""
    meta = {"name": name, "namespace": "default", "uid": "5f0c2c52-7b5e-4a0e-9d5b-3c1f0a9e8d21"}
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": meta, "spec": spec}


def allocated(claim: dict[str, Any], node_slices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The devices the simulated scheduler allocates to the claim on the node (Unschedulable when none fit)."""
    result = allocate(claim, node_slices, device_classes(), set(), node_name(node_slices))
    found = devices(node_slices)
    return [found[r["device"]] for r in result["status"]["allocation"]["devices"]["results"]]


def selected_by_class(class_name: str, node_slices: list[dict[str, Any]]) -> set[str]:
    """Every device of the node the class selects (a request for all of them, no selector of its own)."""
    request = {"name": "all", "exactly": {"deviceClassName": class_name, "allocationMode": "All"}}
    try:
        chosen = allocated(claim_from({"devices": {"requests": [request]}}), node_slices)
    except Unschedulable as error:
        # nothing selected, not a CEL error: the allocator's text for an All request that matches no device
        assert f"all devices of class {class_name} but none match" in str(error), str(error)
        return set()
    return {d["name"] for d in chosen}


def memory(device: dict[str, Any]) -> Quantity:
    return Quantity.parse(device["capacity"]["memory"]["value"])


def tessera(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agent", *args], capture_output=True, text=True, cwd=ROOT, timeout=120, check=False
    )


# ----- the files and their schemas ---------------------------------------------------------------------------


def test_deploy_dra_holds_the_classes_and_the_examples():
    """`kubectl apply -f deploy/dra/` (not recursive) installs NVIDIA's two DeviceClasses and nothing else: the
    example claims and pods are one directory down, applied only on purpose."""
    top = [obj for path in sorted(DEPLOY.glob("*.yaml")) for obj in documents(path)]
    assert sorted((o["kind"], o["metadata"]["name"]) for o in top) == [
        ("DeviceClass", "gpu.nvidia.com"),
        ("DeviceClass", "mig.nvidia.com"),
    ]
    examples = sorted((o["kind"], o["metadata"]["name"]) for _, o in deploy_objects() if o not in top)
    assert examples == [
        ("DeviceClass", "gpu-shared.tessera.dev"),
        ("Pod", "dra-gpu-example"),
        ("Pod", "dra-gpu-share-10gi-example"),
        ("Pod", "dra-gpu-share-20gi-example"),
        ("Pod", "dra-mig-1g-10gb-example"),
        ("ResourceClaimTemplate", "gpu-40gi"),
        ("ResourceClaimTemplate", "gpu-share-10gi"),
        ("ResourceClaimTemplate", "gpu-share-20gi"),
        ("ResourceClaimTemplate", "mig-1g-10gb"),
    ]
    assert all(path.parent == EXAMPLES for path, o in deploy_objects() if o not in top)


@pytest.mark.parametrize("version", DRA_KUBERNETES)
def test_deploy_dra_objects_are_valid_kubernetes(version):
    checked = 0
    for path, obj in deploy_objects():
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            where = f"{path.relative_to(ROOT)}: {obj['kind']}/{obj['metadata']['name']}"
            pytest.fail(f"{where} on {version}: {error.message}")
        checked += 1
    assert checked == 11


def test_oldest_supported_kubernetes_has_no_resource_k8s_io_v1():
    """Why deploy/dra/ is validated from 1.34 on: 1.31 (the oldest the agent's manifests support) has no schema for
    resource.k8s.io/v1 objects, nor has 1.33; kubernetes-validate ships both versions (so this is not a gap in it)."""
    for version in (OLDEST_KUBERNETES, "1.33"):
        for _, obj in deploy_objects():
            if obj["apiVersion"] == "resource.k8s.io/v1":
                with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                    kubernetes_validate.validate(obj, version, strict=True)


# ----- NVIDIA's DeviceClasses select Tessera's devices ---------------------------------------------------------


def test_device_classes_are_nvidias():
    classes = device_classes()
    assert set(classes) == set(NVIDIA_CLASSES)
    for name, expression in NVIDIA_CLASSES.items():
        spec = classes[name]["spec"]
        assert classes[name]["apiVersion"] == "resource.k8s.io/v1"
        assert spec["selectors"] == [{"cel": {"expression": expression}}], name
        # KEP-5004: pods asking for nvidia.com/gpu are served from DRA where no device plugin advertises it
        assert spec.get("extendedResourceName") == ("nvidia.com/gpu" if name == "gpu.nvidia.com" else None), name
        assert "config" not in spec, name


@pytest.mark.parametrize("kubernetes_version", sorted(LAYOUTS))
@pytest.mark.parametrize("node", NODES, ids=lambda n: Path(n).stem)
def test_nvidias_device_classes_select_exactly_tesseras_gpus_and_mig_devices(node, kubernetes_version):
    node_slices = slices(node, kubernetes_version)
    found = devices(node_slices)
    gpus = {name for name, d in found.items() if d["attributes"]["type"]["string"] == "gpu"}
    migs = {name for name, d in found.items() if d["attributes"]["type"]["string"] == "mig"}
    assert gpus | migs == set(found)  # every device is one or the other
    assert gpus or migs
    assert selected_by_class("gpu.nvidia.com", node_slices) == gpus
    assert selected_by_class("mig.nvidia.com", node_slices) == migs


def test_the_simulated_nodes_cover_whole_gpus_and_mig_devices():
    """The class test above is not vacuous: whole GPUs on some nodes, MIG devices on others, both NVIDIA-named."""
    whole = devices(slices("dgx-h100"))
    assert sorted(whole) == [f"gpu-{i}" for i in range(8)]
    mig = devices(slices("a100-mig"))
    assert sorted(mig) == [f"gpu-0-mig-1g10gb-19-{start}" for start in range(7)]
    assert len(devices(slices(H100_BALANCED))) == 32


# ----- the example claims ----------------------------------------------------------------------------------------


def template_claim(name: str) -> dict[str, Any]:
    return claim_from(by_kind("ResourceClaimTemplate")[name]["spec"]["spec"], name)


@pytest.mark.parametrize("node", ["dgx-h100", "dgx-a100"])
def test_example_claim_gets_one_gpu_with_at_least_40_gib(node):
    (device,) = allocated(template_claim("gpu-40gi"), slices(node))
    assert device["attributes"]["type"]["string"] == "gpu"
    assert memory(device).compare(Quantity.parse("40Gi")) >= 0
    # the selector is the one the example promises
    (request,) = by_kind("ResourceClaimTemplate")["gpu-40gi"]["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"]["selectors"] == [
        {"cel": {"expression": "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('40Gi')) >= 0"}}
    ]
    assert request["exactly"]["deviceClassName"] == "gpu.nvidia.com"


def test_example_claim_takes_a_free_gpu_and_none_when_all_are_held():
    node_slices = slices("dgx-h100")
    name = node_name(node_slices)
    held = {(DRIVER, name, f"gpu-{i}") for i in range(7)}
    result = allocate(template_claim("gpu-40gi"), node_slices, device_classes(), held, name)
    assert [r["device"] for r in result["status"]["allocation"]["devices"]["results"]] == ["gpu-7"]
    with pytest.raises(Unschedulable):
        allocate(template_claim("gpu-40gi"), node_slices, device_classes(), held | {(DRIVER, name, "gpu-7")}, name)


def test_example_claim_finds_nothing_on_small_gpus_or_mig_devices():
    with pytest.raises(Unschedulable, match="0 match the request's selectors"):
        allocated(template_claim("gpu-40gi"), slices("t4x4"))  # 16 GB T4s: the selector, not the class, says no
    with pytest.raises(Unschedulable, match=re.escape("0 match class gpu.nvidia.com")):
        allocated(template_claim("gpu-40gi"), slices("a100-mig"))  # a GPU in MIG mode is not a whole GPU


@pytest.mark.parametrize("node", ["a100-mig", H100_BALANCED], ids=lambda n: Path(n).stem)
def test_mig_example_claim_gets_a_1g_10gb(node):
    (device,) = allocated(template_claim("mig-1g-10gb"), slices(node))
    assert device["attributes"]["type"]["string"] == "mig"
    assert device["attributes"]["profile"]["string"] == "1g.10gb"


@pytest.mark.parametrize("kubernetes_version", ["1.34", "1.36"])
def test_mig_example_claim_gets_a_partition_of_a_dynamic_mig_gpu(kubernetes_version):
    dynamic = slices("dgx-h100", kubernetes_version, CONFIGS / "dra-dynamic-mig.yaml")
    (device,) = allocated(template_claim("mig-1g-10gb"), dynamic)
    assert device["name"] == "gpu-0-mig-1g10gb-19-0" and "uuid" not in device["attributes"]  # made by Prepare
    assert device["consumesCounters"][0]["counterSet"] == "gpu-0-counter-set"


@pytest.mark.parametrize("kubernetes_version", ["1.34", "1.36"])
def test_share_example_claims_land_on_one_shared_gpu_with_their_consumed_memory(kubernetes_version):
    from agent.sim.scheduler import devices_in_use

    shared = slices("dgx-a100", kubernetes_version, CONFIGS / "dra-gpu-shares.yaml")
    name, claims = node_name(shared), []
    for template in ("gpu-share-10gi", "gpu-share-20gi"):
        held, consumed = devices_in_use(claims)
        claims.append(allocate(template_claim(template), shared, device_classes(), held, name, consumed=consumed))
    results = [c["status"]["allocation"]["devices"]["results"][0] for c in claims]
    assert [r["device"] for r in results] == ["gpu-0", "gpu-0"]
    assert [r["consumedCapacity"] for r in results] == [
        {"computePercent": "25", "memory": "10Gi"},
        {"computePercent": "0", "memory": "20Gi"},
    ]
    # on GPUs not shared, a claim for memory alone gets a whole GPU with at least that much; one that asks for a
    # compute share finds none (no GPU has that capacity)
    (device,) = allocated(template_claim("gpu-share-20gi"), slices("dgx-a100"))
    assert "allowMultipleAllocations" not in device
    with pytest.raises(Unschedulable, match="0 have the requested capacity free"):
        allocated(template_claim("gpu-share-10gi"), slices("dgx-a100"))


def test_the_shared_resource_class_serves_nvidia_com_gpu_shared_from_shared_gpus_only(tmp_path: Path):
    from agent.sim.scheduler import devices_in_use
    from agent.sim.scheduler.extended import extended_resource_claim

    config = tmp_path / "shares.yaml"
    config.write_text("version: v1\ndra: {enabled: true, gpus: all, gpuShares: [0, 1], defaultShare: 20Gi}\n")
    node_slices = slices("dgx-a100", "1.36", config)
    classes = {**device_classes(), **{n: c for n, c in by_kind("DeviceClass").items() if n not in NVIDIA_CLASSES}}
    assert classes["gpu-shared.tessera.dev"]["spec"]["extendedResourceName"] == "nvidia.com/gpu.shared"
    claims: list[dict[str, Any]] = []
    for n in range(9):  # 4 shares of 20Gi fit on each of the 2 shared GPUs; the 9th finds no room
        container = {"name": "c", "resources": {"limits": {"nvidia.com/gpu.shared": "1"}}}
        pod = {
            "metadata": {"name": f"p{n}", "namespace": "default", "uid": f"uid-{n}"},
            "spec": {"containers": [container]},
        }
        built = extended_resource_claim(pod, classes)
        assert built is not None
        held, consumed = devices_in_use(claims)
        if n == 8:
            with pytest.raises(Unschedulable):
                allocate(built[0], node_slices, classes, held, node_name(node_slices), consumed=consumed)
            break
        claims.append(allocate(built[0], node_slices, classes, held, node_name(node_slices), consumed=consumed))
    devices = [c["status"]["allocation"]["devices"]["results"][0]["device"] for c in claims]
    assert sorted(devices) == ["gpu-0"] * 4 + ["gpu-1"] * 4  # never gpu-2..7: they are not shared


def test_mig_example_claim_finds_nothing_without_mig():
    with pytest.raises(Unschedulable, match=re.escape("0 match class mig.nvidia.com")):
        allocated(template_claim("mig-1g-10gb"), slices("dgx-h100"))


def test_example_pods_use_their_claims_through_dra_only():
    templates = by_kind("ResourceClaimTemplate")
    pods = by_kind("Pod")
    assert pods
    for name, pod in pods.items():
        spec = pod["spec"]
        claims = {c["name"]: c["resourceClaimTemplateName"] for c in spec["resourceClaims"]}
        assert set(claims.values()) <= set(templates), name
        for c in spec["containers"]:
            assert {r["name"] for r in c["resources"]["claims"]} <= set(claims), name
            # the devices come through CDI: no device plugin resource, no NVIDIA runtime class needed
            assert not [r for r in c["resources"].get("limits", {}) if r.startswith("nvidia.com/")], name
        assert "runtimeClassName" not in spec, name
        assert pod["metadata"].get("namespace") is None  # applied where the user wants, next to its template


# ----- the DRA variants: what they grant -----------------------------------------------------------------------


@pytest.mark.parametrize("variant", DRA_VARIANTS)
def test_dra_variants_grant_what_dynamic_mig_compute_modes_and_mps_need(rendered, variant):
    """Prepare creates and destroys MIG devices (dynamic MIG: the MIG "config" capability device, and the "monitor"
    one to find the device just made), sets compute modes and time-slices (time-slicing and MPS per claim:
    CAP_SYS_ADMIN) and runs MPS daemons (the host PID namespace). Still not privileged: drop ALL, no escalation."""
    objects = rendered[variant]
    c, spec = container(objects), pod_spec(objects)
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["SYS_ADMIN"]}
    assert c["securityContext"]["privileged"] is False and c["securityContext"]["allowPrivilegeEscalation"] is False
    assert {k: env(c).get(k) for k in MIG_DEVICES_ENV} == {
        "NVIDIA_MIG_CONFIG_DEVICES": "all",
        "NVIDIA_MIG_MONITOR_DEVICES": "all",
    }
    assert spec["hostPID"] is True
    assert spec["runtimeClassName"] == "nvidia"  # the runtime that mounts the capability devices
    assert host_paths(spec) >= DRA_HOST_PATHS
    assert rbac_grants(variant, objects) == GRANTS | DRA_GRANTS
    keys = set(config_map(objects, "tessera-config")["data"])
    assert {"dra", "dra-dynamic-mig", "dra-gpu-shares"} <= keys


def test_dra_mps_runs_the_claims_mps_daemons_in_the_keeper(rendered):
    """overlays/dra-mps: the agent asks the keeper (its socket, shared through the same host path) to run the MPS
    daemons, so MPS claims and GPU shares outlive agent restarts; overlays/dra has no keeper (the agent's own
    container runs them)."""
    objects = rendered["dra-mps"]
    keeper = keeper_daemonset(objects)
    assert keeper is not None and keeper == keeper_daemonset(rendered["mps"])
    k, agent = keeper_container(objects), container(objects)
    assert k["command"] == ["tessera", "mps-keeper"]
    assert env(agent)["TESSERA_MPS_KEEPER"] == env(k)["TESSERA_MPS_KEEPER"] == "/run/tessera/mps-keeper.sock"
    assert env(agent)["TESSERA_MPS_ROOT"] == env(k)["TESSERA_MPS_ROOT"]
    assert "add" not in k["securityContext"]["capabilities"]  # the keeper itself gets no capability
    assert keeper["spec"]["template"]["spec"]["hostPID"] is True
    assert "dra-gpu-shares" in config_map(objects, "tessera-config")["data"]
    for variant in ("dra", "dra-mig-manager"):
        assert keeper_daemonset(rendered[variant]) is None, variant
        assert "TESSERA_MPS_KEEPER" not in env(container(rendered[variant])), variant
    assert sorted(ds["metadata"]["name"] for ds in daemonsets(objects)) == ["tessera", "tessera-mps-keeper"]


def test_dra_mig_manager_has_the_layouts_and_both_kinds_of_configs(rendered):
    objects = rendered["dra-mig-manager"]
    c = container(objects)
    assert {k: env(c).get(k) for k in MIG_ENV} == MIG_ENV
    assert set(config_map(objects, "tessera-mig-layouts")["data"]) == {"config.yaml"}
    keys = set(config_map(objects, "tessera-config")["data"])
    assert keys == set(config_map(rendered["mig-manager"], "tessera-config")["data"]) | set(DRA_CONFIGS)
    assert host_paths(pod_spec(objects)) == HOST_PATHS | DRA_HOST_PATHS


@pytest.mark.parametrize("version", SUPPORTED_KUBERNETES)
@pytest.mark.parametrize("variant", DRA_VARIANTS)
def test_dra_variants_are_valid_kubernetes(rendered, variant, version):
    """Each DRA variant, combined ones included, rendered by kubectl's kustomize and validated strictly (as every
    variant is in test_manifests; here by name, so that removing an overlay fails)."""
    assert variant in VARIANTS
    for obj in rendered[variant]:
        kubernetes_validate.validate(obj, version, strict=True)
    assert EXTRA_GRANTS[variant] == DRA_GRANTS


# ----- the DRA component's named config ----------------------------------------------------------------------------


def test_overlay_config_is_valid_and_gives_every_gpu_to_dra():
    path = DRA_CONFIGS["dra"]
    assert path.parent == DRA_COMPONENT
    result = tessera("validate", "--strict", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert yaml.safe_load(path.read_text(encoding="utf-8")) == {
        "version": "v1",
        "dra": {"enabled": True, "driverName": DRIVER, "gpus": "all"},
    }


def _mounted_config(tmp_path: Path, rendered: dict[str, list[dict[str, Any]]]) -> Path:
    """The dra variant's tessera-config as the kubelet mounts it (one file per key)."""
    directory = tmp_path / "config"
    directory.mkdir()
    for key, text in config_map(rendered["dra"], "tessera-config")["data"].items():
        (directory / key).write_text(text, encoding="utf-8")
    return directory


def test_only_nodes_labelled_dra_give_their_gpus_to_dra(tmp_path, rendered):
    mounted = str(_mounted_config(tmp_path, rendered))
    labelled = tessera("plan", "--dra", "--node", "dgx-h100", "--config", mounted, "--node-label=dra", "--format=yaml")
    assert labelled.returncode == 0, labelled.stderr
    assert "config dra:" in labelled.stderr and "does not enable dra" not in labelled.stderr
    assert "stay with the device plugin" not in labelled.stderr
    published = [d for d in yaml.safe_load_all(labelled.stdout) if d]
    assert sorted(devices(published)) == [f"gpu-{i}" for i in range(8)]
    assert {s["spec"]["driver"] for s in published} == {DRIVER}
    for label in ((), ("--node-label", "time-slicing-4")):  # unlabelled, or another config: no DRA
        other = tessera("plan", "--dra", "--node", "dgx-h100", "--config", mounted, *label)
        assert other.returncode == 0, other.stderr
        assert "the config does not enable dra" in other.stderr, label


# ----- docs/dra.md -------------------------------------------------------------------------------------------------


def doc_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.DOTALL)


def test_docs_claim_templates_are_valid_and_allocate_on_tesseras_slices():
    """Each template the document shows is valid on 1.34 and 1.37, allocates on one of the simulated nodes (what it
    asks for exists) and not on the T4 node (it does select)."""
    objects = [yaml.safe_load(b) for b in doc_blocks("yaml")]
    templates = [o for o in objects if isinstance(o, dict) and o.get("kind") == "ResourceClaimTemplate"]
    assert len(templates) >= 3
    for template in templates:
        name = template["metadata"]["name"]
        for version in DRA_KUBERNETES:
            kubernetes_validate.validate(template, version, strict=True)
        claim = claim_from(template["spec"]["spec"], name)
        fits = []
        for node in NODES:
            try:
                allocated(claim, slices(node))
            except Unschedulable:
                continue
            fits.append(Path(node).stem)
        assert fits and "t4x4" not in fits, (name, fits)
    names = {t["metadata"]["name"] for t in templates} | set(by_kind("ResourceClaimTemplate"))
    for pod in (o for o in objects if isinstance(o, dict) and o.get("kind") == "Pod"):
        for version in DRA_KUBERNETES:
            kubernetes_validate.validate(pod, version, strict=True)
        assert {c["resourceClaimTemplateName"] for c in pod["spec"]["resourceClaims"]} <= names


def test_docs_dra_config_is_valid(tmp_path):
    (config,) = [b for b in doc_blocks("yaml") if re.match(r"version: v1\ndra:", b)]
    path = tmp_path / "dra.yaml"
    path.write_text(config, encoding="utf-8")
    result = tessera("validate", "--strict", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_docs_recipe_adds_dra_to_a_variant_of_ones_own(kubectl, rendered, tmp_path):
    """The document's overlay for DRA in a variant of one's own: a variant plus components/dra. It must render to that
    variant plus exactly what the DRA variants add (paths, env, grants, privileges, configs)."""
    (recipe,) = [yaml.safe_load(b) for b in doc_blocks("yaml") if "components/dra" in b and "kind: Kustomization" in b]
    (variant,) = recipe["resources"]
    assert variant.startswith("../tessera/daemonset/overlays/")
    name = variant.rsplit("/", 1)[1]
    assert recipe["components"] == ["../tessera/daemonset/components/dra"]
    recipe["resources"] = [os.path.relpath(VARIANTS[name], tmp_path)]
    recipe["components"] = [os.path.relpath(COMPONENTS["dra"], tmp_path)]
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(recipe), encoding="utf-8")
    objects = kubectl.kustomize(tmp_path)
    spec = pod_spec(objects)
    assert canonical(daemonset(objects)) == canonical(with_dra(daemonset(rendered[name]), dra_volumes(spec)))
    assert host_paths(spec) == HOST_PATHS | DRA_HOST_PATHS
    assert rbac_grants("recipe", objects) == GRANTS | EXTRA_GRANTS.get(name, set()) | DRA_GRANTS
    keys = set(config_map(objects, "tessera-config")["data"])
    assert keys == set(config_map(rendered[name], "tessera-config")["data"]) | set(DRA_CONFIGS)


def test_docs_name_only_files_that_exist():
    text = DOC.read_text(encoding="utf-8")
    named = set(
        re.findall(r"(?<![\w/.])((?:deploy/dra|daemonset/(?:overlays|components)/dra)(?:[\w.-]*)(?:/[\w.-]+)*/?)", text)
    )
    assert {
        "deploy/dra/",
        "daemonset/overlays/dra",
        "daemonset/overlays/dra-mps",
        "daemonset/overlays/dra-mig-manager",
    } <= named
    for path in named:
        assert (ROOT / path).exists(), path
    for link in re.findall(r"\]\((\.\./[^)#]+)", text):
        assert (DOC.parent / link).resolve().exists(), link
    assert "kubectl apply -k daemonset/overlays/dra" in text and "kubectl apply -f deploy/dra/" in text


def test_docs_toleration_lets_a_claim_have_a_device_tessera_tainted_unmonitored():
    """Tessera's `unmonitored` taint is NoSchedule (NVIDIA's is None, information only): a device whose health watch
    keeps failing is given to no claim that does not tolerate it; the request the document shows does tolerate it."""
    from datetime import UTC, datetime

    from agent.core.dra.devices import DraDevice
    from agent.core.dra.taints import device_taints
    from agent.core.health import HealthState, record_fault

    node_slices = slices("dgx-h100")
    gpus = devices(node_slices)
    uuids = {name: d["attributes"]["uuid"]["string"] for name, d in gpus.items()}
    health = HealthState()
    for uuid in uuids.values():
        health = record_fault(health, [uuid], "health watch failed: NVML_ERROR_UNKNOWN", 1.0)
    inventory = [DraDevice(name, "gpu", uuid, None, 0, {}, {}) for name, uuid in uuids.items()]
    taints = device_taints(inventory, health, now=datetime(2026, 7, 1, tzinfo=UTC))
    for name, device in gpus.items():
        device["taints"] = [{"key": t.key, "effect": t.effect, "timeAdded": t.time_added} for t in taints[name]]
    assert {t["key"] for d in gpus.values() for t in d["taints"]} == {"gpu.nvidia.com/unmonitored"}
    (request,) = [yaml.safe_load(b)[0] for b in doc_blocks("yaml") if "gpu.nvidia.com/unmonitored" in b]
    plain = {"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}
    with pytest.raises(Unschedulable):
        allocated(claim_from({"devices": {"requests": [plain]}}), node_slices)
    (device,) = allocated(claim_from({"devices": {"requests": [request]}}), node_slices)
    assert device["name"] in gpus
