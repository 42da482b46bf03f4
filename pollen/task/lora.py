"""LoRA layers and the frozen-backbone classifier of FedSA-FTL (seed 002).

LoRA: Hu et al. 2021, https://arxiv.org/abs/2106.09685. FedSA (only the A
matrices are shared): Guo et al. 2025, https://arxiv.org/abs/2410.01463.

A `LoRALinear` computes W0 x + b + (alpha / rank) * B A dropout(x). A and B are
ordinary `nn.Linear` children (`lora_a`, `lora_b`), so sharing policies can
tell them apart by the module that owns them, and Opacus computes their
per-sample gradients with its stock Linear rule. B starts at zero, so a fresh
layer equals its base layer (Hu et al. 2021).
"""

from __future__ import annotations

import torch
from torch import nn


class LoRALinear(nn.Module):
    """A linear layer with a rank-`rank` update B A scaled by alpha / rank."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.base = nn.Linear(in_features, out_features)
        self.lora_a = nn.Linear(in_features, rank, bias=False)
        self.lora_b = nn.Linear(rank, out_features, bias=False)
        nn.init.zeros_(self.lora_b.weight)
        self.dropout = nn.Dropout(dropout)
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scaling * self.lora_b(self.lora_a(self.dropout(x)))


def lora_head(
    in_features: int,
    hidden: int,
    num_classes: int,
    rank: int,
    alpha: float,
    dropout: float,
) -> nn.Sequential:
    """in -> hidden -> classes, both layers LoRA-adapted, ReLU between."""
    return nn.Sequential(
        LoRALinear(in_features, hidden, rank, alpha, dropout),
        nn.ReLU(),
        LoRALinear(hidden, num_classes, rank, alpha, dropout),
    )


class FrozenBackboneClassifier(nn.Module):
    """A frozen feature extractor followed by a trained head.

    The backbone has no trainable parameters and always runs in eval mode
    without autograd, so its output depends on the input alone: a client may
    compute it once per image and train the head on the stored features
    (`cache-features`). `source` says where the backbone's weights came from.
    """

    def __init__(self, backbone: nn.Module, head: nn.Module, source: str) -> None:
        super().__init__()
        self.backbone = backbone.requires_grad_(False).eval()
        self.head = head
        self.source = source

    def train(self, mode: bool = True) -> FrozenBackboneClassifier:
        super().train(mode)
        self.backbone.eval()
        return self

    @torch.no_grad()
    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of images `[B, C, H, W]`, or of cached features `[B, F]`."""
        return self.head(x if x.dim() == 2 else self.features(x))
