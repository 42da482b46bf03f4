"""DP-SGD local training with Opacus: per-sample clipping, Gaussian noise, accounting.

Abadi et al. 2016, "Deep learning with differential privacy",
https://arxiv.org/abs/1607.00133 (Algorithm 1; Opacus: https://opacus.ai).

DP-SGD runs through the one training loop (`pollen.task.train.train_loop`)
with its own batch source (Poisson samples) and step rule (Opacus); what a
client has spent is its `PrivacyLedger`, kept between rounds.

Each client calibrates its own noise: with sampling rate q = batch / shard
size and the steps the whole planned run would take it (every round x local
epochs x 1/q steps, as if it were sampled every round), sigma is the smallest
noise multiplier for which the run's `accountant` (`pollen.common.accountants`:
RDP, PRV or PLD) keeps that run within (`dp-epsilon`, `dp-delta`). Batches are
Poisson samples (each example in with probability q), which is what the
accountants assume. The epsilon a client reports is the accountant's value for
the steps it has actually taken; it reports sigma, q and those steps too, so
the summary can give every accountant's epsilon.

The noise and the Poisson sampling draw from operating-system entropy, never
from the run's seed: the server knows that seed, and noise it can regenerate
protects nothing. DP runs are therefore not bit-for-bit repeatable.

Opacus is imported where it is used: importing it takes about 8 s on a
2-core machine, and a deployed ClientApp is a fresh process per message.
"""

from __future__ import annotations

import secrets
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from flwr.app import ConfigRecord, Context
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..common import accountants
from ..protocol import (
    DP_EPSILON,
    DP_NOISE_MULTIPLIER,
    DP_SAMPLE_RATE,
    DP_STEPS,
    dp_steps_key,
)
from .local_run import LocalRun, Outcome
from .objectives import LocalObjective
from .train import (
    Batch,
    Batches,
    ClientOptimizer,
    TrainResult,
    Transform,
    train_loop,
    trainable,
)

if TYPE_CHECKING:
    from ..settings import Settings

DP_ALTERNATIVE = "cnn-gn"
# torch's note that a frozen first layer's input needs no gradient: expected
# here, nothing a user can act on.
warnings.filterwarnings("ignore", message="Full backward hook is firing")


@dataclass(frozen=True)
class PrivacyPlan:
    """How one client trains privately for the whole run."""

    noise_multiplier: float
    sample_rate: float
    max_grad_norm: float
    delta: float
    steps_per_round: int
    accountant: str = "rdp"

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
        accountant: str = "rdp",
    ) -> PrivacyPlan:
        sample_rate = min(1.0, batch_size / shard_size)
        steps_per_round = local_epochs * max(1, round(1 / sample_rate))
        sigma = accountants.noise_multiplier(
            accountant, epsilon=epsilon, delta=delta, sample_rate=sample_rate,
            steps=rounds * steps_per_round,
        )  # fmt: skip
        return cls(
            sigma, sample_rate, max_grad_norm, delta, steps_per_round, accountant
        )

    @classmethod
    def from_settings(cls, settings: Settings, shard_size: int) -> PrivacyPlan:
        """The plan of a client with `shard_size` examples in this run."""
        s = settings
        return cls.calibrate(
            epsilon=s.dp_epsilon, delta=s.dp_delta, max_grad_norm=s.dp_max_grad_norm,
            shard_size=shard_size, batch_size=s.batch_size,
            local_epochs=s.local_epochs, rounds=s.rounds, accountant=s.accountant,
        )  # fmt: skip

    def epsilon_after(self, steps: int) -> float:
        """The epsilon spent after `steps` DP-SGD steps under this plan."""
        return accountants.epsilon(
            self.accountant, noise_multiplier=self.noise_multiplier,
            sample_rate=self.sample_rate, steps=steps, delta=self.delta,
        )  # fmt: skip


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


@dataclass
class PoissonBatches(Batches):
    """One round's `plan.steps_per_round` batches, each example in each with
    probability q (`plan.sample_rate`), drawn from OS entropy; a batch may
    be empty. Augmentation draws from the round's seed."""

    plan: PrivacyPlan
    seed: int

    def __post_init__(self) -> None:
        device = self.device
        self.sampling = torch.Generator(device=device).manual_seed(secrets.randbits(63))
        self.augment = torch.Generator(device=device).manual_seed(self.seed)

    def epochs(self) -> Iterator[Iterator[Batch]]:
        yield self._batches()

    def _batches(self) -> Iterator[Batch]:
        for _ in range(self.plan.steps_per_round):
            chosen = torch.rand(
                len(self.y), generator=self.sampling, device=self.device
            )
            idx = (chosen < self.plan.sample_rate).nonzero().squeeze(1)
            yield self.preprocess(self.x[idx], self.augment), self.y[idx]


class PrivateStep:
    """A DP-SGD step with Opacus: per-sample gradients (`GradSampleModule`),
    each clipped to C, summed, plus N(0, (sigma C)^2) noise from OS entropy,
    divided by the expected batch size q n (the actual size of a Poisson
    batch would leak how many were drawn); `DPOptimizer.pre_step` does that
    and decides whether the step happens."""

    def __init__(
        self, model: nn.Module, optimizer: ClientOptimizer, plan: PrivacyPlan,
        num_examples: int, device: torch.device,
    ) -> None:  # fmt: skip
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer

        self.params = list(trainable(model).values())
        self.network = GradSampleModule(model)
        noise = torch.Generator(device=device).manual_seed(secrets.randbits(63))
        self.optimizer = DPOptimizer(
            optimizer.build(self.params),
            noise_multiplier=plan.noise_multiplier,
            max_grad_norm=plan.max_grad_norm,
            expected_batch_size=max(1, round(plan.sample_rate * num_examples)),
            generator=noise,
        )

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def ready(self, examples: int) -> bool:
        if not examples:  # an empty Poisson batch still takes a noisy step
            for p in self.params:
                p.grad_sample = p.new_zeros((0, *p.shape))
        return self.optimizer.pre_step()

    def step(self) -> None:
        self.optimizer.original_optimizer.step()

    def close(self) -> None:
        """Drop Opacus' per-parameter sums and its hooks: a plain model again."""
        self.optimizer.zero_grad(set_to_none=True)
        self.network._close()


def train_private(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    plan: PrivacyPlan,
    optimizer: ClientOptimizer,
    preprocess: Transform,
    seed: int,
    objective: LocalObjective | None = None,
) -> TrainResult:
    """One round of DP-SGD: `train_loop` on Poisson batches with private steps.

    A data-independent regulariser gradient (FedProx, FedDyn) is added after
    the noise: it touches no example, so it costs no privacy. SAM's second
    pass has no per-sample clipping, nor has a batch term (MOON's): settings
    refuse dp with either.
    """
    objective = objective or LocalObjective()
    if objective.sam_rho > 0:
        raise ValueError("DP-SGD cannot take SAM steps: its second pass is not private")
    if objective.batch_term is not None:
        raise ValueError("DP-SGD cannot add a batch term: it is not clipped per sample")
    rule = PrivateStep(model, optimizer, plan, len(y), x.device)
    batches = PoissonBatches(x, y, preprocess, plan=plan, seed=seed)
    return train_loop(model, batches, rule, objective)


@dataclass
class PrivacyLedger:
    """The privacy one client has spent: its plan for the run and the DP-SGD
    steps its accountant has counted over every round so far, kept in
    `context.state` under `pollen.protocol.dp_steps_key(client)`."""

    plan: PrivacyPlan
    steps: int = 0

    @classmethod
    def load(cls, context: Context, client: int, plan: PrivacyPlan) -> PrivacyLedger:
        stored = context.state.get(dp_steps_key(client))
        return cls(plan, int(stored["steps"]) if stored is not None else 0)

    def spend(self, steps: int) -> None:
        self.steps += steps

    def save(self, context: Context, client: int) -> None:
        context.state[dp_steps_key(client)] = ConfigRecord({"steps": self.steps})

    def metrics(self) -> dict[str, float | int]:
        """The epsilon spent so far, and what it counts: the run's noise
        multiplier, the sampling rate and the steps taken."""
        return {
            DP_EPSILON: self.plan.epsilon_after(self.steps),
            DP_NOISE_MULTIPLIER: self.plan.noise_multiplier,
            DP_SAMPLE_RATE: self.plan.sample_rate,
            DP_STEPS: self.steps,
        }


def private(run: LocalRun, objective: LocalObjective, context: Context) -> Outcome:
    """DP-SGD for one round (a `Training`, chosen by `dp`); the privacy spent
    over every round so far. The loss on the private batches is not covered
    by epsilon, so it does not leave the client."""
    check_private_model(run.model, run.settings.model)
    plan = PrivacyPlan.from_settings(run.settings, len(run.y))
    ledger = PrivacyLedger.load(context, run.client, plan)
    result = train_private(
        run.model, run.x, run.y, plan=plan, optimizer=run.optimizer,
        preprocess=run.prep, seed=run.seed, objective=objective,
    )  # fmt: skip
    ledger.spend(result.steps)
    ledger.save(context, run.client)
    return result, ledger.metrics()
