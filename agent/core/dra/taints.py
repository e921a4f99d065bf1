"""Device health as DRA device taints, with NVIDIA's keys, so tolerations written for NVIDIA's driver apply.

A device is tainted while ``HealthState`` holds a fault on it or on its GPU (the device plugin front end's
rule: a GPU fault spoils every device on it). Keys are in the driver's domain (``gpu.nvidia.com`` by
default), as NVIDIA's driver names them (facts ``dra.md`` C9, ``gpu-health.md`` 3.2):

- a fault from an XID: ``<driver>/xid`` = the XID number, ``NoSchedule`` (an XID 79 too: NVIDIA gives a
  reboot-class XID its xid taint, not gpu-lost);
- the GPU lost (NVML ``GPU_IS_LOST``), no XID: ``<driver>/gpu-lost``, ``NoSchedule``;
- any other fault (the health watch could not be set up): ``<driver>/unmonitored``, but ``NoSchedule`` where
  NVIDIA uses ``None`` (information only). A decision: NVIDIA's DRA driver gives ``None`` to every GPU it cannot
  register for events, ``NOT_SUPPORTED`` included; Tessera keeps such a GPU Healthy and untainted (as NVIDIA's
  device plugin does), and only a watch that keeps failing for another reason makes this fault, on which the
  device plugin front end and the kubelet's health stream report Unhealthy (so does NVIDIA's device plugin for
  such registration errors): the slice must not offer the device to new claims either. ``None`` is not in the
  1.34 API Tessera serves. docs/dra.md says so, with the toleration that allocates such a device anyway.

XIDs the health policy ignores or blames on the application make no fault, hence no taint (NVIDIA adds an
informational ``None`` taint for its ignored XIDs; Tessera does not). One taint per key: when a device and its
GPU both have an XID fault, the later event's XID is shown.

Unlike NVIDIA's driver a taint goes away when the fault is cleared (the recovery rules of ``agent.core.health``).
``timeAdded`` is kept while the same taint (key, value, effect) stays on the device, and is ``now`` for a new
one, as the Go helper's ``copyTaintTimeAdded`` does; a changed XID is a new taint.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime

from msgspec import Struct

from agent.core.dra.devices import DEFAULT_DRIVER, DraDevice
from agent.core.health import Fault, HealthState

XID = "xid"
GPU_LOST = "gpu-lost"
UNMONITORED = "unmonitored"
NO_SCHEDULE = "NoSchedule"
NO_EXECUTE = "NoExecute"
NONE = "None"  # not valid in the 1.34 API
EFFECTS = (NONE, NO_SCHEDULE, NO_EXECUTE)


class DeviceTaint(Struct, frozen=True):
    """One ``spec.devices[].taints[]`` entry."""

    key: str  # a label name, e.g. "gpu.nvidia.com/xid"
    effect: str = NO_SCHEDULE
    value: str | None = None  # a label value
    time_added: str | None = None  # RFC 3339 in UTC, whole seconds; None lets the API server set it

    def same_as(self, other: DeviceTaint) -> bool:
        """The same taint, whenever it was added."""
        return (self.key, self.value, self.effect) == (other.key, other.value, other.effect)


def device_taints(
    devices: Iterable[DraDevice],
    health: HealthState,
    *,
    now: datetime,
    previous: Mapping[str, Sequence[DeviceTaint]] | None = None,
    driver: str = DEFAULT_DRIVER,
) -> dict[str, tuple[DeviceTaint, ...]]:
    """The taints of each tainted device, by device name, sorted by key (untainted devices are absent).

    ``previous`` is what was published before (by device name); ``now`` stamps taints that are new.
    """
    stamp = rfc3339(now)
    before = previous or {}
    result: dict[str, tuple[DeviceTaint, ...]] = {}
    for device in devices:
        faults = _faults_of(device, health)
        if not faults:
            continue
        latest: dict[str, tuple[float, DeviceTaint]] = {}
        for fault in faults:
            taint = _taint(fault, driver)
            if taint.key not in latest or fault.last_event > latest[taint.key][0]:
                latest[taint.key] = (fault.last_event, taint)
        kept = before.get(device.name, ())
        result[device.name] = tuple(
            _stamped(taint, kept, stamp) for _, (_, taint) in sorted(latest.items(), key=lambda item: item[0])
        )
    return result


def rfc3339(moment: datetime) -> str:
    """``moment`` as metav1.Time serialises it: UTC, whole seconds, ``Z`` (a naive datetime is taken as UTC)."""
    if moment.tzinfo is not None:
        moment = moment.astimezone(UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _faults_of(device: DraDevice, health: HealthState) -> list[Fault]:
    """The faults that make ``device`` Unhealthy (``HealthState.is_healthy``'s rule)."""
    faults = health.faults
    own = [faults[device.uuid]] if device.uuid in faults else []
    if device.parent_uuid is not None:
        return own + ([faults[device.parent_uuid]] if device.parent_uuid in faults else [])
    return own + [f for unit, f in sorted(faults.items()) if f.gpu_uuid == device.uuid and unit != device.uuid]


def _taint(fault: Fault, driver: str) -> DeviceTaint:
    if fault.xid is not None:
        return DeviceTaint(f"{driver}/{XID}", NO_SCHEDULE, str(fault.xid))
    if fault.lost:
        return DeviceTaint(f"{driver}/{GPU_LOST}", NO_SCHEDULE)
    return DeviceTaint(f"{driver}/{UNMONITORED}", NO_SCHEDULE)


def _stamped(taint: DeviceTaint, previous: Sequence[DeviceTaint], now: str) -> DeviceTaint:
    earlier = next((p for p in previous if p.same_as(taint) and p.time_added), None)
    added = earlier.time_added if earlier is not None else now
    return DeviceTaint(taint.key, taint.effect, taint.value, added)
