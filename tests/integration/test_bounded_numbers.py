"""Numbers a user writes are bounded before any arithmetic, wherever they are written (issue 24, defect 5).

``"1e10000000"`` as a quantity used to build a ten-million-digit number: in a claim's opaque ``GpuConfig`` it held
the GIL 9-34 s (every thread of the agent: both gRPC servers, health) and then failed as an internal error the
kubelet retried for ever; ``tessera validate`` called ``dra.defaultShare: "1e10000000"`` valid after 16 s. Now
each is refused at once, as the config's own error naming the field and the bound: in a claim (end to end, the
DRA kubelet emulator preparing it against the running agent), in the sharing config (``tessera validate``) and in
a flag (``inf``, ``nan``, ``1e400`` by the flag's name).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.cli import _parser
from agent.run import OptionsError, build_options
from agent.sim.kubelet.dra_common import PodStartError

from . import test_dra_e2e
from .test_dra_e2e import GPU_CLASS, World
from .test_dra_sharing import gpu_config, shared_claim

world = test_dra_e2e.world  # the fixture: an agent, both kubelets and the API server on a simulated dgx-a100
HUGE = "1e10000000"
INT64_BOUND = "the most allowed here is 9223372036854775807 (2^63 - 1, the largest int64)"


# the fixture's start takes about 3 s and the five Prepare calls below milliseconds; the unbounded parser spent
# 6-34 s in each of them, holding the GIL, so the old behaviour cannot finish within this
@pytest.mark.timeout(20)
def test_a_claim_with_a_huge_quantity_fails_at_once_as_its_own_error_and_the_agent_serves_on(
    world: World, caplog: pytest.LogCaptureFixture
) -> None:
    limits = {"defaultPinnedDeviceMemoryLimit": HUGE}
    shared_claim(world, "huge", gpu_config({"strategy": "MPS", "mpsConfig": limits}))
    with caplog.at_level(logging.WARNING, logger="agent.dra.prepare"), pytest.raises(PodStartError) as refused:
        world.dra.run_pod("default", "huge", "pod-1", [("gpu", "huge")], {"a": [("gpu", None)]})
    message = str(refused.value)
    assert "ResourceClaim default/huge" in message  # the claim, the field and the bound
    assert f"sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: '{HUGE}' is too large: {INT64_BOUND}" in message
    assert "internal error" not in message
    (verdict,) = [r for r in caplog.records if r.getMessage().startswith("claim not prepared")]
    assert "claim=default/huge" in verdict.getMessage()
    assert "retriable=False" in verdict.getMessage() and verdict.levelno == logging.ERROR  # the claim's own fault

    for _ in range(4):  # the kubelet's pod worker tries again: the same answer, and nothing is left prepared
        with pytest.raises(PodStartError, match=f"'{HUGE}' is too large"):
            world.dra.retry_pod("pod-1")
    assert list((world.base / "cdi").glob("*.yaml")) == []
    assert recorded_claims(world) == set()  # not even PrepareStarted in the checkpoint

    # the agent serves on: the next claim is prepared, and the device plugin's GPUs are still advertised
    world.claim("fine", [GPU_CLASS])
    devices = world.dra.run_pod("default", "fine", "pod-2", [("gpu", "fine")], {"a": [("gpu", None)]})
    assert devices["a"]
    test_dra_e2e.poll(lambda: recorded_claims(world) == {"default/fine"}, "only the claim prepared in the status")
    assert world.kubelet.devices("nvidia.com/gpu")


def recorded_claims(world: World) -> set[str]:
    return {str(c["claim"]) for c in (world.agent.status.dra or {}).get("claims", [])}


@pytest.mark.timeout(15)  # `tessera validate` took 16 s on dra.defaultShare "1e10000000", and called it valid
@pytest.mark.parametrize(
    ("config", "error"),
    [
        pytest.param(
            f'version: v1\ndra: {{enabled: true, gpuShares: all, defaultShare: "{HUGE}"}}\n',
            f"error: dra.defaultShare: '{HUGE}' is too large: {INT64_BOUND}",
            id="dra.defaultShare",
        ),
        pytest.param(
            'version: v1\ndra: {enabled: true, gpuShares: all, defaultShare: "1e100000000"}\n',
            f"error: dra.defaultShare: '1e100000000' is too large: {INT64_BOUND}",
            id="dra.defaultShare one more digit",
        ),
        pytest.param(
            f'version: v1\nsharing: {{mps: {{resources: [{{name: gpu, replicas: 2, memoryLimit: "{HUGE}"}}]}}}}\n',
            f"error: sharing.mps.resources[0].memoryLimit: '{HUGE}' is out of range: use between 1Mi and 16Ti",
            id="memoryLimit",
        ),
        pytest.param(
            f"version: v1\ndra: {{enabled: true, gpuShares: all, defaultShare: {'9' * 4000}}}\n",
            f"error: dra.defaultShare: a number of about 4000 digits is too large: {INT64_BOUND}",
            id="defaultShare as a 4000-digit YAML integer",
        ),
    ],
)
def test_validate_refuses_a_huge_quantity_in_the_sharing_config_naming_the_field(
    tmp_path: Path, config: str, error: str
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(config)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    result = subprocess.run(
        [sys.executable, "-m", "agent", "validate", str(path)],
        capture_output=True, text=True, env=environ, timeout=15, check=False,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{path.name}: INVALID" in result.stdout
    assert error in result.stdout


@pytest.mark.parametrize(
    ("flag", "value", "error"),
    [
        ("--health-recovery-seconds", "1e400", "'1e400' is not a finite number; give one from 0 to 604800 seconds"),
        ("--health-recovery-seconds", "inf", "'inf' is not a finite number"),
        ("--health-recovery-seconds", "nan", "'nan' is not a finite number"),
        ("--health-recovery-seconds", "-1", "'-1' is out of range; give one from 0 to 604800 seconds (0 = never)"),
        ("--metrics-interval", "inf", "'inf' is not a finite number; give one from 0.1 to 604800 seconds"),
        ("--metrics-interval", "0", "'0' is out of range"),
        ("--idle-threshold", "nan", "'nan' is not a finite number; give one from 0 to 100 percent"),
    ],
)
def test_a_number_flag_refuses_infinity_nan_and_out_of_range_by_name(
    flag: str, value: str, error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as usage:
        _parser().parse_args(["run", flag, value])
    assert usage.value.code == 2  # before anything starts (tessera run exits 2)
    assert f"argument {flag}: {error}" in capsys.readouterr().err


def test_a_number_flags_env_twin_is_refused_by_its_name(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TESSERA_HEALTH_RECOVERY_SECONDS", "inf")
    with pytest.raises(SystemExit) as usage:
        _parser().parse_args(["run"])
    assert usage.value.code == 2
    err = capsys.readouterr().err
    assert "argument --health-recovery-seconds: 'inf' is not a finite number" in err
    assert "[env TESSERA_HEALTH_RECOVERY_SECONDS]" in err


def test_integer_flags_are_bounded_before_they_are_converted() -> None:
    huge = "9" * 5000  # int() refuses 4,300 digits and more with a ValueError: an internal error, exit 70
    options = build_options(_parser().parse_args(["run", "--ignored-xids", f"13,{huge}"]), {})
    assert options.health.ignored_xids == {13}  # the huge entry is reported as not an XID, the rest is honoured
    with pytest.raises(OptionsError, match=r"--imex-channel-ids: '0xfff.*'\.\.\. is out of range \(Go reads a 64-bit"):
        build_options(_parser().parse_args(["run", "--imex-channel-ids", "0x" + "f" * 4000]), {})
