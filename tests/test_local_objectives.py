"""Local objectives against manual computations: SAM's two passes, BatchNorm
statistics under SAM, the FedProx/FedDyn regulariser and FedDyn's h_k, each
objective's gradient by hand, decoding `local-objective` names, the anchor
and state an objective loads and saves, client optimisers, and FedDyn kept
finite over many rounds."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, RecordDict
from torch import nn

from pollen.protocol import CONFIG, CONTROL, LR, feddyn_state_key, scaffold_state_key
from pollen.settings import Settings
from pollen.strategies.aggregation import Mean
from pollen.strategies.feddyn import FedDynUpdate
from pollen.task.data import load_dataset
from pollen.task.models import build_model
from pollen.task.objectives import (
    ControlTerm,
    DynTerm,
    LocalObjective,
    ProxTerm,
    diverged,
)
from pollen.task.partition import partition_indices
from pollen.task.sharing import Sharing
from pollen.task.train import (
    ClientOptimizer,
    Preprocess,
    evaluate,
    no_preprocess,
    train_local,
)
from tests.conftest import client_update

IDENTITY = Preprocess((0.0,), (1.0 / 255.0,), normalize=True)  # uint8 -> raw values


def tiny_batch(n: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 4, (n, 1, 2, 2), generator=g, dtype=torch.uint8)
    return x, torch.randint(0, 3, (n,), generator=g)


def tiny_mlp(seed: int = 0, bn: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    layers = [nn.Flatten(), nn.Linear(4, 5)]
    layers += [nn.BatchNorm1d(5)] if bn else []
    layers += [nn.Tanh(), nn.Linear(5, 3)]
    return nn.Sequential(*layers)


def one_step(model: nn.Module, x, y, **objective) -> None:
    """One full-batch step of plain SGD (lr 0.1) with the given objective."""
    train_local(
        model, x, y, epochs=1, batch_size=len(y),
        optimizer=ClientOptimizer("sgd", 0.1, momentum=0.0), preprocess=IDENTITY,
        seed=0, objective=LocalObjective(**objective),
    )  # fmt: skip


def test_sam_step_equals_manual_two_pass_computation() -> None:
    x, y = tiny_batch()
    model, manual = tiny_mlp(), tiny_mlp()
    one_step(model, x, y, sam_rho=0.05)
    params = list(manual.parameters())
    inputs = x.float()
    g = torch.autograd.grad(F.cross_entropy(manual(inputs), y), params)
    norm = torch.sqrt(sum((gi**2).sum() for gi in g))
    with torch.no_grad():
        eps = [0.05 * gi / (norm + 1e-12) for gi in g]
        for p, e in zip(params, eps, strict=True):
            p.add_(e)
    g_adv = torch.autograd.grad(F.cross_entropy(manual(inputs), y), params)
    with torch.no_grad():
        for p, e, ga in zip(params, eps, g_adv, strict=True):
            p.sub_(e).sub_(0.1 * ga)
    for a, b in zip(model.parameters(), manual.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    plain = tiny_mlp()
    one_step(plain, x, y)
    assert not torch.allclose(plain[1].weight, model[1].weight)  # SAM did differ


def test_sam_perturbed_pass_leaves_batchnorm_statistics_alone() -> None:
    x, y = tiny_batch()
    model, clean = tiny_mlp(bn=True), tiny_mlp(bn=True)
    one_step(model, x, y, sam_rho=0.5)
    clean.train()
    clean(x.float())  # exactly one clean pass from the same starting weights
    bn, ref = model[2], clean[2]
    torch.testing.assert_close(bn.running_mean, ref.running_mean)
    torch.testing.assert_close(bn.running_var, ref.running_var)
    assert int(bn.num_batches_tracked) == 1
    assert bn.track_running_stats  # restored after the perturbed pass


def test_regularizer_gradient_matches_autograd_of_penalty() -> None:
    torch.manual_seed(0)
    theta = nn.Parameter(torch.randn(4))
    anchor, h = torch.randn(4), torch.randn(4)
    theta.grad = torch.zeros(4)
    DynTerm(0.3, {"w": anchor}, {"w": h}).add_gradients({"w": theta})
    penalty_theta = theta.detach().clone().requires_grad_(True)
    penalty = 0.15 * ((penalty_theta - anchor) ** 2).sum() - (h * penalty_theta).sum()
    penalty.backward()
    torch.testing.assert_close(theta.grad, penalty_theta.grad)


def test_prox_gradient_by_hand() -> None:
    """grad += mu (theta - theta_t): 0.1 + 0.2 * (1 - 0.5), 0.1 + 0.2 * (2 - 3)."""
    theta = nn.Parameter(torch.tensor([1.0, 2.0]))
    theta.grad = torch.tensor([0.1, 0.1])
    ProxTerm(0.2, {"w": torch.tensor([0.5, 3.0])}).add_gradients({"w": theta})
    torch.testing.assert_close(theta.grad, torch.tensor([0.2, -0.1]))


def test_feddyn_gradient_and_next_h_by_hand() -> None:
    """grad = alpha (theta - theta_t) - h_k = 0.5 * [1, -2] - [0.25, -0.5];
    next h_k = h_k - alpha (theta - theta_t) = [0.25 - 0.5, -0.5 + 1]."""
    theta = nn.Parameter(torch.tensor([1.0, 2.0]))
    term = DynTerm(
        0.5, {"w": torch.tensor([0.0, 4.0])}, {"w": torch.tensor([0.25, -0.5])}
    )
    term.add_gradients({"w": theta})  # no data gradient yet: the term is it
    torch.testing.assert_close(theta.grad, torch.tensor([0.25, -0.5]))
    torch.testing.assert_close(
        term.next_h({"w": theta})["w"], torch.tensor([-0.25, 0.5])
    )


def test_sam_gradient_by_hand() -> None:
    """One weight per class, input 1, target 0: logits w, dL/dw = softmax(w) - e_0.
    SAM's gradient is that at w + rho g / ||g||; w itself is restored."""
    model = nn.Linear(1, 2, bias=False)
    w = [0.3, -0.2]
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[w[0]], [w[1]]]))
    x, y = torch.ones(1, 1), torch.tensor([0])

    def grad_at(v: list[float]) -> list[float]:
        p0 = math.exp(v[0]) / (math.exp(v[0]) + math.exp(v[1]))
        return [p0 - 1.0, 1.0 - p0]

    def regrade() -> None:
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()

    regrade()
    g = grad_at(w)
    torch.testing.assert_close(model.weight.grad.flatten(), torch.tensor(g))
    rho, norm = 0.1, math.hypot(*g)
    LocalObjective(sam_rho=rho).data_gradient(model, [model.weight], regrade)
    at_eps = grad_at([wi + rho * gi / norm for wi, gi in zip(w, g, strict=True)])
    torch.testing.assert_close(model.weight.grad.flatten(), torch.tensor(at_eps))
    torch.testing.assert_close(model.weight.detach().flatten(), torch.tensor(w))


@pytest.mark.parametrize(
    ("name", "rho", "term"),
    [
        ("plain", 0.0, None), ("sam", 0.07, None), ("prox", 0.0, ProxTerm),
        ("feddyn", 0.0, DynTerm), ("prox-sam", 0.07, ProxTerm),
        ("feddyn-sam", 0.07, DynTerm),
    ],
)  # fmt: skip
def test_local_objective_names_decode_to_their_parts(name, rho, term) -> None:
    settings = Settings.from_run_config(
        {"local-objective": name, "sam-rho": 0.07, "prox-mu": 0.3, "dyn-alpha": 0.2}
    )
    objective = LocalObjective.from_settings(settings)
    assert objective.sam_rho == rho
    assert type(objective.regularizer) is (term or type(None))
    if term is ProxTerm:
        assert objective.regularizer.mu == 0.3
    if term is DynTerm:
        assert objective.regularizer.alpha == 0.2
        assert objective.regularizer.exclude_bn  # the default


def objective_of(**run_config) -> LocalObjective:
    return LocalObjective.from_settings(Settings.from_run_config(run_config))


@pytest.mark.parametrize("exclude_bn", [True, False])
def test_feddyn_anchors_at_the_received_model_and_keeps_h_in_state(
    exclude_bn: bool,
) -> None:
    """The anchor is the received model's trained shared entries (BatchNorm's
    scale and shift only without `feddyn-exclude-bn`); h_k starts at zero,
    is saved as h_k - alpha (theta_k - theta_t) and read back next round."""
    model = build_model("mlp-bn", (1, 8, 8), 10, seed=0)
    sharing = Sharing.of("shared", model)
    context = Context(1, 1, {}, RecordDict(), {})
    settings = {"local-objective": "feddyn", "dyn-alpha": 0.5,
                "feddyn-exclude-bn": exclude_bn}  # fmt: skip
    objective = objective_of(**settings)
    objective.load(context, 4, model, sharing, RecordDict())
    term = objective.regularizer
    assert tuple(term.anchor) == sharing.trained_shared(exclude_bn=exclude_bn)
    bn_affine = set(sharing.trained_shared()) - set(sharing.trained_shared(True))
    assert bn_affine and bool(bn_affine & set(term.anchor)) != exclude_bn
    assert all(not h.any() for h in term.h.values())
    theta_t = {n: a.clone() for n, a in term.anchor.items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    objective.save(context, 4, model)
    saved = context.state[feddyn_state_key(4)].to_torch_state_dict()
    params = dict(model.named_parameters())
    for name, h in saved.items():
        torch.testing.assert_close(h, -0.5 * (params[name].detach() - theta_t[name]))
    again = objective_of(**settings)
    again.load(context, 4, model, sharing, RecordDict())
    assert all(torch.equal(again.regularizer.h[n], saved[n]) for n in saved)
    assert all(torch.equal(again.regularizer.anchor[n], params[n]) for n in saved)


def test_prox_anchors_every_trained_shared_entry_and_keeps_nothing() -> None:
    model = build_model("mlp-bn", (1, 8, 8), 10, seed=0)
    sharing = Sharing.of("fedbn", model)  # BatchNorm stays local: not anchored
    context = Context(1, 1, {}, RecordDict(), {})
    objective = objective_of(**{"local-objective": "prox-sam", "prox-mu": 0.3})
    objective.load(context, 0, model, sharing, RecordDict())
    assert tuple(objective.regularizer.anchor) == sharing.trained_shared()
    objective.save(context, 0, model)
    assert dict(context.state) == {}


def test_plain_objective_loads_and_saves_nothing() -> None:
    model = build_model("mlp", (1, 8, 8), 10, seed=0)
    context = Context(1, 1, {}, RecordDict(), {})
    objective = objective_of(**{"local-objective": "sam"})
    objective.load(context, 0, model, Sharing.of("shared", model), RecordDict())
    objective.save(context, 0, model)
    assert objective.regularizer is None and dict(context.state) == {}


def test_feddyn_step_and_client_state_by_hand() -> None:
    x, y = tiny_batch()
    model, data_only = tiny_mlp(), tiny_mlp()
    anchor = {n: p.detach().clone() for n, p in model.named_parameters()}
    h = {n: torch.full_like(p, 0.2) for n, p in anchor.items()}
    reg = DynTerm(0.1, anchor, h)
    # first step starts at theta_t, so the alpha term is zero: theta - lr (g - h)
    one_step(model, x, y, regularizer=reg)
    one_step(data_only, x, y)
    for (name, p), q in zip(
        model.named_parameters(), data_only.parameters(), strict=True
    ):
        torch.testing.assert_close(p, q + 0.1 * h[name])
    state = reg.next_h(dict(model.named_parameters()))
    for name, p in model.named_parameters():  # h_k - alpha (theta_k - theta_t)
        torch.testing.assert_close(
            state[name], h[name] - 0.1 * (p.detach() - anchor[name])
        )


def test_feddyn_sam_step_equals_manual_computation() -> None:
    """feddyn-sam: the data gradient at SAM's perturbed point plus FedDyn's
    regulariser gradient at theta itself, alpha (theta - theta_t) - h_k."""
    x, y = tiny_batch()
    model, manual = tiny_mlp(), tiny_mlp()
    anchor = {n: p.detach() + 0.3 for n, p in model.named_parameters()}
    h = {n: torch.full_like(p, -0.2) for n, p in anchor.items()}
    one_step(model, x, y, sam_rho=0.05, regularizer=DynTerm(0.1, anchor, h))
    named = dict(manual.named_parameters())
    params = list(named.values())
    inputs = x.float()
    g = torch.autograd.grad(F.cross_entropy(manual(inputs), y), params)
    norm = torch.sqrt(sum((gi**2).sum() for gi in g))
    eps = [0.05 * gi / (norm + 1e-12) for gi in g]
    with torch.no_grad():
        for p, e in zip(params, eps, strict=True):
            p.add_(e)
    g_adv = torch.autograd.grad(F.cross_entropy(manual(inputs), y), params)
    with torch.no_grad():
        for (name, p), e, ga in zip(named.items(), eps, g_adv, strict=True):
            p.sub_(e)
            p.sub_(0.1 * (ga + 0.1 * (p - anchor[name]) - h[name]))
    for a, b in zip(model.parameters(), manual.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_prox_pulls_towards_anchor() -> None:
    x, y = tiny_batch()
    start = tiny_mlp()
    far = {n: p.detach() + 1.0 for n, p in start.named_parameters()}
    model, plain = copy.deepcopy(start), copy.deepcopy(start)
    for _ in range(2):
        one_step(model, x, y, regularizer=ProxTerm(0.5, far))
        one_step(plain, x, y)
    for p, q, a in zip(
        model.parameters(), plain.parameters(), far.values(), strict=True
    ):
        assert (a - p).norm() < (a - q).norm()


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw"])
def test_client_optimizers_learn_digits(name) -> None:
    ds = load_dataset("digits", "unused", download=False)
    prep = Preprocess(ds.mean, ds.std)
    model = build_model("mlp", ds.input_shape, 10, seed=1)
    lr = 0.05 if name == "sgd" else 2e-3
    train_local(
        model, ds.x_train, ds.y_train, epochs=3, batch_size=32,
        optimizer=ClientOptimizer(name, lr, weight_decay=1e-4), preprocess=prep, seed=3,
    )  # fmt: skip
    accuracy = evaluate(model, ds.x_test, ds.y_test, batch_size=256, preprocess=prep)[1]
    assert accuracy > 0.9


def test_clipping_bounds_the_update() -> None:
    x, y = tiny_batch()
    model, start = tiny_mlp(), tiny_mlp()
    train_local(
        model, x, y, epochs=1, batch_size=len(y),
        optimizer=ClientOptimizer("sgd", 1.0, momentum=0.0), preprocess=IDENTITY,
        seed=0, max_grad_norm=1e-3,
    )  # fmt: skip
    with torch.no_grad():
        moved = torch.sqrt(
            sum(
                ((p - q) ** 2).sum()
                for p, q in zip(model.parameters(), start.parameters(), strict=True)
            )
        )
    assert float(moved) <= 1e-3 * 1.0001


def test_feddyn_stays_finite_over_many_rounds() -> None:
    """30 rounds of FedDyn on 5 non-IID digit clients, half of them each round:
    each client's objective loads h_k from its state and saves it back, the
    server's FedDyn update corrects the uniform mean."""
    ds = load_dataset("digits", "unused", download=False)
    prep = Preprocess(ds.mean, ds.std)
    shards = partition_indices(
        ds.y_train.numpy(), 10, 5, "niid", alpha=0.3, min_size=10, seed=1
    )
    settings = Settings.from_run_config({"strategy": "feddyn", "dyn-alpha": 0.1})
    server = FedDynUpdate(alpha=0.1, num_clients=5)
    model = build_model("mlp", ds.input_shape, 10, seed=1)
    sharing = Sharing.of("shared", model)
    global_state = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    context = Context(1, 1, {}, RecordDict(), {})  # every client's state
    for rnd in range(1, 31):
        clients = [
            c for c in range(5) if np.random.default_rng([1, rnd]).random() < 0.5
        ] or [rnd % 5]
        updates = []
        for c in clients:
            model.load_state_dict(
                {k: torch.from_numpy(v.copy()) for k, v in global_state.items()}
            )
            objective = LocalObjective.from_settings(settings)
            objective.load(context, c, model, sharing, RecordDict())
            idx = torch.from_numpy(shards[c])
            train_local(
                model, ds.x_train[idx], ds.y_train[idx], epochs=2, batch_size=16,
                optimizer=ClientOptimizer("sgd", 0.1, momentum=0.9, weight_decay=5e-4),
                preprocess=prep, seed=rnd * 10 + c, max_grad_norm=10.0,
                objective=objective,
            )  # fmt: skip
            objective.save(context, c, model)
            arrays = {
                k: v.detach().numpy().copy() for k, v in model.state_dict().items()
            }
            updates.append(client_update(c, arrays))
        aggregate = Mean(uniform=True)(updates, global_state)
        global_state = server.apply(global_state, aggregate, sharing.trained_shared)
        assert all(np.isfinite(v).all() for v in global_state.values()), f"round {rnd}"
    model.load_state_dict({k: torch.from_numpy(v) for k, v in global_state.items()})
    loss, accuracy = evaluate(
        model, ds.x_test, ds.y_test, batch_size=256, preprocess=prep
    )
    assert np.isfinite(loss) and accuracy > 0.8


@pytest.mark.parametrize(
    ("make", "key"),
    [(lambda: DynTerm(0.1), feddyn_state_key(0)),
     (lambda: ControlTerm(0.0), scaffold_state_key(0))],
    ids=["feddyn", "scaffold"],
)  # fmt: skip
def test_a_diverged_round_keeps_the_state_of_the_round_before(make, key) -> None:
    """Round 1 trains h_k or c_k from a finite model; round 2 diverges (lr
    1e30 on inputs x 1e20), a reply the server drops; round 3 trains from a
    finite model again. The state round 2 left is round 1's, so round 3 is
    finite (the diverged state made every later round NaN)."""
    context = Context(1, 1, {}, RecordDict(), {})

    def one_round(lr: float, scale: float) -> tuple[float, nn.Module]:
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        x, y = torch.randn(32, 4) * scale, torch.randint(0, 3, (32,))
        zeros = {k: np.zeros(tuple(v.shape), np.float32)
                 for k, v in model.state_dict().items()}  # fmt: skip
        content = RecordDict({
            CONTROL: ArrayRecord({k: Array(v) for k, v in zeros.items()}),
            CONFIG: ConfigRecord({LR: lr}),
        })  # fmt: skip
        objective = LocalObjective(regularizer=make())
        objective.load(context, 0, model, Sharing.of("shared", model), content)
        result = train_local(
            model, x, y, epochs=2, batch_size=8, optimizer=ClientOptimizer("sgd", lr),
            preprocess=no_preprocess, seed=1, objective=objective,
        )  # fmt: skip
        objective.save(context, 0, model)
        return result.loss, model

    one_round(0.01, 1.0)
    kept = {k: v.clone() for k, v in context.state[key].to_torch_state_dict().items()}
    _, broken = one_round(1e30, 1e20)
    assert diverged(broken)
    for name, value in context.state[key].to_torch_state_dict().items():
        assert torch.equal(value, kept[name]), name
    loss, model = one_round(0.01, 1.0)
    assert math.isfinite(loss) and not diverged(model)
