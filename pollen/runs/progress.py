"""Where a run stands between rounds, and the checkpoints that keep it.

The server loop carries a `Progress` from round to round: the global model
after the last finished round, the client-state keys every message carries,
the newest round a checkpoint holds and a copy of the server's state after
that round (`ServerState`). Each round's step returns a new one. The state
is copied when the round is recorded because the next round changes the
strategy before it finishes: a run stopped by Ctrl-C checkpoints the last
finished round from the `Progress` the loop holds (`save_progress`), and a
resumed run starts from its checkpoint (`ServerParts.restore`).
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from logging import INFO
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord
from flwr.common.logger import log

from ..protocol import LR
from ..settings import Settings, SettingsError
from ..strategies.personal import PersonalEvaluation
from ..strategies.strategy import Strategy, to_numpy
from .checkpoints import Checkpoint, model_problem, save_checkpoint
from .lr_schedule import SCHEDULE_KEY, PlateauSchedule

# A checkpoint's record of the run's seconds so far (ServerApp time, over
# every process that ran it), which a resumed run's total time continues.
ELAPSED = "elapsed-seconds"


@dataclass(frozen=True)
class ServerState:
    """A copy of the server's state beyond the model, as a checkpoint of
    one moment holds it."""

    arrays: dict[str, np.ndarray]  # the strategy's and which clients trained
    schedule: dict[str, Any]  # the learning-rate schedule's `state_dict`


@dataclass(frozen=True)
class ServerParts:
    """The server's parts whose state outlives a round: the strategy (server
    update, aggregator, control variate), the personal evaluation (which
    clients have trained) and the learning-rate schedule the loop steps."""

    strategy: Strategy
    personal: PersonalEvaluation
    schedule: PlateauSchedule

    def state(self) -> ServerState:
        """A copy of their state now."""
        arrays = {**self.strategy.state_arrays(), **self.personal.state_arrays()}
        return ServerState(
            {name: np.array(value, copy=True) for name, value in arrays.items()},
            copy.deepcopy(self.schedule.state_dict()),
        )

    def restore(
        self, checkpoint: Checkpoint, model_entries: Collection[str], model: str
    ) -> ArrayRecord:
        """Load their state from `checkpoint`; its global model, which must
        hold the entries of the run's `model` (their names, or a mapping of
        each to its shape, which is then checked too; refused in the words
        of `pollen run`'s check, `model_problem`). The history up to it is
        read back by the ServerApp, the clients' state by the clients."""
        if problem := model_problem(checkpoint, model_entries, model):
            raise SettingsError(problem)
        self.strategy.load_state_arrays(checkpoint.strategy_state)
        self.personal.load_state_arrays(checkpoint.strategy_state)
        self.schedule.load_state_dict(checkpoint.extra[SCHEDULE_KEY])
        print(f"pollen: resuming after round {checkpoint.round}", flush=True)
        return ArrayRecord(
            {k: Array(np.asarray(v, order="C")) for k, v in checkpoint.model.items()}
        )


@dataclass(frozen=True)
class Progress:
    """The run after its last finished round (0 before the first)."""

    round: int
    arrays: ArrayRecord  # the global model after it
    client_config: Mapping[str, str | int]  # client-state keys of every message
    checkpointed: int  # the newest round a checkpoint holds
    state: ServerState  # the server's state after `round`

    def train_config(self, lr: float) -> ConfigRecord:
        """A training message's config: the learning rate and the client-state keys."""
        return ConfigRecord({LR: lr, **self.client_config})

    def eval_config(self, lr: float) -> ConfigRecord:
        """A personal-evaluation message's config: the learning rate a
        fine-tuning client trains at (`fine-tune-epochs`) and the
        client-state keys."""
        return ConfigRecord({LR: lr, **self.client_config})


def save_progress(
    settings: Settings, run_dir: Path, progress: Progress, elapsed: float
) -> None:
    """Checkpoint `progress` (its round, model and server state) with the
    run's settings and its seconds so far."""
    checkpoint = Checkpoint(
        round=progress.round,
        model=to_numpy(progress.arrays),
        strategy_state=progress.state.arrays,
        extra={
            "settings": settings.to_run_config(),
            SCHEDULE_KEY: progress.state.schedule,
            ELAPSED: elapsed,
        },
    )
    path = save_checkpoint(run_dir, checkpoint, settings.checkpoint_keep)
    log(INFO, "pollen: checkpoint of round %d in %s", progress.round, path)
