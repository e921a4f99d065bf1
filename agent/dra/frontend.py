"""The DRA front end as the agent runs it: the DRA service, its registration with the kubelet, the slices.

The reconcile loop owns the decisions (which GPUs DRA serves, their health and taints) and hands them over with
``update``; this only starts, feeds and stops the three shell pieces in the right order — the service before the
registration that advertises it, the devices before either, so the first Prepare the kubelet sends finds them.

One instance works the driver's checkpoint and CDI specs at a time: it holds the lock of the driver's plugin
directory (``<plugins>/<driver>/.tessera/agent.lock``, ``agent.plugin.lock``) from its start to its stop. During
a rolling update (sockets named by ``POD_UID``) the new instance serves at once, but its claims wait on its worker
until the old instance has let go; only then does it read the checkpoint again, roll back a Prepare the old one
left unfinished and remove the CDI specs no recorded claim owns — nothing the old one can still be writing.

Stopping is prompt: a Prepare waiting for its MPS daemon (a state only the stopped reconcile loop would deliver)
and a wait for the lock end at once; the claim is rolled back (``ClaimWorker``), and the kubelet retries it with
the next instance.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.core.dra.devices import DraDevice
from agent.core.dra.taints import DeviceTaint
from agent.dra.types import DraClaimsChanged, DraRegistration, DraSettings

if TYPE_CHECKING:
    from agent.ledger import DeviceLedger

log = logging.getLogger(__name__)

LOCK_POLL_SECONDS = 0.2  # how soon a successor notices its predecessor let go of the checkpoint (no event says it)


class DraFrontEnd:
    def __init__(
        self, settings: DraSettings, api_client: Any, post: Callable[[object], None], ledger: DeviceLedger | None = None
    ) -> None:
        self.settings = settings
        self._ledger = ledger  # the claim worker's Prepare reserves, and its time-slice changes act, in its section
        self._api_client = api_client
        self._post = post
        self._service: Any = None
        self._registrar: Any = None
        self._publisher: Any = None
        self._registered_once = False
        self._mps_cond = threading.Condition()
        self._mps_states: dict[str, tuple[str, str | None, object]] = {}  # key -> (state, error, limits held)
        self._mps_root = settings.mps_root
        self._stopping = threading.Event()  # set by stop(): every wait of a claim worker ends
        self._checkpoint_lock: Any = None  # agent.plugin.lock.DirLock of the driver's plugin directory

    def update(
        self,
        devices: Sequence[DraDevice],
        unhealthy: Mapping[str, str],
        taints: Mapping[str, Sequence[DeviceTaint]],
        *,
        published: Sequence[DraDevice] | None = None,
        counters: Mapping[str, Mapping[str, int]] | None = None,
        slices: bool = True,
    ) -> None:
        """The devices DRA serves (prepared claims included) and their health; ``published`` (default: all of
        them) are the ones offered in the slices — a GPU on its way to the device plugin is served, not offered. The
        counter sets of the offered devices' GPUs come from every device served: a dynamic-MIG GPU whose full device
        is not offered (a MIG device no claim made covers part of it) still has its set; ``counters`` gives them
        (``agent.core.dra.pool``), else they are worked out here the same way."""
        first = not self._registered_once
        self._service.update({d.name: d for d in devices}, dict(unhealthy))
        offered = devices if published is None else published
        names = {d.name for d in offered}
        if slices:  # (not while the first answers about arriving GPUs are due: no pool published half-way)
            from agent.core.dra.partitions import counter_sets

            if counters is None:
                gpus = {d.gpu_uuid for d in offered}
                counters = counter_sets(d for d in devices if d.gpu_uuid in gpus)
            sets = {name: dict(values) for name, values in counters.items()}
            self._publisher.publish(tuple(offered), {n: t for n, t in taints.items() if n in names}, sets)
        if first:  # the kubelet learns of the driver once its service knows the devices
            self._registrar.start()
            self._registered_once = True

    def prepared_devices(self) -> set[str]:
        """Device names some recorded claim holds (completed or being prepared)."""
        if self._service is None:
            return set()
        return {name for names in self._service.prepared().values() for name in names}

    def made_mig_devices(self) -> dict[str, str]:
        return self._service.made_mig_devices() if self._service is not None else {}

    def mig_mode_changes(self) -> int:
        return self._service.mig_mode_changes() if self._service is not None else 0

    def mps_records(self) -> dict[str, Any]:
        return self._service.mps_records() if self._service is not None else {}

    def mps_changed(self, states: Mapping[str, tuple[str, str | None, object]], root: str) -> None:
        """The loop's word on the MPS daemons DRA claims use: key -> (state, last error, the limits it holds), and
        the MPS root."""
        with self._mps_cond:
            self._mps_states, self._mps_root = dict(states), root
            self._mps_cond.notify_all()

    def _wait_mps(self, key: str, timeout: float, limits: object = None) -> str | None:
        """Worker: None once the daemon ``key`` is ready (holding ``limits``, when given: a share's daemon whose
        server defaults change with the shares); why not when it failed or did not answer in time."""

        def settled() -> bool:
            state, error, held = self._mps_states.get(key, ("pending", None, None))
            ready = state == "ready" and (limits is None or held == limits)
            return ready or (state == "down" and error is not None) or self._stopping.is_set()

        with self._mps_cond:
            if not self._mps_cond.wait_for(settled, timeout):
                return f"it did not answer within {timeout:.0f} s"
            if self._stopping.is_set():  # the loop that would say "ready" has stopped: do not wait for it
                return "the agent is stopping"
            state, error, _ = self._mps_states[key]
        return None if state == "ready" else error

    def dropped_gates(self) -> tuple[str, ...]:
        """Feature gates the API server has off, whose fields it dropped from the slices."""
        return self._publisher.dropped if self._publisher is not None else ()

    def claim_devices(self) -> tuple[Any, ...]:
        """The devices of the prepared claims, for telemetry (``agent.telemetry.dra_claims.ClaimDevice``)."""
        if self._service is None:
            return ()
        from agent.telemetry.dra_claims import claim_devices

        return claim_devices(self._service.checkpoint())

    def claims(self) -> list[dict[str, object]]:
        with self._mps_cond:
            held = {key: limits for key, (_, _, limits) in self._mps_states.items() if limits is not None}
        return self._service.claims(held) if self._service is not None else []

    def register_again(self) -> None:
        if self._registrar is not None:
            self._registrar.restart()

    def stop(self) -> None:
        """The kubelet hears the driver go (registration socket removed); slices stay for the next agent.

        The claim worker's waits end first (its MPS daemon, the checkpoint's lock), so the service's stop, which
        waits for the claim being worked on, is not held up by a wait only the stopped loop could end."""
        with self._mps_cond:
            self._stopping.set()
            self._mps_cond.notify_all()
        for piece in (self._registrar, self._service, self._publisher):
            if piece is not None:
                piece.stop()
        if self._checkpoint_lock is not None:
            self._checkpoint_lock.release()  # after the worker's last write: the next instance takes over

    def start(self) -> None:
        """The service (its checkpoint read: which GPUs claims hold) and the slice publisher; the kubelet is
        told of the driver with the first ``update``."""
        from agent.dra.cdi_store import CdiStore
        from agent.dra.checkpoint_store import CheckpointStore, checkpoint_path
        from agent.dra.claims_api import KubernetesClaimReader, KubernetesClaimStatus
        from agent.dra.devnodes import default_device_nodes
        from agent.dra.names import dra_socket, registration_socket
        from agent.dra.publisher import SlicePublisher
        from agent.dra.registration import DRA_SERVICES, HEALTH_SERVICES, DraRegistrar
        from agent.dra.service import DraService
        from agent.dra.timeslices import NvidiaSmiTimeslices
        from agent.gpu.driver_root import CommonEdits

        s = self.settings
        endpoint = dra_socket(s.plugins_dir, s.driver, s.pod_uid)
        endpoint.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
        owner = self._lock_checkpoint(endpoint.parent)  # before the checkpoint is read: then it is the last word
        store = CheckpointStore(checkpoint_path(endpoint.parent))
        self._service = DraService(
            endpoint,
            driver=s.driver,
            pool=s.node_name,
            read_claim=KubernetesClaimReader(self._api_client),
            cdi=CdiStore(s.cdi_root),
            checkpoints=store,
            latency=s.latency,
            node_cdi_kind=s.cdi_kind,
            node_wide_cdi=s.node_wide_cdi,
            cdi_common_edits=None if s.node_wide_cdi else CommonEdits(s.driver_root),
            device_nodes=default_device_nodes(s.node_wide_cdi, s.driver_root.proc, str(s.driver_root.host_dev_root)),
            timeslices=NvidiaSmiTimeslices(s.nvidia_smi),
            claims_changed=lambda: self._post(DraClaimsChanged()),
            mps_ready=self._wait_mps,
            mps_root=lambda: self._mps_root,
            ledger=self._ledger,
            claim_status=KubernetesClaimStatus(self._api_client, s.driver, s.node_name),
        )
        if self._ledger is not None:
            self._ledger.attach_claims(self._service.checkpoint, s.node_name)
        self._service.start()
        if owner:  # no other instance works the checkpoint: what it holds unfinished, or no claim owns, is left over
            self._swept(self._service.sweep_stale_specs())
        else:  # the claims wait on the worker until the other instance lets go
            taking_over = self._service.take_over(self._wait_for_checkpoint, store.load)
            taking_over.add_done_callback(self._taken_over)
        self._publisher = SlicePublisher(self._api_client, s.node_name, s.driver, post=self._post)
        self._publisher.start()
        self._registrar = DraRegistrar(
            registration_socket(s.registry_dir, s.driver, s.pod_uid),
            s.driver,
            endpoint,
            (*DRA_SERVICES, *HEALTH_SERVICES),
            on_status=lambda registered, error: self._post(DraRegistration(registered, error)),
        )
        log.info("DRA driver starting driver=%s node=%s socket=%s", s.driver, s.node_name, endpoint)

    def _lock_checkpoint(self, driver_dir: Path) -> bool:
        """Take the lock of the driver's plugin directory if it is free; False if another instance holds it."""
        from agent.plugin.lock import DirLock, DirLocked

        self._checkpoint_lock = DirLock(
            driver_dir,
            what=f"the DRA checkpoint and CDI specs of {self.settings.driver}",
            does="works",
            advice="this instance's claims wait until it lets go",
        )
        try:
            self._checkpoint_lock.acquire()
        except DirLocked as error:
            log.warning("DRA claims wait for the previous instance to stop error=%r", str(error))
            return False
        return True

    def _wait_for_checkpoint(self) -> bool:
        """Worker: True once the lock is this instance's, False when the agent stops first."""
        from agent.plugin.lock import LockWaitStopped

        try:
            self._checkpoint_lock.acquire(wait=math.inf, stop=self._stopping, poll=LOCK_POLL_SECONDS)
        except LockWaitStopped as error:
            log.info("DRA checkpoint not taken over reason=%r", str(error))
            return False
        except OSError as error:  # the lock file cannot be used any more: never work a checkpoint not ours
            log.error("DRA checkpoint cannot be taken over; claims are refused until the agent restarts error=%r",
                      str(error))  # fmt: skip
            return False
        log.info("DRA checkpoint taken over from the previous instance lock=%s", self._checkpoint_lock.path)
        return True

    def _taken_over(self, done: Future[list[str] | None]) -> None:
        if done.cancelled():
            return
        if (error := done.exception()) is not None:
            log.error("DRA checkpoint taken over, its leftovers not swept error=%r", f"{type(error).__name__}: {error}")
            return
        self._swept(done.result())

    def _swept(self, swept: list[str] | None) -> None:
        """Worker or start: the leftovers of an earlier instance are gone (``swept``: their CDI specs' claims)."""
        if swept is None:
            return  # stopped before it took over
        if swept:
            log.info("removed CDI specs no prepared claim owns claims=%s", ",".join(swept))
        self._post(DraClaimsChanged())  # the checkpoint may differ from the one read at start
