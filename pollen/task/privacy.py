"""DP-SGD local training with Opacus: per-sample clipping, Gaussian noise, accounting.

Each client calibrates its own noise: with sampling rate q = batch / shard
size and the steps the whole planned run would take it (every round x local
epochs x 1/q steps, as if it were sampled every round), sigma is the smallest
noise multiplier for which Opacus' RDP accountant keeps that run within
(`dp-epsilon`, `dp-delta`). Batches are Poisson samples (each example in with
probability q), which is what the accountant assumes. The epsilon a client
reports is the accountant's value for the steps it has actually taken.

The noise and the Poisson sampling draw from operating-system entropy, never
from the run's seed: the server knows that seed, and noise it can regenerate
protects nothing. DP runs are therefore not bit-for-bit repeatable.

Opacus is imported where it is used: importing it takes about 8 s on a
2-core machine, and a deployed ClientApp is a fresh process per message.
"""

from __future__ import annotations

import secrets
import warnings
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .train import ClientOptimizer, Regularizer, TrainResult, Transform

DP_ALTERNATIVE = "cnn-gn"
# Opacus' advice when the best RDP order is the largest one tried (large
# epsilon), and torch's note that a frozen first layer's input needs no
# gradient: both expected here, neither actionable by a user.
warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
warnings.filterwarnings("ignore", message="Full backward hook is firing")


@dataclass(frozen=True)
class PrivacyPlan:
    """How one client trains privately for the whole run."""

    noise_multiplier: float
    sample_rate: float
    max_grad_norm: float
    delta: float
    steps_per_round: int

    @classmethod
    def calibrate(
        cls,
        *,
        epsilon: float,
        delta: float,
        max_grad_norm: float,
        shard_size: int,
        batch_size: int,
        local_epochs: int,
        rounds: int,
    ) -> PrivacyPlan:
        sample_rate = min(1.0, batch_size / shard_size)
        steps_per_round = local_epochs * max(1, round(1 / sample_rate))
        sigma = _noise_multiplier(epsilon, delta, sample_rate, rounds * steps_per_round)
        return cls(sigma, sample_rate, max_grad_norm, delta, steps_per_round)

    def epsilon_after(self, steps: int) -> float:
        """The epsilon spent after `steps` DP-SGD steps under this plan."""
        if steps == 0:
            return 0.0
        from opacus.accountants import RDPAccountant

        accountant = RDPAccountant()
        accountant.history = [(self.noise_multiplier, self.sample_rate, steps)]
        return float(accountant.get_epsilon(self.delta))


@cache
def _noise_multiplier(
    epsilon: float, delta: float, sample_rate: float, steps: int
) -> float:
    """Opacus' calibration (a search over sigma, about a second): once per
    client and process, not every round."""
    from opacus.accountants.utils import get_noise_multiplier

    return get_noise_multiplier(
        target_epsilon=epsilon,
        target_delta=delta,
        sample_rate=sample_rate,
        steps=steps,
        accountant="rdp",
    )


def check_private_model(model: nn.Module, name: str) -> None:
    """Refuse a model Opacus cannot train (BatchNorm mixes samples' gradients)."""
    from opacus.validators import ModuleValidator

    norms = [n for n, m in model.named_modules() if isinstance(m, _BatchNorm)]
    if norms:
        problem = f"BatchNorm layer {norms[0]!r} mixes the samples of a batch"
    elif errors := ModuleValidator.validate(model, strict=False):
        problem = str(errors[0]).splitlines()[0][:200]
    else:
        return
    raise ValueError(
        f"model {name!r} cannot train with dp=true: {problem}; use "
        f"{DP_ALTERNATIVE!r} (the cnn with GroupNorm) or another model without "
        f"BatchNorm"
    )


def train_private(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    plan: PrivacyPlan,
    optimizer: ClientOptimizer,
    preprocess: Transform,
    seed: int,
    regularizer: Regularizer | None = None,
) -> TrainResult:
    """One round of DP-SGD: `plan.steps_per_round` Poisson-sampled steps.

    Opacus computes per-sample gradients, clips each to `max_grad_norm`, sums
    them and adds N(0, (sigma C)^2) noise, divided by the expected batch size
    q n (the actual size of a Poisson batch would leak how many were drawn).
    A data-independent regularizer gradient (FedProx, FedDyn) is added after
    the noise: it touches no example, so it costs no privacy.
    """
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    device = x.device
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    sampler = GradSampleModule(model)
    noise = torch.Generator(device=device).manual_seed(secrets.randbits(63))
    dp_opt = DPOptimizer(
        optimizer.build(list(named.values())),
        noise_multiplier=plan.noise_multiplier,
        max_grad_norm=plan.max_grad_norm,
        expected_batch_size=max(1, round(plan.sample_rate * len(y))),
        generator=noise,
    )
    sampling = torch.Generator(device=device).manual_seed(secrets.randbits(63))
    augment = torch.Generator(device=device).manual_seed(seed)
    sampler.train()
    total = torch.zeros((), device=device)
    for _ in range(plan.steps_per_round):
        dp_opt.zero_grad(set_to_none=True)
        chosen = torch.rand(len(y), generator=sampling, device=device)
        idx = (chosen < plan.sample_rate).nonzero().squeeze(1)
        if len(idx):
            loss = F.cross_entropy(sampler(preprocess(x[idx], augment)), y[idx])
            loss.backward()
            total += loss.detach()
        else:  # an empty Poisson batch still takes a noisy step
            for p in named.values():
                p.grad_sample = p.new_zeros((0, *p.shape))
        if dp_opt.pre_step():
            if regularizer is not None:
                regularizer.add_gradients(named)
            dp_opt.original_optimizer.step()
    dp_opt.zero_grad(set_to_none=True)  # drops Opacus' per-parameter sums
    sampler._close()
    steps = plan.steps_per_round
    return TrainResult(loss=float(total) / steps, num_examples=len(y), steps=steps)
