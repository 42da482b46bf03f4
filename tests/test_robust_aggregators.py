"""The robust aggregation steps: by hand on tiny arrays, then against
Flower 1.42's own strategies (FedMedian, FedTrimmedAvg, Krum, MultiKrum,
Bulyan) on the same replies."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, MetricRecord, RecordDict
from flwr.serverapp.strategy import (
    Bulyan as FlowerBulyan,
)
from flwr.serverapp.strategy import (
    FedMedian,
    FedTrimmedAvg,
    MultiKrum,
)
from flwr.serverapp.strategy import (
    Krum as FlowerKrum,
)
from flwr.serverapp.strategy.bulyan import aggregate_n_closest_weights

from pollen.settings import Settings, SettingsError
from pollen.strategies.aggregation import ClientUpdate
from pollen.strategies.fedavg import FedAvgUpdate
from pollen.strategies.robust import (
    Bulyan,
    Krum,
    Median,
    TrimmedMean,
    krum_scores,
    lowest_scores,
    recursive_krum,
    squared_distances,
)
from tests.conftest import client_update, reply_from

pytestmark = pytest.mark.usefixtures("task_identity")


def update(client: int, w: list[float], examples: float = 1.0) -> ClientUpdate:
    return client_update(client, {"w": np.asarray(w, dtype=np.float64)}, examples)


# ---- by hand ------------------------------------------------------------------


def test_median_by_hand() -> None:
    """Per coordinate: median(1, 5, 100) = 5 and median(-2, 0, 3) = 0; with an
    even count the mean of the two middle values."""
    updates = [update(0, [1, -2]), update(1, [5, 0]), update(2, [100, 3])]
    np.testing.assert_array_equal(Median()(updates, ["w"]).arrays["w"], [5, 0])
    even = Median()(updates[:2], ["w"]).arrays["w"]
    np.testing.assert_array_equal(even, [3, -1])


def test_trimmed_mean_by_hand() -> None:
    """Five values 1, 2, 3, 4, 1000 with beta 0.2 drop int(0.2 x 5) = 1 at
    each end: (2 + 3 + 4) / 3 = 3; beta 0 is the plain mean."""
    updates = [update(k, [v]) for k, v in enumerate([4, 1000, 2, 1, 3])]
    np.testing.assert_allclose(TrimmedMean(0.2)(updates, ["w"]).arrays["w"], [3.0])
    np.testing.assert_allclose(TrimmedMean(0.0)(updates, ["w"]).arrays["w"], [202.0])
    with pytest.raises(ValueError, match=r"\[0, 0.5\)"):
        TrimmedMean(0.5)


def test_krum_scores_by_hand() -> None:
    """Points 0, 1, 3, 10 on a line, f = 1: each sums its n - f - 2 = 1
    nearest squared distances: 1, 1, 4, 49; Krum picks client 0 (first of
    the tie), multi-Krum with m = 2 averages clients 0 and 1, unweighted
    (client 1's claim of 3 examples changes nothing)."""
    updates = [update(0, [0], 1), update(1, [1], 3), update(2, [3]), update(3, [10])]
    distances = squared_distances(updates, ["w"])
    np.testing.assert_array_equal(krum_scores(distances, 1), [1, 1, 4, 49])
    krum = Krum(byzantine=0, select=1)  # f = 0: 2 nearest: 1+9, 1+4, 4+9, 49+81
    np.testing.assert_array_equal(krum_scores(distances, 0), [10, 5, 13, 130])
    np.testing.assert_array_equal(krum(updates, ["w"]).arrays["w"], [1])
    multi = Krum(byzantine=1, select=2)(updates, ["w"])
    np.testing.assert_allclose(multi.arrays["w"], [0.5])
    assert [u.client for u in multi.updates] == [0, 1]
    assert Krum(byzantine=1, select=0)(updates, ["w"]).arrays["w"] == pytest.approx(
        (0 + 1 + 3) / 3  # m = n - f = 3: clients 0, 1, 2
    )


def test_bulyan_by_hand() -> None:
    """n = 7, f = 1: theta = 5 replies chosen by recursive Krum (the far-off
    100 is never chosen, nor the next farthest, -20), then per coordinate
    the beta = 3 values closest to the median of the five."""
    values = [0.0, 1.0, 2.0, 3.0, 4.0, -20.0, 100.0]
    updates = [update(k, [v, -v]) for k, v in enumerate(values)]
    result = Bulyan(byzantine=1)(updates, ["w"])
    assert sorted(u.client for u in result.updates) == [0, 1, 2, 3, 4]
    np.testing.assert_allclose(result.arrays["w"], [2.0, -2.0])  # mean(1, 2, 3)
    assert Bulyan(1).min_updates == 7 and Krum(2, 1).min_updates == 7


def test_recursive_krum_rescores_after_each_pick() -> None:
    """Where one pass of scores and the paper's recursion differ: points
    0, 0, 4, 5, 9 on a line with f = 0. One pass takes the three best first
    scores (clients 2, 0, 1); the recursion re-scores after each pick, with
    max(1, n' - 2) neighbours among the n' replies left."""
    updates = [update(k, [v]) for k, v in enumerate([0, 0, 4, 5, 9])]
    distances = squared_distances(updates, ["w"])
    # 3 nearest each: 0+16+25, 0+16+25, 1+16+16, 1+16+25, 16+25+81
    np.testing.assert_array_equal(krum_scores(distances, 0), [41, 41, 33, 42, 122])
    assert lowest_scores(distances, 0, 3) == [2, 0, 1]
    # then among 0, 0, 5, 9 (2 nearest): 0+25, 0+25, 16+25, 16+81 -> client 0;
    # among 0, 5, 9 (1 nearest): 25, 16, 16 -> client 3, not client 1
    assert recursive_krum(distances, 0, 3) == [2, 0, 3]


# ---- against Flower's strategies ------------------------------------------------


SHAPES = {"conv": (4, 3, 3, 3), "bias": (4,), "fc": (10, 8)}


def replies_and_updates(
    seed: int, n: int, outliers: int, equal_counts: bool = False
) -> tuple[list, list[ClientUpdate]]:
    """n random float32 replies of several shapes, as Flower's messages and
    pollen's updates: honest ones around 0 with a spread growing by 1.3x
    per client, the last `outliers` far off and far from each other."""
    rng = np.random.default_rng(seed)
    counts = [int(c) for c in rng.integers(1, 500, size=n)]
    if equal_counts:  # what Flower's example-weighted MultiKrum and pollen share
        counts = [100] * n
    clients = []
    for k in range(n):
        spread, shift = (1.3**k, 0.0) if k < n - outliers else (10.0, 100.0 * k)
        clients.append(
            {
                key: (spread * rng.normal(size=s) + shift).astype(np.float32)
                for key, s in SHAPES.items()
            }
        )
    messages = [
        reply_from(
            k + 1,
            RecordDict(
                {
                    "arrays": ArrayRecord({key: Array(v) for key, v in arrays.items()}),
                    "metrics": MetricRecord({"num-examples": counts[k]}),
                }
            ),
        )
        for k, arrays in enumerate(clients)
    ]
    updates = [client_update(k, arrays, counts[k]) for k, arrays in enumerate(clients)]
    return messages, updates


def pollen_model(aggregator, updates: list[ClientUpdate]) -> dict[str, np.ndarray]:
    """The next model: the aggregate through FedAvg's update (a float32 model)."""
    current = {key: np.zeros(s, np.float32) for key, s in SHAPES.items()}
    return FedAvgUpdate().apply(
        current, aggregator(updates, SHAPES), lambda _: tuple(SHAPES)
    )


def assert_same(ours: dict[str, np.ndarray], flower: ArrayRecord) -> None:
    assert set(ours) == set(flower)
    for key in SHAPES:
        assert ours[key].dtype == np.float32
        np.testing.assert_allclose(ours[key], flower[key].numpy(), rtol=1e-5, atol=1e-5)


CASES = [(seed, n, outliers) for seed in (0, 1) for n, outliers in ((7, 0), (11, 2))]


@pytest.mark.parametrize(("seed", "n", "outliers"), CASES)
def test_median_equals_flowers_fedmedian(seed: int, n: int, outliers: int) -> None:
    messages, updates = replies_and_updates(seed, n, outliers)
    flower, _ = FedMedian().aggregate_train(1, messages)
    assert_same(pollen_model(Median(), updates), flower)


@pytest.mark.parametrize(("seed", "n", "outliers"), CASES)
@pytest.mark.parametrize("beta", [0.1, 0.2, 0.3])
def test_trimmed_mean_equals_flowers_fedtrimmedavg(
    seed: int, n: int, outliers: int, beta: float
) -> None:
    messages, updates = replies_and_updates(seed, n, outliers)
    flower, _ = FedTrimmedAvg(beta=beta).aggregate_train(1, messages)
    assert_same(pollen_model(TrimmedMean(beta), updates), flower)


@pytest.mark.parametrize(("seed", "n", "outliers"), CASES)
def test_krum_equals_flowers_krum(seed: int, n: int, outliers: int) -> None:
    f = max(outliers, 1)
    messages, updates = replies_and_updates(seed, n, outliers)
    flower, _ = FlowerKrum(num_malicious_nodes=f).aggregate_train(1, messages)
    assert_same(pollen_model(Krum(byzantine=f, select=1), updates), flower)


@pytest.mark.parametrize(("seed", "n", "outliers"), CASES)
@pytest.mark.parametrize("select", [2, 4])
def test_multi_krum_equals_flowers_multikrum(
    seed: int, n: int, outliers: int, select: int
) -> None:
    f = max(outliers, 1)
    messages, updates = replies_and_updates(seed, n, outliers, equal_counts=True)
    strategy = MultiKrum(num_malicious_nodes=f, num_nodes_to_select=select)
    flower, _ = strategy.aggregate_train(1, messages)
    assert_same(pollen_model(Krum(byzantine=f, select=select), updates), flower)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bulyan_equals_flowers_bulyan_with_far_off_attackers(seed: int) -> None:
    """11 replies, f = 2 of them far off: Flower's one-pass selection and the
    paper's recursion pick the same 7, and the results agree."""
    messages, updates = replies_and_updates(seed, 11, 2)
    distances = squared_distances(updates, SHAPES)
    assert sorted(recursive_krum(distances, 2, 7)) == sorted(
        lowest_scores(distances, 2, 7)
    )
    flower, _ = FlowerBulyan(num_malicious_nodes=2).aggregate_train(1, messages)
    assert_same(pollen_model(Bulyan(byzantine=2), updates), flower)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bulyans_coordinate_step_equals_flowers(seed: int) -> None:
    """Whatever the selection, the second step (per coordinate, the mean of
    the beta values closest to the median) equals Flower's
    `aggregate_n_closest_weights` on the replies pollen selected."""
    _, updates = replies_and_updates(seed, 11, 0)
    result = Bulyan(byzantine=2)(updates, SHAPES)
    selected = [[u.arrays[key] for key in SHAPES] for u in result.updates]
    medians = [
        np.median(np.stack(layer), axis=0) for layer in zip(*selected, strict=True)
    ]
    flower = aggregate_n_closest_weights(medians, selected, beta=11 - 4 - 4)
    for key, theirs in zip(SHAPES, flower, strict=True):
        np.testing.assert_allclose(result.arrays[key], theirs, rtol=1e-5, atol=1e-6)


# ---- settings -------------------------------------------------------------------


def run_config(**overrides: object) -> dict[str, object]:
    base = {"num-clients": 10, "client-frac": 1.0}
    return {**base, **{k.replace("_", "-"): v for k, v in overrides.items()}}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"aggregator": "krum", "byzantine_clients": 4}, r"n >= 2f \+ 3 .*samples 10"),
        ({"aggregator": "bulyan", "byzantine_clients": 2}, r"n >= 4f \+ 3 .*\(11\)"),
        ({"aggregator": "multi-krum", "byzantine_clients": 2, "krum_select": 9},
         r"krum-select=9 above n - f = 8"),
        ({"aggregator": "median", "strategy": "feddyn"}, r"FedDyn's server state h"),
        ({"aggregator": "trimmed-mean", "strategy": "fedbuff"}, r"mode='async'"),
        ({"aggregator": "trimmed-mean", "trim_fraction": 0.5}, r"in \[0, 0.5\)"),
        ({"aggregator": "geomed"}, r"one of mean, median, trimmed-mean"),
        ({"aggregator": "krum", "krum_select": 3}, r"only multi-krum averages"),
        ({"aggregator": "trimmed-mean", "trim_fraction": 0.05}, r"trims none .*0.1"),
    ],
)  # fmt: skip
def test_settings_refuse_what_a_rule_cannot_do(overrides: dict, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        Settings.from_run_config(run_config(**overrides))


def test_compose_builds_each_aggregator_from_settings() -> None:
    from pollen.catalog import AGGREGATORS

    def settings(name: str) -> Settings:
        select = {"krum_select": 3} if name == "multi-krum" else {}
        config = run_config(byzantine_clients=1, trim_fraction=0.3, **select)
        return Settings.from_run_config({**config, "aggregator": name})

    built = {
        name: part.load().from_settings(settings(name))
        for name, part in AGGREGATORS.items()
    }
    assert built["trimmed-mean"].beta == 0.3
    assert (built["krum"].byzantine, built["krum"].select) == (1, 1)
    assert (built["multi-krum"].byzantine, built["multi-krum"].select) == (1, 3)
    assert built["bulyan"].min_updates == 7
    assert isinstance(built["median"], Median)


def test_krum_compares_trained_entries_not_batchnorms_counter() -> None:
    """Four honest updates of `w` (N(0, 0.1^2), 20 entries) and a sign-flip
    attacker (-10x); BatchNorm's counter grows by each client's local steps
    (6, 20, 34, 62; the attacker 30). Over the trained entry Krum picks an
    honest client and multi-Krum leaves the attacker out; the counter's
    squared gaps (hundreds) decided both when it was measured too."""
    rng = np.random.default_rng(0)
    counter = "bn.num_batches_tracked"
    updates = [
        client_update(k, {"w": rng.normal(0, 0.1, 20).astype(np.float32),
                          counter: np.array(1000 + steps, np.int64)})
        for k, steps in enumerate([6, 20, 34, 62])
    ]  # fmt: skip
    attack = (-10 * rng.normal(0, 0.1, 20)).astype(np.float32)
    updates.append(client_update(4, {"w": attack, counter: np.array(1030, np.int64)}))
    current = {"w": np.zeros(20, np.float32), counter: np.array(1000, np.int64)}
    assert [u.client for u in Krum(1)(updates, current, ("w",)).updates] != [4]
    kept = [u.client for u in Krum(1, select=0)(updates, current, ("w",)).updates]
    assert 4 not in kept and len(kept) == 4


def test_the_trimmed_count_is_the_written_fraction_of_n() -> None:
    """trim-fraction 0.29 of 100 trims 29 a side (the float product is
    28.999999999999996): 29 outliers at 1e6 above 0..70 all go, the mean is
    that of 29..70; and the smallest fraction a refusal suggests is taken."""
    values = list(range(71)) + [1e6] * 29
    updates = [client_update(k, {"w": np.array([v], np.float64)})
               for k, v in enumerate(values)]  # fmt: skip
    assert TrimmedMean.trimmed(0.29, 100) == 29
    assert TrimmedMean(0.29)(updates, {"w": np.zeros(1)}).arrays["w"][0] == 49.5
    config = {"num-clients": 3, "client-frac": 1.0, "aggregator": "trimmed-mean",
              "trim-fraction": 0.01}  # fmt: skip
    with pytest.raises(SettingsError, match=r"at least 0\.333334") as refused:
        Settings.from_run_config(config)
    suggested = float(str(refused.value).rsplit("at least ", 1)[1].split()[0])
    assert Settings.from_run_config({**config, "trim-fraction": suggested})
