"""Nodes leaving and joining: the roster, sampling among connected clients,
bounded waits for min-available-nodes, and clients whose node never replied."""

from __future__ import annotations

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
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode

from pollen.protocol import CLIENT as CLIENT_KEY
from pollen.strategies.membership import LEAST_ANSWER_WAIT, Membership
from pollen.strategies.sampling import Roster, RosterError, sample_clients
from tests.conftest import reply_from
from tests.rounds import fedavg

pytestmark = pytest.mark.usefixtures("task_identity")


def test_roster_with_one_node_per_client_may_miss_clients() -> None:
    roster = Roster.from_nodes({11: (0, 3), 33: (2, 3)}, 3)
    assert roster.owner == {0: 11, 2: 33}  # client 1 waits for its node
    with pytest.raises(RosterError, match="partition-id 3 of num-partitions 3"):
        Roster.from_nodes({11: (3, 3)}, 3)


def test_joined_drops_nodes_that_left_and_hands_their_partition_on() -> None:
    roster = Roster.from_nodes({11: (0, 3), 22: (1, 3), 33: (2, 3)}, 3)
    after, notes = roster.joined({11, 33}, {}, 3)
    assert after.owner == {0: 11, 2: 33} and not notes
    back, notes = after.joined({11, 33, 44}, {44: (1, 3)}, 3)
    assert back.owner == {0: 11, 1: 44, 2: 33} and not notes


def test_joined_does_not_use_a_second_holder_or_a_foreign_node() -> None:
    roster = Roster.from_nodes({11: (0, 2), 22: (1, 2)}, 2)
    after, notes = roster.joined({11, 22, 55, 66}, {55: (1, 2), 66: (0, 5)}, 2)
    assert after.owner == roster.owner
    assert "node 55 also holds partition-id 1, served by node 22" in notes[0]
    assert "node 66 reports partition-id 0 of 5" in notes[1]


def test_sampling_draws_from_connected_clients_and_honours_the_minimum() -> None:
    everyone = sample_clients(10, 0.3, 7, 2)
    assert sample_clients(10, 0.3, 7, 2, available=range(10)) == everyone
    some = sample_clients(10, 0.3, 7, 2, available=[1, 4, 5, 8])
    assert len(some) == 3 and set(some) <= {1, 4, 5, 8}
    assert sample_clients(10, 0.1, 7, 2, minimum=4) == sorted(
        sample_clients(10, 0.1, 7, 2, minimum=4)
    )
    assert len(sample_clients(10, 0.1, 7, 2, minimum=4)) == 4
    assert sample_clients(10, 0.5, 7, 2, available=[3, 6]) == [3, 6]
    assert sample_clients(10, 0.5, 7, 2, available=[]) == []


class NodeGrid:
    """A Grid whose nodes answer queries from their node config; a node in
    `silent` is connected but answers nothing until it leaves `silent`."""

    def __init__(self, nodes: dict[int, dict], silent: set[int] | None = None) -> None:
        self.nodes = nodes
        self.silent = silent or set()
        self.asked: list[int] = []
        self.waiting: dict[str, Message] = {}  # message ID -> query

    def get_node_ids(self) -> list[int]:
        return list(self.nodes)

    def push_messages(self, messages):
        for m in messages:
            m.metadata.__dict__["_message_id"] = f"q{len(self.asked)}"
            self.asked.append(m.metadata.dst_node_id)
            self.waiting[m.metadata.message_id] = m
            yield m.metadata.message_id

    def pull_messages(self, message_ids):
        for message_id in message_ids:
            query = self.waiting.get(message_id)
            node = query and query.metadata.dst_node_id
            if query is None or node in self.silent or node not in self.nodes:
                continue
            del self.waiting[message_id]
            info = ConfigRecord(self.nodes[node])
            yield reply_from(node, RecordDict({"node": info}), "query", query)


def report(pid: int, parts: int, examples: int = 100, own: bool = False) -> dict:
    return {CLIENT_KEY: pid, "num-partitions": parts, "num-examples": examples,
            "own-data": own}  # fmt: skip


def test_membership_follows_nodes_leaving_and_rejoining() -> None:
    grid = NodeGrid({11: report(0, 2), 22: report(1, 2, 40, own=True)})
    members = Membership(grid, 2, ConfigRecord(), wait=0.0)
    assert members.refresh().owner == {0: 11, 1: 22}
    assert members.own_examples == {1: 40}  # own data: the node's count bounds it
    assert members.refresh().owner == {0: 11, 1: 22} and grid.asked == [11, 22]
    del grid.nodes[22]
    assert members.refresh().owner == {0: 11}
    grid.nodes[22] = report(1, 2)  # the same node ID back (a registered key)
    assert members.refresh().owner == {0: 11, 1: 22}
    assert grid.asked == [11, 22, 22]  # asked again: its state may be gone


def test_a_simulations_nodes_are_placed_without_a_query() -> None:
    """Sorted node IDs serve clients k, k + n, ...; nothing is sent, so
    start-up does not grow with the nodes, and the placement never changes."""
    grid = NodeGrid({33: {}, 11: {}, 22: {}})
    members = Membership(grid, 7, ConfigRecord(), wait=0.0, simulated=True)
    expected = {0: 11, 1: 22, 2: 33, 3: 11, 4: 22, 5: 33, 6: 11}
    assert members.refresh().owner == expected
    assert members.refresh().owner == expected and grid.asked == []


def test_a_simulations_placement_waits_for_its_nodes_to_be_registered() -> None:
    """Flower registers a simulation's nodes after the ServerApp's thread has
    started: a placement made from the first of them would hold for the
    whole run, so the IDs are read until two reads agree."""

    class Registering(NodeGrid):
        def __init__(self, reads: list[list[int]]) -> None:
            super().__init__({})
            self.reads = reads

        def get_node_ids(self) -> list[int]:
            return self.reads.pop(0) if len(self.reads) > 1 else self.reads[0]

    grid = Registering([[11], [11, 22], [11, 22, 33]])
    members = Membership(grid, 6, ConfigRecord(), wait=0.0, simulated=True)
    assert members.refresh().owner == {0: 11, 1: 22, 2: 33, 3: 11, 4: 22, 5: 33}


def test_simulated_nodes_beyond_the_clients_serve_none() -> None:
    """`--federation-config num-supernodes=3` with num-clients=2."""
    grid = NodeGrid({33: {}, 11: {}, 22: {}})
    members = Membership(grid, 2, ConfigRecord(), wait=0.0, simulated=True)
    assert members.refresh().owner == {0: 11, 1: 22}


def test_a_node_whose_shard_differs_from_the_servers_is_warned_about(caplog) -> None:
    """Other size, or the same size with other examples (its fingerprint); a
    node that sends no fingerprint (an older pollen) is taken at its size."""
    grid = NodeGrid({
        11: {**report(0, 4), "shard-fingerprint": "aaaa"},  # the server's shard
        22: {**report(1, 4), "shard-fingerprint": "ffff"},  # other examples
        33: report(2, 4),  # no fingerprint
        44: {**report(3, 4, examples=90), "shard-fingerprint": "dddd"},
    })  # fmt: skip
    shards = {0: (100, "aaaa"), 1: (100, "bbbb"), 2: (100, "cccc"), 3: (100, "dddd")}
    members = Membership(grid, 4, ConfigRecord(), wait=0.0, shards=shards)
    assert members.refresh().owner == {0: 11, 1: 22, 2: 33, 3: 44}
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 2, warned
    assert warned[0].startswith("pollen: node 22's shard for client 1 holds other")
    assert warned[1].startswith("pollen: node 44 holds 90 examples for client 3")


def test_membership_waits_a_bounded_time_then_says_why() -> None:
    grid = NodeGrid({11: report(0, 3)})
    members = Membership(grid, 3, ConfigRecord(), min_available=2, wait=0.0)
    with pytest.raises(RosterError, match=r"1 SuperNode.*min-available-nodes is 2"):
        members.refresh()


def test_a_connected_node_that_never_answers_is_waited_for_once_then_recorded(
    monkeypatch,
) -> None:
    """A SuperNode the SuperLink lists but that answers nothing (one stuck on
    a message of a run its restarted SuperLink ended) holds the start-up for
    node-wait, then each round records it without waiting again; its late
    answer is taken and it joins."""
    now = [0.0]
    monkeypatch.setattr("pollen.strategies.membership.time.monotonic", lambda: now[0])
    monkeypatch.setattr(
        "pollen.strategies.membership.time.sleep",
        lambda s: now.__setitem__(0, now[0] + s),
    )
    grid = NodeGrid({11: report(0, 2), 22: report(1, 2)}, silent={11})
    members = Membership(grid, 2, ConfigRecord(), wait=45.0)
    first = members.participants()
    assert first.roster.owner == {1: 22}
    assert 45.0 <= now[0] < 46.0  # node-wait, not Flower's or a fixed 300 s
    assert first.unreachable == (
        "node 11: connected, but no answer to pollen's query for 45 s (node-wait); "
        "its clients are not sampled until it answers",
    )
    waited = now[0]
    again = members.participants()
    assert now[0] == waited and grid.asked == [11, 22]  # not asked nor waited again
    assert again.unreachable and again.roster.owner == {1: 22}
    grid.silent.clear()  # its answer comes
    joined = members.participants()
    assert joined.roster.owner == {0: 11, 1: 22} and not joined.unreachable
    assert grid.asked == [11, 22]


def test_a_short_node_wait_still_gives_a_node_time_to_answer(monkeypatch) -> None:
    now = [0.0]
    monkeypatch.setattr("pollen.strategies.membership.time.monotonic", lambda: now[0])
    monkeypatch.setattr(
        "pollen.strategies.membership.time.sleep",
        lambda s: now.__setitem__(0, now[0] + s),
    )
    grid = NodeGrid({11: report(0, 1)}, silent={11})
    members = Membership(grid, 1, ConfigRecord(), wait=0.0)
    with pytest.raises(RosterError, match="no SuperNode answered"):
        members.refresh()
    assert now[0] >= LEAST_ANSWER_WAIT


def test_membership_ignores_a_node_with_an_unusable_answer() -> None:
    grid = NodeGrid({11: report(0, 2), 22: {CLIENT_KEY: "one"}})
    members = Membership(grid, 2, ConfigRecord(), wait=0.0)
    assert members.refresh().owner == {0: 11}


def test_a_client_whose_node_never_replied_is_a_recorded_failure() -> None:
    roster = Roster.from_nodes({11: (0, 2), 22: (1, 2)}, 2)
    strategy = fedavg(roster=roster, num_clients=2, client_frac=1.0, seed=0)
    arrays = ArrayRecord({"w": Array(np.ones(2, np.float32))})
    strategy.configure_train(1, arrays, ConfigRecord())
    content = RecordDict(
        {
            "arrays": arrays,
            "metrics": MetricRecord({"num-examples": 5, "train-loss": 1.0}),
            "client": ConfigRecord({CLIENT_KEY: 0}),
        }
    )
    new = strategy.aggregate_train(1, [reply_from(11, content)])
    assert new is not None
    assert strategy.traffic[1].failures == [
        "node 22: no reply for 1 of clients [1] within round-timeout"
    ]


def test_personal_evaluation_asks_only_connected_clients() -> None:
    roster = Roster.from_nodes({11: (0, 2)}, 2)
    strategy = fedavg(roster=roster, num_clients=2, client_frac=1.0, seed=0)
    strategy.trained_clients = {0, 1}
    strategy.evaluation.every = 1
    strategy.evaluation.sharing = type("S", (), {"local": ("bn",), "shared": ("w",)})()
    arrays = ArrayRecord({"w": Array(np.ones(2, np.float32))})
    messages = list(strategy.configure_evaluate(1, arrays, ConfigRecord()))
    assert [m.metadata.dst_node_id for m in messages] == [11]
    assert isinstance(messages[0], Message)


def test_flowers_node_unavailable_error_is_told_as_the_lost_nodes_reason() -> None:
    """Flower answers for a lost node with an error whose source is not that
    node; the failure still names the node that went silent, and the round
    aggregates the others."""
    roster = Roster.from_nodes({11: (0, 2), 22: (1, 2)}, 2)
    strategy = fedavg(roster=roster, num_clients=2, client_frac=1.0, seed=0)
    arrays = ArrayRecord({"w": Array(np.ones(2, np.float32))})
    sent = list(strategy.configure_train(1, arrays, ConfigRecord()))
    error = Error(code=ErrorCode.NODE_UNAVAILABLE, reason="Node Unavailable")
    lost = Message(error, reply_to=sent[1])
    lost.metadata.__dict__["_src_node_id"] = SUPERLINK_NODE_ID  # as Flower sends it
    content = RecordDict(
        {
            "arrays": arrays,
            "metrics": MetricRecord({"num-examples": 5, "train-loss": 1.0}),
            "client": ConfigRecord({CLIENT_KEY: 0}),
        }
    )
    assert strategy.aggregate_train(1, [reply_from(11, content), lost]) is not None
    assert [u.client for u in strategy.traffic[1].updates] == [0]
    assert strategy.traffic[1].failures == [
        "node 22: no reply for 1 of clients [1]: Node Unavailable"
    ]
