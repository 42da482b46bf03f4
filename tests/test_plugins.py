"""User plug-ins beyond the plain cases of test_extensions.py: models that
reuse a module, lazy layers, no linear classifier; loaders in the Keras
layout or counting classes with numpy; entry points shadowed by a built-in
or naming a nested attribute; a local objective whose term cannot be
imported. Each is made to work or refused up front naming the key."""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pollen.extensions import data_set_info
from pollen.listing import models
from pollen.settings import Settings, SettingsError
from tests.user_package import on_path, write_distribution, write_user_package

PKG = "rvplug"

MODULE = '''
import numpy as np
from torch import nn

from pollen.task.objective_parts import Plain


def reused(input_shape, num_classes):
    """One hidden block applied twice (a common weight-tying pattern)."""
    c, h, w = input_shape
    hidden = nn.Linear(16, 16)
    return nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, 16), hidden, nn.ReLU(),
                         hidden, nn.Linear(16, num_classes))


def lazy(input_shape, num_classes):
    """A lazily shaped classifier."""
    return nn.Sequential(nn.Flatten(), nn.LazyLinear(num_classes))


def conv_head(input_shape, num_classes):
    """An all-convolutional classifier: no nn.Linear."""
    c, h, w = input_shape
    return nn.Sequential(nn.Conv2d(c, num_classes, 3, padding=1),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten())


class Holder:
    @staticmethod
    def make(input_shape, num_classes):
        """A perceptron reached through a class attribute."""
        c, h, w = input_shape
        return nn.Sequential(nn.Flatten(), nn.Linear(c * h * w, num_classes))


def numpy_classes():
    """blobs, its classes counted with numpy (np.int64)."""
    from userparts.data import blobs

    d = blobs()
    d["classes"] = d["y_train"].max() + 1
    return d


def channels_last():
    """Colour 32x32 images in the Keras layout [N, H, W, C] (as cifar10's .npz)."""
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (100, 32, 32, 3), dtype=np.uint8)
    y = rng.integers(0, 10, 100)
    return {"x_train": x[:80], "y_train": y[:80], "x_test": x[80:],
            "y_test": y[80:], "classes": 10}


class TypoObjective(Plain):
    """A local objective whose term path is mistyped."""

    term = "rvplug.parts:L1Trm"
'''

ENTRY_POINTS = """
[pollen.models]
mlp = rvplug.parts:lazy
nested = rvplug.parts:Holder.make
"""


@pytest.fixture(scope="module", autouse=True)
def package(tmp_path_factory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("rvuser")
    (root / PKG).mkdir()
    (root / PKG / "__init__.py").write_text("")
    (root / PKG / "parts.py").write_text(textwrap.dedent(MODULE))
    write_user_package(root)
    write_distribution(root, PKG, ENTRY_POINTS)
    with on_path(root):
        yield root


def settings(**values: object) -> Settings:
    return Settings.from_run_config(
        {key.replace("_", "-"): value for key, value in values.items()}
    )


def _run_model(s: Settings):
    """What the ServerApp does with the model before round 1 (no Flower)."""
    from pollen.runs.start import load_model
    from pollen.task.data import load_dataset
    from pollen.task.sharing import Sharing

    dataset = load_dataset(s.data_set, s.data_root, s.download)
    model = load_model(s, dataset)
    Sharing.of(s.sharing_policy, model)
    return {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}


def test_a_model_reusing_a_module_runs() -> None:
    """One hidden block applied twice: both its state-dict names get a kind
    (the sharing map raised KeyError '4.weight' inside the run)."""
    s = settings(model=f"{PKG}.parts:reused", data_set="userparts.data:blobs")
    entries = _run_model(s)
    assert np.array_equal(entries["2.weight"], entries["4.weight"])


def test_a_lazy_model_is_given_its_sizes_under_its_seed() -> None:
    """nn.LazyLinear passed the probe and failed in the run (an
    uninitialised parameter); it is now sized by a batch of zeros, the
    same way in every process."""
    s = settings(model=f"{PKG}.parts:lazy", data_set="userparts.data:blobs")
    first, second = _run_model(s), _run_model(s)
    assert first["1.weight"].shape == (3, 36)
    assert np.array_equal(first["1.weight"], second["1.weight"])


def test_fedper_needs_a_linear_classifier() -> None:
    """With no nn.Linear FedPer kept nothing on the clients: plain FedAvg."""
    with pytest.raises(SettingsError, match="this model has none"):
        settings(model=f"{PKG}.parts:conv_head", data_set="userparts.data:blobs",
                 sharing="fedper")  # fmt: skip


def test_a_channels_last_loader_is_transposed() -> None:
    """[N, H, W, C] colour images were read as 32 channels of 32x3."""
    info = data_set_info(f"{PKG}.parts:channels_last")
    assert (info.channels, info.side) == (3, 32)


def test_classes_counted_with_numpy_are_accepted() -> None:
    settings(data_set=f"{PKG}.parts:numpy_classes")


def test_a_registered_name_a_built_in_shadows_is_listed_as_not_used() -> None:
    (row,) = [line for line in models().splitlines() if "rvplug.parts:lazy" in line]
    assert row.split()[0] == "mlp" and "the built-in of this name wins" in row


def test_an_entry_point_naming_a_nested_attribute_is_accepted() -> None:
    assert "nested" in models()
    settings(model="nested", data_set="userparts.data:blobs")


def test_a_local_objectives_term_that_cannot_be_imported_is_refused() -> None:
    """It passed, then every client failed with a bare AttributeError."""
    with pytest.raises(SettingsError, match=r"local-objective=.*its term 'rvplug"):
        settings(local_objective=f"{PKG}.parts:TypoObjective")
