"""Reports: the tables and plots made from result directories.

`pollen report DIR` (and `compare`, after its last cell) reads every completed
run directory under `DIR/runs/` (or `DIR` itself), groups the runs that differ
only in `seed`, and writes `comparison.json`, `comparison.md` (final and best
accuracy, the round reaching `target`, wall time, bytes up and down; mean
and standard deviation over seeds) and `plots/`: accuracy per round and
against bytes, one figure per setting with a line per strategy, and the
label distribution of each setting's partition.
"""

from __future__ import annotations

import itertools
import json
import shutil
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..files import write_atomic, write_json
from ..runs.results import plot_accuracy_against
from ..settings import PRESETS

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


def cell_name(values: Mapping[str, Any]) -> str:
    """A directory name for a cell: `strategy-fedavg_seed-1` (a named table
    gives its name: `strategy-feddyn-sam`)."""
    parts = [f"{key}-{value_label(value)}" for key, value in values.items()]
    name = "_".join(parts) or "all"
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name)


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
