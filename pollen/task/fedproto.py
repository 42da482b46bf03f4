"""FedProto's client half: each representation pulled to its class's global
prototype, and the client's own prototypes sent back instead of weights.

FedProto (Tan et al. 2022, "FedProto: Federated Prototype Learning across
Heterogeneous Clients", https://arxiv.org/abs/2105.00243, Section 4 and
Algorithm 1) describes each class j on client i by its prototype, the mean
representation of its examples,

    C_i^(j) = (1 / |D_i,j|) sum_{(x, y) in D_i,j} f_i(x)

(f_i: the model's body; the representation is the input of its classifier,
`pollen.task.representation`), and trains each client's model on

    L = L_S(F_i(x), y) + lambda * L_R,    L_R: the distance of f_i(x) to C_bar^(y)

with C_bar the global prototypes the server sends (`pollen.strategies.
prototypes`). As the authors' code and PFLlib do, L_R is the mean squared
error between each example's representation and its class's global
prototype, over the batch and the representation's width, an example whose
class has no global prototype yet contributing 0. A client's prototypes are
the means of the representations its round's training passes computed, all
its local epochs', as PFLlib's `clientproto` averages them (the authors'
code keeps the last epoch's; at one local epoch all three agree). The reply
carries, per class, their sum and count (`pollen.protocol.PROTOTYPES`), so
the server's mean weighs each client by its examples of the class. Chosen
by `local-objective = "fedproto"` with `proto-lambda` (preset `fedproto`:
1, with `sharing = "local"`, so that only prototypes travel).

A personal evaluation predicts, by default under FedProto, as the paper's
Section 3 ("Prototype-based model inference") does and PFLlib tests:

    y_hat = argmin_j ||f_i(x) - C_bar^(j)||_2

over the classes that have a global prototype (`NearestPrototype`; the
evaluation message carries the prototypes); `proto-inference =
"classifier"` tests the client's model instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, Context, RecordDict
from torch import nn

from ..protocol import (
    PROTOTYPE_CENTERS,
    PROTOTYPE_COUNTS,
    PROTOTYPE_KNOWN,
    PROTOTYPE_SUMS,
    PROTOTYPES,
)
from .representation import Representation

if TYPE_CHECKING:
    from ..settings import Settings

METHOD = "FedProto"


@dataclass
class PrototypeDistance:
    """lambda * L_R for `pollen.task.objectives.LocalObjective`: `load` reads
    the global prototypes off the training message, `loss(inputs, targets)`
    after each forward pass of the trained model adds the batch's pull and
    counts its representations, `reply_records` carries the client's
    prototypes (as sums and counts) back."""

    lam: float
    centers: torch.Tensor | None = None  # C_bar, one row per class
    known: torch.Tensor | None = None  # the classes C_bar holds
    sums: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    live: Representation | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> PrototypeDistance:
        return cls(settings.proto_lambda)

    def load(
        self,
        context: Context,
        client: int,
        model: nn.Module,
        new_model: Callable[[], nn.Module],
        content: RecordDict,
    ) -> None:
        """The global prototypes the message carries, on the model's device;
        the client keeps nothing between rounds."""
        record = _prototypes_record(content, "training")
        self.centers, self.known = global_prototypes(
            record, next(model.parameters()).device
        )
        self.sums = torch.zeros_like(self.centers)
        self.counts = torch.zeros(len(self.centers), device=self.centers.device)
        self.live = Representation(model, METHOD)

    def loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """lambda * the mean squared distance of the batch's representations
        (from the trained model's pass just taken) to their classes' global
        prototypes; the representations counted towards the client's own."""
        if self.live is None or self.live.value is None or self.centers is None:
            raise RuntimeError("FedProto's term: no forward pass of the trained model")
        z = self.live.value
        self.sums.index_add_(0, targets, z.detach().to(self.sums.dtype))
        self.counts.index_add_(0, targets, torch.ones_like(self.counts[targets]))
        pulled = self.known[targets].unsqueeze(1)
        goal = torch.where(pulled, self.centers[targets].to(z.dtype), z.detach())
        return self.lam * F.mse_loss(z, goal)

    def save(self, context: Context, client: int, model: nn.Module) -> None:
        """Nothing to keep between rounds; let go of the model."""
        self.close()

    def reply_records(self) -> dict[str, ArrayRecord]:
        """The client's prototypes as per-class sums and counts of its round's
        representations (a class it lacks: zeros)."""
        if self.sums is None or self.counts is None:
            raise RuntimeError("FedProto's term: no prototypes before training")
        return {
            PROTOTYPES: ArrayRecord(
                {
                    PROTOTYPE_SUMS: self.sums.detach().cpu(),
                    PROTOTYPE_COUNTS: self.counts.cpu(),
                }
            )
        }

    def close(self) -> None:
        if self.live is not None:
            self.live.close()
            self.live = None


def _prototypes_record(content: RecordDict, kind: str) -> ArrayRecord:
    """The global prototypes' record of a `kind` message's `content`."""
    record = content.get(PROTOTYPES)
    if not isinstance(record, ArrayRecord):
        raise ValueError(
            f"the {kind} message carries no {PROTOTYPES!r} record "
            "(same local-objective and proto-inference on both sides?)"
        )
    return record


def global_prototypes(
    record: ArrayRecord, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The server's prototypes (`pollen.strategies.prototypes`) on `device`:
    C_bar, one row per class, and which classes it holds."""
    sent = record.to_torch_state_dict()
    return sent[PROTOTYPE_CENTERS].to(device), sent[PROTOTYPE_KNOWN].to(device) > 0


class NearestPrototype(nn.Module):
    """`model` read as FedProto's paper infers: the logit of class j is
    -||z - C_bar^(j)||^2 for the representation z (the input of the model's
    classifier), -inf for a class without a global prototype, so the
    prediction is the nearest prototype and the loss the cross-entropy of
    the softmax over negative squared distances (an example of a class
    without a prototype is never predicted right, and its loss is infinite,
    which history.json writes as null)."""

    def __init__(
        self, model: nn.Module, centers: torch.Tensor, known: torch.Tensor
    ) -> None:
        super().__init__()
        self.model, self.centers, self.known = model, centers, known
        self.representation = Representation(model, METHOD)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        z = self.representation(inputs)
        distances = torch.cdist(z, self.centers.to(z.dtype)).square()
        return (-distances).masked_fill(~self.known, float("-inf"))


def nearest_prototype(model: nn.Module, content: RecordDict) -> nn.Module:
    """What a personal evaluation under `proto-inference = "prototypes"`
    tests: `model` predicting by the global prototypes its message carries."""
    record = _prototypes_record(content, "evaluation")
    centers, known = global_prototypes(record, next(model.parameters()).device)
    if not known.any():
        raise ValueError(
            "no class has a global prototype yet (no accepted reply carried "
            "one): nothing to predict by; proto-inference='classifier' tests "
            "the client's model instead"
        )
    return NearestPrototype(model, centers, known)
