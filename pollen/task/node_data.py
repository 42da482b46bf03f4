"""What one node trains and evaluates on: shards of the run's data set, or
the node's own examples (node config `data-file`).

Both node-config keys are optional: `data-root` replaces the run's
`data-root` (a path on the server's machine) as the folder this node loads
the run's data set from, and `data-file` names a .npz of the node's own
examples, which it trains on whole as client `partition-id` instead of a
shard of the data set (`pollen.task.data.read_node_file`).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, replace
from functools import cache
from logging import WARNING
from pathlib import Path

import torch
from flwr.app import Context
from flwr.common.logger import log

from ..protocol import CLIENT, DATA_FILE, DATA_ROOT, NUM_PARTITIONS
from ..settings import Settings
from .data import DataError, Dataset, load_dataset, read_node_file
from .partition import (
    PartitionError,
)
from .shards import (
    DataKey,
    check_client,
    client_shard,
    client_test_shard,
    federated_data,
    held_out_split,
    shard_fingerprints,
    synthetic_key,
)
from .synthetic import (
    client_split,
    client_train_size,
    global_test,
    synthetic_dataset,
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
        if key := synthetic_key(self.settings):
            return synthetic_dataset(key, None)  # for the model: no test split
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
        if key := synthetic_key(self.settings):
            return client_train_size(key, self.settings.num_clients, client)
        return len(federated_data(self.settings)[1][client])

    def shard_fingerprint(self, client: int) -> str:
        """`client`'s shard of the run's data set as `shard_fingerprints` gives
        it, so the server can tell a node whose copy of the data set differs;
        "" for a node's own examples, which the server does not know, and
        for generated ones, the same on every node."""
        self.check_client(client)
        if self.own is not None:
            return ""
        return shard_fingerprints(self.settings, [client]).get(client, "")

    def train_shard(
        self, client: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`client`'s training images and labels on `device`."""
        self.check_client(client)
        if self.own is not None:
            return _own_split(self.own, "train", str(device))
        if key := synthetic_key(self.settings):
            return client_split(
                key, self.settings.num_clients, client, "train", str(device)
            )
        return client_shard(self.settings, client, device)

    def test_shard(
        self, client: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`client`'s own test examples on `device` (maybe none)."""
        self.check_client(client)
        if self.own is not None:
            return _own_split(self.own, "test", str(device))
        if key := synthetic_key(self.settings):
            return client_split(
                key, self.settings.num_clients, client, "test", str(device)
            )
        return client_test_shard(self.settings, client, device)

    def global_test(
        self, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The data set's whole test split on `device`.

        A node with its own examples needs no copy of the data set: it uses
        the one in its data-root if there is one (never downloading it), and
        gets None (no global metrics) if not.
        """
        if key := synthetic_key(self.settings):
            x, y = global_test(key, self.settings.num_clients)
            return x.to(device), y.to(device)
        if self.own is None:
            return held_out_split(self.settings, device)
        return _local_test_split(DataKey.of(self.settings), str(device))

    def split_key(self, split: str, client: int) -> Hashable:
        """What `model_inputs` names `client`'s `split` ("train", "test") by."""
        return f"{split}-{client}" if self.own is None else (split, self.own)


@cache
def _settings(items: frozenset) -> Settings:
    return Settings.from_run_config(dict(items))


def node_settings(context: Context) -> Settings:
    """The run's settings as this node uses them: with its own `data-root`
    where its node config names one."""
    settings = _settings(frozenset(context.run_config.items()))
    root = _node_path(context, DATA_ROOT)
    return settings if root is None else replace(settings, data_root=root)


def node_data(context: Context) -> NodeData:
    """Where this node's examples come from: shards of the run's data set or,
    with node config `data-file`, its own file (client `partition-id`'s)."""
    settings = node_settings(context)
    path = _node_path(context, DATA_FILE)
    if path is None:
        return NodeData(settings)
    client, _ = node_partition(context)
    return NodeData(settings, OwnData.of(settings.data_set, path, client))


def node_partition(context: Context) -> tuple[int, int]:
    """This node's `partition-id` and `num-partitions` (its node config; set
    by the simulation, by `pollen deploy`, or by hand on a SuperNode)."""
    values = []
    for key in (CLIENT, NUM_PARTITIONS):
        value = context.node_config.get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(
                f"node config {key}={value!r}: expected an integer; start the "
                "SuperNode with --node-config 'partition-id=K num-partitions=N'"
            )
        values.append(value)
    client, count = values
    if not 0 <= client < count:
        raise ValueError(
            f"node config partition-id={client}: expected 0 <= partition-id < "
            f"num-partitions ({count})"
        )
    return client, count


def _node_path(context: Context, key: str) -> str | None:
    """Node-config `key` as a path; None where it is absent or empty."""
    value = context.node_config.get(key, "")
    if not isinstance(value, str):
        raise ValueError(
            f"node config {key}={value!r}: expected a path in quotes "
            f'({key}="/path/to/it")'
        )
    return value or None


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
