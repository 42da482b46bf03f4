"""Reports: the tables and plots made from result directories.

`pollen report DIR` (and `compare`, after its last cell) reads every completed
run directory under `DIR/runs/` (or `DIR` itself), groups the runs that differ
only in `seed`, and writes `comparison.json`, `comparison.md` (final and best
accuracy; with a `target`, the round, wall-clock seconds, simulated seconds
and MB to reach it; wall time, MB up, down and in all, simulated time, MB
measured on shaped links; where clients evaluated their own models, their
mean accuracy on their own test shards and its spread over clients; mean and
standard deviation over seeds) and
`plots/`: accuracy per round, against wall-clock seconds, simulated seconds
and MB, one figure per setting with a line per strategy, and the label
distribution of each setting's partition.

Seconds, simulated seconds and bytes are `Measure`s: quantities a history
row adds to. A group whose runs do not all record one (`sim-seconds` without
a network profile, `seconds` in a hand-made history) has none; a measure no
group has makes no column and no figure, so a report of runs that never had
it looks as it did before.
"""

from __future__ import annotations

import itertools
import json
import shutil
import statistics
import tomllib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from ..catalog import DATA_SETS, TRAINING_KEYS, Scalar
from ..files import write_atomic, write_json
from ..runs.claim import is_held
from ..runs.results import RUN_MARKER, accuracy_figure, plot_accuracy_against
from ..settings import AUTO, INVOCATION_KEYS, PRESETS, Settings

# Keys that name where or how a run ran, not what it computed.
NOT_COMPARED = frozenset(
    {"run-name", "output-dir", "data-root", "device", "resume", "notify-url",
     "notify-every", "checkpoint-every", "checkpoint-keep", "print-labels",
     "state-memory-mib",
     "tracker", "tracking-uri", "tracking-experiment"}
) | INVOCATION_KEYS  # fmt: skip
# Keys drawn as separate lines on one figure; the other varying keys (but the
# seed, averaged over) make separate figures.
SERIES_KEYS = (
    "strategy", "server-update", "aggregator", "local-objective", "bn-policy", "sharing",
)  # fmt: skip
MB = 1e6
T = TypeVar("T")
DEFAULTS = {key: default for key, default, _, _ in Settings.describe()}


@dataclass(frozen=True)
class Measure:
    """A quantity each history row adds to (seconds, bytes): the x of a plot,
    a to-target column and, when `total` names one, a per-run total column.
    `value` is a row's share, None where the row does not record it."""

    key: str  # comparison.json: `<key>-to-target`, `<key>-total`
    plot: str  # plots/accuracy-<plot>-<figure>.png
    header: str  # table column, `{target}` the target in %
    total: str | None  # table column of the run's total, None: none
    xlabel: str
    value: Callable[[Mapping[str, Any]], float | None]


def _row_mb(row: Mapping[str, Any]) -> float | None:
    """All a round moved: the model and updates both ways and the federated
    evaluation's messages (older rows have no `eval-bytes`); None for a row
    that does not record its bytes."""
    counts = [row.get("bytes-up"), row.get("bytes-down"), row.get("eval-bytes", 0)]
    if not all(_is_number(c) for c in counts):
        return None
    return sum(counts) / MB


MEASURES = (
    # the wall time column is the summary's total-seconds (start-up included)
    Measure("seconds", "seconds", "time to {target} (s)", None,
            "wall-clock seconds (cumulative)", lambda row: row.get("seconds")),
    Measure("sim-seconds", "sim-seconds", "sim. time to {target} (s)",
            "sim. time (s)", "simulated seconds under the network profile "
            "(cumulative)", lambda row: row.get("sim-seconds")),
    Measure("mb", "bytes", "MB to {target}", "MB total",
            "MB sent and received (cumulative)", _row_mb),
)  # fmt: skip


class CompareError(ValueError):
    """A grid or a results directory that cannot be used, and why."""


def cell_name(values: Mapping[str, Any]) -> str:
    """A directory name for a cell: `strategy-fedavg_seed-1` (a named table
    gives its name: `strategy-feddyn-sam`)."""
    parts = [f"{key}-{value_label(value)}" for key, value in values.items()]
    return directory_label("_".join(parts) or "all")


def directory_label(text: str) -> str:
    """`text` as a directory name spells it: a character other than a letter,
    a digit, "-", "_" or "." becomes "-"."""
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in text)


def value_label(value: Any) -> str:
    """A grid value as cell names spell it: a named table by its name."""
    return value["name"] if isinstance(value, dict) else str(value)


@dataclass(frozen=True)
class Run:
    name: str
    path: Path
    settings: dict[str, Any]
    summary: dict[str, Any]
    history: list[dict[str, Any]]
    # a deployment over shaped links: the bytes each node's link carried
    network: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        """A setting the run's settings lack (written by an older pollen or
        by hand, or a script's own `Run`) counts as that setting's default."""
        missing = {k: v for k, v in DEFAULTS.items() if k not in self.settings}
        object.__setattr__(self, "settings", {**self.settings, **missing})

    @classmethod
    def read(cls, path: Path, summary: dict[str, Any] | None = None) -> Run:
        """The run in `path`, its files checked for what the report reads:
        `CompareError` names a file that is unreadable or holds something
        else. `summary`: its summary.json, where the caller read it already."""
        if summary is None:
            summary = read_json(path / "summary.json", dict)
        _check_numbers(path / "summary.json", summary, SUMMARY_NUMBERS)
        history = read_json(path / "history.json", list)
        for row in history:
            if not isinstance(row, dict):
                raise CompareError(f"{path / 'history.json'}: a row is not an object")
            _check_numbers(path / "history.json", row, ("round", "accuracy"))
        network = None
        if (path / "network.json").exists():
            network = read_json(path / "network.json", dict)
            nodes = network.get("nodes")
            if not isinstance(nodes, list) or not all(
                isinstance(n, dict) for n in nodes
            ):
                raise CompareError(f"{path / 'network.json'}: no list of nodes")
            for node in nodes:
                _check_numbers(path / "network.json", node, ("bytes-up", "bytes-down"))
        settings = read_json(path / "settings.json", dict)
        return cls(path.name, path, settings, summary, history, network)

    def reaching(self, target: float) -> int | None:
        """The index of the first history row at `target` accuracy or above."""
        return next(
            (i for i, r in enumerate(self.history) if r["accuracy"] >= target), None
        )

    def round_reaching(self, target: float) -> int | None:
        index = self.reaching(target)
        return None if index is None else self.history[index]["round"]

    def cumulative(self, measure: Measure) -> list[float] | None:
        """`measure` summed over the rounds so far, after each round; None if
        a row does not record it (then no partial sum pretends it does)."""
        values = [measure.value(row) for row in self.history]
        if not values or any(v is None for v in values):
            return None
        return list(itertools.accumulate(v for v in values if v is not None))

    def own_accuracy_curve(self) -> list[float | None] | None:
        """Per history row, the clients' mean accuracy with their own models
        on their own test shards (None in a round without personal
        evaluation); None if clients never evaluated their own models."""
        curve = [_mean_own(row.get("personal")) for row in self.history]
        return curve if any(v is not None for v in curve) else None

    def own_accuracies(self) -> list[float] | None:
        """Each client's accuracy on its own test shard at the last personal
        evaluation (history's `personal` rows), None if clients never
        evaluated; a client without a test shard (null) is left out."""
        last = next((r["personal"] for r in reversed(self.history)
                     if r.get("personal")), None)  # fmt: skip
        if last is None:
            return None
        values = [v["local-accuracy"] for v in last.values()]
        return [v for v in values if v is not None] or None

    def protocol_seconds(self) -> float | None:
        """Under SecAgg+: the protocol's mean seconds a round beyond the
        training exchange (keys and shares, where the round ran them rather
        than the round before, unmask and its compute); None for a run that
        did not aggregate securely."""
        rounds = [r["aggregation"] for r in self.history
                  if "secagg-train-seconds" in r.get("aggregation", {})]  # fmt: skip
        if not rounds:
            return None
        stages = ("keys", "shares", "unmask", "unmask-compute")
        return statistics.fmean(
            sum(a.get(f"secagg-{stage}-seconds", 0.0) for stage in stages)
            for a in rounds
        )

    def error_bound(self) -> float | None:
        """Under SecAgg+: the largest bound on an entry's quantisation error
        in a round's mean; None for a run that did not aggregate securely."""
        bounds = [r["aggregation"]["secagg-error-bound"] for r in self.history
                  if "secagg-error-bound" in r.get("aggregation", {})]  # fmt: skip
        return max(bounds) if bounds else None

    def link_mb(self) -> float | None:
        """MB the shaped links carried both ways (network.json), if measured."""
        if self.network is None:
            return None
        nodes = self.network["nodes"]  # checked by `read`
        return sum(n["bytes-up"] + n["bytes-down"] for n in nodes) / MB


# what the report reads of a run's summary.json
SUMMARY_NUMBERS = ("final-accuracy", "best-accuracy", "total-seconds",
                   "total-bytes-up", "total-bytes-down")  # fmt: skip


def read_json(path: Path, kind: type) -> Any:
    """`path`'s JSON value, which must be a `kind` (dict: an object; list);
    `CompareError` says what is wrong with a file a finished run wrote."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CompareError(f"{path} is not a finished run's file: {err}") from err
    if not isinstance(value, kind):
        shape = "an object" if kind is dict else "a list"
        raise CompareError(f"{path} does not hold {shape}, as a finished run's does")
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_numbers(path: Path, record: Mapping[str, Any], keys: Sequence[str]) -> None:
    """`record` (an object in `path`) has a number at each of `keys`."""
    for key in keys:
        if not _is_number(record.get(key)):
            raise CompareError(
                f"{path}: {key!r} is {json.dumps(record.get(key))}, not a number "
                "(a finished run writes one)"
            )


def _mean_own(personal: Mapping[str, Any] | None) -> float | None:
    values = [v["local-accuracy"] for v in (personal or {}).values()
              if v.get("local-accuracy") is not None]  # fmt: skip
    return statistics.fmean(values) if values else None


def _statuses(directory: Path) -> list[tuple[Path, str, dict[str, Any]]]:
    """Every run directory under `directory/runs/` (or `directory`), with how
    it stands ("running": a command holds it, a resume of a completed run
    too; else its summary's "completed", "failed" or "interrupted";
    "damaged": its summary.json is unreadable) and its summary (empty if it
    wrote none; for a damaged one, `error` says what is wrong)."""
    root = directory / "runs" if (directory / "runs").is_dir() else directory
    found = []
    for marker in sorted(root.glob(f"*/{RUN_MARKER}")):
        run = marker.parent
        summary: dict[str, Any] = {}
        if (run / "summary.json").exists():
            try:
                summary = read_json(run / "summary.json", dict)
            except CompareError as err:
                summary = {"status": "damaged", "error": str(err)}
        status = "running" if is_held(run) else str(summary.get("status", "failed"))
        found.append((run, status, summary))
    return found


def read_runs(directory: Path) -> list[Run]:
    """Every completed run under `directory/runs/` (or `directory`); the
    others (failed, interrupted, running: `unfinished_runs`) have no final
    numbers to compare."""
    statuses = _statuses(directory)
    completed = [
        Run.read(path, summary)
        for path, status, summary in statuses
        if status == "completed"
    ]
    if not completed:
        unfinished = len(statuses)
        raise CompareError(
            f"no completed run directories (with summary.json) under {directory}"
            + (f"; {unfinished} run(s) did not complete" if unfinished else "")
        )
    return completed


def unfinished_runs(directory: Path) -> list[dict[str, Any]]:
    """The runs under `directory` that did not complete: name, status,
    rounds recorded and the reason their summary gives (a run that failed
    before writing one has none)."""
    return [
        {
            "run": path.name, "status": status, "rounds": summary.get("rounds", 0),
            "reason": summary.get("error") or (
                "" if status == "running"
                else "no summary.json: it failed before its first round"
            ),
        }
        for path, status, summary in _statuses(directory)
        if status != "completed"
    ]  # fmt: skip


def unfinished_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The runs that did not complete, as a markdown table with a status."""
    lines = ["| run | status | rounds | reason |", "|---|---|---|---|"]
    lines += [
        f"| {r['run']} | {r['status']} | {r['rounds']} | "
        f"{str(r['reason']).replace('|', '/')} |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"


def global_training_default(run: Run, key: str) -> Scalar | None:
    """What "auto" gives a client hyper-parameter `key` (TRAINING_KEYS) for
    the run's data set and client optimiser, before any part's own default."""
    data_set = DATA_SETS.get(run.settings.get("data-set"))
    if data_set is None:
        return None
    return data_set.training.values(run.settings.get("client-optimizer", "sgd"))[key]


def varying_keys(runs: Sequence[Run]) -> list[str]:
    """Settings that differ between runs, in settings order. Beside the
    strategy, only keys that vary within one strategy or depart from its
    preset or from its default: what a strategy decides (its preset's
    `local-objective`, the `server-lr` that "auto" resolves to, ...) follows
    the strategy and is not a setting of its own, but `strategy=feddyn` with
    `local-objective=feddyn-sam`, or `strategy=fedavg` with
    `aggregator=fednova`, is a variant the report must name, and so is a
    client hyper-parameter that departs from the data set's default
    (SCAFFOLD's own momentum 0 beside everyone else's 0.9)."""

    def differs(key: str, among: Sequence[Run]) -> bool:
        return len({json.dumps(r.settings.get(key)) for r in among}) > 1

    def departs(key: str, run: Run) -> bool:
        preset = PRESETS.get(run.settings.get("strategy"), {})
        if key in preset:
            return run.settings.get(key) != preset[key]
        if key in TRAINING_KEYS:  # a part's own default (SCAFFOLD's momentum 0)
            return run.settings.get(key) != global_training_default(run, key)
        default = DEFAULTS.get(key, AUTO)  # "auto": resolved per run, no default
        return default != AUTO and run.settings.get(key) != default

    by_strategy: dict[Any, list[Run]] = {}
    for run in runs:
        by_strategy.setdefault(run.settings.get("strategy"), []).append(run)
    return [
        k for k in runs[0].settings
        if k not in NOT_COMPARED and differs(k, runs)
        and (k == "strategy" or any(differs(k, g) for g in by_strategy.values())
             or any(departs(k, r) for r in runs))
    ]  # fmt: skip


def _stats(values: Sequence[float]) -> dict[str, float]:
    """Mean and (sample) standard deviation; 0 for a single value."""
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": statistics.fmean(values), "std": std}


def summarize_groups(runs: Sequence[Run], target: float | None) -> list[dict[str, Any]]:
    """One row per setting (runs equal but for the seed): means and standard
    deviations over its seeds. To-target values are per seed, None for a seed
    that never reached it. A measure (or the links' MB) that not every seed
    recorded is left out of the row: a mean over some seeds would pass for
    one over all."""
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
            row[field] = _stats(values)
        if target is not None:
            row["round-to-target"] = [m.round_reaching(target) for m in members]
        for measure in MEASURES:
            sums = _of_every_seed([m.cumulative(measure) for m in members])
            if sums is None:
                continue
            if measure.total:
                row[f"{measure.key}-total"] = _stats([c[-1] for c in sums])
            if target is not None:
                row[f"{measure.key}-to-target"] = [
                    None if (i := m.reaching(target)) is None else c[i]
                    for m, c in zip(members, sums, strict=True)
                ]
        owns = _of_every_seed([m.own_accuracies() for m in members])
        if owns is not None:  # clients' own shards: their mean, and their spread
            row["own-accuracy"] = _stats([statistics.fmean(o) for o in owns])
            row["own-spread"] = _stats([statistics.pstdev(o) for o in owns])
        protocol = _of_every_seed([m.protocol_seconds() for m in members])
        if protocol is not None:
            row["secagg-seconds"] = _stats(protocol)
            bounds = [m.error_bound() for m in members]
            row["secagg-error"] = max(b for b in bounds if b is not None)
        links = _of_every_seed([m.link_mb() for m in members])
        if links is not None:
            row["link-mb"] = _stats(links)
        rows.append(row)
    return sorted(rows, key=lambda row: [_order(v) for v in row["setting"].values()])


def _of_every_seed(values: Sequence[T | None]) -> list[T] | None:
    """`values` if every seed has one, else None: a mean over the seeds that
    happen to record a quantity would pass for one over all of them."""
    if any(v is None for v in values):
        return None
    return [v for v in values if v is not None]


def _order(value: Any) -> tuple[int, Any]:
    """Numbers before text, numbers by value (5 before 10)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return 0, value
    return 1, str(value)


Cell = Callable[[Mapping[str, Any]], str]


def markdown_table(rows: Sequence[Mapping[str, Any]], target: float | None) -> str:
    """The groups as a markdown table. A to-target or total column that no
    group has (no target, no network profile) is left out; a group without
    it where others have it shows "n/a"."""

    def present(optional: list[tuple[str, str, Cell]]) -> list[tuple[str, Cell]]:
        return [
            (head, cell) for key, head, cell in optional if any(key in r for r in rows)
        ]

    keys = list(rows[0]["setting"]) if rows else []
    columns: list[tuple[str, Cell]] = [
        *((k, _setting_cell(k)) for k in keys),
        ("seeds", lambda row: str(len(row["seeds"]))),
        ("final acc. (%)", lambda row: _pm(row["final-accuracy"], 100, 2)),
        ("best acc. (%)", lambda row: _pm(row["best-accuracy"], 100, 2)),
    ]
    columns += present([
        ("own-accuracy", "own-shard acc. (%)", _percent_cell("own-accuracy")),
        ("own-spread", "std over clients (pts)", _percent_cell("own-spread")),
    ])  # fmt: skip
    if target is not None:
        percent = f"{100 * target:g}%"
        columns.append((f"round to {percent}",
                        lambda row: _reached(row["round-to-target"], _mean_only)))  # fmt: skip
        columns += present([
            (f"{m.key}-to-target", m.header.format(target=percent),
             _to_target_cell(f"{m.key}-to-target"))
            for m in MEASURES
        ])  # fmt: skip
    columns += [
        ("time (s)", lambda row: _pm(row["seconds"], 1, 0)),
        ("MB up", lambda row: _pm(row["mb-up"], 1, 1)),
        ("MB down", lambda row: _pm(row["mb-down"], 1, 1)),
    ]
    totals = [(f"{m.key}-total", m.total) for m in MEASURES if m.total]
    columns += present([
        (key, head, _stat_cell(key)) for key, head in [*totals, ("link-mb", "link MB")]
    ])  # fmt: skip
    columns += present([
        ("secagg-seconds", "secagg s/round",
         lambda row: _pm(row["secagg-seconds"], 1, 2) if "secagg-seconds" in row
         else "n/a"),
        ("secagg-error", "secagg error bound",
         lambda row: f"{row['secagg-error']:.1e}" if "secagg-error" in row else "n/a"),
    ])  # fmt: skip
    lines = [
        "| " + " | ".join(head for head, _ in columns) + " |",
        "|" + "---|" * len(columns),
    ]
    for row in rows:
        lines.append("| " + " | ".join(cell(row) for _, cell in columns) + " |")
    return "\n".join(lines) + "\n"


def _setting_cell(key: str) -> Cell:
    return lambda row: str(row["setting"][key])


def _to_target_cell(key: str) -> Cell:
    def cell(row: Mapping[str, Any]) -> str:
        if key not in row:
            return "n/a"
        return _reached(row[key], lambda hit: _pm(_stats(hit), 1, 1))

    return cell


def _stat_cell(key: str) -> Cell:
    return lambda row: _pm(row[key], 1, 1) if key in row else "n/a"


def _percent_cell(key: str) -> Cell:
    return lambda row: _pm(row[key], 100, 2) if key in row else "n/a"


def _pm(stat: Mapping[str, float], scale: float, digits: int) -> str:
    mean, std = scale * stat["mean"], scale * stat["std"]
    return f"{mean:.{digits}f} ± {std:.{digits}f}" if std else f"{mean:.{digits}f}"


def _mean_only(hit: Sequence[float]) -> str:
    return f"{statistics.fmean(hit):.1f}"


def _reached(values: Sequence[float | None], show: Callable[[list[float]], str]) -> str:
    """Per-seed values to a target (None: never reached), shown by `show`
    over the seeds that reached it, saying how many did when not all."""
    hit = [v for v in values if v is not None]
    if not hit:
        return "never"
    text = show(hit)
    return (
        text if len(hit) == len(values) else f"{text} ({len(hit)}/{len(values)} seeds)"
    )


def plot_groups(
    runs: Sequence[Run], plots: Path, grid: GridShape | None = None
) -> list[Path]:
    """Accuracy per round and against each measure (cumulative seconds,
    simulated seconds, MB; means over seeds), one figure per setting with a
    line per strategy (and per named cell of the comparison's `grid`),
    titled by what differs between its lines; a
    personalised strategy's clients' own models beside its global model
    (dashed); each setting's label distribution. A line whose seeds do not
    all record a measure is left off that figure, and a figure no line has
    is not drawn."""
    plots.mkdir(parents=True, exist_ok=True)
    written = []
    keys, line_keys, figure_keys = _plot_keys(runs, grid)
    for name, figure in _figure_data(runs, line_keys, figure_keys).items():
        written.append(plots / f"{name}.png")
        plot_accuracy_against(
            figure.series, written[-1], figure.title, figure.xlabel,
            integer_x=figure.integer_x, own_models=figure.own_models,
        )  # fmt: skip
    partition_keys = [  # not the strategy, nor what only a named cell or preset sets
        k for k in keys if k not in SERIES_KEYS and (grid is None or k in figure_keys)
    ]
    return written + _copy_label_plots(runs, plots, partition_keys)


@dataclass(frozen=True)
class FigureData:
    """What one of the report's figures draws: a line per setting (`series`:
    label -> (x, mean accuracy over seeds)), its clients' own models dashed
    beside a personalised line (`own_models`), its `title` and `xlabel`."""

    title: str
    xlabel: str
    series: dict[str, tuple[list[float], list[float]]]
    own_models: dict[str, tuple[list[float], list[float]]]

    @property
    def integer_x(self) -> bool:
        """Whether x counts rounds (no tick at round 2.5)."""
        return self.xlabel == "round"

    def figure(self) -> Any:
        """The figure, as a matplotlib `Figure` (`results.accuracy_figure`)."""
        return accuracy_figure(self.series, self.title, self.xlabel,
                               integer_x=self.integer_x,
                               own_models=self.own_models)  # fmt: skip


def figure_data(
    runs: Sequence[Run], grid: GridShape | None = None
) -> dict[str, FigureData]:
    """`plot_groups`' figures by name (their files' names without `.png`):
    `accuracy-<x>-<setting>`, x being `rounds`, `seconds`, `sim-seconds` or
    `bytes`."""
    _, line_keys, figure_keys = _plot_keys(runs, grid)
    return _figure_data(runs, line_keys, figure_keys)


def _plot_keys(
    runs: Sequence[Run], grid: GridShape | None
) -> tuple[list[str], list[str], list[str]]:
    """The keys that vary between the runs (but the seed, averaged over),
    and of them those drawn as lines of one figure and those that make
    figures of their own (`split_line_and_figure_keys`)."""
    keys = [k for k in varying_keys(runs) if k != "seed"]
    line_keys, figure_keys = split_line_and_figure_keys(keys, grid, runs)
    return keys, list(line_keys), list(figure_keys)


def _figure_data(
    runs: Sequence[Run], line_keys: Sequence[str], figure_keys: Sequence[str]
) -> dict[str, FigureData]:
    figures = {}
    for slug, lines in _figures(runs, line_keys, figure_keys).items():
        title, labels = _figure_title(lines, line_keys, figure_keys)
        for x, data in _setting_figures(lines, title, labels):
            figures[f"accuracy-{x}-{slug}"] = data
    return figures


def _figures(
    runs: Sequence[Run], line_keys: Sequence[str], figure_keys: Sequence[str]
) -> dict[str, dict[str, list[Run]]]:
    """The runs by figure (named after its `figure_keys` values) and, in a
    figure, by line (labelled by its `line_keys` values); a line's runs are
    its seeds."""
    figures: dict[str, dict[str, list[Run]]] = {}
    for run in runs:
        figure = cell_name({k: run.settings[k] for k in figure_keys})
        line = line_label(run, line_keys, runs)
        figures.setdefault(figure, {}).setdefault(line, []).append(run)
    return figures


def _figure_title(
    lines: Mapping[str, Sequence[Run]],
    line_keys: Sequence[str],
    figure_keys: Sequence[str],
) -> tuple[str, dict[str, str]]:
    """A figure's title (its data set and setting, what its lines differ by
    and, when the same for every line, over how many seeds) and each line's
    label."""
    some = next(iter(lines.values()))[0].settings
    figure = ", ".join(f"{k}={some[k]}" for k in figure_keys)
    seeds_in_title, labels = _seed_counts(lines)
    title = ", ".join(t for t in (str(some.get("data-set", "")), figure) if t)
    title += f": by {', '.join(line_keys)}" if line_keys else ""
    return title + seeds_in_title, labels


def _setting_figures(
    lines: Mapping[str, Sequence[Run]], title: str, labels: Mapping[str, str]
) -> Iterator[tuple[str, FigureData]]:
    """One setting's figures, each with the name of its x: accuracy per
    round, and against each measure every line records (a measure no line
    records has no figure)."""
    accuracy = {
        line: [[r["accuracy"] for r in m.history] for m in members]
        for line, members in lines.items()
    }
    own = {line: _mean_own_curve(members) for line, members in lines.items()}
    x_rounds = {
        line: [float(r["round"]) for r in members[0].history]
        for line, members in lines.items()
    }
    yield "rounds", _lines(title, "round", x_rounds, accuracy, own, labels)
    for measure in MEASURES:
        sums = {line: _of_every_seed([m.cumulative(measure) for m in members])
                for line, members in lines.items()}  # fmt: skip
        xs = {line: _mean_curve(s) for line, s in sums.items() if s is not None}
        if xs:  # else no line records this measure: no figure
            yield measure.plot, _lines(title, measure.xlabel, xs, accuracy, own, labels)


def _copy_label_plots(
    runs: Sequence[Run], plots: Path, partition_keys: Sequence[str]
) -> list[Path]:
    """Each setting's label distribution (the first seed's `labels.png`),
    copied into `plots` once per setting of the `partition_keys`; the copies."""
    written = []
    for run in runs:
        heatmap = run.path / "labels.png"
        setting = {k: run.settings[k] for k in partition_keys}
        target = plots / f"labels-{cell_name(setting)}.png"
        if heatmap.exists() and not target.exists():
            shutil.copyfile(heatmap, target)
            written.append(target)
    return written


@dataclass(frozen=True)
class GridShape:
    """What a comparison's grid varies (`axes`: its `[grid]` keys) and what its
    named cells set besides (`named`: the keys inside `{ name = ..., ... }`)."""

    axes: frozenset[str]
    named: frozenset[str]

    @classmethod
    def read(cls, grid: Path) -> GridShape | None:
        """The shape of the grid in `grid`; None without one."""
        if not grid.exists():
            return None
        try:
            axes = tomllib.loads(grid.read_text(encoding="utf-8")).get("grid", {})
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
            raise CompareError(f"cannot read the comparison's {grid}: {err}") from None
        if not isinstance(axes, dict):
            raise CompareError(f"{grid}: grid must be a table, got {axes!r}")
        named = {k for values in axes.values() for v in values
                 if isinstance(v, dict) for k in v}  # fmt: skip
        return cls(frozenset(axes), frozenset(named - set(axes) - {"name"}))


def split_line_and_figure_keys(
    keys: Sequence[str], grid: GridShape | None = None, runs: Sequence[Run] = ()
) -> tuple[list[str], list[str]]:
    """The varying settings that tell one figure's lines apart, and those
    that make separate figures. Strategies and their parts are lines. With
    the comparison's grid known, a setting its named cells set (one cell's
    round deadline, FedSA's own model) names those cells' lines, only the
    grid's other axes make figures, and a setting that varies only because a
    preset resolves it (`personal-eval-every` under FedBN: one value per
    line of `runs`) is neither; one that varies within a line (runs of
    another base config in the same folder) still makes figures. Without a
    grid every other setting makes figures. With a single
    strategy, the last figure setting draws the lines instead."""
    line_keys = [k for k in SERIES_KEYS if k in keys]  # the strategy first
    if grid is None:
        figure_keys = [k for k in keys if k not in SERIES_KEYS]
    else:
        line_keys += [k for k in keys if k in grid.named and k not in SERIES_KEYS]

        def follows_the_line(key: str) -> bool:
            values: dict[str, set[str]] = {}
            for run in runs:
                line = json.dumps([run.settings.get(k) for k in line_keys])
                values.setdefault(line, set()).add(json.dumps(run.settings.get(key)))
            return all(len(v) == 1 for v in values.values())

        figure_keys = [
            k for k in keys
            if k not in line_keys and (k in grid.axes or not follows_the_line(k))
        ]  # fmt: skip
    if not line_keys and figure_keys:
        line_keys = [figure_keys.pop()]
    return line_keys, figure_keys


def line_label(run: Run, line_keys: Sequence[str], runs: Sequence[Run]) -> str:
    """`run`'s line: its strategy (or first line setting), then each other
    line setting where it departs from what most runs have
    (`fedavg, round-deadline=50.0`)."""
    if not line_keys:
        return run.name
    parts = [str(run.settings.get(line_keys[0]))]
    for key in line_keys[1:]:
        values = [json.dumps(r.settings.get(key)) for r in runs]
        default = json.dumps(DEFAULTS.get(key))
        # the most common value; on a tie the default, then the first in order
        usual = max(sorted(set(values)), key=lambda v: (values.count(v), v == default))
        if json.dumps(run.settings.get(key)) != usual:
            value = run.settings.get(key)
            parts.append(str(value) if key in SERIES_KEYS else f"{key}={value}")
    return ", ".join(parts)


def _mean_own_curve(members: Sequence[Run]) -> list[float | None] | None:
    """Per round, the seeds' mean of the clients' own-model accuracy (None
    where a seed did not evaluate them); None unless every seed has some."""
    curves = [c for m in members if (c := m.own_accuracy_curve()) is not None]
    if len(curves) < len(members):
        return None
    length = min(len(c) for c in curves)
    return [
        None if any(c[i] is None for c in curves)
        else statistics.fmean(c[i] or 0.0 for c in curves)
        for i in range(length)
    ]  # fmt: skip


def _lines(
    title: str, xlabel: str,
    xs: Mapping[str, Sequence[float]], accuracy: Mapping[str, Sequence[Sequence[float]]],
    own: Mapping[str, list[float | None] | None], labels: Mapping[str, str],
) -> FigureData:  # fmt: skip
    """One figure: each line in `xs` (its mean accuracy over seeds against
    x), and beside a personalised line its clients' own models at the rounds
    they were evaluated."""
    series, own_models = {}, {}
    for line, x_all in xs.items():
        mean = _mean_curve(accuracy[line])
        x = list(x_all)[: len(mean)]
        series[labels[line]] = (x, mean[: len(x)])
        if (curve := own.get(line)) is not None:
            points = [(x[i], v) for i, v in enumerate(curve[: len(x)]) if v is not None]
            own_models[labels[line]] = ([p[0] for p in points], [p[1] for p in points])
    return FigureData(title, xlabel, series, own_models)


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


def report(directory: Path, target: float | None = None) -> Path:
    """Write comparison.json, comparison.md and plots/ for the runs under
    `directory`; the markdown table's path."""
    runs = read_runs(directory)
    rows = summarize_groups(runs, target)
    table = markdown_table(rows, target)
    unfinished = unfinished_runs(directory)
    if unfinished:
        table += "\nRuns that did not complete:\n\n" + unfinished_table(unfinished)
    grid = GridShape.read(directory / "grid.toml")
    try:
        write_json(
            directory / "comparison.json",
            {"target": target, "groups": rows, "unfinished": unfinished},
        )
        write_atomic(directory / "comparison.md", table)
        fresh, plots = directory / ".plots-new", directory / "plots"
        shutil.rmtree(fresh, ignore_errors=True)
        plot_groups(runs, fresh, grid)
        shutil.rmtree(plots, ignore_errors=True)  # made by an earlier report
        fresh.rename(plots)
    except OSError as err:
        raise CompareError(f"cannot write the report in {directory}: {err}") from err
    return directory / "comparison.md"
