"""Shared pieces of the deployment tests: paths, the rendered variants, the supported Kubernetes versions.

A variant is a kustomization that can be applied (`kind: Kustomization`, the default); a kustomize
Component (`kind: Component`, daemonset/components/) is a piece that variants include and cannot be
rendered alone.

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
# The DaemonSets' names: the agent's (every variant) and the MPS keeper's (components/mps-keeper).
AGENT = "tessera"
KEEPER = "tessera-mps-keeper"


def _kustomization_directories() -> dict[Path, str]:
    """Every directory under daemonset/ with a kustomization file, and that file's kind."""
    found: dict[Path, str] = {}
    for name in KUSTOMIZATION_FILES:
        for path in DAEMONSET.rglob(name):
            if path.is_file():  # (a kustomization file, not a directory that happens to be called so)
                assert path.parent not in found, f"two kustomization files in {path.parent}"
                kind = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("kind", "Kustomization")
                assert kind in ("Kustomization", "Component"), f"{path}: kind {kind}"
                found[path.parent] = kind
    return found


def _by_name(directories: list[Path]) -> dict[str, Path]:
    named = {("base" if d == DAEMONSET / "base" else d.name): d for d in sorted(directories)}
    assert len(named) == len(directories), f"two kustomizations share a directory name: {sorted(directories)}"
    return named


def kustomizations() -> dict[str, Path]:
    """Every kustomization under daemonset/ that is a variant, by name: `base`, then each overlay by its
    directory's name. Found, not listed, so that a new overlay is rendered and validated like the others.
    Components (`kind: Component`) are not variants: kustomize cannot render one alone."""
    return _by_name([d for d, kind in _kustomization_directories().items() if kind == "Kustomization"])


def components() -> dict[str, Path]:
    """Every kustomize Component under daemonset/, by its directory's name; rendered in the variants that
    include it."""
    return _by_name([d for d, kind in _kustomization_directories().items() if kind == "Component"])


VARIANTS = kustomizations()
COMPONENTS = components()


def project() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def config_files() -> list[Path]:
    """The sharing configs of the catalogue (configs/*.yaml; the pods are in a sub-directory)."""
    return sorted(p for p in CONFIGS.iterdir() if p.is_file())


def has_mig_layout(path: Path) -> bool:
    return "migLayout" in (yaml.safe_load(path.read_text(encoding="utf-8")) or {})


def daemonsets(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every DaemonSet of a rendering: the agent's, and the MPS keeper's where the variant has one."""
    return [o for o in objects if o["kind"] == "DaemonSet"]


def daemonset(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """The agent's DaemonSet (`tessera`), exactly one in every variant."""
    (found,) = [o for o in daemonsets(objects) if o["metadata"]["name"] == AGENT]
    return found


def keeper_daemonset(objects: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The MPS keeper's DaemonSet (`tessera-mps-keeper`, from components/mps-keeper), None when absent."""
    found = [o for o in daemonsets(objects) if o["metadata"]["name"] == KEEPER]
    assert len(found) <= 1, "two MPS keeper DaemonSets"
    return found[0] if found else None


def container(objects: list[dict[str, Any]]) -> dict[str, Any]:
    """The agent's container (its DaemonSet has exactly one)."""
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
