"""Personal evaluation: each client tests its own model (shared + local entries).

Under a sharing policy that keeps entries on the clients (FedBN, SiloBN,
FedSA, FedPer, FedRep), or with a personal model of its own (Ditto), the
global model alone is not what a client uses: every
`personal_eval_every` rounds, each client that has trained so far is sent
the shared entries and evaluates them with its own local ones, on the
global test set and on its own test shard. Where a client keeps nothing
(FedAvg), its own model is the global one, tested on its own shard only:
the per-client row a personalisation table compares against (asked for with
an explicit `personal-eval-every`). Composed beside the strategy (it needs
none of its internals); which clients have trained is its state, exported
for checkpoints as `trained-clients`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType
from flwr.serverapp import Grid

from ..protocol import EVAL_SECONDS, METRICS
from ..task.sharing import Sharing
from .replies import ReplyError, checked_personal_reply, reported_seconds
from .sampling import Participants
from .strategy import ObjectiveState, addressed, rejected

TRAINED_CLIENTS = "trained-clients"  # checkpoint state key


@dataclass(frozen=True)
class EvaluateRequest:
    """The personal-evaluation messages of one round, and whom they ask."""

    messages: list[Message]
    clients: list[int]
    owner: Mapping[int, int]
    bytes_down: int


@dataclass
class PersonalOutcome:
    """Each client's personal metrics, the failures, and the bytes sent."""

    results: dict[int, dict[str, float]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    clients: list[int] = field(default_factory=list)  # asked
    bytes_down: int = 0
    seconds: dict[int, float] = field(default_factory=dict)  # client -> eval-seconds


class PersonalEvaluation:
    """Every `every` rounds, every client that has trained evaluates its own
    model; with the record of `predicts_by` beside it where the client
    predicts by that state (FedProto's global prototypes)."""

    def __init__(
        self,
        sharing: Sharing | None,
        every: int,
        predicts_by: ObjectiveState | None = None,
    ) -> None:
        self.sharing = sharing
        self.every = every
        self.predicts_by = predicts_by
        self.trained_clients: set[int] = set()

    def state_arrays(self) -> dict[str, np.ndarray]:
        return {TRAINED_CLIENTS: np.array(sorted(self.trained_clients), np.int64)}

    def load_state_arrays(self, state: Mapping[str, np.ndarray]) -> None:
        self.trained_clients = {int(c) for c in state[TRAINED_CLIENTS]}

    def record_trained(self, clients: Iterable[int]) -> None:
        """Clients whose update was accepted now hold a model of their own."""
        self.trained_clients.update(clients)

    def due(self, server_round: int, final: bool = False) -> bool:
        """Whether clients evaluate their own models after this round (every
        `every` rounds, or, `final`, once at the end: async mode's only one)."""
        return bool(
            self.every
            and self.sharing is not None
            and (final or server_round % self.every == 0)
        )

    def configure(
        self,
        server_round: int,
        arrays: ArrayRecord,
        config: ConfigRecord,
        participants: Participants,
        final: bool = False,
    ) -> EvaluateRequest | None:
        """Messages to every connected client that has trained (None when not due)."""
        if not self.due(server_round, final) or self.sharing is None:
            return None
        owner = participants.roster.owner
        payload = ArrayRecord({key: arrays[key] for key in self.sharing.shared})
        state = self.predicts_by
        records = {state.record_name: state.record()} if state else {}
        clients = sorted(self.trained_clients & set(owner))
        messages = addressed(
            MessageType.EVALUATE, clients, payload, config, server_round, owner,
            records,
        )  # fmt: skip
        size = payload.count_bytes() + sum(r.count_bytes() for r in records.values())
        return EvaluateRequest(messages, clients, owner, size * len(clients))

    def run(
        self,
        grid: Grid,
        server_round: int,
        arrays: ArrayRecord,
        config: ConfigRecord,
        participants: Participants,
        timeout: float,
        final: bool = False,
    ) -> PersonalOutcome:
        """Ask the clients for their personal metrics and wait for them (up
        to `timeout` s) when due (`due`); an empty outcome when not."""
        asked = self.configure(server_round, arrays, config, participants, final)
        if asked is None:
            return PersonalOutcome()
        return self.aggregate(
            asked, grid.send_and_receive(asked.messages, timeout=timeout)
        )

    def aggregate(
        self, request: EvaluateRequest, replies: Iterable[Message]
    ) -> PersonalOutcome:
        """Each client's accuracies and losses (replies checked like training
        ones, a bad one dropped with its reason)."""
        outcome = PersonalOutcome(
            clients=request.clients, bytes_down=request.bytes_down
        )
        replies = list(replies)
        outcome.failures = [
            f"evaluate, node {m.metadata.src_node_id}: {m.error.reason}"
            for m in replies
            if m.has_error()
        ]
        for msg in replies:
            if msg.has_error():
                continue
            node = msg.metadata.src_node_id
            try:
                client, values = checked_personal_reply(
                    msg, request.owner, request.clients, set(outcome.results)
                )
            except ReplyError as problem:
                outcome.failures.append(rejected(node, str(problem), what="evaluate, "))
                continue
            outcome.results[client] = values
            outcome.seconds[client] = reported_seconds(
                msg.content.get(METRICS), EVAL_SECONDS
            )
        outcome.results = dict(sorted(outcome.results.items()))
        return outcome
