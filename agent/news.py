"""What a room's step asks of the reconcile loop.

Each room (health, MIG, MPS, DRA) handles its own events and ticks and answers with ``News``; the loop acts on it
in one place (``Agent._act``), strongest first: read the node again (and so plan and publish), else publish, else
only refresh the status.
"""

from __future__ import annotations

from msgspec import Struct


class News(Struct, frozen=True):
    reread: str | None = None  # read the node again, for this reason (a MIG change, GPUs back from the bus)
    stale: frozenset[str] = frozenset()  # GPUs whose devices are withdrawn until that read succeeds
    publish: bool = False  # what the kubelet sees (either front end) changed
    status: bool = False  # only what the status says changed (a count, what something waits for)
    mps: bool = False  # the MPS daemons DRA's claims need changed: reconcile the MPS manager first
    dra_mps: bool = False  # the MPS daemons' states changed: tell DRA's claims that wait for them


NOTHING = News()
STATUS = News(status=True)
PUBLISH = News(publish=True)
