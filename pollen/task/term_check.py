"""A user's local-objective term, tried for one step before anything starts.

A regulariser of the user's own (docs/extending.md) runs inside every
client's training loop: one whose `pull` is a tensor makes every client
fail on Flower's metric record, and one whose `add_gradients` sets a
parameter's gradient to None trains nothing without a word (the optimiser
skips that parameter). Both show on one step of a batch of two zeros
through the run's freshly built model, which costs milliseconds for the
models a term is written for, so the `pollen` command tries it there, on
the run's own settings, and refuses a term that does either. The term is
loaded at the received model with an empty training message and client
state, as a client's first round loads it; a term that needs more from the
message than that is not tried (the clients will say what it lacks).
"""

from __future__ import annotations

import copy
import math
from numbers import Real

import torch
from flwr.app import Context, RecordDict
from torch import nn
from torch.nn import functional

from ..common.few import few
from ..settings import Settings
from .inputs import shape_model
from .models import LORA_MODELS, data_shape
from .objectives import LocalObjective
from .sharing import Sharing
from .train import trainable

# a model larger than this is not built again for the check: not cheap
TRIED_UP_TO_PARAMETERS = 20_000_000


def term_problem(settings: Settings) -> str | None:
    """Why the run's local objective's term cannot train, from one step on
    a batch of two zeros, or None (no term, a model too large or loaded from
    files to build again here, or a term that needs what only a client's
    training message carries)."""
    objective = LocalObjective.from_settings(settings)
    if objective.regularizer is None or settings.model in LORA_MODELS:
        return None
    shape, classes = data_shape(settings.data_set)
    model = copy.deepcopy(shape_model(settings))  # trained here: a copy
    if sum(p.numel() for p in model.parameters()) > TRIED_UP_TO_PARAMETERS:
        return None
    named = trainable(model)  # what the training loop hands the term
    try:
        objective.load(
            Context(0, 0, {}, RecordDict(), {}), 0, model,
            Sharing.of(settings.sharing_policy, model), RecordDict(),
        )  # fmt: skip
    except Exception:  # it needs what a training message carries: not tried
        return None
    try:
        with_gradient = _one_backward(model, shape, classes)
    except Exception:  # the model cannot train here (a GPU-only layer): not tried
        return None
    who = f"local-objective={settings.local_objective!r}: its term"
    try:
        objective.add_regularizer_gradient(named)
        pull = objective.pull
    except Exception as err:
        return f"{who} raised {type(err).__name__}: {err} on one step of a batch"
    if settings.client_optimizer == "sgd" and not _finite_number(pull):
        # SGD's replies carry FedNova's effective steps, computed from the pull
        return (
            f"{who}'s pull is {_described(pull)}; expected a finite float (a number "
            "each reply's metrics carry)"
        )
    lost = [name for name in with_gradient if named[name].grad is None]
    if lost:
        return (
            f"{who} left no gradient on {few([repr(name) for name in lost])}"
            " after one step of a batch: add_gradients must add to param.grad, "
            "not set it to None (the optimiser would skip those entries)"
        )
    return None


def _finite_number(value: object) -> bool:
    """Whether `value` is a finite Python int or float (what Flower's
    metric records take; a numpy float32 or a tensor they refuse)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return math.isfinite(value)


def _one_backward(model: nn.Module, shape: tuple[int, ...], classes: int) -> list[str]:
    """The data loss's gradient for a batch of two zeros (in training mode,
    as a client computes it); the parameters that have one."""
    model.train()
    inputs = torch.zeros(2, *shape)
    loss = functional.cross_entropy(model(inputs), torch.zeros(2, dtype=torch.long))
    loss.backward()
    return [name for name, p in model.named_parameters() if p.grad is not None]


def _described(value: object) -> str:
    """A value by its type (and a tensor's shape), not its contents."""
    if isinstance(value, torch.Tensor):
        return f"a Tensor of shape {list(value.shape)}"
    return f"a {type(value).__name__}" if not isinstance(value, Real) else repr(value)
