"""One synchronous round, played and returned as a value.

`play_round` sends the training messages, waits for the replies, lets the
strategy check, aggregate and update, then (when due) asks every client
that has trained to evaluate its personal model. It returns the round's
`RoundOutcome`: the new global model and everything the round did. Nothing
outside writes into the strategy; the loop passes in who can take part.
The same calls Flower's `Strategy.start` makes, in its order, so that a
round can start anywhere (a resumed run starts after its checkpoint). An
asynchronous loop would sit beside this one, pushing and pulling messages
as they come and handing each batch of updates to the same aggregation
step and server update.
"""

from __future__ import annotations

from dataclasses import dataclass
from logging import INFO

from flwr.app import ArrayRecord, ConfigRecord
from flwr.common.logger import log
from flwr.serverapp import Grid

from .aggregation import ClientUpdate
from .personal import PersonalEvaluation, PersonalOutcome
from .sampling import Participants
from .strategy import Strategy


@dataclass(frozen=True)
class RoundOutcome:
    """What one round did (the history's traffic and participation columns)."""

    arrays: ArrayRecord  # the global model after the round
    clients: list[int]  # asked to train
    updates: list[ClientUpdate]  # accepted, in client order
    bytes_down: int
    bytes_up: int
    skipped: bool  # too few valid replies: the model was not updated
    failures: list[str]  # replies dropped, and why
    clipped: list[str]  # updates scaled back by the norm bound
    evaluating: list[int]  # asked for personal metrics
    eval_bytes: int
    personal: dict[int, dict[str, float]]  # client -> its personal metrics


def play_round(
    grid: Grid,
    strategy: Strategy,
    personal: PersonalEvaluation,
    server_round: int,
    arrays: ArrayRecord,
    configs: tuple[ConfigRecord, ConfigRecord],
    participants: Participants,
    timeout: float,
) -> RoundOutcome:
    """Train (with the first config), aggregate, update, then evaluate
    personal models (with the second) where due."""
    log(INFO, "[ROUND %d]", server_round)
    train_config, eval_config = configs
    request = strategy.configure_train(server_round, arrays, train_config, participants)
    replies = grid.send_and_receive(request.messages, timeout=timeout)
    trained = strategy.aggregate_train(request, replies)
    if not trained.skipped:
        personal.record_trained(update.client for update in trained.updates)
    arrays = trained.arrays if trained.arrays is not None else arrays
    asked = personal.configure(server_round, arrays, eval_config, participants)
    evaluated = (
        PersonalOutcome()
        if asked is None
        else personal.aggregate(
            asked, grid.send_and_receive(asked.messages, timeout=timeout)
        )
    )
    return RoundOutcome(
        arrays=arrays,
        clients=request.clients,
        updates=trained.updates,
        bytes_down=request.bytes_down,
        bytes_up=trained.bytes_up,
        skipped=trained.skipped,
        failures=trained.failures + evaluated.failures,
        clipped=trained.clipped,
        evaluating=evaluated.clients,
        eval_bytes=evaluated.bytes_down,
        personal=evaluated.results,
    )
