"""pollen from Python: run a federation, compare a grid, read the results.

```python
import pollen

run = pollen.run(rounds=3, strategy="fedprox")  # blocks until the run ends
run.history[-1].accuracy, run.plot(), run.model()
grid = pollen.compare({"strategy": ["fedavg", "fedprox"]}, out="results/cmp", rounds=5)
grid.table(), grid.plot()
```

Each function is the command of the same name: `pollen run`, `pollen
compare` and `pollen report` parse their flags and call these, so a
setting, a check, a console line or an error is the same either way. A run
still goes through Flower's `flwr run`, on a SuperLink of its own, on the
warm federation, on a deployment or over a shaped network, and writes its
run directory as the command does; `Run` and `Comparison` read those files.

Settings are given as the command's `-c` values are: `config` is a dict, a
TOML file, a preset's name (a file in the app's `configs/`), a
"key=value ..." string, or a list of these applied in order, and keyword
arguments come last. A key may be spelled in Python (`local_epochs=2`) or
as the run config names it (`{"local-epochs": 2}`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .deployment import launch, processes
from .deployment.certificates import CertificateError
from .deployment.deploy_actions import NodeConfigError
from .deployment.launch import Interrupted, LaunchError
from .deployment.run_config import RunConfigError
from .experiments import compare as grids
from .experiments import report as reports
from .experiments.report import CompareError, GridShape, figure_data, read_json
from .network_profile import NetworkProfile, ProfileError, resolve
from .runs.checkpoints import CheckpointError
from .runs.results import (
    RUN_MARKER,
    ResultsError,
    RoundRecord,
    curves_figure,
    is_run_dir,
    read_history,
)
from .settings import SettingsError

if TYPE_CHECKING:
    import pandas
    from matplotlib.figure import Figure
    from torch import nn

__all__ = [
    "Comparison", "Interrupted", "Run", "RunFailed", "SettingsError", "compare",
    "report", "run",
]  # fmt: skip

Scalar = str | int | float | bool
# One layer of settings: a dict, a TOML file, a preset's name, "key=value ..."
Layer = Mapping[str, Scalar | os.PathLike[str]] | str | os.PathLike[str]
Config = Layer | Sequence[Layer] | None
# Input a user must fix before anything runs: `SettingsError` in Python, exit
# status 2 from the command
BAD_INPUT = (
    SettingsError, RunConfigError, LaunchError, ResultsError, CheckpointError,
    CompareError, ProfileError, NodeConfigError, CertificateError,
)  # fmt: skip


class RunFailed(RuntimeError):
    """A run, or cells of a comparison, that did not complete. The message
    names the error that ended the run: the ServerApp's, or, when the run
    failed before writing its results, the exception in Flower's stream and
    Flower's last error line. `dir` holds what it wrote (a comparison's
    folder for `compare`, whose `comparison` holds the report of the cells
    that completed)."""

    def __init__(
        self, message: str, dir: Path, comparison: Comparison | None = None
    ) -> None:
        super().__init__(message)
        self.dir = dir
        self.comparison = comparison


@dataclass(frozen=True)
class Run:
    """A run's directory and what it recorded, read when first asked for.

    `settings` is the complete run config it ran with (`settings.json`),
    `summary` how it ended (`summary.json`), `history` one `RoundRecord` per
    round (accuracy, loss, lr, seconds, bytes up and down, clients, ...).
    A run on a SuperLink elsewhere (`run(connection=...)`) wrote them on the
    ServerApp's machine (`elsewhere`): reading them here raises
    `FileNotFoundError`, which says so.
    """

    dir: Path
    elsewhere: bool = False

    @classmethod
    def read(cls, path: str | os.PathLike[str]) -> Run:
        """The run recorded in `path`; `FileNotFoundError` when `path`
        holds no run (no `settings.json` that names one)."""
        directory = Path(path).expanduser().resolve()
        if not is_run_dir(directory):
            raise FileNotFoundError(
                f"{directory} holds no pollen run (no {RUN_MARKER} naming one); "
                "give a run directory, e.g. results/<run-name>"
            )
        return cls(directory)

    @cached_property
    def settings(self) -> dict[str, Any]:
        """The run config the run ran with, every key (`settings.json`)."""
        return read_json(self._file(RUN_MARKER), dict)

    @cached_property
    def summary(self) -> dict[str, Any]:
        """How the run ended: status, rounds, final and best accuracy, total
        seconds and bytes (`summary.json`); empty for a run that failed
        before writing one."""
        path = self._file("summary.json")
        return read_json(path, dict) if path.exists() else {}

    @cached_property
    def history(self) -> list[RoundRecord]:
        """One record per round, in order (`history.json`)."""
        return read_history(self._file("."))

    def to_pandas(self) -> pandas.DataFrame:
        """The history as a DataFrame, one row per round: the columns of
        `history.csv`. Needs pandas (`pip install 'pollen-fl[pandas]'`)."""
        return _pandas().read_csv(self._file("history.csv"))

    def _file(self, name: str) -> Path:
        """The run's file `name` ("." for its folder), or why it cannot be
        read here."""
        if self.elsewhere:
            raise FileNotFoundError(
                f"the run's results are on the ServerApp's machine, in {self.dir} "
                "there: copy that folder here and use Run.read"
            )
        return self.dir / name

    def model(self) -> nn.Module:
        """The final global model, with its weights (`model.pt`), in
        evaluation mode: the server's model after the last round. Entries
        that never travel (FedBN's BatchNorm, FedPer's head, what a LoRA
        sharing keeps) hold the server's copy, their initial values: each
        client's own stay on the client."""
        import torch

        from .settings import Settings
        from .task.inputs import trained_model

        # keys the settings know: a run of an older pollen may record others
        known = {field for field, *_ in Settings.describe()}
        settings = Settings.from_run_config(
            {k: v for k, v in self.settings.items() if k in known}
        )
        weights = torch.load(self._file("model.pt"), weights_only=True)
        return trained_model(settings, weights)

    def plot(self) -> Figure:
        """Test accuracy and loss per round, side by side (a matplotlib
        `Figure`; a notebook shows it, `.savefig` writes it)."""
        title = f"{self.settings.get('strategy')} on {self.settings.get('data-set')}"
        return curves_figure(self.history, title)

    def __repr__(self) -> str:
        summary = self.summary
        if summary.get("final-accuracy") is None:
            return f"Run({str(self.dir)!r}, {summary.get('status', 'no summary')})"
        return (
            f"Run({str(self.dir)!r}, {summary['status']}, {summary['rounds']} "
            f"rounds, final accuracy {100 * summary['final-accuracy']:.2f}%)"
        )


class Table(str):
    """A markdown table: printed as text, shown as a table in a notebook."""

    def _repr_markdown_(self) -> str:
        return str(self)


@dataclass(frozen=True)
class Comparison:
    """A comparison's folder (`pollen compare --out`, or any folder of runs)
    and its report: `runs` (the completed ones), `table()` (mean ± std over
    seeds per setting), `plot()`."""

    dir: Path

    @cached_property
    def _recorded(self) -> list[reports.Run]:
        """The completed runs, as the report reads them."""
        return reports.read_runs(self.dir)

    @cached_property
    def runs(self) -> list[Run]:
        """Every completed run of the comparison, by directory name."""
        return [Run(run.path) for run in self._recorded]

    def table(self) -> Table:
        """The report's table (`comparison.md`): per setting, the mean ±
        standard deviation over seeds of final and best accuracy, rounds,
        time and bytes to the target, and the runs that did not complete."""
        return Table((self.dir / "comparison.md").read_text(encoding="utf-8"))

    @property
    def groups(self) -> list[dict[str, Any]]:
        """The table's rows as data (`comparison.json`'s groups)."""
        return read_json(self.dir / "comparison.json", dict)["groups"]

    def to_pandas(self) -> pandas.DataFrame:
        """The table's rows as a DataFrame: a column per varying setting,
        `<measure>-mean` and `<measure>-std` per measure. Needs pandas."""
        rows = []
        for group in self.groups:
            row = dict(group["setting"])
            for key, value in group.items():
                if isinstance(value, dict) and set(value) == {"mean", "std"}:
                    row |= {f"{key}-mean": value["mean"], f"{key}-std": value["std"]}
            rows.append(row | {"seeds": len(group["runs"])})
        return _pandas().DataFrame(rows)

    def plots(self, x: str = "rounds") -> dict[str, Figure]:
        """The report's figures of accuracy against `x` (`rounds`,
        `seconds`, `sim-seconds` or `bytes`), one per setting, by name."""
        grid = GridShape.read(self.dir / "grid.toml")
        prefix = f"accuracy-{x}-"
        return {
            name.removeprefix(prefix): data.figure()
            for name, data in figure_data(self._recorded, grid).items()
            if name.startswith(prefix)
        }

    def plot(self, x: str = "rounds") -> Figure:
        """Accuracy against `x` (`plots`), a line per strategy (mean over
        seeds): the one figure of a comparison with one setting; `plots`
        gives a comparison with several its figure for each."""
        figures = self.plots(x)
        if len(figures) != 1:
            raise ValueError(
                f"this comparison has {len(figures)} figures against {x!r}"
                + (f" ({', '.join(figures)}); use .plots({x!r})" if figures else "")
            )
        return next(iter(figures.values()))


def _pandas() -> Any:
    """The pandas module, an optional extra of pollen's."""
    try:
        import pandas
    except ImportError:
        raise ImportError(
            "this needs pandas: pip install 'pollen-fl[pandas]'"
        ) from None
    return pandas


def run(
    config: Config = None,
    /,
    *,
    app: str | os.PathLike[str] | None = None,
    deployment: str | os.PathLike[str] | None = None,
    warm: str | os.PathLike[str] | None = None,
    network: str | os.PathLike[str] | None = None,
    connection: str | None = None,
    federation: str | Sequence[str] = (),
    verbose: bool = False,
    **keys: Scalar | os.PathLike[str],
) -> Run:
    """Run one federation and wait for it: `pollen run`.

    A simulation on this machine by default (on the warm federation of
    `pollen warm up` when one runs in this directory, or the one in
    `warm`); `deployment`: on the `pollen deploy up` deployment recorded in
    that folder; `connection`: on that SuperLink of your Flower config;
    `network`: a network profile (a TOML file, or a preset of the app's
    `configs/networks/`) for the simulated clock. `federation`: `flwr run`'s
    `--federation-config` values. `app`: the Flower App (default: the
    current folder when it is one, as for the command, else the pollen
    checkout this package is in).

    Shows pollen's lines and a status line (in a terminal, or as one
    output a notebook updates), and Flower's with `verbose`; all of them
    go to the run directory's `flower.log`.

    Raises `SettingsError` for input to fix, with the command's one-line
    message: a setting that cannot run is refused before any process
    starts. `RunFailed` for a run that did not complete, and `Interrupted`
    (a `KeyboardInterrupt`) on Ctrl-C or Jupyter's stop button, once every
    process the run started has stopped; the run resumes with `resume=` its
    directory.
    """
    app_dir = _app(app)
    overrides = _overrides(config, keys)
    with _bad_input():
        if (profile := network_profile(network, app_dir)) is not None:
            overrides.append(grids.config_text({"network-profile": str(profile)}))
        with processes.stop_signals_interrupt():  # SIGTERM, SIGHUP: as Ctrl-C
            outcome = launch.run(
                app_dir, overrides, connection=connection, federation=_words(federation),
                deployment_dir=_path(deployment), warm_dir=_path(warm), verbose=verbose,
            )  # fmt: skip
    if not outcome.completed:
        raise RunFailed(f"run failed: {outcome.error}", outcome.run_dir)
    return Run(outcome.run_dir, elsewhere=not outcome.here)


COMPARE_INTERRUPTED = (
    "compare interrupted (every running cell was stopped and torn down); run it "
    "again to resume in {}"
)


def compare(
    grid: str | os.PathLike[str] | Mapping[str, Sequence[Any]],
    config: Config = None,
    /,
    *,
    out: str | os.PathLike[str],
    target: float | None = None,
    app: str | os.PathLike[str] | None = None,
    only: str | Sequence[str] = (),
    network: str | os.PathLike[str] | None = None,
    simulate: bool = False,
    jobs: int = 1,
    dry_run: bool = False,
    **keys: Scalar | os.PathLike[str],
) -> Comparison:
    """Run every cell of a grid into `out`, then report: `pollen compare`.

    `grid` is a grid file (TOML: `[base]`, `[grid]`, `target`) or the
    `[grid]` table as a dict, each key a list of the values to compare
    (`{"strategy": ["fedavg", "fedprox"], "seed": [1, 2]}`), with the
    report's `target` accuracy given here. `config` and `keys` apply to
    every cell. Cells that completed in `out` before are kept, an
    interrupted one resumes; `only` narrows the grid (`"strategy=fedavg"`);
    `network` runs every cell as a deployment over links shaped as that
    profile says (root), or with `simulate` as a simulation on its clock;
    `jobs` runs up to that many simulated cells at once, each on a warm
    federation of its own with that share of the CPUs (or, with
    `RAY_ADDRESS` in the environment, on that Ray cluster with that share
    of its actors), each history as one after another gives it; `dry_run`
    validates and lists the cells, running none; `app` as for `run`.

    Raises `SettingsError` for input to fix: a grid or a setting that
    cannot run is refused before any cell starts (so is a report that
    cannot be written). `RunFailed` when cells failed, after the others ran
    and the report was written (its `comparison` holds it), and
    `Interrupted` on Ctrl-C; running it again resumes. With `dry_run` the
    `Comparison` returned is of what `out` held before, if anything.
    """
    app_dir, out_dir = _app(app), Path(out).expanduser()
    overrides = _overrides(config, keys)
    with _bad_input():
        if isinstance(grid, Mapping):
            grid_path, text = out_dir / "grid.toml", grid_toml(grid, target)
        else:
            if target is not None:
                raise SettingsError(
                    f"target={target!r} with a grid file: the file sets its own "
                    "target; give the grid as a dict to set it here"
                )
            grid_path, text = Path(grid).expanduser(), ""
        if simulate and network is None:
            raise grids.CompareError("--simulate needs --network PROFILE")
        selected = ["".join((_key(k), *rest)) for k, *rest in
                    (w.partition("=") for w in _words(only))]  # fmt: skip
        request = grids.Comparison(
            grid_path, app_dir, out_dir, overrides, only=selected,
            network=network_profile(network, app_dir), simulate=simulate,
            jobs=jobs, grid_text=text,
        )  # fmt: skip
        try:
            failed = grids.run_comparison(request, dry_run=dry_run)
        except KeyboardInterrupt:  # Ctrl-C, or SIGTERM during a deployed cell
            message = COMPARE_INTERRUPTED.format(out_dir)
            print(f"pollen: {message}", file=sys.stderr)
            raise Interrupted(out_dir, None, message) from None
    comparison = Comparison(out_dir.resolve())
    if failed:
        raise RunFailed(
            f"{len(failed)} cell(s) failed: {', '.join(failed)} (their logs in "
            f"{out_dir / 'logs'})",
            comparison.dir,
            comparison,
        )
    return comparison


def report(folder: str | os.PathLike[str], target: float | None = None) -> Comparison:
    """Tables and plots of the runs in `folder` (a comparison's, or any
    folder of run directories), written there: `pollen report`. `target`:
    the accuracy whose first round, seconds and bytes the table gives
    (default: the comparison grid's)."""
    directory = Path(folder).expanduser()
    with _bad_input():
        grids.report_comparison(directory, target)
    return Comparison(directory.resolve())


def grid_toml(axes: Mapping[str, Sequence[Any]], target: float | None) -> str:
    """A grid given in Python (the `[grid]` table: key -> values, a value
    a scalar or a table of keys set together with a `name`) as the TOML a
    grid file holds, keys in the run config's spelling."""
    lines = [] if target is None else [f"target = {_toml_value('target', target)}"]
    lines.append("[grid]")
    for key, values in axes.items():
        if hasattr(values, "tolist"):  # a numpy array
            values = values.tolist()
        if isinstance(values, str) or not isinstance(values, Sequence):
            raise SettingsError(
                f"grid key {key!r}: {values!r} is not a list of values to compare"
            )
        spelled = ", ".join(_toml_value(key, value) for value in values)
        lines.append(f"{_toml_key(key)} = [{spelled}]")
    return "\n".join(lines) + "\n"


def _toml_key(name: str) -> str:
    """A key of the grid as TOML writes it: bare, or quoted where it must be
    (the grid's own check then names it)."""
    key = _key(name)
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


def _toml_value(key: str, value: Any) -> str:
    if isinstance(value, Mapping):
        pairs = (f"{_toml_key(k)} = {_toml_value(k, v)}" for k, v in value.items())
        return "{ " + ", ".join(pairs) + " }"
    return json.dumps(_scalar(key, value))


def _key(name: str) -> str:
    """A key as the run config spells it (`local_epochs` -> `local-epochs`)."""
    return name.replace("_", "-")


def _scalar(key: str, value: Any) -> Scalar:
    """A setting's value as the run config takes it: a path as its text."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if type(value).__module__ == "numpy" and hasattr(value, "item"):
        value = value.item()  # a numpy scalar, as from np.linspace
    if not isinstance(value, str | int | float | bool):
        raise SettingsError(
            f"invalid value for {_key(key)!r}: {value!r} is a {type(value).__name__}; "
            "a run-config value is a string, a number or true/false"
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise SettingsError(f"invalid value for {_key(key)!r}: {value!r} is not finite")
    return value


def _overrides(config: Config, keys: Mapping[str, Any]) -> list[str]:
    """`config`'s layers, then `keys`, as the command's `-c` values."""
    if config is None:
        layers: list[Any] = []
    elif isinstance(config, str | os.PathLike | Mapping):
        layers = [config]
    else:
        layers = list(config)
    if keys:
        layers.append(keys)
    overrides = []
    for layer in layers:
        if isinstance(layer, Mapping):
            values = {_key(k): _scalar(k, v) for k, v in layer.items()}
            overrides.append(grids.config_text(values))
        elif isinstance(layer, str | os.PathLike):
            overrides.append(os.fspath(layer))
        else:
            raise SettingsError(
                f"settings {layer!r}: give a dict, a TOML file, a preset's name or "
                '"key=value ..." text'
            )
    return overrides


def network_profile(spec: str | os.PathLike[str] | None, app: Path) -> Path | None:
    """The profile file `spec` names (a path or a preset of the app's
    configs/networks/), read and validated now: None without one."""
    if spec is None:
        return None
    path = resolve(os.fspath(spec), app)
    NetworkProfile.load(path)
    return path


def _words(values: str | Sequence[str]) -> list[str]:
    """A flag's values: one string is one value, not its letters."""
    return [values] if isinstance(values, str) else list(values)


def _path(value: str | os.PathLike[str] | None) -> Path | None:
    return None if value is None else Path(value)


def _app(app: str | os.PathLike[str] | None) -> Path:
    """The Flower App to run: `app`; else the current folder when it is a
    Flower App (as the command's default `.`); else the checkout this
    package is in (a source checkout or an editable install, as `make run`
    makes), so that a notebook anywhere runs pollen's own app; else the
    current folder (whose error says what is missing)."""
    if app is not None:
        return Path(app).expanduser().resolve()
    checkout = Path(__file__).resolve().parent.parent
    for folder in (Path.cwd(), checkout):
        if _is_flower_app(folder):
            return folder
    return Path.cwd()


def _is_flower_app(folder: Path) -> bool:
    """Whether `folder` holds a pyproject.toml with `[tool.flwr.app]`."""
    try:
        project = tomllib.loads((folder / "pyproject.toml").read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return False
    return "app" in project.get("tool", {}).get("flwr", {})


@contextlib.contextmanager
def _bad_input() -> Iterator[None]:
    """Input to fix raised as `SettingsError`, with the command's message."""
    try:
        yield
    except SettingsError:
        raise
    except BAD_INPUT as err:
        raise SettingsError(str(err)) from err
