"""The collector asks PodResources only while the kubelet's checkpoint says one of the node's devices may be held."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import agent.telemetry.attribution as attribution
from agent.core.resources import Device
from agent.core.snapshot import ResourceSnapshot
from agent.plugin.podresources import DeviceHolder
from agent.telemetry.attribution import CHECKPOINT
from agent.telemetry.collector import TelemetryCollector, TelemetryOptions

GPU = "nvidia.com/gpu"
OURS = ("GPU-0000aaaa", "GPU-0000bbbb")


@dataclass(frozen=True)
class Status:
    resources: dict[str, ResourceSnapshot] = field(default_factory=dict)
    registered: frozenset[str] = frozenset()
    inventory: None = None


def status() -> Status:
    devices = tuple(Device(uuid, uuid, n, str(n), 81920) for n, uuid in enumerate(OURS))
    snapshot = ResourceSnapshot(GPU, devices, {d.id: True for d in devices})
    return Status({GPU: snapshot}, frozenset({GPU}))


def write_checkpoint(directory: Path, entries: list[dict] | None) -> None:
    document = {"Data": {"PodDeviceEntries": entries, "RegisteredDevices": {GPU: list(OURS)}}, "Checksum": 0}
    temporary = directory / ".checkpoint.tmp"
    temporary.write_text(json.dumps(document))
    temporary.replace(directory / CHECKPOINT)  # as the kubelet does: a new file each time


def entry(resource: str, *ids: str) -> dict:
    return {"PodUID": "uid-1", "ContainerName": "main", "ResourceName": resource, "DeviceIDs": {"-1": list(ids)}}


class Kubelet:
    def __init__(self) -> None:
        self.asked = 0
        self.answer: dict[str, DeviceHolder] = {}

    def holders(self) -> dict[str, DeviceHolder]:
        self.asked += 1
        return self.answer


@pytest.fixture
def setup(tmp_path: Path) -> tuple[TelemetryCollector, Kubelet]:
    kubelet = Kubelet()
    options = TelemetryOptions(hostname="node-1", device_plugin_dir=tmp_path, proc_root=tmp_path / "proc")
    current = status()
    return TelemetryCollector(options, status=lambda: current, holders=kubelet.holders), kubelet


def allocated_series(collector: TelemetryCollector) -> dict[str, tuple[str, float]]:
    (family,) = [f for f in collector.last.families if f.name == "tessera_device_allocated"]
    position = {label: i for i, label in enumerate(family.labels)}
    return {values[position["device_id"]]: (values[position["pod"]], value) for values, value in family.samples}


def test_nothing_allocated_asks_only_once(setup, tmp_path: Path) -> None:
    collector, kubelet = setup
    write_checkpoint(tmp_path, None)  # a kubelet without allocations writes a Go nil slice
    for _ in range(5):
        collector.collect_once()
    assert kubelet.asked == 1, "asked at the first collection (a broken mount is reported at start), then not"
    write_checkpoint(tmp_path, [entry("example.com/nic", "nic-7")])  # another vendor's device: not ours
    collector.collect_once()
    assert kubelet.asked == 1


def test_an_allocation_in_the_checkpoint_is_looked_up_at_the_next_collection(setup, tmp_path: Path) -> None:
    collector, kubelet = setup
    write_checkpoint(tmp_path, [])
    collector.collect_once()
    collector.collect_once()
    assert kubelet.asked == 1 and allocated_series(collector)[OURS[0]] == ("", 0)

    write_checkpoint(tmp_path, [entry(GPU, OURS[0])])
    kubelet.answer = {OURS[0]: DeviceHolder("team-a", "trainer", "main", GPU)}
    collector.collect_once()
    assert kubelet.asked == 2 and allocated_series(collector)[OURS[0]] == ("trainer", 1)

    write_checkpoint(tmp_path, [entry(GPU, OURS[1] + "::3")])  # a replica of one of our GPUs counts too
    collector.collect_once()
    assert kubelet.asked == 3


@pytest.mark.parametrize(
    "content",
    [
        None,  # no checkpoint at all
        b"not json",
        b'{"Data": {"RegisteredDevices": {}}}',  # no PodDeviceEntries: a shape not known
        b'{"Data": {"PodDeviceEntries": [{"PodUID": "u", "DeviceIDs": 7}]}}',  # an entry not understood
    ],
)
def test_without_a_checkpoint_it_understands_it_always_asks(setup, tmp_path: Path, content: bytes | None) -> None:
    collector, kubelet = setup
    if content is not None:
        (tmp_path / CHECKPOINT).write_bytes(content)
    for _ in range(3):
        collector.collect_once()
    assert kubelet.asked == 3


def test_the_checkpoint_is_parsed_again_only_when_replaced_or_old(tmp_path: Path, monkeypatch) -> None:
    parsed = []
    real = attribution.read_checkpoint
    monkeypatch.setattr(attribution, "read_checkpoint", lambda directory: parsed.append(1) or real(directory))
    now = [0.0]
    reader = attribution.CheckpointReader(tmp_path, max_age=60, clock=lambda: now[0])
    assert reader.read() is None and not parsed  # no file: nothing to parse

    write_checkpoint(tmp_path, [])
    first = reader.read()
    assert first is not None and first.complete and not first.device_ids()
    assert reader.read() is first and len(parsed) == 1

    write_checkpoint(tmp_path, [entry(GPU, OURS[0])])
    assert reader.read().device_ids() == {OURS[0]} and len(parsed) == 2

    now[0] = 61.0
    reader.read()
    assert len(parsed) == 3, "read again once it is older than max_age, changed or not"
