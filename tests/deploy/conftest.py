"""Shared pieces of the deployment tests: paths, the rendered variants, the supported Kubernetes versions.

The variants are rendered by the real kustomize, kubectl's (tests/deploy/kubectl.py). Without a kubectl
that has kustomize v5 every test that needs a rendering fails (it does not skip) with the message
"kubectl with kustomize is needed for the deployment tests: install kubectl >= 1.27".
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.kubectl import Kubectl, KubectlMissing, find

ROOT = Path(__file__).resolve().parents[2]
DAEMONSET = ROOT / "daemonset"
CONFIGS = ROOT / "configs"
PODS = CONFIGS / "pods"

# The Kubernetes versions the manifests are validated against: the oldest and the newest supported.
# 1.31 is the oldest API the agent's kubernetes client range (31 to 37, pyproject.toml) is built for and
# the oldest kubelet the facts cover; 1.37 is the newest schema set kubernetes-validate ships.
OLDEST_KUBERNETES = "1.31"
NEWEST_KUBERNETES = "1.37"
SUPPORTED_KUBERNETES = (OLDEST_KUBERNETES, NEWEST_KUBERNETES)

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")


def kustomizations() -> dict[str, Path]:
    """Every kustomization under daemonset/, by variant name: `base`, then each overlay by its directory's
    name. Found, not listed, so that a new overlay is rendered and validated like the others."""
    found = {
        path.parent
        for name in KUSTOMIZATION_FILES
        for path in DAEMONSET.rglob(name)
        if path.is_file()  # (a kustomization file, not a directory that happens to be called so)
    }
    variants = {("base" if d == DAEMONSET / "base" else d.name): d for d in sorted(found)}
    assert len(variants) == len(found), f"two kustomizations share a directory name: {sorted(found)}"
    return variants


VARIANTS = kustomizations()


def project() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def config_files() -> list[Path]:
    """The sharing configs of the catalogue (configs/*.yaml; the pods are in a sub-directory)."""
    return sorted(p for p in CONFIGS.iterdir() if p.is_file())


def has_mig_layout(path: Path) -> bool:
    return "migLayout" in (yaml.safe_load(path.read_text(encoding="utf-8")) or {})


def daemonset(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == "DaemonSet"]
    return found


def container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (found,) = daemonset(objects)["spec"]["template"]["spec"]["containers"]
    return found


@pytest.fixture(scope="session")
def kubectl() -> Kubectl:
    """kubectl with kustomize v5; fails every test that needs it when there is none."""
    try:
        return find()
    except KubectlMissing as error:
        message = str(error)
    pytest.fail(message, pytrace=False)


@pytest.fixture(scope="session")
def rendered(kubectl: Kubectl) -> dict[str, list[dict[str, Any]]]:
    """`kubectl kustomize` of every variant: what `kubectl apply -k` would send."""
    return {name: kubectl.kustomize(path) for name, path in VARIANTS.items()}
