"""The kubelet's device checkpoint is read defensively: whatever is there, attribution never raises."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from agent.telemetry.attribution import CHECKPOINT, MAX_CHECKPOINT_BYTES, devices_by_pod_uid

GOOD = {
    "Data": {
        "PodDeviceEntries": [
            {
                "PodUID": "uid-1",
                "ContainerName": "main",
                "ResourceName": "nvidia.com/gpu",
                "DeviceIDs": {"0": ["GPU-a"]},
            },
        ],
        "RegisteredDevices": {"nvidia.com/gpu": ["GPU-a", "GPU-b"]},
    },
    "Checksum": 1,
}


def test_a_real_checkpoint_maps_pods_to_devices(tmp_path: Path) -> None:
    (tmp_path / CHECKPOINT).write_text(json.dumps(GOOD))
    assert devices_by_pod_uid(tmp_path) == {"uid-1": {"GPU-a"}}


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(b"[" * 100_000 + b"]" * 100_000, id="nested 100,000 deep"),
        pytest.param(b"\x00\xff garbage", id="binary"),
        pytest.param(b'{"Data": []}', id="Data not an object"),
        pytest.param(
            b'{"Data": {"PodDeviceEntries": [1, "x", {"PodUID": 5}, {"PodUID": "u", "DeviceIDs": 7}]}}',
            id="entries of the wrong shape",
        ),
        pytest.param(b"[]", id="a list"),
    ],
)
def test_a_hostile_checkpoint_gives_nothing_and_never_raises(tmp_path: Path, content: bytes) -> None:
    (tmp_path / CHECKPOINT).write_bytes(content)
    assert devices_by_pod_uid(tmp_path) in ({}, {"u": set()})


def test_an_oversized_or_special_checkpoint_is_not_read(tmp_path: Path) -> None:
    path = tmp_path / CHECKPOINT
    path.write_bytes(b"")
    os.truncate(path, MAX_CHECKPOINT_BYTES + 1)  # sparse: refused by its size
    assert devices_by_pod_uid(tmp_path) == {}
    path.unlink()
    os.mkfifo(path)  # a FIFO would block a naive read for ever
    assert devices_by_pod_uid(tmp_path) == {}
