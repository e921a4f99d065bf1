"""The prepared-claims checkpoint on disk: read at start, replaced atomically after every change.

What is in the file and how it is checked is ``agent.core.dra.checkpoint``; this module only moves bytes, and
decides what happens when they cannot be trusted.

Writing: ``agent.atomic.write_atomically`` (a temporary file in the same directory, fsynced, renamed over the
checkpoint, the directory fsynced): after a crash at any point the file is the old checkpoint or the new one, never
a mix. The file is 0600 and a directory this module creates 0700: it names
the claims and namespaces of the node's pods, which only the agent (root) needs to read.

Reading: a missing file is an empty checkpoint (first start). A file that cannot be decoded (torn, edited, wrong
checksum, a version this agent does not know) is logged as an error naming the file and the reason, renamed aside
to ``<file>.corrupt-<UTC timestamp>`` for a human to look at, and the agent starts empty: it must keep serving.
Starting empty forgets which devices were prepared; the kubelet re-prepares running pods' claims only when it
creates a sandbox (facts/dra.md A2), so until then a device could be prepared for a second claim. That is the
price of a corrupt file, and why the error says so.

The node's boot ID (``/proc/sys/kernel/random/boot_id``) is read once; ``load`` drops every claim recorded in an
earlier boot (``agent.core.dra.checkpoint.for_boot``): after a reboot nothing that was prepared still exists. When
it cannot be read, no reboot can be told apart and the claims are kept (``for_boot`` with an unknown boot ID).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from agent.atomic import remove_temporaries, write_atomically
from agent.core.dra.checkpoint import CHECKPOINT_FILE, Checkpoint, CheckpointError, decode, empty, encode, for_boot

log = logging.getLogger(__name__)

BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")
FILE_MODE = 0o600
DIR_MODE = 0o700
CORRUPT_SUFFIX = ".corrupt-"


class CheckpointSaveError(OSError):
    """The checkpoint could not be written; the message names the file and why. The old file is unchanged."""


def checkpoint_path(plugin_dir: Path) -> Path:
    """The checkpoint in the driver's plugin directory (``/var/lib/kubelet/plugins/<driver>``)."""
    return plugin_dir / CHECKPOINT_FILE


class CheckpointStore:
    """One checkpoint file. ``load`` and ``save`` are called by one thread at a time (the DRA service's worker)."""

    def __init__(
        self,
        path: Path,
        *,
        boot_id_path: Path = BOOT_ID_PATH,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self._boot_id_path = boot_id_path
        self._clock = clock
        self._boot_id: str | None = None

    @property
    def boot_id(self) -> str:
        """This boot's ID, read once; ``""`` when it cannot be read (then no reboot can be told apart)."""
        if self._boot_id is None:
            try:
                self._boot_id = self._boot_id_path.read_text().strip()
            except OSError as error:
                log.error(
                    "cannot read the node's boot ID; prepared claims will not be dropped after a reboot path=%s "
                    "error=%r",
                    self._boot_id_path,
                    error.strerror or str(error),
                )
                self._boot_id = ""
        return self._boot_id

    def load(self) -> Checkpoint:
        """The checkpoint for this boot; empty when there is none, it is corrupt, or it is from an earlier boot."""
        remove_temporaries(self.path)  # left by a crash mid-save; the checkpoint itself is intact
        boot_id = self.boot_id
        try:
            content = self.path.read_bytes()
        except FileNotFoundError:
            log.info("no DRA checkpoint yet, starting with no prepared claims path=%s", self.path)
            return empty(boot_id)
        except OSError as error:
            return self._set_aside(f"cannot be read: {error.strerror or error}", boot_id)
        try:
            checkpoint = decode(content)
        except CheckpointError as error:
            return self._set_aside(str(error), boot_id)
        current = for_boot(checkpoint, boot_id)
        if current.claims != checkpoint.claims:
            log.warning(
                "the node rebooted since the DRA checkpoint was written; its prepared claims are dropped "
                "path=%s claims=%d checkpoint_boot_id=%s boot_id=%s",
                self.path,
                len(checkpoint.claims),
                checkpoint.boot_id,
                boot_id,
            )
        log.info("DRA checkpoint loaded path=%s claims=%d", self.path, len(current.claims))
        return current

    def save(self, checkpoint: Checkpoint) -> None:
        """Replace the file with ``checkpoint``, atomically; ``CheckpointSaveError`` leaves the old file in place."""
        content = encode(checkpoint)
        directory = self.path.parent
        try:
            if not directory.is_dir():
                directory.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
                directory.chmod(DIR_MODE)  # mkdir's mode is filtered by the umask
            write_atomically(self.path, content, FILE_MODE)
        except OSError as error:
            raise CheckpointSaveError(
                f"cannot write the DRA checkpoint {self.path}: {error.strerror or error}"
            ) from None

    def _set_aside(self, reason: str, boot_id: str) -> Checkpoint:
        """Log why the file is unusable, keep it for a human under a new name, and start empty."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(self._clock()))
        aside = self.path.with_name(f"{self.path.name}{CORRUPT_SUFFIX}{stamp}")
        for n in range(1, 100):
            if not aside.exists():
                break
            aside = self.path.with_name(f"{self.path.name}{CORRUPT_SUFFIX}{stamp}-{n}")
        try:
            self.path.replace(aside)
            kept = str(aside)
        except OSError as error:
            kept = f"not moved aside ({error.strerror or error}); it will be overwritten by the next save"
        log.error(
            "the DRA checkpoint is unusable; starting with no prepared claims: devices prepared before may be "
            "prepared again for another claim until their pods' sandboxes are re-created path=%s reason=%r kept=%s",
            self.path,
            reason,
            kept,
        )
        return empty(boot_id)
