"""Nodes and Events through the Kubernetes client's ``ApiClient``, without its typed API classes.

The client's ``CoreV1Api`` imports the pydantic models of the whole core group when it loads — 0.4 s and 20 MB
on these machines, twice the agent's start budget — and turns every Node it reads into them, while the agent
needs a handful of metadata fields. These calls go through the same ``ApiClient`` (its configuration,
credentials, TLS, timeouts and ``ApiException``s) and the same request building the typed classes use; only
the answers stay JSON. Watches use ``kubernetes.watch.Watch`` as usual: :meth:`CoreApi.list_node` takes its
``watch`` and ``_preload_content`` arguments and hands back the open response.

Written against the client's current generator (``param_serialize`` / ``call_api`` / ``response_deserialize``,
kubernetes >= 37).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import kubernetes.client

JSON = "application/json"
PATCH = "application/strategic-merge-patch+json"  # what client-go sends, and the typed classes for a dict
RequestTimeout = float | tuple[float, float] | None

# The query parameters of a list or watch, as the typed methods name them.
_QUERY_NAMES = {
    "field_selector": "fieldSelector",
    "label_selector": "labelSelector",
    "resource_version": "resourceVersion",
    "allow_watch_bookmarks": "allowWatchBookmarks",
    "timeout_seconds": "timeoutSeconds",
    "watch": "watch",
}


class CoreApi:
    """The core-group and events.k8s.io calls the agent makes; objects in and out are plain dicts."""

    def __init__(self, api_client: kubernetes.client.ApiClient) -> None:
        self.api_client = api_client

    # ----- Nodes ----------------------------------------------------------------------------------

    def read_node(self, name: str, *, _request_timeout: RequestTimeout = None) -> dict[str, Any]:
        return self._call("GET", "/api/v1/nodes/{name}", {"name": name}, timeout=_request_timeout)

    def patch_node(
        self, name: str, patch: Mapping[str, Any], *, _request_timeout: RequestTimeout = None
    ) -> dict[str, Any]:
        """A strategic merge patch; for labels and annotations it is a JSON merge patch: ``None`` removes the key."""
        return self._call(
            "PATCH", "/api/v1/nodes/{name}", {"name": name}, body=patch, content_type=PATCH,
            timeout=_request_timeout,
        )  # fmt: skip

    def list_node(
        self,
        *,
        _request_timeout: RequestTimeout = None,
        _preload_content: bool = True,
        **query: object,
    ) -> Any:
        """A list (a dict), or with ``watch=True, _preload_content=False`` the open watch response."""
        return self._call(
            "GET", "/api/v1/nodes", {}, query=_query(query), timeout=_request_timeout, preload=_preload_content
        )

    # ----- Events (events.k8s.io/v1) --------------------------------------------------------------

    def create_event(
        self, namespace: str, body: Mapping[str, Any], *, _request_timeout: RequestTimeout = None
    ) -> dict[str, Any]:
        return self._call(
            "POST", "/apis/events.k8s.io/v1/namespaces/{namespace}/events", {"namespace": namespace}, body=body,
            content_type=JSON, timeout=_request_timeout,
        )  # fmt: skip

    def patch_event(
        self, name: str, namespace: str, patch: Mapping[str, Any], *, _request_timeout: RequestTimeout = None
    ) -> dict[str, Any]:
        return self._call(
            "PATCH", "/apis/events.k8s.io/v1/namespaces/{namespace}/events/{name}",
            {"namespace": namespace, "name": name}, body=patch, content_type=PATCH, timeout=_request_timeout,
        )  # fmt: skip

    # ----- one request ----------------------------------------------------------------------------

    def _call(
        self,
        method: str,
        path: str,
        path_params: Mapping[str, str],
        *,
        query: Sequence[tuple[str, object]] = (),
        body: object = None,
        content_type: str | None = None,
        timeout: RequestTimeout = None,
        preload: bool = True,
    ) -> Any:
        from kubernetes.client.exceptions import ApiException

        headers = {"Accept": JSON}
        if content_type is not None:
            headers["Content-Type"] = content_type
        request = self.api_client.param_serialize(
            method=method,
            resource_path=path,
            path_params=dict(path_params),  # quoted into the path by the client
            query_params=list(query),
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self.api_client.call_api(*request, _request_timeout=timeout)
        if not preload:
            if not 200 <= response.status <= 299:
                response.read()
                raise ApiException.from_response(http_resp=response, body=None, data=None)
            return response.response  # the urllib3 response, read line by line by a watch
        response.read()
        return self.api_client.response_deserialize(response, {"200": "object", "201": "object"}).data


class FallbackCoreApi(CoreApi):
    """:class:`CoreApi` for the device-plugin callers, which handle one error type: an ``ApiException`` becomes
    :class:`agent.kube_http.KubeApiError` (status, reason, body), so they read the lean client's and the official
    client's failures alike. Used for the kubeconfigs only the official client speaks (exec, auth-provider...)."""

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        from kubernetes.client.exceptions import ApiException

        from agent.kube_http import KubeApiError

        try:
            return super()._call(*args, **kwargs)
        except ApiException as error:
            raise KubeApiError(error.status or 0, str(error.reason or ""), error.body) from error


def _query(arguments: Mapping[str, object]) -> list[tuple[str, object]]:
    query = []
    for name, value in arguments.items():
        if name not in _QUERY_NAMES:
            raise TypeError(f"list_node() got an unexpected argument {name!r}")
        if value is not None:
            query.append((_QUERY_NAMES[name], value))
    return query
