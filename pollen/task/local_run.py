"""One round's local training on one client, and the shape of a training schedule.

A `LocalRun` holds what a round trains with: the client's assembled model,
its examples (after any label flip, `pollen.task.attacks`), the optimiser,
the preprocessing and the round's seed; `LocalRun.epochs` is the one pass
every schedule is made of (`pollen.task.train.train_local`).

A `Training` is what the round runs on it: `plain` epochs here, FedRep's
head-then-body phases (`pollen.task.fedrep`), DP-SGD (`pollen.task.privacy`),
Ditto's personal model after the global one (`pollen.task.ditto`) and the
other personal schedules; `pollen.task.schedule` picks one from the
settings. Each pass draws from its own seeds (`seed`, `seed + 3`, `seed + 6`:
`train_local` uses three from its seed; `seed + 9` what a personal
evaluation trains first, `seed + 12` FedALA's sample).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from flwr.app import Context
from torch import nn

from ..protocol import TRAIN_LOSS
from ..settings import Settings
from .cohort import check_steps, cohort_problem, train_cohort
from .objectives import LocalObjective
from .sharing import Sharing
from .train import BatchHook, ClientOptimizer, TrainResult, Transform, train_local

Outcome = tuple[TrainResult, dict[str, float]]  # the result, its own metrics
# the seed offset of what a personal evaluation trains first (FedBABU's
# fine-tuning, Per-FedAvg's step): after the round's passes (0, 3, 6)
ADAPT_SEED_OFFSET = 9


@dataclass
class LocalRun:
    """One round's local training on one client: its model and sharing
    policy, examples, optimiser, preprocessing and seed."""

    settings: Settings
    client: int
    model: nn.Module
    sharing: Sharing
    device: torch.device
    x: torch.Tensor
    y: torch.Tensor
    optimizer: ClientOptimizer
    prep: Transform
    seed: int
    on_batch: BatchHook | None = None  # sees each batch first (APFL)

    def epochs(
        self,
        model: nn.Module,
        epochs: int,
        objective: LocalObjective,
        seed_offset: int = 0,
    ) -> TrainResult:
        """`epochs` of SGD steps on `model` for `objective`."""
        s = self.settings
        return train_local(
            model, self.x, self.y,
            epochs=epochs, batch_size=s.batch_size, optimizer=self.optimizer,
            preprocess=self.prep, seed=self.seed + seed_offset,
            max_grad_norm=s.max_grad_norm, objective=objective,
            on_batch=self.on_batch,
        )  # fmt: skip

    def check_steps(self) -> None:
        """Raise, before any training, when the shard gives no step."""
        s = self.settings
        check_steps(self.model, len(self.y), s.batch_size, s.local_epochs)


class Training(Protocol):
    """What one round trains: the model of `run` for `objective`, with the
    client's `context.state` for what it keeps between rounds."""

    def __call__(
        self, run: LocalRun, objective: LocalObjective, context: Context
    ) -> Outcome: ...


def cohort_epochs(
    runs: list[LocalRun], objectives: list[LocalObjective]
) -> list[TrainResult]:
    """`local-epochs` of every run's model for its objective, trained together
    as one vectorised cohort (`pollen.task.cohort`): the results `plain`
    gives each run, in one computation. The runs share the settings and the
    optimiser; a model or objective the cohort trainer cannot reproduce is
    refused with the reason."""
    first, s = runs[0], runs[0].settings
    if problem := cohort_problem(first.model, objectives[0], first.optimizer):
        raise ValueError(problem)
    return train_cohort(
        [run.model for run in runs], [(run.x, run.y) for run in runs],
        epochs=s.local_epochs, batch_size=s.batch_size, optimizer=first.optimizer,
        preprocess=[run.prep for run in runs], seeds=[run.seed for run in runs],
        objectives=objectives, max_grad_norm=s.max_grad_norm,
        memory_bytes=int(s.cohort_memory_mib * 2**20),
    )  # fmt: skip


def plain(run: LocalRun, objective: LocalObjective, context: Context) -> Outcome:
    """`local-epochs` of the model for the objective; their mean loss."""
    result = run.epochs(run.model, run.settings.local_epochs, objective)
    return result, {TRAIN_LOSS: result.loss}
