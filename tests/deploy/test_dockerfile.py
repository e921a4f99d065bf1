"""The Dockerfile, read as text (tests/image builds and runs it): pinned base image, multi-stage, no compilers in
the final image, the console script as entrypoint, OCI labels, and a build context (.dockerignore) that
holds exactly what the wheel is built from - which is then built, as the builder stage would."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from tests.deploy.conftest import ROOT, project

DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
COMPILERS = ("gcc", "g++", "clang", "build-essential", "make", "musl-dev", "libc6-dev", "python3-dev")
OCI_LABELS = ("title", "description", "source", "licenses", "version")


class Stage:
    def __init__(self, image: str, name: str | None) -> None:
        self.image, self.name = image, name
        self.instructions: list[tuple[str, str]] = []

    def args(self, keyword: str) -> list[str]:
        return [a for k, a in self.instructions if k == keyword]


def parse() -> tuple[dict[str, str], list[Stage]]:
    """(global ARG defaults, stages). Comments and line continuations as Docker reads them."""
    logical: list[str] = []
    pending = ""
    for raw in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not pending):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, "the Dockerfile ends inside a line continuation"
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            words = rest.split()
            image = _substitute(words[0], global_args)
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(image, name))
        elif not stages:
            assert keyword == "ARG", f"only ARG may precede the first FROM, not {keyword}"
            name, _, default = rest.partition("=")
            global_args[name.strip()] = default.strip().strip('"')
        else:
            stages[-1].instructions.append((keyword, rest.strip()))
    return global_args, stages


def _substitute(text: str, values: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: values[m[1] or m[2]], text)


def stage_args(stage: Stage) -> dict[str, str]:
    out = {}
    for arg in stage.args("ARG"):
        name, _, default = arg.partition("=")
        out[name.strip()] = default.strip().strip('"')
    return out


def dockerignore_excludes(relative: str) -> bool:
    """moby's patternmatcher: last matching pattern wins; a pattern also matches every parent directory."""
    rules = []
    for line in DOCKERIGNORE.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").strip().strip("/")
        rules.append((negate, re.compile(_glob_regex(pattern))))
    parts = relative.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for negate, regex in rules:
        if any(regex.fullmatch(c) for c in candidates):
            excluded = not negate
    return excluded


def _glob_regex(pattern: str) -> str:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out, i = out + pattern[i : end + 1], end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return out


def context_files() -> list[str]:
    """The files `docker build .` sends. Directories that are excluded and that no `!` pattern re-includes
    are not walked (a developer's .venv or .git can be large)."""
    negations = [
        line.strip()[1:].strip().strip("/")
        for line in DOCKERIGNORE.read_text(encoding="utf-8").splitlines()
        if line.strip().startswith("!")
    ]
    files = []
    for directory, dirs, names in os.walk(ROOT):
        base = Path(directory).relative_to(ROOT).as_posix()
        prefix = "" if base == "." else base + "/"
        dirs[:] = [
            d for d in dirs if not dockerignore_excludes(prefix + d) or any(n.startswith(prefix + d) for n in negations)
        ]
        files += [prefix + n for n in names if not dockerignore_excludes(prefix + n)]
    return sorted(files)


# ----- the tests ------------------------------------------------------------------------------------------


def test_multi_stage_with_a_builder():
    _, stages = parse()
    assert len(stages) >= 2
    builder, final = stages[0], stages[-1]
    assert builder.name == "builder" and final.name != "builder"
    # the final stage gets the installed tree from the builder only; it copies nothing from the source tree
    copies = final.args("COPY")
    assert copies and not final.args("ADD")
    assert all(copy.split()[0] == "--from=builder" for copy in copies), copies


def test_base_images_are_pinned_to_a_patch_version():
    global_args, stages = parse()
    assert "PYTHON_IMAGE" in global_args
    for stage in stages:
        match = re.fullmatch(r"python:(\d+)\.(\d+)\.(\d+)-slim-(\w+)(@sha256:[0-9a-f]{64})?", stage.image)
        assert match, f"{stage.image}: pin python:<major>.<minor>.<patch>-slim-<debian release>[@sha256:...]"
        assert (int(match[1]), int(match[2])) >= (3, 11), "pyproject.toml requires Python >= 3.11"
    assert len({s.image for s in stages}) == 1, "builder and final stage must use the same interpreter"
    assert "@sha256:" in DOCKERFILE.read_text(encoding="utf-8"), "explain digest pinning"


def test_every_copy_source_exists_and_is_in_the_build_context():
    _, stages = parse()
    context = context_files()
    copied = 0
    for stage in stages:
        for instruction in stage.args("COPY") + stage.args("ADD"):
            if any(w.startswith("--from") for w in instruction.split()):
                assert stage is stages[-1], "only the final stage copies from the builder"
                continue
            words = [w for w in instruction.split() if not w.startswith("--")]
            for source in words[:-1]:
                path = ROOT / source
                assert path.exists(), f"COPY {source}: no such file"
                prefix = source.rstrip("/")
                assert any(f == prefix or f.startswith(prefix + "/") for f in context), f"{source} is .dockerignored"
                copied += 1
    assert copied >= 3


def test_build_context_is_only_what_the_wheel_needs():
    context = context_files()
    assert {"pyproject.toml", "README.md", "agent/cli.py", "agent/sim/presets/dgx-a100.yaml"} <= set(context)
    assert any(f.startswith("agent/data/") and f.endswith(".json") for f in context)
    assert all(f in ("pyproject.toml", "README.md", "LICENSE") or f.startswith("agent/") for f in context), context
    assert not [f for f in context if "__pycache__" in f or f.endswith(".pyc")]
    for outside in ("tests/deploy/test_dockerfile.py", "daemonset/base/daemonset.yaml", "tessera_agent.egg-info/x"):
        assert dockerignore_excludes(outside), outside


def test_entrypoint_is_the_console_script_and_run_its_default_command():
    """`podman run IMAGE` runs the agent; `podman run IMAGE demo` (or `plan ...`) runs that command instead, as
    the arguments after the image replace CMD only."""
    _, stages = parse()
    (entrypoint,) = stages[-1].args("ENTRYPOINT")
    (cmd,) = stages[-1].args("CMD")
    program, default = json.loads(entrypoint), json.loads(cmd)  # exec form: signals reach the agent, no shell
    assert program == ["tessera"] and default == ["run"]
    assert project()["scripts"]["tessera"] == "agent.entry:main"  # forks the config checker first, then the CLI
    for arguments in (default, ["demo"], ["plan", "--node", "t4x4"]):
        result = subprocess.run([sys.executable, "-m", "agent", *arguments, "--help"], capture_output=True, check=False)
        assert result.returncode == 0, (arguments, result.stderr)


def test_no_compilers_in_the_final_stage():
    _, stages = parse()
    final = " ".join(stages[-1].args("RUN"))
    for tool in COMPILERS:
        assert not re.search(rf"(?<![\w-]){re.escape(tool)}(?![\w-])", final), f"{tool} in the final stage"
    assert "apt-get install" not in final and "apk add" not in final
    assert "pip uninstall --yes pip" in final
    # the builder needs no compiler either: the dependencies come as binary wheels
    assert any("--only-binary=:all:" in run for run in stages[0].args("RUN"))


def test_oci_labels():
    _, stages = parse()
    final = stages[-1]
    labels = dict(re.findall(r'(org\.opencontainers\.image\.\w+)="([^"]*)"', " ".join(final.args("LABEL"))))
    for key in OCI_LABELS:
        assert f"org.opencontainers.image.{key}" in labels, key
    values = {k: _substitute(v, stage_args(final)) for k, v in labels.items()}
    assert values["org.opencontainers.image.version"] == project()["version"]
    assert values["org.opencontainers.image.licenses"] == project()["license"]  # an SPDX expression, both
    assert values["org.opencontainers.image.title"] == "tessera-agent"


def test_runtime_environment_matches_the_daemonset():
    _, stages = parse()
    env = " ".join(stages[-1].args("ENV"))
    assert "NVIDIA_VISIBLE_DEVICES=all" in env
    assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in env
    assert "PYTHONDONTWRITEBYTECODE=1" in env  # the root filesystem is read-only
    assert stages[-1].args("USER") == ["0:0"]
    assert stages[-1].args("EXPOSE") == ["9479"]


def test_wheel_builds_from_the_build_context(tmp_path):
    """What the builder stage does, from exactly the files the build context holds."""
    context = tmp_path / "context"
    for relative in context_files():
        target = context / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / relative, target)
    out = tmp_path / "wheels"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(out), str(context)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "License classifiers are deprecated" not in result.stderr and "did not match any files" not in result.stderr
    assert "`project.license` as a TOML table is deprecated" not in result.stdout + result.stderr
    (wheel,) = out.glob("tessera_agent-*.whl")
    assert wheel.name.startswith(f"tessera_agent-{project()['version']}-py3-none-any")
    names = zipfile.ZipFile(wheel).namelist()
    assert "agent/cli.py" in names and "agent/sim/presets/dgx-a100.yaml" in names
    assert any(n.startswith("agent/data/") and n.endswith(".json") for n in names)
    (entry_points,) = [n for n in names if n.endswith("entry_points.txt")]
    assert "tessera = agent.entry:main" in zipfile.ZipFile(wheel).read(entry_points).decode()
    # PEP 639: the license as an SPDX expression, its text in the wheel (setuptools >= 77, pyproject.toml)
    (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    headers = zipfile.ZipFile(wheel).read(metadata).decode().split("\n\n")[0].splitlines()
    assert "License-Expression: Apache-2.0" in headers and "License-File: LICENSE" in headers
    assert not [h for h in headers if h.startswith("License: ")]  # the deprecated free-text field
    (text,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    assert "Apache License" in zipfile.ZipFile(wheel).read(text).decode()


def test_the_build_requirement_reads_the_spdx_license():
    """`license = "Apache-2.0"` and `license-files` need setuptools >= 77 (PEP 639); an older one fails the build."""
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["build-system"]["requires"]
    (setuptools,) = [r for r in requires if r.startswith("setuptools")]
    minimum = re.fullmatch(r"setuptools>=(\d+)(?:\.\d+)*", setuptools)
    assert minimum is not None and int(minimum[1]) >= 77, setuptools
    assert isinstance(project()["license"], str) and project()["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text(encoding="utf-8").lstrip().startswith("Apache License")
