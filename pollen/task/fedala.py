"""FedALA: each client starts its round from a learned, element-wise mix of
the global model and its own previous one.

FedALA (Zhang et al. 2023, "FedALA: Adaptive Local Aggregation for
Personalized Federated Learning", https://arxiv.org/abs/2212.01197,
Algorithm 1) replaces a client's overwrite of its model by the received
global model theta with adaptive local aggregation (ALA). With theta_i its
model after its previous round, the last p parameter tensors (the higher
layers) start from

    theta_hat = theta_i + (theta - theta_i) * W_i,    W_i in [0, 1] element-wise

and every lower tensor from theta. W_i (ones at first) is the client's
state, learned on a random share s of its training examples, batch by
batch, with theta and theta_i fixed:

    W_i <- clip(W_i - eta * grad_{theta_hat} L(theta_hat) * (theta - theta_i), 0, 1)

The client's first aggregation learns W_i until the standard deviation of
the last 10 epochs' losses is below 0.1 (at most `START_EPOCHS` epochs),
each later one for one epoch; a client's first round has no theta_i and
starts from theta. Training then runs from theta_hat as usual and the reply
is its model (FedAvg's aggregation); a round whose training diverged keeps
the state it started from. A personal evaluation tests the mix of the
newest global model and the client's last trained one with the W_i it
learned last (against the previous global model; PFLlib learns one more
epoch first). pollen samples the share at random (PFLlib: a random
contiguous slice, full batches only; pollen keeps the last, smaller one)
and mixes parameters only (BatchNorm statistics: the global model's). Keys: `ala-layers` p (preset `fedala`: 2, the classifier's
weight and bias), `ala-sample` s (0.8) and `ala-eta` (1.0).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, Context
from torch import nn
from torch.func import functional_call

from ..protocol import fedala_state_key, fedala_weights_key
from .local_run import LocalRun, Outcome, Training
from .objectives import LocalObjective, diverged
from .train import has_batch_norm

START_EPOCHS = 50  # the first aggregation's cap (the paper's loop has none)
STABLE_LOSSES = 10  # the first aggregation stops once the last 10 epochs' losses
STABLE_STD = 0.1  # have a standard deviation below this
SAMPLE_SEED_OFFSET = 12  # after the other passes' seeds (0, 3, 6, 9)


def kept(
    context: Context, client: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None] | None:
    """The client's previous model and its W_i (None before they are learned);
    None before its first round."""
    model = context.state.get(fedala_state_key(client))
    if not isinstance(model, ArrayRecord):
        return None
    weights = context.state.get(fedala_weights_key(client))
    learned = (
        weights.to_torch_state_dict() if isinstance(weights, ArrayRecord) else None
    )
    return model.to_torch_state_dict(), learned


def tested(model: nn.Module, context: Context, client: int) -> nn.Module:
    """What the client's personal evaluation tests: the received model
    (`model`) mixed with the client's last trained one by its last W_i (as
    its next round would start, with no new W); `model` until W_i is
    learned, from the client's second round on."""
    if (ala := kept(context, client)) is not None and ala[1] is not None:
        mix(model, *ala)
    return model


def higher(model: nn.Module, layers: int) -> list[str]:
    """The names of `model`'s last `layers` trainable parameter tensors."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return names[-layers:]


def mix(
    model: nn.Module,
    previous: dict[str, torch.Tensor],
    weights: dict[str, torch.Tensor],
) -> None:
    """theta_hat = theta_i + (theta - theta_i) * W in place, for the tensors
    `weights` names; `model` holds theta (on its device, where the mix is)."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, w in weights.items():
            param = params[name]
            local = previous[name].to(param.device)
            param.copy_(local + (param - local) * w.to(param.device))


def learned_weights(
    run: LocalRun,
    previous: dict[str, torch.Tensor],
    weights: dict[str, torch.Tensor] | None,
    sample: float,
    eta: float,
) -> dict[str, torch.Tensor]:
    """W_i learned on a random `sample` share of the client's examples (from
    ones, until stable, where `weights` is None; else one epoch from them)."""
    model, s = run.model, run.settings
    params = dict(model.named_parameters())
    names = list(weights) if weights else higher(model, s.ala_layers)
    glob = {n: params[n].detach().clone() for n in names}
    local = {n: previous[n].to(run.device) for n in names}
    w = {
        n: (weights or {}).get(n, torch.ones_like(glob[n])).to(run.device)
        for n in names
    }
    buffers = {n: b.clone() for n, b in model.named_buffers()}  # not moved by ALA
    generator = torch.Generator().manual_seed(run.seed + SAMPLE_SEED_OFFSET)
    count = max(int(sample * len(run.y)), 1)
    chosen = torch.randperm(len(run.y), generator=generator)[:count].to(run.device)
    smallest = 2 if has_batch_norm(model) else 1  # BatchNorm cannot take one
    batches = [idx for idx in chosen.split(s.batch_size) if len(idx) >= smallest]
    losses: list[float] = []  # the last batch's, each epoch (as PFLlib keeps them)
    model.train()
    for _ in range(START_EPOCHS if weights is None and batches else 1):
        for idx in batches:
            mixed = {
                n: (local[n] + (glob[n] - local[n]) * w[n]).requires_grad_()
                for n in names
            }
            inputs = run.prep(run.x[idx], None)
            logits = functional_call(model, {**mixed, **buffers}, (inputs,))
            loss = F.cross_entropy(logits, run.y[idx])
            grads = torch.autograd.grad(loss, list(mixed.values()))
            for n, grad in zip(names, grads, strict=True):
                w[n] = torch.clamp(w[n] - eta * grad * (glob[n] - local[n]), 0, 1)
        if batches:
            losses.append(float(loss.detach()))
        recent = losses[-STABLE_LOSSES:]
        if len(losses) > STABLE_LOSSES and np.std(recent) < STABLE_STD:
            break
    return w


@dataclass(frozen=True)
class FedAla:
    """The round's `training` from theta_hat (ALA first where the client has
    a previous model); the trained model and W_i kept after it."""

    sample: float
    eta: float
    training: Training

    def __call__(
        self, run: LocalRun, objective: LocalObjective, context: Context
    ) -> Outcome:
        state = kept(context, run.client)
        weights = None
        if state is not None:
            previous, start = state
            weights = learned_weights(run, previous, start, self.sample, self.eta)
            mix(run.model, previous, weights)
        outcome = self.training(run, objective, context)
        if diverged(run.model):  # the server drops the reply; the state stays
            return outcome
        model = {k: v.detach().cpu() for k, v in run.model.state_dict().items()}
        context.state[fedala_state_key(run.client)] = ArrayRecord(model)
        if weights is not None:
            context.state[fedala_weights_key(run.client)] = ArrayRecord(
                {n: w.cpu() for n, w in weights.items()}
            )
        return outcome
