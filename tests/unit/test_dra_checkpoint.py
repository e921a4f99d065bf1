"""The prepared-claims checkpoint: round trip, checksum, reboot, and the "held by another claim" query."""

from __future__ import annotations

import json

import pytest

from agent.core.dra import checkpoint as cpt
from agent.core.dra.cdi import cdi_device_ids
from agent.core.dra.checkpoint import CheckpointError, PreparedClaim, PreparedDevice
from agent.core.dra.claims import ClaimError, ClaimRef, PlannedDevice, PreparePlan, plan_prepare

from .test_dra_claims import Dev

BOOT = "5a1c1c4e-3d2b-4f6a-9e8d-7c6b5a4f3e2d"
UID_A = "0b6f3a52-9f1c-4c1e-8d0e-6c1a2b3c4d5e"
UID_B = "7d4c2f0e-1111-4222-8333-944455556666"
CLAIM_A = ClaimRef("ml", "train", UID_A)
CLAIM_B = ClaimRef("ml", "probe", UID_B)
CLAIM_KIND = "k8s.gpu.nvidia.com/claim"


GPU0 = Dev("gpu-0", "gpu", "GPU-aaaa")
GPU1 = Dev("gpu-1", "gpu", "GPU-bbbb", gpu_minor=1)


def a_plan(ref: ClaimRef, *devices: Dev, admin: bool = False, request: str = "gpu") -> PreparePlan:
    return PreparePlan(ref, tuple(PlannedDevice(request, "node-a", d.name, d, admin_access=admin) for d in devices))


def ids(plan: PreparePlan) -> dict[str, tuple[str, ...]]:
    return {d.device: cdi_device_ids(plan.claim.uid, d.device, d.info.uuid) for d in plan.devices}


def prepared(*plans: PreparePlan) -> cpt.Checkpoint:
    checkpoint = cpt.empty(BOOT)
    for plan in plans:
        checkpoint = cpt.prepare_completed(cpt.prepare_started(checkpoint, plan), plan, ids(plan))
    return checkpoint


def test_a_checkpoint_round_trips_through_its_bytes():
    plan = a_plan(CLAIM_A, GPU0, GPU1, request="gpu/a100")
    started = cpt.prepare_started(cpt.empty(BOOT), plan)
    both = cpt.prepare_started(cpt.prepare_completed(started, plan, ids(plan)), a_plan(CLAIM_B, GPU0, admin=True))
    assert cpt.decode(cpt.encode(both)) == both
    assert cpt.encode(cpt.decode(cpt.encode(both))) == cpt.encode(both)  # deterministic bytes
    assert both.claims[UID_A] == PreparedClaim(
        state="PrepareCompleted",
        namespace="ml",
        name="train",
        devices=(
            PreparedDevice("node-a", "gpu-0", ("gpu",), (f"{CLAIM_KIND}={UID_A}-gpu-0",)),
            PreparedDevice("node-a", "gpu-1", ("gpu",), (f"{CLAIM_KIND}={UID_A}-gpu-1",)),
        ),
    )
    assert both.claims[UID_B].state == "PrepareStarted"
    assert both.claims[UID_B].devices[0].cdi_device_ids == ()


def test_the_file_carries_a_sha256_checksum_over_the_data():
    envelope = json.loads(cpt.encode(prepared(a_plan(CLAIM_A, GPU0))))
    assert set(envelope) == {"data", "checksum"}
    assert envelope["checksum"].startswith("sha256:")
    data = json.loads(envelope["data"])
    assert data["kind"] == "TesseraDRACheckpoint" and data["version"] == 1 and data["nodeBootID"] == BOOT
    assert data["preparedClaims"][UID_A]["checkpointState"] == "PrepareCompleted"


def flip(content: bytes, index: int) -> bytes:
    """``content`` with one byte changed to another that keeps the JSON parseable where possible."""
    old = content[index : index + 1]
    new = b"1" if old != b"1" else b"2"
    return content[:index] + new + content[index + 1 :]


@pytest.mark.parametrize("where", ["boot id", "claim uid", "device name", "checksum"])
def test_a_flipped_byte_fails_the_checksum(where: str):
    content = cpt.encode(prepared(a_plan(CLAIM_A, GPU0)))
    needle = {"boot id": BOOT.encode(), "claim uid": UID_A.encode(), "device name": b"gpu-0", "checksum": b"sha256:"}
    index = content.index(needle[where]) + len(needle[where]) + (2 if where == "checksum" else -2)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        cpt.decode(flip(content, index))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "not valid JSON"),
        (b'{"data": "{}", "checksum": ', "not valid JSON"),
        (b"[]", 'no "data" string'),
        (b'{"Data": "{}", "Checksum": 1}', 'no "data" string'),
        (b"\x00\xff\xfe", "not valid JSON"),
        (b"[" * 100_000, "not valid JSON"),
    ],
)
def test_a_corrupt_file_is_refused_with_a_clear_error(content: bytes, message: str):
    with pytest.raises(CheckpointError, match=message):
        cpt.decode(content)


def sealed(data: dict[str, object]) -> bytes:
    text = json.dumps(data)
    return json.dumps({"data": text, "checksum": cpt._checksum(text)}).encode()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"kind": "TesseraDRACheckpoint", "version": 2, "nodeBootID": BOOT}, "version 2 is unknown"),
        ({"kind": "DRACheckpoint", "version": 1}, "kind is 'DRACheckpoint'"),
        (
            {"kind": "TesseraDRACheckpoint", "version": 1, "preparedClaims": {UID_A: {"checkpointState": "Done"}}},
            "checkpointState is 'Done'",
        ),
        (
            {
                "kind": "TesseraDRACheckpoint",
                "version": 1,
                "preparedClaims": {
                    UID_A: {"checkpointState": "PrepareCompleted", "namespace": "ml", "name": "train",
                            "preparedDevices": [{"pool": "node-a", "device": 7}]}
                },
            },
            r"preparedDevices\[0\].device is not a string",
        ),
    ],
)  # fmt: skip
def test_a_well_sealed_but_unknown_or_malformed_checkpoint_is_refused(data: dict[str, object], message: str):
    with pytest.raises(CheckpointError, match=message):
        cpt.decode(sealed(data))


def test_fields_from_a_newer_agent_are_ignored():
    data = json.loads(json.loads(cpt.encode(prepared(a_plan(CLAIM_A, GPU0))))["data"])
    data["futureField"] = {"x": 1}
    data["preparedClaims"][UID_A]["preparedDevices"][0]["metadata"] = {"numa": 0}
    assert cpt.decode(sealed(data)) == prepared(a_plan(CLAIM_A, GPU0))


def test_a_new_boot_id_empties_the_checkpoint():
    checkpoint = prepared(a_plan(CLAIM_A, GPU0))
    assert cpt.for_boot(checkpoint, BOOT) is checkpoint
    rebooted = cpt.for_boot(checkpoint, "0f0f0f0f-aaaa-4bbb-8ccc-dddddddddddd")
    assert rebooted == cpt.empty("0f0f0f0f-aaaa-4bbb-8ccc-dddddddddddd") and not rebooted.claims


def test_a_checkpoint_without_a_boot_id_adopts_the_current_one():
    checkpoint = cpt.for_boot(cpt.prepare_started(cpt.empty(""), a_plan(CLAIM_A, GPU0)), BOOT)
    assert checkpoint.boot_id == BOOT and UID_A in checkpoint.claims


def test_an_unknown_current_boot_id_keeps_the_checkpoint_whole():
    """The boot ID could not be read: no reboot can be told apart, so nothing prepared is forgotten."""
    checkpoint = prepared(a_plan(CLAIM_A, GPU0))
    assert cpt.for_boot(checkpoint, "") is checkpoint
    unrecorded = cpt.prepare_started(cpt.empty(""), a_plan(CLAIM_B, GPU1))
    assert cpt.for_boot(unrecorded, "") is unrecorded


def test_unprepare_forgets_the_claim_and_an_unknown_claim_changes_nothing():
    checkpoint = prepared(a_plan(CLAIM_A, GPU0), a_plan(CLAIM_B, GPU1))
    assert set(cpt.unprepared(checkpoint, UID_A).claims) == {UID_B}
    assert cpt.unprepared(checkpoint, "99999999-9999-4999-8999-999999999999") is checkpoint


def test_only_completed_claims_answer_prepare_from_the_checkpoint():
    plan = a_plan(CLAIM_A, GPU0)
    started = cpt.prepare_started(cpt.empty(BOOT), plan)
    assert cpt.completed(started, UID_A) is None
    done = cpt.completed(cpt.prepare_completed(started, plan, ids(plan)), UID_A)
    assert done is not None and done.devices[0].cdi_device_ids[0].endswith(f"{UID_A}-gpu-0")


def test_devices_are_held_only_by_completed_non_admin_claims():
    checkpoint = cpt.prepare_started(
        prepared(a_plan(CLAIM_A, GPU0), a_plan(CLAIM_B, GPU1, admin=True)),
        a_plan(ClaimRef("ml", "half", "44444444-4444-4444-8444-444444444444"), GPU1),
    )
    assert cpt.held_devices(checkpoint) == {"gpu-0": CLAIM_A}
    assert cpt.holder(checkpoint, "gpu-0", other_than=UID_B) == CLAIM_A
    assert cpt.holder(checkpoint, "gpu-0", other_than=UID_A) is None
    assert cpt.holder(checkpoint, "gpu-1", other_than=UID_A) is None


def test_a_second_claim_on_a_held_device_is_refused_in_nvidias_words():
    checkpoint = prepared(a_plan(CLAIM_A, GPU0))
    result = {"request": "gpu", "driver": "gpu.nvidia.com", "pool": "node-a", "device": "gpu-0"}
    claim = {
        "metadata": {"namespace": "ml", "name": "probe", "uid": UID_B},
        "status": {"allocation": {"devices": {"results": [result]}}},
    }
    answer = plan_prepare(
        CLAIM_B,
        claim,
        driver="gpu.nvidia.com",
        pool="node-a",
        devices={"gpu-0": GPU0},
        held_by=cpt.held_devices(checkpoint),
    )
    assert isinstance(answer, ClaimError)
    assert answer.message == (
        f"ResourceClaim ml/probe (uid {UID_B}): requested device gpu-0 is already allocated to different claim "
        f"{UID_A} (ml/train)"
    )


def test_completing_without_cdi_ids_for_every_device_is_a_bug_caught_early():
    plan = a_plan(CLAIM_A, GPU0, GPU1)
    with pytest.raises(ValueError, match="no CDI device IDs for gpu-1"):
        cpt.prepare_completed(cpt.empty(BOOT), plan, {"gpu-0": ("x",)})


def test_a_created_mig_device_is_recorded_by_placement_first_then_with_its_ids():
    partition = Dev("gpu-0-mig-1g10gb-19-3", "mig", "", "GPU-aaaa", gi_profile_id=19, placement=(3, 1),
                    consumes_counters={"gpu-0-counter-set": {"memory-slice-3": 1}})  # fmt: skip
    answer = a_plan(CLAIM_A, partition)
    started = cpt.prepare_started(cpt.empty(BOOT), answer)
    intent = started.claims[UID_A].devices[0].mig
    assert intent == cpt.CreatedMig("GPU-aaaa", 19, 3, 1)  # where, before it exists
    made = cpt.CreatedMig("GPU-aaaa", 19, 3, 1, gi_id=10, ci_id=0, uuid="MIG-1111")
    done = cpt.prepare_completed(started, answer, {partition.name: ("k/claim=x",)}, {partition.name: made})
    assert cpt.decode(cpt.encode(done)).claims[UID_A].devices[0].mig == made
    assert cpt.decode(cpt.encode(started)).claims[UID_A].devices[0].mig == intent


def test_a_claims_mps_daemon_is_recorded_and_read_back_and_claims_on_the_same_devices_share_it():
    from agent.core.dra.mps import client_edits, mps_record, records_specs
    from agent.core.dra.opaque import MpsConfig

    config = MpsConfig(default_active_thread_percentage=25, default_pinned_device_memory_limit="10240M")
    record = mps_record(["GPU-aaaa", "GPU-bbbb"], config)
    assert record.env == (
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=GPU-aaaa=10240M,GPU-bbbb=10240M",
    )
    started = cpt.prepare_started(cpt.empty(BOOT), a_plan(CLAIM_A, GPU0, GPU1))
    staged = cpt.with_mps(started, UID_A, record)
    assert cpt.decode(cpt.encode(staged)).claims[UID_A].mps == record
    other = mps_record(["GPU-bbbb", "GPU-aaaa"], MpsConfig())  # the same devices, other limits
    assert other.key == record.key and len(records_specs({UID_A: record, UID_B: other})) == 1
    edits = client_edits(record, "/run/nvidia/mps")
    assert edits["env"][0] == f"CUDA_MPS_PIPE_DIRECTORY=/mps/{record.key}/pipe"
    assert {"containerPath": "/dev/shm", "hostPath": "/run/nvidia/mps/shm", "options": ["rbind", "rw"]} in edits[
        "mounts"
    ]


@pytest.mark.parametrize(
    ("share", "message"),
    [
        ({"memory": -1}, r"share.memory is not a number of bytes"),
        ({"memory": "10Gi"}, r"share.memory is not a number of bytes"),
        ({"memory": 0, "shares": "1"}, r"share.shares is not a number of shares"),
        ({"memory": 1 << 30, "computePercent": 101}, r"share.computePercent is not a percentage 0-100"),
        ("10Gi", r"share is not an object"),
    ],
)
def test_a_malformed_share_is_refused(share: object, message: str):
    device = {"pool": "node-a", "device": "gpu-0", "requests": ["gpu"], "share": share}
    claim = {"checkpointState": "PrepareCompleted", "namespace": "ml", "name": "train", "preparedDevices": [device]}
    data = {"kind": "TesseraDRACheckpoint", "version": 1, "nodeBootID": BOOT, "preparedClaims": {UID_A: claim}}
    with pytest.raises(CheckpointError, match=message):
        cpt.decode(sealed(data))
