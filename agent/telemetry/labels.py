"""Node labels for the scheduler: GPU Feature Discovery's keys and values, computed from the inventory and plan.

Pure and deterministic: no I/O, no clock (GFD's ``nvidia.com/gfd.timestamp`` is left out), the result is sorted by
key. Facts: nvidia-device-plugin.md §9 (GFD ``internal/lm``) and §2 (resource names).

What the labels say, and where Tessera knowingly differs from GFD:

- **One model.** ``nvidia.com/gpu.{product,memory,family,compute.*,count}`` describe one GPU model. GFD picks it
  from a Go map (random on a node with several models); Tessera always describes the model of the first GPU (the
  lowest index), and ``gpu.count`` counts the GPUs of that model, MIG-enabled ones included, as GFD does.
- **Sharing comes from the plan, not the config.** A shared resource's devices are ``<id>::<n>`` replicas of
  physical devices, so the plan alone tells which physical GPUs / MIG devices are shared, how many times, and
  whether the resource is advertised under its original name (``nvidia.com/gpu``, ``nvidia.com/mig-<profile>``)
  or renamed (``<name>.shared``, an explicit ``rename``). No extra argument is needed for that. Label keys always
  use the original name (``nvidia.com/gpu.replicas`` for ``nvidia.com/gpu.shared``), as GFD's do.
- **-SHARED.** GFD appends ``-SHARED`` to ``gpu.product`` when the resource is replicated and not renamed. Users
  report that this silently breaks node selectors on ``gpu.product``, so Tessera adds it only with
  ``shared_suffix=True``.
- **replicas.** 1 when unshared; the per-device replicas when shared; 0 when no GPU of the model is advertised as a
  full GPU (every one has MIG enabled under ``single``/``mixed``), as GFD does. Under ``none`` a MIG-enabled GPU is
  advertised as a full ``nvidia.com/gpu`` (and may be shared), so Tessera reports its sharing where GFD says 0.
  When only some GPUs of the model are shared (Tessera's ``devices`` selector), the sharing of the first shared one
  is reported.
- **MIG devices that are partial compute instances** (``1c.3g.40gb``) are not advertised by Tessera (plan.py), so
  they are not counted or labelled either.
- **Not produced** (the inventory lacks the data): ``gpu.mode`` (PCI class), ``gpu.clique`` (fabric info),
  ``vgpu.*``, and the MIG ``engines.{copy,decoder,encoder,jpeg,ofa}`` labels (NVML's MIG device attributes are not
  kept in ``MigDevice``).
- **mps.capable** is true when an MPS resource is advertised and no GPU has MIG enabled (GFD fails outright on
  MPS with MIG; Tessera can run MPS on MIG devices but keeps GFD's meaning of the label).
- Tessera adds ``nvidia.com/mig.config.state`` (the MIG layout manager's state) when given.

Every value is a valid Kubernetes label value: GFD's ``sanitise()`` (characters outside ``[A-Za-z0-9-_. ]``
dropped, runs of spaces become ``-``), then cut to 63 characters and trimmed of ``-_.`` at both ends. Keys that
would not be valid label keys are dropped (none can arise from NVML's names and profiles).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from agent.core.inventory import Gpu, Inventory, MigDevice
from agent.core.mig_naming import mig_resource_suffix
from agent.core.resources import GPU_RESOURCE, RESOURCE_PREFIX, MigStrategy, Resource, ResourcePlan, Sharing

MIG_CONFIG_STATE_LABEL = "nvidia.com/mig.config.state"
MAX_LABEL_VALUE = 63
_SHARED_SUFFIX = "-SHARED"
_UNSANITARY = re.compile(r"[^A-Za-z0-9\-_. ]")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_LABEL_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
# GFD's getArchFamily, by CUDA compute capability (facts §9).
_FAMILY_BY_MAJOR = {
    1: "tesla",
    2: "fermi",
    3: "kepler",
    5: "maxwell",
    6: "pascal",
    9: "hopper",
    10: "blackwell",
    12: "blackwell",
    13: "rubin",
}  # 7 and 8 split by minor: volta < 7.5 <= turing, ampere < 8.9 = ada-lovelace


def node_labels(
    inventory: Inventory,
    plan: ResourcePlan,
    *,
    mig_config_state: str | None = None,
    shared_suffix: bool = False,
    machine: str | None = None,
) -> dict[str, str]:
    """GFD's labels for this node (see the module docstring), sorted by key.

    ``plan`` is the plan being advertised (its ``mig_strategy`` picks the MIG labels and its shared resources the
    sharing labels); ``machine`` is the DMI product name (``/sys/class/dmi/id/product_name``), ``None`` when
    unreadable; ``mig_config_state`` is Tessera's MIG layout state (e.g. ``success``, ``pending``, ``failed``).
    A node without GPUs gets no GFD labels, as with GFD.
    """
    labels: dict[str, str] = {}
    if mig_config_state is not None:
        labels[MIG_CONFIG_STATE_LABEL] = label_value(mig_config_state)
    gpus = sorted(inventory.gpus, key=lambda g: g.index)
    if not gpus:
        return labels
    shared = _shared_devices(plan)
    labels |= _version_labels(inventory)
    labels["nvidia.com/gpu.machine"] = label_value(machine or "") or "unknown"
    labels["nvidia.com/mig.capable"] = _bool(any(g.mig_capable for g in gpus))
    mps = any(r.sharing is Sharing.MPS for r in plan.resources)
    labels["nvidia.com/mps.capable"] = _bool(mps and not any(g.mig_enabled for g in gpus))
    labels |= _full_gpu_labels(gpus, plan.mig_strategy, shared, shared_suffix)
    if plan.mig_strategy is MigStrategy.SINGLE:
        labels["nvidia.com/mig.strategy"] = str(MigStrategy.SINGLE)
        labels |= _single_labels(gpus, shared, shared_suffix)
    elif plan.mig_strategy is MigStrategy.MIXED:
        labels["nvidia.com/mig.strategy"] = str(MigStrategy.MIXED)
        labels |= _mixed_labels(gpus, shared, shared_suffix)
    return {key: labels[key] for key in sorted(labels) if is_label_key(key)}


# ----- Kubernetes label syntax --------------------------------------------------------------------------------


def sanitise(text: str) -> str:
    """GFD's ``sanitise()``: drop characters outside ``[A-Za-z0-9-_. ]``, turn runs of spaces into ``-``."""
    return "-".join(_UNSANITARY.sub("", text).split())


def label_value(text: str, limit: int = MAX_LABEL_VALUE) -> str:
    """``sanitise(text)`` made a valid label value: at most ``limit`` characters, alphanumeric at both ends."""
    return sanitise(text)[:limit].strip("-_.")


def is_label_value(value: str) -> bool:
    """A valid Kubernetes label value: empty, or up to 63 of ``[-A-Za-z0-9_.]`` starting and ending alphanumeric."""
    return len(value) <= MAX_LABEL_VALUE and _LABEL_VALUE.fullmatch(value) is not None


def is_label_key(key: str) -> bool:
    """A valid Kubernetes label key: an optional DNS-subdomain prefix and ``/``, then a name of up to 63 characters."""
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or _DNS_SUBDOMAIN.fullmatch(prefix) is None):
        return False
    if not prefix and "/" in key:
        return False
    return len(name) <= MAX_LABEL_VALUE and _LABEL_NAME.fullmatch(name) is not None


# ----- node-wide labels ---------------------------------------------------------------------------------------


def _version_labels(inventory: Inventory) -> dict[str, str]:
    labels = {"nvidia.com/cuda.driver-version.full": label_value(inventory.driver_version)}
    parts = inventory.driver_version.strip().split(".")
    if 2 <= len(parts) <= 3:  # GFD's X.Y[.Z]; GFD gives up on anything else, Tessera only leaves these out
        major, minor, revision = (label_value(p) for p in [*parts, ""][:3])
        labels |= {
            "nvidia.com/cuda.driver.major": major,  # the three cuda.driver.* labels are deprecated; GFD still sets them
            "nvidia.com/cuda.driver.minor": minor,
            "nvidia.com/cuda.driver.rev": revision,
            "nvidia.com/cuda.driver-version.major": major,
            "nvidia.com/cuda.driver-version.minor": minor,
            "nvidia.com/cuda.driver-version.revision": revision,
        }
    if inventory.cuda_driver_version is not None:  # NVML's 1000 * major + 10 * minor: 13000 is 13.0
        major, minor = str(inventory.cuda_driver_version // 1000), str(inventory.cuda_driver_version % 1000 // 10)
        labels |= {
            "nvidia.com/cuda.runtime.major": major,  # deprecated, as cuda.driver.*
            "nvidia.com/cuda.runtime.minor": minor,
            "nvidia.com/cuda.runtime-version.major": major,
            "nvidia.com/cuda.runtime-version.minor": minor,
            "nvidia.com/cuda.runtime-version.full": f"{major}.{minor}",
        }
    return labels


def gpu_family(compute_capability: tuple[int, int]) -> str:
    """GFD's architecture family for a CUDA compute capability (``undefined`` when unknown)."""
    major, minor = compute_capability
    if major == 7:
        return "volta" if minor < 5 else "turing"
    if major == 8:
        return "ampere" if minor < 9 else "ada-lovelace"
    return _FAMILY_BY_MAJOR.get(major, "undefined")


def _bool(value: bool) -> str:
    return "true" if value else "false"


# ----- sharing, from the plan ---------------------------------------------------------------------------------


def _shared_devices(plan: ResourcePlan) -> dict[str, Resource]:
    """Physical device ID -> the replicated resource its replicas are advertised in."""
    shared: dict[str, Resource] = {}
    for resource in plan.resources:
        if resource.sharing is not Sharing.NONE and resource.replicas > 1:
            for device in resource.devices:
                shared.setdefault(device.physical_id, resource)
    return shared


def _sharing(physical_ids: Sequence[str], shared: Mapping[str, Resource], original: str) -> tuple[int, str, bool]:
    """(replicas, sharing strategy, shared under the original name) for a set of physical devices.

    0 replicas when the set is empty (nothing of this kind is advertised), 1 when none of them is shared.
    """
    for physical_id in physical_ids:
        resource = shared.get(physical_id)
        if resource is not None:
            return resource.replicas, str(resource.sharing), resource.name == original
    return (1 if physical_ids else 0), str(Sharing.NONE), False


def _resource_labels(
    resource: str,
    *,
    product: Sequence[str],
    count: int,
    sharing: tuple[int, str, bool],
    shared_suffix: bool,
) -> dict[str, str]:
    """GFD's baseLabeler: ``<resource>.{product,count,replicas,sharing-strategy}``."""
    replicas, strategy, under_original_name = sharing
    suffixed = shared_suffix and replicas > 1 and under_original_name
    return {
        f"{resource}.product": _product(product, suffixed),
        f"{resource}.count": str(count),
        f"{resource}.replicas": str(replicas),
        f"{resource}.sharing-strategy": strategy if replicas > 1 else str(Sharing.NONE),
    }


def _product(parts: Sequence[str], suffixed: bool) -> str:
    """GFD's product name: the sanitised parts joined by ``-``, plus ``-SHARED``, kept within 63 characters."""
    text = "-".join(sanitise(p) for p in parts if p)
    if not suffixed:
        return label_value(text)
    base = label_value(text, MAX_LABEL_VALUE - len(_SHARED_SUFFIX))
    return base + _SHARED_SUFFIX if base else _SHARED_SUFFIX[1:]


# ----- nvidia.com/gpu.* ---------------------------------------------------------------------------------------


def _full_gpu_labels(
    gpus: list[Gpu], strategy: MigStrategy, shared: Mapping[str, Resource], shared_suffix: bool
) -> dict[str, str]:
    """The labels of GPU 0's model (GFD's newGPULabelers), before any MIG strategy overloads them."""
    first = gpus[0]
    same_model = [g for g in gpus if g.name == first.name]
    advertised_whole = [g.uuid for g in same_model if strategy is MigStrategy.NONE or not g.mig_enabled]
    labels = _resource_labels(
        GPU_RESOURCE,
        product=[first.name],
        count=len(same_model),
        sharing=_sharing(advertised_whole, shared, GPU_RESOURCE),
        shared_suffix=shared_suffix,
    )
    if first.memory_mib:
        labels[f"{GPU_RESOURCE}.memory"] = str(first.memory_mib)
    major, minor = first.compute_capability
    if major:
        labels |= {
            f"{GPU_RESOURCE}.family": gpu_family(first.compute_capability),
            f"{GPU_RESOURCE}.compute.major": str(major),
            f"{GPU_RESOURCE}.compute.minor": str(minor),
        }
    return labels


def _advertised_migs(gpus: list[Gpu]) -> list[MigDevice]:
    return [m for g in gpus for m in sorted(g.mig_devices, key=lambda m: m.mig_index) if m.is_full_instance]


def _mig_resource_labels(
    resource: str,
    migs: list[MigDevice],
    gpus: list[Gpu],
    shared: Mapping[str, Resource],
    shared_suffix: bool,
) -> dict[str, str]:
    """One MIG resource's labels: GFD's baseLabeler with ``<model>-MIG-<profile>``, plus the MIG attributes.

    The attributes are those of the first device; GFD omits nothing here but the inventory has no engine counts,
    so ``engines.*`` are left out.
    """
    first = migs[0]
    parent = next(g for g in gpus if g.index == first.gpu_index)
    labels = _resource_labels(
        resource,
        product=[parent.name, "MIG", first.profile],
        count=len(migs),
        sharing=_sharing([m.uuid for m in migs], shared, resource),
        shared_suffix=shared_suffix,
    )
    labels |= {
        f"{resource}.memory": str(first.memory_mib),
        f"{resource}.multiprocessors": str(first.multiprocessor_count),
        f"{resource}.slices.gi": str(first.gi_slices),
        f"{resource}.slices.ci": str(first.ci_slices),
    }
    return labels


def _single_labels(gpus: list[Gpu], shared: Mapping[str, Resource], shared_suffix: bool) -> dict[str, str]:
    """``single``: the MIG devices overload ``nvidia.com/gpu.*``; an invalid layout gets GFD's INVALID labels."""
    mig_gpus = [g for g in gpus if g.mig_enabled]
    if not mig_gpus:
        return {}  # no MIG: exactly like none
    profiles = {m.profile for g in mig_gpus for m in g.mig_devices}
    if any(not g.mig_devices for g in mig_gpus) or len(mig_gpus) != len(gpus) or len(profiles) != 1:
        return {
            f"{GPU_RESOURCE}.product": _product([mig_gpus[0].name, "MIG", "INVALID"], suffixed=False),
            f"{GPU_RESOURCE}.count": "0",
            f"{GPU_RESOURCE}.replicas": "0",
            f"{GPU_RESOURCE}.sharing-strategy": "",
            f"{GPU_RESOURCE}.memory": "0",
        }
    migs = _advertised_migs(mig_gpus)
    if not migs:
        return {}  # only partial compute instances: nothing is advertised, the full-GPU labels stand
    return _mig_resource_labels(GPU_RESOURCE, migs, gpus, shared, shared_suffix)


def _mixed_labels(gpus: list[Gpu], shared: Mapping[str, Resource], shared_suffix: bool) -> dict[str, str]:
    """``mixed``: ``nvidia.com/mig-<profile>.*`` for each profile, ``+`` replaced by ``.`` in the key."""
    by_profile: dict[str, list[MigDevice]] = {}
    for mig in _advertised_migs([g for g in gpus if g.mig_enabled]):
        by_profile.setdefault(mig.profile, []).append(mig)
    labels: dict[str, str] = {}
    for profile, migs in sorted(by_profile.items()):
        resource = f"{RESOURCE_PREFIX}mig-{mig_resource_suffix(profile)}"
        labels |= _mig_resource_labels(resource, migs, gpus, shared, shared_suffix)
    return labels
