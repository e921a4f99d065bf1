"""Stands in for the kubelet's device manager and its PodResources API, over real gRPC on real unix sockets.

``emulator`` holds ``KubeletEmulator``; ``registration`` (plugin registration and ListAndWatch), ``pods`` (pod
admission, Allocate and container start) and ``podresources`` (the PodResources v1 server) are its parts, and
``common`` the names, error texts, records and rate limiting they share. This package's public face is the
emulator and the records it hands out, re-exported here: ``from agent.sim.kubelet import KubeletEmulator``.
"""

from agent.sim.kubelet.dra import DraKubeletEmulator as DraKubeletEmulator
from agent.sim.kubelet.emulator import (
    AdmissionError,
    ContainerAllocation,
    ContainerStartError,
    KubeletEmulator,
    Pod,
    RunContainerOptions,
)

__all__ = [
    "AdmissionError",
    "ContainerAllocation",
    "ContainerStartError",
    "KubeletEmulator",
    "Pod",
    "RunContainerOptions",
]
