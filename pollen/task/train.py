"""Local training (the one loop every local objective and DP-SGD run through)
and evaluation on in-memory uint8 tensors.

Shards arrive as uint8 tensors already on the training device; each batch is
converted, normalised and (for 32x32 colour data) augmented there, in one
batched operation, instead of sample by sample in a DataLoader.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .objectives import LocalObjective

# uint8 images (or stored features) -> model inputs; the generator drives
# augmentation and is None at evaluation
Transform = Callable[[torch.Tensor, torch.Generator | None], torch.Tensor]


def pick_device(name: str) -> torch.device:
    """`auto` picks CUDA, then MPS, then CPU; an explicit choice must exist."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("invalid value for 'device': 'cuda'; no CUDA device here")
    if name == "mps" and not torch.backends.mps.is_available():
        raise ValueError("invalid value for 'device': 'mps'; no MPS device here")
    return torch.device(name)


def placed(model: nn.Module, device: torch.device, channels_last: bool) -> nn.Module:
    """`model` moved to `device`; with `channels_last`, its 4-D (convolution)
    weights laid out channels-last there if it is the CPU.

    oneDNN's CPU convolutions run in the channels-last (NHWC) layout;
    with NCHW weights every convolution converts, or takes the slower
    im2col path. Channels-last weights make the layers' outputs and
    gradients channels-last too, so one training step of the catalogue's
    CNNs takes 0.60-0.94x the time and an evaluation 0.49-0.78x
    (`benchmarks/memory_format.py`). The values are the same up to float
    summation order. Elsewhere the layout is left as it is: on CUDA it was
    not measured here. A model whose forward `.view`s a convolution's
    output needs NCHW (`pollen.task.inputs.placed_model` says which).
    """
    model = model.to(device)
    if channels_last and device.type == "cpu":
        model = model.to(memory_format=torch.channels_last)
    return model


class Preprocess:
    """uint8 (or float32) `[B, C, H, W]` -> float inputs: scale, normalise, augment.

    The mean/std tensors are built once, on the device the batches live on,
    not per batch (a per-batch host-to-device copy would stall a GPU).
    """

    def __init__(
        self,
        mean: tuple[float, ...],
        std: tuple[float, ...],
        normalize: bool = True,
        augment: bool = False,
        pad: int = 4,
        device: torch.device | str = "cpu",
    ) -> None:
        self.mean = torch.tensor(mean, device=device).view(1, -1, 1, 1)
        self.std = torch.tensor(std, device=device).view(1, -1, 1, 1)
        self.normalize = normalize
        self.augment = augment
        self.pad = pad

    def __call__(
        self, x: torch.Tensor, generator: torch.Generator | None
    ) -> torch.Tensor:
        # images are uint8 (0..255); generated features come as float32
        out = x.float().div_(255.0) if x.dtype == torch.uint8 else x.clone()
        if self.augment and generator is not None:
            out = random_crop_flip(out, self.pad, generator)
        if self.normalize:
            out = out.sub_(self.mean).div_(self.std)
        return out


def random_crop_flip(
    x: torch.Tensor, pad: int, generator: torch.Generator
) -> torch.Tensor:
    """Per-sample random crop from a zero-padded image and horizontal flip, batched."""
    b, c, h, w = x.shape
    padded = F.pad(x, (pad, pad, pad, pad))
    dy = torch.randint(0, 2 * pad + 1, (b,), generator=generator, device=x.device)
    dx = torch.randint(0, 2 * pad + 1, (b,), generator=generator, device=x.device)
    rows = (dy[:, None] + torch.arange(h, device=x.device))[:, None, :, None]
    cols = (dx[:, None] + torch.arange(w, device=x.device))[:, None, None, :]
    batch = torch.arange(b, device=x.device)[:, None, None, None]
    channel = torch.arange(c, device=x.device)[None, :, None, None]
    out = padded[batch, channel, rows, cols]
    flip = torch.rand(b, generator=generator, device=x.device) < 0.5
    return torch.where(flip[:, None, None, None], out.flip(-1), out)


@dataclass(frozen=True)
class TrainResult:
    loss: float
    num_examples: int
    steps: int


@dataclass(frozen=True)
class ClientOptimizer:
    """The client's optimiser: `sgd` (momentum), `adam` or `adamw` (betas)."""

    name: str = "sgd"
    lr: float = 1e-2
    momentum: float = 0.9
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)

    def build(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        if self.name == "sgd":
            return torch.optim.SGD(
                params, self.lr, momentum=self.momentum, weight_decay=self.weight_decay
            )
        if self.name == "adam":
            return torch.optim.Adam(
                params, self.lr, betas=self.betas, weight_decay=self.weight_decay
            )
        if self.name == "adamw":
            return torch.optim.AdamW(
                params, self.lr, betas=self.betas, weight_decay=self.weight_decay
            )
        raise ValueError(f"unknown optimizer {self.name!r}; allowed: sgd, adam, adamw")


Batch = tuple[torch.Tensor, torch.Tensor]  # model inputs, targets
# what sees each batch before the model's step (APFL's personal model)
BatchHook = Callable[[torch.Tensor, torch.Tensor], None]


def trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters a local step moves, by name, in the model's order."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


@contextmanager
def training_only(model: nn.Module, names: Collection[str]) -> Iterator[None]:
    """Inside, only the trainable parameters named in `names` are trained;
    the others are frozen, and restored on the way out (FedRep's phases)."""
    params = dict(model.named_parameters())
    was = {name: p.requires_grad for name, p in params.items()}
    for name, p in params.items():
        p.requires_grad_(was[name] and name in names)
    try:
        yield
    finally:
        for name, p in params.items():
            p.requires_grad_(was[name])


class StepRule(Protocol):
    """How a batch's gradient becomes an optimiser step."""

    network: nn.Module  # what the forward and backward passes run through

    def zero_grad(self) -> None: ...

    def ready(self, examples: int) -> bool:
        """Finish the data gradient of a batch of `examples`; False: no step."""
        ...

    def step(self) -> None: ...

    def close(self) -> None:
        """Undo what the rule did to the model (after the last step)."""
        ...


@dataclass
class Batches:
    """Where one round's batches come from, epoch by epoch: a shard of uint8
    examples `x`, labels `y`, and what turns a batch into model inputs."""

    x: torch.Tensor
    y: torch.Tensor
    preprocess: Transform

    @property
    def num_examples(self) -> int:
        return len(self.y)

    @property
    def device(self) -> torch.device:
        return self.x.device

    def epochs(self) -> Iterator[Iterator[Batch]]:
        raise NotImplementedError


def has_batch_norm(model: nn.Module) -> bool:
    """Whether `model` has BatchNorm: it cannot train on a single sample, and
    its batch statistics see every sample of a batch."""
    return any(isinstance(m, _BatchNorm) for m in model.modules())


@dataclass
class ShuffledBatches(Batches):
    """`num_epochs` passes over the shard in a seeded random order,
    `batch_size` examples at a time, augmented from a seeded generator; a
    single-sample batch is skipped where the model has BatchNorm (it cannot
    train on one)."""

    batch_size: int
    num_epochs: int
    seed: int
    skip_single: bool

    @staticmethod
    def give_a_step(
        num_examples: int, batch_size: int, num_epochs: int, skip_single: bool
    ) -> bool:
        """Whether such batches hold at least one training step."""
        smallest = 2 if skip_single else 1
        return num_epochs >= 1 and min(batch_size, num_examples) >= smallest

    def __post_init__(self) -> None:
        self.order = torch.Generator().manual_seed(self.seed)
        self.augment = torch.Generator(device=self.device).manual_seed(self.seed + 1)

    def epochs(self) -> Iterator[Iterator[Batch]]:
        for _ in range(self.num_epochs):
            yield self._epoch()

    def _epoch(self) -> Iterator[Batch]:
        order = torch.randperm(len(self.y), generator=self.order).to(self.device)
        for idx in order.split(self.batch_size):
            if len(idx) < 2 and self.skip_single:
                continue
            yield self.preprocess(self.x[idx], self.augment), self.y[idx]


class OptimizerStep:
    """A plain step: clip the total gradient to `max_grad_norm` (> 0), step."""

    def __init__(
        self, model: nn.Module, optimizer: ClientOptimizer, max_grad_norm: float
    ) -> None:
        self.network = model
        self.params = list(trainable(model).values())
        self.optimizer = optimizer.build(self.params)
        self.max_grad_norm = max_grad_norm

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def ready(self, examples: int) -> bool:
        return True

    def step(self) -> None:
        if self.max_grad_norm > 0:
            nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.optimizer.step()

    def close(self) -> None:
        """Nothing to undo."""


def _backward(
    network: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    objective: LocalObjective,
) -> torch.Tensor:
    """The objective's data loss on a batch (the cross-entropy, or FedRoD's
    balanced softmax), plus its batch term where it has one, backpropagated
    into the gradients; the data loss returned."""
    loss = objective.data_loss(network(inputs), targets)
    term = objective.batch_loss(inputs, targets)
    (loss if term is None else loss + term).backward()
    return loss


def _regrade(
    rule: StepRule,
    network: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    objective: LocalObjective,
) -> None:
    """The batch's gradient again, from zero, at the parameters as they are now."""
    rule.zero_grad()
    _backward(network, inputs, targets, objective)


def train_loop(
    model: nn.Module,
    batches: Batches,
    rule: StepRule,
    objective: LocalObjective,
    after_epoch: Callable[[int], None] | None = None,
    on_batch: BatchHook | None = None,
) -> TrainResult:
    """The local training loop, for every objective, with or without DP-SGD.

    Per batch: the clean pass gives g = grad F_k(theta) on the batch (with
    the objective's batch term, MOON's or FedProto's, in the same backward
    pass);
    `objective.data_gradient` may take it again elsewhere (SAM); `rule.ready`
    finishes it (DP-SGD: per-sample clipping and noise) or skips the step;
    the objective's regulariser adds its gradient; `rule.step` clips and
    steps. `on_batch(inputs, targets)` sees each batch first, at the
    parameters before its step (APFL trains its personal model on it);
    `after_epoch(epoch)` is called after each epoch (the centralised
    baseline evaluates there). The loss reported is the mean clean-pass loss
    over the steps taken.
    """
    named = trainable(model)
    params = list(named.values())
    network = rule.network
    network.train()
    total, steps = torch.zeros((), device=batches.device), 0
    for epoch, batch_iter in enumerate(batches.epochs(), start=1):
        for inputs, targets in batch_iter:
            rule.zero_grad()
            if len(targets) and on_batch is not None:
                on_batch(inputs, targets)
            if len(targets):
                loss = _backward(network, inputs, targets, objective)
                again = partial(_regrade, rule, network, inputs, targets, objective)
                objective.data_gradient(model, params, again)
                total += loss.detach()
            if rule.ready(len(targets)):
                objective.add_regularizer_gradient(named)
                rule.step()
            steps += 1
        if after_epoch is not None:
            after_epoch(epoch)
            network.train()
    rule.close()
    if steps == 0:
        raise ValueError(
            f"a shard of {batches.num_examples} samples gives no training step"
        )
    return TrainResult(
        loss=float(total) / steps, num_examples=batches.num_examples, steps=steps
    )


def client_seed(seed: int, server_round: int, client: int) -> int:
    """The seed of one client's training in one round: drawn from (run seed,
    round, client), so a replayed (resumed) round repeats its batches."""
    return int(
        np.random.SeedSequence([seed, server_round, client]).generate_state(1)[0]
    )


def train_local(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    epochs: int,
    batch_size: int,
    optimizer: ClientOptimizer,
    preprocess: Transform,
    seed: int,
    max_grad_norm: float = 0.0,
    objective: LocalObjective | None = None,
    after_epoch: Callable[[int], None] | None = None,
    on_batch: BatchHook | None = None,
) -> TrainResult:
    """Local training over `epochs` of a shard (`train_loop` on shuffled
    batches with plain optimiser steps) for `objective` (default: plain).

    Seeded per round and client: the batch order from `seed`, augmentation
    from `seed + 1` and dropout, which draws from torch's global generator,
    from `seed + 2`, so that a replayed (resumed) round repeats its masks.
    """
    rule = OptimizerStep(model, optimizer, max_grad_norm)
    batches = ShuffledBatches(
        x, y, preprocess, batch_size=batch_size, num_epochs=epochs, seed=seed,
        skip_single=has_batch_norm(model),
    )  # fmt: skip
    torch.manual_seed(seed + 2)
    return train_loop(
        model, batches, rule, objective or LocalObjective(), after_epoch, on_batch
    )


@torch.no_grad()
def backbone_features(
    model: nn.Module,
    x: torch.Tensor,
    preprocess: Preprocess,
    batch_size: int,
) -> torch.Tensor:
    """A frozen-backbone model's features of un-augmented `x`, in batches."""
    return torch.cat(
        [model.features(preprocess(xb, None)) for xb in x.split(batch_size)]
    )


def no_preprocess(x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """The identity: for inputs that are already features."""
    return x


@torch.no_grad()
def evaluate(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    batch_size: int,
    preprocess: Transform,
) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of `model` on `x`, `y`."""
    model.eval()
    wide = torch.float32 if x.device.type == "mps" else torch.float64  # MPS: no f64
    loss_sum = torch.zeros((), dtype=wide, device=x.device)
    correct = torch.zeros((), dtype=torch.int64, device=x.device)
    for xb, yb in zip(x.split(batch_size), y.split(batch_size), strict=True):
        logits = model(preprocess(xb, None))
        loss_sum += F.cross_entropy(logits, yb, reduction="sum").to(wide)
        correct += (logits.argmax(1) == yb).sum()
    n = len(y)
    return float(loss_sum) / n, float(correct) / n
