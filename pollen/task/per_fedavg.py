"""Per-FedAvg: FedAvg that trains for a model one gradient step from each client's own.

Per-FedAvg (Fallah, Mokhtari and Ozdaglar 2020, "Personalized Federated
Learning with Theoretical Guarantees: A Model-Agnostic Meta-Learning
Approach", https://arxiv.org/abs/2002.07948, Algorithm 1, first-order
version) minimises the mean over clients of F_i(w - alpha grad F_i(w)): a
global model from which one local step of rate alpha personalises well.
Each local step takes two batches D and D' and moves

    w_tmp = w - alpha grad f_i(w; D)
    w     <- w - beta grad f_i(w_tmp; D')

(the first-order approximation drops the Hessian term of the exact
meta-gradient). alpha is the client's `lr`, beta `per-fedavg-beta` (preset
`per-fedavg`: 0.005), applied by the client's optimiser (its momentum,
weight decay and `max-grad-norm`). An epoch of n batches gives n // 2
steps; both passes move BatchNorm's statistics, as in PFLlib. The server
averages as FedAvg does. A personal evaluation first takes the one step
the method is trained for, w - alpha grad f_i(w; D) on a batch of the
client's training shard (`adapted`); PFLlib takes that batch from the test
set, pollen from the training shard, as the paper does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from flwr.app import Context

from ..protocol import TRAIN_LOSS
from .local_run import ADAPT_SEED_OFFSET, LocalRun, Outcome
from .objectives import LocalObjective
from .train import (
    OptimizerStep,
    ShuffledBatches,
    TrainResult,
    has_batch_norm,
    trainable,
)


def _inner_step(
    params: list[torch.nn.Parameter], loss: torch.Tensor, alpha: float
) -> None:
    """params <- params - alpha grad loss (plain SGD, no state)."""
    grads = torch.autograd.grad(loss, params)
    with torch.no_grad():
        torch._foreach_add_(params, grads, alpha=-alpha)


@dataclass(frozen=True)
class PerFedAvg:
    """`local-epochs` of Per-FedAvg's first-order steps at outer rate `beta`."""

    beta: float

    def __call__(
        self, run: LocalRun, objective: LocalObjective, context: Context
    ) -> Outcome:
        s, model = run.settings, run.model
        batches = ShuffledBatches(
            run.x, run.y, run.prep, batch_size=s.batch_size,
            num_epochs=s.local_epochs, seed=run.seed,
            skip_single=has_batch_norm(model),
        )  # fmt: skip
        outer = OptimizerStep(
            model, replace(run.optimizer, lr=self.beta), s.max_grad_norm
        )
        params = list(trainable(model).values())
        torch.manual_seed(run.seed + 2)
        model.train()
        total, steps = torch.zeros((), device=run.device), 0
        for epoch in batches.epochs():
            pairs = iter(epoch)
            for (x, y), (x_next, y_next) in zip(pairs, pairs, strict=False):
                start = [p.detach().clone() for p in params]
                _inner_step(params, F.cross_entropy(model(x), y), run.optimizer.lr)
                outer.zero_grad()
                loss = F.cross_entropy(model(x_next), y_next)
                loss.backward()
                with torch.no_grad():
                    torch._foreach_copy_(params, start)
                outer.step()
                total += loss.detach()
                steps += 1
        if steps == 0:
            raise ValueError(
                f"a shard of {len(run.y)} samples gives no Per-FedAvg step (each "
                "takes two batches); lower batch-size or raise local-epochs"
            )
        result = TrainResult(float(total) / steps, len(run.y), steps)
        return result, {TRAIN_LOSS: result.loss}


def adapted(run: LocalRun) -> None:
    """The personalising step: w - alpha grad f_i(w; D), D the first batch
    of the client's shuffled training shard, alpha the client's lr."""
    s, model = run.settings, run.model
    batches = ShuffledBatches(
        run.x, run.y, run.prep, batch_size=s.batch_size, num_epochs=1,
        seed=run.seed + ADAPT_SEED_OFFSET, skip_single=has_batch_norm(model),
    )  # fmt: skip
    first = next(next(batches.epochs()), None)
    if first is None:  # a shard without a batch: nothing to adapt to
        return
    x, y = first
    model.train()
    params = list(trainable(model).values())
    _inner_step(params, F.cross_entropy(model(x), y), run.optimizer.lr)
