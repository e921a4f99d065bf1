"""Reading a file someone else wrote, within a size limit, without ever blocking on it.

Every file the agent reads from outside — a sharing config, a MIG layout, a node spec, the kubelet's
checkpoints — goes through :func:`read_bounded`. It needs no YAML parser (``agent.config.yaml_limits`` adds
that), so what only reads bytes (the telemetry's checkpoint readers) does not load one.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from agent.config.model import ConfigError

MAX_BYTES = 1 << 20  # 1 MiB: the most a ConfigMap can hold


def read_bounded(path: Path | str, origin: str | None = None, max_bytes: int = MAX_BYTES) -> bytes:
    """The bytes of the regular file at ``path`` (symlinks followed), at most ``max_bytes`` of them.

    A directory, FIFO, socket or device (``/dev/null`` excepted: it reads as nothing) is refused without
    opening it, so a FIFO cannot block the caller; a file larger than ``max_bytes`` is refused from its
    size, and a file that grows while it is read is refused after ``max_bytes + 1`` bytes.
    """
    path = Path(path)
    where = str(path) if origin is None else origin
    try:
        info = path.stat()
        if _is_dev_null(info):
            return b""
        _require_regular(info, where, max_bytes)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        try:
            _require_regular(os.fstat(fd), where, max_bytes)  # the file opened is the file checked
            chunks: list[bytes] = []
            size = 0
            while size <= max_bytes:
                chunk = os.read(fd, max_bytes + 1 - size)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
        finally:
            os.close(fd)
    except ConfigError:
        raise
    except (OSError, ValueError) as error:  # ValueError: a path with a NUL byte
        reason = getattr(error, "strerror", None) or str(error)
        raise ConfigError(where, [f"cannot read: {reason}; check the mount and the path"]) from error
    if size > max_bytes:
        raise ConfigError(where, [too_big(size, max_bytes, grew=True)])
    return b"".join(chunks)


def _is_dev_null(info: os.stat_result) -> bool:
    if not stat.S_ISCHR(info.st_mode):
        return False
    try:
        null = Path(os.devnull).stat()
    except OSError:
        return False
    return stat.S_ISCHR(null.st_mode) and info.st_rdev == null.st_rdev


def _require_regular(info: os.stat_result, where: str, max_bytes: int) -> None:
    mode = info.st_mode
    if stat.S_ISDIR(mode):
        raise ConfigError(where, ["is a directory, not a file; name a file in it"])
    if not stat.S_ISREG(mode):
        kind = (
            "a FIFO (named pipe)"
            if stat.S_ISFIFO(mode)
            else "a socket"
            if stat.S_ISSOCK(mode)
            else "a device"
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "not a regular file"
        )
        raise ConfigError(where, [f"is {kind}, not a regular file; give the path of a file"])
    if info.st_size > max_bytes:
        raise ConfigError(where, [too_big(info.st_size, max_bytes)])


def size_text(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.1f} {unit}"
    return f"{n} bytes"


def too_big(size: int, max_bytes: int, *, grew: bool = False) -> str:
    got = f"more than {size_text(max_bytes)}" if grew else f"{size_text(size)} ({size} bytes)"
    return (
        f"larger than the {size_text(max_bytes)} limit: {got}; a ConfigMap holds at most 1 MiB, so this is not a "
        "config or layout: check the path"
    )
