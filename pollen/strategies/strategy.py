"""pollen's strategy: sample, route, check, aggregate, update, in that order.

A round's training half, as `pollen.strategies.round.play_round` drives it:

1. `configure_train` samples clients with a generator seeded by (seed,
   round) among those whose node is connected (the round's `Participants`,
   passed in), and addresses one message per client to the node that serves
   it, carrying only the entries the sharing policy lets travel;
2. `check_replies` checks every reply (`replies.checked_reply`: its
   client, entries, dtypes, finite values, example count, metrics) and
   turns the valid ones, in client order, into typed `ClientUpdate`s;
   `bound` (an optional norm bound) clips or drops an update far above the
   round's median; `finish` skips a round with fewer than `min_replies`;
3. the **aggregation step** (`aggregation.Mean`, or a robust rule of
   `robust`) reduces the updates to one float64 aggregate per entry;
4. the **server update** (`fedavg`, `fedopt`, `feddyn`) turns the aggregate
   into the next shared entries.

Everything a round did (who was asked, bytes down and up, failures, clipped
updates, the accepted updates) comes back in a `TrainOutcome`, each step
returning a new one rather than writing into the one it was given; the strategy
keeps only what must outlive a round (the server update's state), exported
for checkpoints by `state_arrays`. Compared with Flower's `FedAvg`, for
exact and comparable runs: seeded sampling over partitions instead of node
IDs, every reply checked, replies aggregated in client order so float sums
do not depend on arrival, and dtypes kept (float32 weights, integer
BatchNorm counters).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from logging import WARNING
from typing import Protocol

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    RecordDict,
)
from flwr.common.logger import log
from flwr.serverapp import Grid

from .. import protocol
from ..task.sharing import Sharing
from .aggregation import Aggregate, Aggregator, Arrays, ClientUpdate, Mean
from .part_results import checked_aggregate, checked_update
from .replies import (
    Expectation,
    NonFiniteReply,
    ReplyError,
    bound_update_norms,
    checked_reply,
    reply_failures,
)
from .sampling import Participants, sample_clients
from .server_update import ServerUpdate


def to_numpy(record: ArrayRecord) -> dict[str, np.ndarray]:
    return {key: record[key].numpy() for key in record}


@dataclass(frozen=True)
class TrainRequest:
    """What a round's training half sent, to check its replies against."""

    server_round: int
    messages: list[Message]
    clients: list[int]  # sampled, in order
    model: dict[str, np.ndarray]  # the global model the round started from
    shared: tuple[str, ...]  # the entries that travelled
    participants: Participants
    bytes_down: int

    @property
    def current(self) -> dict[str, np.ndarray]:
        """The shared entries the clients were sent."""
        return {key: self.model[key] for key in self.shared}


@dataclass(frozen=True)
class Kept:
    """The updates a check kept, and what it noted about the others."""

    updates: list[ClientUpdate]  # in client order
    failures: list[str] = field(default_factory=list)  # dropped, and why
    clipped: list[str] = field(default_factory=list)  # scaled back by the bound
    bytes_up: int = 0  # what the checked replies carried
    non_finite: int = 0  # dropped for carrying NaN or infinity
    positions: list[int] = field(default_factory=list)  # `bounded`: kept from where


@dataclass(frozen=True)
class TrainOutcome:
    """What a round's training half did; `arrays` is None when it was skipped."""

    arrays: ArrayRecord | None = None
    updates: list[ClientUpdate] = field(default_factory=list)  # accepted, in order
    bytes_up: int = 0
    failures: list[str] = field(default_factory=list)  # replies dropped, and why
    clipped: list[str] = field(default_factory=list)  # updates scaled back
    unselected: list[int] = field(default_factory=list)  # accepted, not aggregated
    report: dict[str, float] = field(default_factory=dict)  # the aggregation step's
    answered: int = 0  # replies that arrived (not a Flower error)
    non_finite: int = 0  # of those, dropped for carrying NaN or infinity
    # all the half sent, where it sent more than the request (SecAgg+'s stages)
    bytes_down: int | None = None

    @property
    def skipped(self) -> bool:
        return self.arrays is None

    @property
    def diverged(self) -> bool:
        """Two or more replies arrived and every one carried NaN or infinity:
        the clients' training diverged (one bad client would be one reply
        among others; one reply alone cannot tell the two apart)."""
        return self.answered >= 2 and self.non_finite == self.answered


def addressed(
    kind: str,
    clients: list[int],
    payload: ArrayRecord,
    config: Mapping,
    server_round: int,
    owner: Mapping[int, int],
    records: Mapping[str, ArrayRecord] | None = None,
) -> list[Message]:
    """One message per client, to the node that serves it, naming the client
    (with further array `records` beside the model, e.g. SCAFFOLD's c)."""
    messages = []
    for client in clients:
        client_config = ConfigRecord(
            {**config, protocol.SERVER_ROUND: server_round, protocol.CLIENT: client}
        )
        content = RecordDict(
            {
                protocol.ARRAYS: payload,
                protocol.CONFIG: client_config,
                **(records or {}),
            }
        )
        messages.append(
            Message(content=content, message_type=kind, dst_node_id=owner[client])
        )
    return messages


class SecureTraining(Protocol):
    """A round's training half in which the server sees only the sum of the
    updates (`secure_round.SecureAggregation`)."""

    def train(
        self, grid: Grid, strategy: Strategy, request: TrainRequest, timeout: float
    ) -> TrainOutcome: ...


class ObjectiveState(Protocol):
    """What the server keeps for a local objective beside the model, sent
    with every training message and moved by the replies' own records
    (SCAFFOLD's control variate c: `scaffold.ServerControl`; FedProto's
    global prototypes: `prototypes.ServerPrototypes`). Checkpointed with
    the model."""

    record_name: str  # the message record that carries it

    def record(self) -> ArrayRecord:
        """The state as a training message's record."""

    def expected(self) -> dict[str, Arrays]:
        """The records every reply must carry for it (name -> entries)."""

    def update(self, updates: Sequence[ClientUpdate]) -> None:
        """After a round: moved by the accepted updates' records."""

    def state_arrays(self) -> dict[str, np.ndarray]: ...

    def load_state_arrays(self, state: Mapping[str, np.ndarray]) -> None: ...


class Strategy:
    """Seeded sampling, checked replies, an aggregation step and a server update."""

    def __init__(
        self,
        *,
        num_clients: int,
        client_frac: float,
        seed: int,
        server_update: ServerUpdate,
        aggregator: Aggregator | None = None,
        sharing: Sharing | None = None,
        min_replies: int = 1,
        min_train_nodes: int = 1,
        norm_bound: float = 0.0,
        norm_action: str = "clip",
        server_state: ObjectiveState | None = None,
        secure: SecureTraining | None = None,
    ) -> None:
        self.num_clients = num_clients
        self.client_frac = client_frac
        self.seed = seed
        self.server_update = server_update
        self.aggregator = aggregator or Mean(uniform=server_update.uniform_mean)
        self.sharing = sharing
        self.min_replies = min_replies
        self.min_train_nodes = min_train_nodes
        self.norm_bound = norm_bound
        self.norm_action = norm_action
        self.server_state = server_state  # SCAFFOLD's c, FedProto's prototypes
        self.secure = secure  # SecAgg+: the round learns only the sum

    @property
    def min_updates(self) -> int:
        """The fewest accepted updates a round aggregates."""
        return max(self.min_replies, self.aggregator.min_updates)

    # ---- checkpointed state ---------------------------------------------------

    def state_arrays(self) -> dict[str, np.ndarray]:
        """Server state beyond the global model that a resumed run needs."""
        state = self.server_state.state_arrays() if self.server_state else {}
        return {
            **self.server_update.state_arrays(),
            **self.aggregator.state_arrays(),
            **state,
        }

    def load_state_arrays(self, state: Mapping[str, np.ndarray]) -> None:
        """Restore what `state_arrays` returned."""
        self.server_update.load_state_arrays(state)
        self.aggregator.load_state_arrays(state)
        if self.server_state:
            self.server_state.load_state_arrays(state)

    # ---- what travels -------------------------------------------------------

    def shared_keys(self, arrays: Mapping[str, object]) -> tuple[str, ...]:
        """Entries that travel (all of them without a sharing policy)."""
        return self.sharing.shared if self.sharing else tuple(arrays)

    def outgoing(self, arrays: ArrayRecord) -> ArrayRecord:
        """The entries sent to clients: the shared ones."""
        return ArrayRecord({key: arrays[key] for key in self.shared_keys(arrays)})

    # ---- a round's training half -------------------------------------------------

    def configure_train(
        self,
        server_round: int,
        arrays: ArrayRecord,
        config: ConfigRecord,
        participants: Participants,
    ) -> TrainRequest:
        """One message per sampled client, addressed to the node that serves it."""
        owner = participants.roster.owner
        clients = self.sampled(server_round, participants)
        payload = self.outgoing(arrays)
        config = ConfigRecord({**config, **self.aggregator.train_config()})
        state = self.server_state
        records = {state.record_name: state.record()} if state else {}
        messages = addressed(
            MessageType.TRAIN, clients, payload, config, server_round, owner, records
        )
        per_client = payload.count_bytes() + sum(
            r.count_bytes() for r in records.values()
        )
        return TrainRequest(
            server_round=server_round,
            messages=messages,
            clients=clients,
            model=to_numpy(arrays),
            shared=self.shared_keys(arrays),
            participants=participants,
            bytes_down=per_client * len(clients),
        )

    def sampled(self, server_round: int, participants: Participants) -> list[int]:
        """The clients a round trains, drawn from those the roster serves
        (the same draw for the same round and roster, so a round's sample
        is known before it starts)."""
        return sample_clients(
            self.num_clients, self.client_frac, self.seed, server_round,
            available=sorted(participants.roster.owner), minimum=self.min_train_nodes,
        )  # fmt: skip

    def check_replies(
        self, request: TrainRequest, replies: Iterable[Message]
    ) -> TrainOutcome:
        """The valid replies as updates in client order, the bytes they
        carried and why the others were dropped; no norm bound, no arrays yet."""
        replies = list(replies)
        failed = [msg for msg in replies if msg.has_error()]
        valid = [msg for msg in replies if not msg.has_error()]
        owner = request.participants.roster.owner
        failures = reply_failures(request.clients, owner, valid, failed)
        kept = self._checked(request, valid)
        return TrainOutcome(
            updates=kept.updates,
            bytes_up=kept.bytes_up,
            failures=failures + kept.failures,
            answered=len(valid),
            non_finite=kept.non_finite,
        )

    def bound(self, request: TrainRequest, outcome: TrainOutcome) -> TrainOutcome:
        """`outcome` with the norm bound applied among its updates, relative
        to the shared entries `request` sent."""
        owner = request.participants.roster.owner
        nodes = [owner[update.client] for update in outcome.updates]
        kept = self.bounded(outcome.updates, request.current, nodes)
        return dataclasses.replace(
            outcome,
            updates=kept.updates,
            failures=outcome.failures + kept.failures,
            clipped=outcome.clipped + kept.clipped,
        )

    def finish(self, request: TrainRequest, outcome: TrainOutcome) -> TrainOutcome:
        """`outcome` with its updates aggregated and the server update stepped
        into its arrays, or as it is (skipped) with fewer than `min_replies`
        or than the aggregation step is defined for."""
        if self.server_state:  # c follows the clients' c_k^+, skipped or not
            self.server_state.update(outcome.updates)
        needed = self.min_updates
        if len(outcome.updates) < needed:
            log(WARNING, "pollen: round %d skipped, the model is unchanged: %d valid "
                "replies, it needs %d (min-train-replies %d, the aggregator %d)",
                request.server_round, len(outcome.updates), needed, self.min_replies,
                self.aggregator.min_updates)  # fmt: skip
            return outcome
        current = request.current
        aggregate = checked_aggregate(
            self.aggregator(outcome.updates, current, self.trained_keys(current)),
            current, outcome.updates, self.aggregator,
        )  # fmt: skip
        used = {update.client for update in aggregate.updates}
        return dataclasses.replace(
            outcome,
            report=dict(aggregate.report),
            unselected=[u.client for u in outcome.updates if u.client not in used],
            arrays=self.step(request.model, request.shared, aggregate),
        )

    def step(
        self, model: Arrays, shared: tuple[str, ...], aggregate: Aggregate
    ) -> ArrayRecord:
        """The next global model: the server update applied to the shared
        entries of `model`, the others unchanged."""
        current = {key: model[key] for key in shared}
        new_shared = checked_update(
            self.server_update.apply(
                current,
                aggregate,
                lambda exclude_bn: self.trained_keys(current, exclude_bn),
            ),
            current,
            self.server_update,
        )
        merged = {**model, **new_shared}
        return ArrayRecord({k: Array(v) for k, v in merged.items()})

    def trained_keys(
        self, current: Arrays, exclude_bn: bool = False
    ) -> tuple[str, ...]:
        """Shared entries a server optimiser or correction may change."""
        if self.sharing:
            return self.sharing.trained_shared(exclude_bn)
        return tuple(
            k for k, v in current.items() if np.issubdtype(v.dtype, np.floating)
        )

    def _checked(self, request: TrainRequest, replies: list[Message]) -> Kept:
        """The replies that pass every check against the shared entries sent,
        as updates in client order; the bytes every reply carried."""
        expected = Expectation(
            arrays=request.current,
            owner=request.participants.roster.owner,
            sampled=frozenset(request.clients),
            max_examples=request.participants.max_examples,
            required_metrics=self.aggregator.required_metrics,
            records=self.server_state.expected() if self.server_state else {},
        )
        accepted: list[ClientUpdate] = []
        failures: list[str] = []
        seen: set[int] = set()
        bytes_up = non_finite = 0
        for msg in replies:
            for name in (protocol.ARRAYS, *expected.records):
                record = msg.content.get(name)
                if isinstance(record, ArrayRecord):
                    bytes_up += record.count_bytes()
            try:
                client, metrics, decoded, records = checked_reply(msg, expected, seen)
            except ReplyError as problem:
                failures.append(rejected(msg.metadata.src_node_id, str(problem)))
                non_finite += isinstance(problem, NonFiniteReply)
                continue
            seen.add(client)
            weight = float(metrics[protocol.NUM_EXAMPLES])
            accepted.append(ClientUpdate(client, decoded, metrics, weight, records))
        accepted.sort(key=lambda update: update.client)
        return Kept(accepted, failures, bytes_up=bytes_up, non_finite=non_finite)

    def bounded(
        self, updates: list[ClientUpdate], current: Arrays, nodes: Sequence[int]
    ) -> Kept:
        """`updates` (from `nodes`, one each) with the norm bound applied
        among them (relative to `current`): the kept ones and where each
        stood in `updates`, the clipped ones noted, the dropped ones as
        failures."""
        if not self.norm_bound or not updates:
            return Kept(updates, positions=list(range(len(updates))))
        bounded = bound_update_norms(
            current, [u.arrays for u in updates], self.norm_bound, self.norm_action
        )
        kept, failures, clipped, positions = [], [], [], []
        for position, (update, node, (arrays, note)) in enumerate(
            zip(updates, nodes, bounded, strict=True)
        ):
            if arrays is None:
                failures.append(rejected(node, f"client {update.client}: {note}"))
                continue
            if note:
                clipped.append(f"node {node}: client {update.client}: {note}")
                log(WARNING, "pollen: clipped update: client %d: %s",
                    update.client, note)  # fmt: skip
            kept.append(dataclasses.replace(update, arrays=arrays))
            positions.append(position)
        return Kept(kept, failures, clipped, positions=positions)


def rejected(node: int, problem: str, what: str = "") -> str:
    """Log a reply that is dropped; the failure line that records it."""
    log(WARNING, "pollen: rejected %sreply from node %d: %s", what, node, problem)
    return f"{what}node {node}: {problem}"
