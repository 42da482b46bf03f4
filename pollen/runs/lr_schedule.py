"""The server's learning-rate schedule: ReduceLROnPlateau's rule on the test loss.

The server has no optimiser, only a learning rate it sends to the clients.
torch's `ReduceLROnPlateau` needs an optimiser to hold that number, and
constructing any torch optimiser imports `torch._dynamo` (about 2 s on a
2-core machine), on the critical path of every run's start-up. This is the
same rule (mode `min`, relative threshold, patience, cooldown, floor) without
one. Its state carries the learning rate itself, under the keys torch's
scheduler uses, so checkpoints written by either resume with the rate they
had reached.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..settings import Settings

SCHEDULE_KEY = "lr-scheduler"  # a checkpoint's `extra` entry for the schedule's state
# the state a checkpoint keeps; the rest comes from the run's settings
_STATE_KEYS = ("best", "num_bad_epochs", "cooldown_counter")


def state_problem(state: Any) -> str | None:
    """What keeps `state` (a checkpoint's, `PlateauSchedule.state_dict`'s
    shape) from being continued, or None: counters that are integers >= 0,
    a best loss and one positive learning rate."""
    if not isinstance(state, dict):
        return "is not a JSON object"
    for key in ("num_bad_epochs", "cooldown_counter"):
        value = state.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return f"has {key}={value!r}, not an integer >= 0"
    best = state.get("best")
    if isinstance(best, bool) or not isinstance(best, int | float):
        return f"has best={best!r}, not a number"
    last = state.get("_last_lr")
    if (
        not isinstance(last, list)
        or len(last) != 1
        or isinstance(last[0], bool)
        or not isinstance(last[0], int | float)
        or not 0 < last[0] < math.inf
    ):
        return f"has _last_lr={last!r}, not [one learning rate > 0]"
    return None


@dataclass
class PlateauSchedule:
    """Multiply `lr` by `factor` (not below `min_lr`) after more than
    `patience` steps without the loss falling below best * (1 - threshold);
    then wait `cooldown` steps before counting again."""

    lr: float
    factor: float
    patience: int
    threshold: float
    cooldown: int
    min_lr: float
    eps: float = 1e-8  # smaller cuts are not made
    best: float = math.inf
    num_bad_epochs: int = 0
    cooldown_counter: int = 0

    @classmethod
    def from_settings(cls, settings: Settings) -> PlateauSchedule:
        """The run's schedule: `lr` and the `lr-*` keys, `min-lr`."""
        s = settings
        return cls(
            s.lr, s.lr_factor, s.lr_patience, s.lr_threshold, s.lr_cooldown, s.min_lr
        )

    def step(self, loss: float) -> float:
        """Record one round's loss; return the learning rate for the next."""
        if loss < self.best * (1 - self.threshold):  # NaN is never better
            self.best, self.num_bad_epochs = loss, 0
        else:
            self.num_bad_epochs += 1
        if self.cooldown_counter > 0:
            self.cooldown_counter -= 1
            self.num_bad_epochs = 0
        if self.num_bad_epochs > self.patience:
            cut = max(self.lr * self.factor, self.min_lr)
            if self.lr - cut > self.eps:
                self.lr = cut
            self.cooldown_counter, self.num_bad_epochs = self.cooldown, 0
        return self.lr

    def state_dict(self) -> dict[str, Any]:
        """The progress to checkpoint: counters, best loss and current lr."""
        return {
            **{key: getattr(self, key) for key in _STATE_KEYS},
            "_last_lr": [self.lr],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()`'s output (or torch's scheduler's);
        ValueError if `state_problem` finds one."""
        if problem := state_problem(state):
            raise ValueError(f"the learning-rate schedule's state {problem}")
        for key in _STATE_KEYS:
            setattr(self, key, type(getattr(self, key))(state[key]))
        self.lr = float(state["_last_lr"][0])
