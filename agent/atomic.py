"""Replacing a file atomically: a reader sees the old content or the new one, never a mix, even after a crash.

The one way the agent writes a file that something else reads while it may change (CDI specs, the DRA checkpoint,
NFD's feature file): the content goes to a temporary file in the same directory (so the rename cannot cross
filesystems), gets the mode asked for set explicitly (``fchmod``, so the process umask cannot change it), is
fsynced, renamed over the target, and the directory is fsynced so the rename itself survives a crash. When any step
fails the temporary file is removed and the target is left as it was.

The temporary file is ``.<name>.tmp-<random>``: hidden, and ending neither in the target's suffix nor in
``.yaml``/``.json``, so directory scanners that skip hidden files (NFD) or read by suffix (CDI) never pick it up.
A crash between creating and renaming it leaves it behind; ``remove_temporaries`` cleans those up.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

TEMPORARY_MARK = ".tmp-"


def write_atomically(path: Path, data: bytes, mode: int) -> None:
    """Replace ``path`` with ``data``, file mode ``mode`` whatever the umask.

    The directory must exist (creating it, and its mode, is the caller's policy). Raises the ``OSError`` of the
    step that failed; ``path`` then still holds its old content (or is still absent) and no temporary file is left.
    """
    fd, name = tempfile.mkstemp(prefix=f".{path.name}{TEMPORARY_MARK}", dir=path.parent)
    temporary = Path(name)
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        temporary.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise
    fsync_directory(path.parent)


def fsync_directory(directory: Path) -> None:
    """Make a rename in ``directory`` durable; a filesystem that cannot fsync a directory is not an error."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def remove_temporaries(path: Path) -> list[Path]:
    """Remove the temporary files a crash during ``write_atomically(path, ...)`` left behind; those removed.

    Only safe when no other writer of ``path`` can be mid-write (the caller is its only writer)."""
    prefix = f".{path.name}{TEMPORARY_MARK}"
    try:
        names = [entry.name for entry in os.scandir(path.parent) if entry.name.startswith(prefix)]
    except OSError:
        return []
    removed = []
    for name in names:
        with contextlib.suppress(OSError):
            (path.parent / name).unlink()
            removed.append(path.parent / name)
    return removed
