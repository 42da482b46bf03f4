"""pollen from Python (`pollen.api`): settings given as the command's are,
a bad one refused before any process starts, a real run read back (its
history, its model, its plot), a failed run's error, Ctrl-C leaving nothing
running and the run resumable, and a grid given as a dict."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import pollen
from pollen import api
from pollen.deployment.processes import alive, descendants
from pollen.experiments.compare import Grid
from pollen.runs.checkpoints import check_resumable
from tests.conftest import PROJECT, fenced_blocks, read_through_line

DIGITS = {"num-clients": 4, "client-frac": 1.0, "local-epochs": 1}


def test_settings_are_the_commands_run_config_values_in_order() -> None:
    overrides = api._overrides(
        ["mnist-fedavg", {"local_epochs": 2}, Path("a.toml"), "rounds=3"],
        {"client_frac": 0.5, "run-name": "a b", "dp": True, "data_root": Path("d")},
    )
    assert overrides == [
        "mnist-fedavg", "local-epochs=2", "a.toml", "rounds=3",
        'client-frac=0.5 run-name="a b" dp=true data-root="d"',
    ]  # fmt: skip
    assert api._overrides(None, {}) == []
    assert api._overrides({"lr": 0.1}, {}) == ["lr=0.1"]


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (
            {"local_epoch": 3},
            r"unknown run-config key 'local-epoch'; did you mean 'local-epochs'\?",
        ),
        ({"rounds": 0}, r"rounds"),
        ({"lr": [0.1]}, r"'lr': \[0.1\] is a list; a run-config value is a string"),
        ({"lr": math.nan}, r"'lr': nan is not finite"),
        ({"strategy": "fedsgd"}, r"strategy"),
    ],
)
def test_a_bad_setting_raises_before_any_process_starts(
    keys: dict, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_process(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a process started: {args}")

    monkeypatch.setattr(subprocess.Popen, "__init__", no_process)
    with pytest.raises(pollen.SettingsError, match=message) as raised:
        pollen.run(output_dir=str(tmp_path), **keys)
    assert isinstance(raised.value, ValueError)
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_the_commands_input_errors_are_settings_errors(tmp_path: Path) -> None:
    """A bad preset, a bad grid and a missing network profile: the command's
    one-line message, as `SettingsError`."""
    with pytest.raises(pollen.SettingsError, match="'nosuchpreset' is not key=value"):
        pollen.run("nosuchpreset")
    with pytest.raises(pollen.SettingsError, match=r"--network .*no such file"):
        pollen.run(network=tmp_path / "none.toml")
    with pytest.raises(pollen.SettingsError, match=r"grid key 'seed'.* not a list"):
        pollen.compare({"seed": 3}, out=tmp_path / "cmp")
    with pytest.raises(pollen.SettingsError, match="target must be an accuracy"):
        pollen.compare({"seed": [1, 2]}, out=tmp_path / "cmp", target=2.0)
    with pytest.raises(FileNotFoundError, match="holds no pollen run"):
        pollen.Run.read(tmp_path)


def test_a_grid_given_as_a_dict_is_the_grid_file_it_writes(tmp_path: Path) -> None:
    text = api.grid_toml(
        {
            "strategy": ["fedavg", {"name": "dyn-sam", "strategy": "feddyn",
                                    "local_objective": "feddyn-sam"}],
            "seed": [1, 2],
            "lr": [0.05],
        },
        target=0.8,
    )  # fmt: skip
    grid = Grid.loads(text, tmp_path / "grid.toml")
    assert grid.target == 0.8
    assert grid.axes == {
        "strategy": ["fedavg", {"name": "dyn-sam", "strategy": "feddyn",
                                "local-objective": "feddyn-sam"}],
        "seed": [1, 2],
        "lr": [0.05],
    }  # fmt: skip


def test_a_preset_is_named_as_the_command_names_it() -> None:
    from pollen.deployment.run_config import resolve_run_config

    config = resolve_run_config(PROJECT, ["mnist-fedavg", "rounds=2"])
    assert (config["data-set"], config["model"], config["rounds"]) == (
        "mnist",
        "cnn",
        2,
    )


def test_a_report_is_a_comparison_of_its_runs(tmp_path: Path) -> None:
    """`pollen.report` of a folder of finished runs: the runs, the table
    (markdown in a notebook), a figure with a line per strategy, a
    DataFrame with a row per setting."""
    from pollen.runs.results import RoundRecord
    from tests.test_compare import write_run

    for strategy, seed, accuracy in (("fedavg", 1, [0.5, 0.7]),
                                     ("fedavg", 2, [0.6, 0.9]),
                                     ("fedprox", 1, [0.4, 0.8])):  # fmt: skip
        rows = [RoundRecord(i + 1, a, 1.0, 0.05, 2.0, 1_000_000, 2_000_000).as_row()
                for i, a in enumerate(accuracy)]  # fmt: skip
        write_run(tmp_path / "runs", f"{strategy}-{seed}",
                  {"strategy": strategy, "seed": seed}, accuracy, history=rows)  # fmt: skip
    comparison = pollen.report(tmp_path, target=0.75)
    assert [run.dir.name for run in comparison.runs] == [
        "fedavg-1",
        "fedavg-2",
        "fedprox-1",
    ]
    assert comparison.runs[1].history[-1].accuracy == 0.9
    table = comparison.table()
    assert table._repr_markdown_() == table == (tmp_path / "comparison.md").read_text()
    assert "| fedavg |" in table and "| fedprox |" in table
    figure = comparison.plot()
    assert sorted(line.get_label() for line in figure.axes[0].lines) == [
        "fedavg (mean of 2 seeds)", "fedprox (1 seed)"
    ]  # fmt: skip
    assert figure._repr_png_().startswith(b"\x89PNG")
    assert set(comparison.plots("bytes")) == {"all"}
    frame = comparison.to_pandas()
    assert list(frame["strategy"]) == ["fedavg", "fedprox"]
    assert list(frame["final-accuracy-mean"]) == pytest.approx([0.8, 0.8])
    assert list(frame["seeds"]) == [2, 1]
    with pytest.raises(ValueError, match="0 figures against 'sim-seconds'"):
        comparison.plot("sim-seconds")


def test_a_dry_run_of_a_grid_given_in_python_lists_the_cells_it_selects(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`only` as one string, with a key in Python's spelling; nothing is
    written, and the grid's numpy values are taken as numbers."""
    import numpy as np

    pollen.compare(
        {"local_epochs": np.array([1, 2]), "strategy": ["fedavg"]},
        out=tmp_path / "cmp", only="local_epochs=2", dry_run=True, rounds=1,
    )  # fmt: skip
    listed = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in listed] == ["local-epochs-2_strategy-fedavg"]
    assert not (tmp_path / "cmp").exists()


def test_a_run_on_another_machines_superlink_says_where_its_files_are(
    tmp_path: Path,
) -> None:
    run = pollen.Run(tmp_path / "there", elsewhere=True)
    for read in (lambda: run.history, lambda: run.settings, run.model):
        with pytest.raises(FileNotFoundError, match="on the ServerApp's machine"):
            read()


@pytest.mark.integration
def test_a_run_returns_its_history_model_and_plot(
    warm_federation: Path, tmp_path: Path
) -> None:
    """`pollen.run` on the warm federation; what it returns is what
    `Run.read` reads back, and the model it gives scores the history's
    final accuracy on the test set."""
    import torch

    from pollen.settings import Settings
    from pollen.task.data import load_dataset
    from pollen.task.train import Preprocess, evaluate

    run = pollen.run(
        DIGITS, rounds=2, output_dir=tmp_path, run_name="two", warm=warm_federation
    )
    assert run.dir == tmp_path / "two"
    assert [r.round for r in run.history] == [1, 2]
    assert run.summary["status"] == "completed" and run.settings["rounds"] == 2
    again = pollen.Run.read(tmp_path / "two")
    assert again.history == run.history and again.summary == run.summary
    frame = again.to_pandas()
    assert list(frame["accuracy"]) == [r.accuracy for r in run.history]

    model = run.model()
    settings = Settings.from_run_config(run.settings)
    data = load_dataset("digits", "data", download=False)
    _, accuracy = evaluate(
        model, data.x_test, data.y_test, batch_size=128,
        preprocess=Preprocess(data.mean, data.std, settings.normalize,
                              device=torch.device("cpu")),
    )  # fmt: skip
    assert accuracy == pytest.approx(run.history[-1].accuracy)
    figure = run.plot()
    assert [len(ax.lines) for ax in figure.axes] == [1, 1]
    assert "matplotlib.pyplot" not in sys.modules  # the caller's backend untouched


@pytest.mark.integration
def test_a_failed_run_raises_naming_its_error(
    warm_federation: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A model this process imports but the run's processes cannot (its
    folder is on this `sys.path` only): the run fails in the ServerApp, and
    `RunFailed` says Flower's error line, which names the module."""
    package = tmp_path / "here_only"
    package.mkdir()
    (package / "nets_here.py").write_text(textwrap.dedent("""
        from torch import nn

        def net(input_shape, num_classes):
            c, h, w = input_shape
            return nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, num_classes))
    """))  # fmt: skip
    monkeypatch.syspath_prepend(str(package))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    with pytest.raises(pollen.RunFailed, match="nets_here") as raised:
        pollen.run(DIGITS, rounds=1, model="nets_here:net", output_dir=tmp_path / "out",
                   run_name="fails", warm=warm_federation)  # fmt: skip
    assert raised.value.dir == tmp_path / "out" / "fails"
    # it failed before a run started in its directory: Flower's lines stay
    # in the temporary folder, said, for the user (here the test) to remove
    said = re.search(r"Flower's and Ray's lines are in (\S+)", capsys.readouterr().err)
    Path(said[1]).unlink()


SCRIPT = """
import sys
import pollen

try:
    pollen.run(rounds=300, num_clients=4, output_dir=sys.argv[1], run_name="stopped")
except pollen.Interrupted as stop:
    print("INTERRUPTED", stop.dir, stop.resume_after, flush=True)
    sys.exit(3)
"""


@pytest.mark.integration
def test_an_interrupt_stops_every_process_and_leaves_the_run_resumable(
    tmp_path: Path,
) -> None:
    """Ctrl-C as a terminal (and Jupyter's stop button) sends it, to the
    whole process group of a script calling `pollen.run`: `Interrupted`,
    nothing left running, the run checkpointed where it stopped."""
    script = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=tmp_path,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    shown = read_through_line(script, "round 2/300")
    started = descendants(script.pid)
    assert started, shown
    os.killpg(script.pid, signal.SIGINT)
    out, err = script.communicate(timeout=120)
    assert script.returncode == 3, err[-3000:]
    said = out.split("INTERRUPTED ", 1)[1].split()
    run_dir, resume_after = Path(said[0]), int(said[1])
    assert run_dir == tmp_path / "stopped" and resume_after >= 2
    deadline = time.monotonic() + 60
    while any(map(alive, started)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [pid for pid in started if alive(pid)]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    settings = json.loads((run_dir / "settings.json").read_text())
    assert check_resumable(run_dir, settings) == resume_after


@pytest.mark.integration
def test_the_readmes_python_example_runs(warm_federation: Path, tmp_path: Path) -> None:
    """The README's Python block, as written, with its run shortened to two
    rounds on the session's warm federation."""
    import types

    readme = (PROJECT / "README.md").read_text()
    (code,) = fenced_blocks(readme, "python")
    shortened = types.SimpleNamespace(
        run=lambda *a, **k: pollen.run(
            *a, **k, rounds=2, output_dir=tmp_path, warm=warm_federation
        )
    )  # fmt: skip
    namespace: dict = {}
    exec(code.replace("import pollen\n", ""), {"pollen": shortened}, namespace)
    assert namespace["run"].settings["strategy"] == "fedprox"
    assert namespace["run"].summary["status"] == "completed"
    assert sum(p.numel() for p in namespace["model"].parameters()) > 0
