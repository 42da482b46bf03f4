"""A warm simulation federation: runs submitted to one SuperLink and Ray
head in turn (`pollen run --warm-simulation`, `pollen compare`'s cells).

That a run on it gives the same history as a run on a federation of its
own is checked by tests/test_simulation.py (the default runs, the killed and
resumed runs, which cross the two).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pollen.cli import EXIT_BAD_INPUT, main
from pollen.deployment.warm_simulation import STATE_FILE, warm_simulation
from tests.conftest import PROJECT
from tests.test_ray_cluster import marked
from tests.test_simulation import ctrl_c_after_round_2

BIN = Path(sys.executable).parent


def test_a_missing_warm_federation_stops_before_anything_starts(
    tmp_path: Path, capsys
) -> None:
    argv = ["run", str(PROJECT), "--warm-simulation", str(tmp_path),
            "-c", f"output-dir='{tmp_path}'"]  # fmt: skip
    assert main(argv) == EXIT_BAD_INPUT
    assert f"no warm simulation in {tmp_path.resolve()} ({STATE_FILE} missing)" in (
        capsys.readouterr().err
    )
    (tmp_path / STATE_FILE).write_text(json.dumps({
        "directory": str(tmp_path), "ray_address": "127.0.0.1:1",
        "ray_temp_dir": "/tmp/none", "ray_pid": 999_999_999, "superlink_pid": 1,
    }))  # fmt: skip
    assert main(argv) == EXIT_BAD_INPUT
    assert "is not running any more" in capsys.readouterr().err
    argv += ["--deployment", str(tmp_path)]
    assert main(argv) == EXIT_BAD_INPUT
    assert list(tmp_path.iterdir()) == [tmp_path / STATE_FILE]


@pytest.mark.integration
def test_an_interrupted_run_leaves_the_federation_serving_and_the_end_leaves_nothing(
    tmp_path: Path,
) -> None:
    """Ctrl-C stops a run on the warm federation as on its own (interrupted,
    checkpointed), the federation then runs the next one, and when its block
    ends none of its processes (SuperLink, ServerApp, Ray) is left."""
    with warm_simulation(tmp_path / "federation") as federation:
        marks = (federation.ray_temp_dir, str(federation.flwr_home))
        command = [str(BIN / "pollen"), "run", str(PROJECT),
                   "--warm-simulation", str(federation.root)]  # fmt: skip
        _, errors = ctrl_c_after_round_2(
            [*command, "-c", f"rounds=300 output-dir='{tmp_path}' run-name='stopped'"]
        )
        summary = json.loads((tmp_path / "stopped" / "summary.json").read_text())
        assert summary["status"] == "interrupted" and summary["rounds"] >= 2
        assert "resume with:" in errors and "--warm-simulation" not in errors
        assert federation.running()
        after = subprocess.run(
            [*command, "-c", f"rounds=1 output-dir='{tmp_path}' run-name='after'"],
            capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        assert after.returncode == 0, after.stdout[-2000:] + after.stderr[-2000:]
        assert marked(marks[0]) and marked(marks[1])
    time.sleep(1)
    assert not marked(marks[0]) and not marked(marks[1])
    assert not (tmp_path / "federation" / STATE_FILE).exists()
    assert (tmp_path / "federation" / "superlink.log").stat().st_size > 0


@pytest.mark.integration
def test_pollen_warm_up_keeps_a_federation_that_runs_here_use(tmp_path: Path) -> None:
    """`pollen warm up` outlives its command; a `pollen run` in that folder
    uses it (and says so) and completes; `status` sees it, `down` stops
    both processes; a second `up` finds it running."""
    from pollen.deployment.processes import alive
    from pollen.deployment.warm_simulation import DEFAULT_DIR, WarmSimulation

    def pollen(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(BIN / "pollen"), *args], cwd=tmp_path, text=True,
                              capture_output=True, timeout=300, check=False)  # fmt: skip

    up = pollen("warm", "up", "--cpus", "1")
    assert up.returncode == 0, up.stderr[-2000:]
    federation = WarmSimulation.load(tmp_path / DEFAULT_DIR)
    try:
        assert "runs already" in pollen("warm", "up").stdout
        run = pollen("run", str(PROJECT), "-c", "rounds=2 output-dir='out'")
        assert run.returncode == 0, run.stderr[-2000:]
        assert "pollen: simulating on the warm federation in .pollen-warm" in run.stdout
        assert "completed 2 rounds" in run.stdout
        assert federation.running()  # the run left the federation serving
        assert "SuperLink pid" in pollen("warm", "status").stdout
    finally:
        down = pollen("warm", "down")
    assert down.returncode == 0, down.stderr
    assert not alive(federation.superlink_pid) and not alive(federation.ray_pid)
    gone = pollen("warm", "status")
    assert gone.returncode == 1 and "no warm simulation" in gone.stderr


def _fake_starts(
    monkeypatch: pytest.MonkeyPatch, taken: int
) -> list[tuple[tuple[int, int, int], subprocess.Popen]]:
    """A Ray head and a SuperLink that are `sleep`s: the head's log says it
    started and, for its first `taken` starts, that a subprocess could not
    bind its port (what Ray says when another process took the port)."""
    from pollen.deployment import warm_simulation as warm

    heads: list[tuple[tuple[int, int, int], subprocess.Popen]] = []

    def head(ports, env, log, cpus=None):
        with log.open("ab") as out:
            out.write(warm.RAY_READY_LINE.encode() + b"\n")
            if len(heads) < taken:
                out.write(warm.PORT_TAKEN + b": ray_client_server [exit code=1]\n")
        process = subprocess.Popen(["sleep", "60"], start_new_session=True)
        heads.append((ports, process))
        return process

    def link(home, env, log):
        return subprocess.Popen(["sleep", "60"], start_new_session=True), None

    monkeypatch.setattr(warm, "start_ray_head", head)
    monkeypatch.setattr(warm, "start_simulation_superlink", link)
    return heads


def test_a_head_whose_port_was_taken_starts_again_on_fresh_ports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ray's client server lost its port to another process between pollen's
    choice and its bind: the head exited a second after saying it started,
    and `pollen warm up` recorded a federation that was not running."""
    from pollen.deployment import warm_simulation as warm
    from pollen.deployment.processes import alive

    heads = _fake_starts(monkeypatch, taken=1)
    federation = warm.start_warm_simulation(tmp_path / "warm")
    try:
        (first, dead), (second, kept) = heads
        assert first != second and federation.ray_pid == kept.pid
        assert federation.ray_address == f"127.0.0.1:{second[0]}"
        dead.wait(timeout=10)
        assert not alive(dead.pid) and alive(kept.pid)
    finally:
        warm.stop_warm_simulation(federation)


def test_a_port_taken_at_every_try_is_an_error_that_leaves_nothing_running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pollen.deployment import warm_simulation as warm

    heads = _fake_starts(monkeypatch, taken=warm.HEAD_TRIES)
    with pytest.raises(warm.WarmSimulationError, match="taken each time"):
        warm.start_warm_simulation(tmp_path / "warm")
    assert len(heads) == warm.HEAD_TRIES
    for _, process in heads:
        assert process.wait(timeout=10) is not None
    assert not (tmp_path / "warm" / STATE_FILE).exists()


def test_a_run_given_a_ray_cluster_leaves_the_warm_federation_here_alone(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """`RAY_ADDRESS` names the cluster a run joins (a comparison's cells on
    a cluster start no warm federation): the one `pollen warm up` keeps in
    the shell's directory is not used, and the run says so."""
    from pollen.deployment.launch import warm_here
    from pollen.deployment.warm_simulation import DEFAULT_DIR

    monkeypatch.chdir(tmp_path)
    (tmp_path / DEFAULT_DIR).mkdir()
    (tmp_path / DEFAULT_DIR / STATE_FILE).write_text("{}")  # not read
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6390")
    assert warm_here() is None
    assert capsys.readouterr().out == (
        f"pollen: the warm federation in {DEFAULT_DIR} is not used: "
        "RAY_ADDRESS=127.0.0.1:6390 names the Ray cluster this run joins\n"
    )
