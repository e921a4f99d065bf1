"""The DRA front end as the agent runs it: the DRA service, its registration with the kubelet, the slices.

The reconcile loop owns the decisions (which GPUs DRA serves, their health and taints) and hands them over with
``update``; this only starts, feeds and stops the three shell pieces in the right order — the service before the
registration that advertises it, the devices before either, so the first Prepare the kubelet sends finds them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from agent.core.dra.devices import DraDevice
from agent.core.dra.taints import DeviceTaint
from agent.dra.types import DraClaimsChanged, DraRegistration, DraSettings

if TYPE_CHECKING:
    from agent.ledger import DeviceLedger

log = logging.getLogger(__name__)


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
        self._mps_states: dict[str, tuple[str, str | None]] = {}
        self._mps_root = settings.mps_root

    def update(
        self,
        devices: Sequence[DraDevice],
        unhealthy: Mapping[str, str],
        taints: Mapping[str, Sequence[DeviceTaint]],
        *,
        published: Sequence[DraDevice] | None = None,
        slices: bool = True,
    ) -> None:
        """The devices DRA serves (prepared claims included) and their health; ``published`` (default: all of
        them) are the ones offered in the slices — a GPU on its way to the device plugin is served, not offered. The
        counter sets of the offered devices' GPUs come from every device served: a dynamic-MIG GPU whose full device
        is not offered (a MIG device no claim made covers part of it) still has its set."""
        first = not self._registered_once
        self._service.update({d.name: d for d in devices}, dict(unhealthy))
        offered = devices if published is None else published
        names = {d.name for d in offered}
        if slices:  # (not while the first answers about arriving GPUs are due: no pool published half-way)
            from agent.core.dra.partitions import counter_sets

            gpus = {d.gpu_uuid for d in offered}
            counters = counter_sets(d for d in devices if d.gpu_uuid in gpus)
            self._publisher.publish(tuple(offered), {n: t for n, t in taints.items() if n in names}, counters)
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

    def mps_records(self) -> dict[str, Any]:
        return self._service.mps_records() if self._service is not None else {}

    def mps_changed(self, states: Mapping[str, tuple[str, str | None]], root: str) -> None:
        """The loop's word on the MPS daemons DRA claims use: key -> (state, last error), and the MPS root."""
        with self._mps_cond:
            self._mps_states, self._mps_root = dict(states), root
            self._mps_cond.notify_all()

    def _wait_mps(self, key: str, timeout: float) -> str | None:
        """Worker: None once the daemon ``key`` is ready; why not when it failed or did not answer in time."""

        def settled() -> bool:
            state, error = self._mps_states.get(key, ("pending", None))
            return state == "ready" or (state == "down" and error is not None)

        with self._mps_cond:
            if not self._mps_cond.wait_for(settled, timeout):
                return f"it did not answer within {timeout:.0f} s"
            state, error = self._mps_states[key]
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
        return self._service.claims() if self._service is not None else []

    def register_again(self) -> None:
        if self._registrar is not None:
            self._registrar.restart()

    def stop(self) -> None:
        """The kubelet hears the driver go (registration socket removed); slices stay for the next agent."""
        for piece in (self._registrar, self._service, self._publisher):
            if piece is not None:
                piece.stop()

    def start(self) -> None:
        """The service (its checkpoint read: which GPUs claims hold) and the slice publisher; the kubelet is
        told of the driver with the first ``update``."""
        from agent.dra.cdi_store import CdiStore
        from agent.dra.checkpoint_store import CheckpointStore, checkpoint_path
        from agent.dra.claims_api import KubernetesClaimReader
        from agent.dra.names import dra_socket, registration_socket
        from agent.dra.publisher import SlicePublisher
        from agent.dra.registration import DRA_SERVICES, HEALTH_SERVICE, DraRegistrar
        from agent.dra.service import DraService
        from agent.dra.timeslices import NvidiaSmiTimeslices

        s = self.settings
        endpoint = dra_socket(s.plugins_dir, s.driver, s.pod_uid)
        endpoint.parent.mkdir(mode=0o750, parents=True, exist_ok=True)
        self._service = DraService(
            endpoint,
            driver=s.driver,
            pool=s.node_name,
            read_claim=KubernetesClaimReader(self._api_client),
            cdi=CdiStore(s.cdi_root),
            checkpoints=CheckpointStore(checkpoint_path(endpoint.parent)),
            latency=s.latency,
            node_cdi_kind=s.cdi_kind,
            timeslices=NvidiaSmiTimeslices(s.nvidia_smi),
            claims_changed=lambda: self._post(DraClaimsChanged()),
            mps_ready=self._wait_mps,
            mps_root=lambda: self._mps_root,
            ledger=self._ledger,
        )
        if self._ledger is not None:
            self._ledger.attach_claims(self._service.checkpoint, s.node_name)
        self._service.start()
        if s.pod_uid is None:  # one instance per node: a spec no recorded claim owns is a leftover (a crash)
            swept = self._service.sweep_stale_specs()
            if swept:
                log.info("removed CDI specs no prepared claim owns claims=%s", ",".join(swept))
        self._publisher = SlicePublisher(self._api_client, s.node_name, s.driver, post=self._post)
        self._publisher.start()
        self._registrar = DraRegistrar(
            registration_socket(s.registry_dir, s.driver, s.pod_uid),
            s.driver,
            endpoint,
            (*DRA_SERVICES, HEALTH_SERVICE),
            on_status=lambda registered, error: self._post(DraRegistration(registered, error)),
        )
        log.info("DRA driver starting driver=%s node=%s socket=%s", s.driver, s.node_name, endpoint)
