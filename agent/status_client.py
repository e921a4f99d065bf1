"""``tessera status``: ask the running agent on this node what it is doing.

It reads the agent's ``/status`` endpoint on the metrics port (the one the DaemonSet's probes use), so it works
through ``kubectl exec`` in the agent's container and never touches NVML, the kubelet or the Kubernetes API
itself: it reports what the agent reports, nothing recomputed.
"""

from __future__ import annotations

import http.client
import json
from typing import Any

from agent.telemetry.server import parse_address

TIMEOUT_SECONDS = 5.0
MAX_DOCUMENT_BYTES = 16 << 20  # a node's status is a few hundred kB at most


class StatusUnavailable(Exception):
    """No answer from the agent; the message says what to check."""


def fetch_status(address: str, timeout: float = TIMEOUT_SECONDS) -> dict[str, Any]:
    """The status document from the agent serving metrics at ``address`` (``HOST:PORT`` or ``:PORT``)."""
    try:
        host, port = parse_address(address)
    except ValueError as error:
        raise StatusUnavailable(f"--metrics-address: {error}") from None
    if host in ("0.0.0.0", "::", ""):  # noqa: S104 - the agent listens on every interface: ask it locally
        host = "127.0.0.1"
    where = f"{host}:{port}"
    if port == 0:
        raise StatusUnavailable("--metrics-address: port 0 names no agent; give the agent's metrics port")
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        connection.request("GET", "/status", headers={"Accept": "application/json"})
        response = connection.getresponse()
        body = response.read(MAX_DOCUMENT_BYTES + 1)
    except ConnectionRefusedError:
        raise StatusUnavailable(
            f"no agent answers on {where}: either `tessera run` is not running here, it runs with another "
            "--metrics-address (or with metrics off), or it is still starting (the endpoint opens once the kubelet "
            "watches its resources). On a cluster: kubectl exec -n tessera-system ds/tessera -- tessera status"
        ) from None
    except TimeoutError:
        raise StatusUnavailable(
            f"the agent on {where} did not answer within {timeout:g} s; it may be overloaded"
        ) from None
    except OSError as error:
        raise StatusUnavailable(f"cannot reach the agent on {where}: {error.strerror or error}") from None
    except http.client.HTTPException as error:
        raise StatusUnavailable(f"{where} does not answer like a Tessera agent: {type(error).__name__}") from None
    finally:
        connection.close()
    if response.status == 404:
        raise StatusUnavailable(f"{where} has no /status: is it a Tessera agent of this version or newer?")
    if response.status != 200:
        raise StatusUnavailable(f"the agent on {where} answered HTTP {response.status} to /status")
    if len(body) > MAX_DOCUMENT_BYTES:
        raise StatusUnavailable(f"the answer from {where} is larger than {MAX_DOCUMENT_BYTES >> 20} MiB; not a status")
    try:
        document = json.loads(body)
    except ValueError:
        raise StatusUnavailable(f"{where} answered /status with something that is not JSON") from None
    if not isinstance(document, dict) or not str(document.get("schema", "")).startswith("tessera.dev/status/"):
        raise StatusUnavailable(f"{where} answered /status with a document Tessera does not know")
    return document
