"""Where the DRA driver's sockets go, named as the Go helper (k8s.io/dynamic-resource-allocation) names them.

Without a pod UID (one instance per node): ``<registry>/<driver>-reg.sock`` and ``<plugins>/<driver>/dra.sock``.
With the pod's UID (a rolling update of the DaemonSet runs two instances side by side; kubelet ≥ 1.33):
``<driver>-<podUID>-reg.sock`` and ``dra-<podUID>.sock``, the registration name shortened the way the helper's
master does when the full path would pass the 108-byte unix socket limit.
"""

from __future__ import annotations

import base64
import hashlib
import re
from pathlib import Path

MAX_SOCKET_PATH = 107  # sun_path is 108 bytes with the terminating NUL
_DRIVER = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_POD_UID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


def check_driver_name(driver: str) -> str:
    """A DRA driver name: a DNS subdomain of at most 63 characters (``DriverNameMaxLength``)."""
    if len(driver) > 63 or not _DRIVER.fullmatch(driver):
        raise ValueError(
            f"DRA driver name {driver!r} must be a DNS subdomain of at most 63 characters (e.g. gpu.nvidia.com)"
        )
    return driver


def check_pod_uid(pod_uid: str) -> str:
    if not _POD_UID.fullmatch(pod_uid):
        raise ValueError(f"pod UID {pod_uid!r} is not a UID (the downward API's metadata.uid)")
    return pod_uid


def registration_socket(registry_dir: Path, driver: str, pod_uid: str | None = None) -> Path:
    """The registration socket the kubelet's plugin watcher picks up (names starting with '.' it ignores)."""
    check_driver_name(driver)
    if pod_uid is None:
        return registry_dir / f"{driver}-reg.sock"
    check_pod_uid(pod_uid)
    short = _b64(hashlib.sha256(pod_uid.encode()).digest()[:8])
    shortest = _b64(hashlib.sha256(driver.encode() + b"\0" + pod_uid.encode()).digest()[:16])
    candidates = (f"{driver}-{pod_uid}-reg.sock", f"{driver}-{short}-reg.sock", f"dra-{shortest}-reg.sock")
    for name in candidates:
        if len(str(registry_dir / name).encode()) <= MAX_SOCKET_PATH:
            return registry_dir / name
    raise ValueError(f"no registration socket name fits under {registry_dir} ({MAX_SOCKET_PATH} bytes)")


def dra_socket(plugins_dir: Path, driver: str, pod_uid: str | None = None) -> Path:
    """The driver's DRA service socket, in its own directory under the kubelet's plugins directory."""
    check_driver_name(driver)
    name = "dra.sock" if pod_uid is None else f"dra-{check_pod_uid(pod_uid)}.sock"
    path = plugins_dir / driver / name
    if len(str(path).encode()) > MAX_SOCKET_PATH:
        raise ValueError(f"DRA socket {path} is longer than a unix socket path may be ({MAX_SOCKET_PATH} bytes)")
    return path


def _b64(raw: bytes) -> str:
    """base64url without padding (Go's RawURLEncoding; the facts do not say which encoding (?))."""
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")
