"""Local training (every local objective) and evaluation on in-memory uint8 tensors.

Shards arrive as uint8 tensors already on the training device; each batch is
converted, normalised and (for 32x32 colour data) augmented there, in one
batched operation, instead of sample by sample in a DataLoader.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

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


class Preprocess:
    """uint8 `[B, C, H, W]` -> float inputs: scale, normalise, augment.

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
        out = x.float().div_(255.0)
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


@dataclass
class Regularizer:
    """weight/2 * ||theta - anchor||^2 - <linear, theta> over named parameters.

    FedProx is (mu, global model, no linear term); FedDyn's client objective is
    (alpha, global model, h_k). Its gradient, weight * (theta - anchor) -
    linear, is added to the data gradient before each optimiser step.
    """

    anchor: dict[str, torch.Tensor]
    weight: float
    linear: dict[str, torch.Tensor] | None = None

    @torch.no_grad()
    def add_gradients(self, named_params: dict[str, nn.Parameter]) -> None:
        for name, anchor in self.anchor.items():
            param = named_params[name]
            term = (param - anchor).mul_(self.weight)
            if self.linear is not None:
                term.sub_(self.linear[name])
            if param.grad is None:
                param.grad = term
            else:
                param.grad.add_(term)

    @torch.no_grad()
    def dyn_state_after(
        self, named_params: dict[str, nn.Parameter]
    ) -> dict[str, torch.Tensor]:
        """FedDyn's next h_k = h_k - alpha (theta_k - theta_t), on the CPU."""
        linear = self.linear or {}
        return {
            name: (
                linear.get(name, 0.0) - self.weight * (named_params[name] - anchor)
            ).cpu()
            for name, anchor in self.anchor.items()
        }


@contextmanager
def frozen_bn_statistics(model: nn.Module) -> Iterator[None]:
    """BatchNorm normalises with batch statistics but updates no running ones.

    Used for SAM's perturbed pass, so only the clean pass moves the running
    mean, variance and counter.
    """
    norms = [m for m in model.modules() if isinstance(m, _BatchNorm)]
    tracking = [m.track_running_stats for m in norms]
    for m in norms:
        m.track_running_stats = False
    try:
        yield
    finally:
        for m, was in zip(norms, tracking, strict=True):
            m.track_running_stats = was


def sam_perturb(params: list[nn.Parameter], rho: float) -> list[torch.Tensor]:
    """Move to theta + rho g / (||g|| + 1e-12) (g: the current gradients); return eps."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    scale = rho / (norm + 1e-12)
    eps = [g * scale for g in grads]
    with torch.no_grad():
        torch._foreach_add_(params, eps)
    return eps


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
    sam_rho: float = 0.0,
    regularizer: Regularizer | None = None,
    after_epoch: Callable[[int], None] | None = None,
) -> TrainResult:
    """Local training over `epochs` of a shard: the local-objective engine.

    Per batch: the clean pass gives g = grad L(theta). With `sam_rho` > 0
    (FedSAM) the descent gradient is taken again at theta + eps, eps =
    rho g / (||g|| + 1e-12), with BatchNorm statistics frozen, and theta is
    restored before the step. A `regularizer` (FedProx, FedDyn) adds its
    gradient; `max_grad_norm` > 0 clips the total; the optimiser steps.
    `after_epoch(epoch)` is called after each epoch (the centralised
    baseline evaluates there).
    """
    device = x.device
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    params = list(named.values())
    opt = optimizer.build(params)
    order_gen = torch.Generator().manual_seed(seed)
    aug_gen = torch.Generator(device=device).manual_seed(seed + 1)
    # dropout draws from torch's global generator: seeded per round and client
    # too, so that a replayed (resumed) round repeats its masks
    torch.manual_seed(seed + 2)
    has_bn = any(isinstance(m, _BatchNorm) for m in model.modules())
    model.train()
    total, steps = torch.zeros((), device=device), 0
    for epoch in range(1, epochs + 1):
        order = torch.randperm(len(y), generator=order_gen).to(device)
        for idx in order.split(batch_size):
            if len(idx) < 2 and has_bn:
                continue  # BatchNorm cannot train on a single sample
            inputs, targets = preprocess(x[idx], aug_gen), y[idx]
            loss = F.cross_entropy(model(inputs), targets)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if sam_rho > 0:
                eps = sam_perturb(params, sam_rho)
                opt.zero_grad(set_to_none=True)
                with frozen_bn_statistics(model):
                    F.cross_entropy(model(inputs), targets).backward()
                with torch.no_grad():
                    torch._foreach_sub_(params, eps)
            if regularizer is not None:
                regularizer.add_gradients(named)
            if max_grad_norm > 0:
                nn.utils.clip_grad_norm_(params, max_grad_norm)
            opt.step()
            total += loss.detach()
            steps += 1
        if after_epoch is not None:
            after_epoch(epoch)
            model.train()
    if steps == 0:
        raise ValueError(f"a shard of {len(y)} samples gives no training step")
    return TrainResult(loss=float(total) / steps, num_examples=len(y), steps=steps)


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
