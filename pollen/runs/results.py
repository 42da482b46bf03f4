"""A run's results on disk, and its per-round console lines.

`<output-dir>/<run-name>/` holds `settings.json`, `history.json`,
`history.csv`, `summary.json`, `curves.png`, `labels.png` and `model.pt`.
Files are written atomically (temporary file, then rename), so a crash never
leaves half a file, and an existing run directory is never reused.
"""

from __future__ import annotations

import csv
import functools
import io
import json
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from ..files import write_atomic, write_json

RUN_MARKER = "settings.json"  # the file that makes a directory a run's
HISTORY_FIELDS = (
    "round", "accuracy", "loss", "lr", "seconds", "bytes-up", "bytes-down", "clients",
    "rejected", "clipped", "skipped",
)  # fmt: skip
# Per-client (personalised) accuracies: mean/min/max columns in history.csv
PERSONAL_COLUMNS = tuple(
    f"personal-{where}-accuracy-{stat}"
    for where in ("global", "local")
    for stat in ("mean", "min", "max")
)
# The ServerApp's last line, printed once summary.json is written: `pollen run`
# stops waiting for Flower's shutdown when it sees it.
RUN_COMPLETED = "pollen: run completed; results in"


class ResultsError(RuntimeError):
    """The run directory cannot be created or written."""


FLOAT_COLUMNS = ("accuracy", "loss")  # NaN where a run diverged: null in JSON


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class RoundRecord:
    """One row of the history."""

    round: int
    accuracy: float
    loss: float
    lr: float
    seconds: float
    bytes_up: int
    bytes_down: int
    clients: list[int] = field(default_factory=list)
    # replies dropped (node, reason), updates scaled back by update-norm-bound,
    # and whether too few valid replies left the model unchanged this round
    failures: list[str] = field(default_factory=list)
    clipped: list[str] = field(default_factory=list)
    skipped: bool = False
    eval_bytes: int = 0
    # client -> {global-accuracy, global-loss, local-accuracy, local-loss}: each
    # client's own model on the global test set and on its own test shard
    personal: dict[int, dict[str, float]] = field(default_factory=dict)
    # under DP-SGD: the largest epsilon any client has spent so far
    dp_epsilon: float | None = None
    # under a network profile: the round's seconds on the simulated clock
    # (pollen.strategies.clock), beside the real `seconds`
    sim_seconds: float | None = None
    # clients whose reply came after the round's deadline (discarded)
    late: list[int] = field(default_factory=list)
    # asynchronous mode: each applied update's staleness (model versions since
    # its client's copy), in the order of `clients`; a row is a model version
    staleness: list[int] = field(default_factory=list)
    # with an attack: the asked clients that attack (settings' attacking
    # clients); with Krum or Bulyan: the accepted updates the aggregator left out
    attackers: list[int] = field(default_factory=list)
    unselected: list[int] = field(default_factory=list)
    # what the aggregation step reported (central DP: clip-norm, unclipped
    # share, epsilon: the user-level privacy spent so far)
    aggregation: dict[str, float] = field(default_factory=dict)

    def as_row(self) -> dict[str, Any]:
        """The row history.json holds: JSON, so a NaN (a diverged loss) is null."""
        row = {k.replace("_", "-"): v for k, v in asdict(self).items()}
        for key in FLOAT_COLUMNS:
            row[key] = _finite_or_none(row[key])
        row["personal"] = {
            str(c): {k: v if math.isfinite(v) else None for k, v in values.items()}
            for c, values in self.personal.items()
        }
        return row

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> RoundRecord:
        """The record `as_row` wrote (a resumed run reads its history back)."""
        values = {k.replace("-", "_"): v for k, v in row.items()}
        for key in FLOAT_COLUMNS:
            if values.get(key) is None:
                values[key] = math.nan
        values["personal"] = {
            int(c): {k: math.nan if v is None else v for k, v in stats.items()}
            for c, stats in row.get("personal", {}).items()
        }
        return cls(**values)

    def personal_stats(self, where: str) -> tuple[float, float, float] | None:
        """(mean, min, max) of the clients' accuracies on `global` or `local` tests."""
        values = np.array([v[f"{where}-accuracy"] for v in self.personal.values()])
        values = values[np.isfinite(values)]
        if not len(values):
            return None
        return float(values.mean()), float(values.min()), float(values.max())


def default_run_name(strategy: str, data_set: str) -> str:
    return f"{strategy}-{data_set}-{datetime.now():%Y%m%d-%H%M%S}"


def check_run_dir_is_new(output_dir: str, run_name: str) -> Path:
    """`<output-dir>/<run-name>`, refused if it exists (results are never
    overwritten) or if `output-dir` lies inside a run directory (a run nested
    in another's results would be taken for part of them)."""
    parent = Path(output_dir).expanduser().resolve()
    if run := next((d for d in (parent, *parent.parents) if is_run_dir(d)), None):
        raise ResultsError(
            f"invalid value for 'output-dir': {output_dir!r} is inside the run "
            f"directory {run}; choose a directory outside every run's results "
            f"(e.g. {run.parent})"
        )
    path = parent / run_name
    if path.exists():
        raise already_exists(path)
    return path


def already_exists(path: Path) -> ResultsError:
    """The error for a run directory that exists: results are never reused."""
    return ResultsError(
        f"invalid value for 'run-name': {path.name!r}; {path} already exists "
        "(results are never overwritten: choose another run-name)"
    )


def is_run_dir(path: Path) -> bool:
    """Whether `path` holds a pollen run: a `settings.json` that names it."""
    try:
        return "run-name" in json.loads((path / RUN_MARKER).read_text())
    except (OSError, ValueError, TypeError):
        return False


def create_run_dir(output_dir: str, run_name: str) -> Path:
    """Make `<output-dir>/<run-name>`; refuse one that already exists."""
    path = check_run_dir_is_new(output_dir, run_name)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir()  # raises if another process took the name in between
    except OSError as err:
        raise ResultsError(f"cannot create run directory {path}: {err}") from err
    return path


def write_history(run_dir: Path, history: list[RoundRecord]) -> None:
    rows = [r.as_row() for r in history]
    write_json(run_dir / "history.json", rows)
    buffer = io.StringIO()
    personal = any(r.personal for r in history)
    private = any(r.dp_epsilon is not None for r in history)
    fields = (
        HISTORY_FIELDS
        + (("dp-epsilon",) if private else ())
        + (PERSONAL_COLUMNS if personal else ())
    )
    writer = csv.DictWriter(buffer, fieldnames=fields, extrasaction="ignore")
    writer.writeheader()
    for record, row in zip(history, rows, strict=True):
        row = {
            **row,
            "clients": " ".join(map(str, row["clients"])),
            "rejected": len(record.failures),
            "clipped": len(record.clipped),
        }
        for where in ("global", "local"):
            stats = record.personal_stats(where) or ("", "", "")
            for stat, value in zip(("mean", "min", "max"), stats, strict=True):
                row[f"personal-{where}-accuracy-{stat}"] = value
        writer.writerow(row)
    write_atomic(run_dir / "history.csv", buffer.getvalue())


def read_history(run_dir: Path) -> list[RoundRecord]:
    """The rounds `write_history` recorded (none if it never ran)."""
    path = run_dir / "history.json"
    if not path.is_file():
        return []
    return [RoundRecord.from_row(row) for row in json.loads(path.read_text())]


def summarize(
    history: list[RoundRecord],
    status: str,
    seconds: float,
    error: str | None = None,
    run_token: str = "",
    privacy: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """What `summary.json` holds: the outcome in a few numbers, the privacy
    spent under every accountant (`RoundRecorder.privacy`, under DP), and
    the token of the command that claimed the run's directory
    (`pollen.runs.claim`)."""
    best = max(history, key=lambda r: r.accuracy, default=None)
    # the last personal evaluation (personal-eval-every need not divide rounds)
    personal = next((r for r in reversed(history) if r.personal), None)
    return {
        "status": status,
        "error": error,
        "run-token": run_token,
        "rounds": len(history),
        "skipped-rounds": sum(record.skipped for record in history),
        "final-accuracy": history[-1].accuracy if history else None,
        "final-loss": _finite_or_none(history[-1].loss) if history else None,
        "best-accuracy": best.accuracy if best else None,
        "best-round": best.round if best else None,
        "total-seconds": round(seconds, 3),
        "total-bytes-up": sum(r.bytes_up for r in history),
        "total-bytes-down": sum(r.bytes_down for r in history),
        "final-dp-epsilon": history[-1].dp_epsilon if history else None,
        "final-personal": {
            where: personal.personal_stats(where) for where in ("global", "local")
        }
        if personal
        else None,
        "final-personal-round": personal.round if personal else None,
        "privacy": privacy,
    }


def privacy_line(privacy: dict[str, Any]) -> str:
    """The privacy spent, under every accountant, for the console:
    "pollen: privacy spent at delta 1e-05 (rdp counts): example-level
    epsilon 2.31 (rdp), 2.10 (prv), 2.09 (pld)"."""
    parts = []
    for level in ("example-level", "user-level"):
        if level in privacy:
            counted = ", ".join(
                f"{'-' if e is None else f'{e:.2f}'} ({name})"
                for name, e in privacy[level]["epsilon"].items()
            )
            parts.append(f"{level} epsilon {counted}")
    return (
        f"pollen: privacy spent at delta {privacy['delta']:g} "
        f"({privacy['accountant']} counts): " + "; ".join(parts)
    )


# Two lines of `round_lines`, as a console reads progress back from them
ACCURACY_LINE = re.compile(
    r"^\[(?P<round>\d{2,})\] acc=(?P<accuracy>[\d.]+|nan)%, loss=(?P<loss>\S+)$"
)
ROUND_LINE = re.compile(
    r"^ {5}round (?P<round>\d+)/(?P<rounds>\d+): .*~(?P<left>\d+) s left"
)


def seconds_left(history: Sequence[RoundRecord], total_rounds: int) -> float:
    """The time the rounds after `history`'s last are expected to take: the
    mean round so far times the rounds to go (what the round block says)."""
    mean_seconds = sum(r.seconds for r in history) / len(history)
    return mean_seconds * (total_rounds - history[-1].round)


def round_lines(record: RoundRecord, total_rounds: int, seconds_left: float) -> str:
    """The console block printed after every round (seed 000's format first)."""
    return (
        f"=== Evaluate global model {record.round} Round ===\n"
        f"[{record.round:02d}] acc={100 * record.accuracy:.2f}%, loss={record.loss:.6f}\n"
        f"     round {record.round}/{total_rounds}: {record.seconds:.2f} s, "
        f"up {_mb(record.bytes_up)}, down {_mb(record.bytes_down)}, "
        f"lr {record.lr:.3g}, clients {len(record.clients)}, "
        f"~{seconds_left:.0f} s left"
        + (f", dp epsilon {record.dp_epsilon:.2f}" if record.dp_epsilon else "")
        + _central_dp_text(record.aggregation)
        + _secagg_text(record.aggregation)
        + (
            f", simulated {record.sim_seconds:.2f} s"
            if record.sim_seconds is not None
            else ""
        )
        + (f", staleness {record.staleness}" if record.staleness else "")
        + (f", late {record.late}" if record.late else "")
        + (f", attackers {record.attackers}" if record.attackers else "")
        + (
            f", left out by the aggregator {record.unselected}"
            if record.unselected
            else ""
        )
        + _fault_line(record)
        + _personal_line(record)
    )


def _secagg_text(report: dict[str, float]) -> str:
    if "secagg-survivors" not in report:
        return ""
    asked = report["secagg-survivors"] + report["secagg-dropped"]
    return (
        f", secagg+ sum of {report['secagg-survivors']:g}/{asked:g} clients "
        f"(error <= {report['secagg-error-bound']:.1e}"
        + (f", {report['secagg-clipped']:g} entries clipped" if report["secagg-clipped"]
           else "")
        + ")"
    )  # fmt: skip


def _central_dp_text(report: dict[str, float]) -> str:
    if "epsilon" not in report:
        return ""
    share = report.get("unclipped")
    return (
        f", user-level epsilon {report['epsilon']:.2f} (clip {report['clip-norm']:.3g}"
        + (f", {100 * share:.0f}% unclipped, noised" if share is not None else "")
        + ")"
    )


def _fault_line(record: RoundRecord) -> str:
    parts = []
    if record.failures:
        parts.append(
            _count(len(record.failures), "reply", "replies") + " failed or rejected"
        )
    if record.clipped:
        parts.append(_count(len(record.clipped), "update", "updates") + " clipped")
    if record.skipped:
        parts.append("round skipped, model unchanged")
    return f"\n     {', '.join(parts)} (history.json says why)" if parts else ""


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _personal_line(record: RoundRecord) -> str:
    parts = []
    for where, label in (("global", "global test"), ("local", "own test")):
        stats = record.personal_stats(where)
        if stats:
            mean, low, high = (100 * v for v in stats)
            parts.append(f"{label} {mean:.2f}% [{low:.2f}, {high:.2f}]")
    if not parts:
        return ""
    return f"\n     personal models ({len(record.personal)}): " + "; ".join(parts)


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


PLOT_STYLE = "seaborn-v0_8-whitegrid"


@contextmanager
def _figure(width: float, height: float) -> Iterator[Any]:
    """A matplotlib `Figure` of `width` x `height` inches in pollen's style,
    to draw on inside the block. It is made without pyplot: neither pyplot's
    global state, its rcParams nor the caller's backend changes (a notebook
    keeps its own, and shows the figure as a cell's value), and the figure
    goes with its last reference."""
    import matplotlib.style
    from matplotlib.figure import Figure

    with matplotlib.style.context(PLOT_STYLE):
        fig = Figure(figsize=(width, height), dpi=110)
        yield fig
        fig.tight_layout()
    # IPython shows an object by its `_repr_png_`; a pyplot figure gets its
    # picture from the notebook's matplotlib backend, which this one skips
    fig._repr_png_ = functools.partial(_png, fig)


def _png(fig: Any) -> bytes:
    """`fig` as PNG bytes."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def plot_curves(
    history: list[RoundRecord], path: Path, title: str, xlabel: str = "round"
) -> None:
    """`curves_figure`, saved as a PNG at `path`."""
    _save(curves_figure(history, title, xlabel), path)


def curves_figure(
    history: Sequence[RoundRecord], title: str, xlabel: str = "round"
) -> Any:
    """Test accuracy and loss per round (or epoch), side by side."""
    rounds = [r.round for r in history]
    with _figure(10, 4) as fig:
        ax_acc, ax_loss = fig.subplots(1, 2)
        ax_acc.plot(rounds, [100 * r.accuracy for r in history], marker="o", ms=3)
        ax_acc.set(xlabel=xlabel, ylabel="test accuracy (%)", title="Accuracy")
        ax_loss.plot(rounds, [r.loss for r in history], marker="o", ms=3, color="C3")
        ax_loss.set(xlabel=xlabel, ylabel="test cross-entropy", title="Loss")
        fig.suptitle(title)
    return fig


Series = Mapping[str, tuple[Sequence[float], Sequence[float]]]


def plot_accuracy_against(
    series: Series,
    path: Path,
    title: str,
    xlabel: str,
    integer_x: bool = False,
    own_models: Series | None = None,
) -> None:
    """`accuracy_figure`, saved as a PNG at `path`."""
    _save(accuracy_figure(series, title, xlabel, integer_x, own_models), path)


def accuracy_figure(
    series: Series,
    title: str,
    xlabel: str,
    integer_x: bool = False,
    own_models: Series | None = None,
) -> Any:
    """Test accuracy (%) of several runs against a common x (round, seconds,
    megabytes), one line per run, for comparing strategies on one figure;
    `integer_x` for rounds (no tick at round 2.5). `own_models[name]`, where
    given, is drawn dashed in `name`'s colour: a personalised run's clients'
    mean accuracy with their own models on their own test shards."""
    with _figure(7, 4.5) as fig:
        ax = fig.subplots()
        for name, (x, accuracy) in series.items():
            (line,) = ax.plot(x, [100 * a for a in accuracy], marker="o", ms=3,
                              label=name)  # fmt: skip
            if own_models and name in own_models:
                own_x, own = own_models[name]
                ax.plot(own_x, [100 * a for a in own], linestyle="--", marker="s",
                        ms=3, color=line.get_color(), label=f"{name}: own models")  # fmt: skip
        ax.set(xlabel=xlabel, ylabel="test accuracy (%)", title=title)
        if integer_x:
            ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend()
    return fig


HEATMAP_MAX_INCHES = 12.0


def plot_label_heatmap(counts: np.ndarray, path: Path, title: str) -> None:
    """Samples per (client, class), annotated when the grid is small. A row
    per client up to 30 clients; beyond, the rows share a figure of at most
    `HEATMAP_MAX_INCHES` (10,000 clients at 0.35 inch a row made a 385,000-
    pixel-tall image and 9 GiB of memory), and the columns one of at most
    twice that (a data set declaring 10,000,000 classes asked matplotlib for
    an image 550,000,220 pixels wide, which it refuses)."""
    clients, classes = counts.shape
    height = min(HEATMAP_MAX_INCHES, max(3, 0.35 * clients + 1.5))
    width = min(2 * HEATMAP_MAX_INCHES, max(5, 0.5 * classes + 2))
    with _figure(width, height) as fig:
        ax = fig.subplots()
        image = ax.imshow(counts, aspect="auto", cmap="viridis")
        ax.grid(False)
        ax.set(xlabel="class", ylabel="client", title=title)
        if clients * classes <= 400:
            peak = counts.max() or 1
            for (i, j), v in np.ndenumerate(counts):
                color = "black" if v > 0.6 * peak else "white"
                ax.text(j, i, str(int(v)), ha="center", va="center", fontsize=7,
                        color=color)  # fmt: skip
        if classes <= 20:
            ax.set_xticks(range(classes))
        if clients <= 30:
            ax.set_yticks(range(clients))
        fig.colorbar(image, ax=ax, label="samples")
    _save(fig, path)


def _save(fig: Any, path: Path) -> None:
    """`fig` as a PNG at `path`, written atomically."""
    write_atomic(path, _png(fig))


def round_scalars(record: RoundRecord) -> dict[str, float]:
    """The numbers a tracker logs for one round, by name: the global model's
    accuracy and loss, the learning rate, the round's seconds (and simulated
    seconds under a network profile), MB up and down, the clients asked and
    the replies dropped, the clients' mean accuracy on their own shards where
    they evaluated their own models, and the DP epsilon spent. A quantity the
    run does not have (no DP, no network profile) is left out."""
    scalars = {
        "accuracy": record.accuracy,
        "loss": record.loss,
        "lr": record.lr,
        "seconds": record.seconds,
        "mb-up": record.bytes_up / 1e6,
        "mb-down": record.bytes_down / 1e6,
        "clients": len(record.clients),
        "failures": len(record.failures),
        "sim-seconds": record.sim_seconds,
        "dp-epsilon": record.dp_epsilon,
    }
    own = record.personal_stats("local")
    if own is not None:
        scalars["personal-own-accuracy"] = own[0]
    return {name: float(value) for name, value in scalars.items() if value is not None}
