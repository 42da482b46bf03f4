"""Harness aggregation, BatchNorm handling, seeded sampling and routing."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from pollen.flower_waits import PollClock
from pollen.protocol import CLIENT as CLIENT_KEY
from pollen.strategies import sampling
from pollen.strategies.aggregation import Mean
from pollen.strategies.fedavg import FedAvgUpdate
from pollen.strategies.sampling import (
    OneMessagePerNode,
    Roster,
    RosterError,
    sample_clients,
)
from pollen.task.models import build_model
from tests.conftest import client_update, reply_from
from tests.rounds import fedavg

pytestmark = pytest.mark.usefixtures("task_identity")


def record(**arrays: np.ndarray) -> ArrayRecord:
    return ArrayRecord({k: Array(v) for k, v in arrays.items()})


def weighted_fedavg(
    records: list[dict[str, np.ndarray]], weights: list[float]
) -> dict[str, np.ndarray]:
    """The aggregation step (Mean) and FedAvg's update, as a round applies them."""
    updates = [
        client_update(c, r, w)
        for c, (r, w) in enumerate(zip(records, weights, strict=True))
    ]
    return FedAvgUpdate().apply(records[0], Mean()(updates, records[0]), lambda _: ())


def test_weighted_average_by_hand() -> None:
    a = {"w": np.array([1.0, 2.0], np.float32), "n": np.array(4, np.int64)}
    b = {"w": np.array([3.0, 6.0], np.float32), "n": np.array(7, np.int64)}
    out = weighted_fedavg([a, b], [1, 3])  # weights 1/4, 3/4
    np.testing.assert_allclose(out["w"], [2.5, 5.0])
    assert out["w"].dtype == np.float32
    assert out["n"].dtype == np.int64 and int(out["n"]) == 6  # 6.25


def test_weighted_average_rejects_bad_weights() -> None:
    a = {"w": np.zeros(2, np.float32)}
    with pytest.raises(ValueError, match="positive weight"):
        weighted_fedavg([a, a], [1, 0])


def reply(client: int, node: int, arrays: ArrayRecord, examples: int) -> Message:
    content = RecordDict(
        {
            "arrays": arrays,
            "metrics": MetricRecord({"num-examples": examples, "train-loss": 1.0}),
            "client": ConfigRecord({CLIENT_KEY: client}),
        }
    )
    return reply_from(node, content)


def test_fedavg_averages_batchnorm_model_keeping_dtypes() -> None:
    models = [build_model("mlp-bn", (1, 4, 4), 3, seed) for seed in (1, 2)]
    for m, shift in zip(models, (0.0, 1.0), strict=True):
        m[2].running_mean.fill_(shift)
        m[2].num_batches_tracked.fill_(10 + 10 * int(shift))
    roster = Roster.from_nodes({11: (0, 2), 22: (1, 2)}, 2)
    strategy = fedavg(roster=roster, num_clients=2, client_frac=1.0, seed=0)
    strategy.configure_train(1, ArrayRecord(models[0].state_dict()), ConfigRecord())
    replies = [
        reply(1, 22, ArrayRecord(models[1].state_dict()), 30),
        reply(0, 11, ArrayRecord(models[0].state_dict()), 10),
    ]
    arrays = strategy.aggregate_train(1, replies)
    state = arrays.to_torch_state_dict()
    torch.testing.assert_close(state["2.running_mean"], torch.full((128,), 0.75))
    assert state["2.num_batches_tracked"].dtype == torch.int64
    assert int(state["2.num_batches_tracked"]) == 18  # 0.25 * 10 + 0.75 * 20 = 17.5
    w0, w1 = (m.state_dict()["1.weight"] for m in models)
    torch.testing.assert_close(state["1.weight"], 0.25 * w0 + 0.75 * w1)
    assert all(v.dtype in (torch.float32, torch.int64) for v in state.values())
    assert [u.client for u in strategy.traffic[1].updates] == [0, 1]  # in order
    assert all(u.metrics["train-loss"] == 1.0 for u in strategy.traffic[1].updates)
    assert strategy.traffic[1].bytes_up == 2 * arrays.count_bytes()


def test_aggregation_does_not_depend_on_reply_order() -> None:
    recs = [
        record(w=np.random.default_rng(i).random(1000).astype(np.float32))
        for i in range(5)
    ]
    roster = Roster.from_nodes({i: (i, 5) for i in range(5)}, 5)
    strategy = fedavg(roster=roster, num_clients=5, client_frac=1.0, seed=0)
    strategy.configure_train(1, recs[0], ConfigRecord())
    forward = [reply(i, i, recs[i], 7 + i) for i in range(5)]
    a = strategy.aggregate_train(1, forward)
    b = strategy.aggregate_train(1, forward[::-1])
    assert a["w"].numpy().tobytes() == b["w"].numpy().tobytes()


def test_sampling_is_seeded_and_sized() -> None:
    first = [sample_clients(10, 0.25, 845, r) for r in range(1, 6)]
    again = [sample_clients(10, 0.25, 845, r) for r in range(1, 6)]
    assert first == again
    assert all(len(s) == 2 and len(set(s)) == 2 for s in first)
    assert len({tuple(s) for s in first}) > 1  # rounds differ
    assert sample_clients(10, 1.0, 1, 1) == list(range(10))
    assert sample_clients(3, 0.1, 1, 1) and len(sample_clients(3, 0.1, 1, 1)) == 1


def test_configure_train_routes_each_client_to_its_node() -> None:
    roster = Roster.from_nodes({101: (0, 2), 202: (1, 2)}, 6)  # 2 nodes, 6 clients
    assert roster.owner == {0: 101, 1: 202, 2: 101, 3: 202, 4: 101, 5: 202}
    strategy = fedavg(roster=roster, num_clients=6, client_frac=0.5, seed=3)
    arrays = record(w=np.ones(3, np.float32))
    messages = list(strategy.configure_train(4, arrays, ConfigRecord({"lr": 0.1})))
    clients = [int(m.content["config"][CLIENT_KEY]) for m in messages]
    assert clients == sample_clients(6, 0.5, 3, 4)
    assert [m.metadata.dst_node_id for m in messages] == [
        roster.owner[c] for c in clients
    ]
    assert all(m.content["config"]["lr"] == 0.1 for m in messages)
    assert strategy.sent[4].bytes_down == 3 * arrays.count_bytes()


def test_roster_refuses_duplicate_and_mismatched_partitions() -> None:
    with pytest.raises(RosterError, match="both hold partition-id 0"):
        Roster.from_nodes({1: (0, 2), 2: (0, 2)}, 2)
    with pytest.raises(RosterError, match="cannot serve num-clients=3"):
        Roster.from_nodes({1: (0, 4), 2: (1, 4)}, 3)


class FakeGrid:
    """Answers every message from its node at once, but those to `silent`,
    and cannot store those to `refused` (left out of the IDs it returns, as
    Flower's grids do); pushing takes `seconds` and a pull half a second on
    the clock `now`."""

    def __init__(self, silent=(), seconds: float = 0.0, refused=()) -> None:
        self.waves: list[list[int]] = []
        self.silent, self.seconds, self.now = set(silent), seconds, 0.0
        self.refused = set(refused)
        self.replies: dict[str, Message] = {}
        self.held: dict[str, int] = {}  # messages to silent nodes: id -> node
        self.pushed = 0

    def push_messages(self, messages):
        self.waves.append([m.metadata.dst_node_id for m in messages])
        self.now += self.seconds
        ids = []
        for message in messages:
            self.pushed += 1
            message_id = f"m{self.pushed}"
            message.metadata.__dict__["_message_id"] = message_id
            node = message.metadata.dst_node_id
            if node in self.refused:
                continue
            ids.append(message_id)
            if node in self.silent:
                self.held[message_id] = node
            else:
                self._answer(message_id, node)
        return ids

    def _answer(self, message_id: str, node: int) -> None:
        reply = reply_from(node, RecordDict())
        reply.metadata.__dict__["_reply_to_message_id"] = message_id
        self.replies[message_id] = reply

    def wake(self, node: int) -> None:
        """Node `node` answers what it held, and from now on at once."""
        self.silent.discard(node)
        for message_id in [i for i, n in self.held.items() if n == node]:
            self._answer(message_id, self.held.pop(message_id))

    def pull_messages(self, message_ids):
        self.now += 0.5
        return [self.replies.pop(i) for i in message_ids if i in self.replies]


@pytest.fixture
def fake_clock(monkeypatch) -> Callable[[FakeGrid], None]:
    """Make OneMessagePerNode read `grid.now` as its clock and never sleep."""

    def use(grid: FakeGrid) -> None:
        monkeypatch.setattr(
            "pollen.strategies.sampling.time.monotonic", lambda: grid.now
        )
        monkeypatch.setattr("pollen.strategies.sampling.time.sleep", lambda s: None)

    return use


def to_nodes(*nodes: int) -> list[Message]:
    return [Message(RecordDict(), dst_node_id=n, message_type="train") for n in nodes]


def test_one_message_per_node_sends_a_nodes_next_message_on_its_reply(
    fake_clock,
) -> None:
    grid = FakeGrid()
    fake_clock(grid)
    replies = OneMessagePerNode(grid).send_and_receive(to_nodes(1, 2, 1, 1), timeout=5)
    assert grid.waves == [[1, 2], [1], [1]]
    assert len(replies) == 4


def test_the_pushes_share_one_timeout(fake_clock) -> None:
    """round-timeout bounds the round, not each message: 4.5 s a message, 10 s in all."""
    grid = FakeGrid(seconds=4.0)
    fake_clock(grid)
    replies = OneMessagePerNode(grid).send_and_receive(to_nodes(1, 1, 1, 1), timeout=10)
    assert grid.waves == [[1], [1], [1]]  # the fourth message is never sent
    assert len(replies) == 3


def test_a_silent_node_holds_back_only_its_own_clients(fake_clock) -> None:
    """Node 1 may still be working on its first message: its next one is
    never sent. Node 2 goes on with its queue meanwhile, not waiting for it."""
    grid = FakeGrid(silent={1})
    fake_clock(grid)
    replies = OneMessagePerNode(grid).send_and_receive(
        to_nodes(1, 2, 1, 2, 2), timeout=5
    )
    assert grid.waves == [[1, 2], [2], [2]]
    assert [r.metadata.src_node_id for r in replies] == [2, 2, 2]


def test_a_message_the_grid_could_not_store_counts_as_not_answered(
    fake_clock,
) -> None:
    grid = FakeGrid(refused={1})
    fake_clock(grid)
    replies = OneMessagePerNode(grid).send_and_receive(to_nodes(1, 2, 1, 2), timeout=5)
    assert grid.waves == [[1, 2], [2]]
    assert [r.metadata.src_node_id for r in replies] == [2, 2]


def test_a_node_late_in_one_call_is_sent_nothing_until_it_answers(fake_clock) -> None:
    """A simulation runs a message whose reply came too late all the same: the
    node's next message waits for that reply, in a later call too (two
    trainings at once would race on the node's state); the late reply is
    dropped."""
    grid = FakeGrid(silent={1})
    fake_clock(grid)
    sender = OneMessagePerNode(grid)
    assert len(sender.send_and_receive(to_nodes(1, 2), timeout=5)) == 1
    assert len(sender.send_and_receive(to_nodes(1, 2), timeout=5)) == 1
    grid.wake(1)
    replies = sender.send_and_receive(to_nodes(1, 2), timeout=5)
    assert grid.waves == [[1, 2], [2], [2], [1]]
    assert [r.metadata.src_node_id for r in replies] == [2, 1]
    assert all(r.metadata.reply_to_message_id in ("m4", "m5") for r in replies)


class OneLongPull(FakeGrid):
    """Node 1 answers while the first pull takes 6 s (Flower retrying a
    killed node's half-pushed reply): that pull returns nothing, the next
    one has the answer."""

    def __init__(self) -> None:
        super().__init__(silent={1})
        self.long = True

    def pull_messages(self, message_ids):
        if self.long:
            self.long = False
            self.now += 6.0
            self.wake(1)
            return []
        return super().pull_messages(message_ids)


def test_a_reply_that_came_during_a_pull_past_the_deadline_is_not_late(
    fake_clock,
) -> None:
    """round-timeout 5 s: the pull that started at 0 s returns at 6 s, so the
    grid is asked once more (that pull starts past the deadline, the last);
    node 1's reply came in time and counts. Node 2's second message, due
    when its first reply came, is not sent after the deadline."""
    grid = OneLongPull()
    fake_clock(grid)
    replies = OneMessagePerNode(grid).send_and_receive(to_nodes(1, 2, 2), timeout=5)
    assert [r.metadata.src_node_id for r in replies] == [1, 2]
    assert grid.waves == [[1, 2]]
    assert grid.now == 6.5  # one more pull, then done


class InstantPulls(FakeGrid):
    """A FakeGrid whose pulls take no time; node 1 answers at `answer_at` s."""

    def __init__(self, answer_at: float) -> None:
        super().__init__(silent={1})
        self.answer_at = answer_at
        self.slept: list[float] = []

    def pull_messages(self, message_ids):
        return [self.replies.pop(i) for i in message_ids if i in self.replies]

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds
        if self.now >= self.answer_at:
            self.wake(1)


@pytest.mark.parametrize(
    ("share", "pulls", "longest"),
    [(0.0, 2000, 0.01), (sampling.DEPLOYED_REPLY_SHARE, 118, 0.5)],
)
def test_a_deployed_grid_is_asked_less_often_the_longer_a_reply_takes(
    monkeypatch, share, pulls, longest
) -> None:
    """By hand, a reply that comes 20 s after its message: a simulation asks
    every 0.01 s (2,000 pulls); a deployment 0.01 s after the push, then
    every 5 % of the time since (0.2 s after 4 s), at most every 0.5 s: 20
    pulls in the first 0.2 s, 20 ln(50) = 78 to 10 s, 20 more to 20 s."""
    grid = InstantPulls(answer_at=20.0)
    monkeypatch.setattr("pollen.strategies.sampling.time.monotonic", lambda: grid.now)
    monkeypatch.setattr("pollen.strategies.sampling.time.sleep", grid.sleep)
    clock = PollClock(0.01, share)
    replies = OneMessagePerNode(grid, clock).send_and_receive(to_nodes(1), timeout=60)
    assert len(replies) == 1
    assert grid.slept[0] == 0.01 and max(grid.slept) == pytest.approx(longest)
    assert len(grid.slept) == pytest.approx(pulls, rel=0.05)
    assert 20.0 <= grid.now < 20.0 + longest + 1e-9  # found within one wait
