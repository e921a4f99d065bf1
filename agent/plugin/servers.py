"""The device plugin's gRPC servers, one per resource, as the reconcile loop keeps them: started for a new resource,
stopped for one that went, handed new snapshots, and served again when their socket is gone.

A socket the kubelet removed (at its start it clears the device-plugin directory) is served again under the same
server when it can be (its streams carry on: no new registration is needed); otherwise the server is restarted.
A socket that cannot be served (a full disk, a bad directory) is said once and tried again every
``SERVE_RETRY_SECONDS``, not at every turn of the loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from agent.core.snapshot import ResourceSnapshot
from agent.plugin.registrations import Registrations
from agent.plugin.server import ResourceServer, stop_servers

log = logging.getLogger(__name__)

SERVE_RETRY_SECONDS = 1.0  # a socket that could not be served is tried again this often


class ResourceServers:
    def __init__(
        self,
        directory: Path,
        registrations: Registrations,
        *,
        clock: Callable[[], float],
        on_stream_closed: Callable[[str], None],
        on_stream_opened: Callable[[str], None],
        on_allocate: Callable[[list[str]], None],
        latency: Any = None,
    ) -> None:
        self._directory = directory
        self._registrations = registrations
        self._clock = clock
        self._callbacks = {"on_stream_closed": on_stream_closed, "on_stream_opened": on_stream_opened,
                           "on_allocate": on_allocate, "latency": latency}  # fmt: skip
        self.servers: dict[str, ResourceServer] = {}
        self._errors: dict[str, str] = {}  # resource -> why its socket could not be served
        self._retry_at: dict[str, float] = {}

    def apply(self, snapshots: Mapping[str, ResourceSnapshot]) -> list[tuple[ResourceServer, ResourceSnapshot]]:
        """Servers for exactly these resources; the running ones whose snapshot changed, with it (the caller hands
        them over, after the status says what the kubelet is about to hear)."""
        for name in self.servers.keys() - snapshots.keys():
            self.servers.pop(name).stop()
            self._registrations.forget(name)
            log.info("resource removed resource=%s", name)
        changed = []
        for name, snapshot in snapshots.items():
            server = self.servers.get(name)
            if server is None:
                self.servers[name] = self._new(snapshot)
                self._registrations.server_started(name)
            elif snapshot.listing() != server.snapshot.listing() or snapshot.options != server.snapshot.options:
                changed.append((server, snapshot))
        return changed

    def serve_missing(self, now: float) -> None:
        """Every server whose socket is gone is served again (the same server when it can be)."""
        for name, server in list(self.servers.items()):
            if server.socket_present():
                continue
            if server.serving:
                log.warning("plugin socket removed resource=%s socket=%s; serving it again", name, server.socket_path)
                if server.restore_socket():  # the same server under its name again: no restart needed
                    self._registrations.socket_restored(name)  # its stream carries on
                    continue
            elif now < self._retry_at.get(name, 0.0):
                continue  # it could not be served a moment ago: do not retry (and fail) every turn
            self.servers.pop(name).stop(grace=0)
            self.servers[name] = self._new(server.snapshot)
            self._registrations.server_started(name)  # the kubelet's stream went with the old server

    def retry_deadlines(self) -> list[float]:
        now = self._clock()
        return [self._retry_at.get(name, now) for name, server in self.servers.items() if not server.serving]

    def stop_all(self) -> None:
        stop_servers(self.servers.values(), grace=0)  # together: every stream ends at once
        self.servers.clear()

    def _new(self, snapshot: ResourceSnapshot) -> ResourceServer:
        server = ResourceServer(snapshot, self._directory, **self._callbacks)
        if not self._directory.is_dir():
            return server  # served once the directory appears (``serve_missing`` sees its socket missing)
        try:
            server.start()
        except OSError as error:
            if self._errors.get(snapshot.name) != str(error):  # said once, not at every retry
                log.error("cannot serve resource=%s socket=%s error=%r", snapshot.name, server.socket_path, str(error))
            self._errors[snapshot.name] = str(error)
            self._retry_at[snapshot.name] = self._clock() + SERVE_RETRY_SECONDS
        else:
            self._errors.pop(snapshot.name, None)
        return server
