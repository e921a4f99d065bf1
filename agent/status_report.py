"""The running agent's status as a document (``/status``, ``tessera status --format json``) and as text.

Built from the one status value the agent publishes after every change, never from the agent itself: what
``tessera status`` shows is exactly what the health endpoints and the metrics see. Every Unhealthy device
carries its reason (the XID and fault, a cordon, a daemon that is down), so an operator does not have to
correlate logs to learn why the kubelet's allocatable count dropped.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent.core.resources import Device
    from agent.status import AgentStatus

SCHEMA = "tessera.dev/status/v1"


def status_document(
    status: AgentStatus,
    *,
    version: str,
    started: bool = True,
    allocated: Sequence[Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """Plain JSON-ready data; keys are stable (``SCHEMA``), lists sorted, so scripts can rely on them.

    ``allocated``: each device a pod holds, from the last metrics collection (``resource``, ``device_id``,
    ``namespace``, ``pod``, ``container``, ``idle_seconds``, ``utilization_percent``); None before the first
    collection or without metrics."""
    gpus = status.inventory.gpus if status.inventory else ()
    return {
        "schema": SCHEMA,
        "version": version,
        "started": started,
        "config": {"name": status.config_name, "digest": status.config_digest, "rejected": status.config_error},
        "kubelet": {"present": status.kubelet_present, "registered": sorted(status.registered)},
        "gpus": [
            {"index": gpu.index, "uuid": gpu.uuid, "name": gpu.name, "mig_devices": len(gpu.mig_devices)}
            for gpu in gpus
        ],
        "resources": [_resource(name, snapshot, status) for name, snapshot in sorted(status.resources.items())],
        "mig": {
            "state": status.mig_state,
            "error": status.mig_error,
            "waiting_for": list(status.waiting_for.get("mig", ())),
        },
        "mps": {key: dict(daemon) for key, daemon in sorted(status.mps.items())},
        "cordoned": [{"unit": unit, "by": list(keys)} for unit, keys in sorted(status.cordoned.items())],
        "cordon_problems": list(status.cordon_problems),
        "dra": dict(status.dra) if status.dra is not None else None,
        "waiting_for": {key: list(reasons) for key, reasons in sorted(status.waiting_for.items())},
        "discovery_error": status.discovery_error,
        "stale_gpus": sorted(status.stale_gpus),
        "internal_errors": dict(sorted(status.internal_errors.items())),
        "memory_limits": [dict(held.to_json()) for held in status.memory_limits],
        "allocated": None if allocated is None else [dict(entry) for entry in sorted(allocated, key=_by_pod_device)],
    }


def _by_pod_device(entry: Mapping[str, Any]) -> tuple[str, str, str, str]:
    return (str(entry["namespace"]), str(entry["pod"]), str(entry["resource"]), str(entry["device_id"]))


def _resource(name: str, snapshot: Any, status: AgentStatus) -> dict[str, Any]:
    unhealthy = [
        {"id": device.id, "gpu": device.gpu_index, "reason": unhealthy_reason(device, status)}
        for device in snapshot.devices
        if not snapshot.health.get(device.id, False)
    ]
    return {
        "name": name,
        "sharing": str(snapshot.sharing),
        "devices": len(snapshot.devices),
        "healthy": len(snapshot.devices) - len(unhealthy),
        "registered": name in status.registered,
        "unhealthy": unhealthy,
    }


def unhealthy_reason(device: Device, status: AgentStatus) -> str:
    """Why the agent advertises ``device`` Unhealthy, in the words of the fault that made it so."""
    faults = status.faults
    for unit in (device.gpu_uuid, device.mig_uuid):
        if unit is not None and unit in faults:
            return faults[unit].reason
    if device.mig_uuid is None:  # a whole GPU is spoilt by a fault on one of its MIG devices
        child = next((f for f in faults.values() if f.gpu_uuid == device.gpu_uuid), None)
        if child is not None:
            return f"{child.reason} (on one of its MIG devices)"
    for unit in (device.gpu_uuid, device.mig_uuid):
        if unit is not None and unit in status.cordoned:
            return f"cordoned ({', '.join(status.cordoned[unit])})"
    return "its MPS daemon is not serving" if _mps_down(status.mps) else "unavailable"


def _mps_down(mps: Mapping[str, Mapping[str, object]]) -> bool:
    return any(daemon.get("state") != "ready" for daemon in mps.values())


def render_text(document: Mapping[str, Any]) -> str:
    """What ``tessera status`` prints: the answers an operator looks for first, one section each."""
    lines = [f"Tessera {document['version']}" + ("" if document["started"] else " (starting)")]
    config = document["config"]
    name = config["name"] or "defaults (no config applies)"
    lines.append(f"Config:     {name}" + (f" ({config['digest'][:12]})" if config["digest"] else ""))
    if config["rejected"]:
        lines.append(f"  rejected: {config['rejected']}")
    kubelet = document["kubelet"]
    registered = ", ".join(kubelet["registered"]) or "nothing"
    lines.append(f"Kubelet:    {'up' if kubelet['present'] else 'not running'}; registered: {registered}")
    lines.append(f"GPUs:       {len(document['gpus'])}")
    lines.append("Resources:")
    for resource in document["resources"]:
        mark = "" if resource["registered"] else "  (not registered)"
        lines.append(
            f"  {resource['name']:<28} {resource['healthy']}/{resource['devices']} healthy  {resource['sharing']}{mark}"
        )
        for device in resource["unhealthy"]:
            lines.append(f"    {device['id']} (GPU {device['gpu']}): {device['reason']}")
    if not document["resources"]:
        lines.append("  none")
    mig = document["mig"]
    if mig["state"]:
        lines.append(f"MIG:        {mig['state']}" + (f": {mig['error']}" if mig["error"] else ""))
        lines += [f"  waiting for: {reason}" for reason in mig["waiting_for"]]
    for key, daemon in document["mps"].items():
        error = f": {daemon['error']}" if daemon.get("error") else ""
        lines.append(f"MPS daemon: {key} {daemon.get('state')}, {daemon.get('restarts', 0)} restarts{error}")
    dra = document.get("dra")
    if dra:
        served = ", ".join(dra["served"]) or "no GPU yet"
        error = f"; {dra['error']}" if dra["error"] else ""
        lines.append(f"DRA:        driver {dra['driver']} serves {served}{error}")
        lines += [f"  leaving for the device plugin once no claim holds it: {uuid}" for uuid in dra["leaving"]]
        lines += [f"  unavailable: {note}" for note in dra.get("unavailable") or []]
        for claim in dra.get("claims") or []:
            made = []
            for device in claim["devices"]:
                extra = [f"MIG device {device['mig']}"] if device.get("mig") else []
                extra += [f"time-slice {device['timeslice']}"] if device.get("timeslice") else []
                if device.get("share"):
                    share = device["share"]
                    compute = f", {share['computePercent']}% of its compute" if share["computePercent"] else ""
                    shares = f", {share['shares']} shares" if share.get("shares") else ""
                    extra.append(f"share of {_memory(share['memory'])}{compute}{shares}")
                made.append(device["device"] + (f" ({', '.join(extra)})" if extra else ""))
            state = "" if claim["state"] == "PrepareCompleted" else f" [{claim['state']}]"
            lines.append(f"  claim {claim['claim']}{state}: {', '.join(made)}")
            for device in claim["devices"]:  # what holds a share's limits: the MPS server, or only its clients
                if device.get("enforcement"):
                    lines.append(f"    {device['device']} limits: {device['enforcement']['note']}")
    lines += memory_limit_lines(document.get("memory_limits") or [])
    for entry in document["cordoned"]:
        lines.append(f"Cordoned:   {entry['unit']} (by {', '.join(entry['by'])})")
    lines += [f"  ignored: {problem}" for problem in document["cordon_problems"]]
    for key, reasons in document["waiting_for"].items():
        if key != "mig":
            lines += [f"Waiting:    {key}: {reason}" for reason in reasons]
    if document["discovery_error"]:
        lines.append(f"Discovery:  {document['discovery_error']}")
    if document["internal_errors"]:
        counts = ", ".join(f"{where} {count}" for where, count in document["internal_errors"].items())
        lines.append(f"Internal errors survived: {counts}")
    return "\n".join(lines) + "\n"


def memory_limit_lines(held: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each container held to a memory size, per GPU: its request and limit and what holds it to them (the driver,
    the MPS server's default, or nothing but goodwill: advisory), with the reason when it is not the driver."""
    if not held:
        return []
    lines = ["Memory limits:"]
    for row in held:
        who = f"{row['namespace']}/{row['pod']}/{row['container']}"
        sizes = f"request {_gib(row['request_bytes'])}, limit {_gib(row['limit_bytes'])}"
        if row["enforcement"] == "driver":
            how = "driver" + (
                ""
                if row["applied"]
                else " (not applied yet: the container has not started, or the driver's call "
                "failed and is tried again; the log says which)"
            )
        else:
            how = f"{row['enforcement']}: {row['reason']}"
        lines.append(f"  {who} on GPU {row['gpu_index']}: {sizes}; {how}")
    return lines


def _gib(size: int) -> str:
    return f"{size / (1 << 30):g}Gi" if size % (1 << 20) == 0 and size >= 1 << 30 else f"{size >> 20}Mi"


def render_idle(document: Mapping[str, Any]) -> str:
    """What ``tessera status --idle`` prints: each allocated device with its pod and how long the pod's own
    processes have left it idle, the longest idle first."""
    allocated = document.get("allocated")
    if allocated is None:
        return "No allocation data: the agent has not collected metrics yet (or runs an older version).\n"
    if not allocated:
        return "No device is allocated to a pod.\n"
    rows = sorted(allocated, key=lambda e: (-float(e["idle_seconds"]), *_by_pod_device(e)))
    table = [("POD", "CONTAINER", "RESOURCE", "DEVICE", "IDLE FOR", "SM %")]
    for entry in rows:
        util = entry.get("utilization_percent")
        table.append(
            (
                f"{entry['namespace']}/{entry['pod'] or '-'}",  # a DRA claim's pods are known by UID only
                str(entry["container"]) or "-",
                str(entry["resource"]),
                str(entry["device_id"]),
                duration(float(entry["idle_seconds"])) if entry["idle_seconds"] else "busy",
                "n/a" if util is None else f"{float(util):.0f}",
            )
        )
    widths = [max(len(row[n]) for row in table) for n in range(len(table[0]))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in table]
    idle = sum(1 for entry in allocated if entry["idle_seconds"])
    lines.append(f"{idle} of {len(allocated)} allocated devices idle (n/a: NVML gives no per-process utilization)")
    return "\n".join(lines) + "\n"


def duration(seconds: float) -> str:
    """``45s``, ``12m05s``, ``3h02m``, ``2d04h``: what an operator reads at a glance."""
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def _memory(amount: int) -> str:
    """A share's memory as a quantity: ``10Gi``, ``1500Mi``; ``no memory`` for none (unlimited or shares mode)."""
    if not amount:
        return "no memory"
    if amount % (1 << 30) == 0:
        return f"{amount >> 30}Gi"
    return f"{amount >> 20}Mi"
