"""A run owns its directory and reports only its own outcome
(`pollen.runs.claim`, `launch.report_outcome`)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pollen.deployment.launch import report_outcome
from pollen.runs.claim import LOCK_FILE, check_claimed, claim, is_held
from pollen.runs.results import ResultsError
from tests.conftest import PROJECT

BIN = Path(sys.executable).parent


def test_a_new_run_directory_is_taken_once(tmp_path: Path) -> None:
    run_dir = tmp_path / "out" / "run"
    first = claim(run_dir, new=True)
    assert run_dir.is_dir() and is_held(run_dir)
    with pytest.raises(ResultsError, match="already exists"):
        claim(run_dir, new=True)
    with pytest.raises(ResultsError, match=f"pid {os.getpid()}"):
        claim(run_dir, new=False)
    first.release()
    # the run never started (no settings.json): nothing of it is left
    assert not (tmp_path / "out").exists()


def test_a_started_run_keeps_its_directory_on_release(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    held = claim(run_dir, new=True)
    (run_dir / "settings.json").write_text('{"run-name": "run"}')
    held.release()
    assert sorted(p.name for p in run_dir.iterdir()) == ["settings.json"]
    assert not is_held(run_dir)


def test_a_lock_of_a_killed_command_is_free(tmp_path: Path) -> None:
    """The kernel drops a dead process's flock: its run can be resumed."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    code = (
        "import sys, time; from pathlib import Path; from pollen.runs.claim import "
        f"claim; claim(Path({str(run_dir)!r}), new=False); print('held', "
        "flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
    assert is_held(run_dir)
    holder.kill()
    holder.wait()
    assert (run_dir / LOCK_FILE).exists() and not is_held(run_dir)
    claim(run_dir, new=False).release()


def test_the_server_app_writes_only_into_the_directory_claimed_for_it(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    held = claim(run_dir, new=True)
    check_claimed(run_dir, held.token)
    check_claimed(run_dir, "")  # `flwr run` by hand: no token, nothing to check
    with pytest.raises(ResultsError, match="is not held for this run"):
        check_claimed(run_dir, "another-token")
    held.release()


def _summary(run_dir: Path, token: str, status: str = "completed") -> None:
    run_dir.mkdir(exist_ok=True)
    (run_dir / "summary.json").write_text(json.dumps({
        "status": status, "error": None, "run-token": token, "rounds": 3,
        "final-accuracy": 0.9, "best-accuracy": 0.91, "best-round": 2,
        "total-seconds": 1.0,
    }))  # fmt: skip


def test_only_a_summary_with_the_runs_own_token_is_its_outcome(
    tmp_path: Path, capsys
) -> None:
    """A summary left by an earlier run (a resume that failed before its
    first round) or written by another is not this run's success."""
    _summary(tmp_path, token="earlier")
    log = tmp_path / "flower.log"
    assert not report_outcome(
        tmp_path, 1.0, token="mine", error="CheckpointError: model.npz", log=log
    )
    assert capsys.readouterr().err.strip() == (
        "pollen: run failed before writing its results: CheckpointError: "
        f"model.npz (Flower's lines: {log})"
    )
    _summary(tmp_path, token="mine")
    assert report_outcome(tmp_path, 1.0, token="mine")
    assert "completed 3 rounds" in capsys.readouterr().out


@pytest.mark.integration
def test_two_runs_on_one_directory_one_runs_the_other_fails_at_once(
    tmp_path: Path,
) -> None:
    """Started together with one run-name: one completes and reports itself,
    the other exits 2 in under 2 s naming the directory, and the winner's
    directory holds one run's files only."""
    config = f"output-dir='{tmp_path}' run-name='same' rounds=2"
    argv = [str(BIN / "pollen"), "run", str(PROJECT), "-c", config]
    started = time.monotonic()
    runs = [
        subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    ended: list[tuple[int, float, str, str]] = []

    def wait(run: subprocess.Popen[str]) -> None:
        out, err = run.communicate(timeout=300)
        ended.append((run.returncode, time.monotonic() - started, out, err))

    waiting = [threading.Thread(target=wait, args=(run,)) for run in runs]
    for thread in waiting:
        thread.start()
    for thread in waiting:
        thread.join()
    codes = sorted(code for code, *_ in ended)
    assert codes == [0, 2], [e[3][-2000:] for e in ended]
    loser = next(e for e in ended if e[0] == 2)
    winner = next(e for e in ended if e[0] == 0)
    assert f"{tmp_path / 'same'} already exists" in loser[3]
    assert loser[1] < winner[1] - 5  # it did not wait for Flower's start-up
    assert "completed 2 rounds" not in loser[2]
    assert "completed 2 rounds" in winner[2]
    names = sorted(p.name for p in (tmp_path / "same").iterdir())
    assert "flower-2.log" not in names and "run.lock" not in names
    summary = json.loads((tmp_path / "same" / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["run-token"]


def test_a_failed_resume_on_a_connection_never_reports_the_earlier_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """On a CONNECTION the directory is not claimed here (the ServerApp is
    remote), so no token tells summaries apart: the summary the resumed
    directory held before the run is not its outcome. Here `flwr run` could
    not reach the SuperLink; the command said "completed 3 rounds" and
    exited 0."""
    from dataclasses import replace

    from pollen.deployment import launch
    from pollen.settings import Settings

    run_dir = tmp_path / "results" / "run"
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps({
        "status": "completed", "error": None, "run-token": "earlier", "rounds": 3,
        "final-accuracy": 0.9, "best-accuracy": 0.91, "best-round": 2,
        "total-seconds": 1.0,
    }))  # fmt: skip
    settings = replace(Settings(), resume=str(run_dir), rounds=10)
    monkeypatch.setattr(launch, "prepare_run", lambda app, o: (settings, "", 0))
    monkeypatch.setattr(launch, "checked_federation", lambda s, f, t: [])

    def unreachable(app, run_config, run_dir, federation, target, console, watchdog):
        console.line("ERROR :   Connection to the SuperLink refused")
        return False

    monkeypatch.setattr(launch, "_submit", unreachable)
    assert not launch.run(tmp_path / "app", [], connection="remote")
    err = capsys.readouterr().err
    assert "run failed before writing its results" in err and "refused" in err
    # no run started in the directory: Flower's lines stay where they were
    # written, said, for the user to read (and for this test to remove)
    kept = Path(re.search(r"Flower's and Ray's lines are in (\S+)", err)[1])
    assert kept.read_text() == "ERROR :   Connection to the SuperLink refused\n"
    kept.unlink()


def test_a_killed_commands_watchdog_leaves_a_resumed_runs_lock_alone(
    tmp_path: Path,
) -> None:
    """The kernel frees a killed command's lock at once, so the run may be
    resumed at once; the dead command's watchdog abandons its claim only
    after its clean-up (a minute and more), and it unlinked the resumed
    run's lock file then: nobody could tell the directory was held, and the
    resumed run's ServerApp failed its check."""
    import io

    from pollen.deployment import watchdog

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "settings.json").write_text("{}")
    resumed = claim(run_dir, new=False)  # the first command is already dead
    try:
        told = json.dumps({"claim": str(run_dir), "made": []}) + "\n"
        watchdog.watch(io.StringIO(told))  # the dead command's watchdog, late
        assert is_held(run_dir)
        check_claimed(run_dir, resumed.token)
    finally:
        resumed.release()
    assert not is_held(run_dir) and not (run_dir / LOCK_FILE).exists()
