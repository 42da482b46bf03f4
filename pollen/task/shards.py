"""The run's data set and every client's shard, computed once per process.

(A generated data set has no shards: `pollen.task.synthetic` makes each
client's examples where it trains; `server_data` covers both kinds.)

Clients and server derive the same shards from the same settings and seed,
so no indices ever travel; a shard is an index set into the training split,
gathered onto the training device once. `DataKey` is the part of the
settings that decides them (and caches them).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache

import numpy as np
import torch

from ..extensions import data_set_info
from ..settings import Settings
from .data import Dataset, load_dataset, partition_cache
from .partition import (
    PartitionError,
    client_test_indices,
    label_counts,
    run_partition,
)
from .synthetic import (
    SyntheticKey,
    client_sizes,
    synthetic_dataset,
    train_size,
)


@dataclass(frozen=True)
class DataKey:
    """The settings that decide the data and the shards (and nothing else)."""

    data_set: str
    data_root: str
    download: bool
    num_clients: int
    partition: str
    alpha: float
    min_size: int
    partition_draws: int
    classes_per_client: int
    class_assignment: str
    synthetic_alpha: float
    synthetic_beta: float
    seed: int

    @classmethod
    def of(cls, settings: Settings) -> DataKey:
        return cls(
            **{name: getattr(settings, name) for name in cls.__dataclass_fields__}
        )


def federated_data(settings: Settings) -> tuple[Dataset, list[np.ndarray]]:
    """The data set and every client's shard (index set into its training split).

    Computed once per process and data key; clients and server derive the same
    shards from the same seed, so no indices ever travel.
    """
    return _federated_data(DataKey.of(settings))


@dataclass(frozen=True)
class ServerData:
    """What the server knows of the run's data before round 1: the data set
    (model shape, normalisation, global test split), each client's number of
    training examples and, for an image data set, each client's label
    counts (None for a generated one: counting would generate every
    client's examples)."""

    dataset: Dataset
    sizes: list[int]
    label_counts: np.ndarray | None


def synthetic_key(settings: Settings) -> SyntheticKey | None:
    """The generator's settings when the run's data set is generated."""
    if not data_set_info(settings.data_set).generated:
        return None
    return SyntheticKey(
        settings.synthetic_alpha, settings.synthetic_beta, settings.seed
    )


def server_data(settings: Settings) -> ServerData:
    """The data as the server sees it (see `ServerData`)."""
    key = synthetic_key(settings)
    if key is not None:
        sizes = client_sizes(settings.num_clients, key.seed)
        return ServerData(
            synthetic_dataset(key, settings.num_clients),
            [train_size(int(size)) for size in sizes],
            None,
        )
    dataset, shards = federated_data(settings)
    counts = label_counts(dataset.y_train.numpy(), shards, dataset.num_classes)
    return ServerData(dataset, [len(shard) for shard in shards], counts)


def shard_fingerprints(settings: Settings, clients: Iterable[int]) -> dict[int, str]:
    """A short hash of each client's shard labels, in order: two processes
    agree on it only if their copies of the data set give that client the
    same examples (a copy ordered otherwise, say by class, gives other ones).
    Empty for generated data: every node generates the same examples."""
    if synthetic_key(settings) is not None:
        return {}
    dataset, shards = federated_data(settings)
    labels = dataset.y_train.numpy().astype(np.int64)
    return {
        c: hashlib.sha256(labels[shards[c]].tobytes()).hexdigest()[:16] for c in clients
    }


def client_shard(
    settings: Settings, client: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """One client's images and labels on the training device, gathered once."""
    check_client(settings, client)
    return _client_shard(DataKey.of(settings), client, str(device))


def held_out_split(
    settings: Settings, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole test split on `device`, moved there once per process."""
    return _held_out_split(DataKey.of(settings), str(device))


def client_test_shard(
    settings: Settings, client: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """One client's own test examples (same label mix as its training shard)."""
    check_client(settings, client)
    return _client_test_shard(DataKey.of(settings), client, str(device))


def check_client(settings: Settings, client: int) -> None:
    """Refuse a client index without a shard (a negative one would wrap around)."""
    if not 0 <= client < settings.num_clients:
        raise PartitionError(
            f"client {client} has no shard: num-clients={settings.num_clients} "
            f"gives clients 0..{settings.num_clients - 1}"
        )


@cache
def _federated_data(key: DataKey) -> tuple[Dataset, list[np.ndarray]]:
    dataset = load_dataset(key.data_set, key.data_root, key.download)
    shards = run_partition(
        dataset.y_train.numpy(),
        dataset.num_classes,
        key,
        partition_cache(key.data_root),
    )
    return dataset, shards


@cache
def _client_shard(
    key: DataKey, client: int, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    dataset, shards = _federated_data(key)
    index = torch.from_numpy(shards[client])
    return dataset.x_train[index].to(device), dataset.y_train[index].to(device)


@cache
def _test_shards(key: DataKey) -> list[np.ndarray]:
    dataset, shards = _federated_data(key)
    counts = label_counts(dataset.y_train.numpy(), shards, dataset.num_classes)
    return client_test_indices(dataset.y_test.numpy(), counts, key.seed)


@cache
def _client_test_shard(
    key: DataKey, client: int, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    dataset, _ = _federated_data(key)
    index = torch.from_numpy(_test_shards(key)[client])
    return dataset.x_test[index].to(device), dataset.y_test[index].to(device)


@cache
def _held_out_split(key: DataKey, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    dataset, _ = _federated_data(key)
    return dataset.x_test.to(device), dataset.y_test.to(device)
