"""FedALA (Zhang et al. 2023): the aggregation weights' step by hand, the mix
a round starts from, the state a client keeps, and what FedALA refuses."""

from __future__ import annotations

import pytest
import torch
from flwr.app import ArrayRecord, Context, RecordDict
from torch import nn

from pollen import client_app
from pollen.protocol import fedala_state_key, fedala_weights_key
from pollen.settings import Settings, SettingsError
from pollen.task.fedala import FedAla, higher, kept, learned_weights, mix
from pollen.task.local_run import plain
from pollen.task.models import build_model
from pollen.task.objectives import LocalObjective
from pollen.task.schedule import local_training
from tests.test_apfl import network
from tests.test_schedule import local_run, settings, tiny_model
from tests.test_sharing import message, run_config

pytestmark = pytest.mark.usefixtures("task_identity")
TOP = ["2.weight", "2.bias"]


def ala_run(**overrides: object):
    return local_run(settings(**{"ala-layers": 2, "batch-size": 8, **overrides})).run


def test_the_higher_layers_are_the_last_trainable_tensors() -> None:
    assert higher(tiny_model(), 2) == TOP
    assert higher(tiny_model(), 3) == ["0.bias", *TOP]


def test_one_epoch_of_the_weights_by_hand() -> None:
    """One batch of all 8 examples, eta 1, W from 0.5: with theta_hat =
    theta_i + (theta - theta_i) W and g the gradient at theta_hat,
    W <- clip(W - g (theta - theta_i), 0, 1)."""
    run = ala_run(**{"ala-sample": 1.0})
    theta = {k: v.detach().clone() for k, v in run.model.state_dict().items()}
    torch.manual_seed(3)
    previous = {k: v + torch.randn_like(v) for k, v in theta.items()}
    start = {k: torch.full_like(theta[k], 0.5) for k in TOP}
    mixed = {k: theta[k] for k in theta} | {
        k: (previous[k] + (theta[k] - previous[k]) * 0.5).requires_grad_() for k in TOP
    }
    loss = nn.functional.cross_entropy(network(mixed, run.x), run.y)
    grads = dict(
        zip(TOP, torch.autograd.grad(loss, [mixed[k] for k in TOP]), strict=True)
    )
    expected = {
        k: torch.clamp(0.5 - grads[k] * (theta[k] - previous[k]), 0, 1) for k in TOP
    }
    weights = learned_weights(run, previous, start, sample=1.0, eta=1.0)
    assert weights.keys() == set(TOP)
    for k in TOP:
        torch.testing.assert_close(weights[k], expected[k])
    mix(run.model, previous, weights)
    after = run.model.state_dict()
    torch.testing.assert_close(after["0.weight"], theta["0.weight"])  # lower: theta
    for k in TOP:
        want = previous[k] + (theta[k] - previous[k]) * expected[k]
        torch.testing.assert_close(after[k], want)


def test_the_first_weights_start_at_ones_and_stay_within_zero_and_one() -> None:
    run = ala_run(**{"batch-size": 2})
    theta = {k: v.detach().clone() for k, v in run.model.state_dict().items()}
    previous = {k: v * 3.0 for k, v in theta.items()}
    unmoved = learned_weights(run, previous, None, sample=0.8, eta=0.0)
    assert all(torch.all(w == 1) for w in unmoved.values())
    weights = learned_weights(run, previous, None, sample=0.8, eta=1.0)
    for w in weights.values():
        assert float(w.min()) >= 0 and float(w.max()) <= 1
    assert any(not torch.all(w == 1) for w in weights.values())


def test_a_sample_smaller_than_a_batch_still_learns() -> None:
    """6 sampled examples, batch 8: one smaller batch, not none."""
    run = ala_run()
    theta = {k: v.detach().clone() for k, v in run.model.state_dict().items()}
    previous = {k: v * 3.0 for k, v in theta.items()}
    weights = learned_weights(run, previous, None, sample=0.8, eta=1.0)
    assert any(not torch.all(w == 1) for w in weights.values())


def test_rounds_keep_the_model_and_learn_the_weights_from_the_second() -> None:
    """Round 1 trains from theta and keeps its model, no weights; round 2
    learns W, starts from the mix and keeps both."""
    run = ala_run()
    context = Context(1, 1, {}, RecordDict(), {})
    training = FedAla(0.8, 1.0, plain)
    training(run, LocalObjective(), context)
    previous, weights = kept(context, 1)
    assert weights is None
    assert torch.equal(previous["0.weight"], run.model.state_dict()["0.weight"])
    second = ala_run()  # the "global" model: tiny_model again
    theta = {k: v.detach().clone() for k, v in second.model.state_dict().items()}
    starts = []
    recording = FedAla(0.8, 1.0, lambda run, objective, context: (
        starts.append({k: v.clone() for k, v in run.model.state_dict().items()})
        or plain(run, objective, context)
    ))  # fmt: skip
    recording(second, LocalObjective(), context)
    _, weights = kept(context, 1)
    assert weights is not None and set(weights) == set(TOP)
    assert any(not torch.all(w == 1) for w in weights.values())
    [start] = starts
    assert torch.equal(start["0.weight"], theta["0.weight"])  # lower: theta
    for k in TOP:
        want = previous[k] + (theta[k] - previous[k]) * weights[k]
        torch.testing.assert_close(start[k], want)


def test_a_client_tests_its_mix_once_it_has_weights() -> None:
    config = run_config(strategy="fedala")
    model = build_model("mlp-bn", (1, 8, 8), 10, config["seed"])
    sent = ArrayRecord(model.state_dict())
    context = Context(1, 1, {}, RecordDict(), config)
    client_app.train(message("train", sent, 1, 1), context)
    losses = []
    for weights in (None, 0.0):  # none learned yet: the received model; W = 0: theta_i
        if weights is not None:
            top = higher(model, 2)
            context.state[fedala_weights_key(1)] = ArrayRecord(
                {k: torch.zeros_like(model.state_dict()[k]) for k in top}
            )
        reply = client_app.evaluate_personal(message("evaluate", sent, 1, 1), context)
        losses.append(reply.content["metrics"]["local-loss"])
    assert losses[0] != losses[1]
    assert isinstance(context.state[fedala_state_key(1)], ArrayRecord)


def test_the_preset_and_the_schedule() -> None:
    s = Settings.from_run_config({"strategy": "fedala"})
    assert (s.ala_layers, s.ala_sample, s.ala_eta) == (2, 0.8, 1.0)
    assert s.personal_eval_every == 1 and s.clients_keep_state
    assert local_training(s, None) == FedAla(0.8, 1.0, plain)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"dp": True, "model": "cnn-gn"}, "ala-layers with dp=true"),
        ({"sharing": "fedper"}, "ala-layers with sharing='fedper'"),
        ({"ditto-lambda": 0.1}, "another personal model"),
        ({"client-execution": "cohort"}, "ala-layers=2"),
        ({"ala-sample": 0}, "ala-sample"),
    ],
)
def test_what_fedala_refuses(overrides: dict, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        Settings.from_run_config({"strategy": "fedala", **overrides})
