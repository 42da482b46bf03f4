"""The recorder's warning for a run that stays at chance while its test
loss rises: on the way to diverging before anything is non-finite."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord
from PIL import Image

from pollen.runs.notify import Notifier
from pollen.runs.recorder import STALL_ROUNDS, RoundRecorder, stalled_at_chance
from pollen.runs.results import (
    HEATMAP_MAX_INCHES,
    RoundRecord,
    plot_label_heatmap,
    seconds_left,
    summarize,
)
from pollen.settings import Settings
from pollen.strategies.round import RoundOutcome
from tests.conftest import resumable_extra


def rows(pairs: list[tuple[float, float]]) -> list[RoundRecord]:
    """(accuracy, loss) per round."""
    common = {"lr": 0.1, "seconds": 1.0, "bytes_up": 0, "bytes_down": 0}
    return [
        RoundRecord(round=i + 1, accuracy=a, loss=loss, **common)
        for i, (a, loss) in enumerate(pairs)
    ]


@pytest.mark.parametrize(
    ("pairs", "stalled"),
    [
        ([(0.5, 1.0), (0.1, 2.0), (0.12, 3.0), (0.09, 4.0)], True),
        ([(0.1, 2.0), (0.1, 3.0), (0.1, 4.0)], False),  # too few rounds to tell
        ([(0.5, 1.0), (0.1, 2.0), (0.1, 1.5), (0.1, 4.0)], False),  # loss fell once
        ([(0.5, 1.0), (0.1, 2.0), (0.16, 3.0), (0.1, 4.0)], False),  # 16% > 1.5 x 10%
        ([(0.9, 0.3), (0.91, 0.31), (0.92, 0.32), (0.93, 0.33)], False),  # learning
    ],
)
def test_stalled_at_chance_by_hand(pairs, stalled: bool) -> None:
    assert stalled_at_chance(rows(pairs), classes=10) is stalled


def test_the_recorder_warns_once_with_the_likely_cause(tmp_path: Path, capsys) -> None:
    settings = Settings.from_run_config({"lr": 5.0, "rounds": 8})
    recorder = RoundRecorder(settings, [], tmp_path, Notifier.from_settings("", 1), "r")
    outcome = RoundOutcome(
        arrays=ArrayRecord(), clients=[0], updates=[], bytes_down=0, bytes_up=0,
        skipped=False, failures=[], clipped=[], evaluating=[], eval_bytes=0,
        personal={},
    )  # fmt: skip
    for server_round in range(1, 8):  # chance accuracy, the loss rising every round
        recorder.record(server_round, outcome, float(server_round), 0.1, settings.lr)
    out = capsys.readouterr().out
    assert out.count("pollen: warning: accuracy has stayed at chance") == 1
    warning = next(line for line in out.splitlines() if "warning" in line)
    assert f"rose for {STALL_ROUNDS} rounds; likely cause: lr=5 too high" in warning


def test_the_label_heatmap_of_ten_thousand_clients_stays_small(tmp_path: Path) -> None:
    """One row per client up to 30; 10,000 clients share a bounded figure
    (at 0.35 inch a row it was 385,000 pixels tall and took 9 GiB)."""
    counts = np.random.default_rng(0).integers(0, 10, (10_000, 10))
    plot_label_heatmap(counts, tmp_path / "labels.png", "many")
    with Image.open(tmp_path / "labels.png") as image:
        assert image.height <= HEATMAP_MAX_INCHES * 110


def test_the_label_heatmap_of_a_million_classes_stays_drawable(tmp_path: Path) -> None:
    """A data set declaring 10,000,000 classes asked for a 550,000,220-pixel
    wide image, which matplotlib refuses (the run failed drawing it)."""
    counts = np.zeros((2, 1_000_000), np.int64)
    counts[:, :3] = 5
    plot_label_heatmap(counts, tmp_path / "labels.png", "many classes")
    with Image.open(tmp_path / "labels.png") as image:
        assert image.width <= 2 * HEATMAP_MAX_INCHES * 110


def test_the_summary_holds_the_last_personal_evaluation() -> None:
    """personal-eval-every=3 over 4 rounds: the clients were evaluated in
    round 3, so that is the summary's final-personal, with its round (it
    was null unless the last round evaluated)."""
    personal = {0: {"global-accuracy": 0.5, "local-accuracy": 0.9},
                1: {"global-accuracy": 0.6, "local-accuracy": 0.7}}  # fmt: skip
    history = rows([(0.5, 1.0)] * 4)
    history[2] = dataclasses.replace(history[2], personal=personal)
    summary = summarize(history, "completed", 4.0)
    assert summary["final-personal-round"] == 3
    assert summary["final-personal"]["local"] == history[2].personal_stats("local")
    assert summarize(rows([(0.5, 1.0)]), "completed", 1.0)["final-personal"] is None


def test_a_resumed_run_records_the_settings_it_now_has(tmp_path: Path) -> None:
    """rounds may be raised on resume: settings.json says what the run now
    is (it kept the first run's rounds=2 after 4 rounds, and pollen report
    grouped it with 2-round runs)."""
    from pollen import server_app
    from pollen.runs.checkpoints import Checkpoint, save_checkpoint

    first = Settings.from_run_config({"rounds": 2})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "settings.json").write_text(
        json.dumps({**first.to_run_config(), "run-name": "run"})
    )
    model = {"w": np.zeros(2, np.float32)}
    extra = resumable_extra(first.to_run_config())
    save_checkpoint(run_dir, Checkpoint(2, model, {}, extra), 2)
    resumed = Settings.from_run_config(
        {**first.to_run_config(), "rounds": 4, "resume": str(run_dir)}
    )
    server_app._open_run_dir(resumed)
    recorded = json.loads((run_dir / "settings.json").read_text())
    assert recorded["rounds"] == 4 and recorded["run-name"] == "run"


def test_the_epsilon_a_skipped_rounds_clients_report_is_counted(tmp_path: Path) -> None:
    """The clients of a round skipped for too few replies trained with DP-SGD
    all the same: the largest epsilon reported counts (it was dropped, so
    the history and the summary said 1.0 where a client had spent 2.0)."""
    from pollen.protocol import DP_EPSILON
    from pollen.strategies.aggregation import ClientUpdate

    def outcome(epsilons: dict[int, float], skipped: bool) -> RoundOutcome:
        updates = [
            ClientUpdate(c, {}, {DP_EPSILON: e}, 1.0) for c, e in epsilons.items()
        ]
        return RoundOutcome(
            arrays=ArrayRecord(), clients=list(epsilons), updates=updates,
            bytes_down=0, bytes_up=0, skipped=skipped, failures=[], clipped=[],
            evaluating=[], eval_bytes=0, personal={},
        )  # fmt: skip

    settings = Settings.from_run_config({"rounds": 2, "dp": True, "model": "cnn-gn"})
    recorder = RoundRecorder(settings, [], tmp_path, Notifier.from_settings("", 1), "r")
    recorder.record(1, outcome({0: 1.0, 1: 1.0}, skipped=False), 1.0, 0.5, 0.1)
    last = recorder.record(2, outcome({0: 2.0}, skipped=True), 1.0, 0.5, 0.1)
    assert last.dp_epsilon == 2.0


def test_a_nan_loss_is_null_in_history_and_summary_json(tmp_path: Path) -> None:
    """A diverged `pollen centralized` epoch's NaN loss was written as bare
    NaN, which is not JSON; it reads back as NaN."""
    import math

    from pollen.files import write_json
    from pollen.runs.results import RoundRecord, summarize, write_history

    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    common = {"lr": 0.5, "seconds": 1.0, "bytes_up": 0, "bytes_down": 0}
    history = [
        RoundRecord(round=1, accuracy=0.42, loss=1.9, **common),
        RoundRecord(round=2, accuracy=0.1, loss=math.nan, **common),
    ]
    write_history(tmp_path, history)
    rows = json.loads((tmp_path / "history.json").read_text(), parse_constant=refuse)
    assert rows[1]["loss"] is None and math.isnan(RoundRecord.from_row(rows[1]).loss)
    write_json(tmp_path / "summary.json", summarize(history, "completed", 3.0))
    summary = json.loads((tmp_path / "summary.json").read_text(), parse_constant=refuse)
    assert summary["final-loss"] is None


def test_seconds_left_is_the_mean_round_so_far_times_the_rounds_to_go() -> None:
    history = [dataclasses.replace(r, seconds=float(r.round))  # 1, 2 and 3 s
               for r in rows([(0.5, 1.0)] * 3)]  # fmt: skip
    assert seconds_left(history, 10) == pytest.approx(2.0 * 7)  # mean 2 s, 7 to go
    assert seconds_left(history[:1], 1) == 0.0
