"""The simulated clock by hand: message, client and round times under a
profile, and a synchronous round's deadline in `play_round`."""

from __future__ import annotations

import math

import numpy as np
import pytest
from flwr.app import ConfigRecord, Error, Message, MetricRecord
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode

from pollen.common.cohorts import COHORT_TRAIN, member_views, packed_reply
from pollen.common.links import LinkShape
from pollen.network_profile import NetworkProfile, ProfileError
from pollen.protocol import CLIENT, CLIENT_RECORD, CONFIG, EVAL_SECONDS, METRICS
from pollen.strategies.aggregation import ClientUpdate
from pollen.strategies.clock import SimulatedClock, effective_rate, transfer_seconds
from pollen.strategies.cohort_grid import CohortGrid
from pollen.strategies.replies import reported_seconds
from pollen.strategies.round import RoundTiming, play_round
from pollen.strategies.sampling import Participants, Roster
from pollen.strategies.strategy import TrainRequest
from tests.conftest import reply_from
from tests.test_round import ROSTER, EchoGrid, model, parts

LINK = LinkShape(delay_ms=20, up_mbit=1, down_mbit=8)


def test_a_message_takes_its_latency_plus_its_bits_over_the_rate() -> None:
    """1 MB up at 1 Mbit/s: 0.02 + 8 s; down at 8 Mbit/s: 0.02 + 1 s."""
    assert transfer_seconds(1_000_000, LINK, "up") == pytest.approx(8.02)
    assert transfer_seconds(1_000_000, LINK, "down") == pytest.approx(1.02)
    assert transfer_seconds(1_000_000, LinkShape(), "up") == 0.0  # unlimited


def test_loss_caps_the_rate_at_tcps_steady_state_throughput() -> None:
    """Mathis et al.: 1.22 * 1448 B * 8 / (0.04 s * sqrt(0.01)) ~ 3.5 Mbit/s,
    below the link's 8 Mbit/s; without loss the link's own rate."""
    lossy = LinkShape(delay_ms=20, down_mbit=8, loss_pct=1)
    expected = math.sqrt(1.5) * 1448 * 8 / (0.04 * 0.1)
    assert effective_rate(lossy, "down") == pytest.approx(expected)
    assert effective_rate(LINK, "down") == 8e6


def test_a_client_time_is_down_plus_slowed_work_plus_up() -> None:
    """Node 1 is 10x slower: 2 s of work count 20."""
    profile = NetworkProfile.from_document(
        {
            "default": {"delay-ms": 20, "up-mbit": 1, "down-mbit": 8},
            "group": [{"nodes": [1], "slowdown": 10}],
        },
        "test",
    )
    clock = SimulatedClock(profile, 2)
    fast = clock.client_seconds(0, 1_000_000, 2.0, 1_000_000)
    slow = clock.client_seconds(1, 1_000_000, 2.0, 1_000_000)
    assert fast == pytest.approx(1.02 + 2.0 + 8.02)
    assert slow == pytest.approx(1.02 + 20.0 + 8.02)


def test_a_synchronous_round_ends_with_its_slowest_client_or_its_deadline() -> None:
    times = {0: 3.0, 1: 11.0, 2: 5.0}
    assert SimulatedClock.round_seconds(times) == 11.0
    assert SimulatedClock.round_seconds(times, deadline=6.0) == 6.0
    assert SimulatedClock.round_seconds(times, deadline=20.0) == 11.0
    assert SimulatedClock.round_seconds(times, deadline=20.0, late=True) == 20.0
    assert SimulatedClock.late(times, 6.0) == [1]
    assert SimulatedClock.late(times, 0.0) == []


@pytest.mark.usefixtures("task_identity")
def test_a_simulated_deadline_discards_the_late_client() -> None:
    """Client 1's link is 1 s one-way: past the 0.5 s deadline. The round
    aggregates client 0 alone (w = 0 + 1), records client 1 as late and
    takes the deadline's time."""
    profile = NetworkProfile.from_document(
        {"group": [{"nodes": [1], "delay-ms": 1000}]}, "test"
    )
    timing = RoundTiming(0.5, SimulatedClock(profile, 2), simulated=True)
    strategy, personal = parts()
    outcome = play_round(
        EchoGrid(), strategy, personal, 1, model(),
        (ConfigRecord({"lr": 0.1}), ConfigRecord()), Participants(ROSTER), 10.0,
        timing,
    )  # fmt: skip
    assert outcome.late == [1] and [u.client for u in outcome.updates] == [0]
    np.testing.assert_allclose(outcome.arrays["w"].numpy(), [1.0, 1.0])
    assert outcome.sim_seconds == 0.5
    assert outcome.clients == [0, 1] and not outcome.failures


@pytest.mark.usefixtures("task_identity")
def test_a_real_deadline_records_clients_without_a_reply_as_late() -> None:
    """Without a clock the deadline is real: the round stops waiting then,
    and a client whose node sent nothing back is late, not a failure."""
    strategy, personal = parts()
    outcome = play_round(
        EchoGrid(silent=frozenset({1})), strategy, personal, 1, model(),
        (ConfigRecord({"lr": 0.1}), ConfigRecord()), Participants(ROSTER), 10.0,
        RoundTiming(deadline=0.5),
    )  # fmt: skip
    assert outcome.late == [1] and not outcome.failures
    assert outcome.sim_seconds is None and not outcome.skipped


class QueuedGrid(EchoGrid):
    """Sets each message's ID as Flower's grids do; `unavailable` clients get
    the SuperLink's "Node Unavailable" error (sent by the SuperLink, not by
    their node). A `silent` client's message stays unanswered, as one queued
    behind its node's other client at the deadline does."""

    def __init__(self, silent=frozenset(), unavailable=frozenset()) -> None:
        super().__init__(silent | unavailable)
        self.unavailable = unavailable

    def send_and_receive(self, messages, *, timeout=None) -> list[Message]:
        messages = list(messages)
        for i, msg in enumerate(messages):
            msg.metadata.__dict__["_message_id"] = f"m{i}"
        replies = super().send_and_receive(messages, timeout=timeout)
        for msg in messages:
            if int(msg.content[CONFIG][CLIENT]) in self.unavailable:
                gone = Error(ErrorCode.NODE_UNAVAILABLE, "Error: Node Unavailable")
                reply = Message(gone, reply_to=msg)
                reply.metadata.__dict__["_src_node_id"] = SUPERLINK_NODE_ID
                replies.append(reply)
        return replies


@pytest.mark.usefixtures("task_identity")
def test_a_client_queued_behind_its_nodes_other_client_is_late() -> None:
    """One node serves both clients; at the deadline it has answered client
    0, not client 1 (its message waited for client 0's reply). Client 1 is
    late, not a failure (it was counted answered because its node was)."""
    strategy, personal = parts()
    outcome = play_round(
        QueuedGrid(silent=frozenset({1})), strategy, personal, 1, model(),
        (ConfigRecord({"lr": 0.1}), ConfigRecord()),
        Participants(Roster({0: 11, 1: 11})), 10.0, RoundTiming(deadline=0.5),
    )  # fmt: skip
    assert outcome.late == [1] and not outcome.failures


@pytest.mark.usefixtures("task_identity")
def test_an_error_before_the_deadline_is_a_failure_not_late() -> None:
    """Client 1's node is gone and the SuperLink says so before the deadline
    (from its own node ID): a failure, as without a deadline (it was counted
    late, and the error left out of the failures); likewise a cohort's error,
    which answers for every client its node serves."""
    strategy, personal = parts()
    outcome = play_round(
        QueuedGrid(unavailable=frozenset({1})), strategy, personal, 1, model(),
        (ConfigRecord({"lr": 0.1}), ConfigRecord()), Participants(ROSTER), 10.0,
        RoundTiming(deadline=0.5),
    )  # fmt: skip
    assert outcome.late == []
    assert any("Node Unavailable" in f for f in outcome.failures)
    strategy, personal = parts()
    outcome = play_round(
        CohortGrid(FailingNodes({22})), strategy, personal, 1, model(),
        (ConfigRecord({"lr": 0.1}), ConfigRecord()), Participants(ROSTER), 10.0,
        RoundTiming(deadline=0.5),
    )  # fmt: skip
    assert outcome.late == [] and [u.client for u in outcome.updates] == [0]
    assert any("out of memory" in f for f in outcome.failures)


class FailingNodes:
    """Answers each packed cohort message with its members' echo (other
    messages as `EchoGrid`), but the nodes in `failing`, which answer with
    an error."""

    def __init__(self, failing: set[int]) -> None:
        self.failing = failing

    def send_and_receive(self, messages, *, timeout=None) -> list[Message]:
        replies = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            if msg.metadata.message_type != COHORT_TRAIN:  # personal evaluation
                replies += EchoGrid().send_and_receive([msg])
                continue
            if node in self.failing:
                replies.append(Message(Error(0, "out of memory"), reply_to=msg))
                continue
            views = member_views(msg)
            answered = [(v, EchoGrid().send_and_receive([v])[0]) for v in views]
            packed = packed_reply(msg, answered)
            replies.append(reply_from(node, packed.content, COHORT_TRAIN))
        return replies


class OmittingNode:
    """Node 11 answers its cohort with the first member's own error (its
    `<client>/error` record) and says nothing of the second."""

    def send_and_receive(self, messages, *, timeout=None) -> list[Message]:
        replies = []
        for msg in messages:
            first = int(member_views(msg)[0].content[CONFIG][CLIENT])
            packed = packed_reply(msg, [], {first: ValueError("no step")})
            replies.append(reply_from(11, packed.content, COHORT_TRAIN))
        return replies


@pytest.mark.usefixtures("task_identity")
def test_a_cohort_member_its_nodes_reply_leaves_out_is_late() -> None:
    """A member's own error answers for that member only: client 1, of
    which its node's reply says nothing, is late (client 0's error counted
    it answered, as if the error were its node's)."""
    strategy, personal = parts()
    outcome = play_round(
        CohortGrid(OmittingNode()), strategy, personal, 1, model(),
        (ConfigRecord({"lr": 0.1}), ConfigRecord()),
        Participants(Roster({0: 11, 1: 11})), 10.0, RoundTiming(deadline=0.5),
    )  # fmt: skip
    assert outcome.late == [1] and not outcome.updates
    assert any("no step" in f for f in outcome.failures)


@pytest.mark.usefixtures("task_identity")
def test_a_deployed_round_with_a_late_client_lasts_its_deadline_on_the_clock() -> None:
    """Deployed (a real deadline, a profile's clock for the prediction; 0.25 s
    a message, the echo reports no work): client 1's node never answers, so
    training stopped waiting at the 0.5 s deadline and the clock counts
    that, not client 0's 0.25 s, then 0.25 s of client 0's personal
    evaluation; without a late client, 0.25 + 0.25 s."""
    profile = NetworkProfile.from_document({"message-overhead": 0.25}, "test")
    strategy, personal = parts()
    outcome = play_round(
        EchoGrid(silent=frozenset({1})), strategy, personal, 1, model(),
        (ConfigRecord({"lr": 0.1}), ConfigRecord()), Participants(ROSTER), 10.0,
        RoundTiming(0.5, SimulatedClock(profile, 2)),
    )  # fmt: skip
    assert outcome.late == [1] and outcome.evaluating == [0]
    assert outcome.sim_seconds == pytest.approx(0.5 + 0.25)
    strategy, personal = parts()
    outcome = play_round(
        EchoGrid(), strategy, personal, 1, model(),
        (ConfigRecord({"lr": 0.1}), ConfigRecord()), Participants(ROSTER), 10.0,
        RoundTiming(0.5, SimulatedClock(profile, 2)),
    )  # fmt: skip
    assert not outcome.late and outcome.sim_seconds == pytest.approx(0.25 + 0.25)


def test_a_message_pays_the_profiles_overhead_once() -> None:
    """`message-overhead` (the deployed message's pulls, pushes and task
    start) is added to every message: 1.02 + 0.25 + 2 + 8.02 s."""
    profile = NetworkProfile.from_document(
        {"message-overhead": 0.25,
         "default": {"delay-ms": 20, "up-mbit": 1, "down-mbit": 8}},
        "test",
    )  # fmt: skip
    clock = SimulatedClock(profile, 1)
    assert clock.client_seconds(0, 1_000_000, 2.0, 1_000_000) == pytest.approx(
        1.02 + 0.25 + 2.0 + 8.02
    )
    assert profile.as_dict(1)["message-overhead"] == 0.25
    with pytest.raises(
        ProfileError, match="message-overhead must be a finite number >= 0"
    ):
        NetworkProfile.from_document({"message-overhead": -1}, "test")


def test_a_personal_evaluation_is_timed_by_its_slowest_client() -> None:
    """Down 1 MB at 8 Mbit/s + 20 ms, overhead, slowed-down work, and only the
    latency back (metrics, no arrays): node 1 (10x slower) evaluating 0.3 s
    takes 1.02 + 0.1 + 3.0 + 0.02 s."""
    profile = NetworkProfile.from_document(
        {"message-overhead": 0.1,
         "default": {"delay-ms": 20, "up-mbit": 1, "down-mbit": 8},
         "group": [{"nodes": [1], "slowdown": 10}]},
        "test",
    )  # fmt: skip
    clock = SimulatedClock(profile, 2)
    assert clock.evaluation_seconds(1_000_000, {0: 0.3, 1: 0.3}) == pytest.approx(
        1.02 + 0.1 + 3.0 + 0.02
    )
    assert clock.evaluation_seconds(1_000_000, {}) == 0.0


class TimedEchoGrid(EchoGrid):
    """EchoGrid whose client k reports k + 1 seconds of personal evaluation."""

    def send_and_receive(self, messages, *, timeout=None):
        replies = super().send_and_receive(messages, timeout=timeout)
        for reply in replies:
            metrics = reply.content[METRICS]
            if "local-accuracy" in metrics:
                metrics[EVAL_SECONDS] = float(reply.content[CLIENT_RECORD][CLIENT] + 1)
        return replies


@pytest.mark.usefixtures("task_identity")
def test_a_round_with_personal_evaluation_waits_for_it_too() -> None:
    """Overhead 0.5 s a message, node 1 twice as slow: training takes 0.5 s
    (the echo reports no work), evaluating 0.5 + 1 and 0.5 + 2 x 2 s: the
    round is 0.5 + 4.5 s on the clock."""
    profile = NetworkProfile.from_document(
        {"message-overhead": 0.5, "group": [{"nodes": [1], "slowdown": 2}]}, "test"
    )
    timing = RoundTiming(0.0, SimulatedClock(profile, 2), simulated=True)
    strategy, personal = parts()
    outcome = play_round(
        TimedEchoGrid(), strategy, personal, 1, model(),
        (ConfigRecord({"lr": 0.1}), ConfigRecord()), Participants(ROSTER), 10.0,
        timing,
    )  # fmt: skip
    assert outcome.evaluating == [0, 1]
    assert outcome.sim_seconds == pytest.approx(0.5 + 4.5)


@pytest.mark.parametrize(
    ("reported", "seconds"),
    [(1.5, 1.5), (0, 0.0), (-1.0, 0.0), (float("nan"), 0.0), (True, 0.0), ("2", 0.0)],
)
def test_reported_seconds_count_only_a_finite_number_at_least_zero(reported, seconds):
    assert reported_seconds({"eval-seconds": reported}, "eval-seconds") == seconds
    assert reported_seconds(None, "eval-seconds") == 0.0


def test_scaffolds_delta_c_travels_up_on_the_clock() -> None:
    """SCAFFOLD's reply carries Delta c_k beside the update, as its message
    carries c beside the model: 1 MB model + 1 MB c down at 8 Mbit/s, 0.02 +
    2 s; 1 MB update + 1 MB Delta c up at 1 Mbit/s, 0.02 + 16 s (the clock
    counted the update alone: 10.04 s)."""
    profile = NetworkProfile.from_document(
        {"default": {"delay-ms": 20, "up-mbit": 1, "down-mbit": 8}}, "test"
    )
    timing = RoundTiming(clock=SimulatedClock(profile, 1), simulated=True)
    w = np.zeros(250_000, np.float32)  # 1 MB
    request = TrainRequest(
        server_round=1, messages=[], clients=[0], model={"w": w}, shared=("w",),
        participants=None, bytes_down=2 * w.nbytes,
    )  # fmt: skip
    update = ClientUpdate(
        0, {"w": w}, MetricRecord({"train-seconds": 0.0}), 1.0, {"control": {"w": w}}
    )
    assert timing.client_times(request, [update])[0] == pytest.approx(18.04)
