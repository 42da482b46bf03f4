"""Ditto: a personal model beside the global one, pulled towards it.

Ditto (Li et al. 2021, "Ditto: Fair and Robust Federated Learning Through
Personalization", https://arxiv.org/abs/2012.04221, Algorithm 1) keeps on
each client k a personal model v_k that never travels. After the round's
training of the global model, v_k (the received model before its first
round) trains `local-epochs` on F_k(v) + lambda/2 ||v - w^t||^2, w^t the
received global model, and stays in `context.state`; the client's personal
evaluation uses v_k. Chosen by `ditto-lambda` > 0 (preset `ditto`: 0.1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from flwr.app import ArrayRecord, Context
from torch import nn

from ..protocol import ditto_state_key
from .inputs import placed_model
from .local_run import LocalRun, Outcome, Training
from .objectives import LocalObjective, ProxTerm, diverged


def personal_state(context: Context, client: int) -> dict[str, torch.Tensor] | None:
    """The client's personal model v_k as kept; None before its first round."""
    stored = context.state.get(ditto_state_key(client))
    return stored.to_torch_state_dict() if isinstance(stored, ArrayRecord) else None


def tested(model: nn.Module, context: Context, client: int) -> nn.Module:
    """What the client's personal evaluation tests: v_k (the assembled
    `model` before the client's first round)."""
    if (v_k := personal_state(context, client)) is not None:
        model.load_state_dict(v_k)
    return model


@dataclass(frozen=True)
class Ditto:
    """The global model's `training`, then the personal model's step with
    pull `lam` towards the received model (`new_model` builds its network)."""

    lam: float
    training: Training
    new_model: Callable[[], nn.Module]

    def __call__(
        self, run: LocalRun, objective: LocalObjective, context: Context
    ) -> Outcome:
        received = {k: v.detach().clone() for k, v in run.model.state_dict().items()}
        outcome = self.training(run, objective, context)
        self.personal(run, context, received)
        return outcome

    def personal(
        self, run: LocalRun, context: Context, received: dict[str, torch.Tensor]
    ) -> None:
        """Train v_k on the client's examples with the proximal pull; keep it."""
        personal = self.new_model()
        start = personal_state(context, run.client)
        personal.load_state_dict(received if start is None else start)
        personal = placed_model(run.settings, personal, run.device)
        pull = ProxTerm(self.lam)
        pull.anchor = {
            name: received[name].to(run.device)
            for name, p in personal.named_parameters()
            if p.requires_grad
        }
        run.epochs(
            personal, run.settings.local_epochs, LocalObjective(regularizer=pull), 6
        )
        if diverged(personal):  # a non-finite v_k would stay so: keep the last
            return
        state = {k: v.detach().cpu() for k, v in personal.state_dict().items()}
        context.state[ditto_state_key(run.client)] = ArrayRecord(state)
