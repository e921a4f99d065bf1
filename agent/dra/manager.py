"""The DRA front end's place in the reconcile loop: which GPUs DRA serves, and moving GPUs between front ends.

Like the MIG and MPS managers it belongs to the loop: ``configure``, ``publish`` and ``tick`` run on the loop's
thread and only look at state; the one slow question — is a GPU the device plugin served still in use? — runs
on a worker whose answer comes back as an event (``DraHandoverChecked``).

The rule: each GPU is served by one front end, and nothing moves under a running workload.
- **To DRA.** A GPU the config gives to DRA leaves the device plugin's ListAndWatch at once (``withdrawn``), and
  joins DRA's slices only when no pod holds any of its devices and no process runs on it (PodResources and NVML;
  unknown counts as busy). A GPU some recorded claim already holds (an agent restart) joins at once.
- **To the device plugin.** A GPU the config takes from DRA leaves DRA's slices at once (no new claim gets it)
  but stays served — claims on it can still be unprepared — until no recorded claim holds any of its devices;
  then the device plugin offers it again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from msgspec import Struct

from agent.core.dra.ownership import dra_gpus, dynamic_mig_gpus, shared_gpus
from agent.core.dra.partitions import Unclaimed
from agent.core.health import HealthState
from agent.core.inventory import Gpu, Inventory
from agent.core.ledger import Drain
from agent.dra.types import (
    DraClaimsChanged,
    DraHandoverChecked,
    DraRegistration,
    DraSettings,
    DraUnclaimedSwept,
    SlicesFailed,
    SlicesPublished,
)
from agent.news import PUBLISH, STATUS, News
from agent.supervise import submit

if TYPE_CHECKING:
    from agent.core.dra.taints import DeviceTaint
    from agent.core.mps import MpsDaemonSpec
    from agent.dra.frontend import DraFrontEnd
    from agent.ledger import DeviceLedger

log = logging.getLogger(__name__)

CHECK_INTERVAL = 1.0  # how often a GPU waiting to move looks again whether it is free
CORDON_TAINT = "tessera.dev/gpu-cordon"  # a device the operator cordoned (agent.core.cordon): NoSchedule


class _Waiting(Struct):
    next_check: float = 0.0
    in_flight: bool = False
    why: tuple[str, ...] = ()
    answered: bool = False  # the first check came back (until then the pool is not published)


class DraManager:
    def __init__(
        self,
        settings: Callable[[str], DraSettings],  # driver name -> where the driver's sockets and files go
        api_client: Callable[[], Any],  # the Kubernetes API client, or None when there is none
        post: Callable[[object], None],
        pod_resources_socket: Path,
        ledger: DeviceLedger,
        *,
        clock_now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._settings = settings
        self._api_client = api_client
        self._post = post
        self._socket = pod_resources_socket
        self._now = clock_now
        self._front: DraFrontEnd | None = None
        self._driver: str | None = None
        self._wanted: frozenset[str] = frozenset()
        self._ledger = ledger  # who holds each device, and which GPUs DRA serves (offered in the slices unless leaving)
        self._adopting: set[str] = set()  # held by recorded claims: DRA's as soon as the ledger's lock is free
        self._arriving: dict[str, _Waiting] = {}  # withdrawn from the device plugin, waiting to be free
        self._taints: dict[str, tuple[DeviceTaint, ...]] = {}
        self._cordon_taints: dict[str, tuple[DeviceTaint, ...]] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dra")
        self._sys_root = Path("/sys")
        self._dynamic_mig: object = None  # the config's dra.dynamicMig
        self._gpu_shares: object = None  # the config's dra.gpuShares
        self._default_share: int | None = None  # ... and dra.defaultShare (bytes)
        self._share_mode: str | int = "memory"  # ... and dra.consumableShares (NVIDIA's mode)
        self._seen_made: set[str] = set()  # MIG devices made for claims that a read after their making covered
        self._first_read: dict[str, Inventory | None] = {}  # made MIG device -> the loop's inventory when first known
        self._published: Inventory | None = None  # the inventory of the last publish
        self._last_made: frozenset[str] = frozenset()
        self._last_modes = 0  # the front end's count of MIG mode changes by claims, when last asked
        self._pcie_roots: dict[str, str | None] = {}  # by PCI bus ID, read once per GPU (None: sysfs does not say)
        self._numa_nodes: dict[str, int | None] = {}  # by PCI bus ID, as sysfs says (None: -1, no affinity)
        self._leaving_check = 0.0
        self._unclaimed: tuple[Unclaimed, ...] = ()  # GPU instances on dynamic-MIG GPUs no claim made (as published)
        self._sweep = _Waiting()  # destroying them: one job at a time, again after CHECK_INTERVAL while held
        self.error: str | None = None  # why DRA cannot run (no API), said in the status
        self.registered: bool | None = None  # the kubelet's last word on the driver's registration

    @property
    def _served(self) -> frozenset[str]:
        """The GPUs DRA serves: the ledger's word, which only it changes (under its lock)."""
        return self._ledger.dra_gpus()

    # ----- the loop's view ------------------------------------------------------------------------

    def configure(
        self,
        enabled: bool,
        driver: str,
        gpus: object,
        inventory: Inventory,
        now: float,
        *,
        dynamic_mig: object = None,
        gpu_shares: object = None,
        default_share: int | None = None,
        share_mode: str | int = "memory",
    ) -> None:
        """The config's ``dra`` section on this node; ``OwnershipError`` when ``gpus`` names GPUs it lacks,
        ``dynamic_mig`` GPUs DRA does not serve or that cannot do MIG, or ``gpu_shares`` GPUs DRA does not serve
        or that are in dynamic MIG."""
        wanted = dra_gpus(gpus if enabled else None, inventory)  # type: ignore[arg-type]
        dynamic = dynamic_mig_gpus(dynamic_mig if enabled else None, wanted, inventory)  # type: ignore[arg-type]
        shared_gpus(gpu_shares if enabled else None, wanted, dynamic, inventory)  # type: ignore[arg-type]
        self._dynamic_mig = dynamic_mig if enabled else None
        self._gpu_shares = gpu_shares if enabled else None
        self._default_share = default_share
        self._share_mode = share_mode
        if wanted and self._front is None:
            client = self._api_client()
            if client is None:
                self._driver = driver
                self.error = "DRA needs the Kubernetes API: a node name (NODE_NAME) and in-cluster access or kubeconfig"
                log.error("DRA cannot run error=%r", self.error)
                wanted = frozenset()
            else:
                from agent.dra.frontend import DraFrontEnd  # the DRA shell loads when DRA serves a GPU

                self._driver, self.error = driver, None
                settings = self._settings(driver)
                self._sys_root = settings.sys_root
                self._front = DraFrontEnd(settings, client, self._post, self._ledger)
                self._front.start()
        held = self._held_gpus(inventory)
        self._adopting |= (wanted - self._served) & held  # a claim recorded before an agent restart: DRA's already
        self._adopt()
        for uuid in wanted - self._served - self._adopting:
            if uuid not in self._arriving:
                self._arriving[uuid] = _Waiting(next_check=now)
                log.info("GPU moves to DRA gpu=%s; withdrawn from the device plugin until it is free", uuid)
        for uuid in list(self._arriving):
            if uuid not in wanted:
                del self._arriving[uuid]  # changed its mind: the device plugin keeps it
        self._wanted = wanted

    def mps_specs(self) -> tuple[MpsDaemonSpec, ...]:
        """The MPS daemons DRA claims need (prepared or being prepared): the MPS manager keeps them running."""
        if self._front is None:
            return ()
        from agent.core.dra.mps import records_specs

        return records_specs(self._front.mps_records())

    def mps_changed(self, status: Mapping[str, Mapping[str, object]], root: str) -> None:
        """The MPS manager's state of DRA's daemons (and the MPS root), for the claims waiting on them."""
        if self._front is None:
            return
        from agent.core.dra.mps import KEY_PREFIX

        states = {
            key: (str(entry.get("state")), entry.get("error"), entry.get("limits"))  # type: ignore[misc]
            for key, entry in status.items()
            if key.startswith(f"{KEY_PREFIX}/")
        }
        self._front.mps_changed(states, root)

    def dynamic_mig_indices(self, inventory: Inventory) -> frozenset[int]:
        """The indices of the GPUs dynamic MIG owns (served by DRA or on their way to it): no static MIG layout
        touches them."""
        gpus = self._served | set(self._arriving)
        named = self._named_dynamic(inventory, frozenset(gpus))
        return frozenset(g.index for g in inventory.gpus if g.uuid in named)

    def dra_indices(self, inventory: Inventory) -> frozenset[int]:
        """The indices of the GPUs DRA serves, is taking, or a recorded claim holds: no static MIG layout touches
        them."""
        gpus = self._served | set(self._arriving) | self._adopting | self._ledger.recorded().claimed_gpus()
        return frozenset(g.index for g in inventory.gpus if g.uuid in gpus)

    def _named_dynamic(self, inventory: Inventory, served: frozenset[str]) -> frozenset[str]:
        from agent.core.dra.ownership import OwnershipError

        if self._dynamic_mig is None:
            return frozenset()
        capable = dynamic_mig_gpus("all", served, inventory)  # the MIG-capable GPUs among them
        try:
            return capable if self._dynamic_mig == "all" else dra_gpus(self._dynamic_mig, inventory) & capable  # type: ignore[arg-type]
        except OwnershipError:  # a named GPU is gone from the node: configure() says so; the rest stay as they are
            return frozenset()

    def _shared_gpus(self, inventory: Inventory) -> frozenset[str]:
        """DRA's GPUs published for memory-sized shares; a GPU named there that is not DRA's (yet), or gone, is
        left out (``configure`` reports it), and so is one in dynamic MIG."""
        if self._gpu_shares is None:
            return frozenset()
        if self._gpu_shares == "all":
            named: set[str | None] = set(self._served)
        else:
            by_index = {g.index: g.uuid for g in inventory.gpus}
            named = {by_index.get(e) if isinstance(e, int) else e for e in self._gpu_shares}  # type: ignore[attr-defined]
        dynamic = self._named_dynamic(inventory, frozenset(self._served))
        return frozenset(uuid for uuid in named if uuid in self._served and uuid not in dynamic)

    def _roots(self, inventory: Inventory) -> dict[str, str]:
        """The PCIe root of each of DRA's GPUs, read from sysfs the first time a GPU is served."""
        from agent.core.dra.devices import pci_bus_id
        from agent.dra.pcie import pcie_roots

        served = (pci_bus_id(g.pci_bus_id) for g in inventory.gpus if g.uuid in self._served)
        bus_ids = {bus_id for bus_id in served if bus_id is not None} - self._pcie_roots.keys()
        if bus_ids:
            from agent.dra.pcie import numa_nodes

            found = pcie_roots(bus_ids, self._sys_root)
            self._pcie_roots.update({bus_id: found.get(bus_id) for bus_id in bus_ids})
            self._numa_nodes.update(numa_nodes(bus_ids, self._sys_root))
        return {bus_id: root for bus_id, root in self._pcie_roots.items() if root is not None}

    def _adopt(self) -> bool:
        """GPUs recorded claims hold become DRA's; True once none waits (the ledger's lock was free)."""
        if self._adopting and self._ledger.adopt_for_dra(self._adopting):
            self._adopting.clear()
        return not self._adopting

    def withdrawn(self, inventory: Inventory) -> frozenset[str]:
        """Device IDs (GPU and MIG UUIDs) the device plugin must not offer: DRA's GPUs, those arriving and those
        a recorded claim holds."""
        gone = self._served | set(self._arriving) | self._adopting
        return frozenset(uid for gpu in inventory.gpus if gpu.uuid in gone for uid in _device_ids(gpu))

    def settle(self, inventory: Inventory) -> frozenset[str]:
        """Before the device plugin's side is worked out: a leaving GPU no claim holds any more goes back to it. The
        GPUs that did (the MIG layout meant for the device plugin's GPUs now covers them)."""
        if self._front is None:
            return frozenset()
        self._adopt()
        leaving = self._served - self._wanted
        if not leaving:
            return frozenset()
        released = self._ledger.release_from_dra(leaving)  # only when no claim holds it or is being prepared on it
        for uuid in sorted(released):
            log.info("GPU returns to the device plugin gpu=%s; no claim holds it", uuid)
        return released

    def publish(
        self, inventory: Inventory, health: HealthState, cordoned: frozenset[str], stale: frozenset[str] = frozenset()
    ) -> None:
        """Hand DRA's devices, their health and taints to the front end (after ``settle``). The devices of ``stale``
        GPUs (their inventory could not be read again: after a MIG change it may name devices that are gone) are
        neither offered nor prepared until a read succeeds, as the device plugin withdraws them."""
        if self._front is None:
            return
        from agent.core.dra.pool import dra_pool
        from agent.core.dra.taints import DeviceTaint, device_taints, rfc3339

        recorded = self._ledger.recorded()
        served = frozenset(self._served)
        pool = dra_pool(
            inventory,
            served=served,
            dynamic_mig=self._named_dynamic(inventory, served),
            numa_nodes=self._numa_nodes,  # read with the roots, the first time a GPU is served
            shared=self._shared_gpus(inventory),
            default_share=self._default_share,
            pcie_roots=self._roots(inventory),
            offered_gpus=frozenset(g for g in self._wanted if g not in stale),
            claimed_placements={g.uuid: recorded.claimed_placements(g.uuid) for g in inventory.gpus},
            claimed_migs=recorded.claimed_migs(),
            share_mode=self._share_mode,
        )
        devices, offered = pool.devices, pool.offered
        self._unclaimed = pool.unclaimed  # a claim allocated a placement one covers could never be prepared
        self._taints = device_taints(devices, health, now=self._now(), previous=self._taints, driver=self._driver)
        unhealthy = {name: ", ".join(t.key for t in taints) for name, taints in self._taints.items()}
        for device in devices:
            if device.uuid in cordoned or device.gpu_uuid in cordoned:  # new claims avoid it; running pods keep it
                unhealthy.setdefault(device.name, "cordoned by the operator")
                earlier = next((t for t in self._cordon_taints.get(device.name, ()) if t.key == CORDON_TAINT), None)
                taint = earlier or DeviceTaint(key=CORDON_TAINT, time_added=rfc3339(self._now()))
                self._taints[device.name] = (*self._taints.get(device.name, ()), taint)
        self._cordon_taints = {n: t for n, t in self._taints.items() if any(x.key == CORDON_TAINT for x in t)}
        for device in devices:
            if device.gpu_uuid in stale:
                unhealthy.setdefault(device.name, "its GPU could not be read again; withdrawn until a read succeeds")
        for name, uuid in self._vanished(inventory).items():  # the claim's container lost its device
            unhealthy[name] = f"the MIG device made for its claim ({uuid}) is gone: a GPU reset destroys MIG devices"
        first_answers_due = any(not w.answered for w in self._arriving.values())
        self._front.update(
            devices, unhealthy, self._taints, published=offered, counters=pool.counters, slices=not first_answers_due
        )

    def on_swept(self, destroyed: int, waiting: tuple[str, ...], now: float) -> bool:
        """The sweep of unclaimed GPU instances is back; True when it destroyed some (the node changed)."""
        if waiting and waiting != self._sweep.why:
            log.info("MIG devices no claim made wait to be destroyed waiting_for=%r", "; ".join(waiting))
        self._sweep = _Waiting(next_check=now + CHECK_INTERVAL, why=waiting, answered=True)
        return destroyed > 0

    def made_mig_changed(self) -> bool:
        """True once each time the MIG devices made for claims, or a GPU's MIG mode, changed since last asked."""
        made = frozenset(self._front.made_mig_devices().values()) if self._front is not None else frozenset()
        modes = self._front.mig_mode_changes() if self._front is not None else 0
        changed = made != self._last_made or modes != self._last_modes
        self._last_made, self._last_modes = made, modes
        return changed

    def _vanished(self, inventory: Inventory) -> dict[str, str]:
        """Prepared dynamic-MIG devices whose MIG device is gone (a GPU reset). A device is judged by a read of the
        node made after it was made: one the inventory shows, or any inventory read after the one current when the
        device was first known (the loop reads the node again after every claim's MIG device is made, so a reset
        right after its making is caught too). One made and not read again yet is not gone."""
        made = self._front.made_mig_devices() if self._front is not None else {}
        made_uuids = set(made.values())
        present = {mig.uuid for gpu in inventory.gpus for mig in gpu.mig_devices}
        for uuid in made_uuids - self._first_read.keys():  # known from the checkpoint alone (an agent restart)
            self._first_read[uuid] = inventory  # (this inventory may have been read before the device was made)
        read_since = {uuid for uuid in made_uuids if self._first_read[uuid] is not inventory}
        self._seen_made = (self._seen_made | (made_uuids & present) | read_since) & made_uuids
        self._first_read = {uuid: first for uuid, first in self._first_read.items() if uuid in made_uuids}
        self._published = inventory
        return {name: uuid for name, uuid in made.items() if uuid in self._seen_made and uuid not in present}

    def next_deadline(self) -> float | None:
        due = [w.next_check for w in self._arriving.values() if not w.in_flight]
        if self._served - self._wanted or self._adopting:
            due.append(self._leaving_check)
        if self._unclaimed and not self._sweep.in_flight:
            due.append(self._sweep.next_check)
        return min(due, default=None)

    def tick(self, now: float, inventory: Inventory) -> bool:
        """Ask about GPUs that wait to move; True when a leaving GPU is free (publish again)."""
        due = {uuid: w for uuid, w in self._arriving.items() if not w.in_flight and now >= w.next_check}
        if due:  # one job for all of them: their answers arrive together, so DRA's pool changes once
            by_uuid = {g.uuid: g for g in inventory.gpus}
            scopes = {
                uuid: frozenset(_device_ids(by_uuid[uuid])) if uuid in by_uuid else frozenset({uuid}) for uuid in due
            }
            for waiting in due.values():
                waiting.in_flight = True
            if submit(self._pool, self._post, "dra", ",".join(sorted(due)), self._check, scopes) is None:
                for waiting in due.values():
                    waiting.in_flight = False
        if self._unclaimed and not self._sweep.in_flight and now >= self._sweep.next_check:
            self._sweep.in_flight = True
            if submit(self._pool, self._post, "dra", "unclaimed", self._destroy_unclaimed, self._unclaimed) is None:
                self._sweep.in_flight = False
        leaving = self._served - self._wanted
        if (leaving or self._adopting) and now >= self._leaving_check:
            self._leaving_check = now + CHECK_INTERVAL
            return bool(leaving - self._held_gpus(inventory)) or bool(self._adopting and self._adopt())
        return False

    def on_checked(self, event: DraHandoverChecked, now: float) -> bool:
        """True when some GPU moved to DRA (publish both sides again)."""
        moved = False
        for uuid, busy in event.results:
            waiting = self._arriving.get(uuid)
            if waiting is None:
                continue
            if busy:
                if busy != waiting.why:
                    log.info("GPU waits to move to DRA gpu=%s waiting_for=%r", uuid, "; ".join(busy))
                waiting.in_flight, waiting.why, waiting.next_check = False, busy, now + CHECK_INTERVAL
                waiting.answered = True
                continue
            del self._arriving[uuid]  # the ledger made it DRA's when it found it free (``_check``)
            moved = True
            log.info("GPU moved to DRA gpu=%s", uuid)
        return moved

    def on_event(self, event: object, now: float) -> News:
        """The DRA front end's news (claims prepared or unprepared, a hand-over answer, MIG devices no claim made
        swept, a registration verdict, slices published or not)."""
        match event:
            case DraClaimsChanged():  # a claim's MPS daemon may be new or gone; a MIG device made or destroyed for it
                if self.made_mig_changed():  # the node is read again now: that read comes after the making
                    for uuid in self._last_made - self._first_read.keys():
                        self._first_read[uuid] = self._published
                    return News(reread="a DRA claim's MIG device or its GPU's MIG mode changed", mps=True)
                return News(status=True, mps=True)
            case DraUnclaimedSwept(destroyed=destroyed, waiting=waiting):
                if self.on_swept(destroyed, waiting, now):
                    return News(reread="MIG devices no claim made were destroyed")
            case DraHandoverChecked():
                if self.on_checked(event, now):
                    return PUBLISH
            case DraRegistration(registered=registered, error=error):
                self.registered = registered
                self.error = None if registered else f"the kubelet refused the driver: {error}"
            case SlicesPublished():
                self.on_slices(True)
            case SlicesFailed(error=error):
                self.on_slices(False, error)
        return STATUS

    def on_crashed(self, key: str, now: float) -> None:
        if key == "unclaimed":
            self._sweep = _Waiting(next_check=now + CHECK_INTERVAL, why=self._sweep.why)
            return
        for uuid in key.split(","):
            waiting = self._arriving.get(uuid)
            if waiting is not None:
                waiting.in_flight, waiting.next_check = False, now + CHECK_INTERVAL

    def on_slices(self, published: bool, error: str = "") -> None:
        """The publisher's news: an outage (RBAC refusing, API away) is said in the status until it ends."""
        if published:
            if self.error and self.error.startswith("cannot publish"):
                self.error = None
        else:
            self.error = f"cannot publish ResourceSlices: {error}"

    def waiting_for(self) -> dict[str, tuple[str, ...]]:
        waiting = {uuid: w.why for uuid, w in self._arriving.items() if w.why}
        if self._unclaimed and self._sweep.why:
            waiting["unclaimed-mig"] = self._sweep.why  # MIG devices no claim made, held by something
        return waiting

    def status(self, driver: object = None) -> dict[str, object] | None:
        """``driver``: where the driver holds containers to their memory (``agent.core.memlimits.DriverReport``, from
        the memory-limits room through the loop; None: no such room), for the shares' enforcement."""
        if self._front is None and self.error is None:
            return None
        return {
            "driver": self._driver,
            "registered": self.registered,
            "served": sorted(self._served),
            "waiting": {uuid: list(w.why) for uuid, w in self._arriving.items()},
            "leaving": sorted(self._served - self._wanted),
            "error": self.error,
            "claims": self._front.claims(driver) if self._front is not None else [],
            "unavailable": self._unavailable(),
        }

    def prepared_claim_devices(self) -> tuple[object, ...]:
        """The devices of the claims prepared through DRA, for the telemetry's per-claim series (any thread)."""
        return self._front.claim_devices() if self._front is not None else ()

    def _unavailable(self) -> list[str]:
        """What the cluster does not offer of what the config asks (the API server dropped a gate's fields)."""
        from agent.core.dra.slices import DROPPED_GATES

        return [DROPPED_GATES[gate] for gate in (self._front.dropped_gates() if self._front is not None else ())]

    def shutdown(self, wait: bool = True) -> None:  # the hand-over checks never need waiting for
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._front is not None:
            self._front.stop()

    # ----- the work -------------------------------------------------------------------------------

    def _held_gpus(self, inventory: Inventory) -> set[str]:
        """GPUs some recorded claim holds a device of."""
        if self._front is None:
            return set()
        names = self._front.prepared_devices()
        if not names:
            return set()
        from agent.core.dra.devices import gpu_minor_of

        # by the name's GPU minor: a claim's device may be a MIG device that exists, or a dynamic-MIG partition whose
        # MIG device is being made (not in the inventory yet) or whose GPU has left dynamic MIG since
        minors = {gpu_minor_of(name) for name in names}
        return {g.uuid for g in inventory.gpus if g.minor_number in minors}

    def _check(self, scopes: dict[str, frozenset[str]]) -> None:
        """Worker: each GPU whose devices nothing holds (a device-plugin pod, a process, a claim) becomes DRA's,
        in the ledger's critical section; the others wait, with who holds them."""
        results = tuple((uuid, tuple(self._ledger.take_for_dra(uuid, Drain(ids, ids)))) for uuid, ids in scopes.items())
        self._post(DraHandoverChecked(results))

    def _destroy_unclaimed(self, unclaimed: tuple[Unclaimed, ...]) -> None:
        """Worker: destroy each GPU instance no claim made, in the ledger's critical section, once nothing holds it
        (a pod, a process, a claim that recorded it meanwhile)."""
        from agent.gpu.mig import MigOperationError, destroy_partition

        destroyed, waiting = 0, []
        for instance in unclaimed:
            drain = Drain(frozenset(instance.mig_uuids), frozenset(instance.mig_uuids))
            with self._ledger.acting(drain) as busy:
                recorded = self._ledger.recorded()
                placement = (instance.profile_id, instance.start)
                if placement in recorded.claimed_placements(instance.gpu_uuid) or (
                    set(instance.mig_uuids) & recorded.claimed_migs()
                ):
                    continue  # a claim is being prepared there now: it is that claim's
                if busy:
                    waiting.append(f"{instance}: {'; '.join(busy)}")
                    continue
                try:
                    destroy_partition(instance.gpu_uuid, instance.gi_id)
                except MigOperationError as error:
                    waiting.append(f"{instance}: {error}")
                    continue
            destroyed += 1
            log.warning(
                "MIG device no claim made destroyed on a dynamic-MIG GPU %s mig=%s; dynamic MIG makes every MIG "
                "device of this GPU per claim (one made by hand, or left by a claim whose record was lost)",
                instance, ",".join(instance.mig_uuids),
            )  # fmt: skip
        self._post(DraUnclaimedSwept(destroyed, tuple(waiting)))


def _device_ids(gpu: Gpu) -> Iterable[str]:
    yield gpu.uuid
    for mig in gpu.mig_devices:
        yield mig.uuid
