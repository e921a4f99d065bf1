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

from typing import Any, Protocol

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


def _short(error: Exception, limit: int = 120) -> str:
    text = str(error) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"
