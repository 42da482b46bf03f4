"""Comparisons: a grid of simulation runs, each a `pollen run`.

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

With `--jobs N` up to N simulated cells run at once, each on a warm
federation of its own, sharing the machine's CPUs (`_shared_federation`).
Where `RAY_ADDRESS` names a Ray cluster the simulated cells join it
instead, each with its own SuperLink here and 1/N of the cluster's
ClientApp actors (`deployment.flower_simulation`).

With `--network PROFILE` every cell runs as a real deployment on this
machine, each SuperNode in its own network namespace behind the link the
profile gives it (`network_cells`); with `--simulate` as well, the cells
are simulations whose simulated clock the profile drives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import statistics
import sys
import threading
import time
import tomllib
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import locks
from ..deployment import processes
from ..deployment.flower_simulation import SHARE_ENV
from ..deployment.launch import RUN_STOP_SECONDS, simulated_nodes
from ..deployment.ray_cluster import (
    RayCluster,
    RayClusterError,
    ask_cluster,
    named_cluster,
)
from ..deployment.run_config import RunConfigError, resolve_settings
from ..deployment.warm_simulation import warm_simulation
from ..files import write_atomic
from ..runs.checkpoints import (
    CheckpointError,
    check_resumable,
    first_difference,
    list_checkpoints,
    recorded_checkpoint_every,
)
from ..runs.claim import is_held
from ..settings import SettingsError
from .report import (
    NOT_COMPARED,
    CompareError,
    cell_name,
    directory_label,
    read_json,
    report,
    value_label,
)
from .running_cells import RunningLines

# How long an interrupted cell's `pollen run` gets to stop its run (and record
# it as interrupted, checkpointed) before it is killed
CELL_STOP_SECONDS = RUN_STOP_SECONDS + 10.0
# the simulated cells' warm SuperLink and Ray head (their logs stay there);
# with --jobs N, one per cell run at once: warm-simulation-1, -2, ...
WARM_DIR = "warm-simulation"
# how often a cell run beside others looks whether the comparison is stopping
CELL_POLL_SECONDS = 0.2

# one cell's run: (its run config, its name, its log) -> the run's exit status
RunCell = Callable[[str, str, Path], int]


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
        """The grid in the TOML file `path`."""
        return cls.loads(grid_text(path), path)

    @classmethod
    def loads(cls, text: str, path: Path) -> Grid:
        """The grid the TOML `text` holds, its errors said as `path`'s."""
        try:
            document = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise CompareError(f"cannot read grid {path}: {err}") from err
        unknown = set(document) - {"base", "grid", "target"}
        if unknown:
            raise CompareError(
                f"{path}: unknown table or key {sorted(unknown)[0]!r}; "
                "a grid has [base], [grid] and an optional target"
            )
        base = document.get("base", {})
        if not isinstance(base, dict):
            raise CompareError(f"{path}: base must be a table ([base]), got {base!r}")
        for key, value in base.items():
            if isinstance(value, list | dict):
                raise CompareError(
                    f"{path}: [base] {key} is a {type(value).__name__}; [base] "
                    "holds one value per key, the values to compare go in a "
                    f"list under [grid] ({key} = [...])"
                )
            _check_scalar(f"{path}: [base] {key}", value)
        axes = document.get("grid", {})
        if not isinstance(axes, dict):
            raise CompareError(
                f"{path}: grid must be a table ([grid], each key a list of values), "
                f"got {axes!r}"
            )
        for key in CELL_KEYS & (set(base) | set(axes)):
            raise CompareError(
                f"{path}: {key} is set by pollen compare for each cell (--out "
                "and the cell's name); leave it out of the grid"
            )
        for key, values in axes.items():
            if not isinstance(values, list) or not values:
                raise CompareError(
                    f"{path}: grid key {key!r} must be a non-empty list, got {values!r}"
                )
            for value in values:
                if isinstance(value, dict):
                    _check_named_value(path, key, value, set(axes))
                else:
                    _check_scalar(f"{path}: grid key {key!r}", value)
        _check_tables_apart(path, axes)
        target = document.get("target")
        if target is not None and not (
            isinstance(target, int | float)
            and not isinstance(target, bool)
            and 0 < target <= 1
        ):
            raise CompareError(
                f"{path}: target must be an accuracy in (0, 1], got {target!r}"
            )
        return cls(dict(base), dict(axes), target)

    def sets(self, key: str) -> bool:
        """Whether [base], a grid key or a named table among its values sets
        run-config `key`."""
        named = (
            v for values in self.axes.values() for v in values if isinstance(v, dict)
        )
        return key in self.base or key in self.axes or any(key in v for v in named)

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
            values = self.axes[key]
            spelled = [directory_label(value_label(value)) for value in values]
            matches = [v for v, text in zip(values, spelled, strict=True)
                       if label in (value_label(v), text)]  # fmt: skip
            if not matches:
                raise CompareError(
                    f"--only {selector!r}: {key} takes {', '.join(spelled)} in this grid"
                )
            picked = chosen.setdefault(key, [])
            picked += [value for value in matches[:1] if value not in picked]
        return dataclasses.replace(self, axes={**self.axes, **chosen})


def grid_text(path: Path) -> str:
    """The text of the grid file `path`, or `CompareError` saying why not."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise CompareError(
            f"cannot read grid {path}: not UTF-8 text (byte {err.start}); a "
            "grid is a TOML file"
        ) from None
    except OSError as err:
        raise CompareError(f"cannot read grid {path}: {err}") from err


def _check_scalar(where: str, value: Any) -> None:
    """A run-config value is a string, a number or a boolean (TOML also has
    dates and times, which no key takes)."""
    if not isinstance(value, str | int | float | bool):
        raise CompareError(
            f"{where}: {value!r} is a {type(value).__name__}; a run-config value "
            "is a string, a number or true/false"
        )


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
        _check_scalar(f"{where} ({name!r}): {setting!r}", scalar)
        if setting in CELL_KEYS:
            raise CompareError(
                f"{where} ({name!r}) sets {setting!r}, which pollen compare sets "
                "for each cell (--out and the cell's name); leave it out"
            )
        if setting != key and setting in grid_keys:
            raise CompareError(
                f"{where} ({name!r}) sets {setting!r}, which is itself a grid key; "
                "set it in one place"
            )


def _check_tables_apart(path: Path, axes: Mapping[str, list[Any]]) -> None:
    """Tables of two grid keys may not set one key: a cell of both would
    take the later table's value and drop the other's without a word."""
    setters: dict[str, str] = {}
    for key, values in axes.items():
        for value in values:
            if not isinstance(value, dict):
                continue
            for setting in set(value) - {"name"}:
                other = setters.setdefault(setting, key)
                if other != key:
                    raise CompareError(
                        f"{path}: tables in grid keys {other!r} and {key!r} both "
                        f"set {setting!r}, and a cell of both would drop one; set "
                        "it in one place"
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


def config_text(values: Mapping[str, Any]) -> str:
    """Run-config values as one `--run-config` string (TOML scalars)."""
    return " ".join(f"{key}={json.dumps(value)}" for key, value in values.items())


DONE, TO_RUN, RESUMES, RESTARTS = "done", "to run", "resumes", "restarts"
# an interrupted cell that left no checkpoint: nothing to resume, it runs anew
STARTS_OVER = "starts over"
HELD = "held by a run that is still going"
# what compare sets for every cell itself: where its run directory goes
CELL_KEYS = frozenset({"output-dir", "run-name"})


@dataclass(frozen=True)
class Cell:
    """One cell of a grid: its directory name, its run config (`config`, as
    given; `run_config`, complete and validated) and what the comparison's
    directory already holds of it (`state`: `DONE`, `TO_RUN`, `RESUMES`
    after round `resume_after`, `STARTS_OVER` or `RESTARTS`, for the reason
    in `note`)."""

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
    if is_held(run_dir):  # never moved aside or rerun under a live run
        return dataclasses.replace(cell, state=HELD)
    if _finished(run_dir):
        _check_computed(run_dir, cell)
        return dataclasses.replace(cell, state=DONE)
    if not list_checkpoints(run_dir):
        note = _why_no_checkpoint(run_dir, cell)
        return dataclasses.replace(cell, state=STARTS_OVER, note=note)
    try:
        round = check_resumable(run_dir, cell.run_config)
    except (CheckpointError, OSError, ValueError) as err:
        return dataclasses.replace(cell, state=RESTARTS, note=str(err))
    return dataclasses.replace(cell, state=RESUMES, resume_after=round)


def _why_no_checkpoint(run_dir: Path, cell: Cell) -> str:
    """How an interrupted cell's run came to leave no checkpoint, from the
    `checkpoint-every` it ran with (its `settings.json`; the cell's own
    where the run stopped before writing one): it stopped before its first,
    or it writes none. Not a fault: the cell simply runs from round 1."""
    every = recorded_checkpoint_every(run_dir)
    if every is None:
        every = cell.run_config.get("checkpoint-every")
    if every:
        return f"before its first checkpoint (checkpoint-every={every})"
    return "with no checkpoint (checkpoint-every=0)"


def refuse_held(cells: Sequence[Cell], out: Path) -> None:
    """Refuse to run while a cell's directory is held by a live run."""
    for cell in cells:
        if cell.state == HELD:
            raise CompareError(
                f"{out / 'runs' / cell.name} is held by a run that is still going "
                "(a cell of an earlier pollen compare that was killed?); let it "
                "finish or stop it, then run pollen compare again"
            )


def _check_computed(run_dir: Path, cell: Cell) -> None:
    """Refuse a finished run whose recorded settings differ from its cell's
    (keys naming only where it ran aside; a key the run did not record, from
    an older pollen, is not compared)."""
    recorded = read_json(run_dir / "settings.json", dict)
    unrecorded = cell.run_config.keys() - recorded.keys()
    key = first_difference(recorded, cell.run_config, NOT_COMPARED | unrecorded)
    if key is not None:
        raise CompareError(
            f"{run_dir} was run with {key}={recorded[key]!r} and its cell now has "
            f"{key}={cell.run_config[key]!r}; this directory holds another grid's "
            "runs: use another --out"
        )


def describe(cell: Cell, running: locks.Holder | None = None) -> str:
    """A cell's state in words, as the dry run and the progress lines say it;
    the cell that `running` (another comparison) runs now is said so, though
    its directory looks interrupted."""
    if running is not None and cell.name in running.doing.split():
        return f"running now (pid {running.pid})"
    if cell.state == HELD:
        return f"{HELD} (its run directory's lock is held)"
    if cell.state == RESUMES:
        return f"interrupted, resumes after round {cell.resume_after}"
    if cell.state == STARTS_OVER:
        return f"interrupted {cell.note}, starts again from round 1"
    if cell.state == RESTARTS:
        return f"interrupted, cannot resume ({cell.note}), runs again"
    return cell.state


LOCK = "compare.lock"


@contextlib.contextmanager
def exclusive(out: Path) -> Iterator[Callable[[str], None]]:
    """Hold `out/compare.lock` while a comparison runs there: a second
    `compare` on the same directory would resume the same cell into the same
    run directory. The lock goes with the process, however it ends. Yields
    `running(cell_names)`, which records the cells being run (their names,
    which hold no space, space-separated) in the lock file for
    `running_now`."""
    stack = contextlib.ExitStack()
    try:
        out.mkdir(parents=True, exist_ok=True)
        running = stack.enter_context(locks.held(out / LOCK))
    except locks.LockHeld as held:
        raise CompareError(
            f"another pollen compare (pid {held.holder.pid}) is running in {out}; "
            "wait for it, or use another --out"
        ) from None
    except OSError as err:
        raise CompareError(
            f"--out {out}: cannot hold a comparison there: {err}"
        ) from err
    with stack:
        yield running


def running_now(out: Path) -> locks.Holder | None:
    """The comparison running in `out`, or None when none runs there
    (`locks.current_holder`)."""
    return locks.current_holder(out / LOCK)


def run_grid(
    cells: Sequence[Cell],
    out: Path,
    run_cells: Sequence[RunCell],
    echo: Callable[[str], None] = print,
    running: Callable[[str], None] = lambda cell_names: None,
    stop: threading.Event | None = None,
) -> list[str]:
    """Run every unfinished cell into `out/runs/`, a progress line per cell
    with an ETA; the cells whose run failed. `run_cell(config, name, log)`
    runs one (exit status); with one in `run_cells`, each cell runs in this
    thread, one after another; with N, up to N at once, each in a thread of
    its own with a `run_cell` of its own, and a line says when each starts.
    `running(names)` is told which cells run (`exclusive`'s). A failed cell
    does not stop the others. Ctrl-C (a `KeyboardInterrupt` here) with
    several running sets `stop`, which each of them (`pollen_run_cell`)
    answers by stopping its run, and returns once all have stopped. An
    interrupted cell continues from its checkpoint, or its directory is
    moved to `out/incomplete/` (never deleted) and it runs again."""
    runs, logs = out / "runs", out / "logs"
    runs.mkdir(parents=True, exist_ok=True)
    logs.mkdir(exist_ok=True)
    progress = _Progress(out, echo, sum(cell.state != DONE for cell in cells),
                         len(run_cells))  # fmt: skip
    queued = [
        (f"[{i}/{len(cells)}] {cell.name}:", cell) for i, cell in enumerate(cells, 1)
    ]
    if len(run_cells) <= 1:  # none when every cell is done
        for prefix, cell in queued:
            if cell.state == DONE:
                echo(f"{prefix} done before, kept")
                continue
            config = _prepared(cell, out, prefix, echo)
            running(cell.name)
            started = time.monotonic()
            status = run_cells[0](config, cell.name, logs / f"{cell.name}.log")
            progress.ended(prefix, cell.name, status, time.monotonic() - started)
        return progress.failed
    if stop is None:
        raise ValueError("cells at once need the `stop` their run_cells watch")
    terminal = echo is print and sys.stdout.isatty()  # a line per running cell
    lines = RunningLines(echo, sys.stdout if terminal else None)
    progress.echo = lines.say
    try:
        return _run_at_once(queued, out, run_cells, progress, running, stop, lines)
    finally:
        lines.redraw({}, force=True)


@dataclass(frozen=True)
class _Running:
    """A cell running beside others: its line's prefix, the `run_cell` it
    holds, its log, the log's size when it started (what follows is this
    run's) and when it started."""

    prefix: str
    cell: Cell
    run_cell: RunCell
    log: Path
    offset: int
    started: float


def _run_at_once(
    queued: Sequence[tuple[str, Cell]],
    out: Path,
    run_cells: Sequence[RunCell],
    progress: _Progress,
    running: Callable[[str], None],
    stop: threading.Event,
    lines: RunningLines,
) -> list[str]:
    """`run_grid` with up to `len(run_cells)` cells at once: a cell starts
    on the first free `run_cell`, in a thread of its own; `lines` shows
    the running ones. A cell whose thread raised failed; anything raised
    here (Ctrl-C) sets `stop`, and returns once every running cell has
    stopped."""
    free = list(run_cells)
    live: dict[futures.Future[int], _Running] = {}
    waiting = list(queued)
    said = ""
    pool = futures.ThreadPoolExecutor(len(run_cells), "pollen-cell")
    try:
        while waiting or live:
            while waiting and (free or waiting[0][1].state == DONE):
                prefix, cell = waiting.pop(0)
                if cell.state == DONE:
                    progress.echo(f"{prefix} done before, kept")
                    continue
                config = _prepared(cell, out, prefix, progress.echo)
                log = out / "logs" / f"{cell.name}.log"
                offset = log.stat().st_size if log.exists() else 0
                entry = _Running(
                    prefix, cell, free.pop(0), log, offset, time.monotonic()
                )
                live[pool.submit(entry.run_cell, config, cell.name, log)] = entry
                progress.echo(f"{prefix} running")
            if (names := " ".join(e.cell.name for e in live.values())) != said:
                running(names)
                said = names
            done, _ = futures.wait(live, CELL_POLL_SECONDS, futures.FIRST_COMPLETED)
            for job in done:
                entry = live.pop(job)
                free.append(entry.run_cell)
                try:
                    status = job.result()
                except Exception as error:  # starting or watching its run failed
                    progress.echo(f"{entry.prefix} {type(error).__name__}: {error}")
                    status = 1
                seconds = time.monotonic() - entry.started
                progress.ended(entry.prefix, entry.cell.name, status, seconds)
            lines.redraw({e.cell.name: (e.log, e.offset) for e in live.values()})
    except BaseException:  # Ctrl-C (SIGTERM), or a fault of pollen's own
        stop.set()  # each running cell stops its run, all at once
        pool.shutdown(wait=False, cancel_futures=True)  # and none starts
        if live:
            progress.echo(
                f"pollen: stopping {len(live)} running cell(s); each records its "
                f"interruption (up to {CELL_STOP_SECONDS:.0f} s)"
            )
        futures.wait(live)
        raise
    finally:
        pool.shutdown(wait=True)
    return progress.failed


def _prepared(cell: Cell, out: Path, prefix: str, echo: Callable[[str], None]) -> str:
    """The run config `cell` runs with now: resuming its run from its
    checkpoint, or after its interrupted run is moved aside to
    `out/incomplete/`."""
    runs = out / "runs"
    if cell.state == RESUMES:
        echo(f"{prefix} {describe(cell)}")
        resume = config_text({"resume": str((runs / cell.name).resolve())})
        return f"{cell.config} {resume}"
    if cell.state in (STARTS_OVER, RESTARTS):
        aside = out / "incomplete" / f"{cell.name}-{int(time.time())}"
        aside.parent.mkdir(exist_ok=True)
        (runs / cell.name).rename(aside)
        echo(f"{prefix} {describe(cell)}; the interrupted run is kept in {aside}")
    return cell.config


class _Progress:
    """The line said as each cell of the comparison in `out` ends: its
    outcome, its seconds, the cells left and the time they take at the mean
    so far, `jobs` at once; the cells that failed."""

    def __init__(
        self, out: Path, echo: Callable[[str], None], left: int, jobs: int
    ) -> None:
        self.out, self.echo, self.left, self.jobs = out, echo, left, jobs
        self.spent: list[float] = []
        self.failed: list[str] = []

    def ended(self, prefix: str, name: str, status: int, seconds: float) -> None:
        self.spent.append(seconds)
        self.left -= 1
        eta = statistics.fmean(self.spent) * self.left / self.jobs
        if status == 0:
            outcome = _outcome(self.out / "runs" / name)
        else:
            outcome = f"failed (see {self.out / 'logs' / name}.log)"
            self.failed.append(name)
        self.echo(
            f"{prefix} {outcome}, {seconds:.0f} s; {self.left} left, "
            f"ETA {_duration(eta)}"
        )


def _finished(run_dir: Path) -> bool:
    try:
        summary = read_json(run_dir / "summary.json", dict)
    except CompareError:
        return False
    return summary.get("status") == "completed"


def _outcome(run_dir: Path) -> str:
    summary = read_json(run_dir / "summary.json", dict)
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


def cell_command(
    app: Path, out: Path, overrides: Sequence[str]
) -> Callable[..., list[str]]:
    """`command(config, name, deployment=None, warm=None, federation=())`:
    the argv of one cell's `pollen run` (submitted to the deployment in that
    directory, or simulated on the warm federation in that one, when given,
    with those `--federation-config` values)."""

    def command(
        config: str,
        name: str,
        deployment: Path | None = None,
        warm: Path | None = None,
        federation: Sequence[str] = (),
    ) -> list[str]:
        argv = [str(Path(sys.executable).parent / "pollen"), "run", str(app)]
        if deployment is not None:
            argv += ["--deployment", str(deployment)]
        if warm is not None:
            argv += ["--warm-simulation", str(warm)]
        for value in federation:
            argv += ["--federation-config", value]
        # the comparison's runs share one MLflow experiment, unless a value names one
        experiment = config_text({"tracking-experiment": out.resolve().name})
        for value in [experiment, *overrides, config, config_text(
            {"output-dir": str((out / "runs").resolve()), "run-name": name}
        )]:  # fmt: skip
            argv += ["-c", value]
        return argv

    return command


def pollen_run_cell(
    app: Path,
    out: Path,
    overrides: Sequence[str],
    warm: Path | None,
    stop: threading.Event | None = None,
    nodes: Mapping[str, int] | None = None,
    env: dict[str, str] | None = None,
) -> RunCell:
    """`run_cell` for `run_grid`: a `pollen run` simulation per cell, on the
    warm federation in `warm` (None: a SuperLink of its own, on the Ray
    cluster `RAY_ADDRESS` in `env` names), with `nodes[name]` SuperNodes
    where given, stopped (given `CELL_STOP_SECONDS` to record its
    interruption) when the comparison is interrupted here or `stop` is set
    from another thread."""
    command = cell_command(app, out, overrides)
    stopping = stop or threading.Event()
    nodes = nodes or {}

    def run_cell(config: str, name: str, log: Path) -> int:
        if stopping.is_set():  # the comparison stopped before this cell began
            raise KeyboardInterrupt
        federation = [f"num-supernodes={nodes[name]}"] if name in nodes else []
        argv = command(config, name, warm=warm, federation=federation)
        # output appended: a resumed or repeated cell keeps its log; the run
        # is stopped with all it started if the comparison is interrupted
        run = processes.start(argv, log=log, env=env)
        try:
            while run.poll() is None:
                if stopping.wait(CELL_POLL_SECONDS):
                    raise KeyboardInterrupt  # this thread's cell is interrupted
            return run.returncode
        finally:
            if run.poll() is None:  # time for the run to record its interruption
                processes.stop(run.pid, grace=CELL_STOP_SECONDS)

    return run_cell


@dataclass(frozen=True)
class Comparison:
    """What `pollen compare` is asked for: the grid in `grid_path`, its cells
    selected by `only` (`Grid.select`), each a run of `app` into `out` with
    the run config `overrides` under it; with a `network` profile (a
    resolved file) each cell runs as a deployment over links shaped as the
    profile says (`network_cells`), or, with `simulate`, as a simulation
    whose clock the profile drives; up to `jobs` simulated cells at once."""

    grid_path: Path
    app: Path
    out: Path
    overrides: Sequence[str] = ()
    only: Sequence[str] = ()
    network: Path | None = None
    simulate: bool = False
    jobs: int = 1
    # the grid's TOML when it was not read from `grid_path` (one given in
    # Python, kept at `grid_path` when the comparison runs)
    grid_text: str = ""

    @property
    def grid_toml(self) -> str:
        """The grid's TOML: `grid_text`, else `grid_path`'s."""
        return self.grid_text or grid_text(self.grid_path)

    @property
    def deployed(self) -> bool:
        """Whether each cell runs as a deployment over a shaped network."""
        return self.network is not None and not self.simulate

    @property
    def cell_overrides(self) -> list[str]:
        """The run config under every cell: `overrides`, then the
        `network-profile` with a network (so a finished cell computed over
        another profile is not kept)."""
        if self.network is None:
            return list(self.overrides)
        return [*self.overrides, config_text({"network-profile": str(self.network)})]

    def validate(self, config: str) -> dict[str, Any]:
        """The complete run config of the cell `config` sets, or the reason
        it has none."""
        values = [*self.cell_overrides, config]
        try:
            return resolve_settings(self.app, values).to_run_config()
        except (SettingsError, RunConfigError) as err:
            raise CompareError(f"cell {config!r}: {err}") from None


def run_comparison(comparison: Comparison, dry_run: bool = False) -> list[str]:
    """`pollen compare`: validate every selected cell of the comparison's
    grid, then list them (`dry_run`) or run the unfinished ones into its
    `out` and print the report's table; the cells that failed."""
    from . import network_cells  # the deployment side: only --network pays

    out = comparison.out
    grid_toml = comparison.grid_toml
    grid = Grid.loads(grid_toml, comparison.grid_path).select(comparison.only)
    if comparison.network is not None and grid.sets("network-profile"):
        raise CompareError(
            f"{comparison.grid_path} sets network-profile, and --network sets it "
            "for every cell (the links shaped and the clock must be one profile); "
            "leave it out of the grid, or run without --network"
        )
    cells = validate_cells(grid, comparison.validate)  # before any write
    # a Ray cluster is asked what it offers once the cells are known to be valid
    cluster = None if comparison.deployed else joined_cluster(os.environ)
    check_jobs(comparison.jobs, comparison.network is not None, cluster)
    run_configs = {cell.name: cell.run_config for cell in cells}
    if comparison.deployed:
        network_cells.check_cells(run_configs)
    if dry_run:
        if comparison.deployed:
            print(f"pollen: each cell runs as a deployment over {comparison.network}")
        print_plan(cells, out)
        return []
    if comparison.deployed:
        network_cells.check_host()
    # SIGTERM stops a comparison as Ctrl-C does: the cell's processes go too
    with exclusive(out) as running, processes.stop_signals_interrupt():
        cells = with_states(cells, out)
        refuse_held(cells, out)
        write_atomic(out / "grid.toml", grid_toml)
        stop = threading.Event()  # set on Ctrl-C: every running cell stops
        with _shared_federation(comparison, cells, cluster) as federations:
            if cluster is not None and federations:
                print(on_cluster(cluster, len(federations)), flush=True)
            run_cells = _cell_runners(
                comparison, run_configs, federations, stop, cluster
            )
            failed = run_grid(cells, out, run_cells, running=running, stop=stop)
        if len(failed) < len(cells):  # else no run to report
            print(report(out, grid.target).read_text(), end="")
    print(f"pollen: comparison in {out}")
    if failed:
        print(f"pollen: {len(failed)} of {len(cells)} cells failed: "
              f"{', '.join(failed)} (their logs in {out / 'logs'})", file=sys.stderr)  # fmt: skip
    return failed


def joined_cluster(environ: Mapping[str, str]) -> RayCluster | None:
    """The Ray cluster that `RAY_ADDRESS` in `environ` names, where the
    simulated cells run, asked what it offers (None: no address, the cells
    run on this machine's own warm federations)."""
    address = named_cluster(environ)
    if address is None:
        return None
    try:
        cluster = ask_cluster(address)
    except RayClusterError as err:
        raise CompareError(str(err)) from None
    if cluster.cpus < 1:
        raise CompareError(
            f"RAY_ADDRESS={address}: the Ray cluster offers no CPU, and each "
            "ClientApp actor needs one; add a node with CPUs, or unset RAY_ADDRESS"
        )
    return cluster


def on_cluster(cluster: RayCluster, at_once: int) -> str:
    """What the console says of the cells' place on `cluster`."""
    said = (
        f"pollen: the cells run on the Ray cluster at {cluster.address} "
        f"({cluster.nodes} node(s), {cluster.cpus} CPUs), each with a SuperLink here"
    )
    if at_once > 1:
        said += f"; {at_once} at once, each with 1/{at_once} of the ClientApp actors"
    return said


def check_jobs(jobs: object, network: bool, cluster: RayCluster | None = None) -> None:
    """Refuse a `jobs` that cannot run at once: each cell at once has at
    least one CPU (of this machine's federations, or of the Ray `cluster`
    the cells join), and cells over a network profile (`network`) run one
    at a time."""
    if cluster is None:
        cores, whose = os.cpu_count() or 1, "this machine's"
        at_once = "the cells run at once, each on a federation with at least one"
    else:
        cores, whose = (
            cluster.cpus,
            f"the Ray cluster's (RAY_ADDRESS={cluster.address})",
        )
        at_once = "the cells run at once, each with at least one ClientApp actor"
    if isinstance(jobs, bool) or not isinstance(jobs, int) or not 1 <= jobs <= cores:
        raise CompareError(
            f"--jobs {jobs!r}: {at_once} of {whose} {cores} CPUs; allowed: 1 to {cores}"
        )
    if jobs > 1 and network:
        raise CompareError(
            f"--jobs {jobs} with --network: cells over a network profile run one "
            "at a time (a deployed cell shapes this machine's links; a simulated "
            "one times its clients by their measured compute, which cells beside "
            "it would slow); use --jobs 1"
        )


def _shared_federation(
    comparison: Comparison, cells: Sequence[Cell], cluster: RayCluster | None = None
) -> contextlib.AbstractContextManager[list[Path | None]]:
    """While the cells run: the warm SuperLinks and Ray heads the simulated
    cells run on (each cell skips their start-up), when a cell is left to
    run; deployed cells start their own. One federation with the machine's
    CPUs, or with `jobs` N > 1 one per cell run at once (at most N, the
    CPUs shared out among them): runs on one Ray head would each size
    their ClientApp actors to all of its CPUs (Flower's
    `pool_size_from_resources`), and two such runs wait on each other's
    actors. Yields the federations' directories; on a Ray `cluster`, None
    for each cell run at once: each starts a SuperLink of its own that
    joins the cluster (there is no Ray head to start)."""
    left = sum(cell.state != DONE for cell in cells)
    out, jobs = comparison.out, comparison.jobs
    if comparison.deployed or not left:
        return contextlib.nullcontext([])
    if cluster is not None:
        return contextlib.nullcontext([None] * min(jobs, left))
    if jobs == 1:
        return _federations([out / WARM_DIR], None)
    slots = [out / f"{WARM_DIR}-{k}" for k in range(1, min(jobs, left) + 1)]
    return _federations(slots, (os.cpu_count() or 1) // len(slots))


@contextlib.contextmanager
def _federations(directories: Sequence[Path], cpus: int | None) -> Iterator[list[Path]]:
    """A warm federation in each of `directories` (`cpus` each), started one
    after another (each takes the ports free then), all stopped at the end."""
    with contextlib.ExitStack() as stack:
        for directory in directories:
            stack.enter_context(warm_simulation(directory, cpus))
        yield list(directories)


def _cell_runners(
    comparison: Comparison,
    run_configs: Mapping[str, Mapping[str, Any]],
    federations: Sequence[Path | None],
    stop: threading.Event,
    cluster: RayCluster | None = None,
) -> list[RunCell]:
    """`run_cells` for `run_grid`: each cell a deployment over the network
    (`run_configs[name]`: its complete run config), or a simulation on one
    of the warm `federations` (`_shared_federation`), one `run_cell` each;
    on a Ray `cluster`, the cells run at once share its actors out."""
    from . import network_cells

    app, out, overrides = comparison.app, comparison.out, comparison.cell_overrides
    if comparison.deployed:
        assert comparison.network is not None
        command = cell_command(app, out, overrides)
        return [network_cells.network_run_cell(
            command, out, comparison.network, run_configs
        )]  # fmt: skip
    nodes = _cohort_nodes(run_configs) if comparison.jobs > 1 else {}
    env = None
    if cluster is not None and len(federations) > 1:
        env = {**os.environ, SHARE_ENV: str(len(federations))}
    return [
        pollen_run_cell(app, out, overrides, federation, stop, nodes, env)
        for federation in federations
    ]


def _cohort_nodes(run_configs: Mapping[str, Mapping[str, Any]]) -> dict[str, int]:
    """The SuperNodes of each cohort cell as one federation with the
    machine's CPUs gives them (a node per actor the cores hold, at most one
    per client): on a federation with fewer CPUs each node would train
    another share of the clients, so another history."""
    return {
        name: simulated_nodes(int(config["num-clients"]), cohorts=True)
        for name, config in run_configs.items()
        if config.get("client-execution") == "cohort"
    }


def print_plan(cells: list[Cell], out: Path) -> None:
    """`compare --dry-run`: each cell's state, and the cell another compare
    is running there now (its run directory looks interrupted)."""
    if out.exists() and not out.is_dir():
        raise CompareError(f"--out {out} is a file; give a folder for the comparison")
    running = running_now(out)
    if running is not None:
        print(f"pollen: another pollen compare (pid {running.pid}) is running in {out}")
    for cell in with_states(cells, out):
        print(f"{cell.name}: {describe(cell, running)}: {cell.config}")


def report_comparison(directory: Path, target: float | None) -> Path:
    """`pollen report`: the report of `directory` at `target`, or at the
    target of the grid it holds; its markdown table's path."""
    if target is None and (directory / "grid.toml").exists():
        target = Grid.load(directory / "grid.toml").target
    if target is not None and not 0 < target <= 1:
        raise CompareError(f"--target must be in (0, 1], got {target}")
    return report(directory, target)
