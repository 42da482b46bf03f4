"""Partition rules as their help states them, a split the settings can
refuse before anything starts, and float features finite as trained."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from pollen.settings import Settings, SettingsError
from pollen.task.data import DataError, load_dataset, read_node_file
from pollen.task.partition import label_counts, partition_indices
from tests.user_package import PACKAGE, on_path, write_user_package


def digits_labels() -> np.ndarray:
    return load_dataset("digits", "/tmp", False).y_train.numpy()


@pytest.mark.parametrize(
    ("clients", "per_client", "equal"), [(20, 3, True), (10, 10, True), (5, 2, False)]
)
def test_deterministic_assignment_is_even_as_its_help_says(
    clients: int, per_client: int, equal: bool
) -> None:
    """'deterministic': every class on equally many clients when num-clients
    is a multiple of the classes, or classes-per-client is all of them (the
    help said "when num-clients x classes-per-client is": 5 x 2 clients
    leave classes 6-9 unused)."""
    y = digits_labels()
    shards = partition_indices(
        y, 10, clients, "pathological", classes_per_client=per_client,
        class_assignment="deterministic", seed=1,
    )  # fmt: skip
    holders = (label_counts(y, shards, 10) > 0).sum(axis=0)
    assert (len(set(holders.tolist())) == 1) == equal, holders.tolist()


def test_silos_with_more_clients_than_classes_is_refused_by_the_settings() -> None:
    """At most one client per class, known from the catalogue: refused
    before anything starts (it failed in the ServerApp, after start-up)."""
    with pytest.raises(SettingsError, match="silos"):
        Settings.from_run_config(
            {"data-set": "digits", "partition": "silos", "num-clients": 11}
        )


@pytest.fixture()
def user_package(tmp_path: Path) -> Iterator[Path]:
    with on_path(write_user_package(tmp_path / "user", entry_points=True)) as root:
        yield root


def test_node_file_features_beyond_float32_are_refused(
    user_package: Path, tmp_path: Path
) -> None:
    """A float64 feature beyond float32's range (1e39) is not finite as
    trained: refused (it passed the check and trained as inf)."""
    x = np.zeros((4, 5), np.float64)
    x[0, 0] = 1e39  # finite as float64, inf as float32
    path = tmp_path / "own.npz"
    np.savez(path, x_train=x, y_train=np.array([0, 1, 0, 1]))
    with (
        warnings.catch_warnings(),
        pytest.raises(DataError, match="not finite in float32"),
    ):
        warnings.simplefilter("ignore")  # numpy's overflow warning in the cast
        read_node_file(f"{PACKAGE}.data:features", path)
