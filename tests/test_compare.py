"""`pollen compare` and `pollen report`: the grid, resuming, aggregation over
seeds, the table, the plots; and a real comparison of two tiny runs."""

from __future__ import annotations

import _thread
import json
import os
import shlex
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from pollen.cli import main
from pollen.experiments import compare, report
from tests.conftest import PROJECT


def write_run(
    root: Path,
    name: str,
    settings: dict,
    accuracy: list[float],
    seconds: float = 10.0,
    history: list[dict] | None = None,
    summary: dict | None = None,
) -> Path:
    """A finished run directory as `pollen run` leaves it (what reports read);
    `history` replaces the default rows (1 MB up, 2 MB down a round),
    `summary` the summary."""
    run = root / name
    run.mkdir(parents=True)
    settings = {"seed": 1, "data-set": "digits", "run-name": name, **settings}
    history = history or [
        {"round": i + 1, "accuracy": a, "bytes-up": 1_000_000, "bytes-down": 2_000_000}
        for i, a in enumerate(accuracy)
    ]
    summary = summary or {
        "status": "completed", "rounds": len(accuracy),
        "final-accuracy": accuracy[-1], "best-accuracy": max(accuracy),
        "best-round": accuracy.index(max(accuracy)) + 1, "total-seconds": seconds,
        "total-bytes-up": 1_000_000 * len(accuracy),
        "total-bytes-down": 2_000_000 * len(accuracy),
    }  # fmt: skip
    for file, content in (
        ("settings", settings),
        ("summary", summary),
        ("history", history),
    ):
        (run / f"{file}.json").write_text(json.dumps(content))
    return run


def grid_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "grid.toml"
    path.write_text(text, errors="surrogateescape")  # \udcXX: that raw byte
    return path


def test_grid_cells_are_the_product_in_order_with_readable_names(
    tmp_path: Path,
) -> None:
    grid = compare.Grid.load(grid_file(tmp_path, """
target = 0.8
[base]
rounds = 3
[grid]
strategy = ["fedavg", "fedprox"]
seed = [1, 2]
"""))  # fmt: skip
    assert grid.base == {"rounds": 3} and grid.target == 0.8
    assert [report.cell_name(c) for c in grid.cells()] == [
        "strategy-fedavg_seed-1", "strategy-fedavg_seed-2",
        "strategy-fedprox_seed-1", "strategy-fedprox_seed-2",
    ]  # fmt: skip
    assert report.cell_name({"data-root": "/a b"}) == "data-root--a-b"


def test_a_named_table_sets_keys_together_in_one_cell(tmp_path: Path) -> None:
    grid = compare.Grid.load(grid_file(tmp_path, """
[grid]
strategy = ["fedavg", {name = "feddyn-sam", strategy = "feddyn", local-objective = "feddyn-sam"}]
seed = [1]
"""))  # fmt: skip
    ran: dict[str, str] = {}

    def run_cell(config: str, name: str, log: Path) -> int:
        ran[name] = config
        write_run(tmp_path / "out" / "runs", name, {}, [0.5])
        return 0

    out = tmp_path / "out"
    cells = compare.with_states(compare.validate_cells(grid, lambda c: {}), out)
    compare.run_grid(cells, out, [run_cell])
    assert ran == {
        "strategy-fedavg_seed-1": 'strategy="fedavg" seed=1',
        "strategy-feddyn-sam_seed-1":
            'strategy="feddyn" local-objective="feddyn-sam" seed=1',
    }  # fmt: skip


def test_only_selects_cells_by_the_values_their_names_spell() -> None:
    named = {"name": "feddyn-sam", "strategy": "feddyn"}
    grid = compare.Grid({}, {"strategy": ["fedavg", named, "fedsam"], "seed": [1, 2]})
    chosen = grid.select(["strategy=feddyn-sam", "strategy=fedavg", "seed=2"])
    assert [report.cell_name(c) for c in chosen.cells()] == [
        "strategy-feddyn-sam_seed-2", "strategy-fedavg_seed-2",
    ]  # fmt: skip
    assert grid.select([]) == grid
    with pytest.raises(
        compare.CompareError, match="strategy takes fedavg, feddyn-sam, fedsam"
    ):
        grid.select(["strategy=fedprox"])
    with pytest.raises(compare.CompareError, match=r"a grid key \(strategy, seed\)"):
        grid.select(["lr=0.1"])


def test_a_report_of_a_folder_with_a_damaged_grid_says_so(tmp_path: Path) -> None:
    """With --target the report reads the grid only for its shape; a damaged
    grid.toml is one line there too (it was a TOMLDecodeError traceback)."""
    write_run(tmp_path / "runs", "a", {"strategy": "fedavg"}, [0.4, 0.6])
    write_run(tmp_path / "runs", "b", {"strategy": "fedprox"}, [0.5, 0.7])
    (tmp_path / "grid.toml").write_text("[grid]\nseed = [1\n")
    with pytest.raises(compare.CompareError, match="cannot read the comparison's"):
        compare.report_comparison(tmp_path, 0.5)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[grid]\nseed = 1\n", "grid key 'seed' must be a non-empty list"),
        ("[grid]\nseed = []\n", "must be a non-empty list"),
        ("target = 80\n", r"target must be an accuracy in \(0, 1\], got 80"),
        ("[cells]\n", "unknown table or key 'cells'"),
        ("[grid\n", "cannot read grid"),
        ("[grid]\nstrategy = [{lr = 0.1}]\n", "needs a name"),
        ("[grid]\nstrategy = [{name = 'a'}]\n", "'a'.* sets no keys"),
        ("[grid]\nstrategy = [{name = 'a', lr = [1]}]\n", "'lr' must be a single"),
        (
            "[grid]\nstrategy = [{name = 'a', seed = 2}]\nseed = [1]\n",
            "sets 'seed', which is itself a grid key",
        ),
        (
            "[base]\nstrategy = ['fedavg', 'fedprox']\n",
            r"\[base\] strategy is a list; \[base\] holds one value per key, the "
            r"values to compare go in a list under \[grid\]",
        ),
        ("[base]\nrun-name = 'x'\n", "run-name is set by pollen compare"),
        ("[grid]\noutput-dir = ['a']\n", "output-dir is set by pollen compare"),
        ("# caf\udce9\n", r"not UTF-8 text \(byte 5\); a grid is a TOML file"),
        ("grid = 5\n", r"grid must be a table \(\[grid\]"),
        ("grid = [1, 2]\n", "grid must be a table"),
        ("[grid]\nseed = [1979-05-27]\n", "grid key 'seed': datetime.date"),
        ("[base]\nseed = 1979-05-27\n", r"\[base\] seed: datetime.date.* is a date"),
        ("target = true\n", "target must be an accuracy in"),
        (
            "[grid]\nstrategy = [{name = 'a', strategy = 'fedavg', run-name = 'x'}]\n",
            r"\('a'\) sets 'run-name', which pollen compare sets for each cell",
        ),
    ],
)
def test_bad_grids_are_refused_with_the_reason(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(compare.CompareError, match=message):
        compare.Grid.load(grid_file(tmp_path, text))


def fake_cell(out: Path, ran: list[str], accuracy: float = 0.5):
    """A `run_cell` that writes a finished run and records its name."""

    def run_cell(config: str, name: str, log: Path) -> int:
        ran.append(name)
        write_run(out / "runs", name, {"strategy": name.split("_")[0]}, [accuracy])
        return 0

    return run_cell


def run_fake_grid(grid: compare.Grid, out: Path, ran: list[str]) -> list[str]:
    """Plan and run `grid` with `fake_cell`; the progress lines."""
    lines: list[str] = []
    cells = compare.with_states(
        compare.validate_cells(grid, lambda c: {"rounds": 1}), out
    )
    compare.run_grid(cells, out, [fake_cell(out, ran)], lines.append)
    return lines


def test_a_grid_resumes_and_keeps_an_interrupted_cell_aside(tmp_path: Path) -> None:
    grid = compare.Grid(
        {"rounds": 1}, {"strategy": ["fedavg", "fedsam"], "seed": [1, 2]}
    )
    ran: list[str] = []
    lines = run_fake_grid(grid, tmp_path, ran)
    assert len(ran) == 4 and lines[-1].startswith(
        "[4/4] strategy-fedsam_seed-2: final 50.00%"
    )
    assert "ETA" in lines[0]
    broken = tmp_path / "runs" / "strategy-fedsam_seed-1"
    (broken / "summary.json").unlink()  # as if killed mid-run, before a checkpoint
    ran.clear()
    lines = run_fake_grid(grid, tmp_path, ran)
    assert ran == ["strategy-fedsam_seed-1"]
    assert sum("done before, kept" in line for line in lines) == 3
    assert (
        "interrupted with no checkpoint (checkpoint-every=0), starts again" in lines[2]
    )
    (aside,) = (tmp_path / "incomplete").iterdir()
    assert (
        aside.name.startswith("strategy-fedsam_seed-1-")
        and (aside / "history.json").exists()
    )


@pytest.mark.parametrize("recorded", [True, False], ids=["settings", "no-settings"])
def test_a_cell_stopped_before_its_first_checkpoint_starts_over(
    tmp_path: Path, recorded: bool
) -> None:
    """A cell of checkpoint-every=1 interrupted before round 1 ended was
    said to be one that "cannot resume (... a run writes them when
    checkpoint-every > 0)": it wrote none yet, and simply runs from round 1.
    Its checkpoint-every is the one its run recorded, else (stopped before
    the ServerApp wrote settings.json) the cell's."""
    grid = compare.Grid({"rounds": 1}, {"strategy": ["fedavg"]})
    stopped = tmp_path / "runs" / "strategy-fedavg"
    stopped.mkdir(parents=True)
    if recorded:
        (stopped / "settings.json").write_text(json.dumps({"checkpoint-every": 1}))
    cells = compare.with_states(
        compare.validate_cells(grid, lambda c: {"rounds": 1, "checkpoint-every": 1}),
        tmp_path,
    )
    lines: list[str] = []
    compare.run_grid(cells, tmp_path, [fake_cell(tmp_path, [])], lines.append)
    assert lines[0] == (
        "[1/1] strategy-fedavg: interrupted before its first checkpoint "
        "(checkpoint-every=1), starts again from round 1; the interrupted run is "
        f"kept in {next((tmp_path / 'incomplete').iterdir())}"
    )
    assert lines[1].startswith("[1/1] strategy-fedavg: final 50.00%")


def test_two_cells_run_at_once_and_the_third_takes_the_first_free_one(
    tmp_path: Path,
) -> None:
    """`--jobs 2`: the first two cells wait for each other (they can only
    both finish if they ran at once), the third starts when one is free; the
    lock file names every cell running, and the lines keep the grid's order
    of cells in their prefixes."""
    grid = compare.Grid({"rounds": 1}, {"seed": [1, 2, 3]})
    cells = compare.with_states(
        compare.validate_cells(grid, lambda c: {"rounds": 1}), tmp_path
    )
    together = threading.Barrier(2, timeout=20)
    threads: dict[str, str] = {}

    def run_cell(config: str, name: str, log: Path) -> int:
        if name != "seed-3":
            together.wait()
        threads[name] = threading.current_thread().name
        write_run(tmp_path / "runs", name, {"seed": int(name[-1])}, [0.5])
        return 0

    lines: list[str] = []
    said: list[str] = []
    failed = compare.run_grid(
        cells, tmp_path, [run_cell, run_cell], lines.append, running=said.append,
        stop=threading.Event(),
    )  # fmt: skip
    assert failed == [] and sorted(threads) == ["seed-1", "seed-2", "seed-3"]
    assert lines[:2] == ["[1/3] seed-1: running", "[2/3] seed-2: running"]
    assert "[3/3] seed-3: running" in lines
    assert sum(line.startswith("[3/3] seed-3: final 50.00%") for line in lines) == 1
    assert said[0] == "seed-1 seed-2" and "seed-3" in said[-1]  # said as it changes
    assert all(name.startswith("pollen-cell") for name in threads.values())


def test_ctrl_c_stops_every_running_cell_at_once_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C in the comparison's thread while two cells run in theirs: both
    runs are stopped (SIGTERM to their process groups, together, not one
    grace period after another) and the interrupt goes on to the caller."""
    from pollen.deployment import processes

    started: list[subprocess.Popen] = []

    def start(command: list[str], *, log: Path, env=None) -> subprocess.Popen:
        run = subprocess.Popen(["sleep", "30"], start_new_session=True)
        started.append(run)
        return run

    monkeypatch.setattr(compare.processes, "start", start)
    stop = threading.Event()
    run_cells = [
        compare.pollen_run_cell(PROJECT, tmp_path, [], tmp_path / f"warm-{k}", stop)
        for k in (1, 2)
    ]
    grid = compare.Grid({"rounds": 1}, {"seed": [1, 2, 3]})
    cells = compare.with_states(
        compare.validate_cells(grid, lambda c: {"rounds": 1}), tmp_path
    )

    returned = threading.Event()

    def interrupt_when_both_run() -> None:
        deadline = time.monotonic() + 20
        while len(started) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        if not returned.is_set():  # never into another test's time
            _thread.interrupt_main()  # as Ctrl-C reaches the main thread

    interrupter = threading.Thread(target=interrupt_when_both_run, daemon=True)
    interrupter.start()
    lines: list[str] = []
    began = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        try:
            compare.run_grid(cells, tmp_path, run_cells, lines.append, stop=stop)
        finally:
            returned.set()
            interrupter.join()
    assert time.monotonic() - began < 15  # SIGTERM ends `sleep` at once
    assert stop.is_set() and len(started) == 2
    assert not any(processes.alive(run.pid) for run in started)
    assert lines[:2] == ["[1/3] seed-1: running", "[2/3] seed-2: running"]
    assert lines[2].startswith("pollen: stopping 2 running cell(s)")
    assert not (tmp_path / "runs" / "seed-3").exists()  # never started


def test_a_cohort_cell_beside_others_keeps_the_nodes_of_one_federation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slot offers fewer CPUs than the machine, and a cohort run's default
    SuperNodes are one per actor the CPUs hold: a cohort cell run beside
    others is given the machine's count, so the history of `--jobs 1`."""
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    configs = {
        "cohort": {"num-clients": 10, "client-execution": "cohort"},
        "few": {"num-clients": 3, "client-execution": "cohort"},
        "plain": {"num-clients": 10, "client-execution": "sequential"},
    }
    nodes = compare._cohort_nodes(configs)
    assert nodes == {"cohort": 4, "few": 3}
    commands: list[list[str]] = []

    def start(command: list[str], *, log: Path, env=None) -> subprocess.Popen:
        commands.append(command)
        return subprocess.Popen(["true"])

    monkeypatch.setattr(compare.processes, "start", start)
    run_cell = compare.pollen_run_cell(
        PROJECT, tmp_path, [], tmp_path / "warm-1", threading.Event(), nodes
    )
    assert run_cell("seed=1", "cohort", tmp_path / "a.log") == 0
    assert run_cell("seed=1", "plain", tmp_path / "b.log") == 0
    flag = commands[0].index("--federation-config")
    assert commands[0][flag + 1] == "num-supernodes=4"
    assert "--federation-config" not in commands[1]


def test_a_cell_on_a_ray_cluster_starts_its_own_superlink_with_its_share(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No warm federation (no `--warm-simulation`: the run's own SuperLink,
    which joins the cluster `RAY_ADDRESS` names), and the environment that
    says how many cells share the cluster's actors."""
    started: list[tuple[list[str], dict | None]] = []

    def start(command: list[str], *, log: Path, env=None) -> subprocess.Popen:
        started.append((command, env))
        return subprocess.Popen(["true"])

    monkeypatch.setattr(compare.processes, "start", start)
    env = {"RAY_ADDRESS": "127.0.0.1:6390", "POLLEN_RAY_SHARE": "2"}
    run_cell = compare.pollen_run_cell(
        PROJECT, tmp_path, [], None, threading.Event(), {}, env
    )
    assert run_cell("seed=1", "seed-1", tmp_path / "a.log") == 0
    [(command, given)] = started
    assert "--warm-simulation" not in command and given == env


def test_a_grid_may_grow_but_not_change_under_its_results(tmp_path: Path) -> None:
    ran: list[str] = []
    run_fake_grid(compare.Grid({}, {"strategy": ["fedavg"]}), tmp_path, ran)
    grown = compare.Grid({}, {"strategy": ["fedavg", "fedsam"]})
    assert run_fake_grid(grown, tmp_path, ran)[0].endswith("done before, kept")
    assert ran == ["strategy-fedavg", "strategy-fedsam"]
    changed = compare.Grid({}, {"strategy": ["fedavg"]})
    with pytest.raises(compare.CompareError, match=(
        r"strategy-fedavg was run with seed=1 and its cell now has seed=2; "
        "this directory holds another grid's runs"
    )):  # fmt: skip
        compare.with_states(
            compare.validate_cells(changed, lambda c: {"seed": 2}), tmp_path
        )
    unrecorded = compare.with_states(
        compare.validate_cells(changed, lambda c: {"new-key": 1}), tmp_path
    )
    assert unrecorded[0].state == compare.DONE  # older runs lack newer keys


def test_an_invalid_cell_stops_the_grid_before_anything_runs(tmp_path: Path) -> None:
    grid = compare.Grid({}, {"lr": [0.1, -1.0]})

    def validate(config: str) -> dict:
        if "-1.0" in config:
            raise compare.CompareError(f"cell {config!r}: lr must be > 0")
        return {}

    with pytest.raises(compare.CompareError, match="lr must be > 0"):
        compare.validate_cells(grid, validate)
    assert not (tmp_path / "runs").exists()


def test_the_suite_grid_validates_and_a_dry_run_lists_its_cells(
    tmp_path: Path, capsys
) -> None:
    args = ["compare", str(PROJECT / "configs" / "grids" / "fmnist-2class.toml"),
            str(PROJECT), "--out", str(tmp_path / "cmp"), "--dry-run",
            "-c", str(PROJECT / "configs" / "fmnist-2class.toml")]  # fmt: skip
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 21 and lines[0].startswith("strategy-fedavg_seed-1: to run:")
    assert not (tmp_path / "cmp").exists()
    assert main([*args, "-c", "lr=-1"]) == 2
    assert "lr" in capsys.readouterr().err


GRIDS = sorted((PROJECT / "configs" / "grids").glob("*.toml"))


def documented_command(grid: Path) -> list[str]:
    """The first `pollen compare` of this grid that its header comment gives
    (with its continuation lines), as `pollen` argv."""
    comments = [line.removeprefix("#").strip() for line in grid.read_text().splitlines()
                if line.startswith("#")]  # fmt: skip
    first = next(i for i, line in enumerate(comments) if "pollen compare" in line)
    command = comments[first]
    for line in comments[first + 1 :]:
        if not command.endswith("\\"):
            break
        command = command.removesuffix("\\") + " " + line
    words = shlex.split(command)
    return words[words.index("compare") :]


@pytest.mark.parametrize("grid", GRIDS, ids=[g.stem for g in GRIDS])
def test_every_grid_validates_with_the_command_its_comment_gives(
    grid: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    """What a grid's header tells a user to run passes every cell's checks
    (a dry run: nothing is written)."""
    args = documented_command(grid)
    out = args.index("--out") + 1
    args[out] = str(tmp_path / "cmp")
    monkeypatch.chdir(PROJECT)
    assert main([*args, "--dry-run"]) == 0, capsys.readouterr().err
    lines = capsys.readouterr().out.splitlines()
    cells = [line for line in lines if not line.startswith("pollen: ")]
    assert cells and all(": to run:" in cell for cell in cells)
    assert not (tmp_path / "cmp").exists()


def test_the_niid_bench_grid_validates_with_its_named_variant(
    tmp_path: Path, capsys
) -> None:
    assert main(["compare", str(PROJECT / "configs" / "grids" / "niid-bench-fmnist.toml"),
                 str(PROJECT), "--out", str(tmp_path / "cmp"), "--dry-run",
                 "-c", str(PROJECT / "configs" / "niid-bench-fmnist.toml"),
                 "--only", "seed=846"]) == 0  # fmt: skip
    assert capsys.readouterr().out.splitlines() == [
        'strategy-fedavg_seed-846: to run: checkpoint-every=5 strategy="fedavg" seed=846',
        'strategy-feddyn-sam_seed-846: to run: checkpoint-every=5 strategy="feddyn" '
        'local-objective="feddyn-sam" seed=846',
        'strategy-fedprox_seed-846: to run: checkpoint-every=5 strategy="fedprox" seed=846',
        'strategy-fedsam_seed-846: to run: checkpoint-every=5 strategy="fedsam" seed=846',
        'strategy-scaffold_seed-846: to run: checkpoint-every=5 strategy="scaffold" '
        "seed=846",
        'strategy-fednova_seed-846: to run: checkpoint-every=5 strategy="fedavg" '
        'aggregator="fednova" seed=846',
    ]


def test_the_feddyn_alpha_grid_validates(tmp_path: Path, capsys) -> None:
    assert main(["compare", str(PROJECT / "configs" / "grids" / "niid-bench-feddyn-alpha.toml"),
                 str(PROJECT), "--out", str(tmp_path / "cmp"), "--dry-run",
                 "-c", str(PROJECT / "configs" / "niid-bench-fmnist.toml")]) == 0  # fmt: skip
    base = 'strategy="feddyn" seed=845 checkpoint-every=5'
    assert capsys.readouterr().out.splitlines() == [
        f"dyn-alpha-{alpha}: to run: {base} dyn-alpha={alpha}"
        for alpha in ("0.01", "0.001", "0.1")
    ]


def test_groups_average_over_seeds_and_the_table_shows_it(tmp_path: Path) -> None:
    for seed, curve in ((1, [0.6, 0.8, 0.9]), (2, [0.5, 0.7, 0.8])):
        write_run(tmp_path, f"avg-{seed}", {"strategy": "fedavg", "seed": seed}, curve)
    write_run(tmp_path, "sam-1", {"strategy": "fedsam", "seed": 1}, [0.7, 0.75], 20.0)
    diverged = write_run(tmp_path, "dyn-1", {"strategy": "feddyn"}, [0.1])
    summary = json.loads((diverged / "summary.json").read_text())
    (diverged / "summary.json").write_text(json.dumps({**summary, "status": "failed"}))
    runs = report.read_runs(tmp_path)  # the failed run is left out
    assert report.varying_keys(runs) == ["seed", "strategy"]  # not run-name
    avg, sam = report.summarize_groups(runs, target=0.75)
    assert avg["setting"] == {"strategy": "fedavg"} and avg["seeds"] == [1, 2]
    assert avg["final-accuracy"]["mean"] == pytest.approx(0.85)
    assert avg["final-accuracy"]["std"] == pytest.approx(0.0707107, rel=1e-5)
    assert avg["round-to-target"] == [2, 3] and sam["round-to-target"] == [2]
    table = report.markdown_table([avg, sam], target=0.75)
    # these histories record bytes (3 MB a round) but no seconds: MB to the
    # target and in all, no time to the target
    assert table.startswith(
        "| strategy | seeds | final acc. (%) | best acc. (%) | round to 75% "
        "| MB to 75% | time (s) | MB up | MB down | MB total |"
    )
    assert (
        "| fedavg | 2 | 85.00 ± 7.07 | 85.00 ± 7.07 | 2.5 | 7.5 ± 2.1 | 10 | 3.0 | 6.0 "
        "| 9.0 |" in table
    )
    assert "| fedsam | 1 | 75.00 | 75.00 | 2.0 | 6.0 | 20 | 2.0 | 4.0 | 6.0 |" in table
    high = report.summarize_groups(runs, target=0.95)
    assert report.markdown_table(high, target=0.95).count(" never |") == 4


def test_clients_own_shard_accuracy_and_its_spread_are_reported(
    tmp_path: Path,
) -> None:
    """The last personal evaluation's own-shard accuracies: their mean and
    their population standard deviation over clients, each averaged over
    seeds; a client without a test shard (null) does not count."""

    def rows(own: dict[str, float | None]) -> list[dict]:
        personal = {c: {"global-accuracy": 0.5, "local-accuracy": a}
                    for c, a in own.items()}  # fmt: skip
        mb = {"bytes-up": 1_000_000, "bytes-down": 2_000_000}
        return [
            {
                "round": 1,
                "accuracy": 0.5,
                "personal": {"0": {"local-accuracy": 0.1}},
                **mb,
            },
            {"round": 2, "accuracy": 0.6, "personal": personal, **mb},
            {"round": 3, "accuracy": 0.7, "personal": {}, **mb},  # not due
        ]

    for seed, own in (
        (1, {"0": 0.6, "1": 1.0}),
        (2, {"0": 0.8, "1": 0.8, "2": None}),
    ):
        write_run(tmp_path, f"per-{seed}", {"strategy": "fedper", "seed": seed},
                  [0.5, 0.6, 0.7], history=rows(own))  # fmt: skip
    write_run(tmp_path, "avg-1", {"strategy": "fedavg"}, [0.5, 0.6, 0.7])
    avg, per = report.summarize_groups(report.read_runs(tmp_path), target=None)
    assert "own-accuracy" not in avg
    assert per["own-accuracy"] == {"mean": pytest.approx(0.8), "std": 0.0}
    assert per["own-spread"]["mean"] == pytest.approx(0.1)  # (0.2 + 0) / 2
    table = report.markdown_table([avg, per], target=None)
    assert "| own-shard acc. (%) | std over clients (pts) |" in table
    assert "| fedavg | 1 | 70.00 | 70.00 | n/a | n/a |" in table
    assert "| fedper | 2 | 70.00 | 70.00 | 80.00 | 10.00 ± 14.14 |" in table


def test_what_a_strategy_resolves_does_not_split_the_report(tmp_path: Path) -> None:
    """`server-lr = "auto"` is 1.0 for FedAvg and 0.01 for FedAdam in their
    settings.json: one figure with both strategies, not one figure each."""
    for strategy, server_lr in (("fedavg", 1.0), ("fedadam", 0.01)):
        write_run(tmp_path, strategy, {"strategy": strategy, "server-lr": server_lr},
                  [0.5, 0.6])  # fmt: skip
    assert report.varying_keys(report.read_runs(tmp_path)) == ["strategy"]
    write_run(tmp_path, "fedadam-0.1", {"strategy": "fedadam", "server-lr": 0.1},
              [0.5, 0.7])  # fmt: skip
    keys = report.varying_keys(report.read_runs(tmp_path))
    assert keys == ["strategy", "server-lr"]  # varied within FedAdam: a setting


def test_a_variant_that_departs_from_its_preset_is_named(tmp_path: Path) -> None:
    """FedAvg's preset objective is plain, FedProx's prox: they follow the
    strategy. FedDyn's is feddyn; a FedDyn run with feddyn-sam must say so."""
    for name, strategy, objective in (("fedavg", "fedavg", "plain"),
                                      ("fedprox", "fedprox", "prox"),
                                      ("feddyn-sam", "feddyn", "feddyn-sam")):  # fmt: skip
        write_run(tmp_path, name, {"strategy": strategy, "local-objective": objective},
                  [0.5, 0.6])  # fmt: skip
    runs = report.read_runs(tmp_path)
    assert report.varying_keys(runs) == ["strategy", "local-objective"]
    rows = report.summarize_groups(runs, None)
    assert {"strategy": "feddyn", "local-objective": "feddyn-sam"} in [
        r["setting"] for r in rows
    ]
    (tmp_path / "feddyn-sam").rename(tmp_path / "aside")
    (tmp_path / "aside" / "summary.json").unlink()  # only the presets remain
    assert report.varying_keys(report.read_runs(tmp_path)) == ["strategy"]


def test_a_run_that_departs_from_a_default_is_named(tmp_path: Path) -> None:
    """FedNova is FedAvg with `aggregator=fednova`, a key no preset sets:
    beside SCAFFOLD alone its row must not read as plain FedAvg."""
    write_run(tmp_path, "fednova", {"strategy": "fedavg", "aggregator": "fednova"},
              [0.5, 0.6])  # fmt: skip
    write_run(tmp_path, "scaffold", {"strategy": "scaffold", "aggregator": "mean"},
              [0.5, 0.7])  # fmt: skip
    runs = report.read_runs(tmp_path)
    assert report.varying_keys(runs) == ["strategy", "aggregator"]
    table = report.markdown_table(report.summarize_groups(runs, None), None)
    assert "| fedavg | fednova | 1 |" in table
    plots = [p.name for p in report.plot_groups(runs, tmp_path / "plots")]
    assert [p for p in plots if p.startswith("accuracy-rounds")] == [
        "accuracy-rounds-all.png"  # one figure, a line for each aggregator
    ]
    (tmp_path / "fednova" / "summary.json").unlink()  # a default is no variant
    write_run(tmp_path, "fedavg", {"strategy": "fedavg", "aggregator": "mean"},
              [0.5, 0.6])  # fmt: skip
    assert report.varying_keys(report.read_runs(tmp_path)) == ["strategy"]


def test_report_regenerates_tables_and_plots_without_training(tmp_path: Path) -> None:
    for strategy, alpha in (("fedavg", 0.1), ("fedsam", 0.1), ("fedavg", 1.0)):
        write_run(tmp_path / "runs", f"{strategy}-{alpha}",
                  {"strategy": strategy, "alpha": alpha}, [0.4, 0.6])  # fmt: skip
    assert main(["report", str(tmp_path), "--target", "0.5"]) == 0
    groups = json.loads((tmp_path / "comparison.json").read_text())["groups"]
    assert len(groups) == 3
    plots = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert plots == [
        "accuracy-bytes-alpha-0.1.png", "accuracy-bytes-alpha-1.0.png",
        "accuracy-rounds-alpha-0.1.png", "accuracy-rounds-alpha-1.0.png",
    ]  # fmt: skip
    assert main(["report", str(tmp_path / "nothing")]) == 2


def mlflow_accuracy(uri: str, experiment: str) -> dict[str, list[tuple[int, float]]]:
    """Each finished MLflow run of `experiment` at `uri`: its accuracy by round."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return {
        run.info.run_name: sorted(
            (m.step, m.value)
            for m in client.get_metric_history(run.info.run_id, "accuracy")
        )
        for run in runs
        if run.info.status == "FINISHED"
    }


@pytest.mark.xdist_group("mlflow")
@pytest.mark.integration
def test_a_real_comparison_of_two_tiny_runs_resumes_and_reports(
    tmp_path: Path, capsys, mlflow_server: str
) -> None:
    grid = grid_file(tmp_path, f"""
target = 0.3
[base]
data-set = "digits"
rounds = 2
num-clients = 2
client-frac = 1.0
checkpoint-every = 1
tracker = "mlflow"
tracking-uri = "{mlflow_server}"
[grid]
strategy = ["fedavg", "fedprox"]
""")  # fmt: skip
    out = tmp_path / "cmp"
    assert main(["compare", str(grid), str(PROJECT), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "[2/2] strategy-fedprox:" in printed and "| fedprox | 1 |" in printed
    for name in ("strategy-fedavg", "strategy-fedprox"):
        settings = json.loads((out / "runs" / name / "settings.json").read_text())
        assert settings["strategy"] == name.split("-")[1] and settings["rounds"] == 2
    # the cells side by side in one MLflow experiment named after the comparison
    tracked = mlflow_accuracy(mlflow_server, "cmp")
    for name in ("strategy-fedavg", "strategy-fedprox"):
        history = json.loads((out / "runs" / name / "history.json").read_text())
        assert tracked[name] == [(row["round"], row["accuracy"]) for row in history]
    assert (out / "plots" / "labels-all.png").exists()
    assert main(["compare", str(grid), str(PROJECT), "--out", str(out)]) == 0
    assert capsys.readouterr().out.count("done before, kept") == 2
    # killed in round 2: the cell continues from its round-1 checkpoint
    fedprox = out / "runs" / "strategy-fedprox"
    (fedprox / "summary.json").unlink()
    shutil.rmtree(fedprox / "checkpoints" / "round-00002")
    dry = ["compare", str(grid), str(PROJECT), "--out", str(out), "--dry-run"]
    assert main(dry) == 0
    assert "strategy-fedprox: interrupted, resumes after round 1:" in (
        capsys.readouterr().out
    )
    with compare.exclusive(out) as running:  # another compare is running it
        running("strategy-fedprox")
        assert main(dry) == 0
    assert f"strategy-fedprox: running now (pid {os.getpid()}):" in (
        capsys.readouterr().out
    )
    assert main(["compare", str(grid), str(PROJECT), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "[2/2] strategy-fedprox: interrupted, resumes after round 1" in printed
    history = json.loads((fedprox / "history.json").read_text())
    assert [row["round"] for row in history] == [1, 2]
    # the resumed cell continued its MLflow run: still two runs, no round twice
    tracked = mlflow_accuracy(mlflow_server, "cmp")
    assert sorted(tracked) == ["strategy-fedavg", "strategy-fedprox"]
    assert [step for step, _ in tracked["strategy-fedprox"]] == [1, 2]
    assert not (out / "incomplete").exists()
    # one comparison per directory at a time
    with compare.exclusive(out):
        assert main(["compare", str(grid), str(PROJECT), "--out", str(out)]) == 2
    assert f"another pollen compare (pid {os.getpid()}) is running in" in (
        capsys.readouterr().err
    )
    # a grown grid keeps the finished cells; a changed one is refused
    grid.write_text(grid.read_text().replace('"fedprox"]', '"fedprox", "fedsam"]'))
    assert main(dry) == 0
    states = [line.split(": ")[:2] for line in capsys.readouterr().out.splitlines()]
    assert states == [
        ["strategy-fedavg", "done"], ["strategy-fedprox", "done"],
        ["strategy-fedsam", "to run"],
    ]  # fmt: skip
    grid.write_text(grid.read_text().replace("rounds = 2", "rounds = 3"))
    assert main(dry) == 2
    assert "was run with rounds=2 and its cell now has rounds=3" in (
        capsys.readouterr().err
    )


def test_rows_follow_the_numbers_and_one_strategy_draws_a_line_per_setting(
    tmp_path: Path,
) -> None:
    for k in (10, 5, 20):
        for partition in ("iid", "niid"):
            write_run(tmp_path, f"k{k}-{partition}",
                      {"num-clients": k, "partition": partition}, [0.5])  # fmt: skip
    rows = report.summarize_groups(report.read_runs(tmp_path), target=None)
    assert [r["setting"]["num-clients"] for r in rows] == [5, 5, 10, 10, 20, 20]
    plots = report.plot_groups(report.read_runs(tmp_path), tmp_path / "plots")
    assert len(plots) == 6  # a figure pair per K, with a line per partition


def test_each_line_says_over_how_many_seeds_it_is_a_mean(
    tmp_path: Path, monkeypatch
) -> None:
    for strategy, seeds in (("fedavg", (1, 2, 3)), ("fedprox", (1,))):
        for seed in seeds:
            write_run(tmp_path, f"{strategy}-{seed}",
                      {"strategy": strategy, "seed": seed}, [0.5])  # fmt: skip
    drawn = []
    monkeypatch.setattr(report, "plot_accuracy_against",
                        lambda series, path, title, *_, **__: drawn.append(
                            (title, sorted(series))))  # fmt: skip
    report.plot_groups(report.read_runs(tmp_path), tmp_path / "plots")
    assert drawn[0] == (
        "digits: by strategy",
        ["fedavg (mean of 3 seeds)", "fedprox (1 seed)"],
    )
    for seed in (2, 3):
        write_run(tmp_path, f"fedprox-{seed}",
                  {"strategy": "fedprox", "seed": seed}, [0.5])  # fmt: skip
    drawn.clear()
    report.plot_groups(report.read_runs(tmp_path), tmp_path / "plots")
    assert drawn[0] == ("digits: by strategy (mean of 3 seeds)", ["fedavg", "fedprox"])


def drawn_figures(monkeypatch) -> list[tuple[str, str, dict, dict]]:
    """What report.plot_groups draws: (file, title, series, own models)."""
    drawn = []
    monkeypatch.setattr(
        report, "plot_accuracy_against",
        lambda series, path, title, xlabel, integer_x=False, own_models=None:
            drawn.append((path.name, title, dict(series), dict(own_models or {}))),
    )  # fmt: skip
    return drawn


def test_named_cells_are_lines_of_one_figure_titled_by_what_differs(
    tmp_path: Path, monkeypatch
) -> None:
    """The network grid's cells: one deadline cell and FedSA's own model are
    lines beside the others, not figures of their own ("round-deadline=0.0")."""
    runs = tmp_path / "runs"
    for name, settings in (
        ("fedavg", {"strategy": "fedavg", "round-deadline": 0.0, "model": "cnn"}),
        (
            "fedavg-deadline",
            {"strategy": "fedavg", "round-deadline": 50.0, "model": "cnn"},
        ),
        ("fedsa", {"strategy": "fedsa", "round-deadline": 0.0, "model": "cnn-lora"}),
    ):
        write_run(runs, name, settings, [0.3, 0.5])
        (runs / name / "labels.png").write_bytes(b"png")  # one partition: one copy
    write_run(runs, "fedbn", {"strategy": "fedavg", "round-deadline": 0.0,
                              "model": "cnn", "bn-policy": "fedbn"}, [0.2, 0.3])  # fmt: skip
    for name, pe in (("fedavg", 0), ("fedavg-deadline", 0), ("fedsa", 1), ("fedbn", 1)):
        settings = json.loads((runs / name / "settings.json").read_text())
        settings["personal-eval-every"] = pe  # "auto", resolved by the preset
        settings.setdefault("bn-policy", "shared")
        (runs / name / "settings.json").write_text(json.dumps(settings))
    (tmp_path / "grid.toml").write_text(
        "[grid]\nstrategy = [\n"
        '  { name = "fedavg", strategy = "fedavg" },\n'
        '  { name = "fedavg-deadline", strategy = "fedavg", round-deadline = 50.0 },\n'
        '  { name = "fedsa", strategy = "fedsa", model = "cnn-lora" },\n'
        '  { name = "fedbn", strategy = "fedavg", bn-policy = "fedbn" },\n]\n'
    )
    drawn = drawn_figures(monkeypatch)
    report.report(tmp_path)
    assert [d[0] for d in drawn] == [
        "accuracy-rounds-all.png",
        "accuracy-bytes-all.png",
    ]
    assert drawn[0][1] == "digits: by strategy, bn-policy, round-deadline, model"
    assert sorted(drawn[0][2]) == [
        "fedavg", "fedavg, fedbn", "fedavg, round-deadline=50.0", "fedsa, model=cnn-lora"
    ]  # fmt: skip
    assert [p.name for p in (tmp_path / "plots").glob("labels-*")] == ["labels-all.png"]
    (tmp_path / "grid.toml").unlink()  # runs without their grid: figures as before
    drawn.clear()
    report.plot_groups(report.read_runs(tmp_path), tmp_path / "plots")
    assert len([d for d in drawn if d[0].startswith("accuracy-rounds")]) == 4


def test_a_personalised_line_has_its_own_models_beside_it(
    tmp_path: Path, monkeypatch
) -> None:
    """FedBN's global model can sit near chance while its clients' own models
    are good: the figure draws both, the own models where they were evaluated."""
    rows = [{"round": r, "accuracy": 0.15, "bytes-up": 1, "bytes-down": 1}
            for r in (1, 2, 3)]  # fmt: skip
    rows[1]["personal"] = {"0": {"local-accuracy": 0.8}, "1": {"local-accuracy": 0.9}}
    rows[2]["personal"] = {"0": {"local-accuracy": 0.9}, "1": {"local-accuracy": None}}
    write_run(tmp_path, "fedbn", {"strategy": "fedavg", "bn-policy": "fedbn"},
              [0.15] * 3, history=rows)  # fmt: skip
    write_run(tmp_path, "fedavg", {"strategy": "fedavg", "bn-policy": "shared"},
              [0.5, 0.6, 0.7])  # fmt: skip
    drawn = drawn_figures(monkeypatch)
    report.plot_groups(report.read_runs(tmp_path), tmp_path / "plots")
    rounds = drawn[0]
    assert rounds[1] == "digits: by bn-policy"
    assert rounds[3] == {"fedbn": ([2.0, 3.0], [pytest.approx(0.85), 0.9])}
    by_bytes = drawn[1]  # x: cumulative MB after rounds 2 and 3
    assert by_bytes[3]["fedbn"][0] == [pytest.approx(4e-6), pytest.approx(6e-6)]


@pytest.mark.integration
@pytest.mark.parametrize(
    "jobs",
    [1, pytest.param(2, marks=pytest.mark.skipif(
        (os.cpu_count() or 1) < 2, reason="--jobs 2 needs 2 CPUs"
    ))],
    ids=["one-cell", "jobs-2"],
)  # fmt: skip
def test_sigterm_stops_a_simulated_comparison_and_everything_its_cells_started(
    tmp_path: Path, jobs: int
) -> None:
    """SIGTERM while the cells' simulations run (one, or two at once with
    `--jobs 2`, each on its own warm federation): the comparison exits as
    after Ctrl-C, and each cell's `pollen run`, the SuperLinks and Ray go
    with it (before, the run and the SuperLink were left orphaned); each
    cell recorded its interruption and resumes from its checkpoint."""
    from tests.deployed import BIN
    from tests.test_simulation import orphaned, running

    seeds = list(range(1, jobs + 1))
    grid = tmp_path / "grid.toml"
    grid.write_text(f"[base]\nrounds = 30\n[grid]\nseed = {seeds}\n")
    markers = (b"flower-superlink", b"flwr-simulation", b"raylet", b"pollen run")
    before = {marker: running(marker) for marker in markers}
    out = tmp_path / "cmp"
    command = [str(BIN / "pollen"), "compare", str(grid), str(PROJECT), "--out",
               str(out), "--jobs", str(jobs)]  # fmt: skip
    comparison = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    histories = [out / "runs" / f"seed-{seed}" / "history.json" for seed in seeds]
    deadline = time.monotonic() + 240
    while not all(history.exists() for history in histories):
        assert comparison.poll() is None, comparison.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "no round finished"
        time.sleep(0.2)
    comparison.send_signal(signal.SIGTERM)
    output, _ = comparison.communicate(timeout=180)
    assert comparison.returncode == 130, output[-3000:]
    time.sleep(1)  # what was stopped has exited
    for marker in markers:
        assert not orphaned(before[marker], marker), f"{marker!r} left running"
    dry = subprocess.run(
        [*command, "--dry-run"], capture_output=True, text=True, timeout=60
    )
    for seed, history in zip(seeds, histories, strict=True):
        # the cell recorded its interruption, and a checkpoint to resume from
        summary = json.loads((history.parent / "summary.json").read_text())
        assert summary["status"] == "interrupted"
        last = summary["rounds"]
        assert (history.parent / "checkpoints" / f"round-{last:05d}").is_dir()
        assert f"seed-{seed}: interrupted, resumes after round {last}" in dry.stdout


@pytest.mark.integration
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="--jobs 2 needs 2 CPUs")
def test_two_cells_at_once_compute_the_histories_of_one_after_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--jobs 2` on 2 CPUs: two warm federations of one CPU each, a cell on
    each at once; every column of every round as the cells run one after
    another on one federation with both CPUs gives it, but the wall times
    (`seconds`, and `sim-seconds`, which the measured compute drives)."""
    grid = grid_file(tmp_path, """
[base]
data-set = "digits"
rounds = 2
num-clients = 3
client-frac = 1.0
[grid]
strategy = ["fedavg", "scaffold"]
""")  # fmt: skip
    monkeypatch.syspath_prepend(str(PROJECT / "benchmarks"))
    from same_histories import run_histories  # less the wall times

    histories = {}
    for jobs in (1, 2):
        out = tmp_path / f"jobs-{jobs}"
        argv = ["compare", str(grid), str(PROJECT), "--out", str(out)]
        assert main([*argv, "--jobs", str(jobs)]) == 0
        histories[jobs] = run_histories(out)
    assert sorted(histories[1]) == ["strategy-fedavg", "strategy-scaffold"]
    assert sorted(
        p.name for p in (tmp_path / "jobs-2").iterdir() if "warm" in p.name
    ) == ["warm-simulation-1", "warm-simulation-2"]
    assert histories[2] == histories[1]
    assert len(histories[1]["strategy-fedavg"]) == 2


def test_report_lists_unfinished_runs_with_their_status(tmp_path: Path) -> None:
    """A run that failed before round 1 (settings but no history or summary)
    and an interrupted one are listed with their status; the rest is
    reported."""
    write_run(tmp_path, "avg", {"strategy": "fedavg"}, [0.6, 0.8])
    stopped = write_run(tmp_path, "sam", {"strategy": "fedsam"}, [0.5])
    summary = json.loads((stopped / "summary.json").read_text())
    interrupted = {**summary, "status": "interrupted", "error": "RunInterrupted: x"}
    (stopped / "summary.json").write_text(json.dumps(interrupted))
    early = tmp_path / "dyn"
    early.mkdir()
    (early / "settings.json").write_text('{"run-name": "dyn", "strategy": "feddyn"}')
    table = report.report(tmp_path).read_text()
    assert "| 1 | 80.00 | 80.00 |" in table  # the completed run, reported
    assert "Runs that did not complete:" in table
    assert (
        "| dyn | failed | 0 | no summary.json: it failed before its first round |"
        in (table)
    )
    assert "| sam | interrupted | 1 | RunInterrupted: x |" in table
    unfinished = json.loads((tmp_path / "comparison.json").read_text())["unfinished"]
    assert [r["run"] for r in unfinished] == ["dyn", "sam"]


def test_a_part_s_own_client_default_is_named_in_the_report(tmp_path: Path) -> None:
    """SCAFFOLD's preset trains with momentum 0 where the data set's default
    is 0.9: a reader must see that the cells trained with other momenta.
    Everyone at the data set's default: no momentum column."""
    write_run(tmp_path / "a", "fedavg", {"strategy": "fedavg", "momentum": 0.9}, [0.5])
    write_run(tmp_path / "a", "prox", {"strategy": "fedprox", "momentum": 0.9}, [0.5])
    assert report.varying_keys(report.read_runs(tmp_path / "a")) == ["strategy"]
    write_run(tmp_path / "b", "fedavg", {"strategy": "fedavg", "momentum": 0.9}, [0.5])
    write_run(tmp_path / "b", "scaffold", {"strategy": "scaffold", "momentum": 0.0},
              [0.6])  # fmt: skip
    keys = report.varying_keys(report.read_runs(tmp_path / "b"))
    assert keys == ["strategy", "momentum"]


def test_line_labels_break_ties_by_the_default_and_a_setting_that_varies_within_a_line_makes_figures(
    tmp_path: Path,
) -> None:
    """Two cells, round-deadline 0 (the default) and 50: the deadline cell is
    the one named, whatever the order. A key no grid axis or named cell sets
    but that varies within one line (runs of two base configs in one folder)
    is not averaged away: it still makes figures."""
    runs = [
        report.Run.read(write_run(tmp_path, name, {"strategy": "fedavg",
                                  "round-deadline": d, "lr": lr}, [0.5]))
        for name, d, lr in (("a", 50.0, 0.1), ("b", 0.0, 0.1), ("c", 50.0, 0.01),
                            ("d", 0.0, 0.01))
    ]  # fmt: skip
    grid = report.GridShape(frozenset({"strategy"}), frozenset({"round-deadline"}))
    keys = ["strategy", "round-deadline", "lr"]
    line_keys, figure_keys = report.split_line_and_figure_keys(keys, grid, runs)
    assert (line_keys, figure_keys) == (["strategy", "round-deadline"], ["lr"])
    labels = {r.name: report.line_label(r, line_keys, runs) for r in runs}
    assert labels == {"a": "fedavg, round-deadline=50.0", "b": "fedavg",
                      "c": "fedavg, round-deadline=50.0", "d": "fedavg"}  # fmt: skip
    same_lr = [r for r in runs if r.settings["lr"] == 0.1]
    assert report.split_line_and_figure_keys(keys, grid, same_lr)[1] == []


def test_a_finished_cell_with_a_relative_network_profile_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A relative network-profile is made absolute where every run config is
    resolved, so the path a cell names is the one its run records: the
    finished cell is kept, not refused as another grid's run."""
    from pollen.deployment.run_config import pin_paths
    from pollen.settings import Settings

    monkeypatch.chdir(PROJECT)
    grid = grid_file(
        tmp_path,
        '[base]\nnetwork-profile = "configs/networks/datacenter.toml"\n'
        "rounds = 1\n[grid]\nseed = [1]\n",
    )
    comparison = compare.Comparison(grid, PROJECT, tmp_path / "out")
    (cell,) = compare.validate_cells(compare.Grid.load(grid), comparison.validate)
    assert cell.run_config["network-profile"] == str(
        PROJECT / "configs/networks/datacenter.toml"
    )
    recorded = pin_paths(Settings.from_run_config(cell.run_config), "fedavg")
    run_dir = tmp_path / "out" / "runs" / cell.name
    run_dir.mkdir(parents=True)
    (run_dir / "settings.json").write_text(json.dumps(recorded.to_run_config()))
    (run_dir / "summary.json").write_text(json.dumps({"status": "completed"}))
    (state,) = compare.with_states([cell], tmp_path / "out")
    assert state.state == compare.DONE


def test_a_cell_a_live_run_holds_is_refused_not_moved_aside(tmp_path: Path) -> None:
    """A killed pollen compare leaves its cell's pollen run going (its own
    session). Run again, the comparison found the directory unfinished and
    moved it aside under the live run, then started the cell again; now it
    says the directory is held, and leaves it."""
    from pollen.runs.claim import claim

    run_dir = tmp_path / "cmp" / "runs" / "cell-a"
    run_dir.mkdir(parents=True)
    (run_dir / "settings.json").write_text("{}")
    cell = compare.Cell("cell-a", "", {"rounds": 3})
    with (
        claim(run_dir, new=False),
        pytest.raises(compare.CompareError, match="is held by a run that is"),
    ):
        compare.refuse_held(compare.with_states([cell], tmp_path / "cmp"), tmp_path)
    assert run_dir.is_dir()


@pytest.mark.parametrize("simulate", [False, True])
def test_a_grid_that_sets_the_network_profile_is_refused_under_network(
    tmp_path: Path, simulate: bool
) -> None:
    """--network shapes (or clocks) every cell with its profile; a cell that
    set another network-profile put the clock on that one while the links
    were shaped as --network's. Refused, before anything runs."""
    profiles = PROJECT / "configs" / "networks"
    grid = grid_file(
        tmp_path,
        "[grid]\nnetwork-profile = "
        f'["{profiles / "mobile-4g.toml"}", "{profiles / "mixed.toml"}"]\n',
    )
    comparison = compare.Comparison(
        grid, PROJECT, tmp_path / "out", network=profiles / "mixed.toml",
        simulate=simulate,
    )  # fmt: skip
    with pytest.raises(compare.CompareError, match="sets network-profile, and "):
        compare.run_comparison(comparison, dry_run=True)
    assert not (tmp_path / "out").exists()


def test_varying_keys_takes_runs_built_without_every_setting(tmp_path: Path) -> None:
    """A `Run` a script builds itself (not `Run.read`, which fills defaults)
    may lack a setting another run has: it counts as the default."""
    a = report.Run("a", tmp_path / "a", {"strategy": "fedavg", "rounds": 10}, {}, [])
    b = report.Run("b", tmp_path / "b", {"strategy": "fedprox"}, {}, [])
    assert report.varying_keys([a, b]) == ["strategy"]
    c = report.Run("c", tmp_path / "c", {"strategy": "fedavg"}, {}, [])
    assert report.varying_keys([a, c]) == []  # rounds=10 is the default
    d = report.Run("d", tmp_path / "d", {"strategy": "fedavg", "rounds": 3}, {}, [])
    assert report.varying_keys([c, d]) == ["rounds"]
