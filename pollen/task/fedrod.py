"""FedRoD: a shared model trained for the balanced risk, and a personal head beside it.

FedRoD (Chen and Chao 2022, "On Bridging Generic and Personalized Federated
Learning for Image Classification", https://arxiv.org/abs/2107.00778,
Section 4 and Algorithm 1) gives each client's model two duties. The shared
model (body f and generic head h_G, averaged by the server as FedAvg
averages) trains on client k for the balanced softmax, so that every
client's objective estimates the same class-balanced risk:

    L_BSM(x, y) = -log( n_{k,y} exp(g_y) / sum_c n_{k,c} exp(g_c) ),   g = h_G(f(x))

with n_{k,c} the client's training examples of class c (a class it lacks
drops out). Its personal head h_P, an `nn.Linear` shaped as the classifier
that never travels, learns on the same batches the client's own risk on
top of the generic prediction:

    L_P(x, y) = CE( g + h_P(z), y ),   z = f(x),   g and z held fixed

and the client's personal model predicts g + h_P(z). In pollen h_P steps
on each batch from the shared model's own forward pass (a hook on the
classifier reads z and g before the shared model's step), with the client's
optimiser at the round's rate and no gradient clipping, as PFLlib's
`clientrod` does; h_P starts as a copy of the received classifier in the
client's first round (PFLlib copies the initial head). The balanced softmax
is the data loss of whichever local objective the run uses. A round whose
training diverged keeps the head it started from. Chosen by
`personal-head = true` (preset `fedrod`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, Context
from torch import nn
from torch.nn.utils import skip_init

from ..protocol import fedrod_head_key
from .local_run import LocalRun, Outcome, Training
from .objectives import LocalObjective, diverged
from .representation import Representation, classifier
from .train import ClientOptimizer

METHOD = "FedRoD"


def log_label_counts(y: torch.Tensor, classes: int) -> torch.Tensor:
    """log n_c for each of `classes` classes in the labels `y` (-inf where
    there are none: the balanced softmax gives that class no mass)."""
    return torch.bincount(y, minlength=classes).float().log()


def personal_head(model: nn.Module, context: Context, client: int) -> nn.Linear:
    """The client's h_P as kept, on `model`'s device; a copy of `model`'s
    classifier's weights before the client's first round (a new module: a
    deep copy would carry the hooks other terms hold on the classifier)."""
    shared = classifier(model, METHOD)
    head = skip_init(  # no draw from torch's global generator: it is overwritten
        nn.Linear, shared.in_features, shared.out_features,
        bias=shared.bias is not None, device=shared.weight.device,
        dtype=shared.weight.dtype,
    )  # fmt: skip
    kept = context.state.get(fedrod_head_key(client))
    start = kept.to_torch_state_dict() if isinstance(kept, ArrayRecord) else None
    head.load_state_dict(shared.state_dict() if start is None else start)
    return head


class HeadLearner:
    """h_P of one client for one round, stepped on each batch the shared
    model trains on: `see` (a `LocalRun.on_batch`) takes the batch's labels,
    and the classifier's hook steps h_P when the training pass reaches it."""

    def __init__(
        self, model: nn.Module, head: nn.Linear, optimizer: ClientOptimizer
    ) -> None:
        self.head = head.train()
        self.optimizer = optimizer.build(list(head.parameters()))
        self.targets: torch.Tensor | None = None
        self._hook = classifier(model, METHOD).register_forward_hook(self._step)

    def see(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """The next training pass's labels (before its forward pass)."""
        self.targets = targets

    def _step(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        """One step of L_P at the pass's z and g; once per batch (SAM's
        second pass and evaluation passes find no labels)."""
        if self.targets is None or not module.training:
            return
        targets, self.targets = self.targets, None
        z, g = args[0].flatten(1).detach(), output.detach()
        with torch.enable_grad():
            loss = F.cross_entropy(g + self.head(z), targets)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
        self.optimizer.step()

    def close(self) -> None:
        self._hook.remove()


@dataclass(frozen=True)
class FedRod:
    """The shared model's `training` on the balanced softmax, with h_P
    stepped on each of its batches; h_P kept after it."""

    training: Training

    def __call__(
        self, run: LocalRun, objective: LocalObjective, context: Context
    ) -> Outcome:
        head = personal_head(run.model, context, run.client)
        learner = HeadLearner(run.model, head, run.optimizer)
        counts = log_label_counts(run.y, head.out_features)  # the classifier's classes
        balanced = replace(objective, log_label_counts=counts)
        try:
            outcome = self.training(
                replace(run, on_batch=learner.see), balanced, context
            )
        finally:
            learner.close()
        if not (diverged(run.model) or diverged(head)):
            state = {k: v.detach().cpu() for k, v in head.state_dict().items()}
            context.state[fedrod_head_key(run.client)] = ArrayRecord(state)
        return outcome


class PersonalPrediction(nn.Module):
    """The client's personal model: g + h_P(z), the shared model's logits
    plus its personal head's on the same representation."""

    def __init__(self, model: nn.Module, head: nn.Linear) -> None:
        super().__init__()
        self.model, self.head = model, head
        self.representation = Representation(model, METHOD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.model(x)
        return logits + self.head(self.representation.value)


def tested(model: nn.Module, context: Context, client: int) -> nn.Module:
    """What the client's personal evaluation tests: g + h_P(z), with the
    received shared model; that model alone before the client's first round."""
    if not isinstance(context.state.get(fedrod_head_key(client)), ArrayRecord):
        return model
    return PersonalPrediction(model, personal_head(model, context, client))
