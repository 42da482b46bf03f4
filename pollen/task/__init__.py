"""Data, partitions, models and local training: everything a client computes."""

from __future__ import annotations

from functools import cache

import numpy as np

from ..settings import Settings
from .data import Dataset, load_dataset
from .partition import partition_indices


def federated_data(settings: Settings) -> tuple[Dataset, list[np.ndarray]]:
    """The data set and every client's shard (index set into its training split).

    Computed once per process and settings; clients and server derive the same
    shards from the same seed, so no indices ever travel.
    """
    return _federated_data(
        settings.data_set,
        settings.data_root,
        settings.download,
        settings.num_clients,
        settings.partition,
        settings.alpha,
        settings.min_size,
        settings.classes_per_client,
        settings.seed,
    )


@cache
def _federated_data(
    data_set: str,
    data_root: str,
    download: bool,
    num_clients: int,
    partition: str,
    alpha: float,
    min_size: int,
    classes_per_client: int,
    seed: int,
) -> tuple[Dataset, list[np.ndarray]]:
    dataset = load_dataset(data_set, data_root, download)
    shards = partition_indices(
        dataset.y_train.numpy(),
        dataset.num_classes,
        num_clients,
        partition,
        alpha=alpha,
        min_size=min_size,
        classes_per_client=classes_per_client,
        seed=seed,
    )
    return dataset, shards
