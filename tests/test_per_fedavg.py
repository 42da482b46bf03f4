"""Per-FedAvg (Fallah et al. 2020, first-order): a step of two batches by
hand, the personalising step a client tests after, and what it refuses."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from flwr.app import ArrayRecord, Context, RecordDict
from torch import nn

from pollen import client_app
from pollen.settings import Settings, SettingsError
from pollen.task.local_run import ADAPT_SEED_OFFSET
from pollen.task.models import build_model
from pollen.task.objectives import LocalObjective
from pollen.task.per_fedavg import PerFedAvg, adapted
from pollen.task.schedule import local_training
from tests.test_apfl import network
from tests.test_schedule import context, local_run, settings
from tests.test_sharing import message, run_config

pytestmark = pytest.mark.usefixtures("task_identity")


def gradient(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> dict:
    """grad of the cross-entropy of tiny_model at `params` on (x, y)."""
    live = {k: v.clone().requires_grad_() for k, v in params.items()}
    loss = nn.functional.cross_entropy(network(live, x), y)
    return dict(zip(live, torch.autograd.grad(loss, list(live.values())), strict=True))


@pytest.mark.parametrize("batch_size", [4, 8])
def test_one_step_by_hand(batch_size: int) -> None:
    """8 examples, seed 7: D and D' are the two halves of the seeded order,
    as two batches of 4 or as one batch of 8 split in two; w_tmp = w - 0.1
    grad f(w; D), w <- w - 0.02 grad f(w_tmp; D')."""
    recorded = local_run(settings(**{"batch-size": batch_size}))
    run = recorded.run
    w = {k: v.detach().clone() for k, v in run.model.state_dict().items()}
    order = torch.randperm(8, generator=torch.Generator().manual_seed(7))
    first, second = order[:4], order[4:]
    g = gradient(w, run.x[first], run.y[first])
    w_tmp = {k: w[k] - 0.1 * g[k] for k in w}
    g_next = gradient(w_tmp, run.x[second], run.y[second])
    result, metrics = PerFedAvg(0.02)(run, LocalObjective(), context())
    assert result.steps == 1 and metrics["train-loss"] == pytest.approx(result.loss)
    loss_next = nn.functional.cross_entropy(
        network(w_tmp, run.x[second]), run.y[second]
    )
    assert result.loss == pytest.approx(float(loss_next), rel=1e-6)
    for k in w:
        torch.testing.assert_close(run.model.state_dict()[k], w[k] - 0.02 * g_next[k])


def test_batches_pair_across_epochs_and_one_batch_steps_on_its_halves() -> None:
    """8 examples in batches of 3 over 2 epochs: 6 batches, 3 steps; one
    batch of 8 in one epoch: one step on its halves; one example: none."""
    recorded = local_run(settings(**{"batch-size": 3, "local-epochs": 2}))
    result, _ = PerFedAvg(0.02)(recorded.run, LocalObjective(), context())
    assert result.steps == 3
    whole = local_run(settings(**{"batch-size": 8})).run
    result, _ = PerFedAvg(0.02)(whole, LocalObjective(), context())
    assert result.steps == 1 and result.num_examples == 8
    alone = replace(whole, x=whole.x[:1], y=whole.y[:1])
    with pytest.raises(ValueError, match="no Per-FedAvg step"):
        PerFedAvg(0.02)(alone, LocalObjective(), context())


def test_the_personalising_step_by_hand() -> None:
    recorded = local_run(settings(**{"batch-size": 4}))
    run = recorded.run
    w = {k: v.detach().clone() for k, v in run.model.state_dict().items()}
    seed = run.seed + ADAPT_SEED_OFFSET
    batch = torch.randperm(8, generator=torch.Generator().manual_seed(seed))[:4]
    g = gradient(w, run.x[batch], run.y[batch])
    adapted(run)
    for k in w:
        torch.testing.assert_close(run.model.state_dict()[k], w[k] - 0.1 * g[k])


def test_a_personal_evaluation_takes_the_step_first() -> None:
    """The same received model tested by a FedAvg client and by a Per-FedAvg
    one: the latter's numbers are those after its step, on both sets."""
    results = {}
    for strategy in ("fedavg", "per-fedavg"):
        config = run_config(strategy=strategy, **{"personal-eval-every": 1})
        model = build_model("mlp-bn", (1, 8, 8), 10, config["seed"])
        sent = ArrayRecord(model.state_dict())
        context = Context(1, 1, {}, RecordDict(), config)
        reply = client_app.evaluate_personal(message("evaluate", sent, 1, 1), context)
        results[strategy] = dict(reply.content["metrics"])
    assert results["fedavg"]["local-loss"] != results["per-fedavg"]["local-loss"]
    assert math.isnan(results["fedavg"]["global-accuracy"])
    assert math.isfinite(results["per-fedavg"]["global-accuracy"])


def test_the_client_app_trains_per_fedavgs_steps() -> None:
    """The same training message to a FedAvg client and a Per-FedAvg one:
    the ClientApp runs Per-FedAvg's schedule, whose reply differs, finite."""
    replies = {}
    for strategy in ("fedavg", "per-fedavg"):
        config = run_config(strategy=strategy)
        model = build_model("mlp-bn", (1, 8, 8), 10, config["seed"])
        sent = ArrayRecord(model.state_dict())
        context = Context(1, 1, {}, RecordDict(), config)
        reply = client_app.train(message("train", sent, 1, 1), context)
        replies[strategy] = reply.content["arrays"].to_torch_state_dict()
    weight = next(k for k in replies["fedavg"] if k.endswith("weight"))
    assert torch.isfinite(replies["per-fedavg"][weight]).all()
    assert not torch.equal(replies["fedavg"][weight], replies["per-fedavg"][weight])


def test_the_preset_and_the_schedule() -> None:
    s = Settings.from_run_config({"strategy": "per-fedavg"})
    assert s.per_fedavg_beta == 0.005 and s.personal_eval_every == 1
    assert local_training(s, None) == PerFedAvg(0.005)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"dp": True, "model": "cnn-gn"}, "per-fedavg-beta with dp=true"),
        ({"local-objective": "prox"}, "local-objective='prox'"),
        ({"ditto-lambda": 0.1}, "a personal model"),
        ({"fine-tune-epochs": 1}, "per-fedavg-beta with fine-tune-epochs"),
        ({"client-execution": "cohort"}, "per-fedavg-beta=0.005"),
    ],
)
def test_what_per_fedavg_refuses(overrides: dict, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        Settings.from_run_config({"strategy": "per-fedavg", **overrides})
