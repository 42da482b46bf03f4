"""`pollen compare` on what users and killed runs leave: a cell a live run
holds (the dry run names it), cells that fail (the exit status says so),
`--only` as directory names spell values, named tables that set one key,
damaged run records and an `--out` that cannot hold a comparison. None
starts Flower."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest

from pollen.cli import main
from pollen.deployment.ray_cluster import RayCluster, RayClusterError, ask_cluster
from pollen.experiments import compare, report
from tests.conftest import PROJECT


def write_finished(run: Path, settings: dict, summary: dict | None = None) -> None:
    run.mkdir(parents=True)
    (run / "settings.json").write_text(json.dumps(settings))
    summary = summary or {
        "status": "completed", "rounds": 1, "final-accuracy": 0.5,
        "best-accuracy": 0.5, "best-round": 1, "total-seconds": 1.0,
        "total-bytes-up": 1, "total-bytes-down": 1,
    }  # fmt: skip
    (run / "summary.json").write_text(json.dumps(summary))
    (run / "history.json").write_text(
        json.dumps([{"round": 1, "accuracy": 0.5, "bytes-up": 1, "bytes-down": 1}])
    )


# 1. --dry-run while another compare runs a cell ------------------------------


def test_dry_run_names_the_cell_another_compare_is_running(
    tmp_path: Path, capsys
) -> None:
    """docs/usage.md: `--dry-run` there names the cell being run ("running
    now (pid N)"). While a compare runs a cell, that cell's `pollen run`
    holds its run directory (run.lock); the dry run was refused."""
    from pollen.runs.claim import claim

    out = tmp_path / "cmp"
    run_dir = out / "runs" / "strategy-fedavg"
    run_dir.mkdir(parents=True)
    (run_dir / "settings.json").write_text("{}")  # the live run's first file
    cell = compare.Cell("strategy-fedavg", 'strategy="fedavg"', {"rounds": 3})
    with compare.exclusive(out) as running, claim(run_dir, new=False):
        running("strategy-fedavg")  # what the other compare records
        compare.print_plan([cell], out)
    assert f"strategy-fedavg: running now (pid {os.getpid()})" in (
        capsys.readouterr().out
    )


# 2. exit status of a compare whose cells failed -------------------------------


@pytest.mark.parametrize("jobs", [1, 2], ids=["one-at-a-time", "jobs-2"])
@pytest.mark.parametrize("failing", [{"seed-2"}, {"seed-1", "seed-2"}])
def test_a_compare_whose_cell_failed_exits_with_exit_failed(
    tmp_path: Path, monkeypatch, capsys, failing: set, jobs: int
) -> None:
    """A cell whose `pollen run` fails makes `pollen compare` exit 1, as
    `pollen run` does for a run that did not complete (it exited 0 when
    another cell completed, and 2, "input to fix", when none did); the
    other cell runs and is reported, also beside it (`--jobs 2`)."""
    grid = tmp_path / "grid.toml"
    grid.write_text('[base]\ndata-set = "digits"\nrounds = 1\n[grid]\nseed = [1, 2]\n')
    out = tmp_path / "cmp"

    def run_cell(config: str, name: str, log: Path) -> int:
        settings = {"seed": int(name[-1]), "data-set": "digits", "run-name": name}
        if name in failing:
            write_finished(
                out / "runs" / name, settings,
                {"status": "failed", "error": "boom", "rounds": 0},
            )  # fmt: skip
            return 1
        write_finished(out / "runs" / name, settings)
        return 0

    monkeypatch.setattr(compare, "_cell_runners", lambda *a: [run_cell] * jobs)
    monkeypatch.setattr(
        compare, "_shared_federation", lambda *a: contextlib.nullcontext([])
    )
    monkeypatch.setattr(compare.os, "cpu_count", lambda: 2)
    command = ["compare", str(grid), str(PROJECT), "--out", str(out)]
    status = main([*command, "--jobs", str(jobs)])
    printed = capsys.readouterr()
    assert "[2/2] seed-2: failed" in printed.out
    assert status == 1, f"exit {status}; stderr: {printed.err}"
    if "seed-1" not in failing:
        assert "[1/2] seed-1: final" in printed.out


@pytest.mark.parametrize(
    ("jobs", "network", "message"),
    [
        ("0", False, r"--jobs 0: the cells run at once, each on a federation with at "
         r"least one of this machine's 2 CPUs; allowed: 1 to 2"),
        ("3", False, r"--jobs 3: .* allowed: 1 to 2"),
        ("2", True, r"--jobs 2 with --network: cells over a network profile run "
         r"one at a time"),
    ],
)  # fmt: skip
def test_jobs_the_machine_cannot_run_are_refused_before_anything_starts(
    tmp_path: Path, monkeypatch, capsys, jobs: str, network: bool, message: str
) -> None:
    """Each cell run at once has a warm federation with at least one CPU;
    deployed cells shape the machine's links, so run one at a time. Said
    before a cell or federation starts (exit 2, nothing written)."""
    import re

    from pollen.cli import EXIT_BAD_INPUT

    monkeypatch.setattr(compare.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(
        compare, "_shared_federation",
        lambda *a: pytest.fail("a federation started"),
    )  # fmt: skip
    grid = tmp_path / "grid.toml"
    grid.write_text('[base]\ndata-set = "digits"\n[grid]\nseed = [1, 2]\n')
    out = tmp_path / "cmp"
    argv = ["compare", str(grid), str(PROJECT), "--out", str(out), "--jobs", jobs]
    if network:
        profile = tmp_path / "net.toml"
        profile.write_text("[default]\ndelay-ms = 5\n")
        argv += ["--network", str(profile)]
    assert main(argv) == EXIT_BAD_INPUT
    assert re.search(message, capsys.readouterr().err)
    assert not out.exists()


CLUSTER = RayCluster("127.0.0.1:6390", cpus=3, nodes=2)


def on_a_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    """`RAY_ADDRESS` names `CLUSTER`, whose resources are asked of no Ray."""
    monkeypatch.setenv("RAY_ADDRESS", CLUSTER.address)
    monkeypatch.setattr(compare, "ask_cluster", lambda address: CLUSTER)


def test_a_ray_cluster_nothing_answers_at_is_refused_before_anything_starts(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """The address is tried (a TCP connection on loopback) before a cell
    or federation starts: Ray's own client retries it for minutes."""
    from pollen.cli import EXIT_BAD_INPUT
    from pollen.deployment.processes import free_port

    address = f"127.0.0.1:{free_port()}"
    monkeypatch.setenv("RAY_ADDRESS", address)
    grid = tmp_path / "grid.toml"
    grid.write_text('[base]\ndata-set = "digits"\n[grid]\nseed = [1, 2]\n')
    out = tmp_path / "cmp"
    assert main(["compare", str(grid), str(PROJECT), "--out", str(out)]) == (
        EXIT_BAD_INPUT
    )
    assert f"RAY_ADDRESS={address}: nothing answers there" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(
    "address", ["6379", "head", "head:port", ":6379", "ray://h:10001", "http://h:8265"]
)
def test_an_address_that_is_not_host_and_port_is_refused(address: str) -> None:
    with pytest.raises(RayClusterError, match=r"allowed: HOST:PORT .* or auto"):
        ask_cluster(address)


@pytest.mark.parametrize(
    ("status", "stdout", "stderr", "said"),
    [
        (0, "a warning only\n", "", "could not be read from what Ray printed"),
        (0, "", "", "could not be read from what Ray printed"),
        (1, "", "ValueError: No node info found matching attributes: ''",
         "this machine is not a node of that cluster"),
        (1, "", "ConnectionError: GCS gone", "Ray could not join a cluster there: "
         "ConnectionError: GCS gone"),
    ],
)  # fmt: skip
def test_what_the_cluster_answers_is_an_error_not_a_traceback(
    monkeypatch, status: int, stdout: str, stderr: str, said: str
) -> None:
    """Something listens at the address (a socket on loopback) and the
    driver's answer is unreadable, or Ray refused: one line saying so."""
    import socket
    import subprocess

    from pollen.deployment import ray_cluster

    def driver(command, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.CompletedProcess(command, status, stdout, stderr)

    monkeypatch.setattr(ray_cluster.subprocess, "run", driver)
    with socket.create_server(("127.0.0.1", 0)) as listening:
        port = listening.getsockname()[1]
        with pytest.raises(RayClusterError, match=f"RAY_ADDRESS=127.0.0.1:{port}: "):
            try:
                ask_cluster(f"127.0.0.1:{port}")
            except RayClusterError as err:
                assert said in str(err)
                raise


def test_jobs_are_bounded_by_the_clusters_cpus_not_this_machines(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """On a cluster each cell at once has at least one of its CPUs: 3 cells
    at once on 3 cluster CPUs from a 2-core machine, not 4."""
    from pollen.cli import EXIT_BAD_INPUT

    monkeypatch.setattr(compare.os, "cpu_count", lambda: 2)
    compare.check_jobs(3, network=False, cluster=CLUSTER)
    on_a_cluster(monkeypatch)
    grid = tmp_path / "grid.toml"
    grid.write_text('[base]\ndata-set = "digits"\n[grid]\nseed = [1, 2]\n')
    out = tmp_path / "cmp"
    argv = ["compare", str(grid), str(PROJECT), "--out", str(out), "--jobs", "4"]
    assert main(argv) == EXIT_BAD_INPUT
    assert (
        "--jobs 4: the cells run at once, each with at least one ClientApp actor of "
        f"the Ray cluster's (RAY_ADDRESS={CLUSTER.address}) 3 CPUs; allowed: 1 to 3"
    ) in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(("jobs", "share"), [(1, None), (2, "2"), (3, "2")])
def test_cells_on_a_cluster_start_no_federation_and_share_its_actors(
    tmp_path: Path, monkeypatch, capsys, jobs: int, share: str | None
) -> None:
    """Each cell run at once starts a SuperLink of its own that joins the
    cluster (no warm federation, no Ray head here); with two cells left,
    `--jobs 3` runs two, each with half of the cluster's actors."""
    from pollen.deployment.flower_simulation import SHARE_ENV

    on_a_cluster(monkeypatch)
    grid = tmp_path / "grid.toml"
    grid.write_text('[base]\ndata-set = "digits"\nrounds = 1\n[grid]\nseed = [1, 2]\n')
    out = tmp_path / "cmp"
    made: list[tuple[Path | None, dict | None]] = []

    def pollen_run_cell(app, out_, overrides, warm, stop, nodes, env):
        made.append((warm, env))

        def run_cell(config: str, name: str, log: Path) -> int:
            settings = {"seed": int(name[-1]), "data-set": "digits", "run-name": name}
            write_finished(out / "runs" / name, settings)
            return 0

        return run_cell

    monkeypatch.setattr(compare, "pollen_run_cell", pollen_run_cell)
    argv = ["compare", str(grid), str(PROJECT), "--out", str(out), "--jobs", str(jobs)]
    assert main(argv) == 0
    at_once = min(jobs, 2)
    assert [warm for warm, _ in made] == [None] * at_once
    assert [env and env[SHARE_ENV] for _, env in made] == [share] * at_once
    printed = capsys.readouterr().out
    assert (
        f"pollen: the cells run on the Ray cluster at {CLUSTER.address} (2 node(s), "
        "3 CPUs), each with a SuperLink here"
    ) in printed
    assert (f"{at_once} at once, each with 1/{at_once} of" in printed) == (jobs > 1)
    assert not (out / compare.WARM_DIR).exists()


def test_pollen_compare_refuses_a_jobs_that_is_not_a_count(tmp_path: Path) -> None:
    """`jobs=` in Python is checked as `--jobs` is: True is not 1."""
    import pollen

    with pytest.raises(pollen.SettingsError, match=r"--jobs True: .* allowed: 1 to"):
        pollen.compare({"seed": [1]}, out=tmp_path / "cmp", jobs=True)
    assert not (tmp_path / "cmp").exists()


# 3. --only ------------------------------------------------------------------


def test_only_given_the_same_value_twice_selects_the_cell_once() -> None:
    """`--only seed=1 --only seed=1` (a script adding the seeds it wants)
    made the cell twice, and the grid was refused as one whose values share
    a directory name."""
    grid = compare.Grid({}, {"strategy": ["fedavg"], "seed": [1, 2]})
    chosen = grid.select(["seed=1", "seed=1"])
    cells = compare.validate_cells(chosen, lambda c: {})
    assert [c.name for c in cells] == ["strategy-fedavg_seed-1"]


@pytest.mark.parametrize(
    ("axes", "selector", "directory"),
    [
        # a named table whose name has a space: directory strategy-feddyn-sam
        (
            {"strategy": [{"name": "feddyn sam", "strategy": "feddyn"}, "fedavg"]},
            "strategy=feddyn-sam",
            "strategy-feddyn-sam",
        ),
        # a float TOML writes 1e+20: directory lr-1e-20
        ({"lr": [1e20, 0.1]}, "lr=1e-20", "lr-1e-20"),
    ],
)
def test_only_accepts_the_value_as_its_directory_name_spells_it(
    axes: dict, selector: str, directory: str
) -> None:
    """docs/usage.md: `--only KEY=VALUE` runs the cells with that value,
    "spelled as in their directory names". A value that sanitising changes
    was only found by its raw spelling; the directory's spelling was refused."""
    grid = compare.Grid({}, axes)
    assert directory in [report.cell_name(c) for c in grid.cells()]
    chosen = grid.select([selector])
    assert [report.cell_name(c) for c in chosen.cells()] == [directory]


# 4. a grid whose named tables set one key twice --------------------------------


def test_two_named_tables_that_set_the_same_key_are_refused(tmp_path: Path) -> None:
    """A named table may not set another grid key ("set it in one place"),
    nor may two tables under different grid keys both set `lr`: the grid was
    accepted and in their cell the later table's lr silently won, while the
    cell's name claimed both variants."""
    path = tmp_path / "grid.toml"
    path.write_text(
        "[grid]\n"
        'strategy = [{name = "prox-fast", strategy = "fedprox", lr = 0.5}]\n'
        'sharing = [{name = "slow", sharing = "none", lr = 0.01}]\n'
    )
    with pytest.raises(compare.CompareError, match="both set 'lr'"):
        compare.Grid.load(path)


# 5. a damaged finished-run record: a traceback instead of a one-line error ------


def test_a_summary_that_is_not_an_object_does_not_crash_the_plan(
    tmp_path: Path,
) -> None:
    """A summary.json holding a JSON list: the run did not finish (a
    TypeError traceback ended `pollen compare` and --dry-run)."""
    run_dir = tmp_path / "runs" / "seed-1"
    write_finished(run_dir, {"seed": 1})
    (run_dir / "summary.json").write_text("[]")
    cell = compare.Cell("seed-1", "seed=1", {"seed": 1, "rounds": 1})
    (state,) = compare.with_states([cell], tmp_path)
    assert state.state != compare.DONE


def test_a_settings_record_that_is_not_an_object_is_a_compare_error(
    tmp_path: Path,
) -> None:
    """A finished run whose settings.json holds a list is named (an
    AttributeError traceback)."""
    run_dir = tmp_path / "runs" / "seed-1"
    write_finished(run_dir, {"seed": 1})
    (run_dir / "settings.json").write_text("[1]")
    cell = compare.Cell("seed-1", "seed=1", {"seed": 1, "rounds": 1})
    with pytest.raises(compare.CompareError, match=r"settings\.json"):
        compare.with_states([cell], tmp_path)


# 6. --out that cannot be a directory: a traceback ------------------------------


def test_an_out_that_is_a_file_is_refused_in_one_line(tmp_path: Path, capsys) -> None:
    """`--out` naming an existing file is one line and exit 2 (a
    FileExistsError traceback)."""
    grid = tmp_path / "grid.toml"
    grid.write_text('[base]\ndata-set = "digits"\nrounds = 1\n[grid]\nseed = [1]\n')
    out = tmp_path / "results.txt"
    out.write_text("not a directory\n")
    status = main(["compare", str(grid), str(PROJECT), "--out", str(out)])
    assert status == 2 and "pollen: error:" in capsys.readouterr().err
    assert out.read_text() == "not a directory\n"
