"""write_atomically(): the chosen mode whatever the umask, and a failed write leaves the old file and no temporary."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.atomic import remove_temporaries, write_atomically


@pytest.fixture
def umask() -> Iterator[None]:
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("process_umask", [0o077, 0o000, 0o277])
@pytest.mark.parametrize("wanted", [0o600, 0o644, 0o444])
def test_the_file_gets_the_mode_asked_for_whatever_the_umask(tmp_path, umask, process_umask, wanted):
    os.umask(process_umask)
    target = tmp_path / "file"
    write_atomically(target, b"new\n", wanted)
    assert mode(target) == wanted and target.read_bytes() == b"new\n"


def test_replacing_a_file_gives_it_the_new_mode_and_content_through_a_rename(tmp_path):
    target = tmp_path / "file"
    target.write_bytes(b"old\n")
    target.chmod(0o666)
    inode = target.stat().st_ino
    write_atomically(target, b"new\n" * 100_000, 0o600)
    assert target.read_bytes() == b"new\n" * 100_000
    assert mode(target) == 0o600 and target.stat().st_ino != inode  # a new file, never rewritten in place
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


def failing(monkeypatch: pytest.MonkeyPatch, step: str) -> None:
    def fail(*args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    if step == "rename":
        monkeypatch.setattr(Path, "replace", fail)
    else:
        monkeypatch.setattr(os, step, fail)


@pytest.mark.parametrize("step", ["fchmod", "write", "fsync", "rename"])
def test_a_failed_write_leaves_the_old_content_and_no_temporary(tmp_path, monkeypatch, step):
    target = tmp_path / "file"
    write_atomically(target, b"old\n", 0o644)
    with monkeypatch.context() as patch:
        failing(patch, step)
        with pytest.raises(OSError, match="No space left"):
            write_atomically(target, b"new\n", 0o600)
    assert target.read_bytes() == b"old\n" and mode(target) == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


def test_a_failed_first_write_leaves_no_file_at_all(tmp_path, monkeypatch):
    with monkeypatch.context() as patch:
        failing(patch, "fsync")
        with pytest.raises(OSError):
            write_atomically(tmp_path / "file", b"new\n", 0o644)
    assert list(tmp_path.iterdir()) == []


def test_a_target_that_cannot_be_replaced_is_left_alone(tmp_path):
    target = tmp_path / "file"
    target.mkdir()
    (target / "inside").write_text("kept")
    with pytest.raises(OSError):
        write_atomically(target, b"new\n", 0o644)
    assert (target / "inside").read_text() == "kept"
    assert [p.name for p in tmp_path.iterdir()] == ["file"]


def test_a_missing_directory_is_the_callers_to_create(tmp_path):
    with pytest.raises(FileNotFoundError):
        write_atomically(tmp_path / "absent" / "file", b"new\n", 0o644)
    assert list(tmp_path.iterdir()) == []


def test_the_temporary_is_hidden_in_the_same_directory_and_synced_before_the_rename(tmp_path, monkeypatch):
    target = tmp_path / "spec.yaml"
    synced: list[int] = []
    renamed: list[Path] = []
    real_replace, real_fsync = Path.replace, os.fsync

    def spy_fsync(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    def spy_replace(self: Path, other: Path) -> Path:
        assert synced, "the data reaches the disk before the rename"
        renamed.append(self)
        return real_replace(self, other)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(Path, "replace", spy_replace)
    write_atomically(target, b"cdiVersion: 0.5.0\n", 0o644)
    [temporary] = renamed
    assert temporary.parent == tmp_path and temporary.name.startswith(".spec.yaml.tmp-")
    assert not temporary.name.endswith((".yaml", ".json"))  # CDI's directory scan reads only those
    assert len(synced) == 2  # the file, then the directory holding the rename


def test_temporaries_left_by_a_crash_are_removed_and_nothing_else(tmp_path):
    target = tmp_path / "checkpoint.json"
    target.write_text("{}")
    for name in (".checkpoint.json.tmp-0a1b2c3d", ".checkpoint.json.tmp-zz", ".other.tmp-00", "checkpoint.json.tmp-1"):
        (tmp_path / name).write_text("half")
    removed = remove_temporaries(target)
    assert sorted(p.name for p in removed) == [".checkpoint.json.tmp-0a1b2c3d", ".checkpoint.json.tmp-zz"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".other.tmp-00", "checkpoint.json", "checkpoint.json.tmp-1"]
    assert remove_temporaries(tmp_path / "absent" / "file") == []
