"""Scenario: one owner per device (issue 24) — both front ends, MIG layouts and kubelet restarts, with NVML failing.

The real agent runs in-process on a simulated node of four A100s, with the device-plugin kubelet emulator, the DRA
kubelet emulator and the API server stand-in (``tests/integration/test_dra_e2e.py``'s ``world``). Two actors work
it at random while 1 % of NVML calls fail:

- the *DRA actor* creates claims (a whole GPU, a MIG device, admin access, a time-sliced GPU), allocates them with
  the simulated scheduler from the published slices, runs pods on them (``run_pod``), starts a process on the
  device for half of them (a prepared claim with no process is what the ledger exists for), stops them, slows
  the API server down (a Prepare reads its claim there: the window in which a GPU may change front end) and
  restarts the DRA kubelet;
- the *node actor* admits and deletes device-plugin pods (again with and without processes), moves GPUs between
  the front ends (``dra.gpus`` in the hot-reloaded config), changes the MIG layout (the config's
  ``migLayout.config`` and the node label ``nvidia.com/mig.config``) and restarts the device-plugin kubelet.

A sampler thread checks, all along:

1. no GPU is held at once by a device-plugin pod (the kubelet's admitted pods) and a DRA claim (the agent's
   checkpoint: prepared or being prepared, admin access included; and the claims of the DRA kubelet's running
   pods). Each sample reads the pods, the claims, the pods again and the claims again, and counts a GPU only when
   one side held it across the other side's read: a hand-over between two reads is never taken for a double;
2. no destructive call (the simulator's log: MIG mode, GPU and compute instance destroy, compute mode) hits a
   device while a pod or a claim holds it — a pod from its admission until it is deleted, a claim from its pod's
   start until the pod stops and while the agent's checkpoint records it (being prepared, prepared, being
   unprepared) — nor a scope with processes (``test_never_destructive``'s ``Holdings``); a workload is never
   handed a device taken away after it was given or recorded; the time-slice of a GPU a time-sliced claim holds
   stays that claim's;
3. the reconcile loop answers (``agent.responsive``), and internal errors happen only while NVML faults are
   injected, each naming an NVML error.

At the end every workload ends, the faults stop, and the agent must converge: DRA serves exactly the configured
GPUs, the device plugin's GPUs have the layout asked for. Refused operations (a Prepare for a GPU that left DRA,
a pod nobody has a device for, a claim the scheduler cannot place) are expected and counted.

What the scenario found besides, now fixed (each pinned below by a deterministic test):

- a claim prepared on a device the node no longer had *before* the claim was recorded is a phantom, not a second
  owner: DRA offered and prepared the devices of a GPU whose inventory could not be read again after a MIG change.
  The scenario asserts none (``phantom_devices_given``);
- a GPU DRA gives back to the device plugin got the static layout only at the next layout event;
- a compute instance that fails to be made left its GPU instance behind, and the layout never completed over it.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import pytest

from agent.config.labels import MIG_CONFIG_LABEL, NodeLabelChanged
from agent.config.watch import ConfigSourceChanged
from agent.core.dra.checkpoint import CHECKPOINT_FILE, Checkpoint, CheckpointError, decode
from agent.core.dra.devices import gpu_minor_of
from agent.sim.kubelet.common import AdmissionError
from agent.sim.kubelet.dra_common import PodStartError, PodStopError
from agent.sim.nvml.codes import Return
from agent.sim.nvml.driver import DestructiveCall, SimDriver
from agent.sim.scheduler.errors import Unschedulable
from tests import cdi_devices
from tests.integration import test_dra_e2e
from tests.integration.test_dra_e2e import DRIVER, World
from tests.integration.test_dra_sharing import LEVELS, gpu_config, smi  # noqa: F401 (smi: the fixture)
from tests.integration.test_ledger import MIG_CLASS, allocated
from tests.reliability.test_never_destructive import Held, Holdings, _layout, _start_process

world = test_dra_e2e.world  # the fixture: the agent, both kubelets and the API server on a simulated node

GPUS = 4
NODE_SPEC = {"name": "owners", "gpus": [{"model": "A100-SXM4-80GB", "count": GPUS}]}
LAYOUTS = {  # name -> each GPU's MIG profiles (None: MIG disabled), for the device plugin's GPUs
    "all-disabled": [None] * GPUS,
    "all-3g.40gb": [["3g.40gb"] * 2] * GPUS,
    "all-2g.20gb": [["2g.20gb"] * 3] * GPUS,
    "mixed": [["1g.10gb", "2g.20gb", "3g.40gb"]] * 2 + [None] * (GPUS - 2),
}
MIG_CONFIGS = """      all-disabled:
        - {devices: all, mig-enabled: false}
      all-3g.40gb:
        - {devices: all, mig-enabled: true, mig-devices: {3g.40gb: 2}}
      all-2g.20gb:
        - {devices: all, mig-enabled: true, mig-devices: {2g.20gb: 3}}
      mixed:
        - {devices: [0, 1], mig-enabled: true, mig-devices: {3g.40gb: 1, 2g.20gb: 1, 1g.10gb: 1}}
        - {devices: [2, 3], mig-enabled: false}
"""
# the agent's slow re-check (lost GPUs, MIG devices changed by hand) and health's quiet period, short: more NVML
# reads for the faults to hit, and GPUs a fault made Unhealthy come back within the scenario
QUICK_CHECKS = {"liveness_seconds": 0.5, "recovery_seconds": 0.5}
CLAIM_KINDS = ("gpu", "gpu", "mig", "admin", "timeslice")
INTERVALS = ("Short", "Medium", "Long")
MIG_DEVICE_CLASS = {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": "mig.nvidia.com"},
                    "spec": {"selectors": [{"cel": {"expression": MIG_CLASS}}]}}  # fmt: skip


def config_text(dra_gpus: list[int], layout: str) -> str:
    return (
        "version: v1\n"
        "flags: {migStrategy: mixed}\n"
        f"dra:\n  enabled: true\n  gpus: [{', '.join(map(str, sorted(dra_gpus)))}]\n"
        f"migLayout:\n  config: {layout}\n  layouts:\n    version: v1\n    mig-configs:\n{MIG_CONFIGS}"
    )


def write_config(world: World, dra_gpus: list[int], layout: str) -> None:
    """Replace the config atomically (as the kubelet swaps a ConfigMap) and tell the agent at once (what its
    watcher does, without its delay)."""
    staged = world.base / "config.staged"
    staged.write_text(config_text(dra_gpus, layout))
    staged.replace(world.base / "config.yaml")
    world.agent.post(ConfigSourceChanged())


# ----- who holds what, as the kubelets and the agent's checkpoint say -------------------------------------------------


class Owners:
    """Reads the holders of every GPU from both sides: the device-plugin kubelet's admitted pods; the agent's
    checkpoint (claims prepared and being prepared, admin access included) and the DRA kubelet's running pods."""

    def __init__(self, world: World, minors: dict[int, str]) -> None:
        self.world = world
        self.minors = minors  # GPU minor -> UUID
        self.parents: dict[str, str] = {}  # GPU or MIG UUID -> its GPU (a MIG UUID is never reused)
        self.unreadable_checkpoints = 0

    def refresh_parents(self) -> None:
        driver = self.world.driver
        with driver.lock:
            for gpu in driver.gpus:
                self.parents[gpu.uuid] = gpu.uuid
                for _, ci in gpu.mig_devices():
                    self.parents[ci.uuid] = gpu.uuid

    def pods(self) -> dict[str, set[str]]:
        """GPU UUID -> the device-plugin pods holding one of its devices."""
        held: dict[str, set[str]] = {}
        for pod in self.world.kubelet.pods():
            for allocations in (*pod.containers.values(), *pod.init_containers.values()):
                for allocation in allocations.values():
                    for device_id in allocation.device_ids:
                        physical = device_id.split("::", 1)[0]
                        if physical not in self.parents:
                            self.refresh_parents()
                        gpu = self.parents.get(physical, physical)
                        held.setdefault(gpu, set()).add(f"{pod.namespace}/{pod.name} ({pod.uid[:8]})")
        return held

    def claims(self, checkpoint: Checkpoint | None) -> dict[str, set[str]]:
        """GPU UUID -> the claims holding one of its devices."""
        held: dict[str, set[str]] = {}

        def add(device: str, claim: str) -> None:
            minor = gpu_minor_of(device)
            if minor is not None and minor in self.minors:
                held.setdefault(self.minors[minor], set()).add(claim)

        for uid, claim in checkpoint.claims.items() if checkpoint is not None else ():
            for device in claim.devices:
                add(device.device, f"claim {claim.namespace}/{claim.name} {uid[:8]} ({claim.state})")
        dra = self.world.dra
        running = {p.uid for p in dra.pods() if p.running}
        for state in dra.claims():
            if state.pod_uids & running:
                for device in state.devices:
                    add(device.device, f"claim {state.namespace}/{state.name} {state.uid[:8]} (a running pod's)")
        return held

    def checkpoint(self) -> Checkpoint | None:
        """The agent's checkpoint as it is on disk (replaced atomically: never torn)."""
        paths = sorted((self.world.base / "plugins").glob(f"*/{CHECKPOINT_FILE}"))
        try:
            return decode(paths[0].read_bytes()) if paths else None
        except FileNotFoundError:
            return None
        except CheckpointError:
            self.unreadable_checkpoints += 1
            return None


class Holds(Holdings):
    """``Holdings`` for both front ends, three threads, and holds whose end is known after the fact; the destructive
    calls are checked against them as they come in."""

    def __init__(self, driver: SimDriver) -> None:
        super().__init__(driver)
        self.lock = threading.Lock()
        self.checked = 0  # destructive calls checked so far
        self.found: list[str] = []
        self.ended: list[tuple[str, Held]] = []  # what each holder held, once it ended

    def take(self, key: str, physical: list[str]) -> bool:
        """``key`` holds ``physical`` from now on; False (and nothing held) when one no longer exists."""
        with self.lock:
            try:
                self.hold(key, physical)
            except AssertionError:
                return False
            return True

    def drop(self, key: str, at: float | None = None) -> None:
        """``key`` holds nothing from ``at`` (now when None)."""
        with self.lock:
            held = self.open.pop(key, None)
            if held is not None:
                until = time.monotonic() if at is None else at
                self.ended += [(key, replace(h, until=max(h.since, until))) for h in held]

    def holding(self) -> set[str]:
        with self.lock:
            return set(self.open)

    def check(self) -> list[str]:
        """The destructive calls logged since the last check that hit a held device or a scope with processes."""
        calls = self.driver.destructive_calls
        with self.lock:
            new, self.checked = calls[self.checked :], len(calls)
            if not new:
                return []
            held = self.ended + [(key, h) for key, holds in self.open.items() for h in holds]
        bad = [f"{c.symbol} on {c.target} with {c.processes} process(es)" for c in new if c.processes]
        bad += [f"{c.symbol} on {c.target} at {c.at:.3f} while {key} held {h.physical} (since {h.since:.3f})"
                for c in new for key, h in held if h.disturbed_by(c)]  # fmt: skip
        self.found += bad
        return bad


# ----- the actors -----------------------------------------------------------------------------------------------------


@dataclass
class DraWorkload:
    claim: str
    uid: str  # the claim's
    kind: str
    device: str
    pid: int | None = None
    prepared: float = float("inf")  # when its pod started: the claim was recorded by then


@dataclass
class Scenario:
    world: World
    owners: Owners
    holds: Holds
    ops: Counter[str] = field(default_factory=Counter)
    refusals: Counter[str] = field(default_factory=Counter)
    stop: threading.Event = field(default_factory=threading.Event)
    dra_gpus: list[int] = field(default_factory=lambda: [0, 1])
    layout: str = "mixed"  # the config's migLayout.config
    label: str | None = None  # the node label nvidia.com/mig.config (wins over the config when set)
    dra_pods: dict[str, DraWorkload] = field(default_factory=dict)  # pod UID -> its claim and process
    dp_pods: dict[str, int | None] = field(default_factory=dict)  # pod name -> its process
    timesliced: dict[int, tuple[str, int]] = field(default_factory=dict)  # GPU index -> (pod UID, level)
    phantoms: list[str] = field(default_factory=list)  # workloads given a device destroyed before they got it
    recorded_since: dict[str, float] = field(default_factory=dict)  # claim UID -> the first read of it recorded
    numbers: Iterator[int] = field(default_factory=itertools.count)
    crashed: list[str] = field(default_factory=list)

    def refused(self, what: str, error: BaseException) -> None:
        self.ops[f"{what} refused"] += 1
        self.refusals[f"{what}: {_reason(str(error))}"] += 1

    def run(self, name: str, step: Callable[[random.Random], None], seed: int) -> threading.Thread:
        def loop() -> None:
            rng = random.Random(seed)
            pace = threading.Event()
            try:
                while not self.stop.is_set():
                    step(rng)
                    pace.wait(rng.uniform(0.005, 0.05))  # the pace of the users, not a wait for anything
            except Exception as error:  # the actor itself failed: the test says so
                self.crashed.append(f"{name}: {type(error).__name__}: {error}")
                raise

        thread = threading.Thread(target=loop, name=f"actor-{name}", daemon=True)
        thread.start()
        return thread

    # ----- the DRA actor --------------------------------------------------------------------------------------------

    def dra_step(self, rng: random.Random) -> None:
        roll = rng.random()
        if roll < 0.35:
            self.new_claim(rng)
        elif roll < 0.65:
            if self.dra_pods:
                self.end_claim(rng.choice(sorted(self.dra_pods)))
        elif roll < 0.655:
            self.world.dra.restart()
            self.ops["DRA kubelet restart"] += 1
        elif roll < 0.67:
            for uid in sorted(self.dra_pods):  # every claim ends now and then, so that GPUs can move
                self.end_claim(uid)
        elif roll < 0.72:  # the API server slows down or recovers: a Prepare reads its claim from it
            self.world.api.set_latency(rng.choice((0.0, 0.02, 0.05, 0.1)))
            self.ops["API server latency change"] += 1

    def new_claim(self, rng: random.Random) -> None:
        world, n = self.world, next(self.numbers)
        kind, level = rng.choice(CLAIM_KINDS), rng.choice(INTERVALS)
        name, uid = f"claim-{n}", f"dra-pod-{n}"
        parameters = gpu_config({"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": level}})
        try:
            device_class = "mig.nvidia.com" if kind == "mig" else DRIVER
            given = parameters if kind == "timeslice" else None
            claim = allocated(world, name, device_class, "true", admin=kind == "admin", parameters=given)
        except Unschedulable as error:
            self.refused("claim allocation", error)
            world.api.delete("resourceclaims", name, "default")
            return
        self.ops[f"{kind} claim allocated"] += 1
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        workload = self.dra_pods[uid] = DraWorkload(name, claim["metadata"]["uid"], kind, result["device"])
        try:
            ids = world.dra.run_pod("default", f"pod-{n}", uid, [("gpu", name)], {"main": [("gpu", None)]})
        except (PodStartError, RuntimeError) as error:  # RuntimeError: the kubelet is restarting
            self.refused(f"{kind} claim prepare", error)
            self.end_claim(uid)
            return
        self.ops[f"{kind} claim prepared"] += 1
        workload.prepared = time.monotonic()
        # the device the container gets: what the claim's CDI spec gives it
        physical = next(iter(cdi_devices.physical(world.base / "cdi", ids["main"], world.driver)), None)
        if physical is None or not self.exists(physical) or not self.holds.take(f"claim {name}", [physical]):
            self.claim_given_a_missing_device(workload, physical)
            return
        index = self.index_of(physical)
        if kind == "timeslice" and index is not None:
            self.timesliced[index] = (uid, LEVELS[level])
        if rng.random() < 0.5:  # half the workloads run a process; the others are prepared and idle
            workload.pid = 200_000 + n
            if not self.start_process(physical, workload.pid):
                self.claim_given_a_missing_device(workload, physical)

    def end_claim(self, uid: str) -> None:
        """The pod's containers end (their process first), then the kubelet unprepares; again later if it fails.
        The claim holds its device until the agent has unprepared it: from here on the checkpoint says so."""
        workload = self.dra_pods[uid]
        if workload.pid is not None:
            self.world.driver.remove_process(workload.pid)
            workload.pid = None
        self.timesliced = {i: held for i, held in self.timesliced.items() if held[0] != uid}
        self.holds.drop(f"claim {workload.claim}")
        try:
            self.world.dra.stop_pod(uid)
        except KeyError:
            pass  # it never reached the kubelet (which was restarting)
        except (PodStopError, RuntimeError) as error:
            self.refused("claim unprepare", error)
            return
        del self.dra_pods[uid]
        self.world.api.delete("resourceclaims", workload.claim, "default")
        self.ops["claim unprepared"] += 1

    # ----- the node actor -------------------------------------------------------------------------------------------

    def node_step(self, rng: random.Random) -> None:
        roll = rng.random()
        if roll < 0.35:
            self.new_pod(rng)
        elif roll < 0.62:
            if self.dp_pods:
                self.end_pod(rng.choice(sorted(self.dp_pods)))
        elif roll < 0.69:
            self.dra_gpus = sorted(rng.sample(range(GPUS), rng.randint(1, GPUS - 1)))
            write_config(self.world, self.dra_gpus, self.layout)
            self.ops["config change (dra.gpus)"] += 1
        elif roll < 0.74:
            self.layout = rng.choice(sorted(LAYOUTS))
            write_config(self.world, self.dra_gpus, self.layout)
            self.ops["layout change (config)"] += 1
        elif roll < 0.79:
            self.label = rng.choice([None, *sorted(LAYOUTS)])
            self.world.agent.post(NodeLabelChanged(MIG_CONFIG_LABEL, self.label))
            self.ops["layout change (node label)"] += 1
        elif roll < 0.80:
            self.world.kubelet.restart()
            self.ops["device-plugin kubelet restart"] += 1
        elif roll < 0.82:
            for pod in sorted(self.dp_pods):
                self.end_pod(pod)

    def new_pod(self, rng: random.Random) -> None:
        kubelet = self.world.kubelet
        offered = [r for r in kubelet.resources()
                   if not kubelet.stopped(r) and "Healthy" in kubelet.devices(r).values()]  # fmt: skip
        if not offered:
            return
        resource, n = rng.choice(sorted(offered)), next(self.numbers)
        name = f"dp-{n}"
        try:
            pod = kubelet.create_pod(name, {"main": {resource: 1}})
        except AdmissionError as error:
            self.refused("device-plugin pod", error)
            return
        self.ops["device-plugin pod admitted"] += 1
        physical = [i.split("::", 1)[0] for i in pod.containers["main"][resource].device_ids]
        self.dp_pods[name] = None
        if not all(map(self.exists, physical)) or not self.holds.take(f"pod {name}", physical):
            self.holds.found.append(f"pod {name} was given {physical}: {self.why_missing(physical[0])}")
            return
        if rng.random() < 0.5:
            self.dp_pods[name] = pid = 100_000 + n
            if not self.start_process(physical[0], pid):
                self.holds.found.append(f"pod {name} was given {physical}: {self.why_missing(physical[0])}")

    def end_pod(self, name: str) -> None:
        pid = self.dp_pods.pop(name)
        if pid is not None:
            self.world.driver.remove_process(pid)
        self.holds.drop(f"pod {name}")  # before the kubelet frees the device: the agent may act at once
        self.world.kubelet.delete_pod(name)
        self.ops["device-plugin pod deleted"] += 1

    # ----- devices --------------------------------------------------------------------------------------------------

    def index_of(self, physical: str) -> int | None:
        if physical not in self.owners.parents:
            self.owners.refresh_parents()
        parent = self.owners.parents.get(physical)
        return next((g.index for g in self.world.driver.gpus if g.uuid == parent), None)

    def start_process(self, physical: str, pid: int) -> bool:
        """A workload's process starts on its device; False when the node does not have the device (a MIG device
        destroyed, a whole GPU now in MIG mode)."""
        try:
            _start_process(self.world.driver, physical, pid, "compute")
        except ValueError:
            return False
        self.ops["workload process started"] += 1
        return True

    def exists(self, physical: str) -> bool:
        """The node has the device: a MIG device that was not destroyed, a whole GPU not in MIG mode."""
        driver = self.world.driver
        with driver.lock:
            return any(
                (gpu.uuid == physical and not gpu.mig_current)
                or any(ci.uuid == physical for _, ci in gpu.mig_devices())
                for gpu in driver.gpus
            )

    def taken_away(self, physical: str | None) -> DestructiveCall | None:
        """The last call that took the device away (None: none did)."""
        self.owners.refresh_parents()
        gpu = self.owners.parents.get(physical or "")
        whole = ("nvmlDeviceSetMigMode", "reset_gpu")  # these take every MIG device of the GPU with them
        calls = [c for c in self.world.driver.destructive_calls if c.result == Return.SUCCESS
                 and (c.target == physical or (c.target == gpu and c.symbol in whole))]  # fmt: skip
        return calls[-1] if calls else None

    def why_missing(self, physical: str | None) -> str:
        call = self.taken_away(physical)
        if call is None:
            return "the node does not have it, and no call explains why"
        return f"{call.symbol} at {call.at:.3f} took it away"

    def claim_given_a_missing_device(self, workload: DraWorkload, physical: str | None) -> None:
        """A prepared claim's device is not on the node. Taken away once the claim was recorded (PrepareStarted):
        destroyed under a holder. Before: the agent prepared a device it no longer had — a phantom."""
        holder = f"claim {workload.claim} ({workload.device}: {physical})"
        call = self.taken_away(physical)
        recorded = min(self.recorded_since.get(workload.uid, workload.prepared), workload.prepared)
        if call is None or call.at >= recorded:
            self.holds.found.append(f"{holder}: {self.why_missing(physical)}; recorded by {recorded:.3f}")
        else:
            self.phantoms.append(f"{holder}: {self.why_missing(physical)}, before it was recorded ({recorded:.3f})")


def _reason(message: str) -> str:
    """A refusal's gist, to count refusals by kind."""
    for gist in (
        "which DRA no longer serves",  # Prepare: the GPU went to the device plugin after the claim was allocated
        "does not exist on this node",  # Prepare: the device left DRA's view (its GPU is leaving, or re-laid out)
        "is not registered",  # the DRA kubelet restarted and the driver has not registered again yet
        "requested number of devices unavailable",  # every device of the resource is allocated
        "cannot allocate all claims",  # the scheduler found no free device
        "unknown device IDs",  # Allocate of a device the plugin withdrew before the kubelet heard of it
    ):
        if gist in message:
            return gist
    return message[:120]


# ----- the sampler ----------------------------------------------------------------------------------------------------


@dataclass
class Sampler:
    scenario: Scenario
    samples: int = 0
    doubles: Counter[str] = field(default_factory=Counter)  # a GPU with two owners -> the samples that saw it
    timeslices: list[str] = field(default_factory=list)
    unresponsive: list[str] = field(default_factory=list)
    slowest_answer: float = 0.0
    moved: Counter[str] = field(default_factory=Counter)
    mig_states: Counter[str] = field(default_factory=Counter)
    recorded: dict[str, float] = field(default_factory=dict)  # checkpoint hold -> the last read that had it
    stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._run, name="owners-sampler", daemon=True)
        thread.start()
        return thread

    def _run(self) -> None:
        try:
            self._sample_until_stopped()
        except Exception as error:  # the sampler itself failed: the test says so
            self.scenario.crashed.append(f"sampler: {type(error).__name__}: {error}")
            raise

    def _sample_until_stopped(self) -> None:
        agent, pace = self.scenario.world.agent, threading.Event()
        served, state, asked = self._served(), agent.status.mig_state, time.monotonic()
        while not self.stop.is_set():
            self.sample()
            now_served, now_state = self._served(), agent.status.mig_state
            self.moved["GPU moved to DRA"] += len(now_served - served)
            self.moved["GPU back to the device plugin"] += len(served - now_served)
            if now_state != state and now_state is not None:
                self.mig_states[now_state] += 1
            served, state = now_served, now_state
            if time.monotonic() - asked > 1.0:
                asked = time.monotonic()
                self.ask()
            pace.wait(0.01)  # the sampling rate of a monitor, not a wait for an event

    def sample(self) -> None:
        scenario = self.scenario
        owners = scenario.owners
        self.samples += 1
        owners.refresh_parents()  # every MIG device that lives a moment is known by its GPU
        # 1. two owners: each side read twice around the other
        pods1 = owners.pods()
        read = time.monotonic()
        checkpoint1 = owners.checkpoint()
        claims1 = owners.claims(checkpoint1)
        pods2 = owners.pods()
        claims2 = owners.claims(owners.checkpoint())
        for gpu, claims in claims1.items():
            if pods := pods1.get(gpu, set()) & pods2.get(gpu, set()):  # the same pod held it across the claims' read
                self.doubles[f"{gpu}: pod {', '.join(sorted(pods))} and {', '.join(sorted(claims))}"] += 1
        for gpu, pods in pods2.items():
            if claims := claims1.get(gpu, set()) & claims2.get(gpu, set()):  # the same claim across the pods' read
                self.doubles[f"{gpu}: pod {', '.join(sorted(pods))} and {', '.join(sorted(claims))}"] += 1
        # 2. destructive calls under a holder, the checkpoint's claims among the holders
        self._track(checkpoint1, read)
        scenario.holds.check()
        before = dict(scenario.timesliced)
        levels = {g.index: g.timeslice for g in scenario.world.driver.gpus}
        after = dict(scenario.timesliced)
        for index, (uid, level) in before.items():
            if after.get(index) == (uid, level) and levels[index] != level:  # held by the claim across the read
                self.timeslices.append(f"GPU {index} at time-slice {levels[index]}, its claim ({uid}) set {level}")

    def _track(self, checkpoint: Checkpoint | None, read: float) -> None:
        """Every device a recorded claim holds (being prepared, prepared, being unprepared) is held from the read
        that first shows it to the last read that still does."""
        holds, present = self.scenario.holds, {}
        for uid, claim in checkpoint.claims.items() if checkpoint is not None else ():
            for device in claim.devices:
                world = self.scenario.world
                given = cdi_devices.physical(world.base / "cdi", device.cdi_device_ids[:1], world.driver)
                uuid = given[0] if given and given[0] is not None else self._resolve(device.device)
                if uuid is not None:
                    present[f"checkpoint {uid} {device.device}"] = uuid
        holding = holds.holding()
        for key, uuid in present.items():
            if key not in holding and key not in self.recorded:
                holds.take(key, [uuid])  # a device that does not exist is the actor's to judge
                self.scenario.recorded_since.setdefault(key.split()[1], time.monotonic())
            self.recorded[key] = read
        for key in [k for k in self.recorded if k not in present]:
            holds.drop(key, at=self.recorded.pop(key))

    def _resolve(self, device: str) -> str | None:
        """The UUID on the node now of a device a claim is being prepared on (its name: ``gpu-<minor>`` or a MIG
        device's canonical name ending with ``-<GPU-instance profile ID>-<start>``)."""
        driver, minor = self.scenario.world.driver, gpu_minor_of(device)
        with driver.lock:
            gpu = next((g for g in driver.gpus if g.minor_number == minor), None)
            if gpu is None or device == f"gpu-{minor}":
                return gpu.uuid if gpu is not None else None
            profile, start = (int(part) for part in device.rsplit("-", 2)[1:])
            found = (ci.uuid for gi, ci in gpu.mig_devices() if (gi.profile.id, gi.placement[0]) == (profile, start))
            return next(found, None)

    def ask(self) -> None:
        started = time.monotonic()
        if not self.scenario.world.agent.responsive(timeout=10.0):
            self.unresponsive.append(f"the reconcile loop did not answer in 10 s (at {started:.1f})")
        self.slowest_answer = max(self.slowest_answer, time.monotonic() - started)

    def _served(self) -> frozenset[str]:
        dra = self.scenario.world.agent.status.dra or {}
        return frozenset(dra.get("served", ()))  # type: ignore[arg-type]


# ----- the scenario ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("world", "seconds"),
    [
        pytest.param({**NODE_SPEC, **QUICK_CHECKS}, 8, id="ci"),
        pytest.param({**NODE_SPEC, **QUICK_CHECKS}, 600, id="long", marks=[pytest.mark.long, pytest.mark.timeout(900)]),
    ],
    indirect=["world"],
)
@pytest.mark.usefixtures("smi")  # nvidia-smi sets the time-slices claims ask for
def test_both_front_ends_mig_changes_and_kubelet_restarts_never_give_a_gpu_two_owners(
    world: World, figures: dict[str, object], seconds: float, caplog: pytest.LogCaptureFixture
) -> None:
    world.kubelet.serve_dra(world.dra)  # the kubelet's PodResources lists DRA claims too, as on a real node
    world.api.create("deviceclasses", MIG_DEVICE_CLASS)
    inventory = world.agent.status.inventory
    assert inventory is not None
    owners = Owners(world, {g.minor_number: g.uuid for g in inventory.gpus})
    owners.refresh_parents()
    scenario = Scenario(world, owners, Holds(world.driver))
    write_config(world, scenario.dra_gpus, scenario.layout)
    converged(scenario, "the first layout and front ends")
    assert not world.agent.status.internal_errors, world.agent.status.internal_errors

    sampler = Sampler(scenario)
    sampling = sampler.start()
    world.driver.set_fault_rate(0.01, seed=11, code=Return.ERROR_UNKNOWN)
    started = time.monotonic()
    actors = [scenario.run("dra", scenario.dra_step, 24), scenario.run("node", scenario.node_step, 42)]
    try:
        scenario.stop.wait(seconds)  # the scenario's length
    finally:
        scenario.stop.set()
        for actor in actors:
            actor.join(60)
        world.driver.set_fault_rate(0)
        world.api.set_latency(0)
    faulted = dict(world.agent.status.internal_errors)
    assert not scenario.crashed, scenario.crashed
    assert not any(a.is_alive() for a in actors), "an actor is stuck"

    end_everything(scenario)
    converged(scenario, "the last config, with every workload gone")
    sampler.stop.set()
    sampling.join(30)
    sampler.sample()
    sampler.ask()
    after = dict(world.agent.status.internal_errors)
    said = sorted({r.getMessage()[:300] for r in caplog.records if "internal error survived" in r.getMessage()})
    destructive = world.driver.destructive_calls
    figures.update(
        seconds=seconds,
        operations=dict(sorted(scenario.ops.items())),
        refusals=dict(scenario.refusals.most_common(10)),
        hand_overs=dict(sampler.moved),
        mig_states_seen=dict(sampler.mig_states),
        destructive_calls=len(destructive),
        samples=sampler.samples,
        double_holders=len(sampler.doubles),
        destructive_under_a_holder=len(scenario.holds.found),
        time_slice_changed_under_its_claim=len(sampler.timeslices),
        phantom_devices_given=len(scenario.phantoms),
        random_nvml_faults=world.driver.random_faults,
        internal_errors_while_faulted=faulted,
        internal_errors_after=after,
        internal_errors_said=said,
        slowest_loop_answer_s=round(sampler.slowest_answer, 2),
        scenario_seconds=round(time.monotonic() - started, 1),
    )
    if scenario.phantoms:
        figures["phantoms"] = scenario.phantoms[:5]
    assert not sampler.doubles, sampler.doubles.most_common(5)
    assert not scenario.holds.found, scenario.holds.found[:5]
    assert not sampler.timeslices, sampler.timeslices[:5]
    assert not sampler.unresponsive, sampler.unresponsive[:5]
    assert world.thread.is_alive()
    assert after == faulted, f"internal errors without NVML faults: {after} (while faulted: {faulted})"
    assert all("NVML" in message for message in said), f"internal errors no NVML fault explains: {said}"
    assert owners.unreadable_checkpoints == 0
    assert scenario.phantoms == [], "a workload was given a device the node no longer had"
    # it exercised what it is about
    assert scenario.ops["device-plugin pod admitted"] and sum(n for op, n in scenario.ops.items() if "prepared" in op)
    assert sampler.moved["GPU moved to DRA"] and sampler.moved["GPU back to the device plugin"]
    assert sampler.mig_states["success"] > 1, "no MIG layout change went through: the scenario tested nothing"


def end_everything(scenario: Scenario) -> None:
    """Every workload ends: DRA pods stop (again while the kubelet cannot reach the driver) and their claims go,
    pods the DRA kubelet keeps from a failed start are stopped too, device-plugin pods are deleted."""
    world = scenario.world

    def all_stopped() -> bool:
        for uid in sorted(scenario.dra_pods):
            scenario.end_claim(uid)
        for pod in world.dra.pods():
            with contextlib.suppress(PodStopError, KeyError):  # asked again
                world.dra.stop_pod(pod.uid)
        return not scenario.dra_pods and not world.dra.pods()

    test_dra_e2e.poll(all_stopped, "every DRA pod stopped", 60)
    for pod in sorted(scenario.dp_pods):
        scenario.end_pod(pod)
    assert not world.kubelet.pods()


def converged(scenario: Scenario, what: str) -> None:
    """The agent serves what the config asks: DRA exactly its GPUs, registered; the device plugin the others, with
    their layout in place; nothing waits."""
    world = scenario.world
    uuids = {g.index: g.uuid for g in world.driver.gpus}
    wanted = {uuids[i] for i in scenario.dra_gpus}
    expected = LAYOUTS[scenario.label or scenario.layout]

    def settled() -> bool:
        dra = world.agent.status.dra or {}
        served = set(dra.get("served", ()))  # type: ignore[arg-type]
        return served == wanted and not dra.get("leaving") and not dra.get("waiting") and DRIVER in world.dra.drivers()

    def laid_out() -> bool:
        status, layout = world.agent.status, _layout(world.driver)
        return (
            status.mig_state == "success"
            and status.config_error is None
            and all(layout[i] == expected[i] for i in range(GPUS) if uuids[i] not in wanted)
        )

    def state() -> str:
        status = world.agent.status
        return (
            f"DRA {status.dra}; MIG {status.mig_state} {status.mig_error or ''}; layout {_layout(world.driver)}; "
            f"waiting {status.waiting_for}; unread {sorted(status.stale_gpus)}; config error {status.config_error}"
        )

    try:
        test_dra_e2e.poll(settled, f"{what}: DRA serves GPUs {scenario.dra_gpus}", 90)
        # a failed change retries after its backoff (up to a minute)
        test_dra_e2e.poll(laid_out, f"{what}: the layout {scenario.label or scenario.layout}", 150)
    except TimeoutError as error:
        raise TimeoutError(f"{error}; {state()}") from None


# ----- what the scenario found ----------------------------------------------------------------------------------------

TWO_A100 = {"gpus": [{"model": "A100-SXM4-80GB", "count": 2}]}


def laid_out(world: World, index: int, profiles: list[str] | None) -> bool:
    """The GPU has the layout, the MIG manager is done, and the agent has read it."""
    return (
        _layout(world.driver)[index] == profiles
        and world.agent.status.mig_state == "success"
        and _known_migs(world, index) == _real_migs(world.driver, index)
    )


@pytest.mark.parametrize("world", [TWO_A100], indirect=True)
def test_dra_never_prepares_a_mig_device_its_gpu_no_longer_has(world: World) -> None:
    """GPU 0 is the device plugin's, laid out as two 3g.40gb; a layout change makes it three 2g.20gb, and reading
    GPU 0 again fails (an NVML error). The config then gives GPU 0 to DRA: a claim for the 3g.40gb device that is
    gone must not be prepared — the device plugin withdraws a GPU it cannot read, so must DRA."""
    gpu0 = world.driver.gpus[0]
    write_config(world, [1], "all-disabled")  # GPU 0 to the device plugin first, then its layout
    test_dra_e2e.poll(lambda: (world.agent.status.dra or {}).get("served") == [world.driver.gpus[1].uuid], "GPU 1")
    write_config(world, [1], "all-3g.40gb")
    test_dra_e2e.poll(lambda: laid_out(world, 0, ["3g.40gb"] * 2), "GPU 0 laid out and read")
    gone = _real_migs(world.driver, 0)
    probe = allocated(world, "probe", DRIVER, "true")  # a claim as the scheduler allocates it (GPU 1)
    world.api.delete("resourceclaims", "probe", "default")

    world.driver.inject_error("nvmlDeviceGetNumaNodeId", Return.ERROR_UNKNOWN, times=None, gpu_index=0)
    write_config(world, [1], "all-2g.20gb")

    def relaid_unread() -> bool:
        return _layout(world.driver)[0] == ["2g.20gb"] * 3 and gpu0.uuid in world.agent.status.stale_gpus

    test_dra_e2e.poll(relaid_unread, "GPU 0 re-laid out, and not read again")
    write_config(world, [0, 1], "all-2g.20gb")
    test_dra_e2e.poll(lambda: gpu0.uuid in (world.agent.status.dra or {}).get("served", ()), "GPU 0 moved to DRA")

    late = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": "late", "namespace": "default"}, "spec": probe["spec"]}  # fmt: skip
    claim = world.api.create("resourceclaims", late)
    claim["status"] = copy.deepcopy(probe["status"])
    claim["status"].pop("reservedFor", None)
    # allocated from a slice that offered GPU 0's first 3g.40gb device (as DRA's slices do meanwhile)
    claim["status"]["allocation"]["devices"]["results"][0]["device"] = "gpu-0-mig-3g40gb-9-0"
    world.api.update("resourceclaims", claim, status=True)
    try:
        ids = world.dra.run_pod("default", "late", "pod-late", [("gpu", "late")], {"main": [("gpu", None)]})
    except PodStartError as refused:
        assert "gpu-0-mig-3g40gb-9-0" in str(refused)  # refused, naming the device the agent cannot vouch for
    else:
        given = cdi_devices.physical(world.base / "cdi", ids["main"], world.driver)
        pytest.fail(f"prepared on {given}; the layout change destroyed {sorted(gone)}")
    finally:
        world.driver.clear_injected_errors()
    world.api.wait_for(lambda: "gpu-0-mig-2g20gb-14-0" in world.devices(), 60)  # read again (after its backoff)


@pytest.mark.parametrize("world", [TWO_A100], indirect=True)
def test_a_gpu_dra_gives_back_gets_the_layout_of_the_device_plugins_gpus(world: World) -> None:
    world.dra.wait_for(lambda: DRIVER in world.dra.drivers(), test_dra_e2e.DEADLINE, "the DRA driver registered")
    write_config(world, [1], "all-3g.40gb")  # GPU 0 leaves DRA (no claim holds it) for the device plugin
    test_dra_e2e.poll(lambda: (world.agent.status.dra or {}).get("served") == [world.driver.gpus[1].uuid], "GPU 1")
    test_dra_e2e.poll(lambda: laid_out(world, 0, ["3g.40gb"] * 2), "GPU 0 laid out once the device plugin has it", 15)


@pytest.mark.parametrize("world", [TWO_A100], indirect=True)
def test_a_layout_change_whose_compute_instance_failed_once_completes(world: World) -> None:
    write_config(world, [1], "all-disabled")  # GPU 0 to the device plugin first, then its layout
    test_dra_e2e.poll(lambda: (world.agent.status.dra or {}).get("served") == [world.driver.gpus[1].uuid], "GPU 1")
    world.driver.inject_error("nvmlGpuInstanceCreateComputeInstance", Return.ERROR_UNKNOWN, times=1, gpu_index=0)
    write_config(world, [1], "all-3g.40gb")
    test_dra_e2e.poll(lambda: laid_out(world, 0, ["3g.40gb"] * 2), "GPU 0 laid out after one failed attempt", 15)


def _known_migs(world: World, index: int) -> set[str]:
    inventory = world.agent.status.inventory
    return {m.uuid for g in inventory.gpus if g.index == index for m in g.mig_devices} if inventory else set()


def _real_migs(driver: SimDriver, index: int) -> set[str]:
    with driver.lock:
        return {ci.uuid for _, ci in driver.gpus[index].mig_devices()}
