"""The inotify watchers (agent.plugin.watch, agent.config.watch) on real files, real sockets and real inotify.

Each test waits on the queue the watcher posts to, with a deadline. The default safety re-check is 30 s,
so an event that arrives within the deadline came through inotify; where a test asserts that nothing is
posted it waits a short quiet window (inotify delivers in well under a millisecond).
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from agent.config.watch import ConfigSourceChanged, ConfigWatcher
from agent.plugin.watch import (
    KubeletSocketChanged,
    KubeletWatcher,
    PluginDirChanged,
    PluginDirWatcher,
    PluginSocketRemoved,
)

DEADLINE = 5.0  # for an event that must come
QUIET = 0.4  # for events that must not


class Posted:
    """What a watcher posted, in order."""

    def __init__(self) -> None:
        self.queue: queue.Queue[object] = queue.Queue()

    def __call__(self, event: object) -> None:
        self.queue.put(event)

    def next(self, what: str) -> object:
        try:
            return self.queue.get(timeout=DEADLINE)
        except queue.Empty:
            raise AssertionError(f"nothing posted within {DEADLINE:g} s: expected {what}") from None

    def take(self, count: int, what: str) -> list[object]:
        return [self.next(what) for _ in range(count)]

    def nothing(self, window: float = QUIET) -> None:
        try:
            event = self.queue.get(timeout=window)
        except queue.Empty:
            return
        raise AssertionError(f"unexpected {event!r}")


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="w", dir="/tmp"))  # unix socket paths are limited to 107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def sockets() -> Iterator[Callable[[Path], socket.socket]]:
    """``bind(path)``: a listening unix socket at ``path``, as the kubelet or a plugin server holds one."""
    held: list[socket.socket] = []

    def bind(path: Path) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(path))
        sock.listen()
        held.append(sock)
        return sock

    yield bind
    for sock in held:
        sock.close()


def thread_alive(native_id: int | None) -> bool:
    return any(t.native_id == native_id for t in threading.enumerate())


@contextmanager
def running(watcher: PluginDirWatcher | ConfigWatcher) -> Iterator[PluginDirWatcher | ConfigWatcher]:
    watcher.start()
    try:
        assert watcher.armed.wait(DEADLINE), "the watches were not in place in time"
        yield watcher
        assert watcher.alive() and thread_alive(watcher.native_id)
    finally:
        watcher.stop()
    assert not thread_alive(watcher.native_id), "stop() returned with the thread still running"


def cpu_ticks(native_id: int | None) -> int:
    """utime + stime of one thread of this process, in clock ticks."""
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5), counted after "pid (comm)"


# --- the device-plugin directory ---------------------------------------------------------------------------


def test_start_posts_the_current_state(base: Path, sockets) -> None:
    posted = Posted()
    with running(PluginDirWatcher(base / "dp", posted)):
        assert posted.take(2, "the state at start") == [PluginDirChanged(False), KubeletSocketChanged(False)]
        posted.nothing()

    (base / "dp").mkdir()
    sockets(base / "dp" / "kubelet.sock")
    posted = Posted()
    with running(PluginDirWatcher(base / "dp", posted)):
        assert posted.take(2, "the state at start") == [PluginDirChanged(True), KubeletSocketChanged(True)]
        posted.nothing()


def test_the_kubelet_socket_created_replaced_and_removed_is_posted(base: Path, sockets) -> None:
    directory = base / "dp"
    directory.mkdir()
    kubelet_sock = directory / "kubelet.sock"
    posted = Posted()
    with running(PluginDirWatcher(directory, posted)):
        assert posted.take(2, "the state at start") == [PluginDirChanged(True), KubeletSocketChanged(False)]

        first = sockets(kubelet_sock)
        assert posted.next("the kubelet socket created") == KubeletSocketChanged(True)

        # a kubelet restart: the old socket removed and a new one bound at once
        first.close()
        kubelet_sock.unlink()
        sockets(kubelet_sock)
        seen = [posted.next("the kubelet socket replaced")]
        if seen == [KubeletSocketChanged(False)]:  # the removal and the new socket read in two batches
            seen.append(posted.next("the new kubelet socket"))
        assert seen[-1] == KubeletSocketChanged(True)

        # a new socket renamed onto the name (no removal event at all)
        sockets(base / "kubelet.sock.new")  # outside: a socket renamed away from the directory is reported
        (base / "kubelet.sock.new").rename(kubelet_sock)
        assert posted.next("the kubelet socket replaced by a rename") == KubeletSocketChanged(True)

        kubelet_sock.unlink()
        assert posted.next("the kubelet socket removed") == KubeletSocketChanged(False)
        posted.nothing()


def test_a_deleted_or_moved_plugin_socket_is_posted(base: Path, sockets) -> None:
    directory = base / "dp"
    directory.mkdir()
    sockets(directory / "kubelet.sock")
    sockets(directory / "old.sock")  # there before the watcher started
    posted = Posted()
    with running(PluginDirWatcher(directory, posted)):
        assert posted.take(2, "the state at start") == [PluginDirChanged(True), KubeletSocketChanged(True)]

        sockets(directory / "nvidia-gpu.sock")
        (directory / "kubelet_internal_checkpoint").write_text("{}")  # not sockets: nothing said when they go
        (directory / "kubelet_internal_checkpoint").unlink()
        (directory / ".tessera").mkdir()
        (directory / ".tessera").rmdir()
        posted.nothing()

        (directory / "nvidia-gpu.sock").unlink()
        assert posted.next("a plugin socket deleted") == PluginSocketRemoved("nvidia-gpu.sock")
        (directory / "old.sock").rename(base / "elsewhere.sock")
        assert posted.next("a plugin socket moved away") == PluginSocketRemoved("old.sock")
        posted.nothing()


def test_the_directory_deleted_and_recreated_is_posted_and_watched_again(base: Path, sockets) -> None:
    directory = base / "dp"
    directory.mkdir()
    sockets(directory / "kubelet.sock")
    sockets(directory / "nvidia-gpu.sock")  # held open: the directory's own IN_DELETE_SELF waits for it
    posted = Posted()
    with running(PluginDirWatcher(directory, posted)):
        assert posted.take(2, "the state at start") == [PluginDirChanged(True), KubeletSocketChanged(True)]

        shutil.rmtree(directory)
        gone = posted.take(3, "the directory deleted")
        assert sorted(map(repr, gone)) == sorted(
            map(repr, [PluginSocketRemoved("nvidia-gpu.sock"), KubeletSocketChanged(False), PluginDirChanged(False)])
        )
        assert gone[-1] == PluginDirChanged(False)

        directory.mkdir()
        assert posted.next("the directory recreated") == PluginDirChanged(True)
        sockets(directory / "kubelet.sock")
        assert posted.next("the kubelet socket in the new directory") == KubeletSocketChanged(True)
        posted.nothing()


def test_a_directory_that_does_not_exist_yet_is_waited_for_through_its_ancestors(base: Path, sockets) -> None:
    directory = base / "var" / "lib" / "kubelet" / "device-plugins"
    posted = Posted()
    with running(PluginDirWatcher(directory, posted)):
        assert posted.take(2, "the state at start") == [PluginDirChanged(False), KubeletSocketChanged(False)]
        (base / "var" / "lib").mkdir(parents=True)
        (base / "var" / "lib" / "kubelet").mkdir()
        posted.nothing()
        directory.mkdir()
        assert posted.next("the directory created") == PluginDirChanged(True)
        sockets(directory / "kubelet.sock")
        assert posted.next("the kubelet socket") == KubeletSocketChanged(True)


def test_the_safety_recheck_posts_what_no_event_said_and_nothing_else(base: Path, sockets) -> None:
    # A directory reached through a renamed grandparent reports nothing (the grandparent is not watched):
    # a watcher with the default 30 s re-check stays silent, one re-checking every 0.2 s finds it.
    directory = base / "x" / "a" / "dp"
    directory.mkdir(parents=True)
    sockets(directory / "kubelet.sock")
    sockets(directory / "nvidia-gpu.sock")
    posted, unaware = Posted(), Posted()
    with (
        running(PluginDirWatcher(directory, posted, safety_interval=0.2)),
        running(PluginDirWatcher(directory, unaware)),
    ):
        assert posted.take(2, "the state at start") == [PluginDirChanged(True), KubeletSocketChanged(True)]
        assert unaware.take(2, "the state at start") == [PluginDirChanged(True), KubeletSocketChanged(True)]
        posted.nothing(1.0)  # five re-checks that find nothing new post nothing

        (base / "new" / "a" / "dp").mkdir(parents=True)  # built aside and renamed into place whole
        sockets(base / "new" / "a" / "dp" / "kubelet.sock")
        (base / "x").rename(base / "old")
        (base / "new").rename(base / "x")
        found = posted.take(2, "the re-check to notice the new directory")
        assert found == [PluginSocketRemoved("nvidia-gpu.sock"), KubeletSocketChanged(True)]
        posted.nothing()
        unaware.nothing(0)

        (directory / "kubelet.sock").unlink()  # the new directory is watched
        assert posted.next("the kubelet socket removed") == KubeletSocketChanged(False)


def test_an_error_on_the_watch_thread_is_logged_and_the_watch_rebuilt(
    base: Path, sockets, caplog: pytest.LogCaptureFixture
) -> None:
    directory = base / "dp"
    directory.mkdir()
    sockets(directory / "nvidia-gpu.sock")
    posted = Posted()
    failed = threading.Event()

    def post(event: object) -> None:
        if event == KubeletSocketChanged(True) and not failed.is_set():
            failed.set()
            raise RuntimeError("the loop's queue refused the event")
        posted(event)

    watcher = PluginDirWatcher(directory, post)
    with caplog.at_level(logging.ERROR, logger="agent.fswatch"), running(watcher):
        assert posted.take(2, "the state at start") == [PluginDirChanged(True), KubeletSocketChanged(False)]
        sockets(directory / "kubelet.sock")
        assert posted.next("the event again after the rebuild") == KubeletSocketChanged(True)
        assert failed.is_set() and watcher.failures == 1
        assert "the loop's queue refused the event" in caplog.text
        assert watcher.armed.wait(DEADLINE)
        (directory / "nvidia-gpu.sock").unlink()
        assert posted.next("events after the rebuild") == PluginSocketRemoved("nvidia-gpu.sock")


def test_kubelet_watcher_keeps_its_former_interface(base: Path, sockets) -> None:
    directory = base / "dp"
    directory.mkdir()
    posted = Posted()
    with running(KubeletWatcher(directory / "kubelet.sock", posted)):
        assert posted.next("the state at start") == KubeletSocketChanged(False)
        sockets(directory / "kubelet.sock")
        assert posted.next("the kubelet socket") == KubeletSocketChanged(True)
        sockets(directory / "p.sock")
        (directory / "p.sock").unlink()
        posted.nothing()


# --- the config ---------------------------------------------------------------------------------------------


def configmap_volume(directory: Path, files: dict[str, str], version: int) -> None:
    """Write ``files`` as the kubelet's AtomicWriter updates a ConfigMap volume: a new timestamped directory,
    ``..data_tmp`` pointing to it renamed onto ``..data``, user-visible symlinks, the old directory removed."""
    directory.mkdir(exist_ok=True)
    stamped = directory / f"..2026_01_01_00_00_0{version}.000000001"
    stamped.mkdir()
    for name, text in files.items():
        (stamped / name).write_text(text)
    old = (directory / "..data").readlink() if (directory / "..data").is_symlink() else None
    (directory / "..data_tmp").symlink_to(stamped.name)
    (directory / "..data_tmp").rename(directory / "..data")
    for name in files:
        if not (directory / name).is_symlink():
            (directory / name).symlink_to(Path("..data") / name)
    if old is not None:
        shutil.rmtree(directory / old)


def test_a_configmap_data_swap_posts_once(base: Path) -> None:
    volume = base / "config"
    configmap_volume(volume, {"default.yaml": "version: v1\n", "a100.yaml": "version: v1\n"}, 1)
    posted = Posted()
    with running(ConfigWatcher(volume, posted)):
        posted.nothing()
        configmap_volume(volume, {"default.yaml": "version: v1\nflags: {}\n", "a100.yaml": "version: v1\n"}, 2)
        assert posted.next("the swapped ConfigMap") == ConfigSourceChanged()
        posted.nothing()
        configmap_volume(volume, {"default.yaml": "version: v1\n", "a100.yaml": "version: v1\n"}, 3)
        assert posted.next("the ConfigMap swapped again") == ConfigSourceChanged()
        posted.nothing()


def test_a_file_of_a_configmap_volume_posts_once_when_swapped(base: Path) -> None:
    volume = base / "config"
    configmap_volume(volume, {"config.yaml": "version: v1\n"}, 1)
    posted = Posted()
    with running(ConfigWatcher(volume / "config.yaml", posted)):
        configmap_volume(volume, {"config.yaml": "version: v1\nflags: {}\n"}, 2)
        assert posted.next("the swapped ConfigMap key") == ConfigSourceChanged()
        posted.nothing()
        configmap_volume(volume, {"config.yaml": "version: v1\n"}, 3)  # the watch follows the new ..data
        assert posted.next("the ConfigMap key swapped again") == ConfigSourceChanged()
        posted.nothing()


def test_a_file_edited_in_place_or_replaced_posts(base: Path) -> None:
    config = base / "config.yaml"
    config.write_text("version: v1\n")
    posted = Posted()
    with running(ConfigWatcher(config, posted)):
        config.write_text("version: v1\nflags: {}\n")
        assert posted.next("the file edited in place") == ConfigSourceChanged()
        posted.nothing()

        staged = base / ".config.yaml.swp"
        staged.write_text("version: v1\nsharing: {}\n")
        staged.replace(config)
        assert posted.next("the file replaced by a rename") == ConfigSourceChanged()
        posted.nothing()

        config.unlink()
        assert posted.next("the file deleted") == ConfigSourceChanged()
        posted.nothing()


def test_a_plain_directory_of_configs_posts_on_a_write(base: Path) -> None:
    directory = base / "configs"
    directory.mkdir()
    (directory / "default.yaml").write_text("version: v1\n")
    posted = Posted()
    with running(ConfigWatcher(directory, posted)):
        (directory / "default.yaml").write_text("version: v1\nflags: {}\n")
        assert posted.next("a config written") == ConfigSourceChanged()
        (directory / "a100.yaml").write_text("version: v1\n")
        assert posted.next("a config added") == ConfigSourceChanged()
        posted.nothing()


def test_events_that_change_nothing_post_nothing(base: Path) -> None:
    config = base / "config.yaml"
    config.write_text("version: v1\n")
    info = config.stat()
    posted = Posted()
    with running(ConfigWatcher(config, posted)):
        with config.open("ab"):  # opened for writing and closed unwritten: IN_CLOSE_WRITE
            pass
        os.utime(config, ns=(info.st_atime_ns, info.st_mtime_ns))  # times set to what they were: IN_ATTRIB
        config.chmod(info.st_mode & 0o777)  # IN_ATTRIB
        (base / "other.yaml").write_text("version: v1\n")  # another file in the directory
        posted.nothing()


def test_a_new_file_is_posted_once_written_not_while_written(base: Path) -> None:
    config = base / "etc" / "tessera" / "config.yaml"
    posted = Posted()
    with running(ConfigWatcher(config, posted)):
        config.parent.mkdir(parents=True)
        posted.nothing()
        with config.open("w") as writer:
            writer.write("version: v1\n")
            writer.flush()
            posted.nothing()  # created, half written: not yet
        assert posted.next("the written file") == ConfigSourceChanged()
        posted.nothing()


def test_the_config_safety_recheck_posts_a_change_no_event_said(base: Path) -> None:
    config = base / "x" / "a" / "config.yaml"
    config.parent.mkdir(parents=True)
    config.write_text("version: v1\n")
    posted, unaware = Posted(), Posted()
    with running(ConfigWatcher(config, posted, safety_interval=0.2)), running(ConfigWatcher(config, unaware)):
        posted.nothing(1.0)
        (base / "new" / "a").mkdir(parents=True)  # built aside and renamed into place whole
        (base / "new" / "a" / "config.yaml").write_text("version: v1\nflags: {}\n")
        (base / "x").rename(base / "old")  # through a renamed grandparent: no event
        (base / "new").rename(base / "x")
        assert posted.next("the re-check to notice the new file") == ConfigSourceChanged()
        posted.nothing()
        unaware.nothing(0)


# --- both ---------------------------------------------------------------------------------------------------


def test_idle_watchers_use_no_cpu_and_stop_at_once(base: Path, sockets) -> None:
    directory = base / "dp"
    directory.mkdir()
    config = base / "config.yaml"
    config.write_text("version: v1\n")
    posted = Posted()
    plugin_dir, config_watch = PluginDirWatcher(directory, posted), ConfigWatcher(config, posted)
    with running(plugin_dir), running(config_watch):
        assert posted.take(2, "the state at start") == [PluginDirChanged(True), KubeletSocketChanged(False)]
        sockets(directory / "kubelet.sock")  # both threads are past their start once these come back
        config.write_text("version: v1\nflags: {}\n")
        assert {repr(e) for e in posted.take(2, "a change each")} == {
            repr(KubeletSocketChanged(True)),
            repr(ConfigSourceChanged()),
        }
        before = [cpu_ticks(plugin_dir.native_id), cpu_ticks(config_watch.native_id)]
        time.sleep(1.0)  # the point: nothing happens for a second
        after = [cpu_ticks(plugin_dir.native_id), cpu_ticks(config_watch.native_id)]
        assert all(b - a <= 1 for a, b in zip(before, after, strict=True)), (before, after)
        posted.nothing(0)


def test_a_stop_that_does_not_wait_returns_while_the_thread_is_busy(base: Path, sockets) -> None:
    """``tessera run`` stops its watchers without waiting for their threads (the process ends right after, and
    closing an inotify instance can take the kernel ~10 ms): ``stop(timeout=0)`` returns at once even while the
    thread is in the middle of something, and the thread still ends by itself."""
    directory = base / "dp"
    directory.mkdir()
    busy, release = threading.Event(), threading.Event()

    def post(event: object) -> None:
        if event == KubeletSocketChanged(True):
            busy.set()
            release.wait(DEADLINE)

    watcher = PluginDirWatcher(directory, post)
    watcher.start()
    assert watcher.armed.wait(DEADLINE)
    sockets(directory / "kubelet.sock")
    assert busy.wait(DEADLINE), "the watcher did not post the kubelet socket"
    watcher.stop(timeout=0)
    assert thread_alive(watcher.native_id)  # returned without waiting for it
    release.set()
    deadline = time.monotonic() + DEADLINE
    while thread_alive(watcher.native_id) and time.monotonic() < deadline:
        threading.Event().wait(0.01)
    assert not thread_alive(watcher.native_id), "the stopped thread did not end"


def test_a_watcher_starts_without_running_a_program(base: Path) -> None:
    """The first watcher of a start runs no subprocess: inotify_simple alone would look its libc up with
    ``ldconfig -p`` (~13 ms of every start). A fresh interpreter, so that no earlier watcher has been armed; an
    audit hook sees every program started."""
    directory = base / "dp"
    directory.mkdir()
    script = f"""
import sys, threading
started = []
sys.addaudithook(lambda event, args: started.append(args[0]) if event in ("subprocess.Popen", "os.posix_spawn",
                                                                         "os.exec", "os.fork") else None)
from pathlib import Path
from agent.plugin.watch import PluginDirWatcher, KubeletSocketChanged
seen = threading.Event()
watcher = PluginDirWatcher(Path({str(directory)!r}), lambda e: seen.set() if e == KubeletSocketChanged(True) else None)
watcher.start()
assert watcher.armed.wait({DEADLINE})
open({str(directory / "kubelet.sock")!r}, "w").close()
assert seen.wait({DEADLINE}), "the watcher did not see the socket"
watcher.stop()
print(started)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"programs run while a watcher started: {result.stdout}"
