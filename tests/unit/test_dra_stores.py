"""The DRA driver's files: claim CDI specs under the CDI root and the prepared-claims checkpoint, on a real disk."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from types import MappingProxyType

import pytest
import yaml

from agent.core.dra.cdi import CdiError, claim_spec, gpu_nodes
from agent.core.dra.checkpoint import (
    PREPARE_COMPLETED,
    Checkpoint,
    PreparedClaim,
    PreparedDevice,
    decode,
    empty,
    encode,
)
from agent.dra.cdi_store import CdiStore, CdiStoreError
from agent.dra.checkpoint_store import CheckpointSaveError, CheckpointStore, checkpoint_path

UID = "0b6f3a52-9f1c-4c1e-8d0e-6c1a2b3c4d5e"
UID2 = "12345678-1234-4234-8234-123456789012"  # all digits up front: a YAML 1.1 reader must still see a string
BOOT = "a85d0bcb-e4bf-483a-a4f0-b31707c072e4"
LATER_BOOT = "f00dcafe-0000-4000-8000-000000000001"


@pytest.fixture
def strict_umask() -> Iterator[None]:
    """A umask that would make files private and directories closed: the stores must set modes themselves."""
    old = os.umask(0o077)
    yield
    os.umask(old)


def spec(uid: str = UID) -> dict:
    return claim_spec(uid, {"gpu-0": gpu_nodes(0)})


def one_claim(boot_id: str = BOOT) -> Checkpoint:
    device = PreparedDevice("node-a", "gpu-0", ("gpu",), (f"k8s.gpu.nvidia.com/claim={UID}-gpu-0",))
    claim = PreparedClaim(PREPARE_COMPLETED, "ml", "train", (device,))
    return Checkpoint(boot_id, MappingProxyType({UID: claim}))


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# ----- CDI specs --------------------------------------------------------------------------------------------------


def test_a_spec_is_written_as_yaml_readable_by_the_runtime_in_a_directory_it_creates(tmp_path, strict_umask):
    store = CdiStore(tmp_path / "run" / "cdi")
    path = store.write(UID2, spec(UID2))
    assert path == tmp_path / "run" / "cdi" / f"k8s.gpu.nvidia.com-claim_{UID2}.yaml"
    assert mode(path) == 0o644 and mode(path.parent) == 0o755
    document = yaml.safe_load(path.read_text())
    assert document == spec(UID2)
    assert document["cdiVersion"] == "0.5.0" and document["devices"][0]["name"] == f"{UID2}-gpu-0"
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temporary file left behind
    assert store.exists(UID2)


def test_writing_again_replaces_the_whole_file(tmp_path):
    store = CdiStore(tmp_path)
    store.write(UID, claim_spec(UID, {"gpu-0": gpu_nodes(0), "gpu-1": gpu_nodes(1)}))
    store.write(UID, spec())
    assert yaml.safe_load(store.path(UID).read_text()) == spec()


def test_removing_twice_is_fine(tmp_path):
    store = CdiStore(tmp_path)
    store.write(UID, spec())
    assert store.remove(UID) is True
    assert store.remove(UID) is False
    assert not store.exists(UID)


def test_a_cdi_root_that_cannot_be_a_directory_is_an_error_naming_it(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    store = CdiStore(tmp_path / "file" / "cdi")
    with pytest.raises(CdiStoreError) as error:
        store.write(UID, spec())
    assert str(tmp_path / "file" / "cdi") in str(error.value)
    assert not store.exists(UID)


def test_a_uid_that_could_leave_the_directory_is_refused(tmp_path):
    with pytest.raises(CdiError):
        CdiStore(tmp_path).write("../../etc/passwd", spec())


def test_stale_lists_only_our_specs_whose_claim_is_not_kept(tmp_path):
    store = CdiStore(tmp_path)
    store.write(UID, spec())
    store.write(UID2, spec(UID2))
    (tmp_path / "nvidia.yaml").write_text("cdiVersion: 0.5.0\n")  # nvidia-ctk's node-wide spec: not ours
    (tmp_path / f".k8s.gpu.nvidia.com-claim_{UID}.yaml.tmp-1234").write_text("")  # a temporary: not a spec
    assert store.claim_uids() == sorted([UID, UID2])
    assert store.stale(keep={UID}) == [UID2]
    assert CdiStore(tmp_path / "missing").stale(keep=()) == []


# ----- checkpoint -------------------------------------------------------------------------------------------------


@pytest.fixture
def boot_id(tmp_path) -> Path:
    path = tmp_path / "boot_id"
    path.write_text(BOOT + "\n")
    return path


def test_no_checkpoint_yet_is_empty_for_this_boot(tmp_path, boot_id):
    store = CheckpointStore(tmp_path / "plugin" / "tessera-checkpoint.json", boot_id_path=boot_id)
    assert store.load() == empty(BOOT)


def test_a_saved_checkpoint_is_private_and_read_back(tmp_path, boot_id):
    old = os.umask(0)
    try:
        store = CheckpointStore(checkpoint_path(tmp_path / "plugin"), boot_id_path=boot_id)
        store.save(one_claim())
    finally:
        os.umask(old)
    assert mode(store.path) == 0o600 and mode(store.path.parent) == 0o700
    assert store.path.name == "tessera-checkpoint.json"
    assert store.load() == one_claim()
    assert decode(store.path.read_bytes()) == one_claim()
    assert sorted(p.name for p in store.path.parent.iterdir()) == ["tessera-checkpoint.json"]


def test_a_corrupt_checkpoint_is_logged_kept_aside_and_the_agent_starts_empty(tmp_path, boot_id, caplog):
    path = tmp_path / "tessera-checkpoint.json"
    good = encode(one_claim())
    path.write_bytes(good.replace(b"gpu-0", b"gpu-7", 1))  # one flipped character: the checksum no longer matches
    store = CheckpointStore(path, boot_id_path=boot_id, clock=lambda: 1_780_000_000.0)
    with caplog.at_level(logging.ERROR):
        assert store.load() == empty(BOOT)
    aside = tmp_path / "tessera-checkpoint.json.corrupt-20260528T202640Z"
    assert aside.read_bytes() == good.replace(b"gpu-0", b"gpu-7", 1)
    assert not path.exists()
    message = " ".join(r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
    assert str(path) in message and "checksum mismatch" in message and str(aside) in message
    # a second corrupt file in the same second does not overwrite the first one kept aside
    path.write_text("{not json")
    assert store.load() == empty(BOOT)
    assert (tmp_path / "tessera-checkpoint.json.corrupt-20260528T202640Z-1").read_text() == "{not json"


def test_a_checkpoint_of_an_unknown_version_is_set_aside_too(tmp_path, boot_id, caplog):
    data = json.dumps({"kind": "TesseraDRACheckpoint", "version": 2, "nodeBootID": BOOT, "preparedClaims": {}})
    envelope = {"data": data, "checksum": "sha256:" + hashlib.sha256(data.encode()).hexdigest()}
    path = tmp_path / "tessera-checkpoint.json"
    path.write_text(json.dumps(envelope))
    with caplog.at_level(logging.ERROR):
        assert CheckpointStore(path, boot_id_path=boot_id).load() == empty(BOOT)
    assert "version 2 is unknown" in caplog.text
    kept = [p for p in tmp_path.iterdir() if p != boot_id]
    assert len(kept) == 1 and kept[0].name.startswith("tessera-checkpoint.json.corrupt-")


def test_claims_of_an_earlier_boot_are_dropped(tmp_path, boot_id, caplog):
    path = tmp_path / "tessera-checkpoint.json"
    CheckpointStore(path, boot_id_path=boot_id).save(one_claim())
    boot_id.write_text(LATER_BOOT)
    with caplog.at_level(logging.WARNING):
        assert CheckpointStore(path, boot_id_path=boot_id).load() == empty(LATER_BOOT)
    assert "rebooted" in caplog.text


def test_without_a_readable_boot_id_the_claims_are_kept(tmp_path, boot_id, caplog):
    path = tmp_path / "tessera-checkpoint.json"
    CheckpointStore(path, boot_id_path=boot_id).save(one_claim())
    with caplog.at_level(logging.ERROR):
        assert CheckpointStore(path, boot_id_path=tmp_path / "no-boot-id").load() == one_claim()
    assert "boot ID" in caplog.text


def test_a_temporary_left_by_a_crash_mid_save_is_cleaned_up(tmp_path, boot_id):
    path = tmp_path / "tessera-checkpoint.json"
    store = CheckpointStore(path, boot_id_path=boot_id)
    store.save(one_claim())
    (tmp_path / ".tessera-checkpoint.json.tmp-0a0b0c0d").write_bytes(b"half a file")
    assert store.load() == one_claim()
    assert not (tmp_path / ".tessera-checkpoint.json.tmp-0a0b0c0d").exists()


def test_a_checkpoint_that_cannot_be_written_is_an_error_naming_it(tmp_path, boot_id):
    (tmp_path / "file").write_text("")
    store = CheckpointStore(tmp_path / "file" / "tessera-checkpoint.json", boot_id_path=boot_id)
    with pytest.raises(CheckpointSaveError) as error:
        store.save(one_claim())
    assert str(store.path) in str(error.value)
