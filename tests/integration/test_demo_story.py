"""`tessera demo` tells the whole story (issue 26, item 6): what became of the pod on the GPU that had the error,
the `tessera plan` command (and config) that shows the same resources without running anything, a MIG-enabled
GPU handed over whole under ``--mig-strategy none`` said as such, and SIGTERM cleaning up like Ctrl-C does."""

from __future__ import annotations

import os
import re
import selectors
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TIMEOUT = 60


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}


def _demo(*args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", "agent", "demo", *args], capture_output=True, text=True, timeout=TIMEOUT, env=_env(),
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result


@pytest.fixture(scope="module")
def default_run() -> subprocess.CompletedProcess[str]:
    return _demo()


def test_the_pod_on_the_gpu_with_the_error_is_said_to_keep_running_on_it(default_run) -> None:
    out = default_run.stdout
    gpu = re.search(r"Injecting XID 48 \(double-bit ECC error\) on GPU (\d) \((GPU-[0-9a-f-]+)\)", out)
    assert gpu is not None, out
    trainer = next(line for line in out.splitlines() if line.strip().startswith("pod trainer "))
    assert trainer.endswith(f"NVIDIA_VISIBLE_DEVICES={gpu[2]}")  # the pod that holds the GPU hit
    assert f"pod trainer on GPU {gpu[1]}: still Running, with the same device" in out
    assert "a kubelet evicts no pod for an Unhealthy device" in out
    assert "No new pod is given the device while it is Unhealthy" in out
    assert "trainer" in next(line for line in out.splitlines() if "pods kept their devices" in line)


def test_the_demo_prints_the_plan_command_that_shows_its_resources(default_run, tmp_path: Path) -> None:
    """Save the config the demo prints, run the command it prints: the plan advertises what the kubelet saw."""
    lines = default_run.stdout.splitlines()
    start = next(
        i for i, line in enumerate(lines) if "save the demo's sharing config as demo-time-slicing.yaml" in line
    )
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("  and run `"))
    (tmp_path / "demo-time-slicing.yaml").write_text("\n".join(line[6:] for line in lines[start + 1 : end]) + "\n")
    command = shlex.split(lines[end].removeprefix("  and run `").removesuffix("`"))
    assert command[:2] == ["tessera", "plan"] and "--mig-strategy" in command
    shown = subprocess.run(
        [sys.executable, "-m", "agent", *command[1:]], capture_output=True, text=True, timeout=TIMEOUT,
        env=_env(), cwd=tmp_path, check=False,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    registered = dict(re.findall(r"^ {6}(nvidia\.com/\S+) +capacity (\d+), allocatable", default_run.stdout, re.M))
    advertised = shown.stdout.splitlines()[-1].removeprefix("Advertised (mig-strategy mixed): ")
    planned = dict((name, count) for name, count in re.findall(r"(nvidia\.com/\S+) × (\d+)", advertised))
    assert registered and planned == registered


def test_a_mig_enabled_gpu_handed_over_whole_is_said_to_be_unusable() -> None:
    out = _demo("--mig-strategy", "none").stdout
    frame = out.split("[1/5]")[0]
    warnings = [line for line in frame.splitlines() if line.startswith("  warning ")]
    assert len(warnings) == 2 and all("has MIG enabled: with mig-strategy none" in w for w in warnings)
    lines = out.splitlines()
    trainer = next(i for i, line in enumerate(lines) if line.strip().startswith("pod trainer "))
    assert "has MIG enabled: CUDA in this pod finds no device it can use" in lines[trainer + 1]
    assert "`tessera plan --node demo --mig-strategy none --config demo-time-slicing.yaml`" in out


def _demo_directories(pid: int, prefix: str) -> set[Path]:
    """The /tmp/<prefix>* directories whose unix sockets the process holds open (the kubelet emulator's and the
    agent's), found through its file descriptors, not by listing /tmp (other runs may be there too)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 8 and fields[6] in inodes and f"/{prefix}" in fields[7]:
            path = Path(fields[7])
            found.add(next(p for p in path.parents if p.name.startswith(prefix)))
    return found


@pytest.mark.parametrize(
    ("args", "prefix", "step", "said"),
    [
        ((), "tessera-demo-", "[3/5]", "demo stopped by SIGTERM"),
        (("--dra",), "tessera-dra-", "[3/8]", "demo --dra stopped by SIGTERM"),
    ],
    ids=["device-plugin", "dra"],
)
def test_sigterm_stops_the_demo_and_leaves_no_directory_behind(
    args: tuple[str, ...], prefix: str, step: str, said: str
) -> None:
    env = {**_env(), "PYTHONUNBUFFERED": "1"}  # each line as it is printed, to send SIGTERM mid-demo
    with subprocess.Popen(
        [sys.executable, "-m", "agent", "demo", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
    ) as process:  # fmt: skip
        assert process.stdout is not None and process.stderr is not None
        directories: set[Path] = set()
        deadline = time.monotonic() + TIMEOUT
        with selectors.DefaultSelector() as selector:
            selector.register(process.stdout, selectors.EVENT_READ)
            while not directories:  # the agent and the kubelet emulator serve: the demo is in the middle
                assert time.monotonic() < deadline, "the demo never reached its pods"
                assert selector.select(timeout=deadline - time.monotonic()), "no output from the demo"
                line = process.stdout.readline()
                assert line, f"the demo ended early: {process.stderr.read()}"
                if line.startswith(step):
                    directories = _demo_directories(process.pid, prefix)
        assert len(directories) == 1 and all(d.is_dir() for d in directories), directories
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=TIMEOUT)
        stderr = process.stderr.read()
    assert code == 128 + signal.SIGTERM, stderr
    assert said in stderr and "Traceback" not in stderr
    assert not any(d.exists() for d in directories), directories
