"""The command line and the warm simulation federation on input of the
wrong kind and on half-gone federations: one line and an honest exit code,
never a traceback; a federation's leftover Ray head is stopped, not
orphaned. None starts Flower."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pollen.cli import EXIT_BAD_INPUT, EXIT_FAILED, main
from pollen.deployment import launch, processes, warm_simulation
from pollen.deployment.warm_simulation import STATE_FILE
from tests.conftest import PROJECT


class Submitted(Exception):
    """`pollen run` got as far as submitting (would start Flower)."""


@pytest.fixture
def no_submit(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> bool:
        raise Submitted("the run was submitted")

    monkeypatch.setattr(launch, "_submit", refuse)


def standin(name: str) -> subprocess.Popen[bytes]:
    """A process of ours whose command line contains `name` (argv[0]), as
    its own process-group leader (as the Ray head and the SuperLink are)."""
    process = subprocess.Popen(
        ["bash", "-c", f"exec -a {name} sleep 300"], start_new_session=True
    )
    deadline = time.monotonic() + 5
    while name not in processes.command_line(process.pid):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return process


def kill(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.kill(process.pid, signal.SIGKILL)
    process.wait()


def record(directory: Path, ray_pid: int, superlink_pid: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    temp = directory / "ray-temp"
    temp.mkdir(exist_ok=True)
    state = directory / STATE_FILE
    state.write_text(json.dumps({
        "directory": str(directory.resolve()), "ray_address": "127.0.0.1:1",
        "ray_temp_dir": str(temp), "ray_pid": ray_pid, "superlink_pid": superlink_pid,
    }))  # fmt: skip
    return state


def one_line_exit(argv: list[str], code: int, capsys) -> str:
    """`main(argv)` ends with `code` and one `pollen: error:` line, no traceback."""
    assert main(argv) == code
    err = capsys.readouterr().err.strip()
    assert err.startswith("pollen: error:") and "\n" not in err, err
    return err


# --- path arguments of the wrong kind: a traceback instead of one line -------


@pytest.mark.parametrize("action", ["status", "up", "down"])
def test_warm_dir_that_is_a_file_is_one_line(tmp_path: Path, capsys, action) -> None:
    """`pollen warm ACTION --dir FILE`: NotADirectoryError traceback."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    one_line_exit(["warm", action, "--dir", str(afile)], EXIT_FAILED, capsys)


@pytest.mark.parametrize("flag", ["--warm-simulation", "--deployment"])
def test_run_target_dir_that_is_a_file_is_one_line(
    tmp_path: Path, capsys, no_submit, flag
) -> None:
    """`pollen run --warm-simulation FILE` / `--deployment FILE`: a
    NotADirectoryError traceback, where a missing DIR is exit 2, one line."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    argv = ["run", str(PROJECT), flag, str(afile), "-c", f"output-dir='{tmp_path}'"]
    one_line_exit(argv, EXIT_BAD_INPUT, capsys)


def test_run_federation_config_toml_that_does_not_exist_is_one_line(
    tmp_path: Path, capsys, no_submit
) -> None:
    """`--federation-config missing.toml` (Flower reads a .toml value as a
    file): FileNotFoundError traceback instead of exit 2."""
    argv = ["run", str(PROJECT), "--federation-config", str(tmp_path / "fed.toml"),
            "-c", f"output-dir='{tmp_path}'"]  # fmt: skip
    one_line_exit(argv, EXIT_BAD_INPUT, capsys)


def test_warm_state_file_with_a_non_integer_pid_is_one_line(
    tmp_path: Path, capsys
) -> None:
    """A simulation.json whose pid is a string: TypeError traceback from
    os.kill, where a list is 'unreadable', one line."""
    state = record(tmp_path / "fed", 1, 1)
    data = json.loads(state.read_text())
    data["ray_pid"] = "12"
    state.write_text(json.dumps(data))
    one_line_exit(
        ["warm", "status", "--dir", str(tmp_path / "fed")], EXIT_FAILED, capsys
    )


def test_compare_out_that_is_a_file_is_one_line(tmp_path: Path, capsys) -> None:
    """`pollen compare GRID --out FILE --dry-run`: NotADirectoryError traceback."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    grid = PROJECT / "configs" / "grids" / "niid-bench-fmnist.toml"
    argv = ["compare", str(grid), str(PROJECT), "--out", str(afile), "--dry-run"]
    one_line_exit(argv, EXIT_BAD_INPUT, capsys)


def test_deploy_certs_out_that_is_a_file_is_one_line(tmp_path: Path, capsys) -> None:
    """`pollen deploy certs FILE HOST`: FileExistsError traceback."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main(["deploy", "certs", str(afile), "localhost"]) in (
        EXIT_BAD_INPUT,
        EXIT_FAILED,
    )
    assert capsys.readouterr().err.startswith("pollen: error:")


@pytest.mark.parametrize("action", [["status"], ["down"], ["restart", "superlink"]])
def test_deploy_dir_that_is_a_file_is_one_line(tmp_path: Path, capsys, action) -> None:
    """`pollen deploy status|down|restart --dir FILE`: NotADirectoryError traceback."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    argv = ["deploy", action[0], "--dir", str(afile), *action[1:]]
    assert main(argv) in (EXIT_BAD_INPUT, EXIT_FAILED)
    assert capsys.readouterr().err.startswith("pollen: error:")


# --- flags accepted that cannot work; exit codes that lie ---------------------


def test_deploy_register_with_no_key_is_not_success(tmp_path: Path, capsys) -> None:
    """`pollen deploy register EMPTY_DIR --connection x` registers nothing,
    prints nothing and exits 0."""
    (tmp_path / "keys").mkdir()
    rc = main(["deploy", "register", str(tmp_path / "keys"), "--connection", "x"])
    assert rc != 0


def test_run_federation_config_stray_word_is_refused(
    tmp_path: Path, capsys, no_submit
) -> None:
    """`--federation-config "num-supernodes=2 client-resources-num-cpus 2"`:
    Flower's parser drops the word without '=' (as it did for --node-config
    and --run-config, which pollen now refuses); the run goes ahead with
    the default CPUs."""
    argv = ["run", str(PROJECT), "-c", f"output-dir='{tmp_path}'",
            "--federation-config", "num-supernodes=2 client-resources-num-cpus 2"]  # fmt: skip
    one_line_exit(argv, EXIT_BAD_INPUT, capsys)


# --- warm down / warm up on a federation that is half gone or not its own ----


@pytest.mark.parametrize("action", ["down", "up"])
def test_what_is_left_of_a_federation_is_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, action: str
) -> None:
    """The SuperLink died, the Ray head still runs: `warm down` said 'not
    running any more' and left the head for ever; `warm up` started anew
    over it (simulation.json overwritten) and orphaned it."""
    monkeypatch.setattr(
        warm_simulation, "start_warm_simulation",
        lambda directory, cpus=None: warm_simulation.WarmSimulation(
            str(directory), "127.0.0.1:2", "/tmp/x", 1, 1
        ),
    )  # fmt: skip
    head = standin("ray-head-standin")
    gone = standin("flower-superlink-standin")
    kill(gone)
    try:
        directory = tmp_path / "fed"
        record(directory, head.pid, gone.pid)
        main(["warm", action, "--dir", str(directory)])
        time.sleep(0.5)
        assert head.poll() is not None, f"warm {action} left the Ray head running"
    finally:
        kill(head)


@pytest.mark.parametrize(
    "argv", [["--port", "70000"], ["--port", "-1"], ["--nodes", "0"]]
)
def test_deploy_up_numbers_out_of_range_are_refused_before_anything(
    tmp_path: Path, capsys, argv: list[str]
) -> None:
    """--port 70000 made the directory, then an OverflowError traceback;
    --nodes 0 exited 1, a failed deployment, for input to fix."""
    directory = tmp_path / "dep"
    with pytest.raises(SystemExit) as exit_info:
        main(["deploy", "up", "--dir", str(directory), "--insecure", *argv])
    assert exit_info.value.code == EXIT_BAD_INPUT and not directory.exists()
    assert "is not in" in capsys.readouterr().err


def test_stopping_a_federation_stops_what_its_dead_ray_head_left(
    tmp_path: Path,
) -> None:
    """The Ray head's process (`ray start --block`) ended, its raylet runs on
    in its group: stopping the federation stops it (it was left)."""
    from tests.test_deploy_inputs import group_with_a_dead_leader

    head, member = group_with_a_dead_leader(tmp_path, "ray")
    try:
        record(tmp_path / "fed", head, head)
        warm_simulation.stop_warm_simulation(
            warm_simulation.WarmSimulation.read(tmp_path / "fed")
        )
        assert processes.reaped(member, 5.0) or not processes.alive(member)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGKILL)


def test_a_federation_config_file_takes_pollens_simulation_defaults(
    tmp_path: Path,
) -> None:
    """Flower refuses a .toml beside key=value words, and pollen added its
    defaults as such words: every simulation given a file failed."""
    toml = tmp_path / "fed.toml"
    toml.write_text('num-supernodes = 2\nname = "a b"\n')
    federation = launch.simulation_federation([str(toml)], num_clients=4)
    given = launch._parse_federation(federation)
    assert given["num-supernodes"] == 2 and given["name"] == "a b"
    assert given["client-resources-num-cpus"] == 1


def test_a_warm_federation_refuses_actors_its_head_cannot_place(
    tmp_path: Path, capsys
) -> None:
    """A warm Ray head started with `--cpus 1` never places an actor that
    needs 2 CPUs; `--warm-simulation` checked against this machine's cores
    (2 here) and let the run wait for ever. A record without its CPUs (made
    before they were kept) counts this machine's."""
    head, link = standin("ray-head-standin"), standin("flower-superlink-standin")
    try:
        state = record(tmp_path / "fed", head.pid, link.pid)
        raw = json.loads(state.read_text())
        assert warm_simulation.WarmSimulation(**raw).cores == (os.cpu_count() or 1)
        state.write_text(json.dumps({**raw, "cpus": 1}))
        err = one_line_exit(
            ["run", str(PROJECT), "--warm-simulation", str(tmp_path / "fed"),
             "-c", f"output-dir='{tmp_path}'",
             "--federation-config", "client-resources-num-cpus=2"],
            EXIT_BAD_INPUT, capsys,
        )  # fmt: skip
        assert "client-resources-num-cpus=2" in err and "(0, 1]" in err
        state.write_text(json.dumps({**raw, "cpus": "two"}))
        with pytest.raises(warm_simulation.WarmSimulationError, match="its CPUs"):
            warm_simulation.WarmSimulation.read(tmp_path / "fed")
    finally:
        kill(head)
        kill(link)


def test_warm_up_says_the_cpus_a_running_head_keeps(tmp_path: Path) -> None:
    """`warm up --cpus 1` over a head offering 2 said only 'runs already':
    runs went on being sized for 2 with no word why. A head of 0 CPUs
    (through the Python API; the command refuses it) is refused before
    anything starts: Ray places no actor and every run waits."""
    head, link = standin("ray-head-standin"), standin("flower-superlink-standin")
    try:
        state = record(tmp_path / "fed", head.pid, link.pid)
        state.write_text(json.dumps({**json.loads(state.read_text()), "cpus": 2}))
        said = warm_simulation.warm_up(tmp_path / "fed", 1)
        assert "runs already" in said and "2 CPUs (--cpus 2)" in said
        assert "`pollen warm down` first for --cpus 1" in said
        assert "first for" not in warm_simulation.warm_up(tmp_path / "fed", 2)
    finally:
        kill(head)
        kill(link)
    with pytest.raises(warm_simulation.WarmSimulationError, match="at least 1 CPU"):
        warm_simulation.start_warm_simulation(tmp_path / "zero", 0)
    assert not (tmp_path / "zero").exists()
