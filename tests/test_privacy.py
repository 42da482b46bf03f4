"""DP-SGD (`pollen.task.privacy`): per-sample clipping, calibrated Gaussian
noise and epsilon accounting, checked against values computed here by hand
or with Opacus' own accountant, and end to end through the ClientApp."""

from __future__ import annotations

import copy
import math
import sys

import pytest
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from opacus.accountants import RDPAccountant
from opacus.accountants.utils import get_noise_multiplier
from torch import nn

from pollen import client_app
from pollen.protocol import (
    CLIENT,
    DP_EPSILON,
    DP_NOISE_MULTIPLIER,
    DP_SAMPLE_RATE,
    DP_STEPS,
    dp_steps_key,
)
from pollen.settings import Settings
from pollen.task import train as train_module
from pollen.task.models import build_model
from pollen.task.moon import ModelContrast
from pollen.task.objectives import LocalObjective, ProxTerm
from pollen.task.privacy import (
    PrivacyLedger,
    PrivacyPlan,
    check_private_model,
    train_private,
)
from pollen.task.train import ClientOptimizer, Preprocess, no_preprocess, train_local

pytestmark = [
    pytest.mark.filterwarnings("ignore:Optimal order is the largest alpha"),
    pytest.mark.filterwarnings("ignore:Full backward hook is firing"),
]

PLAIN_SGD = ClientOptimizer("sgd", lr=1.0, momentum=0.0, weight_decay=0.0)


def plan(sigma: float, sample_rate: float, clip: float, steps: int = 1) -> PrivacyPlan:
    return PrivacyPlan(
        noise_multiplier=sigma,
        sample_rate=sample_rate,
        max_grad_norm=clip,
        delta=1e-5,
        steps_per_round=steps,
    )


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def clipped_mean_gradient(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, clip: float, batch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_i g_i min(1, C / ||g_i||) / batch_size, one sample at a time; and the
    per-sample norms ||g_i|| (over all parameters together)."""
    params = list(model.parameters())
    total = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
    norms = []
    for xi, yi in zip(x, y, strict=True):
        loss = F.cross_entropy(model(xi[None]), yi[None])
        grads = torch.autograd.grad(loss, params)
        g = torch.cat([t.reshape(-1) for t in grads]).double()
        norm = g.norm()
        norms.append(norm)
        total += g * min(1.0, clip / float(norm))
    return total / batch_size, torch.stack(norms)


def tiny_linear() -> nn.Module:
    torch.manual_seed(3)
    return nn.Linear(4, 3)


@pytest.mark.parametrize(
    ("make_model", "shape"),
    [
        (tiny_linear, (4,)),
        (lambda: build_model("mlp", (1, 2, 2), 3, 0), (1, 2, 2)),
    ],
    ids=["linear", "mlp"],
)
def test_every_per_sample_gradient_is_clipped_before_averaging(
    make_model, shape
) -> None:
    n, clip, lr = 6, 0.5, 1.0
    model = make_model()
    gen = torch.Generator().manual_seed(0)
    x = 1000.0 * torch.randn((n, *shape), generator=gen)
    with torch.no_grad():  # the least likely class: a large gradient for each
        y = model(x).argmin(1)
    reference = copy.deepcopy(model)
    expected, norms = clipped_mean_gradient(reference, x, y, clip, n)
    assert (norms > 100 * clip).all()  # clipping bites for every sample

    before = flat_params(model)
    result = train_private(
        model, x, y, plan=plan(0.0, 1.0, clip),
        optimizer=PLAIN_SGD, preprocess=no_preprocess, seed=0,
    )  # fmt: skip
    assert result.steps == 1 and result.num_examples == n
    update = (flat_params(model) - before).double()
    torch.testing.assert_close(update, -lr * expected, rtol=1e-4, atol=1e-6)
    # each clipped gradient has norm C, so their mean has norm <= C
    assert update.norm() <= lr * clip * (1 + 1e-5)
    # and the unclipped mean would be orders of magnitude larger
    assert update.norm() < norms.mean() / 100


def test_regularizer_gradient_is_added_after_clipping_and_noise() -> None:
    """FedProx under DP-SGD: the step is the clipped mean gradient plus
    mu (theta - anchor), the latter neither clipped nor scaled."""
    n, clip, mu = 6, 0.5, 0.3
    model = tiny_linear()
    gen = torch.Generator().manual_seed(0)
    x = 1000.0 * torch.randn((n, 4), generator=gen)
    with torch.no_grad():
        y = model(x).argmin(1)
    expected, _ = clipped_mean_gradient(copy.deepcopy(model), x, y, clip, n)
    anchor = {name: p.detach() + 2.0 for name, p in model.named_parameters()}
    before = flat_params(model)
    objective = LocalObjective(regularizer=ProxTerm(mu, anchor))
    train_private(
        model, x, y, plan=plan(0.0, 1.0, clip), optimizer=PLAIN_SGD,
        preprocess=no_preprocess, seed=0, objective=objective,
    )  # fmt: skip
    prox = torch.full_like(before, -2.0 * mu).double()  # mu (theta - anchor)
    update = (flat_params(model) - before).double()
    torch.testing.assert_close(update, -(expected + prox), rtol=1e-4, atol=1e-6)


def test_sam_is_refused_under_dp() -> None:
    x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    with pytest.raises(ValueError, match="SAM"):
        train_private(
            tiny_linear(), x, y, plan=plan(1.0, 0.5, 1.0), optimizer=PLAIN_SGD,
            preprocess=no_preprocess, seed=0, objective=LocalObjective(sam_rho=0.05),
        )  # fmt: skip


def test_a_batch_term_is_refused_under_dp() -> None:
    """MOON's term would join the loss outside the per-sample clipping."""
    x, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    with pytest.raises(ValueError, match="batch term"):
        train_private(
            tiny_linear(), x, y, plan=plan(1.0, 0.5, 1.0), optimizer=PLAIN_SGD,
            preprocess=no_preprocess, seed=0,
            objective=LocalObjective(batch_term=ModelContrast(1.0, 0.5)),
        )  # fmt: skip


def test_dp_and_plain_training_run_through_the_same_loop() -> None:
    """Both call the objective's hooks from `train_loop` itself: one loop."""
    callers = []

    class Recording(LocalObjective):
        def add_regularizer_gradient(self, named) -> None:
            callers.append(sys._getframe(1).f_code)

    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    train_local(
        tiny_linear(), x, y, epochs=1, batch_size=4, optimizer=PLAIN_SGD,
        preprocess=no_preprocess, seed=0, objective=Recording(),
    )  # fmt: skip
    train_private(
        tiny_linear(), x, y, plan=plan(1.0, 0.5, 1.0, steps=3), optimizer=PLAIN_SGD,
        preprocess=no_preprocess, seed=0, objective=Recording(),
    )  # fmt: skip
    assert len(callers) == 2 + 3
    assert set(callers) == {train_module.train_loop.__code__}


def test_privacy_ledger_counts_steps_across_rounds_in_state() -> None:
    p = PrivacyPlan.calibrate(
        epsilon=8, delta=1e-5, max_grad_norm=1, shard_size=500, batch_size=50,
        local_epochs=2, rounds=5,
    )  # fmt: skip
    context = Context(1, 1, {}, RecordDict(), {})
    for spent in (20, 40):
        ledger = PrivacyLedger.load(context, 3, p)
        ledger.spend(20)
        ledger.save(context, 3)
        assert context.state[dp_steps_key(3)]["steps"] == spent
        assert ledger.metrics() == {
            DP_EPSILON: p.epsilon_after(spent),
            DP_NOISE_MULTIPLIER: p.noise_multiplier,
            DP_SAMPLE_RATE: 0.1,
            DP_STEPS: spent,
        }
    assert PrivacyLedger.load(context, 4, p).steps == 0  # another client's


def test_noise_has_the_calibrated_scale() -> None:
    batch_size, clip, sigma, lr = 8, 0.7, 2.0, 1.0
    torch.manual_seed(5)
    start = nn.Linear(100, 50)  # 5,050 parameters: 5,050 noise draws
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch_size, 100, generator=gen)
    y = torch.randint(0, 50, (batch_size,), generator=gen)
    after = {}
    for s in (0.0, sigma):
        model = copy.deepcopy(start)
        train_private(
            model, x, y, plan=plan(s, 1.0, clip),
            optimizer=PLAIN_SGD, preprocess=no_preprocess, seed=11,
        )  # fmt: skip
        after[s] = flat_params(model)
    noise = (after[sigma] - after[0.0]).double()
    expected_std = lr * sigma * clip / batch_size
    assert noise.std().item() == pytest.approx(expected_std, rel=0.1)
    assert abs(noise.mean().item()) < 4 * expected_std / math.sqrt(noise.numel())


def test_an_empty_poisson_batch_still_takes_a_noisy_step() -> None:
    clip, sigma, lr = 1.0, 1.5, 1.0
    torch.manual_seed(6)
    model = nn.Linear(100, 50)
    before = flat_params(model)
    x, y = torch.randn(20, 100), torch.randint(0, 50, (20,))
    result = train_private(
        model, x, y, plan=plan(sigma, 1e-12, clip),
        optimizer=PLAIN_SGD, preprocess=no_preprocess, seed=2,
    )  # fmt: skip
    assert result.steps == 1 and result.loss == 0.0  # no example was drawn
    noise = (flat_params(model) - before).double()
    # the expected batch q n rounds up to one example
    assert noise.std().item() == pytest.approx(lr * sigma * clip, rel=0.1)


def accountant_epsilon(
    sigma: float, sample_rate: float, steps: int, delta: float = 1e-5
) -> float:
    """Opacus' RDP accountant, stepped once per DP-SGD step."""
    accountant = RDPAccountant()
    for _ in range(steps):
        accountant.step(noise_multiplier=sigma, sample_rate=sample_rate)
    return accountant.get_epsilon(delta)


def test_calibration_and_epsilon_match_opacus_accountant() -> None:
    p = PrivacyPlan.calibrate(
        epsilon=8, delta=1e-5, max_grad_norm=1, shard_size=500, batch_size=50,
        local_epochs=2, rounds=5,
    )  # fmt: skip
    assert p.sample_rate == pytest.approx(0.1)
    assert p.steps_per_round == 20  # 2 epochs x 10 expected batches
    assert p.max_grad_norm == 1 and p.delta == 1e-5
    sigma = get_noise_multiplier(
        target_epsilon=8, target_delta=1e-5, sample_rate=0.1, steps=100,
        accountant="rdp",
    )  # fmt: skip
    assert p.noise_multiplier == pytest.approx(sigma, rel=1e-12)
    assert p.epsilon_after(0) == 0.0
    spent = []
    for k in (20, 60, 100):
        expected = accountant_epsilon(p.noise_multiplier, 0.1, k)
        assert p.epsilon_after(k) == pytest.approx(expected, rel=1e-9)
        spent.append(expected)
    assert spent[0] < spent[1] < spent[2]
    # the whole planned run spends the budget, and only just
    assert 8 * 0.95 <= spent[2] <= 8


@pytest.mark.parametrize("name", ["cnn", "mlp-bn"])
def test_batchnorm_models_are_refused_with_the_alternative_named(name) -> None:
    model = build_model(name, (1, 8, 8), 10, 0)
    with pytest.raises(ValueError, match="cnn-gn") as err:
        check_private_model(model, name)
    assert repr(name) in str(err.value) and "BatchNorm" in str(err.value)


@pytest.mark.parametrize("name", ["cnn-gn", "mlp"])
def test_models_without_batchnorm_are_accepted(name) -> None:
    check_private_model(build_model(name, (1, 8, 8), 10, 0), name)


def test_train_private_leaves_a_plain_model_behind() -> None:
    model = build_model("cnn-gn", (1, 8, 8), 10, 0)
    gen = torch.Generator().manual_seed(4)
    x = torch.randint(0, 256, (40, 1, 8, 8), generator=gen, dtype=torch.uint8)
    y = torch.randint(0, 10, (40,), generator=gen)
    prep = Preprocess((0.5,), (0.25,))
    p = plan(1.0, 0.25, 1.0, steps=4)
    before = flat_params(model)
    result = train_private(
        model, x, y, plan=p, optimizer=ClientOptimizer(lr=0.05),
        preprocess=prep, seed=7,
    )  # fmt: skip
    assert result.steps == p.steps_per_round == 4
    assert result.num_examples == 40
    assert math.isfinite(result.loss) and result.loss > 0
    assert not torch.equal(flat_params(model), before)

    assert not hasattr(model, "autograd_grad_sample_hooks")
    for name, module in model.named_modules():
        for hooks in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks"):
            assert not getattr(module, hooks), (name, hooks)
        assert not getattr(module, "activations", []), name
    for name, param in model.named_parameters():
        for attr in ("grad_sample", "_forward_counter", "_current_grad_sample"):
            assert not hasattr(param, attr), (name, attr)

    # the bare model still trains and predicts: no hook captures activations
    model.train()
    F.cross_entropy(model(prep(x, None)), y).backward()
    assert all(not getattr(m, "activations", []) for m in model.modules())
    assert not any(hasattr(q, "grad_sample") for q in model.parameters())
    with torch.no_grad():
        assert model.eval()(prep(x, None)).shape == (40, 10)
    # and can be wrapped for DP-SGD again (Opacus refuses hooks added twice)
    again = train_private(
        model, x, y, plan=p, optimizer=ClientOptimizer(lr=0.05),
        preprocess=prep, seed=8,
    )  # fmt: skip
    assert again.steps == 4


@pytest.mark.usefixtures("task_identity")
def test_client_app_accounts_epsilon_per_client_across_rounds() -> None:
    config = {
        "data-set": "digits", "model": "cnn-gn", "num-clients": 8,
        "batch-size": 30, "lr": 0.05, "device": "cpu", "dp": True, "rounds": 3,
    }  # fmt: skip
    settings = Settings.from_run_config(config).to_run_config()
    context = Context(1, 1, {}, RecordDict(), settings)
    arrays = ArrayRecord(
        build_model("cnn-gn", (1, 8, 8), 10, settings["seed"]).state_dict()
    )

    def train(client: int, server_round: int) -> dict:
        msg = Message(
            RecordDict(
                {
                    "arrays": arrays,
                    "config": ConfigRecord(
                        {"lr": 0.05, "server-round": server_round, CLIENT: client}
                    ),
                }
            ),
            dst_node_id=1,
            message_type="train",
        )
        return dict(client_app.train(msg, context).content["metrics"])

    first = train(1, 1)
    other = train(0, 1)  # another client's accountant is its own
    second = train(1, 2)

    batch, delta = settings["batch-size"], settings["dp-delta"]

    def steps_per_round(metrics: dict) -> int:
        return settings["local-epochs"] * round(metrics["num-examples"] / batch)

    per_round = steps_per_round(first)
    q = batch / first["num-examples"]
    sigma = second["dp-noise-multiplier"]
    assert first["dp-noise-multiplier"] == sigma  # the plan is fixed for the run
    # sigma is calibrated so the whole planned run (every round) just fits
    planned = accountant_epsilon(sigma, q, settings["rounds"] * per_round, delta)
    assert settings["dp-epsilon"] - 0.01 <= planned <= settings["dp-epsilon"]
    assert 0 < first["dp-epsilon"] < second["dp-epsilon"] < settings["dp-epsilon"]
    # no loss on the private batches leaves the client; the training time
    # does (the simulated clock's), as the reply's own arrival would show it,
    # and so do its steps (FedNova's; fixed by the shard size, as above) and
    # what its epsilon counts (q and the DP-SGD steps so far: public, as sigma)
    assert set(first) == {
        "num-examples",
        "dp-epsilon",
        "dp-noise-multiplier",
        "dp-sample-rate",
        "dp-steps",
        "train-seconds",
        "local-steps",
        "effective-steps",
    }
    assert first["local-steps"] == per_round
    assert (first["dp-sample-rate"], first["dp-steps"]) == (q, per_round)
    assert second["dp-steps"] == 2 * per_round
    assert context.state["dp-steps-1"]["steps"] == 2 * per_round
    assert context.state["dp-steps-0"]["steps"] == steps_per_round(other)
    for metrics, steps in ((first, per_round), (second, 2 * per_round)):
        expected = accountant_epsilon(sigma, q, steps, delta)
        assert metrics["dp-epsilon"] == pytest.approx(expected, rel=1e-9)
    expected = accountant_epsilon(
        other["dp-noise-multiplier"], batch / other["num-examples"],
        steps_per_round(other), delta,
    )  # fmt: skip
    assert other["dp-epsilon"] == pytest.approx(expected, rel=1e-9)
