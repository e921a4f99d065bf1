"""Keeps this node's ResourceSlices equal to what the agent serves through DRA, through the API server.

The reconcile loop hands over the devices and their taints (``publish``); one worker thread makes the API
server's slices match: it reads the Node's UID once (the slices are owned by the Node, so they go with it),
the server's version once (1.34 wants counters and devices in one slice, 1.35+ in separate ones), lists
this node's slices of this driver, and writes only what differs — updating slices in place, creating the
missing ones, deleting the surplus — with the pool generation bumped whenever the content changes, so
consumers never mix two generations.

The slices do not stay put on their own: the kubelet deletes every slice of its node when it starts, and
anyone with the rights can delete or edit them. A watch on this node's slices of this driver wakes the
worker on every change; it lists the slices again and writes only if they differ from what is wanted. An API
server that does not answer is retried with backoff (1 s doubling to 30 s) and reported once per outage.

Only this node's slices of this driver are ever touched: every list, watch and delete is field-selected by
``spec.nodeName`` and ``spec.driver``, and a slice is written only with this node's name in it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from agent.core.dra.devices import DraDevice
from agent.core.dra.partitions import counter_sets
from agent.core.dra.slices import DROPPED_GATES, dropped_gates, layout_for, resource_slices
from agent.core.dra.taints import DeviceTaint
from agent.dra.types import SlicesFailed, SlicesPublished
from agent.kube_api import CoreApi

Counters = Mapping[str, Mapping[str, int]]  # counter set name -> counter -> amount
log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "resource.k8s.io", "v1", "resourceslices"
MAX_BACKOFF = 30.0
WATCH_SECONDS = 300  # a watch is renewed this often (the server ends it anyway; a renewal is not a poll)


class SlicePublisher:
    def __init__(
        self,
        api_client: Any,  # kubernetes.client.ApiClient
        node_name: str,
        driver: str,
        *,
        post: Callable[[object], None] = lambda event: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        import kubernetes  # the client loads with the DRA front end only

        self._custom = kubernetes.client.CustomObjectsApi(api_client)
        self._core = CoreApi(api_client)
        self._version = kubernetes.client.VersionApi(api_client)
        self._exception = kubernetes.client.exceptions.ApiException
        self._watch_factory = kubernetes.watch.Watch
        self._node_name = node_name
        self._driver = driver
        self._selector = f"spec.nodeName={node_name},spec.driver={driver}"
        self._post = post
        self._clock = clock
        self._lock = threading.Condition()
        self._desired: tuple[tuple[DraDevice, ...], Mapping[str, Sequence[DeviceTaint]], Counters | None] | None = None
        self._dirty = False
        self._asked = False  # a publish() waits for its answer (a watch event's re-check is silent when equal)
        self._stopped = False
        self._node_uid: str | None = None
        self._layout: str | None = None
        self._failing = False
        self._generation = 0  # the last one published: a pool that was wiped comes back newer, never older
        # What was last asked for and the slices' content as the API server stored it then (it may normalise
        # what it is given): a re-check compares with that, so it settles even where the forms differ.
        self._applied: tuple[object, list[Any]] | None = None
        self._threads: list[threading.Thread] = []
        # feature gates the API server has off, seen in what it stored of the last write (read by the status)
        self.dropped: tuple[str, ...] = ()
        self._active_watch: Any = None
        self._watch_response: Any = None  # the open watch's HTTP response (urllib3), for stop

    # ----- the loop's side ------------------------------------------------------------------------

    def start(self) -> None:
        for target, name in ((self._work, "dra-slices"), (self._watch, "dra-slices-watch")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def publish(
        self,
        devices: Sequence[DraDevice],
        taints: Mapping[str, Sequence[DeviceTaint]],
        counters: Counters | None = None,
    ) -> None:
        """From now on the node's slices should list ``devices`` (with ``taints``) and the counter sets ``counters``
        (default: the ones ``devices`` carry; a dynamic-MIG GPU whose full device is not offered still has its set);
        returns at once."""
        with self._lock:
            self._desired = (tuple(devices), dict(taints), counters)
            self._dirty = self._asked = True
            self._lock.notify_all()

    def stop(self, timeout: float | None = 2.0) -> None:
        """Stop the workers; the slices stay (the next agent adopts them; the kubelet wipes them if the
        driver stays away)."""
        with self._lock:
            self._stopped = True
            self._lock.notify_all()
        watch, response = self._active_watch, self._watch_response
        if watch is not None:
            watch.stop()
        if response is not None:  # the watch blocks in a read: shutting its socket down ends it now
            with contextlib.suppress(Exception):
                response.shutdown()
        for thread in self._threads:
            thread.join(timeout)

    # ----- the worker -----------------------------------------------------------------------------

    def _work(self) -> None:
        backoff = 1.0
        retry_at: float | None = None
        while True:
            with self._lock:
                while not self._stopped and not (self._dirty and self._desired is not None):
                    wait = None if retry_at is None else max(0.0, retry_at - self._clock())
                    if wait == 0.0:
                        self._dirty = True
                        break
                    self._lock.wait(wait)
                if self._stopped:
                    return
                self._dirty, desired, asked = False, self._desired, self._asked
                self._asked = False
            assert desired is not None
            try:
                generation, count, wrote = self._reconcile(*desired)
            except Exception as error:  # the API server's refusal or absence: retried with backoff
                with self._lock:
                    self._asked = self._asked or asked
                self._failed(error, backoff)
                retry_at, backoff = self._clock() + backoff, min(MAX_BACKOFF, backoff * 2)
                continue
            retry_at, backoff = None, 1.0
            if self._failing:
                log.info("ResourceSlices published again after an outage node=%s", self._node_name)
            if wrote or asked or self._failing:
                self._post(SlicesPublished(generation, count))
            self._failing = False

    def _failed(self, error: Exception, backoff: float) -> None:
        text = _describe(error)
        if not self._failing:
            log.error("cannot publish ResourceSlices node=%s error=%r; retrying", self._node_name, text)
            self._post(SlicesFailed(text))
        else:
            log.debug("ResourceSlices still not published error=%r retry_in=%.0fs", text, backoff)
        self._failing = True

    def _reconcile(
        self, devices: tuple[DraDevice, ...], taints: Mapping[str, Sequence[DeviceTaint]], counters: Counters | None
    ) -> tuple[int, int, bool]:
        """Make the API server's slices match; (the pool's generation, its slice count, whether it wrote)."""
        if self._node_uid is None:
            self._node_uid = self._core.read_node(self._node_name)["metadata"]["uid"]
        if self._layout is None:
            self._layout = layout_for(self._version.get_code().git_version)
        existing = self._list()
        current = max((s["spec"]["pool"]["generation"] for s in existing), default=0)
        sets = counter_sets(devices) if counters is None else counters
        wanted_input = (devices, taints, sets)
        if existing and self._applied == (wanted_input, _contents(existing)):
            return current, len(existing), False
        same = resource_slices(
            self._node_name, self._node_uid, self._driver, devices, current, self._layout, taints=taints,
            counter_sets=sets,
        )  # fmt: skip
        if existing and _contents(existing) == _contents(same):
            self._generation = max(self._generation, current)
            self._applied = (wanted_input, _contents(existing))
            return current, len(existing), False
        generation = max(current, self._generation) + 1
        self._generation = generation
        wanted = resource_slices(
            self._node_name, self._node_uid, self._driver, devices, generation, self._layout, taints=taints,
            counter_sets=sets,
        )  # fmt: skip
        # old slices first (the Go helper's order): consumers never see two generations at once for long
        for surplus in existing[len(wanted) :]:
            self._delete(surplus)
        for old, new in zip(existing, wanted, strict=False):
            self._update(old, new)
        for new in wanted[len(existing) :]:
            self._create(new)
        stored = self._list()
        self._applied = (wanted_input, _contents(stored))
        self._check_dropped(wanted, stored)
        log.info(
            "ResourceSlices published node=%s driver=%s generation=%d slices=%d devices=%d",
            self._node_name, self._driver, generation, len(wanted), len(devices),
        )  # fmt: skip
        return generation, len(wanted), True

    def _check_dropped(self, wanted: list[dict[str, Any]], stored: list[dict[str, Any]]) -> None:
        dropped = dropped_gates(wanted, stored)
        for gate in sorted(set(dropped) - set(self.dropped)):
            log.warning("%s node=%s", DROPPED_GATES[gate], self._node_name)
        self.dropped = dropped

    def _list(self) -> list[dict[str, Any]]:
        listed = self._custom.list_cluster_custom_object(GROUP, VERSION, PLURAL, field_selector=self._selector)
        items = [i for i in listed.get("items", []) if _ours(i, self._node_name, self._driver)]
        return sorted(items, key=lambda s: s["metadata"]["name"])

    def _create(self, body: dict[str, Any]) -> None:
        self._custom.create_cluster_custom_object(GROUP, VERSION, PLURAL, body)

    def _update(self, old: dict[str, Any], new: dict[str, Any]) -> None:
        body = {**new, "metadata": {**old["metadata"], "ownerReferences": new["metadata"]["ownerReferences"]}}
        self._custom.replace_cluster_custom_object(GROUP, VERSION, PLURAL, old["metadata"]["name"], body)

    def _delete(self, old: dict[str, Any]) -> None:
        try:
            self._custom.delete_cluster_custom_object(GROUP, VERSION, PLURAL, old["metadata"]["name"])
        except self._exception as error:
            if error.status != 404:  # gone already: what was wanted
                raise

    # ----- the watch ------------------------------------------------------------------------------

    def _watch(self) -> None:
        """Wake the worker when a slice of ours changes that it did not write (the kubelet's wipe, a user)."""
        resource_version: str | None = None
        backoff = 1.0
        while not self._stopped:
            watch = self._watch_factory()
            self._active_watch = watch
            try:
                if resource_version is None:
                    listed = self._custom.list_cluster_custom_object(
                        GROUP, VERSION, PLURAL, field_selector=self._selector
                    )
                    resource_version = listed["metadata"]["resourceVersion"]
                for event in watch.stream(
                    self._open_watch,
                    GROUP, VERSION, PLURAL,
                    field_selector=self._selector,
                    resource_version=resource_version,
                    timeout_seconds=WATCH_SECONDS,
                ):  # fmt: skip
                    obj = event["object"]
                    if event["type"] == "ERROR":
                        resource_version = None  # 410 Gone: list again
                        break
                    resource_version = obj["metadata"]["resourceVersion"]
                    self._seen(event["type"], obj)
                backoff = 1.0
            except Exception as error:  # the API server is away: the worker reports it; the watch waits
                if self._stopped:
                    return
                log.debug("ResourceSlice watch ended error=%r", _describe(error))
                resource_version = None
                with self._lock:
                    self._lock.wait(backoff)
                backoff = min(MAX_BACKOFF, backoff * 2)

    def _open_watch(self, *args: Any, **kwargs: Any) -> Any:
        """The list call the watch makes, its response kept so that ``stop`` can end the blocked read. (No
        docstring return type for the client's Watch to decode into: events stay the plain dicts they are.)"""
        response = self._custom.list_cluster_custom_object(*args, **kwargs)
        self._watch_response = response
        return response

    def _seen(self, kind: str, obj: dict[str, Any]) -> None:
        """Any change wakes the worker, its own writes too: a re-check that finds the slices as wanted writes
        nothing (one list), and one that does not finds what someone else changed."""
        log.debug("ResourceSlice event kind=%s slice=%s", kind, obj.get("metadata", {}).get("name"))
        with self._lock:
            self._dirty = True
            self._lock.notify_all()


def _ours(item: dict[str, Any], node: str, driver: str) -> bool:
    spec = item.get("spec", {})
    return spec.get("nodeName") == node and spec.get("driver") == driver


def _contents(slices: Sequence[dict[str, Any]]) -> list[Any]:
    """What a consumer sees of a pool's slices, generation aside (it is bumped only when this differs)."""
    out = []
    for item in slices:
        spec = dict(item["spec"])
        spec["pool"] = {k: v for k, v in spec["pool"].items() if k != "generation"}
        out.append(spec)
    return out


def _describe(error: Exception) -> str:
    status = getattr(error, "status", None)
    reason = getattr(error, "reason", None)
    if status is not None:
        body = getattr(error, "body", "") or ""
        return f"HTTP {status} {reason}: {str(body)[:300]}"
    return f"{type(error).__name__}: {error}"
