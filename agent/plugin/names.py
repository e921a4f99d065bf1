"""Resource names and the socket file each resource is served on."""

from __future__ import annotations

import re

_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_SUBDOMAIN = re.compile(rf"^{_DNS_LABEL}(\.{_DNS_LABEL})*$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_SOCKET_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def resource_name_problem(name: str) -> str | None:
    """Why the kubelet would reject ``name`` as an extended resource (IsExtendedResourceName), or None.

    NVIDIA's stricter rule is applied too: at most 63 characters in all.
    """
    if "/" not in name:
        return f"{name!r} has no domain prefix (expected e.g. nvidia.com/gpu)"
    if "kubernetes.io/" in name:
        return f"{name!r} uses the reserved kubernetes.io domain"
    if name.startswith("requests."):
        return f"{name!r} must not start with 'requests.'"
    if len(name) > 63:
        return f"{name!r} is longer than 63 characters"
    domain, _, short = name.partition("/")
    if "/" in short:
        return f"{name!r} has more than one '/'"
    if len(domain) > 244 or not _DNS_SUBDOMAIN.fullmatch(f"requests.{domain}"):
        return f"{name!r}: the domain must be a lower-case DNS subdomain"
    if not 1 <= len(short) <= 63 or not _QUALIFIED_NAME.fullmatch(short):
        return f"{name!r}: the name after '/' must be 1-63 letters, digits, '-', '_' or '.'"
    return None


def socket_name(resource: str) -> str:
    """The socket file a resource is served on: NVIDIA's names for ``nvidia.com/*`` resources.

    ``nvidia.com/mig-1g.10gb`` is served on ``nvidia-mig-1g.10gb.sock`` (as NVIDIA's plugin does); another
    domain keeps its full name (``example.com/foo`` on ``example.com-foo.sock``), so different resources
    never share a socket. The result is a bare file name (no ``/``, no ``..``), safe to join under the
    plugin directory; anything else is a ``ValueError``.
    """
    domain, _, short = resource.partition("/")
    base = f"nvidia-{short}" if domain == "nvidia.com" else f"{domain}-{short}"
    name = f"{base}.sock"
    if not domain or not short or not _SOCKET_SAFE.fullmatch(base) or ".." in name:  # "x/a." would give "x-a..sock"
        raise ValueError(f"resource {resource!r} does not give a safe socket file name")
    return name
