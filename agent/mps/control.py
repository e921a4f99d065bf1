"""Talking to one ``nvidia-cuda-mps-control`` daemon: start it, send control commands, read its log.

Every command is built here from validated values (integers, device UUIDs), never from raw text, and the
binary is run without a shell. A command the daemon rejects, or a daemon that does not answer, is an
``MpsError`` carrying the daemon's own words and the last lines of its control log.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path

from agent.core.mps import MpsDaemonSpec

PID_FILE = "nvidia-cuda-mps-control.pid"
CONTROL_LOG = "control.log"
MAX_PIPE_PATH = 87  # the daemon fails to start with a longer pipe directory
_UUID = re.compile(r"^(GPU|MIG)-[0-9a-fA-F-]{36}$")
COMMAND_TIMEOUT = 10.0
READINESS_COMMAND = "get_default_active_thread_percentage"


class MpsError(RuntimeError):
    pass


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def pinned_limit_command(uuid: str, mib: int) -> str:
    if not isinstance(uuid, str) or not _UUID.match(uuid) or not _is_int(mib) or not 0 < mib < 1 << 24:
        raise ValueError(f"refusing to send an MPS limit for {uuid!r} of {mib!r} MiB")
    return f"set_default_device_pinned_mem_limit {uuid} {mib}M"


def thread_percentage_command(percent: int) -> str:
    if not _is_int(percent) or not 1 <= percent <= 100:
        raise ValueError(f"refusing to send an active thread percentage of {percent!r}")
    return f"set_default_active_thread_percentage {percent}"


def server_limit_commands(server: int, uuid_mib: Sequence[tuple[str, int]], percent: int) -> list[str]:
    """The limits for a running server's new clients (``set_device_pinned_mem_limit`` and
    ``set_active_thread_percentage`` on its PID): defaults only reach servers started after them (facts mig-mps.md)."""
    if not _is_int(server) or server <= 0:
        raise ValueError(f"refusing to send limits for MPS server {server!r}")
    thread_percentage_command(percent)  # the same checks as the defaults
    commands = []
    for uuid, mib in uuid_mib:
        pinned_limit_command(uuid, mib)
        commands.append(f"set_device_pinned_mem_limit {server} {uuid} {mib}M")
    commands.append(f"set_active_thread_percentage {server} {percent}")
    return commands


class MpsControl:
    def __init__(
        self,
        binary: str,
        pipe_dir: Path,
        log_dir: Path,
        visible_devices: Sequence[str],
        *,
        active_thread_percentage: int | None = None,
        pinned_memory_mib: Sequence[tuple[str, int]] = (),
    ) -> None:
        if len(str(pipe_dir)) > MAX_PIPE_PATH:
            raise MpsError(
                f"MPS pipe directory {pipe_dir} is longer than {MAX_PIPE_PATH} characters; use a shorter --mps-root"
            )
        for uuid in visible_devices:
            if not _UUID.match(uuid):
                raise ValueError(f"not a device UUID: {uuid!r}")
        self.binary = binary
        self.pipe_dir = pipe_dir
        self.log_dir = log_dir
        self._env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir),
            "CUDA_MPS_LOG_DIRECTORY": str(log_dir),
            "CUDA_VISIBLE_DEVICES": ",".join(visible_devices),
        }
        if active_thread_percentage is not None:
            thread_percentage_command(active_thread_percentage)  # validates
            self._env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(active_thread_percentage)
        if pinned_memory_mib:
            for uuid, mib in pinned_memory_mib:
                pinned_limit_command(uuid, mib)  # validates
            self._env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(f"{u}={m}M" for u, m in pinned_memory_mib)

    def start(self) -> None:
        """``nvidia-cuda-mps-control -d``: returns once the daemon is up (or raises with its log)."""
        self.pipe_dir.mkdir(parents=True, exist_ok=True)
        self.pipe_dir.chmod(0o755)  # clients in containers of any user must reach the pipe
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.chmod(0o700)
        result = self._run(["-d"], "")
        if result.returncode != 0:
            raise MpsError(f"nvidia-cuda-mps-control -d failed: {_output(result)}{self._log_hint()}")

    def commands(self, lines: Sequence[str]) -> list[str]:
        """Send commands (client mode, one per line); the daemon's replies, one string per output line."""
        for line in lines:
            if "\n" in line or "\r" in line or not line.strip():
                raise ValueError(f"refusing an MPS command with a line break or nothing in it: {line!r}")
        result = self._run([], "".join(f"{line}\n" for line in lines))
        if result.returncode != 0:
            raise MpsError(f"MPS daemon at {self.pipe_dir} does not answer: {_output(result)}{self._log_hint()}")
        return [line for line in result.stdout.splitlines() if line.strip()]

    def answers(self) -> bool:
        """A daemon listens on the pipe and replies to a harmless query."""
        try:
            return bool(self.commands([READINESS_COMMAND]))
        except MpsError:
            return False

    def quit(self) -> None:
        self.commands(["quit"])

    def pid(self) -> int | None:
        """The daemon's PID from its pid file, if that process is alive."""
        try:
            pid = int((self.pipe_dir / PID_FILE).read_text().strip())
        except (OSError, ValueError):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return pid
        return pid

    def log_tail(self, lines: int = 5) -> list[str]:
        try:
            return (self.log_dir / CONTROL_LOG).read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return []

    def _log_hint(self) -> str:
        tail = self.log_tail()
        return f"; control.log ends: {' | '.join(tail)}" if tail else ""

    def _run(self, arguments: list[str], stdin: str) -> subprocess.CompletedProcess[str]:
        try:
            return subprocess.run(
                [self.binary, *arguments],
                input=stdin,
                capture_output=True,
                text=True,
                env=self._env,
                timeout=COMMAND_TIMEOUT,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            raise MpsError(f"cannot run {self.binary}: {error}") from error


def control_for(binary: str, root: Path, spec: MpsDaemonSpec) -> MpsControl:
    """The control of a spec's daemon under ``root``; its environment carries the limits too, so they hold
    from the daemon's first instant."""
    return MpsControl(
        binary,
        root / spec.key / "pipe",
        root / spec.key / "log",
        spec.visible_devices,
        active_thread_percentage=spec.active_thread_percentage,
        pinned_memory_mib=spec.pinned_memory_mib,
    )


def _output(result: subprocess.CompletedProcess[str]) -> str:
    text = (result.stderr or result.stdout or "").strip().replace("\n", " | ")
    return text or f"exit status {result.returncode}"
