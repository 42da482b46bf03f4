"""A user's package of models, data sets and an aggregator, as
docs/extending.md describes one, written where a test wants it: a model
factory, a seeded data-set loader and an aggregation rule that a run can
use, and the wrong ones each refusal is tested on.
"""

from __future__ import annotations

from pathlib import Path

PACKAGE = "userparts"

NETS = '''
"""Model factories: (input_shape, num_classes) -> torch.nn.Module."""

from torch import nn

from pollen.task.lora import LoRALinear


def tiny_net(input_shape, num_classes):
    """A perceptron with one hidden layer of 16."""
    c, h, w = input_shape
    return nn.Sequential(
        nn.Flatten(), nn.Linear(c * h * w, 16), nn.ReLU(), nn.Linear(16, num_classes)
    )


def bn_net(input_shape, num_classes):
    c, h, w = input_shape
    return nn.Sequential(
        nn.Flatten(), nn.Linear(c * h * w, 16), nn.BatchNorm1d(16),
        nn.Linear(16, num_classes),
    )


def lora_net(input_shape, num_classes):
    c, h, w = input_shape
    return nn.Sequential(nn.Flatten(), LoRALinear(c * h * w, num_classes, 2, 2.0))


def wrong_outputs(input_shape, num_classes):
    c, h, w = input_shape
    return nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, num_classes + 1))


def wrong_input(input_shape, num_classes):
    return nn.Linear(5, num_classes)  # no Flatten: images do not fit


def not_a_module(input_shape, num_classes):
    return "a model"


def raises(input_shape, num_classes):
    raise RuntimeError("needs a GPU")


NOT_CALLABLE = 3
'''

DATA = '''
"""Data-set loaders: () -> a mapping of x_train, y_train, x_test, y_test, classes."""

import numpy as np


def blobs():
    """Three classes of 6x6 grey images, each a blob of its own brightness."""
    rng = np.random.default_rng(7)

    def split(n):
        y = rng.integers(0, 3, n)
        x = rng.normal(60.0 + 60.0 * y[:, None, None], 25.0, (n, 6, 6))
        return np.clip(x, 0, 255).astype(np.uint8), y

    (x_train, y_train), (x_test, y_test) = split(160), split(60)
    return {"x_train": x_train, "y_train": y_train, "x_test": x_test,
            "y_test": y_test, "classes": 3}


def features():
    rng = np.random.default_rng(8)
    x = rng.normal(size=(50, 5)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    return {"x_train": x[:40], "y_train": y[:40], "x_test": x[40:],
            "y_test": y[40:], "classes": 2}


def not_a_mapping():
    return blobs()["x_train"], blobs()["y_train"]


def without_classes():
    return {k: v for k, v in blobs().items() if k != "classes"}


def float_labels():
    return {**blobs(), "y_train": blobs()["y_train"].astype(np.float32)}


def labels_beyond_classes():
    return {**blobs(), "classes": 2}


def int_images():
    return {**blobs(), "x_train": blobs()["x_train"].astype(np.int64)}


def raises():
    raise FileNotFoundError("blobs.npz")
'''

RULES = '''
"""Aggregation rules: subclasses of pollen.strategies.aggregation.Rule."""

import numpy as np

from pollen.strategies.aggregation import Aggregate, Rule


class UniformMean(Rule):
    """The unweighted mean of the replies: every client counts once."""

    min_updates = 2

    def __call__(self, updates, keys, trained=()):
        arrays = {
            key: np.mean([u.arrays[key].astype(np.float64) for u in updates], axis=0)
            for key in keys
        }
        return Aggregate(arrays, tuple(updates))
'''

ENTRY_POINTS = f"""
[pollen.models]
tiny = {PACKAGE}.nets:tiny_net

[pollen.aggregators]
uniform = {PACKAGE}.rules:UniformMean

[pollen.data_sets]
blobs = {PACKAGE}.data:blobs
"""


def write_user_package(root: Path, entry_points: bool = False) -> Path:
    """Write the package `userparts` (modules `nets`, `data`, `rules`) into `root`,
    with, given `entry_points`, the metadata of an installed distribution
    that registers `tiny`, `blobs` and `uniform`; `root` is what goes on the path."""
    package = root / PACKAGE
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "nets.py").write_text(NETS)
    (package / "data.py").write_text(DATA)
    (package / "rules.py").write_text(RULES)
    if entry_points:
        info = root / f"{PACKAGE}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: 0.1\n"
        )
        (info / "entry_points.txt").write_text(ENTRY_POINTS)
    return root
