"""The docs agree with the code: what README.md and docs/*.md show a reader works as shown.

- Every command in a ``bash``/``sh``/``shell``/``console`` block (or after a ``$`` prompt) is either run here — a
  ``tessera`` command, in-process through ``agent.cli.main`` on a simulated node, from a directory holding the
  repository's ``configs/``, ``daemonset/`` and ``deploy/`` and the files the docs invent (``my.yaml``,
  ``bad.yaml`` …: ``USER_FILES``) — or matched by ``SKIPPED``, which says why it cannot run here. A command run
  must exit as the doc implies (0, or what ``FAILS_AS_SHOWN`` records from the doc), and every output line a
  ``console`` block shows after it must be in what it printed (``…`` and ``...`` stand for anything).
- Every ``tessera_…`` metric named is exported: the names come from one collection of the real collector (every
  family is built at every collection, with or without series), not from a list kept here.
- Every ``--flag`` is one of the ``tessera`` command it is written with (by the CLI's own parser), or, in prose,
  of some ``tessera`` command or of another tool named in ``FOREIGN_FLAGS``.
- Every repository path (``configs/…``, ``daemonset/…``, ``deploy/…``, ``docs/…``, ``agent/…``, ``tests/…``) and
  every relative link, anchors included, leads somewhere.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import re
import shlex
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from agent.cli import _parser, main
from agent.telemetry.exposition import Family

ROOT = Path(__file__).parents[2]
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
SHELLS = ("bash", "sh", "shell", "console")

# Programs whose commands the docs show but this test does not run, and why.
SKIPPED = {
    "kubectl": "needs a Kubernetes cluster (tests/deploy renders and schema-checks every manifest these apply)",
    "helm": "changes the NVIDIA GPU Operator of a cluster",
    "docker": "builds and pushes the image (tests/deploy/test_dockerfile.py checks the Dockerfile)",
    "curl": "asks a running agent's metrics port (tests/integration/test_metrics_start.py serves those paths)",
    "python3": "makes a venv and installs from the package index: the network, and a minute (.ci/run does it)",
}
SKIPPED_TESSERA = {
    "demo": "runs for seconds; tests/integration/test_demo*.py run both demos and check what they print",
    "run": "the agent serves until it is stopped; the integration tests run it against emulated kubelets",
    "status": "asks the agent running on the node",
}
NODE_LOCAL = "--node local reads the real NVIDIA driver, which this machine does not have (exit 3)"
VARIABLE = "sets a shell variable for the kubectl lines after it"

# Commands the doc shows failing, with the status the doc implies (configuration.md, "Exit codes": 1 is invalid
# input) and what in the doc says so.
FAILS_AS_SHOWN = {
    "tessera validate bad.yaml": (1, "shows bad.yaml: INVALID"),
    "tessera validate deep.yaml": (1, "shows deep.yaml: INVALID"),
    "tessera mig apply --dry-run --node dgx-a100 --config nofit.yaml": (1, "shows the layout does not fit"),
    "tessera mig apply --node dgx-a100 --config configs/": (1, "shows configs/ refused: a directory, not a file"),
}

# The files the docs' commands name that a reader writes for themselves.
USER_FILES = {
    "my.yaml": "version: v1\nsharing:\n  timeSlicing:\n    resources: [{name: nvidia.com/gpu, replicas: 4}]\n",
    "cm.yaml": (
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: tessera-config, namespace: tessera-system}\ndata:\n"
        "  default: |\n    version: v1\n"
        "  time-slicing-4: |\n    version: v1\n"
        "    sharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 4}]}}\n"
    ),
    "my-dra.yaml": "version: v1\ndra:\n  enabled: true\n  gpus: [4, 5, 6, 7]\n",
    "bad.yaml": "version: v1\nsharing: [\n",  # a flow list never closed
    "deep.yaml": "a: " + "[" * 500 + "]" * 500 + "\n",  # 501 levels with the map
    "nofit.yaml": (
        "version: v1\nmig-configs:\n  nofit:\n"
        "    - {devices: all, mig-enabled: true, mig-devices: {7g.80gb: 1, 1g.10gb: 1}}\n"
    ),
}

# Flags of other programs that the docs mention, by the program.
FOREIGN_FLAGS = {
    "--overwrite": "kubectl label",
    "--consumable-shares": "NVIDIA's gpu-kubelet-plugin",
    "--field-selector": "kubectl get",
    "--previous": "kubectl logs",
    "--to-revision": "kubectl rollout undo",
    "--as": "kubectl auth can-i",
    "--set": "helm",
    "--reuse-values": "helm",
    "--build-arg": "docker build",
    "--rm": "docker run",
    "--read-only": "docker run",
    "--tmpfs": "docker run",
    "--cap-drop": "docker run",
    "--set-timeslice": "nvidia-smi compute-policy",
    "--runtime": "nvidia-ctk runtime configure",
    "--output": "nvidia-ctk cdi generate",
    "--device-name-strategy": "nvidia-ctk cdi generate",
    "--root-dir": "the kubelet",
    "--check": "ruff format",
}

FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*[a-z0-9]")
METRIC = re.compile(r"(?<![\w./])tessera_[a-z0-9_]*[a-z0-9](?![\w<*])")
REPO_PATH = re.compile(r"(?<![\w./-])(?:configs|daemonset|deploy|docs|agent|tests)/[\w./+-]*")
KUBECTL_REFERENCE = re.compile(r"(?:rollout \w+|set image) +$")  # `rollout status daemonset/tessera`: kind/name
LINK = re.compile(r"\]\((?!https?:)([^)\s]*)\)")


@dataclass
class Command:
    where: str
    text: str
    argv: list[str]
    shown: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Doc:
    path: Path
    text: str
    blocks: list[tuple[int, str, str]]  # (line, language, body without its indent)
    prose: str  # the text outside fenced blocks

    @property
    def name(self) -> str:
        return str(self.path.relative_to(ROOT))


@functools.cache
def docs() -> tuple[Doc, ...]:
    parsed = []
    for path in DOCS:
        text = path.read_text()
        blocks = []
        for match in FENCE.finditer(text):
            indent = len(match["indent"])
            body = "\n".join(line[indent:] for line in match["body"].splitlines())
            blocks.append((text.count("\n", 0, match.start()) + 1, match["lang"], body))
        parsed.append(Doc(path, text, blocks, FENCE.sub("", text)))
    return tuple(parsed)


def commands(doc: Doc, line: int, body: str) -> list[Command]:
    """A shell block's commands (continuation lines joined, comments dropped); after ``$`` prompts, the lines
    up to the next prompt are the output the doc shows."""
    lines = body.splitlines()
    prompted = any(text.startswith("$ ") for text in lines)
    found: list[Command] = []
    index = 0
    while index < len(lines):
        start, text = index, lines[index]
        index += 1
        if prompted and not text.startswith("$ "):
            if found:
                found[-1].shown.append(text)
            continue
        text = text.removeprefix("$ ") if prompted else text
        while text.endswith("\\") and index < len(lines):
            text, index = text[:-1] + " " + lines[index].strip(), index + 1
        argv = shlex.split(text, comments=True)
        if argv:
            found.append(Command(f"{doc.name}:{line + 1 + start}", " ".join(argv), argv))
    return found


@functools.cache
def all_commands() -> tuple[Command, ...]:
    return tuple(
        command
        for doc in docs()
        for line, lang, body in doc.blocks
        if lang in SHELLS or any(text.startswith("$ ") for text in body.splitlines())
        for command in commands(doc, line, body)
    )


def is_tessera(word: str) -> bool:
    return re.fullmatch(r"(\S*/bin/)?tessera", word) is not None


def skip_reason(argv: list[str]) -> str | None:
    """Why a command the docs show is not run here. None: a ``tessera`` command this test runs, or a program it
    does not know (``test_every_command_shown_is_run_or_skipped_for_a_reason`` names those)."""
    if "=" in argv[0]:
        return VARIABLE
    if not is_tessera(argv[0]):
        return SKIPPED.get(Path(argv[0]).name)
    if argv[1] in SKIPPED_TESSERA:
        return SKIPPED_TESSERA[argv[1]]
    return NODE_LOCAL if ["--node", "local"] in map(list, itertools.pairwise(argv)) else None


RUNNABLE = [command for command in all_commands() if is_tessera(command.argv[0]) and skip_reason(command.argv) is None]


@pytest.fixture(scope="module")
def user_dir() -> Iterator[Path]:
    """A reader's working directory: the repository's configs and manifests, and the files the docs invent."""
    with tempfile.TemporaryDirectory(prefix="tessera-docs-") as name:
        directory = Path(name)
        for kept in ("configs", "daemonset", "deploy"):
            (directory / kept).symlink_to(ROOT / kept)
        for file_name, text in USER_FILES.items():
            (directory / file_name).write_text(text)
        yield directory


def shown_in(line: str, output: str) -> bool:
    """The doc's output line is in the output, whitespace aside, ``…`` and ``...`` standing for anything."""
    parts = re.split(r"\.\.\.|…", "".join(line.split()))
    return re.search(".*?".join(map(re.escape, parts)), "".join(output.split()), re.S) is not None


@pytest.mark.parametrize("command", RUNNABLE, ids=[f"{c.where} {c.text}" for c in RUNNABLE])
def test_a_command_shown_runs_as_shown(command: Command, user_dir: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(user_dir)
    for name in [name for name in os.environ if name.startswith("TESSERA_")]:
        monkeypatch.delenv(name)
    try:
        status = main(command.argv[1:])
    except SystemExit as stop:  # argparse: --help, usage errors
        status = stop.code if isinstance(stop.code, int) else 2
    out, err = capsys.readouterr()
    expected = FAILS_AS_SHOWN.get(command.text, (0, "the doc shows it working"))[0]
    assert status == expected, f"{command.where}: `{command.text}` exited {status}, not {expected}\n{out}{err}"
    missing = [line for line in command.shown if line.strip() not in ("", "...", "…") if not shown_in(line, out + err)]
    assert not missing, f"{command.where}: `{command.text}` did not print, as the doc shows:\n" + "\n".join(missing)


def test_every_command_shown_is_run_or_skipped_for_a_reason() -> None:
    unknown = [f"{c.where}: {c.text}" for c in all_commands() if not is_tessera(c.argv[0]) and not skip_reason(c.argv)]
    assert not unknown, "commands this test neither runs nor skips for a reason (SKIPPED):\n" + "\n".join(unknown)
    assert len(RUNNABLE) >= 15  # the docs show that many runnable commands; fewer means the parsing broke
    ran = {command.text for command in RUNNABLE}
    assert set(FAILS_AS_SHOWN) <= ran, f"FAILS_AS_SHOWN names commands no doc shows: {set(FAILS_AS_SHOWN) - ran}"
    named = {word for command in RUNNABLE for word in command.argv}
    assert set(USER_FILES) <= named, f"USER_FILES no command uses: {set(USER_FILES) - named}"


@dataclass(frozen=True)
class EmptyNode:
    """The agent's status on a node with nothing to offer, as much of it as the collector reads."""

    resources: dict = field(default_factory=dict)
    registered: frozenset[str] = frozenset()
    inventory: None = None


@functools.cache
def collected() -> dict[str, Family]:
    """Every family one collection builds, by name: the collector itself on a node with nothing on it."""
    from agent.telemetry.collector import TelemetryCollector, TelemetryOptions
    from agent.telemetry.latency import OperationLatency

    with tempfile.TemporaryDirectory() as name:
        options = TelemetryOptions(hostname="docs", device_plugin_dir=Path(name), proc_root=Path(name) / "proc")
        collector = TelemetryCollector(options, EmptyNode, dict, latency=OperationLatency(), claims=list)
        collector.collect_once()
    return {family.name: family for family in collector.last.families}


def exported_metrics() -> set[str]:
    """The names a scrape shows: a counter's with ``_total``, a histogram's with its series' suffixes too."""
    suffixes = {"gauge": ("",), "counter": ("_total",), "histogram": ("", "_bucket", "_sum", "_count")}
    return {name + suffix for name, family in collected().items() for suffix in suffixes[family.kind]}


def test_every_metric_named_is_exported_and_every_family_is_documented() -> None:
    exported = exported_metrics()
    assert len(collected()) > 40  # one collection builds every family
    named = {(doc.name, name) for doc in docs() for name in METRIC.findall(doc.text)}
    unknown = sorted(f"{where}: {name}" for where, name in named if name not in exported)
    assert not unknown, "metrics the docs name that the agent does not export:\n" + "\n".join(unknown)
    documented = {name for where, name in named if where in ("docs/metrics.md", "docs/telemetry.md")}
    undocumented = sorted(name for name in collected() if not {name, f"{name}_total"} & documented)
    assert not undocumented, f"exported but in neither docs/metrics.md nor docs/telemetry.md: {undocumented}"


def test_the_metric_tables_give_each_family_s_type_and_labels() -> None:
    rows = [
        (doc.name, match)
        for doc in docs()
        for match in re.finditer(r"^\| `(tessera_\w+)` \| (\w+) \| ([^|]*) \|", doc.text, re.M)
    ]
    assert len(rows) >= len(collected())
    wrong = []
    for where, (name, kind, labels) in ((where, match.groups()) for where, match in rows):
        family = collected()[name.removesuffix("_total") if kind == "counter" else name]
        if (family.kind, family.labels) != (kind, tuple(re.findall(r"`(\w+)`", labels))):
            wrong.append(f"{where}: {name} {kind} {labels.strip()}; the code: {family.kind} {', '.join(family.labels)}")
    assert not wrong, "\n".join(wrong)


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})


def parser_for(words: list[str]) -> tuple[argparse.ArgumentParser, str]:
    """The (sub)parser a ``tessera`` command line reaches, and its name (``tessera mig apply``)."""
    parser, name = _parser(), "tessera"
    for word in words:
        if word not in subparsers(parser):
            break
        parser, name = subparsers(parser)[word], f"{name} {word}"
    return parser, name


def options(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


def tessera_lines(doc: Doc) -> list[tuple[str, list[str]]]:
    """Every ``tessera`` command line the doc writes: in shell blocks (also after ``kubectl exec … --``), in
    inline code, and in README's synopsis; as words after ``tessera``."""
    found = []
    for command in all_commands():
        if command.where.startswith(f"{doc.name}:"):
            at = [i for i, word in enumerate(command.argv) if is_tessera(word)]
            found += [(command.where, command.argv[i + 1 :]) for i in at[:1]]
    for span in INLINE.findall(doc.prose):
        if span.startswith("tessera "):
            found.append((f"{doc.name} `{span}`", span.split()[1:]))
    for line, lang, body in doc.blocks:
        if lang == "text":
            synopsis = re.sub(r"\n +(?=\[|--)", " ", body)  # continuation lines of a synopsis entry
            entries = [text for text in synopsis.splitlines() if text.startswith("tessera ")]
            found += [(f"{doc.name}:{line}", text.split()[1:]) for text in entries]
    return found


def test_every_flag_named_is_the_cli_s() -> None:
    root = _parser()
    everywhere = options(root) | {o for sub in subparsers(root).values() for o in options(sub)}
    everywhere |= {o for sub in subparsers(subparsers(root)["mig"]).values() for o in options(sub)}
    wrong = []
    for doc in docs():
        for where, words in tessera_lines(doc):
            parser, name = parser_for(words)
            flags = {word.split("=")[0] for word in re.findall(r"--[a-z][a-z0-9-]*", " ".join(words))}
            wrong += [f"{where}: {name} has no {flag}" for flag in sorted(flags - options(parser))]
        for flag in sorted(set(FLAG.findall(doc.text)) - everywhere - set(FOREIGN_FLAGS)):
            wrong.append(f"{doc.name}: {flag} is no tessera command's flag (nor in FOREIGN_FLAGS)")
    assert not wrong, "\n".join(wrong)


def test_the_run_table_gives_each_flag_s_environment_twin() -> None:
    """README's ``tessera run`` table: each flag is ``run``'s, and the first variable named is its twin."""
    run = subparsers(_parser())["run"]
    actions = {option: action for action in run._actions for option in action.option_strings}
    readme = docs()[0].text
    table = readme[readme.index("### `tessera run`") :].split("\n\n")[1]
    rows = re.findall(r"^\| `(--[a-z-]+)[^`]*`[^|]*\| ([^|]*)\|", table, re.M)
    assert len(rows) > 30
    wrong = [f"{flag}: no such flag of tessera run" for flag, _ in rows if flag not in actions]
    for flag, variables in rows:
        twin = getattr(actions.get(flag), "env", None)
        if twin is not None and re.findall(r"[A-Z][A-Z_]*[A-Z]", variables)[:1] != [twin]:
            wrong.append(f"{flag}: the table names {variables.strip()}, the flag's twin is {twin}")
    assert not wrong, "\n".join(wrong)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*_]|\[([^]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(doc: Doc) -> set[str]:
    headings = re.findall(r"^#{1,6} +(.+?) *$", doc.prose, re.M)
    seen: dict[str, int] = {}
    found = set()
    for heading in headings:
        base = slug(heading)
        found.add(base if base not in seen else f"{base}-{seen[base]}")
        seen[base] = seen.get(base, 0) + 1
    return found


def test_every_path_and_link_leads_somewhere() -> None:
    by_path = {doc.path.resolve(): doc for doc in docs()}
    dead = []
    for doc in docs():
        # config examples (yaml, json) name the reader's own files
        checked = FENCE.sub(lambda m: "" if m["lang"] in ("yaml", "json") else m[0], doc.text)
        for text_line in checked.splitlines():
            for match in REPO_PATH.finditer(text_line):
                if KUBECTL_REFERENCE.search(text_line[: match.start()]):
                    continue
                path = match[0].rstrip(".")
                if "<" not in text_line[match.end() : match.end() + 1] and not (ROOT / path).exists():
                    dead.append(f"{doc.name}: {path}")
        for target in LINK.findall(doc.prose):
            file_part, _, anchor = target.partition("#")
            linked = (doc.path.parent / file_part if file_part else doc.path).resolve()
            if not linked.exists():
                dead.append(f"{doc.name}: link {target}")
            elif anchor and linked in by_path and anchor not in anchors(by_path[linked]):
                dead.append(f"{doc.name}: link {target}: no such heading")
    assert not dead, "\n".join(dead)
