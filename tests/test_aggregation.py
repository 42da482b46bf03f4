"""The aggregation step on its own: hand-computed values, and Flower's own
weighted average on the same inputs."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict
from flwr.serverapp.strategy.strategy_utils import aggregate_arrayrecords

from pollen.strategies.aggregation import Mean
from pollen.strategies.fedavg import FedAvgUpdate
from tests.conftest import client_update


def test_two_clients_by_hand() -> None:
    """x0 = [1, 2] (1 example), x1 = [3, 6] (3 examples)."""
    updates = [
        client_update(0, {"w": np.array([1.0, 2.0])}, 1),
        client_update(1, {"w": np.array([3.0, 6.0])}, 3),
    ]
    weighted = Mean()(updates, ["w"])
    np.testing.assert_array_equal(weighted.arrays["w"], [2.5, 5.0])  # (1 + 9) / 4, ...
    uniform = Mean(uniform=True)(updates, ["w"])
    np.testing.assert_array_equal(uniform.arrays["w"], [2.0, 4.0])
    assert weighted.arrays["w"].dtype == np.float64  # the server update casts once
    assert [u.client for u in weighted.updates] == [0, 1]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mean_equals_flowers_weighted_average(seed: int) -> None:
    """Flower's FedAvg aggregation (`aggregate_arrayrecords`) on the same
    replies gives the same model as pollen's Mean + FedAvg update."""
    rng = np.random.default_rng(seed)
    shapes = {"conv": (4, 3, 3, 3), "bias": (4,), "fc": (10, 8)}
    counts = [int(n) for n in rng.integers(1, 500, size=5)]
    clients = [
        {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
        for _ in counts
    ]
    records = [
        RecordDict(
            {
                "arrays": ArrayRecord({k: Array(v) for k, v in arrays.items()}),
                "metrics": MetricRecord({"num-examples": n}),
            }
        )
        for arrays, n in zip(clients, counts, strict=True)
    ]
    flower = aggregate_arrayrecords(records, "num-examples")
    updates = [
        client_update(c, a, n)
        for c, (a, n) in enumerate(zip(clients, counts, strict=True))
    ]
    current = {k: np.zeros(s, np.float32) for k, s in shapes.items()}
    ours = FedAvgUpdate().apply(
        current, Mean()(updates, shapes), lambda _: tuple(shapes)
    )
    for key in shapes:
        assert ours[key].dtype == np.float32
        np.testing.assert_allclose(ours[key], flower[key].numpy(), rtol=1e-5, atol=1e-6)
