"""Driving pollen's strategy round by round in unit tests, without a Grid.

`Harness` holds a `Strategy`, its `PersonalEvaluation` and the round's
`Participants`, and plays the two halves of a round the way
`pollen.strategies.round.play_round` does, keeping each round's outcome so
tests can read what it did (`traffic[r]`, `personal[r]`).
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
from pollen.strategies.sampling import Participants, Roster
from pollen.strategies.server_update import ServerUpdate
from pollen.strategies.strategy import Strategy, TrainOutcome, TrainRequest
from pollen.task.sharing import Sharing


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
        self.traffic: dict[int, TrainOutcome] = {}
        self.personal: dict[int, dict[int, dict[str, float]]] = {}
        self.evaluated: dict[int, PersonalOutcome] = {}
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
        request = self.strategy.configure_train(
            server_round, arrays, config, self.participants
        )
        self.sent[server_round] = request
        return request.messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> ArrayRecord | None:
        outcome = self.strategy.aggregate_train(self.sent[server_round], replies)
        self.traffic[server_round] = outcome
        if not outcome.skipped:
            self.evaluation.record_trained(u.client for u in outcome.updates)
        return outcome.arrays

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
