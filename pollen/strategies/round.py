"""One synchronous round, played and returned as a value.

`play_round` sends the training messages, waits for the replies, lets the
strategy check, aggregate and update, then (when due) asks every client
that has trained to evaluate its personal model. It returns the round's
`RoundOutcome`: the new global model and everything the round did. Nothing
outside writes into the strategy; the loop passes in who can take part.
The same calls Flower's `Strategy.start` makes, in its order, so that a
round can start anywhere (a resumed run starts after its checkpoint).

Under SecAgg+ (`secure-aggregation`) the training half is the protocol's
(`secure_round.SecureAggregation`): the server learns only the sum of the
updates and steps the server update from its mean, with no deadline and no
norm bound (both need each update).

With a `RoundTiming` the round has a deadline (replies after it are
discarded and recorded as late) and, under a network profile, a simulated
time (`strategies.clock`). The asynchronous loop, FedBuff's, sits beside this one
(`asynchronous.BufferedAsync`) and returns the same `RoundOutcome` per
model version.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from logging import INFO

from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.common.logger import log
from flwr.serverapp import Grid

from ..protocol import ARRAYS, CLIENT, CONFIG, TRAIN_SECONDS
from .aggregation import ClientUpdate
from .clock import SimulatedClock
from .personal import PersonalEvaluation, PersonalOutcome
from .replies import reported_seconds
from .sampling import Participants
from .strategy import Strategy, TrainOutcome, TrainRequest


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
    late: list[int] = field(default_factory=list)  # replies after the deadline
    staleness: list[int] = field(default_factory=list)  # async: per update
    unselected: list[int] = field(default_factory=list)  # accepted, not aggregated
    aggregation: dict[str, float] = field(default_factory=dict)  # its report
    sim_seconds: float | None = None  # on the simulated clock, under a profile
    diverged: bool = False  # every reply carried NaN or infinity


@dataclass(frozen=True)
class RoundTiming:
    """The deadline of a synchronous round and the clock that times it.

    With a `clock` the round's simulated seconds are recorded. A deadline
    (0: none) is simulated when `simulated` (a simulation under a network
    profile: replies whose simulated arrival is after it are discarded) and
    real otherwise (the round stops waiting then; replies not in are late).
    """

    deadline: float = 0.0
    clock: SimulatedClock | None = None
    simulated: bool = False

    def wait(self, timeout: float) -> float:
        """How long the round waits for replies in real seconds."""
        if self.deadline and not self.simulated:
            return min(self.deadline, timeout)
        return timeout

    def client_times(
        self, request: TrainRequest, updates: list[ClientUpdate]
    ) -> dict[int, float]:
        """Each accepted update's client time on the simulated clock: its
        upload is its entries and its further records (SCAFFOLD's Delta c_k)."""
        if self.clock is None:
            return {}
        per_client = request.bytes_down // max(len(request.clients), 1)
        return {
            u.client: self.clock.client_seconds(
                u.client, per_client, reported_seconds(u.metrics, TRAIN_SECONDS),
                _upload_bytes(u),
            )
            for u in updates
        }  # fmt: skip

    def round_seconds(
        self, times: dict[int, float], late: list[int], evaluated: PersonalOutcome
    ) -> float | None:
        """The round's simulated seconds, training and personal evaluation
        (None without a clock). Training ends with the slowest accepted
        client, or at the deadline when a client was late for it: in
        simulation the clock found it so (`late`); deployed, the round
        stopped waiting for a `late` client there (its own time is unknown,
        and the wait was the deadline's), and an accepted client whose time
        on the clock is past the deadline would be late in the profiled
        federation, which would stop waiting there too."""
        if self.clock is None:
            return None
        seconds = self.clock.round_seconds(times, self.deadline, bool(late))
        per_client = evaluated.bytes_down // max(len(evaluated.clients), 1)
        return seconds + self.clock.evaluation_seconds(per_client, evaluated.seconds)


def message_bytes(message: Message) -> int:
    """The bytes of a message's arrays (0 for an error reply)."""
    if message.has_error():
        return 0
    arrays = message.content.get(ARRAYS)
    return arrays.count_bytes() if isinstance(arrays, ArrayRecord) else 0


def play_round(
    grid: Grid,
    strategy: Strategy,
    personal: PersonalEvaluation,
    server_round: int,
    arrays: ArrayRecord,
    configs: tuple[ConfigRecord, ConfigRecord],
    participants: Participants,
    timeout: float,
    timing: RoundTiming = RoundTiming(),
) -> RoundOutcome:
    """Train (with the first config), aggregate, update, then evaluate
    personal models (with the second) where due."""
    log(INFO, "[ROUND %d]", server_round)
    train_config, eval_config = configs
    request = strategy.configure_train(server_round, arrays, train_config, participants)
    if strategy.secure is not None:  # SecAgg+: no deadline, no norm bound
        trained = strategy.secure.train(grid, strategy, request, timeout)
        late, times = [], timing.client_times(request, trained.updates)
    else:
        request, trained, late, times = _train_in_clear(
            grid, strategy, request, timeout, timing
        )
    if not trained.skipped:
        personal.record_trained(update.client for update in trained.updates)
    arrays = trained.arrays if trained.arrays is not None else arrays
    evaluated = personal.run(
        grid, server_round, arrays, eval_config, participants, timeout
    )
    return RoundOutcome(
        arrays=arrays,
        clients=request.clients + sorted(set(late) - set(request.clients)),
        updates=trained.updates,
        bytes_down=(
            request.bytes_down if trained.bytes_down is None else trained.bytes_down
        ),
        bytes_up=trained.bytes_up,
        skipped=trained.skipped,
        failures=trained.failures + evaluated.failures,
        clipped=trained.clipped,
        evaluating=evaluated.clients,
        eval_bytes=evaluated.bytes_down,
        personal=evaluated.results,
        late=late,
        sim_seconds=timing.round_seconds(times, late, evaluated),
        unselected=trained.unselected,
        aggregation=trained.report,
        diverged=trained.diverged,
    )


def _train_in_clear(
    grid: Grid,
    strategy: Strategy,
    request: TrainRequest,
    timeout: float,
    timing: RoundTiming,
) -> tuple[TrainRequest, TrainOutcome, list[int], dict[int, float]]:
    """The training half with every update seen: send, wait (to the
    deadline), check, bound and aggregate; the request less the clients that
    were late, the outcome, the late and each accepted client's time."""
    replies = grid.send_and_receive(request.messages, timeout=timing.wait(timeout))
    real_deadline = timing.deadline and not timing.simulated
    late = _late_in_real_time(request, replies) if real_deadline else []
    if late:
        request = replace(
            request, clients=[c for c in request.clients if c not in late]
        )
    checked = strategy.check_replies(request, replies)
    times = timing.client_times(request, checked.updates)
    if timing.simulated and timing.deadline and timing.clock is not None:
        late = timing.clock.late(times, timing.deadline)
        in_time = [u for u in checked.updates if u.client not in late]
        checked = replace(checked, updates=in_time)
    return (
        request,
        strategy.finish(request, strategy.bound(request, checked)),
        late,
        times,
    )


def _upload_bytes(update: ClientUpdate) -> int:
    """The bytes of an update's arrays and of its further array records."""
    records = [update.arrays, *update.records.values()]
    return sum(int(a.nbytes) for record in records for a in record.values())


def _late_in_real_time(request: TrainRequest, replies: list[Message]) -> list[int]:
    """The sampled clients with no reply of any kind (an update or an error)
    to their message when the round stopped waiting (at its deadline, or its
    timeout without one): their message unanswered, or not sent yet (queued
    behind their node's other clients). A cohort's members are answered by
    ID too (`pollen.common.cohorts.unpack`). Late clients are recorded as
    late, the others' errors as failures."""
    client_of = {
        m.metadata.message_id: int(m.content[CONFIG][CLIENT])
        for m in request.messages
        if m.metadata.message_id
    }
    replied = {
        client_of[reply.metadata.reply_to_message_id]
        for reply in replies
        if reply.metadata.reply_to_message_id in client_of
    }
    return [c for c in request.clients if c not in replied]
