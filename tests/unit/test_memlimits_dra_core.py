"""The pure part of the driver's per-container limits for DRA claims: which prepared devices have a size (a share,
an MPS claim's pinned limit; never a MIG device), which pinned limits a GPU cannot hold, and when the memory-limits
room's report says the driver holds a claim's containers."""

from __future__ import annotations

from types import MappingProxyType, SimpleNamespace
from typing import Any

import pytest

from agent.core.dra.checkpoint import PREPARE_COMPLETED, Checkpoint, PreparedClaim, PreparedDevice
from agent.core.dra.mps import MpsRecord, memory_sizes, pinned_mib, pinned_over_memory, share_record
from agent.core.dra.opaque import MpsConfig, OpaqueConfigError
from agent.core.dra.shares import Limits, Share
from agent.core.memlimits import DriverReport, Enforcement, claim_sizes

GIB, MIB = 1 << 30, 1 << 20
GPU0, GPU1 = "GPU-00000000-0000-0000-0000-000000000000", "GPU-11111111-1111-1111-1111-111111111111"
INVENTORY: Any = SimpleNamespace(gpus=(SimpleNamespace(index=0, minor_number=0, uuid=GPU0),
                                       SimpleNamespace(index=1, minor_number=1, uuid=GPU1)))  # fmt: skip


def claim(name: str, *devices: PreparedDevice, mps: MpsRecord | None = None) -> PreparedClaim:
    return PreparedClaim(PREPARE_COMPLETED, "default", name, devices, mps)


def device(name: str, share: Share | None = None) -> PreparedDevice:
    return PreparedDevice("node", name, ("gpu",), share=share)


def test_a_share_and_an_mps_claims_pinned_limit_are_sizes_a_mig_device_is_not() -> None:
    pinned = MpsRecord("dra/x", (GPU1,), (f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={GPU1}=12288M",))
    checkpoint = Checkpoint("boot", MappingProxyType({
        "u1": claim("share", device("gpu-0", Share(10 * GIB))),
        "u2": claim("pinned", device("gpu-1"), mps=pinned),
        "u3": claim("mig-share", device("gpu-1-mig-3g40gb-9-0", Share(5 * GIB))),  # a MIG device: no driver limits
        "u4": claim("whole", device("gpu-0")),  # no size
    }))  # fmt: skip
    sizes = claim_sizes(checkpoint, INVENTORY)
    assert {key[1]: (s.gpu_uuid, s.size) for key, s in sizes.items()} == {
        "share": (GPU0, 10 * GIB),
        "pinned": (GPU1, 12 * GIB),
    }


def test_memory_sizes_come_from_the_share_or_the_pinned_limits() -> None:
    assert memory_sizes(share_record(GPU0, Limits(10240, 25), 81920)) == {GPU0: 10240}
    assert memory_sizes(share_record(GPU0, Limits(None, 25), 81920)) == {}
    env = ("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50", f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={GPU0}=1024M,{GPU1}=2048M")
    assert pinned_mib(MpsRecord("dra/x", (GPU0, GPU1), env)) == {GPU0: 1024, GPU1: 2048}
    assert memory_sizes(None) == {}


def test_a_pinned_limit_above_the_devices_memory_is_named_with_its_field() -> None:
    devices = [("gpu-0", GPU0, 80 * GIB), ("gpu-1", GPU1, 40 * GIB)]
    assert pinned_over_memory(MpsConfig(default_pinned_device_memory_limit="40960M"), devices) is None
    said = pinned_over_memory(MpsConfig(default_pinned_device_memory_limit="40961M"), devices)
    assert said == (
        f"sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: 40961Mi for device gpu-1 ({GPU1}) is more than its "
        "40960Mi of memory; give at most 40960Mi"
    )
    per_device = MpsConfig(default_pinned_device_memory_limit="1024M",
                           default_per_device_pinned_memory_limit={"0": "90000M"})  # fmt: skip
    assert "defaultPerDevicePinnedMemoryLimit: 90000Mi for device gpu-0" in str(pinned_over_memory(per_device, devices))
    with pytest.raises(OpaqueConfigError, match="invalid device index 2"):
        pinned_over_memory(MpsConfig(default_per_device_pinned_memory_limit={"2": "1M"}), devices)


def test_the_driver_holds_a_claim_only_where_it_can_and_every_container_is_held() -> None:
    report = DriverReport(
        capable=frozenset({GPU0}),
        claims=MappingProxyType({("default/a", GPU0): (Enforcement.DRIVER, Enforcement.DRIVER),
                                 ("default/b", GPU0): (Enforcement.DRIVER, Enforcement.ADVISORY)}),
    )  # fmt: skip
    assert report.holds("default/a", GPU0)
    assert report.holds("default/new", GPU0)  # no container yet: each is held as it starts
    assert not report.holds("default/b", GPU0)  # one container fell back
    assert not report.holds("default/a", GPU1)  # a GPU the driver was not found able on
    assert not report.holds("default/a", "MIG-0")
    refused = DriverReport(capable=frozenset({GPU0}), refusals=MappingProxyType({GPU0: "not root"}))
    assert not refused.holds("default/a", GPU0)
    assert not DriverReport(capable=frozenset({GPU0}), refusals=MappingProxyType({"*": "r580"})).holds("x/y", GPU0)
    assert not DriverReport().holds("default/a", GPU0)


def test_a_share_counted_in_shares_is_held_to_its_part_of_the_memory() -> None:
    """consumableShares: N — the claim consumes no memory capacity (Share.memory 0), yet its MPS record gives its
    containers their part of the GPU's memory, as its CDI edits do: the driver must hold them to that too."""
    from agent.core.dra.mps import ShareLimits

    record = MpsRecord("dra/gpu-0", (GPU0,), share=ShareLimits(memory_mib=20480, threads=None, device_mib=81920))
    checkpoint = Checkpoint("boot", MappingProxyType({
        "u1": claim("quarter", device("gpu-0", Share(0, shares=1)), mps=record),
    }))  # fmt: skip
    sizes = claim_sizes(checkpoint, INVENTORY)
    assert {key[1]: (s.gpu_uuid, s.size) for key, s in sizes.items()} == {"quarter": (GPU0, 20480 * MIB)}
