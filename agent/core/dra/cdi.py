"""The CDI spec of one prepared claim, its file name, and the CDI device IDs the kubelet gets back.

Identity, as NVIDIA's DRA driver (facts/dra.md C7): vendor ``k8s.gpu.nvidia.com``, class ``claim``, so the spec's
kind is ``k8s.gpu.nvidia.com/claim``; one spec per claim in the file ``k8s.gpu.nvidia.com-claim_<claimUID>.yaml``
(CDI's transient spec name) under the CDI root; one device entry per prepared device named
``<claimUID>-<device name>`` (``3f2c…-gpu-0``), whose ID is ``k8s.gpu.nvidia.com/claim=<claimUID>-<device name>``.
The claim UID must be a Kubernetes UID (an RFC 4122 UUID) and the device name a DNS label, so the file name can
never leave the CDI directory and every entry name is a valid CDI device name.

``cdiVersion`` is ``0.5.0``: the lowest version that allows what this spec emits. Claim UIDs often begin with a
digit, so entry names do too, which CDI accepts only from 0.5.0 on (the CDI library's ``requiresV050``); nothing
else emitted needs more (no annotations (0.6.0), no ``additionalGIDs`` or ``intelRdt`` (0.7.0)). Keeping it low
keeps older runtimes (containerd 1.7, CRI-O, podman) able to read it.

What goes in the spec, and why:

- Per device, the device nodes the caller gives (``/dev/nvidia<minor>``; for a MIG device also the GPU-instance
  and compute-instance capability nodes ``/dev/nvidia-caps/nvidia-cap<n>``, with type, major and minor so the
  runtime can create them; ``gpu_nodes`` and ``mig_nodes`` build them from numbers the shell reads).
- For the whole claim, ``NVIDIA_VISIBLE_DEVICES=void``, as ``nvidia-ctk cdi generate`` and NVIDIA's driver do:
  CUDA images set ``NVIDIA_VISIBLE_DEVICES=all``, and on a node whose default runtime is the NVIDIA runtime in
  legacy mode that would inject every GPU of the node; ``void`` turns that off so the container sees exactly the
  devices CDI gives it. A per-device ``NVIDIA_VISIBLE_DEVICES=<uuid>`` would be wrong twice: CDI applies env edits
  in order, so with two devices the last would win, and it would re-enable the legacy injection CDI replaces.
- The caller's ``common_edits`` (spec-level ``containerEdits``): the driver's control nodes, libraries, binaries,
  firmware and hooks, as NVIDIA's container toolkit gives them (``agent.core.cdi_edits``, discovered under
  ``--driver-root`` by ``agent.gpu.driver_root``).

The spec stands alone: the IDs returned to the kubelet are the claim's own entries, nothing else, so no container
depends on a spec Tessera did not write (a node without ``nvidia-ctk cdi generate``'s spec, a MIG device created by
this Prepare whose UUID no earlier spec can hold). The claim's own ID is the first (and only) one, so the kubelet's
``allocatedResourcesStatus[].resourceID`` is the claim ID, as with NVIDIA's driver. ``node_wide=True`` (the
``--node-wide-cdi`` flag) keeps the old behaviour for nodes that rely on ``nvidia-ctk cdi generate``: each device
also gets the node-wide ``nvidia.com/gpu=<uuid>`` ID (the MIG UUID for a MIG device), and the claim spec holds only
the GPU's node.

Pure: builds documents and names; the shell writes the file (atomically, mode 0644, under ``--cdi-root``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from msgspec import Struct

CDI_VERSION = "0.5.0"
CDI_VENDOR = "k8s.gpu.nvidia.com"
CDI_CLASS = "claim"
CDI_KIND = f"{CDI_VENDOR}/{CDI_CLASS}"
SPEC_FILE_PREFIX = f"{CDI_VENDOR}-{CDI_CLASS}_"  # CDI's GenerateTransientSpecName(vendor, class, id)
SPEC_FILE_SUFFIX = ".yaml"
VISIBLE_DEVICES_VOID = "NVIDIA_VISIBLE_DEVICES=void"
CAPS_DIR = "/dev/nvidia-caps"
NODE_WIDE_CDI_KIND = "nvidia.com/gpu"  # the kind of the spec nvidia-ctk cdi generate writes

_UID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


class CdiError(ValueError):
    """A name that cannot be used in a CDI spec (it could escape the CDI directory or break the spec)."""


class DeviceNode(Struct, frozen=True):
    """One CDI ``deviceNodes`` entry."""

    path: str  # the path in the container
    host_path: str | None = None  # defaults to ``path`` on the host
    type: str | None = None  # "c" for a character device the runtime may create from major/minor
    major: int | None = None
    minor: int | None = None
    permissions: str | None = None  # cgroup access, e.g. "rw"

    def to_cdi(self) -> dict[str, Any]:
        node: dict[str, Any] = {"path": self.path}
        for key, value in (
            ("hostPath", self.host_path),
            ("type", self.type),
            ("major", self.major),
            ("minor", self.minor),
            ("permissions", self.permissions),
        ):
            if value is not None:
                node[key] = value
        return node


def check_claim_uid(claim_uid: str) -> str:
    """The claim UID, if it is a Kubernetes UID; else ``CdiError`` (it becomes part of a file name)."""
    if not isinstance(claim_uid, str) or not _UID.fullmatch(claim_uid):
        raise CdiError(
            f"claim UID {claim_uid!r} is not a Kubernetes UID (8-4-4-4-12 hex digits); refusing to name a CDI spec "
            "file after it"
        )
    return claim_uid


def spec_file_name(claim_uid: str) -> str:
    """``k8s.gpu.nvidia.com-claim_<claimUID>.yaml``, a bare file name that stays inside the CDI directory."""
    return f"{SPEC_FILE_PREFIX}{check_claim_uid(claim_uid)}{SPEC_FILE_SUFFIX}"


def claim_uid_of_spec_file(file_name: str) -> str | None:
    """The claim UID a spec file of ours was written for, or ``None`` for any other file (sweeping stale specs)."""
    if not (file_name.startswith(SPEC_FILE_PREFIX) and file_name.endswith(SPEC_FILE_SUFFIX)):
        return None
    uid = file_name[len(SPEC_FILE_PREFIX) : -len(SPEC_FILE_SUFFIX)]
    return uid if _UID.fullmatch(uid) else None


def claim_device_name(claim_uid: str, device_name: str) -> str:
    """The spec entry name, ``<claimUID>-<device name>``."""
    if not _DNS_LABEL.fullmatch(device_name):
        raise CdiError(f"device name {device_name!r} is not a DNS label; it cannot name a CDI device")
    return f"{check_claim_uid(claim_uid)}-{device_name}"


def claim_device_id(claim_uid: str, device_name: str) -> str:
    """``k8s.gpu.nvidia.com/claim=<claimUID>-<device name>``, the fully qualified CDI device ID."""
    return f"{CDI_KIND}={claim_device_name(claim_uid, device_name)}"


def cdi_device_ids(
    claim_uid: str,
    device_name: str,
    uuid: str,
    *,
    node_wide: bool = False,
    node_cdi_kind: str = NODE_WIDE_CDI_KIND,
) -> tuple[str, ...]:
    """The CDI IDs for one prepared device: the claim entry, then (``node_wide`` only) the node-wide
    ``<kind>=<uuid>``."""
    ids = [claim_device_id(claim_uid, device_name)]
    if node_wide:
        ids.append(f"{node_cdi_kind}={uuid}")
    return tuple(ids)


def gpu_nodes(minor: int, dev_root: str = "/") -> tuple[DeviceNode, ...]:
    """A full GPU's device node, ``/dev/nvidia<minor>`` (from ``<dev_root>/dev/nvidia<minor>`` on the host)."""
    path = f"/dev/nvidia{minor}"
    return (DeviceNode(path, host_path=None if dev_root in ("", "/") else dev_root.rstrip("/") + path),)


def mig_nodes(
    parent_minor: int, caps_major: int, gi_minor: int, ci_minor: int, dev_root: str = "/"
) -> tuple[DeviceNode, ...]:
    """A MIG device's nodes: the parent GPU's node and its GI and CI capability nodes (``nvidia-caps`` major).

    The capability minors come from ``/proc/driver/nvidia/capabilities/gpu<m>/mig/gi<g>[/ci<c>]/access`` and the
    major from ``/proc/devices``; the shell reads them. Type and numbers let the runtime create the nodes in the
    container even when the host has not created them.
    """
    caps = tuple(
        DeviceNode(f"{CAPS_DIR}/nvidia-cap{minor}", type="c", major=caps_major, minor=minor, permissions="rw")
        for minor in (gi_minor, ci_minor)
    )
    return (*gpu_nodes(parent_minor, dev_root), *caps)


def claim_spec(
    claim_uid: str,
    device_nodes: Mapping[str, Sequence[DeviceNode]],
    *,
    common_edits: Mapping[str, Any] | None = None,
    device_edits: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The CDI spec document for one claim: ``device_nodes`` maps each prepared device's name to its nodes.

    Entries keep the given order (the plan's). ``common_edits`` (CDI ``containerEdits`` keys: ``env``,
    ``deviceNodes``, ``mounts``, ``hooks``) are added at spec level after ``NVIDIA_VISIBLE_DEVICES=void``;
    ``device_edits`` (``env``, ``mounts``) to one device's entry (an MPS client's pipe, shared memory, limits).
    """
    check_claim_uid(claim_uid)
    if not device_nodes:
        raise CdiError(f"claim {claim_uid} has no devices; a CDI spec needs at least one")
    devices = []
    for name, nodes in device_nodes.items():
        if not nodes:
            raise CdiError(f"device {name} of claim {claim_uid} has no device nodes; a CDI device needs edits")
        entry: dict[str, Any] = {"deviceNodes": [node.to_cdi() for node in nodes]}
        for key, value in ((device_edits or {}).get(name) or {}).items():
            entry[key] = list(value)
        devices.append({"name": claim_device_name(claim_uid, name), "containerEdits": entry})
    edits: dict[str, Any] = {"env": [VISIBLE_DEVICES_VOID]}
    for key, value in (common_edits or {}).items():
        if key == "env":
            edits["env"] = [VISIBLE_DEVICES_VOID, *(e for e in value if e != VISIBLE_DEVICES_VOID)]
        else:
            edits[key] = list(value)
    return {"cdiVersion": CDI_VERSION, "kind": CDI_KIND, "devices": devices, "containerEdits": edits}
