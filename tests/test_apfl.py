"""APFL (Deng et al. 2020): the personal model and its mixing weight stepped
by hand beside the global model's step, the mixture a client tests, and
what APFL refuses."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, RecordDict
from torch import nn
from torch.func import functional_call

from pollen import client_app
from pollen.protocol import apfl_alpha_key, apfl_state_key, ditto_state_key
from pollen.settings import Settings, SettingsError
from pollen.task.apfl import Apfl, PersonalMixture, kept, mixed_state
from pollen.task.local_run import plain
from pollen.task.models import build_model
from pollen.task.objectives import LocalObjective
from pollen.task.schedule import local_training
from pollen.task.train import ClientOptimizer, placed
from tests.test_schedule import local_run, settings, tiny_model
from tests.test_sharing import message, run_config

pytestmark = pytest.mark.usefixtures("task_identity")


def network(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """tiny_model's forward pass, written out."""
    hidden = torch.relu(x @ params["0.weight"].T + params["0.bias"])
    return hidden @ params["2.weight"].T + params["2.bias"]


def test_one_step_of_v_alpha_and_w_by_hand() -> None:
    """One full batch, lr 0.1, no momentum, alpha 0.3: with g the gradient
    at v_bar = 0.3 v + 0.7 w, v moves by -0.1 * 0.3 g, alpha by
    -0.1 <v - w, g>, and w by its own plain step, all from the start."""
    recorded = local_run(settings(**{"batch-size": 8}))
    run = recorded.run
    w0 = {k: v.detach().clone() for k, v in run.model.state_dict().items()}
    torch.manual_seed(5)
    v0 = {k: torch.randn_like(v) for k, v in w0.items()}
    mixed = {k: (0.3 * v0[k] + 0.7 * w0[k]).requires_grad_() for k in w0}
    loss = nn.functional.cross_entropy(network(mixed, run.x), run.y)
    g = dict(zip(mixed, torch.autograd.grad(loss, list(mixed.values())), strict=True))
    w_params = {k: w.clone().requires_grad_() for k, w in w0.items()}
    w_loss = nn.functional.cross_entropy(network(w_params, run.x), run.y)
    w_grad = dict(
        zip(w0, torch.autograd.grad(w_loss, list(w_params.values())), strict=True)
    )
    alpha = 0.3 - 0.1 * sum(float(((v0[k] - w0[k]) * g[k]).sum()) for k in w0)
    assert 0 < alpha < 1  # no clipping in this case

    context = Context(1, 1, {}, RecordDict(), {})
    context.state[apfl_state_key(1)] = ArrayRecord(v0)
    context.state[apfl_alpha_key(1)] = ConfigRecord({"alpha": 0.3})
    Apfl(0.5, plain, tiny_model)(run, LocalObjective(), context)
    v1, alpha1 = kept(context, 1)
    assert alpha1 == pytest.approx(alpha, rel=1e-5)
    for k in w0:
        torch.testing.assert_close(v1[k], v0[k] - 0.1 * 0.3 * g[k])
        torch.testing.assert_close(run.model.state_dict()[k], w0[k] - 0.1 * w_grad[k])


def test_the_written_out_chain_rule_is_autograd_s_through_the_mixture() -> None:
    """Three steps on `fedavg-cnn` laid out channels-last, with momentum:
    v and alpha as autograd steps them through alpha v + (1 - alpha) w, with
    alpha a leaf of the graph (what `PersonalMixture.step` computed until
    2026-12-06)."""
    cpu = torch.device("cpu")
    w = placed(build_model("fedavg-cnn", (1, 28, 28), 10, seed=0), cpu, True)
    personal = placed(build_model("fedavg-cnn", (1, 28, 28), 10, seed=1), cpu, True)
    reference = copy.deepcopy(personal)
    sgd = ClientOptimizer(lr=0.05, momentum=0.9)
    mixture = PersonalMixture(w, personal, 0.4, sgd)
    params = dict(reference.named_parameters())
    optimizer = sgd.build(list(params.values()))
    alpha = torch.tensor(0.4)
    generator = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(6, 1, 28, 28, generator=generator)
        y = torch.randint(0, 10, (6,), generator=generator)
        mixture.step(x, y)
        leaf = alpha.clone().requires_grad_()
        mixed = {
            n: leaf * v + (1 - leaf) * dict(w.named_parameters())[n].detach()
            for n, v in params.items()
        }
        loss = nn.functional.cross_entropy(functional_call(reference, mixed, (x,)), y)
        *grads, grad_alpha = torch.autograd.grad(loss, [*params.values(), leaf])
        for param, grad in zip(params.values(), grads, strict=True):
            param.grad = grad
        optimizer.step()
        alpha = (alpha - sgd.lr * grad_alpha).clamp(0.0, 1.0)
        with torch.no_grad():  # w moves between steps, as its own step moves it
            for param in w.parameters():
                param.mul_(0.99)
    assert 0 < float(alpha) < 1 and float(alpha) != 0.4
    assert mixture.alpha == pytest.approx(float(alpha), rel=1e-5)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(personal.state_dict()[name], value)


def test_the_first_round_starts_v_at_the_received_model_and_alpha_as_set() -> None:
    """At lr 0 nothing moves: v is kept as it started, the received model,
    and alpha at `apfl-alpha` (with v = w, alpha's gradient is 0 anyway)."""
    run = local_run(settings(**{"batch-size": 8})).run
    run = replace(run, optimizer=ClientOptimizer("sgd", 0.0, 0.0))
    received = {k: v.detach().clone() for k, v in run.model.state_dict().items()}
    context = Context(1, 1, {}, RecordDict(), {})
    Apfl(0.4, plain, tiny_model)(run, LocalObjective(), context)
    v1, alpha1 = kept(context, 1)
    assert alpha1 == pytest.approx(0.4)
    for name, value in received.items():
        assert torch.equal(v1[name], value)


def test_frozen_parameters_pass_through_the_mixture() -> None:
    """A frozen layer (a LoRA backbone's) is the same in v and w: only the
    trained parameters are mixed and stepped."""
    global_model, personal = tiny_model(), tiny_model()
    for model in (global_model, personal):
        model[0].requires_grad_(False)
    frozen = personal[0].weight.detach().clone()
    mixture = PersonalMixture(
        global_model, personal, 0.5, ClientOptimizer("sgd", 0.1, 0.0)
    )
    mixture.step(torch.linspace(-1, 1, 24).reshape(8, 3), torch.arange(8) % 2)
    assert torch.equal(personal[0].weight, frozen)
    assert not torch.equal(personal[2].weight, tiny_model()[2].weight)


def test_alpha_stays_within_zero_and_one() -> None:
    for lr in (1e6, -1e6):
        mixture = PersonalMixture(
            tiny_model(), tiny_model(), 0.5, ClientOptimizer("sgd", 0.1, 0.0)
        )
        with torch.no_grad():
            mixture.personal[0].weight.add_(1.0)
        mixture.lr = lr
        mixture.step(torch.linspace(-1, 1, 24).reshape(8, 3), torch.arange(8) % 2)
        assert mixture.alpha in (0.0, 1.0)


def test_the_mixture_mixes_parameters_and_keeps_v_s_statistics() -> None:
    w = build_model("mlp-bn", (1, 8, 8), 10, 0)
    v_model = build_model("mlp-bn", (1, 8, 8), 10, 1)
    with torch.no_grad():
        v_model[2].running_mean.fill_(3.0)
    v = v_model.state_dict()
    mixed = mixed_state(w, v, 0.25)
    torch.testing.assert_close(
        mixed["1.weight"], 0.25 * v["1.weight"] + 0.75 * w.state_dict()["1.weight"]
    )
    assert torch.equal(
        mixed["2.running_mean"], torch.full_like(v["2.running_mean"], 3.0)
    )
    assert mixed.keys() == v.keys()


def test_a_client_tests_its_mixture() -> None:
    """After a round, the personal evaluation tests alpha v + (1 - alpha) w
    with the alpha kept: with alpha 1 that is v itself, which Ditto's
    evaluation of the same v as its personal model confirms; alpha 0 differs."""
    config = run_config(strategy="apfl")
    model = build_model("mlp-bn", (1, 8, 8), 10, config["seed"])
    context = Context(1, 1, {}, RecordDict(), config)
    sent = ArrayRecord(model.state_dict())
    client_app.train(message("train", sent, 1, 1), context)
    losses = {}
    for alpha in (0.0, 1.0):
        context.state[apfl_alpha_key(1)] = ConfigRecord({"alpha": alpha})
        reply = client_app.evaluate_personal(message("evaluate", sent, 1, 1), context)
        losses[alpha] = reply.content["metrics"]["local-loss"]
    ditto = Context(1, 1, {}, RecordDict(), run_config(strategy="ditto"))
    ditto.state[ditto_state_key(1)] = context.state[apfl_state_key(1)]
    as_ditto = client_app.evaluate_personal(message("evaluate", sent, 1, 1), ditto)
    assert losses[1.0] == pytest.approx(as_ditto.content["metrics"]["local-loss"])
    assert losses[0.0] != pytest.approx(losses[1.0])


def test_the_preset_and_the_schedule() -> None:
    s = Settings.from_run_config({"strategy": "apfl"})
    assert s.apfl_alpha == 0.5 and s.personal_eval_every == 1 and s.clients_keep_state
    chosen = local_training(s, None)
    assert isinstance(chosen, Apfl) and chosen.alpha == 0.5 and chosen.training is plain


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"dp": True, "model": "cnn-gn"}, "apfl-alpha with dp=true"),
        ({"ditto-lambda": 0.1}, "apfl-alpha with ditto-lambda"),
        ({"head-epochs": 1, "sharing": "fedper"}, "apfl-alpha with head-epochs"),
        ({"fine-tune-epochs": 1}, "apfl-alpha with fine-tune-epochs"),
        ({"client-execution": "cohort"}, "apfl-alpha=0.5"),
        ({"apfl-alpha": 1.5}, "in \\[0, 1\\]"),
    ],
)
def test_what_apfl_refuses(overrides: dict, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        Settings.from_run_config({"strategy": "apfl", **overrides})
