"""MOON (Li et al. 2021): the model-contrastive loss by hand, its gradient
through the training step, and the previous model a client keeps."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Context, RecordDict
from torch import nn

from pollen import client_app
from pollen.protocol import moon_state_key
from pollen.settings import Settings, SettingsError
from pollen.task.cohort import cohort_problem
from pollen.task.models import build_model
from pollen.task.moon import ModelContrast, contrastive_loss
from pollen.task.objectives import LocalObjective
from pollen.task.sharing import Sharing
from pollen.task.train import ClientOptimizer, no_preprocess, train_local
from tests.test_sharing import message, run_config

pytestmark = pytest.mark.usefixtures("task_identity")


def test_the_contrastive_loss_by_hand() -> None:
    """Example 1: z = z_glob = (1, 0), z_prev = (0, 1), tau 0.5: the cosines
    are 1 and 0, so l = -log(e^2 / (e^2 + e^0)) = log(1 + e^-2). Example 2:
    z = (1, 1), z_glob = (1, 0), z_prev = (-1, 0): the cosines are
    +-1/sqrt(2), the logits +-sqrt(2), so l = log(1 + e^(-2 sqrt(2))).
    The batch's loss is their mean."""
    z = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    z_glob = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    z_prev = torch.tensor([[0.0, 1.0], [-1.0, 0.0]])
    first, second = (
        math.log(1 + math.exp(-2)),
        math.log(1 + math.exp(-2 * math.sqrt(2))),
    )
    assert first == pytest.approx(0.126928011)
    got = contrastive_loss(z, z_glob, z_prev, tau=0.5)
    assert float(got) == pytest.approx((first + second) / 2, rel=1e-6)


def tiny_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def loaded_term(
    model: nn.Module, previous: nn.Module | None, mu: float = 2.0
) -> tuple[ModelContrast, Context]:
    """MOON's term loaded on `model`, with `previous` kept as the client's
    previous model (None: its first round, the initial model `tiny_model(9)`)."""
    context = Context(1, 1, {}, RecordDict(), {})
    if previous is not None:
        context.state[moon_state_key(3)] = ArrayRecord(previous.state_dict())
    term = ModelContrast(mu, 0.5)
    term.load(context, 3, model, lambda: tiny_model(9))
    return term, context


def by_hand(
    z: torch.Tensor, z_glob: torch.Tensor, z_prev: torch.Tensor
) -> torch.Tensor:
    """Eq. 3 written out: -log(e^(a/tau) / (e^(a/tau) + e^(b/tau))), per example."""
    a = (z * z_glob).sum(1) / (z.norm(dim=1) * z_glob.norm(dim=1))
    b = (z * z_prev).sum(1) / (z.norm(dim=1) * z_prev.norm(dim=1))
    return -torch.log(torch.exp(a / 0.5) / (torch.exp(a / 0.5) + torch.exp(b / 0.5)))


def test_one_step_follows_the_gradient_of_the_data_loss_plus_mu_l_con() -> None:
    """One full-batch SGD step (lr 0.1): the parameters move by -lr times the
    gradient of CE + mu * l_con, with z the input of the last layer and the
    global and previous models fixed, all computed here without pollen."""
    model, previous = tiny_model(0), tiny_model(1)
    x = torch.linspace(-1, 1, 24).reshape(8, 3)
    y = torch.tensor([0, 1, 1, 0, 1, 0, 0, 1])
    received = copy.deepcopy(model)
    body = lambda m: m[1](m[0](x))  # noqa: E731 - the representation
    loss = (
        nn.functional.cross_entropy(model(x), y)
        + 2.0
        * by_hand(body(model), body(received).detach(), body(previous).detach()).mean()
    )
    grads = torch.autograd.grad(loss, list(model.parameters()))
    expected = [
        p.detach() - 0.1 * g for p, g in zip(model.parameters(), grads, strict=True)
    ]
    term, _ = loaded_term(model, previous)
    result = train_local(
        model, x, y, epochs=1, batch_size=8, preprocess=no_preprocess, seed=0,
        optimizer=ClientOptimizer("sgd", 0.1, 0.0),
        objective=LocalObjective(batch_term=term),
    )  # fmt: skip
    assert result.steps == 1
    for param, want in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(param.detach(), want)


def test_a_previous_model_equal_to_the_global_one_adds_no_gradient() -> None:
    """z_prev = z_glob: l_con = log 2 whatever z is, so its gradient is 0."""
    model = tiny_model(0)
    term, _ = loaded_term(model, copy.deepcopy(model))
    x = torch.linspace(-1, 1, 12).reshape(4, 3)
    model(x)
    loss = term.loss(x)
    assert float(loss.detach()) == pytest.approx(2.0 * math.log(2))
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    assert all(g is None or float(g.abs().max()) < 1e-6 for g in grads)


def test_the_first_previous_model_is_the_initial_one_and_the_trained_is_kept() -> None:
    model = tiny_model(0)
    term, context = loaded_term(model, None)
    _, previous = term.fixed
    for kept, initial in zip(
        previous.model.state_dict().values(), tiny_model(9).state_dict().values(),
        strict=True,
    ):  # fmt: skip
        assert torch.equal(kept, initial)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    term.save(context, 3, model)
    kept = context.state[moon_state_key(3)].to_torch_state_dict()
    assert torch.equal(kept["0.weight"], model[0].weight.detach())
    assert term.fixed == [] and not model[2]._forward_hooks  # let go


def test_batchnorm_statistics_move_once_per_batch_as_without_moon() -> None:
    """The term's fixed models run on copies: the trained model's running
    statistics are those of plain training on the same batches."""
    stats = {}
    x = torch.rand(16, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    y = torch.arange(16) % 10
    for moon in (False, True):
        model = build_model("mlp-bn", (1, 8, 8), 10, 0)
        objective = LocalObjective()
        if moon:
            term = ModelContrast(1.0, 0.5)
            term.load(Context(1, 1, {}, RecordDict(), {}), 0, model,
                      lambda: build_model("mlp-bn", (1, 8, 8), 10, 0))  # fmt: skip
            objective = LocalObjective(batch_term=term)
        train_local(model, x, y, epochs=1, batch_size=8, preprocess=no_preprocess,
                    seed=0, optimizer=ClientOptimizer("sgd", 0.0, 0.0),
                    objective=objective)  # fmt: skip
        stats[moon] = {k: v.clone() for k, v in model.state_dict().items()
                       if "running" in k or "tracked" in k}  # fmt: skip
    assert stats[True]["2.num_batches_tracked"] == 2
    for name, value in stats[False].items():
        torch.testing.assert_close(stats[True][name], value)


def test_two_rounds_keep_the_trained_model_as_the_next_previous_one() -> None:
    """Round 1 keeps the trained model; round 2, sent a moved aggregate,
    contrasts with it: the same round 2 without the kept model (the initial
    one as previous) replies otherwise."""
    settings = run_config(strategy="moon")
    model = build_model("mlp-bn", (1, 8, 8), 10, settings["seed"])
    sharing = Sharing.of("shared", model)
    context = Context(1, 1, {}, RecordDict(), settings)
    reply = client_app.train(
        message("train", ArrayRecord(model.state_dict()), 1, 1), context
    )
    arrays = reply.content["arrays"]
    kept = context.state[moon_state_key(1)]
    for name in sharing.shared:
        assert np.array_equal(kept[name].numpy(), arrays[name].numpy())
    state = arrays.to_torch_state_dict()
    moved = ArrayRecord(
        {k: v * 0.5 if v.is_floating_point() else v for k, v in state.items()}
    )
    replies = []
    for keep in (True, False):
        again = copy.deepcopy(context)
        if not keep:
            del again.state[moon_state_key(1)]
        second = client_app.train(message("train", moved, 1, 2), again)
        replies.append(second.content["arrays"]["1.weight"].numpy())
    assert not np.allclose(*replies)


def test_a_cohort_refuses_a_batch_term_at_run_time_too() -> None:
    model = tiny_model(0)
    term, _ = loaded_term(model, None)
    problem = cohort_problem(model, LocalObjective(batch_term=term), ClientOptimizer())
    assert problem is not None and "term on each batch (ModelContrast)" in problem


def test_the_fixed_models_are_in_evaluation_mode() -> None:
    """As in the authors' code: their running statistics, no dropout."""
    model = tiny_model(0)
    term, _ = loaded_term(model, tiny_model(1))
    assert all(not seen.model.training for seen in term.fixed)
    assert all(
        not p.requires_grad for seen in term.fixed for p in seen.model.parameters()
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"model": "cnn-lora"}, "not a LoRA head"),
        ({"dp": True, "model": "cnn-gn"}, "'moon' with dp=true"),
        ({"client-execution": "cohort"}, "client-execution='cohort'"),
        ({"moon-tau": 0}, "moon-tau"),
        ({"model": "logreg", "data-set": "synthetic"}, "allowed: mlp"),
        ({"sharing": "lg"}, "the term is constant"),
    ],
)
def test_what_moon_refuses(overrides: dict, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        Settings.from_run_config({"strategy": "moon", **overrides})


def test_the_preset() -> None:
    s = Settings.from_run_config({"strategy": "moon"})
    assert (s.server_update, s.local_objective, s.moon_mu, s.moon_tau) == (
        "fedavg", "moon", 1.0, 0.5,
    )  # fmt: skip
    assert s.clients_keep_state
