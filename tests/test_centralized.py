"""`pollen centralized`: the baseline trains, records an epoch per row, sits
beside federated runs in a report, and evaluating between epochs leaves
training untouched."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from pollen.cli import main
from pollen.experiments import report
from pollen.task.data import load_dataset
from pollen.task.models import build_model
from pollen.task.train import ClientOptimizer, Preprocess, evaluate, train_local
from tests.conftest import PROJECT
from tests.test_compare import write_run


def test_evaluating_after_each_epoch_does_not_change_training() -> None:
    data = load_dataset("digits", "unused", download=False)
    x, y = data.x_train[:300], data.y_train[:300]
    prep = Preprocess(data.mean, data.std)
    trained = []
    for hook in (False, True):
        model = build_model("mlp", data.input_shape, data.num_classes, seed=3)
        seen: list[float] = []

        def after_epoch(epoch: int, model=model, seen=seen) -> None:
            seen.append(evaluate(model, x, y, batch_size=64, preprocess=prep)[1])

        train_local(model, x, y, epochs=3, batch_size=32, optimizer=ClientOptimizer(
            "adam", 1e-3), preprocess=prep, seed=5,
            after_epoch=after_epoch if hook else None)  # fmt: skip
        trained.append(model.state_dict())
        assert len(seen) == (3 if hook else 0)
    assert all(torch.equal(trained[0][k], trained[1][k]) for k in trained[0])


def test_the_baseline_writes_a_run_that_reports_beside_federated_ones(
    tmp_path: Path, capsys
) -> None:
    config = (f"data-set='digits' rounds=2 local-epochs=2 output-dir='{tmp_path}' "
              "run-name='central'")  # fmt: skip
    assert main(["centralized", str(PROJECT), "-c", config]) == 0
    run = tmp_path / "central"
    history = json.loads((run / "history.json").read_text())
    assert [r["round"] for r in history] == [1, 2, 3, 4]  # rounds x local-epochs
    assert history[-1]["accuracy"] > 0.85 and history[-1]["bytes-up"] == 0
    settings = json.loads((run / "settings.json").read_text())
    assert settings["strategy"] == "centralized" and settings["centralized-epochs"] == 4
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"
    assert (run / "curves.png").exists() and (run / "model.pt").exists()
    write_run(tmp_path, "fedavg", {**settings, "strategy": "fedavg"}, [0.5, 0.7])
    rows = report.summarize_groups(report.read_runs(tmp_path), target=None)
    assert [r["setting"] for r in rows] == [
        {"strategy": "centralized"},
        {"strategy": "fedavg"},
    ]
    # the directory exists now: a second run is refused and nothing is touched
    before = (run / "history.json").read_bytes()
    assert main(["centralized", str(PROJECT), "-c", config]) == 2
    assert "already exists" in capsys.readouterr().err
    assert (run / "history.json").read_bytes() == before
    assert main(["centralized", str(PROJECT), "-c", config, "--epochs", "0"]) == 2
