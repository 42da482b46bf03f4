"""The server's plateau schedule follows torch's ReduceLROnPlateau step by step,
and resumes from a checkpointed state with the learning rate it had reached."""

from __future__ import annotations

import json
import math

import pytest
import torch

from pollen.runs.lr_schedule import PlateauSchedule

# falls, plateaus (within and beyond the threshold), a NaN round, rises
LOSSES = [
    2.0, 1.5, 1.5, 1.49999, 1.6, 1.4, 1.4, 1.4, math.nan, 1.39, 1.39, 1.39,
    1.39, 1.39, 1.39, 1.0, 1.2, 1.2, 1.2, 1.2, 1.2, 1.2, 1.2, 1.2,
]  # fmt: skip
CASES = [  # factor, patience, threshold, cooldown, min_lr
    (0.5, 1, 1e-4, 0, 0.0),
    (0.1, 0, 1e-4, 2, 1e-4),
    (0.5, 2, 0.05, 1, 0.02),
]


def torch_lrs(lr: float, case: tuple, losses: list[float]) -> list[float]:
    factor, patience, threshold, cooldown, min_lr = case
    holder = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
        holder, mode="min", factor=factor, patience=patience,
        threshold=threshold, cooldown=cooldown, min_lr=min_lr,
    )  # fmt: skip
    lrs = []
    for loss in losses:
        scheduler.step(loss)
        lrs.append(holder.param_groups[0]["lr"])
    return lrs


def schedule(lr: float, case: tuple) -> PlateauSchedule:
    factor, patience, threshold, cooldown, min_lr = case
    return PlateauSchedule(lr, factor, patience, threshold, cooldown, min_lr)


@pytest.mark.parametrize("case", CASES)
def test_same_rates_as_torch(case: tuple) -> None:
    plateau = schedule(0.1, case)
    ours = [plateau.step(loss) for loss in LOSSES]
    assert ours == torch_lrs(0.1, case, LOSSES)
    assert ours[-1] < 0.1  # the sequence does cut the rate


@pytest.mark.parametrize("case", CASES)
def test_resumed_schedule_continues_where_it_stopped(case: tuple) -> None:
    whole = schedule(0.1, case)
    expected = [whole.step(loss) for loss in LOSSES]
    first = schedule(0.1, case)
    for loss in LOSSES[:12]:
        first.step(loss)
    saved = json.loads(json.dumps(first.state_dict()))  # as a checkpoint keeps it
    resumed = schedule(0.1, case)  # a new run starts at the configured lr
    resumed.load_state_dict(saved)
    assert resumed.lr == expected[11] < 0.1
    assert [resumed.step(loss) for loss in LOSSES[12:]] == expected[12:]


def test_resumes_from_torch_schedulers_checkpoint() -> None:
    """Checkpoints written before this module held torch's state dict."""
    factor, patience, threshold, _, _ = CASES[0]
    holder = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
        holder, factor=factor, patience=patience, threshold=threshold
    )
    for loss in LOSSES[:12]:
        scheduler.step(loss)
    resumed = schedule(0.1, CASES[0])
    resumed.load_state_dict(json.loads(json.dumps(scheduler.state_dict())))
    assert resumed.lr == holder.param_groups[0]["lr"] < 0.1
    ours = [resumed.step(loss) for loss in LOSSES[12:]]
    theirs = []
    for loss in LOSSES[12:]:
        scheduler.step(loss)
        theirs.append(holder.param_groups[0]["lr"])
    assert ours == theirs
