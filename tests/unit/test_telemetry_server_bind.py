"""The metrics server binds without asking the resolver.

``http.server.HTTPServer.server_bind`` looks up the host's fully qualified name (for ``0.0.0.0`` a reverse lookup of
the node's hostname), which nothing here uses and which hangs for as long as DNS does on a node whose resolver is
unreachable: metrics, ``/healthz`` and ``/readyz`` would wait for it.
"""

from __future__ import annotations

import socket
import urllib.request

import pytest

from agent.telemetry.collector import LastCollection
from agent.telemetry.server import TelemetryServer


def test_the_metrics_server_serves_without_a_name_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[object] = []

    def resolver(*args: object) -> str:
        asked.append(args)
        raise OSError("the resolver is unreachable")

    monkeypatch.setattr(socket, "getfqdn", resolver)
    monkeypatch.setattr(socket, "gethostbyaddr", resolver)
    server = TelemetryServer(":0", LastCollection(), lambda: (True, "ok"), lambda: (True, "ok"))  # all interfaces
    server.start()
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz", timeout=10) as response:
            assert response.status == 200 and response.read() == b"ok\n"
    finally:
        server.stop()
    assert not asked
