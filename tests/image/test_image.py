"""The project's image, built from its Dockerfile and run as the DaemonSet runs it.

Every container runs with a read-only root filesystem, every capability dropped, no privilege escalation,
no network and a tmpfs at /tmp (the DaemonSet's emptyDir), and names its program (``--entrypoint
tessera``), so the commands work whatever the image's default command is. ``tessera run --simulate``
serves the kubelet emulator of this test process through a bind-mounted device-plugin directory, with the
DaemonSet's environment and a sharing config mounted as the ConfigMap is.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.sim.kubelet import KubeletEmulator
from tests.image.conftest import Image
from tests.image.engine import ROOT, EngineError

pytestmark = [pytest.mark.image, pytest.mark.timeout(1200)]  # the first test waits for the build

MIB = 1 << 20
MAX_ADDED = 100 * MIB  # what the image may add to its base
CONFINED = ("--network", "none", "--read-only", "--cap-drop=all", "--security-opt", "no-new-privileges")
NODE = textwrap.dedent(
    """
    name: image-node
    gpus:
      - model: A100-SXM4-80GB
        count: 2
    """
)
PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
POD_RESOURCES_DIR = "/var/lib/kubelet/pod-resources"


def tessera(image: Image, *args: str, volumes: tuple[str, ...] = (), env: tuple[str, ...] = ()) -> list[str]:
    """The podman command that runs ``tessera <args>`` in a confined container of the image."""
    return image.engine.podman_command(
        "run", "--rm", *CONFINED, "--tmpfs", "/tmp",
        *[a for v in volumes for a in ("--volume", v)], *[a for e in env for a in ("--env", e)],
        "--entrypoint", "tessera", image.name, *args,
    )  # fmt: skip


def run_tessera(image: Image, *args: str) -> str:
    result = subprocess.run(
        tessera(image, *args), capture_output=True, text=True, timeout=300, env=image.engine.env, check=False
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"tessera {' '.join(args)} exited {result.returncode}:\n{output}"
    assert "Traceback" not in output
    return result.stdout


def test_image_adds_less_than_100_mib_to_its_base(image: Image) -> None:
    added = image.engine.size(image.name) - image.engine.size(image.base)
    assert added < MAX_ADDED, f"the image adds {added / MIB:.1f} MiB to its base (at most {MAX_ADDED // MIB} MiB)"


def test_image_holds_the_agent_and_nothing_to_build_or_install_with(image: Image) -> None:
    """The agent's interpreter has no pip (nothing installs at run time), no compiler is on PATH, and the
    agent's package, its simulators' data and the console scripts are there, but not the repository's tests;
    and the container is confined as the DaemonSet's is."""
    probe = textwrap.dedent(
        """
        import importlib.resources, importlib.util, shutil
        assert (importlib.resources.files("agent.sim") / "presets" / "demo.yaml").is_file()
        print("pip", importlib.util.find_spec("pip") is not None)
        print("compilers", [c for c in ("gcc", "cc", "g++", "clang", "make") if shutil.which(c)])
        print("scripts", [s for s in ("tessera", "tessera-sim-mps-control") if shutil.which(s)])
        print("tests", importlib.util.find_spec("tests") is not None)
        import os, re
        print("confined", os.access("/", os.W_OK), re.search(r"CapEff:\\s+(\\w+)", open("/proc/self/status").read())[1])
        """
    )
    command = image.engine.podman_command(
        "run", "--rm", *CONFINED, "--entrypoint", "python", image.name, "-c", probe
    )  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=image.engine.env, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == [
        "pip False",
        "compilers []",
        "scripts ['tessera', 'tessera-sim-mps-control']",
        "tests False",
        "confined False 0000000000000000",  # the root filesystem read-only, no capability left
    ]


def test_help(image: Image) -> None:
    out = run_tessera(image, "--help")
    assert out.startswith("usage: tessera")
    for command in ("run", "plan", "validate", "demo", "status"):
        assert command in out


def test_demo(image: Image) -> None:
    out = run_tessera(image, "demo")
    assert "The agent registered 5 resources with the kubelet" in out
    assert "Healthy again after" in out
    assert "Agent stopped; plugin sockets left behind: none." in out
    assert out.rstrip().endswith("or run the tests (README).")


def test_demo_dra(image: Image) -> None:
    out = run_tessera(image, "demo", "--dra")
    assert "The DRA driver registered with the kubelet's plugin watcher" in out
    assert out.rstrip().splitlines()[-1].startswith("Done.")


@pytest.fixture
def node_dir() -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="img", dir="/tmp"))  # unix socket paths must stay short
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_run_serves_the_kubelet_through_the_plugin_directory(image: Image, node_dir: Path) -> None:
    """``tessera run`` in the container, configured as the DaemonSet configures it: a named config of the
    mounted ConfigMap directory (time-slicing x4), the kubelet's directories mounted from the host. The
    kubelet registers the replicas, a pod gets two of them, and SIGTERM (podman stop) ends the agent with
    status 0 and its sockets removed."""
    (node_dir / "config").mkdir()
    shutil.copy(ROOT / "daemonset/base/configs/time-slicing-4.yaml", node_dir / "config" / "time-slicing-4")
    (node_dir / "node.yaml").write_text(NODE)
    kubelet = KubeletEmulator(node_dir / "dp", node_dir / "pr" / "kubelet.sock", dial_timeout=5.0)
    kubelet.start()
    name = f"tessera-run-{node_dir.name}"
    command = tessera(
        image,
        "run",
        "--simulate",
        "/etc/tessera/node.yaml",
        volumes=(
            f"{node_dir / 'dp'}:{PLUGIN_DIR}",
            f"{node_dir / 'pr'}:{POD_RESOURCES_DIR}:ro",
            f"{node_dir / 'config'}:/etc/tessera/config:ro",
            f"{node_dir / 'node.yaml'}:/etc/tessera/node.yaml:ro",
        ),
        env=(
            "TESSERA_CONFIG=/etc/tessera/config",
            "TESSERA_CONFIG_NAME=time-slicing-4",  # what the node label nvidia.com/device-plugin.config picks
            f"TESSERA_DEVICE_PLUGIN_DIR={PLUGIN_DIR}",
            f"TESSERA_POD_RESOURCES_SOCKET={POD_RESOURCES_DIR}/kubelet.sock",
            "TESSERA_LOG_FORMAT=text",
        ),
    )
    command[command.index("--rm") + 1 : command.index("--rm") + 1] = ["--name", name]
    log_path = node_dir / "agent.log"
    with log_path.open("w") as log:
        container = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=image.engine.env)
    try:

        def registered() -> bool:
            if container.poll() is not None:
                raise AssertionError(f"the container exited {container.returncode}:\n{log_path.read_text()}")
            return kubelet.allocatable("nvidia.com/gpu") == 8 if "nvidia.com/gpu" in kubelet.resources() else False

        try:
            kubelet.wait_for(registered, timeout=180, what="nvidia.com/gpu registered with 8 replicas")
        except TimeoutError as error:
            raise AssertionError(f"{error}\n{log_path.read_text()}") from None
        assert all(health == "Healthy" for health in kubelet.devices("nvidia.com/gpu").values())
        assert (node_dir / "dp" / "nvidia-gpu.sock").is_socket()

        pod = kubelet.create_pod("train", {"main": {"nvidia.com/gpu": 2}})
        allocation = pod.containers["main"]["nvidia.com/gpu"]
        assert len(allocation.device_ids) == 2
        gpus = {device.split("::")[0] for device in allocation.device_ids}
        assert set(allocation.response.envs["NVIDIA_VISIBLE_DEVICES"].split(",")) == gpus

        image.engine.podman("stop", "--time", "30", name, timeout=120)
        assert container.wait(timeout=120) == 0, log_path.read_text()
        assert not list((node_dir / "dp").glob("nvidia-*.sock")), "the agent left its sockets behind"
    finally:
        if container.poll() is None:
            with contextlib.suppress(EngineError):
                image.engine.podman("rm", "--force", name, timeout=120)
            container.wait(timeout=120)
        kubelet.stop()
