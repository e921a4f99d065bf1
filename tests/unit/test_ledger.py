"""The ledger's answers, as values: what each holder blocks, and the holds the ledger keeps itself."""

from __future__ import annotations

from pathlib import Path

from agent.core.dra.checkpoint import PREPARE_COMPLETED, Checkpoint, PreparedClaim, PreparedDevice
from agent.core.dra.mps import MpsRecord
from agent.core.inventory import Inventory
from agent.core.ledger import Drain
from agent.ledger import ALLOCATE_GRACE_SECONDS, DeviceLedger
from agent.plugin.podresources import DeviceHolder, PodAllocations

from .builders import a100

GPU0, GPU1 = (f"GPU-0000000{i}-0000-4000-8000-000000000000" for i in range(2))
INVENTORY = Inventory("", "", None, (a100(0, GPU0), a100(1, GPU1)), ())
WHOLE = Drain(frozenset({GPU0}), frozenset({GPU0}))


def ledger(
    claims: dict[str, PreparedClaim] | None = None,
    now: list[float] | None = None,
    listed: dict[str, DeviceHolder] | None = None,
) -> DeviceLedger:
    """A ledger of GPU 0 and 1 whose kubelet lists ``listed`` (a test may change it) and whose clock is ``now``."""
    clock = now if now is not None else [0.0]
    pods = listed if listed is not None else {}
    book = DeviceLedger(
        Path("/nonexistent"),
        pod_resources=lambda: PodAllocations(dict(pods), {}),
        processes=lambda uuids, exclude: {u: () for u in uuids},
        clock=lambda: clock[0],
    )
    book.inventory = INVENTORY
    book.attach_claims(lambda: Checkpoint("boot", dict(claims or {})), "node-a")
    return book


def claim(name: str, device: str = "gpu-0", *, admin: bool = False, daemon: str | None = None) -> PreparedClaim:
    mps = MpsRecord(daemon, (GPU0,)) if daemon else None
    return PreparedClaim(PREPARE_COMPLETED, "default", name, (PreparedDevice("node-a", device, ("gpu",),
                                                                              admin_access=admin),), mps)  # fmt: skip


def test_a_device_allocate_answered_for_is_held_until_podresources_has_had_time_to_list_it() -> None:
    now = [100.0]
    book = ledger(now=now)
    assert book.why_busy(WHOLE) == []
    book.note_allocated([f"{GPU0}::3"])  # a replica of GPU 0
    (reason,) = book.why_busy(WHOLE)
    assert reason.startswith(f"{GPU0}::3 held by a pod the kubelet is admitting")
    assert book.why_busy(Drain(frozenset({GPU1}), frozenset({GPU1}))) == []  # only its own GPU
    now[0] += ALLOCATE_GRACE_SECONDS + 0.1  # by now PodResources lists it if the kubelet admitted the pod
    assert book.why_busy(WHOLE) == []


def test_a_claim_does_not_block_its_own_step_and_an_mps_quit_waits_only_for_its_claims() -> None:
    book = ledger({"uid-a": claim("a", daemon="dra/a")})
    assert book.why_busy(WHOLE) == [f"{GPU0} held by claim default/a (DRA claim)"]
    assert book.why_busy(WHOLE, other_than_claim="uid-a") == []
    assert book.why_busy(WHOLE, for_daemon="dra/a") != []  # the daemon serving the claim waits for it
    assert book.why_busy(WHOLE, for_daemon="dra/other") == []  # ... another daemon does not


def test_an_admin_access_claim_is_a_holder_too() -> None:
    book = ledger({"uid-m": claim("monitor", admin=True)})
    assert book.why_busy(WHOLE) == [f"{GPU0} held by claim default/monitor (DRA admin-access claim)"]


def test_a_noted_allocation_ends_once_podresources_lists_the_device() -> None:
    """From then on the kubelet's word counts: a pod that ends frees its GPU at once, not after the grace."""
    listed: dict[str, DeviceHolder] = {}
    book = ledger(listed=listed)
    book.note_allocated([GPU0])
    listed[GPU0] = DeviceHolder("default", "train", "main", "nvidia.com/gpu")
    assert book.why_busy(WHOLE) == [f"{GPU0} held by default/train (main) (device-plugin pod)"]  # listed once
    listed.clear()  # the pod ended
    assert book.why_busy(WHOLE) == []
