"""The sharing config, one row per rule: YAML in, what the node advertises (or the error the user reads) out.

Rows follow the facts (nvidia-device-plugin.md): §1 config format, parsing, precedence and sharing, §2 names,
§3 replica IDs, §11.1-11.4 NVIDIA's own config cases. Tessera's extensions (per-GPU ``devices``, ``rename``
and ``resources`` honoured, unknown-key warnings) are marked "Tessera". The nodes are simulated and reached
through real pynvml, so the inventories are what discovery really returns.

An outcome is either ``Adv`` — the advertised resources as {name: (device count, sharing, replicas)} and the
warnings the user sees — or ``Err`` — a ``ConfigError`` / ``PlanError`` whose message holds a field path and a
phrase. The second half covers what a config does to allocation: Allocate and GetPreferredAllocation.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from agent.config.effective import FlagOverrides, effective
from agent.config.model import ConfigError
from agent.config.source import parse_document
from agent.core.allocation import (
    VISIBLE_DEVICES_ENV,
    AllocationError,
    DeviceListStrategy,
    container_allocation,
    validate_request,
)
from agent.core.inventory import Inventory
from agent.core.plan import glob_matches, plan
from agent.core.preferred import preferred
from agent.core.resources import AllocationPolicy, PlanError, Resource, ResourcePlan
from agent.gpu.discovery import discover
from agent.sim.nvml.install import simulated_node
from agent.sim.nvml.spec import parse_node_spec

GPU = "nvidia.com/gpu"
SHARED = "nvidia.com/gpu.shared"
MIG_1G = "nvidia.com/mig-1g.10gb"
MIG_3G = "nvidia.com/mig-3g.40gb"
NONE, TS, MPS = "none", "time-slicing", "mps"
ORIGIN = "cfg.yaml"

NODES = {
    "a100x2": {"gpus": [{"model": "A100-SXM4-80GB", "count": 2}]},
    # GPU 0: MIG with 0:0 = 3g.40gb, 0:1 and 0:2 = 1g.10gb (the driver places the big one first); GPU 1 full
    "mig": {
        "gpus": [
            {"model": "A100-SXM4-80GB", "mig": {"instances": ["1g.10gb", "1g.10gb", "3g.40gb"]}},
            {"model": "A100-SXM4-80GB"},
        ]
    },
    "t4": {"gpus": [{"model": "T4"}]},
    # two MIG GPUs with two 1g.10gb each: replicas of MIG devices on two parents
    "mig2": {"gpus": [{"model": "A100-SXM4-80GB", "count": 2, "mig": {"instances": ["1g.10gb", "1g.10gb"]}}]},
}


@pytest.fixture(scope="module")
def nodes() -> Iterator[dict[str, Inventory]]:
    inventories = {}
    for name, spec in NODES.items():
        with simulated_node(parse_node_spec(spec)):
            inventories[name] = discover()
    yield inventories


@dataclass(frozen=True)
class Adv:
    """Advertised: {resource: (devices, sharing, replicas per device)}; each warning phrase must be shown."""

    resources: dict[str, tuple[int, str, int]]
    warns: tuple[str, ...] = ()


@dataclass(frozen=True)
class Err:
    """Refused: one message holds both the field path and the phrase."""

    path: str
    phrase: str


@dataclass(frozen=True)
class Row:
    id: str
    yaml: str
    outcome: Adv | Err
    node: str = "a100x2"


def placeholders(inventory: Inventory) -> dict[str, str]:
    """``@gpu1`` -> GPU 1's UUID, ``@mig0.2`` -> MIG device 0:2's UUID, ``@legacy0.2`` -> its R450 form."""
    values = {}
    for gpu in inventory.gpus:
        values[f"@gpu{gpu.index}"] = gpu.uuid
        for mig in gpu.mig_devices:
            values[f"@mig{gpu.index}.{mig.mig_index}"] = mig.uuid
            values[f"@legacy{gpu.index}.{mig.mig_index}"] = f"MIG-{gpu.uuid}/{mig.gi_id}/{mig.ci_id}"
    return values


def render(text: str, inventory: Inventory) -> str:
    for token, value in sorted(placeholders(inventory).items(), key=lambda kv: -len(kv[0])):
        text = text.replace(token, value)
    return text


def advertise(
    text: str, inventory: Inventory, *, strict: bool = False, overrides: FlagOverrides | None = None
) -> tuple[ResourcePlan, list[str]]:
    model, warnings = parse_document(text, ORIGIN, strict=strict)
    result = plan(effective(model, overrides or FlagOverrides()).plan, inventory)
    return result, warnings + list(result.warnings)


def summary(result: ResourcePlan) -> dict[str, tuple[int, str, int]]:
    return {r.name: (len(r.devices), str(r.sharing), r.replicas) for r in result.resources}


def ts(entry: str, *, group: str = "", before: str = "") -> str:
    """A ``sharing.timeSlicing`` document with one resource entry (``entry``: its YAML mapping lines),
    ``group`` lines next to ``resources`` and ``before`` lines ahead of ``sharing``."""
    lines = "\n".join(f"      {line}" for line in entry.strip().splitlines())
    lines = "    - " + lines.lstrip()
    head = "".join(f"    {line}\n" for line in group.strip().splitlines()) if group else ""
    return f"version: v1\n{before}sharing:\n  timeSlicing:\n{head}    resources:\n{lines}\n"


R0 = "sharing.timeSlicing.resources[0]"
MIG_1G_TS_4 = (
    "flags: {migStrategy: mixed}\nsharing:\n  timeSlicing:\n    resources:\n    - {name: mig-1g.10gb, replicas: 4}\n"
)
LONG_52 = "a" * 52  # nvidia.com/ + 52 = 63 characters: the longest name NVIDIA accepts
UUID = "b1028956-cfa2-0990-bf4a-5da9abb51763"

ROWS = [
    # ----- NVIDIA's documented examples -------------------------------------------------------------
    Row("empty-file-is-all-defaults", "", Adv({GPU: (2, NONE, 1)})),
    Row("comment-only-file-is-all-defaults", "# nothing configured yet\n", Adv({GPU: (2, NONE, 1)})),
    Row("version-only", "version: v1\n", Adv({GPU: (2, NONE, 1)})),
    Row("time-slicing-4-replicas", ts("name: nvidia.com/gpu\nreplicas: 4"), Adv({GPU: (8, TS, 4)})),
    Row(
        "time-slicing-rename-by-default-advertises-only-shared",
        ts("name: nvidia.com/gpu\nreplicas: 4", group="renameByDefault: true"),
        Adv({SHARED: (8, TS, 4)}),
    ),
    Row(
        "time-slicing-fail-requests-greater-than-one",
        ts("name: nvidia.com/gpu\nreplicas: 4", group="failRequestsGreaterThanOne: true"),
        Adv({GPU: (8, TS, 4)}),
    ),
    Row(
        "mps-10-replicas",
        "version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 10\n",
        Adv({GPU: (20, MPS, 10)}),
    ),
    Row(
        "mps-rename-by-default",
        "sharing:\n  mps:\n    renameByDefault: true\n    resources:\n    - {name: gpu, replicas: 2}\n",
        Adv({SHARED: (4, MPS, 2)}),
    ),
    Row(
        "json-document",
        json.dumps(
            {"version": "v1", "sharing": {"timeSlicing": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2}]}}}
        ),
        Adv({GPU: (4, TS, 2)}),
    ),
    Row("short-name-gets-nvidia-prefix", ts("name: gpu\nreplicas: 3"), Adv({GPU: (6, TS, 3)})),
    Row("t4-time-slicing", ts("name: gpu\nreplicas: 4"), Adv({GPU: (4, TS, 4)}), node="t4"),
    Row(
        "mig-mixed-no-sharing",
        "flags:\n  migStrategy: mixed\n",
        Adv({GPU: (1, NONE, 1), MIG_1G: (2, NONE, 1), MIG_3G: (1, NONE, 1)}),
        node="mig",
    ),
    Row(
        "mig-mixed-time-slicing-1g-10gb-x4",
        "version: v1\nflags:\n  migStrategy: mixed\nsharing:\n  timeSlicing:\n    resources:\n"
        "    - name: nvidia.com/mig-1g.10gb\n      replicas: 4\n",
        Adv({GPU: (1, NONE, 1), MIG_1G: (8, TS, 4), MIG_3G: (1, NONE, 1)}),
        node="mig",
    ),
    Row(
        "mig-none-advertises-the-mig-gpu-whole",
        "flags: {migStrategy: none}",
        Adv({GPU: (2, NONE, 1)}, warns=("GPU 0 (@gpu0) has MIG enabled", "CUDA in a pod given it finds no device")),
        node="mig",
    ),
    Row(
        "mig-single-on-a-mixed-mode-node",
        "flags: {migStrategy: single}",
        Err("mig-strategy single", "same MIG mode"),
        node="mig",
    ),
    Row(
        "sharing-a-name-no-device-has-is-a-warning",
        ts("name: nvidia.com/mig-1g.10gb\nreplicas: 4"),
        Adv({GPU: (2, NONE, 1)}, warns=(f"{R0}: no device on this node is nvidia.com/mig-1g.10gb",)),
    ),
    # ----- version ------------------------------------------------------------------------------------
    Row("version-number-1-is-text-1", "version: 1", Err("version", "unknown version: 1")),
    Row("version-v2", "version: v2", Err("version", "unknown version: v2")),
    Row("version-bool", "version: true", Err("version", "unknown version: true")),
    Row("version-empty-is-v1", 'version: ""', Adv({GPU: (2, NONE, 1)})),
    Row("version-null-is-v1", "version:\n", Adv({GPU: (2, NONE, 1)})),
    # ----- replicas -----------------------------------------------------------------------------------
    Row("replicas-1", ts("name: gpu\nreplicas: 1"), Err(f"{R0}.replicas", "number of replicas must be >= 2")),
    Row("replicas-0", ts("name: gpu\nreplicas: 0"), Err(f"{R0}.replicas", "number of replicas must be >= 2")),
    Row("replicas-negative", ts("name: gpu\nreplicas: -1"), Err(f"{R0}.replicas", "number of replicas must be >= 2")),
    Row("replicas-missing", ts("name: gpu"), Err(f"{R0}.replicas", "required field is missing")),
    Row("replicas-null", ts("name: gpu\nreplicas:"), Err(f"{R0}.replicas", "expected a whole number, got nothing")),
    Row("replicas-as-text", ts('name: gpu\nreplicas: "4"'), Err(f"{R0}.replicas", "got the text '4'")),
    Row("replicas-float", ts("name: gpu\nreplicas: 2.0"), Err(f"{R0}.replicas", "whole number, got the number 2.0")),
    Row("replicas-bool", ts("name: gpu\nreplicas: true"), Err(f"{R0}.replicas", "whole number, got the boolean true")),
    Row("replicas-no-upper-bound", ts("name: gpu\nreplicas: 48"), Adv({GPU: (96, TS, 48)})),
    # ----- resources list -----------------------------------------------------------------------------
    Row(
        "resources-missing",
        "sharing:\n  timeSlicing: {}\n",
        Err("sharing.timeSlicing.resources", "required field is missing"),
    ),
    Row(
        "resources-empty",
        "sharing:\n  timeSlicing:\n    resources: []\n",
        Err("sharing.timeSlicing.resources", "no resources specified"),
    ),
    Row(
        "mps-resources-empty",
        "sharing:\n  mps:\n    resources: []\n",
        Err("sharing.mps.resources", "no resources specified"),
    ),
    Row(
        "resources-null",
        "sharing:\n  timeSlicing:\n    resources:\n",
        Err("sharing.timeSlicing.resources", "expected a list, got nothing"),
    ),
    Row("time-slicing-null-is-no-sharing", "sharing:\n  timeSlicing:\n", Adv({GPU: (2, NONE, 1)})),
    # ----- devices ------------------------------------------------------------------------------------
    Row("devices-all", ts("name: gpu\nreplicas: 2\ndevices: all"), Adv({GPU: (4, TS, 2)})),
    Row(
        "devices-other-string",
        ts("name: gpu\nreplicas: 2\ndevices: not-all"),
        Err(f"{R0}.devices", "devices set as 'not-all' but the only valid string input is 'all'"),
    ),
    Row(
        "devices-empty-string",
        ts('name: gpu\nreplicas: 2\ndevices: ""'),
        Err(f"{R0}.devices", "the only valid string input is 'all'"),
    ),
    Row("devices-0", ts("name: gpu\nreplicas: 2\ndevices: 0"), Err(f"{R0}.devices", "a count of devices must be > 0")),
    Row(
        "devices-negative",
        ts("name: gpu\nreplicas: 2\ndevices: -2"),
        Err(f"{R0}.devices", "a count of devices must be > 0"),
    ),
    Row("devices-float", ts("name: gpu\nreplicas: 2\ndevices: 2.0"), Err(f"{R0}.devices", "got the number 2.0")),
    Row("devices-bool", ts("name: gpu\nreplicas: 2\ndevices: true"), Err(f"{R0}.devices", "'all', a count or a list")),
    Row(
        "devices-list-negative-int",
        ts("name: gpu\nreplicas: 2\ndevices: [-1]"),
        Err(f"{R0}.devices", "unsupported device -1"),
    ),
    Row(
        "devices-list-negative-text",
        ts('name: gpu\nreplicas: 2\ndevices: ["-1"]'),
        Err(f"{R0}.devices", "unsupported device '-1'"),
    ),
    Row(
        "devices-list-invalid-text",
        ts('name: gpu\nreplicas: 2\ndevices: ["invalid-UUID"]'),
        Err(f"{R0}.devices", "unsupported device 'invalid-UUID'"),
    ),
    Row(
        "devices-list-gpu-uuid-not-a-uuid",
        ts('name: gpu\nreplicas: 2\ndevices: ["GPU-UUID"]'),
        Err(f"{R0}.devices", "unsupported device 'GPU-UUID'"),
    ),
    Row(
        "devices-list-mig-uuid-not-a-uuid",
        ts('name: gpu\nreplicas: 2\ndevices: ["MIG-UUID"]'),
        Err(f"{R0}.devices", "unsupported device 'MIG-UUID'"),
    ),
    Row(
        "devices-list-legacy-mig-without-gi-ci",
        ts(f'name: gpu\nreplicas: 2\ndevices: ["MIG-GPU-{UUID}"]'),
        Err(f"{R0}.devices", "unsupported device"),
    ),
    Row(
        "devices-list-float",
        ts("name: gpu\nreplicas: 2\ndevices: [1.5]"),
        Err(f"{R0}.devices", "unsupported device 1.5"),
    ),
    Row(
        "devices-list-nested",
        ts("name: gpu\nreplicas: 2\ndevices: [[0]]"),
        Err(f"{R0}.devices", "unsupported device [0]"),
    ),
    Row("devices-count-2-is-both", ts("name: gpu\nreplicas: 2\ndevices: 2"), Adv({GPU: (4, TS, 2)})),
    Row(
        "devices-count-more-than-the-node-has",
        ts("name: gpu\nreplicas: 2\ndevices: 3"),
        Err(f"{R0}.devices", "3 devices requested but nvidia.com/gpu has 2 on this node"),
    ),
    Row(
        "devices-index-the-node-lacks",
        ts("name: gpu\nreplicas: 2\ndevices: [5]"),
        Err(f"{R0}.devices[0]", "'5' is not a nvidia.com/gpu device on this node"),
    ),
    Row(
        "devices-subset-without-rename-would-mix",
        ts("name: gpu\nreplicas: 2\ndevices: [0]"),
        Err(R0, "would mix shared and dedicated devices"),
    ),
    # ----- per-GPU sharing (Tessera: NVIDIA forces devices to all) --------------------------------------
    Row(
        "per-gpu-index-0",
        ts("name: gpu\nreplicas: 3\ndevices: [0]", group="renameByDefault: true"),
        Adv({GPU: (1, NONE, 1), SHARED: (3, TS, 3)}),
    ),
    Row(
        "per-gpu-index-1-as-text",
        ts('name: gpu\nreplicas: 3\ndevices: ["1"]', group="renameByDefault: true"),
        Adv({GPU: (1, NONE, 1), SHARED: (3, TS, 3)}),
    ),
    Row(
        "per-gpu-count-1",
        ts("name: gpu\nreplicas: 3\ndevices: 1", group="renameByDefault: true"),
        Adv({GPU: (1, NONE, 1), SHARED: (3, TS, 3)}),
    ),
    Row(
        "per-gpu-uuid",
        ts("name: gpu\nreplicas: 3\ndevices: [@gpu1]", group="renameByDefault: true"),
        Adv({GPU: (1, NONE, 1), SHARED: (3, TS, 3)}),
    ),
    Row(
        "per-gpu-explicit-rename",
        ts("name: gpu\nrename: gpu-ts\nreplicas: 3\ndevices: [1]"),
        Adv({GPU: (1, NONE, 1), "nvidia.com/gpu-ts": (3, TS, 3)}),
    ),
    Row(
        "per-gpu-mps",
        "sharing:\n  mps:\n    renameByDefault: true\n    resources:\n    - {name: gpu, replicas: 4, devices: [0]}\n",
        Adv({GPU: (1, NONE, 1), SHARED: (4, MPS, 4)}),
    ),
    Row(
        "per-gpu-two-entries-two-names",
        "sharing:\n  timeSlicing:\n    resources:\n"
        "    - {name: gpu, rename: gpu-2x, replicas: 2, devices: [0]}\n"
        "    - {name: gpu, rename: gpu-4x, replicas: 4, devices: [1]}\n",
        Adv({"nvidia.com/gpu-2x": (2, TS, 2), "nvidia.com/gpu-4x": (4, TS, 4)}),
    ),
    Row(
        "per-gpu-two-entries-one-name-same-replicas",
        "sharing:\n  timeSlicing:\n    renameByDefault: true\n    resources:\n"
        "    - {name: gpu, replicas: 3, devices: [0]}\n    - {name: gpu, replicas: 3, devices: [1]}\n",
        Adv({SHARED: (6, TS, 3)}),
    ),
    Row(
        "per-gpu-one-name-two-replica-counts",
        "sharing:\n  timeSlicing:\n    renameByDefault: true\n    resources:\n"
        "    - {name: gpu, replicas: 2, devices: [0]}\n    - {name: gpu, replicas: 4, devices: [1]}\n",
        Err("sharing.timeSlicing.resources[1]", "one resource has one replica count"),
    ),
    Row(
        "two-entries-claim-gpu-0",
        "sharing:\n  timeSlicing:\n    renameByDefault: true\n    resources:\n"
        "    - {name: gpu, replicas: 3, devices: [0]}\n    - {name: gpu, replicas: 3, devices: [@gpu0]}\n",
        Err("sharing.timeSlicing.resources[1]", "GPU 0 (@gpu0) is already shared by sharing.timeSlicing.resources[0]"),
    ),
    Row(
        "duplicate-names-nvidia-takes-the-max-tessera-refuses",
        "sharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, replicas: 2}\n    - {name: gpu, replicas: 4}\n",
        Err("sharing.timeSlicing.resources[1]", "is already shared by sharing.timeSlicing.resources[0]"),
    ),
    Row(
        "per-mig-index-0-1",
        "flags: {migStrategy: mixed}\nsharing:\n  timeSlicing:\n    renameByDefault: true\n    resources:\n"
        '    - {name: mig-1g.10gb, replicas: 4, devices: ["0:1"]}\n',
        Adv({GPU: (1, NONE, 1), MIG_1G: (1, NONE, 1), f"{MIG_1G}.shared": (4, TS, 4), MIG_3G: (1, NONE, 1)}),
        node="mig",
    ),
    Row(
        "per-mig-uuid",
        "flags: {migStrategy: mixed}\nsharing:\n  timeSlicing:\n    renameByDefault: true\n    resources:\n"
        "    - {name: mig-1g.10gb, replicas: 2, devices: [@mig0.2]}\n",
        Adv({GPU: (1, NONE, 1), MIG_1G: (1, NONE, 1), f"{MIG_1G}.shared": (2, TS, 2), MIG_3G: (1, NONE, 1)}),
        node="mig",
    ),
    Row(
        "per-mig-legacy-r450-uuid",
        "flags: {migStrategy: mixed}\nsharing:\n  timeSlicing:\n    renameByDefault: true\n    resources:\n"
        "    - {name: mig-1g.10gb, replicas: 2, devices: [@legacy0.1]}\n",
        Adv({GPU: (1, NONE, 1), MIG_1G: (1, NONE, 1), f"{MIG_1G}.shared": (2, TS, 2), MIG_3G: (1, NONE, 1)}),
        node="mig",
    ),
    Row(
        "per-mig-gpu-index-is-not-a-mig-device",
        "flags: {migStrategy: mixed}\nsharing:\n  timeSlicing:\n    renameByDefault: true\n    resources:\n"
        "    - {name: mig-1g.10gb, replicas: 2, devices: [0]}\n",
        Err(f"{R0}.devices[0]", "'0' is not a nvidia.com/mig-1g.10gb device"),
        node="mig",
    ),
    Row(
        "full-gpu-next-to-mig-gpu-shared-alone",
        "flags: {migStrategy: mixed}\nsharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, replicas: 2}\n",
        Adv({GPU: (2, TS, 2), MIG_1G: (2, NONE, 1), MIG_3G: (1, NONE, 1)}),
        node="mig",
    ),
    # ----- names and renames --------------------------------------------------------------------------
    Row("name-missing", ts("replicas: 2"), Err(f"{R0}.name", "required field is missing")),
    Row("name-invalid", ts("name: $invalid$\nreplicas: 2"), Err(f"{R0}.name", "incorrect format for resource name")),
    Row(
        "name-other-domain-gets-nvidia-prefix-and-fails",
        ts("name: example.com/gpu\nreplicas: 2"),
        Err(f"{R0}.name", "'nvidia.com/example.com/gpu'"),
    ),
    Row("name-upper-case", ts("name: GPU\nreplicas: 2"), Err(f"{R0}.name", "incorrect format for resource name")),
    Row("name-underscore", ts("name: gpu_x\nreplicas: 2"), Err(f"{R0}.name", "incorrect format for resource name")),
    Row(
        "name-64-characters",
        ts(f"name: nvidia.com/{LONG_52}b\nreplicas: 2"),
        Err(f"{R0}.name", "must be 63 characters or less"),
    ),
    Row(
        "rename-invalid",
        ts("name: gpu\nrename: $invalid$\nreplicas: 2"),
        Err(f"{R0}.rename", "incorrect format for resource name"),
    ),
    Row(
        "rename-63-characters-with-auto-prefix",
        ts(f"name: gpu\nrename: {LONG_52}\nreplicas: 2"),
        Adv({f"nvidia.com/{LONG_52}": (4, TS, 2)}),
    ),
    Row(
        "rename-64-characters",
        ts(f"name: gpu\nrename: {LONG_52}b\nreplicas: 2"),
        Err(f"{R0}.rename", "fully-qualified resource name must be 63 characters or less"),
    ),
    Row(
        "rename-already-prefixed",
        ts("name: gpu\nrename: nvidia.com/valid-shared\nreplicas: 2"),
        Adv({"nvidia.com/valid-shared": (4, TS, 2)}),
    ),
    Row("rename-empty-is-no-rename", ts('name: gpu\nrename: ""\nreplicas: 2'), Adv({GPU: (4, TS, 2)})),
    Row("rename-yaml-number-is-text", ts("name: gpu\nrename: 5\nreplicas: 2"), Adv({"nvidia.com/5": (4, TS, 2)})),
    Row(
        "rename-beats-rename-by-default",  # Tessera: NVIDIA forces <name>.shared here
        ts("name: gpu\nrename: mine\nreplicas: 2", group="renameByDefault: true"),
        Adv({"nvidia.com/mine": (4, TS, 2)}),
    ),
    # ----- flags --------------------------------------------------------------------------------------
    Row(
        "device-list-strategy-string", "flags:\n  plugin:\n    deviceListStrategy: cdi-cri\n", Adv({GPU: (2, NONE, 1)})
    ),
    Row(
        "device-list-strategy-list",
        "flags:\n  plugin:\n    deviceListStrategy: [envvar, cdi-annotations]\n",
        Adv({GPU: (2, NONE, 1)}),
    ),
    Row(
        "device-list-strategy-bad-string",
        "flags:\n  plugin:\n    deviceListStrategy: bogus\n",
        Err("flags.plugin.deviceListStrategy[0]", "got 'bogus'"),  # a single string is read as a list of one
    ),
    Row(
        "device-list-strategy-bad-list-item",
        "flags:\n  plugin:\n    deviceListStrategy: [envvar, bogus]\n",
        Err("flags.plugin.deviceListStrategy[1]", "got 'bogus'"),
    ),
    Row("mig-strategy-bad", "flags:\n  migStrategy: bogus\n", Err("flags.migStrategy", "got 'bogus'")),
    Row("mig-strategy-upper-case-value", "flags:\n  migStrategy: MIXED\n", Err("flags.migStrategy", "got 'MIXED'")),
    Row(
        "bool-flag-as-text",
        'flags:\n  failOnInitError: "true"\n',
        Err("flags.failOnInitError", "got the text 'true': write it without quotes"),
    ),
    Row("bool-flag-yaml-1-1-yes", "flags:\n  failOnInitError: yes\n", Adv({GPU: (2, NONE, 1)})),
    Row(
        "plugin-bool-flag-as-text",
        'flags:\n  plugin:\n    passDeviceSpecs: "false"\n',
        Err("flags.plugin.passDeviceSpecs", "write it without quotes"),
    ),
    Row(
        "device-id-strategy-bad",
        "flags:\n  plugin:\n    deviceIDStrategy: serial\n",
        Err("flags.plugin.deviceIDStrategy", "got 'serial'"),
    ),
    Row(
        "allocation-policy-bad",
        "flags:\n  plugin:\n    sharedDevicesAllocationPolicy: spread\n",
        Err("flags.plugin.sharedDevicesAllocationPolicy", "got 'spread'"),
    ),
    Row(
        "text-flag-yaml-number-is-text",
        "flags:\n  plugin:\n    cdiAnnotationPrefix: 5\n  gfd:\n    sleepInterval: 60\n",
        Adv({GPU: (2, NONE, 1)}, warns=("flags.plugin.cdiAnnotationPrefix: ",)),  # read as text, then not honoured
    ),
    Row(
        "mps-root-must-be-an-absolute-path",
        "flags:\n  mpsRoot: 5\n",
        Err("flags.mpsRoot", "must be an absolute path"),
    ),
    Row(
        "mps-root-without-dot-dot",
        "flags:\n  mpsRoot: /run/../etc\n",
        Err("flags.mpsRoot", "without '..'"),
    ),
    Row("flags-all-commented-out", "version: v1\nflags:\n  # migStrategy: mixed\n", Adv({GPU: (2, NONE, 1)})),
    # ----- imex ---------------------------------------------------------------------------------------
    Row("imex-channel-0", "imex:\n  channelIDs: [0]\n", Adv({GPU: (2, NONE, 1)})),
    Row("imex-no-channels", "imex:\n  channelIDs: []\n", Adv({GPU: (2, NONE, 1)})),
    Row("imex-channels-null", "imex:\n  channelIDs:\n", Adv({GPU: (2, NONE, 1)})),
    Row(
        "imex-channel-2",
        "imex:\n  channelIDs: [2]\n",
        Err("imex.channelIDs", "channelIDs must be [] or [0]; found [2]"),
    ),
    Row("imex-channel-as-text", 'imex:\n  channelIDs: ["0"]\n', Err("imex.channelIDs[0]", "write it without quotes")),
    Row(
        "imex-required-as-text",
        'imex:\n  required: "yes"\n',
        Err("imex.required", "expected a boolean (true or false), got the text 'yes': write it without quotes"),
    ),
    # ----- key case -----------------------------------------------------------------------------------
    Row(
        "section-keys-any-case",
        "VERSION: v1\nSharing:\n  TIMESLICING:\n    resources:\n    - {name: gpu, replicas: 3}\n",
        Adv({GPU: (6, TS, 3)}),
    ),
    Row("section-key-case-still-validates", "Version: v2", Err("version", "unknown version: v2")),
    Row(
        "flags-keys-any-case",
        "Flags:\n  MIGSTRATEGY: mixed\n",
        Adv({GPU: (1, NONE, 1), MIG_1G: (2, NONE, 1), MIG_3G: (1, NONE, 1)}),
        node="mig",
    ),
    Row(
        "plugin-keys-any-case",
        "flags:\n  Plugin:\n    devicelistSTRATEGY: bogus\n",
        Err("flags.plugin.deviceListStrategy[0]", "got 'bogus'"),  # a single string is read as a list of one
    ),
    Row("imex-keys-any-case", "IMEX:\n  channelids: [3]\n", Err("imex.channelIDs", "found [3]")),
    Row(
        "group-keys-are-exact-resources",
        "sharing:\n  timeSlicing:\n    Resources:\n    - {name: gpu, replicas: 2}\n",
        Err("sharing.timeSlicing.resources", "required field is missing"),
    ),
    Row(
        "group-keys-are-exact-rename-by-default",
        ts("name: gpu\nreplicas: 2", group="RenameByDefault: true"),
        Adv(
            {GPU: (4, TS, 2)},
            warns=(
                "unknown key sharing.timeSlicing.RenameByDefault is ignored; did you mean "
                "sharing.timeSlicing.renameByDefault?",
            ),
        ),
    ),
    Row("entry-keys-are-exact", ts("Name: gpu\nreplicas: 2"), Err(f"{R0}.name", "required field is missing")),
    Row(
        "naming-rule-keys-are-exact",
        "resources:\n  gpus:\n  - {Pattern: '*', name: any}\n",
        Err("resources.gpus[0].pattern", "required field is missing"),
    ),
    Row(
        "resources-section-keys-any-case",
        "resources:\n  GPUs:\n  - {pattern: '*A100*', name: a100}\n",
        Adv({"nvidia.com/a100": (2, NONE, 1)}),
    ),
    # ----- unknown keys -------------------------------------------------------------------------------
    Row(
        "typo-time-slice-turns-sharing-off-with-a-warning",
        "sharing:\n  timeSlice:\n    resources:\n    - {name: gpu, replicas: 4}\n",
        Adv(
            {GPU: (2, NONE, 1)}, warns=("unknown key sharing.timeSlice is ignored; did you mean sharing.timeSlicing?",)
        ),
    ),
    Row(
        "typo-top-level",
        "sharng:\n  timeSlicing: {}\n",
        Adv({GPU: (2, NONE, 1)}, warns=("unknown key sharng is ignored; did you mean sharing?",)),
    ),
    Row(
        "typo-flag",
        "flags:\n  migStrategey: mixed\n",
        Adv({GPU: (2, NONE, 1)}, warns=("unknown key flags.migStrategey is ignored; did you mean flags.migStrategy?",)),
    ),
    Row(
        # NVIDIA's decoder matches keys case-insensitively but never a snake_case spelling: ignored there, warned here
        "snake-case-flag-is-not-the-flag",
        "flags:\n  mig_strategy: mixed\n",
        Adv({GPU: (2, NONE, 1)}, warns=("unknown key flags.mig_strategy is ignored; did you mean flags.migStrategy?",)),
    ),
    Row(
        "snake-case-entry-key-is-not-the-key",
        ts("name: gpu\nreplicas: 2\nmemory_limit: 10Gi"),
        Adv({GPU: (4, TS, 2)}, warns=(f"unknown key {R0}.memory_limit is ignored; did you mean {R0}.memoryLimit?",)),
    ),
    Row(
        "number-key-is-unknown-not-an-error",
        "1: x\n",
        Adv({GPU: (2, NONE, 1)}, warns=("unknown key 1 is ignored; known keys here: version, flags, resources",)),
    ),
    Row(
        "typo-inside-entry",
        ts("name: gpu\nreplicas: 2\ndevice: [0]"),
        Adv({GPU: (4, TS, 2)}, warns=(f"unknown key {R0}.device is ignored; did you mean {R0}.devices?",)),
    ),
    Row(
        "unrelated-key-lists-the-known-ones",
        "colour: blue\n",
        Adv({GPU: (2, NONE, 1)}, warns=("unknown key colour is ignored; known keys here: version, flags",)),
    ),
    Row(
        "both-time-slicing-and-mps-mps-wins",
        "sharing:\n  timeSlicing:\n    resources:\n    - {name: gpu, replicas: 8}\n"
        "  mps:\n    resources:\n    - {name: gpu, replicas: 2}\n",
        Adv(
            {GPU: (4, MPS, 2)}, warns=("sharing has both timeSlicing and mps; mps is used and timeSlicing is ignored",)
        ),
    ),
    Row(
        "both-time-slicing-and-mps-bad-time-slicing-still-fails",
        "sharing:\n  timeSlicing:\n    resources: []\n  mps:\n    resources:\n    - {name: gpu, replicas: 2}\n",
        Err("sharing.timeSlicing.resources", "no resources specified"),
    ),
    # ----- resources naming rules (Tessera honours them; NVIDIA validates then discards) ----------------
    Row(
        "naming-gpus-glob",
        "resources:\n  gpus:\n  - {pattern: '*A100*', name: a100}\n",
        Adv({"nvidia.com/a100": (2, NONE, 1)}),
    ),
    Row(
        "naming-gpus-glob-is-anchored",
        "resources:\n  gpus:\n  - {pattern: 'A100*', name: a100}\n",
        Adv({GPU: (2, NONE, 1)}),
    ),
    Row(
        "naming-gpus-exact-product",
        "resources:\n  gpus:\n  - {pattern: NVIDIA A100-SXM4-80GB, name: a100-80gb}\n",
        Adv({"nvidia.com/a100-80gb": (2, NONE, 1)}),
    ),
    Row(
        "naming-first-matching-rule-wins",
        "resources:\n  gpus:\n  - {pattern: '*T4', name: t4}\n  - {pattern: '*A100*', name: a100}\n"
        "  - {pattern: '*', name: other}\n",
        Adv({"nvidia.com/a100": (2, NONE, 1)}),
    ),
    Row(
        "naming-then-sharing-the-new-name",
        "resources:\n  gpus:\n  - {pattern: '*A100*', name: a100}\nsharing:\n  timeSlicing:\n    resources:\n"
        "    - {name: a100, replicas: 2}\n",
        Adv({"nvidia.com/a100": (4, TS, 2)}),
    ),
    Row(
        "naming-mig-profiles",
        "flags: {migStrategy: mixed}\nresources:\n  mig:\n  - {pattern: '1g.*', name: mig-small}\n",
        Adv({GPU: (1, NONE, 1), "nvidia.com/mig-small": (2, NONE, 1), MIG_3G: (1, NONE, 1)}),
        node="mig",
    ),
    Row(
        "naming-mig-exact-profile",
        "flags: {migStrategy: mixed}\nresources:\n  mig:\n  - {pattern: 3g.40gb, name: mig-big}\n",
        Adv({GPU: (1, NONE, 1), MIG_1G: (2, NONE, 1), "nvidia.com/mig-big": (1, NONE, 1)}),
        node="mig",
    ),
    Row(
        "naming-pattern-missing",
        "resources:\n  gpus:\n  - {name: a100}\n",
        Err("resources.gpus[0].pattern", "required field is missing"),
    ),
    Row(
        "naming-name-missing",
        "resources:\n  mig:\n  - {pattern: '*'}\n",
        Err("resources.mig[0].name", "required field is missing"),
    ),
    Row(
        "naming-name-invalid",
        "resources:\n  gpus:\n  - {pattern: '*', name: A100}\n",
        Err("resources.gpus[0].name", "incorrect format for resource name 'nvidia.com/A100'"),
    ),
    # ----- whole documents ----------------------------------------------------------------------------
    Row("tessera-match-does-not-change-the-plan", 'match: "NVIDIA A100*"\n', Adv({GPU: (2, NONE, 1)})),
    # in the writer's terms, never pydantic's ("a valid dictionary or instance of ConfigModel")
    Row("top-level-list", "- version: v1\n", Err("(top level)", "expected a mapping of keys to values, got a list")),
    Row("top-level-number", "42\n", Err("(top level)", "expected a mapping of keys to values, got the number 42")),
    Row(
        "section-text",
        "version: v1\nsharing: mps\n",
        Err("sharing", "expected a mapping of keys to values, got the text 'mps'"),
    ),
    Row(
        "list-expected",
        "sharing: {timeSlicing: {resources: 3}}\n",
        Err("sharing.timeSlicing.resources", "expected a list"),
    ),
    Row("not-yaml", "sharing: [\n", Err("", "not valid YAML or JSON")),
]


@pytest.mark.parametrize("row", ROWS, ids=[row.id for row in ROWS])
def test_config_row(row: Row, nodes: dict[str, Inventory]):
    inventory = nodes[row.node]
    text = render(row.yaml, inventory)
    if isinstance(row.outcome, Adv):
        result, warnings = advertise(text, inventory)
        assert summary(result) == row.outcome.resources
        for phrase in row.outcome.warns:
            assert any(render(phrase, inventory) in w for w in warnings), (phrase, warnings)
        if not row.outcome.warns:
            assert warnings == []
        return
    path, phrase = row.outcome.path, render(row.outcome.phrase, inventory)
    with pytest.raises((ConfigError, PlanError)) as raised:
        advertise(text, inventory)
    if isinstance(raised.value, ConfigError):
        assert ORIGIN in str(raised.value)
        assert raised.value.problems
        assert any(p.startswith(f"{path}: " if path else "") and phrase in p for p in raised.value.problems), (
            raised.value.problems
        )
    else:
        message = str(raised.value)
        assert path in message
        assert phrase in message


# ----- which GPU a per-GPU rule shares -------------------------------------------------------------------

PER_GPU = [
    ("devices: [0]", 0),
    ('devices: ["0"]', 0),
    ("devices: [1]", 1),
    ("devices: 1", 0),  # a count takes the first devices in index order (NVIDIA: random map order)
    ("devices: [@gpu1]", 1),
    ("devices: [@gpu0, 0]", 0),  # the same GPU twice is one GPU
]


@pytest.mark.parametrize(("selector", "shared_index"), PER_GPU)
def test_per_gpu_rule_shares_exactly_the_selected_gpu(selector: str, shared_index: int, nodes: dict[str, Inventory]):
    inventory = nodes["a100x2"]
    text = render(ts(f"name: gpu\nreplicas: 3\n{selector}", group="renameByDefault: true"), inventory)
    result, _ = advertise(text, inventory)
    shared, dedicated = result.resource(SHARED), result.resource(GPU)
    assert shared is not None and dedicated is not None
    shared_uuid = inventory.gpus[shared_index].uuid
    assert [d.id for d in shared.devices] == [f"{shared_uuid}::{n}" for n in range(3)]
    assert [d.id for d in dedicated.devices] == [inventory.gpus[1 - shared_index].uuid]


def test_mig_time_slicing_replicas_are_the_mig_uuids_with_suffixes(nodes: dict[str, Inventory]):
    inventory = nodes["mig"]
    text = MIG_1G_TS_4
    result, _ = advertise(text, inventory)
    small = [m for m in inventory.gpus[0].mig_devices if m.profile == "1g.10gb"]
    resource = result.resource(MIG_1G)
    assert resource is not None
    assert [d.id for d in resource.devices] == [f"{m.uuid}::{n}" for m in small for n in range(4)]
    assert {d.index for d in resource.devices} == {"0:1", "0:2"}


def test_strict_mode_rejects_what_lenient_mode_only_warns_about(nodes: dict[str, Inventory]):
    text = "sharing:\n  timeSlice:\n    resources:\n    - {name: gpu, replicas: 4}\n"
    _, warnings = advertise(text, nodes["a100x2"])
    assert warnings
    with pytest.raises(ConfigError) as raised:
        advertise(text, nodes["a100x2"], strict=True)
    assert raised.value.problems == ["unknown key sharing.timeSlice is ignored; did you mean sharing.timeSlicing?"]


# rows whose warnings come from parsing (not from planning against the node): strict mode refuses them
PARSE_WARNING_ROWS = [
    r
    for r in ROWS
    if isinstance(r.outcome, Adv)
    and r.outcome.warns
    and not any(planned in r.outcome.warns[0] for planned in ("no device on this node", "has MIG enabled"))
]


@pytest.mark.parametrize("row", PARSE_WARNING_ROWS, ids=[r.id for r in PARSE_WARNING_ROWS])
def test_strict_mode_refuses_every_row_that_warns_at_parse_time(row: Row, nodes: dict[str, Inventory]):
    with pytest.raises(ConfigError) as raised:
        advertise(render(row.yaml, nodes[row.node]), nodes[row.node], strict=True)
    assert any(row.outcome.warns[0] in p for p in raised.value.problems)


def test_strict_mode_accepts_a_clean_config(nodes: dict[str, Inventory]):
    result, warnings = advertise(ts("name: gpu\nreplicas: 2"), nodes["a100x2"], strict=True)
    assert summary(result) == {GPU: (4, TS, 2)}
    assert warnings == []


def test_every_problem_of_a_bad_document_is_reported_at_once(nodes: dict[str, Inventory]):
    text = "version: v9\nflags: {migStrategy: bogus}\nsharing:\n  timeSlicing:\n    resources:\n    - {name: gpu}\n"
    with pytest.raises(ConfigError) as raised:
        advertise(text, nodes["a100x2"])
    paths = [p.split(": ", 1)[0] for p in raised.value.problems]
    assert paths == ["version", "flags.migStrategy", f"{R0}.replicas"]


# ----- precedence and the failRequestsGreaterThanOne default (§1.2, §1.6, §11.1) ---------------------------


@pytest.mark.parametrize(
    ("group", "strategy_key", "expected"),
    [
        ("", "timeSlicing", False),
        ("failRequestsGreaterThanOne: true", "timeSlicing", True),
        ("", "mps", True),  # v0.20.0: unset means true for MPS (NVIDIA config_test.go)
        ("failRequestsGreaterThanOne: false", "mps", False),  # an explicit false stays false
    ],
)
def test_fail_requests_greater_than_one_default_depends_on_the_strategy(
    group: str, strategy_key: str, expected: bool, nodes: dict[str, Inventory]
):
    head = f"    {group}\n" if group else ""
    text = f"sharing:\n  {strategy_key}:\n{head}    resources:\n    - {{name: gpu, replicas: 2}}\n"
    result, _ = advertise(text, nodes["a100x2"])
    resource = result.resource(GPU)
    assert resource is not None
    assert resource.fail_requests_greater_than_one is expected


def test_flag_given_explicitly_beats_the_file_which_beats_the_default(nodes: dict[str, Inventory]):
    text = (
        "flags:\n  migStrategy: none\n  plugin:\n    deviceListStrategy: volume-mounts\n"
        "    sharedDevicesAllocationPolicy: packed\n"
    )
    model, _ = parse_document(text, ORIGIN)
    from_file = effective(model, FlagOverrides())
    assert from_file.plan.mig_strategy == "none"
    assert from_file.allocation.strategies == (DeviceListStrategy.VOLUME_MOUNTS,)
    assert from_file.allocation.policy is AllocationPolicy.PACKED
    explicit = effective(
        model,
        FlagOverrides(mig_strategy="mixed", device_list_strategy=("cdi-cri",), allocation_policy="distributed"),
    )
    assert explicit.plan.mig_strategy == "mixed"
    assert explicit.allocation.strategies == (DeviceListStrategy.CDI_CRI,)
    assert explicit.allocation.policy is AllocationPolicy.DISTRIBUTED
    defaults = effective(parse_document("", ORIGIN)[0], FlagOverrides())
    assert defaults.plan.mig_strategy == "none"
    assert defaults.allocation.strategies == (DeviceListStrategy.ENVVAR,)
    assert defaults.allocation.policy is AllocationPolicy.DISTRIBUTED
    mixed, _ = advertise(text, nodes["mig"], overrides=FlagOverrides(mig_strategy="mixed"))
    assert MIG_1G in summary(mixed)


def test_device_list_strategy_string_and_list_reach_allocation():
    one = effective(parse_document("flags: {plugin: {deviceListStrategy: cdi-cri}}", ORIGIN)[0], FlagOverrides())
    two = effective(
        parse_document("flags: {plugin: {deviceListStrategy: [envvar, cdi-annotations]}}", ORIGIN)[0], FlagOverrides()
    )
    assert one.allocation.strategies == (DeviceListStrategy.CDI_CRI,)
    assert two.allocation.strategies == (DeviceListStrategy.ENVVAR, DeviceListStrategy.CDI_ANNOTATIONS)


# ----- NVIDIA's anchored glob (§1.5, resources_test.go §11.4) ---------------------------------------------

GLOBS = [
    ("1g.24gb", "1g.24gb", True),
    ("1g.24gb", "2g.48gb", False),
    ("1g.24gb", "1g.24gb-me", False),
    ("1g.24gb", "1g.24gb+me.all", False),
    ("1g.24gb", "x1g.24gb", False),
    ("1g.24gb", "1g.24gb+gfx", False),
    ("1g.24gb-me", "1g.24gb-me", True),
    ("1g.24gb+me.all", "1g.24gb+me.all", True),
    ("1g.24gb+gfx", "1g.24gb+gfx", True),
    ("1g.24gb+gfx", "1g.24gb", False),
    ("1g.24gb+gfx", "1g.24gb-me", False),
    ("2g.48gb+gfx", "2g.48gb+gfx", True),
    ("2g.48gb", "2g.48gb+gfx", False),
    ("*", "anything at all", True),
    ("1g.*", "1g.24gb", True),
    ("1g.*", "2g.48gb", False),
    ("*gb", "1g.24gb", True),
    ("*gb", "1g.24gb-me", False),
    ("1g.1?gb", "1g.10gb", False),  # only * is special
    ("[12]g.*", "1g.10gb", False),
]


@pytest.mark.parametrize(("pattern", "subject", "matches"), GLOBS)
def test_naming_pattern_is_nvidias_anchored_glob(pattern: str, subject: str, matches: bool):
    assert glob_matches(pattern, subject) is matches


# ----- allocation from a config: Allocate (§4) --------------------------------------------------------------


def shared_resource(text: str, inventory: Inventory, name: str = GPU) -> tuple[Resource, AllocationPolicy]:
    model, _ = parse_document(text, ORIGIN)
    settings = effective(model, FlagOverrides())
    resource = plan(settings.plan, inventory).resource(name)
    assert resource is not None
    return resource, settings.allocation.policy


def allocate(resource: Resource, ids: list[str], strategies=(DeviceListStrategy.ENVVAR,)):
    by_id = {d.id: d for d in resource.devices}
    devices = validate_request(
        resource.name,
        ids,
        by_id,
        dict.fromkeys(by_id, True),
        fail_requests_greater_than_one=resource.fail_requests_greater_than_one,
    )
    return container_allocation(resource.name, devices, strategies)


def test_a_replica_allocates_its_physical_gpu(nodes: dict[str, Inventory]):
    inventory = nodes["a100x2"]
    resource, _ = shared_resource(ts("name: gpu\nreplicas: 4"), inventory)
    gpu1 = inventory.gpus[1].uuid
    assert allocate(resource, [f"{gpu1}::2"]).envs == {VISIBLE_DEVICES_ENV: gpu1}
    cdi = allocate(resource, [f"{gpu1}::3"], (DeviceListStrategy.CDI_CRI,))
    assert cdi.cdi_devices == (f"k8s.device-plugin.nvidia.com/gpu={gpu1}",)


def test_two_replicas_of_one_gpu_give_the_container_one_gpu(nodes: dict[str, Inventory]):
    inventory = nodes["a100x2"]
    resource, _ = shared_resource(ts("name: gpu\nreplicas: 4"), inventory)
    gpu0, gpu1 = (g.uuid for g in inventory.gpus)
    assert allocate(resource, [f"{gpu0}::0", f"{gpu0}::3"]).envs == {VISIBLE_DEVICES_ENV: gpu0}
    assert allocate(resource, [f"{gpu1}::1", f"{gpu0}::1"]).envs == {VISIBLE_DEVICES_ENV: f"{gpu1},{gpu0}"}


def test_a_mig_replica_allocates_its_mig_device(nodes: dict[str, Inventory]):
    inventory = nodes["mig"]
    text = MIG_1G_TS_4
    resource, _ = shared_resource(text, inventory, MIG_1G)
    mig = inventory.gpus[0].mig_devices[2]
    assert allocate(resource, [f"{mig.uuid}::1"]).envs == {VISIBLE_DEVICES_ENV: mig.uuid}


def test_fail_requests_greater_than_one_refuses_two_replicas_with_nvidias_text(nodes: dict[str, Inventory]):
    inventory = nodes["a100x2"]
    resource, _ = shared_resource(ts("name: gpu\nreplicas: 4", group="failRequestsGreaterThanOne: true"), inventory)
    gpu0, gpu1 = (g.uuid for g in inventory.gpus)
    with pytest.raises(AllocationError) as raised:
        allocate(resource, [f"{gpu0}::0", f"{gpu1}::0"])
    assert "maximum request size for shared resources is 1; found 2" in str(raised.value)
    assert f'"{GPU}"' in str(raised.value)
    assert allocate(resource, [f"{gpu1}::0"]).envs == {VISIBLE_DEVICES_ENV: gpu1}


def test_mps_refuses_two_replicas_by_default(nodes: dict[str, Inventory]):
    inventory = nodes["a100x2"]
    resource, _ = shared_resource("sharing:\n  mps:\n    resources:\n    - {name: gpu, replicas: 4}\n", inventory)
    gpu0 = inventory.gpus[0].uuid
    with pytest.raises(AllocationError, match="maximum request size for shared resources is 1; found 3"):
        allocate(resource, [f"{gpu0}::0", f"{gpu0}::1", f"{gpu0}::2"])


def test_time_slicing_allows_two_replicas_by_default(nodes: dict[str, Inventory]):
    inventory = nodes["a100x2"]
    resource, _ = shared_resource(ts("name: gpu\nreplicas: 4"), inventory)
    gpu0, gpu1 = (g.uuid for g in inventory.gpus)
    assert allocate(resource, [f"{gpu0}::0", f"{gpu1}::0"]).envs == {VISIBLE_DEVICES_ENV: f"{gpu0},{gpu1}"}


def test_dedicated_gpu_next_to_a_shared_one_is_not_limited_to_one(nodes: dict[str, Inventory]):
    inventory = nodes["a100x2"]
    text = ts("name: gpu\nreplicas: 4\ndevices: [0]", group="failRequestsGreaterThanOne: true\nrenameByDefault: true")
    dedicated, _ = shared_resource(text, inventory, GPU)
    assert allocate(dedicated, [inventory.gpus[1].uuid]).envs == {VISIBLE_DEVICES_ENV: inventory.gpus[1].uuid}


# ----- allocation from a config: GetPreferredAllocation (§7) -------------------------------------------------


def pick_one_by_one(resource: Resource, policy: AllocationPolicy, count: int) -> list[str]:
    """``count`` pods asking for one replica each, one after the other: each pick leaves the pool."""
    by_id = {d.id: d for d in resource.devices}
    available = list(by_id)
    picks = []
    for _ in range(count):
        [chosen] = preferred(available, [], 1, by_id, {}, policy)
        picks.append(chosen)
        available.remove(chosen)
    return picks


def parent_index(resource: Resource, device_id: str) -> int:
    return next(d.gpu_index for d in resource.devices if d.id == device_id)


POLICY = "flags:\n  plugin:\n    sharedDevicesAllocationPolicy: {policy}\n"


def test_distributed_spreads_single_replica_pods_across_gpus(nodes: dict[str, Inventory]):
    resource, policy = shared_resource(
        ts("name: gpu\nreplicas: 4", before=POLICY.format(policy="distributed")), nodes["a100x2"]
    )
    assert policy is AllocationPolicy.DISTRIBUTED
    picks = pick_one_by_one(resource, policy, 4)
    assert [parent_index(resource, p) for p in picks] == [0, 1, 0, 1]


def test_packed_fills_one_gpu_before_the_next(nodes: dict[str, Inventory]):
    resource, policy = shared_resource(
        ts("name: gpu\nreplicas: 4", before=POLICY.format(policy="packed")), nodes["a100x2"]
    )
    assert policy is AllocationPolicy.PACKED
    picks = pick_one_by_one(resource, policy, 6)
    assert [parent_index(resource, p) for p in picks] == [0, 0, 0, 0, 1, 1]


@pytest.mark.parametrize("policy", list(AllocationPolicy))
def test_two_replica_request_stays_on_one_gpu_that_can_hold_it(policy: AllocationPolicy, nodes: dict[str, Inventory]):
    inventory = nodes["a100x2"]
    resource, _ = shared_resource(ts("name: gpu\nreplicas: 4"), inventory)
    by_id = {d.id: d for d in resource.devices}
    gpu0, gpu1 = (g.uuid for g in inventory.gpus)
    available = [i for i in by_id if i != f"{gpu0}::0"]  # one pod already on GPU 0
    picked = preferred(available, [], 2, by_id, {}, policy)
    # distributed: the idle GPU 1; packed: the busier GPU 0. Either way both replicas on one GPU.
    assert {i.split("::")[0] for i in picked} == {gpu1 if policy is AllocationPolicy.DISTRIBUTED else gpu0}


def test_two_replica_request_spans_gpus_only_when_none_has_two_free(nodes: dict[str, Inventory]):
    inventory = nodes["a100x2"]
    resource, _ = shared_resource(ts("name: gpu\nreplicas: 2"), inventory)
    by_id = {d.id: d for d in resource.devices}
    gpu0, gpu1 = (g.uuid for g in inventory.gpus)
    picked = preferred([f"{gpu0}::1", f"{gpu1}::0"], [], 2, by_id, {}, AllocationPolicy.DISTRIBUTED)
    assert sorted(picked) == sorted([f"{gpu0}::1", f"{gpu1}::0"])


def test_preferred_replicas_are_deterministic_and_ignore_the_offer_order(nodes: dict[str, Inventory]):
    resource, _ = shared_resource(ts("name: gpu\nreplicas: 4"), nodes["a100x2"])
    by_id = {d.id: d for d in resource.devices}
    available = list(by_id)[1:]
    for policy in AllocationPolicy:
        first = preferred(available, [], 3, by_id, {}, policy)
        assert preferred(list(reversed(available)), [], 3, by_id, {}, policy) == first
        assert preferred(available, [], 3, by_id, {}, policy) == first


MIG2_TS = (
    "flags: {migStrategy: mixed}\nsharing:\n  timeSlicing:\n    resources:\n    - {name: mig-1g.10gb, replicas: 2}\n"
)


def test_distributed_mig_replicas_go_to_the_least_loaded_parent_gpu_then_the_idle_mig_device(
    nodes: dict[str, Inventory],
):
    resource, _ = shared_resource(MIG2_TS, nodes["mig2"], MIG_1G)
    picks = pick_one_by_one(resource, AllocationPolicy.DISTRIBUTED, 4)
    assert [parent_index(resource, p) for p in picks] == [0, 1, 0, 1]
    assert len({p.split("::")[0] for p in picks}) == 4  # four pods, four different MIG devices


def test_packed_mig_replicas_fill_one_parent_gpu_first(nodes: dict[str, Inventory]):
    resource, _ = shared_resource(MIG2_TS, nodes["mig2"], MIG_1G)
    picks = pick_one_by_one(resource, AllocationPolicy.PACKED, 5)
    assert [parent_index(resource, p) for p in picks] == [0, 0, 0, 0, 1]
    mig_devices = [p.split("::")[0] for p in picks[:4]]
    assert list(Counter(mig_devices).values()) == [2, 2]  # one MIG device full before the next
    assert mig_devices[0] == mig_devices[1]
