"""Reading a ResourceClaim from the API server for NodePrepareResources.

The DRA service takes any ``ClaimReader``: a callable ``(namespace, name, uid) -> dict | None`` that returns the
claim as ``resource.k8s.io/v1`` JSON (camelCase keys, as the API server sends it), ``None`` when the API server
says it does not exist, and raises ``ClaimsUnavailable`` when the API server cannot be asked (down, timing out,
refusing us) and ``ClaimUnreadable`` when what it sent for the claim cannot be decoded. The split matters to the
kubelet's user: "not found" means the claim was deleted before Prepare; an outage means nothing is wrong with the
claim and the kubelet's retry will succeed once the API server is back; an unreadable claim must be fixed.
Both become a per-claim error; neither fails the rest of the batch.

``KubernetesClaimReader`` is that callable over the official Kubernetes client. The UID is not compared here:
``agent.core.dra.claims.plan_prepare`` does it (a claim deleted and re-created under the same name is a different
claim) and words the error.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any, Protocol

from agent.core.dra.device_status import DeviceStatus, TooManyDeviceStatuses, with_prepared, without_ours

GROUP, VERSION, PLURAL = "resource.k8s.io", "v1", "resourceclaims"
CONNECT_TIMEOUT = 3.0
READ_TIMEOUT = 10.0  # the kubelet gives a whole NodePrepareResources call 45 s (facts/dra.md A1)


class ClaimsUnavailable(Exception):
    """The API server could not be asked for a claim; the message says why. Retrying later may succeed."""


class ClaimUnreadable(Exception):
    """The API server answered with a claim that cannot be read (a number too long for JSON decoding, say): the
    claim's fault, not the server's; asking again gives the same answer."""


class ClaimReader(Protocol):
    def __call__(self, namespace: str, name: str, uid: str) -> dict[str, Any] | None: ...


class KubernetesClaimReader:
    """``GET /apis/resource.k8s.io/v1/namespaces/<ns>/resourceclaims/<name>`` through the Kubernetes client.

    404 → ``None``; any other HTTP error (401/403: RBAC, 429, 5xx) or a connection failure or timeout →
    ``ClaimsUnavailable`` naming the claim and the status. Safe to call from one worker thread at a time (the
    DRA service's executor); the client's connection pool is reused between calls.
    """

    def __init__(
        self, api_client: Any, *, connect_timeout: float = CONNECT_TIMEOUT, read_timeout: float = READ_TIMEOUT
    ) -> None:
        import kubernetes  # the client loads with the DRA front end only

        self._custom = kubernetes.client.CustomObjectsApi(api_client)
        self._api_exception = kubernetes.client.exceptions.ApiException
        self._timeout = (connect_timeout, read_timeout)

    def __call__(self, namespace: str, name: str, uid: str) -> dict[str, Any] | None:
        try:
            claim = self._custom.get_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name, _request_timeout=self._timeout
            )
        except self._api_exception as error:
            if error.status == 404:
                return None
            reason = f" {error.reason}" if error.reason else ""
            raise ClaimsUnavailable(
                f"the API server answered HTTP {error.status}{reason} for ResourceClaim {namespace}/{name}"
            ) from None
        except ValueError as error:  # the body did not decode (json: a number over Python's 4,300 digits, say)
            raise ClaimUnreadable(
                f"ResourceClaim {namespace}/{name} cannot be read as JSON ({_short(error)}); fix or re-create the claim"
            ) from None
        except Exception as error:  # urllib3 connection errors and timeouts, TLS trouble: the server is unreachable
            raise ClaimsUnavailable(
                f"the API server could not be reached for ResourceClaim {namespace}/{name}: "
                f"{type(error).__name__}: {error}"
            ) from None
        if not isinstance(claim, dict):
            raise ClaimsUnavailable(f"the API server sent something other than an object for {namespace}/{name}")
        return claim


class ClaimStatusNotWritten(Exception):
    """A claim's ``status.devices`` could not be written; the message says why (the Prepare stands)."""


class ClaimStatus(Protocol):
    """Writes what the driver reports of a claim's devices in ``status.devices`` (``agent.core.dra.device_status``)."""

    def prepared(self, namespace: str, name: str, uid: str, statuses: Sequence[DeviceStatus]) -> bool: ...
    def unprepared(self, namespace: str, name: str, uid: str, pool: str, devices: Sequence[str]) -> bool: ...


JSON_PATCH = "application/json-patch+json"
STATUS_READ_TIMEOUT = 5.0  # a report, all its reads and writes: a slow API server holds the claim worker this long
STATUS_ATTEMPTS = 3  # a claim another writer changed meanwhile (the scheduler, another driver) is read again


class KubernetesClaimStatus:
    """``status.devices`` written through ``PATCH .../resourceclaims/<name>/status`` (RBAC: ``patch`` on
    ``resourceclaims/status``), as a JSON patch that first tests the ``resourceVersion`` it read: entries other
    drivers wrote meanwhile are never overwritten; on a conflict the claim is read again (up to 3 times).

    Each call answers True when it wrote, False when there was nothing to write (the claim is gone, re-created under
    another UID, or already says so), and raises ``ClaimStatusNotWritten`` when the API server refused or could not
    be reached. Runs on the DRA service's one worker thread.
    """

    def __init__(
        self,
        api_client: Any,
        driver: str,
        node: str,
        *,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
        connect_timeout: float = CONNECT_TIMEOUT,
        read_timeout: float = STATUS_READ_TIMEOUT,
    ) -> None:
        import kubernetes

        from agent.core.dra.taints import rfc3339

        self._custom = kubernetes.client.CustomObjectsApi(api_client)
        self._api_exception = kubernetes.client.exceptions.ApiException
        self._connect_timeout, self._read_timeout = connect_timeout, read_timeout
        self._driver, self._node = driver, node
        self._now = lambda: rfc3339(now())

    def prepared(self, namespace: str, name: str, uid: str, statuses: Sequence[DeviceStatus]) -> bool:
        now = self._now()
        return self._update(
            namespace, name, uid, lambda claim: with_prepared(claim, self._driver, statuses, self._node, now)
        )

    def unprepared(self, namespace: str, name: str, uid: str, pool: str, devices: Sequence[str]) -> bool:
        return self._update(namespace, name, uid, lambda claim: without_ours(claim, self._driver, pool, devices))

    def _update(self, namespace: str, name: str, uid: str, change: Callable[[dict[str, Any]], list | None]) -> bool:
        where = f"ResourceClaim {namespace}/{name}"
        deadline = time.monotonic() + self._read_timeout  # one budget for every read and write of this report

        def timeout() -> tuple[float, float]:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ClaimStatusNotWritten(f"{where}: no answer within {self._read_timeout:g} s in all")
            return (min(self._connect_timeout, left), left)

        for _ in range(STATUS_ATTEMPTS):
            try:
                claim = self._custom.get_namespaced_custom_object(
                    GROUP, VERSION, namespace, PLURAL, name, _request_timeout=timeout()
                )
            except ClaimStatusNotWritten:
                raise
            except self._api_exception as error:
                if error.status == 404:
                    return False
                raise ClaimStatusNotWritten(
                    f"reading {where}: HTTP {error.status} {error.reason or ''}".rstrip()
                ) from None
            except Exception as error:
                raise ClaimStatusNotWritten(f"reading {where}: {type(error).__name__}: {_short(error)}") from None
            metadata = claim.get("metadata") if isinstance(claim, dict) else None
            if not isinstance(metadata, dict) or metadata.get("uid") != uid:
                return False  # deleted and re-created: another claim, not ours to report on
            try:
                devices = change(claim)
            except TooManyDeviceStatuses as error:
                raise ClaimStatusNotWritten(f"{where}: {error}") from None
            if devices is None:
                return False
            status = claim.get("status") if isinstance(claim.get("status"), dict) else {}
            operation = "replace" if "devices" in status else "add"
            patch = [
                {"op": "test", "path": "/metadata/resourceVersion", "value": metadata.get("resourceVersion")},
                {"op": operation, "path": "/status/devices", "value": devices},
            ]
            try:
                self._custom.patch_namespaced_custom_object_status(
                    GROUP, VERSION, namespace, PLURAL, name, patch,
                    _content_type=JSON_PATCH, _request_timeout=timeout(),
                )  # fmt: skip
                return True
            except ClaimStatusNotWritten:
                raise
            except self._api_exception as error:
                if error.status in (409, 422) and _test_failed(error):
                    continue  # changed since it was read: read it again
                if error.status == 404:
                    return False
                raise ClaimStatusNotWritten(
                    f"writing status.devices of {where}: HTTP {error.status} {error.reason or ''}: {_short(error)}"
                ) from None
            except Exception as error:
                raise ClaimStatusNotWritten(
                    f"writing status.devices of {where}: {type(error).__name__}: {_short(error)}"
                ) from None
        raise ClaimStatusNotWritten(
            f"{where} kept changing while its status.devices was written ({STATUS_ATTEMPTS} tries)"
        )


def _test_failed(error: Any) -> bool:
    """The JSON patch's ``test`` of the resourceVersion failed (or the server saw a conflict)."""
    body = str(getattr(error, "body", "") or "")
    return error.status == 409 or "testing value" in body


def _short(error: Exception, limit: int = 120) -> str:
    text = str(error) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"
