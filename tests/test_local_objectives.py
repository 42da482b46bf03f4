"""Local objectives against manual computations: SAM's two passes, BatchNorm
statistics under SAM, the FedProx/FedDyn regulariser and FedDyn's h_k, client
optimisers, and FedDyn kept finite over many rounds."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pollen.strategies.feddyn import FedDyn
from pollen.strategies.sampling import Roster
from pollen.task.data import load_dataset
from pollen.task.models import build_model
from pollen.task.partition import partition_indices
from pollen.task.train import (
    ClientOptimizer,
    Preprocess,
    Regularizer,
    evaluate,
    train_local,
)

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


def one_step(model: nn.Module, x, y, **kwargs) -> None:
    """One full-batch step of plain SGD (lr 0.1) with the given objective."""
    train_local(
        model, x, y, epochs=1, batch_size=len(y),
        optimizer=ClientOptimizer("sgd", 0.1, momentum=0.0), preprocess=IDENTITY,
        seed=0, **kwargs,
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
    Regularizer({"w": anchor}, 0.3, {"w": h}).add_gradients({"w": theta})
    penalty_theta = theta.detach().clone().requires_grad_(True)
    penalty = 0.15 * ((penalty_theta - anchor) ** 2).sum() - (h * penalty_theta).sum()
    penalty.backward()
    torch.testing.assert_close(theta.grad, penalty_theta.grad)


def test_feddyn_step_and_client_state_by_hand() -> None:
    x, y = tiny_batch()
    model, data_only = tiny_mlp(), tiny_mlp()
    anchor = {n: p.detach().clone() for n, p in model.named_parameters()}
    h = {n: torch.full_like(p, 0.2) for n, p in anchor.items()}
    reg = Regularizer(anchor, 0.1, h)
    # first step starts at theta_t, so the alpha term is zero: theta - lr (g - h)
    one_step(model, x, y, regularizer=reg)
    one_step(data_only, x, y)
    for (name, p), q in zip(
        model.named_parameters(), data_only.parameters(), strict=True
    ):
        torch.testing.assert_close(p, q + 0.1 * h[name])
    state = reg.dyn_state_after(dict(model.named_parameters()))
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
    one_step(model, x, y, sam_rho=0.05, regularizer=Regularizer(anchor, 0.1, h))
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
        one_step(model, x, y, regularizer=Regularizer(far, 0.5))
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
    """30 rounds of FedDyn on 5 non-IID digit clients, half of them each round."""
    ds = load_dataset("digits", "unused", download=False)
    prep = Preprocess(ds.mean, ds.std)
    shards = partition_indices(
        ds.y_train.numpy(), 10, 5, "niid", alpha=0.3, min_size=10, seed=1
    )
    roster = Roster.from_nodes({c + 1: (c, 5) for c in range(5)}, 5)
    server = FedDyn(alpha=0.1, roster=roster, num_clients=5, client_frac=0.5, seed=1)
    model = build_model("mlp", ds.input_shape, 10, seed=1)
    global_state = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    h_k: dict[int, dict[str, torch.Tensor]] = {}
    for rnd in range(1, 31):
        clients = [
            c for c in range(5) if np.random.default_rng([1, rnd]).random() < 0.5
        ] or [rnd % 5]
        server._global = global_state
        updates = []
        for c in clients:
            model.load_state_dict(
                {k: torch.from_numpy(v.copy()) for k, v in global_state.items()}
            )
            anchor = {n: p.detach().clone() for n, p in model.named_parameters()}
            h = h_k.get(c) or {n: torch.zeros_like(a) for n, a in anchor.items()}
            reg = Regularizer(anchor, 0.1, h)
            idx = torch.from_numpy(shards[c])
            train_local(
                model, ds.x_train[idx], ds.y_train[idx], epochs=2, batch_size=16,
                optimizer=ClientOptimizer("sgd", 0.1, momentum=0.9, weight_decay=5e-4),
                preprocess=prep, seed=rnd * 10 + c, max_grad_norm=10.0, regularizer=reg,
            )  # fmt: skip
            h_k[c] = reg.dyn_state_after(dict(model.named_parameters()))
            updates.append(
                {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
            )
        global_state = server.update(global_state, updates, [1.0] * len(updates))
        assert all(np.isfinite(v).all() for v in global_state.values()), f"round {rnd}"
    model.load_state_dict({k: torch.from_numpy(v) for k, v in global_state.items()})
    loss, accuracy = evaluate(
        model, ds.x_test, ds.y_test, batch_size=256, preprocess=prep
    )
    assert np.isfinite(loss) and accuracy > 0.8
