"""The server's evaluation of the global model on the test split, and the
divergence checks.

Arrays in, (loss, accuracy) out; a model or loss that is no longer finite,
or a round whose every client reply was not, raises `DivergenceError` with
the likely cause (`divergence_hint`), before the round is recorded or
checkpointed. What follows from the numbers (the history, the
console line, the learning-rate step) is the recorder's job.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from flwr.app import ArrayRecord

from ..extensions import part
from ..settings import Settings
from ..task.data import Dataset
from ..task.inputs import model_inputs
from ..task.train import Preprocess, evaluate


class DivergenceError(RuntimeError):
    """The global model or its test loss is no longer finite."""


class GlobalEvaluation:
    """The global model's test loss and accuracy, on `device`."""

    def __init__(
        self,
        settings: Settings,
        dataset: Dataset,
        model: torch.nn.Module,
        device: torch.device,
    ) -> None:
        self.settings = settings
        self.model = model
        self.device = device
        self.y_test = dataset.y_test.to(device)
        self.x_test, self.preprocess = model_inputs(
            settings, "test", model, dataset.x_test.to(device),
            Preprocess(dataset.mean, dataset.std, settings.normalize, device=device),
        )  # fmt: skip

    def __call__(self, server_round: int, arrays: ArrayRecord) -> tuple[float, float]:
        """(loss, accuracy) of `arrays` on the test split; refuses a diverged model."""
        state = arrays.to_torch_state_dict()
        self.model.load_state_dict({k: v.to(self.device) for k, v in state.items()})
        loss, accuracy = evaluate(
            self.model,
            self.x_test,
            self.y_test,
            batch_size=self.settings.test_batch_size,
            preprocess=self.preprocess,
        )
        check_finite(server_round, state, loss, self.settings)
        return loss, accuracy


def check_finite(
    server_round: int, state: dict[str, torch.Tensor], loss: float, settings: Settings
) -> None:
    """Stop a diverged run before its round is recorded or checkpointed."""
    broken = [
        k for k, v in state.items() if v.is_floating_point() and not v.isfinite().all()
    ]
    if not broken and math.isfinite(loss):
        return
    what = (
        f"{len(broken)} entries of the global model ({broken[0]!r}, ...) are"
        if broken
        else f"the test loss ({loss}) is"
    )
    raise DivergenceError(
        f"round {server_round}: {what} not finite, the run diverged; "
        f"likely cause: {divergence_hint(settings)}. The last good checkpoint, "
        "if any, is kept"
    )


def check_clients_finite(server_round: int, diverged: bool, settings: Settings) -> None:
    """Stop a run whose clients all sent NaN or infinity this round: that is
    their training diverging (one bad client would be one among others),
    not a round to skip."""
    if diverged:
        raise DivergenceError(
            f"round {server_round}: every client's reply carried NaN or infinity "
            f"(the log names each entry), the clients' training diverged; likely "
            f"cause: {divergence_hint(settings)}. The last good checkpoint, if "
            "any, is kept"
        )


def divergence_hint(s: Settings) -> str:
    """The parts' own hints (pollen.catalog), then the client learning rate."""
    values = dataclasses.asdict(s)
    parts = (
        part("server-update", s.server_update),
        part("local-objective", s.local_objective),
    )
    hints = [p.divergence_hint.format(**values) for p in parts if p.divergence_hint]
    hints.append(f"lr={s.lr:g} too high (max-grad-norm={s.max_grad_norm:g})")
    return "; or ".join(dict.fromkeys(hints))
