"""Split a training set into client shards (index sets), deterministically.

Schemes (`partition`):

- `iid`: a seeded shuffle dealt into equal shards (flwr-datasets `IidPartitioner`);
- `niid`: per-class Dirichlet(`alpha`) proportions, redrawn until every client
  has `min-size` samples (flwr-datasets `DirichletPartitioner`);
- `niid-client`: per-client Dirichlet(`alpha`) label mixes (Hsu et al. 2019):
  every client gets an equal shard, its classes drawn from its own mix,
  without replacement. Unlike `niid` it scales to any number of clients: with
  1,000 clients and alpha 0.1 on MNIST, `niid` leaves ~30 clients empty in
  every draw, so no `min-size` can be met. Once a class runs out, the clients
  still to be dealt draw from the classes left, so the last shards are the
  least skewed;
- `pathological`: `classes-per-client` classes per client, each class's samples
  split among the clients holding it (flwr-datasets `PathologicalPartitioner`).
  `class-assignment` picks the classes: `first-deterministic` (client i's
  first class is i mod classes, the others drawn by seed, as in Li et al.
  2021, so how many clients share a class varies with the seed),
  `deterministic` (client i holds classes i, i+1, ... mod classes, whatever
  the seed) or `random`; classes no client drew are unused;
- `silos`: clients own contiguous class groups, all samples of those classes
  (2 clients on 10 classes: 0-4 and 5-9).

The same labels, scheme and seed always give the same shards. A partition
that would leave a client without training samples is refused with a
`PartitionError` naming the scheme, the client count and the key to change.

flwr-datasets' partitioners are kept, but importing them (with `datasets`,
pandas and pyarrow) takes about 10 s, which a deployed ClientApp, a fresh
process per message, would pay every round. Given a `cache_dir`, shards are
therefore kept on disk under a digest of everything that decides them (the
labels, the scheme and its parameters, the seed, the flwr-datasets
version) and read back instead of recomputed; an unreadable or
inconsistent file is recomputed, a cache that cannot be written is skipped.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from ..common.partition_sizes import PartitionError, check_min_size
from ..files import NpzError, read_npz, write_atomic, write_npz

if TYPE_CHECKING:  # flwr-datasets loads only where shards are computed (about 10 s)
    from flwr_datasets.partitioner import Partitioner


class _FlwrParams(NamedTuple):
    """What decides a flwr-datasets partition besides the labels. Hashed as
    a list, in this order, into the name of its cached shards (`_digest`):
    a field added or moved renames every cache file."""

    num_classes: int
    num_clients: int
    scheme: str
    alpha: float
    min_size: int
    classes_per_client: int
    class_assignment: str
    seed: int


def partition_indices(
    labels: np.ndarray,
    num_classes: int,
    num_clients: int,
    scheme: str,
    *,
    alpha: float = 0.5,
    min_size: int = 10,
    classes_per_client: int = 2,
    class_assignment: str = "first-deterministic",
    seed: int = 845,
    cache_dir: Path | None = None,
) -> list[np.ndarray]:
    """Return one sorted index array into `labels` per client (none empty),
    from `cache_dir` when it holds them (see module docstring)."""
    n = len(labels)
    if num_clients > n:
        raise PartitionError(
            f"invalid value for 'num-clients': {num_clients}; the training split has "
            f"only {n} samples, so partition {scheme!r} would leave clients without "
            f"any; use at most {n} clients"
        )
    if scheme == "silos":
        shards = _silos(labels, num_classes, num_clients)
    elif scheme == "niid-client":
        shards = _client_mixes(labels, num_classes, num_clients, alpha, min_size, seed)
    else:
        params = _FlwrParams(num_classes, num_clients, scheme, alpha, min_size,
                            classes_per_client, class_assignment, seed)  # fmt: skip
        path = cache_dir and cache_dir / f"{_digest(labels, params)}.npz"
        shards = _read_shards(path, num_clients, n)
        if shards is None:
            shards = _flwr_partition(labels, params)
            _write_shards(path, shards)
    empty = [i for i, s in enumerate(shards) if len(s) == 0]
    if empty:
        raise PartitionError(
            f"partition {scheme!r} with num-clients={num_clients} leaves client "
            f"{empty[0]} without training samples ({len(empty)} of {num_clients} "
            f"clients empty); {_remedy(scheme, min_size, classes_per_client)}"
        )
    return [np.sort(s) for s in shards]


def _digest(labels: np.ndarray, params: _FlwrParams) -> str:
    """What decides a flwr-datasets partition, hashed."""
    h = hashlib.sha256(np.ascontiguousarray(labels, np.int64).tobytes())
    h.update(json.dumps([list(params), version("flwr-datasets")]).encode())
    return h.hexdigest()[:32]


def _read_shards(
    path: Path | None, num_clients: int, n: int
) -> list[np.ndarray] | None:
    """The cached shards at `path`, or None (absent, unreadable, inconsistent)."""
    if path is None or not path.exists():
        return None
    try:
        saved = read_npz(path)
        shards = [saved[f"shard-{c}"] for c in range(num_clients)]
    except (OSError, NpzError, KeyError):
        return None
    for shard in shards:
        if shard.dtype.kind not in "iu" or (
            len(shard) and not 0 <= shard.min() <= shard.max() < n
        ):
            return None
    return shards


def _write_shards(path: Path | None, shards: list[np.ndarray]) -> None:
    """Keep `shards` at `path` (atomically); a cache that cannot be written is
    only slower."""
    if path is None:
        return
    buffer = io.BytesIO()
    write_npz(buffer, {f"shard-{c}": s for c, s in enumerate(shards)})
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, buffer.getvalue())


def _remedy(scheme: str, min_size: int, classes_per_client: int) -> str:
    """What to change when `scheme` leaves a client empty."""
    if scheme == "niid":
        return f"raise min-size (now {min_size}) to at least 1 or use fewer clients"
    if scheme == "pathological":
        return (
            "use fewer clients or a lower classes-per-client (now "
            f"{classes_per_client})"
        )
    if scheme == "silos":
        return "some classes have no training samples; use fewer clients"
    return "use fewer clients"


def _silos(labels: np.ndarray, num_classes: int, num_clients: int) -> list[np.ndarray]:
    if num_clients > num_classes:
        raise PartitionError(
            f"invalid value for 'num-clients': {num_clients}; partition 'silos' gives "
            f"each client whole classes, so at most {num_classes} clients"
        )
    groups = np.array_split(np.arange(num_classes), num_clients)
    return [np.flatnonzero(np.isin(labels, g)) for g in groups]


def _client_mixes(
    labels: np.ndarray,
    num_classes: int,
    num_clients: int,
    alpha: float,
    min_size: int,
    seed: int,
) -> list[np.ndarray]:
    """Equal shards, each dealt from its client's Dirichlet(alpha) label mix."""
    check_min_size("niid-client", num_clients, min_size, len(labels))
    size = len(labels) // num_clients
    rng = np.random.default_rng([seed, 2])
    pools = [rng.permutation(np.flatnonzero(labels == c)) for c in range(num_classes)]
    left = np.array([len(pool) for pool in pools])
    shards = []
    for _ in range(num_clients):
        mix = rng.dirichlet(np.full(num_classes, alpha))
        counts = np.zeros(num_classes, np.int64)
        while (need := size - counts.sum()) > 0:
            weights = np.where(left > counts, mix, 0.0)
            if weights.sum() == 0:  # its classes are used up: take what is left
                weights = (left > counts).astype(float)
            drawn = rng.multinomial(need, weights / weights.sum())
            counts += np.minimum(drawn, left - counts)
        taken = [
            pool[len(pool) - left[c] :][: counts[c]] for c, pool in enumerate(pools)
        ]
        left -= counts
        shards.append(np.concatenate(taken))
    return shards


def _flwr_partition(labels: np.ndarray, params: _FlwrParams) -> list[np.ndarray]:
    """Each client's indices into `labels`, as flwr-datasets' partitioner for
    `params.scheme` deals them; what it cannot deal is a `PartitionError`
    saying which key to change."""
    import datasets

    order = np.arange(len(labels))
    if params.scheme == "iid":  # IidPartitioner deals contiguous shards: shuffle first
        order = np.random.default_rng(params.seed).permutation(len(labels))
    table = datasets.Dataset.from_dict({"index": order, "label": labels[order]})
    partitioner = _partitioner(params, len(labels))
    partitioner.dataset = table
    try:
        return [
            np.asarray(
                partitioner.load_partition(i).with_format("numpy")[:]["index"], np.int64
            )
            for i in range(params.num_clients)
        ]
    except ValueError as err:
        raise _partition_failed(params, err) from err


def _partitioner(params: _FlwrParams, num_samples: int) -> Partitioner:
    """flwr-datasets' partitioner for `params.scheme`, once the parameters
    are checked against the `num_samples` training samples and the classes:
    `niid` cannot give every client `min_size` samples from fewer, nor
    `pathological` a client more classes than there are."""
    from flwr_datasets.partitioner import (
        DirichletPartitioner,
        IidPartitioner,
        PathologicalPartitioner,
    )

    num_clients, min_size = params.num_clients, params.min_size
    if params.scheme == "iid":
        return IidPartitioner(num_partitions=num_clients)
    if params.scheme == "niid":
        if min_size * num_clients > num_samples:
            raise PartitionError(
                f"invalid value for 'min-size': {min_size}; {num_clients} clients x "
                f"{min_size} exceeds the {num_samples} training samples; lower "
                "min-size or use fewer clients"
            )
        return DirichletPartitioner(
            num_partitions=num_clients,
            partition_by="label",
            alpha=params.alpha,
            min_partition_size=min_size,
            seed=params.seed,
        )
    if params.scheme == "pathological":
        if params.classes_per_client > params.num_classes:
            raise PartitionError(
                f"invalid value for 'classes-per-client': {params.classes_per_client}; "
                f"the data set has {params.num_classes} classes"
            )
        return PathologicalPartitioner(
            num_partitions=num_clients,
            partition_by="label",
            num_classes_per_partition=params.classes_per_client,
            class_assignment_mode=params.class_assignment,
            seed=params.seed,
        )
    raise PartitionError(f"unknown partition {params.scheme!r}")


def _partition_failed(params: _FlwrParams, err: ValueError) -> PartitionError:
    """What a partitioner's `err` means for the user: which key to change."""
    scheme, num_clients, min_size = params.scheme, params.num_clients, params.min_size
    if scheme == "niid":
        return PartitionError(
            f"invalid value for 'min-size': {min_size}; Dirichlet(alpha={params.alpha}) "
            f"could not give all {num_clients} clients {min_size} samples in repeated "
            f"draws; lower min-size or raise alpha ({err})"
        )
    if scheme == "pathological":  # flwr-datasets: a class has too few samples
        return PartitionError(
            f"partition 'pathological' with num-clients={num_clients} and "
            f"classes-per-client={params.classes_per_client} would leave clients "
            f"without samples of their classes ({str(err).split('. ')[0]}); "
            f"{_remedy(scheme, min_size, params.classes_per_client)}"
        )
    return PartitionError(f"partition {scheme!r} failed: {err}")


def label_counts(
    labels: np.ndarray, shards: Sequence[np.ndarray], num_classes: int
) -> np.ndarray:
    """Counts `[client, class]` of each shard's labels."""
    return np.stack([np.bincount(labels[s], minlength=num_classes) for s in shards])


def client_test_indices(
    test_labels: np.ndarray, train_counts: np.ndarray, seed: int
) -> list[np.ndarray]:
    """Each client's share of the test split, following its training labels.

    The test examples of class c are shuffled (seeded) and dealt out in
    proportion to how many training examples of c each client holds, so a
    client's test shard has its own label mix and no two shards overlap. A
    client without class c gets none of it.
    """
    rng = np.random.default_rng([seed, 1])
    num_clients, num_classes = train_counts.shape
    shards: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c in range(num_classes):
        owners = train_counts[:, c]
        if owners.sum() == 0:
            continue
        pool = rng.permutation(np.flatnonzero(test_labels == c))
        bounds = np.rint(np.cumsum(owners) / owners.sum() * len(pool)).astype(int)
        for client, part in enumerate(np.split(pool, bounds[:-1])):
            shards[client].append(part)
    return [np.sort(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
            for parts in shards]  # fmt: skip


def format_label_counts(counts: np.ndarray) -> str:
    """One line per client: its total and per-class counts."""
    width = max(len(str(int(counts.max()))), 3)
    head = "client  total  " + " ".join(f"{c:>{width}}" for c in range(counts.shape[1]))
    rows = [
        f"{i:>6}  {int(row.sum()):>5}  " + " ".join(f"{int(v):>{width}}" for v in row)
        for i, row in enumerate(counts)
    ]
    return "\n".join([head, *rows])
