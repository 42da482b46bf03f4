"""Hostile and broken client replies: dropped with a reason, never a crash.

Every strategy gets the same honest replies plus random malformed ones;
its next model must equal what it makes of the honest replies alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pytest
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Error,
    Message,
    MetricRecord,
    RecordDict,
)
from flwr.supercore.task_identity import TaskIdentity

from pollen.protocol import CLIENT as CLIENT_KEY
from pollen.strategies.aggregation import ClientUpdate
from pollen.strategies.replies import bound_update_norms, update_norm
from pollen.strategies.sampling import Roster
from tests.conftest import reply_from
from tests.rounds import Harness, fedavg, feddyn, fedopt

pytestmark = pytest.mark.usefixtures("task_identity")

HONEST = 3  # clients 0..2 reply correctly
HOSTILE = 12  # clients 3..14 may send anything
CLIENTS = HONEST + HOSTILE
SHARD = 50  # every client's shard size: the most examples it may claim

GLOBAL = {
    "w": np.arange(6, dtype=np.float32).reshape(2, 3) / 10,
    "b": np.zeros(3, np.float32),
    "n": np.array(7, np.int64),  # an integer entry, like BatchNorm's counter
}


def strategies() -> dict[str, Callable[..., Harness]]:
    return {
        "fedavg": lambda **kw: fedavg(**kw),
        "feddyn": lambda **kw: feddyn(alpha=0.1, **kw),
        "fedavgm": lambda **kw: fedopt(
            optimizer="sgd", server_lr=1.0, momentum=0.9, **kw
        ),
        "fedadagrad": lambda **kw: fedopt(optimizer="adagrad", server_lr=0.1, **kw),
        "fedadam": lambda **kw: fedopt(optimizer="adam", server_lr=0.1, **kw),
        "fedyogi": lambda **kw: fedopt(optimizer="yogi", server_lr=0.1, **kw),
    }


def build(name: str, **extra) -> Harness:
    roster = Roster.from_nodes({c + 1: (c, CLIENTS) for c in range(CLIENTS)}, CLIENTS)
    return strategies()[name](
        roster=roster, num_clients=CLIENTS, client_frac=1.0, seed=0,
        max_examples=dict.fromkeys(range(CLIENTS), SHARD), **extra,
    )  # fmt: skip


def record(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({k: Array(np.asarray(v)) for k, v in arrays.items()})


def content(client, arrays, examples=10, loss=0.5) -> RecordDict:
    return RecordDict(
        {
            "arrays": record(arrays) if isinstance(arrays, dict) else arrays,
            "metrics": MetricRecord({"num-examples": examples, "train-loss": loss}),
            "client": ConfigRecord({CLIENT_KEY: client}),
        }
    )


def honest(client: int, rng: np.random.Generator) -> Message:
    moved = {
        "w": GLOBAL["w"] + rng.normal(0, 0.1, (2, 3)).astype(np.float32),
        "b": GLOBAL["b"] + rng.normal(0, 0.1, 3).astype(np.float32),
        "n": GLOBAL["n"] + 5,
    }
    return reply_from(
        client + 1, content(client, moved, examples=int(rng.integers(1, SHARD)))
    )


def corrupt_array() -> ArrayRecord:
    good = record(GLOBAL)
    good["w"] = Array(
        dtype="float32", shape=(2, 3), stype="numpy.ndarray", data=b"junk"
    )
    return good


# Each fault: (name, client -> the message a hostile client sends)
FAULTS: list[tuple[str, Callable[[int], Message]]] = [
    ("missing entry", lambda c: reply_from(c + 1, content(c, {"w": GLOBAL["w"], "n": GLOBAL["n"]}))),
    ("extra entry", lambda c: reply_from(c + 1, content(c, {**GLOBAL, "x": GLOBAL["b"]}))),
    ("wrong shape", lambda c: reply_from(c + 1, content(c, {**GLOBAL, "w": GLOBAL["w"].T.copy()}))),
    ("wrong dtype", lambda c: reply_from(c + 1, content(c, {**GLOBAL, "w": GLOBAL["w"].astype(np.float64)}))),
    ("int for float", lambda c: reply_from(c + 1, content(c, {**GLOBAL, "b": np.zeros(3, np.int32)}))),
    ("nan", lambda c: reply_from(c + 1, content(c, {**GLOBAL, "b": np.array([0, math.nan, 0], np.float32)}))),
    ("inf", lambda c: reply_from(c + 1, content(c, {**GLOBAL, "w": np.full((2, 3), np.inf, np.float32)}))),
    ("corrupt buffer", lambda c: reply_from(c + 1, content(c, corrupt_array()))),
    ("negative count", lambda c: reply_from(c + 1, content(c, GLOBAL, examples=-5))),
    ("zero count", lambda c: reply_from(c + 1, content(c, GLOBAL, examples=0))),
    ("count above shard", lambda c: reply_from(c + 1, content(c, GLOBAL, examples=10**9))),
    ("nan count", lambda c: reply_from(c + 1, content(c, GLOBAL, examples=math.nan))),
    ("nan metric", lambda c: reply_from(c + 1, content(c, GLOBAL, loss=math.nan))),
    ("list metric", lambda c: reply_from(c + 1, content(c, GLOBAL, loss=[1.0, 2.0]))),
    ("no arrays", lambda c: reply_from(c + 1, RecordDict({"metrics": MetricRecord({"num-examples": 3})}))),
    ("no client", lambda c: reply_from(c + 1, RecordDict({"arrays": record(GLOBAL), "metrics": MetricRecord({"num-examples": 3})}))),
    ("client as text", lambda c: reply_from(c + 1, RecordDict({"arrays": record(GLOBAL), "metrics": MetricRecord({"num-examples": 3}), "client": ConfigRecord({CLIENT_KEY: "0"})}))),
    ("impersonates client 0", lambda c: reply_from(c + 1, content(0, GLOBAL))),
    ("unknown client", lambda c: reply_from(c + 1, content(CLIENTS + 7, GLOBAL))),
]  # fmt: skip


def failures_of_replies(strategy: Harness) -> list[str]:
    """Round 1's failures, less those of sampled clients that sent nothing."""
    failures = strategy.traffic[1].failures
    return [f for f in failures if not f.endswith("within round-timeout")]


def play(strategy: Harness, replies: list[Message]) -> tuple[dict | None, Harness]:
    strategy.configure_train(1, record(GLOBAL), ConfigRecord())
    out = strategy.aggregate_train(1, replies)
    return (None if out is None else {k: out[k].numpy() for k in out}), strategy


@pytest.mark.parametrize("name", list(strategies()))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_malformed_replies_leave_the_honest_aggregate(
    name: str, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    good = [honest(c, rng) for c in range(HONEST)]
    picks = rng.choice(len(FAULTS), size=HOSTILE, replace=True)
    bad = [FAULTS[f][1](HONEST + i) for i, f in enumerate(picks)]
    bad.append(honest(1, rng))  # a second reply for client 1 comes last
    mixed = good + bad
    order = rng.permutation(len(good))  # honest replies arrive in any order...
    mixed = [good[i] for i in order] + bad  # ...and hostile ones after them
    expected, _ = play(build(name), good)
    got, strategy = play(build(name), mixed)
    assert expected is not None and got is not None
    for key, value in expected.items():
        np.testing.assert_array_equal(got[key], value, err_msg=key)
        assert got[key].dtype == GLOBAL[key].dtype
    failures = strategy.traffic[1].failures
    assert len(failures) == len(bad), failures
    assert strategy.trained_clients == set(range(HONEST))


@pytest.mark.parametrize("fault", FAULTS, ids=[f for f, _ in FAULTS])
def test_each_fault_is_named(fault) -> None:
    _, make = fault
    out, strategy = play(build("fedavg"), [make(HONEST)])
    assert out is None  # nothing valid: the model stays as it was
    (failure,) = failures_of_replies(strategy)
    assert failure.startswith(f"node {HONEST + 1}: ")
    silent = set(strategy.traffic[1].failures) - {failure}
    assert len(silent) == CLIENTS - 1  # the sampled clients that sent nothing
    assert all("no reply for 1 of clients" in s for s in silent)
    assert strategy.traffic[1].skipped and not strategy.trained_clients


def test_too_few_valid_replies_skip_the_round() -> None:
    rng = np.random.default_rng(0)
    replies = [honest(0, rng), FAULTS[5][1](HONEST)]
    out, strategy = play(build("fedadam", min_replies=2), replies)
    assert out is None and strategy.traffic[1].skipped
    assert not strategy.trained_clients  # nothing of the round was kept


NON_FINITE = {"nan", "inf", "nan metric"}


@pytest.mark.parametrize(
    ("faults", "honest_replies", "diverged"),
    [
        (["nan", "inf", "nan metric"], 0, True),  # every client: training diverged
        (["nan"], 0, False),  # one reply alone: a bad client or a diverged one
        (["nan", "inf"], 1, False),  # NaN among honest replies: a bad client
        (["nan", "wrong shape"], 0, False),  # not all fail the same way
        ([], 0, False),  # nobody answered: lost nodes, not a divergence
    ],
)
def test_a_round_diverged_when_every_reply_is_non_finite(
    faults: list[str], honest_replies: int, diverged: bool
) -> None:
    make = dict(FAULTS)
    rng = np.random.default_rng(0)
    replies = [honest(c, rng) for c in range(honest_replies)]
    replies += [make[f](HONEST + i) for i, f in enumerate(faults)]
    _, strategy = play(build("fedavg"), replies)
    outcome = strategy.traffic[1]
    assert len(outcome.updates) == honest_replies
    dropped = [f for f in outcome.failures if "within round-timeout" not in f]
    assert len(dropped) == len(faults)  # besides the sampled clients not answering
    assert outcome.diverged is diverged


def with_delta(client: int, delta: np.ndarray, examples: int) -> Message:
    arrays = {**GLOBAL, "w": GLOBAL["w"] + delta.astype(np.float32)}
    return reply_from(client + 1, content(client, arrays, examples=examples))


def test_update_norm_bound_by_hand() -> None:
    """Norms 1, 2 and 100 (median 2), bound 3: the third is cut to norm 6."""
    unit = np.zeros((2, 3))
    unit[0, 0] = 1.0
    replies = [
        with_delta(0, unit, 1),
        with_delta(1, 2 * unit, 1),
        with_delta(2, 100 * unit, 2),
    ]
    clipped, strategy = play(
        build("fedavg", norm_bound=3.0, norm_action="clip"), replies
    )
    assert clipped is not None
    # weights 1/4, 1/4, 2/4 on moves 1, 2 and 6
    assert clipped["w"][0, 0] == pytest.approx(GLOBAL["w"][0, 0] + (1 + 2 + 2 * 6) / 4)
    assert strategy.traffic[1].clipped and not failures_of_replies(strategy)
    dropped, strategy = play(
        build("fedavg", norm_bound=3.0, norm_action="drop"), replies
    )
    assert dropped is not None
    assert dropped["w"][0, 0] == pytest.approx(GLOBAL["w"][0, 0] + (1 + 2) / 2)
    (failure,) = failures_of_replies(strategy)
    assert "norm 100 > 3 x the median 2" in failure
    np.testing.assert_array_equal(dropped["n"], GLOBAL["n"])  # integers not clipped


def test_clipping_keeps_direction_and_dtypes() -> None:
    current = {"w": np.ones(4, np.float32), "n": np.array(3, np.int64)}
    big = {"w": np.array([4, 5, 1, 1], np.float32), "n": np.array(9, np.int64)}
    small = {"w": np.array([1, 1, 1, 2], np.float32), "n": np.array(4, np.int64)}
    (kept_small, note_small), _, (kept_big, note_big) = bound_update_norms(
        current, [small, small, big], bound=1.0, action="clip"
    )  # norms 1, 1, 5
    assert note_small == "" and kept_small is small
    assert note_big and update_norm(current, kept_big) == pytest.approx(1.0, rel=1e-6)
    np.testing.assert_allclose(kept_big["w"] - 1, np.array([3, 4, 0, 0]) / 5, rtol=1e-6)
    assert kept_big["w"].dtype == np.float32 and int(kept_big["n"]) == 9


def test_the_norm_bound_returns_what_it_kept_and_leaves_its_input_alone() -> None:
    """Norms 1, 1 and 5 (median 1), bound 2: clipped, then dropped; the
    kept updates, the clip note and the failure come back as a value."""
    current = {"w": np.ones(4, np.float32)}
    moves = [[1, 1, 1, 2], [2, 1, 1, 1], [4, 5, 1, 1]]
    updates = [
        ClientUpdate(c, {"w": np.array(m, np.float32)}, MetricRecord(), 1.0)
        for c, m in enumerate(moves)
    ]
    nodes = [c + 1 for c in range(3)]
    clipped = build("fedavg", norm_bound=2.0).strategy.bounded(updates, current, nodes)
    assert [u.client for u in clipped.updates] == [0, 1, 2] and not clipped.failures
    assert clipped.positions == [0, 1, 2]
    (note,) = clipped.clipped
    assert note.startswith("node 3: client 2: ")
    assert update_norm(current, clipped.updates[2].arrays) == pytest.approx(2.0)
    dropping = build("fedavg", norm_bound=2.0, norm_action="drop").strategy
    dropped = dropping.bounded(updates, current, nodes)
    assert [u.client for u in dropped.updates] == [0, 1] and not dropped.clipped
    assert dropped.positions == [0, 1]
    (failure,) = dropped.failures
    assert failure.startswith("node 3: client 2: ")
    assert updates[2].arrays["w"].tolist() == [4, 5, 1, 1]  # the input is unchanged


def test_a_failed_node_is_recorded_and_the_round_goes_on() -> None:
    """A node that crashed or timed out comes back as a Flower error reply."""
    strategy = build("fedavg")
    sent = list(strategy.configure_train(1, record(GLOBAL), ConfigRecord()))
    lost = next(m for m in sent if m.metadata.dst_node_id == 2)
    TaskIdentity.node_id = 2
    crashed = Message(Error(code=1, reason="node went away"), reply_to=lost)
    TaskIdentity.node_id = 0
    rng = np.random.default_rng(0)
    out = strategy.aggregate_train(1, [honest(0, rng), crashed, honest(2, rng)])
    assert out is not None and strategy.trained_clients == {0, 2}
    assert failures_of_replies(strategy) == ["node 2: node went away"]


def test_records_beside_the_checked_ones_are_never_aggregated() -> None:
    """A reply may carry other records; only its checked 'metrics' are
    averaged (Flower's metric average would sum every MetricRecord, and a
    NaN or a list there would reach the history or end the ServerApp)."""
    rng = np.random.default_rng(0)
    good = [honest(c, rng) for c in range(HONEST)]
    padded = [reply_from(m.metadata.src_node_id, m.content.copy()) for m in good]
    padded[0].content["extra"] = MetricRecord({"x": math.nan, "y": [1.0, 2.0]})
    padded[1].content["more"] = MetricRecord({"num-examples": 10**9})
    strategy = build("fedavg")
    strategy.configure_train(1, record(GLOBAL), ConfigRecord())
    expected = strategy.aggregate_train(1, good)
    metrics = [dict(u.metrics) for u in strategy.traffic[1].updates]
    strategy = build("fedavg")
    strategy.configure_train(1, record(GLOBAL), ConfigRecord())
    got = strategy.aggregate_train(1, padded)
    padded_metrics = [dict(u.metrics) for u in strategy.traffic[1].updates]
    assert not failures_of_replies(strategy)
    assert padded_metrics == metrics
    assert all(
        m == {"num-examples": m["num-examples"], "train-loss": 0.5} for m in metrics
    )
    for key in GLOBAL:
        np.testing.assert_array_equal(got[key].numpy(), expected[key].numpy())


def personal(client: int, node: int | None = None, **metrics) -> Message:
    """A personal-evaluation reply from `client`'s node (or `node`); a metric
    given as None is left out."""
    values = {"global-accuracy": 0.5, "global-loss": 1.0, "local-accuracy": 0.75,
              "local-loss": 0.5, "num-examples": 10, **metrics}  # fmt: skip
    values = {k: v for k, v in values.items() if v is not None}
    content = RecordDict(
        {"metrics": MetricRecord(values), "client": ConfigRecord({CLIENT_KEY: client})}
    )
    return reply_from(client + 1 if node is None else node, content, "evaluate")


def evaluated(replies: list[Message]) -> Harness:
    """Clients 0 and 1 asked for their personal metrics in round 1, `replies` in."""
    strategy = build("fedavg")
    strategy.trained_clients = {0, 1}
    strategy.evaluation.every = 1
    strategy.evaluation.sharing = type(
        "Local", (), {"local": ("bn",), "shared": tuple(GLOBAL)}
    )
    strategy.configure_evaluate(1, record(GLOBAL), ConfigRecord())
    strategy.aggregate_evaluate(1, replies)
    return strategy


# Each fault of a personal-evaluation reply: (expected reason, the message)
PERSONAL_FAULTS: list[tuple[str, Callable[[], Message]]] = [
    ("lacks its 'metrics'", lambda: reply_from(2, RecordDict({"client": ConfigRecord({CLIENT_KEY: 1})}), "evaluate")),
    ("does not name its client", lambda: reply_from(2, RecordDict({"metrics": MetricRecord({"global-accuracy": 0.5})}), "evaluate")),
    ("client 3 was not asked to evaluate", lambda: personal(3)),
    ("client 0 is not served by node 2", lambda: personal(0, node=2)),
    ("a second reply for client 0", lambda: personal(0, **{"global-accuracy": 0.9})),
    ("'global-accuracy' must lie in [0, 1]", lambda: personal(1, **{"global-accuracy": 1.5})),
    ("'local-loss' must lie in [0, inf]", lambda: personal(1, **{"local-loss": -1.0})),
    ("'local-accuracy' must be a number, got None", lambda: personal(1, **{"local-accuracy": None})),
    ("'global-loss' must be a number, got [1.0]", lambda: personal(1, **{"global-loss": [1.0]})),
]  # fmt: skip


@pytest.mark.parametrize(
    "fault", PERSONAL_FAULTS, ids=[why for why, _ in PERSONAL_FAULTS]
)
def test_each_personal_evaluation_fault_is_named(fault) -> None:
    why, make = fault
    bad = make()
    strategy = evaluated([personal(0), bad])
    assert list(strategy.personal[1]) == [0]
    assert strategy.personal[1][0]["global-accuracy"] == 0.5  # the first reply's
    (failure,) = strategy.evaluated[1].failures
    assert failure.startswith(f"evaluate, node {bad.metadata.src_node_id}: ")
    assert why in failure


def test_personal_evaluation_allows_nan_for_a_client_without_test_data() -> None:
    strategy = evaluated([personal(1, **{"local-accuracy": math.nan}), personal(0)])
    assert list(strategy.personal[1]) == [0, 1]
    assert math.isnan(strategy.personal[1][1]["local-accuracy"])
    assert not strategy.evaluated[1].failures
