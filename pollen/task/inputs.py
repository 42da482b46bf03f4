"""The run's model and what it sees of a batch: settings -> model, and,
for a frozen backbone with `cache-features`, its features computed once.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from functools import lru_cache

import torch
from torch import nn

from ..settings import Settings
from .data import Dataset
from .lora import FrozenBackboneClassifier
from .models import (
    LORA_MODELS,
    MODELS,
    ModelOptions,
    build_model,
    data_shape,
    user_model,
)
from .shards import DataKey
from .train import Preprocess, Transform, backbone_features, no_preprocess, placed


def settings_model(settings: Settings, dataset: Dataset) -> nn.Module:
    """The run's model, freshly initialised from its seed (same on every node)."""
    return build_model(
        settings.model, dataset.input_shape, dataset.num_classes, settings.seed,
        _options(settings),
    )  # fmt: skip


def placed_model(
    settings: Settings, model: nn.Module, device: torch.device
) -> nn.Module:
    """The run's `model` on `device` (`pollen.task.train.placed`):
    channels-last on the CPU where it is the catalogue's, whose layers take
    either layout (`nn.Flatten`, never a `.view` of a convolution's
    output), and trains one client at a time with plain backward passes.
    NCHW elsewhere: a user's forward may `.view` a convolution's output;
    Opacus's per-sample convolution gradients (DP-SGD) unfold their input
    with NCHW strides, and would read a channels-last one wrong without an
    error; a cohort stacks its members' weights for grouped convolutions
    and steps them with fused kernels that read a gradient as laid out as
    its parameter."""
    ours = settings.model in MODELS or settings.model in LORA_MODELS
    plain = not settings.dp and settings.client_execution != "cohort"
    return placed(model, device, channels_last=ours and plain)


@lru_cache(maxsize=1)  # one run's checks ask in turn; a grid's cells keep none
def shape_model(settings: Settings) -> nn.Module:
    """The run's model for the command's checks of its entries, size and one
    step, built once for the run's checks: a user's model as validating
    the settings built it (a slow factory is not run again), else built from
    the settings, a frozen backbone with random weights (the same shapes,
    nothing downloaded). Its weights are not the run's: not to be trained
    in place (copy it)."""
    if settings.model not in MODELS and settings.model not in LORA_MODELS:
        return user_model(settings.model, settings.data_set)
    shape, classes = data_shape(settings.data_set)
    options = ModelOptions(
        settings.lora_rank, settings.lora_alpha, settings.lora_dropout
    )
    return build_model(settings.model, shape, classes, settings.seed, options)


def trained_model(settings: Settings, weights: Mapping[str, torch.Tensor]) -> nn.Module:
    """The run's model holding `weights` (a run's `model.pt`: every entry of
    the model, by name), in evaluation mode. Its shape comes from the data
    set's catalogue entry, so a built-in data set is not read (a user's
    loader is asked for its shape)."""
    shape, classes = data_shape(settings.data_set)
    model = build_model(
        settings.model, shape, classes, settings.seed, _options(settings)
    )
    model.load_state_dict(weights)
    return model.eval()


def _options(settings: Settings) -> ModelOptions:
    return ModelOptions(
        settings.lora_rank,
        settings.lora_alpha,
        settings.lora_dropout,
        settings.backbone_weights,
    )


_FEATURES: dict[tuple, torch.Tensor] = {}


def model_inputs(
    settings: Settings,
    split: Hashable,
    model: nn.Module,
    x: torch.Tensor,
    preprocess: Preprocess,
) -> tuple[torch.Tensor, Transform]:
    """What `model` sees of `x`: the images and `preprocess`, or, with
    `cache-features` and a frozen backbone, the backbone's features of the
    un-augmented images (computed once per process) and the identity.

    `split` names what `x` is (e.g. "train-3", "test": `NodeData.split_key`);
    together with the settings that decide the data and the backbone it keys
    the cache, so any model instance of the run may fill it.
    """
    if not (settings.cache_features and isinstance(model, FrozenBackboneClassifier)):
        return x, preprocess
    key = (
        DataKey.of(settings), settings.model, settings.backbone_weights,
        settings.normalize, split, str(x.device),
    )  # fmt: skip
    if key not in _FEATURES:  # a None generator: no augmentation
        _FEATURES[key] = backbone_features(
            model, x, preprocess, settings.test_batch_size
        )
    return _FEATURES[key], no_preprocess
