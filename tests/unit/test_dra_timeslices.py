"""Time-slices through a real ``nvidia-smi`` command line (a stand-in script with nvidia-smi's exit statuses)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.gpu.timeslice import TimesliceError, TimesliceNotSupported, set_timeslice

UUID = "GPU-4f477a2b-200b-541f-a68d-792e32e38526"


def smi(tmp_path: Path, status: int, said: str = "") -> str:
    script = tmp_path / "nvidia-smi"
    script.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/args\necho "{said}" >&2\nexit {status}\n')
    script.chmod(0o755)
    return str(script)


def test_the_command_line_is_nvidias(tmp_path: Path) -> None:
    set_timeslice(smi(tmp_path, 0), UUID, 3)
    assert (tmp_path / "args").read_text().split() == ["compute-policy", "-i", UUID, "--set-timeslice", "3"]


def test_not_supported_is_told_apart_from_other_failures(tmp_path: Path) -> None:
    with pytest.raises(TimesliceNotSupported, match="not supported for GPU"):
        set_timeslice(smi(tmp_path, 3, "Setting the timeslice is not supported for GPU"), UUID, 1)
    with pytest.raises(TimesliceError, match="nvidia-smi said: No devices were found") as failed:
        set_timeslice(smi(tmp_path, 6, "No devices were found"), UUID, 1)
    assert not isinstance(failed.value, TimesliceNotSupported)


@pytest.mark.parametrize(("uuid", "level"), [("GPU-1; rm -rf /", 1), ("MIG-0000", 1), (UUID, 4), (UUID, True)])
def test_values_that_are_not_a_gpu_uuid_and_a_level_never_reach_the_command(tmp_path: Path, uuid, level) -> None:
    with pytest.raises(TimesliceError, match="refusing"):
        set_timeslice(smi(tmp_path, 0), uuid, level)
    assert not (tmp_path / "args").exists()


def test_a_reset_on_a_gpu_without_time_slices_is_no_error_but_setting_one_is(tmp_path: Path, monkeypatch) -> None:
    from agent.dra import timeslices

    monkeypatch.setattr(timeslices, "compute_mode", lambda uuid: timeslices.DEFAULT)  # NVML: in DEFAULT already
    unsupported = timeslices.NvidiaSmiTimeslices(smi(tmp_path, 3, "not supported"))
    unsupported.reset(UUID)  # tolerated, as NVIDIA does
    with pytest.raises(timeslices.TimesliceFailed):
        unsupported.apply(UUID, 3)
