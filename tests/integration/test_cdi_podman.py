"""A real CDI consumer: Debian's podman (with runc) starts containers from the CDI IDs the agent hands out.

The agent runs in process on a simulated node whose driver lies on disk (``agent.sim.driver_root``: stand-in
libraries and binaries, device nodes that are ``/dev/null``); DRA claims of every kind are prepared through the DRA
kubelet emulator (a whole GPU, a static MIG device, a MIG device made by dynamic MIG, a memory share of an MPS GPU),
and the device plugin answers an Allocate with the ``cdi-cri`` strategy. Each returned ID is then given to
``podman run --device <ID>`` and nothing else, so everything the container gets comes from the specs Tessera wrote,
resolved by the CNCF CDI library podman shares with containerd. Inside, the test reads the device nodes, the driver's
files (a stand-in ``nvidia-smi`` runs), and the environment.

podman 4.3 reads CDI specs only from ``/etc/cdi`` and ``/var/run/cdi`` (``cdi_spec_dirs`` came later), so each
``podman`` runs in a mount namespace of its own (``unshare --mount``) with a tmpfs over ``/run`` and the agent's CDI
root bound at ``/run/cdi``: nothing on the host changes. Settings as for the image tests (``tests/image/engine.py``):
runc with cgroupfs, the test's own ``containers.conf`` with ``default_ulimits = []``, no network. The image is
Debian's ``busybox-static`` in a tarball, imported once per session. Needs root; skipped with the reason elsewhere
(failed under ``CI``, where ``.ci/run`` installs the tools).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.sim.driver_root import VERSION
from agent.sim.scheduler import allocate
from tests.image.engine import RUNC, Engine, EngineError
from tests.integration import test_dra_e2e
from tests.integration.test_dra_dynamic_mig import mig_claim
from tests.integration.test_dra_e2e import DEADLINE, DRIVER, World
from tests.integration.test_dra_shares import share_claim
from tests.integration.test_ledger import MIG_CLASS

pytestmark = pytest.mark.podman

world = test_dra_e2e.world  # the fixture: the agent, both kubelets and the API server on a simulated node
BUSYBOX = Path("/bin/busybox")  # Debian's busybox-static
IMAGE = "localhost/tessera-cdi-busybox:test"
APPLETS = ("sh", "ls", "cat", "env", "test", "stat", "readlink", "echo", "true")
LIB = "/usr/lib/x86_64-linux-gnu"
UUID_IS = "'uuid' in device.attributes['gpu.nvidia.com'] && device.attributes['gpu.nvidia.com'].uuid == '{}'"
# GPU 0 dynamic MIG, GPU 1 static MIG, GPU 2 whole, GPU 3 shared by memory: DRA's; GPUs 4 and 5 the device plugin's
NODE = {
    "gpus": [
        {"model": "A100-SXM4-80GB", "mig": {"instances": []}},
        {"model": "A100-SXM4-80GB", "mig": {"instances": ["3g.40gb", "3g.40gb"]}},
        {"model": "A100-SXM4-80GB", "count": 2},
        {"model": "A100-SXM4-80GB"},
        {"model": "A100-SXM4-80GB", "mig": {"instances": ["3g.40gb", "3g.40gb"]}},
    ]
}


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "podman runs containers here as root only"
    tools = {
        "podman": shutil.which("podman"), "runc": os.access(RUNC, os.X_OK), "busybox-static": _static(BUSYBOX),
        "util-linux": shutil.which("unshare"),
    }  # fmt: skip
    missing = [package for package, found in tools.items() if not found]
    if missing:
        return f"missing {', '.join(missing)}: apt-get install {' '.join(missing)} (as .ci/run does)"
    return None


def _static(binary: Path) -> bool:
    """A statically linked executable (Debian's busybox-static; plain busybox needs a libc the image lacks)."""
    try:
        with binary.open("rb") as file:
            return b"ld-linux" not in file.read(1 << 16)  # a dynamic one names its loader (PT_INTERP) up front
    except OSError:
        return False


class Podman:
    """podman on storage of the test session's, each call in a mount namespace whose /run/cdi is ``cdi_root``."""

    def __init__(self, base: Path) -> None:
        self.engine = Engine(base)

    def run(self, cdi_root: Path, *args: str, timeout: float = 60) -> str:
        script = 'mount -t tmpfs tmpfs /run && mkdir /run/cdi && mount --bind "$0" /run/cdi && exec "$@"'
        command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, str(cdi_root)]
        result = subprocess.run(
            [*command, *self.engine.podman_command(*args)],
            capture_output=True, text=True, timeout=timeout, env=self.engine.env, stdin=subprocess.DEVNULL,
            check=False,
        )  # fmt: skip
        if result.returncode != 0:
            raise EngineError(f"podman {' '.join(args)}\nexited {result.returncode}:\n{result.stdout + result.stderr}")
        return result.stdout

    def container(self, cdi_root: Path, ids: list[str], script: str) -> str:
        """``script`` run in a container given exactly the CDI devices ``ids``."""
        devices = [arg for cdi_id in ids for arg in ("--device", cdi_id)]
        return self.run(cdi_root, "run", "--rm", "--network", "none", *devices, IMAGE, "sh", "-c", script)


@pytest.fixture(scope="session")
def podman() -> Iterator[Podman]:
    reason = _unavailable()
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the podman CDI tests: {reason}", pytrace=False)
        pytest.skip(reason)
    base = Path(tempfile.mkdtemp(prefix="pc", dir="/tmp"))  # podman refuses a runroot longer than 50 characters
    rootfs = base / "rootfs"
    (rootfs / "bin").mkdir(parents=True)
    shutil.copy2(BUSYBOX, rootfs / "bin" / "busybox")
    for applet in APPLETS:
        (rootfs / "bin" / applet).symlink_to("busybox")
    tarball = base / "busybox.tar"
    subprocess.run(["tar", "-C", str(rootfs), "-cf", str(tarball), "."], check=True, timeout=60)
    (base / "storage").mkdir()
    podman = Podman(base / "storage")
    try:
        podman.engine.podman("import", "--change", "ENV=PATH=/usr/bin:/bin", str(tarball), IMAGE, timeout=120)
        podman.run(base, "run", "--rm", "--network", "none", IMAGE, "true")
    except (EngineError, subprocess.TimeoutExpired) as error:
        podman.engine.remove_all()
        shutil.rmtree(base, ignore_errors=True)
        if os.environ.get("CI"):
            raise
        pytest.skip(f"podman cannot run a container here: {str(error)[-600:]}")
    yield podman
    podman.engine.remove_all()
    shutil.rmtree(base, ignore_errors=True)


def driver_files_inside(output: str) -> None:
    """What every GPU container gets from the driver root, as the container printed it (``CHECK_DRIVER``)."""
    assert "NVIDIA_VISIBLE_DEVICES=void" in output.splitlines()
    assert f"libcuda.so.{VERSION} (stand-in)" in output  # the versioned library, and through its SONAME link
    assert output.count(f"libcuda.so.{VERSION} (stand-in)") == 2
    assert "nvidia-smi stand-in" in output  # the driver's binary, mounted and runnable
    for node in ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"):
        assert f"char /dev/{node} 1:3" in output  # the control nodes: the stand-in driver's are /dev/null


CHECK_DRIVER = (
    f"env; cat {LIB}/libcuda.so.{VERSION} {LIB}/libcuda.so.1; nvidia-smi; "
    "for n in /dev/nvidia* /dev/nvidia-caps/*; do test -c $n && echo char $n $(stat -c '%t:%T' $n); done; true"
)


CHECK_MPS = '; test -z "$CUDA_MPS_PIPE_DIRECTORY" || echo pipe $(ls "$CUDA_MPS_PIPE_DIRECTORY")'


def hex_numbers(major: int, minor: int) -> str:
    return f"{major:x}:{minor:x}"  # as stat's %t:%T print them


@pytest.mark.parametrize("world", [NODE], indirect=True)
def test_every_kind_of_prepared_device_runs_in_podman_from_the_ids_alone(
    world: World, podman: Podman, mps_bin: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mps_root = world.base / "mps"
    monkeypatch.setenv("PATH", f"{mps_bin}:{os.environ['PATH']}")
    before = world.agent.status.config_digest
    (world.base / "config.yaml").write_text(
        f"version: v1\nflags: {{migStrategy: mixed, mpsRoot: '{mps_root}', plugin: {{deviceListStrategy: cdi-cri}}}}\n"
        "dra:\n  enabled: true\n  gpus: [0, 1, 2, 3]\n  dynamicMig: [0]\n  gpuShares: [3]\n"
    )
    test_dra_e2e.poll(lambda: world.agent.status.config_digest != before, "the config applied")
    world.api.create("deviceclasses", {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
                                       "metadata": {"name": "mig.nvidia.com"},
                                       "spec": {"selectors": [{"cel": {"expression": MIG_CLASS}}]}})  # fmt: skip
    world.dra.wait_for(lambda: DRIVER in world.dra.drivers(), DEADLINE, "the DRA driver registered")
    gpus = world.driver.gpus
    static_mig = gpus[1].mig_devices()[0][1].uuid
    world.api.wait_for(lambda: {"gpu-2", "gpu-3"} <= set(world.devices()) and len(world.devices()) > 10, DEADLINE)
    claims = {
        "whole": world.claim("whole", [UUID_IS.format(gpus[2].uuid)]),
        "static-mig": static_mig_claim(world, "static-mig", static_mig),
        "dynamic-mig": mig_claim(world, "dynamic-mig", "2g.20gb"),  # GPU 1's are 3g.40gb: one made on GPU 0
        "share": share_claim(world, "share", memory="10Gi"),
    }
    cdi = world.base / "cdi"
    outputs = {}
    for name in claims:
        ids = world.dra.run_pod("default", name, f"pod-{name}", [("gpu", name)], {"main": [("gpu", None)]})["main"]
        assert ids and all(i.startswith("k8s.gpu.nvidia.com/claim=") for i in ids), ids  # only Tessera's specs
        outputs[name] = podman.container(cdi, ids, CHECK_DRIVER + CHECK_MPS)
    for output in outputs.values():
        driver_files_inside(output)
    assert f"char /dev/nvidia{gpus[2].minor_number} 1:3" in outputs["whole"]
    assert "/dev/nvidia-caps/" not in outputs["whole"] and "CUDA_MPS_PIPE_DIRECTORY" not in outputs["whole"]
    # the MIG device made for the claim: its GPU's node and its own GI and CI capability nodes (mig-minors numbers)
    (gi, ci) = next((gi, ci) for gi, ci in gpus[0].mig_devices())
    gi_minor = 3 + gpus[0].minor_number * 135 + gi.id * 9
    assert f"char /dev/nvidia{gpus[0].minor_number} 1:3" in outputs["dynamic-mig"]
    assert f"char /dev/nvidia-caps/nvidia-cap{gi_minor} {hex_numbers(508, gi_minor)}" in outputs["dynamic-mig"]
    ci_minor = gi_minor + 1 + ci.id
    assert f"char /dev/nvidia-caps/nvidia-cap{ci_minor} {hex_numbers(508, ci_minor)}" in outputs["dynamic-mig"]
    # the share: its GPU, and the MPS daemon's pipe directory and limits
    share = outputs["share"]
    assert f"char /dev/nvidia{gpus[3].minor_number} 1:3" in share
    assert "CUDA_MPS_PIPE_DIRECTORY=/mps/dra/" in share
    pipe = next(line for line in share.splitlines() if line.startswith("pipe "))
    assert "control" in pipe.split(), pipe  # the daemon's control pipe, in the directory mounted from the host
    assert f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={gpus[3].uuid}=10240M" in share.splitlines()
    # the static MIG device: GPU 1's node and the capability nodes of its first GPU and compute instance
    (gi, ci) = gpus[1].mig_devices()[0]
    gi_minor = 3 + gpus[1].minor_number * 135 + gi.id * 9
    assert f"char /dev/nvidia{gpus[1].minor_number} 1:3" in outputs["static-mig"]
    for minor in (gi_minor, gi_minor + 1 + ci.id):
        assert f"char /dev/nvidia-caps/nvidia-cap{minor} {hex_numbers(508, minor)}" in outputs["static-mig"]


def static_mig_claim(world: World, name: str, uuid: str) -> dict:
    """A claim for the MIG device of this UUID (one that exists: GPU 1's layout), allocated and stored."""
    request = {"deviceClassName": "mig.nvidia.com", "selectors": [{"cel": {"expression": UUID_IS.format(uuid)}}]}
    claim = world.api.create("resourceclaims", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "mig", "exactly": request}]}},
    })  # fmt: skip
    classes = {c["metadata"]["name"]: c for c in world.api.objects("deviceclasses")}
    allocated = allocate(claim, world.slices(), classes, set(), test_dra_e2e.NODE)
    return world.api.update("resourceclaims", allocated, status=True)


DEVICE_PLUGIN_NODE = {
    "gpus": [{"model": "A100-SXM4-80GB"}, {"model": "A100-SXM4-80GB", "mig": {"instances": ["3g.40gb", "3g.40gb"]}}]
}


@pytest.mark.parametrize("world", [DEVICE_PLUGIN_NODE], indirect=True)
def test_the_device_plugins_cdi_names_run_in_podman_from_the_spec_it_writes(world: World, podman: Podman) -> None:
    before = world.agent.status.config_digest
    (world.base / "config.yaml").write_text(
        "version: v1\nflags: {migStrategy: mixed, plugin: {deviceListStrategy: cdi-cri}}\n"
    )
    test_dra_e2e.poll(lambda: world.agent.status.config_digest != before, "the config applied")
    kubelet, gpus = world.kubelet, world.driver.gpus
    kubelet.wait_for(
        lambda: kubelet.allocatable("nvidia.com/gpu") == 1 and kubelet.allocatable("nvidia.com/mig-3g.40gb") == 2,
        timeout=DEADLINE, what="the GPU and the two MIG devices advertised",
    )  # fmt: skip
    (gi, ci) = gpus[1].mig_devices()[1]
    allocated = {
        "gpu": kubelet.allocate_raw("nvidia.com/gpu", [gpus[0].uuid]),
        "mig": kubelet.allocate_raw("nvidia.com/mig-3g.40gb", [ci.uuid]),
    }
    outputs = {}
    for name, response in allocated.items():
        (container,) = response.container_responses
        names = [d.name for d in container.cdi_devices]
        assert "NVIDIA_VISIBLE_DEVICES" not in container.envs  # CDI alone, as NVIDIA's plugin answers
        assert names == [f"k8s.device-plugin.nvidia.com/gpu={gpus[0].uuid if name == 'gpu' else ci.uuid}"]
        outputs[name] = podman.container(world.base / "cdi", names, CHECK_DRIVER)
    for output in outputs.values():
        driver_files_inside(output)
    assert f"char /dev/nvidia{gpus[0].minor_number} 1:3" in outputs["gpu"] and "nvidia-caps" not in outputs["gpu"]
    gi_minor = 3 + gpus[1].minor_number * 135 + gi.id * 9
    assert f"char /dev/nvidia{gpus[1].minor_number} 1:3" in outputs["mig"]
    for minor in (gi_minor, gi_minor + 1 + ci.id):
        assert f"char /dev/nvidia-caps/nvidia-cap{minor} {hex_numbers(508, minor)}" in outputs["mig"]
