"""The retiring daemon's own MPS servers, left out of its drain: read from the daemon, or none when it does not
answer (then every process on its devices counts, as before: nothing is quit under a workload)."""

from __future__ import annotations

from pathlib import Path

from agent.mps.control import MpsControl
from agent.mps.manager import _server_pids


def control(tmp_path: Path, binary: Path) -> MpsControl:
    return MpsControl(str(binary), tmp_path / "pipe", tmp_path / "log", ["GPU-0b8e2f44-0000-4000-8000-000000000001"])


def test_a_daemon_that_does_not_answer_has_no_servers_to_leave_out(tmp_path: Path) -> None:
    assert _server_pids(control(tmp_path, tmp_path / "no-such-binary")) == frozenset()
    assert _server_pids(None) == frozenset()


def test_the_servers_the_daemon_lists_are_left_out(tmp_path: Path, mps_bin: Path) -> None:
    mps = control(tmp_path, mps_bin / "nvidia-cuda-mps-control")
    mps.start()
    try:
        mps.commands(["start_server -uid 0"])
        (server,) = _server_pids(mps)
        assert server > 0 and str(server) in mps.commands(["get_server_list"])
    finally:
        mps.quit()
