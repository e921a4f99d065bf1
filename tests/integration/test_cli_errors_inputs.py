"""No traceback from plan, validate or mig for any input: odd files in, one clear line (or verdict) out.

Each input goes through every command that reads a config or a layout; whatever the exit code, the output
never holds a traceback, an internal error, PyYAML's ``<unicode string>`` or a bare ``[Errno N]``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

INPUTS = {
    "empty": "",
    "list": "- a\n- b\n",
    "scalar": "42\n",
    "binary": b"\xff\xfe\x00",
    "configmap-null-data": "apiVersion: v1\nkind: ConfigMap\ndata: null\n",
    "configmap-odd-keys": "apiVersion: v1\nkind: ConfigMap\nmetadata: 5\ndata:\n  '': ''\n  ..data: |\n    x: 1\n",
    "configmap-in-configmap": "apiVersion: v1\nkind: ConfigMap\ndata:\n  a: |\n    apiVersion: v1\n    kind: Pod\n",
    "layout-empty-spec": "version: v1\nmigLayout: {layouts: {version: v1, mig-configs: {x: []}}}\n",
    "layouts-not-a-map": "version: v1\nmigLayout: {config: x, layouts: 5}\n",
    "mig-configs-number": "mig-configs: 5\n",
    "match-number": "version: v1\nmatch: 5\n",
    "kind-list": "apiVersion: v1\nkind: List\nitems: []\n",
    "yaml-error": "version: v1\nsharing: {timeSlicing: [\n",
}
COMMANDS = [
    ("validate", "{path}"),
    ("plan", "--node", "dgx-a100", "--config", "{path}"),
    ("plan", "--node", "t4x4", "--config", "{path}", "--config-name", "a"),
    ("mig", "apply", "--dry-run", "--node", "dgx-a100", "--config", "{path}"),
    ("mig", "assert", "--node", "t4x4", "--config", "{path}"),
]


@pytest.mark.parametrize("name", sorted(INPUTS))
def test_no_command_prints_a_traceback_for_an_odd_input(tmp_path: Path, name: str):
    path = tmp_path / f"{name}.yaml"
    content = INPUTS[name]
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    for command in COMMANDS:
        args = [part.format(path=path) for part in command]
        result = subprocess.run(
            [sys.executable, "-m", "agent", *args], capture_output=True, text=True, env=environ, timeout=60, check=False
        )
        output = result.stdout + result.stderr
        assert result.returncode in (0, 1, 5), (args, output)
        for bad in ("Traceback", "internal error", "<unicode string>", "[Errno"):
            assert bad not in output, (args, output)
        if result.returncode == 1:
            assert output.strip(), args  # a failure always says why
