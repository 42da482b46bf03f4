"""`pollen.deployment.processes`: start, wait until ready, stop by PID."""

from __future__ import annotations

import sys
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
