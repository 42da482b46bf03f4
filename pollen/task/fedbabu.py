"""FedBABU: only the body trains in the federation; the head is fine-tuned to test.

FedBABU (Oh, Kim and Yun 2022, "FedBABU: Toward Enhanced Representation for
Federated Image Classification", https://arxiv.org/abs/2106.06042,
Algorithm 1) splits the model into a body (every layer below the classifier)
and a head (the classifier, the model's last `nn.Linear`). The head keeps
its random initialisation, the same on every client, and is never trained;
each round a client trains the body alone, from the received body, and the
server averages the bodies:

    theta_body^{t+1} = sum_k (n_k / n) theta_{k,body}^t,    theta_head^t = theta_head^0

so every client learns one representation for one fixed classifier. To
personalise, a client fine-tunes the whole model (body and head) on its own
training examples for tau_f epochs and tests that model.

In pollen the two halves are separate settings that compose: `freeze-head`
is the round's training (`FrozenHead`; the `fedper` sharing keeps the
unchanging head on each client) and `fine-tune-epochs` the personal
evaluation's fine-tuning (`fine_tuned`), which also gives FedAvg-FT under
FedAvg. Preset `fedbabu`: both, with tau_f = 5.
"""

from __future__ import annotations

from dataclasses import dataclass

from flwr.app import Context

from .local_run import ADAPT_SEED_OFFSET, LocalRun, Outcome, Training
from .objectives import LocalObjective
from .train import training_only


@dataclass(frozen=True)
class FrozenHead:
    """The round's `training` with the classifier frozen: only the body's
    parameters step (the head's requires_grad is restored afterwards)."""

    training: Training

    def __call__(
        self, run: LocalRun, objective: LocalObjective, context: Context
    ) -> Outcome:
        body = [k for k, kind in run.sharing.kinds.items() if kind != "head"]
        with training_only(run.model, body):
            return self.training(run, objective, context)


def fine_tuned(run: LocalRun, epochs: int) -> None:
    """`epochs` of the whole model on the client's training examples, for
    the plain cross-entropy, before a personal evaluation (FedBABU's tau_f)."""
    run.epochs(run.model, epochs, LocalObjective(), ADAPT_SEED_OFFSET)
