"""TensorBoard tracking, read back with TensorBoard's own event reader."""

from __future__ import annotations

from pathlib import Path

import pytest
from flwr.app import ArrayRecord

from pollen.runs.notify import Notifier
from pollen.runs.recorder import RoundRecorder
from pollen.runs.tracking import TENSORBOARD_DIR
from pollen.settings import Settings
from pollen.strategies.round import RoundOutcome

event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator",
    reason="the tensorboard extra is not installed",
)


def outcome(bytes_up: int) -> RoundOutcome:
    return RoundOutcome(
        arrays=ArrayRecord(), clients=[0, 1], updates=[], bytes_down=2_000_000,
        bytes_up=bytes_up, skipped=False, failures=["node 3: late"], clipped=[],
        evaluating=[], eval_bytes=0,
        personal={0: {"global-accuracy": 0.4, "local-accuracy": 0.5},
                  1: {"global-accuracy": 0.4, "local-accuracy": 0.7}},
    )  # fmt: skip


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
    recorder = RoundRecorder(settings, [], tmp_path, Notifier.from_settings("", 1), "r")
    for server_round, accuracy in ((1, 0.5), (2, 0.6), (3, 0.7)):
        recorder.record(server_round, outcome(1_000_000), 1 - accuracy, accuracy)
    events = scalars(tmp_path)
    assert series(events, "accuracy") == [(1, 0.5), (2, 0.6), (3, 0.7)]
    assert series(events, "mb-up") == [(1, 1.0), (2, 1.0), (3, 1.0)]
    assert series(events, "failures")[0] == (1, 1.0)
    assert series(events, "personal-own-accuracy")[0] == (1, 0.6)
    assert "dp-epsilon" not in events.Tags()["scalars"]  # no DP: no series
    assert "settings/text_summary" in events.Tags()["tensors"]
    # resumed from round 2's checkpoint: round 3 again (other numbers), then 4
    resumed = Settings.from_run_config({"tracker": "tensorboard", "rounds": 4})
    recorder = RoundRecorder(
        resumed, recorder.history[:2], tmp_path, Notifier.from_settings("", 1), "r"
    )
    for server_round, accuracy in ((3, 0.8), (4, 0.9)):
        recorder.record(server_round, outcome(1_000_000), 1 - accuracy, accuracy)
    assert series(scalars(tmp_path), "accuracy") == [
        (1, 0.5), (2, 0.6), (3, 0.8), (4, 0.9)
    ]  # fmt: skip


def test_no_tracker_writes_nothing(tmp_path: Path) -> None:
    settings = Settings.from_run_config({"rounds": 1})
    recorder = RoundRecorder(settings, [], tmp_path, Notifier.from_settings("", 1), "r")
    recorder.record(1, outcome(0), 1.0, 0.5)
    assert not (tmp_path / TENSORBOARD_DIR).exists()
