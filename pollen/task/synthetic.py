"""Synthetic(alpha, beta), the FedProx paper's generated federated data set.

Li et al. 2020 ("Federated Optimization in Heterogeneous Networks", Sec. 5.1,
after Shamir et al. 2014): every client k has its own softmax-regression
task over 60 features and 10 classes,

    u_k ~ N(0, alpha^2),  B_k ~ N(0, beta^2)
    W_k (60 x 10), b_k (10): entries ~ N(u_k, 1)
    v_k (60): entries ~ N(B_k, 1)
    x ~ N(v_k, Sigma), Sigma = diag(j^-1.2), j = 1..60
    y = argmax(x W_k + b_k)

alpha sets how much the clients' models differ, beta how much their inputs
do; Synthetic(1, 1) is the paper's most heterogeneous case. Client k holds
floor(lognormal(4, 2)) + 50 examples (power-law sizes), 90% of them for
training and the rest as its own test split, as FedProx's generator splits
them.

Everything is drawn from the run's seed: the sizes from one stream (client
k's size is the k-th draw, whatever the number of clients), each client's
task, training and test examples from streams of their own, so a client's
data is made only where it trains, in O(its size), and never for the
clients not sampled. The global test set is the test splits of the first
`EVAL_CLIENTS` clients (made without their training splits): the same
examples for every number of clients from that many on.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, lru_cache

import numpy as np
import torch

from .data import Dataset

FEATURES = 60
CLASSES = 10
TRAIN_SHARE = 0.9
EVAL_CLIENTS = 1000  # whose test splits make the global test set
CACHED_CLIENTS = 256  # clients' examples a process keeps (it trains few at once)
# Generator streams per seed: [seed, _TAG, stream(, client)]. The tag keeps
# them apart from pollen's other streams of the seed ([seed, round] samples
# a round's clients), and numpy's seeding ignores trailing zeros, so no
# stream is 0.
_TAG = 0x53594E  # "SYN"
_SIZES, _TASK = 1, 2  # a client's splits: 3, 4
_SPLITS = {"train": 3, "test": 4}
_CHUNK = 65_536  # examples whose logits are computed at once
_COVARIANCE = np.arange(1, FEATURES + 1, dtype=np.float64) ** -1.2


@dataclass(frozen=True)
class SyntheticKey:
    """What decides the generated data: alpha, beta, the seed."""

    alpha: float
    beta: float
    seed: int


def client_sizes(num_clients: int, seed: int) -> np.ndarray:
    """Every client's number of examples, training and test together."""
    return _sizes(seed, num_clients).copy()


@cache
def _sizes(seed: int, num_clients: int) -> np.ndarray:
    rng = np.random.default_rng([seed, _TAG, _SIZES])
    return rng.lognormal(4.0, 2.0, num_clients).astype(np.int64) + 50


def train_size(size: int) -> int:
    """How many of a client's `size` examples it trains on."""
    return int(TRAIN_SHARE * size)


def client_train_size(key: SyntheticKey, num_clients: int, client: int) -> int:
    """How many examples client `client` trains on."""
    return train_size(int(_sizes(key.seed, num_clients)[client]))


def client_task(
    key: SyntheticKey, client: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Client `client`'s (W_k, b_k, v_k)."""
    rng = np.random.default_rng([key.seed, _TAG, _TASK, client])
    u, b_mean = rng.normal(0.0, key.alpha), rng.normal(0.0, key.beta)
    weights = rng.normal(u, 1.0, (FEATURES, CLASSES))
    bias = rng.normal(u, 1.0, CLASSES)
    centre = rng.normal(b_mean, 1.0, FEATURES)
    return weights, bias, centre


def client_examples(
    key: SyntheticKey, client: int, split: str, count: int
) -> tuple[np.ndarray, np.ndarray]:
    """`count` examples of client `client`'s "train" or "test" split: float32
    features [count, 60] and int64 labels [count]."""
    weights, bias, centre = client_task(key, client)
    rng = np.random.default_rng([key.seed, _TAG, _SPLITS[split], client])
    noise = rng.standard_normal((count, FEATURES), dtype=np.float32)
    x = centre.astype(np.float32) + noise * np.sqrt(_COVARIANCE).astype(np.float32)
    y = np.empty(count, dtype=np.int64)
    for start in range(0, count, _CHUNK):  # float64 logits, a chunk at a time
        rows = x[start : start + _CHUNK].astype(np.float64)
        # einsum, not BLAS: OpenBLAS's gemm was seen to spin forever in the
        # ServerApp's thread of Flower's simulation process
        y[start : start + _CHUNK] = np.argmax(
            np.einsum("ij,jk->ik", rows, weights) + bias, axis=1
        )
    return x, y


def client_split(
    key: SyntheticKey, num_clients: int, client: int, split: str, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """One client's "train" or "test" split as model inputs `[n, 60, 1, 1]`
    and labels on `device` (the newest `CACHED_CLIENTS` kept per process)."""
    size = int(_sizes(key.seed, num_clients)[client])
    return _client_tensors(key, client, split, split_size(size, split), device)


def split_size(size: int, split: str) -> int:
    """How many of a client's `size` examples are in its "train" or "test"
    split."""
    return train_size(size) if split == "train" else size - train_size(size)


@lru_cache(maxsize=CACHED_CLIENTS)
def _client_tensors(
    key: SyntheticKey, client: int, split: str, count: int, device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = client_examples(key, client, split, count)
    features = torch.from_numpy(x).view(-1, FEATURES, 1, 1)
    return features.to(device), torch.from_numpy(y).to(device)


@cache
def global_test(
    key: SyntheticKey, num_clients: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The test splits of the first `EVAL_CLIENTS` clients (all of them when
    there are fewer), on the CPU."""
    sizes = _sizes(key.seed, min(num_clients, EVAL_CLIENTS)).tolist()
    parts = [
        client_examples(key, client, "test", split_size(size, "test"))
        for client, size in enumerate(sizes)
    ]
    x = np.concatenate([x for x, _ in parts]).reshape(-1, FEATURES, 1, 1)
    return torch.from_numpy(x), torch.from_numpy(np.concatenate([y for _, y in parts]))


def synthetic_dataset(key: SyntheticKey, num_clients: int | None) -> Dataset:
    """What the server and every node build the model for: no training split
    (clients generate theirs), identity normalisation (the features are used
    as drawn) and, given `num_clients` (the server), the global test set."""
    x_test, y_test = (
        global_test(key, num_clients)
        if num_clients is not None
        else (torch.empty((0, FEATURES, 1, 1)), torch.empty(0, dtype=torch.int64))
    )
    return Dataset(
        name="synthetic",
        num_classes=CLASSES,
        x_train=torch.empty((0, FEATURES, 1, 1)),
        y_train=torch.empty(0, dtype=torch.int64),
        x_test=x_test,
        y_test=y_test,
        mean=(0.0,) * FEATURES,
        std=(1.0,) * FEATURES,
        source=f"Synthetic({key.alpha:g}, {key.beta:g}) generated from seed {key.seed}",
    )
