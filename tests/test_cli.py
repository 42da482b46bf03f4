"""`pollen run`'s defaults for the simulation it starts; the CLI loads without torch."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest

from pollen.deployment.launch import (
    CLIENT_CPUS,
    SIMULATED_NODES,
    LaunchError,
    LocalSuperLink,
    Target,
    checked_federation,
    simulation_federation,
)
from pollen.settings import Settings


def test_simulation_defaults_fill_only_the_keys_not_given() -> None:
    assert simulation_federation([], 7) == [
        "num-supernodes=7",
        f"client-resources-num-cpus={CLIENT_CPUS}",
    ]
    given = ["num-supernodes=3 client-resources-num-gpus=0.5"]
    assert simulation_federation(given, 7) == [
        *given,
        f"client-resources-num-cpus={CLIENT_CPUS}",
    ]
    given = ["client-resources-num-cpus=2", "num-supernodes=10"]
    assert simulation_federation(given, 7) == given
    # more clients than SIMULATED_NODES share the nodes
    assert simulation_federation([], 100_000)[0] == f"num-supernodes={SIMULATED_NODES}"
    with pytest.raises(LaunchError, match="invalid --federation-config"):
        simulation_federation(["num-supernodes=three"], 7)


@pytest.mark.parametrize("user_value", [None, "1"])
def test_ray_prestarts_no_idle_workers_unless_the_user_says(
    user_value: str | None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The simulation's environment (the SuperLink's, inherited by Ray) turns
    off Ray's idle workers for a first driver; a value the user set wins."""
    monkeypatch.delenv("RAY_TMPDIR", raising=False)
    if user_value is None:
        monkeypatch.delenv("RAY_prestart_worker_first_driver", raising=False)
    else:
        monkeypatch.setenv("RAY_prestart_worker_first_driver", user_value)
    link = LocalSuperLink(tmp_path)
    try:
        env = link.env
    finally:
        link.remove_folders()
    assert env["RAY_prestart_worker_first_driver"] == (user_value or "0")
    assert env["FLWR_HOME"] == str(link.home)
    # Ray's files in a folder of the run's own, not kept in $TMPDIR/ray for good
    assert env["RAY_TMPDIR"] == str(link.ray_dir) and not link.ray_dir.exists()


def test_the_cli_loads_without_torch() -> None:
    """`pollen --help`, `run`, `compare` and `deploy` answer without the
    seconds torch's import takes; only `pollen centralized` needs it."""
    probe = "import sys, pollen.cli; print('torch' in sys.modules)"
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    )
    assert loaded.stdout.strip() == "False"


# --- --network -------------------------------------------------------------


def _capture_runs(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """Every `pollen run` a compare cell would start, recorded, not run."""
    from pollen.experiments import compare

    commands: list[list[str]] = []

    class Finished:  # a run that has exited with status 1
        pid = 0
        returncode = 1

        def wait(self) -> int:
            return 1

        def poll(self) -> int:
            return 1

    def fake_start(command: list[str], **kwargs: object) -> Finished:
        commands.append(command)
        return Finished()

    monkeypatch.setattr(compare.processes, "start", fake_start)
    # no warm federation for runs that are not run
    monkeypatch.setattr(compare, "warm_simulation", lambda *_: contextlib.nullcontext())
    return commands


@pytest.mark.parametrize("command", ["run", "compare"])
def test_a_bad_network_profile_is_one_line_and_bad_input(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pollen.cli import EXIT_BAD_INPUT, main
    from tests.conftest import PROJECT

    grid = tmp_path / "grid.toml"
    grid.write_text('[grid]\nstrategy = ["fedavg"]\n')
    where = [str(PROJECT)] if command == "run" else [
        str(grid), str(PROJECT), "--out", str(tmp_path / "cmp")]  # fmt: skip
    bad = tmp_path / "bad.toml"
    bad.write_text("[default]\nslowdown = 0.5\n")
    for spec, message in [
        (str(tmp_path / "missing.toml"), "no such file"),
        ("no-such-preset", "not a file and not a preset"),
        (str(bad), "slowdown must be >= 1"),
    ]:
        assert main([command, *where, "--network", spec]) == EXIT_BAD_INPUT
        error = capsys.readouterr().err
        assert len(error.strip().splitlines()) == 1 and message in error
    assert not (tmp_path / "cmp").exists()


def test_compare_simulate_passes_the_profile_to_every_cell(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from pollen.cli import EXIT_BAD_INPUT, main
    from tests.conftest import PROJECT

    commands = _capture_runs(monkeypatch)
    grid = tmp_path / "grid.toml"
    grid.write_text('[base]\ndata-set = "digits"\n[grid]\nstrategy = ["fedavg"]\n')
    profile = tmp_path / "net.toml"
    profile.write_text("[default]\ndelay-ms = 5\n")
    argv = ["compare", str(grid), str(PROJECT), "--out", str(tmp_path / "cmp")]
    main([*argv, "--network", str(profile), "--simulate"])  # the fake run fails
    assert len(commands) == 1 and "--deployment" not in commands[0]
    assert "--warm-simulation" in commands[0]  # simulated cells share a federation
    assert f'network-profile="{profile.resolve()}"' in commands[0]
    assert main([*argv, "--simulate"]) == EXIT_BAD_INPUT
    assert "--simulate needs --network" in capsys.readouterr().err


def test_run_network_passes_the_profile_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pollen.cli import main
    from pollen.deployment import launch

    given: list[list[str]] = []
    monkeypatch.setattr(
        launch, "run", lambda app, overrides, **kwargs: given.append(overrides)
        or launch.Outcome(tmp_path, completed=True),
    )  # fmt: skip
    profile = tmp_path / "net.toml"
    profile.write_text("[default]\ndelay-ms = 5\n")
    assert main(["run", "-c", "rounds=1", "--network", str(profile)]) == 0
    assert given == [["rounds=1", f'network-profile="{profile.resolve()}"']]


def test_a_simulation_never_waits_for_more_nodes_than_it_starts() -> None:
    """3 clients start 3 SuperNodes: min-available-nodes=5 would wait
    node-wait (120 s) and fail; refused before anything starts."""
    settings = Settings.from_run_config({"num-clients": 3, "min-available-nodes": 5})
    with pytest.raises(LaunchError, match=r"'min-available-nodes': 5 above the "
                       r"simulation's 3 SuperNodes"):  # fmt: skip
        checked_federation(settings, [], Target())
    more = ["num-supernodes=5"]
    assert checked_federation(settings, more, Target())[0] == "num-supernodes=5"


def test_a_superlink_starting_up_is_stopped_when_the_command_dies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watchdog learns of the SuperLink as it starts, not after its
    health check (up to a minute): a command killed in between left the
    SuperLink, in its own session, running. A `sleep` stands in for it; the
    command dies while waiting for it to answer."""
    import os
    import signal
    import subprocess
    import time

    from pollen.deployment import processes
    from pollen.deployment.watchdog import Watchdog

    started: list[subprocess.Popen] = []
    real_popen = processes._popen

    def start(command, *, log, env=None, cwd=None):
        started.append(real_popen(["sleep", "300"], env, cwd, subprocess.DEVNULL))
        return started[-1]

    watchdog = Watchdog()

    def dies_waiting(pid, ready, *, name, log, timeout):
        assert watchdog.process.stdin is not None
        watchdog.process.stdin.close()  # what the kernel does for a killed command
        watchdog.process.wait(timeout=30)
        raise SystemExit

    monkeypatch.setattr(processes, "start", start)
    monkeypatch.setattr(processes, "wait_ready", dies_waiting)
    monkeypatch.setattr(processes, "stop", lambda pid, grace=0: None)  # it is dead
    try:
        with pytest.raises(SystemExit):
            LocalSuperLink(tmp_path / "run", watchdog).__enter__()
        time.sleep(0.2)
        assert started and started[0].poll() is not None, "the SuperLink outlived it"
    finally:
        for process in started:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGKILL)
                process.wait()
