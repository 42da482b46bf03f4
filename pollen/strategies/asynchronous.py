"""Asynchronous training: FedBuff's loop beside the synchronous round.

Up to `concurrency` clients train at once. Whenever one replies, its reply
is checked like a synchronous one (`Strategy.check_replies`) and goes into
the buffer, and the freed slot goes at once to an idle client (seeded
draw) with the current model. Every `buffer-size` accepted replies the
server rebases them onto the current model, applies the norm bound among
them, aggregates them with FedBuff's staleness weights (`fedbuff`) and
steps the server update: one new model version, which it returns as a
`RoundOutcome` (a history row per version) for evaluation, recording and
checkpoints. `rounds` counts versions: the server loop asks for one
version at a time (`BufferedAsync.next_version`), passing in the model, the
training config (its learning rate) and who can take part.

Replies are taken in one of two orders:

- real time (deployment, or a simulation without a network profile): as
  they arrive, looked for `POLL_SECONDS` after a message or reply (in a
  deployment, then less often the longer none comes: `sampling.reply_clock`);
- simulated time (a simulation under a network profile): a reply's arrival
  is its dispatch time on the simulated clock plus the client's simulated
  time (`strategies.clock`), so the loop waits until every client in flight has
  replied for real and takes the earliest simulated arrival. Staleness and
  the order of versions are then those of the profiled federation, not of
  this machine; the real run is slower for it (one client trains at a time
  once the first wave is in).

Under a profile the clock runs either way: a taken reply moves it on to the
reply's arrival (never back), and the server's own work between versions
(its evaluation, the records, a checkpoint: it takes no reply and sends no
message meanwhile) moves it on by the seconds it took here. In real order
(a deployment under a profile) the clock only predicts: each version's
simulated seconds are what the profiled federation would take over the
order the deployment saw.

A client silent for `round-timeout`, or whose node the SuperLink answers
for with Flower's "Node Unavailable" error, is a failure, and its node is
sent nothing more for the rest of the run.

A checkpoint is taken right after a version, when the buffer is empty, so a
resumed run loses no accepted update; the clients in flight at that moment
are not replayed (a resumed run dispatches afresh from the checkpointed
version). At the end the loop waits for the clients still in flight and
discards their replies (recorded in the last row as unused), so no message
of the run is left running.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from logging import INFO, WARNING

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType
from flwr.common.constant import ErrorCode
from flwr.common.logger import log

from .. import protocol
from ..flower_waits import PollClock
from ..settings import Settings
from .aggregation import ClientUpdate
from .clock import SimulatedClock
from .fedbuff import buffered_mean, rebased
from .replies import reported_seconds
from .round import RoundOutcome, message_bytes
from .sampling import LONGEST_REPLY_POLL, Participants
from .strategy import Strategy, TrainRequest, addressed, rejected, to_numpy

POLL_SECONDS = 0.05  # how soon the real-time loop asks for replies again


@dataclass(frozen=True)
class AsyncOptions:
    """How FedBuff's loop runs: clients training at once, replies per
    version, the seed of its draws, and how long a client may stay silent."""

    concurrency: int
    buffer_size: int
    seed: int
    timeout: float  # real seconds

    @classmethod
    def from_settings(cls, settings: Settings) -> AsyncOptions:
        """`concurrency` (or as many as a synchronous round samples) and
        `buffer-size` (or half of them, one at least)."""
        concurrency = settings.concurrency or settings.sample_size
        return cls(
            concurrency=concurrency,
            buffer_size=settings.buffer_size or max(1, concurrency // 2),
            seed=settings.seed,
            timeout=settings.round_timeout,
        )


@dataclass(frozen=True)
class Dispatch:
    """One training message in flight."""

    request: TrainRequest  # the one-client request its reply is checked against
    version: int  # the model version it carries
    sent_at: float  # simulated seconds (0 without a clock)
    started: float  # time.monotonic() when sent

    @property
    def client(self) -> int:
        return self.request.clients[0]


@dataclass
class Buffered:
    """An accepted update waiting in the buffer."""

    update: ClientUpdate
    dispatch: Dispatch


@dataclass
class _Pending:
    """What the next version's history row accumulates."""

    bytes_down: int = 0
    bytes_up: int = 0
    failures: list[str] = field(default_factory=list)
    non_finite: int = 0  # replies in a row with NaN or infinity, none valid
    failed: set[int] = field(default_factory=set)  # clients failed since a valid one


class BufferedAsync:
    """FedBuff's server loop over a Flower grid (see module docstring)."""

    def __init__(
        self,
        grid,
        strategy: Strategy,
        options: AsyncOptions,
        first: int,
        clock: SimulatedClock | None = None,
        poll: PollClock | None = None,
        simulated: bool = True,
    ) -> None:
        """A loop whose first version is `first` (after a resume: the one
        after the checkpoint's), its draws seeded by the seed and `first`;
        it asks for replies as `poll` says (`sampling.reply_clock`; every
        `POLL_SECONDS` by default). A `clock` orders the replies when
        `simulated`, and otherwise only times the versions."""
        self.grid = grid
        self.poll = poll or PollClock(POLL_SECONDS)
        self.strategy = strategy
        self.concurrency = options.concurrency
        self.buffer_size = options.buffer_size
        self.timeout = options.timeout
        self.clock = clock
        self.by_clock = clock is not None and simulated  # replies' order
        self.rng = np.random.default_rng([options.seed, first, 0xA5])
        self.in_flight: dict[str, Dispatch] = {}
        self.arrived: dict[str, tuple[Message, float]] = {}  # simulated order
        self.buffer: list[Buffered] = []
        self.snapshots: dict[int, dict[str, np.ndarray]] = {}  # version -> sent
        self.now = 0.0  # simulated seconds
        self.lost_nodes: set[int] = set()
        self.pending = _Pending()  # what the version in the making accumulates

    def next_version(
        self,
        arrays: ArrayRecord,
        version: int,
        config: ConfigRecord,
        participants: Participants,
        server_seconds: float = 0.0,
    ) -> RoundOutcome:
        """Train from `arrays` (version `version` - 1) until the buffer makes
        version `version`: its outcome. New dispatches carry `config` and go
        to `participants`; `server_seconds` is the server's own work since
        the last version, on the clock before anything is sent. An outcome
        marked diverged (no new model) when the replies show the clients'
        training diverged: the run stops there; one marked skipped (the model
        unchanged) when every client that can take part failed since the
        last valid reply."""
        self.pending, started = _Pending(), self.now
        if self.clock is not None:
            self.now += server_seconds
        while len(self.buffer) < self.buffer_size:
            self._fill(arrays, version - 1, config, participants)
            if not self.in_flight:
                raise RuntimeError(
                    "async: no client can train (every node is lost or busy)"
                )
            self._take(*self._next_reply())
            if self.pending.non_finite >= max(2, self.concurrency):
                return self._diverged(arrays)
            owner = participants.roster.owner
            able = {c for c, node in owner.items() if node not in self.lost_nodes}
            if able and self.pending.failed >= able:  # its time on the clock kept
                return replace(self._unmade(arrays, version),
                               sim_seconds=self.now - started if self.clock else None)  # fmt: skip
        outcome = self._flush(arrays, version - 1)
        log_version(version, outcome)
        return replace(outcome, sim_seconds=self.now - started if self.clock else None)

    def drain(self) -> list[int]:
        """Wait for every client still in flight (up to `timeout`); their
        replies are not used. The clients that were still training."""
        clients = sorted(d.client for d in self.in_flight.values())
        for message_id in self.arrived:  # in, but not yet taken
            self.in_flight.pop(message_id, None)
        self.arrived.clear()
        deadline = time.monotonic() + self.timeout
        while self.in_flight and time.monotonic() < deadline:
            for reply in self.grid.pull_messages(list(self.in_flight)):
                self.in_flight.pop(reply.metadata.reply_to_message_id, None)
                self.poll.message_seen()
            self.poll.sleep(LONGEST_REPLY_POLL)
        self.in_flight.clear()
        return clients

    # ---- dispatching ----------------------------------------------------

    def _fill(
        self,
        arrays: ArrayRecord,
        version: int,
        config: ConfigRecord,
        participants: Participants,
    ) -> None:
        """Send the current model to idle clients until `concurrency` train."""
        owner = participants.roster.owner
        busy_nodes = {owner.get(d.client) for d in self.in_flight.values()}
        idle = [
            c for c in sorted(owner)
            if owner[c] not in busy_nodes and owner[c] not in self.lost_nodes
        ]  # fmt: skip
        free = min(self.concurrency - len(self.in_flight), len(idle))
        if free <= 0:
            return
        chosen: list[int] = []
        for _ in range(free):  # one client per node, as OneMessagePerNode does
            client = int(self.rng.choice(idle))
            chosen.append(client)
            idle = [c for c in idle if owner[c] != owner[client]]
            if not idle:
                break
        payload = self.strategy.outgoing(arrays)
        shared = self.strategy.shared_keys(arrays)
        if version not in self.snapshots:
            self.snapshots[version] = to_numpy(arrays)
        model = self.snapshots[version]
        messages = addressed(
            MessageType.TRAIN, chosen, payload, config, version + 1, owner
        )
        # a message the grid could not store is left out of its IDs: its
        # client stays idle (Flower's grids set each message's ID on it)
        pushed = {i for i in self.grid.push_messages(messages) if i}
        self.poll.message_seen()
        now = time.monotonic()
        bytes_down = payload.count_bytes()  # the same payload to every client
        for client, message in zip(chosen, messages, strict=True):
            message_id = message.metadata.message_id
            if message_id not in pushed:
                continue
            self.pending.bytes_down += bytes_down
            request = TrainRequest(
                server_round=version + 1, messages=[message], clients=[client],
                model=model, shared=shared, participants=participants,
                bytes_down=bytes_down,
            )  # fmt: skip
            self.in_flight[message_id] = Dispatch(request, version, self.now, now)

    # ---- receiving ------------------------------------------------------

    def _next_reply(self) -> tuple[Message, Dispatch]:
        """The next reply to take, in real or simulated order."""
        while True:
            waiting = [m for m in self.in_flight if m not in self.arrived]
            asked = time.monotonic()
            got = list(self.grid.pull_messages(waiting)) if waiting else []
            if got:
                self.poll.message_seen()
            for reply in sorted(got, key=self._client_of):  # a batch: client order
                message_id = reply.metadata.reply_to_message_id
                if message_id in self.in_flight:
                    self.arrived[message_id] = (reply, self._arrival(reply, message_id))
            self._expire(asked)
            if not self.in_flight:
                raise RuntimeError(
                    "async: every client in flight went silent for round-timeout "
                    f"({self.timeout:g} s); see the failures above"
                )
            if self.arrived and not self.by_clock:
                first = next(iter(self.arrived))  # the first to arrive for real
            elif self.arrived and set(self.arrived) == set(self.in_flight):
                first = min(self.arrived, key=lambda m: self.arrived[m][1])
            else:
                self.poll.sleep(LONGEST_REPLY_POLL)
                continue
            self.now = max(self.now, self.arrived[first][1])
            return self._pop(first)

    def _client_of(self, reply: Message) -> int:
        dispatch = self.in_flight.get(reply.metadata.reply_to_message_id)
        return dispatch.client if dispatch else -1

    def _pop(self, message_id: str) -> tuple[Message, Dispatch]:
        reply, _ = self.arrived.pop(message_id)
        return reply, self.in_flight.pop(message_id)

    def _arrival(self, reply: Message, message_id: str) -> float:
        """A reply's arrival on the simulated clock (0 without one)."""
        dispatch = self.in_flight[message_id]
        if self.clock is None or reply.has_error():
            return dispatch.sent_at
        seconds = reported_seconds(
            reply.content.get(protocol.METRICS), protocol.TRAIN_SECONDS
        )
        return dispatch.sent_at + self.clock.client_seconds(
            dispatch.client, dispatch.request.bytes_down, seconds, message_bytes(reply)
        )

    def _expire(self, asked: float) -> None:
        """Give up on clients that had been in flight for longer than
        `timeout` (real s) when the SuperLink was last `asked` (monotonic
        s): a failure, and their node is sent nothing more (it may be gone,
        or still busy with the message). Not by the time the pull returned:
        a pull can take a minute (Flower retries a reply's missing objects,
        a killed node's half-pushed reply), and replies that came meanwhile
        are in the next pull, not late."""
        for message_id, dispatch in list(self.in_flight.items()):
            if (
                message_id not in self.arrived
                and asked - dispatch.started > self.timeout
            ):
                del self.in_flight[message_id]
                node = dispatch.request.participants.roster.owner[dispatch.client]
                self.lost_nodes.add(node)
                self.pending.failures.append(rejected(
                    node, f"client {dispatch.client}: no reply within round-timeout "
                    f"({self.timeout:g} s)"))  # fmt: skip

    def _take(self, reply: Message, dispatch: Dispatch) -> None:
        """Check one reply; a valid one goes into the buffer. The SuperLink's
        "Node Unavailable" answer (the node stopped sending heartbeats) is a
        failure whose node is sent nothing more, as one silent past the
        timeout is: re-sent work would only fail again at each poll."""
        if reply.has_error() and reply.error.code == ErrorCode.NODE_UNAVAILABLE:
            roster = dispatch.request.participants.roster
            self.lost_nodes.add(roster.owner[dispatch.client])
        checked = self.strategy.check_replies(dispatch.request, [reply])
        self.pending.bytes_up += checked.bytes_up
        self.pending.failures += checked.failures
        self.buffer += [Buffered(u, dispatch) for u in checked.updates]
        if checked.updates:
            self.pending.non_finite = 0
            self.pending.failed.clear()
        else:
            self.pending.non_finite += checked.non_finite
            if not checked.non_finite:  # NaN is divergence's to judge (`_diverged`)
                self.pending.failed.add(dispatch.client)

    def _unmade(self, arrays: ArrayRecord, version: int) -> RoundOutcome:
        """Version `version` skipped, the model unchanged: every client that
        can take part failed (or was rejected) since the last valid reply, so
        waiting on would only send them the same work again (the next
        version tries once more; a run of none but skipped versions fails)."""
        log(WARNING, "pollen: version %d skipped, the model is unchanged: every "
            "client's reply failed or was rejected", version)  # fmt: skip
        return self._unchanged(arrays, diverged=False)

    def _diverged(self, arrays: ArrayRecord) -> RoundOutcome:
        """No new version: as many replies in a row as train at once (two at
        least) carried NaN or infinity and none was valid, so the clients'
        training diverged, which the server loop stops the run for."""
        return self._unchanged(arrays, diverged=True)

    def _unchanged(self, arrays: ArrayRecord, diverged: bool) -> RoundOutcome:
        """A skipped version's outcome: `arrays` as they were, and what the
        replies since the last version cost and why they failed."""
        pending = self.pending
        self._forget_snapshots()
        return RoundOutcome(
            arrays=arrays, clients=[], updates=[], bytes_down=pending.bytes_down,
            bytes_up=pending.bytes_up, skipped=True, failures=pending.failures,
            clipped=[], evaluating=[], eval_bytes=0, personal={}, diverged=diverged,
        )  # fmt: skip

    def _forget_snapshots(self) -> None:
        """Keep only the model versions a client in flight was sent."""
        in_use = {d.version for d in self.in_flight.values()}
        self.snapshots = {v: s for v, s in self.snapshots.items() if v in in_use}

    def _flush(self, arrays: ArrayRecord, version: int) -> RoundOutcome:
        """Rebase, bound, aggregate and step the buffer: the next version
        (the model unchanged when the bound left fewer updates than
        `min-train-replies`)."""
        batch, self.buffer = self.buffer, []
        model = self.snapshots.get(version) or to_numpy(arrays)  # sent as version
        shared = self.strategy.shared_keys(arrays)
        current = {key: model[key] for key in shared}
        trained = set(self.strategy.trained_keys(current))
        updates = [
            rebased(b.update, self.snapshots[b.dispatch.version], current, trained)
            for b in batch
        ]
        # each update's node in the roster it was sent under (a node may have
        # joined or left since)
        nodes = [b.dispatch.request.participants.roster.owner[b.dispatch.client]
                 for b in batch]  # fmt: skip
        kept = self.strategy.bounded(updates, current, nodes)
        staleness = [version - batch[i].dispatch.version for i in kept.positions]
        needed = self.strategy.min_updates  # the bound may leave fewer
        if len(kept.updates) < needed:
            log(WARNING, "pollen: version %d skipped, the model is unchanged: %d "
                "updates kept of %d, it needs %d (min-train-replies)", version + 1,
                len(kept.updates), len(batch), needed)  # fmt: skip
        else:
            arrays = self.strategy.step(
                model, shared, buffered_mean(kept.updates, staleness, current, trained)
            )
        self._forget_snapshots()
        return RoundOutcome(
            arrays=arrays,
            clients=[u.client for u in kept.updates],
            updates=kept.updates,
            bytes_down=self.pending.bytes_down,
            bytes_up=self.pending.bytes_up,
            skipped=len(kept.updates) < needed,
            failures=self.pending.failures + kept.failures,
            clipped=kept.clipped,
            evaluating=[],
            eval_bytes=0,
            personal={},
            staleness=staleness,
        )


def log_version(version: int, outcome: RoundOutcome) -> None:
    log(INFO, "[VERSION %d] %d updates, staleness %s", version,
        len(outcome.updates), outcome.staleness)  # fmt: skip
