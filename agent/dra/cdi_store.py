"""The claims' CDI spec files under ``--cdi-root``: written atomically, removed on Unprepare, swept when stale.

One file per claim, named by ``agent.core.dra.cdi.spec_file_name`` (NVIDIA's transient spec name,
``k8s.gpu.nvidia.com-claim_<claimUID>.yaml``). The container runtime reads the directory when a container is
created, so a file must never be seen half-written: ``agent.atomic.write_atomically`` writes it under a temporary
name in the same directory (starting with ``.`` and not ending in ``.yaml``/``.json``, which CDI's directory scan
skips), fsyncs it, renames it over the final name and fsyncs the directory so the rename itself survives a crash.

Format: YAML. The name ends in ``.yaml`` (NVIDIA's name, which users and tools look for), and CDI readers choose
their parser by that suffix: the Go library happens to parse JSON in a ``.yaml`` file too (JSON is YAML), but
other implementations need not, and a human reading ``/var/run/cdi`` sees the format ``nvidia-ctk cdi generate``
writes. PyYAML's safe dumper quotes every string a YAML 1.1 reader could take for a number or a bool.

Permissions: the file is 0644 (the runtime reads it; it holds device paths, no secrets) and a directory this module
has to create is 0755, as ``nvidia-ctk`` and the CDI library create ``/var/run/cdi`` and ``/etc/cdi``. Both are set
explicitly, whatever the process umask.

Errors (a directory that cannot be created or written, a full disk) are ``CdiStoreError`` naming the directory or
file and the OS reason; the DRA service turns them into a per-claim error.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import yaml

from agent.atomic import write_atomically
from agent.core.dra.cdi import claim_uid_of_spec_file, spec_file_name

log = logging.getLogger(__name__)

DEFAULT_CDI_ROOT = Path("/var/run/cdi")
FILE_MODE = 0o644
DIR_MODE = 0o755


class CdiStoreError(OSError):
    """A spec file could not be written or removed; the message names the file or directory and why."""


class CdiStore:
    """The spec files of this driver's claims in one CDI directory."""

    def __init__(self, root: Path = DEFAULT_CDI_ROOT) -> None:
        self.root = root

    def path(self, claim_uid: str) -> Path:
        """Where the claim's spec lives (``CdiError`` if the UID is not a Kubernetes UID)."""
        return self.root / spec_file_name(claim_uid)

    def exists(self, claim_uid: str) -> bool:
        """True when the claim's spec is on disk: after a reboot ``/var/run/cdi`` (tmpfs) is empty again."""
        return self.path(claim_uid).is_file()

    def write(self, claim_uid: str, spec: Mapping[str, Any]) -> Path:
        """Write (or replace) the claim's spec atomically; ``CdiStoreError`` if the directory is not writable."""
        final = self.path(claim_uid)
        content = dump(spec)
        self._ensure_root()
        try:
            write_atomically(final, content, FILE_MODE)  # the mode whatever the umask: the runtime must read it
        except OSError as error:
            raise CdiStoreError(
                f"cannot write CDI spec {final} in the CDI directory {self.root}: {_why(error)}; the directory "
                "(--cdi-root) must be writable by the agent, mounted read-write from the host"
            ) from None
        return final

    def remove(self, claim_uid: str) -> bool:
        """Remove the claim's spec; False if there was none (removing twice is fine)."""
        final = self.path(claim_uid)
        try:
            final.unlink()
        except (FileNotFoundError, NotADirectoryError):  # not there, or no directory it could be in
            return False
        except OSError as error:
            raise CdiStoreError(f"cannot remove CDI spec {final} from {self.root}: {_why(error)}") from None
        return True

    def claim_uids(self) -> list[str]:
        """The claim UIDs of the spec files of ours in the directory (other vendors' files are not ours)."""
        try:
            names = sorted(entry.name for entry in os.scandir(self.root) if entry.is_file(follow_symlinks=False))
        except FileNotFoundError:
            return []
        except OSError as error:
            raise CdiStoreError(f"cannot list the CDI directory {self.root}: {_why(error)}") from None
        return [uid for uid in map(claim_uid_of_spec_file, names) if uid is not None]

    def stale(self, keep: Collection[str]) -> list[str]:
        """Claim UIDs of spec files of ours whose claim is not in ``keep`` (the checkpoint's claims): left by a
        checkpoint dropped as corrupt, or by a reboot when ``--cdi-root`` is not on tmpfs. The owner removes them
        (``remove``) when no Prepare can be in flight for them."""
        return [uid for uid in self.claim_uids() if uid not in keep]

    def _ensure_root(self) -> None:
        if self.root.is_dir():
            return
        try:
            self.root.mkdir(mode=DIR_MODE, parents=True)
            self.root.chmod(DIR_MODE)  # mkdir's mode is filtered by the umask
        except FileExistsError:
            if not self.root.is_dir():
                raise CdiStoreError(f"the CDI directory {self.root} exists but is not a directory") from None
        except OSError as error:
            raise CdiStoreError(
                f"cannot create the CDI directory {self.root}: {_why(error)}; --cdi-root must name a writable "
                "directory (the host's /var/run/cdi, mounted read-write)"
            ) from None
        else:
            log.info("created the CDI directory path=%s mode=%o", self.root, DIR_MODE)


_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)  # libyaml's: a self-contained spec's ~4 kB in 2 ms, not 8


def dump(spec: Mapping[str, Any]) -> bytes:
    """A spec as YAML (the safe dumper's quoting, libyaml's speed where PyYAML has it)."""
    return yaml.dump(_plain(spec), Dumper=_DUMPER, sort_keys=False, default_flow_style=False).encode()


def _plain(value: Any) -> Any:
    """Mappings and sequences as dicts and lists, which the safe dumper knows (specs may hold tuples)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _why(error: OSError) -> str:
    return error.strerror or str(error)
