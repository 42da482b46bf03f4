"""Mistakes caught before any Flower process starts: each `pollen run` below
exits with status 2 and one line naming the key, the value and what is
allowed, without staging the app for Flower (issue 32's list of inputs that
used to be found only after start-up, or not at all)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from pollen.cli import EXIT_BAD_INPUT, main
from pollen.deployment import launch, processes
from pollen.runs.results import check_run_dir_is_new
from tests.conftest import PROJECT


@pytest.fixture
def no_flower(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a run gets as far as staging the app for Flower."""

    def staged_app(app: Path) -> None:
        raise AssertionError("the run reached Flower before its check")

    monkeypatch.setattr(launch, "staged_app", staged_app)


CASES = [
    ("rounds=", r"'rounds=' has no value"),
    ("lr=0.01 rounds= local-epochs=2", r"'rounds=' has no value"),
    ("rounds 3", r"'rounds' is not key=value"),
    ("rounds='ten'", r"'rounds': 'ten'; allowed: an integer"),
    (
        "partition='pathological' classes-per-client=11",
        r"classes-per-client=11 with data-set='digits', which has 10 classes",
    ),
    ("dp=true model='mlp-bn'", r"dp=true with model='mlp-bn': its BatchNorm"),
    ("num-clients=100000", r"training split has 1,437 examples.*1 to 1437"),
    ("bn-policy='fedbn'", r"bn-policy='fedbn' with model='mlp', which has no"),
    ("tracking-uri='http://127.0.0.1:5000'", r"only tracker='mlflow' logs to a"),
    (
        "tracker='mlflow' tracking-uri='mlruns'",
        r"'tracking-uri': 'mlruns'; allowed: empty, an http\(s\) URL",
    ),
]


@pytest.mark.parametrize(("config", "message"), CASES, ids=[c for c, _ in CASES])
def test_a_mistake_stops_before_flower_starts(
    config: str, message: str, no_flower: None, tmp_path: Path, capsys
) -> None:
    argv = ["run", str(PROJECT), "-c", f"output-dir='{tmp_path}'", "-c", config]
    assert main(argv) == EXIT_BAD_INPUT
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1
    assert re.search(message, error), error
    assert not any(tmp_path.iterdir())  # no run directory left behind


def test_a_device_this_machine_lacks_stops_a_simulation(
    no_flower: None, tmp_path: Path, capsys
) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: device='cuda' is valid here")
    argv = ["run", str(PROJECT), "-c", f"output-dir='{tmp_path}' device='cuda'"]
    assert main(argv) == EXIT_BAD_INPUT
    assert "'cuda'; no CUDA device here; allowed here: auto" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda raw: raw[: len(raw) // 2], r"cannot read .*mnist\.npz"),
        (lambda raw: b"not a zip archive" * 10, r"cannot read .*mnist\.npz"),
        (None, r"no data for 'mnist'.*set download=true"),
    ],
    ids=["truncated", "garbage", "missing"],
)
def test_a_damaged_data_file_stops_before_flower_starts(
    damage, message: str, no_flower: None, tmp_path: Path, capsys
) -> None:
    """The data set the run names is read before Flower starts (and left
    decoded in the cache for the run); a damaged file is one line, exit 2."""
    rng = np.random.default_rng(0)
    arrays = {
        "x_train": rng.integers(0, 256, (20, 28, 28), dtype=np.uint8),
        "y_train": np.arange(20, dtype=np.uint8) % 10,
        "x_test": rng.integers(0, 256, (10, 28, 28), dtype=np.uint8),
        "y_test": np.arange(10, dtype=np.uint8),
    }
    data = tmp_path / "data"
    data.mkdir()
    np.savez_compressed(data / "mnist.npz", **arrays)
    if damage is None:
        (data / "mnist.npz").unlink()
    else:
        (data / "mnist.npz").write_bytes(damage((data / "mnist.npz").read_bytes()))
    config = (f"output-dir='{tmp_path}' data-set='mnist' data-root='{data}' "
              "download=false num-clients=2")  # fmt: skip
    assert main(["run", str(PROJECT), "-c", config]) == EXIT_BAD_INPUT
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "data-set='mnist'" in error
    assert re.search(message, error), error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]  # no run dir


def test_an_output_dir_inside_a_run_directory_is_refused(
    no_flower: None, tmp_path: Path, capsys
) -> None:
    """A new run nested inside an old run's results would pass for part of them."""
    old = tmp_path / "old-run"
    old.mkdir()
    (old / "settings.json").write_text('{"run-name": "old-run"}')
    argv = ["run", str(PROJECT), "-c", f"output-dir='{old / 'plots'}'"]
    assert main(argv) == EXIT_BAD_INPUT
    assert f"is inside the run directory {old}" in capsys.readouterr().err
    assert sorted(p.name for p in old.iterdir()) == ["settings.json"]
    stray = tmp_path / "notes"  # a settings.json that is not a run's
    stray.mkdir()
    (stray / "settings.json").write_text("{}")
    assert check_run_dir_is_new(str(stray / "out"), "r") == stray / "out" / "r"


def test_a_tracking_server_that_does_not_answer_stops_the_run(
    no_flower: None, tmp_path: Path, capsys
) -> None:
    uri = f"http://127.0.0.1:{processes.free_port()}"
    config = f"output-dir='{tmp_path}' tracker='mlflow' tracking-uri='{uri}'"
    assert main(["run", str(PROJECT), "-c", config]) == EXIT_BAD_INPUT
    assert f"no MLflow tracking server answers at {uri}" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
