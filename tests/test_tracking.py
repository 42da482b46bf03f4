"""Experiment tracking, read back with each tracker's own reader: TensorBoard's
event accumulator, and MLflow's client against a real tracking server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from flwr.app import ArrayRecord

from pollen.deployment import processes
from pollen.deployment.run_config import pin_tracking_uri
from pollen.runs.notify import Notifier
from pollen.runs.recorder import RoundRecorder
from pollen.runs.tracking import open_tracker
from pollen.runs.tracking_mlflow import RUN_FILE, URI_ENV
from pollen.runs.tracking_tensorboard import TENSORBOARD_DIR
from pollen.settings import Settings, SettingsError
from pollen.strategies.round import RoundOutcome

event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator",
    reason="the tensorboard extra is not installed",
)
mlflow_tracking = pytest.importorskip(
    "mlflow.tracking", reason="the mlflow extra is not installed"
)


def outcome(bytes_up: int) -> RoundOutcome:
    return RoundOutcome(
        arrays=ArrayRecord(), clients=[0, 1], updates=[], bytes_down=2_000_000,
        bytes_up=bytes_up, skipped=False, failures=["node 3: late"], clipped=[],
        evaluating=[], eval_bytes=0,
        personal={0: {"global-accuracy": 0.4, "local-accuracy": 0.5},
                  1: {"global-accuracy": 0.4, "local-accuracy": 0.7}},
    )  # fmt: skip


def recorder_for(
    settings: Settings, run_dir: Path, history: list | None = None
) -> RoundRecorder:
    """A recorder whose tracker holds `history` (the rounds a resume restored)."""
    history = list(history or [])
    tracker = open_tracker(settings, run_dir, "r", history)
    notifier = Notifier.from_settings("", 1)
    return RoundRecorder(settings, history, run_dir, notifier, "r", tracker)


def play(recorder: RoundRecorder, accuracies: dict[int, float]) -> None:
    for server_round, accuracy in accuracies.items():
        lr = recorder.settings.lr  # the schedule's rate: unchanged on a rising accuracy
        recorder.record(server_round, outcome(1_000_000), 1 - accuracy, accuracy, lr)


def scalars(run_dir: Path) -> event_accumulator.EventAccumulator:
    events = event_accumulator.EventAccumulator(str(run_dir / TENSORBOARD_DIR))
    events.Reload()
    return events


def series(events, tag: str) -> list[tuple[int, float]]:
    return [(e.step, round(e.value, 6)) for e in events.Scalars(tag)]


def test_rounds_are_written_and_a_resume_writes_on_from_its_checkpoint(
    tmp_path: Path,
) -> None:
    settings = Settings.from_run_config({"tracker": "tensorboard", "rounds": 3})
    recorder = recorder_for(settings, tmp_path)
    play(recorder, {1: 0.5, 2: 0.6, 3: 0.7})
    recorder.tracker.finish(tmp_path, "completed")
    events = scalars(tmp_path)
    assert series(events, "accuracy") == [(1, 0.5), (2, 0.6), (3, 0.7)]
    assert series(events, "mb-up") == [(1, 1.0), (2, 1.0), (3, 1.0)]
    assert series(events, "failures")[0] == (1, 1.0)
    assert series(events, "personal-own-accuracy")[0] == (1, 0.6)
    assert "dp-epsilon" not in events.Tags()["scalars"]  # no DP: no series
    assert "settings/text_summary" in events.Tags()["tensors"]
    # resumed from round 2's checkpoint: round 3 again (other numbers), then 4
    resumed = Settings.from_run_config({"tracker": "tensorboard", "rounds": 4})
    recorder = recorder_for(resumed, tmp_path, recorder.history[:2])
    play(recorder, {3: 0.8, 4: 0.9})
    assert series(scalars(tmp_path), "accuracy") == [
        (1, 0.5), (2, 0.6), (3, 0.8), (4, 0.9)
    ]  # fmt: skip


def test_tensorboard_switched_on_at_a_resume_starts_with_the_restored_rounds(
    tmp_path: Path,
) -> None:
    untracked = recorder_for(Settings.from_run_config({"rounds": 3}), tmp_path)
    play(untracked, {1: 0.5, 2: 0.6})
    assert not (tmp_path / TENSORBOARD_DIR).exists()
    resumed = Settings.from_run_config({"tracker": "tensorboard", "rounds": 3})
    play(recorder_for(resumed, tmp_path, untracked.history), {3: 0.7})
    assert series(scalars(tmp_path), "accuracy") == [(1, 0.5), (2, 0.6), (3, 0.7)]


def mlflow_settings(uri: str, rounds: int, experiment: str) -> Settings:
    return Settings.from_run_config({
        "tracker": "mlflow", "tracking-uri": uri, "rounds": rounds,
        "tracking-experiment": experiment,
    })  # fmt: skip


def metric(client, run_id: str, name: str) -> list[tuple[int, float]]:
    history = client.get_metric_history(run_id, name)
    return sorted((m.step, round(m.value, 6)) for m in history)


@pytest.mark.xdist_group("mlflow")
def test_an_mlflow_run_holds_settings_rounds_and_files_and_a_resume_continues_it(
    tmp_path: Path, mlflow_server: str
) -> None:
    client = mlflow_tracking.MlflowClient(mlflow_server)
    recorder = recorder_for(mlflow_settings(mlflow_server, 3, "unit"), tmp_path)
    play(recorder, {1: 0.5, 2: 0.6})
    (tmp_path / "model.pt").write_bytes(b"weights")
    recorder.tracker.finish(tmp_path, "failed")
    run_id = json.loads((tmp_path / RUN_FILE).read_text())["run-id"]
    run = client.get_run(run_id)
    experiment = client.get_experiment(run.info.experiment_id)
    assert experiment.name == "unit" and run.info.run_name == "r"
    assert run.info.status == "FAILED"
    assert run.data.params["rounds"] == "3" and run.data.params["strategy"] == "fedavg"
    assert len(run.data.params) == len(Settings().to_run_config())
    assert metric(client, run_id, "accuracy") == [(1, 0.5), (2, 0.6)]
    assert metric(client, run_id, "mb-up") == [(1, 1.0), (2, 1.0)]
    assert metric(client, run_id, "personal-own-accuracy")[0] == (1, 0.6)
    assert "dp-epsilon" not in run.data.metrics  # no DP: no metric
    files = {a.path for a in client.list_artifacts(run_id)}
    assert {"history.json", "history.csv", "model.pt"} <= files
    # resumed from round 1's checkpoint with more rounds: the same MLflow run,
    # round 2 not logged twice, the changed setting a tag
    resumed = mlflow_settings(mlflow_server, 4, "unit")
    recorder = recorder_for(resumed, tmp_path, recorder.history[:1])
    play(recorder, {2: 0.6, 3: 0.7, 4: 0.8})
    recorder.tracker.finish(tmp_path, "completed")
    run = client.get_run(run_id)
    assert json.loads((tmp_path / RUN_FILE).read_text())["run-id"] == run_id
    assert run.info.status == "FINISHED" and run.data.params["rounds"] == "3"
    assert run.data.tags["resumed.rounds"] == "4"
    assert metric(client, run_id, "accuracy") == [
        (1, 0.5),
        (2, 0.6),
        (3, 0.7),
        (4, 0.8),
    ]


def test_an_sqlite_store_keeps_its_artefacts_beside_it_and_a_late_tracker_backfills(
    tmp_path: Path,
) -> None:
    store = tmp_path / "store"
    store.mkdir()
    uri = f"sqlite:///{store / 'mlflow.db'}"
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    untracked = recorder_for(Settings.from_run_config({"rounds": 3}), run_dir)
    play(untracked, {1: 0.5, 2: 0.6})
    # tracking switched on at the resume: a new MLflow run with every round
    recorder = recorder_for(mlflow_settings(uri, 3, ""), run_dir, untracked.history)
    play(recorder, {3: 0.7})
    recorder.tracker.finish(run_dir, "interrupted")
    client = mlflow_tracking.MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("pollen").experiment_id])
    assert run.info.status == "KILLED"
    assert metric(client, run.info.run_id, "accuracy") == [(1, 0.5), (2, 0.6), (3, 0.7)]
    assert list((store / "mlartifacts" / "pollen").rglob("history.json"))


@pytest.mark.xdist_group("mlflow")
def test_a_tracking_server_that_stops_answering_is_said_once_and_the_run_goes_on(
    tmp_path: Path, mlflow_server: str, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    recorder = recorder_for(mlflow_settings(mlflow_server, 3, "unit"), tmp_path)
    gone = f"http://127.0.0.1:{processes.free_port()}"
    recorder.tracker.client = mlflow_tracking.MlflowClient(gone)
    play(recorder, {1: 0.5, 2: 0.6, 3: 0.7})
    recorder.tracker.finish(tmp_path, "completed")
    assert capsys.readouterr().err.count("MLflow logging at") == 1
    rounds = json.loads((tmp_path / "history.json").read_text())
    assert [row["round"] for row in rounds] == [1, 2, 3]


def test_no_tracker_writes_nothing(tmp_path: Path) -> None:
    recorder = recorder_for(Settings.from_run_config({"rounds": 1}), tmp_path)
    play(recorder, {1: 0.5})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["history.csv", "history.json"]


def test_the_cli_pins_where_mlflow_logs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(URI_ENV, raising=False)

    def pinned(**values) -> str:
        settings = Settings.from_run_config({"tracker": "mlflow", **values})
        return pin_tracking_uri(settings).tracking_uri

    assert pinned() == f"sqlite:///{tmp_path / 'results' / 'mlflow.db'}"
    assert pinned(**{"tracking-uri": "sqlite:///a/m.db"}) == (
        f"sqlite:///{tmp_path / 'a' / 'm.db'}"
    )
    monkeypatch.setenv(URI_ENV, "http://127.0.0.1:5000")
    assert pinned() == "http://127.0.0.1:5000"
    assert pinned(**{"tracking-uri": "https://mlflow.lab:443"}) == (
        "https://mlflow.lab:443"
    )
    run = tmp_path / "run"
    run.mkdir()
    (run / RUN_FILE).write_text(
        json.dumps({"tracking-uri": "http://h:1", "run-id": "x"})
    )
    assert pinned(resume=str(run)) == "http://h:1"  # a resume logs where it did
    monkeypatch.delenv(URI_ENV)
    plain = Settings.from_run_config({"tracker": "tensorboard"})
    assert pin_tracking_uri(plain) == plain


def test_a_tracking_uri_from_the_environment_is_checked_before_the_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """$MLFLOW_TRACKING_URI=mlruns (MLflow's plain folder) was pinned
    unchecked, and the ServerApp refused its own run config after start-up."""
    monkeypatch.setenv(URI_ENV, "mlruns")
    with pytest.raises(SettingsError, match=r"'mlruns' \(from \$MLFLOW_TRACKING_URI"):
        pin_tracking_uri(Settings.from_run_config({"tracker": "mlflow"}))


def test_a_store_mlflow_cannot_open_is_said_once_and_the_run_goes_on(
    tmp_path: Path, capsys
) -> None:
    """A database store whose driver is not installed failed in MLflow's
    client constructor, outside the tracker's guard: the run crashed."""
    pytest.importorskip("mlflow")
    settings = Settings.from_run_config(
        {"tracker": "mlflow", "tracking-uri": "postgresql://u:p@127.0.0.1:1/db",
         "rounds": 2}
    )  # fmt: skip
    recorder = recorder_for(settings, tmp_path)
    play(recorder, {1: 0.5, 2: 0.6})
    recorder.tracker.finish(tmp_path, "completed")
    assert capsys.readouterr().err.count("MLflow logging at") == 1
    rounds = json.loads((tmp_path / "history.json").read_text())
    assert [row["round"] for row in rounds] == [1, 2]
