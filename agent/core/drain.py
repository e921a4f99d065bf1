"""What a disruptive operation must wait for, as pure values.

Before the agent changes MIG mode, destroys a GPU or compute instance, or quits an MPS daemon, it withdraws
every device the operation touches from ListAndWatch (so the kubelet allocates none of them again) and
waits until the kubelet holds none of them and NVML shows no process where the operation acts.

``Drain`` says both: ``withdrawn`` are physical device IDs (a GPU UUID stands for the whole-GPU device and
all its replicas, a MIG UUID for that MIG device and its replicas); ``scopes`` are the GPU or MIG UUIDs on
which NVML must list no compute process and no MPS client.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from agent.core.inventory import Inventory
from agent.core.ledger import Drain, Holder
from agent.core.mig_layout import DestroyInstance, Operation, SetMigMode


def mig_drain(operations: Mapping[int, Sequence[Operation]], inventory: Inventory) -> Drain:
    """The devices a MIG change disturbs.

    A MIG mode change resets the whole GPU: the GPU as a device, every MIG device on it and every process on
    it. Destroying an instance disturbs its MIG devices, and the whole GPU where that is advertised as one
    device (``migStrategy: none`` hands a pod the MIG-enabled GPU with its instances). Creating an instance
    disturbs nothing that runs.
    """
    withdrawn: set[str] = set()
    scopes: set[str] = set()
    for gpu_index, ops in operations.items():
        gpu = next((g for g in inventory.gpus if g.index == gpu_index), None)
        for op in ops:
            if isinstance(op, SetMigMode):
                if gpu is not None:
                    withdrawn |= {gpu.uuid, *(m.uuid for m in gpu.mig_devices)}
                    scopes.add(gpu.uuid)
            elif isinstance(op, DestroyInstance):
                withdrawn.update(op.mig_uuids)
                scopes.update(op.mig_uuids)
                if gpu is not None:
                    withdrawn.add(gpu.uuid)
    return Drain(frozenset(withdrawn), frozenset(scopes))


def busy_reasons(drain: Drain, holders: Mapping[str, Holder], processes: Mapping[str, Iterable[int]]) -> list[str]:
    """Why the drained devices are not free yet, one line each (empty: free).

    ``holders`` maps advertised device IDs (``<physical>::<n>`` for a replica) to their holder;
    ``processes`` maps a scope UUID to the PIDs NVML lists on it.
    """
    reasons = sorted(
        f"{device_id} held by {h.namespace}/{h.pod} ({h.container})"
        for device_id, h in holders.items()
        if device_id.split("::", 1)[0] in drain.withdrawn
    )
    for uuid in sorted(drain.scopes):
        pids = sorted(processes.get(uuid, ()))
        if pids:
            reasons.append(f"{uuid} runs {len(pids)} process(es) (pid {', '.join(map(str, pids[:5]))})")
    return reasons
