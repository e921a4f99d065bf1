"""One agent per device-plugin directory: the second is refused by name, or gets the lock once it is let go."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from agent.plugin.lock import LockWaitStopped, PluginDirLock, PluginDirLocked


def test_a_second_holder_is_refused_naming_the_first(tmp_path: Path) -> None:
    first = PluginDirLock(tmp_path)
    first.acquire()
    try:
        with pytest.raises(PluginDirLocked, match=rf"pid {os.getpid()} on .+ since"):
            PluginDirLock(tmp_path).acquire(wait=0.1)
    finally:
        first.release()
    assert (first.path.stat().st_mode & 0o777) == 0o600


def test_a_waiting_agent_takes_over_when_its_predecessor_lets_go(tmp_path: Path) -> None:
    """A rolling update: the old agent is still stopping when the new one starts."""
    old, new = PluginDirLock(tmp_path), PluginDirLock(tmp_path)
    old.acquire()
    let_go = threading.Timer(0.2, old.release)
    let_go.start()
    try:
        new.acquire(wait=10)
        assert new.held
    finally:
        let_go.join()
        new.release()


def test_the_lock_survives_the_kubelet_cleaning_the_directory(tmp_path: Path) -> None:
    """Kubelets delete regular files in the directory at start; the lock lives in a sub-directory."""
    holder = PluginDirLock(tmp_path)
    holder.acquire()
    try:
        for entry in tmp_path.iterdir():
            if entry.is_file():
                entry.unlink()
        with pytest.raises(PluginDirLocked):
            PluginDirLock(tmp_path).acquire()
    finally:
        holder.release()


def test_a_stop_ends_the_wait_for_the_lock_at_once_naming_the_holder(tmp_path: Path) -> None:
    """SIGTERM while a predecessor still holds the directory: the waiting agent goes now, not when its wait ends."""
    holder, waiter = PluginDirLock(tmp_path), PluginDirLock(tmp_path)
    holder.acquire()
    stop = threading.Event()
    outcome: list[BaseException] = []

    def wait() -> None:
        try:
            waiter.acquire(wait=600, stop=stop)
        except BaseException as error:
            outcome.append(error)

    thread = threading.Thread(target=wait, daemon=True)
    try:
        thread.start()
        stop.set()
        thread.join(timeout=10)  # far below the 600 s the wait would otherwise last
        assert not thread.is_alive()
        (error,) = outcome
        assert isinstance(error, LockWaitStopped) and not waiter.held
        assert f"stopped while waiting for the device-plugin directory {tmp_path}" in str(error)
        assert f"pid {os.getpid()}" in str(error)
    finally:
        stop.set()
        thread.join(timeout=10)
        holder.release()
