"""Shared pieces of the deployment tests: paths, the rendered variants, the supported Kubernetes versions."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.kustomize import build

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

VARIANTS = {
    "base": DAEMONSET / "base",
    "mig-manager": DAEMONSET / "overlays" / "mig-manager",
    "mps": DAEMONSET / "overlays" / "mps",
    "service-monitor": DAEMONSET / "overlays" / "service-monitor",
}


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
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {name: build(path) for name, path in VARIANTS.items()}
