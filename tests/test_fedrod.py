"""FedRoD (Chen and Chao 2022): the balanced softmax and the personal head's
step by hand, the two heads a client tests, and what FedRoD refuses."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from flwr.app import ArrayRecord, Context, RecordDict
from torch import nn

from pollen import client_app
from pollen.protocol import fedrod_head_key
from pollen.settings import Settings, SettingsError
from pollen.task import fedrod
from pollen.task.fedrod import FedRod, PersonalPrediction, log_label_counts
from pollen.task.local_run import plain
from pollen.task.models import build_model
from pollen.task.objectives import LocalObjective
from pollen.task.representation import Representation
from pollen.task.schedule import local_training, personal_test
from pollen.task.train import ClientOptimizer
from tests.test_schedule import local_run, settings, tiny_model
from tests.test_sharing import message, run_config

pytestmark = pytest.mark.usefixtures("task_identity")

# two examples of class 0, six of class 1: the balanced softmax differs from CE
LABELS = torch.tensor([0, 1, 1, 1, 1, 0, 1, 1])


def representation(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """tiny_model's body, written out: z."""
    return torch.relu(x @ params["0.weight"].T + params["0.bias"])


def network(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """tiny_model's forward pass, written out: g = h_G(z)."""
    return representation(params, x) @ params["2.weight"].T + params["2.bias"]


def test_the_balanced_softmax_by_hand() -> None:
    """Logits 0 and counts (1, 3): class 0's loss is -log(1/4), class 1's
    -log(3/4); a class the client lacks takes no mass and no gradient."""
    objective = LocalObjective(log_label_counts=log_label_counts(LABELS[:4], 2))
    assert objective.log_label_counts.tolist() == pytest.approx([0.0, math.log(3)])
    logits = torch.zeros(1, 2)
    assert float(objective.data_loss(logits, torch.tensor([0]))) == pytest.approx(
        math.log(4)
    )
    assert float(objective.data_loss(logits, torch.tensor([1]))) == pytest.approx(
        -math.log(0.75)
    )
    assert float(LocalObjective().data_loss(logits, torch.tensor([0]))) == (
        pytest.approx(math.log(2))
    )
    missing = LocalObjective(log_label_counts=log_label_counts(torch.tensor([1]), 3))
    scores = torch.tensor([[0.5, -1.0, 2.0]], requires_grad=True)
    loss = missing.data_loss(scores, torch.tensor([1]))
    loss.backward()
    # classes 0 and 2 drop out: a softmax over class 1 alone
    assert float(loss.detach()) == pytest.approx(0.0, abs=1e-6)
    assert torch.isfinite(scores.grad).all()


@pytest.mark.parametrize("sam_rho", [0.0, 0.05])
def test_one_step_of_the_shared_model_and_the_personal_head_by_hand(
    sam_rho: float,
) -> None:
    """One full batch, lr 0.1: the shared model steps on the balanced softmax
    of the client's counts (2, 6), and h_P, starting as a copy of the
    received classifier, on CE(g + h_P(z)) at the same (pre-step) z and g;
    under SAM, whose second pass h_P must not see, h_P's step is the same."""
    run = replace(local_run(settings(**{"batch-size": 8})).run, y=LABELS)
    w0 = {k: v.detach().clone() for k, v in run.model.state_dict().items()}
    w = {k: v.clone().requires_grad_() for k, v in w0.items()}
    prior = torch.tensor([math.log(2), math.log(6)])
    loss = nn.functional.cross_entropy(network(w, run.x) + prior, LABELS)
    w_grad = dict(zip(w, torch.autograd.grad(loss, list(w.values())), strict=True))
    z, g = representation(w0, run.x), network(w0, run.x)
    head = {"weight": w0["2.weight"].clone(), "bias": w0["2.bias"].clone()}
    head = {k: v.requires_grad_() for k, v in head.items()}
    head_loss = nn.functional.cross_entropy(
        g + z @ head["weight"].T + head["bias"], LABELS
    )
    head_grad = torch.autograd.grad(head_loss, list(head.values()))

    context = Context(1, 1, {}, RecordDict(), {})
    FedRod(plain)(run, LocalObjective(sam_rho=sam_rho), context)
    kept = context.state[fedrod_head_key(1)].to_torch_state_dict()
    for (name, value), grad in zip(head.items(), head_grad, strict=True):
        torch.testing.assert_close(kept[name], value.detach() - 0.1 * grad)
    if not sam_rho:
        for name, value in w0.items():
            torch.testing.assert_close(
                run.model.state_dict()[name], value - 0.1 * w_grad[name]
            )


def test_the_head_is_kept_from_round_to_round() -> None:
    """At lr 0 nothing moves: h_P is kept as the client left it."""
    run = local_run(settings(**{"batch-size": 8})).run
    run = replace(run, optimizer=ClientOptimizer("sgd", 0.0, 0.0))
    context = Context(1, 1, {}, RecordDict(), {})
    torch.manual_seed(3)
    start = {"weight": torch.randn(2, 4), "bias": torch.randn(2)}
    context.state[fedrod_head_key(1)] = ArrayRecord(start)
    FedRod(plain)(run, LocalObjective(), context)
    kept = context.state[fedrod_head_key(1)].to_torch_state_dict()
    for name, value in start.items():
        assert torch.equal(kept[name], value)


def test_the_personal_head_is_a_new_module_without_the_classifiers_hooks() -> None:
    """Beside MOON (whose term hooks the classifier) h_P copies the
    classifier's weights, not its hooks nor, through them, the model."""
    model = tiny_model()
    seen = Representation(model, "MOON")
    head = fedrod.personal_head(model, Context(1, 1, {}, RecordDict(), {}), 1)
    assert not head._forward_hooks and head is not model[2]
    assert torch.equal(head.weight, model[2].weight)
    seen.close()


def test_the_personal_prediction_sums_both_heads() -> None:
    model, head = tiny_model(), nn.Linear(4, 2)
    x = torch.linspace(-1, 1, 24).reshape(8, 3)
    params = {k: v.detach() for k, v in model.state_dict().items()}
    expected = network(params, x) + head(representation(params, x))
    torch.testing.assert_close(PersonalPrediction(model, head)(x), expected)


def test_a_client_tests_the_sum_of_its_heads() -> None:
    """With h_P = 0 the personal model is the shared one (FedAvg's client
    evaluation of the same model gives the same loss); after a round of
    FedRoD it differs."""
    config = run_config(strategy="fedrod")
    model = build_model("mlp-bn", (1, 8, 8), 10, config["seed"])
    sent = ArrayRecord(model.state_dict())
    plain_eval = Context(1, 1, {}, RecordDict(), run_config(strategy="fedavg"))
    reply = client_app.evaluate_personal(message("evaluate", sent, 1, 1), plain_eval)
    shared_loss = reply.content["metrics"]["local-loss"]

    context = Context(1, 1, {}, RecordDict(), config)
    client_app.train(message("train", sent, 1, 1), context)
    trained_head = context.state[fedrod_head_key(1)]
    zero = {
        k: torch.zeros_like(v) for k, v in trained_head.to_torch_state_dict().items()
    }
    context.state[fedrod_head_key(1)] = ArrayRecord(zero)
    reply = client_app.evaluate_personal(message("evaluate", sent, 1, 1), context)
    assert reply.content["metrics"]["local-loss"] == pytest.approx(shared_loss)
    context.state[fedrod_head_key(1)] = trained_head
    reply = client_app.evaluate_personal(message("evaluate", sent, 1, 1), context)
    assert reply.content["metrics"]["local-loss"] != pytest.approx(shared_loss)


def test_the_preset_and_the_schedule() -> None:
    s = Settings.from_run_config({"strategy": "fedrod"})
    assert s.personal_head and s.personal_eval_every == 1 and s.clients_keep_state
    assert local_training(s, None) == FedRod(plain)
    test = personal_test(s)
    assert test.personal is fedrod.tested and test.adapt is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"dp": True, "model": "cnn-gn"}, "personal-head with dp=true"),
        ({"sharing": "fedper"}, "personal-head with sharing='fedper'"),
        ({"ditto-lambda": 0.1}, "personal-head with another personal model"),
        ({"fine-tune-epochs": 1}, "personal-head with fine-tune-epochs"),
        ({"model": "vgg16-lora", "data-set": "cifar10"}, "model='vgg16-lora'"),
        ({"client-execution": "cohort"}, "personal-head=true"),
        ({"per-fedavg-beta": 0.01}, "per-fedavg-beta with a personal model"),
        ({"apfl-alpha": 0.5}, "personal-head with another personal model"),
    ],
)
def test_what_fedrod_refuses(overrides: dict, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        Settings.from_run_config({"strategy": "fedrod", **overrides})
