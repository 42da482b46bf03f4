"""The step after every round returns the run's next `Progress` as a value:
the learning rate it records is the one the round trained with, the schedule
steps after it, checkpoints hold the progress, and Ctrl-C checkpoints the
last finished round (`runs.loops`, `runs.progress`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord

from pollen.protocol import LR
from pollen.runs.checkpoints import load_checkpoint
from pollen.runs.interruption import RunInterrupted
from pollen.runs.loops import Federation, Loop, Records, _drive, finish_round
from pollen.runs.lr_schedule import PlateauSchedule
from pollen.runs.notify import Notifier
from pollen.runs.progress import ELAPSED, Progress, ServerParts, save_progress
from pollen.runs.recorder import RoundRecorder
from pollen.settings import Settings, SettingsError
from pollen.strategies.asynchronous import AsyncOptions
from pollen.strategies.fedopt import ServerAdam
from pollen.strategies.personal import PersonalEvaluation
from pollen.strategies.round import RoundOutcome
from pollen.strategies.strategy import Strategy
from pollen.task.client_state import KEEP_FROM

# every loss 1.0 and a threshold of 50%: round 1 sets the best, each later
# round is a plateau and (patience 0) halves the rate
PLATEAU = {"lr": 0.1, "lr-patience": 0, "lr-threshold": 0.5, "lr-factor": 0.5}


def model(value: float) -> ArrayRecord:
    return ArrayRecord({"w": Array(np.full(2, value, np.float32))})


def outcome(arrays: ArrayRecord) -> RoundOutcome:
    return RoundOutcome(
        arrays=arrays, clients=[0], updates=[], bytes_down=0, bytes_up=0,
        skipped=False, failures=[], clipped=[], evaluating=[], eval_bytes=0,
        personal={},
    )  # fmt: skip


def parts(settings: Settings) -> ServerParts:
    """A server with state to checkpoint: FedAdam's moments."""
    update = ServerAdam(server_lr=0.1)
    strategy = Strategy(num_clients=2, client_frac=1.0, seed=0, server_update=update)
    return ServerParts(
        strategy, PersonalEvaluation(None, 0), PlateauSchedule.from_settings(settings)
    )


def make_loop(config: dict, run_dir: Path) -> Loop:
    settings = Settings.from_run_config(config)
    recorder = RoundRecorder(settings, [], run_dir, Notifier.from_settings("", 1), "r")
    records = Records(lambda server_round, arrays: (1.0, 0.5), recorder, run_dir,
                      lambda: 1.5)  # fmt: skip
    federation = Federation(grid=None, membership=None, clock=None, simulation=True)
    return Loop(settings, federation, parts(settings), records)


def start(loop: Loop) -> Progress:
    return Progress(0, model(0.0), {KEEP_FROM: 0}, 0, loop.parts.state())


def test_a_finished_round_is_a_new_progress_recorded_with_the_lr_it_trained_with(
    tmp_path: Path,
) -> None:
    loop = make_loop({**PLATEAU, "rounds": 3, "checkpoint-every": 2}, tmp_path)
    before = start(loop)
    one = finish_round(loop, 1, outcome(model(1.0)), before)
    assert before.round == 0 and before.arrays["w"].numpy()[0] == 0.0  # unchanged
    assert (one.round, one.checkpointed, one.client_config) == (1, 0, {KEEP_FROM: 0})
    two = finish_round(loop, 2, outcome(model(2.0)), one)
    three = finish_round(loop, 3, outcome(model(3.0)), two)
    history = loop.records.recorder.history
    assert [r.lr for r in history] == [0.1, 0.1, 0.05]  # the rate each trained with
    assert loop.parts.schedule.lr == 0.025  # the next round's
    assert three.train_config(loop.parts.schedule.lr)[LR] == 0.025
    # round 2 is checkpointed (every 2), round 3 too (the last): clients may
    # forget their state from before each
    assert (two.checkpointed, two.client_config) == (2, {KEEP_FROM: 2})
    assert (three.checkpointed, three.client_config) == (3, {KEEP_FROM: 3})
    saved = load_checkpoint(tmp_path, 2)
    assert saved.model["w"][0] == 2.0
    assert saved.extra["lr-scheduler"]["_last_lr"] == [0.05]
    assert saved.extra[ELAPSED] == 1.5


def test_a_model_nothing_of_which_travels_keeps_its_lr(tmp_path: Path) -> None:
    """Under sharing local the server's model (so its test loss) never
    changes: that is no plateau, and the rate stays as it started."""
    loop = make_loop({**PLATEAU, "rounds": 3, "sharing": "local"}, tmp_path)
    progress = start(loop)
    for server_round in (1, 2, 3):
        progress = finish_round(loop, server_round, outcome(model(0.0)), progress)
    assert [r.lr for r in loop.records.recorder.history] == [0.1, 0.1, 0.1]
    assert loop.parts.schedule.lr == 0.1


def test_ctrl_c_checkpoints_the_last_finished_round(tmp_path: Path) -> None:
    """Round 2 is interrupted: round 1's model and state are checkpointed,
    as they were when round 1 was recorded."""
    loop = make_loop({**PLATEAU, "rounds": 3}, tmp_path)

    def play(server_round: int, progress: Progress) -> RoundOutcome:
        if server_round == 2:
            loop.parts.schedule.step(9.0)  # a change the checkpoint must not hold
            raise RunInterrupted()
        return outcome(model(float(server_round)))

    with pytest.raises(RunInterrupted):
        _drive(loop, start(loop), play)
    saved = load_checkpoint(tmp_path)
    assert saved.round == 1 and saved.model["w"][0] == 1.0
    assert saved.extra["lr-scheduler"]["_last_lr"] == [0.1]


def test_a_checkpointed_progress_restores_the_server_parts(tmp_path: Path) -> None:
    loop = make_loop({**PLATEAU, "rounds": 2}, tmp_path)
    progress = finish_round(loop, 1, outcome(model(1.0)), start(loop))
    progress = finish_round(loop, 2, outcome(model(2.0)), progress)
    save_progress(loop.settings, tmp_path, progress, 3.0)
    fresh = parts(loop.settings)
    arrays = fresh.restore(load_checkpoint(tmp_path), {"w"}, "mlp")
    assert arrays["w"].numpy()[0] == 2.0
    assert fresh.schedule == loop.parts.schedule
    state = fresh.state()
    assert state.arrays.keys() == progress.state.arrays.keys()
    with pytest.raises(SettingsError, match="entries of the checkpoint's model"):
        fresh.restore(load_checkpoint(tmp_path), {"w", "b"}, "mlp")


def test_a_restored_model_keeps_scalar_entries_scalar(tmp_path: Path) -> None:
    """BatchNorm's `num_batches_tracked` is a 0-d integer: restored as a 1-d
    array, every reply of a resumed run would be refused as the wrong shape
    (`np.ascontiguousarray` returns at least one dimension)."""
    loop = make_loop({**PLATEAU, "rounds": 2}, tmp_path)
    counter = np.array(7, np.int64)
    arrays = ArrayRecord({"w": Array(np.ones(2, np.float32)), "n": Array(counter)})
    progress = finish_round(loop, 1, outcome(arrays), start(loop))
    save_progress(loop.settings, tmp_path, progress, 3.0)
    restored = parts(loop.settings).restore(
        load_checkpoint(tmp_path), {"w", "n"}, "mlp"
    )
    assert restored["n"].numpy().shape == () and restored["n"].numpy() == 7
    assert restored["w"].numpy().flags.c_contiguous


def test_the_server_state_is_a_copy(tmp_path: Path) -> None:
    loop = make_loop(PLATEAU, tmp_path)
    state = loop.parts.state()
    loop.parts.schedule.step(1.0)
    assert state.schedule["best"] == float("inf")


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"mode": "async", "num-clients": 10, "client-frac": 0.4}, (4, 2)),
        ({"mode": "async", "concurrency": 3}, (3, 1)),
        ({"mode": "async", "concurrency": 6, "buffer-size": 5}, (6, 5)),
    ],
)
def test_async_options_default_to_a_synchronous_rounds_sample(config, expected):
    options = AsyncOptions.from_settings(Settings.from_run_config(config))
    assert (options.concurrency, options.buffer_size) == expected
