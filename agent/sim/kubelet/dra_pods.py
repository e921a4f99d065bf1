"""The DRA kubelet emulator's pod side: ``PrepareResources`` before a sandbox, ``GetResources`` for each container,
``UnprepareResources`` when a pod has stopped (facts/dra.md A2, ``cm/dra/manager.go``). Mixed into
``agent.sim.kubelet.dra.DraKubeletEmulator``, whose state it uses.

Prepare, in the kubelet's order: GET every claim (resource.k8s.io/v1), check the pod is in ``status.reservedFor``,
take the drivers from the allocation results and look each up (all claims validated before anything changes), add
the pod to each claim's cache entry, skip claims prepared already, then ONE NodePrepareResources per driver with
this pod's remaining claims (45 s, through the service chosen at registration). An RPC error, an answer for a UID
not asked for, a non-empty per-claim error or missing entries abort with the kubelet's text; only when every batch
succeeded are the claims marked prepared. Each driver's answer is added to the claim's devices as it arrives: up to
1.36 appended to what the claim holds (``ClaimInfo.addDevice``; so a claim prepared again — after a kubelet restart,
or after a batch another driver failed — holds its devices twice, kubernetes#140471), from 1.37 in place of it
(``resetDevices`` first, kubernetes#140274). Unprepare: claims other pods still reference only lose this pod; the
others go to one NodeUnprepareResources per driver with the same rules, and leave the cache on success.
"""

from __future__ import annotations

import copy
import logging
import time
from typing import TYPE_CHECKING, Any

import grpc

from agent.sim.kubelet.common import CONN_CLOSING, go_rpc_error
from agent.sim.kubelet.dra_common import (
    API_TIMEOUT,
    PREPARE,
    UNPREPARE,
    DraCall,
    DraPod,
    KubeletError,
    PreparedDevice,
    api_error_text,
)

if TYPE_CHECKING:
    from agent.sim.kubelet.dra import DraKubeletEmulator
    from agent.sim.kubelet.dra_plugins import _Plugin

log = logging.getLogger("agent.sim.kubelet.dra")

GROUP, VERSION, PLURAL = "resource.k8s.io", "v1", "resourceclaims"
_RESERVE_ATTEMPTS = 5


class _ClaimInfo:
    """``ClaimInfo``: what the kubelet's checkpoint keeps for a claim, plus the in-memory ``prepared`` flag."""

    def __init__(self, uid: str, name: str, namespace: str, drivers: list[str]) -> None:
        self.uid = uid
        self.name = name
        self.namespace = namespace
        self.pod_uids: set[str] = set()
        self.drivers: dict[str, list[PreparedDevice]] = {d: [] for d in drivers}  # DriverState
        self.prepared = False


class DraPodsMixin:
    """Pods: ``run_pod`` / ``retry_pod`` / ``stop_pod`` (see the module docstring)."""

    # ------------------------------------------------------------------------------------------ prepare

    def _prepare_resources(self: DraKubeletEmulator, pod: DraPod) -> None:
        infos: list[tuple[dict, list[str], dict[str, _Plugin]] | None] = []
        for _pod_claim, claim_name in pod.claims:
            if claim_name is None:
                infos.append(None)  # no claim generated: nothing to do
                continue
            claim = self._get_claim(pod.namespace, claim_name)
            meta = claim.get("metadata") or {}
            status = claim.get("status") or {}
            if not _reserved_for(claim, pod.uid):
                if self.reserve and status.get("allocation"):
                    claim = self._reserve(claim, pod)
                else:
                    raise KubeletError(
                        f"pod {pod.name} ({pod.uid}) is not allowed to use ResourceClaim {claim_name} "
                        f"({meta.get('uid', '')})"
                    )
            allocation = (claim.get("status") or {}).get("allocation")
            if not allocation:
                raise KubeletError(f"ResourceClaim {meta.get('name', claim_name)}: not allocated")
            drivers: list[str] = []
            for result in (allocation.get("devices") or {}).get("results") or []:
                driver = result.get("driver", "")
                if driver not in drivers:
                    drivers.append(driver)
            plugins: dict[str, _Plugin] = {}
            for driver in drivers:
                if not driver:
                    raise KubeletError("DRA driver name is empty")
                plugin = self._get_plugin(driver)
                if plugin is None:
                    raise KubeletError(f"DRA driver {driver} is not registered")
                plugins[driver] = plugin
            infos.append((claim, drivers, plugins))

        batches: dict[int, tuple[_Plugin, list[_ClaimInfo]]] = {}
        to_prepare: dict[str, _ClaimInfo] = {}
        with self._cond:
            for entry in infos:
                if entry is None:
                    continue
                claim, drivers, plugins = entry
                meta = claim["metadata"]
                key = (meta.get("namespace") or pod.namespace, meta["name"])
                info = self._claim_infos.get(key)
                if info is None:
                    info = _ClaimInfo(meta["uid"], meta["name"], key[0], drivers)
                    self._claim_infos[key] = info
                elif info.uid != meta["uid"]:
                    raise KubeletError(
                        f"old ResourceClaim with same name {meta['name']} and different UID {info.uid} still exists "
                        "(previous pod force-deleted?!)"
                    )
                info.pod_uids.add(pod.uid)
                if info.prepared:
                    log.info("Resources already prepared pod=%s/%s claim=%s", pod.namespace, pod.name, info.name)
                    continue
                to_prepare[info.uid] = info
                for driver in drivers:
                    plugin = plugins[driver]
                    batches.setdefault(id(plugin), (plugin, []))[1].append(info)
            self._changed()

        for plugin, claims in batches.values():
            answers = self._call(PREPARE, plugin, claims, pod.uid)
            with self._cond:
                for info in claims:
                    if info.uid not in answers:
                        continue
                    if self.reprepare_appends:
                        info.drivers.setdefault(plugin.driver, []).extend(answers[info.uid])
                    else:
                        info.drivers[plugin.driver] = answers[info.uid]
                self._changed()

        with self._cond:
            for info in to_prepare.values():
                info.prepared = True
            self._changed()

    def _get_claim(self: DraKubeletEmulator, namespace: str, name: str) -> dict:
        try:
            claim = self._custom_api.get_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name, _request_timeout=API_TIMEOUT
            )
        except Exception as exc:  # ApiException, or the API server unreachable
            raise KubeletError(f"fetch ResourceClaim {name}: {api_error_text(exc)}") from None
        if not isinstance(claim, dict):
            raise KubeletError(f"fetch ResourceClaim {name}: the API server sent no object")
        return claim

    def _reserve(self: DraKubeletEmulator, claim: dict, pod: DraPod) -> dict:
        """What the scheduler does before binding: add the pod to ``status.reservedFor`` (PUT /status)."""
        name = claim["metadata"]["name"]
        namespace = claim["metadata"].get("namespace") or pod.namespace
        for _ in range(_RESERVE_ATTEMPTS):
            if _reserved_for(claim, pod.uid):
                return claim
            body = copy.deepcopy(claim)
            reserved = list((body.get("status") or {}).get("reservedFor") or [])
            reserved.append({"resource": "pods", "name": pod.name, "uid": pod.uid})
            body.setdefault("status", {})["reservedFor"] = reserved
            try:
                return self._custom_api.replace_namespaced_custom_object_status(
                    GROUP, VERSION, namespace, PLURAL, name, body, _request_timeout=API_TIMEOUT
                )
            except self._api_exception as exc:
                if exc.status != 409:
                    raise KubeletError(f"reserve ResourceClaim {name} for the pod: {api_error_text(exc)}") from None
            except Exception as exc:
                raise KubeletError(f"reserve ResourceClaim {name} for the pod: {api_error_text(exc)}") from None
            claim = self._get_claim(namespace, name)
        raise KubeletError(f"reserve ResourceClaim {name} for the pod: conflict after {_RESERVE_ATTEMPTS} attempts")

    def _release(self: DraKubeletEmulator, pod: DraPod) -> None:
        """What the resourceclaim controller does once the pod is gone: drop it from ``reservedFor`` (best effort)."""
        for _pod_claim, name in pod.claims:
            if name is None:
                continue
            for _ in range(_RESERVE_ATTEMPTS):
                try:
                    claim = self._custom_api.get_namespaced_custom_object(
                        GROUP, VERSION, pod.namespace, PLURAL, name, _request_timeout=API_TIMEOUT
                    )
                    reserved = (claim.get("status") or {}).get("reservedFor") or []
                    kept = [r for r in reserved if r.get("uid") != pod.uid]
                    if len(kept) == len(reserved):
                        break
                    claim["status"]["reservedFor"] = kept
                    if not kept:
                        del claim["status"]["reservedFor"]
                    self._custom_api.replace_namespaced_custom_object_status(
                        GROUP, VERSION, pod.namespace, PLURAL, name, claim, _request_timeout=API_TIMEOUT
                    )
                    break
                except self._api_exception as exc:
                    if exc.status != 409:
                        break
                except Exception:
                    break

    # ------------------------------------------------------------------------------------------ one RPC

    def _call(
        self: DraKubeletEmulator, method: str, plugin: _Plugin, claims: list[_ClaimInfo], pod_uid: str
    ) -> dict[str, list[PreparedDevice]]:
        """One batch RPC and the kubelet's rules for its answer; the devices of each answered claim (Prepare)."""
        stub, messages = plugin.dra_stub()
        wire_claims = [messages.Claim(namespace=c.namespace, uid=c.uid, name=c.name) for c in claims]
        record: dict[str, Any] = {
            "method": method,
            "driver": plugin.driver,
            "endpoint": plugin.endpoint,
            "service": plugin.service,
            "pod_uid": pod_uid,
            "claim_uids": tuple(c.uid for c in claims),
            "claim_names": tuple(c.name for c in claims),
        }
        try:
            if method == PREPARE:
                request = messages.NodePrepareResourcesRequest(claims=wire_claims)
                response = stub.NodePrepareResources(request, timeout=self.call_timeout)
            else:
                request = messages.NodeUnprepareResourcesRequest(claims=wire_claims)
                response = stub.NodeUnprepareResources(request, timeout=self.call_timeout)
        except grpc.RpcError as exc:
            outcome = f"{method}: {go_rpc_error(exc)}"
            self._record_call(record, error=go_rpc_error(exc), outcome=outcome)
            raise KubeletError(outcome) from None
        except ValueError:  # the channel was closed under us (deregistration, stop)
            outcome = f"{method}: {CONN_CLOSING}"
            self._record_call(record, error=CONN_CLOSING, outcome=outcome)
            raise KubeletError(outcome) from None

        answered = tuple(response.claims.keys())
        errors = {uid: response.claims[uid].error for uid in answered if response.claims[uid].error}
        record.update(answered=answered, errors=errors)
        requested = {c.uid: c for c in claims}
        outcome = ""
        for uid in answered:
            if uid not in requested:
                outcome = f"{method} returned result for unknown claim UID {uid}"
                break
        if not outcome:
            for info in claims:
                if info.uid in errors:
                    outcome = f"{method} failed for ResourceClaim {info.name}: {errors[info.uid]}"
                    break
        if not outcome and len(claims) - len(answered):
            outcome = f"{method} skipped {len(claims) - len(answered)} ResourceClaims"
        self._record_call(record, outcome=outcome)
        if outcome:
            raise KubeletError(outcome)
        if method != PREPARE:
            return {}
        devices: dict[str, list[PreparedDevice]] = {}
        for uid in answered:
            result = response.claims[uid]
            devices[uid] = [
                PreparedDevice(
                    driver=plugin.driver,
                    pool=d.pool_name,
                    device=d.device_name,
                    request_names=tuple(d.request_names),
                    cdi_device_ids=tuple(d.cdi_device_ids),
                    share_id=_share_id(d),
                )
                for d in result.devices
            ]
        return devices

    def _record_call(self: DraKubeletEmulator, record: dict[str, Any], **fields: Any) -> None:
        with self._cond:
            self._calls.append(DraCall(**record, **fields, at=time.monotonic()))
            self._changed()

    # ------------------------------------------------------------------------------------------ containers

    def _container_cdi(self: DraKubeletEmulator, pod: DraPod) -> dict[str, tuple[str, ...]]:
        """``GetResources``: per container the CDI IDs of the devices whose request_names is empty or holds the
        request the container names (every device of the claim when it names none)."""
        by_pod_claim = dict(pod.claims)
        out: dict[str, tuple[str, ...]] = {}
        with self._cond:
            for container, refs in pod.containers.items():
                ids: list[str] = []
                for pod_claim, request in refs:
                    claim_name = by_pod_claim[pod_claim]
                    if claim_name is None:
                        continue
                    info = self._claim_infos.get((pod.namespace, claim_name))
                    if info is None:
                        raise KubeletError(
                            f"internal error: unable to get claim info for ResourceClaim {claim_name} "
                            f"in namespace {pod.namespace}"
                        )
                    for devices in info.drivers.values():
                        for device in devices:
                            if not request or not device.request_names or request in device.request_names:
                                ids.extend(device.cdi_device_ids)
                out[container] = tuple(ids)
        return out

    # ------------------------------------------------------------------------------------------ unprepare

    def _unprepare_resources(self: DraKubeletEmulator, pod: DraPod) -> None:
        with self._cond:
            names = [info.name for key, info in self._claim_infos.items() if pod.uid in info.pod_uids]
            if not names:  # nothing cached for the pod: the names from its spec
                names = [name for _, name in pod.claims if name is not None]
            batches: dict[str, list[_ClaimInfo]] = {}
            done: list[_ClaimInfo] = []
            for name in names:
                info = self._claim_infos.get((pod.namespace, name))
                if info is None:
                    continue
                if len(info.pod_uids) > 1:
                    info.pod_uids.discard(pod.uid)  # other pods still use it: only the reference goes
                    continue
                done.append(info)
                for driver in info.drivers:
                    batches.setdefault(driver, []).append(info)
            self._changed()
        for driver, claims in batches.items():
            plugin = self._get_plugin(driver)
            if plugin is None:
                raise KubeletError(f"DRA driver {driver} is not registered")
            self._call(UNPREPARE, plugin, claims, pod.uid)
        with self._cond:
            for info in done:
                self._claim_infos.pop((info.namespace, info.name), None)
            self._changed()


def _reserved_for(claim: dict, pod_uid: str) -> bool:
    """``resourceclaim.IsReservedForPod``: an entry with the pod's UID."""
    return any(r.get("uid") == pod_uid for r in (claim.get("status") or {}).get("reservedFor") or [])


def _share_id(device: Any) -> str | None:
    """``Device.share_id`` (v1 only, proto3 optional): None when unset."""
    if "share_id" in device.DESCRIPTOR.fields_by_name and device.HasField("share_id"):
        return device.share_id
    return None
