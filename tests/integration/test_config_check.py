"""The sharing config checked in a child process (agent.config.check, agent.config.isolated).

What a user would notice: the agent applies exactly the config ``tessera plan`` validates in-process (same model,
warnings, digest and reason, same errors); a checker that dies, hangs, floods its output or answers garbage is a
config error naming the config path and what happened, never a crash or a stall, and the next change is checked
afresh; the agent's own process holds neither the schema nor PyYAML for it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from agent.config.isolated import Check, CheckerFailed
from agent.config.model import ConfigError
from agent.config.source import load_config, read_config_set
from tests.integration.test_config_reload import SHARED_GPUS, world  # noqa: F401 - the fixture

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
PRODUCTS = [["NVIDIA A100-SXM4-80GB"], ["NVIDIA H100 80GB HBM3"], []]
BAD = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n      - name: nvidia.com/gpu\n        replicas: '4'\n"


def _sets(tmp_path: Path) -> list[Path]:
    """Every example config directory of the project, a ConfigMap manifest, and a directory with a bad config."""
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "default.yaml").write_text(BAD)
    (bad / "typo.yaml").write_text("version: v1\ntimeSlice:\n  resources: []\n")
    (bad / "match.yaml").write_text('version: v1\nmatch: ["NVIDIA H100*"]\n')
    return [ROOT / "configs", ROOT / "daemonset" / "base" / "configs", *sorted((ROOT / "configs").glob("*.yaml")), bad]


def _outcome(load, *args, **kwargs) -> object:
    try:
        return load(*args, **kwargs)
    except ConfigError as error:
        return ("error", error.origin, error.problems)


def test_the_child_gives_what_parse_config_gives_in_process(tmp_path: Path) -> None:
    for path in _sets(tmp_path):
        checked = Check(path).result()
        for requested in [None, *read_config_set(path).documents]:
            for products in PRODUCTS:
                expected = _outcome(load_config, read_config_set(path), requested=requested, gpu_products=products)
                got = _outcome(checked.choose, requested, None, products)
                assert got == expected, (path, requested, products)


def test_a_label_choice_is_the_same_as_in_process(tmp_path: Path) -> None:
    path = ROOT / "daemonset" / "base" / "configs"
    checked = Check(path).result()
    for label in ("per-gpu-sharing", "mps-10gb.yaml", "no-such-config"):
        expected = load_config(read_config_set(path), label=label, gpu_products=PRODUCTS[0])
        assert checked.choose(None, label, PRODUCTS[0]) == expected


def test_the_agents_process_loads_neither_the_schema_nor_yaml() -> None:
    code = (
        "import sys\nfrom pathlib import Path\nfrom agent.config.isolated import Check\n"
        f"loaded = Check(Path({str(ROOT / 'daemonset/base/configs')!r})).result().choose(None, 'mps-10gb', [])\n"
        "print(loaded.name, loaded.model.replicated[0])\n"
        "print(sorted(m for m in sys.modules if m in ('agent.config.schema', 'yaml')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.splitlines() == ["mps-10gb.yaml mps", "[]"]


# ----- a checker that misbehaves -------------------------------------------------------------------------


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _rejected(check: Check) -> str:
    with pytest.raises(ConfigError) as error:
        check.result()
    assert error.value.origin == str(check.path)
    return str(error.value)


def test_a_checker_that_dies_is_a_config_error_with_its_last_words(tmp_path: Path) -> None:
    code = "import sys; print('MemoryError: out of memory', file=sys.stderr); sys.exit(3)"
    message = _rejected(Check(tmp_path, command=_python(code)))
    assert "exit code 3" in message and "MemoryError: out of memory" in message
    assert "last good config stays" in message


def test_a_checker_that_hangs_is_stopped_at_its_deadline(tmp_path: Path) -> None:
    check = Check(tmp_path, command=_python("import time; time.sleep(120)"), timeout=1.0)
    started = time.monotonic()
    message = _rejected(check)
    assert time.monotonic() - started < 30
    assert "no answer within 1 s" in message
    assert check._process is not None and check._process.poll() is not None  # killed, not left behind


def test_a_checker_that_closes_its_output_but_keeps_running_is_stopped_at_its_deadline(tmp_path: Path) -> None:
    """End of output is not the end of the child: a checker that closes stdout and stderr and then hangs is still
    held to its deadline, and killed."""
    code = "import os, time\nos.close(1)\nos.close(2)\ntime.sleep(120)"
    check = Check(tmp_path, command=_python(code), timeout=2.0)  # ample for the child to start and close both
    outcome: list[BaseException | object] = []

    def collect() -> None:
        try:
            outcome.append(check.result())
        except BaseException as error:  # the outcome is what the test looks at
            outcome.append(error)

    waiter = threading.Thread(target=collect, daemon=True)
    waiter.start()
    waiter.join(timeout=30)  # far past the 2 s deadline: a check still waiting here ignored it
    try:
        assert not waiter.is_alive(), "the check still waits on a checker that closed its output but runs on"
        [error] = outcome
        assert isinstance(error, CheckerFailed) and error.origin == str(tmp_path)
        assert "the config checker did not exit within 2 s" in str(error)
        assert "last good config stays" in str(error)
        assert check._process is not None and check._process.poll() is not None  # killed, not left behind
    finally:
        check.cancel()
        waiter.join(timeout=30)


def test_a_checker_that_floods_its_output_is_stopped(tmp_path: Path) -> None:
    code = "import sys\nwhile True: sys.stdout.write('x' * 65536)"
    check = Check(tmp_path, command=_python(code), max_output=1 << 20)
    assert "larger than 1 MiB" in _rejected(check)
    assert check._process is not None and check._process.poll() is not None


def _answer(model: dict) -> str:
    member = {"digest": "0", "match": None, "match_problem": None, "warnings": [], "model": model}
    return json.dumps({"origin": "x", "is_directory": True, "manifest": None, "members": {"a": member}})


@pytest.mark.parametrize(
    ("answer", "words"),
    [
        ("not json at all", "not a checked config set"),
        ("[1, 2]", "not a checked config set"),
        (json.dumps({"origin": "x", "is_directory": True, "manifest": None}), "not a checked config set"),
        (
            _answer({"sharing": {"time_slicing": {"resources": [{"name": "g", "replicas": "4"}]}}}),
            "replicas: expected int, got str",
        ),
        (_answer({"no_such_field": 1}), "has no field 'no_such_field'"),
    ],
)
def test_an_answer_that_is_no_checked_set_is_a_config_error(tmp_path: Path, answer: str, words: str) -> None:
    code = f"import sys; sys.stdout.write({answer!r})"
    assert words in _rejected(Check(tmp_path, command=_python(code)))


def test_an_agent_whose_checker_died_advertises_nothing_then_applies_the_next_change(world) -> None:  # noqa: F811
    kubelet, configmap, start = world
    configmap.publish({"default": SHARED_GPUS})
    dead = Check(configmap.root, command=_python("import sys; sys.exit(9)"))
    agent = start(config_check=dead)
    kubelet.wait_for(lambda: agent.status.config_error is not None, 10, "the checker's failure to be noticed")
    assert "exit code 9" in agent.status.config_error and str(configmap.root) in agent.status.config_error
    assert "nvidia.com/gpu.shared" not in kubelet.resources()
    configmap.publish({"default": SHARED_GPUS + "\n"})  # the next change is checked afresh, by the real checker
    kubelet.wait_for(lambda: kubelet.allocatable("nvidia.com/gpu.shared") == 8, 20, "the config applied")
    assert agent.status.config_error is None


def test_an_agent_whose_checker_died_tries_again_on_its_own(world) -> None:  # noqa: F811
    """The checker failing (it died, hung, could not start) says nothing about the config: the agent checks the
    same files again after a backoff, without waiting for them to change (a config error would wait)."""
    kubelet, configmap, start = world
    configmap.publish({"default": SHARED_GPUS})
    dead = Check(configmap.root, command=_python("import sys; sys.exit(9)"))
    agent = start(config_check=dead)
    kubelet.wait_for(lambda: agent.status.config_error is not None, 10, "the checker's failure to be noticed")
    kubelet.wait_for(lambda: kubelet.allocatable("nvidia.com/gpu.shared") == 8, 20, "the config applied unchanged")
    assert agent.status.config_error is None


# ----- when the checker runs again -------------------------------------------------------------------------


def test_the_stamp_moves_with_a_configmap_swap_and_only_then(tmp_path: Path) -> None:
    """A checked set is reused while its files stay (a node label choosing another config of it needs no new
    child); a ConfigMap update (the ``..data`` swap) or an edited file is checked again."""
    from agent.config.early import stamp
    from tests.integration.test_config_reload import ConfigMapDir

    configmap = ConfigMapDir(tmp_path / "cm")
    configmap.publish({"default": SHARED_GPUS, "other": SHARED_GPUS})
    first = stamp(configmap.root)
    assert stamp(configmap.root) == first
    configmap.publish({"default": SHARED_GPUS, "other": SHARED_GPUS})  # the same texts, a new ..data
    assert stamp(configmap.root) != first
    single = tmp_path / "config.yaml"
    single.write_text(SHARED_GPUS)
    before = stamp(single)
    single.write_text(SHARED_GPUS + "\n")
    assert stamp(single) != before


def test_an_early_checker_for_another_path_is_stopped(tmp_path: Path) -> None:
    """``tessera run`` starts the checker on the path it was given before the options are read; if the options
    name another config (NVIDIA's --config-file, say), that checker is stopped, not left running; on the same
    path the agent takes it over."""
    from agent.agent import AgentOptions
    from agent.run import take_over

    options = AgentOptions(device_plugin_dir=tmp_path / "dp", config_path=tmp_path / "other.yaml")
    early = Check(tmp_path / "given.yaml", command=_python("import time; time.sleep(120)"))
    assert take_over(options, early).config_check is None
    assert early._process is not None and early._process.poll() is not None
    same = Check(tmp_path / "other.yaml", command=_python("import time; time.sleep(120)"))
    try:
        assert take_over(options, same).config_check is same
        assert same._process is not None and same._process.poll() is None
    finally:
        same.cancel()


@pytest.mark.parametrize(
    ("argv", "environ", "expected"),
    [
        (["run", "--config", "/etc/tessera/config"], {}, "/etc/tessera/config"),
        (["run", "--simulate", "dgx-a100", "--config=/c.yaml"], {}, "/c.yaml"),
        (["run", "--config", "/a.yaml", "--config", "/b.yaml"], {}, "/b.yaml"),  # argparse: the last one wins
        (["run"], {"TESSERA_CONFIG": "/env.yaml"}, "/env.yaml"),
        (["run", "--config", "/flag.yaml"], {"TESSERA_CONFIG": "/env.yaml"}, "/flag.yaml"),
        (["run", "--config-file", "/nvidia.yaml"], {}, "/nvidia.yaml"),  # NVIDIA's flag, after Tessera's
        (["run"], {"CONFIG_FILE": "/nvidia.yaml", "TESSERA_CONFIG": "/env.yaml"}, "/env.yaml"),
        (["run", "--config-file", "/nvidia.yaml"], {"TESSERA_CONFIG": "/env.yaml"}, "/env.yaml"),
        (["run"], {"CONFIG_FILE": "/nvidia.yaml"}, "/nvidia.yaml"),
        (["run"], {}, None),
        (["run", "--config"], {}, None),  # argparse's error to give, not a path
        (["plan", "--config", "/c.yaml"], {}, None),  # only `run` starts a checker before its parser
        (["run", "--", "--config", "/c.yaml"], {}, None),
        (["run", "--conf", "/c.yaml"], {}, None),  # abbreviated: argparse reads it; the agent checks it itself
        ([], {"TESSERA_CONFIG": "/env.yaml"}, None),
    ],
)
def test_the_config_is_read_from_the_command_line_before_the_parser(argv, environ, expected) -> None:
    from agent.config.early import config_on_command_line

    assert config_on_command_line(argv, environ) == expected


def _hooked_env(tmp_path: Path, hold: str | None = None, **extra: str) -> dict[str, str]:
    """This environment (less TESSERA_*) with tests/checker_hook's ``sitecustomize`` on the path; ``hold``: what
    the first checker to take it does (``hang 120``, ``exit 3``: see that module)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests" / "checker_hook"), str(ROOT)])
    if hold is not None:
        (tmp_path / "hold").write_text(hold)
        env["CHECKER_HOOK"] = str(tmp_path / "hold")
    return {**env, **extra}


def _checkers_of(path: Path) -> list[int]:
    """Live processes whose command line names ``path``: a checker on it (``-m agent.config.check <path>``, or the
    child ``tessera run --config <path>`` forked for its first check), once that command has ended."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            words = (proc / "cmdline").read_bytes().split(b"\0")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if str(path).encode() in words and state != "Z":
            found.append(int(proc.name))
    return found


@pytest.mark.parametrize("words", [["--no-such-flag"], ["--help"], ["--health-recovery-seconds", "-5"]])
def test_a_run_that_never_starts_leaves_no_early_checker_behind(tmp_path: Path, words: list[str]) -> None:
    """``tessera run`` starts the config checker before it parses its flags; a usage error or ``--help`` ends the
    command at once, and the checker with it (a held checker would otherwise run on for two minutes)."""
    config = tmp_path / "config"
    config.mkdir()
    (config / "default.yaml").write_text(SHARED_GPUS)
    env = _hooked_env(tmp_path, "hang 120")
    result = subprocess.run(
        [sys.executable, "-m", "agent", "run", "--config", str(config), *words],
        capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == (0 if words == ["--help"] else 2), result.stderr
    assert _checkers_of(config) == []


def test_tessera_run_forks_its_checker_before_the_command_line_loads(tmp_path: Path) -> None:
    """The checker is the longest step of a start and the agent waits for it: ``tessera run`` forks it first, before
    the command line's modules (argparse, logging, json, pathlib, the CLI) load — the checker uses none of them and
    would start ~20 ms later. What the process holds as it forks is what the checker starts with."""
    config = tmp_path / "config"
    config.mkdir()
    (config / "default.yaml").write_text(SHARED_GPUS)
    loaded = tmp_path / "modules"
    env = _hooked_env(tmp_path, CHECKER_FORK_MODULES=str(loaded))
    result = subprocess.run(
        [sys.executable, "-m", "agent", "run", "--config", str(config), "--no-such-flag"],
        capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr  # the usage error, said after the fork
    at_start = subprocess.run(  # what the interpreter loads by itself (a development install's finder: pathlib)
        [sys.executable, "-c", "import sys; print(*sys.modules)"], capture_output=True, text=True, env=env, check=True
    ).stdout.split()
    modules = set(loaded.read_text().split()) - set(at_start)
    assert "agent.config.early" in modules and "agent.config.forked" in modules  # this is the early fork
    assert not modules & {"agent.cli", "argparse", "logging", "json", "pathlib", "typing", "subprocess"}, modules


@pytest.mark.parametrize("why", ["fork-fails", "a-thread-runs"])
def test_when_the_entry_point_cannot_fork_a_new_interpreter_checks_the_config(why: str) -> None:
    """The early fork is only a head start: a fork the kernel refuses (EAGAIN: too many processes) or a process that
    already runs a thread (it must not fork) gives no early check, and the config is checked by a new interpreter,
    the same answer; no pipe of the failed fork is left open."""
    code = (
        "import os, sys, threading, errno\nfrom pathlib import Path\n"
        "from agent.config.early import fork_early\nfrom agent.config.isolated import Check, start_early\n"
        "if sys.argv[2] == 'fork-fails':\n"
        "    def refused():\n        raise OSError(errno.EAGAIN, 'Resource temporarily unavailable')\n"
        "    os.fork = refused\n"
        "else:\n    threading.Thread(target=threading.Event().wait, daemon=True).start()\n"
        "fds = len(os.listdir('/proc/self/fd'))\n"
        "early = fork_early(['run', '--config', sys.argv[1]], {})\n"
        "print(early is None, len(os.listdir('/proc/self/fd')) == fds)\n"
        "check = start_early(sys.argv[1], early=early)\n"
        "print(type(check._process).__name__, check.result().members == Check(Path(sys.argv[1])).result().members)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(ROOT / "configs"), why], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["True True", "Popen True"]


def test_the_checker_loads_no_model_machinery_and_searches_no_installed_package() -> None:
    """The check is on every start's path: it reads the configs with PyYAML and agent.config.schema's walk only —
    no pydantic (~70 ms to import and build its models, the longest step of a start when the checker used it) and
    no search of installed distributions (``importlib.metadata``, with ``email`` and ``zipfile``)."""
    code = (
        "import io, sys, contextlib\nfrom agent.config.check import main\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n    main([sys.argv[1]])\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pydantic', 'pydantic_core')"
        " or m == 'importlib.metadata'))\n"
        "print(out.getvalue())\n"
    )
    for path in (ROOT / "configs", ROOT / "daemonset" / "base" / "configs"):
        result = subprocess.run(
            [sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60, cwd=ROOT
        )
        assert result.returncode == 0, result.stderr
        loaded, answer = result.stdout.split("\n", 1)
        assert loaded == "[]", (path, loaded)
        members = json.loads(answer)["members"]
        assert members and all("model" in member for member in members.values()), members


def test_the_first_check_forked_by_tessera_run_answers_as_a_new_interpreter_does() -> None:
    """``tessera run`` forks its first checker (no new interpreter, ~25 ms sooner); the answer is the same checked
    set, warnings and errors alike. Forked in a fresh process: this one has threads, which must never fork."""
    code = (
        "import sys\nfrom pathlib import Path\nfrom agent.config.early import fork_early\n"
        "from agent.config.isolated import Check, start_early\n"
        "path = sys.argv[1]\n"
        "forked = start_early(None, early=fork_early(['run', '--config', path], {}))\n"
        "assert type(forked._process).__name__ == 'ForkedChecker', forked._process\n"
        "got, expected = forked.result(), Check(Path(path)).result()\n"
        "print(got.members == expected.members and got.config_set == expected.config_set)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pydantic', 'yaml')))\n"
    )
    for path in (ROOT / "configs", ROOT / "daemonset" / "base" / "configs"):
        result = subprocess.run(
            [sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60, cwd=ROOT
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines() == ["True", "[]"], (path, result.stdout)


def test_a_forked_checker_that_dies_is_a_checker_failure(tmp_path: Path) -> None:
    """A config that cannot be read is the set's error, as from a new interpreter; a forked checker that dies is
    ``CheckerFailed`` naming its exit code (retried with backoff by the agent, not waited on until the files
    change). The hold acts as the child is forked, before its stderr is the pipe: its words are not asked for."""
    code = (
        "import sys\nfrom agent.config.early import fork_early\nfrom agent.config.isolated import start_early\n"
        "check = start_early(None, early=fork_early(['run', '--config', sys.argv[1]], {}))\n"
        "try:\n    check.result()\nexcept Exception as error:\n    print(type(error).__name__, error)\n"
    )
    missing = tmp_path / "no-such-config.yaml"
    result = subprocess.run([sys.executable, "-c", code, str(missing)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ConfigError ") and str(missing) in result.stdout  # the set cannot be read
    hooked = "import os\nos.register_at_fork(after_in_child=__import__('sitecustomize')._take)\n" + code
    result = subprocess.run(
        [sys.executable, "-c", hooked, str(ROOT / "configs")],
        capture_output=True, text=True, timeout=60, env=_hooked_env(tmp_path, "exit 3"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("CheckerFailed "), result.stdout
    assert "exit code 3" in result.stdout


@pytest.mark.parametrize("pidfd", ["pidfd", "no-pidfd"])
def test_waiting_on_a_forked_checker_ends_at_its_exit_or_its_deadline(tmp_path: Path, pidfd: str) -> None:
    """The agent waits for a forked checker's exit, bounded: a checker that runs on past the wait's timeout is
    ``TimeoutExpired`` (then killed, its exit code the kill's), one that exits gives its exit code. The child's
    exit wakes the wait (its pidfd); a kernel without pidfds gets the same answers by asking."""
    code = (
        "import os, subprocess, sys\n"
        "os.register_at_fork(after_in_child=__import__('sitecustomize')._take)\n"
        "from agent.config.forked import ForkedChecker\n"
        "if sys.argv[2] == 'no-pidfd':\n    del os.pidfd_open\n"
        "held = ForkedChecker(sys.argv[1])\n"
        "try:\n    print('exited', held.wait(timeout=1.0))\nexcept subprocess.TimeoutExpired:\n    print('timed out')\n"
        "held.kill()\nprint('killed', held.wait())\n"
        "free = ForkedChecker(sys.argv[1])\n"
        "answer = free.stdout.read()\n"
        "print('answered', answer[:1] == b'{', free.wait(timeout=60))\n"
    )
    env = _hooked_env(tmp_path, "hang 120")
    result = subprocess.run(
        [sys.executable, "-c", code, str(ROOT / "configs"), pidfd],
        capture_output=True, text=True, timeout=60, env=env, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["timed out", "killed -9", "answered True 0"]


def test_a_forked_checker_reaped_by_someone_else_is_a_checker_failure_not_a_crash() -> None:
    """A forked checker whose exit another waiter took (nobody in the agent does; a library might) leaves its exit
    code unknown: the check fails as a checker failure (retried), and stopping it raises nothing."""
    code = (
        "import os, sys\nfrom agent.config.early import fork_early\nfrom agent.config.isolated import start_early\n"
        "check = start_early(None, early=fork_early(['run', '--config', sys.argv[1]], {}))\n"
        "os.waitpid(check._process.pid, 0)  # someone else reaps it\n"
        "try:\n    check.result()\nexcept Exception as error:\n    print(type(error).__name__, error)\n"
        "check.cancel()\nprint('stopped')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(ROOT / "configs")], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("CheckerFailed ") and "exit code -1" in lines[0], lines
    assert lines[-1] == "stopped"
