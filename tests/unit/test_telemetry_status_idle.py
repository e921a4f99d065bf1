"""``tessera status --idle``'s text (issue 17): longest idle first, a plain word where there is no number."""

from __future__ import annotations

import pytest

from agent.status_report import duration, render_idle


def entry(pod: str, idle: float, util: float | None, device: str = "GPU-1::0") -> dict:
    return {"resource": "nvidia.com/gpu", "device_id": device, "namespace": "ml", "pod": pod, "container": "main",
            "idle_seconds": idle, "utilization_percent": util}  # fmt: skip


def test_the_longest_idle_device_comes_first_and_busy_ones_say_so() -> None:
    text = render_idle({"allocated": [entry("a", 0.0, 80.0), entry("b", 7400.0, 0.0), entry("c", 30.0, None)]})
    lines = text.splitlines()
    assert [line.split()[0] for line in lines[1:4]] == ["ml/b", "ml/c", "ml/a"]
    assert lines[1].split()[-2:] == ["2h03m", "0"] and lines[2].split()[-2:] == ["30s", "n/a"]
    assert lines[3].split()[-2:] == ["busy", "80"]
    assert lines[-1].startswith("2 of 3 allocated devices idle")


def test_no_data_and_no_allocation_are_told_apart() -> None:
    assert "not collected metrics yet" in render_idle({"allocated": None})
    assert "not collected metrics yet" in render_idle({})  # an older agent's document
    assert render_idle({"allocated": []}) == "No device is allocated to a pod.\n"


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.4, "0s"), (59.9, "59s"), (60, "1m00s"), (3599, "59m59s"), (3600, "1h00m"), (90061, "1d01h")],
)
def test_durations_read_at_a_glance(seconds: float, text: str) -> None:
    assert duration(seconds) == text
