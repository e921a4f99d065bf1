"""``tessera run``'s memory-limit flags and their environment twins: on by default, off turns the room and the
toolkit variables off, the two paths come from flag or variable and are refused when not absolute."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.cli import _parser
from agent.memlimits.settings import MemoryLimitSettings
from agent.run import OptionsError, RunOptions, build_options


@pytest.fixture(autouse=True)
def _no_tessera_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("TESSERA_"):
            monkeypatch.delenv(name)


def options(*argv: str) -> RunOptions:
    return build_options(_parser().parse_args(["run", *argv]), {})


def test_memory_limits_are_on_by_default_at_the_hosts_paths() -> None:
    assert options().memory_limits == MemoryLimitSettings(Path("/sys/fs/cgroup"), Path("/var/log/containers"))


def test_the_flags_set_the_paths_and_off_turns_it_off() -> None:
    given = options("--cgroup-root", "/host/cgroup", "--container-logs", "/host/logs").memory_limits
    assert given is not None and (given.cgroup_root, given.container_logs) == (Path("/host/cgroup"), Path("/host/logs"))
    assert options("--memory-limits", "off").memory_limits is None


def test_the_environment_twins_do_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSERA_CGROUP_ROOT", "/host/cgroup")
    monkeypatch.setenv("TESSERA_CONTAINER_LOGS", "/host/logs")
    given = options().memory_limits
    assert given is not None and (given.cgroup_root, given.container_logs) == (Path("/host/cgroup"), Path("/host/logs"))
    monkeypatch.setenv("TESSERA_MEMORY_LIMITS", "off")
    assert options().memory_limits is None


def test_a_relative_cgroup_root_is_refused_by_name() -> None:
    with pytest.raises(OptionsError, match="--cgroup-root"):
        options("--cgroup-root", "sys/fs/cgroup")
