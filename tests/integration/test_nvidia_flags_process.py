"""NVIDIA's flags on a real ``tessera run``: a refusal is one line and exit 2 before anything starts, and
``--fail-on-init-error`` ends the run when NVML cannot initialise."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.cli import _parser
from agent.gpu.nvml import NvmlUnavailable
from agent.run import build_options, run_agent
from agent.sim.nvml.codes import Return


def tessera_run(plugin_dir: Path, *argv: str, **environ: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")} | environ
    return subprocess.run(
        [sys.executable, "-m", "agent", "run", "--device-plugin-dir", str(plugin_dir), "--metrics-address", "off",
         *argv],
        capture_output=True, text=True, env=env, timeout=60, check=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "environ", "name"),
    [
        (["--fail-on-init-error=maybe"], {}, "--fail-on-init-error"),
        ([], {"PASS_DEVICE_SPECS": "true"}, "PASS_DEVICE_SPECS"),
        (["--simulate", "t4x4", "--device-id-strategy", "index"], {}, "--device-id-strategy"),
    ],
)
def test_a_refused_nvidia_setting_is_one_line_and_exit_2_before_anything_starts(tmp_path, argv, environ, name):
    result = tessera_run(tmp_path, *argv, **environ)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    (line,) = result.stderr.splitlines()  # no log line: the agent never started, no traceback
    assert line.startswith(f"tessera: {name}: ") and "; " in line
    assert list(tmp_path.iterdir()) == []  # no socket, no lock


def test_fail_on_init_error_ends_the_run_when_nvml_cannot_initialise(sim_node, tmp_path):
    driver = sim_node("t4x4")
    driver.fail_init(Return.ERROR_DRIVER_NOT_LOADED)
    args = _parser().parse_args(["run", "--device-plugin-dir", str(tmp_path), "--fail-on-init-error"])
    with pytest.raises(NvmlUnavailable, match="DRIVER_NOT_LOADED"):
        run_agent(build_options(args, {}), None, None)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(ctypes.util.find_library("nvidia-ml") is not None, reason="this machine has an NVIDIA driver")
def test_fail_on_init_error_without_a_driver_exits_3_with_the_reason(tmp_path):
    result = tessera_run(tmp_path, FAIL_ON_INIT_ERROR="true")
    assert result.returncode == 3, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.splitlines()[-1].startswith("tessera: NVML init failed")


def test_sighup_reads_the_config_again_instead_of_ending_the_agent(tmp_path: Path):
    """NVIDIA's config-manager sidecar sends SIGHUP after switching the config: the agent must survive it."""
    import signal

    from agent.sim.kubelet import KubeletEmulator

    kubelet = KubeletEmulator(tmp_path / "dp", None)
    kubelet.start()
    log = tmp_path / "agent.log"
    command = [sys.executable, "-m", "agent", "run", "--simulate", "t4x4", "--device-plugin-dir", str(tmp_path / "dp"),
               "--metrics-address", "off", "--log-level", "info"]  # fmt: skip
    with log.open("wb") as out:
        agent = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        kubelet.wait_for(lambda: kubelet.allocatable("nvidia.com/gpu") == 4, timeout=30, what="4 GPUs registered")
        agent.send_signal(signal.SIGHUP)
        kubelet.wait_for(lambda: b"signal=SIGHUP" in log.read_bytes(), timeout=10, what="the SIGHUP logged")
        assert agent.poll() is None
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=30) == 0
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        kubelet.stop()
