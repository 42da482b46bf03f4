"""Data, partitions, models and local training: everything a client computes."""

from __future__ import annotations

import hashlib
from collections.abc import Hashable
from dataclasses import dataclass
from functools import cache
from logging import WARNING
from pathlib import Path

import numpy as np
import torch
from flwr.common.logger import log
from torch import nn

from ..settings import Settings
from .data import DataError, Dataset, cache_root, load_dataset, read_node_file
from .lora import FrozenBackboneClassifier
from .models import ModelOptions, build_model
from .partition import (
    PartitionError,
    client_test_indices,
    label_counts,
    partition_indices,
)
from .train import Preprocess, Transform, backbone_features, no_preprocess


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
    classes_per_client: int
    class_assignment: str
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


def shard_fingerprints(settings: Settings, clients: list[int]) -> dict[int, str]:
    """A short hash of each client's shard labels, in order: two processes
    agree on it only if their copies of the data set give that client the
    same examples (a copy ordered otherwise, say by class, gives other ones)."""
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


@dataclass(frozen=True)
class OwnData:
    """A node's own examples (node config `data-file`): one version of the
    .npz that holds them (a changed file is read again) and the one client
    (the node's `partition-id`) whose whole training shard they are."""

    client: int
    data_set: str
    path: str
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, data_set: str, path: str, client: int) -> OwnData:
        """The file at `path` as it is now."""
        resolved = Path(path).expanduser().resolve()
        try:
            stat = resolved.stat()
        except OSError as err:
            raise DataError(
                f"data-file {resolved}: {err.strerror}; node config data-file must "
                "name a .npz this node can read"
            ) from err
        return cls(client, data_set, str(resolved), stat.st_size, stat.st_mtime_ns)


@dataclass(frozen=True)
class NodeData:
    """What one node trains and evaluates on: shards of the run's data set,
    from `settings.data_root` (the node's own data-root, where it has one),
    or the node's `own` examples."""

    settings: Settings
    own: OwnData | None = None

    def dataset(self) -> Dataset:
        """The data set the model is built for, with the statistics that
        normalise its inputs."""
        if self.own is not None:
            return _own_dataset(self.own)
        return federated_data(self.settings)[0]

    def check_client(self, client: int) -> None:
        """Refuse a client this node holds no examples for."""
        check_client(self.settings, client)
        if self.own is not None and client != self.own.client:
            raise PartitionError(
                f"client {client}: this node holds only client {self.own.client}'s "
                f"examples (its partition-id; data-file {self.own.path})"
            )

    def num_examples(self, client: int) -> int:
        """How many examples `client` trains on."""
        self.check_client(client)
        if self.own is not None:
            return len(_own_dataset(self.own).y_train)
        return len(federated_data(self.settings)[1][client])

    def shard_fingerprint(self, client: int) -> str:
        """`client`'s shard of the run's data set as `shard_fingerprints` gives
        it, so the server can tell a node whose copy of the data set differs;
        "" for a node's own examples, which the server does not know."""
        self.check_client(client)
        if self.own is not None:
            return ""
        return shard_fingerprints(self.settings, [client])[client]

    def train_shard(
        self, client: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`client`'s training images and labels on `device`."""
        self.check_client(client)
        if self.own is not None:
            return _own_split(self.own, "train", str(device))
        return client_shard(self.settings, client, device)

    def test_shard(
        self, client: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`client`'s own test examples on `device` (maybe none)."""
        self.check_client(client)
        if self.own is not None:
            return _own_split(self.own, "test", str(device))
        return client_test_shard(self.settings, client, device)

    def global_test(
        self, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The data set's whole test split on `device`.

        A node with its own examples needs no copy of the data set: it uses
        the one in its data-root if there is one (never downloading it), and
        gets None (no global metrics) if not.
        """
        if self.own is None:
            return held_out_split(self.settings, device)
        return _local_test_split(DataKey.of(self.settings), str(device))

    def split_key(self, split: str, client: int) -> Hashable:
        """What `model_inputs` names `client`'s `split` ("train", "test") by."""
        return f"{split}-{client}" if self.own is None else (split, self.own)


@cache
def _own_dataset(own: OwnData) -> Dataset:
    return read_node_file(own.data_set, Path(own.path))


@cache
def _own_split(
    own: OwnData, split: str, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    dataset = _own_dataset(own)
    x, y = getattr(dataset, f"x_{split}"), getattr(dataset, f"y_{split}")
    return x.to(device), y.to(device)


@cache
def _local_test_split(
    key: DataKey, device: str
) -> tuple[torch.Tensor, torch.Tensor] | None:
    try:
        dataset = load_dataset(key.data_set, key.data_root, download=False)
    except DataError as err:
        log(WARNING, "pollen: no global test set on this node, its global "
            "metrics are NaN: %s", err)  # fmt: skip
        return None
    return dataset.x_test.to(device), dataset.y_test.to(device)


def partition_cache(data_root: str) -> Path:
    """Where shards computed from the data sets under `data_root` are kept."""
    return cache_root(data_root) / "partitions"


@cache
def _federated_data(key: DataKey) -> tuple[Dataset, list[np.ndarray]]:
    dataset = load_dataset(key.data_set, key.data_root, key.download)
    shards = partition_indices(
        dataset.y_train.numpy(),
        dataset.num_classes,
        key.num_clients,
        key.partition,
        alpha=key.alpha,
        min_size=key.min_size,
        classes_per_client=key.classes_per_client,
        class_assignment=key.class_assignment,
        seed=key.seed,
        cache_dir=partition_cache(key.data_root),
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


def settings_model(settings: Settings, dataset: Dataset) -> nn.Module:
    """The run's model, freshly initialised from its seed (same on every node)."""
    options = ModelOptions(
        settings.lora_rank,
        settings.lora_alpha,
        settings.lora_dropout,
        settings.backbone_weights,
    )
    return build_model(
        settings.model, dataset.input_shape, dataset.num_classes, settings.seed, options
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
