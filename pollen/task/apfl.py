"""APFL: a personal model mixed with the global one, by a weight each client learns.

APFL (Deng, Kamani and Mahdavi 2020, "Adaptive Personalized Federated
Learning", https://arxiv.org/abs/2003.13461, Algorithm 1) keeps on client i
a personal model v_i and a mixing weight alpha_i, and uses the mixture

    v_bar_i = alpha_i v_i + (1 - alpha_i) w_i

with w_i the client's copy of the global model. At each local step t, on
the same batch xi, beside the global model's own step (FedAvg's, whose
reply is exactly FedAvg's):

    v_i     <- v_i - eta grad_v f_i(v_bar_i; xi) = v_i - eta alpha_i grad f_i(v_bar_i; xi)
    alpha_i <- alpha_i - eta grad_alpha f_i(v_bar_i; xi)
             = alpha_i - eta <v_i - w_i, grad f_i(v_bar_i; xi)>,   clipped to [0, 1]

all at the parameters before the step. The server averages the w_i as
FedAvg does (the reply is FedAvg's for a model without dropout, whose
masks the extra pass would shift); v_i and alpha_i never travel, and the
client's personal evaluation tests v_bar_i with the received global model
as w_i. The mixture mixes the trained parameters (frozen ones are the
same in both); its BatchNorm statistics are v_i's own, updated by the
mixed model's passes. v_i's steps are not clipped (`max-grad-norm` clips
w's). v_i starts at the received model in the client's first round,
alpha_i at `apfl-alpha` (preset `apfl`: 0.5); a round whose training
diverged keeps the state it started from. PFLlib trains v_i on its own
outputs and mixes once a round, with an L2 term on alpha (after FedTorch);
pollen follows the paper's per-step gradients.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, ConfigRecord, Context
from torch import nn
from torch.func import functional_call

from ..protocol import apfl_alpha_key, apfl_state_key
from .inputs import placed_model
from .local_run import LocalRun, Outcome, Training
from .objectives import LocalObjective, diverged
from .train import ClientOptimizer, trainable

ALPHA = "alpha"  # the config record's key


def kept(context: Context, client: int) -> tuple[dict[str, torch.Tensor], float] | None:
    """The client's v_i and alpha_i as kept; None before its first round."""
    stored = context.state.get(apfl_state_key(client))
    weight = context.state.get(apfl_alpha_key(client))
    if not isinstance(stored, ArrayRecord) or not isinstance(weight, ConfigRecord):
        return None
    return stored.to_torch_state_dict(), float(weight[ALPHA])


def mixed_state(
    global_model: nn.Module, personal: dict[str, torch.Tensor], alpha: float
) -> dict[str, torch.Tensor]:
    """v_bar's state dict, on `global_model`'s device: alpha v + (1 - alpha)
    w for every parameter, v's own entries for the buffers (BatchNorm's
    statistics)."""
    params = dict(global_model.named_parameters())
    device = next(iter(params.values())).device
    return {
        name: alpha * value.to(device) + (1 - alpha) * params[name].detach()
        if name in params
        else value.to(device)
        for name, value in personal.items()
    }


def tested(model: nn.Module, context: Context, client: int) -> nn.Module:
    """What the client's personal evaluation tests: v_bar_i, with the
    received global model (`model`) as w_i; `model` itself before the
    client's first round."""
    if (personal := kept(context, client)) is not None:
        model.load_state_dict(mixed_state(model, *personal))
    return model


class PersonalMixture:
    """v_i and alpha_i of one client for one round, stepped on each batch the
    global model sees (`step`, a `LocalRun.on_batch`)."""

    def __init__(
        self,
        global_model: nn.Module,
        personal: nn.Module,
        alpha: float,
        optimizer: ClientOptimizer,
    ) -> None:
        self.global_model = global_model
        self.personal = personal.train()
        self.lr = optimizer.lr
        self.params = trainable(personal)
        self.optimizer = optimizer.build(list(self.params.values()))
        device = next(iter(self.params.values())).device
        self._alpha = torch.tensor(float(alpha), device=device)

    @property
    def alpha(self) -> float:
        """alpha_i now (read once a round: no device sync per step)."""
        return float(self._alpha)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """One step of v_i and alpha_i on the batch, at the global model's
        parameters before its step.

        The chain rule through the mixture is written out, not left to
        autograd: with g the loss's gradient at v_bar = w + alpha (v - w),
        grad_v = alpha g and grad_alpha = <v - w, g>. Autograd's graph of
        alpha v + (1 - alpha) w passes over the model's entries five times
        and once more for each product its backward pass needs; this makes
        v - w, v_bar and alpha g, and takes one dot product, which cuts
        the mixture's own cost (beyond a second training step) by a half
        to three fifths on the catalogue's CNNs (docs/performance.md, and the
        autograd version's times in docs/lab-notes/algorithms.md)."""
        global_params = dict(self.global_model.named_parameters())
        with torch.no_grad():
            gaps = {n: v - global_params[n] for n, v in self.params.items()}
            mixed = {
                n: torch.addcmul(global_params[n], self._alpha, gap).requires_grad_()
                for n, gap in gaps.items()
            }
        logits = functional_call(self.personal, mixed, (inputs,), strict=False)
        loss = F.cross_entropy(logits, targets)
        grads = torch.autograd.grad(loss, list(mixed.values()))
        with torch.no_grad():
            grad_alpha = sum(
                torch.vdot(gap.reshape(-1), grad.reshape(-1))
                for gap, grad in zip(gaps.values(), grads, strict=True)
            )
            for param, grad in zip(self.params.values(), grads, strict=True):
                param.grad = grad.mul_(self._alpha)
        self.optimizer.step()
        self._alpha = (self._alpha - self.lr * grad_alpha).clamp(0.0, 1.0)


@dataclass(frozen=True)
class Apfl:
    """The global model's `training`, with v_i and alpha_i stepped on each of
    its batches (`new_model` builds v_i's network); both kept after it."""

    alpha: float
    training: Training
    new_model: Callable[[], nn.Module]

    def __call__(
        self, run: LocalRun, objective: LocalObjective, context: Context
    ) -> Outcome:
        personal = self.new_model()
        start = kept(context, run.client)
        personal.load_state_dict(run.model.state_dict() if start is None else start[0])
        alpha = self.alpha if start is None else start[1]
        mixture = PersonalMixture(
            run.model,
            placed_model(run.settings, personal, run.device),
            alpha,
            run.optimizer,
        )
        outcome = self.training(replace(run, on_batch=mixture.step), objective, context)
        alpha = mixture.alpha
        if diverged(run.model) or diverged(personal) or not math.isfinite(alpha):
            return outcome  # the server drops the reply; the state stays
        state = {k: v.detach().cpu() for k, v in personal.state_dict().items()}
        context.state[apfl_state_key(run.client)] = ArrayRecord(state)
        context.state[apfl_alpha_key(run.client)] = ConfigRecord({ALPHA: alpha})
        return outcome
