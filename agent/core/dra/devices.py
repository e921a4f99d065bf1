"""The DRA device model: the node's GPUs and MIG devices as NVIDIA's DRA driver names and describes them.

A claim or DeviceClass written for NVIDIA's driver (``gpu.nvidia.com``) must select Tessera's devices
unchanged, so names, attributes and capacities follow NVIDIA's driver (facts ``dra.md`` C2, C3):

- A GPU that is not MIG-enabled is one device ``gpu-<minor>``. A MIG-enabled GPU is not offered whole; each
  MIG device that exists is one device ``gpu-<parentMinor>-mig-<profile>-<giProfileId>-<placementStart>``
  (static MIG), ``<profile>`` spelled by NVIDIA's ``ToCanonicalName`` rule: dots removed, lower case, every
  character outside ``[a-z0-9-.]`` replaced by ``-``, then leading/trailing ``-`` and a trailing ``.`` trimmed
  (``1g.10gb+me`` -> ``1g10gb-me``).
- MIG devices whose compute instance is smaller than their GPU instance (``1c.3g.40gb``) are left out: NVIDIA's
  driver only knows profiles with C == G, and two compute instances of one GPU instance would get one name.
- Attributes are NVIDIA's, with unqualified names in the driver's domain: ``type``, ``uuid``, ``productName``,
  ``brand`` (go-nvlib's string, e.g. ``Nvidia``), ``architecture`` (go-nvlib's string: ``Ada Lovelace``, not
  NVML's short ``Ada``), ``cudaComputeCapability`` (version ``8.0.0``), ``driverVersion`` (the NVML string
  normalised as Masterminds/semver's ``NewVersion(...).String()`` does: ``580.95.05`` -> ``580.95.5``; the
  facts mark this normalisation (?), the rule here is the library's), ``cudaDriverVersion`` (``<major>.<minor>``
  from NVML's int: 13000 -> ``13.0.0``) and ``resource.kubernetes.io/pciBusID`` (go-nvlib's spelling:
  ``0000:18:00.0``). MIG devices add ``parentUUID`` and ``profile`` and carry their GPU's attributes.
- ``resource.kubernetes.io/pcieRoot`` comes from sysfs, which NVML does not read: the DRA shell passes it in
  ``pcie_roots`` (``agent.dra.pcie``).
- ``resource.kubernetes.io/numaNode`` (int, a standard attribute since Kubernetes 1.37) is the NUMA node of the
  GPU's PCI device: what sysfs says (``/sys/bus/pci/devices/<bus ID>/numa_node``, passed in ``numa_nodes`` by the
  DRA shell), ``-1`` (no NUMA affinity) meaning no attribute; where sysfs has no entry, NVML's
  ``nvmlDeviceGetNumaNodeId`` from the inventory. A scheduler aligns a claim's GPU and NIC with it.
- ``addressingMode`` (string ``HMM``, ``ATS`` or ``None``) as NVML's ``nvmlDeviceGetAddressingMode`` reports it;
  absent where NVML does not (NVIDIA publishes it only then).
- Left out, and why: ``brand`` when NVML does not report one. An attribute whose value
  cannot be a version (a driver string semver cannot read) is left out rather than failing the GPU.
- Capacities, in base units: a GPU's ``memory`` in bytes (from the inventory's MiB, which NVML's byte count
  always is a whole multiple of on these products). A MIG device's ``multiprocessors``, ``copyEngines``,
  ``decoders``, ``encoders``, ``jpegEngines``, ``ofaEngines`` (SM count and memory as NVML reported them for the
  device; engine counts from NVML's GPU instance profile info, ``nvmlDeviceGetGpuInstanceProfileInfo``, as
  NVIDIA's driver reads them, so a model the packaged MIG table does not know, Blackwell, gets them too; the
  table is only the fallback for an inventory without profile info), ``memory`` (bytes) and ``memorySlice<i>``
  = 1 for each memory slice its placement covers.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from types import MappingProxyType
from typing import Literal

from msgspec import Struct, field

from agent.core.inventory import Gpu, Inventory, MigDevice
from agent.core.mig_catalog import mig_catalog

DEFAULT_DRIVER = "gpu.nvidia.com"
STANDARD_DOMAIN = "resource.kubernetes.io"
PCI_BUS_ID = "resource.kubernetes.io/pciBusID"
PCIE_ROOT = "resource.kubernetes.io/pcieRoot"
NUMA_NODE = "resource.kubernetes.io/numaNode"
GPU = "gpu"
MIG = "mig"

_MIB = 1 << 20
_NVLIB_ARCHITECTURES = {"Ada": "Ada Lovelace"}  # NVML's short names where go-nvlib spells them otherwise
_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-9a-f]$")  # the only form the attribute accepts
# Masterminds/semver NewVersion: optional "v", one to three numbers, pre-release and build metadata.
_LOOSE_SEMVER = re.compile(
    r"^v?(\d+)(?:\.(\d+))?(?:\.(\d+))?"
    r"(?:-([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?(?:\+([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?$"
)


class Version(str):
    """An attribute value of the ``version`` kind (semver 2.0.0), e.g. ``Version("8.0.0")``; a plain ``str`` is
    a ``string`` attribute."""

    __slots__ = ()


AttributeValue = bool | int | str  # a Version is a str; tell the kinds apart with attribute_kind()
AttributeKind = Literal["bool", "int", "string", "version"]


def attribute_kind(value: AttributeValue) -> AttributeKind:
    """The API's name for the kind of ``value`` (``bool`` is tested before ``int``: True is an int in Python)."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, Version):
        return "version"
    if isinstance(value, str):
        return "string"
    raise TypeError(f"a DRA attribute is a bool, an int, a str or a Version, not {type(value).__name__}")


class RequestPolicy(Struct, frozen=True):
    """A consumable capacity's ``requestPolicy``: what a claim that does not ask consumes (``default``), and the
    valid range requests are rounded up into (``minimum + n * step``, at most ``maximum``) — or, when
    ``valid_values`` is given, those values instead of a range."""

    default: int
    minimum: int
    maximum: int
    step: int
    valid_values: tuple[int, ...] | None = None


class DraDevice(Struct, frozen=True):
    """One device of this node's pool, as a ResourceSlice lists it."""

    name: str  # unique in the pool, a DNS label
    kind: Literal["gpu", "mig"]
    uuid: str
    parent_uuid: str | None  # the GPU of a MIG device
    gpu_minor: int  # /dev/nvidia<minor> of the GPU (the parent's for a MIG device)
    attributes: Mapping[str, AttributeValue]  # unqualified names belong to the driver's domain
    capacity: Mapping[str, int]  # base units (bytes, counts)
    # counter set -> counter -> amount this device uses up (partitionable devices; dynamic MIG, not static MIG)
    consumes_counters: Mapping[str, Mapping[str, int]] = field(default_factory=lambda: MappingProxyType({}))
    # a MIG device's GPU instance and compute instance IDs (None for a full GPU): they name its capability device
    # nodes, /proc/driver/nvidia/capabilities/gpu<gpu_minor>/mig/gi<gi_id>[/ci<ci_id>]/access (facts/dra.md C7)
    gi_id: int | None = None
    ci_id: int | None = None
    # an abstract MIG device of a dynamic-MIG GPU (``partitions``): the GPU-instance profile and the placement
    # (start, size in memory slices) Prepare creates it at; it has no UUID until then
    gi_profile_id: int | None = None
    placement: tuple[int, int] | None = None
    # a GPU shared by claims (``shares``): several allocations, each consuming part of its capacities
    allow_multiple_allocations: bool = False
    request_policies: Mapping[str, RequestPolicy] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def dynamic(self) -> bool:
        """An abstract MIG device of a dynamic-MIG GPU: Prepare creates it, Unprepare destroys it."""
        return self.placement is not None

    @property
    def gpu_uuid(self) -> str:
        """The physical GPU this device lives on."""
        return self.parent_uuid or self.uuid


def dra_devices(
    inventory: Inventory,
    *,
    gpu_uuids: Collection[str] | None = None,
    pcie_roots: Mapping[str, str] | None = None,
    numa_nodes: Mapping[str, int | None] | None = None,
    dynamic_mig: Collection[str] = (),
    shared: Collection[str] = (),
    default_share: int | None = None,
    share_mode: str | int = "memory",
) -> tuple[DraDevice, ...]:
    """The devices of ``inventory`` (only the GPUs in ``gpu_uuids`` when given), by GPU minor then name.

    ``pcie_roots`` maps a PCI bus ID in the attribute's spelling (``0000:18:00.0``) to its PCIe root
    (``pci0000:00``); GPUs without an entry get no ``pcieRoot`` attribute. ``numa_nodes`` maps a bus ID to the
    NUMA node sysfs gives it (None: ``-1``, no affinity, no attribute); a GPU without an entry gets the inventory's
    (NVML's) node, if any. GPUs in ``dynamic_mig`` (UUIDs) are
    listed as partitionable devices (``partitions``): every MIG profile and placement, and the full GPU where it can
    be prepared whole; one whose MIG mode is off and cannot change without a reset is listed as a plain GPU. GPUs in
    ``shared`` (UUIDs) are listed for shares (``shares``) in ``share_mode`` (NVIDIA's ``consumableShares``): a
    whole GPU (MIG off) or each of its MIG devices, a claim that asks for no memory getting ``default_share`` bytes
    of one in ``memory`` mode (None: all of it).
    """
    devices: list[DraDevice] = []
    for gpu in sorted(inventory.gpus, key=lambda g: g.minor_number):
        if gpu_uuids is not None and gpu.uuid not in gpu_uuids:
            continue
        common = _common_attributes(gpu, inventory, pcie_roots or {}, numa_nodes or {})
        catalog = mig_catalog(gpu.pci_device_id) if gpu.uuid in dynamic_mig else None
        if catalog is not None:
            from agent.core.dra.partitions import partitionable_devices, partitioned  # they build on this module

            if partitioned(gpu):  # else (MIG off, not switchable without a reset) a plain GPU, below
                devices.extend(partitionable_devices(gpu, catalog, common))
                continue
        if not gpu.mig_enabled:
            device = _gpu_device(gpu, common)
            if gpu.uuid in shared:
                from agent.core.dra.shares import shareable  # it builds on this module

                device = shareable(device, default_share, share_mode)
            devices.append(device)
            continue
        migs = [_mig_device(gpu, mig, common) for mig in gpu.mig_devices if mig.is_full_instance]
        if gpu.uuid in shared:
            from agent.core.dra.shares import shareable

            migs = [shareable(mig, default_share, share_mode) for mig in migs]
        devices.extend(sorted(migs, key=lambda d: d.name))
    return tuple(devices)


def gpu_device_name(gpu: Gpu) -> str:
    return f"gpu-{gpu.minor_number}"


def gpu_minor_of(device_name: str) -> int | None:
    """The GPU minor a device name carries (``gpu-<minor>`` or ``gpu-<minor>-mig-…``); None for another name."""
    parts = device_name.split("-")
    return int(parts[1]) if len(parts) > 1 and parts[0] == "gpu" and parts[1].isdigit() else None


def mig_device_name(gpu: Gpu, mig: MigDevice) -> str:
    """NVIDIA's ``MigSpecTuple.ToCanonicalName``."""
    return f"gpu-{gpu.minor_number}-mig-{canonical_profile(mig.profile)}-{mig.gi_profile_id}-{mig.placement.start}"


def canonical_profile(profile: str) -> str:
    """A profile string as it appears in a device name: ``1g.10gb`` -> ``1g10gb``, ``1g.10gb+me`` -> ``1g10gb-me``."""
    name = re.sub(r"[^a-z0-9-.]", "-", profile.replace(".", "").lower())
    return name.strip("-").removesuffix(".")[:253]


def pci_bus_id(nvml_bus_id: str) -> str | None:
    """go-nvlib's ``GetPCIBusID``: lower case, the 8-digit NVML domain cut to 4; None unless it is then a BDF."""
    bus = nvml_bus_id.lower()
    if bus != "0000":
        bus = bus.removeprefix("0000")
    return bus if _BDF.match(bus) else None


def semver(text: str) -> Version | None:
    """``text`` as Masterminds/semver's ``NewVersion(text).String()`` spells it (missing parts 0, leading zeros
    dropped, a ``v`` prefix removed); None where that parser fails (four parts, empty)."""
    match = _LOOSE_SEMVER.match(text.strip())
    if match is None:
        return None
    major, minor, patch, pre, build = match.groups()
    if pre is not None and any(p.isdigit() and len(p) > 1 and p[0] == "0" for p in pre.split(".")):
        return None  # semver: numeric pre-release identifiers have no leading zeros
    version = f"{int(major)}.{int(minor or 0)}.{int(patch or 0)}"
    return Version(version + (f"-{pre}" if pre else "") + (f"+{build}" if build else ""))


def cuda_driver_version(value: int) -> Version:
    """NVML's CUDA driver version int as NVIDIA's driver publishes it: 12040 -> ``12.4.0``."""
    return Version(f"{value // 1000}.{value % 1000 // 10}.0")


def qualified(name: str, driver: str = DEFAULT_DRIVER) -> tuple[str, str]:
    """(domain, identifier) of an attribute or capacity name; an unqualified name is in the driver's domain."""
    domain, _, identifier = name.rpartition("/")
    return (domain or driver, identifier)


def cel_device(device: DraDevice, driver: str = DEFAULT_DRIVER) -> dict[str, object]:
    """The ``device`` a CEL selector sees: ``device.driver``, ``device.attributes[domain].name`` and
    ``device.capacity[domain].name`` (capacities as ints in base units, versions as ``Version``)."""
    attributes: dict[str, dict[str, AttributeValue]] = {}
    for name, value in device.attributes.items():
        domain, identifier = qualified(name, driver)
        attributes.setdefault(domain, {})[identifier] = value
    capacity: dict[str, dict[str, int]] = {}
    for name, amount in device.capacity.items():
        domain, identifier = qualified(name, driver)
        capacity.setdefault(domain, {})[identifier] = amount
    return {"driver": driver, "attributes": attributes, "capacity": capacity}


# ----- building -------------------------------------------------------------------------------------


def _common_attributes(
    gpu: Gpu, inventory: Inventory, pcie_roots: Mapping[str, str], numa_nodes: Mapping[str, int | None]
) -> dict[str, AttributeValue]:
    """What a GPU and its MIG devices share (NVIDIA's ``CommonAttributesMig`` takes the parent's values)."""
    major, minor = gpu.compute_capability
    attributes: dict[str, AttributeValue] = {
        "productName": gpu.name,
        "architecture": _NVLIB_ARCHITECTURES.get(gpu.architecture, gpu.architecture),
        "cudaComputeCapability": Version(f"{major}.{minor}.0"),
    }
    if gpu.brand:
        attributes["brand"] = gpu.brand
    driver_version = semver(inventory.driver_version)
    if driver_version is not None:
        attributes["driverVersion"] = driver_version
    if inventory.cuda_driver_version is not None:
        attributes["cudaDriverVersion"] = cuda_driver_version(inventory.cuda_driver_version)
    bus = pci_bus_id(gpu.pci_bus_id)
    if bus is not None:
        attributes[PCI_BUS_ID] = bus
        if bus in pcie_roots:
            attributes[PCIE_ROOT] = pcie_roots[bus]
    numa = numa_nodes[bus] if bus is not None and bus in numa_nodes else gpu.numa_node
    if numa is not None and numa >= 0:
        attributes[NUMA_NODE] = numa
    if gpu.addressing_mode:
        attributes["addressingMode"] = gpu.addressing_mode
    return attributes


def _gpu_device(gpu: Gpu, common: Mapping[str, AttributeValue]) -> DraDevice:
    return DraDevice(
        name=gpu_device_name(gpu),
        kind=GPU,
        uuid=gpu.uuid,
        parent_uuid=None,
        gpu_minor=gpu.minor_number,
        attributes=MappingProxyType({"type": GPU, "uuid": gpu.uuid, **common}),
        capacity=MappingProxyType({"memory": gpu.memory_mib * _MIB}),
    )


def _mig_device(gpu: Gpu, mig: MigDevice, common: Mapping[str, AttributeValue]) -> DraDevice:
    attributes = {"type": MIG, "uuid": mig.uuid, "parentUUID": gpu.uuid, "profile": mig.profile, **common}
    capacity = {"multiprocessors": mig.multiprocessor_count}
    counts = gpu.gi_profile(mig.gi_profile_id)
    catalog = mig_catalog(gpu.pci_device_id) if counts is None else None
    profile = catalog.profile_by_id(mig.gi_profile_id) if catalog is not None else None
    if counts is not None:  # NVML's GPU instance profile info, as NVIDIA's driver reads it
        capacity |= {
            "copyEngines": counts.copy_engines,
            "decoders": counts.decoders,
            "encoders": counts.encoders,
            "jpegEngines": counts.jpeg_engines,
            "ofaEngines": counts.ofa_engines,
        }
    elif profile is not None:  # fallback: an inventory without profile info (built by hand, an old reading)
        capacity |= {
            "copyEngines": profile.copy_engines,
            "decoders": profile.decoders,
            "encoders": profile.encoders,
            "jpegEngines": profile.jpeg_engines,
            "ofaEngines": profile.ofa_engines,
        }
    capacity["memory"] = mig.memory_mib * _MIB
    start = mig.placement.start
    capacity |= {f"memorySlice{i}": 1 for i in range(start, start + mig.placement.size)}
    return DraDevice(
        name=mig_device_name(gpu, mig),
        kind=MIG,
        uuid=mig.uuid,
        parent_uuid=gpu.uuid,
        gpu_minor=gpu.minor_number,
        attributes=MappingProxyType(attributes),
        capacity=MappingProxyType(capacity),
        gi_id=mig.gi_id,
        ci_id=mig.ci_id,
    )
