"""Split a training set into client shards (index sets), deterministically.

Schemes (`partition`):

- `iid`: a seeded shuffle dealt into equal shards (flwr-datasets `IidPartitioner`);
- `niid`: per-class Dirichlet(`alpha`) proportions, redrawn until every client
  has `min-size` samples (flwr-datasets `DirichletPartitioner`, which gives up
  after 11 tries of its own). A partitioner that gives up is started again
  with a seed derived from (`seed`, draw), up to `partition-draws` draws in
  all (`draw_seed`): the first draw uses `seed` itself, so a partition that
  its first draw gives is the same whatever the bound. The default, 30, from
  MNIST (2026-12-05): 50 clients at alpha 0.05 with min-size 10 took 1 to 11
  draws over seeds 1-20 (69 draws, 20 that met min-size), so all 30 miss
  with a chance of about 0.71^30 = 3e-5; a draw that gives up takes about
  0.5 s, so a request no draw meets is refused after about 15 s;
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
The file also says which draw gave the shards, so a process whose
`partition-draws` stops short of it draws (and refuses) as one without the
file would. `pollen run` draws the partition before any process starts,
where it can read the data set (`pollen.deployment.model_checks`), so the
ServerApp reads its file.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import warnings
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np

from ..common.partition_sizes import PartitionError, check_min_size
from ..files import NpzError, read_npz, write_atomic, write_npz

if TYPE_CHECKING:  # flwr-datasets loads only where shards are computed (about 10 s)
    import datasets
    from flwr_datasets.partitioner import Partitioner


# Dealt in equal shards: once `Settings` has checked num-clients and min-size
# against the training split (`partition_sizes`), every client gets samples,
# so nothing is learnt by drawing them before the run starts.
EQUAL_SHARDS = ("iid", "niid-client")


class _FlwrParams(NamedTuple):
    """What decides a flwr-datasets partition besides the labels. Hashed as
    a list, in this order, into the name of its cached shards (`_digest`):
    a field added or moved renames every cache file. `partition-draws` is
    not one: it decides only whether the shards are drawn at all (the file
    says which draw gave them)."""

    num_classes: int
    num_clients: int
    scheme: str
    alpha: float
    min_size: int
    classes_per_client: int
    class_assignment: str
    seed: int


class PartitionKeys(Protocol):
    """The run-config keys that decide a run's partition: its `Settings`, or
    the part of them that keys a process's data (`shards.DataKey`)."""

    @property
    def num_clients(self) -> int: ...
    @property
    def partition(self) -> str: ...
    @property
    def alpha(self) -> float: ...
    @property
    def min_size(self) -> int: ...
    @property
    def classes_per_client(self) -> int: ...
    @property
    def class_assignment(self) -> str: ...
    @property
    def seed(self) -> int: ...
    @property
    def partition_draws(self) -> int: ...


def run_partition(
    labels: np.ndarray, num_classes: int, keys: PartitionKeys, cache_dir: Path | None
) -> list[np.ndarray]:
    """`partition_indices` as a run's `keys` ask for it: the one call the
    ServerApp, each ClientApp and `pollen run`'s check before start-up make."""
    return partition_indices(
        labels,
        num_classes,
        keys.num_clients,
        keys.partition,
        alpha=keys.alpha,
        min_size=keys.min_size,
        classes_per_client=keys.classes_per_client,
        class_assignment=keys.class_assignment,
        seed=keys.seed,
        draws=keys.partition_draws,
        cache_dir=cache_dir,
    )


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
    draws: int = 30,
    cache_dir: Path | None = None,
) -> list[np.ndarray]:
    """Return one sorted index array into `labels` per client (none empty),
    from `cache_dir` when it holds them; `niid` is drawn at most `draws`
    times (see module docstring)."""
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
        shards = _read_shards(path, num_clients, n, draws)
        if shards is None:
            shards, draw = _flwr_partition(labels, params, draws)
            _write_shards(path, shards, draw)
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
    path: Path | None, num_clients: int, n: int, draws: int
) -> list[np.ndarray] | None:
    """The cached shards at `path`, or None (absent, unreadable, inconsistent,
    or given by a draw beyond the first `draws`). A file without its draw
    predates redraws: its shards are the first draw's."""
    if path is None or not path.exists():
        return None
    try:
        saved = read_npz(path)
        shards = [saved[f"shard-{c}"] for c in range(num_clients)]
        draw = int(saved.get("draw", 0))
    except (OSError, NpzError, KeyError, TypeError, ValueError):
        return None
    if draw >= draws:
        return None
    for shard in shards:
        if shard.dtype.kind not in "iu" or (
            len(shard) and not 0 <= shard.min() <= shard.max() < n
        ):
            return None
    return shards


def _write_shards(path: Path | None, shards: list[np.ndarray], draw: int) -> None:
    """Keep `shards` at `path` (atomically) with the `draw` that gave them; a
    cache that cannot be written is only slower."""
    if path is None:
        return
    buffer = io.BytesIO()
    arrays = {f"shard-{c}": s for c, s in enumerate(shards)}
    write_npz(buffer, {**arrays, "draw": np.array(draw, np.int64)})
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


def _flwr_partition(
    labels: np.ndarray, params: _FlwrParams, draws: int
) -> tuple[list[np.ndarray], int]:
    """Each client's indices into `labels`, as flwr-datasets' partitioner for
    `params.scheme` deals them, and the draw that dealt them (0: the first).
    `niid` is drawn again from `draw_seed` while a draw cannot give every
    client min-size samples, `draws` times at most; what the partitioner
    cannot deal is a `PartitionError` saying which key to change."""
    import datasets

    order = np.arange(len(labels))
    if params.scheme == "iid":  # IidPartitioner deals contiguous shards: shuffle first
        order = np.random.default_rng(params.seed).permutation(len(labels))
    table = datasets.Dataset.from_dict({"index": order, "label": labels[order]})
    tries = max(1, draws) if params.scheme == "niid" else 1
    draw = 0
    while True:
        # an impossible request is refused here, at the first draw, undrawn
        partitioner = _partitioner(params, len(labels), draw_seed(params.seed, draw))
        try:
            shards = _deal(partitioner, table, params)
        except ValueError as err:
            draw += 1
            if draw < tries:
                continue
            raise _partition_failed(params, err, tries) from err
        if draw:
            print(_redraw_note(params, draw), flush=True)
        return shards, draw


def _deal(
    partitioner: Partitioner, table: datasets.Dataset, params: _FlwrParams
) -> list[np.ndarray]:
    """Each client's indices as `partitioner` deals `table`; `ValueError`
    where it cannot (flwr-datasets' own warning that it tries again is not
    shown: the caller says what it does)."""
    partitioner.dataset = table
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The specified min_partition_size")
        return [
            np.asarray(
                partitioner.load_partition(i).with_format("numpy")[:]["index"], np.int64
            )
            for i in range(params.num_clients)
        ]


def draw_seed(seed: int, draw: int) -> int:
    """The seed of a partition's `draw`-th draw (0: the first): `seed` itself
    first, so every partition its first draw gives stays as it was; then an
    integer derived from (`seed`, `draw`), unrelated to the other seeds."""
    if draw == 0:
        return seed
    return int(np.random.SeedSequence([seed, draw]).generate_state(1)[0])


def _redraw_note(params: _FlwrParams, draw: int) -> str:
    """The console line that says a later draw gave the partition."""
    return (
        f"pollen: note: partition 'niid' (alpha={params.alpha}, "
        f"num-clients={params.num_clients}, min-size={params.min_size}): the "
        f"draw of seed {params.seed} left a client below min-size; draw "
        f"{draw + 1} (seed {draw_seed(params.seed, draw)}) gives every client "
        "at least min-size samples"
    )


def _partitioner(params: _FlwrParams, num_samples: int, seed: int) -> Partitioner:
    """flwr-datasets' partitioner for `params.scheme`, seeded with `seed`,
    once the parameters are checked against the `num_samples` training
    samples and the classes: `niid` cannot give every client `min_size`
    samples from fewer, nor `pathological` a client more classes than there
    are."""
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
            seed=seed,
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
            seed=seed,
        )
    raise PartitionError(f"unknown partition {params.scheme!r}")


def _partition_failed(
    params: _FlwrParams, err: ValueError, draws: int
) -> PartitionError:
    """What a partitioner's `err`, after `draws` draws, means for the user:
    which key to change."""
    scheme, num_clients, min_size = params.scheme, params.num_clients, params.min_size
    if scheme == "niid":
        return PartitionError(
            f"invalid value for 'min-size': {min_size}; Dirichlet(alpha={params.alpha}) "
            f"left one of the {num_clients} clients below {min_size} samples in each "
            f"of {draws} draws (partition-draws={draws}, seeds derived from "
            f"seed={params.seed}); lower min-size, raise alpha, use fewer clients or "
            "partition='niid-client', or raise partition-draws"
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
