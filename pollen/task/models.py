"""Model architectures. Input shape and class count come from the data set.

A user's model (`model = "module:function"` or a name an installed package
registers, `pollen.extensions`) is a factory with the signature of `mlp`;
`user_model_info` builds it once to find what the catalogue declares of
pollen's own (BatchNorm, LoRA layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from ..catalog import DATA_SETS, ModelInfo
from ..catalog import MODELS as CATALOG
from ..common.announce import announced
from ..extensions import (
    MODEL_GROUP,
    ExtensionError,
    import_path,
    summary,
    user_function,
)
from .data import user_dataset
from .lora import FrozenBackboneClassifier, LoRALinear, lora_head
from .sharing import TRAINED, entry_kinds

Shape = tuple[int, int, int]


@dataclass(frozen=True)
class ModelOptions:
    """Settings only some architectures read (LoRA heads, the VGG16 backbone)."""

    lora_rank: int = 8
    lora_alpha: float = 8.0
    lora_dropout: float = 0.1
    backbone_weights: str = "random"


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


def logreg(input_shape: Shape, num_classes: int) -> nn.Module:
    """Multinomial logistic regression: one linear layer to the logits, the
    model the FedProx paper trains on its Synthetic data."""
    c, h, w = input_shape
    return nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, num_classes))


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


def _conv_block(c_in: int, c_out: int, group_norm: bool) -> nn.Sequential:
    norm = nn.GroupNorm(8, c_out) if group_norm else nn.BatchNorm2d(c_out)
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
        norm,
        nn.ReLU(),
        nn.MaxPool2d(2),
    )


def _cnn_body(input_shape: Shape, group_norm: bool = False) -> tuple[nn.Module, int]:
    """Two conv-norm-ReLU-pool blocks, flattened; returns (body, feature count)."""
    c, h, w = input_shape
    body = nn.Sequential(
        _conv_block(c, 32, group_norm), _conv_block(32, 64, group_norm), nn.Flatten()
    )
    return body, 64 * (h // 4) * (w // 4)


def cnn(input_shape: Shape, num_classes: int, group_norm: bool = False) -> nn.Module:
    """Two conv-BN-ReLU-pool blocks and a 128-unit head (grey 28x28, colour 32x32)."""
    body, features = _cnn_body(input_shape, group_norm)
    return nn.Sequential(
        body, nn.Linear(features, 128), nn.ReLU(), nn.Linear(128, num_classes)
    )


def cnn_gn(input_shape: Shape, num_classes: int) -> nn.Module:
    """`cnn` with GroupNorm(8 groups) for BatchNorm: what DP-SGD (Opacus) can train,
    since per-sample gradients are undefined when samples share batch statistics."""
    return cnn(input_shape, num_classes, group_norm=True)


def simple_cnn(input_shape: Shape, num_classes: int) -> nn.Module:
    """NIID-Bench's "simple CNN" (Li et al., 2021), LeNet-5 in shape: 5x5 convs
    with 6 and 16 channels, each ReLU and 2x2 max-pool, then 120-84-classes.

    About 15 times fewer multiply-adds than `cnn` on 28x28 input (0.28M against
    4.2M) and no normalisation layers: the model that published non-IID
    benchmark numbers (Fashion-MNIST, MNIST, CIFAR-10) were measured with.
    """
    c, h, w = input_shape
    if problem := CATALOG["simple-cnn"].input_problem(c, min(h, w)):
        raise ValueError(problem)
    side_h, side_w = ((h - 4) // 2 - 4) // 2, ((w - 4) // 2 - 4) // 2
    return nn.Sequential(
        nn.Conv2d(c, 6, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * side_h * side_w, 120), nn.ReLU(),
        nn.Linear(120, 84), nn.ReLU(),
        nn.Linear(84, num_classes),
    )  # fmt: skip


def fedavg_cnn(input_shape: Shape, num_classes: int) -> nn.Module:
    """The CNN of FedAvg (McMahan et al. 2017, https://arxiv.org/abs/1602.05629,
    Section 3), as PFLlib's `FedAvgCNN` builds it, the model its leaderboard
    and personalised baselines use: 5x5 convolutions with 32 and 64 channels,
    unpadded, each ReLU and 2x2 max-pool, then a 512-unit ReLU layer and the
    classifier. No normalisation, no dropout: 582,026 parameters on 28x28 grey
    images and 10 classes (the paper pads its convolutions; PFLlib does not).
    """
    c, h, w = input_shape
    if problem := CATALOG["fedavg-cnn"].input_problem(c, min(h, w)):
        raise ValueError(problem)
    side_h, side_w = ((h - 4) // 2 - 4) // 2, ((w - 4) // 2 - 4) // 2
    return nn.Sequential(
        nn.Conv2d(c, 32, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * side_h * side_w, 512), nn.ReLU(),
        nn.Linear(512, num_classes),
    )  # fmt: skip


def cnn_lora(input_shape: Shape, num_classes: int, options: ModelOptions) -> nn.Module:
    """`cnn` whose two-layer classifier is LoRA-adapted (trained, not frozen, body)."""
    body, features = _cnn_body(input_shape)
    head = lora_head(
        features, 128, num_classes,
        options.lora_rank, options.lora_alpha, options.lora_dropout,
    )  # fmt: skip
    return nn.Sequential(body, head)


def vgg16_lora(
    input_shape: Shape, num_classes: int, options: ModelOptions
) -> FrozenBackboneClassifier:
    """FedSA-FTL's model: frozen VGG16 features, global average pooling to 512,
    and a LoRA-adapted 512 -> 512 -> classes head."""
    c, h, w = input_shape
    if problem := CATALOG["vgg16-lora"].input_problem(c, min(h, w)):
        raise ValueError(problem)
    features, source = vgg16_features(options.backbone_weights)
    backbone = nn.Sequential(features, nn.AdaptiveAvgPool2d(1), nn.Flatten())
    head = lora_head(
        512, 512, num_classes,
        options.lora_rank, options.lora_alpha, options.lora_dropout,
    )  # fmt: skip
    return FrozenBackboneClassifier(backbone, head, source)


def vgg16_features(weights: str) -> tuple[nn.Module, str]:
    """VGG16's convolutional part and where its weights came from.

    `imagenet`: torchvision's ImageNet weights (downloaded once into torch's
    cache); `random`: the current torch seed; anything else: a file holding a
    state dict of VGG16 (`features.N.*` keys) or of its features alone.
    """
    from torchvision.models import vgg

    features = vgg.make_layers(vgg.cfgs["D"], batch_norm=False)
    if weights == "random":
        return features, "random initialisation"
    try:
        features.load_state_dict(_pretrained_features(weights))
    except RuntimeError as err:  # keys or shapes that are not VGG16's
        raise ValueError(
            f"backbone-weights={weights!r}: not VGG16 weights ({err}); allowed: "
            "imagenet, random, or a file saved with torch.save(vgg16().state_dict())"
        ) from err
    return (
        features,
        "imagenet (torchvision)" if weights == "imagenet" else f"file {weights}",
    )


@cache
def _pretrained_features(weights: str) -> dict[str, torch.Tensor]:
    """The features' state dict from ImageNet or a file, read once per process
    (every message builds a fresh model). Files are read with `weights_only`,
    so loading one cannot run code."""
    if weights == "imagenet":
        from torchvision.models import VGG16_Weights

        try:
            state = VGG16_Weights.IMAGENET1K_V1.get_state_dict(progress=False)
        except Exception as err:  # no network, proxy, checksum: all end here
            raise ValueError(
                f"backbone-weights='imagenet': torchvision could not obtain the "
                f"VGG16 ImageNet weights ({type(err).__name__}: {err}); set "
                f"backbone-weights to a local weights file, or to 'random'"
            ) from err
    else:
        try:
            state = torch.load(Path(weights), map_location="cpu", weights_only=True)
            if not isinstance(state, dict):
                raise TypeError(f"it holds a {type(state).__name__}, not a state dict")
        except Exception as err:
            raise ValueError(
                f"backbone-weights={weights!r}: not a VGG16 weights file "
                f"({type(err).__name__}: {err}); allowed: imagenet, random, or a "
                f"file saved with torch.save(vgg16().state_dict())"
            ) from err
    prefixed = {k: v for k, v in state.items() if k.startswith("features.")}
    if prefixed:
        state = {k.removeprefix("features."): v for k, v in prefixed.items()}
    return state


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


MODELS = {
    "mlp": mlp,
    "logreg": logreg,
    "mlp-bn": mlp_bn,
    "cnn": cnn,
    "cnn-gn": cnn_gn,
    "simple-cnn": simple_cnn,
    "fedavg-cnn": fedavg_cnn,
    "mobilenet": mobilenet,
}
LORA_MODELS = {"cnn-lora": cnn_lora, "vgg16-lora": vgg16_lora}


def build_model(
    name: str,
    input_shape: Shape,
    num_classes: int,
    seed: int,
    options: ModelOptions | None = None,
) -> nn.Module:
    """A freshly initialised model; the same seed gives the same weights.

    `name` is a built-in's, or a user's model (`pollen.extensions`): a
    factory `(input_shape, num_classes) -> nn.Module`, as `mlp` is.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if name in LORA_MODELS:
            return LORA_MODELS[name](
                input_shape, num_classes, options or ModelOptions()
            )
        if name in MODELS:
            return MODELS[name](input_shape, num_classes)
        factory = user_function("model", name, MODEL_GROUP)
        with announced(f"building model {name!r} (a user's factory)",
                       f"model {name!r} built"):  # fmt: skip
            model = factory(input_shape, num_classes)
        if isinstance(model, nn.Module):
            _materialise(model, input_shape)
        return model


def _materialise(model: nn.Module, input_shape: tuple[int, ...]) -> None:
    """Give a user's lazy layers (`nn.LazyLinear`, ...) their sizes by one
    batch of zeros, under the model's seed: every entry must exist before
    the sharing policy and the optimiser see the model."""
    tensors = [*model.parameters(), *model.buffers()]
    if not any(is_lazy(t) for t in tensors):
        return
    training = model.training
    with torch.no_grad():
        model.eval()(torch.zeros(2, *input_shape))
    model.train(training)


def _described(output: object) -> str:
    """A model's output by its shapes, not its values (a tuple of two
    tensors printed whole would take lines)."""
    if isinstance(output, torch.Tensor):
        return str(list(output.shape))
    if isinstance(output, tuple | list):
        inside = ", ".join(_described(item) for item in output)
        return f"a {type(output).__name__} of {len(output)} ({inside})"
    return f"a {type(output).__name__}"


def data_shape(data_set: str) -> tuple[Shape, int]:
    """A data set's input shape (channels, height, width) and its number of
    classes: a built-in's from the catalogue, a user's from its loader."""
    if data_set in DATA_SETS:
        info = DATA_SETS[data_set]
        return (info.channels, info.side, info.side), info.classes
    dataset = user_dataset(data_set)
    return dataset.input_shape, dataset.num_classes


@cache
def user_model(name: str, data_set: str) -> nn.Module:
    """A user's model built on `data_set` once per process (seed 0: what is
    read of it is its layers and shapes, not its weights), or
    `ExtensionError` when the factory fails or returns no `nn.Module`.
    Shared by every check in the command: a caller that trains it copies it."""
    shape, classes = data_shape(data_set)
    try:
        model = build_model(name, shape, classes, seed=0)
    except ExtensionError:
        raise
    except Exception as err:
        raise ExtensionError(
            f"model={name!r}: its factory raised {type(err).__name__}: {err} "
            f"{_given(data_set)}"
        ) from err
    if not isinstance(model, nn.Module):
        raise ExtensionError(
            f"model={name!r}: its factory returned a {type(model).__name__}, not "
            "a torch.nn.Module"
        )
    return model


def _given(data_set: str) -> str:
    """How a check's line names the data set a model was built for."""
    shape, classes = data_shape(data_set)
    return f"for data-set {data_set!r} ({'x'.join(map(str, shape))}, {classes} classes)"


@cache
def user_model_info(name: str, data_set: str) -> ModelInfo:
    """What the catalogue says of a user's model, found by building it on
    `data_set`'s input shape and passing a batch of two through it: its
    BatchNorm, LoRA and dropout layers (what DP-SGD, the BatchNorm policies,
    the LoRA sharings and cohorts ask of a model). `ExtensionError` when the factory fails,
    returns no `nn.Module`, or the model cannot take the data or gives
    other than one output per class (`pollen.extensions.model_info` asks
    this at run time)."""
    shape, classes = data_shape(data_set)
    given = _given(data_set)
    model = user_model(name, data_set)
    try:
        with torch.no_grad():
            output = model.eval()(torch.zeros(2, *shape))
    except Exception as err:
        raise ExtensionError(
            f"model={name!r} cannot take a batch of inputs {given}: "
            f"{type(err).__name__}: {err}"
        ) from err
    expected = (2, classes)
    if not isinstance(output, torch.Tensor) or tuple(output.shape) != expected:
        raise ExtensionError(
            f"model={name!r} gives {_described(output)} for a batch of 2 {given}; "
            f"expected logits {list(expected)}, one per class"
        )
    if not any(parameter.requires_grad for parameter in model.parameters()):
        count = sum(parameter.numel() for parameter in model.parameters())
        raise ExtensionError(
            f"model={name!r} has no trainable parameters ({count:,} parameters, "
            "none with requires_grad): every client's optimiser would have nothing "
            "to train; leave at least one layer trainable"
        )
    modules = list(model.modules())
    path = str(import_path(name, MODEL_GROUP))
    return ModelInfo(
        name=name,
        summary=summary(user_function("model", name, MODEL_GROUP), path),
        batchnorm=any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in modules),
        lora=any(isinstance(m, LoRALinear) for m in modules),
        linear=any(isinstance(m, nn.Linear) for m in modules),
        body=any(kind in TRAINED - {"head"} for kind in entry_kinds(model).values()),
        dropout=any(
            isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in modules
        ),
    )
