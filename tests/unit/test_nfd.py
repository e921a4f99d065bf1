"""write_feature_file(): NFD's local feature file, written atomically and only when its content changes."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from agent.core.plan import plan
from agent.core.resources import PlanConfig
from agent.gpu.discovery import discover
from agent.sim.nvml.driver import SimDriver
from agent.telemetry.labels import node_labels
from agent.telemetry.nfd import MAX_FEATURE_FILE_BYTES, render_feature_file, write_feature_file

LABELS = {"nvidia.com/gpu.product": "Tesla-T4", "nvidia.com/gpu.count": "4", "nvidia.com/mig.capable": "false"}


@pytest.fixture
def umask() -> Iterator[Callable[[int], None]]:
    previous = os.umask(0o022)
    os.umask(previous)
    yield os.umask
    os.umask(previous)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_writes_sorted_key_value_lines(tmp_path: Path) -> None:
    target = tmp_path / "tessera"
    assert write_feature_file(target, LABELS) is True
    assert target.read_text() == (
        "nvidia.com/gpu.count=4\nnvidia.com/gpu.product=Tesla-T4\nnvidia.com/mig.capable=false\n"
    )
    assert mode(target) == 0o644


def test_mode_is_0644_whatever_the_umask(tmp_path: Path, umask: Callable[[int], None]) -> None:
    umask(0o077)
    target = tmp_path / "features.d" / "tessera"
    assert write_feature_file(target, LABELS)
    assert mode(target) == 0o644
    assert mode(target.parent) == 0o755


def test_unchanged_content_is_not_rewritten(tmp_path: Path) -> None:
    target = tmp_path / "tessera"
    assert write_feature_file(target, LABELS)
    os.utime(target, ns=(1_000_000_000, 1_000_000_000))
    before = target.stat()
    assert write_feature_file(target, dict(reversed(list(LABELS.items())))) is False
    after = target.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_changed_content_replaces_the_file_atomically(tmp_path: Path) -> None:
    target = tmp_path / "tessera"
    write_feature_file(target, LABELS)
    inode = target.stat().st_ino
    assert write_feature_file(target, {**LABELS, "nvidia.com/gpu.count": "8"}) is True
    assert "nvidia.com/gpu.count=8\n" in target.read_text()
    assert target.stat().st_ino != inode  # a new file renamed over the old one, never rewritten in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tessera"]  # no temporary file left behind


def test_temporary_file_is_hidden_from_nfd_and_fsynced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "tessera"
    seen: list[str] = []
    synced: list[int] = []
    real_replace, real_fsync = Path.replace, os.fsync

    def spy_replace(self: Path, other: Path) -> Path:
        seen.append(self.name)
        assert self.parent == target.parent
        assert self.read_text() == render_feature_file(LABELS)
        assert len(synced) >= 1  # the data reached the disk before the rename
        return real_replace(self, other)

    def spy_fsync(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(Path, "replace", spy_replace)
    monkeypatch.setattr(os, "fsync", spy_fsync)
    write_feature_file(target, LABELS)
    assert len(seen) == 1 and seen[0].startswith(".tessera.")  # NFD skips files starting with '.'
    assert len(synced) == 2  # the file, then its directory


def test_failed_write_leaves_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "tessera"
    write_feature_file(target, LABELS)
    old = target.read_text()

    def broken(self: Path, other: Path) -> Path:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "replace", broken)
    with pytest.raises(OSError, match="No space left"):
        write_feature_file(target, {"nvidia.com/gpu.count": "1"})
    assert target.read_text() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tessera"]


def test_empty_labels_write_an_empty_file(tmp_path: Path) -> None:
    target = tmp_path / "tessera"
    write_feature_file(target, LABELS)
    assert write_feature_file(target, {}) is True
    assert target.read_text() == ""
    assert write_feature_file(target, {}) is False


@pytest.mark.parametrize(
    "relative",
    ["features.d/../tessera", "../tessera", "features.d/.tessera", "features.d/.hidden.tmp"],
)
def test_bad_paths_are_refused(tmp_path: Path, relative: str) -> None:
    (tmp_path / "features.d").mkdir()
    with pytest.raises(ValueError, match=r"'\.\.'|file name"):
        write_feature_file(Path(f"{tmp_path}/{relative}"), LABELS)
    assert sorted(p.name for p in (tmp_path / "features.d").iterdir()) == []


def test_directory_is_created_only_when_its_parent_exists(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"features\.d"):
        write_feature_file(tmp_path / "missing" / "features.d" / "tessera", LABELS)
    assert not (tmp_path / "missing").exists()
    assert write_feature_file(tmp_path / "features.d" / "tessera", LABELS)


def test_paths_that_cannot_hold_the_file(tmp_path: Path) -> None:
    (tmp_path / "plain").write_text("x")
    with pytest.raises(NotADirectoryError):
        write_feature_file(tmp_path / "plain" / "tessera", LABELS)
    (tmp_path / "tessera").mkdir()
    with pytest.raises(IsADirectoryError):
        write_feature_file(tmp_path / "tessera", LABELS)


@pytest.mark.parametrize(
    "labels",
    [
        {"nvidia.com/gpu.product": "bad value"},
        {"nvidia.com/gpu.product": "x" * 64},
        {"nvidia.com/gpu.product": "line\nbreak"},
        {"nvidia.com/bad key": "1"},
        {"=nvidia.com/x": "1"},
        {"#comment": "1"},
        {"": "1"},
    ],
)
def test_invalid_labels_are_refused(tmp_path: Path, labels: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="cannot write node labels"):
        write_feature_file(tmp_path / "tessera", labels)
    assert not (tmp_path / "tessera").exists()


def test_oversized_file_is_refused(tmp_path: Path) -> None:
    labels = {f"example.com/label-{n:05d}": "v" * 63 for n in range(MAX_FEATURE_FILE_BYTES // 80 + 1)}
    with pytest.raises(ValueError, match="bytes NFD reads"):
        write_feature_file(tmp_path / "tessera", labels)


def test_node_labels_round_trip(tmp_path: Path, sim_node: Callable[[object], SimDriver]) -> None:
    sim_node("a100-mig")
    inventory = discover()
    labels = node_labels(inventory, plan(PlanConfig(), inventory), mig_config_state="success")
    target = tmp_path / "features.d" / "tessera"
    assert write_feature_file(target, labels)
    parsed = dict(line.split("=", 1) for line in target.read_text().splitlines())
    assert parsed == labels
    assert (
        write_feature_file(target, node_labels(inventory, plan(PlanConfig(), inventory), mig_config_state="success"))
        is False
    )
