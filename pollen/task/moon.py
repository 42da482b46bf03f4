"""MOON's model-contrastive loss: a client's representation pulled towards the
global model's and pushed away from its own previous model's.

MOON (Li, He and Song 2021, "Model-Contrastive Federated Learning",
https://arxiv.org/abs/2103.16257, Algorithm 1, eq. 3-4) adds to client k's
loss on a batch, for each example x,

    l_con = -log( exp(sim(z, z_glob) / tau)
                  / (exp(sim(z, z_glob) / tau) + exp(sim(z, z_prev) / tau)) )

    loss = l_sup(w; x, y) + mu * l_con

with sim the cosine similarity and z, z_glob and z_prev the representations
of x by the model being trained, by the global model the round received
(w^t, fixed) and by the client's model after its previous round (w_k^{t-1},
fixed). The representation is the input of the model's classifier, its
last `nn.Linear`, as PFLlib takes it (the model's body); the paper adds a
projection head, which pollen's catalogue models do not have. Before a
client's first round its previous model is the common initialisation (in
the authors' code a party's own initial model, the same after round 0,
which trains without the term). The previous model is the client's state
(`pollen.protocol.moon_state_key`), every state-dict entry.

The term's gradient flows through the same forward pass as the data loss
(`pollen.task.train._backward` adds `loss` before the backward pass), so
BatchNorm's running statistics move once per batch; the two fixed models
run in evaluation mode, as in the authors' code (their running statistics,
no dropout).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, Context, RecordDict
from torch import nn

from ..protocol import moon_state_key
from .representation import Representation

if TYPE_CHECKING:
    from ..settings import Settings


def contrastive_loss(
    z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor, tau: float
) -> torch.Tensor:
    """The batch's mean l_con (eq. 3): cross-entropy of the logits
    [sim(z, z_glob), sim(z, z_prev)] / tau with the global one as the class."""
    logits = torch.stack(
        [F.cosine_similarity(z, z_glob, dim=1), F.cosine_similarity(z, z_prev, dim=1)],
        dim=1,
    )
    target = torch.zeros(len(z), dtype=torch.long, device=z.device)
    return F.cross_entropy(logits / tau, target)


@dataclass
class ModelContrast:
    """MOON's term mu * l_con, for `pollen.task.objectives.LocalObjective`:
    `load` before training, `loss(inputs)` after each forward pass of the
    trained model, `save` after training."""

    mu: float
    tau: float
    fixed: list[Representation] = field(default_factory=list)  # global, previous
    live: Representation | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> ModelContrast:
        return cls(settings.moon_mu, settings.moon_tau)

    def load(
        self,
        context: Context,
        client: int,
        model: nn.Module,
        new_model: Callable[[], nn.Module],
        content: RecordDict | None = None,
    ) -> None:
        """Fix copies of the received model (global) and of the client's
        previous one (the common initialisation before its first round);
        the message carries nothing for the term."""
        previous = copy.deepcopy(model)  # the client's network, device and layout
        kept = context.state.get(moon_state_key(client))
        previous.load_state_dict(
            kept.to_torch_state_dict()
            if isinstance(kept, ArrayRecord)
            else new_model().state_dict()
        )
        for fixed in (copy.deepcopy(model), previous):
            fixed.requires_grad_(False)
            fixed.eval()
            self.fixed.append(Representation(fixed, "MOON"))
        self.live = Representation(model, "MOON")

    def loss(
        self, inputs: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor:
        """mu * l_con of the batch `inputs` the trained model has just seen
        (the labels play no part)."""
        if self.live is None or self.live.value is None:
            raise RuntimeError("MOON's term: no forward pass of the trained model")
        with torch.no_grad():
            z_glob, z_prev = (represent(inputs) for represent in self.fixed)
        return self.mu * contrastive_loss(self.live.value, z_glob, z_prev, self.tau)

    def save(self, context: Context, client: int, model: nn.Module) -> None:
        """Keep the trained model as the client's previous one, and let go."""
        state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
        context.state[moon_state_key(client)] = ArrayRecord(state)
        self.close()

    def reply_records(self) -> dict[str, ArrayRecord]:
        """Nothing beside the model."""
        return {}

    def close(self) -> None:
        """Remove the hooks and the fixed models."""
        for seen in self.fixed:
            seen.close()
        if self.live is not None:
            self.live.close()
        self.fixed, self.live = [], None
