"""Nothing outlives a run: SIGHUP (a closed terminal), SIGTERM and SIGKILL
of the `pollen run` process each stop every process the run started and
remove its temporary files, and leave the run directory interrupted and
resumable (`processes.stop_signals_interrupt`, `deployment.watchdog`)."""

from __future__ import annotations

import json
import os
import pty
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pollen.deployment import processes
from pollen.deployment.launch import LocalSuperLink
from pollen.deployment.processes import alive, descendants
from tests.conftest import PROJECT, read_through_line

pytestmark = pytest.mark.integration
BIN = Path(sys.executable).parent
# the temporary paths a `pollen run` simulation makes: Flower's home, the
# staged app, the stream's log
TEMPORARY = re.compile(r"/tmp/pollen-(flwr-home-[^/]+|app-[^/]+|flower-[^/]+\.log)")
ROUND = re.compile(r"^ {5}round (\d+)/300: ", re.MULTILINE)


def paths_of(pids: list[int]) -> set[Path]:
    """The temporary paths processes `pids` use: their working folders,
    open files and command-line arguments."""
    found: set[str] = set()
    for pid in pids:
        proc = Path(f"/proc/{pid}")
        try:
            found.update(TEMPORARY.findall(os.readlink(proc / "cwd")))
            found.update(TEMPORARY.findall((proc / "cmdline").read_bytes().decode()))
            for fd in (proc / "fd").iterdir():
                found.update(TEMPORARY.findall(os.readlink(fd)))
        except OSError:
            continue
    return {Path(f"/tmp/pollen-{name}") for name in found}


def on_terminal(argv: list[str]) -> tuple[subprocess.Popen[bytes], int]:
    """Start `argv` with a terminal (a pty) as its standard output and error,
    as from an interactive shell; the process and the terminal's master end
    (closing it hangs the terminal up, as a closed window or SSH session)."""
    master, slave = pty.openpty()
    run = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
    os.close(slave)
    return run, master


def read_until(master: int, text: str) -> str:
    """What the terminal shows, read until `text` appears."""
    shown = b""
    while text.encode() not in shown:
        shown += os.read(master, 4096)
    return shown.decode(errors="replace")


@pytest.mark.parametrize(
    "sig", [signal.SIGHUP, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name
)
def test_a_stopped_run_leaves_nothing_running_and_can_resume(
    sig: signal.Signals, tmp_path: Path
) -> None:
    """SIGHUP comes as a closing terminal sends it: the run's terminal is
    hung up first, so whatever the clean-up says cannot be written there
    (EIO) and must not fail it. SIGTERM and SIGKILL come to a command whose
    output is read through pipes, so what it showed last can be checked."""
    config = f"rounds=300 output-dir='{tmp_path}' run-name='stopped'"
    argv = [str(BIN / "pollen"), "run", str(PROJECT), "-c", config]
    shown = err = ""
    if sig == signal.SIGHUP:
        run, master = on_terminal(argv)
        read_until(master, "round 2/300")
    else:
        run = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)  # fmt: skip
        shown = read_through_line(run, "round 2/300")
    started = descendants(run.pid)  # by PID: what this run started
    temporary = paths_of([run.pid, *started])
    assert any("flwr-home" in p.name for p in temporary), temporary
    if sig == signal.SIGHUP:
        os.close(master)  # the terminal is gone
        run.send_signal(sig)
        run.wait(timeout=120)
    else:
        run.send_signal(sig)
        out, err = run.communicate(timeout=120)
        shown += out
    assert run.returncode == (-9 if sig == signal.SIGKILL else 130), err[-3000:]
    deadline = time.monotonic() + 60  # the watchdog's work after a SIGKILL
    while any(map(alive, started)) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = [p for p in started if alive(p)]
    assert not left, f"{sig.name} left processes {left} running"
    assert not [p for p in temporary if p.exists()]
    run_dir = tmp_path / "stopped"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["rounds"] >= 2
    assert (run_dir / "checkpoints" / f"round-{summary['rounds']:05d}").is_dir()
    assert (run_dir / "flower.log").exists() and not (run_dir / "run.lock").exists()
    if sig == signal.SIGTERM:  # the console's last round is the history's last
        assert int(ROUND.findall(shown)[-1]) == summary["rounds"], err[-2000:]
        assert f"interrupted after round {summary['rounds']}" in err


def test_a_killed_run_on_a_warm_federation_stops_its_serverapp_only(
    warm_federation: Path, tmp_path: Path
) -> None:
    """SIGKILL of a `pollen run --warm-simulation`: its ServerApp is
    interrupted (the run recorded as interrupted), the federation stays."""
    from pollen.deployment.processes import named_descendants
    from pollen.deployment.warm_simulation import WarmSimulation
    from pollen.deployment.watchdog import SERVERAPP_PROCESSES

    warm = WarmSimulation.load(warm_federation)
    before = set(named_descendants(warm.superlink_pid, SERVERAPP_PROCESSES))
    config = f"rounds=300 output-dir='{tmp_path}' run-name='stopped'"
    run = subprocess.Popen(
        [str(BIN / "pollen"), "run", str(PROJECT), "--warm-simulation",
         str(warm_federation), "-c", config],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    read_through_line(run, "round 2/300")
    found = named_descendants(warm.superlink_pid, SERVERAPP_PROCESSES)
    ours = [pid for pid in found if pid not in before]
    assert ours
    run.kill()
    run.communicate(timeout=60)
    deadline = time.monotonic() + 60
    while any(map(alive, ours)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(map(alive, ours)), "the killed run's ServerApp trains on"
    assert alive(warm.superlink_pid)
    summary = json.loads((tmp_path / "stopped" / "summary.json").read_text())
    assert summary["status"] == "interrupted"


def test_a_stop_signal_while_a_finished_runs_superlink_stops_waits_for_the_clean_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM arrives while the SuperLink of a run that has ended is being
    stopped: the SuperLink is stopped, its log kept and its Flower home
    removed all the same (the signal cut that short and the finished run
    was reported as interrupted)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "settings.json").write_text("{}")
    link = LocalSuperLink(run_dir)
    link.log_path.write_text("the SuperLink's log\n")
    link.process = subprocess.Popen(["sleep", "30"], start_new_session=True)
    stop = processes.stop

    def stop_signalled(pid: int) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)  # the handler runs here
        stop(pid)

    monkeypatch.setattr(processes, "stop", stop_signalled)
    try:
        with processes.stop_signals_interrupt():
            link.__exit__(None, None, None)
    except KeyboardInterrupt:
        pytest.fail("the signal cut the clean-up short")
    finally:
        link.process.kill()
    assert (run_dir / "superlink.log").read_text() == "the SuperLink's log\n"
    assert not link.home.exists() and not link.ray_dir.exists()
    assert link.process.wait(5) is not None
