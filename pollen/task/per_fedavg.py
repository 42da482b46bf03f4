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
meta-gradient). alpha is the client's `lr` (which the server's schedule
lowers), beta `per-fedavg-beta` (preset `per-fedavg`: 0.005, fixed),
applied by the client's optimiser (its momentum, weight decay and
`max-grad-norm`). Consecutive batches pair up across the round's epochs,
so `local-epochs` x n batches give that many // 2 steps; a shard of one
batch steps once on its two halves. Both passes move BatchNorm's
statistics, as in PFLlib. The server averages as FedAvg does. A personal
evaluation first takes the one step the method is trained for, w - alpha
grad f_i(w; D) on a batch of the client's training shard (`adapted`), as
the paper and PFLlib (at the commit `benchmarks/pfllib_side_by_side.py`
records) do.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from flwr.app import Context

from ..protocol import TRAIN_LOSS
from .local_run import ADAPT_SEED_OFFSET, LocalRun, Outcome
from .objectives import LocalObjective
from .train import (
    Batch,
    OptimizerStep,
    ShuffledBatches,
    TrainResult,
    has_batch_norm,
    trainable,
)


def _pairs(stream: Iterator[Batch], smallest: int) -> Iterator[tuple[Batch, Batch]]:
    """Consecutive batches of `stream` two by two (an odd last one left out);
    a stream of one batch gives its two halves, each of `smallest`+ examples."""
    batches = iter(stream)
    first, second = next(batches, None), next(batches, None)
    if first is not None and second is None:
        x, y = first
        half = len(y) // 2
        if half >= smallest and len(y) - half >= smallest:
            yield (x[:half], y[:half]), (x[half:], y[half:])
        return
    if first is None or second is None:
        return
    yield first, second
    for batch in batches:
        following = next(batches, None)
        if following is None:
            return
        yield batch, following


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
        stream = (batch for epoch in batches.epochs() for batch in epoch)
        smallest = 2 if has_batch_norm(model) else 1
        for (x, y), (x_next, y_next) in _pairs(stream, smallest):
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
                f"a shard of {len(run.y)} samples gives no Per-FedAvg step: each "
                f"takes two batches, or one batch's halves of {smallest}+ examples"
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
