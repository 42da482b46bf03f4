"""A user's package of models, data sets and parts, as docs/extending.md
describes one, written where a test wants it: a model factory, a seeded
data-set loader, an aggregation rule, a server update and a local objective
that a run can use, and the wrong ones each refusal is tested on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from pollen.extensions import registered

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


def two_outputs(input_shape, num_classes):
    """Logits and features, as some research code returns them."""
    c, h, w = input_shape

    class Both(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, 16))
            self.head = nn.Linear(16, num_classes)

        def forward(self, x):
            features = self.body(x)
            return self.head(features), features

    return Both()


def trains_on_gpu_only(input_shape, num_classes):
    """Evaluates anywhere, raises in training: the check at the door (a
    batch in evaluation mode) passes, and every client then fails."""
    model = tiny_net(input_shape, num_classes)

    def refuse(module, inputs):
        if module.training:
            raise RuntimeError("this model trains on a GPU only")

    model.register_forward_pre_hook(refuse)
    return model


BUILT = []  # the input shapes `counted` was built for, in this process


def counted(input_shape, num_classes):
    """`tiny_net`, each build recorded (a slow factory is built once)."""
    BUILT.append(input_shape)
    return tiny_net(input_shape, num_classes)


def half_frozen(input_shape, num_classes):
    """`tiny_net` with its first layer frozen (a fine-tuned head)."""
    model = tiny_net(input_shape, num_classes)
    model[1].requires_grad_(False)
    return model


def frozen(input_shape, num_classes):
    """A linear model with every parameter frozen."""
    c, h, w = input_shape
    model = nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, num_classes))
    model.requires_grad_(False)
    return model


def not_a_module(input_shape, num_classes):
    return "a model"


def raises(input_shape, num_classes):
    raise RuntimeError("needs a GPU")


NOT_CALLABLE = 3
'''

DATA = '''
"""Data-set loaders: () -> a mapping of x_train, y_train, x_test, y_test, classes."""

import os

import numpy as np


def site_digits():
    """Ten classes of 28x28 grey images from the .npz at $USERPARTS_NPZ,
    where each site keeps its copy."""
    with np.load(os.environ["USERPARTS_NPZ"]) as f:
        splits = {k: f[k] for k in ("x_train", "y_train", "x_test", "y_test")}
    return {**splits, "classes": 10}


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

UPDATES = '''
"""Server updates: subclasses of pollen.strategies.server_update.ServerUpdate."""

import numpy as np

from pollen.strategies.aggregation import cast_like
from pollen.strategies.server_update import ServerUpdate


class DampedAverage(ServerUpdate):
    """x + server-lr (aggregate - x): FedAvg's step shortened (auto lr 0.5)."""

    auto_server_lr = 0.5

    def __init__(self, lr):
        self.lr = lr

    @classmethod
    def from_settings(cls, settings):
        return cls(settings.server_lr)

    def apply(self, current, aggregate, trained):
        return {
            key: cast_like(x + self.lr * (aggregate.arrays[key] - x), x)
            for key, x in current.items()
        }
'''

OBJECTIVES = '''
"""A local objective: its torch-free part (what Settings asks) and its term."""

import torch

from pollen.task.objective_parts import Plain


class L1Decay(Plain):
    """The data loss plus mu ||theta||_1, refused without a weight."""

    term = "userparts.objectives:L1Term"

    @classmethod
    def problem(cls, settings):
        if settings.prox_mu == 0:
            return "userparts' l1 decay with prox-mu=0: the term would be 0"
        return super().problem(settings)


class L1Term:
    """grad (mu ||theta||_1) = mu sign(theta); no state kept."""

    exclude_bn = False

    def __init__(self, mu):
        self.mu, self.names = mu, ()

    @classmethod
    def from_settings(cls, settings):
        return cls(settings.prox_mu)

    @property
    def pull(self):
        return 0.0

    def load(self, context, client, anchor, content):
        self.names = tuple(anchor)

    @torch.no_grad()
    def add_gradients(self, named):
        for name in self.names:
            param = named[name]
            param.grad = param.grad + self.mu * torch.sign(param)

    def save(self, context, client, named):
        """Nothing to keep."""

    def reply_records(self):
        return {}
'''

BROKEN_PARTS = '''
"""Aggregators and server updates that are wrong in ways a round shows."""

import numpy as np

from pollen.strategies.aggregation import Aggregate, Rule, cast_like
from userparts.updates import DampedAverage


class DictMean(Rule):
    """Returns its dict of means, not an Aggregate."""

    def __call__(self, updates, keys, trained=()):
        return {key: np.mean([u.arrays[key] for u in updates], axis=0) for key in keys}


class Raises(Rule):
    def __call__(self, updates, keys, trained=()):
        raise KeyError("num-examples")


class Float64Update(DampedAverage):
    """Forgets `cast_like`: pollen casts its float64 result."""

    def apply(self, current, aggregate, trained):
        return dict(aggregate.arrays)


class Dropping(DampedAverage):
    """Leaves the first entry out of the next model."""

    def apply(self, current, aggregate, trained):
        kept = {k: cast_like(v, current[k]) for k, v in aggregate.arrays.items()}
        kept.pop(next(iter(kept)))
        return kept
'''

BROKEN_OBJECTIVES = '''
"""Local objectives whose terms are wrong in ways only a step shows."""

import torch

from pollen.task.objective_parts import Plain
from userparts.objectives import L1Term


class TensorPull(Plain):
    term = "userparts.broken_objectives:TensorPullTerm"


class TensorPullTerm(L1Term):
    """Its pull is a tensor: Flower's metric record refuses it."""

    @property
    def pull(self):
        return torch.tensor(0.5)


class Dropping(Plain):
    term = "userparts.broken_objectives:DroppingTerm"


class DroppingTerm(L1Term):
    """Sets every gradient to None: the optimiser then skips each entry."""

    def add_gradients(self, named):
        for name in self.names:
            named[name].grad = None


class NeedsMessage(Plain):
    term = "userparts.broken_objectives:NeedsMessageTerm"


class NeedsMessageTerm(DroppingTerm):
    """Reads a record only its server sends: not tried before the run."""

    def load(self, context, client, anchor, content):
        self.offset = content["server-offset"]
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
    """Write the package `userparts` (modules `nets`, `data`, `rules`,
    `updates`, `objectives`, `broken_objectives`, `broken_parts`) into
    `root`,
    with, given `entry_points`, the metadata of an installed distribution
    that registers `tiny`, `blobs` and `uniform`; `root` is what goes on the path."""
    package = root / PACKAGE
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "nets.py").write_text(NETS)
    (package / "data.py").write_text(DATA)
    (package / "rules.py").write_text(RULES)
    (package / "updates.py").write_text(UPDATES)
    (package / "objectives.py").write_text(OBJECTIVES)
    (package / "broken_objectives.py").write_text(BROKEN_OBJECTIVES)
    (package / "broken_parts.py").write_text(BROKEN_PARTS)
    if entry_points:
        write_distribution(root, PACKAGE, ENTRY_POINTS)
    return root


def write_distribution(root: Path, name: str, entry_points: str) -> None:
    """The metadata of an installed distribution `name` in `root` that
    registers `entry_points` (an entry_points.txt)."""
    info = root / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n"
    )
    (info / "entry_points.txt").write_text(entry_points)


@contextlib.contextmanager
def on_path(root: Path) -> Iterator[Path]:
    """`root` first on the module path, and entry points read afresh on the
    way in and out (pollen reads them once per process)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(root))
        registered.cache_clear()
        yield root
    registered.cache_clear()
