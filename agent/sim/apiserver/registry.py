"""The verbs (get, list, create, update, patch, delete, deletecollection) over the store, with the server's
preparation (``strategy``), validation (``validate``) and optimistic concurrency.

Validation runs outside the store's lock; the write then commits only if the object still has the resourceVersion
it was prepared from. An update that names a resourceVersion gets 409 Conflict when that is stale (also when it went
stale during validation); one that names none (an unconditional update) is prepared again on the newer object.
An update that changes nothing is a no-op: no new resourceVersion, no event (as etcd3's ``GuaranteedUpdate``).
"""

from __future__ import annotations

import base64
import binascii
import copy
import json
from collections.abc import Callable

from agent.sim.apiserver import patch as patches
from agent.sim.apiserver.errors import ApiError, bad_request, conflict, not_found, success_status
from agent.sim.apiserver.kinds import Kind
from agent.sim.apiserver.selectors import FieldSelector, LabelSelector
from agent.sim.apiserver.store import Store, with_rv
from agent.sim.apiserver.strategy import check_body, generate_name, now, prepare_create, prepare_update, same_object
from agent.sim.apiserver.validate import Validator

_MAX_ATTEMPTS = 50


def _meta(obj: dict) -> dict:
    return obj.get("metadata") or {}


class Registry:
    def __init__(self, store: Store, validator: Validator, disabled_gates: frozenset[str] = frozenset()) -> None:
        self.store = store
        self.validator = validator
        self.disabled_gates = disabled_gates  # feature gates that are off: their fields are dropped on write

    # -- reads

    def get(self, kind: Kind, namespace: str | None, name: str) -> dict:
        obj = self.store.get(kind, namespace, name)
        if obj is None:
            raise not_found(kind, name)
        return obj

    def list(
        self,
        kind: Kind,
        namespace: str | None,
        fields: FieldSelector,
        labels: LabelSelector,
        limit: int | None = None,
        continue_token: str | None = None,
    ) -> dict:
        """A list object; items carry no apiVersion/kind, as the real server's lists. ``limit``/``continue`` page
        through the current state (not a consistent snapshot, unlike etcd)."""
        items, rv = self.store.list(kind, namespace)
        items = [o for o in items if fields.matches(o) and labels.matches(o)]
        if continue_token:
            try:
                start = json.loads(base64.urlsafe_b64decode(continue_token.encode()))["start"]
            except (ValueError, KeyError, TypeError, binascii.Error) as e:
                raise bad_request(f"continue key is not valid: {e}") from e
            items = [o for o in items if [_meta(o).get("namespace") or "", _meta(o)["name"]] > start]
        meta: dict[str, object] = {"resourceVersion": str(rv)}
        if limit and len(items) > limit:
            last = items[limit - 1]
            token = {"rv": rv, "start": [_meta(last).get("namespace") or "", _meta(last)["name"]]}
            meta["continue"] = base64.urlsafe_b64encode(json.dumps(token).encode()).decode()
            meta["remainingItemCount"] = len(items) - limit
            items = items[:limit]
        return {
            "kind": kind.list_kind,
            "apiVersion": kind.api_version,
            "metadata": meta,
            "items": [{k: v for k, v in o.items() if k not in ("apiVersion", "kind")} for o in items],
        }

    # -- writes

    def create(
        self, kind: Kind, namespace: str | None, body: object, *, dry_run: bool = False, keep_status: bool = False
    ) -> dict:
        obj = prepare_create(
            kind, namespace, check_body(kind, body, namespace), keep_status=keep_status, disabled=self.disabled_gates
        )
        self.validator.check(kind, obj)
        if dry_run:
            return obj
        generated = bool(_meta(body).get("generateName")) and not _meta(body).get("name")  # type: ignore[union-attr]
        for _ in range(_MAX_ATTEMPTS):
            try:
                return self.store.insert(kind, obj)
            except ApiError as e:
                if e.code != 409 or not generated:
                    raise
                obj["metadata"]["name"] = generate_name(obj["metadata"]["generateName"])
        raise ApiError(500, "could not generate a unique name")

    def update(
        self,
        kind: Kind,
        namespace: str | None,
        name: str,
        body: object,
        *,
        subresource: str | None = None,
        dry_run: bool = False,
    ) -> dict:
        check_body(kind, body, namespace, name)
        return self._update(kind, namespace, name, lambda old: body, subresource, dry_run)  # type: ignore[arg-type,return-value]

    def patch(
        self,
        kind: Kind,
        namespace: str | None,
        name: str,
        content_type: str,
        body: object,
        *,
        subresource: str | None = None,
        dry_run: bool = False,
    ) -> dict:
        pinned = isinstance(body, dict) and bool(_meta(body).get("resourceVersion"))

        def patched(old: dict) -> dict:
            result = patches.apply(content_type, copy.deepcopy(old), body)
            if not isinstance(result, dict):
                raise ApiError(422, "the patch does not leave an object", "Invalid")
            check_body(kind, result, namespace, name)
            rv = _meta(result).get("resourceVersion")
            if rv and rv != _meta(old).get("resourceVersion"):
                raise conflict(kind, name)
            if not pinned and isinstance(result.get("metadata"), dict):
                result["metadata"].pop("resourceVersion", None)
            return result

        return self._update(kind, namespace, name, patched, subresource, dry_run)

    def _update(
        self,
        kind: Kind,
        namespace: str | None,
        name: str,
        make_body: Callable[[dict], dict],
        subresource: str | None,
        dry_run: bool,
    ) -> dict:
        for _ in range(_MAX_ATTEMPTS):
            old = self.get(kind, namespace, name)
            old_rv = _meta(old)["resourceVersion"]
            body = make_body(old)
            wanted = _meta(body).get("resourceVersion")
            if wanted and wanted != old_rv:
                raise conflict(kind, name)
            new = prepare_update(kind, body, old, subresource, disabled=self.disabled_gates)
            if same_object(new, old):
                return old
            self.validator.check(kind, new, old, subresource)
            if dry_run:
                return with_rv(new, int(old_rv))
            stored = self.store.replace(kind, new, old_rv)
            if stored is not None:
                return stored
            if wanted:
                raise conflict(kind, name)
        raise conflict(kind, name, "too many concurrent writers")

    def delete(
        self, kind: Kind, namespace: str | None, name: str, options: dict | None = None, *, dry_run: bool = False
    ) -> tuple[int, dict]:
        """(HTTP status, body): 200 when the object is gone, with the deleted object (the resource.k8s.io kinds'
        registries set ``ReturnDeletedObject``, and the client's models expect it) or, for a Node, a success
        Status; 202 with the object when finalizers hold it (it then gets ``deletionTimestamp``)."""
        with self.store.cond:
            code, body, _ = self._delete_locked(kind, self.get(kind, namespace, name), options, dry_run)
            return code, body

    def delete_collection(
        self,
        kind: Kind,
        namespace: str | None,
        fields: FieldSelector,
        labels: LabelSelector,
        options: dict | None = None,
        *,
        dry_run: bool = False,
    ) -> dict:
        """Delete every match; the answer is the list of deleted objects, as the real server's."""
        with self.store.cond:
            items, _ = self.store.list(kind, namespace)
            deleted = []
            for obj in items:
                if fields.matches(obj) and labels.matches(obj):
                    deleted.append(self._delete_locked(kind, obj, options, dry_run)[2])
            return {
                "kind": kind.list_kind,
                "apiVersion": kind.api_version,
                "metadata": {"resourceVersion": str(self.store.rv)},
                "items": deleted,
            }

    def _delete_locked(self, kind: Kind, obj: dict, options: dict | None, dry_run: bool) -> tuple[int, dict, dict]:
        meta = _meta(obj)
        name = meta["name"]
        preconditions = (options or {}).get("preconditions") or {}
        if preconditions.get("uid") and preconditions["uid"] != meta.get("uid"):
            raise conflict(
                kind,
                name,
                f"Precondition failed: UID in precondition: {preconditions['uid']}, "
                f"UID in object meta: {meta.get('uid')}",
            )
        if preconditions.get("resourceVersion") and preconditions["resourceVersion"] != meta.get("resourceVersion"):
            raise conflict(
                kind,
                name,
                f"Precondition failed: ResourceVersion in precondition: {preconditions['resourceVersion']}, "
                f"ResourceVersion in object meta: {meta.get('resourceVersion')}",
            )
        if dry_run:
            return 200, obj, obj
        if meta.get("finalizers"):
            if meta.get("deletionTimestamp"):
                return 202, obj, obj
            marked = {**obj, "metadata": {**meta, "deletionTimestamp": now(), "deletionGracePeriodSeconds": 0}}
            stored = self.store.replace(kind, marked, meta["resourceVersion"])
            assert stored is not None  # the lock is held
            return 202, stored, stored
        gone = self.store.remove(kind, meta.get("namespace"), name)
        return 200, (obj if kind.returns_deleted else success_status(kind, name, meta.get("uid"))), gone
