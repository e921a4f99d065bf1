"""The kustomize manifests in daemonset/, rendered by kubectl's kustomize (tests/deploy/kubectl.py) and checked.

Every kustomization under daemonset/ is a variant (conftest.VARIANTS finds them): base and each overlay.
Components (daemonset/components/, conftest.COMPONENTS) are checked in the variants that include them: the
MPS keeper's (a second DaemonSet, tessera-mps-keeper, in the mps variant).

Every rendered object is validated with kubernetes-validate (strict: unknown fields are errors) against
the oldest and the newest supported Kubernetes version. Custom resources (the Prometheus operator's
ServiceMonitor) have no schema there and are skipped by kind; their fields are checked by hand below.
Then the fields that matter for security and operation: no privileged container, capabilities, the exact
hostPath set, RBAC (exactly the API access each variant grants), probes, the downward API, the ConfigMap
keys, and the MPS keeper: what it may do and what it shares with the agent.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from copy import deepcopy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.deploy.conftest import (
    AGENT,
    COMPONENTS,
    CONFIGS,
    DAEMONSET,
    KEEPER,
    KUSTOMIZATION_FILES,
    PODS,
    ROOT,
    SUPPORTED_KUBERNETES,
    VARIANTS,
    config_files,
    container,
    daemonset,
    daemonsets,
    has_mig_layout,
    keeper_daemonset,
    project,
)
from tests.deploy.kubectl import MIN_KUBECTL, MIN_KUSTOMIZE, NEEDED, RenderError

NAMESPACE = "tessera-system"
# Custom resources: not in kubernetes-validate's schemas (it ships the built-in API only).
CUSTOM_KINDS = {"ServiceMonitor"}
# The agent's hostPath volumes in every variant, exactly: (host path, type, mount path, read-only).
HOST_PATHS = {
    ("/var/lib/kubelet/device-plugins", "Directory", "/var/lib/kubelet/device-plugins", False),
    ("/var/lib/kubelet/pod-resources", "Directory", "/var/lib/kubelet/pod-resources", True),
    ("/run/nvidia/mps", "DirectoryOrCreate", "/run/nvidia/mps", False),
    (
        "/etc/kubernetes/node-feature-discovery/features.d",
        "DirectoryOrCreate",
        "/etc/kubernetes/node-feature-discovery/features.d",
        False,
    ),
    ("/proc", "Directory", "/host/proc", True),
    # memory limits: the host's cgroup v2 tree where the host has it (NVML is given a container's cgroup by this
    # path) and the kubelet's container log links (a starting container's ID); the agent only reads both
    ("/sys/fs/cgroup", "Directory", "/sys/fs/cgroup", True),
    ("/var/log/containers", "DirectoryOrCreate", "/var/log/containers", True),
}
MPS_ROOT = ("/run/nvidia/mps", "DirectoryOrCreate", "/run/nvidia/mps", False)
# The directory of the MPS keeper's socket, which the keeper and the agent mount from the same host path.
KEEPER_SOCKET_DIRECTORY = ("/run/tessera", "DirectoryOrCreate", "/run/tessera", False)
# The DRA driver's directories (overlays/dra), each at the host's path: the kubelet is handed these paths (the
# registration socket in the plugin watcher's directory, the DRA socket and checkpoint under the plugins
# directory) and the container runtime reads the claims' CDI specs from the host's /var/run/cdi. The host's root,
# read-only at /driver-root (CONTAINER_DRIVER_ROOT): the specs name the driver's files and device nodes as the host
# has them, so the agent reads them there (agent.gpu.driver_root).
DRIVER_ROOT = ("/", "Directory", "/driver-root", True)
DRA_HOST_PATHS = {
    ("/var/lib/kubelet/plugins_registry", "Directory", "/var/lib/kubelet/plugins_registry", False),
    ("/var/lib/kubelet/plugins", "DirectoryOrCreate", "/var/lib/kubelet/plugins", False),
    ("/var/run/cdi", "DirectoryOrCreate", "/var/run/cdi", False),
    DRIVER_ROOT,
}
# The variants with the DRA front end (components/dra), exactly, each with the variant it adds DRA to.
DRA_VARIANTS = {"dra": "base", "dra-mps": "mps", "dra-mig-manager": "mig-manager"}
# What a variant adds to the agent's HOST_PATHS; every other variant (a new overlay too) has HOST_PATHS alone.
EXTRA_HOST_PATHS = {
    "mps": {KEEPER_SOCKET_DIRECTORY},
    "dra": DRA_HOST_PATHS,
    "dra-mps": DRA_HOST_PATHS | {KEEPER_SOCKET_DIRECTORY},
    "dra-mig-manager": DRA_HOST_PATHS,
}
# The MPS keeper's hostPath volumes, exactly: the MPS root and its socket's directory.
KEEPER_HOST_PATHS = {MPS_ROOT, KEEPER_SOCKET_DIRECTORY}
# The one hostPath mount with a subPath, in the agent and the keeper: <mps root>/shm as the container's
# /dev/shm, shared with the MPS clients (which get the same host directory at /dev/shm).
SHM_MOUNT = {"name": "mps-root", "mountPath": "/dev/shm", "subPath": "shm"}
# The variants with the MPS keeper (components/mps-keeper), exactly.
KEEPER_VARIANTS = {"mps", "dra-mps"}
# What components/mps-keeper adds to the agent's environment, and nothing more.
KEEPER_ENV = {"TESSERA_MPS_KEEPER": "/run/tessera/mps-keeper.sock"}
# What overlays/dra adds to the agent's environment, and nothing more: the three directories (flag twins of
# `tessera run`) and POD_UID from the downward API (socket names per pod, for a rolling update).
DRA_ENV = {
    "TESSERA_DRA_REGISTRY_DIR": "/var/lib/kubelet/plugins_registry",
    "TESSERA_DRA_PLUGINS_DIR": "/var/lib/kubelet/plugins",
    "TESSERA_CDI_ROOT": "/var/run/cdi",
    "POD_UID": {"fieldRef": {"fieldPath": "metadata.uid"}},
    "CONTAINER_DRIVER_ROOT": "/driver-root",  # NVIDIA's variable: where the agent sees the host's driver root
}
# The MIG capability devices the NVIDIA runtime mounts (components/gpu-admin, with CAP_SYS_ADMIN): "config" to
# create and destroy GPU and compute instances, "monitor" to list every MIG device.
MIG_DEVICES_ENV = {"NVIDIA_MIG_CONFIG_DEVICES": "all", "NVIDIA_MIG_MONITOR_DEVICES": "all"}
# What MIG and MPS may add to the base container, and nothing more.
MIG_ENV = {"TESSERA_MIG_CONFIG": "/etc/tessera/mig/config.yaml", **MIG_DEVICES_ENV}
# The API access of every variant, exactly, as (API group, resource, verb); daemonset/base/rbac.yaml and
# daemonset/overlays/node-labels/rbac.yaml say why each is there. Widening any of this is a security
# decision: change these sets in the same commit, on purpose.
NODE_READ = {("", "nodes", verb) for verb in ("get", "list", "watch")}  # its own Node's labels
EVENTS = {(group, "events", verb) for group in ("events.k8s.io", "") for verb in ("create", "patch")}
GRANTS = NODE_READ | EVENTS
# The DRA driver's calls (overlays/dra/rbac.yaml says why each is there): this node's ResourceSlices listed and
# watched (field-selected), created, replaced (PUT) and deleted; the ResourceClaim the kubelet asks it to prepare
# read by name. No `get` on slices (never read by name), no list/watch on claims, no patch, no deletecollection.
DRA_GRANTS = {("resource.k8s.io", "resourceslices", v) for v in ("list", "watch", "create", "update", "delete")} | {
    ("resource.k8s.io", "resourceclaims", "get"),
    ("resource.k8s.io", "resourceclaims/status", "patch"),  # status.devices after Prepare (agent.dra.claims_api)
}
# What an opt-in overlay adds to GRANTS; every other variant (a new overlay too) grants GRANTS alone.
EXTRA_GRANTS = {"node-labels": {("", "nodes", "patch")}, **{variant: DRA_GRANTS for variant in DRA_VARIANTS}}
RBAC_KINDS = {"Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding"}
# Named configs an overlay adds to tessera-config that are not copies of the catalogue (configs/), by key, with
# the file each is generated from: they work only with that overlay, so they ship only there. components/dra's
# `dra` gives a node's GPUs to DRA, which needs the component's host paths and RBAC; every DRA variant has it. Not
# in a configs/ directory: test_config_copies_in_daemonset_are_identical_to_the_catalogue checks those.
DRA_COMPONENT = DAEMONSET / "components" / "dra"
DRA_CONFIGS = {
    "dra": DRA_COMPONENT / "dra.yaml",
    "dra-dynamic-mig": DRA_COMPONENT / "dra-dynamic-mig.yaml",  # a copy of configs/'s
    "dra-gpu-shares": DRA_COMPONENT / "dra-gpu-shares.yaml",  # a copy of configs/'s
}
OVERLAY_CONFIGS = {variant: DRA_CONFIGS for variant in DRA_VARIANTS}
# The variants with the MIG layout manager (overlays/mig-manager): they ship the catalogue's configs with a layout.
MIG_LAYOUT_VARIANTS = {"mig-manager", "dra-mig-manager"}
READ_VERBS = {"get", "list", "watch"}


def pod_spec(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """The agent's pod spec."""
    return daemonset(objects)["spec"]["template"]["spec"]


def keeper_pod_spec(objects: list[dict[str, Any]]) -> dict[str, Any]:
    keeper = keeper_daemonset(objects)
    assert keeper is not None, "no MPS keeper"
    return keeper["spec"]["template"]["spec"]


def keeper_container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (found,) = keeper_pod_spec(objects)["containers"]
    return found


def all_containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return spec["containers"] + spec.get("initContainers", [])


def env(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def host_paths(spec: dict[str, Any]) -> set[tuple[str, str, str, bool]]:
    """A pod spec's hostPath mounts (but the subPath ones) as (host path, type, mount path, read-only)."""
    volumes = {v["name"]: v["hostPath"] for v in spec["volumes"] if "hostPath" in v}
    found = set()
    for c in all_containers(spec):
        for m in c["volumeMounts"]:
            if m["name"] in volumes and "subPath" not in m:
                hp = volumes[m["name"]]
                found.add((hp["path"], hp.get("type", ""), m["mountPath"], bool(m.get("readOnly"))))
    assert {p for p, *_ in found} == {v["path"] for v in volumes.values()}, "a hostPath volume is never mounted"
    return found


def sub_path_mounts(c: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for m in c["volumeMounts"] if "subPath" in m]


def host_location(spec: dict[str, Any], c: dict[str, Any], path: str) -> str:
    """Where `path` of container `c` is on the host: through the hostPath volume mounted at its longest
    prefix (fails when that volume is not a hostPath one, or when no volume holds the path)."""
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = [m for m in c["volumeMounts"] if Path(path).is_relative_to(m["mountPath"])]
    assert mounts, f"{path} is on no volume of {c['name']}"
    mount = max(mounts, key=lambda m: len(Path(m["mountPath"]).parts))
    volume = volumes[mount["name"]]
    assert "hostPath" in volume, f"{c['name']}: {path} is on {mount['name']}, not a hostPath volume"
    return str(Path(volume["hostPath"]["path"], mount.get("subPath", ""), Path(path).relative_to(mount["mountPath"])))


def canonical(ds: dict[str, Any]) -> dict[str, Any]:
    """A DaemonSet with its lists that merge by key (env, volumes, volume mounts) in one order: strategic
    merge patches put what they add first."""
    ds = deepcopy(ds)
    spec = ds["spec"]["template"]["spec"]
    spec["volumes"] = sorted(spec["volumes"], key=lambda v: v["name"])
    for c in all_containers(spec):
        c["env"] = sorted(c.get("env", []), key=lambda e: e["name"])
        c["volumeMounts"] = sorted(c.get("volumeMounts", []), key=lambda m: m["mountPath"])
    return ds


def kustomization(directory: Path) -> dict[str, Any]:
    (path,) = [directory / name for name in KUSTOMIZATION_FILES if (directory / name).is_file()]
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def flag_twins(command: str) -> set[str]:
    """The environment twins of `tessera <command>`'s flags, from its --help."""
    out = subprocess.run(
        [sys.executable, "-m", "agent", command, "--help"], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout
    groups = re.findall(r"\[env\s+([^\]]+)\]", out)  # "[env A]", "[env A, B]", "[env A=true]", wrapped or not
    return {name for group in groups for name in re.findall(r"(?:^|,)\s*([A-Z_]+)", group)}


def config_map(objects: list[dict[str, Any]], name: str) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == name]
    return found


# ----- rendering and schema validation ---------------------------------------------------------------


def test_every_kustomization_is_a_variant():
    """conftest finds the variants; make sure it finds the ones the docs name (and the tests rely on), and
    that a Component, which kustomize cannot render alone, is not one."""
    assert {"base", "mig-manager", "mps", "service-monitor", "node-labels", *DRA_VARIANTS} <= set(VARIANTS)
    assert {"mps-keeper", "gpu-admin", "dra"} <= set(COMPONENTS)
    assert not set(COMPONENTS.values()) & set(VARIANTS.values())
    for name, directory in VARIANTS.items():
        assert kustomization(directory).get("kind", "Kustomization") == "Kustomization", name
    for name, directory in COMPONENTS.items():
        assert kustomization(directory)["kind"] == "Component", name


def included_components(directory: Path) -> set[Path]:
    """Every component a kustomization renders with: its own, theirs, and those of the kustomizations it takes
    as resources (an overlay built on another variant)."""
    found: set[Path] = set()
    spec = kustomization(directory)
    for entry in spec.get("components", []):
        component = (directory / entry).resolve()
        found |= {component} | included_components(component)
    for entry in spec.get("resources", []):
        if (directory / entry).is_dir():
            found |= included_components((directory / entry).resolve())
    return found


def test_every_component_is_in_a_variant():
    """A component is rendered and validated only through the variants that include it; the keeper's is
    in exactly KEEPER_VARIANTS, the DRA front end's in exactly DRA_VARIANTS, and the driver's privileges
    (gpu-admin) in the MIG manager's and DRA's variants."""
    including = {name: included_components(directory) for name, directory in VARIANTS.items()}
    for name, directory in COMPONENTS.items():
        assert any(directory.resolve() in used for used in including.values()), f"no variant includes {name}"

    def variants_with(component: str) -> set[str]:
        return {name for name, used in including.items() if COMPONENTS[component].resolve() in used}

    assert variants_with("mps-keeper") == KEEPER_VARIANTS
    assert variants_with("dra") == set(DRA_VARIANTS)
    assert variants_with("gpu-admin") == MIG_LAYOUT_VARIANTS | set(DRA_VARIANTS)


def test_kubectl_has_kustomize_v5(kubectl):
    """The tool users render the manifests with (`kubectl apply -k`), new enough for them."""
    assert os.access(kubectl.path, os.X_OK)
    assert int(re.match(r"v(\d+)", kubectl.kustomize_version).group(1)) >= MIN_KUSTOMIZE, kubectl
    assert "kubectl >= {}.{}".format(*MIN_KUBECTL) in NEEDED  # the failure message asks for what is checked


def test_every_variant_renders(rendered):
    for name, objects in rendered.items():
        kinds = sorted(o["kind"] for o in objects)
        assert {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "DaemonSet", "Service"} <= set(
            kinds
        ), name
        names = sorted(ds["metadata"]["name"] for ds in daemonsets(objects))
        assert names == sorted([AGENT, *([KEEPER] if name in KEEPER_VARIANTS else [])]), name
    assert {name for name, objects in rendered.items() if keeper_daemonset(objects)} == KEEPER_VARIANTS


def test_kubernetes_validate_ships_the_supported_versions():
    """kubernetes-validate silently falls back to an older schema set; make sure it has ours."""
    schemas = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    for version in SUPPORTED_KUBERNETES:
        assert (schemas / f"v{version}.0-local-strict").is_dir(), f"kubernetes-validate lacks {version}"


@pytest.mark.parametrize("version", SUPPORTED_KUBERNETES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_objects_are_valid_kubernetes(rendered, variant, version):
    checked = 0
    for obj in rendered[variant]:
        if obj["kind"] in CUSTOM_KINDS:
            continue  # no schema in kubernetes-validate; see test_service_monitor
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{variant}: {obj['kind']}/{obj['metadata']['name']} on {version}: {error.message}")
        checked += 1
    assert checked >= 7


@pytest.mark.parametrize("version", SUPPORTED_KUBERNETES)
def test_pods_and_runtime_class_are_valid_kubernetes(version):
    files = [*sorted(PODS.glob("*.yaml")), DAEMONSET / "runtimeclass.yaml"]
    assert len(files) >= 6
    for path in files:
        for obj in yaml.safe_load_all(path.read_text(encoding="utf-8")):
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as error:
                pytest.fail(f"{path.relative_to(ROOT)} on {version}: {error.message}")


def test_every_namespaced_object_is_in_the_agents_namespace(rendered):
    cluster_scoped = {"Namespace", "ClusterRole", "ClusterRoleBinding"}
    for name, objects in rendered.items():
        for obj in objects:
            expected = None if obj["kind"] in cluster_scoped else NAMESPACE
            assert obj["metadata"].get("namespace") == expected, (name, obj["kind"], obj["metadata"]["name"])
        (ns,) = [o for o in objects if o["kind"] == "Namespace"]
        assert ns["metadata"]["name"] == NAMESPACE
        # hostPath volumes are forbidden by the baseline Pod Security level
        assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


# ----- security ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_no_variant_is_privileged(rendered, variant):
    """Every DaemonSet of the variant: the agent's and, with MPS, the keeper's."""
    for ds in daemonsets(rendered[variant]):
        spec = ds["spec"]["template"]["spec"]
        for c in all_containers(spec):
            sc = c["securityContext"]
            assert sc["privileged"] is False, ds["metadata"]["name"]
            assert sc["allowPrivilegeEscalation"] is False, ds["metadata"]["name"]
            assert sc["readOnlyRootFilesystem"] is True, ds["metadata"]["name"]
            assert sc["capabilities"]["drop"] == ["ALL"], ds["metadata"]["name"]
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, ds["metadata"]["name"]
            assert "procMount" not in sc, ds["metadata"]["name"]
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, ds["metadata"]["name"]
        assert not spec.get("hostNetwork") and not spec.get("hostIPC"), ds["metadata"]["name"]
        assert spec.get("initContainers") is None, "no (privileged) init container, unlike NVIDIA's MPS shm mount"


def test_default_variants_add_no_capability_and_stay_in_their_pid_namespace(rendered):
    defaults = set(VARIANTS) - {"mig-manager", "mps", *DRA_VARIANTS}
    assert {"base", "service-monitor", "node-labels"} <= defaults
    for variant in defaults:
        for ds in daemonsets(rendered[variant]):
            spec = ds["spec"]["template"]["spec"]
            for c in all_containers(spec):
                assert "add" not in c["securityContext"]["capabilities"], (variant, ds["metadata"]["name"])
            assert not spec.get("hostPID"), (variant, ds["metadata"]["name"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_host_paths_are_exactly_the_needed_set(rendered, variant):
    assert set(EXTRA_HOST_PATHS) <= set(VARIANTS)
    assert host_paths(pod_spec(rendered[variant])) == HOST_PATHS | EXTRA_HOST_PATHS.get(variant, set())
    c = container(rendered[variant])
    # the only other use of a hostPath volume
    assert sub_path_mounts(c) == [SHM_MOUNT]
    assert env(c)["TESSERA_MPS_ROOT"] == MPS_ROOT[0]
    if keeper_daemonset(rendered[variant]) is not None:
        assert host_paths(keeper_pod_spec(rendered[variant])) == KEEPER_HOST_PATHS
        assert sub_path_mounts(keeper_container(rendered[variant])) == [SHM_MOUNT]


def test_mig_overlay_adds_only_sys_admin_and_the_mig_devices(rendered):
    base, mig = container(rendered["base"]), container(rendered["mig-manager"])
    assert mig["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["SYS_ADMIN"]}
    assert {k: v for k, v in mig["securityContext"].items() if k != "capabilities"} == {
        k: v for k, v in base["securityContext"].items() if k != "capabilities"
    }
    added = {k: v for k, v in env(mig).items() if k not in env(base)}
    assert added == MIG_ENV
    assert {k: v for k, v in env(mig).items() if k in env(base)} == env(base)
    assert not pod_spec(rendered["mig-manager"]).get("hostPID")
    # the layouts: a ConfigMap volume, mounted read-only where TESSERA_MIG_CONFIG points
    base_volumes = pod_spec(rendered["base"])["volumes"]
    new_volumes = [v for v in pod_spec(rendered["mig-manager"])["volumes"] if v not in base_volumes]
    assert new_volumes == [{"name": "mig-layouts", "configMap": {"name": "tessera-mig-layouts"}}]
    (mount,) = [m for m in mig["volumeMounts"] if m["name"] == "mig-layouts"]
    assert mount["readOnly"] is True
    assert str(Path(mount["mountPath"]) / "config.yaml") == MIG_ENV["TESSERA_MIG_CONFIG"]
    assert set(config_map(rendered["mig-manager"], "tessera-mig-layouts")["data"]) == {"config.yaml"}


def test_mps_overlay_adds_to_the_agent_only_sys_admin_host_pid_and_the_keepers_socket(rendered):
    base, mps = container(rendered["base"]), container(rendered["mps"])
    assert mps["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["SYS_ADMIN"]}
    assert pod_spec(rendered["mps"])["hostPID"] is True
    added = {k: v for k, v in env(mps).items() if k not in env(base)}
    assert added == KEEPER_ENV
    assert {k: v for k, v in env(mps).items() if k in env(base)} == env(base)
    base_volumes, mps_volumes = pod_spec(rendered["base"])["volumes"], pod_spec(rendered["mps"])["volumes"]
    assert [v for v in base_volumes if v not in mps_volumes] == []
    assert [v for v in mps_volumes if v not in base_volumes] == [
        {"name": "keeper-socket", "hostPath": {"path": "/run/tessera", "type": "DirectoryOrCreate"}}
    ]
    assert [m for m in base["volumeMounts"] if m not in mps["volumeMounts"]] == []
    assert [m for m in mps["volumeMounts"] if m not in base["volumeMounts"]] == [
        {"name": "keeper-socket", "mountPath": "/run/tessera"}
    ]
    # the MPS daemons' memory is the keeper's (test_mps_keeper), not the agent's
    assert mps["resources"] == base["resources"]
    # and nothing else: without those, the agent's DaemonSet is base's
    stripped = deepcopy(daemonset(rendered["mps"]))
    spec = stripped["spec"]["template"]["spec"]
    del spec["hostPID"]
    spec["volumes"] = [v for v in spec["volumes"] if v["name"] != "keeper-socket"]
    (c,) = spec["containers"]
    c["env"] = [e for e in c["env"] if e["name"] not in KEEPER_ENV]
    c["volumeMounts"] = [m for m in c["volumeMounts"] if m["name"] != "keeper-socket"]
    del c["securityContext"]["capabilities"]["add"]
    assert canonical(stripped) == canonical(daemonset(rendered["base"]))


def dra_volumes(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The hostPath volumes of DRA_HOST_PATHS in a pod spec."""
    paths = {path for path, *_ in DRA_HOST_PATHS}
    return [v for v in spec["volumes"] if v.get("hostPath", {}).get("path") in paths]


def with_dra(ds: dict[str, Any], volumes: list[dict[str, Any]]) -> dict[str, Any]:
    """A variant's agent DaemonSet with exactly what components/dra adds: its hostPath volumes (``volumes``, each
    mounted at its own path), DRA_ENV, the MIG capability devices with CAP_SYS_ADMIN (components/gpu-admin:
    dynamic MIG, compute modes for time-slicing and MPS per claim), and the host PID namespace (MPS per claim)."""
    ds = deepcopy(ds)
    spec = ds["spec"]["template"]["spec"]
    spec["hostPID"] = True
    spec["volumes"] = [v for v in spec["volumes"] if v["name"] not in {x["name"] for x in volumes}] + volumes
    (c,) = spec["containers"]
    added = {**DRA_ENV, **MIG_DEVICES_ENV}
    c["env"] = [e for e in c["env"] if e["name"] not in added] + [
        {"name": k, "valueFrom": v} if isinstance(v, dict) else {"name": k, "value": v} for k, v in added.items()
    ]
    c["volumeMounts"] += [_dra_mount(v) for v in volumes]
    c["securityContext"]["capabilities"]["add"] = ["SYS_ADMIN"]
    return ds


def _dra_mount(volume: dict[str, Any]) -> dict[str, Any]:
    """Each DRA directory at the host's own path; the host's root read-only at /driver-root, following what a driver
    container mounts there later (HostToContainer)."""
    if volume["hostPath"]["path"] == DRIVER_ROOT[0]:
        return {"name": volume["name"], "mountPath": DRIVER_ROOT[2], "readOnly": True,
                "mountPropagation": "HostToContainer"}  # fmt: skip
    return {"name": volume["name"], "mountPath": volume["hostPath"]["path"]}


@pytest.mark.parametrize("variant", DRA_VARIANTS)
def test_dra_variants_are_their_variant_plus_exactly_what_the_dra_front_end_needs(rendered, variant):
    """overlays/dra (base + components/dra), overlays/dra-mps (mps + it) and overlays/dra-mig-manager (mig-manager
    + it): the variant's agent DaemonSet with three hostPath volumes at the host's own paths, four environment
    variables, CAP_SYS_ADMIN and the MIG config and monitor capability devices (Prepare creates and destroys MIG
    devices, sets compute modes and time-slices), the host PID namespace (MPS daemons per claim); its other objects
    unchanged (the MPS keeper's DaemonSet of dra-mps is the mps variant's); the DRA RBAC and named configs. Nothing
    else: the container stays unprivileged (test_no_variant_is_privileged)."""
    objects, parent = rendered[variant], rendered[DRA_VARIANTS[variant]]
    spec, c = pod_spec(objects), container(objects)
    volumes = dra_volumes(spec)
    assert {(v["hostPath"]["path"], v["hostPath"]["type"]) for v in volumes} == {
        (path, kind) for path, kind, _, _ in DRA_HOST_PATHS
    }
    # the agent hands the kubelet its socket paths and the runtime its CDI IDs: each directory is the host's own
    for name in ("TESSERA_DRA_REGISTRY_DIR", "TESSERA_DRA_PLUGINS_DIR", "TESSERA_CDI_ROOT"):
        assert host_location(spec, c, DRA_ENV[name]) == DRA_ENV[name], name
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["SYS_ADMIN"]}
    assert {k: env(c).get(k) for k in MIG_DEVICES_ENV} == MIG_DEVICES_ENV
    assert spec["hostPID"] is True
    assert canonical(daemonset(objects)) == canonical(with_dra(daemonset(parent), volumes))
    # the other objects: the parent's, the DRA RBAC, and the named configs merged into tessera-config
    agent_ds = daemonset(objects)
    others = [o for o in objects if o is not agent_ds and o is not config_map(objects, "tessera-config")]
    parents = [o for o in parent if o is not daemonset(parent) and o is not config_map(parent, "tessera-config")]
    assert [o for o in parents if o not in others] == []
    assert {(o["kind"], o["metadata"]["name"]) for o in others if o not in parents} == {
        ("ClusterRole", "tessera-dra-driver"),
        ("ClusterRoleBinding", "tessera-dra-driver"),
    }
    data, parent_data = config_map(objects, "tessera-config")["data"], config_map(parent, "tessera-config")["data"]
    assert {k: v for k, v in data.items() if k in parent_data} == parent_data
    assert set(data) - set(parent_data) == set(DRA_CONFIGS)


# What a shipped config makes the agent ask of the NVIDIA driver, and the grant each request needs (components/
# gpu-admin and components/dra say why): privileged requests (MIG mode, compute modes, time-slices) need
# CAP_SYS_ADMIN; creating and destroying GPU and compute instances the MIG "config" capability device; seeing the
# MIG devices made after the container started the "monitor" one; MPS daemons the host PID namespace.
MIG_DEVICES = {"NVIDIA_MIG_CONFIG_DEVICES", "NVIDIA_MIG_MONITOR_DEVICES"}
# any DRA claim may ask for time-slicing or MPS in its opaque config, whatever the node's config
NEEDS_DRA = {"SYS_ADMIN", "hostPID"}
NEEDS_DYNAMIC_MIG = {"SYS_ADMIN", *MIG_DEVICES}  # Prepare makes the claim's MIG device, Unprepare destroys it
NEEDS_GPU_SHARES = {"SYS_ADMIN", "hostPID"}  # MPS enforces the shares
NEEDS_MIG_LAYOUT = {"SYS_ADMIN", *MIG_DEVICES, "TESSERA_MIG_CONFIG"}  # the layout manager


def config_needs(config: dict[str, Any]) -> set[str]:
    dra = config.get("dra") or {}
    needs = set()
    if dra.get("enabled"):
        needs |= NEEDS_DRA
        if dra.get("dynamicMig"):
            needs |= NEEDS_DYNAMIC_MIG
        if dra.get("gpuShares"):
            needs |= NEEDS_GPU_SHARES
    if config.get("migLayout"):
        needs |= NEEDS_MIG_LAYOUT
    return needs


def agent_grants(objects: list[dict[str, Any]]) -> set[str]:
    """The agent's capabilities, hostPID, the MIG devices the runtime mounts and the layouts file, by name."""
    spec, c = pod_spec(objects), container(objects)
    grants = set(c["securityContext"]["capabilities"].get("add", []))
    grants |= {"hostPID"} if spec.get("hostPID") else set()
    grants |= {k for k, v in env(c).items() if k in MIG_DEVICES and v == "all"}
    grants |= {"TESSERA_MIG_CONFIG"} if "TESSERA_MIG_CONFIG" in env(c) else set()
    return grants


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_grants_what_its_configs_need(rendered, variant):
    """A config a variant ships works on the nodes labelled with it: the agent may make the driver requests it
    causes (a dynamic-MIG Prepare without the MIG config device, or an MPS claim's compute mode without
    CAP_SYS_ADMIN, would fail with a permission error). And the NVIDIA runtime refuses to start a container
    that asks for the MIG devices without CAP_SYS_ADMIN."""
    objects = rendered[variant]
    grants = agent_grants(objects)
    for key, text in config_map(objects, "tessera-config")["data"].items():
        missing = config_needs(yaml.safe_load(text) or {}) - grants
        assert not missing, f"{variant}: config {key} needs {sorted(missing)}"
    if grants & MIG_DEVICES:
        assert "SYS_ADMIN" in grants, variant


def test_the_configs_that_need_grants_are_shipped():
    """test_every_variant_grants_what_its_configs_need is not vacuous: each kind of need is in a shipped config."""
    shipped = [yaml.safe_load(p.read_text(encoding="utf-8")) for p in [*config_files(), *DRA_CONFIGS.values()]]
    needs = [config_needs(c or {}) for c in shipped]
    for kind in (NEEDS_DRA, NEEDS_DYNAMIC_MIG, NEEDS_GPU_SHARES, NEEDS_MIG_LAYOUT):
        assert any(kind <= n for n in needs), kind
    assert any(config_needs(c or {}) == NEEDS_DRA | NEEDS_DYNAMIC_MIG for c in shipped)  # dra-dynamic-mig


def test_mps_keeper(rendered):
    """tessera-mps-keeper: what it may do (no capability, no API access, hostPID), how it is updated
    (OnDelete: deleting its pod ends the node's MPS daemons), what it shares with the agent (its socket,
    the MPS root, the image, the nodes)."""
    objects = rendered["mps"]
    keeper, agent_ds = keeper_daemonset(objects), daemonset(objects)
    assert keeper is not None
    spec, agent_spec = keeper_pod_spec(objects), pod_spec(objects)
    c, agent = keeper_container(objects), container(objects)
    assert keeper["spec"]["updateStrategy"] == {"type": "OnDelete"}
    assert spec["hostPID"] is True
    # no Kubernetes API access: no token, and not the agent's (or any) ServiceAccount
    assert spec["automountServiceAccountToken"] is False
    assert "serviceAccountName" not in spec and "serviceAccount" not in spec
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["priorityClassName"] == agent_spec["priorityClassName"] == "system-node-critical"
    assert c["command"] == ["tessera", "mps-keeper"] and "args" not in c
    assert c["image"] == agent["image"]
    assert c["securityContext"] == {
        "privileged": False,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert spec["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    assert not spec.get("hostNetwork") and not spec.get("hostIPC") and not spec.get("initContainers")
    # nothing but the unix socket to talk to, and no probe that could restart it (and end the daemons)
    assert "ports" not in c and not {"livenessProbe", "readinessProbe", "startupProbe"} & set(c)
    # the agent and the keeper agree on the socket and the MPS root, and see both at the same host paths
    assert env(c)["TESSERA_MPS_KEEPER"] == env(agent)["TESSERA_MPS_KEEPER"]
    assert env(c)["TESSERA_MPS_ROOT"] == env(agent)["TESSERA_MPS_ROOT"]
    socket, root = env(c)["TESSERA_MPS_KEEPER"], env(c)["TESSERA_MPS_ROOT"]
    for path in (socket, str(Path(socket).parent)):
        assert host_location(spec, c, path) == host_location(agent_spec, agent, path), path
    assert Path(socket).parent.as_posix() == KEEPER_SOCKET_DIRECTORY[2]
    # not in the MPS root, parts of which the kubelet mounts into every MPS client pod
    assert not Path(host_location(spec, c, socket)).is_relative_to(MPS_ROOT[0])
    for path in (root, "/dev/shm"):
        assert host_location(spec, c, path) == host_location(agent_spec, agent, path), path
    assert host_location(spec, c, root) == root  # the agent hands the kubelet host paths
    # only hostPath volumes (test_host_paths_are_exactly_the_needed_set says which)
    assert all("hostPath" in v for v in spec["volumes"]), spec["volumes"]
    # the agent's nodes, exactly
    assert spec["affinity"] == agent_spec["affinity"]
    assert spec["tolerations"] == agent_spec["tolerations"]
    # the host driver's MPS binaries come with "compute", and the GPUs with NVIDIA_VISIBLE_DEVICES
    assert "compute" in env(c)["NVIDIA_DRIVER_CAPABILITIES"].split(",")
    assert env(c)["NVIDIA_VISIBLE_DEVICES"] == env(agent)["NVIDIA_VISIBLE_DEVICES"] == "all"
    # the MPS control daemon and one MPS server per client UID run here
    assert c["resources"]["limits"]["memory"] == "1Gi"
    # two DaemonSets that select each other's pods would fight over them; the Service is the agent's
    pods = keeper["spec"]["template"]["metadata"]["labels"]
    agent_pods = agent_ds["spec"]["template"]["metadata"]["labels"]
    assert keeper["spec"]["selector"]["matchLabels"].items() <= pods.items()
    assert not keeper["spec"]["selector"]["matchLabels"].items() <= agent_pods.items()
    assert not agent_ds["spec"]["selector"]["matchLabels"].items() <= pods.items()
    (service,) = [o for o in objects if o["kind"] == "Service"]
    assert not service["spec"]["selector"].items() <= pods.items()


def test_every_environment_variable_of_the_keeper_is_a_flag_twin_of_tessera_mps_keeper(rendered):
    """As for the agent (`tessera run`): a typo in a TESSERA_* name would be ignored silently."""
    twins = flag_twins("mps-keeper")
    assert {"TESSERA_MPS_KEEPER", "TESSERA_MPS_ROOT", "TESSERA_LOG_FORMAT"} <= twins
    checked = set()
    for name, objects in rendered.items():
        if keeper_daemonset(objects) is not None:
            unknown = {k for k in env(keeper_container(objects)) if not k.startswith("NVIDIA_")} - twins
            assert not unknown, (name, unknown)
            checked.add(name)
    assert checked == KEEPER_VARIANTS


def test_mig_and_mps_together_as_docs_install_describes(kubectl, rendered, tmp_path):
    """docs/install.md's recipe, taken from the document: the mig-manager variant plus the MPS keeper
    component, with its paths (relative to a checkout at ../tessera) pointed at this repository."""
    install = (ROOT / "docs" / "install.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```yaml\n(.*?)```", install, flags=re.DOTALL)
    (recipe,) = [yaml.safe_load(b) for b in blocks if "components/mps-keeper" in b]
    assert recipe["resources"] == ["../tessera/daemonset/overlays/mig-manager"]
    assert recipe["components"] == ["../tessera/daemonset/components/mps-keeper"]
    # kustomize takes a resource directory only as a relative path, as the document's own overlay has it
    recipe["resources"] = [os.path.relpath(VARIANTS["mig-manager"], tmp_path)]
    recipe["components"] = [os.path.relpath(COMPONENTS["mps-keeper"], tmp_path)]
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(recipe), encoding="utf-8")
    objects = kubectl.kustomize(tmp_path)
    c = container(objects)
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["SYS_ADMIN"]}
    assert pod_spec(objects)["hostPID"] is True
    assert {k: env(c).get(k) for k in MIG_ENV} == MIG_ENV
    assert {k: env(c).get(k) for k in KEEPER_ENV} == KEEPER_ENV
    assert host_paths(pod_spec(objects)) == HOST_PATHS | {KEEPER_SOCKET_DIRECTORY}
    # the keeper of the mps variant, exactly, with the agent's image
    assert keeper_daemonset(objects) == keeper_daemonset(rendered["mps"])
    assert keeper_container(objects)["image"] == c["image"]
    assert sorted(ds["metadata"]["name"] for ds in daemonsets(objects)) == [AGENT, KEEPER]
    checked = 0
    for obj in objects:
        if obj["kind"] in CUSTOM_KINDS:
            continue
        for version in SUPPORTED_KUBERNETES:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as error:
                pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} on {version}: {error.message}")
        checked += 1
    assert checked >= 8


def rbac_grants(variant: str, objects: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    """What the agent's ServiceAccount may do, as (API group, resource, verb), after checking that the
    RBAC objects are plain: every role bound, only to that ServiceAccount, no wildcard, no aggregation, no
    resourceNames or nonResourceURLs, no built-in role."""
    (sa,) = [o for o in objects if o["kind"] == "ServiceAccount"]
    subject = {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": NAMESPACE}
    assert pod_spec(objects)["serviceAccountName"] == sa["metadata"]["name"], variant
    roles = {(o["kind"], o["metadata"]["name"]): o for o in objects if o["kind"] in ("Role", "ClusterRole")}
    bindings = [o for o in objects if o["kind"] in ("RoleBinding", "ClusterRoleBinding")]
    bound = set()
    for binding in bindings:
        name = binding["metadata"]["name"]
        assert binding["subjects"] == [subject], (variant, name)
        ref = binding["roleRef"]
        assert ref["apiGroup"] == "rbac.authorization.k8s.io", (variant, name)
        assert (ref["kind"], ref["name"]) in roles, f"{variant}: {name} binds a role the manifests do not define"
        bound.add((ref["kind"], ref["name"]))
    assert bound == set(roles), f"{variant}: roles bound by nothing: {set(roles) - bound}"
    grants = set()
    for (kind, name), role in roles.items():
        assert "aggregationRule" not in role, (variant, name)
        for rule in role["rules"]:
            # resourceNames cannot follow a DaemonSet's pods to their nodes; nonResourceURLs are not needed
            assert set(rule) == {"apiGroups", "resources", "verbs"}, (variant, name, rule)
            for field in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[field], f"{variant}: a wildcard in {kind} {name}: {rule}"
            grants |= {(g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    return grants


@pytest.mark.parametrize("variant", VARIANTS)
def test_rbac_grants_exactly_node_reads_and_events(rendered, variant):
    objects = rendered[variant]
    grants = rbac_grants(variant, objects)
    assert not {g for g in grants if g[1] == "secrets"}, variant
    assert not [o for o in objects if o["kind"] == "Secret"], variant
    writes = {g for g in grants if g[2] not in READ_VERBS}
    assert {g for g in writes if g[1] != "events"} <= EXTRA_GRANTS.get(variant, set()), f"{variant} writes {writes}"
    assert grants == GRANTS | EXTRA_GRANTS.get(variant, set()), variant
    # cluster-wide, since the Node and its Events are outside the agent's namespace; nothing namespaced
    assert {o["kind"] for o in objects if o["kind"] in RBAC_KINDS} == {"ClusterRole", "ClusterRoleBinding"}
    # the grants are the agent's alone: any other DaemonSet (the MPS keeper) mounts no token at all
    for ds in daemonsets(objects):
        if ds["metadata"]["name"] != AGENT:
            spec = ds["spec"]["template"]["spec"]
            assert spec.get("automountServiceAccountToken") is False, (variant, ds["metadata"]["name"])
            assert not {"serviceAccountName", "serviceAccount"} & set(spec), (variant, ds["metadata"]["name"])


def test_base_rbac_is_every_variants_and_node_patch_is_opt_in(rendered):
    """Only overlays/node-labels may patch Nodes; it adds a role of its own and leaves base's as it is."""
    base = [o for o in rendered["base"] if o["kind"] in RBAC_KINDS]
    for variant, objects in rendered.items():
        rbac = [o for o in objects if o["kind"] in RBAC_KINDS]
        assert [o for o in base if o not in rbac] == [], variant
        if variant not in EXTRA_GRANTS:
            assert len(rbac) == len(base), variant
    assert ("", "nodes", "patch") not in rbac_grants("base", rendered["base"])
    assert set(EXTRA_GRANTS) <= set(VARIANTS)


# ----- operation --------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_probes_use_healthz_and_readyz_on_the_metrics_port(rendered, variant):
    c = container(rendered[variant])
    (port,) = c["ports"]
    assert port == {"name": "metrics", "containerPort": 9479, "protocol": "TCP"}
    assert env(c)["TESSERA_METRICS_ADDRESS"] == ":9479"
    for probe, path in (("startupProbe", "/healthz"), ("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        assert c[probe]["httpGet"] == {"path": path, "port": "metrics"}, probe
    (service,) = [o for o in rendered[variant] if o["kind"] == "Service"]
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 9479, "targetPort": "metrics", "protocol": "TCP"}]
    pod_labels = daemonset(rendered[variant])["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()


def test_service_monitor(rendered):
    (sm,) = [o for o in rendered["service-monitor"] if o["kind"] == "ServiceMonitor"]
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    (service,) = [o for o in rendered["service-monitor"] if o["kind"] == "Service"]
    assert sm["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    assert set(sm["spec"]) == {"selector", "namespaceSelector", "endpoints"}
    assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "relabelings", "honorLabels"}
    assert endpoint["honorLabels"] is True  # else the operator renames our pod/namespace/container to exported_*


def test_node_name_comes_from_the_downward_api(rendered):
    for objects in rendered.values():
        assert env(container(objects))["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}


def test_pod_uid_comes_from_the_downward_api(rendered):
    """POD_UID (`tessera run --pod-uid`) names the DRA sockets per pod; only the dra variant sets it."""
    with_uid = {name for name, objects in rendered.items() if "POD_UID" in env(container(objects))}
    assert with_uid == set(DRA_VARIANTS)
    for name in DRA_VARIANTS:
        assert env(container(rendered[name]))["POD_UID"] == {"fieldRef": {"fieldPath": "metadata.uid"}}


def test_every_environment_variable_is_a_flag_twin_of_tessera_run(rendered):
    """A typo in a TESSERA_* name would be ignored silently by the agent; compare with `tessera run --help`."""
    twins = flag_twins("run")
    assert {"TESSERA_CONFIG", "TESSERA_MIG_CONFIG", "TESSERA_HOST_PROC", "TESSERA_MPS_KEEPER"} <= twins
    assert set(DRA_ENV) <= twins  # POD_UID too: the twin of --pod-uid (its value comes from the downward API)
    runtime = {"NODE_NAME", "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", *MIG_ENV} - {"TESSERA_MIG_CONFIG"}
    for name, objects in rendered.items():
        unknown = set(env(container(objects))) - twins - runtime
        assert not unknown, (name, unknown)
    c = container(rendered["base"])
    assert env(c)["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env(c)["NVIDIA_DRIVER_CAPABILITIES"] == "compute,utility"
    # the image's entrypoint (`tessera`) with `run`, said in the manifest rather than left to the image's CMD
    assert "command" not in c and c["args"] == ["run"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_memory_limits_are_on_and_read_where_the_host_mounts_are(rendered, variant):
    """Every variant holds sized replicas to their size: TESSERA_CGROUP_ROOT and TESSERA_CONTAINER_LOGS point at
    read-only mounts of the host's cgroup tree (at the host's own path, which NVML is given) and log links."""
    c = container(rendered[variant])
    assert env(c)["TESSERA_MEMORY_LIMITS"] == "on"
    mounted = {m["mountPath"]: m.get("readOnly", False) for m in c["volumeMounts"]}
    for name, host in (("TESSERA_CGROUP_ROOT", "/sys/fs/cgroup"), ("TESSERA_CONTAINER_LOGS", "/var/log/containers")):
        assert env(c)[name] == host and mounted[host] is True, (variant, name)
    assert {"TESSERA_MEMORY_LIMITS", "TESSERA_CGROUP_ROOT", "TESSERA_CONTAINER_LOGS"} <= flag_twins("run")


def test_status_is_served_on_a_socket_in_the_pod_not_on_the_metrics_port(rendered):
    """/status (every claim, the pods holding GPUs) stays on the node: a unix socket in an emptyDir of the agent's
    pod, where `kubectl exec ... -- tessera status` finds it through the same variable; the Service and the probes
    reach only the metrics port."""
    from agent.cli import DEFAULT_STATUS_SOCKET

    for name, objects in rendered.items():
        spec, c = pod_spec(objects), container(objects)
        path = env(c)["TESSERA_STATUS_SOCKET"]
        assert path == DEFAULT_STATUS_SOCKET, name  # `tessera status` on the node finds it without a flag too
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == str(Path(path).parent)]
        (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
        assert "emptyDir" in volume and "hostPath" not in volume, (name, volume)
        assert not mount.get("readOnly"), name
        probes = [c[p]["httpGet"]["path"] for p in ("startupProbe", "livenessProbe", "readinessProbe")]
        assert "/status" not in probes


def test_scheduling_and_rollout(rendered):
    ds = daemonset(rendered["base"])
    spec = ds["spec"]["template"]["spec"]
    assert spec["priorityClassName"] == "system-node-critical"
    assert spec["runtimeClassName"] == "nvidia"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert {"key": "CriticalAddonsOnly", "operator": "Exists"} in spec["tolerations"]
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    # ORed: NFD's PCI vendor label, or the GPU Operator's
    assert [t["matchExpressions"] for t in terms] == [
        [{"key": "feature.node.kubernetes.io/pci-10de.present", "operator": "In", "values": ["true"]}],
        [{"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]}],
    ]
    assert ds["spec"]["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}}
    resources = container(rendered["base"])["resources"]
    assert set(resources["requests"]) == set(resources["limits"]) == {"cpu", "memory"}


def test_image_is_the_project_version(rendered):
    """Every DaemonSet's: the keeper runs the agent's image (`tessera mps-keeper`)."""
    for name, objects in rendered.items():
        for ds in daemonsets(objects):
            for c in all_containers(ds["spec"]["template"]["spec"]):
                assert c["image"] == f"tessera-agent:{project()['version']}", (name, ds["metadata"]["name"])


# ----- the sharing configs in the ConfigMap ------------------------------------------------------------


def test_config_map_keys_are_the_catalogue(rendered):
    """base: every config of configs/ that needs no MIG manager; mig-manager adds the ones with a layout; an
    overlay may add named configs of its own (OVERLAY_CONFIGS) that work only with it.
    Keys are the file names without .yaml (the value of nvidia.com/device-plugin.config)."""
    files = config_files()
    dra_only = {p.stem for p in files if "dra" in (yaml.safe_load(p.read_text(encoding="utf-8")) or {})}
    without_layout = {p.stem for p in files if not has_mig_layout(p)} - dra_only  # DRA's ship with its overlay
    assert set(OVERLAY_CONFIGS) <= set(VARIANTS)
    for variant in VARIANTS:
        catalogue = {p.stem for p in files} - dra_only if variant in MIG_LAYOUT_VARIANTS else without_layout
        expected = catalogue | set(OVERLAY_CONFIGS.get(variant, {}))
        assert set(config_map(rendered[variant], "tessera-config")["data"]) == expected, variant
    assert set(config_map(rendered["mig-manager"], "tessera-config")["data"]) == {p.stem for p in files} - dra_only
    for name, objects in rendered.items():
        own = OVERLAY_CONFIGS.get(name, {})
        assert not (set(own) - dra_only) & {p.stem for p in files}, f"{name} shadows a config of the catalogue"
        for stem in set(own) & dra_only:  # the catalogue's DRA configs ship with the dra overlay, unchanged
            assert own[stem].read_text(encoding="utf-8") == (CONFIGS / f"{stem}.yaml").read_text(encoding="utf-8")
        for key, text in config_map(objects, "tessera-config")["data"].items():
            source = own.get(key, CONFIGS / f"{key}.yaml")
            assert text == source.read_text(encoding="utf-8"), (name, key)


def test_config_copies_in_daemonset_are_identical_to_the_catalogue():
    """kustomize reads files only below a kustomization, hence the copies; they must not drift."""
    copies = sorted(DAEMONSET.glob("**/configs/*.yaml"))
    assert copies
    for copy in copies:
        original = CONFIGS / copy.name
        assert copy.read_bytes() == original.read_bytes(), f"cp {original.relative_to(ROOT)} {copy.relative_to(ROOT)}"


def test_config_is_mounted_as_a_directory_where_tessera_config_points(rendered):
    for objects in rendered.values():
        c = container(objects)
        (volume,) = [v for v in pod_spec(objects)["volumes"] if v.get("configMap", {}).get("name") == "tessera-config"]
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == volume["name"]]
        assert mount["readOnly"] is True and "subPath" not in mount  # subPath mounts never see updates
        assert env(c)["TESSERA_CONFIG"] == mount["mountPath"] == "/etc/tessera/config"
        assert not mount["mountPath"].startswith("/etc/nvidia")  # the NVIDIA runtime's hooks write there


def test_mig_layout_names_used_by_configs_exist_in_the_layouts_file(rendered):
    """With --mig-config, layouts are looked up by name in that file, also migLayout.config's name."""
    for variant in MIG_LAYOUT_VARIANTS:
        layouts = yaml.safe_load(config_map(rendered[variant], "tessera-mig-layouts")["data"]["config.yaml"])
        for key, text in config_map(rendered[variant], "tessera-config")["data"].items():
            section = (yaml.safe_load(text) or {}).get("migLayout")
            if section:
                assert section["config"] in layouts["mig-configs"], (variant, key)
                # the same layout as the one embedded in the config
                embedded = section["layouts"]["mig-configs"][section["config"]]
                assert layouts["mig-configs"][section["config"]] == embedded, (variant, key)


# ----- the renderer: kubectl's kustomize, as `kubectl apply -k` runs it ------------------------------------


def test_renderer_refuses_files_outside_the_kustomization(kubectl, tmp_path):
    """kustomize's default load restrictor, which is why daemonset/ holds copies of configs/: the tests
    render with it, as users apply with it, so a manifest reading ../../configs fails here too."""
    (tmp_path / "outside.yaml").write_text("version: v1\n")
    inner = tmp_path / "k"
    inner.mkdir()
    (inner / "link.yaml").symlink_to(tmp_path / "outside.yaml")
    for entry in ("../outside.yaml", "link.yaml"):
        (inner / "kustomization.yaml").write_text(
            yaml.safe_dump(
                {
                    "namespace": "x",
                    "generatorOptions": {"disableNameSuffixHash": True},
                    "configMapGenerator": [{"name": "c", "files": [f"k={entry}"]}],
                }
            )
        )
        with pytest.raises(RenderError, match="security"):
            kubectl.kustomize(inner)


def test_renderer_reports_kustomizes_error(kubectl, tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resourcez: [a.yaml]\n")
    with pytest.raises(RenderError, match=r"kubectl kustomize .* failed .*resourcez"):
        kubectl.kustomize(tmp_path)
