"""FedBuff's staleness weights and buffered mean, by hand on tiny arrays, and
the asynchronous loop's order, staleness and buffer on a scripted grid."""

from __future__ import annotations

import math

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
from flwr.common.constant import ErrorCode

from pollen.network_profile import NetworkProfile
from pollen.protocol import (
    ARRAYS,
    CLIENT,
    CLIENT_RECORD,
    CONFIG,
    METRICS,
    NUM_EXAMPLES,
    TRAIN_SECONDS,
)
from pollen.settings import Settings, SettingsError
from pollen.strategies.aggregation import ClientUpdate
from pollen.strategies.asynchronous import AsyncOptions, BufferedAsync
from pollen.strategies.clock import SimulatedClock
from pollen.strategies.fedavg import FedAvgUpdate
from pollen.strategies.fedbuff import buffered_mean, rebased, staleness_weight
from pollen.strategies.fedopt import ServerSgd
from pollen.strategies.round import RoundOutcome
from pollen.strategies.sampling import Participants, Roster
from pollen.strategies.strategy import Strategy
from tests.conftest import client_update, reply_from


def update(client: int, *values: float) -> ClientUpdate:
    return client_update(client, {"w": np.array(values)})


def test_staleness_weight_is_one_over_sqrt_one_plus_staleness() -> None:
    assert staleness_weight(0) == 1.0
    assert staleness_weight(3) == 0.5
    assert staleness_weight(8) == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        staleness_weight(-1)


def test_rebasing_moves_an_update_onto_the_current_model() -> None:
    """Sent [0, 1], trained to [1, 3]: Delta = [1, 2], onto current [5, 5]."""
    moved = rebased(
        update(0, 1.0, 3.0),
        {"w": np.array([0.0, 1.0])},
        {"w": np.array([5.0, 5.0])},
        trained={"w"},
    )
    np.testing.assert_array_equal(moved.arrays["w"], [6.0, 7.0])


def test_two_updates_of_different_staleness() -> None:
    """x = [1, 2]; Delta_A = [1, 0] (tau 0), Delta_B = [0, 2] (tau 3):
    Delta_bar = (1 * [1, 0] + 0.5 * [0, 2]) / 2 = [0.5, 0.5]."""
    current = {"w": np.array([1.0, 2.0])}
    result = buffered_mean(
        [update(0, 2.0, 2.0), update(1, 1.0, 4.0)], [0, 3], current, {"w"}
    )
    np.testing.assert_allclose(result.arrays["w"], [1.5, 2.5])


def test_three_updates_divide_by_the_buffer_size_not_the_weights() -> None:
    """x = [0]; Deltas 3, 6, 9 with tau 0, 1, 8: (3 + 6/sqrt 2 + 9/3) / 3."""
    result = buffered_mean(
        [update(0, 3.0), update(1, 6.0), update(2, 9.0)],
        [0, 1, 8],
        {"w": np.zeros(1)},
        {"w"},
    )
    expected = (3 + 6 / math.sqrt(2) + 3) / 3
    np.testing.assert_allclose(result.arrays["w"], [expected])


def test_the_server_learning_rate_scales_the_buffered_step() -> None:
    """FedBuff's x + eta_g * Delta_bar is FedOpt's sgd on x + Delta_bar."""
    current = {"w": np.array([1.0, 2.0], np.float32)}
    aggregate = buffered_mean(
        [update(0, 2.0, 2.0), update(1, 1.0, 4.0)], [0, 3], current, {"w"}
    )
    sgd = ServerSgd(server_lr=0.5)
    stepped = sgd.apply(current, aggregate, lambda exclude_bn: ("w",))
    np.testing.assert_allclose(stepped["w"], [1.25, 2.25])
    assert stepped["w"].dtype == np.float32


def test_a_buffer_needs_one_staleness_per_update() -> None:
    with pytest.raises(ValueError, match="one staleness per update"):
        buffered_mean([update(0, 1.0)], [0, 1], {"w": np.zeros(1)}, {"w"})


def test_statistics_are_a_staleness_weighted_mean_not_rebased() -> None:
    """A running variance sent as 5 (version 0), trained to 1 (tau 3), with
    the current model's at 1.5: rebased it would be 1.5 - 4 < 0. Statistics
    instead take sum s(tau) v / sum s(tau): (1 * 2 + 0.5 * 1) / 1.5."""
    stale = client_update(1, {"var": np.array([1.0])})
    moved = rebased(stale, {"var": np.array([5.0])}, {"var": np.array([1.5])}, set())
    np.testing.assert_array_equal(moved.arrays["var"], [1.0])
    fresh = client_update(0, {"var": np.array([2.0])})
    result = buffered_mean([fresh, moved], [0, 3], {"var": np.array([1.5])}, set())
    np.testing.assert_allclose(result.arrays["var"], [(2.0 + 0.5) / 1.5])


SENT_AT_MOST = 100  # more training messages than any test here needs


class ScriptedGrid:
    """Each client answers its training message with its received entries
    + 1 (+ `steps[(client, n)]` for its n-th message, where given) after
    `train_seconds[client]` (reported, not slept); replies arrive in the
    order of `order` (client ids), one per pull."""

    def __init__(
        self,
        order: list[int],
        train_seconds: dict[int, float],
        non_finite: frozenset[int] = frozenset(),  # these answer with NaN
        refused: frozenset[int] = frozenset(),  # the grid cannot store theirs
        unavailable: frozenset[int] = frozenset(),  # their node stopped
        steps: dict[tuple[int, int], float] | None = None,
        raising: frozenset[int] = frozenset(),  # their ClientApp raises
    ) -> None:
        self.raising = raising
        self.order = list(order)
        self.steps = steps or {}
        self.refused = refused
        self.unavailable = unavailable
        self.train_seconds = train_seconds
        self.non_finite = non_finite
        self.replies: dict[str, tuple[int, object]] = {}
        self.sent: list[tuple[int, float]] = []  # (client, w it was sent)

    def push_messages(self, messages):
        if len(self.sent) > SENT_AT_MOST:
            raise AssertionError("the loop keeps sending: it would never stop")
        ids = []
        for message in messages:
            client = int(message.content[CONFIG][CLIENT])
            received = message.content[ARRAYS]["w"].numpy()
            nth = sum(1 for c, _ in self.sent if c == client)
            self.sent.append((client, float(received[0])))
            step = self.steps.get((client, nth), 1.0)
            sent_back = received + (np.nan if client in self.non_finite else step)
            content = RecordDict({
                ARRAYS: ArrayRecord({"w": Array(sent_back)}),
                METRICS: MetricRecord(
                    {NUM_EXAMPLES: 1, TRAIN_SECONDS: self.train_seconds[client]}
                ),
                CLIENT_RECORD: ConfigRecord({CLIENT: client}),
            })  # fmt: skip
            message_id = f"m{len(self.sent)}"  # set on the message, as Flower does
            message.metadata.__dict__["_message_id"] = message_id
            reply = reply_from(message.metadata.dst_node_id, content)
            if client in self.unavailable:  # what the SuperLink answers for it
                gone = Error(ErrorCode.NODE_UNAVAILABLE, "Error: Node Unavailable")
                reply = Message(gone, reply_to=message)
            if client in self.raising:  # Flower's error reply, the traceback in it
                raised = Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
                               "Traceback ...\nTypeError: a tensor pull")  # fmt: skip
                reply = Message(raised, reply_to=message)
            reply.metadata.__dict__["_reply_to_message_id"] = message_id
            if client not in self.refused:  # left out of the IDs, as Flower does
                self.replies[message_id] = (client, reply)
                ids.append(message_id)
        return ids

    def pull_messages(self, message_ids):
        wanted = [i for i in message_ids if i in self.replies]
        for client in list(self.order):  # the next in the script that is in flight
            for message_id in wanted:
                if self.replies[message_id][0] == client:
                    self.order.remove(client)
                    return [self.replies.pop(message_id)[1]]
        return [self.replies.pop(i)[1] for i in wanted]  # off script: all at once


ROSTER = Roster.from_nodes({10 + c: (c, 3) for c in range(3)}, 3)


def engine(
    grid, clock=None, concurrency=2, buffer_size=2, simulated=True, **strategy_kw
) -> BufferedAsync:
    strategy = Strategy(
        num_clients=3, client_frac=1.0, seed=0, server_update=FedAvgUpdate(),
        **strategy_kw,
    )  # fmt: skip
    options = AsyncOptions(concurrency, buffer_size, seed=0, timeout=30.0)
    return BufferedAsync(
        grid, strategy, options, first=1, clock=clock, simulated=simulated
    )


def play_versions(
    loop: BufferedAsync, start: ArrayRecord, last: int
) -> list[RoundOutcome]:
    """Versions 1 to `last`, each trained from the one before, as the server
    loop asks for them (none after one marked diverged: the run stops)."""
    outcomes: list[RoundOutcome] = []
    arrays = start
    for version in range(1, last + 1):
        outcome = loop.next_version(
            arrays, version, ConfigRecord(), Participants(ROSTER)
        )
        outcomes.append(outcome)
        if outcome.diverged:
            break
        arrays = outcome.arrays
    return outcomes


@pytest.mark.usefixtures("task_identity")
def test_the_loop_buffers_replies_and_counts_staleness_in_versions() -> None:
    """Concurrency 2, buffer 1, every update +1 (Delta = 1): each version
    adds s(tau) = 1 / sqrt(1 + tau) to the model; the second client of the
    first wave, sent version 0 and taken after version 1, has staleness 1."""
    grid = ScriptedGrid(order=[], train_seconds=dict.fromkeys(range(3), 0.0))
    loop = engine(grid, buffer_size=1)
    start = ArrayRecord({"w": Array(np.zeros(1, np.float32))})
    versions = play_versions(loop, start, 3)
    assert versions[0].staleness == [0]
    assert versions[1].staleness == [1]  # the second of the first wave
    expected = np.cumsum([staleness_weight(v.staleness[0]) for v in versions])
    np.testing.assert_allclose([v.arrays["w"].numpy()[0] for v in versions], expected)
    assert expected[1] == pytest.approx(1 + 1 / math.sqrt(2))
    assert all(len(v.updates) == 1 for v in versions)
    assert loop.drain() and not loop.in_flight


@pytest.mark.usefixtures("task_identity")
@pytest.mark.parametrize(("bad", "diverged"), [({0, 1, 2}, True), ({1}, False)])
def test_replies_all_non_finite_end_the_versions_as_diverged(
    bad: set[int], diverged: bool
) -> None:
    """As many NaN replies in a row as train at once, none valid: one last
    outcome marked diverged (the server loop stops the run on it); one NaN
    client among honest ones is dropped and the versions go on."""
    grid = ScriptedGrid([], dict.fromkeys(range(3), 0.0), non_finite=frozenset(bad))
    loop = engine(grid, concurrency=2, buffer_size=1)
    start = ArrayRecord({"w": Array(np.zeros(1, np.float32))})
    versions = play_versions(loop, start, 4)
    assert [v.diverged for v in versions] == [False] * (len(versions) - 1) + [diverged]
    if diverged:
        assert len(versions) == 1 and versions[0].skipped
        assert len(versions[0].failures) == 2  # both replies, each named
    else:
        assert len(versions) == 4 and all(v.updates for v in versions)


@pytest.mark.usefixtures("task_identity")
@pytest.mark.parametrize("raising", [{0, 1, 2}, {1}])
def test_a_version_every_client_fails_is_skipped_not_waited_for(
    raising: set[int],
) -> None:
    """Every client that can take part raising since the last valid reply
    skips the version (the model unchanged, each failure named) instead of
    sending them the same work forever; one raising client among honest
    ones is a failure, and the versions go on."""
    grid = ScriptedGrid([], dict.fromkeys(range(3), 0.0), raising=frozenset(raising))
    loop = engine(grid, concurrency=2, buffer_size=1)
    start = ArrayRecord({"w": Array(np.zeros(1, np.float32))})
    versions = play_versions(loop, start, 3)
    assert len(versions) == 3 and not any(v.diverged for v in versions)
    if raising == {0, 1, 2}:
        assert all(v.skipped and v.arrays is start for v in versions)
        assert all("TypeError: a tensor pull" in v.failures[0] for v in versions)
        assert {c for c, _ in grid.sent} == {0, 1, 2}  # each tried before giving up
        assert set(loop.snapshots) <= {d.version for d in loop.in_flight.values()}
    else:
        assert all(v.updates and not v.skipped for v in versions)


@pytest.mark.usefixtures("task_identity")
def test_a_message_the_grid_could_not_store_leaves_its_client_idle() -> None:
    """Flower's grids leave a message they could not store out of the IDs
    they return: its client is not in flight, and the others go on."""
    grid = ScriptedGrid([], dict.fromkeys(range(3), 0.0), refused=frozenset({0}))
    loop = engine(grid, concurrency=2, buffer_size=1)
    start = ArrayRecord({"w": Array(np.zeros(1, np.float32))})
    versions = play_versions(loop, start, 4)
    assert len(versions) == 4
    assert {u.client for v in versions for u in v.updates} <= {1, 2}
    assert 0 in {client for client, _ in grid.sent}  # it was asked, and refused


@pytest.mark.usefixtures("task_identity")
def test_a_node_the_superlink_calls_unavailable_is_sent_nothing_more() -> None:
    """Flower's "Node Unavailable" error reply (the node stopped sending
    heartbeats): a failure naming the node, which is asked nothing more,
    and the others go on."""
    grid = ScriptedGrid([], dict.fromkeys(range(3), 0.0), unavailable=frozenset({0}))
    loop = engine(grid, concurrency=2, buffer_size=1)
    start = ArrayRecord({"w": Array(np.zeros(1, np.float32))})
    versions = play_versions(loop, start, 4)
    assert len(versions) == 4 and all(v.updates for v in versions)
    assert [client for client, _ in grid.sent].count(0) == 1  # never again
    failures = [f for v in versions for f in v.failures]
    assert len(failures) == 1 and "node 10" in failures[0], failures


@pytest.mark.usefixtures("task_identity")
def test_the_simulated_clock_orders_replies_by_simulated_arrival() -> None:
    """Clients train 1 s each, client 2 ten times slower (profile, unlimited
    links). Client 2 answers first for real, yet the loop takes replies by
    simulated arrival: the fast pair makes a version every simulated second,
    and client 2's update, sent version 0, arrives at 10 s into the version
    made then, with the staleness of all the versions made meanwhile."""
    profile = NetworkProfile.from_document(
        {"group": [{"nodes": [2], "slowdown": 10}]}, "test"
    )
    clock = SimulatedClock(profile, 3)
    grid = ScriptedGrid(order=[2], train_seconds=dict.fromkeys(range(3), 1.0))
    loop = engine(grid, clock=clock, concurrency=3, buffer_size=2)
    start = ArrayRecord({"w": Array(np.zeros(1, np.float32))})
    versions = play_versions(loop, start, 10)
    loop.drain()
    assert sorted(u.client for u in versions[0].updates) == [0, 1]
    assert versions[0].staleness == [0, 0]
    assert versions[0].sim_seconds == pytest.approx(1.0)
    with_slow = [v for v in versions if 2 in [u.client for u in v.updates]]
    assert len(with_slow) == 1
    index = versions.index(with_slow[0])
    slow = [u.client for u in with_slow[0].updates].index(2)
    assert with_slow[0].staleness[slow] == index  # versions 1..index came first
    elapsed = sum(v.sim_seconds for v in versions[: index + 1])
    assert elapsed == pytest.approx(10.0)


@pytest.mark.usefixtures("task_identity")
def test_a_deployed_loop_takes_replies_as_they_come_and_the_clock_only_times_them() -> (
    None
):
    """The profile of the test above, deployed: client 2 (10 s on the clock)
    answers first for real and is taken first, into version 1 with one of
    the fast pair (1 s), so version 1 lasts 10 simulated seconds, the slow
    client's arrival. Its second message, sent at 10 s (still version 0: the
    buffer was not yet full), arrives at 20 s, after client 1's (1 s)."""
    profile = NetworkProfile.from_document(
        {"group": [{"nodes": [2], "slowdown": 10}]}, "test"
    )
    clock = SimulatedClock(profile, 3)
    grid = ScriptedGrid(order=[2], train_seconds=dict.fromkeys(range(3), 1.0))
    loop = engine(grid, clock=clock, concurrency=3, buffer_size=2, simulated=False)
    start = ArrayRecord({"w": Array(np.zeros(1, np.float32))})
    versions = play_versions(loop, start, 2)
    loop.drain()
    assert sorted(u.client for u in versions[0].updates) == [0, 2]
    assert versions[0].sim_seconds == pytest.approx(10.0)
    assert sorted(u.client for u in versions[1].updates) == [1, 2]
    assert versions[1].staleness == [1, 1]  # both were sent version 0
    assert versions[1].sim_seconds == pytest.approx(10.0)


@pytest.mark.usefixtures("task_identity")
def test_the_servers_work_between_versions_delays_the_next_dispatch_on_the_clock() -> (
    None
):
    """Clients 0 and 1 train first (1 s and 3 s on the clock; unlimited
    links). Version 1 is client 0's reply at 1 s. The server then works 5 s
    (evaluation, records), sending nothing: client 1's reply comes in at
    3 s, meanwhile, and is taken at 6 s, so version 2 lasts 5 s (not 2 + 5:
    the work overlaps the training still in flight); client 2, sent after
    the work at 6 s, replies at 9 s, taken after 5 s more work at 11 s."""
    clock = SimulatedClock(NetworkProfile.from_document({}, "test"), 3)
    grid = ScriptedGrid(order=[], train_seconds={0: 1.0, 1: 3.0, 2: 3.0})
    loop = engine(grid, clock=clock, concurrency=2, buffer_size=1)
    arrays = ArrayRecord({"w": Array(np.zeros(1, np.float32))})
    versions = []
    for version, server_seconds in [(1, 0.0), (2, 5.0), (3, 5.0)]:
        outcome = loop.next_version(
            arrays, version, ConfigRecord(), Participants(ROSTER), server_seconds
        )
        versions.append(outcome)
        arrays = outcome.arrays
    assert [[u.client for u in v.updates] for v in versions] == [[0], [1], [2]]
    assert [v.sim_seconds for v in versions] == pytest.approx([1.0, 5.0, 5.0])


class BlockingGrid(ScriptedGrid):
    """Each pull while `blocking` takes 31 s of the engine's clock (Flower
    retrying a half-pushed reply's objects) and returns nothing; the
    replies that came meanwhile are in the next pull once it is not."""

    def __init__(self, clock: list[float]) -> None:
        super().__init__([], dict.fromkeys(range(3), 0.0))
        self.clock, self.blocking = clock, 1  # pulls left that block

    def pull_messages(self, message_ids):
        if self.blocking:
            self.blocking -= 1
            self.clock[0] += 31.0
            return []
        return super().pull_messages(message_ids)


@pytest.mark.usefixtures("task_identity")
def test_replies_that_come_during_a_long_pull_are_not_late(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """round-timeout 30 s: a pull that returns after the deadline does not
    make the clients it waited for late, they are asked once more; clients
    still silent at a pull that starts after it are given up on."""
    clock = [1000.0]
    monkeypatch.setattr(
        "pollen.strategies.asynchronous.time.monotonic", lambda: clock[0]
    )
    grid = BlockingGrid(clock)
    loop = engine(grid, concurrency=2, buffer_size=2)
    start = ArrayRecord({"w": Array(np.zeros(1, np.float32))})
    (version,) = play_versions(loop, start, 1)
    assert len(version.updates) == 2 and not version.failures
    grid.blocking = 100  # silent from here on: the second pull starts past it
    with pytest.raises(RuntimeError, match="went silent for round-timeout"):
        loop.next_version(version.arrays, 2, ConfigRecord(), Participants(ROSTER))


@pytest.mark.usefixtures("task_identity")
def test_each_update_is_bounded_under_the_roster_it_was_sent_with() -> None:
    """Client 2's node joins after version 1; version 2's buffer holds client
    1 (sent under the roster without it) and client 2. The norm bound looks
    each update's node up in the roster it was sent under (it looked all up
    in the first's, and the server stopped on KeyError 2)."""
    before = Roster.from_nodes({10: (0, 3), 11: (1, 3)}, 3)
    grid = ScriptedGrid(order=[0, 0, 1, 2], train_seconds=dict.fromkeys(range(3), 0.0))
    loop = engine(grid, concurrency=3, buffer_size=2, norm_bound=2.0)
    start = ArrayRecord({"w": Array(np.zeros(1, np.float32))})
    first = loop.next_version(start, 1, ConfigRecord(), Participants(before))
    assert [u.client for u in first.updates] == [0, 0]
    second = loop.next_version(first.arrays, 2, ConfigRecord(), Participants(ROSTER))
    assert sorted(u.client for u in second.updates) == [1, 2]


@pytest.mark.usefixtures("task_identity")
def test_a_dropped_update_takes_its_own_staleness_with_it() -> None:
    """Version 2's buffer: client 0's update sent at version 0 (staleness 1,
    a step of 10), then its update sent at version 1 (staleness 0, a step of
    1). The norm bound (1 x the median, drop) drops the first; the kept one
    keeps staleness 0, so the model moves by 1 / sqrt(1 + 0) = 1 (it was
    given the first's staleness by client id: 1 / sqrt(2))."""
    grid = ScriptedGrid(
        order=[1, 1, 0, 0], train_seconds=dict.fromkeys(range(3), 0.0),
        steps={(0, 0): 10.0},
    )  # fmt: skip
    roster = Roster({0: 10, 1: 11})
    loop = engine(grid, norm_bound=1.0, norm_action="drop")
    start = ArrayRecord({"w": Array(np.zeros(1, np.float32))})
    first = loop.next_version(start, 1, ConfigRecord(), Participants(roster))
    assert [u.client for u in first.updates] == [1, 1]
    np.testing.assert_allclose(first.arrays["w"].numpy(), [1.0])
    second = loop.next_version(first.arrays, 2, ConfigRecord(), Participants(roster))
    assert [u.client for u in second.updates] == [0] and len(second.failures) == 1
    assert second.staleness == [0]
    np.testing.assert_allclose(second.arrays["w"].numpy(), [2.0])


@pytest.mark.usefixtures("task_identity")
def test_a_version_with_fewer_updates_than_min_train_replies_is_skipped() -> None:
    """min-train-replies 2, a buffer of 2, the norm bound (drop) leaving 1:
    the version is skipped and the model kept, as a synchronous round with
    fewer valid replies is."""
    grid = ScriptedGrid(
        order=[0, 1], train_seconds=dict.fromkeys(range(3), 0.0),
        steps={(1, 0): 10.0},
    )  # fmt: skip
    loop = engine(grid, norm_bound=1.0, norm_action="drop", min_replies=2)
    start = ArrayRecord({"w": Array(np.zeros(1, np.float32))})
    (version,) = play_versions(loop, start, 1)
    assert version.skipped and len(version.updates) == 1
    np.testing.assert_array_equal(version.arrays["w"].numpy(), [0.0])


def test_min_train_replies_above_the_buffer_is_refused() -> None:
    with pytest.raises(SettingsError, match="min-train-replies=3 above the 2 replies"):
        Settings.from_run_config(
            {"mode": "async", "num-clients": 4, "client-frac": 1.0,
             "buffer-size": 2, "min-train-replies": 3}
        )  # fmt: skip


def test_dp_sgd_is_refused_with_async() -> None:
    """DP-SGD's noise is set for at most one training of a client a round;
    FedBuff hands a fast client its next task at once (one trained 10 times
    in 5 versions, spending epsilon 5.33 of a 4.0 budget, by Opacus's RDP
    accountant): refused, before anything starts."""
    with pytest.raises(SettingsError, match=r"dp=true with mode='async'"):
        Settings.from_run_config({"mode": "async", "dp": True, "model": "cnn-gn"})
