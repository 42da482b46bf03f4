"""Which training a round runs, from the settings: the one place that decides.

DP-SGD (`dp`, `pollen.task.privacy`), FedRep's two phases (`head-epochs`,
`pollen.task.fedrep`) or plain epochs (`pollen.task.local_run`), the last
with FedBABU's classifier frozen (`freeze-head`, `pollen.task.fedbabu`), or
Per-FedAvg's two-batch steps (`per-fedavg-beta`, `pollen.task.per_fedavg`);
under Ditto (`ditto-lambda`, `pollen.task.ditto`) the personal model's step
follows whichever it is, and under APFL (`apfl-alpha`, `pollen.task.apfl`)
its personal model steps beside each of its batches; under FedALA
(`ala-layers`, `pollen.task.fedala`) it starts from its adaptive mix. The
settings refuse DP-SGD with any of the others. FedPer and LG-FedAvg need no schedule: their sharing policies keep
a part of the model on the client (`pollen.task.sharing`).
"""

from __future__ import annotations

from functools import partial

from ..settings import Settings
from .apfl import Apfl
from .data import Dataset
from .ditto import Ditto
from .fedala import FedAla
from .fedbabu import FrozenHead
from .fedrep import FedRep
from .inputs import settings_model
from .local_run import Training, plain
from .per_fedavg import PerFedAvg
from .privacy import private


def local_training(settings: Settings, dataset: Dataset) -> Training:
    """The round's training for `settings` (models of `dataset`)."""
    training: Training = plain
    if settings.dp:
        training = private
    elif settings.head_epochs:
        training = FedRep(settings.head_epochs)
    elif settings.freeze_head:
        training = FrozenHead(plain)
    elif settings.per_fedavg_beta:
        training = PerFedAvg(settings.per_fedavg_beta)
    new_model = partial(settings_model, settings, dataset)
    if settings.ditto_lambda:
        return Ditto(settings.ditto_lambda, training, new_model)
    if settings.apfl_alpha:
        return Apfl(settings.apfl_alpha, training, new_model)
    if settings.ala_layers:
        return FedAla(settings.ala_sample, settings.ala_eta, training)
    return training
