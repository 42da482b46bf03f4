"""Driving pollen's strategy round by round in unit tests, through the
production round (`pollen.strategies.round.play_round`) on a scripted grid.

`Harness` holds a `Strategy`, its `PersonalEvaluation` and the round's
`Participants`. A test asks for a round's training messages
(`configure_train`), writes the replies it wants (honest, hostile, broken),
and `aggregate_train` plays the round with `play_round` on a grid that
answers with exactly those replies: the same reply checks, norm bound,
aggregation and server update, in the same order, as a run. Each round's
`RoundOutcome` is kept so tests can read what it did (`traffic[r]`,
`personal[r]`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message

from pollen.catalog import SERVER_UPDATES
from pollen.strategies.fedavg import FedAvgUpdate
from pollen.strategies.feddyn import FedDynUpdate
from pollen.strategies.personal import (
    EvaluateRequest,
    PersonalEvaluation,
    PersonalOutcome,
)
from pollen.strategies.round import RoundOutcome, play_round
from pollen.strategies.sampling import Participants, Roster
from pollen.strategies.server_update import ServerUpdate
from pollen.strategies.strategy import Strategy, TrainRequest
from pollen.task.sharing import Sharing


class ScriptedGrid:
    """A grid whose training messages are answered by the replies a test
    wrote (evaluation messages by none: tests evaluate apart)."""

    def __init__(self, replies: Iterable[Message]) -> None:
        self.replies = list(replies)

    def send_and_receive(self, messages, *, timeout=None) -> list[Message]:
        train = [m for m in messages if m.metadata.message_type == "train"]
        return self.replies if train else []


class Harness:
    """A strategy under test, with the round state a server loop would hold."""

    def __init__(
        self,
        strategy: Strategy,
        roster: Roster,
        personal_eval_every: int = 0,
        max_examples: Mapping[int, int] | None = None,
    ) -> None:
        self.strategy = strategy
        self.roster = roster
        self.max_examples = dict(max_examples or {})
        self.evaluation = PersonalEvaluation(strategy.sharing, personal_eval_every)
        self.traffic: dict[int, RoundOutcome] = {}
        self.personal: dict[int, dict[int, dict[str, float]]] = {}
        self.evaluated: dict[int, PersonalOutcome] = {}
        self.asked: dict[int, tuple[ArrayRecord, ConfigRecord]] = {}
        self.sent: dict[int, TrainRequest] = {}
        self._evaluate: dict[int, EvaluateRequest] = {}

    def __getattr__(self, name: str) -> Any:  # the server update's state: h, m, v
        return getattr(self.strategy.server_update, name)

    @property
    def participants(self) -> Participants:
        return Participants(self.roster, self.max_examples)

    @property
    def trained_clients(self) -> set[int]:
        return self.evaluation.trained_clients

    @trained_clients.setter
    def trained_clients(self, clients: set[int]) -> None:
        self.evaluation.trained_clients = set(clients)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord
    ) -> list[Message]:
        """The round's training messages, as `play_round` will send them."""
        self.asked[server_round] = (arrays, config)
        request = self.strategy.configure_train(
            server_round, arrays, config, self.participants
        )
        self.sent[server_round] = request
        return request.messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> ArrayRecord | None:
        """Play the round through `play_round`, the clients answering with
        `replies`; the next model, or None where the round was skipped."""
        arrays, config = self.asked[server_round]
        outcome = play_round(
            ScriptedGrid(replies), self.strategy, self.evaluation, server_round,
            arrays, (config, config), self.participants, timeout=1.0,
        )  # fmt: skip
        self.traffic[server_round] = outcome
        return None if outcome.skipped else outcome.arrays

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord
    ) -> list[Message]:
        request = self.evaluation.configure(
            server_round, arrays, config, self.participants
        )
        if request is None:
            return []
        self._evaluate[server_round] = request
        return request.messages

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> None:
        outcome = self.evaluation.aggregate(self._evaluate[server_round], replies)
        self.evaluated[server_round] = outcome
        if outcome.results:
            self.personal[server_round] = outcome.results


def harness(
    update: ServerUpdate,
    *,
    roster: Roster,
    num_clients: int,
    personal_eval_every: int = 0,
    max_examples: Mapping[int, int] | None = None,
    sharing: Sharing | None = None,
    **options: Any,
) -> Harness:
    strategy = Strategy(
        num_clients=num_clients, server_update=update, sharing=sharing, **options
    )
    return Harness(strategy, roster, personal_eval_every, max_examples)


def fedavg(**kw: Any) -> Harness:
    return harness(FedAvgUpdate(), **kw)


def fedopt(
    *, optimizer: str, server_lr: float, momentum: float = 0.0, beta1: float = 0.9,
    beta2: float = 0.99, tau: float = 1e-3, bias_correction: bool = False, **kw: Any,
) -> Harness:  # fmt: skip
    update = SERVER_UPDATES[optimizer].load()(
        server_lr=server_lr, momentum=momentum, beta1=beta1, beta2=beta2, tau=tau,
        bias_correction=bias_correction,
    )  # fmt: skip
    return harness(update, **kw)


def feddyn(
    *, alpha: float, h_scale: str = "num-clients", exclude_bn: bool = True, **kw: Any
) -> Harness:
    update = FedDynUpdate(
        alpha=alpha, num_clients=kw["num_clients"], h_scale=h_scale,
        exclude_bn=exclude_bn,
    )  # fmt: skip
    return harness(update, **kw)
