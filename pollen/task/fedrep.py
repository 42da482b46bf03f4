"""FedRep's local schedule: the client's own head first, then the shared body.

FedRep (Collins et al. 2021, "Exploiting Shared Representations for
Personalized Federated Learning", https://arxiv.org/abs/2102.07078,
Algorithm 1) shares a representation (the body) and keeps a personal head
(the classifier) on each client: the `fedper` sharing policy
(`pollen.task.sharing`) keeps the head local. Each round the client first
trains its head with the received body frozen, then the body with its head
frozen, so the head fits the new representation before the representation
moves. Chosen by `head-epochs` > 0 (preset `fedrep`: 2).
"""

from __future__ import annotations

from dataclasses import dataclass

from flwr.app import Context

from .local_run import LocalRun, Outcome, plain
from .objectives import LocalObjective, frozen_bn_statistics
from .train import training_only


@dataclass(frozen=True)
class FedRep:
    """`head_epochs` of the local classifier with the shared body frozen (its
    BatchNorm statistics too), then `local-epochs` of the shared body with the
    classifier frozen. The objective's regulariser anchors shared entries
    only, so the head phase keeps SAM but no regulariser."""

    head_epochs: int

    def __call__(
        self, run: LocalRun, objective: LocalObjective, context: Context
    ) -> Outcome:
        model = run.model
        with training_only(model, run.sharing.local), frozen_bn_statistics(model):
            run.epochs(model, self.head_epochs, LocalObjective(objective.sam_rho), 3)
        with training_only(model, run.sharing.shared):
            return plain(run, objective, context)
