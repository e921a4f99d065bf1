"""``tessera status``: ask the running agent on this node what it is doing.

It reads the agent's ``/status`` on the agent's unix socket (``--status-socket``; ``agent.telemetry.status_socket``),
which only the node itself reaches: in the agent's container through ``kubectl exec``, or as root on the node. It
never touches NVML, the kubelet or the Kubernetes API itself: it reports what the agent reports, nothing recomputed.
"""

from __future__ import annotations

import http.client
import json
import socket
from typing import Any

TIMEOUT_SECONDS = 5.0
MAX_DOCUMENT_BYTES = 16 << 20  # a node's status is a few hundred kB at most
ON_A_CLUSTER = "On a cluster: kubectl exec -n tessera-system ds/tessera -- tessera status"


class StatusUnavailable(Exception):
    """No answer from the agent; the message says what to check."""


class _UnixConnection(http.client.HTTPConnection):
    """HTTP over a unix socket (the host name is only what the request's Host header says)."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def fetch_status(path: str, timeout: float = TIMEOUT_SECONDS) -> dict[str, Any]:
    """The status document from the agent serving ``/status`` on the unix socket ``path``."""
    connection = _UnixConnection(path, timeout)
    try:
        connection.request("GET", "/status", headers={"Accept": "application/json"})
        response = connection.getresponse()
        body = response.read(MAX_DOCUMENT_BYTES + 1)
    except (FileNotFoundError, ConnectionRefusedError):
        raise StatusUnavailable(
            f"no agent answers on {path}: either `tessera run` is not running on this node, it serves /status on "
            "another --status-socket (TESSERA_STATUS_SOCKET), it runs with --metrics-address off or --status-socket "
            f"off, or it is still starting (the socket opens once the kubelet watches its resources). {ON_A_CLUSTER}"
        ) from None
    except PermissionError:
        raise StatusUnavailable(
            f"no permission to connect to {path}: the agent's status socket is its user's only (mode 0600); run "
            f"tessera status as that user (root), on the node or in the agent's container. {ON_A_CLUSTER}"
        ) from None
    except TimeoutError:
        raise StatusUnavailable(f"the agent on {path} did not answer within {timeout:g} s; it may be busy") from None
    except OSError as error:
        raise StatusUnavailable(f"cannot reach the agent on {path}: {error.strerror or error}") from None
    except http.client.HTTPException as error:
        raise StatusUnavailable(f"{path} does not answer like a Tessera agent: {type(error).__name__}") from None
    finally:
        connection.close()
    if response.status == 404:
        raise StatusUnavailable(f"{path} has no /status: is it a Tessera agent's --status-socket?")
    if response.status != 200:
        raise StatusUnavailable(f"the agent on {path} answered HTTP {response.status} to /status")
    if len(body) > MAX_DOCUMENT_BYTES:
        raise StatusUnavailable(f"the answer from {path} is larger than {MAX_DOCUMENT_BYTES >> 20} MiB; not a status")
    try:
        document = json.loads(body)
    except ValueError:
        raise StatusUnavailable(f"{path} answered /status with something that is not JSON") from None
    if not isinstance(document, dict) or not str(document.get("schema", "")).startswith("tessera.dev/status/"):
        raise StatusUnavailable(f"{path} answered /status with a document Tessera does not know")
    return document
