"""Local training and evaluation on in-memory uint8 tensors.

Shards arrive as uint8 tensors already on the training device; each batch is
converted, normalised and (for 32x32 colour data) augmented there, in one
batched operation, instead of sample by sample in a DataLoader.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


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


def train_sgd(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    momentum: float,
    weight_decay: float,
    preprocess: Preprocess,
    seed: int,
) -> TrainResult:
    """Plain local SGD (with momentum and weight decay) over `epochs` of a shard."""
    device = x.device
    optimizer = torch.optim.SGD(
        model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay
    )
    order_gen = torch.Generator().manual_seed(seed)
    aug_gen = torch.Generator(device=device).manual_seed(seed + 1)
    model.train()
    total, steps = torch.zeros((), device=device), 0
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=order_gen).to(device)
        for idx in order.split(batch_size):
            if len(idx) < 2 and _has_batchnorm(model):
                continue  # BatchNorm cannot train on a single sample
            inputs = preprocess(x[idx], aug_gen)
            loss = F.cross_entropy(model(inputs), y[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.detach()
            steps += 1
    if steps == 0:
        raise ValueError(f"a shard of {len(y)} samples gives no training step")
    return TrainResult(loss=float(total) / steps, num_examples=len(y), steps=steps)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    batch_size: int,
    preprocess: Preprocess,
) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of `model` on `x`, `y`."""
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=x.device)
    correct = torch.zeros((), dtype=torch.int64, device=x.device)
    for xb, yb in zip(x.split(batch_size), y.split(batch_size), strict=True):
        logits = model(preprocess(xb, None))
        loss_sum += F.cross_entropy(logits, yb, reduction="sum").double()
        correct += (logits.argmax(1) == yb).sum()
    n = len(y)
    return float(loss_sum) / n, float(correct) / n


def _has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
