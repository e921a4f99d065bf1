"""``tessera plan --dra`` shows exactly what the agent publishes, on every preset node and every DRA config shipped.

The docs tell users to preview a config with ``tessera plan --dra --node <preset> --config configs/dra-*.yaml``;
issue 25 found that preview listing 208 devices where the agent published 8. Here the real agent runs on each
simulated preset with each shipped config, publishes to the API server stand-in, and its ResourceSlices must be the
preview's, field for field (only what the API server or the pool's history adds is left out: the object's name,
UID, version, timestamps and the pool's generation).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.sim.apiserver import ApiServer
from agent.sim.kubelet import DraKubeletEmulator, KubeletEmulator
from agent.sim.nvml.driver import SimDriver

from .test_dra_e2e import DEADLINE, NODE, end_mps_daemons, start_agent
from .test_previews_cli import exits

ROOT = Path(__file__).resolve().parents[2]
PRESETS = sorted(p.stem for p in (ROOT / "agent" / "sim" / "presets").glob("*.yaml"))
CONFIGS = sorted(p.name for p in (ROOT / "configs").glob("dra-*.yaml"))
NODE_UID = "7d3c1f0e-25a9-4c1b-9a52-0f4b8e6d2c11"


def normalised(slices: list[dict]) -> list[dict]:
    """What a slice says, without what the API server or the pool's history adds."""
    kept = []
    for item in slices:
        spec = json.loads(json.dumps(item["spec"]))
        spec["pool"].pop("generation")
        metadata = {k: item["metadata"][k] for k in ("generateName", "ownerReferences") if k in item["metadata"]}
        kept.append({"apiVersion": item["apiVersion"], "kind": item["kind"], "metadata": metadata, "spec": spec})
    return sorted(kept, key=lambda s: s["metadata"].get("generateName", ""))


def first_pool(api: ApiServer) -> list[dict] | None:
    """The node's first complete pool, as the API server's history holds it: every slice of the lowest generation
    that ever stood complete (all ``resourceSliceCount`` of them, none of another generation). Later generations
    may differ (a MIG device no claim made is swept away, and its placements come back)."""
    current: dict[str, dict] = {}
    for event in api.store.events_after(0):
        item = event.object
        if item.get("kind") != "ResourceSlice" or item["spec"]["nodeName"] != NODE:
            continue
        if event.type == "DELETED":
            current.pop(item["metadata"]["name"], None)
        else:
            current[item["metadata"]["name"]] = item
        pools = {(s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"]) for s in current.values()}
        if len(pools) == 1 and next(iter(pools))[1] == len(current):
            return list(current.values())
    return None


def test_the_presets_and_configs_are_all_here() -> None:
    assert {"dgx-a100", "dgx-h100", "a100-mig", "t4x4", "demo"} <= set(PRESETS)
    assert {"dra-dynamic-mig.yaml", "dra-gpu-shares.yaml"} <= set(CONFIGS)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("preset", PRESETS)
def test_plan_dra_is_what_the_agent_publishes(
    preset: str, config: str, sim_node: Callable[[object], SimDriver]
) -> None:
    config_path = ROOT / "configs" / config
    preview = exits(
        0, "plan", "--dra", "--node", preset, "--config", str(config_path), "--node-name", NODE,
        "--node-uid", NODE_UID, "--kubernetes-version", "1.36", "--format", "json",
    )  # fmt: skip
    expected = normalised(json.loads(preview.stdout)["items"])
    assert expected  # every preset has GPUs DRA publishes

    sim_node(preset)
    base = Path(tempfile.mkdtemp(prefix="p", dir="/tmp"))  # unix socket paths stay short
    (base / "sys").mkdir()  # no PCIe links: the simulated GPUs are on no real bus (the preview reads none either)
    shutil.copy(config_path, base / "config.yaml")
    api = ApiServer(git_version="v1.36.3")
    api.start()
    api.add_node(NODE, uid=NODE_UID)
    kubelet = KubeletEmulator(base / "dp", base / "pr" / "kubelet.sock")
    kubelet.start()
    dra = DraKubeletEmulator(base / "registry", NODE, api.api_client(), wipe_delay=1.0)
    dra.start()
    agent, thread = start_agent(base, api)
    try:
        first = api.wait_for(lambda: first_pool(api), DEADLINE)  # once its GPUs are found free
        assert normalised(first) == expected
    finally:
        agent.stop()
        thread.join(timeout=20)
        dra.stop()
        kubelet.stop()
        api.stop()
        end_mps_daemons(base)
        shutil.rmtree(base, ignore_errors=True)
