"""Comparisons: a grid of simulation runs, and the tables and plots made from
result directories.

`pollen compare GRID.toml --out DIR` runs every cell of a grid (the product of
the values listed under `[grid]`, each cell a complete `pollen run` with the
settings under `[base]`; a value may be a table of keys set together, with a
`name` for the cell) into `DIR/runs/<cell>/`, skipping cells whose run
has completed, so an interrupted comparison resumes where it stopped: an
interrupted cell continues from its latest checkpoint (`checkpoint-every`),
or without one its directory is moved to `DIR/incomplete/` (never deleted)
and it runs again. Every cell's settings are validated, and every finished
run checked against its cell, before the first run starts: a grid may grow
(more values, so more cells) in its directory, but a finished run computed
with other settings than its cell now has is refused. The latest grid is
kept as `DIR/grid.toml`.

`pollen report DIR` (and `compare`, after its last cell) reads every completed
run directory under `DIR/runs/` (or `DIR` itself), groups the runs that differ
only in `seed`, and writes `comparison.json`, `comparison.md` (final and best
accuracy, the round reaching `target`, wall time, bytes up and down; mean
and standard deviation over seeds) and `plots/`: accuracy per round and
against bytes, one figure per setting with a line per strategy, and the
label distribution of each setting's partition.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NamedTuple

from .checkpoints import CheckpointError, check_resumable
from .results import plot_accuracy_against, write_atomic, write_json
from .settings import PRESETS, first_difference

# Keys that name where or how a run ran, not what it computed.
NOT_COMPARED = frozenset(
    {"run-name", "output-dir", "data-root", "device", "resume", "notify-url",
     "notify-every", "checkpoint-every", "checkpoint-keep", "print-labels"}
)  # fmt: skip
# Keys drawn as separate lines on one figure; the other varying keys (but the
# seed, averaged over) make separate figures.
SERIES_KEYS = ("strategy", "server-update", "local-objective", "bn-policy", "sharing")
MB = 1e6


class CompareError(ValueError):
    """A grid or a results directory that cannot be used, and why."""


@dataclass(frozen=True)
class Grid:
    """Run-config values shared by every cell (`base`), the values each
    varying key takes (`axes`; the cells are their product) and the accuracy
    whose first round the report gives (`target`)."""

    base: dict[str, Any]
    axes: dict[str, list[Any]]
    target: float | None = None

    @classmethod
    def load(cls, path: Path) -> Grid:
        try:
            document = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as err:
            raise CompareError(f"cannot read grid {path}: {err}") from err
        unknown = set(document) - {"base", "grid", "target"}
        if unknown:
            raise CompareError(
                f"{path}: unknown table or key {sorted(unknown)[0]!r}; "
                "a grid has [base], [grid] and an optional target"
            )
        axes = document.get("grid", {})
        for key, values in axes.items():
            if not isinstance(values, list) or not values:
                raise CompareError(
                    f"{path}: grid key {key!r} must be a non-empty list, got {values!r}"
                )
            for value in values:
                if isinstance(value, dict):
                    _check_named_value(path, key, value, set(axes))
        target = document.get("target")
        if target is not None and not (
            isinstance(target, int | float) and 0 < target <= 1
        ):
            raise CompareError(
                f"{path}: target must be an accuracy in (0, 1], got {target!r}"
            )
        return cls(dict(document.get("base", {})), dict(axes), target)

    def cells(self) -> list[dict[str, Any]]:
        """Each cell's values of the varying keys, in the grid's order (a named
        value stays a table; `cell_settings` spreads it)."""
        keys = list(self.axes)
        return [
            dict(zip(keys, combo, strict=True))
            for combo in itertools.product(*self.axes.values())
        ]

    def select(self, only: Sequence[str]) -> Grid:
        """The grid narrowed to the cells whose values `only` names, as
        `key=value` with the value spelled as in the cell's directory name
        (`strategy=fedavg`, `seed=2`, a named table's name); several values of
        one key select all of them."""
        chosen: dict[str, list[Any]] = {}
        for selector in only:
            key, _, label = selector.partition("=")
            if key not in self.axes or not label:
                raise CompareError(
                    f"--only {selector!r}: expected key=value with a grid key "
                    f"({', '.join(self.axes) or 'this grid has none'})"
                )
            labels = [_label(value) for value in self.axes[key]]
            if label not in labels:
                raise CompareError(
                    f"--only {selector!r}: {key} takes {', '.join(labels)} in this grid"
                )
            chosen.setdefault(key, []).append(self.axes[key][labels.index(label)])
        return dataclasses.replace(self, axes={**self.axes, **chosen})


def _check_named_value(
    path: Path, key: str, value: dict[str, Any], grid_keys: set[str]
) -> None:
    """A table among a grid key's values sets several keys together, e.g.
    `{name = "feddyn-sam", strategy = "feddyn", local-objective = "feddyn-sam"}`:
    a `name` for the cell, then scalars that are no other grid key."""
    where = f"{path}: a table in grid key {key!r}"
    name = value.get("name")
    if not isinstance(name, str) or not name:
        raise CompareError(f"{where} needs a name (a non-empty string), got {value!r}")
    settings = {k: v for k, v in value.items() if k != "name"}
    if not settings:
        raise CompareError(f"{where} ({name!r}) sets no keys besides its name")
    for setting, scalar in settings.items():
        if isinstance(scalar, dict | list):
            raise CompareError(
                f"{where} ({name!r}): {setting!r} must be a single value, "
                f"got {scalar!r}"
            )
        if setting != key and setting in grid_keys:
            raise CompareError(
                f"{where} ({name!r}) sets {setting!r}, which is itself a grid key; "
                "set it in one place"
            )


def cell_settings(values: Mapping[str, Any]) -> dict[str, Any]:
    """A cell's run-config values: named tables spread into their keys."""
    settings: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            settings.update({k: v for k, v in value.items() if k != "name"})
        else:
            settings[key] = value
    return settings


def cell_name(values: Mapping[str, Any]) -> str:
    """A directory name for a cell: `strategy-fedavg_seed-1` (a named table
    gives its name: `strategy-feddyn-sam`)."""
    parts = [f"{key}-{_label(value)}" for key, value in values.items()]
    name = "_".join(parts) or "all"
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name)


def _label(value: Any) -> str:
    """A grid value as cell names spell it: a named table by its name."""
    return value["name"] if isinstance(value, dict) else str(value)


def config_text(values: Mapping[str, Any]) -> str:
    """Run-config values as one `--run-config` string (TOML scalars)."""
    return " ".join(f"{key}={json.dumps(value)}" for key, value in values.items())


DONE, TO_RUN, RESUMES, RESTARTS = "done", "to run", "resumes", "restarts"


@dataclass(frozen=True)
class Cell:
    """One cell of a grid: its directory name, its run config (`config`, as
    given; `run_config`, complete and validated) and what the comparison's
    directory already holds of it (`state`: `DONE`, `TO_RUN`, `RESUMES`
    after round `resume_after`, or `RESTARTS`, for the reason in `note`)."""

    name: str
    config: str
    run_config: dict[str, Any]
    state: str = TO_RUN
    resume_after: int | None = None
    note: str = ""


def validate_cells(grid: Grid, validate: Callable[[str], dict[str, Any]]) -> list[Cell]:
    """Every cell of `grid`, validated by `validate(config)` (which returns the
    complete run config); nothing is read or written."""
    cells = []
    for values in grid.cells():
        config = config_text({**grid.base, **cell_settings(values)})
        cells.append(Cell(cell_name(values), config, validate(config)))
    names = [cell.name for cell in cells]
    if len(set(names)) != len(names):
        raise CompareError(
            "two cells share a directory name; make the grid values distinct"
        )
    return cells


def with_states(cells: Sequence[Cell], out: Path) -> list[Cell]:
    """`cells` with what `out/runs/` holds of each. A finished run is kept
    only if its cell still asks for what it computed, so a grid may grow
    (more values, so more cells) but not change under its results; an
    interrupted run resumes from its latest checkpoint when that checkpoint's
    settings allow it."""
    return [_with_state(cell, out / "runs" / cell.name) for cell in cells]


def _with_state(cell: Cell, run_dir: Path) -> Cell:
    if not run_dir.exists():
        return cell
    if _finished(run_dir):
        _check_computed(run_dir, cell)
        return dataclasses.replace(cell, state=DONE)
    try:
        round = check_resumable(run_dir, cell.run_config)
    except (CheckpointError, OSError, ValueError) as err:
        return dataclasses.replace(cell, state=RESTARTS, note=str(err))
    return dataclasses.replace(cell, state=RESUMES, resume_after=round)


def _check_computed(run_dir: Path, cell: Cell) -> None:
    """Refuse a finished run whose recorded settings differ from its cell's
    (keys naming only where it ran aside; a key the run did not record, from
    an older pollen, is not compared)."""
    try:
        recorded = json.loads((run_dir / "settings.json").read_text())
    except (OSError, ValueError) as err:
        raise CompareError(f"cannot read {run_dir / 'settings.json'}: {err}") from err
    unrecorded = cell.run_config.keys() - recorded.keys()
    key = first_difference(recorded, cell.run_config, NOT_COMPARED | unrecorded)
    if key is not None:
        raise CompareError(
            f"{run_dir} was run with {key}={recorded[key]!r} and its cell now has "
            f"{key}={cell.run_config[key]!r}; this directory holds another grid's "
            "runs: use another --out"
        )


class Holder(NamedTuple):
    """The comparison holding a directory's lock: its pid and the cell it is
    running (empty between cells)."""

    pid: str
    cell_name: str


def describe(cell: Cell, running: Holder | None = None) -> str:
    """A cell's state in words, as the dry run and the progress lines say it;
    the cell that `running` (another comparison) runs now is said so, though
    its directory looks interrupted."""
    if running is not None and cell.name == running.cell_name:
        return f"running now (pid {running.pid})"
    if cell.state == RESUMES:
        return f"interrupted, resumes after round {cell.resume_after}"
    if cell.state == RESTARTS:
        return f"interrupted, cannot resume ({cell.note}), runs again"
    return cell.state


LOCK = "compare.lock"


@contextlib.contextmanager
def exclusive(out: Path) -> Iterator[Callable[[str], None]]:
    """Hold `out/compare.lock` while a comparison runs there: a second
    `compare` on the same directory would resume the same cell into the same
    run directory. The lock goes with the process, however it ends. Yields
    `running(cell_name)`, which records the cell being run in the lock file
    for `running_now`."""
    out.mkdir(parents=True, exist_ok=True)
    with (out / LOCK).open("a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CompareError(
                f"another pollen compare (pid {_holder(lock).pid}) is running in {out}; "
                "wait for it, or use another --out"
            ) from None

        def running(cell_name: str) -> None:
            lock.truncate(0)
            lock.write(f"{os.getpid()} {cell_name}".rstrip())
            lock.flush()

        running("")
        yield running


def running_now(out: Path) -> Holder | None:
    """The comparison running in `out`, or None when none runs there. The
    probe holds a shared lock for an instant; a compare starting in that
    instant is told to wait."""
    try:
        lock = (out / LOCK).open()
    except FileNotFoundError:
        return None
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _holder(lock)
        fcntl.flock(lock, fcntl.LOCK_UN)
        return None


def _holder(lock: IO[str]) -> Holder:
    """What a held lock file records."""
    lock.seek(0)
    pid, _, cell_name = lock.read().strip().partition(" ")
    return Holder(pid or "?", cell_name)


def run_grid(
    cells: Sequence[Cell],
    out: Path,
    run_cell: Callable[[str, str, Path], int],
    echo: Callable[[str], None] = print,
    running: Callable[[str], None] = lambda cell_name: None,
) -> None:
    """Run every unfinished cell into `out/runs/`, a progress line per cell
    with an ETA. `run_cell(config, name, log)` runs one (exit status);
    `running(name)` is told which cell runs (`exclusive`'s). An interrupted
    cell continues from its checkpoint, or its directory is moved to
    `out/incomplete/` (never deleted) and it runs again."""
    runs, logs = out / "runs", out / "logs"
    runs.mkdir(parents=True, exist_ok=True)
    logs.mkdir(exist_ok=True)
    left = sum(cell.state != DONE for cell in cells)
    spent: list[float] = []
    for index, cell in enumerate(cells, 1):
        prefix = f"[{index}/{len(cells)}] {cell.name}:"
        if cell.state == DONE:
            echo(f"{prefix} done before, kept")
            continue
        config = cell.config
        if cell.state == RESUMES:
            echo(f"{prefix} {describe(cell)}")
            resume = config_text({"resume": str((runs / cell.name).resolve())})
            config = f"{config} {resume}"
        elif cell.state == RESTARTS:
            aside = out / "incomplete" / f"{cell.name}-{int(time.time())}"
            aside.parent.mkdir(exist_ok=True)
            (runs / cell.name).rename(aside)
            echo(f"{prefix} {describe(cell)}; the interrupted run is kept in {aside}")
        running(cell.name)
        started = time.monotonic()
        status = run_cell(config, cell.name, logs / f"{cell.name}.log")
        spent.append(time.monotonic() - started)
        left -= 1
        eta = statistics.fmean(spent) * left
        outcome = (
            _outcome(runs / cell.name)
            if status == 0
            else f"failed (see {logs / cell.name}.log)"
        )
        echo(
            f"{prefix} {outcome}, {spent[-1]:.0f} s; {left} left, ETA {_duration(eta)}"
        )


def _finished(run_dir: Path) -> bool:
    try:
        return (
            json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
        )
    except (OSError, ValueError, KeyError):
        return False


def _outcome(run_dir: Path) -> str:
    summary = json.loads((run_dir / "summary.json").read_text())
    return (
        f"final {100 * summary['final-accuracy']:.2f}%, best "
        f"{100 * summary['best-accuracy']:.2f}% (round {summary['best-round']})"
    )


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def pollen_run_cell(app: Path, out: Path, overrides: Sequence[str]) -> Callable:
    """`run_cell` for `run_grid`: a `pollen run` simulation per cell."""

    def run_cell(config: str, name: str, log: Path) -> int:
        command = [str(Path(sys.executable).parent / "pollen"), "run", str(app)]
        for value in [*overrides, config, config_text(
            {"output-dir": str((out / "runs").resolve()), "run-name": name}
        )]:  # fmt: skip
            command += ["-c", value]
        with log.open("a") as sink:  # a resumed or repeated cell keeps its log
            return subprocess.run(
                command, stdout=sink, stderr=subprocess.STDOUT
            ).returncode

    return run_cell


# --- reports -----------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    name: str
    path: Path
    settings: dict[str, Any]
    summary: dict[str, Any]
    history: list[dict[str, Any]]

    @classmethod
    def read(cls, path: Path) -> Run:
        try:
            return cls(
                path.name, path,
                json.loads((path / "settings.json").read_text()),
                json.loads((path / "summary.json").read_text()),
                json.loads((path / "history.json").read_text()),
            )  # fmt: skip
        except (OSError, ValueError) as err:
            raise CompareError(
                f"{path} is not a finished run directory: {err}"
            ) from err

    def round_reaching(self, target: float) -> int | None:
        return next((r["round"] for r in self.history if r["accuracy"] >= target), None)


def read_runs(directory: Path) -> list[Run]:
    """Every completed run under `directory/runs/` (or `directory`); failed
    runs (diverged, stopped) have no final numbers to compare."""
    root = directory / "runs" if (directory / "runs").is_dir() else directory
    runs = [Run.read(p.parent) for p in sorted(root.glob("*/summary.json"))]
    completed = [r for r in runs if r.summary.get("status") == "completed"]
    if not completed:
        raise CompareError(
            f"no completed run directories (with summary.json) under {root}"
        )
    return completed


def varying_keys(runs: Sequence[Run]) -> list[str]:
    """Settings that differ between runs, in settings order. Beside the
    strategy, only keys that vary within one strategy or depart from its
    preset: what a strategy decides (its preset's `local-objective`, the
    `server-lr` that "auto" resolves to, ...) follows the strategy and is not
    a setting of its own, but `strategy=feddyn` with
    `local-objective=feddyn-sam` is a variant the report must name."""

    def differs(key: str, among: Sequence[Run]) -> bool:
        return len({json.dumps(r.settings.get(key)) for r in among}) > 1

    def departs(key: str, run: Run) -> bool:
        preset = PRESETS.get(run.settings.get("strategy"), {})
        return key in preset and run.settings.get(key) != preset[key]

    by_strategy: dict[Any, list[Run]] = {}
    for run in runs:
        by_strategy.setdefault(run.settings.get("strategy"), []).append(run)
    return [
        k for k in runs[0].settings
        if k not in NOT_COMPARED and differs(k, runs)
        and (k == "strategy" or any(differs(k, g) for g in by_strategy.values())
             or any(departs(k, r) for r in runs))
    ]  # fmt: skip


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(
        values
    ) > 1 else 0.0


def summarize_groups(runs: Sequence[Run], target: float | None) -> list[dict[str, Any]]:
    """One row per setting (runs equal but for the seed): means and standard
    deviations over its seeds."""
    keys = [k for k in varying_keys(runs) if k != "seed"]
    groups: dict[tuple, list[Run]] = {}
    for run in runs:
        groups.setdefault(
            tuple(json.dumps(run.settings.get(k)) for k in keys), []
        ).append(run)
    rows = []
    for members in groups.values():
        first = members[0].settings
        row: dict[str, Any] = {
            "setting": {k: first.get(k) for k in keys},
            "runs": [m.name for m in members],
            "seeds": [m.settings.get("seed") for m in members],
        }
        for field, values in {
            "final-accuracy": [m.summary["final-accuracy"] for m in members],
            "best-accuracy": [m.summary["best-accuracy"] for m in members],
            "seconds": [m.summary["total-seconds"] for m in members],
            "mb-up": [m.summary["total-bytes-up"] / MB for m in members],
            "mb-down": [m.summary["total-bytes-down"] / MB for m in members],
        }.items():
            row[field] = dict(zip(("mean", "std"), _mean_std(values), strict=True))
        if target is not None:
            reached = [m.round_reaching(target) for m in members]
            row["round-to-target"] = reached
        rows.append(row)
    return sorted(rows, key=lambda row: [_order(v) for v in row["setting"].values()])


def _order(value: Any) -> tuple[int, Any]:
    """Numbers before text, numbers by value (5 before 10)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return 0, value
    return 1, str(value)


def markdown_table(rows: Sequence[Mapping[str, Any]], target: float | None) -> str:
    keys = list(rows[0]["setting"]) if rows else []
    head = [*keys, "seeds", "final acc. (%)", "best acc. (%)"]
    if target is not None:
        head.append(f"round to {100 * target:g}%")
    head += ["time (s)", "MB up", "MB down"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [str(row["setting"][k]) for k in keys]
        cells.append(str(len(row["seeds"])))
        cells.append(_pm(row["final-accuracy"], 100, 2))
        cells.append(_pm(row["best-accuracy"], 100, 2))
        if target is not None:
            cells.append(_reached(row["round-to-target"]))
        cells += [
            _pm(row["seconds"], 1, 0),
            _pm(row["mb-up"], 1, 1),
            _pm(row["mb-down"], 1, 1),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _pm(stat: Mapping[str, float], scale: float, digits: int) -> str:
    mean, std = scale * stat["mean"], scale * stat["std"]
    return f"{mean:.{digits}f} ± {std:.{digits}f}" if std else f"{mean:.{digits}f}"


def _reached(rounds: Sequence[int | None]) -> str:
    hit = [r for r in rounds if r is not None]
    if not hit:
        return "never"
    text = f"{statistics.fmean(hit):.1f}"
    return (
        text if len(hit) == len(rounds) else f"{text} ({len(hit)}/{len(rounds)} seeds)"
    )


def plot_groups(runs: Sequence[Run], plots: Path) -> list[Path]:
    """Accuracy per round and against bytes (means over seeds), one figure
    per setting with a line per strategy; each setting's label distribution."""
    keys = [k for k in varying_keys(runs) if k != "seed"]
    series_keys = [k for k in keys if k in SERIES_KEYS]
    figure_keys = [k for k in keys if k not in SERIES_KEYS]
    if not series_keys and figure_keys:  # one strategy: compare along a setting
        series_keys = [figure_keys.pop()]
    figures: dict[str, dict[str, list[Run]]] = {}
    for run in runs:
        figure = cell_name({k: run.settings[k] for k in figure_keys})
        line = (
            ", ".join(
                f"{k}={run.settings[k]}"
                if k not in SERIES_KEYS
                else str(run.settings[k])
                for k in series_keys
            )
            or run.name
        )
        figures.setdefault(figure, {}).setdefault(line, []).append(run)
    plots.mkdir(parents=True, exist_ok=True)
    written = []
    for slug, lines in figures.items():
        some = next(iter(lines.values()))[0].settings
        figure = ", ".join(f"{k}={some[k]}" for k in figure_keys)
        seeds_in_title, labels = _seed_counts(lines)
        by_round, by_bytes = {}, {}
        for line, members in lines.items():
            accuracy = _mean_curve(
                [[r["accuracy"] for r in m.history] for m in members]
            )
            megabytes = _mean_curve([_cumulative_mb(m.history) for m in members])
            rounds = list(range(1, len(accuracy) + 1))
            label = labels[line]
            by_round[label], by_bytes[label] = (rounds, accuracy), (megabytes, accuracy)
        title = ": ".join(t for t in (str(some.get("data-set", "")), figure) if t)
        title += seeds_in_title
        for suffix, series, xlabel in (
            ("rounds", by_round, "round"),
            ("bytes", by_bytes, "MB sent and received (cumulative)"),
        ):
            path = plots / f"accuracy-{suffix}-{slug}.png"
            plot_accuracy_against(
                series, path, title, xlabel, integer_x=suffix == "rounds"
            )
            written.append(path)
    partition_keys = [k for k in keys if k not in SERIES_KEYS]  # not the strategy
    for run in runs:  # each setting's partition (the first seed's)
        labels = run.path / "labels.png"
        setting = {k: run.settings[k] for k in partition_keys}
        target = plots / f"labels-{cell_name(setting)}.png"
        if labels.exists() and not target.exists():
            shutil.copyfile(labels, target)
            written.append(target)
    return written


def _seed_counts(lines: Mapping[str, Sequence[Run]]) -> tuple[str, dict[str, str]]:
    """Over how many seeds each line is a mean, said once (a title suffix)
    when every line has the same count, else on each line's label."""
    counts = {line: len(members) for line, members in lines.items()}
    spelled = {n: f"mean of {n} seeds" if n > 1 else "1 seed" for n in counts.values()}
    if len(spelled) == 1:
        (count,) = spelled
        suffix = f" ({spelled[count]})" if count > 1 else ""
        return suffix, {line: line for line in lines}
    return "", {line: f"{line} ({spelled[n]})" for line, n in counts.items()}


def _mean_curve(curves: Sequence[Sequence[float]]) -> list[float]:
    """Mean per round over seeds, as long as the shortest curve."""
    length = min(len(c) for c in curves)
    return [statistics.fmean(c[i] for c in curves) for i in range(length)]


def _cumulative_mb(history: Sequence[Mapping[str, Any]]) -> list[float]:
    return list(
        itertools.accumulate((r["bytes-up"] + r["bytes-down"]) / MB for r in history)
    )


def report(directory: Path, target: float | None = None) -> Path:
    """Write comparison.json, comparison.md and plots/ for the runs under
    `directory`; the markdown table's path."""
    runs = read_runs(directory)
    rows = summarize_groups(runs, target)
    table = markdown_table(rows, target)
    write_json(directory / "comparison.json", {"target": target, "groups": rows})
    write_atomic(directory / "comparison.md", table)
    fresh, plots = directory / ".plots-new", directory / "plots"
    shutil.rmtree(fresh, ignore_errors=True)
    plot_groups(runs, fresh)
    shutil.rmtree(plots, ignore_errors=True)  # made by an earlier report
    fresh.rename(plots)
    return directory / "comparison.md"
