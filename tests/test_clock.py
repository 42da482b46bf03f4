"""The simulated clock by hand: message, client and round times under a
profile, and a synchronous round's deadline in `play_round`."""

from __future__ import annotations

import math

import numpy as np
import pytest
from flwr.app import ConfigRecord

from pollen.deployment.network import LinkShape
from pollen.network_profile import NetworkProfile
from pollen.runs.clock import SimulatedClock, effective_rate, transfer_seconds
from pollen.strategies.round import RoundTiming, play_round
from pollen.strategies.sampling import Participants
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
