"""A round played through `play_round` returns its whole outcome as a value."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from pollen.protocol import ARRAYS, CLIENT, CLIENT_RECORD, CONFIG, METRICS
from pollen.strategies.fedavg import FedAvgUpdate
from pollen.strategies.personal import PersonalEvaluation, PersonalOutcome
from pollen.strategies.round import play_round
from pollen.strategies.sampling import Participants, Roster
from pollen.strategies.strategy import Strategy
from tests.conftest import reply_from

pytestmark = pytest.mark.usefixtures("task_identity")
ROSTER = Roster.from_nodes({11: (0, 2), 22: (1, 2)}, 2)


class EchoGrid:
    """Each client answers a training message with its received entries + k+1
    (k: the client), weighted by k+1 examples; a personal evaluation with
    accuracy 0.5. `silent` clients never answer."""

    def __init__(self, silent: frozenset[int] = frozenset()) -> None:
        self.silent = silent
        self.sent: list[Message] = []

    def send_and_receive(self, messages, *, timeout=None) -> list[Message]:
        replies = []
        for msg in messages:
            if not msg.metadata.message_id:  # as Flower's grids set it
                msg.metadata.__dict__["_message_id"] = f"m{len(self.sent)}"
            self.sent.append(msg)
            client = int(msg.content[CONFIG][CLIENT])
            if client in self.silent:
                continue
            who = ConfigRecord({CLIENT: client})
            if msg.metadata.message_type == "train":
                received = msg.content[ARRAYS]
                moved = {k: Array(received[k].numpy() + client + 1) for k in received}
                metrics = MetricRecord({"num-examples": client + 1})
                content = {ARRAYS: ArrayRecord(moved), METRICS: metrics}
            else:
                names = (
                    "global-accuracy",
                    "global-loss",
                    "local-accuracy",
                    "local-loss",
                )
                content = {METRICS: MetricRecord(dict.fromkeys(names, 0.5))}
            content[CLIENT_RECORD] = who
            replies.append(
                reply_from(
                    msg.metadata.dst_node_id,
                    RecordDict(content),
                    msg.metadata.message_type,
                    answering=msg,
                )
            )
        return replies


class LocalBias:
    """A sharing policy stand-in: `w` travels, `b` stays on the clients."""

    shared = ("w",)
    local = ("b",)

    def trained_shared(self, exclude_bn: bool = False) -> tuple[str, ...]:
        return self.shared


def parts(min_replies: int = 1) -> tuple[Strategy, PersonalEvaluation]:
    strategy = Strategy(
        num_clients=2, client_frac=1.0, seed=0, server_update=FedAvgUpdate(),
        sharing=LocalBias(), min_replies=min_replies,
    )  # fmt: skip
    return strategy, PersonalEvaluation(LocalBias(), every=1)


def model() -> ArrayRecord:
    return ArrayRecord(
        {"w": Array(np.zeros(2, np.float32)), "b": Array(np.ones(1, np.float32))}
    )


def test_a_round_returns_the_new_model_and_everything_it_did() -> None:
    strategy, personal = parts()
    grid = EchoGrid()
    configs = (ConfigRecord({"lr": 0.1}), ConfigRecord())
    outcome = play_round(
        grid, strategy, personal, 1, model(), configs, Participants(ROSTER), 10.0
    )
    # w: (1 * (0 + 1) + 2 * (0 + 2)) / 3 = 5/3; b never travelled and is kept
    np.testing.assert_allclose(outcome.arrays["w"].numpy(), [5 / 3, 5 / 3], rtol=1e-6)
    np.testing.assert_array_equal(outcome.arrays["b"].numpy(), [1.0])
    assert outcome.clients == [0, 1] and [u.client for u in outcome.updates] == [0, 1]
    one_way = ArrayRecord({"w": model()["w"]}).count_bytes() * 2
    assert outcome.bytes_down == outcome.bytes_up == outcome.eval_bytes == one_way
    assert not outcome.skipped and not outcome.failures
    assert outcome.evaluating == [0, 1] and set(outcome.personal) == {0, 1}
    assert [m.content[CONFIG]["lr"] for m in grid.sent[:2]] == [0.1, 0.1]
    assert personal.trained_clients == {0, 1}


def test_a_skipped_round_keeps_the_model_and_trains_no_one() -> None:
    strategy, personal = parts(min_replies=2)
    start = model()
    outcome = play_round(
        EchoGrid(silent=frozenset({1})), strategy, personal, 1, start,
        (ConfigRecord(), ConfigRecord()), Participants(ROSTER), 10.0,
    )  # fmt: skip
    assert outcome.skipped and outcome.arrays is start
    assert outcome.failures == [
        "node 22: no reply for 1 of clients [1] within round-timeout"
    ]
    assert not personal.trained_clients and not outcome.personal


def test_personal_metrics_are_asked_for_only_when_due() -> None:
    """`PersonalEvaluation.run`, the step a round and the last async version
    share: every 2 rounds here, and only clients that have trained."""
    personal = PersonalEvaluation(LocalBias(), every=2)
    personal.record_trained([1])
    grid = EchoGrid()
    args = (model(), ConfigRecord(), Participants(ROSTER), 10.0)
    assert personal.run(grid, 1, *args) == PersonalOutcome() and not grid.sent
    evaluated = personal.run(grid, 2, *args)
    assert evaluated.clients == [1] and set(evaluated.results) == {1}
    assert [int(m.content[CONFIG][CLIENT]) for m in grid.sent] == [1]
