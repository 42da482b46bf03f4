"""What a round trains and what a personal evaluation tests, from the settings:
the one place that decides.

A round trains DP-SGD (`dp`, `pollen.task.privacy`), FedRep's two phases
(`head-epochs`, `pollen.task.fedrep`) or plain epochs
(`pollen.task.local_run`), the last with FedBABU's classifier frozen
(`freeze-head`, `pollen.task.fedbabu`), or Per-FedAvg's two-batch steps
(`per-fedavg-beta`, `pollen.task.per_fedavg`); under Ditto (`ditto-lambda`,
`pollen.task.ditto`) the personal model's step follows whichever it is,
under APFL (`apfl-alpha`, `pollen.task.apfl`) its personal model steps
beside each of its batches, and under FedRoD (`personal-head`,
`pollen.task.fedrod`) its personal head does, on the balanced softmax;
under FedALA (`ala-layers`, `pollen.task.fedala`) it starts from its
adaptive mix. The settings refuse DP-SGD with any of the others, and the
personal models with each other. FedPer and LG-FedAvg need no schedule:
their sharing policies keep a part of the model on the client
(`pollen.task.sharing`).

A personal evaluation (`personal_test`) tests the client's personal model
where it keeps one, then trains it first where the settings say so
(`fine-tune-epochs`, Per-FedAvg's step), and reads its predictions off
the global prototypes under FedProto's inference (`proto-inference`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from flwr.app import Context, RecordDict
from torch import nn

from ..settings import Settings
from . import apfl, ditto, fedala, fedproto, fedrod, per_fedavg
from .apfl import Apfl
from .data import Dataset
from .ditto import Ditto
from .fedala import FedAla
from .fedbabu import FrozenHead, fine_tuned
from .fedrep import FedRep
from .fedrod import FedRod
from .inputs import settings_model
from .local_run import LocalRun, Training, plain
from .per_fedavg import PerFedAvg
from .privacy import private

# the client's assembled model -> the personal model it tests (the same
# module changed in place, or one around it)
PersonalModel = Callable[[nn.Module, Context, int], nn.Module]


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
    if settings.personal_head:
        return FedRod(training)
    return training


@dataclass(frozen=True)
class PersonalTest:
    """What a personal evaluation tests: the client's personal model where
    it keeps one (`personal`), trained first on its shard where the
    settings say so (`adapt`, on a run of that model), read by what the
    evaluation message carries where it predicts by that (`predicts`:
    FedProto's nearest global prototype)."""

    personal: PersonalModel | None = None
    adapt: Callable[[LocalRun], None] | None = None
    predicts: Callable[[nn.Module, RecordDict], nn.Module] | None = None


def personal_test(settings: Settings) -> PersonalTest:
    """The personal evaluation for `settings` (the settings refuse two
    personal models, or one with an adaptation, together)."""
    personal: PersonalModel | None = None
    if settings.ditto_lambda:
        personal = ditto.tested
    elif settings.apfl_alpha:
        personal = apfl.tested
    elif settings.ala_layers:
        personal = fedala.tested
    elif settings.personal_head:
        personal = fedrod.tested
    adapt: Callable[[LocalRun], None] | None = None
    if settings.fine_tune_epochs:
        adapt = partial(fine_tuned, epochs=settings.fine_tune_epochs)
    elif settings.per_fedavg_beta:
        adapt = per_fedavg.adapted
    predicts = (
        fedproto.nearest_prototype if settings.proto_inference == "prototypes" else None
    )
    return PersonalTest(personal, adapt, predicts)
