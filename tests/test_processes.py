"""`pollen.deployment.processes`: start, wait until ready, stop by PID."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from pollen.deployment import processes

IGNORES_SIGTERM = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('up', flush=True); time.sleep(60)"
)


def test_a_process_that_exits_early_is_reported_with_its_log(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "early.log"
    process = processes.start(
        [sys.executable, "-c", "print('cannot bind'); raise SystemExit(3)"], log=log
    )
    with pytest.raises(processes.ProcessError, match=r"early exited(.|\n)*cannot bind"):
        processes.wait_ready(
            process.pid, lambda: False, name="early", log=log, timeout=30
        )
    process.wait()


def test_a_silent_process_times_out_and_a_ready_one_returns(tmp_path: Path) -> None:
    log = tmp_path / "sleeper.log"
    process = processes.start([sys.executable, "-c", IGNORES_SIGTERM], log=log)
    try:
        with pytest.raises(processes.ProcessError, match="did not answer in 0 s"):
            processes.wait_ready(
                process.pid, lambda: False, name="sleeper", log=log, timeout=0.2
            )
        processes.wait_ready(
            process.pid, lambda: "up" in log.read_text(), name="sleeper", log=log,
            timeout=30,
        )  # fmt: skip
    finally:
        processes.stop(process.pid, grace=0.5)
    assert not processes.alive(process.pid)


def test_stop_kills_what_ignores_sigterm_and_what_it_started(tmp_path: Path) -> None:
    """SIGTERM, the grace period, then SIGKILL for the group and for a
    descendant that left it (as Flower's SuperExec children do)."""
    stray = (
        "import subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-c', {IGNORES_SIGTERM!r}], "
        "start_new_session=True); time.sleep(60)"
    )
    process = processes.start([sys.executable, "-c", stray], log=tmp_path / "p.log")
    processes.wait_ready(
        process.pid, lambda: bool(processes.descendants(process.pid)),
        name="parent", log=tmp_path / "p.log", timeout=30,
    )  # fmt: skip
    (child,) = processes.descendants(process.pid)
    processes.stop(process.pid, grace=0.5)
    assert process.poll() is not None
    assert processes.reaped(child, 5) or not processes.alive(child)


def test_stop_child_keeps_the_exit_status(tmp_path: Path) -> None:
    process = processes.start(
        [sys.executable, "-c", "import time; time.sleep(60)"], log=None
    )
    processes.stop_child(process, grace=5)
    assert process.returncode == -15


def test_a_record_knows_its_processes_by_pid_and_start_time() -> None:
    """A recorded PID runs as recorded only with the start time the record
    keeps; a record without one trusts the PID; a zombie or a PID that
    ended does not run; a group is the record's while its leader runs as
    recorded or has ended, never when the PID runs another program."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = processes.start_times([process.pid, 0], {})
        assert started == {str(process.pid): processes.start_time(process.pid)}
        assert processes.start_times([process.pid], {str(process.pid): 7}) == {
            str(process.pid): 7
        }  # a time already recorded is kept
        assert processes.recorded_runs(process.pid, started)
        assert processes.recorded_runs(process.pid, {})
        assert not processes.recorded_runs(process.pid, {str(process.pid): 1})
        assert not processes.recorded_runs(0, {})
        assert processes.group_is_ours(process.pid, True)
        assert not processes.group_is_ours(process.pid, False)  # reused PID
        assert not processes.group_is_ours(0, False)
        process.kill()
        while processes.alive(process.pid):  # a zombie until reaped
            time.sleep(0.01)
        assert not processes.recorded_runs(process.pid, started)
        assert processes.group_is_ours(process.pid, False)  # its group may run on
    finally:
        process.kill()
        process.wait()
    assert processes.start_times([process.pid], {}) == {}


def test_a_live_process_whose_stat_cannot_be_read_is_trusted_without_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where /proc hides other processes' stat (hidepid=), a recorded PID
    that runs is still the record's unless the record has a start time it
    cannot check (the first `recorded_runs` called it gone: `deploy status`
    said stopped and `down` left its group)."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    hidden = f"/proc/{process.pid}/stat"
    read_text = Path.read_text

    def hiding(self: Path, *args, **kwargs) -> str:
        if str(self) == hidden:
            raise PermissionError(13, "Permission denied", hidden)
        return read_text(self, *args, **kwargs)

    try:
        monkeypatch.setattr(Path, "read_text", hiding)
        assert processes.recorded_runs(process.pid, {})
        assert not processes.recorded_runs(process.pid, {str(process.pid): 5})
    finally:
        process.kill()
        process.wait()
