"""The round's training schedules on a tiny model: which one the settings
choose, FedRep's two phases (what each trains, with what objective and seed)
and Ditto's personal model (where it starts, what pulls it, where it stays)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from flwr.app import Context, RecordDict
from torch import nn

from pollen.protocol import TRAIN_LOSS, ditto_state_key
from pollen.settings import Settings
from pollen.task.ditto import Ditto, personal_state
from pollen.task.fedrep import FedRep
from pollen.task.local_run import LocalRun, Outcome, plain
from pollen.task.objectives import LocalObjective, ProxTerm
from pollen.task.privacy import private
from pollen.task.schedule import local_training
from pollen.task.sharing import Sharing
from pollen.task.train import ClientOptimizer, TrainResult, no_preprocess

BODY = ("0.weight", "0.bias")
HEAD = ("2.weight", "2.bias")


def settings(**overrides: object) -> Settings:
    return Settings.from_run_config(
        {"model": "mlp", "batch-size": 4, "local-epochs": 1, **overrides}
    )


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


@dataclass
class Pass:
    trained: frozenset[str]  # the parameters that required a gradient
    start: dict[str, torch.Tensor]
    epochs: int
    objective: LocalObjective
    seed_offset: int = 0


@dataclass
class Recorded:
    """A LocalRun whose passes are recorded before they run."""

    run: LocalRun
    passes: list[Pass] = field(default_factory=list)

    def __post_init__(self) -> None:
        train = self.run.epochs

        def epochs(model: nn.Module, *args: Any) -> TrainResult:
            trained = frozenset(
                n for n, p in model.named_parameters() if p.requires_grad
            )
            start = {k: v.clone() for k, v in model.state_dict().items()}
            self.passes.append(Pass(trained, start, *args))
            return train(model, *args)

        self.run.epochs = epochs


def local_run(s: Settings) -> Recorded:
    model = tiny_model()
    x = torch.linspace(-1, 1, 24).reshape(8, 3)
    y = torch.tensor([0, 1, 1, 0, 1, 0, 0, 1])
    run = LocalRun(
        s, 1, model, Sharing.of("fedper", model), torch.device("cpu"), x, y,
        ClientOptimizer("sgd", 0.1, 0.0), no_preprocess, 7,
    )  # fmt: skip
    return Recorded(run)


def context() -> Context:
    return Context(1, 1, {}, RecordDict(), {})


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({}, plain),
        ({"dp": True, "model": "cnn-gn"}, private),
        ({"strategy": "fedrep"}, FedRep(2)),
    ],
)
def test_settings_choose_the_schedule(overrides: dict, expected: object) -> None:
    assert local_training(settings(**overrides), None) == expected


def test_ditto_wraps_the_schedule_it_would_run_alone() -> None:
    ditto = local_training(settings(strategy="ditto"), None)
    assert isinstance(ditto, Ditto) and ditto.lam == 0.1 and ditto.training is plain
    both = local_training(settings(strategy="fedrep", **{"ditto-lambda": 0.5}), None)
    assert isinstance(both, Ditto) and both.training == FedRep(2)


def test_plain_trains_every_parameter_local_epochs_for_the_objective() -> None:
    recorded = local_run(settings(**{"local-epochs": 3}))
    objective = LocalObjective(0.05)
    result, metrics = plain(recorded.run, objective, context())
    [only] = recorded.passes
    assert only.trained == {*BODY, *HEAD} and only.epochs == 3
    assert only.objective is objective and only.seed_offset == 0
    assert result.steps == 3 * 2 and metrics == {TRAIN_LOSS: result.loss}


def test_fedrep_trains_the_head_alone_then_the_body_alone() -> None:
    recorded = local_run(settings(**{"local-epochs": 2}))
    objective = LocalObjective(0.05, ProxTerm(0.5))
    result, metrics = FedRep(3)(recorded.run, objective, context())
    head, body = recorded.passes
    # the head phase: the local classifier only, SAM kept, no regulariser
    assert head.trained == set(HEAD) and head.epochs == 3 and head.seed_offset == 3
    assert head.objective == LocalObjective(0.05)
    # the body phase: the shared entries only, from the trained head
    assert body.trained == set(BODY) and body.epochs == 2 and body.seed_offset == 0
    assert body.objective is objective
    assert not torch.equal(body.start["2.weight"], head.start["2.weight"])
    assert torch.equal(body.start["0.weight"], head.start["0.weight"])
    assert result.steps == 2 * 2 and metrics == {TRAIN_LOSS: result.loss}
    assert all(p.requires_grad for p in recorded.run.model.parameters())  # restored


def scaled_by_two(
    run: LocalRun, objective: LocalObjective, context: Context
) -> Outcome:
    """A stand-in for the global model's training: it doubles every entry."""
    with torch.no_grad():
        for p in run.model.parameters():
            p.mul_(2)
    return TrainResult(0.25, len(run.y), 1), {TRAIN_LOSS: 0.25}


def test_ditto_trains_a_personal_model_pulled_to_the_received_one() -> None:
    recorded = local_run(settings())
    received = {k: v.clone() for k, v in recorded.run.model.state_dict().items()}
    state = context()
    ditto = Ditto(0.5, scaled_by_two, tiny_model)
    outcome = ditto(recorded.run, LocalObjective(), state)
    assert outcome == (TrainResult(0.25, 8, 1), {TRAIN_LOSS: 0.25})  # the global's
    [first] = recorded.passes
    # v_k starts at the received model (not the trained global one), is
    # pulled towards it with lambda and draws from seeds seed + 6
    for k, v in received.items():
        assert torch.equal(first.start[k], v)
        assert torch.equal(first.objective.regularizer.anchor[k], v)
    assert first.objective.regularizer.mu == 0.5 and first.seed_offset == 6
    kept = personal_state(state, 1)
    assert kept is not None and set(kept) == set(received)
    assert not torch.equal(kept["0.weight"], received["0.weight"])  # it trained
    assert personal_state(state, 2) is None  # another client's
    # the next round starts from the kept v_k, anchored at that round's model
    again = local_run(settings())
    ditto(again.run, LocalObjective(), state)
    for k, v in kept.items():
        assert torch.equal(again.passes[0].start[k], v)
    assert ditto_state_key(1) in state.state
