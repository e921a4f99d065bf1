"""Debian's buildah and podman, run as root on storage of the test's own, and the stand-in base image.

No container registry is reachable here, so the image the Dockerfile's ``FROM`` names is made from Debian's
packages (mmdebstrap: bookworm's python3 and pip, with Debian's ``EXTERNALLY-MANAGED`` marker removed so pip
may install, as it may in the python image) and tagged with exactly that name in this storage; the build
never pulls (``--pull-never``). The settings are the ones that work on these machines as root: chroot
isolation for buildah, runc with cgroupfs for podman, a ``containers.conf`` holding ``default_ulimits = []``,
and the overlay storage driver (vfs where the kernel has no overlayfs). Nothing global is touched:
``--root`` and ``--runroot`` lie in a directory the caller owns and removes.

pip inside the build needs this machine's pip configuration (its index, find-links, certificate and
constraints): :func:`pip_settings` writes what pip reads here (config files and ``PIP_*`` variables, as
``pip config list`` reports them) into one ``pip.conf`` mounted as the build's ``/etc/pip.conf``, and
mounts every local file or directory it names read-only at the same path.
"""

from __future__ import annotations

import ast
import hashlib
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
TOOLS = {"buildah": "buildah", "podman": "podman", "runc": "runc", "mmdebstrap": "mmdebstrap"}  # command: package
RUNC = "/usr/sbin/runc"
# The stand-in base: what the python image holds that the build and the agent need.
BASE_PACKAGES = ("python3", "python3-venv", "python-is-python3", "python3-pip")
BASE_HOOK = 'rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED'
# The python image's configuration (its PATH and LANG): the Dockerfile extends PATH.
BASE_CHANGES = (
    "ENV=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "ENV=LANG=C.UTF-8",
    'CMD=["python3"]',
)


class EngineError(AssertionError):
    """A container command failed: the command, its exit status and the end of its output."""


def missing_tools() -> list[str]:
    """The Debian packages whose commands are missing (``runc`` is looked for where podman is told it is)."""
    missing = [pkg for cmd, pkg in TOOLS.items() if cmd != "runc" and shutil.which(cmd) is None]
    if not os.access(RUNC, os.X_OK):
        missing.append(TOOLS["runc"])
    return missing


def base_image_name() -> str:
    """The image the Dockerfile builds FROM (its ``PYTHON_IMAGE`` default), as Docker normalizes a short name."""
    match = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", DOCKERFILE.read_text(encoding="utf-8"), re.MULTILINE)
    assert match, "the Dockerfile has no `ARG PYTHON_IMAGE=<image>` default"
    name = match[1]
    if "/" not in name.split(":")[0]:
        name = "docker.io/library/" + name
    return name


def debian_release(image: str) -> str:
    """``python:3.11.11-slim-bookworm`` -> ``bookworm``."""
    match = re.search(r"-slim-(\w+)$", image)
    assert match, f"{image}: expected a python:<version>-slim-<debian release> image"
    return match[1]


def run(command: list[str], *, timeout: float, env: dict[str, str] | None = None) -> str:
    """Run ``command``; its output, or an :class:`EngineError` naming what failed."""
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL, check=False
    )
    if result.returncode != 0:
        output = (result.stdout + result.stderr)[-6000:]
        raise EngineError(f"{' '.join(command)}\nexited {result.returncode}:\n{output}")
    return result.stdout


def base_tarball(cache: Path, release: str) -> Path:
    """The stand-in base's root filesystem as a tarball, made with mmdebstrap unless the cache holds it.

    Keyed by the release and what goes into it; delete the file to make it afresh."""
    key = hashlib.sha256(repr((release, BASE_PACKAGES, BASE_HOOK)).encode()).hexdigest()[:12]
    tarball = cache / f"base-{release}-{key}.tar"
    if tarball.exists():
        return tarball
    cache.mkdir(parents=True, exist_ok=True)
    partial = cache / f".{tarball.name}.{os.getpid()}.partial"
    try:
        run(
            [
                "mmdebstrap", "--quiet", "--variant=minbase", "--format=tar",
                "--include=" + ",".join(BASE_PACKAGES),
                "--customize-hook=" + BASE_HOOK,
                release, str(partial),
            ],
            timeout=900,
        )  # fmt: skip
        partial.replace(tarball)
    finally:
        partial.unlink(missing_ok=True)
    return tarball


@dataclass
class PipSettings:
    """The machine's pip configuration for the build: one config file and the local paths it names."""

    config: str
    paths: list[Path] = field(default_factory=list)


def pip_settings() -> PipSettings:
    """What ``pip config list`` reports (files and ``PIP_*`` variables, the variables winning, as pip reads
    them), as one config file; and every existing local path among its values. A ``file://`` index's pages
    link to files beside the index, so an index is mounted with its parent directory."""
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    files: dict[tuple[str, str], str] = {}
    variables: dict[tuple[str, str], str] = {}
    for line in listed.splitlines():
        key, sep, value = line.partition("=")
        if not sep:
            continue
        section, _, option = key.rpartition(".")
        text = ast.literal_eval(value)
        if section == ":env:":
            variables[("global", option)] = text
        else:
            files[(section, option)] = text
    sections: dict[str, dict[str, str]] = {}
    paths: set[Path] = set()
    for (section, option), value in sorted({**files, **variables}.items()):
        sections.setdefault(section, {})[option] = " ".join(value.split())  # pip splits lists on whitespace
        for word in value.split():
            path = Path(unquote(urlparse(word).path)) if word.startswith("file://") else Path(word)
            if not path.is_absolute() or not path.exists():
                continue
            if option.endswith("index-url") and path.parent != Path("/"):
                path = path.parent
            paths.add(path)
    # a path inside another one is mounted with it
    outer = sorted(p for p in paths if not any(q != p and q in p.parents for q in paths))
    text = "\n".join(
        f"[{section}]\n" + "".join(f"{o} = {v}\n" for o, v in options.items()) for section, options in sections.items()
    )
    return PipSettings(text, outer)


def storage_driver() -> str:
    """overlay where the kernel has it (a container starts in 0.2 s), else vfs (a full copy of the image's
    files for each container: 5 s or more)."""
    with Path("/proc/filesystems").open() as filesystems:
        return "overlay" if any(line.split()[-1:] == ["overlay"] for line in filesystems) else "vfs"


class Engine:
    """buildah and podman on one storage directory of the caller's."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.conf = base / "containers.conf"
        # podman's default nofile limit (1048576) is above the hard limit root has here and cannot raise:
        # runc fails "error setting rlimit type 7: operation not permitted" unless it sets none
        self.conf.write_text(
            "[containers]\ndefault_ulimits = []\n"
            # podman's own state, events and networks beside the storage, not in /run/libpod and /etc/containers
            f'[engine]\ntmp_dir = "{base / "libpod"}"\nevents_logger = "file"\n'
            f'events_logfile_path = "{base / "events.log"}"\n'
            f'[network]\nnetwork_config_dir = "{base / "networks"}"\n'
        )
        self.env = {**os.environ, "CONTAINERS_CONF": str(self.conf)}
        self.storage = ["--storage-driver", storage_driver()]
        self.storage += ["--root", str(base / "root"), "--runroot", str(base / "runroot")]

    def buildah(self, *args: str, timeout: float = 600) -> str:
        return run(["buildah", *self.storage, *args], timeout=timeout, env=self.env)

    def podman_command(self, *args: str) -> list[str]:
        return ["podman", *self.storage, "--runtime", RUNC, "--cgroup-manager", "cgroupfs", *args]

    def podman(self, *args: str, timeout: float = 300) -> str:
        return run(self.podman_command(*args), timeout=timeout, env=self.env)

    def import_base(self, tarball: Path, name: str) -> None:
        changes = [arg for change in BASE_CHANGES for arg in ("--change", change)]
        self.podman("import", *changes, str(tarball), name)

    def build(self, context: Path, tag: str, pip: PipSettings) -> None:
        pip_conf = self.base / "pip.conf"
        pip_conf.write_text(pip.config)
        volumes = [f"{pip_conf}:/etc/pip.conf:ro"] + [f"{p}:{p}:ro" for p in pip.paths]
        self.buildah(
            "bud", "--isolation", "chroot", "--pull-never", "--layers=false",
            *[arg for volume in volumes for arg in ("--volume", volume)],
            "--file", str(context / "Dockerfile"), "--tag", tag, str(context),
            timeout=1200,
        )  # fmt: skip

    def size(self, image: str) -> int:
        return int(self.podman("image", "inspect", "--format", "{{.Size}}", image).strip())

    def remove_all(self) -> None:
        """Every container; the storage directory itself is the caller's to delete."""
        for command in (self.podman_command("rm", "--all", "--force"), ["buildah", *self.storage, "rm", "--all"]):
            subprocess.run(command, capture_output=True, timeout=120, env=self.env, check=False)
