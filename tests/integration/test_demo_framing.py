"""`tessera demo` says what it runs before it runs it, shows an unschedulable pod the way a cluster does
(Pending, with the scheduler's reason), labels the timings it shortens, and turns bad input into one line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

TIMEOUT = 60


def _demo(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    return subprocess.run(
        [sys.executable, "-m", "agent", "demo", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env,
        check=False,
    )


@pytest.fixture(scope="module")
def default_run() -> subprocess.CompletedProcess[str]:
    return _demo()


def _line(out: str, start: str) -> str:
    return next(line for line in out.splitlines() if line.strip().startswith(start))


def test_the_demo_names_its_node_sharing_config_and_mig_strategy_before_it_starts(
    default_run: subprocess.CompletedProcess[str],
) -> None:
    assert default_run.returncode == 0, default_run.stderr
    assert default_run.stderr == ""  # nothing but the story: no log lines, no gRPC core chatter
    lines = default_run.stdout.splitlines()
    first_step = next(i for i, line in enumerate(lines) if line.startswith("[1/5]"))
    frame = "\n".join(lines[:first_step])
    assert "demo-node (preset 'demo', chosen with --node): 4× NVIDIA A100-SXM4-80GB" in _line(frame, "node ")
    config = _line(frame, "sharing config ")
    assert "demo-time-slicing" in config and "GPU 3 time-sliced ×4 as nvidia.com/gpu.shared" in config
    assert "built into the demo, agent/demo.py" in frame  # where the config comes from
    assert "mixed (--mig-strategy)" in _line(frame, "MIG strategy ")


def test_a_pod_that_does_not_fit_stays_pending_with_the_schedulers_reason(
    default_run: subprocess.CompletedProcess[str],
) -> None:
    pending = _line(default_run.stdout, "pod greedy")
    assert pending.endswith(
        "-> Pending: 0/1 nodes are available: 1 Insufficient nvidia.com/gpu. "
        "preemption: 0/1 nodes are available: 1 No preemption victims found for incoming pod."
    )
    assert "refused" not in default_run.stdout and "UnexpectedAdmissionError" not in default_run.stdout
    assert "greedy" not in _line(default_run.stdout, "5 resources registered again")  # never admitted


def test_shortened_timings_say_so(default_run: subprocess.CompletedProcess[str]) -> None:
    assert "health recovery after 2 s without errors (shortened from 60 s for the demo)" in default_run.stdout
    assert "no new errors for 2 s (shortened from 60 s for the demo)" in default_run.stdout


def test_single_runs_where_every_gpu_has_one_mig_profile() -> None:
    result = _demo("--node", "a100-mig", "--mig-strategy", "single")
    assert result.returncode == 0, result.stderr
    assert "single (--mig-strategy)" in _line(result.stdout, "MIG strategy ")
    assert "nvidia.com/gpu             capacity 7, allocatable 7" in result.stdout
    assert "-> Pending: 0/1 nodes are available: 1 Insufficient nvidia.com/gpu." in _line(result.stdout, "pod greedy")


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (
            ["--node", "nosuch"],
            2,
            ["'nosuch' is neither a file nor a preset", "presets: a100-mig, demo, dgx-a100, dgx-h100, t4x4", "--node"],
        ),
        (
            ["--mig-strategy", "single"],
            1,
            [
                "--mig-strategy single cannot apply to node 'demo'",
                "GPU(s) 0, 1 have MIG enabled and GPU(s) 2, 3 do not",  # why
                "Try --mig-strategy mixed, or --node a100-mig --mig-strategy single",  # the fix
            ],
        ),
        (["--mig-strategy", "bogus"], 2, ["invalid choice: 'bogus'"]),
        (["--node", "."], 2, ["is a directory", "docs/simulated-node.md"]),
    ],
    ids=["unknown-node", "single-on-mixed-node", "unknown-strategy", "directory-as-node"],
)
def test_bad_input_is_one_line_naming_the_problem_and_the_fix(args: list[str], code: int, says: list[str]) -> None:
    result = _demo(*args)
    assert result.returncode == code
    assert "Traceback" not in result.stderr + result.stdout
    assert "internal error" not in result.stderr
    assert result.stdout == ""  # nothing started
    error = [line for line in result.stderr.splitlines() if line.startswith("tessera")][-1]
    for text in says:
        assert text in error


def test_a_reader_that_leaves_early_ends_the_demo_quietly() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    with subprocess.Popen(
        [sys.executable, "-m", "agent", "demo"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True
    ) as process:
        assert process.stdout is not None and process.stderr is not None
        assert process.stdout.readline().startswith("Tessera demo:")
        process.stdout.close()  # `tessera demo | head -1`
        code = process.wait(timeout=TIMEOUT)
        stderr = process.stderr.read()
    assert code == 1
    assert stderr == ""
