"""Node labels as a Node Feature Discovery local feature file (NFD's ``features.d``), as GFD writes them.

NFD's ``local`` source reads every file in ``/etc/kubernetes/node-feature-discovery/features.d/`` (mounted into the
nfd-worker) and labels the node with its ``key=value`` lines; a file's labels disappear when the file does. What
that reader does, and what follows for the writer:

- lines are trimmed, ``#`` starts a comment (``# +expiry-time=...`` is a directive) and a line without ``=`` means
  ``key=true``: Tessera writes plain ``key=value`` lines, sorted, with no header, so old NFD versions read it too;
- files whose name starts with ``.`` are skipped: the temporary file is ``.<name>.tmp-<random>``, so a half-written
  file is never read, and a hidden target name (which NFD would ignore) is refused;
- files over 64 KiB are skipped whole: a larger content is refused here rather than silently dropped there;
- NFD re-reads the directory every sleep interval (60 s by default): the file is replaced atomically
  (``agent.atomic.write_atomically``: temporary file in the same directory, fsync, rename, directory fsync) and only
  when its content changes, so NFD never sees a partial file and an unchanged node never touches the disk.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path

from agent.atomic import write_atomically
from agent.telemetry.labels import is_label_key, is_label_value

FEATURES_DIR = Path("/etc/kubernetes/node-feature-discovery/features.d")
DEFAULT_FEATURE_FILE = FEATURES_DIR / "tessera"  # GFD's is features.d/gfd
MAX_FEATURE_FILE_BYTES = 65536  # NFD's MaxFeatureFileSize
FILE_MODE = 0o644
DIR_MODE = 0o755


def render_feature_file(labels: Mapping[str, str]) -> str:
    """The file's content: one ``key=value`` line per label, sorted by key.

    Raises ``ValueError`` naming every key or value that is not a valid Kubernetes label.
    """
    problems = [f"invalid label key {k!r}" for k in labels if not is_label_key(k)]
    problems += [f"invalid value {v!r} for label {k!r}" for k, v in labels.items() if not is_label_value(v)]
    if problems:
        raise ValueError("cannot write node labels: " + "; ".join(sorted(problems)))
    text = "".join(f"{key}={labels[key]}\n" for key in sorted(labels))
    if len(text.encode()) > MAX_FEATURE_FILE_BYTES:
        raise ValueError(
            f"cannot write node labels: {len(text.encode())} bytes is more than the {MAX_FEATURE_FILE_BYTES} "
            "bytes NFD reads from a feature file"
        )
    return text


def write_feature_file(path: Path, labels: Mapping[str, str]) -> bool:
    """Write ``labels`` to the feature file ``path`` if its content changes; True when the file was written.

    The directory is created (mode 0755) when its parent exists. Raises ``ValueError`` for a path with ``..`` or a
    hidden or empty file name and for invalid labels, ``FileNotFoundError`` / ``NotADirectoryError`` /
    ``IsADirectoryError`` when the path cannot hold the file, and ``OSError`` when writing fails (the old file is
    then left as it was).
    """
    path = Path(path)
    target = _checked(path)
    data = render_feature_file(labels).encode()
    with contextlib.suppress(FileNotFoundError):
        if target.read_bytes() == data:
            return False
    write_atomically(target, data, FILE_MODE)
    return True


class FeatureFile:
    """The feature file at ``path``, kept up to date by :func:`write_feature_file` once per collection.

    When the labels are those of the previous update and the file is still the one left then (same inode, size
    and times), nothing is read, validated or written: the common case of a node whose labels do not change.
    Anything else — new labels, a file someone removed or edited, a failed write — goes through
    ``write_feature_file`` again.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._labels: dict[str, str] | None = None
        self._key: tuple[int, ...] | None = None

    def update(self, labels: Mapping[str, str]) -> bool:
        """True when the file was written; raises as ``write_feature_file`` does."""
        if self._key is not None and labels == self._labels and self._stat() == self._key:
            return False
        self._labels = self._key = None
        written = write_feature_file(self.path, labels)
        self._labels, self._key = dict(labels), self._stat()
        return written

    def _stat(self) -> tuple[int, ...] | None:
        try:
            info = self.path.stat()
        except (OSError, ValueError):
            return None
        return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def _checked(path: Path) -> Path:
    if ".." in path.parts:
        raise ValueError(f"feature file path {str(path)!r} must not contain '..'")
    if path.name in ("", ".") or path.name.startswith("."):
        raise ValueError(
            f"feature file path {str(path)!r} needs a file name that does not start with '.' (NFD ignores hidden files)"
        )
    directory = path.parent
    if not directory.exists():
        if not directory.parent.is_dir():
            raise FileNotFoundError(
                f"cannot write the feature file {path}: neither {directory} nor its parent {directory.parent} exists; "
                "mount NFD's features.d directory (/etc/kubernetes/node-feature-discovery/features.d) into the pod"
            )
        directory.mkdir(mode=DIR_MODE, exist_ok=True)
        directory.chmod(DIR_MODE)  # mkdir's mode is filtered by the umask
    if not directory.is_dir():
        raise NotADirectoryError(f"cannot write the feature file {path}: {directory} is not a directory")
    if path.is_dir():
        raise IsADirectoryError(f"cannot write the feature file {path}: it is a directory")
    return path
