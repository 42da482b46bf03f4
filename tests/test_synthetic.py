"""Synthetic(alpha, beta) against the FedProx paper's definition: power-law
sizes, per-client tasks drawn as specified, labels from the client's own
softmax regression, everything deterministic from the seed."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict

from pollen import client_app
from pollen.settings import Settings, SettingsError
from pollen.task.node_data import NodeData
from pollen.task.shards import server_data
from pollen.task.synthetic import (
    CLASSES,
    EVAL_CLIENTS,
    FEATURES,
    SyntheticKey,
    client_examples,
    client_sizes,
    client_task,
    global_test,
    train_size,
)


def test_sizes_are_floor_lognormal_4_2_plus_50() -> None:
    """For an integer c, floor(L) >= c exactly when L >= c, so with L
    lognormal(4, 2) the share of sizes - 50 >= c is P(Z >= (ln c - 4) / 2)."""
    extra = client_sizes(100_000, seed=3) - 50
    assert extra.min() >= 0
    for c in (3, 20, 55, 400, 3000):
        z = (math.log(c) - 4) / 2
        expected = 0.5 * math.erfc(z / math.sqrt(2))  # the normal's tail
        assert np.mean(extra >= c) == pytest.approx(expected, abs=0.006)


def test_sizes_do_not_depend_on_the_number_of_clients_but_on_the_seed() -> None:
    many = client_sizes(5000, seed=3)
    np.testing.assert_array_equal(client_sizes(40, seed=3), many[:40])
    assert not np.array_equal(client_sizes(40, seed=4), many[:40])


@pytest.mark.parametrize(("alpha", "beta"), [(0.5, 2.0), (2.0, 0.5)])
def test_tasks_are_drawn_as_specified(alpha: float, beta: float) -> None:
    """W_k, b_k ~ N(u_k, 1) with u_k ~ N(0, alpha^2); v_k ~ N(B_k, 1) with
    B_k ~ N(0, beta^2): estimate u_k and B_k from each client's draws (610
    and 60 of them) and check both spreads over 3,000 clients."""
    key = SyntheticKey(alpha, beta, seed=11)
    tasks = [client_task(key, k) for k in range(3000)]
    model_draws = np.array([np.concatenate([w.ravel(), b]) for w, b, _ in tasks])
    centres = np.array([v for _, _, v in tasks])
    u, b_means = model_draws.mean(axis=1), centres.mean(axis=1)
    # each estimate carries its own sampling noise: 1/610 and 1/60 in variance
    assert np.var(u) - 1 / 610 == pytest.approx(alpha**2, rel=0.08)
    assert np.var(b_means) - 1 / 60 == pytest.approx(beta**2, rel=0.08)
    assert np.mean(np.var(model_draws, axis=1)) == pytest.approx(1.0, abs=0.02)
    assert np.mean(np.var(centres, axis=1)) == pytest.approx(1.0, abs=0.05)


def test_examples_follow_the_clients_own_task() -> None:
    """x ~ N(v_k, diag(j^-1.2)) and y = argmax(x W_k + b_k)."""
    key = SyntheticKey(1.0, 1.0, seed=5)
    weights, bias, centre = client_task(key, 7)
    x, y = client_examples(key, 7, "train", 40_000)
    assert x.shape == (40_000, FEATURES) and x.dtype == np.float32
    assert y.dtype == np.int64 and y.min() >= 0 and y.max() < CLASSES
    np.testing.assert_allclose(x.mean(axis=0), centre, atol=0.02)
    expected = np.arange(1, FEATURES + 1) ** -1.2
    np.testing.assert_allclose(x.var(axis=0), expected, rtol=0.05)
    np.testing.assert_array_equal(y, np.argmax(x @ weights + bias, axis=1))
    again_x, again_y = client_examples(key, 7, "train", 40_000)
    np.testing.assert_array_equal(again_x, x)
    np.testing.assert_array_equal(again_y, y)
    assert np.array_equal(client_examples(key, 7, "train", 100)[0], x[:100])
    for other in (SyntheticKey(1.0, 1.0, seed=6), key):  # another seed, split
        split = "test" if other == key else "train"
        assert not np.array_equal(client_examples(other, 7, split, 100)[0], x[:100])


def test_a_node_and_the_server_see_the_same_client() -> None:
    """A node's training and test splits hold 90% and 10% of the client's
    examples; the server's sizes are the training splits'; the global test
    set is the test splits of the first clients."""
    settings = Settings.from_run_config(
        {"data-set": "synthetic", "num-clients": 30, "seed": 2, "device": "cpu"}
    )
    assert settings.partition == "natural"
    node = NodeData(settings)
    key = SyntheticKey(1.0, 1.0, seed=2)
    size = int(client_sizes(30, seed=2)[4])
    x_train, y_train = node.train_shard(4, torch.device("cpu"))
    x_test, y_test = node.test_shard(4, torch.device("cpu"))
    assert x_train.shape == (train_size(size), FEATURES, 1, 1)
    x, _ = client_examples(key, 4, "train", train_size(size))
    np.testing.assert_array_equal(x_train.view(-1, FEATURES).numpy(), x)
    _, y = client_examples(key, 4, "test", size - train_size(size))
    np.testing.assert_array_equal(y_test.numpy(), y)
    assert len(x_train) + len(x_test) == size
    assert node.num_examples(4) == len(y_train)
    data = server_data(settings)
    assert data.sizes[4] == len(y_train) and data.label_counts is None
    _, test_y = global_test(key, 30)
    assert len(test_y) == sum(
        s - train_size(s) for s in client_sizes(30, seed=2).tolist()
    )
    assert torch.equal(data.dataset.y_test, test_y)
    assert len(global_test(key, 5000)[1]) == len(global_test(key, EVAL_CLIENTS)[1])


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"data-set": "synthetic", "partition": "iid"}, r"partition='natural'"),
        ({"partition": "natural"}, r"generated data set"),
        ({"data-set": "synthetic", "num-clients": 2_000_000}, r"1 to 1,000,000"),
    ],
)
def test_synthetic_settings_are_checked(config: dict, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        Settings.from_run_config(config)


@pytest.mark.usefixtures("task_identity")  # Flower's Message needs a run
def test_a_deployed_node_answers_the_query_for_a_synthetic_client() -> None:
    """A deployment still asks its nodes: a synthetic client's answer is its
    training size and no fingerprint (every node generates the same)."""
    settings = Settings.from_run_config({"data-set": "synthetic", "num-clients": 30})
    context = Context(
        1, 1, {"partition-id": 3, "num-partitions": 30}, RecordDict(),
        settings.to_run_config(),
    )  # fmt: skip
    query = Message(RecordDict({"config": ConfigRecord({})}), dst_node_id=1,
                    message_type="query")  # fmt: skip
    answer = client_app.query(query, context).content["node"]
    assert answer["num-examples"] == train_size(int(client_sizes(30, seed=845)[3]))
    assert answer["shard-fingerprint"] == "" and answer["own-data"] is False
