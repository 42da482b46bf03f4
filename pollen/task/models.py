"""Model architectures. Input shape and class count come from the data set."""

from __future__ import annotations

import torch
from torch import nn

Shape = tuple[int, int, int]


def mlp(input_shape: Shape, num_classes: int) -> nn.Module:
    """784-128-64-10 with ReLU (seed 003), for any flattened input size."""
    c, h, w = input_shape
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(c * h * w, 128),
        nn.ReLU(),
        nn.Linear(128, 64),
        nn.ReLU(),
        nn.Linear(64, num_classes),
    )


def mlp_bn(input_shape: Shape, num_classes: int) -> nn.Module:
    """784-128, BatchNorm1d, ReLU, 128-10 (seed 004); logits, no softmax."""
    c, h, w = input_shape
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(c * h * w, 128),
        nn.BatchNorm1d(128),
        nn.ReLU(),
        nn.Linear(128, num_classes),
    )


def _conv_block(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU(),
        nn.MaxPool2d(2),
    )


def cnn(input_shape: Shape, num_classes: int) -> nn.Module:
    """Two conv-BN-ReLU-pool blocks and a 128-unit head (grey 28x28, colour 32x32)."""
    c, h, w = input_shape
    return nn.Sequential(
        _conv_block(c, 32),
        _conv_block(32, 64),
        nn.Flatten(),
        nn.Linear(64 * (h // 4) * (w // 4), 128),
        nn.ReLU(),
        nn.Linear(128, num_classes),
    )


def mobilenet(input_shape: Shape, num_classes: int) -> nn.Module:
    """torchvision MobileNetV2 for small images: stride-1 stem, own input channels.

    The ImageNet stem (stride 2) would shrink a 32x32 image to 1x1 before the
    last blocks; the seeds' CIFAR variant keeps the first convolution at stride 1.
    """
    from torchvision.models import mobilenet_v2

    model = mobilenet_v2(num_classes=num_classes)
    stem = model.features[0][0]
    model.features[0][0] = nn.Conv2d(
        input_shape[0], stem.out_channels, 3, stride=1, padding=1, bias=False
    )
    return model


MODELS = {"mlp": mlp, "mlp-bn": mlp_bn, "cnn": cnn, "mobilenet": mobilenet}


def build_model(
    name: str, input_shape: Shape, num_classes: int, seed: int
) -> nn.Module:
    """A freshly initialised model; the same seed gives the same weights."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; allowed: {', '.join(MODELS)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MODELS[name](input_shape, num_classes)
